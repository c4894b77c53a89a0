"""Where a model goes on several devices: ``plan`` turns budgets into a device map.

``plan(model, max_memory)`` returns ``{module name: device}``, filling the budgets in the order
given with submodules in registration order (plan never runs the model, so the order in which
``forward`` calls them is not known to it); it never touches a device. The walk of a model lives in
``_model_walk``, budgets are read by ``_budgets``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .._errors import DeviceSpecError, TorchplaceError, prefixed, user_stacklevel
from .._model_walk import ModelTree, display, walk_model
from .._sizes import format_bytes as _format_bytes
from .._suggest import close_matches, did_you_mean
from .._tensor_size import dtype_named, nbytes_as
from ..moving._transfer import is_accelerator
from ._budgets import (
    DISK,
    Headroom,
    MemorySpec,
    Place,
    describe,
    machine_budgets,
    parse_budgets,
)

__all__ = [
    "DeviceMap",
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
        for close in [close_matches(name, present, n=1)]
    ]
    warnings.warn(
        f"plan(): no_split names no class of the model ({', '.join(guesses)}), so every module "
        f"may be split; classes present: {', '.join(present)}",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _dtype(dtype: object) -> torch.dtype | None:
    """The dtype ``plan(dtype=...)`` means: a torch dtype as it is, its name (``"int8"`` too,
    to size 8-bit weights), or any spelling the command line's ``--dtype`` takes (``"bf16"``,
    ``"bfloat16"``, ``"torch.float16"``)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = dtype_named(dtype, floating=False) if isinstance(dtype, str) else None
    if found is not None:
        return found
    raise DeviceSpecError(
        f"dtype={dtype!r} is not a torch dtype; use e.g. torch.float16, 'bfloat16' or 'bf16'"
    )


def _running_totals(targets: list[float | None]) -> list[float | None]:
    total = 0.0
    out: list[float | None] = []
    for target in targets:
        if target is not None:
            total += target
        out.append(None if target is None else total)
    return out


