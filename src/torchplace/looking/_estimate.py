"""How much memory a model needs to train: ``estimate`` counts or fakes, it never allocates.

``estimate(model)`` gives the bytes of parameters, buffers, gradients and optimizer state, per
device and dtype, as an ``Estimate``; it works on skeletons (parameters on meta). ``plan`` sizes
tensors with the same ``_tensor_size.nbytes_as``, so a budget and an estimate count bytes alike.
Given an ``example_input``, it also runs one step on fake tensors (``_fake_step``) and adds the
step's peak per device, split by kind and by module; where that cannot be done here, the
``Estimate`` says why in ``fallback`` and keeps the counting.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import math
import os
import shlex
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch
from torch import nn

from .._errors import (
    DeviceSpecError,
    TorchplaceError,
    first_line,
    prefixed,
    user_stacklevel,
)
from .._model_walk import compiled_inner, display
from .._sizes import format_bytes as _format_bytes
from .._suggest import did_you_mean
from .._tensor_size import nbytes_as
from ..moving._offloaded import disk_placeholders, homes, outside_units
from ._fake_checks import real_kernel_refuses
from ._fake_step import (
    KINDS,
    ModulePeak,
    OperatorFailed,
    StepMeasure,
    Unmeasurable,
    measure_step,
)
from ._sigint import sigint_deferred
from ._user_opt import state_bytes

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "Estimate",
    "EstimateRow",
    "ModulePeak",
    "PeakRow",
    "estimate",
]

_STEPS = ("train", "forward")
# Column headings of the peak table, short enough for 100 columns.
_SHORT = {"parameters": "params", "gradients": "grads", "optimizer_state": "optimizer"}
_SHORT.update(activations="activations", temporaries="temps", workspace="cuBLAS")


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
class PeakRow:
    """One device at the peak of a measured step: what each kind held then, and the total."""

    device: torch.device
    parameters: int = 0
    buffers: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    temporaries: int = 0
    workspace: int = 0
    inputs: int = 0
    total: int = 0


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What a model needs for training: ``rows`` per device and dtype, and their totals.

    >>> import torch, torchplace
    >>> found = torchplace.estimate(torch.nn.Linear(1000, 1000), optimizer="adam")
    >>> found.parameters, found.gradients, found.optimizer_state > 2 * found.parameters
    (4004000, 4004000, True)

    ``str(estimate)`` is a readable table, ``to_dict()`` is JSON-able, and the object renders
    in ``rich``. A measured step (``step`` is ``"train"`` or ``"forward"``) adds ``peaks`` (per
    device, each kind's bytes at that device's peak), ``activations`` and ``temporaries`` (the
    most each held at once) and ``modules`` (the modules that ran, highest peak first); when it
    could not be measured, ``fallback`` says why and only the counting is there.

    ``on_disk``: the bytes of weights a device map left on ``"disk"`` (read from the checkpoint
    while their module runs). They are in no row, since no device holds them between calls,
    and no gradients or optimizer state is counted for them (they are read afresh each call);
    a measured step counts them on their module's device while it runs, among its activations
    (tensors made during the step). A training step of an offloaded model is not measured
    (refused): estimate the model before it is dispatched, where a skeleton sizes like it.
    """

    rows: tuple[EstimateRow, ...]
    optimizer: str | None
    grads: bool
    parameter_count: int
    trainable_count: int
    step: str | None = None
    peaks: tuple[PeakRow, ...] = ()
    activations: int = 0
    temporaries: int = 0
    modules: tuple[ModulePeak, ...] = ()
    fallback: str | None = None
    on_disk: int = 0
    first_step_peak: int | None = None

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

    @property
    def peak(self) -> int:
        """The step's peak: each device's peak, summed; ``total`` when no step was measured."""
        return sum(row.total for row in self.peaks) if self.peaks else self.total

    def peak_by_device(self) -> dict[torch.device, int]:
        """Each device's peak in the measured step; ``by_device()`` when none was measured."""
        if not self.peaks:
            return self.by_device()
        return {row.device: row.total for row in self.peaks}

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
            "on_disk": self.on_disk,
            **self._step_dict(),
        }

    def _step_dict(self) -> dict[str, Any]:
        """The measured step's part of ``to_dict()`` (empty when none was asked for)."""
        if self.step is None:
            return {}
        return {
            "step": self.step,
            "fallback": self.fallback,
            "peak": self.peak,
            "first_step_peak": self.first_step_peak,
            "peak_by_device": {str(dev): n for dev, n in self.peak_by_device().items()},
            "activations": self.activations,
            "temporaries": self.temporaries,
            "peaks": [{**dataclasses.asdict(row), "device": str(row.device)} for row in self.peaks],
            "modules": [{**dataclasses.asdict(m), "device": str(m.device)} for m in self.modules],
        }

    def _title(self) -> str:
        optimizer = "no optimizer" if self.optimizer is None else f"{self.optimizer} state"
        grads = "gradients" if self.grads else "no gradients"
        return (
            f"Estimate: {self.parameter_count:,} parameters ({self.trainable_count:,} trainable), "
            f"{grads}, {optimizer}"
        )

    def __rich__(self) -> Any:
        """The counting table and, for a measured step, the peak's and the modules'."""
        if self.step is None:
            return self._counting_table()
        from rich.console import Group  # rich loads only when rendering
        from rich.text import Text

        if self.fallback is not None:
            note = f"The {self.step} step was not measured, counted only: {self.fallback}"
            return Group(self._counting_table(), Text(note))
        tables = [self._counting_table(), self._peak_table()]
        return Group(*tables, *([self._module_table()] if self.modules else []))

    def _peak_table(self) -> Table:
        from rich.table import Table

        table = Table(
            title=f"Peak of one {self.step} step: {_format_bytes(self.peak)} "
            f"(activations at most {_format_bytes(self.activations)}, temporaries at most "
            f"{_format_bytes(self.temporaries)})",
            title_justify="left",
        )
        table.add_column("device")
        # the cuBLAS column only where a CUDA step holds a workspace
        kinds = [k for k in KINDS if k != "workspace" or any(r.workspace for r in self.peaks)]
        for kind in kinds:
            table.add_column(_SHORT.get(kind, kind), justify="right")
        table.add_column("peak", justify="right", style="bold")
        for row in self.peaks:
            values = (getattr(row, kind) for kind in (*kinds, "total"))
            table.add_row(str(row.device), *(_format_bytes(n) for n in values))
        return table

    def _module_table(self, top: int = 5) -> Table:
        from rich.table import Table

        table = Table(title="Modules at the highest peaks", title_justify="left")
        for header in ("module", "type", "device", "peak while it ran", "parameters", "output"):
            table.add_column(header, justify="left" if header in ("module", "type") else "right")
        for m in self.modules[:top]:
            sizes = (_format_bytes(n) for n in (m.peak, m.parameters, m.outputs))
            table.add_row(m.name, m.type_name, str(m.device), *sizes)
        return table

    def _counting_table(self) -> Table:
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
        if self.on_disk:  # no device holds them between calls: in no total
            shown = _format_bytes(self.on_disk)
            table.add_row("disk (read as run)", "", shown, "", "", "", shown, style="dim")
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


