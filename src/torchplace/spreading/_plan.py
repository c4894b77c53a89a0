"""Where a model goes on several devices: ``plan`` turns budgets into a device map.

``plan(model, max_memory)`` returns ``{module name: device}``, filling the budgets in the order
given with submodules in registration order (plan never runs the model, so the order in which
``forward`` calls them is not known to it); it never touches a device. The walk of a model lives in
``_model_walk``, budgets are read by ``_budgets``.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Iterable

import torch
from torch import nn

from .._errors import DeviceSpecError, TorchplaceError
from .._model_walk import ModelTree, display, walk_model
from .._sizes import format_bytes as _format_bytes
from .._tensor_size import nbytes_as
from ._budgets import MemorySpec, parse_budgets

__all__ = [
    "plan",
]

# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _NoSplit:
    """The modules never split: a class name matches a module whose class has exactly that
    name (as Accelerate's ``no_split_module_classes``); a class matches its instances,
    subclasses included (as ``isinstance``), and never an unrelated class of the same name."""

    names: frozenset[str] = frozenset()
    classes: tuple[type[nn.Module], ...] = ()

    def entry(self, module: nn.Module) -> str | None:
        """The name of the entry that keeps ``module`` whole, or None when none does."""
        name = type(module).__name__
        if name in self.names or type(module) in self.classes:
            return name
        for cls in self.classes:
            if isinstance(module, cls):
                return cls.__name__
        return None


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


NoSplitSpec = Iterable[type | str] | type | str  # or "auto"


def _auto_no_split(modules: list[nn.Module]) -> list[type | str]:
    """``no_split="auto"``: the class names a transformers model keeps whole, gathered from the
    ``_no_split_modules`` of each of its modules (a model nests others: a vision tower)."""
    declared = [m for m in modules if hasattr(m, "_no_split_modules")]
    if not declared:
        raise TorchplaceError(
            f"no_split='auto' reads a transformers model's _no_split_modules, and no module "
            f"of this {type(modules[0]).__name__} has one; pass the classes to keep whole "
            "(no_split=[Block]) or their names (no_split=['Block'])"
        )
    names: dict[str, None] = {}
    for module in declared:
        declared_names: Iterable[object] = getattr(module, "_no_split_modules", None) or ()
        for name in declared_names:
            names[str(name)] = None
    return list(names)


def _no_split_classes(model: nn.Module, no_split: NoSplitSpec) -> _NoSplit:
    """The classes never split. An entry that matches no module of the model is ignored, as
    Accelerate ignores it, so that one list serves several model families; when no entry
    matches at all, a warning says so (with the near names, for a typo), since then nothing is
    kept whole. A class that only shares its name with the model's own is refused: it is
    almost always the class from another import of the same code."""
    modules = list(model.modules())
    if isinstance(no_split, str) and no_split == "auto":
        no_split = _auto_no_split(modules)
    elif isinstance(no_split, (str, type)):
        no_split = [no_split]
    present = sorted({type(m).__name__ for m in modules})
    names: set[str] = set()
    classes: list[type[nn.Module]] = []
    absent: list[str] = []
    for entry in no_split:
        if isinstance(entry, type) and issubclass(entry, nn.Module):
            if any(isinstance(m, entry) for m in modules):
                classes.append(entry)
                continue
            namesake = next((type(m) for m in modules if type(m).__name__ == entry.__name__), None)
            if namesake is not None:
                raise TorchplaceError(
                    f"no_split: {_qualified(entry)} is not the model's "
                    f"{_qualified(namesake)}, only a class of the same name, and no module "
                    f"of the model is an instance of it; pass the model's class or the name "
                    f"{entry.__name__!r}"
                )
            absent.append(entry.__name__)
        elif isinstance(entry, str):
            if entry in present:
                names.add(entry)
            else:
                absent.append(entry)
        else:
            raise TorchplaceError(
                f"no_split: {entry!r} is neither a module class nor a class name; "
                "pass classes (no_split=[Block]) or their names (no_split=['Block'])"
            )
    if absent and not names and not classes:
        _warn_none_present(absent, present)
    return _NoSplit(frozenset(names), tuple(classes))


def _warn_none_present(absent: list[str], present: list[str]) -> None:
    guesses = [
        f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
        for name in absent
        for close in [difflib.get_close_matches(name, present, n=1)]
    ]
    warnings.warn(
        f"plan(): no_split names no class of the model ({', '.join(guesses)}), so every module "
        f"may be split; classes present: {', '.join(present)}",
        UserWarning,
        stacklevel=4,
    )


def _dtype(dtype: object) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        found = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    raise DeviceSpecError(
        f"dtype={dtype!r} is not a torch dtype; use e.g. torch.float16 or 'bfloat16'"
    )


class _Planner:
    """Fills devices in the order of the budgets with units of tensors in registration order."""

    def __init__(
        self,
        tree: ModelTree,
        budgets: dict[torch.device, int],
        no_split: _NoSplit,
        dtype: torch.dtype | None,
    ) -> None:
        self.tree = tree
        self.devices = list(budgets)
        self.budgets = budgets
        self.left = [budgets[d] for d in self.devices]
        self.current = 0
        self.no_split = no_split
        self.size = {key: nbytes_as(t, dtype) for key, t in tree.tensors.items()}
        self.placed: dict[int, int] = {}  # tensor id -> index into self.devices
        self.tied = self._tied_closures()

    def _tied_closures(self) -> dict[int, set[int]]:
        """For each tensor, every tensor that must share its device.

        Modules that hold the same tensor directly are joined (transitively): their direct
        tensors form one group, placed whole when its first member is placed.
        """
        parent: dict[str, str] = {path: path for path in self.tree.modules}

        def find(path: str) -> str:
            while parent[path] != path:
                parent[path] = parent[parent[path]]
                path = parent[path]
            return path

        for owners in self.tree.owner_modules.values():
            for other in owners[1:]:
                parent[find(other)] = find(owners[0])
        groups: dict[str, set[int]] = {}
        for path, ids in self.tree.direct.items():
            groups.setdefault(find(path), set()).update(ids)
        return {key: groups[find(owners[0])] for key, owners in self.tree.owner_modules.items()}

    def unplaced(self, ids: Iterable[int]) -> set[int]:
        out: set[int] = set()
        for key in ids:
            out |= self.tied[key]
        return {key for key in out if key not in self.placed}

    def need(self, ids: set[int]) -> int:
        return sum(self.size[key] for key in ids)

    def assign(self, ids: set[int]) -> None:
        for key in ids:
            self.placed[key] = self.current
        self.left[self.current] -= self.need(ids)

    def splittable(self, path: str) -> bool:
        module = self.tree.modules[path]
        has_parts = any(self.tree.subtree(child) for child in self.tree.children[path])
        return has_parts and self.no_split.entry(module) is None

    def visit(self, path: str) -> None:
        ids = self.unplaced(self.tree.subtree(path))
        while ids:
            if self.need(ids) <= self.left[self.current]:
                self.assign(ids)
                return
            if self.splittable(path):
                direct = self.unplaced(self.tree.direct[path])
                while direct and self.need(direct) > self.left[self.current]:
                    self.advance(path, direct, whole=False)
                if direct:
                    self.assign(direct)
                for child in self.tree.children[path]:
                    self.visit(child)
                return
            self.advance(path, ids, whole=True)

    def advance(self, path: str, ids: set[int], *, whole: bool) -> None:
        if self.current + 1 < len(self.devices):
            self.current += 1
            return
        module = self.tree.modules[path]
        name = type(module).__name__
        entry = self.no_split.entry(module)
        what = (
            f"{display(path)} ({name})"
            if whole
            else f"the tensors {display(path)} ({name}) holds itself"
        )
        why = (
            (f"{name} is in no_split" if entry == name else f"{name} is a {entry}, in no_split")
            if whole and entry is not None
            else "it has no submodules to split"
            if whole
            else "they cannot be split"
        )
        outside = self.tree.subtree(path) if whole else frozenset(self.tree.direct[path])
        partners = sorted(
            {p for key in ids - outside for p in self.tree.owner_modules[key]} - {path}
        )
        if partners:
            shown = ", ".join(display(p) for p in partners[:3])
            why += f", and tied tensors bring {shown} along"
        fixes = "or add a device after it" + (
            f", or take {entry} out of no_split" if entry is not None else ""
        )
        remaining = sum(self.size[key] for key in self.tree.tensors if key not in self.placed)
        last = self.devices[-1]
        earlier = [
            f"{d}: {_format_bytes(self.left[i])} of {_format_bytes(self.budgets[d])}"
            for i, d in enumerate(self.devices[:-1])
        ]
        left_over = f" (left unused earlier: {', '.join(earlier)})" if earlier else ""
        raise TorchplaceError(
            f"the model does not fit: {what} needs {_format_bytes(self.need(ids))} in one piece "
            f"({why}) but {last}, the last device, has {_format_bytes(self.left[-1])} left"
            f"{left_over}; {_format_bytes(remaining)} of the model is still unplaced. plan fills "
            "devices in the order given and never goes back, so raise the budget of "
            f"{last} by at least {_format_bytes(remaining - self.left[-1])}, {fixes}"
        )

    def device_map(self) -> dict[str, torch.device]:
        out: dict[str, torch.device] = {}

        def emit(path: str, inherited: torch.device | None) -> None:
            ids = self.tree.subtree(path)
            devices = {self.devices[self.placed[key]] for key in ids}
            if not devices:
                return
            if len(devices) == 1:
                (dev,) = devices
                if dev != inherited:
                    out[path] = dev
                return
            direct = self.tree.direct[path]
            if direct:
                dev = self.devices[self.placed[direct[0]]]
                if dev != inherited:
                    out[path] = dev
                inherited = dev
            for child in self.tree.children[path]:
                emit(child, inherited)  # noqa: F821 (deleted once done)

        try:
            emit("", None)
        finally:
            del emit  # it refers to itself: break the cycle so it is freed at once
        return out


def _refuse_overfull(total: int, budgets: dict[torch.device, int], dtype: object) -> None:
    """The error for a model whose parameters and buffers exceed all budgets together."""
    capacity = sum(budgets.values())
    if total > capacity:
        listed = ", ".join(f"{d}: {_format_bytes(b)}" for d, b in budgets.items())
        cast_to = _dtype(dtype)
        cast = "" if cast_to is None else f" in {str(cast_to).removeprefix('torch.')}"
        # Host memory is the usual room to grow: suggest adding it, or, when it is already
        # budgeted, raising it (adding the cpu again is no advice).
        more = (
            "raise a budget by that much (the cpu's, if the machine has the memory)"
            if torch.device("cpu") in budgets
            else "raise a budget by that much, add a device (for example 'cpu')"
        )
        raise TorchplaceError(
            f"the model does not fit: its parameters and buffers need "
            f"{_format_bytes(total)}{cast} but the budgets hold {_format_bytes(capacity)} "
            f"({listed}), {_format_bytes(total - capacity)} short; {more}, or plan with "
            "a smaller dtype"
        )


def plan(
    model: nn.Module,
    /,
    max_memory: MemorySpec,
    *,
    no_split: NoSplitSpec = (),
    dtype: torch.dtype | str | None = None,
) -> dict[str, torch.device]:
    """Assign submodules, in registration order, to devices within budgets: a device map.

    >>> import torch, torchplace
    >>> model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
    >>> device_map = torchplace.plan(model, {"cuda:0": "600KiB", "cuda:1": "2MiB"})
    >>> {name: str(dev) for name, dev in device_map.items()}
    {'0': 'cuda:0', '1': 'cuda:0', '2': 'cuda:1', '3': 'cuda:1'}
    >>> torchplace.plan(model, {"cpu": "10GiB"})
    {'': device(type='cpu')}

    Budgets (``"10GiB"``, ``"512MiB"``, ``"500MB"``, ``"2GB"``, or bytes as any integer or a
    whole real number) count parameters and buffers and are used exactly as given: leave room
    for activations yourself. Devices fill in the order the budgets are listed; an int key N
    means ``cuda:N``.

    Submodules are taken in registration order (the order of ``model.named_modules()``), as
    Accelerate's ``infer_auto_device_map`` does: plan never runs the model, so it cannot know
    the order in which ``forward`` calls them. That is the order a sequential model or a
    transformer stack runs them; a model that registers a module before one it runs earlier
    (a head defined first) is still planned correctly, each part on its device, only with more
    device changes per forward than a map in running order. A module that does not fit where
    the last one went is split into its children, unless it is in ``no_split``: a class name
    keeps whole the modules whose class has exactly that name (as Accelerate's
    ``no_split_module_classes``), a class keeps whole its instances, subclasses included;
    entries that match no module of the model are ignored, so one list serves several model
    families (a warning says when none matches), and ``no_split="auto"`` reads a transformers
    model's ``_no_split_modules``. Modules that hold the same tensor
    (tied weights) share a device: the group goes where its first member goes. ``dtype``
    sizes floating tensors as if cast to it. The map is the smallest that says it: a module
    whose whole subtree shares a device is one entry, and a name covers its submodules unless
    a longer name overrides it. Works on skeletons and fake tensors; no device is touched.
    """
    try:
        if not isinstance(model, nn.Module):
            raise TorchplaceError(f"maps an nn.Module, not {type(model).__name__}; pass the model")
        budgets = parse_budgets(max_memory)
        classes = _no_split_classes(model, no_split)
        planner = _Planner(walk_model(model), budgets, classes, _dtype(dtype))
        _refuse_overfull(sum(planner.size.values()), budgets, dtype)
        planner.visit("")
        return planner.device_map()
    except TorchplaceError as err:
        raise type(err)(f"plan(): {err}") from err.__cause__
