"""``move`` while torch.compile traces it: a batch's tensors, by the one walk, as plain ``.to``.

Inside a compiled function (``torch.compiler.is_compiling()``) a move of a batch keeps its
eager results (the same containers rebuilt the same way, a tensor already there returned as it
is, a tensor met twice copied once) but none of the eager machinery Dynamo cannot trace:
packing small tensors into one copy, the pinned staging ring, host syncs by event, the undo
log. Each tensor travels by ``Tensor.to`` in the graph, which the compiler schedules;
``non_blocking=None`` means False there (a copy the graph does not wait for would need an
event the graph cannot hold).

What changes objects in place or calls code of its own cannot be traced: a module or
optimizer (whether moved itself or found in a batch, or passed as ``optimizer=``) and an object
with its own ``.to``. Those raise ``MoveError`` naming the object and saying to move it outside
the compiled function. With ``fullgraph=True`` torch.compile reports it as the exception it
observed; without, Dynamo runs ``move`` eagerly instead, where all of them move as usual.

torch 2.6's Dynamo can neither raise nor catch an exception class of a user's
(``_dynamo_compat``): there the refusal is raised while tracing, from outside the trace, naming
what was met but not where, and torch.compile reports it with or without ``fullgraph``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._devices import DeviceSpec, device
from .._dynamo_compat import raise_in_trace, traced_supports
from .._errors import MoveError
from .._tree import Located, map_tensors
from ._transfer import data_meta_message, on

__all__ = ["traced_move"]

_OUTSIDE = "move it outside the compiled function (before calling it, or on its result)"
_CANNOT = "torchplace.move cannot move it inside torch.compile"


class _TracedMoveError(MoveError):
    """``MoveError`` as torch.compile can build it: with the built-in ``__init__`` (Dynamo
    cannot trace ``MoveError``'s own), its ``name`` set afterwards."""

    __init__ = RuntimeError.__init__
    # Pickled as the built-in pickles it (its args, then its __dict__ with ``name``):
    # MoveError's own rebuild passes ``name=``, which this ``__init__`` does not take.
    __reduce__ = BaseException.__reduce__


def _error(message: str, name: str | None) -> MoveError:
    if not traced_supports("exceptions"):  # torch 2.6: raised from outside the trace
        raise_in_trace(MoveError, message)
    error: MoveError = _TracedMoveError(message)
    error.name = name
    return error


class _Refused(Exception):
    """An object met in the walk that cannot be moved inside a compiled function."""


class _OnMeta(Exception):
    """A batch tensor on meta bound for a real device: it has no values to copy."""


def _meta_refusal(name: str, shape: tuple[int, ...], dtype: torch.dtype, target: Any) -> None:
    """Raises the error of a batch's tensor on meta from outside the trace (torch 2.6)."""
    tensor = torch.empty(shape, dtype=dtype, device="meta")
    raise MoveError(data_meta_message(name, tensor, target) + ". Nothing was moved")


_raise_on_meta = torch.compiler.assume_constant_result(_meta_refusal)  # type: ignore[no-untyped-call]


def _what(obj: Any) -> str:
    if isinstance(obj, nn.Module):
        return f"a module ({type(obj).__name__}), which a move changes in place"
    if isinstance(obj, torch.optim.Optimizer):
        return f"an optimizer ({type(obj).__name__}), whose state a move changes in place"
    return f"a {type(obj).__name__} with its own .to(), which torchplace does not trace"


def _resolve(spec: DeviceSpec) -> torch.device:
    """``torchplace.device(spec)``, run as it is while torch.compile traces and its result
    taken as a constant: what a spec means does not change within a process (Dynamo cannot
    trace asking the drivers how many devices there are, which ``"auto"`` does)."""
    return device(spec)


_resolve = torch.compiler.assume_constant_result(_resolve)  # type: ignore[no-untyped-call]


def traced_move(
    obj: Any, spec: DeviceSpec, non_blocking: bool | None, optimizers: list[Any]
) -> Any:
    """``move(obj, spec)`` of a batch (or tensor) as torch.compile can trace it."""
    target = _resolve(spec)
    if optimizers or isinstance(obj, (nn.Module, torch.optim.Optimizer)):
        what = _what(optimizers[0] if optimizers else obj)
        raise _error(
            f"torchplace.move inside torch.compile was given {what}: that cannot be traced; "
            f"{_OUTSIDE}",
            None,
        )
    root = "tensor" if isinstance(obj, torch.Tensor) else "batch"
    asynchronous = bool(non_blocking)
    moved: list[tuple[torch.Tensor, torch.Tensor]] = []  # a tensor met twice: one copy

    def step(t: torch.Tensor) -> torch.Tensor:
        if on(t, target):
            return t
        for seen, copy in moved:  # by identity, which Dynamo traces (an id() it may not)
            if seen is t:
                return copy
        if t.is_meta:
            if not traced_supports("exceptions"):  # torch 2.6: said now, without the path
                _raise_on_meta(f"a tensor of the {root}", tuple(t.shape), t.dtype, target)
            raise _OnMeta(t)
        new = t.to(target, non_blocking=asynchronous)
        moved.append((t, new))
        return new

    def refuse(node: Any) -> Any:
        if not traced_supports("exceptions"):  # torch 2.6: said now, without the path
            _error(f"the {root} holds {_what(node)}: {_CANNOT}; {_OUTSIDE}", None)
        raise _Refused(node)

    try:
        return map_tensors(obj, step, to=refuse, owner=refuse, root=root)
    except Located as located:
        where, cause = located.path(root), located.cause
        if isinstance(cause, _OnMeta):
            message = data_meta_message(where, cause.args[0], target) + ". Nothing was moved"
        elif isinstance(cause, _Refused):
            message = f"{where} is {_what(cause.args[0])}: {_CANNOT}; {_OUTSIDE}"
        else:
            message = f"could not move {where} to {target}: {cause}"
        raise _error(message, where)  # noqa: B904 (no `from`: see map_tensors)
