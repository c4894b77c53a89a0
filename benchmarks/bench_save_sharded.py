"""Saving an FSDP2 model on 2 ranks (Gloo, CPU) to a directory, beside DCP's Hugging Face writer.

Run as ``python benchmarks/bench_save_sharded.py [--layers 16] [--width 2048] [--rounds 3]
[--max-shard-size 5GB]``.

A model of ``--layers`` x ``Linear(width, width)`` (16 x 2048 x 2048 float32: 256 MiB) is
sharded with ``fully_shard`` (each layer, then the root) on 2 ranks under ``torchrun``, and saved
into a fresh directory each round, the ways taking turns in the same processes:

* ``torchplace``: ``torchplace.save(model, DIR, max_shard_size=...)`` on every rank (each tensor
  gathered once; one shard, ``model.safetensors``, is written by rank 0, several are split among
  the ranks, shard ``i`` by rank ``i % 2``; every file flushed);
* ``dcp``: ``torch.distributed.checkpoint.save(model.state_dict(),
  storage_writer=HuggingFaceStorageWriter(DIR, save_distributed=True,
  enable_consolidation=True))``, then rank 0 flushes the files (``os.fsync``), as ``save`` does.

Each round is timed from a barrier to a barrier (the slower rank counts); each way is reported
by its fastest round, and the saved files are checked against each other once.

Target (DESIGN.md section 5): ``torchplace`` at most 0.7x ``dcp``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rows import add_row

WORKER = r"""
import json, os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import torchplace

root, layers, width, rounds = Path(sys.argv[1]), *map(int, sys.argv[2:5])
max_shard_size = sys.argv[5]
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)


def flush(folder):
    for file in folder.rglob("*"):
        if file.is_file():
            with open(file, "rb+") as f:
                os.fsync(f.fileno())


def ways(folder):
    yield "torchplace", lambda: torchplace.save(model, folder / "torchplace",
                                                 max_shard_size=max_shard_size)
    def with_dcp():
        writer = dcp.HuggingFaceStorageWriter(str(folder / "dcp"), save_distributed=True,
                                              enable_consolidation=True)
        dcp.save(model.state_dict(), storage_writer=writer)
        if rank == 0:
            flush(folder / "dcp")
    yield "dcp", with_dcp


best = {}
for r in range(rounds):
    folder = root / f"round-{r}"
    folder.mkdir(exist_ok=True)
    for name, work in ways(folder):
        dist.barrier()
        start = time.perf_counter()
        work()
        dist.barrier()
        took = time.perf_counter() - start
        best[name] = min(best.get(name, took), took)
if rank == 0:
    print(json.dumps(best), flush=True)
dist.destroy_process_group()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="torchplace's shards (below the model's size: split among the ranks)",
    )
    parser.add_argument("--rows", help="append the figures as JSON lines to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_save_sharded-") as d:
        script = Path(d) / "worker.py"
        script.write_text(textwrap.dedent(WORKER))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nnodes=1", "--nproc-per-node=2", str(script), d, str(args.layers),
                   str(args.width), str(args.rounds), args.max_shard_size]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"torchrun failed:\n{done.stdout}\n{done.stderr}")
        best = json.loads(done.stdout.strip().splitlines()[-1])
        _check(Path(d) / "round-0")
    nbytes = args.layers * args.width * args.width * 4
    print(f"model: {nbytes / 2**20:.0f} MiB on 2 ranks")
    for name, took in best.items():
        print(f"{name:12} {took:7.3f} s  {nbytes / took / 2**30:5.2f} GiB/s")
    ratio = best["torchplace"] / best["dcp"]
    print(f"torchplace / dcp {ratio:.2f}x (target <= 0.7x)")
    add_row(args.rows, "FSDP2 save on 2 ranks / DCP's HF writer", ratio, "<= 0.7x", ratio <= 0.7)


def _check(folder: Path) -> None:
    """The two ways saved the same tensors."""
    from safetensors.torch import load_file

    ours: dict = {}
    for file in sorted((folder / "torchplace").glob("*.safetensors")):  # one file, or shards
        ours |= load_file(str(file))
    theirs: dict = {}
    for file in sorted((folder / "dcp").glob("*.safetensors")):  # the consolidated files
        theirs |= load_file(str(file))
    assert sorted(ours) == sorted(theirs), (sorted(ours)[:3], sorted(theirs)[:3])
    assert all(bool((ours[k] == theirs[k]).all()) for k in ours)


if __name__ == "__main__":
    main()
