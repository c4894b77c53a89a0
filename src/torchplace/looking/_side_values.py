"""Values for a fake step's reads of a tensor in Python: small tensors computed on the side.

Fake tensors hold no values, so a step that reads one in Python (``.item()``, ``.tolist()``,
``if t.max() > n``) cannot run on them: XLM checks ``lengths.max().item() <= slen``, JetMoE's
router splits its tokens by ``expert_size.tolist()``. Each such read is torch's
``aten._local_scalar_dense``. A skeleton has no values to read, and what a read decides
(which expert a token goes to) changes no size the step holds, only where it goes; what the
step needs is a value consistent with the tensors around it (split sizes that add up to the
tokens routed).

So beside each small fake tensor made from small ones (at most ``LIMIT`` elements each), a
real CPU tensor of the same shape and dtype is computed by the same operator: its side value.
An operator that makes integers or booleans from tensors without side values (the top-k
experts of a router's logits, tokens unequal to the padding id) is run on stand-ins for them:
seeded random numbers for small floating tensors (a skeleton's logits have no value to be
true to), zeros for integers and ``True`` for booleans (every place set, as a mask's
``nonzero`` is sized), these two only where no operator of the step made them (a buffer of
a skeleton; the example batch's own tensors give their real values, ``remember``): integers
made from a large tensor (the ``argmax`` of a large one) get none, nor does anything made
from them, and a read of one fails as before (``DataDependentOutputException``): the
estimate counts instead.

Side values cost a real operator beside each small fake one, so the estimate runs a step
without them first, and again with them only where that step read a value (``on``).

A side value stays right while its tensor is unchanged: one changed in place by an operator
whose operands do not all have side values loses its own, and so does any tensor whose version
moved otherwise (a change through a view).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["LIMIT", "SideValues"]

# The most elements a tensor with a side value holds (a float32 one: 4 MiB).
LIMIT = 1 << 20
_SEED = 0


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _on_cpu(value: Any) -> Any:
    """A device named by an operator's arguments (a factory's ``device=``) as the CPU's."""
    return torch.device("cpu") if isinstance(value, torch.device) else value


def _written(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The operands ``func`` changes in place (its schema's written arguments)."""
    found = []
    for i, arg in enumerate(getattr(getattr(func, "_schema", None), "arguments", ())):
        info = getattr(arg, "alias_info", None)
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        found.extend(_tensors(value))
    return found


class SideValues:
    """The side values of one fake step: ``value(func, args)`` answers a read of a fake
    tensor, ``after(...)`` computes the side values of an operator's outputs."""

    def __init__(self) -> None:
        self.known: Any = WeakTensorKeyDictionary()  # fake tensor -> (side value, its version)
        self.unknown: Any = WeakTensorKeyDictionary()  # integers an operator made, unknown
        self.generator = torch.Generator().manual_seed(_SEED)
        self.on = True  # off: no side value is computed, and every read fails as fake tensors'

    def remember(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """``real``'s values as the side value of ``fake``, made from it (the example batch's
        tensors: a read of them reads the caller's values, not a stand-in's zeros), where it
        has values and is small; nothing while side values are off."""
        from torch.utils._python_dispatch import _disable_current_modes

        if not self.on or real.numel() > LIMIT or real.is_meta:
            return
        if type(real) is not torch.Tensor and not isinstance(real, torch.nn.Parameter):
            return  # a fake tensor, or a subclass whose values are its own
        with _disable_current_modes(), torch.no_grad():
            self.known[fake] = (real.detach().to("cpu", copy=True), fake._version)

    def read(self, t: Any) -> Any:
        """``t.item()`` of a fake tensor's side value; ``LookupError`` where it has none."""
        from torch.utils._python_dispatch import _disable_current_modes

        side = self._side(t)
        if side is None:
            raise LookupError("no side value")
        with _disable_current_modes():  # a real tensor, read outside the fake modes
            return side.item()

    def _side(self, t: Any) -> torch.Tensor | None:
        held = self.known.get(t) if isinstance(t, torch.Tensor) else None
        if held is None or held[1] != t._version:
            return None
        return held[0]  # type: ignore[no-any-return]

    def after(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Side values for ``out`` where its operands allow (see the module docstring); none
        for the operands ``func`` changed in place otherwise."""
        if not self.on:
            return
        kwargs = kwargs or {}
        outs = _tensors(out)
        computed = self._computed(func, args, kwargs, outs) if outs else None
        if computed is None or len(computed) != len(outs):
            self._forget([*outs, *_written(func, args, kwargs)])
            return
        for fake, side in zip(outs, computed, strict=True):
            if tuple(side.shape) == tuple(fake.shape) and side.dtype == fake.dtype:
                self.known[fake] = (side, fake._version)
            else:  # the fake kernel sized it otherwise (a mask's nonzero, every place set)
                self._forget([fake])

    def _seedable(self, t: torch.Tensor) -> bool:
        """Whether a stand-in may be made for ``t``, which has no side value: a small one,
        floating, or made by no operator of the step (a batch's token ids)."""
        return t.numel() <= LIMIT and (_floating(t) or t not in self.unknown)

    def _computed(
        self, func: Any, args: Any, kwargs: Any, outs: list[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        """``func`` run for real on the side values of its operands (stand-ins where there are
        none and it makes integers), with the fake modes off; None where it may not or fails."""
        from torch.utils._python_dispatch import _disable_current_modes

        if any(o.numel() > LIMIT for o in outs):
            return None
        operands = _tensors((args, kwargs))
        sides = [self._side(t) for t in operands]
        missing = [t for t, side in zip(operands, sides, strict=True) if side is None]
        if missing and (all(_floating(o) for o in outs) or not all(map(self._seedable, missing))):
            return None
        with _disable_current_modes(), torch.no_grad():
            swap = {
                id(t): side if side is not None else self._stand_in(t)
                for t, side in zip(operands, sides, strict=True)
            }

            def real(v: Any) -> Any:
                return swap.get(id(v), v) if isinstance(v, torch.Tensor) else _on_cpu(v)

            try:
                return _tensors(func(*tree_map(real, args), **tree_map(real, kwargs)))
            except Exception:  # no CPU kernel for it, or side values it refuses
                return None

    def _stand_in(self, t: torch.Tensor) -> torch.Tensor:
        """Values for a fake tensor without a side value (see the module docstring)."""
        shape, dtype = tuple(t.shape), t.dtype
        if _floating(t):
            return torch.randn(shape, generator=self.generator).to(dtype)
        if dtype == torch.bool:
            return torch.ones(shape, dtype=dtype)
        return torch.zeros(shape, dtype=dtype)

    def _forget(self, tensors: list[torch.Tensor]) -> None:
        """No side value for ``tensors``; those of integers or booleans get no stand-in."""
        for t in tensors:
            self.known.pop(t, None)
            if not _floating(t):
                self.unknown[t] = True
