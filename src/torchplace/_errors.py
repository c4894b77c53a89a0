"""torchplace's exceptions: one root, one subclass per way placement goes wrong.

The tree, with when each is raised (every ``raise`` in the package, as of this release)::

    TorchplaceError (RuntimeError)   root, and raised alone for what fits no subclass: an
    │                                argument of the wrong kind or value (move's attributes= or
    │                                non_blocking=, optimizer=, DeviceLoader's iterable/prefetch/
    │                                pin_memory/non_blocking, an object that is not an
    │                                nn.Module for plan/dispatch/estimate/guard/load_into, a
    │                                skeleton factory that returns something else, load_into's
    │                                rename= that is no callable or dict of patterns), a cyclic or
    │                                absurdly deep object or model, a model that does not fit
    │                                plan()'s budgets, plan's example_input beside given
    │                                budgets, max_memory='auto' where no memory can be read, a
    │                                lazy module estimate() cannot size, an example_input its
    │                                model cannot take (or, naming it and its module, an
    │                                operator that fake tensors cannot run on it),
    │                                grads=False with step='train',
    │                                torchplace estimate's config that transformers cannot
    │                                build or lacking transformers, or that is no JSON object,
    │                                nests too deep, names no model class in architectures or
    │                                asks for too many layers, a one-shot source read by
    │                                two DeviceLoader loops, bench
    │                                --device meta, and distributed's setup() outside torchrun,
    │                                without torch.distributed, or when the process group does
    │                                not start, and its verify() without a process group; an
    │                                offloaded module called with gradients on (inference
    │                                only), load_into's execution_device= without a device_map,
    │                                state_dict() or pickling of a model with modules left on
    │                                disk (gather it with move first);
    │                                watch(): an unknown raise_on kind, an ignore= module that
    │                                is not installed, in its block, the first sync, copy or
    │                                mix that raise_on names (at the user's line), and its exit
    │                                in a thread that did not enter it (or with none open)
    ├── DeviceSpecError (ValueError)  a device spec torchplace cannot parse ("cdua", -1, 3.5), and
    │                                 the other settings that name devices or sizes: a budget or
    │                                 key of plan's max_memory, plan's strategy, a dispatch
    │                                 device map, estimate's optimizer name and step=, remap
    │                                 --to, distributed's backend= and the
    │                                 torchrun variables (LOCAL_RANK, RANK, MASTER_PORT, ...)
    ├── DeviceUnavailableError        a valid spec naming a device this machine does not have
    ├── MixedDevicesError             where(): the object's tensors live on several devices
    ├── NoTensorsError                where(): the object holds no tensor at all
    ├── PlacementError                verify() and distributed.verify(): tensors are not where
    │                                 they should be (``.stragglers`` lists them)
    ├── DeviceMismatchError           guard(): a module got an input on the wrong device;
    │                                 dispatch(): a device clash inside a dispatched part
    ├── MoveError                     move(): a copy failed, a meta tensor has no data to move, an
    │                                 object's own .to() misbehaved, an optimizer of another
    │                                 model; inside torch.compile, a module, optimizer, own-.to()
    │                                 object or container it cannot trace; DeviceLoader: a
    │                                 batch's copy failed; dispatch: a part got an input on meta
    │                                 (``.name`` names the object)
    └── CheckpointError               load()/load_into()/inspect/remap: a missing, corrupt,
                                      foreign or unsafe file, or one that does not fit the model
                                      (``.path``, ``.missing``, ``.unexpected``, ``.mismatched``)

A bare ``TorchplaceError`` is thus common: the subclasses are kept to the ways placement goes
wrong that the public contract names, and new ones are not added for bad arguments, since each
class is part of that contract (``docs/design.md``, "Errors"). Catch ``TorchplaceError`` to
catch them all.

Every message names the offending object by its path (``encoder.layers.3.norm.weight``,
``batch['images'][2]``), says what was expected and what was found, and suggests the fix. Some
errors also carry what they list as attributes, for programs that act on them; each attribute is
a keyword-only constructor argument with an empty default, so ``raise MoveError("text")`` works
everywhere and an error raised without the data simply carries none.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "CheckpointError",
    "DeviceMismatchError",
    "DeviceSpecError",
    "DeviceUnavailableError",
    "MixedDevicesError",
    "MoveError",
    "NoTensorsError",
    "PlacementError",
    "Straggler",
    "TorchplaceError",
]


class TorchplaceError(RuntimeError):
    """Root of every error torchplace raises.

    Raised as itself for what no subclass names: an argument of the wrong kind or value, a
    cyclic object, a model that does not fit ``plan``'s budgets, ``distributed.setup`` outside
    torchrun (the module docstring lists every case).

    >>> import torchplace
    >>> issubclass(torchplace.PlacementError, torchplace.TorchplaceError)
    True
    """

    # Keyword data (attribute name -> value) that pickling must carry besides the message;
    # subclasses with data override ``_data``.
    def _data(self) -> dict[str, Any]:
        return {}

    def __reduce__(self) -> str | tuple[Any, ...]:
        # BaseException pickles as cls(*args), which would drop keyword-only data: errors cross
        # processes (torch.multiprocessing, a subprocess' result), so keep it.
        data = self._data()
        if not data:
            return super().__reduce__()
        return (_rebuild, (type(self), self.args, data), self.__dict__ or None)


@dataclasses.dataclass(frozen=True)
class Straggler:
    """A tensor that is not on the expected device.

    >>> import torch
    >>> from torchplace import Straggler
    >>> Straggler("encoder.weight", "parameter", torch.device("cpu"), 64).kind
    'parameter'
    """

    name: str
    kind: str
    device: torch.device
    nbytes: int


def _rebuild(cls: type[TorchplaceError], args: tuple[Any, ...], data: dict[str, Any]) -> Any:
    return cls(*args, **data)


def _names(values: Iterable[str] | None) -> tuple[str, ...]:
    return tuple(values) if values is not None else ()


class DeviceSpecError(TorchplaceError, ValueError):
    """A device spec that is not a device at all (also a ``ValueError``); also a budget, device
    map, optimizer name or torchrun variable that cannot be read."""


class DeviceUnavailableError(TorchplaceError):
    """A well-formed device that this machine does not have."""


class MixedDevicesError(TorchplaceError):
    """An object whose tensors live on more than one device where one was expected."""


class NoTensorsError(TorchplaceError):
    """An object that holds no tensor, so it has no device to read."""


class PlacementError(TorchplaceError):
    """Tensors that are not on the device they were verified against.

    ``stragglers``: every tensor found misplaced, as ``torchplace.Straggler`` records (the
    message shows the first ten), or an empty tuple when the raiser did not pass them.

    >>> import torch, torchplace
    >>> s = torchplace.Straggler("weight", "parameter", torch.device("cpu"), 16)
    >>> err = torchplace.PlacementError("1 tensor is not on meta", stragglers=[s])
    >>> err.stragglers[0].name
    'weight'
    """

    def __init__(self, *args: object, stragglers: Iterable[Straggler] = ()) -> None:
        super().__init__(*args)
        self.stragglers: tuple[Straggler, ...] = tuple(stragglers)

    def _data(self) -> dict[str, Any]:
        return {"stragglers": self.stragglers} if self.stragglers else {}


class DeviceMismatchError(TorchplaceError):
    """A module received an input on a device other than its own."""


class MoveError(TorchplaceError):
    """A move that could not be done; nothing was left half-moved.

    ``name``: the path of the tensor or object that could not be moved
    (``encoder.weight``, ``batch['images'][2]``), or ``None`` when the raiser did not say.

    >>> import torchplace
    >>> torchplace.MoveError("weight is on meta", name="weight").name
    'weight'
    >>> torchplace.MoveError("could not move").name is None
    True
    """

    def __init__(self, *args: object, name: str | None = None) -> None:
        super().__init__(*args)
        self.name: str | None = name

    def _data(self) -> dict[str, Any]:
        return {"name": self.name} if self.name is not None else {}


class CheckpointError(TorchplaceError):
    """A checkpoint that cannot be read or does not fit the model.

    ``path``: the file (or directory, or shard index) concerned, or ``None``.
    For a load that does not fit, the keys by name, each an empty tuple when none (or when the
    raiser did not pass them): ``missing`` (the model's keys the file lacks), ``unexpected``
    (the file's keys the model does not take) and ``mismatched`` (keys in both whose shapes or
    types differ).

    >>> import torchplace
    >>> err = torchplace.CheckpointError("does not fit", path="m.pt", missing=["bias"])
    >>> err.path.name, err.missing, err.unexpected, err.mismatched
    ('m.pt', ('bias',), (), ())
    """

    def __init__(
        self,
        *args: object,
        path: str | os.PathLike[str] | None = None,
        missing: Iterable[str] | None = None,
        unexpected: Iterable[str] | None = None,
        mismatched: Iterable[str] | None = None,
    ) -> None:
        super().__init__(*args)
        self.path: Path | None = Path(path) if path is not None else None
        self.missing: tuple[str, ...] = _names(missing)
        self.unexpected: tuple[str, ...] = _names(unexpected)
        self.mismatched: tuple[str, ...] = _names(mismatched)

    def _data(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "missing": self.missing,
            "unexpected": self.unexpected,
            "mismatched": self.mismatched,
        }
        if self.path is not None:
            data["path"] = self.path
        return {k: v for k, v in data.items() if v}


def check_flags(call: str, /, *, optional: tuple[str, ...] = (), **flags: object) -> None:
    """``DeviceSpecError`` naming the first of ``flags`` that is not ``True`` or ``False`` (or
    ``None``, for those named in ``optional``): a string such as ``"no"`` is true in Python, so
    it would turn an option on without a word. What equals one of them (``0``, ``1``, NumPy's
    booleans), as torch's own options take, passes.

    >>> check_flags("load()", strict="no")
    Traceback (most recent call last):
    ...
    torchplace.DeviceSpecError: load(): strict='no' is not True or False; pass strict=False ...
    """
    for name, value in flags.items():
        if isinstance(value, bool) or (value is None and name in optional):
            continue
        if not isinstance(value, (str, bytes)) and _is_flag(value):
            continue
        allowed = "True, False or None" if name in optional else "True or False"
        raise DeviceSpecError(
            f"{call}: {name}={value!r} is not {allowed}; pass {name}=False or {name}=True"
        )


def _is_flag(value: object) -> bool:
    """Whether ``value`` equals ``True`` or ``False`` as one plain truth (``0``, ``1``,
    ``numpy.bool_``), without raising."""
    try:
        return any(bool(value == flag) for flag in (True, False))
    except Exception:  # an object whose == raises, or gives no single truth
        return False


# The public entry points, whose names lead their errors' messages ("dispatch(): "), as
# ``prefixed`` puts them there; another name leading a message ("state_dict(): ") is the
# message's own, and stays.
_ENTRY_POINTS = (
    "available|device|devices_of|dispatch|estimate|guard|inspect|load|load_into|move|plan|"
    "remap|report|skeleton|stragglers|verify|watch|where"
)
_ENTRY_POINT = re.compile(rf"^(?:(?:{_ENTRY_POINTS})\(\): )+")


def prefixed(err: TorchplaceError, prefix: str) -> TorchplaceError:
    """``err`` again, its message led by ``prefix`` (an entry point's name), with its data
    (``missing``, ``path``, ``stragglers``, ...) kept: the wrapper's re-raise of its errors.
    One prefix, the outermost entry point's: the user called ``load_into``, so an error of the
    ``dispatch`` it calls reads ``load_into(): ...``, not ``load_into(): dispatch(): ...``.

    >>> str(prefixed(TorchplaceError("dispatch(): bad map"), "load_into()"))
    'load_into(): bad map'
    """
    text = _ENTRY_POINT.sub("", str(err), count=1)
    return type(err)(f"{prefix}: {text}", **err._data())


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none), for quoting
    PyTorch's errors inside torchplace's own; the whole error stays chained as the cause."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def user_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel``, for a warning issued by the caller of this function,
    that points at the first frame outside torchplace: the user's line, however many of
    torchplace's own calls lie between (a public function that hands over to another, a split
    into steps) - so no warning needs its depth counted by hand."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] == (
        "torchplace"
    ):
        frame = frame.f_back
        level += 1
    return level