# What sizes the optimizer's state: a name of ``_OPTIMIZERS``, the user's own optimizer, or None.
OptimizerSpec = str | torch.optim.Optimizer | None


def _optimizer_name(optimizer: OptimizerSpec) -> OptimizerSpec:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    names = f"{', '.join(repr(n) for n in _OPTIMIZERS)}, 'momentum', None or an Optimizer"
    if not isinstance(optimizer, str):
        return _not_a_name(optimizer, names)
    text = optimizer.strip().lower()
    name = _OPTIMIZER_ALIASES.get(text, text)
    if name is not None and name not in _OPTIMIZERS:
        hint = did_you_mean(name, _OPTIMIZERS)
        raise DeviceSpecError(
            f"optimizer={optimizer!r} is not one estimate knows; {hint}use one of {names}"
        )
    return name


def _not_a_name(optimizer: object, names: str) -> NoReturn:
    raise DeviceSpecError(
        f"optimizer={type(optimizer).__name__}(...) is neither an optimizer's name nor a "
        f"torch.optim.Optimizer; give one of {names}"
    )


def _refuse_lazy(model: nn.Module) -> None:
    """A lazy module's tensors have no shape before its first forward: nothing to size."""
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in named:
        if isinstance(tensor, (nn.UninitializedParameter, nn.UninitializedBuffer)):
            owner = model.get_submodule(name.rpartition(".")[0])
            raise TorchplaceError(
                f"{name} belongs to a lazy module ({type(owner).__name__}) and has no shape until "
                "its first forward; run one batch through the model, then estimate it"
            )


