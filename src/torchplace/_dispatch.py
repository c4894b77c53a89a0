"""Several devices: ``estimate`` what a model needs, ``plan`` where it goes, ``dispatch`` it there.

The three steps, and what each one promises::

    estimate(model)                 bytes of parameters, buffers, gradients and optimizer state,
                                    per device and dtype; works on skeletons (parameters on meta)
    plan(model, max_memory)         {module name: device}, filling the budgets in the order given
                                    with submodules in execution order; never touches a device
    dispatch(model, device_map)     places each submodule on its device and installs hooks that
                                    move inputs to each submodule as it runs; the output comes
                                    back to the device of the input

A device map names modules (``""`` is the whole model). A tensor goes to the device of the most
specific name that contains it, so ``{"": "cuda:0", "head": "cuda:1"}`` puts everything on
``cuda:0`` except ``head``. ``undispatch`` removes every hook without moving anything, and
``is_dispatched`` tells whether a model carries them: ``torchplace.move`` gathers a dispatched
model back onto one device with these two.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._devices import device as _device
from ._errors import DeviceMismatchError, DeviceSpecError, MoveError, TorchplaceError
from ._inspect import format_bytes as _format_bytes
from ._tree import Located, map_tensors

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "Estimate",
    "EstimateRow",
    "dispatch",
    "estimate",
    "is_dispatched",
    "plan",
    "undispatch",
]

Size = int | str  # bytes, or "10GiB", "500MB"
MemorySpec = Mapping[str | int | torch.device, Size]  # device -> budget
DeviceMapSpec = Mapping[str, str | int | torch.device]  # module name -> device

# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def _parse_size(value: object, where: str) -> int:
    """Bytes from ``1024``, ``"500MB"`` (10**6) or ``"10GiB"`` (2**30); ``where`` names it."""
    if isinstance(value, bool):
        raise DeviceSpecError(f"{where}: a budget is a size like '10GiB' or bytes, not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise DeviceSpecError(f"{where}: the budget {value} is negative; give bytes >= 0")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match is not None:
            unit = match.group(2).lower()
            if unit in _UNITS:
                return int(float(match.group(1)) * _UNITS[unit])
            if unit in ("k", "m", "g", "t"):
                raise DeviceSpecError(
                    f"{where}: the size {value!r} has no unit in bytes; write "
                    f"'{match.group(1)}{unit.upper()}iB' (powers of 1024) or "
                    f"'{match.group(1)}{unit.upper()}B' (powers of 1000)"
                )
    raise DeviceSpecError(
        f"{where}: cannot read the size {value!r}; write bytes as an int or a string such as "
        "'10GiB', '512MiB' (powers of 1024) or '500MB', '2GB' (powers of 1000)"
    )


# ---------------------------------------------------------------------------------------------
# Walking a model: every module under every name, and who owns each tensor
# ---------------------------------------------------------------------------------------------


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _display(path: str) -> str:
    """How messages name a module or tensor: ``model.encoder.0`` (``model`` for the root)."""
    return f"model.{path}" if path else "model"


@dataclasses.dataclass
class _Tree:
    """A model's modules under every name they have, and the tensors each holds directly."""

    modules: dict[str, nn.Module]  # path -> module, in registration (execution) order
    children: dict[str, list[str]]  # path -> child paths
    direct: dict[str, list[int]]  # path -> ids of the tensors the module itself holds
    tensors: dict[int, torch.Tensor]  # id -> tensor
    owners: dict[int, list[str]]  # id -> qualified names (``lm_head.weight``), first first
    owner_modules: dict[int, list[str]]  # id -> paths of the modules that hold it directly

    subtrees: dict[str, frozenset[int]] = dataclasses.field(default_factory=dict)

    def subtree(self, path: str) -> frozenset[int]:
        """Ids of every tensor held by the module at ``path`` or any module under it."""
        found = self.subtrees.get(path)
        if found is None:
            ids = set(self.direct[path])
            for child in self.children[path]:
                ids |= self.subtree(child)
            found = self.subtrees[path] = frozenset(ids)
        return found


