"""Filling an FSDP2 model on 2 ranks (Gloo, CPU) from a safetensors file, three ways side by side.

Run as ``python benchmarks/bench_sharded.py [--layers 16] [--width 2048] [--rounds 3]``.

A model of ``--layers`` x ``Linear(width, width)`` is saved once as ``model.safetensors``
(16 x 2048 x 2048 float32: 256 MiB, a 128 MiB shard per rank). Each way then runs under
``torchrun --nproc-per-node 2`` in fresh processes: the model is built on ``meta``, sharded with
``fully_shard`` (each layer, then the root), given memory with ``to_empty`` and zeroed (so the
shards' pages are resident before the clock starts), and filled from the file:

* ``dcp``: ``torch.distributed.checkpoint.load(model.state_dict(), storage_reader=
  HuggingFaceStorageReader(folder))``;
* ``broadcast``: rank 0 reads the file (``safetensors.torch.load_file``), then
  ``set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True,
  broadcast_from_rank0=True))``;
* ``torchplace``: ``torchplace.load_into(model, "model.safetensors")``.

Each rank times the fill from a barrier to its end (the slower rank counts) and reports its
peak resident memory during the fill above what it held before (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``); imports come before the clock. The file is read once
beforehand, so every way finds it in the page cache. Each way runs in ``--rounds`` fresh pairs
of processes, taking turns, and fills the model twice in each: the first fill is what a
training job pays (it loads once), the second shows the steady state. Every fill is checked
against the file. Each way is reported by its fastest fills and its largest memory.

Target (docs/design.md): torchplace's first fill at most 0.3x the time of the faster of ``dcp``
and ``broadcast``, with extra peak memory per rank at most a quarter of its shard + 64 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WAYS = ("dcp", "broadcast", "torchplace")


def _rss_peak_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS (Linux 4.0 and later)


def worker(way: str, folder: Path, layers: int, width: int, rounds: int) -> None:
    """One rank under torchrun: fill the model ``rounds`` times, write the figures as JSON."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import torchplace
    import torchplace.checkpoint._sharded  # not timed: load_into imports it on first use

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    path = folder / "model.safetensors"
    seconds, extra, floor = [], [], []
    for _ in range(rounds):
        with torch.device("meta"):
            model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().zero_()  # resident before the clock starts
        shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        dist.barrier()
        _reset_peak()
        before = _rss_kib()
        start = time.perf_counter()
        if way == "torchplace":
            torchplace.load_into(model, path)
        elif way == "dcp":
            dcp.load(model.state_dict(), storage_reader=dcp.HuggingFaceStorageReader(str(folder)))
        else:
            state = load_file(str(path)) if rank == 0 else {}
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(model, state, options=options)
            del state
        took = torch.tensor([time.perf_counter() - start])
        peak = _rss_peak_kib() - before
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        seconds.append(float(took))
        extra.append(peak * 1024)
        # Checked against the file, rank by rank (outside the clock).
        with safe_open(str(path), "pt") as f:
            for name, p in model.named_parameters():
                assert isinstance(p, DTensor)
                local = p.to_local()
                whole = f.get_slice(name)
                rows = local.shape[0]
                start_row = rank * -(-p.shape[0] // dist.get_world_size())
                want = whole[start_row : start_row + rows]
                assert torch.equal(local, want), f"{way}: {name} differs on rank {rank}"
        # The floor: one copy of the shard's bytes from memory into the shards, timed alike.
        sources = [torch.randn_like(p.to_local()) for p in model.parameters()]
        dist.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            for p, source in zip(model.parameters(), sources, strict=True):
                p.to_local().copy_(source)
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        floor.append(float(took))
        del model, sources
    figures = {"way": way, "seconds": seconds, "extra": extra, "shard": shard, "floor": floor}
    (folder / f"{way}-{rank}.json").write_text(json.dumps(figures))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3, help="fresh process pairs per way")
    parser.add_argument("--worker", nargs=2, metavar=("WAY", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]), args.layers, args.width, args.rounds)
        return

    import torch
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        torch.manual_seed(0)
        state = {}
        for i in range(args.layers):
            state[f"{i}.weight"] = torch.randn(args.width, args.width)
            state[f"{i}.bias"] = torch.randn(args.width)
        save_file(state, str(folder / "model.safetensors"))
        size = (folder / "model.safetensors").stat().st_size
        del state
        (folder / "model.safetensors").read_bytes()  # into the page cache
        env = dict(os.environ)
        env |= {"CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
        env.setdefault("OMP_NUM_THREADS", "1")
        if sys.platform == "linux":
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        fresh: dict[str, list[float]] = {way: [] for way in WAYS}  # the first fill
        warm: dict[str, list[float]] = {way: [] for way in WAYS}  # fills after it
        extra: dict[str, int] = dict.fromkeys(WAYS, 0)
        shard = 0
        floor: list[float] = []
        mib = 2**20
        print(
            f"{args.layers} x Linear({args.width}, {args.width}), file {size / mib:.0f} MiB, "
            f"2 ranks, gloo, CPU; {args.rounds} fresh process pairs per way, 2 fills each"
        )
        for _ in range(args.rounds):
            for way in WAYS:  # the ways take turns round by round
                command = [
                    sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                    "--nproc-per-node=2", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{_free_port()}", __file__,
                    "--layers", str(args.layers), "--width", str(args.width),
                    "--rounds", "2", "--worker", way, str(folder),
                ]  # fmt: skip
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    print(f"{way}: failed\n{done.stdout}\n{done.stderr}")
                    sys.exit(1)
                ranks = [json.loads((folder / f"{way}-{r}.json").read_text()) for r in (0, 1)]
                fresh[way].append(ranks[0]["seconds"][0])
                warm[way] += ranks[0]["seconds"][1:]
                extra[way] = max(extra[way], *(max(r["extra"]) for r in ranks))
                shard = max(shard, *(r["shard"] for r in ranks))
                floor += ranks[0]["floor"]
        for way in WAYS:
            print(
                f"{way:>11}: first fill {min(fresh[way]):.3f} s (of {len(fresh[way])}), "
                f"second fill {min(warm[way]):.3f} s, extra peak memory per rank "
                f"{extra[way] / mib:.0f} MiB (shard {shard / mib:.0f} MiB)"
            )
        print(
            f"{'memcpy':>11}: {min(floor):.3f} s (one copy of each rank's shard from memory "
            "into the shards, 2 ranks at once: the floor for any way that copies)"
        )
        rival = min(min(fresh["dcp"]), min(fresh["broadcast"]))
        ratio = min(fresh["torchplace"]) / rival
        warm_ratio = min(warm["torchplace"]) / min(min(warm["dcp"]), min(warm["broadcast"]))
        budget = shard / 4 + 64 * mib
        print(f"torchplace / faster rival, first fill: {ratio:.2f}x (target <= 0.30x)")
        print(f"torchplace / faster rival, second fill in the same processes: {warm_ratio:.2f}x")
        print(
            f"torchplace extra memory: {extra['torchplace'] / mib:.0f} MiB "
            f"(target <= shard/4 + 64 MiB = {budget / mib:.0f} MiB)"
        )
        met = ratio <= 0.3 and extra["torchplace"] <= budget
        print("targets met" if met else "targets NOT met")


if __name__ == "__main__":
    main()