class _Planner:
    """Fills devices in the order of the budgets with units of tensors in registration order.

    ``targets`` (balanced strategies) gives some devices the bytes they should hold; the
    running total of the targets up to a device bounds what the bounded devices hold up to it:
    a unit goes there whole when it ends within the bound; one that crosses it is split when
    it can be, else it goes where its middle falls (on a device still empty, a unit that
    crosses its bound stays, so that no device with a target is left empty). ``collect``
    makes the last device's overflow a list instead of an error.
    """

    def __init__(
        self,
        tree: ModelTree,
        budgets: dict[Place, int],
        no_split: _NoSplit,
        size: dict[int, int],
        targets: list[float | None] | None = None,
        *,
        collect: bool = False,
    ) -> None:
        self.tree = tree
        self.devices = list(budgets)
        self.budgets = budgets
        self.left = [budgets[d] for d in self.devices]
        self.targets = targets or [None] * len(self.devices)
        self.bounds = _running_totals(self.targets)
        self.spread = 0  # bytes placed on bounded devices so far
        self.current = 0
        self.no_split = no_split
        self.size = size
        self.placed: dict[int, int] = {}  # tensor id -> index into self.devices, -1: left out
        self.tied = self._tied_closures()
        self.overflow: list[tuple[str, int]] | None = [] if collect else None

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
        if self.bounds[self.current] is not None:
            self.spread += self.need(ids)

    def fits(self, ids: set[int], *, splittable: bool) -> bool:
        """Whether the unit goes to the current device (whole, or by its middle)."""
        need = self.need(ids)
        bound = self.bounds[self.current]
        if need > self.left[self.current]:
            return False
        if bound is None or self.spread + need <= bound:
            return True
        empty = self.left[self.current] == self.budgets[self.devices[self.current]]
        target = self.targets[self.current] or 0
        return not splittable and (self.spread + need / 2 <= bound or (empty and target > 0))

    def splittable(self, path: str) -> bool:
        module = self.tree.modules[path]
        has_parts = any(self.tree.subtree(child) for child in self.tree.children[path])
        return has_parts and self.no_split.entry(module) is None

    def visit(self, path: str) -> None:
        ids = self.unplaced(self.tree.subtree(path))
        splittable = self.splittable(path)
        while ids:
            if self.fits(ids, splittable=splittable):
                self.assign(ids)
                return
            if splittable:
                self.split(path)
                return
            if not self.advance(path, ids, whole=True):
                return

    def split(self, path: str) -> None:
        """Place a module's own tensors, then its children one by one."""
        direct = self.unplaced(self.tree.direct[path])
        while direct and not self.fits(direct, splittable=False):
            if not self.advance(path, direct, whole=False):
                direct = set()
        if direct:
            self.assign(direct)
        for child in self.tree.children[path]:
            self.visit(child)

    def advance(self, path: str, ids: set[int], *, whole: bool) -> bool:
        """Go on to the next device (True). At the last one, the unit is left out when
        collecting (False), else the error says what does not fit and why."""
        if self.current + 1 < len(self.devices):
            self.current += 1
            return True
        if self.overflow is not None:
            self.overflow.append((path, self.need(ids)))
            self.placed.update(dict.fromkeys(ids, -1))
            return False
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

    def disk_blocks(self) -> set[str]:
        """The modules that the map must put on the disk whole: each holds a parameter below
        it, all of which lie on the disk, and it is kept whole (in ``no_split``) or holds
        tensors itself (then the map names it, and a disk entry is read whole). What such a
        block holds besides (a rotary embedding's buffers, a norm without weights) goes with
        it. Other modules (a decoder that holds the layers and a rotary embedding beside them)
        are split instead, so that each layer stays a unit of its own."""
        disk = self.devices.index(DISK)
        params = {k for k, t in self.tree.tensors.items() if isinstance(t, nn.Parameter)}
        return {
            path
            for path, module in self.tree.modules.items()
            if path
            and (self.tree.direct[path] or self.no_split.entry(module) is not None)
            and (mine := self.tree.subtree(path) & params)
            and all(self.placed.get(k) == disk for k in mine)
        }

    def weightless(self, blocks: set[str]) -> set[int]:
        """What the disk tier cannot hold: the buffers held only by modules with no parameter
        in them and in no disk block (``blocks``; a rotary embedding beside the layers would be
        a disk entry with nothing in the checkpoint), and every tensor of a module with an extra
        state (``get_extra_state``, which ``load_into`` cannot leave in the file) and of the
        modules above it, or of the outermost ``no_split`` block around it, kept whole. A tied
        parameter and a persistent buffer may stay: ``load_into`` reads a tie for each holder
        from its one key, and keeps a disk module's buffers in memory."""
        bare = {
            path
            for path in self.tree.modules
            if not any(
                isinstance(self.tree.tensors[k], nn.Parameter) for k in self.tree.subtree(path)
            )
        }
        found = {
            key
            for key, owners in self.tree.owner_modules.items()
            if all(path in bare and not blocks & set(_and_above(path)) for path in owners)
        }
        for path, module in self.tree.modules.items():
            if type(module).get_extra_state is not nn.Module.get_extra_state:
                # it and every module above it that holds tensors itself: a disk entry's whole
                # subtree stays in the file, so none of them may be one
                above = _and_above(path)
                whole = [a for a in above if self.no_split.entry(self.tree.modules[a])]
                if whole:
                    found.update(self.tree.subtree(whole[-1]))
                for name in above:
                    found.update(self.tree.direct.get(name, ()))
        return found

    def keep_off_disk(self) -> None:
        """Move what the disk cannot hold (``weightless``) from the disk to the device that
        runs the disk's modules, as ``dispatch`` picks it: the first accelerator the map
        uses, else the cpu, past its budget by these bytes (buffers, small); and pull onto the
        disk what a disk block holds on another tier (a buffer-only child placed before it)."""
        if DISK not in self.devices:
            return
        disk = self.devices.index(DISK)
        blocks = self.disk_blocks()
        off = self.weightless(blocks)
        for path in blocks:
            for key in self.tree.subtree(path) - off:
                self.placed[key] = disk
        moved = [k for k in off if self.placed.get(k) == disk]
        if not moved:
            return
        used = set(self.placed.values())
        runs = [
            i
            for i, d in enumerate(self.devices)
            if i in used and isinstance(d, torch.device) and is_accelerator(d)
        ]
        host = torch.device("cpu")
        if not runs and host not in self.devices:  # budgets of the disk alone
            self.devices.append(host)
            self.left.append(0)
        home = runs[0] if runs else self.devices.index(host)
        for key in moved:
            self.placed[key] = home
        self.left[home] -= self.need(set(moved))

    def device_map(self) -> dict[str, Place]:
        """The smallest map: children of one device collapse to their parent, except that a
        model wholly on the disk is mapped by its children, since the disk tier streams the
        parts that run (``load_into`` refuses ``{"": "disk"}``)."""
        self.keep_off_disk()
        out: dict[str, Place] = {}
        root_by_parts = bool(self.tree.children[""]) and not self.tree.direct[""]

        def emit(path: str, inherited: Place | None) -> None:
            ids = self.tree.subtree(path)
            devices = {self.devices[self.placed[key]] for key in ids}
            if not devices:
                return
            if len(devices) == 1 and not (path == "" and DISK in devices and root_by_parts):
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


