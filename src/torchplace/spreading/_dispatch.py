"""Running a model across several devices: ``dispatch`` places it by a device map.

``dispatch(model, device_map)`` places each submodule on its device and installs hooks that
move inputs to each submodule as it runs; the output comes back to the device of the input.

A device map names modules (``""`` is the whole model). A tensor goes to the device of the most
specific name that contains it, so ``{"": "cuda:0", "head": "cuda:1"}`` puts everything on
``cuda:0`` except ``head``. ``undispatch`` removes every hook without moving anything, and
``is_dispatched`` tells whether a model carries them: ``torchplace.move`` gathers a dispatched
model back onto one device with these two.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import torch
from torch import nn

from .._device_map import DISK, entry_of, parse_device_map, whole_model_map
from .._devices import device as _device
from .._errors import (
    DeviceMismatchError,
    DeviceSpecError,
    MoveError,
    TorchplaceError,
    first_line,
    prefixed,
)
from .._model_walk import ModelTree, display, walk_model
from .._tree import Located, iter_leaves, map_tensors
from ..moving._hooks import MARK, Installed, is_dispatched, undispatch
from ..moving._move import place
from ..moving._offloaded import DISK_UNIT, HOME, Home, homes
from ..moving._transfer import is_accelerator
from ._offload import DEFAULT_WINDOW, SHIELD, DeviceFetcher, Fetcher, Ring, Unit

__all__ = [
    "dispatch",
    "is_dispatched",
    "undispatch",
]

DeviceMapSpec = Mapping[str, str | int | torch.device]  # module name -> device


_DEVICE_ERROR = re.compile(
    r"same device|expected device|two devices|different devices|wrong device|"
    r"expected all tensors|to be on the device|is on device",
    re.IGNORECASE,
)


class _MetaInput(Exception):
    """A tensor on ``meta`` bound for a real device: it holds no data to copy. Carries the
    input's path (``kwargs['position_embeddings'][0]``)."""


def _to(obj: Any, dev: torch.device, *, keep_meta: bool = False, root: str = "input") -> Any:
    """``obj`` with every tensor on ``dev``, by the collection rules of ``move`` (objects with
    their own ``.to`` use it); containers with nothing to move come back as the same object.
    With ``keep_meta``, meta tensors stay where they are; otherwise a meta tensor bound for a
    real device raises ``_MetaInput`` with its path under ``root``. Other errors surface as they
    were raised."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.device == dev or (keep_meta and t.is_meta):
            return t
        if t.is_meta:
            raise _MetaInput
        return t.to(dev)

    try:
        # a forward's own arguments: a generator or a set passes as it is (``refuse=False``)
        return map_tensors(obj, one, to=lambda o: o.to(dev), root=root, refuse=False)
    except Located as located:
        if isinstance(located.cause, _MetaInput):
            raise _MetaInput(located.path(root)) from None
        raise located.cause from located.cause.__cause__


def _first_device(obj: Any) -> torch.device | None:
    """The device of the first tensor in nested inputs, or None when there is none.

    It walks with the tree walker of ``move`` (``iter_leaves``), so that every collection the
    hooks move an input out of (dataclasses, objects with their own ``.to``, mappings of any
    kind) also gives the output its way back. A cyclic input is not followed round its cycle:
    the model may accept what torchplace would refuse to move.
    """
    for _, leaf in iter_leaves(obj, "input", skip_cycles=True):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return None


def _resolve(path: str, entries: dict[str, torch.device]) -> torch.device | None:
    """The device of the most specific map entry that contains ``path``."""
    entry = entry_of(path, entries)
    return None if entry is None else entries[entry]


def _targets(tree: ModelTree, entries: dict[str, torch.device]) -> dict[int, torch.device]:
    """Each tensor's device under the map; errors for uncovered tensors and split ties."""
    targets: dict[int, torch.device] = {}
    uncovered: list[str] = []
    for key, owners in tree.owner_modules.items():
        devices = {path: _resolve(path, entries) for path in owners}
        found = {dev for dev in devices.values() if dev is not None}
        if len(found) > 1:
            names = tree.owners[key]
            placed = ", ".join(f"{display(p)} on {d}" for p, d in devices.items())
            raise DeviceSpecError(
                f"{display(names[0])} is tied to {', '.join(map(display, names[1:]))} but the "
                f"map splits its holders ({placed}); one tensor has one device, so map "
                f"{' and '.join(repr(p) for p in owners)} to the same device"
            )
        if None in devices.values():
            uncovered.append(tree.owners[key][0])
            continue
        (targets[key],) = found
    if uncovered:
        # named as the map's keys are (state-dict names), not display()'s "model." paths: a
        # model whose child is called "model" (transformers') showed "model.model.model.1"
        shown = ", ".join(repr(n) for n in uncovered[:5])
        more = f" and {len(uncovered) - 5} more" if len(uncovered) > 5 else ""
        first = uncovered[0].rpartition(".")[0]
        raise DeviceSpecError(
            f"the device map leaves {shown}{more} without a device; add an entry for "
            f"{first!r} or one of its parents ('' covers the whole model)"
        )
    return targets


def _place(tree: ModelTree, targets: dict[int, torch.device]) -> None:
    """Move each tensor once to its target, keeping ties and identity; all or nothing."""
    place(tree.modules[""], targets)


# The hooks are small classes rather than closures, so a dispatched model can still be
# deep-copied (each copy calling its own modules) and pickled.


