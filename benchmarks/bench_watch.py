"""What an active ``watch`` adds to a training step's host time on the CPU, as a ratio.

Run as ``python benchmarks/bench_watch.py [--rounds N]``. Target (issue 35): active, at most 2x
the step's host time; inactive, nothing.

The step: forward, backward and ``Adam.step`` of an MLP of 8 ``Linear`` + ReLU blocks, width
512 with batch 32 and width 128 with batch 8 (small operations, where a fixed cost per call
weighs most), one thread. On the CPU, ``watch()`` with no accelerator installs nothing, and
``watch("cuda:0")`` on a machine without it is refused, so the active case watches ``cuda:0``
where there is one, else ``meta`` declared a device with a boundary (as the tests do, with
``_NO_BOUNDARY``): its function-level mode is installed and sees every
call of the step's Python API (none crosses a boundary here). Which calls it sends on to the
dispatch-level mode depends on the function called, and for a few (``item``, indexing) on
whether a watched device's tensor is among the arguments: the script prints, for the step,
how many calls are plain whatever the devices and which are not, so that what a GPU step would
pay beyond this figure can be judged (Adam's ``item`` reads a step count kept on the CPU, on a
GPU too). Each round times one bare, one watched and one bare step again (the control, the
noise floor) and one under an empty dispatch mode (for scale: what any dispatch mode costs, the
mechanism of ``watch`` before issue 35's item 4), in the thread's CPU time, and the 10th
percentile of each series is compared, as interference only ever adds time. The first watched
step in the process is timed on its own.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from torchplace.looking import _watch
from torchplace.looking._watch import watch
from torchplace.looking._watch_ops import PLAIN, plan


class EmptyMode(TorchDispatchMode):
    """For scale: a dispatch mode that only runs each operation, the least any such mode costs."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class Routes(TorchFunctionMode):
    """Counts the step's calls that ``watch`` runs plainly whatever the devices; names the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = 0
        self.other: dict[str, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if plan(func) == PLAIN:
            self.plain += 1
        else:
            name = getattr(func, "__name__", str(func))
            self.other[name] = self.other.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def step_of(layers: int, width: int, batch: int) -> Callable[[], None]:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch, width), torch.randn(batch, width)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    return step


def timed(step: Callable[[], None]) -> float:
    # the thread's CPU time: the step runs on this one thread (autograd too, on the CPU), and
    # the other processes of a shared machine do not count in it as they do in wall time
    start = time.thread_time()
    step()
    return time.thread_time() - start


def low(times: list[float]) -> float:
    """The 10th percentile: interference only adds time, so the fast end is the signal."""
    return sorted(times)[len(times) // 10]


def measure(layers: int, width: int, batch: int, rounds: int) -> dict[str, Any]:
    step = step_of(layers, width, batch)
    for _ in range(5):
        step()
    routes = Routes()
    with routes:
        step()
    if torch.cuda.is_available():
        seen = watch("cuda:0")
    else:  # meta has no boundary, so watch("meta") installs nothing unless told it has one
        _watch._NO_BOUNDARY = frozenset({"cpu"})
        seen = watch("meta")
    start = time.thread_time()
    with seen:
        step()
    first = time.thread_time() - start
    bare: list[float] = []
    watched: list[float] = []
    control: list[float] = []
    empty: list[float] = []
    for _ in range(rounds):
        bare.append(timed(step))
        with seen:
            watched.append(timed(step))
        control.append(timed(step))
        with EmptyMode():
            empty.append(timed(step))
    assert not seen.rows, seen  # nothing of a CPU step crosses a boundary
    fast = low(bare)
    return {
        "bare_us": fast * 1e6,
        "watched": low(watched) / fast,
        "control": low(control) / fast,
        "empty_mode": low(empty) / fast,
        "first_s": first,
        "plain": routes.plain,
        "other": routes.other,  # type: ignore[dict-item]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="rounds per model (default 200)")
    rounds = parser.parse_args().rounds
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, 10th percentile of {rounds} alternating rounds")
    for layers, width, batch in ((8, 512, 32), (8, 128, 8)):
        result = measure(layers, width, batch, rounds)
        verdict = "ok" if result["watched"] <= 2.0 else "OVER TARGET"
        print(
            f"{layers} x Linear({width})+ReLU, batch {batch}, Adam: "
            f"bare {result['bare_us']:.0f} us/step; watched {result['watched']:.2f}x "
            f"(target 2x, {verdict}); bare again {result['control']:.2f}x; "
            f"an empty dispatch mode {result['empty_mode']:.2f}x; "
            f"first watched step {result['first_s'] * 1e3:.0f} ms"
        )
        other = ", ".join(f"{name} x{n}" for name, n in sorted(result["other"].items()))
        print(f"  calls: {result['plain']} plain whatever the devices; by device: {other}")


if __name__ == "__main__":
    main()
