"""CRC-32 as zip files record it, computed piece by piece and joined, so that threads reading one
record side by side can each check the chunk they read.

``combine(crc_a, crc_b, len_b)`` is the CRC-32 of ``a + b`` from the two CRCs and ``b``'s length
(zlib's ``crc32_combine``, which Python's ``zlib`` does not offer): appending ``len_b`` zero bytes
to ``a`` is a linear map over GF(2), found by squaring the one-zero-bit operator, and cached by
length (a record's chunks but its last have one length, so a join is one 32-step product).

``crc32()`` is the function that computes a chunk's CRC-32: ISA-L's (``isal.isal_zlib.crc32``,
a runtime dependency) where it can be imported, else ``zlib.crc32`` (a platform without an
``isal`` wheel); both give the same values and release the GIL while they run, so reading
threads overlap. In the reader's threads ISA-L's runs at about 8.5 GB/s a core and zlib's at 2.5
(``bench_read.py --crc``): a check adding about 13% to a read from the page cache against
40-60%. The check is on by default for reads into host memory either way (``check_as_read``,
``benchmarks/RESULTS.md``): a flipped bit never loads silently. It is picked once, on first use.
"""

from __future__ import annotations

import functools
import importlib
import zlib
from collections.abc import Callable
from typing import Any

__all__ = ["check_as_read", "combine", "crc32", "fast_crc"]

Crc32 = Callable[[Any], int]  # a buffer's CRC-32, as zlib.crc32 computes it

_CHECK = (b"123456789", 0xCBF43926)  # CRC-32's check value


@functools.cache
def _pick() -> tuple[Crc32, bool]:
    """(the CRC-32 function, whether it is ISA-L's): ISA-L's where it imports and gives the
    check value, else zlib's."""
    try:
        fast = importlib.import_module("isal.isal_zlib").crc32
    except (ImportError, AttributeError):
        return zlib.crc32, False
    if fast(_CHECK[0]) != _CHECK[1]:  # a broken build: zlib's is right, if slower
        return zlib.crc32, False
    return fast, True


def crc32() -> Crc32:
    """The CRC-32 function the reader's threads call: ISA-L's, else zlib's.

    >>> crc32()(b"checkpoint") == zlib.crc32(b"checkpoint")
    True
    """
    return _pick()[0]


def fast_crc() -> bool:
    """Whether ``crc32()`` is ISA-L's (the ``isal`` dependency installed and working)."""
    return _pick()[1]


def check_as_read(check_crc: bool | None, target: str = "cpu") -> bool:
    """Whether the reader checks each record's CRC-32 as it reads it onto a ``target`` device
    type: ``check_crc`` if given. Left to ``None`` (the default): into host memory, always.
    ISA-L's CRC-32 (a runtime dependency) costs about 13% of a read from the page cache into
    fresh memory (its page faults dominate); zlib's, the fallback where ``isal`` has no wheel,
    40-60%, and it stays on there too: a flipped bit must not load silently. Onto a GPU the reads
    go into pinned buffers already faulted in, memcpy-fast: there ISA-L's check took 56% more of
    a thread's time on the CPU (not yet measured on a GPU), so it is off by default.

    >>> check_as_read(True, "cuda"), check_as_read(False), check_as_read(None, "cuda")
    (True, False, False)
    >>> check_as_read(None)
    True
    """
    if check_crc is not None:
        return check_crc
    return target == "cpu"


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