class _Origins:
    """The devices of the inputs of the model's calls in progress, one stack per thread, so
    that two threads running one dispatched model each get their own output back. Copies and
    pickles start empty (a thread-local cannot be copied)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def stack(self) -> list[torch.device | None]:
        stack: list[torch.device | None] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._local = threading.local()


class _MoveInputs:
    """Forward pre-hook: every tensor input to ``device``; on the model itself it also notes
    the device of the first input, so that the output can go back there."""

    def __init__(self, device: torch.device | None, origins: _Origins | None, path: str) -> None:
        self.device = device
        self.origins = origins
        self.path = path

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Any] | None:
        if self.origins is not None:
            if args and isinstance(args[0], torch.Tensor):  # the usual call, without a walk
                self.origins.stack.append(args[0].device)
            else:
                self.origins.stack.append(_first_device((args, kwargs)))
        if self.device is None:
            return None
        try:
            return _to(args, self.device, root="args"), _to(kwargs, self.device, root="kwargs")
        except _MetaInput as meta:
            raise self._meta_error(module, str(meta), name=str(meta)) from None
        except NotImplementedError as err:  # an input's own .to() met a meta tensor
            leaves = iter_leaves((args, kwargs), "input", skip_cycles=True)
            if not any(isinstance(leaf, torch.Tensor) and leaf.is_meta for _, leaf in leaves):
                raise
            raise self._meta_error(module, "an input") from err

    def _meta_error(self, module: nn.Module, what: str, name: str | None = None) -> MoveError:
        return MoveError(
            f"{display(self.path)} ({type(module).__name__}) runs on {self.device} but got "
            f"{what} on meta, which holds no data (an earlier part of the model is on meta, or "
            "the caller passed it); map the parts before it to meta as well, or load real "
            "weights",
            name=name,
        )


class _ReturnOutput:
    """Forward hook on the model (also run when forward raises): the output goes back to the
    device of the input; outputs on ``meta`` hold no data and stay."""

    def __init__(self, origins: _Origins):
        self.origins = origins

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        stack = self.origins.stack
        origin = stack.pop() if stack else None
        if origin is None or output is None:
            return None
        return _to(output, origin, keep_meta=True)


class _StandIn:
    """Stands in for ``module.forward`` (in the module's ``__dict__``), calling what was there
    before: an instance-level forward, or the class's."""

    def __init__(self, module: nn.Module, previous: Any) -> None:
        self.module = module
        self.previous = previous  # an instance-level forward that was there before, or None
        self.__doc__ = getattr(module.forward, "__doc__", None)

    @property
    def __wrapped__(self) -> Any:
        """What this stands in for, so that ``inspect.signature(module.forward)`` still works."""
        if self.previous is not None:
            return self.previous
        return type(self.module).forward.__get__(self.module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


class _ExplainClash(_StandIn):
    """Stands in for ``module.forward``: a device clash raised inside it is explained.

    The innermost one that sees the clash explains it; the ones around it let it through.
    """

    def __init__(self, module: nn.Module, previous: Any, message: str) -> None:
        super().__init__(module, previous)
        self.message = message  # "{error}" stands for the first line of PyTorch's message

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.forward(*args, **kwargs)
        except TorchplaceError:
            raise
        except RuntimeError as err:
            if not _DEVICE_ERROR.search(str(err)):
                raise
            raise DeviceMismatchError(self.message.replace("{error}", first_line(err))) from err


def _split_message(path: str, name: str, spread: str) -> str:
    head = (
        f"{display(path)} ({name}) is split across devices ({spread}) and its own forward "
        "combined tensors from different devices ({error}). dispatch moves the inputs of each "
        "submodule as it runs, not the results a parent combines itself; "
    )
    if not path:  # keeping the model whole on one device would defeat the map
        return head + (
            "map the submodules whose results the model's forward combines (the ones it adds, "
            "concatenates or compares, rather than passes on to the next) to the same device"
        )
    return head + (
        f"keep {name} on one device with plan(model, max_memory, no_split=[{name!r}]), or map "
        f"'{path}' to a single device"
    )


def _whole_message(path: str, name: str, dev: torch.device) -> str:
    return (
        f"{display(path)} ({name}) runs on {dev}, where dispatch put its parameters and "
        "buffers and moved its inputs, yet its forward met a tensor on another device "
        "({error}). That tensor is one dispatch cannot see: a plain tensor attribute "
        "(register it with self.register_buffer(...)), or a tensor made on a fixed device "
        "inside forward (make it on the device of the input instead)"
    )


def _runs(module: nn.Module) -> bool:
    """Whether calling ``module`` runs code of its own: a container (``ModuleList``,
    ``ModuleDict``, a plain ``nn.Module`` that only holds others) has no forward, and its
    parent calls its children instead."""
    return type(module).forward is not nn.Module.forward or "forward" in module.__dict__


def _wrap(module: nn.Module, installed: Installed, message: str) -> None:
    if not _runs(module):  # never called, so nothing to explain
        return
    installed.previous_forward = module.__dict__.get("forward")
    module.__dict__["forward"] = _ExplainClash(module, installed.previous_forward, message)
    installed.wrapped_forward = True


def _spread(tree: ModelTree, path: str, targets: dict[int, torch.device]) -> str:
    parts: list[str] = []
    for child in tree.children[path]:
        devices = sorted({str(targets[k]) for k in tree.subtree(child)})
        if devices:
            parts.append(f"{child} on {' and '.join(devices)}")
    if tree.direct[path]:
        parts.insert(0, f"its own tensors on {targets[tree.direct[path][0]]}")
    shown = parts[:4] + ([f"{len(parts) - 4} more"] if len(parts) > 4 else [])
    return ", ".join(shown)


def _hook(tree: ModelTree, targets: dict[int, torch.device]) -> None:
    """Hooks where devices change: the top of each one-device subtree inside a split parent,
    each split parent that holds tensors itself, and the model (to bring the output back).

    A top that never runs (a ``ModuleList`` of layers mapped whole, as ``plan`` maps it) hands
    its hook down to its children, which its parent calls one by one: the hooks go on the
    modules that run. An ``nn.Sequential`` may be called or have its layers called one by one,
    so it keeps its hook and its children get theirs too (a call moves nothing twice).
    """
    devices_of = {path: {targets[key] for key in tree.subtree(path)} for path in tree.modules}
    done: set[int] = set()
    handed_down: set[str] = set()  # one-device tops that never run: their children are tops
    origins = _Origins()
    for path, module in tree.modules.items():
        if id(module) in done:
            continue
        done.add(id(module))
        parent = path.rpartition(".")[0] if path else None
        devices = devices_of[path]
        installed = Installed(handles=[])
        target: torch.device | None = None
        name = type(module).__name__
        top = parent is None or len(devices_of[parent]) > 1 or parent in handed_down
        if len(devices) == 1 and top and parent is not None and not _runs(module):
            handed_down.add(path)
        elif len(devices) == 1 and top:
            (target,) = devices
            _wrap(module, installed, _whole_message(path, name, target))
            if parent is not None and isinstance(module, nn.Sequential):
                handed_down.add(path)  # it runs, or its parent runs its layers one by one
        elif len(devices) > 1:
            if tree.direct[path]:
                target = targets[tree.direct[path][0]]
            _wrap(module, installed, _split_message(path, name, _spread(tree, path, targets)))
        # Prepended, so that the inputs are moved before any other pre-hook looks at them: a
        # guard installed earlier checks a module whose forward is an instance attribute (as
        # dispatch's own _ExplainClash is) with a pre-hook, which must see the moved inputs
        # even when dispatch comes after it (a re-dispatch of a guarded model).
        if parent is None:
            installed.handles.append(
                module.register_forward_pre_hook(
                    _MoveInputs(target, origins, path), with_kwargs=True, prepend=True
                )
            )
            installed.handles.append(
                module.register_forward_hook(_ReturnOutput(origins), always_call=True)
            )
        elif target is not None:
            installed.handles.append(
                module.register_forward_pre_hook(
                    _MoveInputs(target, None, path), with_kwargs=True, prepend=True
                )
            )
        if installed.handles or installed.wrapped_forward:
            module.__dict__[MARK] = installed


@dataclasses.dataclass
class _Offload:
    """How a map runs: the execution device of offloaded modules (None: each runs where it
    is), each map entry's tier when it is offloaded, and the device each entry runs on."""

    execution: torch.device | None
    tiers: dict[str, str]  # entry -> "cpu" | "disk"
    runs: dict[str, torch.device]  # entry -> the device its modules run on


def _offloading(entries: dict[str, torch.device | str], execution_device: object) -> _Offload:
    """Which entries are offloaded, and where everything runs (see ``dispatch``)."""
    if execution_device is not None:
        try:
            execution: torch.device | None = _device(execution_device)  # type: ignore[arg-type]
        except TorchplaceError as err:
            raise type(err)(f"execution_device: {err}") from None
    else:
        accelerators = [
            d for d in entries.values() if isinstance(d, torch.device) and is_accelerator(d)
        ]
        execution = accelerators[0] if accelerators else None
    host = torch.device("cpu")
    tiers: dict[str, str] = {}
    runs: dict[str, torch.device] = {}
    for name, where in entries.items():
        if where == DISK:
            tiers[name] = DISK
            runs[name] = execution or host
        elif where == host and execution is not None and execution != host:
            tiers[name] = "cpu"
            runs[name] = execution
        else:
            assert isinstance(where, torch.device)
            runs[name] = where
    return _Offload(execution, tiers, runs)


def _blocks(model: nn.Module, offload: _Offload) -> dict[str, str]:
    """The map that ``{"": "cpu"}`` (with an accelerator executing) or ``{"": "disk"}`` stands
    for: each block of the model its own entry on that tier, as ``load_into`` reads
    ``{"": "disk"}``, so that a window of blocks bounds the device's memory, not the whole
    model at once, and a model loaded by ``{"": "disk"}`` is dispatched again by the same map."""
    return whole_model_map(model, offload.tiers[""], str(offload.execution or "cpu"))


def check_offloading(
    tree: ModelTree,
    entries: dict[str, torch.device | str],
    execution_device: object,
    offload_window: int,
) -> None:
    """``dispatch``'s checks of ``execution_device``, ``offload_window`` and the map's
    offloaded entries for ``entries`` (parsed by ``parse_device_map``), for a caller that does
    a long job before dispatching."""
    offload = _offloading(entries, execution_device)
    if offload.tiers:
        _check_window(offload_window)
    _check_offload_map(tree, entries, offload)


def _check_window(offload_window: object) -> None:
    """``DeviceSpecError`` unless ``offload_window`` is a whole number of modules, at least 1."""
    if isinstance(offload_window, bool) or not isinstance(offload_window, int):
        raise DeviceSpecError(
            f"offload_window={offload_window!r} is not a whole number; pass how many offloaded "
            "modules may be resident at once, e.g. offload_window=2"
        )
    if offload_window < 1:
        raise DeviceSpecError(f"offload_window must be at least 1, not {offload_window}")


def _keep_on_disk(model: nn.Module, entries: Mapping[str, object]) -> None:
    """Refuse a new map that takes a module off the disk tier: its weights are in the checkpoint,
    not in memory, and only ``move`` reads them back."""
    for path, _, home in homes(model):
        entry = entry_of(path, entries)
        if home.tier == DISK and (entry is None or entries[entry] != DISK):
            raise MoveError(
                f"{display(path)} is offloaded to 'disk' (its weights are in its checkpoint, "
                "not in memory), and this map puts it elsewhere; gather the model first, "
                "torchplace.move(model, 'cpu'), then dispatch it by the new map",
                name=path,
            )


def _homes(
    tree: ModelTree, offload: _Offload, targets: dict[int, torch.device]
) -> dict[int, torch.device]:
    """Where each tensor lives: as it runs, except offloaded parameters: on the CPU for the
    host tier, and left where they are (``meta``, the bytes in the checkpoint) for the disk
    tier, whose modules must carry the checkpoint's reader that ``load_into`` gave them."""
    homes = dict(targets)
    params = {id(p) for p in tree.modules[""].parameters()}
    for key in params:
        # The most specific entry of the whole map decides: a module mapped to a device
        # inside an offloaded entry ({"": "cpu", "model.layers": "cuda:0"}) is not offloaded.
        entry = entry_of(tree.owner_modules[key][0], offload.runs)
        if entry is None or entry not in offload.tiers:
            continue
        if offload.tiers[entry] == "cpu":
            homes[key] = torch.device("cpu")
            continue
        del homes[key]
        home = tree.modules[entry].__dict__.get(HOME)
        if not isinstance(home, Home) or home.source is None or not tree.tensors[key].is_meta:
            _refuse_other_unit(tree.tensors[key], entry)
            raise DeviceSpecError(
                f"device_map[{entry!r}] is 'disk', but the weights of {display(entry)} are in "
                "memory, not left in a checkpoint: dispatch writes no weights to disk. Fill the "
                "model with torchplace.load_into(skeleton, checkpoint, device_map=...), which "
                "leaves them in the file, or map it to 'cpu'"
            )
    return homes


def _refuse_other_unit(tensor: torch.Tensor, entry: str) -> None:
    """``DeviceSpecError`` for a weight left on disk by ``load_into`` for another disk module
    than the map's entry ``entry`` (a map other than the one the model was loaded with)."""
    unit = tensor.__dict__.get(DISK_UNIT) if tensor.is_meta else None
    if isinstance(unit, str):
        raise DeviceSpecError(
            f"device_map[{entry!r}] is 'disk', but the weights under {display(entry)} were "
            f"left in their checkpoint for the disk module {display(unit)}, which is read "
            f"whole; dispatch by the map the model was loaded with (device_map[{unit!r}] = "
            "'disk'), or gather it first, torchplace.move(model, 'cpu'), then dispatch it"
        )


def _unit_paths(tree: ModelTree, path: str, entries: Mapping[str, object]) -> list[str]:
    """The modules that run for an offloaded entry: itself, or (a container that never runs
    itself, such as a ``ModuleList``) its children, each in turn, less those the map puts
    elsewhere (an entry of their own)."""
    if _runs(tree.modules[path]) or not tree.children[path]:
        return [path]
    entry = entry_of(path, entries)
    return [
        p
        for child in tree.children[path]
        if entry_of(child, entries) == entry
        for p in _unit_paths(tree, child, entries)
    ]


def _check_offload_map(tree: ModelTree, entries: Mapping[str, object], offload: _Offload) -> None:
    """Refuse what an offloaded map cannot run: an entry inside a ``"disk"`` one that is not on
    disk itself (a disk module is read whole, from one source), and a tied tensor whose holders
    the map puts on different tiers (one fetched for each call, one resident)."""
    for name, where in entries.items():
        if where != DISK:
            continue
        for inner, there in entries.items():
            if inner != name and _under(inner, name) and there != DISK:
                raise DeviceSpecError(
                    f"device_map[{inner!r}] is {str(there)!r} inside {name!r}, which is on "
                    f"'disk': a disk module is read whole; map the parts of {name!r} to 'disk' "
                    f"one by one instead, or map {name!r} to 'cpu' or a device"
                )
    for key, owners in tree.owner_modules.items():
        if len(set(owners)) < 2:
            continue
        held = {path: entry_of(path, entries) for path in owners}
        tiers = {path: offload.tiers.get(entry or "") for path, entry in held.items()}
        if len(set(tiers.values())) > 1:
            names = tree.owners[key]
            placed = ", ".join(
                f"{display(p)} " + (f"offloaded to {t!r}" if t else "resident")
                for p, t in tiers.items()
            )
            raise DeviceSpecError(
                f"{display(names[0])} is tied to {', '.join(map(display, names[1:]))} but the "
                f"map offloads some of its holders and not others ({placed}); one tensor is "
                f"fetched or resident, not both, so map "
                f"{' and '.join(repr(e) for e in dict.fromkeys(held.values()))} alike"
            )
    _refuse_shared_modules(tree, offload)


def _refuse_shared_modules(tree: ModelTree, offload: _Offload) -> None:
    """``DeviceSpecError`` for one module object with weights, reached under two names that the
    map runs in different offloaded units (a block a model shares between places, as Zamba's):
    each unit would bring its weights in and take them out under the other one's call. A shared
    module without weights (GPT's one activation for every layer) is left alone."""
    if not offload.tiers:
        return
    paths: dict[int, list[str]] = {}
    for path, module in tree.modules[""].named_modules(remove_duplicate=False):
        if next(module.parameters(), None) is not None:  # one with no weights is harmless
            paths.setdefault(id(module), []).append(path)
    units: dict[str, list[str]] = {}
    for group in (g for g in paths.values() if len(g) > 1):
        homes: set[str | None] = set()
        for path in group:
            entry = entry_of(path, offload.runs)
            if entry is None or entry not in offload.tiers:
                homes.add(None)
                continue
            found = units.get(entry)
            if found is None:
                found = units[entry] = _unit_paths(tree, entry, offload.runs)
            homes.add(next((u for u in found if _under(path, u)), entry))
        if len(homes) > 1 and homes != {None}:
            raise DeviceSpecError(
                f"{' and '.join(map(display, group))} are one module, shared, and the map "
                "offloads them as parts of different units (or offloads one and not the "
                "other): each would bring its weights in and out under the other's call; map "
                "the modules that share it to one entry, or keep it on a device"
            )


def _units(tree: ModelTree, offload: _Offload) -> list[Unit]:
    """Every offloaded module that runs, in registration order, with its parameter slots."""
    assert offload.execution is not None or DISK in offload.tiers.values()
    execution = offload.execution or torch.device("cpu")
    units: list[Unit] = []
    for entry, tier in offload.tiers.items():
        found = tree.modules[entry].__dict__.get(HOME)
        entry_source = found.source if isinstance(found, Home) else None
        for path in _unit_paths(tree, entry, offload.runs):
            source = entry_source
            slots, names = [], []
            for key in tree.subtree(path):
                tensor = tree.tensors[key]
                if not isinstance(tensor, nn.Parameter):
                    continue
                for qualified in tree.owners[key]:
                    owner, _, leaf = qualified.rpartition(".")
                    if entry_of(owner, offload.runs) != entry or not _under(owner, path):
                        continue
                    slots.append((tree.modules[owner], leaf, tensor))
                    names.append(qualified[len(entry) + 1 :] if entry else qualified)
            if source is not None and tier == DISK and path != entry:
                source = source.only(path[len(entry) + 1 :] if entry else path)
            home = Home(tier, execution, source if tier == DISK else None)
            units.append(Unit(path, tree.modules[path], slots, names, home, entry))
    units.sort(key=lambda u: list(tree.modules).index(u.path))
    return units


def _under(path: str, top: str) -> bool:
    return not top or path == top or path.startswith(top + ".")


def _pin(units: list[Unit], execution: torch.device | None) -> None:
    """Host-tier weights in pinned memory, so that their copies to CUDA run asynchronously."""
    if execution is None or execution.type != "cuda":
        return
    for unit in units:
        for _, _, p in unit.slots:
            if p.device.type == "cpu" and not p.is_pinned():
                p.data = p.data.pin_memory()


def _forget_host_homes(model: nn.Module) -> None:
    """An earlier dispatch's host-tier marks (disk tiers keep theirs: their reader)."""
    for _, module, home in list(homes(model)):
        if home.source is None:
            del module.__dict__[HOME]


_F = TypeVar("_F", bound=Callable[..., Any])


def _untraced(fn: _F) -> _F:
    """``fn``, which ``torch.compile`` runs as it is each call, never tracing it (a graph break
    around the call): ``torch.compiler.disable`` around it, made on the first call where the
    compiler is loaded (importing it takes 1.5-2 s, which a model that is never compiled does
    not pay); the attribute keeps the compiler from tracing into it before that."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        disabled = _DISABLED.get(fn)
        if disabled is None:
            disabled = _DISABLED[fn] = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]
        return disabled(*args, **kwargs)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    call._torchdynamo_disable_msg = _UNTRACED  # type: ignore[attr-defined]  # fullgraph's error
    return cast(_F, call)


_DISABLED: dict[Callable[..., Any], Callable[..., Any]] = {}  # made once torch.compile is loaded
_UNTRACED = (
    "torchplace: an offloaded module brings its weights in (from host memory or read from its "
    "checkpoint) at each call, which no graph can hold; compile without fullgraph=True (its "
    "hooks then run between the graphs), or gather the model with torchplace.move first"
)


@_untraced
def _bring_in(ring: Ring, index: int) -> None:
    """Unit ``index``'s weights in before its call, covered by ``SHIELD`` (a Ctrl-C waits
    until the forward runs); on any failure nothing stays in and the shield is left. Never
    traced by ``torch.compile`` (a graph break runs it as it is, each call): traced, its reads
    would run on the compiler's fake tensors."""
    SHIELD.enter()
    try:
        ring.before(index)
    except BaseException:
        SHIELD.cover()
        try:
            ring.after(index)  # ends the call ``before`` refused or half began
        finally:
            SHIELD.leave(deliver=False)
        raise


@_untraced
def _let_go(ring: Ring, index: int, *, deliver: bool) -> None:
    """Unit ``index``'s weights let go after its call, covered by ``SHIELD`` until they are
    out; then a SIGINT kept meanwhile is raised (``deliver``), or dropped where an interrupt
    already ends the call."""
    SHIELD.cover()
    try:
        ring.after(index)
    finally:
        SHIELD.leave(deliver=deliver)


def _run(ring: Ring, index: int, call: Callable[[], Any]) -> Any:
    """One call of unit ``index``, the one record of its offload: weights in, the call, weights
    out, whatever ends the call (an exception, a Ctrl-C anywhere: ``Shield`` keeps a SIGINT from
    landing between the steps). With gradients on, the call runs under the unit's saved-tensor
    hooks (``_through``)."""
    _bring_in(ring, index)
    try:
        SHIELD.lift()  # a Ctrl-C kept since the weights began to come in is raised here
        kept = _kept(ring, index)
        if kept is None:
            out = call()
        else:
            with kept.hooks():
                out = call()
        SHIELD.cover()  # until the weights are out
    except Exception:
        _let_go(ring, index, deliver=True)  # a Ctrl-C kept meanwhile replaces it
        raise
    except BaseException:
        _let_go(ring, index, deliver=False)  # the interrupt under way is raised
        raise
    _let_go(ring, index, deliver=True)
    return out


@_untraced
def _kept(ring: Ring, index: int) -> Any:
    """The unit's saved-tensor hooks for this call, made outside any ``torch.compile`` trace."""
    return ring.kept(index)


class _Offloaded(_StandIn):
    """Stands in for the forward of an offloaded module (or of a module inside one): called
    directly (``layer.forward(...)``, as squeezebert calls its layers) or by a ``__call__`` that
    did not go through ``_OffloadedCall`` (a compiled module's), it brings the unit's weights
    in for the call; called while its unit runs on this thread, it only calls through."""

    def __init__(self, module: nn.Module, previous: Any, ring: Ring, index: int) -> None:
        super().__init__(module, previous)
        self.ring, self.index = ring, index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.ring.running(self.index):
            return self.forward(*args, **kwargs)
        return _run(self.ring, self.index, lambda: self.forward(*args, **kwargs))


class _OffloadedCall:
    """Stands in for ``_call_impl`` of an offloaded module (or of a module inside one), which
    ``Module.__call__`` looks up on the instance: the unit's weights come in before the module's
    own forward pre-hooks run and go out after its forward hooks, so that hooks see the weights
    as on the model held whole (``weight_norm``'s hook computes the weight from them)."""

    def __init__(self, module: nn.Module, previous: Any, ring: Ring, index: int) -> None:
        self.module, self.previous = module, previous
        self.ring, self.index = ring, index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.ring.running(self.index):
            out = self.call(*args, **kwargs)
            self.ring.used(self.index, self.module)
            return out
        return _run(self.ring, self.index, lambda: self.call(*args, **kwargs))

    def call(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module)._call_impl(self.module, *args, **kwargs)  # type: ignore[no-untyped-call]


class _NoValues:
    """``state_dict()`` of a module left on disk: its parameters are ``meta`` placeholders with no
    values, which a saved file would keep as such (``save_pretrained`` and ``torch.save`` of
    them fail deep inside, or write nothing that loads). ``keep_vars=True`` (the parameters
    themselves, as torchplace's own walks ask) passes."""

    def __init__(self, unit: Unit) -> None:
        self.path = unit.path
        source = unit.home.source
        self.where = getattr(source, "where", "its checkpoint")

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if keep_vars:
            return
        raise TorchplaceError(
            f"state_dict(): {display(self.path)} is offloaded to 'disk' (its weights stay in "
            f"{self.where} and are meta tensors here), so a state dict would hold no values; "
            "gather the model first, torchplace.move(model, 'cpu') (or a device it fits on), "
            "then save it - or keep the checkpoint it was loaded from, which holds them"
        )


class _NoMove:
    """Stands in for ``_apply`` of a module on disk or above one (``.to()``, ``.cpu()`` and
    ``.cuda()`` go through it): a move of their ``meta`` placeholders failed deep in torch,
    with advice (``to_empty``) that loses the weights, and after the modules before them had
    moved. One placeholder is tried first, so that nothing moves; a cast (``.half()``), which
    keeps them on ``meta``, goes through."""

    def __init__(self, model: nn.Module, units: list[Unit], previous: Any) -> None:
        self.model = weakref.ref(model)  # the model holds this: no cycle through it
        self.units, self.previous = units, previous

    def __deepcopy__(self, memo: dict[int, Any]) -> _NoMove:
        """The copy of a model (``copy.deepcopy`` keeps it in ``memo`` while copying) gets one
        guarding the copy."""
        model = self.model()
        copied = memo.get(id(model)) if model is not None else None
        new = _NoMove.__new__(_NoMove)
        new.model = weakref.ref(copied if isinstance(copied, nn.Module) else model)  # type: ignore[arg-type]
        new.units = copy.deepcopy(self.units, memo)
        new.previous = copy.deepcopy(self.previous, memo)
        return new

    def __call__(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        for unit in self.units:
            held = next((p for p in unit.module.parameters() if p.is_meta), None)
            if held is None:
                continue
            where = getattr(unit.home.source, "where", "its checkpoint")
            here = (
                f"{display(unit.path)} is offloaded to 'disk' (its weights stay in {where} and "
                "are meta tensors here)"
            )
            fix = (
                "gather the model first, torchplace.move(model, 'cpu') (or a device it fits "
                "on), or dispatch it again with another map"
            )
            try:
                out = fn(held)
            except (NotImplementedError, RuntimeError) as exc:  # "Cannot copy out of meta"
                if isinstance(exc, RuntimeError) and not _takes_real(fn):
                    raise  # the device itself (a build without it): torch's error says so
                raise TorchplaceError(
                    f"{here}, so .to(), .cpu(), .cuda() and share_memory() cannot move it; {fix}; "
                    "nothing was moved"
                ) from exc
            if isinstance(out, torch.Tensor) and not out.is_meta:  # to_empty: new memory
                raise TorchplaceError(
                    f"{here}, so to_empty() would give them new, uninitialised memory in place "
                    f"of the values it reads from the file, and every other weight too; {fix}; "
                    "nothing was changed"
                )
            break
        if self.previous is not None:
            return self.previous(fn, recurse)
        model = self.model()
        assert model is not None, "called through the model, which holds it"
        return type(model)._apply(model, fn, recurse)  # type: ignore[no-untyped-call]


def _takes_real(fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether ``fn`` (what ``_apply`` applies) works on a real, empty CPU tensor: then what
    failed on a placeholder (``share_memory_``: "only available on CPU") failed for being on
    ``meta``; else it fails for any tensor (``.to("mps")`` in a build without MPS)."""
    try:
        fn(torch.empty(0))
    except Exception:
        return False
    return True


class _NoLoad:
    """``load_state_dict`` of a module on disk, above one or inside one, where the state dict
    gives values for a disk module's weights: they are ``meta`` placeholders, into which torch
    copies as a no-op (its warning says to pass ``assign=True``), and with ``assign=True`` the
    next call reads the file's weights over the ones given. Either way the model silently went on
    with the checkpoint's weights there, and the new ones elsewhere. Refused by the first module
    ``load_state_dict`` meets (the one it is called on) before it loads anything; a state dict
    that gives the disk modules nothing (a head, an adapter, ``strict=False``) loads."""

    def __init__(self, disk: list[tuple[str, str, str]]) -> None:
        self.disk = disk  # (its path in the model, its path below the hooked module, its file)

    def __call__(self, module: nn.Module, state_dict: Any, prefix: str, *rest: Any) -> None:
        for path, below, where in self.disk:
            head = f"{prefix}{below}." if below else prefix
            given = next((k for k in state_dict if k.startswith(head)), None)
            if given is None:
                continue
            raise TorchplaceError(
                f"load_state_dict(): {display(path)} is offloaded to 'disk' (its weights stay "
                f"in {where}, read when it runs, and are meta tensors here), so the values given "
                f"for it ({given!r}) would not be kept: torch copies into its placeholders as a "
                "no-op, and with assign=True its next call reads the file's over them. Gather "
                "the model first, torchplace.move(model, 'cpu') (or a device it fits on), then "
                "load the state dict; or save it and load_into the skeleton from that file with "
                "the map; nothing was loaded into this module"
            )


def _guard_moves(model: nn.Module, disk: list[Unit]) -> None:
    """``_NoMove`` on each module on disk and on every module above one, the model's root
    included, each trying the disk modules under it, and ``_NoLoad`` on those and on every
    module inside a disk module (``undispatch`` takes them away)."""
    paths = {""} | {unit.path for unit in disk}
    for unit in disk:
        parts = unit.path.split(".")
        paths.update(".".join(parts[:n]) for n in range(1, len(parts)))
    for path in paths if disk else ():
        module = model.get_submodule(path)
        under = [u for u in disk if not path or u.path == path or u.path.startswith(f"{path}.")]
        installed = module.__dict__.get(MARK) or Installed(handles=[])
        if not installed.wrapped_apply:
            installed.previous_apply = module.__dict__.get("_apply")
            installed.wrapped_apply = True
        module.__dict__["_apply"] = _NoMove(module, under, installed.previous_apply)
        cut = len(path) + 1 if path else 0
        _refuse_loads(module, installed, [(u, u.path[cut:]) for u in under])
    for unit in disk:  # and each module inside one (a load into it is as silent)
        for name, inner in unit.module.named_modules():
            if name:
                installed = inner.__dict__.get(MARK) or Installed(handles=[])
                installed.inside = unit.path
                _refuse_loads(inner, installed, [(unit, "")])


def _refuse_loads(module: nn.Module, installed: Installed, under: list[tuple[Unit, str]]) -> None:
    """``_NoLoad`` on ``module`` for the disk modules ``under`` it (each with its path below
    ``module``; "" for the one it is, or lies inside), kept in its mark for ``undispatch``."""
    disk = [
        (u.path, below, getattr(u.home.source, "where", "its checkpoint")) for u, below in under
    ]
    hook = _NoLoad(disk)
    installed.handles.append(module._register_load_state_dict_pre_hook(hook, with_module=True))  # type: ignore[no-untyped-call]
    module.__dict__[MARK] = installed


def _hook_units(units: list[Unit], window: int, transport: Fetcher) -> None:
    """The ring's record on each offloaded module and on every module inside it that runs
    (``_OffloadedCall`` and ``_Offloaded``), kept in their marks for ``undispatch``."""
    if not units:
        return
    ring = Ring(units, window, transport)
    for i, unit in enumerate(units):
        done: set[int] = set()
        for _, module in unit.module.named_modules():
            if id(module) not in done and (module is unit.module or _runs(module)):
                done.add(id(module))
                _stand_in(module, ring, i)
        if unit.home.tier == DISK:
            installed = unit.module.__dict__[MARK]
            installed.handles.append(unit.module.register_state_dict_pre_hook(_NoValues(unit)))  # type: ignore[no-untyped-call]
        unit.module.__dict__[HOME] = unit.home


def _stand_in(module: nn.Module, ring: Ring, index: int) -> None:
    installed = module.__dict__.get(MARK) or Installed(handles=[])
    if not installed.wrapped_forward:  # undispatch puts back what was there before
        installed.previous_forward = module.__dict__.get("forward")
        installed.wrapped_forward = True
    if not installed.wrapped_call:
        installed.previous_call = module.__dict__.get("_call_impl")
        installed.wrapped_call = True
    previous = module.__dict__.get("forward")
    module.__dict__["forward"] = _Offloaded(module, previous, ring, index)
    module.__dict__["_call_impl"] = _OffloadedCall(
        module, module.__dict__.get("_call_impl"), ring, index
    )
    module.__dict__[MARK] = installed


def dispatch(
    model: nn.Module,
    device_map: DeviceMapSpec,
    /,
    *,
    execution_device: str | int | torch.device | None = None,
    offload_window: int = DEFAULT_WINDOW,
    _transport: Fetcher | None = None,
) -> nn.Module:
    """Place each submodule on its device and move inputs to it as it runs.

    >>> import torch, torchplace
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> model = torchplace.dispatch(model, {"0": "cpu", "2": "meta"})
    >>> model[2].weight.device
    device(type='meta')
    >>> model[2](torch.ones(1, 4)).device  # the hook moved the CPU input to meta
    device(type='meta')

    ``device_map`` maps module names (``""`` is the whole model) to devices, as ``plan``
    returns it; a tensor goes to the device of the most specific name that contains it, and
    every tensor must be covered. Tied tensors stay one object, so their holders must share a
    device. Parameters keep their identity where PyTorch allows it. Inputs (positional and
    keyword, nested in any collection ``move`` handles: lists, tuples, dicts, dataclasses,
    objects with their own ``.to``) are moved to each submodule's device before it runs (before
    any other forward pre-hook, so a ``guard`` sees them moved; a container that never runs
    itself, a ``ModuleList`` of layers mapped whole, has its modules move their own inputs as
    its parent calls them), and the model's output comes
    back to the device of its first tensor input, wherever that input is nested (outputs on
    ``meta`` hold no data and stay there).

    A container passed as an input reaches a submodule as the caller's own object when all its
    tensors are on that submodule's device; else the submodule gets a moved copy (as ``move``
    gives one), so what it writes into a mutable input (a cache dict, a list) is not seen by
    the caller or by later parts. Return such results from ``forward``, keep a cache per
    device, or pass an object torchplace does not walk into (neither a collection nor with a
    ``.to``, as Hugging Face's ``Cache`` classes), which every part gets as is.

    Offloading: a module mapped to ``"cpu"`` while an accelerator executes
    (``execution_device``, by default the map's first accelerator), or mapped to ``"disk"``,
    is offloaded. Its parameters stay home between calls (pinned host memory; for ``"disk"``,
    ``meta``, their bytes left in the checkpoint ``load_into(..., device_map=...)`` filled the
    model from) and are brought to the execution device just before its forward, the next
    offloaded modules fetched ahead (on a side CUDA stream, or read from the checkpoint in a
    background thread) while it runs, and dropped after; at most ``offload_window`` offloaded
    modules' weights are there at once. Their buffers live on the execution device. With no
    accelerator in the map, ``"cpu"`` modules simply run on the CPU and ``"disk"`` ones run on
    the CPU with their weights read just in time, on the calling thread (there is no copy to
    overlap). Gradients flow through offloaded modules to the parameters that live on a
    device: what autograd saves of an offloaded weight is a reference, read again at backward;
    a backward that would give an offloaded weight a gradient raises ``TorchplaceError`` naming
    it (its weights are copies, so that gradient would be lost: freeze them, as PEFT does).

    Dispatching again replaces the hooks;
    ``torchplace.move(model, device)`` gathers the model onto one device and removes them.
    If a parent's own code mixes outputs of children on different devices, the error names it
    and points at ``plan(..., no_split=[...])``.
    """
    try:
        return _dispatched(model, device_map, execution_device, offload_window, _transport)
    except TorchplaceError as err:
        raise prefixed(err, "dispatch()") from err.__cause__


def _dispatched(
    model: nn.Module,
    device_map: DeviceMapSpec,
    execution_device: str | int | torch.device | None,
    offload_window: int,
    transport: Fetcher | None,
) -> nn.Module:
    """``dispatch``'s work, all or nothing (see there)."""
    if not isinstance(model, nn.Module):
        raise TorchplaceError(
            f"dispatch() places an nn.Module, not {type(model).__name__}; pass the model"
        )
    tree = walk_model(model)
    entries = parse_device_map(tree, device_map, resolve=_device)  # a test may fake it
    _keep_on_disk(model, entries)
    offload = _offloading(entries, execution_device)
    if offload.tiers.get("") and len(entries) == 1:  # the whole model in host memory or on disk
        entries = parse_device_map(tree, _blocks(model, offload), resolve=_device)
        offload = _offloading(entries, execution_device)
    targets = _targets(tree, offload.runs)
    _check_offload_map(tree, entries, offload)
    units = _units(tree, offload) if offload.tiers else []
    if units:
        _check_window(offload_window)
    _place(tree, _homes(tree, offload, targets))  # all or nothing: on failure the model
    _pin(units, offload.execution)  # and its hooks are as they were
    undispatch(model)  # only now: a bad map or a failed move keeps an earlier dispatch whole
    _forget_host_homes(model)
    _hook(tree, targets)
    transport = transport or DeviceFetcher(offload.execution or torch.device("cpu"))
    _hook_units(units, offload_window, transport)
    _guard_moves(model, [unit for unit in units if unit.home.tier == DISK])
    return model
