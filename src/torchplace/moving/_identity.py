"""Keeping identity through a move: how a tensor is replaced or swapped, how each step is
undone, and which parameter now stands for one that a move replaced.

A move commits in steps through an ``UndoLog``; the undo of each step is recorded before the
step runs, so an interrupt leaves nothing done that cannot be taken back. A parameter moved
between devices whose tensors PyTorch cannot share a shallow copy (cpu<->meta) is replaced by
a ``parameter_like`` it, or swapped whole (``swap_step``) when PyTorch is asked to swap; the
replacement is recorded (``record_replacement``) so that ``current`` finds it and an optimizer
built before can be re-bound.
"""

from __future__ import annotations

import contextlib
import copyreg
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .._tensor_size import PLAIN_TYPES

__all__ = [
    "UndoLog",
    "current",
    "parameter_like",
    "record_replacement",
    "replaced_outside",
    "swap_step",
]


class UndoLog:
    """Applies commit steps one by one and can take them all back, newest first.

    Each undo is recorded *before* its step runs, so an interrupt (Ctrl-C) arriving anywhere
    cannot leave a step done without its undo. Every undo is therefore written to be safe
    whether or not its step ran: it puts back a value read before the step, or checks that the
    step happened (a swap) before reversing it.
    """

    def __init__(self) -> None:
        self.undos: list[Callable[[], None]] = []

    def apply(self, do: Callable[[], None], undo: Callable[[], None]) -> None:
        self.undos.append(undo)
        do()

    def rollback(self) -> None:
        """Run every undo, newest first. An interrupt or failure in one does not stop the rest:
        an interrupted undo is run again (each is idempotent), and the first problem is raised
        once everything is back."""
        pending: BaseException | None = None
        while self.undos:
            try:
                self.undos[-1]()
            except KeyboardInterrupt as exc:
                if pending is None:
                    pending = exc
                    continue  # run it again: undos are idempotent
            except Exception as exc:
                pending = pending or exc
            self.undos.pop()
        if pending is not None:
            raise pending


def set_data(p: torch.Tensor, data: torch.Tensor) -> Callable[[], None]:
    def do() -> None:
        p.data = data

    return do


def set_item(container: Any, key: Any, value: Any) -> Callable[[], None]:
    def do() -> None:
        container[key] = value

    return do


def set_attr(obj: Any, name: str, value: Any) -> Callable[[], None]:
    def do() -> None:
        setattr(obj, name, value)

    return do


def restore(container: dict[str, Any], saved: dict[str, Any]) -> Callable[[], None]:
    def do() -> None:
        container.update(saved)

    return do


def del_item(container: Any, key: Any) -> Callable[[], None]:
    def do() -> None:
        container.pop(key, None)

    return do


def swaps() -> bool:
    """Whether PyTorch is asked to swap whole tensors (keeping identity across any move)."""
    swap = getattr(torch.__future__, "get_swap_module_params_on_conversion", None)
    return bool(swap()) if swap is not None else False


