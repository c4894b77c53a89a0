"""torchplace puts every tensor of a PyTorch program in its place, and proves it.

Public names are resolved on first use (a module ``__getattr__``), so ``import torchplace``
imports no torch: the ``torchplace`` command starts at once, and ``torchplace.load`` costs the
torch import only when it is first touched.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

# The exception tree is plain Python (no torch): imported at once, so that an error raised from
# any module says torchplace.CheckpointError even before anyone asked torchplace for it.
from ._errors import (
    CheckpointError,
    DeviceMismatchError,
    DeviceSpecError,
    DeviceUnavailableError,
    MixedDevicesError,
    MoveError,
    NoTensorsError,
    PlacementError,
    Straggler,
    TorchplaceError,
)

if _TYPE_CHECKING:  # what type checkers and editors see; nothing more is imported at run time
    from . import distributed as distributed
    from ._devices import available, device
    from .checkpoint._checkpoint import load, skeleton
    from .checkpoint._save import Saving, save
    from .looking._estimate import Estimate, estimate
    from .looking._guard import Guard, guard
    from .looking._inspect import devices_of, stragglers, verify, where
    from .looking._report import Report, report
    from .looking._watch import watch
    from .moving._loader import DeviceLoader
    from .moving._move import move
    from .spreading._dispatch import dispatch
    from .spreading._load_by_map import load_into
    from .spreading._plan import plan

__version__ = "0.1.0.dev0"

__all__ = [
    "CheckpointError",
    "DeviceLoader",
    "DeviceMismatchError",
    "DeviceSpecError",
    "DeviceUnavailableError",
    "Estimate",
    "Guard",
    "MixedDevicesError",
    "MoveError",
    "NoTensorsError",
    "PlacementError",
    "Report",
    "Saving",
    "Straggler",
    "TorchplaceError",
    "available",
    "device",
    "devices_of",
    "dispatch",
    "estimate",
    "guard",
    "load",
    "load_into",
    "move",
    "plan",
    "report",
    "save",
    "skeleton",
    "stragglers",
    "verify",
    "watch",
    "where",
]

# Where each public name lives. A test checks this table against the TYPE_CHECKING imports.
_HOMES = {
    "DeviceLoader": "moving._loader",
    "Estimate": "looking._estimate",
    "estimate": "looking._estimate",
    "Guard": "looking._guard",
    "guard": "looking._guard",
    "Report": "looking._report",
    "report": "looking._report",
    "devices_of": "looking._inspect",
    "stragglers": "looking._inspect",
    "verify": "looking._inspect",
    "where": "looking._inspect",
    "watch": "looking._watch",
    "available": "_devices",
    "device": "_devices",
    "dispatch": "spreading._dispatch",
    "load": "checkpoint._checkpoint",
    "load_into": "spreading._load_by_map",
    "skeleton": "checkpoint._checkpoint",
    "save": "checkpoint._save",
    "Saving": "checkpoint._save",
    "move": "moving._move",
    "plan": "spreading._plan",
}


def _claim(module: str, names: list[str]) -> None:
    """Bind ``names`` from ``torchplace.<module>`` here, saying they are torchplace's (tracebacks
    and reprs show ``torchplace.load``), so that later look-ups skip ``__getattr__``."""
    source = _importlib.import_module(f"torchplace.{module}")
    for name in names:
        obj = getattr(source, name)
        if getattr(obj, "__module__", "").startswith("torchplace."):
            obj.__module__ = "torchplace"
        globals()[name] = obj


_claim("_errors", [n for n in __all__ if n not in _HOMES])


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is not None:  # every public name of that module at once, so they agree
        _claim(home, [n for n, m in _HOMES.items() if m == home])
        return globals()[name]
    if name in _SUBPACKAGES:  # distributed imports torch.distributed: only when first used
        return _importlib.import_module(f"torchplace.{name}")
    message = f"module 'torchplace' has no attribute {name!r}"
    if not name.startswith("_"):  # not for the probes of tools (__wrapped__, _fields, ...)
        from ._suggest import did_you_mean

        hint = did_you_mean(name, [n for n in __dir__() if not n.startswith("_")])
        message += f"; {hint.rstrip()}" if hint else ""
    # name= says the name, and tells Python the message already suggests what it would
    raise AttributeError(message, name=name)


# The subpackages, each a step of a tensor's journey (docs/design.md, "Module map"): listed by
# dir() whether or not imported yet.
_SUBPACKAGES = ("checkpoint", "cli", "distributed", "looking", "moving", "spreading")


def __dir__() -> list[str]:
    """The public names, ``__version__`` and the subpackages; none of the private modules and
    helpers that importing binds here (``_errors``, ``annotations``, ``importlib``)."""
    return sorted({*__all__, "__version__", *_SUBPACKAGES})
