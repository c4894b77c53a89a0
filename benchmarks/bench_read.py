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
(``_host_read.READ_THREADS``) and chunk size (``_host_read.READ_CHUNK_BYTES``) set to each of a few
values, to choose them by measurement.

``--crc`` times what checking every record's CRC-32 as it is read costs, with each CRC-32
function the reader can use (zlib's, and ISA-L's where ``isal`` is installed: ``pip install
isal``), against the same read of the ``.pt`` file unchecked, round by round in this process: as
wall-clock time over the unchecked read, and as the CPU time the reader's threads spent in the
CRC calls over the unchecked read's CPU time (a figure the other processes' load moves less).
Target (``check_crc`` on by default): at most +15% of the page-cache read.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TARGET = 0.7
CRC_TARGET = 0.15  # the most a default CRC-32 check may add to a page-cache read


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
    parser.add_argument("--crc", action="store_true", help="time the CRC-32 check, zlib and ISA-L")
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
        if args.crc:
            _crc_cost(pt, nbytes, args.rounds, memcpy)
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
    from torchplace.checkpoint import _host_read

    print(f"{nbytes / 2**20:.0f} MiB from the page cache, {os.cpu_count()} CPUs")
    print(f"{'threads':>8}{'chunk MiB':>10}{'st GB/s':>9}{'pt GB/s':>9}")
    saved = (_host_read.READ_THREADS, _host_read.READ_CHUNK_BYTES)
    try:
        for threads in (1, 2, 4, 8, 16):
            if threads > 2 * (os.cpu_count() or 1):
                continue
            for chunk_mb in (4, 16, 64):
                _host_read.READ_THREADS, _host_read.READ_CHUNK_BYTES = threads, chunk_mb << 20
                speeds = [
                    nbytes / best(lambda p=p: torchplace.load(p), rounds) / 1e9 for p in (st, pt)
                ]
                print(f"{threads:>8}{chunk_mb:>10}{speeds[0]:>9.2f}{speeds[1]:>9.2f}")
    finally:
        _host_read.READ_THREADS, _host_read.READ_CHUNK_BYTES = saved


def _crc_functions() -> dict[str, Callable[..., int]]:
    import zlib

    found: dict[str, Callable[..., int]] = {"zlib": zlib.crc32}
    try:
        from isal import isal_zlib
    except ImportError:
        print("isal is not installed (pip install isal): ISA-L's CRC-32 is not timed")
    else:
        found["isal"] = isal_zlib.crc32
    return found


def _crc_cost(pt: Path, nbytes: int, rounds: int, memcpy: Callable[[], Any]) -> None:
    """The check's cost with each CRC-32 function, in the reader's threads (see ``--crc``),
    beside the floor (``memcpy``: a fresh allocation and a copy of as many bytes)."""
    import torchplace
    from torchplace.checkpoint import _crc

    spent = [0.0]  # CPU seconds inside the CRC calls, summed over the reader's threads
    lock = threading.Lock()

    def timed(fn: Callable[..., int]) -> Callable[..., int]:
        def run(data: Any) -> int:
            start = time.thread_time()
            out = fn(data)
            with lock:
                spent[0] += time.thread_time() - start
            return out

        return run

    functions = _crc_functions()
    wall = dict.fromkeys(["unchecked", *functions], float("inf"))
    cpu = dict.fromkeys(wall, float("inf"))
    in_crc = dict.fromkeys(functions, float("inf"))
    floor = float("inf")
    saved = _crc._pick
    try:
        for _ in range(rounds):  # the ways take turns, round by round
            floor = min(floor, best(memcpy, 1))
            for name in wall:
                fn = functions.get(name)
                _crc._pick = lambda fn=fn: (timed(fn) if fn else saved()[0], fn is not None)
                spent[0] = 0.0
                start, start_cpu = time.perf_counter(), time.process_time()
                torchplace.load(pt, check_crc=fn is not None)
                wall[name] = min(wall[name], time.perf_counter() - start)
                cpu[name] = min(cpu[name], time.process_time() - start_cpu)
                if fn is not None:
                    in_crc[name] = min(in_crc[name], spent[0])
    finally:
        _crc._pick = saved
    _crc_report(nbytes, rounds, wall, cpu, in_crc)
    print(f"floor (memcpy into a fresh allocation): {floor:.3f} s, {nbytes / floor / 1e9:.2f} GB/s")


def _crc_report(
    nbytes: int,
    rounds: int,
    wall: dict[str, float],
    cpu: dict[str, float],
    in_crc: dict[str, float],
) -> None:
    from torchplace.checkpoint import _host_read

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{nbytes / 2**20:.0f} MiB .pt from the page cache, best of {rounds} rounds, "
        f"{_host_read.READ_THREADS} reading threads, {os.cpu_count()} CPUs, load average {load:.1f}"
    )
    print(
        f"{'check':<12}{'wall s':>8}{'GB/s':>7}{'+wall':>8}{'CPU s':>8}{'CRC CPU s':>11}{'+CPU':>7}"
    )
    base, base_cpu = wall["unchecked"], cpu["unchecked"]
    for name, seconds in wall.items():
        extra = seconds / base - 1
        spent = in_crc.get(name, 0.0)
        print(
            f"{name:<12}{seconds:>8.3f}{nbytes / seconds / 1e9:>7.2f}{extra:>+8.0%}"
            f"{cpu[name]:>8.3f}{spent:>11.3f}{spent / base_cpu:>+7.0%}"
        )
    for name in in_crc:
        extra = wall[name] / base - 1
        verdict = "met" if extra <= CRC_TARGET else "NOT met"
        print(f"check with {name}: {extra:+.0%} wall (target <= +{CRC_TARGET:.0%}): {verdict}")


if __name__ == "__main__":
    main()
