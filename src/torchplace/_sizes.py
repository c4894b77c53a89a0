"""Sizes for people and from people: bytes in binary units (``format_bytes``) and budgets such as
``"10GiB"`` read back (``parse_size``). Plain Python, so the command line can show sizes
without importing torch."""

from __future__ import annotations

import math
import numbers
import operator
import re

from ._errors import DeviceSpecError

__all__ = ["format_bytes"]


def format_bytes(n: int) -> str:
    """Bytes in binary units.

    >>> from torchplace._sizes import format_bytes
    >>> format_bytes(512), format_bytes(4096), format_bytes(3 * 2**30)
    ('512 B', '4.0 KiB', '3.0 GiB')
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(value: object, where: str) -> int:
    """Bytes from ``1024``, ``"500MB"`` (10**6) or ``"10GiB"`` (2**30); ``where`` names it.

    Any integer type counts (``operator.index``: numpy and torch integers too), and so does a
    real number that is a whole number of bytes (``1e9``, ``np.float32(2**20)``).
    """
    if isinstance(value, bool):
        raise DeviceSpecError(f"{where}: a budget is a size like '10GiB' or bytes, not {value!r}")
    negative = f"{where}: the budget {value!r} is negative; give a size >= 0 such as '10GiB'"
    if not isinstance(value, str):
        count: int | None = None
        try:
            count = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            if isinstance(value, numbers.Real) and math.isfinite(value):
                if value < 0:
                    raise DeviceSpecError(negative) from None
                if not float(value).is_integer():
                    raise DeviceSpecError(
                        f"{where}: the budget {value!r} is not a whole number of bytes; give "
                        "an int, or a string such as '1.5GiB'"
                    ) from None
                count = int(float(value))
        if count is not None:
            if count < 0:
                raise DeviceSpecError(negative)
            return count
    if isinstance(value, str):
        if value.strip().startswith("-") and _SIZE.match(value.strip()[1:]):
            raise DeviceSpecError(negative)
        match = _SIZE.match(value)
        if match is not None:
            unit = match.group(2).lower()
            if unit in _UNITS:
                return int(float(match.group(1)) * _UNITS[unit])
            if unit in ("k", "m", "g", "t"):
                raise DeviceSpecError(
                    f"{where}: the size {value!r} has no unit in bytes; write "
                    f"'{match.group(1)}{unit.upper()}iB' (powers of 1024) or "
                    f"'{match.group(1)}{unit.upper()}B' (powers of 1000)"
                )
    raise DeviceSpecError(
        f"{where}: cannot read the size {value!r}; write bytes as an int or a string such as "
        "'10GiB', '512MiB' (powers of 1024) or '500MB', '2GB' (powers of 1000)"
    )