def _walk(model: nn.Module) -> _Tree:
    tree = _Tree({}, {}, {}, {}, {}, {})
    active: set[int] = set()

    def visit(path: str, module: nn.Module) -> None:
        if id(module) in active:  # a module that contains itself; Module.to() would loop too
            raise TorchplaceError(f"{_display(path)} contains itself; a model must be a tree")
        active.add(id(module))
        tree.modules[path] = module
        tree.children[path] = []
        tree.direct[path] = []
        for kind in ("_parameters", "_buffers"):
            slots: dict[str, torch.Tensor | None] = getattr(module, kind)
            for name, tensor in slots.items():
                if tensor is None:
                    continue
                key = id(tensor)
                tree.tensors[key] = tensor
                tree.owners.setdefault(key, []).append(_join(path, name))
                owners = tree.owner_modules.setdefault(key, [])
                if path not in owners:
                    owners.append(path)
                if key not in tree.direct[path]:
                    tree.direct[path].append(key)
        for name, child in module._modules.items():
            if child is None:
                continue
            child_path = _join(path, name)
            tree.children[path].append(child_path)
            visit(child_path, child)
        active.discard(id(module))

    visit("", model)
    return tree


def _nbytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes a tensor takes, or would take in ``dtype`` (floating tensors only)."""
    if dtype is not None and tensor.is_floating_point():
        return tensor.numel() * dtype.itemsize
    return tensor.numel() * tensor.element_size()


# ---------------------------------------------------------------------------------------------
# estimate
# ---------------------------------------------------------------------------------------------

# Optimizer name -> (state tensors shaped like each parameter, whether a scalar ``step`` is kept)
_OPTIMIZERS: dict[str, tuple[int, bool]] = {
    "sgd": (0, False),
    "sgd-momentum": (1, False),
    "adam": (2, True),
    "adamw": (2, True),
    "adagrad": (1, True),
}
_OPTIMIZER_ALIASES = {"momentum": "sgd-momentum", "sgd_momentum": "sgd-momentum", "none": None}


@dataclasses.dataclass(frozen=True)
class EstimateRow:
    """Bytes on one device in one dtype, split by what holds them."""

    device: torch.device
    dtype: torch.dtype
    parameters: int = 0
    buffers: int = 0
    gradients: int = 0
    optimizer_state: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.buffers + self.gradients + self.optimizer_state


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What a model needs for training: ``rows`` per device and dtype, and their totals.

    >>> import torch, torchplace
    >>> found = torchplace.estimate(torch.nn.Linear(1000, 1000), optimizer="adam")
    >>> found.parameters, found.gradients, found.optimizer_state > 2 * found.parameters
    (4004000, 4004000, True)

    ``str(estimate)`` is a readable table, ``to_dict()`` is JSON-able, and the object renders
    in ``rich``.
    """

    rows: tuple[EstimateRow, ...]
    optimizer: str | None
    grads: bool
    parameter_count: int
    trainable_count: int

    @property
    def parameters(self) -> int:
        return sum(row.parameters for row in self.rows)

    @property
    def buffers(self) -> int:
        return sum(row.buffers for row in self.rows)

    @property
    def gradients(self) -> int:
        return sum(row.gradients for row in self.rows)

    @property
    def optimizer_state(self) -> int:
        return sum(row.optimizer_state for row in self.rows)

    @property
    def total(self) -> int:
        return sum(row.total for row in self.rows)

    def by_device(self) -> dict[torch.device, int]:
        """Total bytes per device, in the order the rows list them."""
        totals: dict[torch.device, int] = {}
        for row in self.rows:
            totals[row.device] = totals.get(row.device, 0) + row.total
        return totals

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form: every row and the totals, in bytes."""
        return {
            "optimizer": self.optimizer,
            "grads": self.grads,
            "parameter_count": self.parameter_count,
            "trainable_count": self.trainable_count,
            "rows": [
                {
                    "device": str(row.device),
                    "dtype": str(row.dtype).removeprefix("torch."),
                    "parameters": row.parameters,
                    "buffers": row.buffers,
                    "gradients": row.gradients,
                    "optimizer_state": row.optimizer_state,
                    "total": row.total,
                }
                for row in self.rows
            ],
            "total": self.total,
            "by_device": {str(dev): total for dev, total in self.by_device().items()},
        }

    def _title(self) -> str:
        optimizer = "no optimizer" if self.optimizer is None else f"{self.optimizer} state"
        grads = "gradients" if self.grads else "no gradients"
        return (
            f"Estimate: {self.parameter_count:,} parameters ({self.trainable_count:,} trainable), "
            f"{grads}, {optimizer}"
        )

    def __rich__(self) -> Table:
        from rich.table import Table  # rich loads only when rendering

        table = Table(title=self._title(), title_justify="left")
        for header in ("device", "dtype", "parameters", "buffers", "gradients", "optimizer"):
            table.add_column(header, justify="left" if header in ("device", "dtype") else "right")
        table.add_column("total", justify="right", style="bold")
        for row in self.rows:
            table.add_row(
                str(row.device),
                str(row.dtype).removeprefix("torch."),
                *(
                    _format_bytes(n)
                    for n in (
                        row.parameters,
                        row.buffers,
                        row.gradients,
                        row.optimizer_state,
                        row.total,
                    )
                ),
            )
        totals = self.by_device()
        for dev, total in totals.items() if len(totals) > 1 else ():
            table.add_row(f"{dev} total", "", "", "", "", "", _format_bytes(total), style="dim")
        table.add_row("total", "", "", "", "", "", _format_bytes(self.total), end_section=True)
        return table

    def __str__(self) -> str:
        from rich.console import Console  # rich loads only when rendering

        buffer = io.StringIO()
        console = Console(file=buffer, width=100, color_system=None, force_terminal=False)
        console.print(self)
        return "\n".join(line.rstrip() for line in buffer.getvalue().strip("\n").splitlines())


def _optimizer_name(optimizer: str | None) -> str | None:
    if optimizer is None:
        return None
    if not isinstance(optimizer, str):
        raise DeviceSpecError(
            f"optimizer={optimizer!r}: give the optimizer's name as a string, one of "
            f"{', '.join(repr(n) for n in _OPTIMIZERS)} or None"
        )
    text = optimizer.strip().lower()
    name = _OPTIMIZER_ALIASES.get(text, text)
    if name is not None and name not in _OPTIMIZERS:
        guess = difflib.get_close_matches(name, list(_OPTIMIZERS), n=1)
        hint = f"did you mean {guess[0]!r}? " if guess else ""
        raise DeviceSpecError(
            f"optimizer={optimizer!r} is not one estimate knows; {hint}use one of "
            f"{', '.join(repr(n) for n in _OPTIMIZERS)}, 'momentum' or None"
        )
    return name


def estimate(
    model: nn.Module, /, *, optimizer: str | None = "adam", grads: bool = True
) -> Estimate:
    """Bytes a model needs to train: parameters, buffers, gradients and optimizer state.

    >>> import torch, torchplace
    >>> est = torchplace.estimate(torch.nn.Linear(1000, 1000), optimizer="adam")
    >>> est.parameters, est.gradients, est.optimizer_state
    (4004000, 4004000, 8008008)
    >>> skeleton = torch.nn.Linear(1000, 1000, device="meta")
    >>> torchplace.estimate(skeleton, optimizer="sgd").total
    8008000

    Counted per device and dtype, each tied parameter once. Gradients and optimizer state are
    counted for parameters that require grad, on their parameter's device and dtype, as PyTorch
    creates them: ``"sgd"`` keeps none, ``"sgd-momentum"`` (or ``"momentum"``) one buffer per
    parameter, ``"adam"``/``"adamw"`` two, ``"adagrad"`` one; Adam and Adagrad also keep a scalar
    ``step`` per parameter on the CPU. ``optimizer=None`` counts no state, ``grads=False`` no
    gradients (inference). A skeleton (parameters on ``meta``) is sized like the real model.
    Activations are not counted: they depend on the batch.
    """
    try:
        name = _optimizer_name(optimizer)
        if not isinstance(model, nn.Module):
            raise TorchplaceError(
                f"estimate() sizes an nn.Module, not {type(model).__name__}; pass the model"
            )
        copies, has_step = _OPTIMIZERS[name] if name is not None else (0, False)
        rows: dict[tuple[torch.device, torch.dtype], dict[str, int]] = {}

        def add(dev: torch.device, dtype: torch.dtype, field: str, nbytes: int) -> None:
            row = rows.setdefault((dev, dtype), {})
            row[field] = row.get(field, 0) + nbytes

        count = trainable = 0
        step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for param in model.parameters():  # each tied parameter once
            nbytes = _nbytes(param)
            count += param.numel()
            add(param.device, param.dtype, "parameters", nbytes)
            if not param.requires_grad:
                continue
            trainable += param.numel()
            if grads:
                add(param.device, param.dtype, "gradients", nbytes)
            if copies:
                add(param.device, param.dtype, "optimizer_state", copies * nbytes)
            if has_step:
                add(torch.device("cpu"), step_dtype, "optimizer_state", step_dtype.itemsize)
        for buffer in model.buffers():
            add(buffer.device, buffer.dtype, "buffers", _nbytes(buffer))
        return Estimate(
            rows=tuple(EstimateRow(dev, dtype, **fields) for (dev, dtype), fields in rows.items()),
            optimizer=name,
            grads=grads,
            parameter_count=count,
            trainable_count=trainable,
        )
    except TorchplaceError as err:
        raise type(err)(f"estimate(): {err}") from err.__cause__


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------

_PLANNABLE_WORDS = {
    "auto": "plan never looks at the machine",
    "best": "plan never looks at the machine",
    "gpu": "plan never looks at the machine",
    "disk": "offloading to disk is not supported",
}


def _budget_device(key: object) -> torch.device:
    """A budget key as an explicit device, parsed without asking whether it exists."""
    where = f"max_memory[{key!r}]"
    if isinstance(key, bool):
        raise DeviceSpecError(f"{where}: a budget key is a device like 'cuda:0', not {key!r}")
    if isinstance(key, int):
        if key < 0:
            raise DeviceSpecError(f"{where}: device index {key} is negative; use 'cuda:0' and up")
        return torch.device("cuda", key)
    if isinstance(key, torch.device):
        parsed = key
    elif isinstance(key, str):
        text = key.strip().lower()
        if text in _PLANNABLE_WORDS:
            raise DeviceSpecError(
                f"{where}: {_PLANNABLE_WORDS[text]}, so it needs a named device such as "
                "'cuda:0', 'cuda:1' or 'cpu'"
            )
        try:
            parsed = torch.device(text)
        except (RuntimeError, ValueError):
            guess = difflib.get_close_matches(text.split(":")[0], ["cpu", "cuda", "meta", "xpu"])
            hint = f"did you mean {guess[0]!r}? " if guess else ""
            raise DeviceSpecError(
                f"{where}: unknown device {key!r}; {hint}budget keys are devices such as "
                "'cuda:0', 'cuda:1', 'xpu:0', 'mps', 'cpu' or an int N for 'cuda:N'"
            ) from None
    else:
        raise DeviceSpecError(
            f"{where}: a budget key is a device name, an int or a torch.device, "
            f"not {type(key).__name__}"
        )
    if parsed.type in ("cpu", "meta"):
        if parsed.index not in (None, 0):
            raise DeviceSpecError(f"{where}: the {parsed.type} device has no index {parsed.index}")
        return torch.device(parsed.type)
    return torch.device(parsed.type, 0 if parsed.index is None else parsed.index)


def _parse_budgets(max_memory: object) -> dict[torch.device, int]:
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise DeviceSpecError(
            f"max_memory must be a non-empty dict of budgets such as "
            f"{{'cuda:0': '10GiB', 'cpu': '64GiB'}}, not {max_memory!r}"
        )
    budgets: dict[torch.device, int] = {}
    spelled: dict[torch.device, object] = {}
    for key, value in max_memory.items():
        dev = _budget_device(key)
        if dev in budgets:
            raise DeviceSpecError(
                f"max_memory names {dev} twice ({spelled[dev]!r} and {key!r}); give it one budget"
            )
        budgets[dev] = _parse_size(value, f"max_memory[{key!r}]")
        spelled[dev] = key
    return budgets


def _no_split_classes(model: nn.Module, no_split: Iterable[type | str]) -> set[str]:
    """Names of the classes never split; a name given as a string must exist in the model."""
    if isinstance(no_split, (str, type)):
        no_split = [no_split]
    present = sorted({type(m).__name__ for m in model.modules()})
    names: set[str] = set()
    for entry in no_split:
        if isinstance(entry, type):
            names.add(entry.__name__)
        elif isinstance(entry, str):
            if entry not in present:
                guess = difflib.get_close_matches(entry, present, n=1)
                hint = f"did you mean {guess[0]!r}? " if guess else ""
                raise DeviceSpecError(
                    f"no_split: no module of class {entry!r} is in the model; {hint}"
                    f"classes present: {', '.join(present)}"
                )
            names.add(entry)
        else:
            raise DeviceSpecError(
                f"no_split: {entry!r} is neither a module class nor a class name; "
                "pass classes (no_split=[Block]) or their names (no_split=['Block'])"
            )
    return names


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
    """Fills devices in the order of the budgets with units of tensors in execution order."""

    def __init__(
        self,
        tree: _Tree,
        budgets: dict[torch.device, int],
        no_split: set[str],
        dtype: torch.dtype | None,
    ) -> None:
        self.tree = tree
        self.devices = list(budgets)
        self.budgets = budgets
        self.left = [budgets[d] for d in self.devices]
        self.current = 0
        self.no_split = no_split
        self.size = {key: _nbytes(t, dtype) for key, t in tree.tensors.items()}
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
        return has_parts and type(module).__name__ not in self.no_split

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
        what = (
            f"{_display(path)} ({name})"
            if whole
            else f"the tensors {_display(path)} ({name}) holds itself"
        )
        why = (
            f"{name} is in no_split"
            if whole and name in self.no_split
            else "it has no submodules to split"
            if whole
            else "they cannot be split"
        )
        outside = self.tree.subtree(path) if whole else frozenset(self.tree.direct[path])
        partners = sorted(
            {p for key in ids - outside for p in self.tree.owner_modules[key]} - {path}
        )
        if partners:
            shown = ", ".join(_display(p) for p in partners[:3])
            why += f", and tied tensors bring {shown} along"
        fixes = "or add a device after it" + (
            f", or take {name} out of no_split" if name in self.no_split else ""
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
                emit(child, inherited)

        emit("", None)
        return out


def plan(
    model: nn.Module,
    /,
    max_memory: MemorySpec,
    *,
    no_split: Iterable[type | str] = (),
    dtype: torch.dtype | str | None = None,
) -> dict[str, torch.device]:
    """Assign submodules, in execution order, to devices within budgets: a device map.

    >>> import torch, torchplace
    >>> model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
    >>> device_map = torchplace.plan(model, {"cuda:0": "600KiB", "cuda:1": "2MiB"})
    >>> {name: str(dev) for name, dev in device_map.items()}
    {'0': 'cuda:0', '1': 'cuda:0', '2': 'cuda:1', '3': 'cuda:1'}
    >>> torchplace.plan(model, {"cpu": "10GiB"})
    {'': device(type='cpu')}

    Budgets (``"10GiB"``, ``"512MiB"``, ``"500MB"``, ``"2GB"`` or bytes) count parameters and
    buffers and are used exactly as given: leave room for activations yourself. Devices fill
    in the order the budgets are listed; an int key N means ``cuda:N``. Submodules are taken
    in registration order, which is the order a sequential model or a transformer stack runs
    them, and a module that does not fit where the last one went is split into its children,
    unless its class is in ``no_split`` (classes or class names). Modules that hold the same
    tensor (tied weights) share a device: the group goes where its first member goes. ``dtype``
    sizes floating tensors as if cast to it. The map is the smallest that says it: a module
    whose whole subtree shares a device is one entry, and a name covers its submodules unless
    a longer name overrides it. Works on skeletons and fake tensors; no device is touched.
    """
    try:
        if not isinstance(model, nn.Module):
            raise TorchplaceError(
                f"plan() maps an nn.Module, not {type(model).__name__}; pass the model"
            )
        budgets = _parse_budgets(max_memory)
        classes = _no_split_classes(model, no_split)
        planner = _Planner(_walk(model), budgets, classes, _dtype(dtype))
        total = sum(planner.size.values())
        capacity = sum(budgets.values())
        if total > capacity:
            listed = ", ".join(f"{d}: {_format_bytes(b)}" for d, b in budgets.items())
            cast_to = _dtype(dtype)
            cast = "" if cast_to is None else f" in {str(cast_to).removeprefix('torch.')}"
            raise TorchplaceError(
                f"the model does not fit: its parameters and buffers need "
                f"{_format_bytes(total)}{cast} but the budgets hold {_format_bytes(capacity)} "
                f"({listed}), {_format_bytes(total - capacity)} short; raise a budget by that "
                "much, add a device (for example 'cpu'), or plan with a smaller dtype"
            )
        planner.visit("")
        return planner.device_map()
    except TorchplaceError as err:
        raise type(err)(f"plan(): {err}") from err.__cause__


# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------

_MARK = "_torchplace_dispatch"
_DEVICE_ERROR = re.compile(
    r"same device|expected device|two devices|different devices|wrong device|"
    r"expected all tensors|to be on the device|is on device",
    re.IGNORECASE,
)


@dataclasses.dataclass
class _Installed:
    """What dispatch put on one module, so that undispatch can take it all away."""

    handles: list[torch.utils.hooks.RemovableHandle]
    wrapped_forward: bool = False
    previous_forward: Any = None  # an instance-level forward that was there before, if any


def _to(obj: Any, dev: torch.device, *, keep_meta: bool = False) -> Any:
    """``obj`` with every tensor on ``dev``, by the collection rules of ``move`` (objects with
    their own ``.to`` use it); containers with nothing to move come back as the same object.
    With ``keep_meta``, meta tensors stay where they are. Errors surface as they were raised."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.device == dev or (keep_meta and t.is_meta):
            return t
        return t.to(dev)

    try:
        return map_tensors(obj, one, to=lambda o: o.to(dev), root="input")
    except Located as located:
        raise located.cause from located.cause.__cause__


