"""What each catalogued tensor costs: the catalog and ``torchplace inspect`` of a checkpoint as
large as the largest published ones.

Run as ``python benchmarks/bench_catalog.py [--tensors N] [--rounds N] [--baseline SRC]``.
Targets (issue 31): a 100,000-tensor shard index (DeepSeek-V3's lists about 91,000) catalogued
in under 1 s, and ``torchplace inspect`` of it, table printed, in under 3 s; ``inspect`` of a
pickle of 2,000,000 integers refused within its bound (a pickle of 20,000,000 took 42 s and
3.8 GB to read whole).

The index has 16 ``.safetensors`` shards of 2x2 float32 tensors named as a mixture-of-experts
model names them, so the headers, not the disk, are what is read. A ``torch.save`` file of
30,000 tensors is catalogued beside it (no target). Every figure comes from a fresh
interpreter, with ``--baseline SRC`` also from another tree (``git worktree add``): the
catalog is timed inside it (imports left out, its first call counted), ``inspect`` whole from
the shell (start-up included, output into a pipe). Interference only adds time, so each series
is summed up by its minimum.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CATALOG_TARGET = 1.0
INSPECT_TARGET = 3.0

_TIME_CATALOG = """
import resource, sys, time
from torchplace.checkpoint._catalog import catalog
from torchplace._errors import CheckpointError
start, cpu = time.perf_counter(), time.process_time()
try:
    found = len(catalog(sys.argv[1]).entries)
except CheckpointError as exc:
    found = "refused: " + str(exc)[:60]
took, cpu = time.perf_counter() - start, time.process_time() - cpu
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(took, cpu, peak, found)
"""


def expert_names(count: int) -> list[str]:
    """Tensor names as a mixture-of-experts model has them: 256 experts a layer."""
    names: list[str] = []
    layer = 0
    while len(names) < count:
        for expert in range(256):
            for part in ("gate_proj", "up_proj", "down_proj"):
                for suffix in ("weight", "weight_scale_inv"):
                    names.append(f"model.layers.{layer}.mlp.experts.{expert}.{part}.{suffix}")
        layer += 1
    return names[:count]


def write_index(root: Path, count: int, shards: int = 16) -> Path:
    """A shard index of ``count`` 2x2 float32 tensors in ``shards`` files."""
    names = expert_names(count)
    per = -(-count // shards)
    weight_map = {}
    for s in range(shards):
        part = names[s * per : (s + 1) * per]
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header = {
            name: {"dtype": "F32", "shape": [2, 2], "data_offsets": [16 * k, 16 * (k + 1)]}
            for k, name in enumerate(part)
        }
        raw = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
        (root / shard).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16 * len(part)))
        weight_map.update(dict.fromkeys(part, shard))
    index = root / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def write_torch_files(root: Path, tensors: int, ints: int) -> tuple[Path, Path]:
    import torch

    many = root / "many.pt"
    torch.save({f"model.layers.{i // 10}.w{i % 10}": torch.zeros(2) for i in range(tensors)}, many)
    numbers = root / "ints.pt"
    torch.save({"w": torch.ones(2), "ids": list(range(ints))}, numbers)
    return many, numbers


def env_for(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src), "COLUMNS": "200"}


def time_catalog(src: Path, path: Path) -> tuple[float, float, float, str]:
    """(seconds, CPU seconds, peak MiB, entries or refusal) of one ``catalog`` in a fresh
    interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", _TIME_CATALOG, str(path)],
        env=env_for(src),
        capture_output=True,
        text=True,
        check=True,
    )
    took, cpu, peak, found = done.stdout.split(maxsplit=3)
    return float(took), float(cpu), float(peak), found.strip()


def time_inspect(src: Path, path: Path, *flags: str, limit: float) -> tuple[float, float]:
    """Seconds and CPU seconds of ``torchplace inspect PATH`` in a fresh interpreter, its output
    into a pipe (infinity past ``limit``: a baseline's table of 100,000 rows took minutes)."""
    start, before = time.perf_counter(), _children_cpu()
    try:
        subprocess.run(
            [sys.executable, "-m", "torchplace", "inspect", str(path), *flags],
            env=env_for(src),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            check=False,
            timeout=limit,
        )
    except subprocess.TimeoutExpired:
        return float("inf"), float("inf")
    return time.perf_counter() - start, _children_cpu() - before


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100_000, help="tensors in the index")
    parser.add_argument("--pt-tensors", type=int, default=30_000, help="tensors in the .pt")
    parser.add_argument("--ints", type=int, default=2_000_000, help="integers in the pickle")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per figure")
    parser.add_argument("--baseline", type=Path, help="another tree's src/ to time beside")
    parser.add_argument("--limit", type=float, default=120, help="seconds an inspect may take")
    args = parser.parse_args()
    trees = {"this tree": Path(__file__).resolve().parent.parent / "src"}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    load = os.getloadavg()[0]
    print(f"load average {load:.2f}; {args.rounds} rounds, minimum of each")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        index = write_index(root, args.tensors)
        many, numbers = write_torch_files(root, args.pt_tensors, args.ints)
        for name, src in trees.items():
            report(name, src, index, many, numbers, args)
    return 0


def report(name: str, src: Path, index: Path, many: Path, numbers: Path, args: Any) -> None:
    rounds = range(args.rounds)
    cat = min(time_catalog(src, index)[:2] for _ in rounds)
    table = min(time_inspect(src, index, limit=args.limit) for _ in rounds)
    as_json = min(time_inspect(src, index, "--json", limit=args.limit) for _ in rounds)
    pt = min(time_catalog(src, many)[:2] for _ in rounds)
    took, cpu, peak, found = time_catalog(src, numbers)
    verdict = {True: "met", False: "MISSED"}
    print(f"\n{name} ({src}); seconds: wall, and CPU of the process")
    print(
        f"  catalog, index of {args.tensors:,} tensors: {cat[0]:7.2f} {cat[1]:7.2f}  "
        f"(target < {CATALOG_TARGET} s: {verdict[cat[0] < CATALOG_TARGET]})"
    )
    print(
        f"  torchplace inspect INDEX (table):    {table[0]:7.2f} {table[1]:7.2f}  "
        f"(target < {INSPECT_TARGET} s: {verdict[table[0] < INSPECT_TARGET]})"
    )
    print(f"  torchplace inspect INDEX --json:     {as_json[0]:7.2f} {as_json[1]:7.2f}")
    print(f"  catalog, .pt of {args.pt_tensors:,} tensors:     {pt[0]:7.2f} {pt[1]:7.2f}")
    print(
        f"  catalog, pickle of {args.ints:,} ints: {took:7.2f} {cpu:7.2f}  peak "
        f"{peak:.0f} MiB, {found}"
    )


if __name__ == "__main__":
    sys.exit(main())
