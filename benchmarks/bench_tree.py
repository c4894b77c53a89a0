"""Batch traversal: moving a nested batch of 1,000 small tensors to the device it is already on.

Side by side in one run: torchplace.move, its candidate walkers (torch.utils._pytree, optree),
Accelerate's send_to_device and Lightning's move_data_to_device. Target (DESIGN.md §5): torchplace
at most half the time of Accelerate and of Lightning.

    python benchmarks/bench_tree.py [--device cpu] [--repeat 200]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    device = torchplace.device(args.device)
    batch = make_batch(device)
    print(f"batch: {count(batch)} tensors on {device}; best of 5 x {args.repeat} calls")
    times: dict[str, float] = {}
    for name, fn in candidates(device).items():
        fn(batch)
        runs = timeit.repeat(lambda fn=fn: fn(batch), number=args.repeat, repeat=5)
        times[name] = min(runs) / args.repeat
    ours = times["torchplace.move"]
    for name, seconds in times.items():
        print(f"{name:34s} {seconds * 1e3:8.3f} ms/batch   torchplace/this = {ours / seconds:5.2f}")
    for rival in ("accelerate.send_to_device", "lightning move_data_to_device"):
        if rival in times:
            ratio = ours / times[rival]
            verdict = "meets" if ratio <= 0.5 else "MISSES"
            print(f"target <= 0.50x {rival}: {ratio:.2f}x ({verdict})")


if __name__ == "__main__":
    main()
