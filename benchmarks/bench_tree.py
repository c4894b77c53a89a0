"""Batch traversal: moving a nested batch of 1,000 small tensors.

Two cases, each side by side in one run:

- to the device it is already on: torchplace.move, its candidate walkers (torch.utils._pytree,
  optree), Accelerate's send_to_device and Lightning's move_data_to_device. Target: torchplace at
  most half the time of Accelerate and of Lightning.
- to another device (cpu -> meta, so no bytes move and only per-tensor overhead counts): the same
  rivals and a bare list of ``.to()`` calls over the 1,000 tensors. Target: torchplace at most
  Accelerate's time and at most twice the bare loop.

    python benchmarks/bench_tree.py [--device cpu] [--to meta] [--repeat 200]
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

import torchplace


def make_batch(device: torch.device) -> dict[str, Any]:
    """1,000 small tensors in the shapes real batches take: dicts of lists of tuples."""
    t = lambda: torch.zeros(4, device=device)  # noqa: E731
    return {
        "images": [t() for _ in range(300)],
        "targets": [
            {"boxes": t(), "labels": t(), "meta": {"id": 3, "name": "x"}} for _ in range(200)
        ],
        "pairs": [(t(), t()) for _ in range(100)],
        "mask": t(),
        "extra": {"ids": [t() for _ in range(99)]},
    }


def count(batch: Any) -> int:
    return len([x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)])


def candidates(device: torch.device) -> dict[str, Callable[[Any], Any]]:
    def same_or_move(x: Any) -> Any:
        return x.to(device) if isinstance(x, torch.Tensor) else x

    found: dict[str, Callable[[Any], Any]] = {
        "torchplace.move": lambda b: torchplace.move(b, device),
        "walk: torch.utils._pytree": lambda b: pytree.tree_map(same_or_move, b),
    }
    try:
        import optree

        found["walk: optree"] = lambda b: optree.tree_map(same_or_move, b, none_is_leaf=True)
    except ImportError:
        pass
    try:
        from accelerate.utils import send_to_device

        found["accelerate.send_to_device"] = lambda b: send_to_device(b, device)
    except ImportError:
        pass
    try:
        from lightning_fabric.utilities.apply_func import move_data_to_device

        found["lightning move_data_to_device"] = lambda b: move_data_to_device(b, device)
    except ImportError:
        pass
    return found


def timed(fns: dict[str, Callable[[Any], Any]], batch: Any, repeat: int) -> dict[str, float]:
    """Best seconds per call of each function on ``batch``, printed against torchplace.

    The functions take turns, round after round (15 rounds of ``repeat // 10`` calls each),
    so that a slow spell of a shared machine falls on all of them instead of on one.
    """
    for fn in fns.values():
        fn(batch)
    number = max(1, repeat // 10)
    times = dict.fromkeys(fns, float("inf"))
    for _ in range(15):
        for name, fn in fns.items():
            seconds = timeit.timeit(lambda fn=fn: fn(batch), number=number) / number
            times[name] = min(times[name], seconds)
    ours = times["torchplace.move"]
    for name, seconds in times.items():
        print(f"{name:34s} {seconds * 1e3:8.3f} ms/batch   torchplace/this = {ours / seconds:5.2f}")
    return times


def verdict(times: dict[str, float], rival: str, limit: float) -> None:
    if rival in times:
        ratio = times["torchplace.move"] / times[rival]
        print(
            f"target <= {limit:.2f}x {rival}: {ratio:.2f}x "
            f"({'meets' if ratio <= limit else 'MISSES'})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--to", default="meta", help="the other device, for the second case")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    device = torchplace.device(args.device)
    batch = make_batch(device)
    print(f"same device: {count(batch)} tensors on {device}; best call of 15 interleaved rounds")
    times = timed(candidates(device), batch, args.repeat)
    verdict(times, "accelerate.send_to_device", 0.5)
    verdict(times, "lightning move_data_to_device", 0.5)

    other = torchplace.device(args.to)
    tensors = [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    print(f"\nanother device: {len(tensors)} tensors from {device} to {other}")
    rivals = {
        name: fn
        for name, fn in candidates(other).items()
        if not name.startswith("walk:")  # the walkers are compared above
    }
    rivals["bare list of .to() calls"] = lambda _: [t.to(other) for t in tensors]
    times = timed(rivals, batch, args.repeat)
    verdict(times, "accelerate.send_to_device", 1.0)
    verdict(times, "bare list of .to() calls", 2.0)


if __name__ == "__main__":
    main()