def estimate(
    model: nn.Module,
    /,
    *,
    optimizer: OptimizerSpec = "adam",
    grads: bool = True,
    example_input: Any = None,
    step: str = "train",
) -> Estimate:
    """Bytes a model needs: parameters, buffers, gradients, optimizer state, and with an
    ``example_input`` the peak of one step, run on fake tensors.

    >>> import torch, torchplace
    >>> est = torchplace.estimate(torch.nn.Linear(1000, 1000), optimizer="adam")
    >>> est.parameters, est.gradients, est.optimizer_state
    (4004000, 4004000, 8008008)
    >>> skeleton = torch.nn.Linear(1000, 1000, device="meta")
    >>> torchplace.estimate(skeleton, optimizer="sgd").total
    8008000
    >>> step = torchplace.estimate(skeleton, example_input=torch.ones(64, 1000), optimizer="sgd")
    >>> step.peak_by_device()[torch.device("meta")] >= step.total + 64 * 1000 * 4
    True

    Counted per device and dtype, each tied parameter once. Gradients and optimizer state are
    counted for parameters that require grad, on their parameter's device and dtype, as PyTorch
    creates them: ``"sgd"`` keeps none, ``"sgd-momentum"`` (or ``"momentum"``) one buffer per
    parameter, ``"adam"``/``"adamw"`` two, ``"adagrad"`` one; Adam and Adagrad also keep a scalar
    ``step`` per parameter on the CPU. Your own ``torch.optim.Optimizer`` is sized by a step of
    a copy of it (its class and flags: ``amsgrad``, ``foreach``, momentum) on ``meta`` stand-ins,
    and that copy runs the measured step; yours is not touched. ``optimizer=None`` counts no
    state, ``grads=False`` no gradients, ``step="forward"`` (inference) neither, with or without
    an ``example_input``. A
    skeleton (parameters on ``meta``) is sized like the real model. A model already sharded by
    FSDP2 (DTensor parameters) is sized by the shards this rank holds, while
    ``parameter_count`` stays the whole model's.

    ``example_input`` (a batch, or a callable that takes a device and builds one there with
    ``torch.zeros``/``ones``/``full``/``empty``) makes one step run on fake tensors on the
    model's devices: ``step="train"`` a forward, a backward from the output's ``.loss`` (else
    the sum of its floating outputs) and the optimizer's step, run twice so that ``peak`` is a
    steady step's (the optimizer's state held from its start; ``first_step_peak`` is the
    first's where it differs), with the optimizer implementation PyTorch picks on the model's
    device (single-tensor on the CPU and ``meta``, foreach on CUDA); ``step="forward"`` a forward
    under ``torch.no_grad`` (no gradients or optimizer state then). A mapping is passed as
    ``model(**batch)``, a tuple as ``model(*batch)``, anything else as ``model(batch)``. The
    model runs as its code says (autocast, activation checkpointing, its training flag) and is
    left as it was; nothing real is allocated. A model on a device this machine lacks (a fake
    ``cuda:0``) runs on ``meta`` and is reported under its own device. Where the step cannot
    be measured (torch's private tracker missing or changed, a model spread over devices this
    machine lacks), a warning says why, ``fallback`` holds the reason, and the counting stays.
    """
    try:
        name = _optimizer_name(optimizer)
        _refuse_non_model(model)
        model = _uncompiled(model)
        if step not in _STEPS:
            raise DeviceSpecError(f"step={step!r}: use 'train' or 'forward'")
        if example_input is None:  # counted: an inference step keeps no gradients or state
            return _count(model, name, grads) if step == "train" else _count(model, None, False)
        if step == "train" and not grads:
            raise TorchplaceError(
                "grads=False with step='train': a training step makes gradients; for inference "
                "pass step='forward'"
            )
        offloaded = next((path for path, _, _ in homes(model)), None) if step == "train" else None
        if offloaded is not None:
            raise TorchplaceError(
                f"{display(offloaded) if offloaded else 'the model'} is offloaded by its device "
                "map, and a training step of an offloaded model is not measured (its weights "
                "come and go with each call and again at backward); pass step='forward' for "
                "inference, or estimate the model before it is dispatched (a skeleton sizes "
                "like the real model)"
            )
        _refuse_inside_disk_module(model)
        with sigint_deferred():  # a Ctrl-C raised once the step has unwound, the model put back
            return _measured(model, name, example_input, step)
    except TorchplaceError as err:
        raise prefixed(err, "estimate()") from err.__cause__


def _refuse_inside_disk_module(model: nn.Module) -> None:
    """A module inside one offloaded to ``"disk"``: its weights come in when that module runs,
    not when this one runs alone, so no step of it alone can be measured."""
    units = outside_units(model)
    if units:
        raise TorchplaceError(
            f"{type(model).__name__} lies inside the module offloaded to 'disk' at "
            f"{display(units[0])} (its path in the model it was loaded into), which reads its "
            "weights when it runs, so a step of this module alone cannot be measured; estimate "
            "that module or the whole model, or leave example_input out to count its weights"
        )