def _and_above(path: str) -> list[str]:
    """``path`` and the path of every module above it, the root's ``""`` last."""
    parts = path.split(".") if path else []
    return [".".join(parts[:n]) for n in range(len(parts), -1, -1)]


_STRATEGIES = ("sequential", "balanced", "balanced_low_0")


class DeviceMap(dict[str, Place]):
    """What ``plan`` returns: a plain dict ``{module name: device}`` (``"disk"`` for the disk
    tier), equal to any dict with the same entries, that also says what it was planned with:
    ``budgets``, the bytes per device as used (after the headroom), and ``headroom``, per
    device the bytes kept free and how that figure was obtained (a ``Headroom``)."""

    budgets: dict[Place, int]
    headroom: dict[Place, Headroom]

    def __init__(
        self,
        entries: Mapping[str, Place] | None = None,
        /,
        *,
        budgets: Mapping[Place, int] | None = None,
        headroom: Mapping[Place, Headroom] | None = None,
    ) -> None:
        super().__init__(entries or {})
        self.budgets = dict(budgets or {})
        self.headroom = dict(headroom or {})


def _strategy(strategy: object) -> str:
    if isinstance(strategy, str) and strategy in _STRATEGIES:
        return strategy
    hint = did_you_mean(str(strategy), _STRATEGIES)
    raise DeviceSpecError(
        f"strategy={strategy!r} is not one plan knows; {hint}use one of "
        f"{', '.join(repr(name) for name in _STRATEGIES)}"
    )


def _budgets_of(
    model: nn.Module, max_memory: object, example_input: Any
) -> tuple[dict[Place, int], dict[Place, Headroom]]:
    """The budgets plan fills, and the headroom each keeps."""
    if isinstance(max_memory, str) and max_memory.strip().lower() == "auto":
        return machine_budgets(model, example_input)
    if example_input is not None:
        raise TorchplaceError(
            "example_input sizes the headroom that max_memory='auto' keeps for activations, "
            "but budgets given as a mapping are used as given; leave room in them yourself, "
            "or pass max_memory='auto'"
        )
    budgets = parse_budgets(max_memory)
    return budgets, {d: Headroom(0, "none: the budgets were given") for d in budgets}


def _level(capacities: list[int], amount: int) -> float:
    """The fill level that spreads ``amount`` over devices of these capacities as evenly as
    they allow: each holds ``min(capacity, level)``."""
    left, count = float(amount), len(capacities)
    for i, capacity in enumerate(sorted(capacities)):
        if capacity * (count - i) >= left:
            return left / (count - i)
        left -= capacity
    return float(max(capacities))


def _targets(budgets: dict[Place, int], total: int, strategy: str) -> list[float | None] | None:
    """Bytes each accelerator should hold under a balanced strategy (None: fill as sequential).

    ``"balanced"`` spreads the model evenly over the accelerators (as evenly as their budgets
    allow); ``"balanced_low_0"`` spreads it over all but the first, which gets only what the
    others cannot hold. The last accelerator, and the cpu and disk after it, are filled as
    sequential: they take whatever is left."""
    accelerators = [d for d in budgets if isinstance(d, torch.device) and d.type != "cpu"]
    if strategy == "sequential" or len(accelerators) < 2:
        return None
    shared = accelerators[1:] if strategy == "balanced_low_0" else accelerators
    amount = min(total, sum(budgets[d] for d in accelerators))
    level = _level([budgets[d] for d in shared], min(amount, sum(budgets[d] for d in shared)))
    targets: dict[Place, float] = {d: min(float(budgets[d]), level) for d in shared}
    if strategy == "balanced_low_0":
        targets[accelerators[0]] = max(amount - sum(targets.values()), 0.0)
    last = accelerators[-1]
    return [None if d == last else targets.get(d) for d in budgets]


