"""torchplace's exceptions: one root, one subclass per way placement goes wrong.

The tree, with when each is raised::

    TorchplaceError (RuntimeError)   root; also raised alone for cyclic or absurdly deep objects
    ├── DeviceSpecError (ValueError)  a device spec torchplace cannot parse ("cdua", -1, 3.5)
    ├── DeviceUnavailableError        a valid spec naming a device this machine does not have
    ├── MixedDevicesError             where(): the object's tensors live on several devices
    ├── NoTensorsError                where(): the object holds no tensor at all
    ├── PlacementError                verify(): tensors are not where they should be
    ├── DeviceMismatchError           guard(): a module got an input on the wrong device
    ├── MoveError                     move(): a copy failed, or a meta tensor has no data to move
    └── CheckpointError               load()/load_into(): a missing, corrupt, foreign or unsafe file

Every message names the offending object by its path (``encoder.layers.3.norm.weight``,
``batch['images'][2]``), says what was expected and what was found, and suggests the fix.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "DeviceMismatchError",
    "DeviceSpecError",
    "DeviceUnavailableError",
    "MixedDevicesError",
    "MoveError",
    "NoTensorsError",
    "PlacementError",
    "TorchplaceError",
]


class TorchplaceError(RuntimeError):
    """Root of every error torchplace raises."""


class DeviceSpecError(TorchplaceError, ValueError):
    """A device spec that is not a device at all (also a ``ValueError``)."""


class DeviceUnavailableError(TorchplaceError):
    """A well-formed device that this machine does not have."""


class MixedDevicesError(TorchplaceError):
    """An object whose tensors live on more than one device where one was expected."""


class NoTensorsError(TorchplaceError):
    """An object that holds no tensor, so it has no device to read."""


class PlacementError(TorchplaceError):
    """Tensors that are not on the device they were verified against."""


class DeviceMismatchError(TorchplaceError):
    """A module received an input on a device other than its own."""


class MoveError(TorchplaceError):
    """A move that could not be done; nothing was left half-moved."""


class CheckpointError(TorchplaceError):
    """A checkpoint that cannot be read or does not fit the model."""


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none), for quoting
    PyTorch's errors inside torchplace's own; the whole error stays chained as the cause."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