def _first_device(obj: Any) -> torch.device | None:
    """The device of the first tensor in nested inputs, or None when there is none."""
    if isinstance(obj, torch.Tensor):
        return obj.device
    items: Iterable[Any] = ()
    if isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, Mapping):
        items = obj.values()
    for item in items:
        found = _first_device(item)
        if found is not None:
            return found
    return None


def _parse_device_map(tree: _Tree, device_map: object) -> dict[str, torch.device]:
    if not isinstance(device_map, Mapping):
        raise DeviceSpecError(
            f"device_map must be a dict of module name -> device such as "
            f"{{'encoder': 'cuda:0', 'decoder': 'cuda:1'}} (plan() makes one), "
            f"not {type(device_map).__name__}"
        )
    names = list(tree.modules)
    entries: dict[str, torch.device] = {}
    for name, spec in device_map.items():
        where = f"device_map[{name!r}]"
        if not isinstance(name, str):
            raise DeviceSpecError(f"{where}: keys are module names (strings), '' for the model")
        if name not in tree.modules:
            owned = [key for key, qualified in tree.owners.items() if name in qualified]
            if owned:
                module = name.rpartition(".")[0]
                raise DeviceSpecError(
                    f"{where}: {_display(name)} is a tensor, not a module; map the module that "
                    f"holds it, {module!r}"
                )
            guess = difflib.get_close_matches(name, names, n=3)
            hint = f"did you mean {' or '.join(repr(g) for g in guess)}? " if guess else ""
            raise DeviceSpecError(
                f"{where}: the model has no submodule {name!r}; {hint}keys are names from "
                "model.named_modules(), and '' is the whole model"
            )
        try:
            entries[name] = _device(spec)
        except TorchplaceError as err:
            raise type(err)(f"{where}: {err}") from None
    return entries


