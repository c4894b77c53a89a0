"""How much memory a model needs to train: ``estimate`` counts, it never allocates.

``estimate(model)`` gives the bytes of parameters, buffers, gradients and optimizer state, per
device and dtype, as an ``Estimate``; it works on skeletons (parameters on meta). ``plan`` sizes
tensors with the same ``_tensor_size.nbytes_as``, so a budget and an estimate count bytes alike.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import os
import shlex
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._errors import DeviceSpecError, TorchplaceError
from .._sizes import format_bytes as _format_bytes
from .._tensor_size import nbytes_as

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "Estimate",
    "EstimateRow",
    "estimate",
]


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
    A model already sharded by FSDP2 (DTensor parameters) is sized by the shards this rank
    holds, while ``parameter_count`` stays the whole model's. Activations are not counted: they
    depend on the batch.
    """
    try:
        name = _optimizer_name(optimizer)
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
        copies, has_step = _OPTIMIZERS[name] if name is not None else (0, False)
        rows: dict[tuple[torch.device, torch.dtype], dict[str, int]] = {}

        def add(dev: torch.device, dtype: torch.dtype, field: str, nbytes: int) -> None:
            row = rows.setdefault((dev, dtype), {})
            row[field] = row.get(field, 0) + nbytes

        count = trainable = 0
        step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        _refuse_lazy(model)
        for param in model.parameters():  # each tied parameter once
            nbytes = nbytes_as(param)
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
            add(buffer.device, buffer.dtype, "buffers", nbytes_as(buffer))
        return Estimate(
            rows=tuple(EstimateRow(dev, dtype, **fields) for (dev, dtype), fields in rows.items()),
            optimizer=name,
            grads=grads,
            parameter_count=count,
            trainable_count=trainable,
        )
    except TorchplaceError as err:
        raise type(err)(f"estimate(): {err}") from err.__cause__
