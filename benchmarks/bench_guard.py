"""What an installed guard adds to a forward pass on the CPU, as a ratio to the bare forward.

Run as ``python benchmarks/bench_guard.py [--rounds N]``. Two models, one thread, no autograd:

* the issue's target: 48 blocks of ``Linear(512)`` + ``ReLU``, batch 16, at most 3% added;
* The target (docs/design.md): 100 blocks of ``Linear(512)`` + ``ReLU``, batch 1, at most 5% added.

Each round times one bare and one guarded forward (the guard is installed and removed outside
the timing), so drift in the machine's speed hits both alike. Interference from other processes
only ever adds time, so each series is summed up by its 10th percentile, and the overhead is
guarded / bare - 1 of those. A second bare series in the same rounds (the control) shows the
noise floor; for scale, an empty forward pre-hook on every module is measured too.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

from torchplace.looking._guard import guard


def mlp(blocks: int, width: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def timed(forward: Callable[[], object]) -> float:
    start = time.perf_counter()
    forward()
    return time.perf_counter() - start


def empty_hooks(model: nn.Module) -> Callable[[], None]:
    handles = [m.register_forward_pre_hook(lambda m, a: None) for m in model.modules()]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


def low(times: list[float]) -> float:
    """The 10th percentile: interference only adds time, so the fast end is the signal."""
    return sorted(times)[len(times) // 10]


def overhead(blocks: int, batch: int, width: int, rounds: int) -> dict[str, float]:
    model = mlp(blocks, width)
    x = torch.randn(batch, width)
    forward = lambda: model(x)  # noqa: E731
    for _ in range(20):
        forward()
    bare: list[float] = []
    guarded: list[float] = []
    control: list[float] = []
    hooked: list[float] = []
    for _ in range(rounds):
        bare.append(timed(forward))
        with guard(model):
            guarded.append(timed(forward))
        control.append(timed(forward))
        remove = empty_hooks(model)
        hooked.append(timed(forward))
        remove()
    fast = low(bare)
    return {
        "bare_us": fast * 1e6,
        "guard": low(guarded) / fast - 1,
        "control": low(control) / fast - 1,
        "hook_every_module": low(hooked) / fast - 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400, help="rounds per model (default 400)")
    rounds = parser.parse_args().rounds
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, 10th percentile of {rounds} alternating rounds")
    with torch.no_grad():
        for name, blocks, batch, target in (
            ("48 x Linear(512)+ReLU, batch 16", 48, 16, 0.03),
            ("100 x Linear(512)+ReLU, batch 1", 100, 1, 0.05),
        ):
            result = overhead(blocks, batch, 512, rounds)
            verdict = "ok" if result["guard"] <= target else "OVER TARGET"
            print(
                f"{name}: bare {result['bare_us']:.0f} us/forward; "
                f"guard {result['guard']:+.1%} (target {target:.0%}, {verdict}); "
                f"bare again {result['control']:+.1%}; "
                f"empty hook on every module {result['hook_every_module']:+.1%}"
            )


if __name__ == "__main__":
    main()
