"""The user's own optimizer in an estimate: its class and flags, over other parameters.

``estimate(model, optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True))`` sizes what
that optimizer keeps and runs its step as configured (``foreach``, ``fused``, ``amsgrad``,
momentum). The user's object is never stepped or changed: a copy of it, with the same
hyperparameters per group, is made over stand-in parameters (``meta`` ones to size its state,
the fake ones of a measured step), and its state found by running its ``step()`` there.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._errors import DeviceSpecError

__all__ = ["clone_over", "state_bytes"]

# The hooks an optimizer keeps, none of which the copy takes (the user's would see stand-ins).
_HOOKS = tuple(
    f"_optimizer{what}_{when}_hooks"
    for what in ("_step", "_state_dict", "_load_state_dict")
    for when in ("pre", "post")
)


def clone_over(
    optimizer: torch.optim.Optimizer, stand_in: Callable[[torch.Tensor], torch.Tensor | None]
) -> torch.optim.Optimizer:
    """A fresh optimizer of ``optimizer``'s class with its groups' hyperparameters, over
    ``stand_in(param)`` for each of its parameters (those it maps to None are left out), no
    state and none of its hooks."""
    clone = object.__new__(type(optimizer))
    kept = {k: v for k, v in vars(optimizer).items() if k not in ("state", "param_groups")}
    clone.__dict__.update(kept)
    for hooks in _HOOKS:
        setattr(clone, hooks, collections.OrderedDict())
    clone.state = collections.defaultdict(dict)
    clone.param_groups = []
    for group in optimizer.param_groups:
        params = [s for s in map(stand_in, group["params"]) if s is not None]
        if params:
            clone.add_param_group({**group, "params": params})
    return clone


def state_bytes(
    optimizer: torch.optim.Optimizer, model: nn.Module
) -> dict[tuple[torch.device, torch.dtype], int]:
    """The bytes ``optimizer`` keeps for ``model``'s parameters that require grad, per device and
    dtype, found by one step of a copy of it over ``meta`` stand-ins with gradients (its
    scalars that live on the CPU, Adam's ``step``, are counted there)."""
    own = {id(p): p for p in model.parameters()}
    stand_ins: dict[int, nn.Parameter] = {}

    def stand_in(param: torch.Tensor) -> torch.Tensor | None:
        if id(param) not in own or not param.requires_grad:
            return None
        meta = nn.Parameter(torch.empty_like(param, device="meta"))
        meta.grad = torch.empty_like(meta)
        stand_ins[id(meta)] = param  # type: ignore[assignment]
        return meta

    try:
        clone = clone_over(optimizer, stand_in)
        if clone.param_groups:
            clone.step()
    except Exception as exc:  # its constructor's or step's checks (fused on meta)
        raise DeviceSpecError(
            f"optimizer={type(optimizer).__name__}(...): its state could not be sized by a step "
            f"on meta tensors ({type(exc).__name__}: {exc}); give its name as a string instead"
        ) from exc
    return _sized(clone.state, stand_ins)


def _sized(
    state: Mapping[Any, Mapping[str, Any]], originals: Mapping[int, torch.Tensor]
) -> dict[tuple[torch.device, torch.dtype], int]:
    out: dict[tuple[torch.device, torch.dtype], int] = {}
    for meta, values in state.items():
        param = originals[id(meta)]
        for value in values.values():
            if isinstance(value, torch.Tensor):
                dev = param.device if value.device.type == "meta" else value.device
                key = (dev, value.dtype)
                out[key] = out.get(key, 0) + value.numel() * value.element_size()
    return out
