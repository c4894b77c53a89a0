"""Which aten operations cross the host-device boundary, and what each costs: ``watch``'s table.

``plan`` sorts the calls of torch's Python API (what a ``TorchFunctionMode`` sees): those that
cannot cross run unwatched; the others, when they may, run under a ``TorchDispatchMode``, which
sees their aten operations after PyTorch has decomposed them, and ``classify`` names the
operations that cross. What reaches the dispatcher for each pattern (torch 2.6 to 2.15):

* ``t.item()``, ``bool(t)``, ``float(t)``, ``if t:``, ``if loss > x:`` all end in
  ``_local_scalar_dense``: one host wait per call, the element's bytes read back;
* ``.cpu()``, ``.to("cpu")``, ``.tolist()`` (PyTorch copies to the host first) and ``.to(dev)``,
  ``.cuda()`` are ``_to_copy``; ``a.copy_(b)`` is ``copy_``; ``.numpy()`` of a device tensor
  is refused by PyTorch, so it is seen as the ``.cpu()`` before it; a fake tensor's
  ``tolist`` (``FakeTensorMode``'s, in Python) is instead one ``_local_scalar_dense`` per
  element, which ``listed`` turns back into the one copy a device makes;
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

import os
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._tensor_size import nbytes

__all__ = [
    "ALWAYS", "BY_DEVICE", "ITEM", "LOOK", "PLAIN", "TORCHPLACE_DIR", "TORCH_DIR", "Event",
    "classify", "gradient_copy", "listed", "mixing", "plan", "scan", "simple", "touches",
]  # fmt: skip

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


def gradient_copy(forward: Event, grad: torch.Tensor) -> tuple[Event, int]:
    """The copy autograd makes in the backward pass of ``forward`` (a copy): the gradient goes
    back the other way, blocking, from (or into) pageable memory."""
    if forward.direction == "host_to_device":
        return _copy(grad, None, False, ".cpu() / .tolist()")
    return _copy(grad, grad, False, ".to(device)")


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


ITEM = Event("sync", ".item() / bool(t) / if t", "device_to_host", None, None, True, FIX_ITEM)


def _item(
    args: Sequence[Any], kwargs: dict[str, Any], out: Any, watched: Callable[[torch.device], bool]
) -> tuple[Event, int] | None:
    if not watched(args[0].device):
        return None
    return ITEM, args[0].element_size()


# Where torch's and torchplace's Python files are: their frames are not the user's.
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
TORCHPLACE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def listed(frame: types.FrameType | None) -> tuple[types.FrameType, tuple[Event, int]] | None:
    """For an ``.item()`` made by a ``tolist`` of torch's Python code (a fake tensor's, which
    reads its tensor one element at a time, having no data to copy): the outermost such call
    on the stack from ``frame``, and the one copy that ``Tensor.tolist`` makes of the whole
    tensor on a device instead, with its bytes. ``None`` for any other ``.item()``."""
    found = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(TORCH_DIR):
            if frame.f_code.co_name == "tolist":
                found = frame
        elif not name.startswith(TORCHPLACE_DIR):
            break  # the caller's frame: a tolist above it is another call's
        frame = frame.f_back
    if found is None:
        return None
    tensor = found.f_locals.get("self")
    if not isinstance(tensor, torch.Tensor):
        return None
    return found, _copy(tensor, None, False, ".cpu() / .tolist()")


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


# How ``watch``'s function-level mode treats a call (``plan``): PLAIN cannot cross the boundary
# (only its arguments are looked at: ``scan``); BY_DEVICE crosses only with a watched device's
# tensor among its arguments, and then runs under the dispatch-level mode, where ``classify``
# sees its operations; ALWAYS runs there whatever its arguments (a copy from the host).
PLAIN, BY_DEVICE, ALWAYS = 0, 1, 2
LOOK = object()  # ``scan``: run a call that cannot cross under the dispatch-level mode

# Python-level names that may copy from the host with no device tensor among their arguments
# (``to`` too, unless it is given dtypes alone: see ``simple``).
_COPIES = frozenset(
    {"to", "cuda", "xpu", "mps", "type", "tensor", "as_tensor", "asarray", "new_tensor"}
)
# Operations whose aten decomposition (CompositeImplicitAutograd) holds none of the operations
# of ``_table``: safe to run without looking inside, like an operation with kernels of its own.
_SAFE_COMPOSITES = frozenset(
    {"linear", "matmul", "is_complex", "is_floating_point", "flatten", "reshape", "contiguous",
     "dropout", "layer_norm", "softmax", "log_softmax", "conv1d", "conv2d", "conv3d",
     "batch_norm", "group_norm", "expand_as", "view_as", "chunk", "split",
     "cross_entropy_loss", "__matmul__", "__rmatmul__",
     # conversions of dtype alone (to(dtype))
     "float", "double", "half", "bfloat16", "long", "int", "short", "byte", "char", "bool",
     # metadata, no operation at all
     "size", "dim", "stride", "numel", "data_ptr", "untyped_storage", "element_size",
     "is_contiguous", "storage_offset", "get_device", "requires_grad_", "retain_grad"}
)  # fmt: skip
# Dunder methods of ``torch.Tensor`` that are one aten operation of another name.
_DUNDERS = {
    "__add__": "add", "__radd__": "add", "__iadd__": "add_", "__sub__": "sub",
    "__rsub__": "rsub", "__isub__": "sub_", "__mul__": "mul", "__rmul__": "mul",
    "__imul__": "mul_", "__truediv__": "div", "__itruediv__": "div_", "__neg__": "neg",
    "__pow__": "pow", "__ipow__": "pow_", "__eq__": "eq", "__ne__": "ne", "__lt__": "lt",
    "__le__": "le", "__gt__": "gt", "__ge__": "ge", "__abs__": "abs",
}  # fmt: skip
_C_CALLABLES = (
    types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
    torch._ops.OpOverloadPacket, torch._ops.OpOverload,
)  # fmt: skip
_PLANS: dict[Any, int] = {}


def _python_plain() -> frozenset[Any]:
    """Python-level functions of torch's that do no more than operations that cannot cross the
    boundary (read in their source), and the autograd entry points: the operations that autograd
    runs are its own formulas, except the gradient of a copy, which ``watch`` records by a hook
    on the copy's result."""
    functional = torch.nn.functional
    names = ("relu", "mse_loss", "dropout", "layer_norm", "softmax", "log_softmax",
             "cross_entropy", "nll_loss", "silu", "gelu", "embedding", "linear")  # fmt: skip
    found = {getattr(functional, name, None) for name in names}
    found |= {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}
    found |= {torch.Tensor.__len__, torch.Tensor.__hash__}
    found.discard(None)
    return frozenset(found)


