"""What real kernels refuse and fake (meta) ones let through: checked in the fake step.

A fake step that runs where the real one raises would size a step that cannot run. Two checks
stand in for the real kernels':

- a matrix product's operands in different dtypes (a float64 or int64 batch into a float32
  ``Linear``): torch's meta kernels of ``mm``/``addmm`` do not look at dtypes, its CPU and CUDA
  kernels raise;
- an embedding lookup past the table: fake tensors hold no values, but positions made by
  ``torch.arange`` (shifted by a number, reshaped) have known ones, and a learned position table
  shorter than the sequence (GPT-2's ``n_positions``) raises ``IndexError`` in a real step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["FakeChecks", "real_kernel_refuses"]

# Products whose real kernels take one dtype for all their operands (``_int_mm`` and
# ``_scaled_mm`` mix them by design).
_ONE_DTYPE = frozenset(
    {"mm", "addmm", "_addmm_activation", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot"}
)
# Operators whose output holds the values of their first operand, reshaped or copied.
_SAME_VALUES = frozenset(
    {
        "alias",
        "clone",
        "contiguous",
        "detach",
        "expand",
        "lift_fresh",
        "reshape",
        "squeeze",
        "t",
        "transpose",
        "unsqueeze",
        "view",
        "_to_copy",
        "_unsafe_view",
    }
)


def real_kernel_refuses(exc: BaseException | None) -> bool:
    """Whether ``exc`` was raised by one of these checks: what the real kernel raises too."""
    return getattr(exc, "torchplace_real", False) is True


def _as_real(exc: Exception) -> Exception:
    exc.torchplace_real = True  # type: ignore[attr-defined]
    return exc


def _name(func: Any) -> str:
    return str(getattr(getattr(func, "overloadpacket", None), "__name__", ""))


class FakeChecks:
    """The checks of one step: ``before`` an operator runs (raising as the real kernel would),
    ``after`` it (noting the range of values an output is known to hold)."""

    def __init__(self) -> None:
        self.ranges: Any = WeakTensorKeyDictionary()  # tensor -> (least, most, its version)
        self.cast = False  # the running torch function is one autocast casts the operands of

    def seen(self) -> AutocastSeen:
        """The mode that keeps ``autocast`` up to date while a step runs."""
        return AutocastSeen(self)

    def before(self, func: Any, args: Any) -> None:
        name = _name(func)
        one_dtype = name in _ONE_DTYPE and getattr(func, "_overloadname", None) == "default"
        # not where autocast casts the operands on the real device (on meta it does nothing),
        # nor in the backward, whose operands are the forward's, let through there
        if one_dtype and not self.cast and torch._C._current_autograd_node() is None:
            dtypes = list(dict.fromkeys(a.dtype for a in args if isinstance(a, torch.Tensor)))
            if len(dtypes) > 1:
                said = " and ".join(str(d).removeprefix("torch.") for d in dtypes)
                raise _as_real(
                    RuntimeError(f"{name}: its operands are in different dtypes ({said})")
                )
        if name == "embedding" and len(args) >= 2:
            weight, indices = args[0], args[1]
            known = self._range(indices)
            if known is not None and (known[0] < 0 or known[1] >= weight.shape[0]):
                raise _as_real(
                    IndexError(
                        f"index out of range in self (positions {known[0]}..{known[1]} in a "
                        f"table of {weight.shape[0]} rows)"
                    )
                )

    def after(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if not isinstance(out, torch.Tensor):
            return
        known = self._known(_name(func), args, kwargs or {})
        if known is not None:
            self.ranges[out] = (*known, out._version)

    def _range(self, t: Any) -> tuple[int, int] | None:
        """What ``t`` is known to hold, while it is unchanged: a change in place, through any
        view of its storage (``clamp_``, ``pos[10:] -= 10``), moves its version on."""
        held = self.ranges.get(t) if isinstance(t, torch.Tensor) else None
        if held is None or held[2] != t._version:
            return None
        return held[0], held[1]

    def _known(self, name: str, args: Any, kwargs: dict[str, Any]) -> tuple[int, int] | None:
        first = args[0] if args else None
        if name == "arange":
            return _arange_range(args)
        prior = self._range(first)
        if prior is None:
            return None
        if name in _SAME_VALUES:
            return prior
        shift = args[1] if len(args) > 1 else None
        alpha = kwargs.get("alpha", 1)
        if name in ("add", "sub") and type(shift) is int and type(alpha) is int:
            step = shift * alpha * (1 if name == "add" else -1)
            return prior[0] + step, prior[1] + step
        return None


# The torch functions whose operands autocast casts to its lower precision, by device type
# (PyTorch's autocast op lists; CUDA's holds the CPU's and a few more, other types take the
# CPU's): the products among them see operands of one dtype on the real device.
_CAST_ON_CPU = frozenset(
    {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm",
     "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
     "prelu", "scaled_dot_product_attention"}
)  # fmt: skip
_CAST = {
    "cpu": _CAST_ON_CPU,
    "cuda": _CAST_ON_CPU | {"mv", "addmv", "addr", "einsum", "chain_matmul", "multi_dot"},
}


class AutocastSeen(TorchFunctionMode):
    """Notes, for each torch function a step calls, whether autocast casts its operands there:
    inside an operator's dispatch (where the checks run) autocast reads as off."""

    def __init__(self, checks: FakeChecks) -> None:
        super().__init__()
        self.checks = checks

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        self.checks.cast = any(name in _CAST.get(t, _CAST_ON_CPU) for t in _autocasting())
        return func(*args, **(kwargs or {}))


def _autocasting() -> list[str]:
    """The device types autocast is on for: a real kernel's operands would be cast to one dtype
    there, while on ``meta`` (where a fake step runs) autocast does nothing."""
    on = []
    for device_type in ("cpu", "cuda", "xpu", "mps"):
        try:
            if torch.is_autocast_enabled(device_type):
                on.append(device_type)
        except (RuntimeError, TypeError):  # a device type or a signature this torch lacks
            continue
    return on


def _arange_range(args: Any) -> tuple[int, int] | None:
    """The least and the most of ``torch.arange(*args)``, for whole numbers (None otherwise,
    or when it is empty)."""
    if not args or not all(type(a) is int for a in args):
        return None
    values = range(*args)
    if not values:
        return None
    return min(values[0], values[-1]), max(values[0], values[-1])