def _resolve(path: str, entries: dict[str, torch.device]) -> torch.device | None:
    """The device of the most specific map entry that contains ``path``."""
    probe = path
    while True:
        if probe in entries:
            return entries[probe]
        if not probe:
            return None
        probe = probe.rpartition(".")[0]


def _targets(tree: _Tree, entries: dict[str, torch.device]) -> dict[int, torch.device]:
    """Each tensor's device under the map; errors for uncovered tensors and split ties."""
    targets: dict[int, torch.device] = {}
    uncovered: list[str] = []
    for key, owners in tree.owner_modules.items():
        devices = {path: _resolve(path, entries) for path in owners}
        found = {dev for dev in devices.values() if dev is not None}
        if len(found) > 1:
            names = tree.owners[key]
            placed = ", ".join(f"{_display(p)} on {d}" for p, d in devices.items())
            raise DeviceSpecError(
                f"{_display(names[0])} is tied to {', '.join(map(_display, names[1:]))} but the "
                f"map splits its holders ({placed}); one tensor has one device, so map "
                f"{' and '.join(repr(p) for p in owners)} to the same device"
            )
        if None in devices.values():
            uncovered.append(tree.owners[key][0])
            continue
        (targets[key],) = found
    if uncovered:
        shown = ", ".join(_display(n) for n in uncovered[:5])
        more = f" and {len(uncovered) - 5} more" if len(uncovered) > 5 else ""
        first = uncovered[0].rpartition(".")[0]
        raise DeviceSpecError(
            f"the device map leaves {shown}{more} without a device; add an entry for "
            f"{first!r} or one of its parents ('' covers the whole model)"
        )
    return targets


