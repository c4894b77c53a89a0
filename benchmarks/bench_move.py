"""Moving a model with its Adam state to a GPU, as a fraction of one large pinned copy's bandwidth.

Target (DESIGN.md §5): ``torchplace.move(model, "cuda", optimizer=adam)`` reaches 85% of the
bandwidth of a single pinned host-to-device copy of the same number of bytes. Side by side:
``model.to("cuda")`` plus the by-hand optimizer-state loop people write.

    python benchmarks/bench_move.py [--layers 24] [--width 2048]

Needs a CUDA device; without one it says so and exits 0.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

import torchplace


def build(layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    state = sum(v.nbytes for s in opt.state.values() for v in s.values() if v.dim() > 0)
    params = sum(p.nbytes for p in model.parameters())
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    return model, opt, params + grads + state


def timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def pinned_copy_seconds(nbytes: int) -> float:
    """The best time of one pinned host-to-device copy of ``nbytes``."""
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    landing = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    landing.copy_(pinned, non_blocking=True)  # warm up
    return min(timed(lambda: landing.copy_(pinned, non_blocking=True)) for _ in range(5))


def by_hand(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.to("cuda")
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                state[key] = value.to("cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_move: skipped, no CUDA device (the target applies to a GPU)")
        return
    nbytes = build(args.layers, args.width)[2]
    best_copy = pinned_copy_seconds(nbytes)
    results: dict[str, float] = {}
    for name, fn in (
        ("torchplace.move", lambda m, o: torchplace.move(m, "cuda", optimizer=o)),
        ("model.to + state loop", by_hand),
    ):
        runs = []
        for _ in range(3):
            m, o, _ = build(args.layers, args.width)
            runs.append(timed(lambda m=m, o=o, fn=fn: fn(m, o)))
            del m, o
            torch.cuda.empty_cache()
        results[name] = min(runs)
    gbps = nbytes / best_copy / 1e9
    print(f"{nbytes / 2**30:.2f} GiB (parameters, grads, Adam state); pinned copy {gbps:.1f} GB/s")
    for name, seconds in results.items():
        fraction = best_copy / seconds
        print(f"{name:24s} {nbytes / seconds / 1e9:6.1f} GB/s = {fraction:.2f} of the pinned copy")
    fraction = best_copy / results["torchplace.move"]
    print(f"target >= 0.85: {fraction:.2f} ({'met' if fraction >= 0.85 else 'MISSED'})")


if __name__ == "__main__":
    main()