def _refuse_non_model(model: Any) -> None:
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        raise TorchplaceError(
            f"sizes a model, not a path ({path!r}); build the model without memory and size "
            "that: torchplace.estimate(torchplace.skeleton(YourModel, config)), where "
            "skeleton(YourModel, config) calls YourModel(config) with its parameters on "
            "meta. For the bytes the checkpoint holds, run: torchplace inspect "
            f"{shlex.quote(os.path.expanduser(path))}"  # quoted, ~ would stay a name
        )
    if not isinstance(model, nn.Module):
        raise TorchplaceError(f"sizes an nn.Module, not {type(model).__name__}; pass the model")
    _refuse_lazy(model)


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile``'d model wraps (its ``_orig_mod``): it holds the same
    parameters, and its step is the one measured (the compiled one cannot run on fake tensors
    under torch's tracker: its gradients come out of compiled code, unseen)."""
    while (inner := compiled_inner(model)) is not None:
        model = inner
    return model


def _count(model: nn.Module, spec: OptimizerSpec, grads: bool) -> Estimate:
    """Parameters, buffers, gradients and optimizer state, per device and dtype (the state of
    the user's own optimizer, ``spec``, sized by a step of a copy of it on meta)."""
    user = spec if isinstance(spec, torch.optim.Optimizer) else None
    name = spec if isinstance(spec, str) else None
    copies, has_step = _OPTIMIZERS[name] if name is not None else (0, False)
    rows: dict[tuple[torch.device, torch.dtype], dict[str, int]] = {}

    def add(dev: torch.device, dtype: torch.dtype, field: str, nbytes: int) -> None:
        row = rows.setdefault((dev, dtype), {})
        row[field] = row.get(field, 0) + nbytes

    count = trainable = on_disk = 0
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    disk = disk_placeholders(model)
    for param in model.parameters():  # each tied parameter once
        nbytes = nbytes_as(param)
        count += param.numel()
        if id(param) in disk:  # on no device between calls
            on_disk += nbytes
            trainable += param.numel() if param.requires_grad else 0
            continue
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
        add(buffer.device, buffer.dtype, "buffers", nbytes_as(buffer))
    for (dev, dtype), nbytes in state_bytes(user, model).items() if user is not None else ():
        add(dev, dtype, "optimizer_state", nbytes)
    return Estimate(
        rows=tuple(EstimateRow(dev, dtype, **fields) for (dev, dtype), fields in rows.items()),
        optimizer=type(user).__name__ if user is not None else name,
        grads=grads,
        parameter_count=count,
        trainable_count=trainable,
        on_disk=on_disk,
    )


def count_tensors(
    tensors: Iterable[tuple[tuple[int, ...], torch.dtype, bool]],
    device: torch.device,
    optimizer: str | None,
    grads: bool,
) -> Estimate:
    """``estimate`` of tensors of these shapes and dtypes on ``device``, each a buffer where its
    flag says so and a parameter otherwise (the floating and complex parameters trained),
    counted from the shapes alone: what ``torchplace estimate`` of a checkpoint gives, with no
    tensor made (a 100k-tensor index made fake parameters for seconds). The same bytes as
    ``estimate`` of a module holding such parameters and buffers.

    >>> cpu = torch.device("cpu")
    >>> found = count_tensors([((1000, 1000), torch.float32, False)], cpu, "adam", True)
    >>> found.parameters, found.gradients, found.optimizer_state
    (4000000, 4000000, 8000004)
    >>> count_tensors([((1000,), torch.float32, True)], cpu, "adam", True).buffers
    4000
    """
    name = cast("str | None", _optimizer_name(optimizer))  # a name in, a name out
    copies, has_step = _OPTIMIZERS[name] if name is not None else (0, False)
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    rows: dict[tuple[torch.device, torch.dtype], dict[str, int]] = {}
    cpu = torch.device("cpu")
    count = trainable = steps = 0
    for shape, dtype, buffer in tensors:
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        row = rows.setdefault((device, dtype), dict.fromkeys(("parameters", "gradients"), 0))
        if buffer:
            row["buffers"] = row.get("buffers", 0) + nbytes
            continue
        row["parameters"] += nbytes
        count += numel
        if not (dtype.is_floating_point or dtype.is_complex):
            continue
        trainable += numel
        row["gradients"] += nbytes if grads else 0
        row["optimizer_state"] = row.get("optimizer_state", 0) + copies * nbytes
        steps += 1 if has_step else 0
    if steps:
        row = rows.setdefault((cpu, step_dtype), {})
        row["optimizer_state"] = row.get("optimizer_state", 0) + steps * step_dtype.itemsize
    return Estimate(
        rows=tuple(EstimateRow(dev, dtype, **fields) for (dev, dtype), fields in rows.items()),
        optimizer=name,
        grads=grads,
        parameter_count=count,
        trainable_count=trainable,
    )


def _measured(model: nn.Module, name: OptimizerSpec, example_input: Any, step: str) -> Estimate:
    """The counting for ``step``, with the peak of that step run on fake tensors added (or the
    reason it could not be, warned about)."""
    train = step == "train"
    counted = _count(model, name if train else None, train)
    try:
        measure = measure_step(model, example_input, optimizer=name if train else None, train=train)
    except Unmeasurable as why:
        warnings.warn(
            f"estimate(): the {step} step was not measured, so activations and temporaries are "
            f"not in this estimate (counted parameters, gradients and optimizer state): {why}",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return dataclasses.replace(counted, step=step, fallback=str(why))
    except TorchplaceError:
        raise
    except OperatorFailed as failed:
        raise _operator_error(model, step, failed) from failed.__cause__
    except Exception as exc:  # the model's own error on this input
        raise TorchplaceError(
            f"example_input: the {step} step of {type(model).__name__} on it raised "
            f"{type(exc).__name__}: {exc}; {_lacking(model, example_input)}{PASS_A_BATCH}"
        ) from exc
    return dataclasses.replace(
        counted,
        step=step,
        peaks=tuple(PeakRow(dev, **kinds) for dev, kinds in measure.peaks.items()),
        activations=measure.most["activations"],
        temporaries=measure.most["temporaries"],
        modules=measure.modules,
        first_step_peak=_first_step_peak(measure),
    )


def _first_step_peak(measure: StepMeasure) -> int | None:
    """The first step's peak, where it differs from the steady step's."""
    if measure.first_peaks is None:
        return None
    first = sum(kinds["total"] for kinds in measure.first_peaks.values())
    steady = sum(kinds["total"] for kinds in measure.peaks.values())
    return first if first != steady else None


def _lacking(model: nn.Module, example_input: Any) -> str:
    """Where a mapping batch lacks the model's main input (a transformers model's
    ``main_input_name``: ``pixel_values`` for an image model), a sentence naming it, else ''.
    Said only once the step failed: a model may take another input in its place."""
    if not isinstance(example_input, Mapping):
        return ""
    main = getattr(model, "main_input_name", None)
    try:
        takes = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return ""
    if not isinstance(main, str) or main in example_input or main not in takes:
        return ""
    return f"it lacks {main!r}, the input {type(model).__name__} takes first; "


# What estimate's errors about ``example_input`` tell a Python caller to do; the command line,
# whose input is its own tokens, puts its own fix in their place (``cli/_estimate``).
_PYTHON_CALLS = "model(**batch) for a mapping, model(*batch) for a tuple, else model(batch)"
PASS_A_BATCH = f"pass a batch this model takes, as {_PYTHON_CALLS}"
IF_NOT_A_BATCH = (
    f"If example_input is not a batch this model takes, pass one that is ({_PYTHON_CALLS})"
)
COUNT_INSTEAD = "estimate without example_input counts"


def _operator_error(model: nn.Module, step: str, failed: OperatorFailed) -> TorchplaceError:
    """The error for a step that failed inside an operator on fake tensors. Its fake (meta)
    kernel checks what the real one does, as a rule, so the input is the likely cause; but
    some check more (a dtype their real kernels take), and from here the two cannot be told
    apart: the message names the operator and the module, and says what to do in either case."""
    cause = failed.__cause__
    said = f"{type(cause).__name__}: {first_line(cause)}" if cause is not None else "an error"
    kind = f" ({failed.type_name})" if failed.type_name is not None else ""
    where = f", in {display(failed.module)}{kind}" if failed.module is not None else ""
    if real_kernel_refuses(cause):  # what the real kernel checks and the fake one does not
        return TorchplaceError(
            f"example_input: the {step} step of {type(model).__name__} cannot run on it: the "
            f"operator {failed.op}{where} raises {said}, as its real kernel does; {PASS_A_BATCH}"
        )
    return TorchplaceError(
        f"example_input: the {step} step of {type(model).__name__} on fake tensors failed in "
        f"the operator {failed.op}{where}: {said}. {IF_NOT_A_BATCH}. If it is (a real forward "
        "of the model takes it), this operator cannot run on fake tensors with these "
        f"arguments, so the step cannot be measured: {COUNT_INSTEAD} the parameters, gradients "
        f"and optimizer state, and a model in another dtype (bfloat16) may get past {failed.op}"
    )
