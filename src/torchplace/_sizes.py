"""Sizes for people: bytes in binary units. Plain Python, so the command line can show sizes
without importing torch."""

from __future__ import annotations

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
