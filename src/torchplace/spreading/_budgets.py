"""Budgets for ``plan``: which devices it may fill, and with how many bytes.

``parse_budgets`` reads a mapping such as ``{"cuda:0": "10GiB", "cpu": "64GiB", "disk": "1TB"}``;
sizes such as ``"10GiB"`` are read by ``_sizes.parse_size``. ``machine_budgets`` reads them from
the machine for ``max_memory="auto"``: each visible accelerator's free memory (NVML, as
``device("best")`` reads it) and the host's available memory, less a headroom for activations.
Nothing here allocates on a device.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._devices import available, free_memory, host_available
from .._errors import DeviceSpecError, TorchplaceError
from .._sizes import format_bytes, parse_size
from .._suggest import did_you_mean

__all__ = [
    "DISK",
    "HEADROOM_FRACTION",
    "OPEN",
    "Headroom",
    "MemorySpec",
    "Place",
    "budget_device",
    "describe",
    "machine_budgets",
    "parse_budgets",
]

Size = int | str  # bytes, or "10GiB", "500MB"
MemorySpec = Mapping[str | int | torch.device, Size] | str  # device -> budget, or "auto"
Place = torch.device | str  # a device, or DISK
DISK = "disk"
# The disk's budget under max_memory="auto": open. The disk tier keeps weights in the checkpoint
# they are loaded from, where they already lie, so it needs no room of its own.
OPEN = 2**63 - 1

# The share of each device's free memory that max_memory="auto" keeps free when no example input
# measures a step. A tenth: on a device filled with weights, the forward of a batch of a few
# sequences (hidden states, attention scores, a KV cache, the logits) and the CUDA context with
# cuBLAS's workspace and the caching allocator's rounding take hundreds of MiB to a few GiB, and
# a tenth of today's accelerators (16 to 141 GiB) is 1.6 to 14 GiB; for the host it leaves room
# for the process itself and for the pinned staging of offloaded weights.
HEADROOM_FRACTION = 0.10

_NAMED_ONLY = {"auto", "best", "gpu"}


def budget_device(key: object) -> Place:
    """A budget key as an explicit device (or ``"disk"``), parsed without asking whether it
    exists."""
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
        if text == DISK:
            return DISK
        if text in _NAMED_ONLY:
            raise DeviceSpecError(
                f"{where}: a budget is for one named device such as 'cuda:0', 'cuda:1', 'cpu' "
                "or 'disk'; for budgets read from the machine pass max_memory='auto'"
            )
        try:
            parsed = torch.device(text)
        except (RuntimeError, ValueError):
            hint = did_you_mean(text.split(":")[0], ["cpu", "cuda", "meta", "xpu"])
            raise DeviceSpecError(
                f"{where}: unknown device {key!r}; {hint}budget keys are devices such as "
                "'cuda:0', 'cuda:1', 'xpu:0', 'mps', 'cpu', 'disk' or an int N for 'cuda:N'"
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


def parse_budgets(max_memory: object) -> dict[Place, int]:
    """A mapping's budgets in bytes, in the order given but with ``"disk"`` last."""
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise DeviceSpecError(
            f"max_memory must be 'auto' or a non-empty dict of budgets such as "
            f"{{'cuda:0': '10GiB', 'cpu': '64GiB', 'disk': '1TB'}}, not {max_memory!r}"
        )
    budgets: dict[Place, int] = {}
    spelled: dict[Place, object] = {}
    for key, value in max_memory.items():
        dev = budget_device(key)
        if dev in budgets:
            raise DeviceSpecError(
                f"max_memory names {dev} twice ({spelled[dev]!r} and {key!r}); give it one budget"
            )
        budgets[dev] = parse_size(value, f"max_memory[{key!r}]")
        spelled[dev] = key
    if DISK in budgets:  # the slowest tier is filled last, wherever it is listed
        budgets[DISK] = budgets.pop(DISK)
    return budgets


@dataclasses.dataclass(frozen=True)
class Headroom:
    """Bytes of a device kept free by ``plan``, and how the figure was obtained."""

    bytes: int
    how: str


def _step_activations(model: nn.Module, example_input: Any) -> int | None:
    """Bytes a forward of ``example_input`` holds beyond the weights (activations and
    temporaries at the step's peak), from ``estimate``; None where this torchplace's
    ``estimate`` cannot run a step (it takes no ``example_input``)."""
    from ..looking._estimate import estimate

    if "example_input" not in inspect.signature(estimate).parameters:
        return None
    run: Any = estimate  # its keywords are checked above, where this estimate may lack them
    found = run(model, optimizer=None, grads=False, example_input=example_input, step="forward")
    return max(int(found.peak) - int(found.parameters) - int(found.buffers), 0)


def _reserve(free: int, measured: int | None, example_input: Any, what: str) -> Headroom:
    """The headroom of a device that runs the model, with ``free`` bytes free."""
    if measured is not None:
        return Headroom(
            min(measured, free),
            "activations and temporaries of a forward of example_input, as estimated",
        )
    why = (
        "no example_input was given"
        if example_input is None
        else "this estimate cannot run a step with example_input"
    )
    share = f"{HEADROOM_FRACTION:.0%} of the {what}"
    return Headroom(int(free * HEADROOM_FRACTION), f"{share}, kept for activations ({why})")


def machine_budgets(
    model: nn.Module, example_input: Any
) -> tuple[dict[Place, int], dict[Place, Headroom]]:
    """``max_memory="auto"``: each visible accelerator's free memory and the host's available
    memory, in that order, each less its headroom, then the disk, open (``OPEN``): its weights
    stay in the checkpoint. The accelerators run the model, so they keep room for its
    activations; the host keeps a share for the process itself (or, with no accelerator, room
    for the activations). An accelerator whose free memory cannot be read is left out, and so
    is the host where its available memory cannot be read."""
    free = {d: free_memory(d) for d in available() if d.type != "cpu"}
    readable = {d: f for d, f in free.items() if f is not None}
    host = host_available()
    if not readable and host is None:
        raise TorchplaceError(
            "max_memory='auto' could read the free memory of no device here (no accelerator "
            "answered, and the host's available memory cannot be read on this system); give "
            "the budgets: max_memory={'cuda:0': '20GiB', 'cpu': '64GiB'}"
        )
    measured = _step_activations(model, example_input) if example_input is not None else None
    headroom: dict[Place, Headroom] = {
        d: _reserve(f, measured, example_input, "free memory") for d, f in readable.items()
    }
    cpu = torch.device("cpu")
    if host is None:
        headroom[cpu] = Headroom(0, "left out: the host's available memory cannot be read here")
    elif readable:
        share = f"{HEADROOM_FRACTION:.0%} of the available host memory"
        headroom[cpu] = Headroom(
            int(host * HEADROOM_FRACTION), f"{share}, kept for the process and its staging"
        )
    else:
        headroom[cpu] = _reserve(host, measured, example_input, "available host memory")
    have = {**readable, **({} if host is None else {cpu: host})}
    budgets: dict[Place, int] = {d: max(f - headroom[d].bytes, 0) for d, f in have.items()}
    budgets[DISK] = OPEN
    headroom[DISK] = Headroom(
        0, "none: open, its weights stay in the checkpoint they are read from"
    )
    return budgets, headroom


def describe(budgets: Mapping[Place, int]) -> str:
    """``cuda:0: 10.0 GiB, cpu: 64.0 GiB`` for messages (an ``OPEN`` disk: ``disk: open``)."""
    return ", ".join(f"{d}: {'open' if b == OPEN else format_bytes(b)}" for d, b in budgets.items())
