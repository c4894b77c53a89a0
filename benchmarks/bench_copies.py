"""Consolidated copies against per-tensor ``.to()``, and the sweep that sets the threshold.

Target (docs/design.md): 500 small tensors to a GPU at least 4x faster as one consolidated copy
than with one ``.to()`` each.

    python benchmarks/bench_copies.py            # the 500-tensor comparison, as a ratio
    python benchmarks/bench_copies.py --sweep    # counts x sizes; prints MIN_COUNT and
                                                 # MAX_TENSOR_BYTES for torchplace/_consolidate.py
    python benchmarks/bench_copies.py --host     # the host-side work alone, on any machine
    pytest benchmarks/bench_copies.py -s         # the same comparison, skipped without CUDA

It also times the alternative way of splitting on the device (one ``clone`` per slice of the
landed buffer) against the fused split torchplace uses, so that choice stays measured, and the
same comparison with 500 tensors of 500 different shapes, which the split cannot cut shape by
shape (the 500 tensors of the target come in three shapes, as a model's layers repeat theirs).
Without CUDA it says so and exits 0: the figures only mean something on a GPU.

``--host`` times what a consolidated copy does on the host (checks, grouping, packing, cutting
views, one ``clone`` per view) by copying to ``meta``, which moves no bytes; it runs anywhere
and is how a change to that bookkeeping is measured on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence

import torch

from torchplace.cli._bench import _no_sync, _time
from torchplace.moving._consolidate import (
    MAX_TENSOR_BYTES,
    MIN_COUNT,
    _consolidate,
    consolidated_copy,
)

TARGET_RATIO = 4.0
SIZES = (256, 1024, 4096)  # float32 elements per small tensor, in turn: 1, 4 and 16 KiB


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
    """``count`` small float32 tensors of 1, 4 and 16 KiB in turn, or of ``count`` shapes."""
    if distinct:  # as many shapes as tensors, about the same sizes
        return [torch.rand(SIZES[i % len(SIZES)] + i // len(SIZES) + 1) for i in range(count)]
    return [torch.rand(SIZES[i % len(SIZES)]) for i in range(count)]


def compare(
    device: torch.device, count: int = 500, repeat: int = 40, *, distinct: bool = False
) -> dict[str, float]:
    """Seconds for ``count`` small tensors: per-tensor ``.to()``, consolidated, clone split."""
    tensors = small_tensors(count, distinct=distinct)
    pinned = [t.pin_memory() for t in tensors]
    best = _interleaved(
        {
            "per_tensor": lambda: [t.to(device) for t in tensors],
            "per_pinned": lambda: [t.to(device, non_blocking=True) for t in pinned],
            "together": lambda: consolidated_copy(tensors, device),
            "clones": lambda: _clone_slices(tensors, device),
        },
        device,
        repeat,
    )
    per_tensor, per_pinned = best["per_tensor"], best["per_pinned"]
    together, clones = best["together"], best["clones"]
    return {
        "per_tensor_s": per_tensor,
        "per_tensor_pinned_s": per_pinned,
        "consolidated_s": together,
        "clone_split_s": clones,
        "ratio": per_tensor / together,
        "ratio_vs_pinned": per_pinned / together,
        "fused_vs_clone_split": clones / together,
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
        "three_shapes": small_tensors(count),
        "distinct_shapes": small_tensors(count, distinct=True),
        "steps_and_biases": [torch.rand(()) if i % 2 else torch.rand(512) for i in range(count)],
    }
    best = {
        name: _time(
            functools.partial(_consolidate, tensors, meta, pin=False, non_blocking=False),
            _no_sync,
            repeat,
        )
        for name, tensors in cases.items()
    }
    for name, seconds in best.items():
        print(f"host side, {count} tensors, {name.replace('_', ' ')}: {seconds * 1e3:.3f} ms")
    return best


def report(figures: dict[str, float], label: str = "500 small tensors") -> bool:
    met = figures["ratio"] >= TARGET_RATIO
    print(
        f"{label}: per-tensor .to() {figures['per_tensor_s'] * 1e3:.2f} ms, "
        f"from pinned {figures['per_tensor_pinned_s'] * 1e3:.2f} ms, "
        f"consolidated {figures['consolidated_s'] * 1e3:.2f} ms, "
        f"clone split {figures['clone_split_s'] * 1e3:.2f} ms"
    )
    print(
        f"ratio per-tensor/consolidated {figures['ratio']:.2f}x "
        f"(target >= {TARGET_RATIO:.0f}x: {'met' if met else 'MISSED'}); "
        f"vs pinned per-tensor {figures['ratio_vs_pinned']:.2f}x; "
        f"fused split vs clone split {figures['fused_vs_clone_split']:.2f}x"
    )
    return met


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="measure the threshold")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--host", action="store_true", help="host-side work only, any machine")
    args = parser.parse_args(argv)
    if args.host:
        host_side(args.count)
        return 0
    if not torch.cuda.is_available():
        print("bench_copies: skipped, no CUDA device (the targets apply to a GPU)")
        return 0
    device = torch.device(args.device)
    if args.sweep:
        sweep(device)
        return 0
    met = report(compare(device, args.count))
    report(compare(device, args.count, distinct=True), f"{args.count} shapes (not the target)")
    return 0 if met else 1


def test_consolidated_copies_against_per_tensor() -> None:
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    report(compare(torch.device("cuda:0")))


if __name__ == "__main__":
    sys.exit(main())
