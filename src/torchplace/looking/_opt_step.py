"""The optimizer step's own temporaries, told apart from the state it keeps.

torch's MemTracker books every tensor made inside ``optimizer.step()`` as optimizer state; but
the step also makes short-lived tensors (Adam's ``exp_avg_sq.sqrt() + eps`` and the like),
gone when it returns. Which is which is known only then: what the optimizer's ``state`` holds
after the step is state, the rest was a temporary. So each tensor the step makes is noted with
the operator that made it and the one after which it was freed, each device's peak inside the
step with its operator, and when the step is over, what was alive at each such peak and is not
state is moved from ``optimizer_state`` to ``temporaries`` (in the peak, and in the most each
kind held at once).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["OptimizerStepBook"]


@dataclasses.dataclass
class _Made:
    device: torch.device
    nbytes: int
    made: int  # the operator that made it
    freed: int | None = None  # the first operator it was not alive after


class OptimizerStepBook:
    """What one optimizer step made, and when (see the module docstring)."""

    def __init__(self) -> None:
        self.op = 0
        self.made: dict[int, tuple[Any, _Made]] = {}  # id(winfo) -> (winfo, its record)
        self.peaks: dict[torch.device, int] = {}  # device -> the operator of its peak
        # device -> the temporaries it held as the step began, and the most state it had held
        self.before: dict[torch.device, tuple[int, int]] = {}
        self.started = False

    def start(self, current: dict[torch.device, dict[Any, int]], most: dict[Any, Any]) -> None:
        from torch.distributed._tools.mem_tracker import _MemRefType

        self.started = True
        self.made.clear()  # a step before this one (the first of a steady one) is settled
        self.peaks.clear()
        opt, temp = _MemRefType.OPT, _MemRefType.TEMP
        for dev in {*current, *most}:
            held = current.get(dev, {}).get(temp, 0)
            self.before[dev] = (held, most.get(dev, {}).get(opt, 0))

    def note_made(self, winfo: Any) -> None:
        if winfo is not None and id(winfo) not in self.made:
            made = _Made(winfo.device, int(winfo.mem_consumed), self.op)
            self.made[id(winfo)] = (winfo, made)

    def note_freed(self, winfo: Any) -> None:
        entry = self.made.get(id(winfo))
        if entry is not None and entry[1].freed is None:
            entry[1].freed = self.op

    def alive(self, made: _Made, op: int) -> bool:
        return made.made <= op and (made.freed is None or made.freed > op)

    def temporaries(self, kept: set[int]) -> list[tuple[Any, _Made]]:
        """What the step made that its optimizer does not keep."""
        return [(w, m) for key, (w, m) in self.made.items() if key not in kept]

    def at_peak(self, temps: list[tuple[Any, _Made]], dev: torch.device) -> int:
        """The bytes of ``temps`` alive at ``dev``'s peak inside the step (0: none there)."""
        op = self.peaks.get(dev)
        if op is None:
            return 0
        return sum(m.nbytes for _, m in temps if m.device == dev and self.alive(m, op))

    def most_at_once(self, temps: list[tuple[Any, _Made]], dev: torch.device) -> int:
        """The most bytes of ``temps`` on ``dev`` alive at once."""
        changes: list[tuple[int, int]] = []
        for _, m in temps:
            if m.device == dev:
                changes.append((m.made, m.nbytes))
                if m.freed is not None:
                    changes.append((m.freed, -m.nbytes))
        held = most = 0
        for _, change in sorted(changes):  # frees sort before makes at one operator
            held += change
            most = max(most, held)
        return most