def _place(
    tree: ModelTree,
    budgets: dict[Place, int],
    no_split: _NoSplit,
    size: dict[int, int],
    targets: list[float | None] | None,
) -> dict[str, Place]:
    """The device map; a balanced fill that does not fit (whole units that cannot follow the
    even split) falls back to the sequential fill, which packs tighter."""
    planner = _Planner(tree, budgets, no_split, size, targets)
    try:
        planner.visit("")
    except TorchplaceError:
        if targets is None:
            raise
        planner = _Planner(tree, budgets, no_split, size)
        planner.visit("")
    return planner.device_map()


def _refuse_overfull(
    tree: ModelTree,
    budgets: dict[Place, int],
    no_split: _NoSplit,
    size: dict[int, int],
    *,
    dtype: torch.dtype | None,
) -> None:
    """The error for a model whose parameters and buffers exceed all budgets together: the
    shortfall in bytes, and the largest part that finds no room when the devices are filled."""
    total, capacity = sum(size.values()), sum(budgets.values())
    if total <= capacity:
        return
    collecting = _Planner(tree, budgets, no_split, size, collect=True)
    collecting.visit("")
    path, largest = max(collecting.overflow or [("", total)], key=lambda item: item[1])
    part = f"{display(path)} ({type(tree.modules[path]).__name__}, {_format_bytes(largest)})"
    cast = "" if dtype is None else f" in {str(dtype).removeprefix('torch.')}"
    # Host memory is the usual room to grow: suggest raising it when it is budgeted already
    # (adding the cpu again is no advice), else adding it; then the disk. ("auto" budgets end
    # with an open disk, so a model never overfills them.)
    more = (
        "raise a budget by that much (the cpu's, if the machine has the memory)"
        if torch.device("cpu") in budgets
        else "raise a budget by that much, add a device (for example 'cpu')"
    )
    if DISK not in budgets:
        more += ", add a 'disk' budget"
    raise TorchplaceError(
        f"the model does not fit: its parameters and buffers need "
        f"{_format_bytes(total)}{cast} but the budgets hold {_format_bytes(capacity)} "
        f"({describe(budgets)}), {_exact(total - capacity)} short, and the largest part "
        f"left without room is {part}; {more}, or plan with a "
        "smaller dtype"
    )


def _exact(nbytes: int) -> str:
    """``1.5 GiB (1610612736 bytes)``, or ``12 B`` where that is already exact."""
    shown = _format_bytes(nbytes)
    return shown if shown.endswith(" B") else f"{shown} ({nbytes} bytes)"


