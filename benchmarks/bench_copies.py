"""A batch of many small tensors to a GPU: one consolidated copy against per-tensor ``.to()``.

Targets (docs/design.md): 500 tensors of 4 KiB at least 2.5x faster than one ``.to()`` each with
owned results (``torchplace.move(batch, "cuda")``, the default) and at least 4x with
``views=True``; 500 tensors of 500 different shapes at least 2x and 3x. Beside them, in the
same run, the floors: one pinned copy of the packed bytes into a fresh buffer (the least any
consolidated copy does; the floor of views), and that copy plus the fastest way measured to
make owned tensors of the landed bytes from views cut beforehand (the floor of owned results).
The ways to split are timed on their own too: one ``_foreach_add`` that allocates every result
and one ``_foreach_copy_`` (the owned path on CUDA), ``empty_like`` each and one
``_foreach_copy_``, one ``clone`` each (the owned path on the CPU).

    python benchmarks/bench_copies.py            # both targets, as ratios; exit 1 if missed
    python benchmarks/bench_copies.py --sweep    # counts x sizes; prints MIN_COUNT and
                                                 # MAX_TENSOR_BYTES for moving/_consolidate.py
    python benchmarks/bench_copies.py --host     # the same ways on the CPU, any machine
    python benchmarks/bench_copies.py --kept     # memory held by one tensor kept per batch
    pytest benchmarks/bench_copies.py -s         # the same comparison, skipped without CUDA

Without CUDA the default run says so and exits 0: the targets only mean something on a GPU.

``--host`` runs the consolidation engines from the CPU to the CPU (real bytes, no device:
``packed_host_copy`` with its host split, and ``consolidated_views``) against one
``.to(copy=True)`` each, with the floors measured beside them, then times the host-side
bookkeeping alone by copying to ``meta``, which moves no bytes. It is how a change to that
bookkeeping is measured on a machine without a GPU; its ratios are not the GPU's.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import torchplace
from torchplace.moving._consolidate import (
    MAX_TENSOR_BYTES,
    MIN_COUNT,
    consolidated_copy,
    consolidated_views,
    packed_host_copy,
)

sys.path.insert(0, str(Path(__file__).parent))
from _rows import add_row

# (owned, views): per-tensor time over torchplace's, at least
TARGETS = {"4 KiB": (2.5, 4.0), "shapes": (2.0, 3.0)}
SMALL = 1024  # float32 elements: 4 KiB


# Host-only timings count this thread's CPU time: on a shared CPU, wall-clock time mostly
# measures how long the other processes' time slices were. Anything with a GPU counts wall time.
_HOST_CLOCK = time.thread_time


def _time(fn: Callable[[], object], repeat: int) -> float:
    """Best CPU seconds of ``fn`` over ``repeat`` runs, after one warm-up (host only)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = _HOST_CLOCK()
        fn()
        best = min(best, _HOST_CLOCK() - start)
    return best


