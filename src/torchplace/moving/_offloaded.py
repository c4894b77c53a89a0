"""Modules whose weights live away from where they run: what ``dispatch`` and ``load_into``
leave on an offloaded module, and how ``move`` brings such weights back.

``dispatch`` runs a module mapped to ``"cpu"`` or ``"disk"`` on an execution device, its weights
copied there just before its forward (``spreading._offload``); ``load_into(device_map=...)``
leaves a ``"disk"`` module's weights in the checkpoint they came from, its parameters on
``meta`` in the meantime. Each such module carries a ``Home`` (under ``HOME`` in its
``__dict__``): its tier, where it runs, and, for the disk tier, the ``WeightSource`` that reads
its weights. ``looking`` reads it to report a module as offloaded; ``move`` reads the disk
weights back with ``gather_homes`` when it gathers the model onto one device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import nn

from .._devices import free_memory, host_available
from .._errors import MoveError
from .._sizes import format_bytes
from ._identity import DISK_UNIT, UndoLog, record_replacement

__all__ = [
    "DEFAULT_WINDOW",
    "DISK_UNIT",
    "HOME",
    "Home",
    "WeightSource",
    "disk_placeholders",
    "drop_homes",
    "gather_homes",
    "homes",
    "mark_disk_placeholder",
    "outside_units",
]

HOME = "_torchplace_home"
DEFAULT_WINDOW = 2  # units resident on the execution device at once: the running one + 1 ahead


class WeightSource(Protocol):
    """Where a disk-tier module's weights are read from (a checkpoint's byte ranges)."""

    where: str  # the file, for messages and reports
    nbytes: int  # the bytes one read brings, in the model's dtypes

    def read(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The module's parameters by their names inside it, read onto ``device``."""
        ...

    def only(self, prefix: str) -> WeightSource:
        """The same source limited to the names under ``prefix`` (names kept as they are)."""
        ...


@dataclasses.dataclass
class Home:
    """Where an offloaded module's weights live between its calls, and where it runs."""

    tier: str  # "cpu" (host memory, pinned when the execution device is CUDA) or "disk"
    execution: torch.device
    source: WeightSource | None = None  # the disk tier's reader


def homes(model: nn.Module, /) -> Iterator[tuple[str, nn.Module, Home]]:
    """Every offloaded module of ``model`` with its path and ``Home``, in registration order."""
    for path, module in model.named_modules(remove_duplicate=True):
        home = module.__dict__.get(HOME)
        if isinstance(home, Home):
            yield path, module, home


def disk_placeholders(model: nn.Module, /) -> dict[int, torch.Tensor]:
    """The ``meta`` parameters that stand in for disk-tier weights (read from the checkpoint
    while their module runs), by id: those of ``model``'s disk modules, and those of a disk
    module ``model`` lies inside (``outside_units``)."""
    found = _own_placeholders(model)
    for p in model.parameters():
        if p.is_meta and DISK_UNIT in p.__dict__:
            found.setdefault(id(p), p)
    return found


def _own_placeholders(model: nn.Module) -> dict[int, torch.Tensor]:
    """The placeholders of ``model``'s own disk modules (their ``Home`` within it), by id."""
    return {
        id(p): p
        for _, module, home in homes(model)
        if home.tier == "disk"
        for p in module.parameters()
        if p.is_meta
    }


def mark_disk_placeholder(p: torch.Tensor, unit: str, /) -> None:
    """Mark ``p`` as a placeholder of the disk module at ``unit`` (its path in the model it
    was loaded into): a module inside that one, looked at alone, knows where its weights are."""
    p.__dict__[DISK_UNIT] = unit


def outside_units(model: nn.Module, /) -> list[str]:
    """The disk modules that ``model`` lies inside (their paths in the model they were loaded
    into): they hold some of its weights' placeholders, and read those weights when they run,
    not when ``model`` runs alone."""
    own = _own_placeholders(model)
    units = (
        p.__dict__.get(DISK_UNIT) for p in model.parameters() if p.is_meta and id(p) not in own
    )
    return list(dict.fromkeys(u for u in units if isinstance(u, str)))


def drop_homes(model: nn.Module, /) -> None:
    """Forget every ``Home`` under ``model`` (its weights are back in the module)."""
    for _, module, _ in list(homes(model)):
        module.__dict__.pop(HOME, None)


def gather_homes(model: nn.Module, target: torch.device, log: UndoLog, /) -> None:
    """``move``'s first step for a model with offloaded modules: refuse when the whole model
    does not fit on ``target`` (saying how much is missing), then read every disk-tier
    module's weights back into its parameter slots (on the CPU; the move takes them on), each
    swap recorded in ``log`` so that a failed move puts the ``meta`` parameters back. The
    ``Home`` marks go with the hooks, when the move has gathered the model."""
    offloaded = list(homes(model))
    if not offloaded:
        return
    _check_fits(model, target)
    read: list[str] = []  # the modules whose source was read: it covers their submodules
    for path, module, home in offloaded:
        if home.source is None or any(_within(path, top) for top in read):
            continue  # a layer of a container on disk: its weights came with the container's
        read.append(path)
        values = home.source.read(torch.device("cpu"))
        for name, value in values.items():
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path)
            old = owner._parameters[leaf]
            assert old is not None
            if not value.untyped_storage().resizable():  # a view of a mapped file: copied,
                value = value.clone()  # so that the gathered model no longer hangs on the file
            new = nn.Parameter(value, requires_grad=old.requires_grad)
            log.apply(_put(owner, leaf, new), _put(owner, leaf, old))
            log.apply(*record_replacement(old, new))  # an optimizer holding it is re-bound


def _within(path: str, top: str) -> bool:
    return not top or path == top or path.startswith(top + ".")


def _put(owner: nn.Module, leaf: str, p: nn.Parameter) -> Callable[[], None]:
    def put() -> None:
        owner._parameters[leaf] = p

    return put


def _check_fits(model: nn.Module, target: torch.device) -> None:
    """``MoveError`` when the bytes not on ``target`` yet exceed what is free there."""
    disk = {id(p) for _, m, h in homes(model) if h.source is not None for p in m.parameters()}
    needed = 0
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen or (t.device == target and id(t) not in disk):
            continue
        seen.add(id(t))
        needed += t.numel() * t.element_size()
    free = host_available() if target.type == "cpu" else free_memory(target)
    if free is not None and needed > free:
        raise MoveError(
            f"{type(model).__name__} does not fit on {target}: gathering it there needs "
            f"{format_bytes(needed)} more and {format_bytes(free)} is free, so "
            f"{format_bytes(needed - free)} is missing; keep it dispatched (its offloaded "
            "modules run from host memory or disk), or free memory on the target first"
        )