def plan(
    model: nn.Module,
    /,
    max_memory: MemorySpec = "auto",
    *,
    no_split: NoSplitSpec = (),
    dtype: torch.dtype | str | None = None,
    strategy: str = "sequential",
    example_input: Any = None,
) -> DeviceMap:
    """Assign submodules, in registration order, to devices within budgets: a device map.

    >>> import torch, torchplace
    >>> model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
    >>> device_map = torchplace.plan(model, {"cuda:0": "600KiB", "cuda:1": "2MiB"})
    >>> {name: str(dev) for name, dev in device_map.items()}
    {'0': 'cuda:0', '1': 'cuda:0', '2': 'cuda:1', '3': 'cuda:1'}
    >>> torchplace.plan(model, {"cpu": "10GiB"})
    {'': device(type='cpu')}
    >>> torchplace.plan(model, {"cpu": "600KiB", "disk": "1TB"})
    {'0': device(type='cpu'), '1': device(type='cpu'), '2': 'disk', '3': 'disk'}

    Budgets: a mapping of devices to sizes (``"10GiB"``, ``"512MiB"``, ``"500MB"``, ``"2GB"``,
    or bytes as any integer or a whole real number) that count parameters and buffers and are
    used exactly as given: leave room for activations yourself. Devices fill in the order
    listed, ``"disk"`` always last; an int key N means ``cuda:N``. Or ``"auto"`` (the default):
    each visible accelerator's free memory (read through NVML, which creates no CUDA context,
    else ``mem_get_info``) in index order, then the host's available memory, each less a
    headroom. An accelerator keeps room for activations: a forward of ``example_input``'s, as
    ``estimate`` measures them on fake tensors, or else a tenth of its free memory. The host
    keeps a tenth for the process and the staging of offloaded weights (without an
    accelerator, room for activations as above). An accelerator whose free memory cannot be
    read (MPS), or a host whose available memory cannot be, is left out (named in
    ``.headroom``), and then the disk, open (``budgets["disk"]`` is ``OPEN``): a model larger
    than the accelerators and the host spills its last modules to ``"disk"``, left in the
    checkpoint ``load_into`` reads. The result is a plain ``dict`` that
    also carries ``.budgets`` (bytes per device as used) and ``.headroom`` (per device, a
    ``Headroom`` with ``.bytes`` and ``.how``, how the figure was obtained).

    ``strategy="sequential"`` fills each device before the next. ``"balanced"`` spreads the
    model evenly by bytes over the accelerators, as their budgets allow: a module goes whole to
    a GPU when it ends within that GPU's share, is split when it crosses it (unless in
    ``no_split``), and an unsplittable one goes where its middle falls. ``"balanced_low_0"``
    spreads it over all accelerators but the first, which holds only what the others cannot
    (kept free for what generation adds there). The cpu and the disk are filled after the
    accelerators; should the even split not fit where the sequential fill would, the
    sequential map is returned.

    Submodules are taken in registration order (``model.named_modules()``), as Accelerate's
    ``infer_auto_device_map`` does: plan never runs the model, so a model that registers a
    module before one it runs earlier is still planned correctly, with more device changes per
    forward. A module that does not fit where the last one went is split into its children
    unless it is in ``no_split``: a class name keeps whole the modules whose class has exactly
    that name (as ``no_split_module_classes``), a class its instances, subclasses included;
    entries that match no module are ignored (a warning says when none matches), and
    ``no_split="auto"`` reads a transformers model's ``_no_split_modules``. Modules that hold
    the same tensor (tied weights: an embedding and its head) go where the first of them goes,
    the disk included (each reads the tensor from the file's one key). Every map is one that
    ``load_into`` and ``dispatch`` accept: a module that holds buffers and no parameter (a
    rotary embedding's ``inv_freq``) stays with the disk block it is part of (a layer on disk
    keeps its buffers in memory, its persistent ones read from the file), but one outside any
    has nothing the disk tier keeps: where its turn falls on the disk, it goes to the device
    that runs the disk's modules (the first accelerator of the map, else the cpu), past that
    device's budget by its bytes. So does a module with an extra state (``get_extra_state``),
    with the modules above it, or the ``no_split`` block around it, kept whole.
    ``dtype`` sizes floating tensors as if cast to it. A module whose whole subtree shares a
    device is one entry, and a name covers its submodules unless a longer name overrides it. A
    model that does not fit raises, naming the shortfall in bytes and the largest part left
    without room. Works on skeletons and fake tensors, allocating nothing on the devices it
    plans for.
    """
    try:
        return _device_map(model, max_memory, no_split, dtype, strategy, example_input)
    except TorchplaceError as err:
        raise prefixed(err, "plan()") from err.__cause__


def _device_map(
    model: nn.Module,
    max_memory: MemorySpec,
    no_split: NoSplitSpec,
    dtype: torch.dtype | str | None,
    strategy: str,
    example_input: Any,
) -> DeviceMap:
    """``plan``'s map, its errors without the ``plan(): `` before them."""
    if not isinstance(model, nn.Module):
        raise TorchplaceError(f"maps an nn.Module, not {type(model).__name__}; pass the model")
    chosen = _strategy(strategy)
    cast = _dtype(dtype)
    budgets, headroom = _budgets_of(model, max_memory, example_input)
    classes = _no_split_classes(model, no_split)
    tree = walk_model(model)
    size = {key: nbytes_as(t, cast) for key, t in tree.tensors.items()}
    _refuse_overfull(tree, budgets, classes, size, dtype=cast)
    targets = _targets(budgets, sum(size.values()), chosen)
    device_map = _place(tree, budgets, classes, size, targets)
    return DeviceMap(device_map, budgets=budgets, headroom=headroom)