def plan(func: Any) -> int:
    """How ``watch``'s function-level mode treats ``func`` (cached: one look-up a call)."""
    try:
        found = _PLANS.get(func)
    except TypeError:  # an unhashable callable handed to handle_torch_function: not torch's
        return BY_DEVICE
    if found is None:
        found = _PLANS[func] = _plan(func)
    return found


def _plan(func: Any) -> int:
    if isinstance(func, types.MethodWrapperType):  # a tensor attribute's getter or setter
        return PLAIN
    if func in _PYTHON_PLAIN:
        return PLAIN
    name = getattr(func, "__name__", "")
    if isinstance(func, torch._ops.OpOverload):
        name = func._schema.name.partition("::")[2] if func.namespace == "aten" else ""
        if func.namespace == "profiler":
            return PLAIN
    elif isinstance(func, torch._ops.OpOverloadPacket) and func._qualified_op_name.startswith(
        "profiler::"
    ):
        return PLAIN
    if name in _COPIES:
        return ALWAYS
    if not isinstance(func, _C_CALLABLES):  # Python code: it may do anything
        return BY_DEVICE
    name = _DUNDERS.get(name, name)
    if name in _SAFE_COMPOSITES:
        return PLAIN
    packet = getattr(aten, name, None) if name else None
    if not isinstance(packet, torch._ops.OpOverloadPacket) or name in _BOUNDARY_NAMES:
        return BY_DEVICE
    dispatched = False
    for overload in packet.overloads():  # type: ignore[no-untyped-call]
        qualified = f"aten::{name}" + ("" if overload == "default" else f".{overload}")
        if "name" in overload.lower():  # names, dimname, dim_DimnameList: named tensors' forms,
            continue  # which rename and call the positional one
        try:
            composite = torch._C._dispatch_has_kernel_for_dispatch_key(
                qualified, "CompositeImplicitAutograd"
            )
        except RuntimeError:  # an overload of TorchScript's only, not in the dispatcher
            continue
        if composite:
            return BY_DEVICE  # decomposed in C++ into operations that may cross
        dispatched = True
    return PLAIN if dispatched else BY_DEVICE  # TorchScript's alone (aten::__getitem__)