def _place(tree: _Tree, targets: dict[int, torch.device]) -> None:
    """Move each tensor once to its target, keeping ties and identity; all or nothing."""
    from ._move import place

    place(tree.modules[""], targets)


# The hooks are small classes rather than closures, so a dispatched model can still be
# deep-copied (each copy calling its own modules) and pickled.


class _MoveInputs:
    """Forward pre-hook: every tensor input to ``device``; on the model itself it also notes
    the device of the first input, so that the output can go back there."""

    def __init__(
        self, device: torch.device | None, origins: list[torch.device | None] | None, path: str
    ) -> None:
        self.device = device
        self.origins = origins
        self.path = path

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Any] | None:
        if self.origins is not None:
            self.origins.append(_first_device((args, kwargs)))
        if self.device is None:
            return None
        try:
            return _to(args, self.device), _to(kwargs, self.device)
        except NotImplementedError as err:  # "Cannot copy out of meta tensor"
            if _first_device((args, kwargs)) != torch.device("meta"):
                raise
            raise MoveError(
                f"{_display(self.path)} ({type(module).__name__}) runs on {self.device} but got "
                "an input on meta, which holds no data (an earlier part of the model is on "
                f"meta); map the parts before it to meta as well, or load real weights"
            ) from err


class _ReturnOutput:
    """Forward hook on the model (also run when forward raises): the output goes back to the
    device of the input; outputs on ``meta`` hold no data and stay."""

    def __init__(self, origins: list[torch.device | None]):
        self.origins = origins

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        origin = self.origins.pop() if self.origins else None
        if origin is None or output is None:
            return None
        return _to(output, origin, keep_meta=True)


