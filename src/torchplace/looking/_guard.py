"""guard(): stop an input on the wrong device at the module that receives it.

Without a guard, a tensor on the wrong device surfaces deep inside an operator as "Expected all
tensors to be on the same device", with no word about which module or which argument. A guard
checks each module's inputs as its ``forward`` receives them and raises ``DeviceMismatchError``
naming the module's path and class, the input's position or key, both devices and the fix.

Which modules are checked, decided once at install:

* a module that directly holds parameters or buffers: every tensor input (positional, keyword,
  nested in lists, tuples, dicts and dataclasses) must be on one of the devices of those tensors
  (several when the module itself is spread over devices);
* a module that holds no tensor and has no children, whose ``forward`` takes two or more
  arguments (a loss, an attention kernel, an ``Add``): its tensor inputs must share one device;
* any other module (containers, one-argument activations) is left alone: it costs nothing, and
  whatever it passes on is checked where it is used.

A zero-dimensional CPU tensor is accepted anywhere, as PyTorch treats it as a scalar. The hot path
reads the device of one of the module's own tensors on every call (so a model moved after the
guard was installed is judged where it is now) and compares it with each input's; only when they
differ does the guard look at all of the module's tensors, so a mismatch is always judged against
the module's current devices.

How: a forward pre-hook would do, but PyTorch runs any module that has a hook through a slow path
that costs more than the check itself (3 to 4% of a 48-layer MLP's forward on a CPU). So the
guard wraps ``forward`` on the class of each checked module instead: the wrapper looks the module
up in a table of guarded modules (instances not in it pass straight through) and runs after any
forward pre-hooks, so it sees inputs that a pre-hook has moved. A class is restored when no
guarded instance of it is left. A module with a ``forward`` of its own instance (as Accelerate
and ``dispatch`` set) gets a forward pre-hook instead, which runs after the pre-hooks registered
before it; ``dispatch`` prepends its input-moving hooks, so they run first even when the model
is dispatched again under a guard. Copies and pickles of a guarded model are not guarded.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils.hooks import RemovableHandle

from .._errors import DeviceMismatchError, TorchplaceError
from .._model_walk import unwrapped
from .._tree import read_attribute

__all__ = ["Guard", "guard"]

# How deep the guard looks into nested inputs; deeper levels (or a cycle) are not checked.
_MAX_DEPTH = 32

# Parameter-free modules whose inputs are meant to live on different devices: CTCLoss takes its
# length tensors on the CPU next to CUDA log-probabilities.
_MIXED_BY_DESIGN: tuple[type[nn.Module], ...] = (nn.CTCLoss,)

# Cache of "can this forward take several inputs?" per class-level forward function.
_SEVERAL: dict[Callable[..., Any], bool] = {}


def guard(model: nn.Module, /) -> Guard:
    """Check, before each module runs, that its tensor inputs are on the module's devices.

    >>> import torch, torchplace
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 2), nn.ReLU())
    >>> with torchplace.guard(model):
    ...     model(torch.ones(3, 4)).shape
    torch.Size([3, 2])
    >>> model = model.to("meta")
    >>> with torchplace.guard(model):
    ...     model(torch.ones(3, 4))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    torchplace.DeviceMismatchError: model.0 (Linear) got input[0] on cpu but its parameters ...

    The guard is installed when ``guard`` returns and stays until ``.remove()`` or the end of
    the ``with`` block, which takes it off even when the forward raised. Guards on the same
    modules share their checks, so nesting or installing twice checks each module once, and a
    mismatch names the module by its path from the outermost guarded model (``model.1`` under
    ``guard(model)``, even when ``guard(model[1])`` came first). When no guard is installed
    nothing of it is left; while one is, each checked module pays one extra Python call (see
    the module docstring for which modules are checked).

    Raises ``TorchplaceError`` when ``model`` is not an ``nn.Module``; a checked module raises
    ``DeviceMismatchError`` before its forward runs, e.g. "model.head (Linear) got input[0] on
    cpu but its parameters are on cuda:0; move the input with x = torchplace.move(x, 'cuda:0')".
    """
    return Guard(model)


class Guard:
    """Device checks installed on a model's modules; a context manager. See ``guard``.

    >>> import torchplace
    >>> from torch import nn
    >>> g = torchplace.guard(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    >>> g
    <Guard on Sequential, 1 module checked>
    >>> g.remove()
    >>> g
    <Guard on Sequential, removed>
    """

    __slots__ = ("_checks", "_model")

    def __init__(self, model: nn.Module, /) -> None:
        if not isinstance(model, nn.Module):
            raise TorchplaceError(
                f"guard() needs an nn.Module, got {_describe(model)}; "
                "pass the model (or the submodule) whose inputs should be checked"
            )
        self._model = model
        # Each check this guard uses, with the path this guard names its module by.
        self._checks: list[tuple[_Check, str]] | None = None
        self._install()

    @property
    def installed(self) -> bool:
        """Whether this guard's checks are in place."""
        return self._checks is not None

    def remove(self) -> None:
        """Take this guard off the model; harmless when already removed."""
        checks, self._checks = self._checks, None
        for check, path in checks or ():
            check.release(path)

    def __enter__(self) -> Guard:
        if self._checks is None:
            self._install()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        name = type(self._model).__name__
        if self._checks is None:
            return f"<Guard on {name}, removed>"
        count = len(self._checks)
        return f"<Guard on {name}, {count} module{'' if count == 1 else 's'} checked>"

    def _install(self) -> None:
        checks: list[tuple[_Check, str]] = []
        _, prefix = unwrapped(self._model)  # torch.compile's, Fabric's, DDP's: not named
        try:
            for name, module in self._model.named_modules():
                if prefix and f"{name}.".startswith(prefix):
                    name = f"{name}."[len(prefix) :].rstrip(".")
                path = f"model.{name}" if name else "model"
                check = _Check.install(module, path)
                if check is not None:
                    checks.append((check, path))
        except BaseException:
            for check, path in checks:
                check.release(path)
            raise
        self._checks = checks


# id(module) -> its check, for every module that some installed guard checks. A check leaves
# this table when its last guard is removed or its module is garbage collected.
_CHECKS: dict[int, _Check] = {}


class _Check:
    """The check of one module, shared by every guard installed on it.

    Each guard names the module by its path from the model that guard was given: ``model.1``
    for a guard on the whole model, ``model`` for one on ``model[1]`` itself. A mismatch is
    reported under the longest of these paths, the one from the outermost guarded model, so
    the message does not depend on which guard came first; it changes when that guard goes.
    """

    __slots__ = ("class_name", "handle", "id", "key", "label", "patched", "paths", "ref", "tensors")

    def __init__(self, path: str, module: nn.Module, owned: tuple[dict[str, Any], str] | None):
        self.class_name = type(module).__name__
        self.paths = [path]  # one per guard that uses this check, in order of installation
        self.label = ""
        self._relabel()
        # The module's own parameter (or buffer) dict and a key in it: the probe whose device
        # the hot path compares inputs with. None for a module that holds no tensor.
        self.tensors: dict[str, Any] | None = None
        self.key = ""
        if owned is not None:
            self.tensors, self.key = owned
        self.handle: RemovableHandle | None = None  # the forward pre-hook, when one is used
        self.patched: type[nn.Module] | None = None  # the class whose forward is wrapped
        self.id = id(module)
        self.ref = weakref.ref(module, self._collected)

    @classmethod
    def install(cls, module: nn.Module, path: str) -> _Check | None:
        """The check on ``module`` (shared when already there), or None when it needs none."""
        if isinstance(module, torch.jit.ScriptModule):
            return None  # TorchScript cannot call back into Python
        with _LOCK:
            return cls._install(module, path)

    @classmethod
    def _install(cls, module: nn.Module, path: str) -> _Check | None:
        check = _CHECKS.get(id(module))
        if check is not None and check.ref() is module:
            check.paths.append(path)
            check._relabel()
            return check
        owned = _probe(module)
        if owned is None and not _takes_several(module):
            return None
        check = cls(path, module, owned)
        if "forward" not in module.__dict__ and _patch(type(module)):
            check.patched = type(module)
        else:
            check.handle = module.register_forward_pre_hook(check.hook, with_kwargs=True)
        _CHECKS[id(module)] = check
        return check

    def _relabel(self) -> None:
        """Name the module as the outermost guard does: the longest path (first on ties)."""
        if self.paths:
            self.label = f"{max(self.paths, key=len)} ({self.class_name})"

    def release(self, path: str) -> None:
        """One guard fewer on this module (the one naming it ``path``); the last one takes the
        check off."""
        with _LOCK:
            if not self.paths:  # already retired, by garbage collection
                return
            self.paths.remove(path)  # equal paths are interchangeable: any one of them
            if self.paths:
                self._relabel()
            else:
                self._retire()

    def _collected(self, ref: weakref.ref[nn.Module]) -> None:
        with _LOCK:  # a garbage collection may run this in any thread
            if self.paths:
                self.paths.clear()
                self._retire()

    def _retire(self) -> None:
        if _CHECKS.get(self.id) is self:
            del _CHECKS[self.id]
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if self.patched is not None:
            _unpatch(self.patched)
            self.patched = None

    def hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Run before ``module``'s forward: pass quietly, or raise ``DeviceMismatchError``."""
        tensors = self.tensors
        if tensors is None:
            self._agree(args, kwargs)
            return
        try:
            device = tensors[self.key].device
        except (KeyError, AttributeError):  # the probe was deleted or set to None
            self._verdict(module, args, kwargs)
            return
        for arg in args:
            if isinstance(arg, Tensor):
                if arg.device != device:
                    self._verdict(module, args, kwargs)
                    return
            elif not _all_on(arg, device, 0):
                self._verdict(module, args, kwargs)
                return
        if kwargs:
            for arg in kwargs.values():
                if not _all_on(arg, device, 0):
                    self._verdict(module, args, kwargs)
                    return

    def _verdict(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The slow path: judge every input against all of the module's current tensors."""
        owned = _probe(module)
        if owned is None:  # the module no longer holds any tensor
            self.tensors = None
            self._agree(args, kwargs)
            return
        self.tensors, self.key = owned
        if getattr(module, "_hf_hook", None) is not None:
            return  # Accelerate's hook moves the inputs inside forward, after this check
        devices, holder = _own_devices(module)
        for where, tensor in _inputs(args, kwargs):
            found = tensor.device
            if found in devices or _is_scalar(tensor):
                continue
            fix = f"move the input with x = torchplace.move(x, '{devices[0]}')"
            if devices[0].type == "meta":  # more likely, the weights were never loaded
                fix += (
                    ", or give the module data with torchplace.load_into or "
                    f"Module.to_empty(device='{found}')"
                )
            raise DeviceMismatchError(
                f"{self.label} got {where} on {found} but its {holder} on {_join(devices)}; {fix}"
            )

    def _agree(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A module without tensors of its own: its tensor inputs must share one device."""
        if args and isinstance(args[0], Tensor):  # the usual case, (a, b, ...), without a walk
            device = args[0].device
            for arg in args:
                if not _all_on(arg, device, 0):
                    break
            else:
                if not kwargs or _all_on(kwargs, device, 0):
                    return
        first: tuple[str, torch.device] | None = None
        for where, tensor in _inputs(args, kwargs):
            if _is_scalar(tensor):
                continue
            if first is None:
                first = (where, tensor.device)
            elif tensor.device != first[1]:
                raise DeviceMismatchError(
                    f"{self.label} got {where} on {tensor.device} but {first[0]} is on "
                    f"{first[1]}, and a module's inputs must share one device; "
                    f"move the input with x = torchplace.move(x, '{first[1]}')"
                )


class _Patch:
    """A class whose ``forward`` the guard wrapped: the wrapper, what it replaced, its users."""

    __slots__ = ("own", "users", "wrapper")

    def __init__(self, wrapper: Callable[..., Any], own: Callable[..., Any] | None) -> None:
        self.wrapper = wrapper
        self.own = own  # the class's own forward, or None when it inherited one
        self.users = 0


_PATCHES: dict[type[nn.Module], _Patch] = {}

# Installing and removing checks and class wrappers read then write the tables above and the
# classes themselves: one lock makes each step whole when several threads guard models at once.
_LOCK = threading.RLock()


def _patch(cls: type[nn.Module]) -> bool:
    """Wrap ``cls.forward`` (once per class); False when it cannot be wrapped."""
    patch = _PATCHES.get(cls)
    if patch is None:
        original = inspect.getattr_static(cls, "forward", None)
        if not inspect.isfunction(original):
            return False  # a staticmethod, a partial, a C function: use a hook
        own = cls.__dict__.get("forward")

        def forward(self: nn.Module, /, *args: Any, **kwargs: Any) -> Any:
            if type(self) is cls:  # not a subclass reaching this through super()
                check = _CHECKS.get(id(self))
                if check is not None:
                    check.hook(self, args, kwargs)
            return original(self, *args, **kwargs)

        functools.update_wrapper(forward, original)  # inspect.signature still tells the truth
        try:
            cls.forward = forward
        except (TypeError, AttributeError):
            return False
        patch = _PATCHES[cls] = _Patch(forward, own)
    patch.users += 1
    return True


def _unpatch(cls: type[nn.Module]) -> None:
    patch = _PATCHES.get(cls)
    if patch is None:
        return
    patch.users -= 1
    if patch.users:
        return
    del _PATCHES[cls]
    if cls.__dict__.get("forward") is not patch.wrapper:
        return  # someone replaced it after us: theirs stays (ours, if they call it, passes)
    if patch.own is None:
        delattr(cls, "forward")
    else:
        cls.forward = patch.own


def _probe(module: nn.Module) -> tuple[dict[str, Any], str] | None:
    """The dict and key of the module's first own parameter (else buffer), or None."""
    for tensors in (module._parameters, module._buffers):
        for key, tensor in tensors.items():
            if tensor is not None:
                return tensors, key
    return None


def _own_devices(module: nn.Module) -> tuple[list[torch.device], str]:
    """The devices of the module's own tensors in order of first use, and what holds them."""
    devices: list[torch.device] = []
    for tensors in (module._parameters, module._buffers):
        for tensor in tensors.values():
            if tensor is not None and tensor.device not in devices:
                devices.append(tensor.device)
    if any(t is not None for t in module._parameters.values()):
        return devices, "parameters are"
    if sum(t is not None for t in module._buffers.values()) == 1:
        return devices, "buffer is"
    return devices, "buffers are"


def _takes_several(module: nn.Module) -> bool:
    """Whether a module without tensors of its own is worth checking for inputs that disagree."""
    if isinstance(module, _MIXED_BY_DESIGN) or next(module.children(), None) is not None:
        return False
    shared = "forward" not in module.__dict__
    function = getattr(type(module), "forward", None) if shared else None
    if function is not None and function in _SEVERAL:
        return _SEVERAL[function]
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        several = True
    else:
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        several = len(parameters) >= 2 or any(p.kind in variadic for p in parameters)
    if function is not None:
        _SEVERAL[function] = several
    return several


def _all_on(obj: object, device: torch.device, depth: int) -> bool:
    """The hot path: whether every tensor inside ``obj`` is on ``device``."""
    if isinstance(obj, Tensor):
        return obj.device == device
    if obj is None or depth > _MAX_DEPTH or isinstance(obj, (str, bytes, int, float)):
        return True
    if isinstance(obj, PackedSequence):
        return _all_on((obj.data, obj.sorted_indices, obj.unsorted_indices), device, depth)
    if isinstance(obj, (list, tuple)):
        return all(_all_on(item, device, depth + 1) for item in obj)
    if isinstance(obj, Mapping):
        return all(_all_on(item, device, depth + 1) for item in obj.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return all(
            _all_on(read_attribute(obj, field.name), device, depth + 1)
            for field in dataclasses.fields(obj)
        )
    return True


def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[str, Tensor]]:
    """Every tensor among a call's inputs with its place: input[0], input['mask'], input[1][2]."""
    for index, arg in enumerate(args):
        yield from _tensors(arg, f"input[{index}]", 0)
    for key, arg in kwargs.items():
        yield from _tensors(arg, f"input[{key!r}]", 0)


def _tensors(obj: object, where: str, depth: int) -> Iterator[tuple[str, Tensor]]:
    if isinstance(obj, Tensor):
        yield where, obj
    elif obj is None or depth > _MAX_DEPTH or isinstance(obj, (str, bytes, int, float)):
        return
    elif isinstance(obj, PackedSequence):  # batch_sizes stays on the CPU by design
        for name in ("data", "sorted_indices", "unsorted_indices"):
            yield from _tensors(getattr(obj, name), f"{where}.{name}", depth + 1)
    elif isinstance(obj, (list, tuple)):
        for index, item in enumerate(obj):
            yield from _tensors(item, f"{where}[{index}]", depth + 1)
    elif isinstance(obj, Mapping):
        for key, item in obj.items():
            yield from _tensors(item, f"{where}[{key!r}]", depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            value = read_attribute(obj, field.name)
            yield from _tensors(value, f"{where}.{field.name}", depth + 1)


def _is_scalar(tensor: Tensor) -> bool:
    """A zero-dimensional CPU tensor, which PyTorch accepts next to tensors on any device."""
    return tensor.ndim == 0 and tensor.device.type == "cpu"


def _join(devices: list[torch.device]) -> str:
    names = [str(d) for d in devices]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _describe(obj: object) -> str:
    text = repr(obj)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(obj).__qualname__}: {text}"
