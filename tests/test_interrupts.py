"""Ctrl-C at any point of a move leaves everything as it was, or everything moved.

A KeyboardInterrupt can arrive between any two lines of Python. These tests count the lines
torchplace runs in one move, then run the move again once per line with an interrupt raised
there, and check that the model, its gradients, buffers, self-moving modules and optimizer are
either exactly as before (the same objects, devices and values) or completely moved.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn

import torchplace

pytestmark = pytest.mark.slow  # a sweep: the move interrupted at each of its lines

PACKAGE = str(Path(torchplace.__file__).parent)


class Interrupter:
    """Counts torchplace's line events; raises KeyboardInterrupt at the ``at``-th one."""

    def __init__(self, at: int | None = None) -> None:
        self.at = at
        self.count = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(PACKAGE) or frame.f_code.co_name == "_forget":
            return None  # only torchplace's own lines, not a finalizer that gc runs meanwhile
        return self.local

    def local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.count += 1
            if self.count == self.at:
                raise KeyboardInterrupt
        return self.local


@contextmanager
def tracing(tracer: Interrupter) -> Iterator[None]:
    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(old)


class Counter(nn.Module):
    """Keeps a state outside parameters and buffers and moves it itself, as torchmetrics does."""

    def __init__(self) -> None:
        super().__init__()
        self.total = torch.zeros(3)
        self.seen = [torch.ones(1)]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        this = super()._apply(fn, recurse)
        self.total = fn(self.total)
        self.seen = [fn(t) for t in self.seen]
        return this


class Net(nn.Module):
    """Small, with one of everything a move handles: a tie, an RNN's weight cache, a buffer,
    gradients, Adam state and a module that moves state of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(3, 2)
        self.rnn = nn.LSTM(2, 2, bias=False)
        self.head = nn.Linear(2, 3, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.full((2,), 0.5))
        self.counter = Counter()


_BUILT: list[tuple[Net, torch.optim.Optimizer]] = []


def build() -> tuple[Net, torch.optim.Optimizer]:
    """A trained model and its optimizer: a fresh deep copy of one built once."""
    if not _BUILT:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        out, _ = model.rnn(model.emb(torch.tensor([[1, 2]])) * model.scale)
        model.head(out).sum().backward()
        opt.step()
        _BUILT.append((model, opt))
    return copy.deepcopy(_BUILT[0])


def snapshot(model: Net, opt: torch.optim.Optimizer) -> list[Any]:
    """Everything a move may change: objects, devices and (off meta) values."""

    def look(t: torch.Tensor | None) -> Any:
        if t is None:
            return None
        values = None if t.is_meta else t.detach().clone()
        return (id(t), t.device, t.shape, values)

    found: list[Any] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        found.append((name, look(p), look(p.grad)))
    for name, b in model.named_buffers():
        found.append((name, look(b)))
    found.append(("counter", look(model.counter.total), [look(t) for t in model.counter.seen]))
    found.append(("flat", [id(w) for w in model.rnn._flat_weights]))
    for group in opt.param_groups:
        for p in group["params"]:
            found.append(("opt", id(p), {k: look(v) for k, v in opt.state[p].items()}))
    return found


def same(a: list[Any], b: list[Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            return len(x) == len(y) and all(eq(i, j) for i, j in zip(x, y, strict=True))
        if isinstance(x, dict) and isinstance(y, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        return bool(x == y)

    return eq(a, b)


def fully_moved(model: Net, opt: torch.optim.Optimizer, target: str) -> bool:
    dev = torch.device(target)
    torchplace.verify(model, dev, optimizer=opt)
    params = list(model.parameters())
    held = [p for g in opt.param_groups for p in g["params"]]
    return (
        model.head.weight is model.emb.weight
        and [id(p) for p in held] == [id(p) for p in params]
        and model.counter.total.device == dev
        and all(t.device == dev for t in model.counter.seen)
        and all(w.device == dev for w in model.rnn._flat_weights)
    )


def interrupt_everywhere(target: str, swap: bool) -> None:
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        model, opt = build()
        counter = Interrupter()
        with tracing(counter):
            torchplace.move(model, target, optimizer=opt)
        assert fully_moved(model, opt, target)
        total = counter.count
        assert total > 100  # the tracer saw the move
        outcomes = {"before": 0, "moved": 0}
        for at in range(1, total + 1):
            model, opt = build()
            before = snapshot(model, opt)
            try:
                with tracing(Interrupter(at)):
                    torchplace.move(model, target, optimizer=opt)
            except KeyboardInterrupt:
                pass
            if same(snapshot(model, opt), before):
                outcomes["before"] += 1
            else:
                assert fully_moved(model, opt, target), f"half-moved by an interrupt at line {at}"
                outcomes["moved"] += 1
        assert outcomes["before"] > 0 and outcomes["before"] + outcomes["moved"] == total
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


@pytest.mark.filterwarnings("ignore:torchplace.move to meta discarded")
@pytest.mark.parametrize("swap", [False, True], ids=["replace", "swap"])
def test_ctrl_c_at_any_line_of_a_move_leaves_all_or_nothing(swap: bool) -> None:
    interrupt_everywhere("meta", swap)
