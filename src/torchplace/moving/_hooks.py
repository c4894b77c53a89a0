"""What ``dispatch`` leaves on a model: the marker on each hooked module and its removal.

``move`` gathers a dispatched model back onto one device with ``is_dispatched`` and
``undispatch``; ``dispatch`` installs what they remove. Both import this module, not each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["MARK", "Installed", "is_dispatched", "undispatch"]

MARK = "_torchplace_dispatch"


@dataclasses.dataclass
class Installed:
    """What dispatch put on one module, so that undispatch can take it all away."""

    handles: list[torch.utils.hooks.RemovableHandle]
    wrapped_forward: bool = False
    previous_forward: Any = None  # an instance-level forward that was there before, if any
    wrapped_call: bool = False  # ``_call_impl`` stood in for (an offloaded module and those in it)
    previous_call: Any = None  # an instance-level ``_call_impl`` that was there before, if any
    wrapped_apply: bool = False  # ``_apply`` guarded (the root of a model with disk modules)
    previous_apply: Any = None  # an instance-level ``_apply`` that was there before, if any
    inside: str = ""  # the path of the disk module this module lies inside, if any


def _marked(module: nn.Module) -> Iterator[nn.Module]:
    for sub in module.modules():
        if MARK in sub.__dict__:
            yield sub


def is_dispatched(module: nn.Module, /) -> bool:
    """Whether ``dispatch`` left hooks on ``module`` or any of its submodules.

    >>> import torch, torchplace
    >>> from torchplace.moving._hooks import is_dispatched
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> is_dispatched(model), is_dispatched(torchplace.dispatch(model, {"": "cpu"}))
    (False, True)
    """
    return next(_marked(module), None) is not None


def undispatch(module: nn.Module, /) -> None:
    """Remove every hook and marker ``dispatch`` installed, moving no tensor.

    >>> import torch, torchplace
    >>> from torchplace.moving._hooks import is_dispatched, undispatch
    >>> model = torchplace.dispatch(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"": "cpu"})
    >>> undispatch(model)
    >>> is_dispatched(model)
    False
    """
    for sub in list(_marked(module)):
        installed: Installed = sub.__dict__.pop(MARK)
        for handle in installed.handles:
            handle.remove()
        for name, wrapped, previous in (
            ("forward", installed.wrapped_forward, installed.previous_forward),
            ("_call_impl", installed.wrapped_call, installed.previous_call),
            ("_apply", installed.wrapped_apply, installed.previous_apply),
        ):
            if wrapped and previous is None:
                sub.__dict__.pop(name, None)
            elif wrapped:
                sub.__dict__[name] = previous