def simple(func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None) -> bool:
    """Whether a call that may cross cannot in this form: ``t.to(dtype)``, or ``t[i]`` with
    ints, slices, ``None`` and ``...`` alone (no tensor, no list: nothing to read on the host)."""
    if func is _GETITEM:
        index = args[1]
        if isinstance(index, tuple):
            return all(_basic(i) for i in index)
        return _basic(index)
    return (
        func is _TO
        and not (kwargs and kwargs.get("device") is not None)
        and all(a is None or isinstance(a, (torch.dtype, bool)) for a in args[1:])
    )


def _basic(index: object) -> bool:
    """An index with nothing to read on the host: a slice's bounds are ints or ``None`` (a
    one-element tensor as a bound is read with ``.item()``)."""
    if isinstance(index, slice):
        return all(b is None or isinstance(b, int) for b in (index.start, index.stop, index.step))
    return isinstance(index, _BASIC_INDEX)


def scan(
    func: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    watched: Callable[[torch.device], bool],
) -> tuple[Event, int] | object | None:
    """One look at the arguments of a call that cannot cross the boundary. ``LOOK`` when a
    watched device's one-element tensor is where PyTorch may want a number (an argument, or a
    member of a list or tuple, other than a method's ``self``): PyTorch reads it with ``.item()``
    before the call (``x[:n]``, ``torch.arange(n)``, ``x.reshape(n, -1)``), a host wait that
    only a look inside shows; else ``mixing``'s event, or ``None``."""
    scalar = None
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            if arg.numel() == 1:
                if arg.device.type == "cpu":
                    if scalar is None and arg.dim() == 0:
                        scalar = arg
                elif watched(arg.device) and (i or reads_first(func)):
                    return LOOK
        elif isinstance(arg, (list, tuple)) and _one_element(arg, watched):
            return LOOK
    if kwargs and _one_element(kwargs.values(), watched):
        return LOOK
    if scalar is None or len(args) < 2:
        return None
    if not any(isinstance(a, torch.Tensor) and watched(a.device) for a in args):
        return None
    return _MIXING, nbytes(scalar)


def _one_element(values: Iterable[Any], watched: Callable[[torch.device], bool]) -> bool:
    """A watched device's one-element tensor among ``values`` or in a list or tuple there."""
    for value in values:
        if isinstance(value, (list, tuple)):
            if _one_element(value, watched):
                return True
        elif isinstance(value, torch.Tensor) and value.numel() == 1 and watched(value.device):
            return True
    return False


_FIRST: dict[Any, bool] = {}


def reads_first(func: Any) -> bool:
    """Whether ``func``'s first argument may be read as a number: not for a method of
    ``torch.Tensor`` (its ``self``) nor for the Python-level functions of ``_PYTHON_PLAIN``."""
    try:
        found = _FIRST.get(func)
    except TypeError:
        return True
    if found is None:
        name = getattr(func, "__name__", "")
        found = _FIRST[func] = not (
            isinstance(func, types.MethodWrapperType)
            or func in _PYTHON_PLAIN
            or getattr(torch.Tensor, name, None) is func
        )
    return found


def touches(
    args: Sequence[Any], kwargs: dict[str, Any], watched: Callable[[torch.device], bool]
) -> bool:
    """Whether a call has a watched device's tensor among its arguments (or in a list or tuple
    among them), or a ``device=`` naming a watched device."""
    for arg in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(arg, torch.Tensor):
            if watched(arg.device):
                return True
        elif isinstance(arg, (list, tuple)) and any(
            isinstance(a, torch.Tensor) and watched(a.device) for a in arg
        ):
            return True
    device = kwargs.get("device") if kwargs else None
    if device is None:
        return False
    try:
        return watched(torch.device(device))
    except (RuntimeError, TypeError):  # not a device spec: the call will say so
        return False


_BOUNDARY_NAMES = frozenset(op._schema.name.partition("::")[2] for op in _HANDLERS)
_PYTHON_PLAIN = _python_plain()
_TO = torch.Tensor.to
_GETITEM = torch.Tensor.__getitem__
_BASIC_INDEX = (int, slice, type(None), type(Ellipsis))