def replaces(p: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether PyTorch would replace the Parameter object rather than swap its data."""
    if torch.__future__.get_overwrite_module_params_on_conversion():
        return True
    return not torch._has_compatible_shallow_copy_type(p, new)


def needs_swap(p: torch.Tensor, new: torch.Tensor) -> bool:
    """Tensors whose device lives in a Python subclass (fake tensors, traceable wrappers): only
    swap_tensors moves them in place, as in Module._apply. When a weak reference blocks the
    swap (fake tensors made inside FakeTensorMode have one), the Parameter is replaced."""
    return isinstance(p, FakeTensor) or is_traceable_wrapper_subclass(new)


def swappable(p: torch.Tensor, shell: torch.Tensor) -> bool:
    """swap_tensors refuses tensors with weak references (FakeTensorMode keeps some)."""
    return not weakref.getweakrefs(p) and not weakref.getweakrefs(shell)


def swap_step(a: torch.Tensor, b: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:
    """The step that swaps ``a`` and ``b`` (two devices), and its undo, which swaps them back
    only if ``a`` is where the step put it: safe to run whether or not the step ran."""
    arrived = b.device

    def do() -> None:
        torch.utils.swap_tensors(a, b)  # type: ignore[no-untyped-call]

    def undo() -> None:
        if a.device == arrived and b.device != arrived:
            torch.utils.swap_tensors(a, b)  # type: ignore[no-untyped-call]

    return do, undo


def parameter_like(
    p: nn.Parameter, data: torch.Tensor, *, materialize: bool = False
) -> nn.Parameter:
    """A Parameter holding ``data`` (not copied) that stands for ``p``: same class,
    requires_grad, attributes (``__dict__``, such as ``no_weight_decay``) and slots.

    swap_tensors exchanges class, ``__dict__`` and slots with the data, so a plain Parameter
    swapped in would strip them. With ``materialize``, a lazy parameter becomes the class its
    ``materialize`` would make it. Attributes come from a Parameter or a Parameter subclass,
    never from a tensor subclass (a fake tensor, a DTensor), which keeps its device among them:
    that must come from ``data``.

    >>> import torch
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> p.no_decay = True
    >>> q = parameter_like(p, torch.empty(2, device="meta"))
    >>> q.device.type, q.no_decay, q.requires_grad
    ('meta', True, True)
    """
    cls = type(p)
    if materialize and isinstance(p, nn.UninitializedParameter):
        cls = cast(Any, p).cls_to_become
    if issubclass(cls, nn.Parameter) and type(data) in PLAIN_TYPES:
        new = torch.Tensor._make_subclass(cls, data, p.requires_grad)
        new.__dict__.update(p.__dict__)
        for slot in copyreg._slotnames(cls):  # type: ignore[attr-defined]
            if hasattr(p, slot):
                setattr(new, slot, getattr(p, slot))
        return _unmarked(new)
    new = nn.Parameter(data, requires_grad=p.requires_grad)
    if type(p) is nn.Parameter and type(new) is nn.Parameter:
        new.__dict__.update(p.__dict__)
    elif type(p) is not nn.Parameter and issubclass(type(p), nn.Parameter):
        with contextlib.suppress(TypeError):  # another layout stays a plain Parameter
            new.__class__ = type(p)
        new.__dict__.update(p.__dict__)
    return _unmarked(new)


# On a disk tier's ``meta`` placeholder: the path of its disk module (``_offloaded``).
DISK_UNIT = "_torchplace_disk_unit"


def _unmarked(new: nn.Parameter) -> nn.Parameter:
    """``new`` without a disk placeholder's mark, unless it is one (on ``meta``)."""
    if not new.is_meta:
        new.__dict__.pop(DISK_UNIT, None)
    return new


def keep_requires_grad(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new``, a copy of ``old`` made under ``no_grad``, requiring grad when ``old`` did.

    ``Module.to`` keeps a buffer's ``requires_grad`` (PyTorch copies buffers with autograd on);
    here the copy is a leaf that requires grad, as the buffer was.
    """
    if old.requires_grad and new is not old and not new.requires_grad:
        new.requires_grad_(True)
    return new


# Parameters that a move replaced (cpu<->meta): id(old) -> (weak old, new), so that an optimizer
# that was not passed to that move can still be named and re-bound later. The new parameter is
# held strongly (while the stale one lives): a weak reference to it would stop swap_tensors,
# which refuses tensors that have any. (A WeakKeyDictionary would compare tensors with ==.)
_replaced: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}


def record_replacement(
    old: torch.Tensor, new: torch.Tensor
) -> tuple[Callable[[], None], Callable[[], None]]:
    """The step that records ``old`` as replaced by ``new``, and its undo (for a move's log)."""
    key = id(old)
    before = _replaced.get(key)
    done: list[weakref.finalize[Any, Any]] = []

    def do() -> None:
        _replaced[key] = (weakref.ref(old), new)
        done.append(weakref.finalize(old, _forget, key, new))

    def undo() -> None:
        while done:  # its finalizer holds ``new``: kept, a rolled-back move would leak it
            done.pop().detach()
        if before is None:
            _replaced.pop(key, None)
        else:
            _replaced[key] = before

    return do, undo


def _forget(key: int, new: torch.Tensor) -> None:
    """Drop the record of a replaced parameter once it dies (if it still says ``new``)."""
    found = _replaced.get(key)
    if found is not None and found[1] is new:
        del _replaced[key]


def current(param: torch.Tensor) -> torch.Tensor:
    """The parameter that now stands for ``param``, following replacements made by moves."""
    for _ in range(1000):
        found = _replaced.get(id(param))
        if found is None or found[0]() is not param:
            return param
        param = found[1]
    return param


def _replaced_by_conversion(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether ``Module.to`` from ``old``'s device to ``new``'s replaces the Parameter object."""
    if torch.__future__.get_overwrite_module_params_on_conversion():
        return True
    return not torch._has_compatible_shallow_copy_type(old, new)


def replaced_outside(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> dict[int, torch.Tensor]:
    """The parameters of ``optimizer`` that a plain ``model.to()`` replaced, matched to the
    model's ``params`` (id(old) -> new); empty when they are not that.

    ``Module.to`` between cpu and meta replaces every Parameter object, so an optimizer built
    before holds none of the model's parameters and torchplace never saw the replacement. They
    are taken as replaced when the optimizer holds none of ``params`` and its parameters line up
    one for one with them (all, or those that require grad) in shape, dtype and requires_grad,
    each on a device from which PyTorch replaces rather than moves. Another model's optimizer,
    on the same device, is not.
    """
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if not held or not params:
        return {}
    ids = {id(p) for p in params}
    if any(id(p) in ids or id(current(p)) in ids for p in held):
        return {}
    for candidates in (params, [p for p in params if p.requires_grad]):
        if len(candidates) == len(held) and all(
            old.shape == new.shape
            and old.dtype == new.dtype
            and old.requires_grad == new.requires_grad
            and old.device != new.device
            and _replaced_by_conversion(old, new)
            for old, new in zip(held, candidates, strict=True)
        ):
            return {id(old): new for old, new in zip(held, candidates, strict=True)}
    return {}
