"""torchplace puts every tensor of a PyTorch program in its place, and proves it."""

from __future__ import annotations

from ._checkpoint import load, load_into, skeleton
from ._devices import available, device
from ._dispatch import dispatch
from ._errors import (
    CheckpointError,
    DeviceMismatchError,
    DeviceSpecError,
    DeviceUnavailableError,
    MixedDevicesError,
    MoveError,
    NoTensorsError,
    PlacementError,
    TorchplaceError,
)
from ._estimate import Estimate, estimate
from ._guard import Guard, guard
from ._inspect import Straggler, devices_of, stragglers, verify, where
from ._loader import DeviceLoader
from ._move import move
from ._plan import plan
from ._report import Report, report

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
    "skeleton",
    "stragglers",
    "verify",
    "where",
]

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("torchplace."):
        _obj.__module__ = "torchplace"
del _name, _obj


def __getattr__(name: str) -> object:
    # torchplace.distributed imports torch.distributed only when first used.
    if name == "distributed":
        import importlib

        return importlib.import_module("torchplace.distributed")
    raise AttributeError(f"module 'torchplace' has no attribute {name!r}")
