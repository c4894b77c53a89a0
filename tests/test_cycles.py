"""torchplace frees what it used as soon as a call returns: no reference cycles left behind.

A recursive helper defined inside a function refers to itself through its closure; left as it
is, it keeps everything the call gathered (a batch's rebuilt containers, every tensor a report
listed, a model walk) alive until Python's cycle collector happens to run. On a GPU that is
memory the user freed and still cannot use. Each public call here must leave no garbage for the
collector: its temporaries die by reference counting alone.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchplace


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The collector off, so that only what a call leaves behind is there to find."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def garbage_after(call: Callable[[], Any]) -> list[str]:
    """What the collector finds after ``call``: its functions by name, else a count."""
    gc.collect()
    call()
    gc.set_debug(gc.DEBUG_SAVEALL)  # keep what it finds, to name it
    try:
        found = gc.collect()
        names = [
            f"{o.__qualname__} ({o.__code__.co_filename}:{o.__code__.co_firstlineno})"
            for o in gc.garbage
            if type(o).__name__ == "function"
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.collect()  # and now free it for good
    return names or ([f"{found} objects"] if found else [])


def calls(tmp_path: Path) -> dict[str, Callable[[], Any]]:
    model = Pair()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    batch = {"x": [torch.zeros(2) for _ in range(5)], "pairs": [(torch.ones(1), 3)]}
    found = {
        "move a batch to meta": lambda: torchplace.move(batch, "meta"),
        "move a batch where it is": lambda: torchplace.move(batch, "cpu"),
        "move a model with its optimizer": lambda: torchplace.move(model, "cpu", optimizer=opt),
        "move a model to meta": lambda: torchplace.move(Pair(), "meta"),
        "verify": lambda: torchplace.verify(model, "cpu", optimizer=opt),
        "verify an optimizer": lambda: torchplace.verify(opt, "cpu"),
        "report an optimizer": lambda: str(torchplace.report(opt)),
        "where": lambda: torchplace.where(model),
        "report": lambda: str(torchplace.report(model, optimizer=opt)),
        "stragglers": lambda: torchplace.stragglers(batch, "cpu"),
        "devices_of": lambda: torchplace.devices_of(batch),
        "load": lambda: torchplace.load(tmp_path / "model.pt"),
        "load_into": lambda: torchplace.load_into(model, tmp_path / "model.pt"),
        "skeleton + load_into": lambda: torchplace.load_into(
            torchplace.skeleton(Pair), tmp_path / "model.pt"
        ),
        "estimate": lambda: torchplace.estimate(model),
        "plan": lambda: torchplace.plan(Pair(), {"cpu": "1MB"}),
        "DeviceLoader": lambda: list(torchplace.DeviceLoader([batch] * 3, "cpu")),
    }
    try:
        from safetensors.torch import save_file
    except ImportError:
        return found
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    found["load_into safetensors"] = lambda: torchplace.load_into(
        model, tmp_path / "model.safetensors"
    )
    return found


@pytest.mark.slow
def test_public_calls_leave_no_reference_cycles(tmp_path: Path, no_collector: None) -> None:
    everything = calls(tmp_path)
    for call in everything.values():  # first calls may fill torch's own caches
        call()
        call()
    left = {name: found for name, call in everything.items() if (found := garbage_after(call))}
    assert left == {}, f"reference cycles left for the collector: {left}"


def test_a_batch_moved_and_inspected_is_freed_by_reference_counting(no_collector: None) -> None:
    batch = {"x": [torch.zeros(1000)], "y": ({"z": torch.ones(3)},)}
    moved = torchplace.move(batch, "meta")
    torchplace.verify(batch, "cpu")
    str(torchplace.report(batch))
    alive = weakref.ref(batch["x"][0]), weakref.ref(moved["y"][0]["z"])
    del batch, moved
    assert [ref() for ref in alive] == [None, None]


def test_a_failed_walk_leaves_no_cycle_of_its_own(no_collector: None) -> None:
    def fail() -> None:
        looped: list[Any] = [torch.zeros(1)]
        looped.append(looped)
        try:
            with pytest.raises(torchplace.TorchplaceError, match="cycle"):
                torchplace.move(looped, "meta")
        finally:
            looped.pop()  # the caller's own cycle, broken: what remains would be torchplace's

    fail()
    assert garbage_after(fail) == []