class _ExplainClash:
    """Stands in for ``module.forward``: a device clash raised inside it is explained.

    The innermost one that sees the clash explains it; the ones around it let it through.
    """

    def __init__(self, module: nn.Module, previous: Any, message: str) -> None:
        self.module = module
        self.previous = previous  # an instance-level forward that was there before, or None
        self.message = message  # "{error}" stands for the first line of PyTorch's message
        self.__doc__ = getattr(module.forward, "__doc__", None)

    @property
    def __wrapped__(self) -> Any:
        """What this stands in for, so that ``inspect.signature(module.forward)`` still works."""
        if self.previous is not None:
            return self.previous
        return type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            if self.previous is not None:
                return self.previous(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)
        except TorchplaceError:
            raise
        except RuntimeError as err:
            if not _DEVICE_ERROR.search(str(err)):
                raise
            raise DeviceMismatchError(self.message.replace("{error}", _first_line(err))) from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _split_message(path: str, name: str, spread: str) -> str:
    where = f"map '{path}' to a single device" if path else "give the model one device ('')"
    return (
        f"{_display(path)} ({name}) is split across devices ({spread}) and its own forward "
        "combined tensors from different devices ({error}). dispatch moves the inputs of each "
        "submodule, not the results a parent mixes itself; keep "
        f"{name} on one device with plan(model, max_memory, no_split=[{name!r}]), or {where}"
    )


