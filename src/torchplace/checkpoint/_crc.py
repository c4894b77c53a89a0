"""CRC-32 as zip files record it, computed piece by piece and joined, so that threads reading one
record side by side can each check the chunk they read.

``combine(crc_a, crc_b, len_b)`` is the CRC-32 of ``a + b`` from the two CRCs and ``b``'s length
(zlib's ``crc32_combine``, which Python's ``zlib`` does not offer): appending ``len_b`` zero bytes
to ``a`` is a linear map over GF(2), found by squaring the one-zero-bit operator, and cached by
length (a record's chunks but its last have one length, so a join is one 32-step product).
"""

from __future__ import annotations

import functools

__all__ = ["combine"]

_POLY = 0xEDB88320  # CRC-32's polynomial, reflected


def _times(matrix: tuple[int, ...], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(matrix, row) for row in matrix)


@functools.lru_cache(maxsize=64)
def _zeros(length: int) -> tuple[int, ...]:
    """The operator that appends ``length`` zero bytes to a CRC-32's register."""
    op = (_POLY, *(1 << n for n in range(31)))  # one zero bit
    op = _square(_square(_square(op)))  # one zero byte: eight bits
    result: tuple[int, ...] | None = None
    while length:
        if length & 1:
            result = op if result is None else tuple(_times(op, row) for row in result)
        length >>= 1
        if length:
            op = _square(op)
    assert result is not None
    return result


def combine(crc_a: int, crc_b: int, len_b: int, /) -> int:
    """The CRC-32 of ``a + b`` given ``crc32(a)``, ``crc32(b)`` and ``len(b)``.

    >>> import zlib
    >>> combine(zlib.crc32(b"check"), zlib.crc32(b"point"), 5) == zlib.crc32(b"checkpoint")
    True
    """
    if len_b == 0:
        return crc_a
    return _times(_zeros(len_b), crc_a) ^ crc_b
