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
both formats.
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

        ways: dict[str, Callable[[], Any]] = {
            "memcpy (fresh allocation)": memcpy,
            "torchplace.load safetensors": lambda: torchplace.load(st),
            "torchplace.load pt (zip)": lambda: torchplace.load(pt),
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


if __name__ == "__main__":
    main()