def _interleaved(
    ways: dict[str, Callable[[], object]],
    sync: Callable[[], object],
    repeat: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """The best time of each way, the ways taking turns round after round: on a shared host
    whose speed drifts from one second to the next, every way sees the same drift."""
    for fn in ways.values():
        fn()
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(repeat):
        for name, fn in ways.items():
            sync()
            start = clock()
            fn()
            sync()
            best[name] = min(best[name], clock() - start)
    return best


def _each(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def small_tensors(count: int, *, distinct: bool = False) -> list[torch.Tensor]:
    """``count`` float32 tensors of 4 KiB, or of ``count`` different 2-D shapes near 4 KiB."""
    if distinct:
        return [torch.rand(1 + i % 4, SMALL // (1 + i % 4) + i // 4) for i in range(count)]
    return [torch.rand(SMALL) for _ in range(count)]


def _packed(
    tensors: Sequence[torch.Tensor], device: torch.device, *, pin: bool
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The packed bytes of ``tensors`` on the host, a landing buffer for them on ``device``,
    and views of that buffer shaped like ``tensors`` (all made before any timing)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    staging = flat.pin_memory() if pin else flat
    landed = torch.empty_like(flat, device=device)
    landed.copy_(staging)
    sizes = [t.numel() for t in tensors]
    cut = [p.view(t.shape) for p, t in zip(landed.split(sizes), tensors, strict=True)]
    return staging, landed, cut


def _floors_and_splits(
    tensors: Sequence[torch.Tensor], device: torch.device, *, pin: bool
) -> dict[str, Callable[[], object]]:
    """The floors and the ways to split a landed buffer into owned tensors."""
    staging, landed, cut = _packed(tensors, device, pin=pin)

    def copy() -> torch.Tensor:  # every copy lands in memory of its own
        return torch.empty_like(landed).copy_(staging, non_blocking=pin)

    def add_and_copy() -> object:  # what the owned path does on CUDA (float32)
        owned = torch._foreach_add(cut, 0)
        torch._foreach_copy_(owned, cut)
        return owned

    def empty_and_copy() -> object:
        owned = [torch.empty_like(v) for v in cut]
        torch._foreach_copy_(owned, cut)
        return owned

    return {
        "floor_copy": copy,
        "split_add_copy": add_and_copy,
        "split_empty_copy": empty_and_copy,
        "split_clones": lambda: [v.clone() for v in cut],
    }


def compare(
    device: torch.device, count: int = 500, repeat: int = 40, *, distinct: bool = False
) -> dict[str, float]:
    """Seconds for ``count`` small tensors to a GPU: per-tensor ``.to()`` (pageable, pinned),
    ``move`` owned (the default) and with ``views=True``, the floors and the owned splits."""
    tensors = small_tensors(count, distinct=distinct)
    pinned = [t.pin_memory() for t in tensors]
    ways: dict[str, Callable[[], object]] = {
        "per_tensor": lambda: [t.to(device) for t in tensors],
        "per_pinned": lambda: [t.to(device, non_blocking=True) for t in pinned],
        "owned": lambda: torchplace.move(tensors, device),
        "views": lambda: torchplace.move(tensors, device, views=True),
        **_floors_and_splits(tensors, device, pin=True),
    }
    return _interleaved(ways, lambda: torch.cuda.synchronize(device), repeat)


def compare_on_host(
    count: int = 500, repeat: int = 40, *, distinct: bool = False
) -> dict[str, float]:
    """Seconds for the same ways from the CPU to the CPU: the consolidation engines themselves
    (``move`` never consolidates for a CPU target), against one ``.to(copy=True)`` each."""
    cpu = torch.device("cpu")
    tensors = small_tensors(count, distinct=distinct)
    ways: dict[str, Callable[[], object]] = {
        "per_tensor": lambda: [t.to(cpu, copy=True) for t in tensors],
        "owned": lambda: packed_host_copy(tensors, cpu, non_blocking=False),
        "views": lambda: consolidated_views(tensors, cpu, pin=False, non_blocking=False),
        **_floors_and_splits(tensors, cpu, pin=False),
    }
    return _interleaved(ways, lambda: None, repeat, _HOST_CLOCK)


def report(
    best: dict[str, float], label: str, targets: tuple[float, float] | None, rows: str | None
) -> bool:
    """Print the figures of one case as ratios; ``targets`` None: no target applies here."""
    per = best["per_tensor"]
    splits = min(seconds for name, seconds in best.items() if name.startswith("split_"))
    best["floor_owned"] = best["floor_copy"] + splits
    print(f"{label}: " + ", ".join(f"{name} {s * 1e3:.3f} ms" for name, s in best.items()))
    met = True
    for i, way in enumerate(("owned", "views")):
        ratio = per / best[way]
        floor = best["floor_owned" if way == "owned" else "floor_copy"]
        target = targets[i] if targets else None
        ok = None if target is None else ratio >= target
        met &= ok is not False
        verdict = "no target here" if ok is None else ("met" if ok else "MISSED")
        wanted = f">= {target}x" if target else "-"
        print(
            f"  {way}: per-tensor/{way} {ratio:.2f}x (target {wanted}: {verdict}); "
            f"{best[way] / floor:.2f}x its floor"
        )
        add_row(rows, f"{label}: {way} vs per-tensor .to()", ratio, wanted, ok)
        add_row(rows, f"{label}: {way} over its floor", best[way] / floor, "-", None)
    return met


def sweep(device: torch.device, repeat: int = 10) -> tuple[int, int]:
    """Ratio per-tensor/consolidated over counts and sizes; returns suggested constants."""
    counts = (2, 4, 8, 16, 32, 64, 256)
    sizes = (256, 4 << 10, 16 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20)  # bytes each
    print(f"per-tensor .to() time / consolidated time on {device} (above 1: consolidate)")
    print("bytes\\count " + "".join(f"{c:>8}" for c in counts))
    wins: dict[tuple[int, int], bool] = {}
    sync = functools.partial(torch.cuda.synchronize, device)
    for nbytes in sizes:
        cells = []
        for count in counts:
            tensors = [torch.rand(nbytes // 4) for _ in range(count)]
            best = _interleaved(
                {
                    "each": functools.partial(_each, tensors, device),
                    "one": functools.partial(consolidated_copy, tensors, device),
                },
                sync,
                repeat,
            )
            each, one = best["each"], best["one"]
            wins[nbytes, count] = each / one > 1.1
            cells.append(f"{each / one:8.2f}")
        print(f"{nbytes:>11} " + "".join(cells))
    min_count = next((c for c in counts if wins[4 << 10, c] and wins[256, c]), counts[-1])
    max_bytes = max((s for s in sizes if wins[s, 64]), default=sizes[0])
    print(f"suggested: MIN_COUNT = {min_count}, MAX_TENSOR_BYTES = {max_bytes}")
    print(f"current:   MIN_COUNT = {MIN_COUNT}, MAX_TENSOR_BYTES = {MAX_TENSOR_BYTES}")
    return min_count, max_bytes


def host_side(count: int = 500, repeat: int = 200) -> dict[str, float]:
    """Seconds of host-side work for ``count`` small tensors, consolidated onto ``meta``."""
    meta = torch.device("meta")
    cases = {
        "4 KiB each": small_tensors(count),
        "distinct shapes": small_tensors(count, distinct=True),
        "steps and biases": [torch.rand(()) if i % 2 else torch.rand(512) for i in range(count)],
    }
    best = {}
    for name, tensors in cases.items():
        views = functools.partial(consolidated_views, tensors, meta, pin=False, non_blocking=False)
        owned = functools.partial(packed_host_copy, tensors, meta, non_blocking=False)
        best[f"{name}, views"] = _time(views, repeat)
        best[f"{name}, owned (a clone each on meta)"] = _time(owned, repeat)
    for name, seconds in best.items():
        print(f"host side, {count} tensors to meta, {name}: {seconds * 1e3:.3f} ms")
    return best


def kept(batches: int = 300, masks: int = 250) -> dict[str, int]:
    """Bytes held by one label kept from each of ``batches`` batches (16 int64 labels beside
    ``masks`` tensors of 4 KiB), owned and as views, through the engines on the CPU."""
    cpu = torch.device("cpu")
    held: dict[str, list[torch.Tensor]] = {"owned": [], "views": []}
    for i in range(batches):
        batch = [torch.arange(16) + i, *(torch.rand(SMALL) for _ in range(masks))]
        held["owned"].append(packed_host_copy(batch, cpu, non_blocking=False)[0])
        held["views"].append(consolidated_views(batch, cpu, pin=False, non_blocking=False)[0][0])
    figures = {}
    for way, labels in held.items():
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in labels}
        figures[way] = sum(storages.values())
        print(f"{batches} labels kept, {way}: {figures[way] / (1 << 20):.3f} MiB held")
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="measure the threshold")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=40, help="rounds per way")
    parser.add_argument("--host", action="store_true", help="the same ways on the CPU")
    parser.add_argument("--kept", action="store_true", help="memory held by kept tensors")
    parser.add_argument("--rows", help="append the figures as JSON lines to this file")
    args = parser.parse_args(argv)
    count = args.count
    if args.kept:
        kept()
        return 0
    if args.host:
        # One intra-op thread: on a shared CPU, a 2 MiB copy split over threads waits a whole
        # time slice (about 20 ms) for a thread that is not running, and nothing here needs two.
        torch.set_num_threads(1)
        for label, distinct in ((f"{count} x 4 KiB, cpu", False), (f"{count} shapes, cpu", True)):
            report(compare_on_host(count, args.repeat, distinct=distinct), label, None, args.rows)
        host_side(count, args.repeat)
        return 0
    if not torch.cuda.is_available():
        print("bench_copies: skipped, no CUDA device (the targets apply to a GPU)")
        return 0
    device = torch.device(args.device)
    if args.sweep:
        sweep(device)
        return 0
    met = True
    for name, distinct in (("4 KiB", False), ("shapes", True)):
        label = f"{count} x 4 KiB" if not distinct else f"{count} shapes"
        best = compare(device, count, args.repeat, distinct=distinct)
        met &= report(best, label, TARGETS[name], args.rows)
    return 0 if met else 1


def test_consolidated_copies_against_per_tensor() -> None:
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    report(compare(torch.device("cuda:0")), "500 x 4 KiB", TARGETS["4 KiB"], None)


if __name__ == "__main__":
    sys.exit(main())
