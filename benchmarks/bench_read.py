"""Reading a checkpoint into memory against a fresh allocation and memcpy of as many bytes.

Run as ``python benchmarks/bench_read.py [--size-mb 512] [--rounds 7] [--tensors 16]``.

A state dict of ``--tensors`` float32 tensors, ``--size-mb`` in all, is written once as a
``.safetensors`` file and as a torch zip (``.pt``) file, and each file is read once beforehand so
it is in the page cache. Then, round by round, in this one process:

* ``memcpy``: ``torch.empty(n, dtype=torch.uint8)`` and ``copy_`` from a tensor over a bytes
  object already in memory, ``n`` the size of the data (what reading from the page cache costs
  at best: a fresh allocation, its page faults, and the copy);
* ``torchplace.load(f)`` (``mmap=False``, the default: no tensor backed by the file) of each
  file;
* for reference: ``torch.load(f, mmap=False)``, and ``safetensors.torch.load_file(f)`` (which
  maps the file: no bytes are read until used, so its time says nothing about reading).

Each way is reported by its fastest round, as GB/s and as a fraction of the ``memcpy`` speed.
Target (the safe default is fast): ``torchplace.load`` at least 0.7x the ``memcpy`` speed for
both formats. Also timed: ``torchplace.load(pt, check_crc=True)`` (every record's CRC-32
checked, what that option costs) and a bf16 load of the fp32 safetensors file through
``load_into`` (converted a chunk at a time as it is read).

``--sweep`` times ``torchplace.load`` of each file with the reader's pool of threads
(``_reader.READ_THREADS``) and chunk size (``_reader.READ_CHUNK_BYTES``) set to each of a few
values, to choose them by measurement.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TARGET = 0.7


def best(fn: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
        del out
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--sweep", action="store_true", help="time pool and chunk sizes")
    args = parser.parse_args()

    from safetensors.torch import load_file, save_file

    import torchplace

    per = args.size_mb * 2**20 // 4 // args.tensors
    torch.manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(per) for i in range(args.tensors)}
    nbytes = sum(t.nbytes for t in state.values())
    with tempfile.TemporaryDirectory() as tmp:
        st, pt = Path(tmp) / "model.safetensors", Path(tmp) / "model.pt"
        save_file(state, st)
        torch.save(state, pt)
        del state
        os.sync()
        for path in (st, pt):  # into the page cache
            path.read_bytes()
        source = torch.frombuffer(bytearray(st.read_bytes()[-nbytes:]), dtype=torch.uint8)

        def memcpy() -> torch.Tensor:
            out = torch.empty(nbytes, dtype=torch.uint8)
            out.copy_(source)
            return out

        if args.sweep:
            _sweep(st, pt, nbytes, args.rounds)
            return

        def bf16() -> Any:
            model = torchplace.skeleton(_Layers, per, args.tensors).to(torch.bfloat16)
            return torchplace.load_into(model, st)

        ways: dict[str, Callable[[], Any]] = {
            "memcpy (fresh allocation)": memcpy,
            "torchplace.load safetensors": lambda: torchplace.load(st),
            "torchplace.load pt (zip)": lambda: torchplace.load(pt),
            "  the same, check_crc=True": lambda: torchplace.load(pt, check_crc=True),
            "load_into bf16 from fp32 (st)": bf16,
            "torch.load pt, mmap=False": lambda: torch.load(pt, weights_only=True),
            "safetensors load_file (maps)": lambda: load_file(st),
        }
        results = dict.fromkeys(ways, float("inf"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(args.rounds):  # the ways take turns, round by round
                for name, fn in ways.items():
                    results[name] = min(results[name], best(fn, 1))

    base = results["memcpy (fresh allocation)"]
    print(
        f"{nbytes / 2**20:.0f} MiB in {args.tensors} tensors, from the page cache, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print(f"{'way':<32}{'seconds':>9}{'GB/s':>8}{'x memcpy':>10}")
    for name, seconds in results.items():
        print(f"{name:<32}{seconds:>9.3f}{nbytes / seconds / 1e9:>8.2f}{base / seconds:>10.2f}")
    for name in ("torchplace.load safetensors", "torchplace.load pt (zip)"):
        ratio = base / results[name]
        verdict = "met" if ratio >= TARGET else "NOT met"
        print(f"{name}: {ratio:.2f}x the memcpy speed (target >= {TARGET}): {verdict}")


class _Layers(torch.nn.Module):
    """``count`` parameters named as the benchmark's state dict (``layer{i}.weight``)."""

    def __init__(self, per: int, count: int) -> None:
        super().__init__()
        for i in range(count):
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(torch.empty(per))
            self.add_module(f"layer{i}", layer)


def _sweep(st: Path, pt: Path, nbytes: int, rounds: int) -> None:
    import torchplace
    from torchplace.checkpoint import _reader

    print(f"{nbytes / 2**20:.0f} MiB from the page cache, {os.cpu_count()} CPUs")
    print(f"{'threads':>8}{'chunk MiB':>10}{'st GB/s':>9}{'pt GB/s':>9}")
    saved = (_reader.READ_THREADS, _reader.READ_CHUNK_BYTES)
    try:
        for threads in (1, 2, 4, 8, 16):
            if threads > 2 * (os.cpu_count() or 1):
                continue
            for chunk_mb in (4, 16, 64):
                _reader.READ_THREADS, _reader.READ_CHUNK_BYTES = threads, chunk_mb << 20
                speeds = [
                    nbytes / best(lambda p=p: torchplace.load(p), rounds) / 1e9 for p in (st, pt)
                ]
                print(f"{threads:>8}{chunk_mb:>10}{speeds[0]:>9.2f}{speeds[1]:>9.2f}")
    finally:
        _reader.READ_THREADS, _reader.READ_CHUNK_BYTES = saved


if __name__ == "__main__":
    main()
