"""Budgets for ``plan``: which devices it may fill, and with how many bytes.

``parse_budgets`` reads a mapping such as ``{"cuda:0": "10GiB", "cpu": "64GiB"}``; sizes such as
``"10GiB"`` are read by ``_sizes.parse_size``. Nothing here touches a device.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

import torch

from .._errors import DeviceSpecError
from .._sizes import parse_size

__all__ = ["MemorySpec", "budget_device", "parse_budgets"]

Size = int | str  # bytes, or "10GiB", "500MB"
MemorySpec = Mapping[str | int | torch.device, Size]  # device -> budget

_PLANNABLE_WORDS = {
    "auto": "plan never looks at the machine",
    "best": "plan never looks at the machine",
    "gpu": "plan never looks at the machine",
    "disk": "offloading to disk is not supported",
}


def budget_device(key: object) -> torch.device:
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


def parse_budgets(max_memory: object) -> dict[torch.device, int]:
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise DeviceSpecError(
            f"max_memory must be a non-empty dict of budgets such as "
            f"{{'cuda:0': '10GiB', 'cpu': '64GiB'}}, not {max_memory!r}"
        )
    budgets: dict[torch.device, int] = {}
    spelled: dict[torch.device, object] = {}
    for key, value in max_memory.items():
        dev = budget_device(key)
        if dev in budgets:
            raise DeviceSpecError(
                f"max_memory names {dev} twice ({spelled[dev]!r} and {key!r}); give it one budget"
            )
        budgets[dev] = parse_size(value, f"max_memory[{key!r}]")
        spelled[dev] = key
    return budgets
