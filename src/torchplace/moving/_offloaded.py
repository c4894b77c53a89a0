"""Modules whose weights live away from where they run: what ``dispatch`` and ``load_into``
leave on an offloaded module, and how ``move`` brings such weights back.

``dispatch`` runs a module mapped to ``"cpu"`` or ``"disk"`` on an execution device, its weights
copied there just before its forward (``spreading._offload``); ``load_into(device_map=...)``
leaves a ``"disk"`` module's weights in the checkpoint they came from, its parameters on
``meta`` in the meantime. Each such module carries a ``Home`` (under ``HOME`` in its
``__dict__``): its tier, where it runs, and, for the disk tier, the ``WeightSource`` that reads
its weights. ``looking`` reads it to report a module as offloaded; ``move`` reads the disk
weights back with ``bring_home`` when it gathers the model onto one device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

__all__ = ["HOME", "Home", "WeightSource", "bring_home", "drop_homes", "homes"]

HOME = "_torchplace_home"


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


def drop_homes(model: nn.Module, /) -> None:
    """Forget every ``Home`` under ``model`` (its weights are back in the module)."""
    for _, module, _ in list(homes(model)):
        module.__dict__.pop(HOME, None)


def bring_home(model: nn.Module, /) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Read every disk-tier module's weights back into its parameters (on the CPU, as the
    parameters' new data; identity kept), and return what was replaced, for an undo.

    The module's parameter objects are kept: each ``meta`` parameter is swapped for a CPU one
    holding the file's values, in the same slot, and the slot's old object is returned so that
    a failed move can put it back.
    """
    replaced: list[tuple[nn.Module, str, nn.Parameter]] = []
    for _, module, home in list(homes(model)):
        if home.source is None:
            continue
        values = home.source.read(torch.device("cpu"))
        for name, value in values.items():
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path)
            old = owner._parameters[leaf]
            assert old is not None
            new = nn.Parameter(value, requires_grad=old.requires_grad)
            new.__dict__.update(old.__dict__)
            owner._parameters[leaf] = new
            replaced.append((owner, leaf, old))
    return replaced
