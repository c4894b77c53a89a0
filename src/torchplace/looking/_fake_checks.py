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
        self.ranges: Any = WeakTensorKeyDictionary()  # tensor -> (least, most) value
        self.autocast = False  # autocast was on where the running torch function was called

    def seen(self) -> AutocastSeen:
        """The mode that keeps ``autocast`` up to date while a step runs."""
        return AutocastSeen(self)

    def before(self, func: Any, args: Any) -> None:
        name = _name(func)
        one_dtype = name in _ONE_DTYPE and getattr(func, "_overloadname", None) == "default"
        if one_dtype and not self.autocast:  # autocast casts them on the real device
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
            self.ranges[out] = known
        elif out in self.ranges:  # changed in place (clamp_, add_, index_put_): not known now
            del self.ranges[out]

    def _range(self, t: Any) -> tuple[int, int] | None:
        known: tuple[int, int] | None = self.ranges.get(t) if isinstance(t, torch.Tensor) else None
        return known

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


class AutocastSeen(TorchFunctionMode):
    """Notes, for each torch function a step calls, whether autocast is on there: inside an
    operator's dispatch (where the checks run) autocast reads as off."""

    def __init__(self, checks: FakeChecks) -> None:
        super().__init__()
        self.checks = checks

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.checks.autocast = _autocasting()
        return func(*args, **(kwargs or {}))


def _autocasting() -> bool:
    """Whether autocast is on for any device type: a real kernel's operands would be cast to
    one dtype there, while on ``meta`` (where a fake step runs) autocast does nothing."""
    for device_type in ("cpu", "cuda", "xpu", "mps"):
        try:
            if torch.is_autocast_enabled(device_type):
                return True
        except (RuntimeError, TypeError):  # a device type or a signature this torch lacks
            continue
    return False


def _arange_range(args: Any) -> tuple[int, int] | None:
    """The least and the most of ``torch.arange(*args)``, for whole numbers (None otherwise,
    or when it is empty)."""
    if not args or not all(type(a) is int for a in args):
        return None
    values = range(*args)
    if not values:
        return None
    return min(values[0], values[-1]), max(values[0], values[-1])
