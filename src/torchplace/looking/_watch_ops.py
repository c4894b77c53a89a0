"""Which aten operations cross the host-device boundary, and what each costs: ``watch``'s table.

``watch`` sees operations as a ``TorchDispatchMode`` sees them, after PyTorch has decomposed
the Python-level calls. What reaches the dispatcher for each pattern (torch 2.6 to 2.15):

* ``t.item()``, ``bool(t)``, ``float(t)``, ``if t:``, ``if loss > x:`` all end in
  ``_local_scalar_dense``: one host wait per call, the element's bytes read back;
* ``.cpu()``, ``.to("cpu")``, ``.tolist()`` (PyTorch copies to the host first) and ``.to(dev)``,
  ``.cuda()`` are ``_to_copy``; ``a.copy_(b)`` is ``copy_``; ``.numpy()`` of a device tensor
  is refused by PyTorch, so it is seen as the ``.cpu()`` before it;
* ``torch.tensor(data, device=dev)`` and ``torch.as_tensor(list, device=dev)`` copy inside
  PyTorch's constructor, out of sight, and reach the dispatcher as ``lift_fresh`` of a tensor
  already on the device (under ``FakeTensorMode`` as a ``_to_copy`` instead);
* shapes that depend on values: ``nonzero`` (also ``torch.where(mask)`` and ``argwhere``),
  ``unique`` in its forms, ``masked_select``, ``x[mask]`` (``index`` with a boolean index),
  ``x[mask] = v`` (``index_put_``; from torch 2.15, ``x[mask] = 0.0`` with a Python number runs
  as ``masked_fill_``, which does not wait), ``repeat_interleave`` without ``output_size``,
  ``bincount``;
  and answers the host needs: ``torch.equal``, ``torch.allclose``.

A copy's host waits: a copy asked blocking waits for the device's queue (PyTorch synchronizes
the stream after it), in both directions. ``non_blocking=True`` is honoured when the host side
is pinned; PyTorch pins the result of ``.to("cpu", non_blocking=True)`` itself, which the
result's ``is_pinned()`` shows. Not honoured: to the device from pageable memory, the host
stages the bytes itself before the call returns (no wait for the queue, but no overlap);
into pageable memory, the call returns only once the copy is done, a wait.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._tensor_size import nbytes

__all__ = ["Event", "classify", "mixing"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Event:
    """What one operation did at the boundary (a row's key, less the line it came from)."""

    kind: str  # "sync", "copy" or "mixing"
    op: str  # what the user wrote, as far as the dispatcher tells
    direction: str | None  # "host_to_device", "device_to_host", or None
    pinned: bool | None  # the host side of a copy
    non_blocking: bool | None  # asked, for a copy
    waits: bool  # the host waited for the device
    fix: str


FIX_ITEM = "keep it on the device and read it every N steps (torch.where for a condition)"
FIX_TO_HOST = (
    "reduce on the device and copy every N steps, or .to('cpu', non_blocking=True) and one sync"
)
FIX_PAGEABLE = (
    "pin it (DataLoader(pin_memory=True)) or use torchplace.DeviceLoader, non_blocking=True"
)
FIX_PINNED = "the host side is pinned: pass non_blocking=True"
FIX_DONE_TO_DEVICE = "none needed: pinned and non-blocking"
FIX_DONE_TO_HOST = "non-blocking into pinned memory: synchronize before reading the result"
FIX_TENSOR = "make it once, outside the step, or on the device (torch.full, torch.arange)"
FIX_SHAPE = {
    "nonzero": "torch.nonzero_static(x, size=N), or keep the mask: torch.where(mask, x, 0)",
    "unique": "do it once outside the step, or count over a known range (one_hot, scatter_add)",
    "masked_select": "keep the shape: torch.where(mask, x, 0)",
    "x[mask]": "keep the shape: torch.where(mask, x, 0), or index with precomputed indices",
    "x[mask] = v": "x.masked_fill_(mask, v) or torch.where(mask, v, x): no shape to learn",
    "repeat_interleave": "pass output_size= (the total, known on the host)",
    "bincount": "torch.zeros(N).scatter_add_(0, x, ones): the size is yours, not the data's",
    "equal": "compare on the device ((a == b).all()) and read the answer every N steps",
    "allclose": "torch.isclose(a, b).all() on the device, read every N steps",
}
FIX_MIXING = "use a Python number (or make the tensor on the device) instead of a CPU tensor"


def _host(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


def _pinned(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:  # a build or tensor that cannot say
        return False


def _copy(
    src: torch.Tensor, host: torch.Tensor | None, non_blocking: bool, op: str
) -> tuple[Event, int]:
    """A copy of ``src`` across the boundary; ``host`` is its host-side tensor (``src`` itself
    for a copy to the device), ``None`` when unknown (taken as pageable)."""
    to_device = src.device.type == "cpu"
    pinned = host is not None and _pinned(host)
    honoured = non_blocking and pinned
    if honoured:
        fix = FIX_DONE_TO_DEVICE if to_device else FIX_DONE_TO_HOST
    elif to_device:
        fix = FIX_PINNED if pinned else FIX_PAGEABLE
    else:
        fix = FIX_TO_HOST
    direction = "host_to_device" if to_device else "device_to_host"
    # From pageable memory, a non-blocking copy to the device is staged by the host at once
    # (no wait for the queue); into pageable memory, it returns only once the copy is done.
    waits = not non_blocking if to_device else not honoured
    return Event("copy", op, direction, pinned, non_blocking, waits, fix), nbytes(src)


def _to_copy(
    args: Sequence[Any], kwargs: dict[str, Any], out: Any, watched: Callable[[torch.device], bool]
) -> tuple[Event, int] | None:
    src = args[0]
    dst = torch.device(kwargs.get("device") or src.device)
    non_blocking = bool(kwargs.get("non_blocking", False))
    if src.device.type == "cpu" and watched(dst):
        return _copy(src, src, non_blocking, ".to(device)")
    if watched(src.device) and dst.type == "cpu":
        host = out if isinstance(out, torch.Tensor) else None
        return _copy(src, host, non_blocking, ".cpu() / .tolist()")
    return None


def _copy_(
    args: Sequence[Any], kwargs: dict[str, Any], out: Any, watched: Callable[[torch.device], bool]
) -> tuple[Event, int] | None:
    dst, src = args[0], args[1]
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if _host(src) and watched(dst.device):
        return _copy(src, src, non_blocking, "copy_ to the device")
    if watched(src.device) and _host(dst):
        return _copy(src, dst, non_blocking, "copy_ to the host")
    return None


def _lift_fresh(
    args: Sequence[Any], kwargs: dict[str, Any], out: Any, watched: Callable[[torch.device], bool]
) -> tuple[Event, int] | None:
    if not isinstance(out, torch.Tensor) or not watched(out.device):
        return None
    event = Event(
        "copy", "torch.tensor(data, device=...)", "host_to_device", False, False, True, FIX_TENSOR
    )
    return event, nbytes(out)


def _item(
    args: Sequence[Any], kwargs: dict[str, Any], out: Any, watched: Callable[[torch.device], bool]
) -> tuple[Event, int] | None:
    if not watched(args[0].device):
        return None
    op = ".item() / bool(t) / if t"
    return Event("sync", op, "device_to_host", None, None, True, FIX_ITEM), args[0].element_size()


def _shape(name: str, needs_mask: bool = False) -> Callable[..., tuple[Event, int] | None]:
    """A handler for an operation whose output's size (or answer) the host must read."""

    def handler(
        args: Sequence[Any],
        kwargs: dict[str, Any],
        out: Any,
        watched: Callable[[torch.device], bool],
    ) -> tuple[Event, int] | None:
        if not isinstance(args[0], torch.Tensor) or not watched(args[0].device):
            return None
        if needs_mask and not _boolean_index(args[1]):
            return None
        if name == "repeat_interleave" and kwargs.get("output_size") is not None:
            return None
        return Event("sync", name, None, None, None, True, FIX_SHAPE[name]), 0

    return handler


def _boolean_index(indices: object) -> bool:
    return isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


Handler = Callable[
    [Sequence[Any], dict[str, Any], Any, Callable[[torch.device], bool]], "tuple[Event, int] | None"
]


def _table() -> dict[Any, Handler]:
    table: dict[Any, Handler] = {
        aten._to_copy.default: _to_copy,
        aten.copy_.default: _copy_,
        aten.lift_fresh.default: _lift_fresh,
        aten._local_scalar_dense.default: _item,
        aten.nonzero.default: _shape("nonzero"),
        aten.masked_select.default: _shape("masked_select"),
        aten.index.Tensor: _shape("x[mask]", needs_mask=True),
        aten.index_put_.default: _shape("x[mask] = v", needs_mask=True),
        aten.index_put.default: _shape("x[mask] = v", needs_mask=True),
        aten.repeat_interleave.Tensor: _shape("repeat_interleave"),
        aten.repeat_interleave.self_Tensor: _shape("repeat_interleave"),
        aten.bincount.default: _shape("bincount"),
        aten.equal.default: _shape("equal"),
        aten.allclose.default: _shape("allclose"),
    }
    for name in (
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
    ):
        packet = getattr(aten, name, None)
        if packet is not None:
            table[packet.default] = _shape("unique")
    return table


_HANDLERS = _table()


def classify(
    func: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    out: Any,
    watched: Callable[[torch.device], bool],
) -> tuple[Event, int] | None:
    """The event ``func`` made (and its bytes), or ``None`` when it did not cross the boundary
    of a device for which ``watched(device)`` is true."""
    handler = _HANDLERS.get(func)
    if handler is not None:
        return handler(args, kwargs, out, watched)
    return mixing(args, watched)


_MIXING = Event(
    "mixing", "a CPU scalar tensor with a device tensor", None, None, None, False, FIX_MIXING
)


def mixing(
    args: Sequence[Any], watched: Callable[[torch.device], bool]
) -> tuple[Event, int] | None:
    """A CPU tensor of zero dimensions beside a watched device's tensor, which PyTorch allows
    (it reads the scalar on the host): an implicit mix of devices."""
    # Every operation of the block comes here: the common case (no zero-dimensional CPU
    # tensor among the arguments) is decided by one cheap look at each argument.
    scalar = None
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() == 0 and arg.device.type == "cpu":
            scalar = arg
            break
    if scalar is None:
        return None
    if not any(isinstance(a, torch.Tensor) and watched(a.device) for a in args):
        return None
    return _MIXING, nbytes(scalar)