def _whole_message(path: str, name: str, dev: torch.device) -> str:
    return (
        f"{_display(path)} ({name}) runs on {dev}, where dispatch put its parameters and "
        "buffers and moved its inputs, yet its forward met a tensor on another device "
        "({error}). That tensor is one dispatch cannot see: a plain tensor attribute "
        "(register it with self.register_buffer(...)), or a tensor made on a fixed device "
        "inside forward (make it on the device of the input instead)"
    )


def _wrap(module: nn.Module, installed: _Installed, message: str) -> None:
    if type(module).forward is nn.Module.forward:  # containers such as ModuleList never run
        return
    installed.previous_forward = module.__dict__.get("forward")
    module.__dict__["forward"] = _ExplainClash(module, installed.previous_forward, message)
    installed.wrapped_forward = True


def _spread(tree: _Tree, path: str, targets: dict[int, torch.device]) -> str:
    parts: list[str] = []
    for child in tree.children[path]:
        devices = sorted({str(targets[k]) for k in tree.subtree(child)})
        if devices:
            parts.append(f"{child} on {' and '.join(devices)}")
    if tree.direct[path]:
        parts.insert(0, f"its own tensors on {targets[tree.direct[path][0]]}")
    shown = parts[:4] + ([f"{len(parts) - 4} more"] if len(parts) > 4 else [])
    return ", ".join(shown)


