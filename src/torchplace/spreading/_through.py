"""Gradients through offloaded modules: what autograd keeps of an offloaded weight.

A unit called with gradients on runs with the weights it fetched, as at inference. Autograd
would keep them alive until backward in two ways, defeating the window: a leaf that requires
grad gets an ``AccumulateGrad`` node holding it, and every operation that needs the weight for
its backward (a Linear, for the input's gradient) saves it. So:

- a fetched weight that requires grad is not a leaf but the output of ``_Weight``, which
  holds nothing of it; its backward, reached only when a gradient for that weight is computed,
  raises naming the weight (the gradient would land on a copy and be lost);
- while the unit runs, ``saved_tensors_hooks`` (``Kept``) keep, in place of a fetched weight or
  a view of one, where it lies in the unit; backward fetches the unit again (``Ring.refetch``),
  one unit's weights at a time per window, given back when the backward pass ends.

Tensors that are not the unit's weights go to the hooks that were active around the call
(activation checkpointing, a user's own offload of activations), or are kept as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .._errors import TorchplaceError
from .._model_walk import display

__all__ = ["ANCHOR", "Kept", "Ref", "lost_gradient", "outer_hooks", "requiring"]


def lost_gradient(name: str) -> TorchplaceError:
    return TorchplaceError(
        f"backward(): {display(name)} is offloaded (its weights are brought in for each call "
        "and dropped after) and requires grad, so its gradient would land on a copy and be "
        "lost. Freeze the offloaded base weights, as PEFT does to train adapters "
        "(model.requires_grad_(False), then make the trainable parts require grad), or map the "
        "modules you train to a device"
    )


class _Weight(torch.autograd.Function):
    """An offloaded weight that requires grad, as a non-leaf (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, t: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        return t.detach()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise lost_gradient(ctx.name)


ANCHOR = torch.zeros((), requires_grad=True)
"""What each ``_Weight`` hangs from, so that its output requires grad; never given a gradient
(``_Weight.backward`` raises first)."""


def requiring(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` as an offloaded weight that requires grad, for a call with gradients on."""
    out: torch.Tensor = _Weight.apply(ANCHOR, t, name)  # type: ignore[no-untyped-call]
    return out


@dataclasses.dataclass(frozen=True)
class Ref:
    """What autograd keeps in place of a fetched weight (or a view of one): the unit, the
    slot, and the view's geometry relative to the slot's tensor."""

    index: int
    slot: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements, from the slot tensor's own storage offset


def outer_hooks() -> tuple[Callable[[Any], Any], Callable[[Any], Any]] | None:
    """The saved-tensor hooks active around the call (torch >= 2.x keeps a stack of them)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        hooks = top(False)
    except TypeError:  # an older signature
        return None
    return hooks if hooks else None


class Kept:
    """``saved_tensors_hooks`` for one call of unit ``index``: its fetched weights (by their
    storages) kept as ``Ref``, fetched again by ``refetch`` when backward unpacks them."""

    def __init__(
        self, index: int, tensors: list[torch.Tensor], refetch: Callable[[int], list[torch.Tensor]]
    ) -> None:
        self.index, self.refetch = index, refetch
        # by storage: (slot, dtype, storage offset, numel) of each weight, never the tensors
        # (the hooks live as long as the graph, which must not keep the weights alive)
        self.by_storage: dict[int, list[tuple[int, torch.dtype, int, int]]] = {}
        for slot, t in enumerate(tensors):
            if t.layout is torch.strided and t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                where = (slot, t.dtype, int(t.storage_offset()), t.numel())
                self.by_storage.setdefault(ptr, []).append(where)
        self.outer = outer_hooks()

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        ref = self._ref(t)
        if ref is not None:
            return ref
        if self.outer is not None:
            return (self.outer, self.outer[0](t))
        return t

    def unpack(self, kept: Any) -> torch.Tensor:
        if isinstance(kept, Ref):
            base = self.refetch(kept.index)[kept.slot]
            return base.as_strided(kept.size, kept.stride, base.storage_offset() + kept.offset)
        if isinstance(kept, tuple):
            (_, unpack), packed = kept
            out: torch.Tensor = unpack(packed)
            return out
        return kept  # type: ignore[no-any-return]

    def _ref(self, t: torch.Tensor) -> Ref | None:
        if not self.by_storage or t.layout is not torch.strided or t.device.type == "meta":
            return None
        try:
            candidates = self.by_storage.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # no storage (a tensor subclass)
            return None
        for slot, dtype, start, numel in candidates or ():
            if t.dtype != dtype:
                continue
            offset = int(t.storage_offset()) - start
            if 0 <= offset < max(numel, 1):
                return Ref(self.index, slot, tuple(t.shape), tuple(t.stride()), offset)
        return None
