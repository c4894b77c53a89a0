"""A batch of many small tensors to a GPU: one consolidated copy against per-tensor ``.to()``.

Targets (docs/design.md): 500 tensors of 4 KiB at least 4x faster than one ``.to()`` each, and
500 tensors of 500 different shapes at least 3x. Measured through the public path,
``torchplace.move(batch, "cuda")``, whose small tensors land as views of bounded shared buffers;
beside it, the same copy with ``views=False`` (each result owns its storage: the fused split a
model's tensors take), one ``clone`` per slice of the landed buffer, and per-tensor copies from
pinned memory.

    python benchmarks/bench_copies.py            # both targets, as ratios; exit 1 if missed
    python benchmarks/bench_copies.py --sweep    # counts x sizes; prints MIN_COUNT and
                                                 # MAX_TENSOR_BYTES for moving/_consolidate.py
    python benchmarks/bench_copies.py --host     # the host-side work alone, on any machine
    pytest benchmarks/bench_copies.py -s         # the same comparison, skipped without CUDA

Without CUDA it says so and exits 0: the figures only mean something on a GPU.

``--host`` times what a consolidated copy does on the host (checks, layout, packing, cutting
views or one ``clone`` per view) by copying to ``meta``, which moves no bytes; it runs anywhere
and is how a change to that bookkeeping is measured on a machine without a GPU.
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
    pack_and_copy,
)

sys.path.insert(0, str(Path(__file__).parent))
from _rows import add_row

TARGET_RATIO = 4.0  # 500 tensors of 4 KiB
TARGET_SHAPES_RATIO = 3.0  # 500 tensors of 500 shapes
SMALL = 1024  # float32 elements: 4 KiB


def _time(fn: Callable[[], object], repeat: int) -> float:
    """Best wall-clock seconds of ``fn`` over ``repeat`` runs, after one warm-up (host only)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _interleaved(
    ways: dict[str, Callable[[], object]], device: torch.device, repeat: int
) -> dict[str, float]:
    """The best time of each way, the ways taking turns round after round: on a shared host
    whose speed drifts from one second to the next, every way sees the same drift."""
    for fn in ways.values():
        fn()
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(repeat):
        for name, fn in ways.items():
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _each(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def _clone_slices(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The alternative split: one buffer, one copy, then one ``clone`` kernel per tensor."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.nbytes // 16) * 16
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    for t, offset in zip(tensors, offsets, strict=True):
        staging[offset : offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
    landed = staging.to(device, non_blocking=True)
    return [
        landed[o : o + t.nbytes].view(t.dtype).view(t.shape).clone()
        for t, o in zip(tensors, offsets, strict=True)
    ]


def small_tensors(count: int, *, distinct: bool = False) -> list[torch.Tensor]:
    """``count`` float32 tensors of 4 KiB, or of ``count`` different 2-D shapes near 4 KiB."""
    if distinct:
        return [torch.rand(1 + i % 4, SMALL // (1 + i % 4) + i // 4) for i in range(count)]
    return [torch.rand(SMALL) for _ in range(count)]


def compare(
    device: torch.device, count: int = 500, repeat: int = 40, *, distinct: bool = False
) -> dict[str, float]:
    """Seconds for ``count`` small tensors: per-tensor ``.to()``, ``move`` (views), owned
    results, a clone per slice, per-tensor from pinned memory."""
    tensors = small_tensors(count, distinct=distinct)
    pinned = [t.pin_memory() for t in tensors]
    best = _interleaved(
        {
            "per_tensor": lambda: [t.to(device) for t in tensors],
            "per_pinned": lambda: [t.to(device, non_blocking=True) for t in pinned],
            "move": lambda: torchplace.move(tensors, device),
            "owned": lambda: torchplace.move(tensors, device, views=False),
            "clones": lambda: _clone_slices(tensors, device),
        },
        device,
        repeat,
    )
    return {
        "per_tensor_s": best["per_tensor"],
        "per_tensor_pinned_s": best["per_pinned"],
        "move_s": best["move"],
        "owned_s": best["owned"],
        "clone_split_s": best["clones"],
        "ratio": best["per_tensor"] / best["move"],
        "ratio_owned": best["per_tensor"] / best["owned"],
        "ratio_vs_pinned": best["per_pinned"] / best["move"],
    }


def sweep(device: torch.device, repeat: int = 10) -> tuple[int, int]:
    """Ratio per-tensor/consolidated over counts and sizes; returns suggested constants."""
    counts = (2, 4, 8, 16, 32, 64, 256)
    sizes = (256, 4 << 10, 16 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20)  # bytes each
    print(f"per-tensor .to() time / consolidated time on {device} (above 1: consolidate)")
    print("bytes\\count " + "".join(f"{c:>8}" for c in counts))
    wins: dict[tuple[int, int], bool] = {}
    for nbytes in sizes:
        cells = []
        for count in counts:
            tensors = [torch.rand(nbytes // 4) for _ in range(count)]
            best = _interleaved(
                {
                    "each": functools.partial(_each, tensors, device),
                    "one": functools.partial(consolidated_copy, tensors, device),
                },
                device,
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
        owned = functools.partial(pack_and_copy, tensors, meta, pin=False, non_blocking=False)
        best[f"{name}, views"] = _time(views, repeat)
        best[f"{name}, owned (a clone each on the host)"] = _time(owned, repeat)
    for name, seconds in best.items():
        print(f"host side, {count} tensors, {name}: {seconds * 1e3:.3f} ms")
    return best


def report(figures: dict[str, float], label: str, target: float, rows: str | None = None) -> bool:
    met = figures["ratio"] >= target
    print(
        f"{label}: per-tensor .to() {figures['per_tensor_s'] * 1e3:.2f} ms, "
        f"from pinned {figures['per_tensor_pinned_s'] * 1e3:.2f} ms, "
        f"move (views) {figures['move_s'] * 1e3:.2f} ms, "
        f"views=False {figures['owned_s'] * 1e3:.2f} ms, "
        f"clone split {figures['clone_split_s'] * 1e3:.2f} ms"
    )
    print(
        f"  per-tensor/move {figures['ratio']:.2f}x (target >= {target:.0f}x: "
        f"{'met' if met else 'MISSED'}); views=False {figures['ratio_owned']:.2f}x; "
        f"vs pinned per-tensor {figures['ratio_vs_pinned']:.2f}x"
    )
    add_row(rows, f"{label}: move vs per-tensor .to()", figures["ratio"], f">= {target:.0f}x", met)
    add_row(rows, f"{label}: views=False vs per-tensor", figures["ratio_owned"], "-", None)
    return met


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="measure the threshold")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=40, help="rounds per way")
    parser.add_argument("--host", action="store_true", help="host-side work only, any machine")
    parser.add_argument("--rows", help="append the figures as JSON lines to this file")
    args = parser.parse_args(argv)
    if args.host:
        host_side(args.count, args.repeat)
        return 0
    if not torch.cuda.is_available():
        print("bench_copies: skipped, no CUDA device (the targets apply to a GPU)")
        return 0
    device = torch.device(args.device)
    if args.sweep:
        sweep(device)
        return 0
    count = args.count
    met = report(compare(device, count, args.repeat), f"{count} x 4 KiB", TARGET_RATIO, args.rows)
    shapes = compare(device, count, args.repeat, distinct=True)
    met &= report(shapes, f"{count} shapes", TARGET_SHAPES_RATIO, args.rows)
    return 0 if met else 1


def test_consolidated_copies_against_per_tensor() -> None:
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    report(compare(torch.device("cuda:0")), "500 x 4 KiB", TARGET_RATIO)


if __name__ == "__main__":
    sys.exit(main())