def _hook(tree: _Tree, targets: dict[int, torch.device]) -> None:
    """Hooks where devices change: the top of each one-device subtree inside a split parent,
    each split parent that holds tensors itself, and the model (to bring the output back)."""
    devices_of = {path: {targets[key] for key in tree.subtree(path)} for path in tree.modules}
    done: set[int] = set()
    origins: list[torch.device | None] = []
    for path, module in tree.modules.items():
        if id(module) in done:
            continue
        done.add(id(module))
        parent = path.rpartition(".")[0] if path else None
        devices = devices_of[path]
        installed = _Installed(handles=[])
        target: torch.device | None = None
        name = type(module).__name__
        if len(devices) == 1 and (parent is None or len(devices_of[parent]) > 1):
            (target,) = devices
            _wrap(module, installed, _whole_message(path, name, target))
        elif len(devices) > 1:
            if tree.direct[path]:
                target = targets[tree.direct[path][0]]
            _wrap(module, installed, _split_message(path, name, _spread(tree, path, targets)))
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
                module.register_forward_pre_hook(_MoveInputs(target, None, path), with_kwargs=True)
            )
        if installed.handles or installed.wrapped_forward:
            module.__dict__[_MARK] = installed


def dispatch(model: nn.Module, device_map: DeviceMapSpec, /) -> nn.Module:
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
    device. Parameters keep their identity where PyTorch allows it. Inputs (positional,
    keyword, nested in lists, tuples and dicts) are moved to each submodule's device before it
    runs, and the model's output comes back to the device of its first tensor input (outputs on
    ``meta`` hold no data and stay there). Dispatching again replaces the hooks;
    ``torchplace.move(model, device)`` gathers the model onto one device and removes them.
    If a parent's own code mixes outputs of children on different devices, the error names it
    and points at ``plan(..., no_split=[...])``.
    """
    try:
        if not isinstance(model, nn.Module):
            raise TorchplaceError(
                f"dispatch() places an nn.Module, not {type(model).__name__}; pass the model"
            )
        undispatch(model)
        tree = _walk(model)
        entries = _parse_device_map(tree, device_map)
        targets = _targets(tree, entries)
        _place(tree, targets)
        _hook(tree, targets)
        return model
    except TorchplaceError as err:
        raise type(err)(f"dispatch(): {err}") from err.__cause__


def _marked(module: nn.Module) -> Iterator[nn.Module]:
    for sub in module.modules():
        if _MARK in sub.__dict__:
            yield sub


def is_dispatched(module: nn.Module, /) -> bool:
    """Whether ``dispatch`` left hooks on ``module`` or any of its submodules.

    >>> import torch, torchplace
    >>> from torchplace._dispatch import is_dispatched
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> is_dispatched(model), is_dispatched(torchplace.dispatch(model, {"": "cpu"}))
    (False, True)
    """
    return next(_marked(module), None) is not None


def undispatch(module: nn.Module, /) -> None:
    """Remove every hook and marker ``dispatch`` installed, moving no tensor.

    >>> import torch, torchplace
    >>> from torchplace._dispatch import is_dispatched, undispatch
    >>> model = torchplace.dispatch(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"": "cpu"})
    >>> undispatch(model)
    >>> is_dispatched(model)
    False
    """
    for sub in list(_marked(module)):
        installed: _Installed = sub.__dict__.pop(_MARK)
        for handle in installed.handles:
            handle.remove()
        if installed.wrapped_forward:
            if installed.previous_forward is None:
                sub.__dict__.pop("forward", None)
            else:
                sub.__dict__["forward"] = installed.previous_forward
