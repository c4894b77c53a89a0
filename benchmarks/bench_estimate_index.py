"""``torchplace estimate INDEX`` of a checkpoint with very many tensors: counted from the catalog.

Run as ``python benchmarks/bench_estimate_index.py [--tensors N] [--rounds R]``. A shard index
of ``N`` (default 100,000) 2x2 tensors, every tenth one int64 (the layout of a large MoE's
experts), written once by ``torchplace.save`` into 8 shards; then ``torchplace estimate INDEX
--json`` in this process, ``R`` times. Target (issue 51): under 3 s. Before the count read the
catalog's shapes, it built a fake parameter per tensor and took 13-16 s.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

import torch

import torchplace
from torchplace.cli import main as cli


def build(root: Path, count: int) -> Path:
    tensors = {
        f"model.layers.{i // 100}.mlp.experts.{i % 100}.w": (
            torch.zeros(2, 2, dtype=torch.int64) if i % 10 == 0 else torch.zeros(2, 2)
        )
        for i in range(count)
    }
    per_shard = -(-sum(t.nbytes for t in tensors.values()) // 8)
    torchplace.save(tensors, root / "index", max_shard_size=per_shard)
    return root / "index" / "model.safetensors.index.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as where:
        index = build(Path(where), args.tensors)
        times = []
        for _ in range(args.rounds):
            out = io.StringIO()
            started = time.perf_counter()
            with contextlib.redirect_stdout(out):
                status = cli(["estimate", str(index), "--json", "--device", "cpu"])
            times.append(time.perf_counter() - started)
            assert status == 0 and json.loads(out.getvalue())["parameter_count"] == 4 * args.tensors
    best = min(times)
    print(f"estimate of a {args.tensors:,}-tensor index: best {best:.2f} s of {args.rounds} "
          f"(target < 3 s: {'met' if best < 3 else 'missed'})")  # fmt: skip


if __name__ == "__main__":
    main()
