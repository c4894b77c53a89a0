"""Where each piece of optimizer state belongs: the one rule book for ``move`` and ``verify``.

PyTorch's optimizers keep some state off their parameter's device: Adam's ``step`` lives on
the CPU unless the group is fused or capturable, NAdam's ``mu_product`` is made on the CPU (a
copy beside the parameter works too), and ASGD keeps its ``step`` beside its parameter (a CPU
one works too). Everything else goes with its parameter.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._errors import TorchplaceError

__all__ = ["StateRule", "device_hosted", "optimizer_list", "rule_for"]


class StateRule(NamedTuple):
    """Where one key of a parameter's optimizer state belongs.

    ``on_host``: a move sends it to the CPU rather than with its parameter.
    ``strict``: only that place is right; otherwise the CPU or the parameter's device both are.
    """

    on_host: bool
    strict: bool

    @property
    def host(self) -> bool:
        """It belongs on the CPU, whatever its parameter's device."""
        return self.on_host and self.strict

    @property
    def flexible(self) -> bool:
        """It may live on the CPU or beside its parameter."""
        return not self.strict

    def destination(self, target: torch.device) -> torch.device:
        """Where a move that sends its parameter to ``target`` sends it."""
        return torch.device("cpu") if self.on_host else target


_WITH_PARAMETER = StateRule(on_host=False, strict=True)
_ON_HOST = StateRule(on_host=True, strict=True)
_HOST_OR_PARAMETER = StateRule(on_host=True, strict=False)
_PARAMETER_OR_HOST = StateRule(on_host=False, strict=False)


def device_hosted(group: dict[str, Any]) -> bool:
    """Whether a param group keeps all its state with its parameters (fused or capturable)."""
    return bool(group.get("fused")) or bool(group.get("capturable"))


def rule_for(optimizer: torch.optim.Optimizer, group: dict[str, Any], key: Any) -> StateRule:
    """The rule for state ``key`` of a parameter in ``group`` of ``optimizer``.

    >>> import torch
    >>> opt = torch.optim.NAdam([torch.nn.Parameter(torch.zeros(1))])
    >>> rule_for(opt, opt.param_groups[0], "step").host
    True
    >>> rule_for(opt, opt.param_groups[0], "mu_product").flexible
    True
    """
    if device_hosted(group):
        return _WITH_PARAMETER
    if key == "step":
        if isinstance(optimizer, torch.optim.ASGD):
            return _PARAMETER_OR_HOST  # made beside its parameter, whatever the flags
        return _ON_HOST
    if key == "mu_product":
        return _HOST_OR_PARAMETER
    return _WITH_PARAMETER


def optimizer_list(optimizer: Any) -> list[torch.optim.Optimizer]:
    """``optimizer=`` as a list: None, one optimizer, or a list/tuple of them."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if isinstance(optimizer, (list, tuple)) and all(
        isinstance(o, torch.optim.Optimizer) for o in optimizer
    ):
        return list(optimizer)
    raise TorchplaceError(
        f"optimizer= takes a torch.optim.Optimizer or a list of them, not "
        f"{type(optimizer).__name__}; pass optimizer=opt or optimizer=[opt1, opt2]"
    )
