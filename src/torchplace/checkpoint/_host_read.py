"""Byte ranges of a file straight into host tensors that already exist: no mapping, no second
copy.

The bytes go by ``os.preadv`` straight into each tensor's memory, cut into chunks that a few
threads (``_read_threads``) read side by side (a read from the page cache is a memcpy that
releases the GIL, and the page faults of fresh memory are taken on as many cores as read; the
ranks torchrun starts on one machine share its cores). On Linux each chunk's pages are first
populated in one call (``MADV_POPULATE_WRITE``), which took 15-20% off a 512 MiB read into a
fresh process against a fault per 4 KiB page; asking for huge pages instead (``MADV_HUGEPAGE``)
made warm reads 3x faster but fresh processes 3x slower on the 2-core VM it was measured on (the
host backs new huge pages slowly), so it is not done. An item of another dtype in the file is
read a chunk at a time into a buffer of each thread's own and converted into place, and each
checked chunk's CRC-32 is computed by the thread that read it.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from ._crc import combine, crc32
from ._plan_items import ReadItem
from ._read_threads import CORES, read_in_threads, thread_count

__all__ = [
    "PREADV",
    "READ_CHUNK_BYTES",
    "READ_THREADS",
    "as_bytes",
    "byte_view",
    "converted_from",
    "failed_checks",
    "pread_exactly",
    "read_host",
]

READ_CHUNK_BYTES = 16 << 20
PREADV = hasattr(os, "preadv")
READ_THREADS = max(1, min(4, CORES)) if PREADV else 1


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view of the same memory."""
    flat = t.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` on Linux, None elsewhere (or where ctypes cannot reach it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError, ImportError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return cast(Callable[[int, int, int], int], madvise)


_MADVISE = _libc_madvise()
_MADV_POPULATE_WRITE = 23  # Linux 5.14 on; older kernels refuse it, and the read faults instead
_PAGE = mmap.PAGESIZE


def _populate(address: int, nbytes: int) -> None:
    """Fault in the whole pages of ``[address, address + nbytes)`` in one call; advice only."""
    start = -(-address // _PAGE) * _PAGE
    end = (address + nbytes) // _PAGE * _PAGE
    if _MADVISE is not None and end - start >= 16 * _PAGE:
        _MADVISE(start, end - start, _MADV_POPULATE_WRITE)


def _bytes_of(t: torch.Tensor) -> tuple[memoryview, int]:
    """A writable memoryview of a contiguous host tensor's bytes (no copy), and their address;
    with as few calls into torch as it takes (a fill makes one per tensor it reads)."""
    if t.requires_grad:
        t = t.detach()
    if not t.dim() or t.stride(-1) != 1 or not t.numel():
        # 0-d, empty, or contiguous with a last dim of size 1 strided otherwise (channels_last
        # 1x1 convolutions: torch calls them contiguous), which a dtype view refuses
        t = t.reshape(-1)
    return memoryview(cast(Any, t.view(torch.uint8).numpy())).cast("B"), t.data_ptr()


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 host tensor's bytes (no copy)."""
    return memoryview(cast(Any, t.numpy()))


def pread_exactly(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` with the file's bytes from ``offset``; ``EOFError`` where the file ends."""
    done = 0
    total = len(view)
    while done < total:
        if PREADV:
            n = os.preadv(fd, [view[done:]], offset + done)
        else:  # no preadv (Windows): one thread only, so the seek and the read stay together
            os.lseek(fd, offset + done, os.SEEK_SET)
            data = os.read(fd, min(total - done, READ_CHUNK_BYTES))
            n = len(data)
            view[done : done + n] = data
        if n == 0:
            raise EOFError(
                f"the file ends at byte {offset + done}, inside a tensor that runs to byte "
                f"{offset + total}"
            )
        done += n


def converted_from(item: ReadItem) -> torch.dtype | None:
    """The file's dtype of ``item`` where it differs from its tensor's, else None."""
    stored = item.stored
    return None if stored is None or stored == item.into.dtype else stored


# The reader's own cut of ``ReadItem``s into chunks, private to it (its threads' hot path).
# A host read's chunks: (where to, from where, its address) for a direct one; (tensor's
# elements, first and last element, from where, the file's dtype) for a converting one. A
# chunk's task is (0, its index among direct chunks) or (1, its index among converting ones); a
# checked item is (its recorded CRC-32, its name, [(its chunks' tasks, their lengths)]).
_Direct = tuple[memoryview, int, int, int]  # and the file it is read from
_Converting = tuple[torch.Tensor, int, int, int, torch.dtype, int]
_Checked = tuple[int, str, list[tuple[tuple[int, int], int]]]


def _host_chunks(
    items: Sequence[ReadItem], fds: Sequence[int]
) -> tuple[list[_Direct], list[_Converting], list[_Checked], dict[tuple[int, int], int]]:
    """``read_host``'s items (each read from the file of its ``fds``) cut into chunks of at
    most ``READ_CHUNK_BYTES``: the direct chunks, the converting ones, the checked items, and a
    CRC-32 slot per checked chunk."""
    direct: list[_Direct] = []
    converting: list[_Converting] = []
    checked: list[_Checked] = []
    crcs: dict[tuple[int, int], int] = {}  # a checked chunk's task -> its file bytes' CRC-32
    for item, fd in zip(items, fds, strict=True):
        offset, t, stored = item.start, item.into, converted_from(item)
        chunks: list[tuple[tuple[int, int], int]] = []
        if stored is None:
            view, address = _bytes_of(t)
            if 0 < len(view) <= READ_CHUNK_BYTES:  # one chunk (most tensors): no slicing
                chunks.append(((0, len(direct)), len(view)))
                direct.append((view, offset, address, fd))
            else:
                for start in range(0, len(view), READ_CHUNK_BYTES):
                    chunk = view[start : start + READ_CHUNK_BYTES]
                    chunks.append(((0, len(direct)), len(chunk)))
                    direct.append((chunk, offset + start, address + start, fd))
        else:
            flat = t.detach().reshape(-1)
            step = READ_CHUNK_BYTES // stored.itemsize
            for first in range(0, flat.numel(), step):
                last = min(first + step, flat.numel())
                chunks.append(((1, len(converting)), (last - first) * stored.itemsize))
                at = offset + first * stored.itemsize
                converting.append((flat, first, last, at, stored, fd))
        check = item.check
        if check is not None:
            checked.append((check[0], check[1], chunks))
            crcs.update(dict.fromkeys((task for task, _ in chunks), 0))
    return direct, converting, checked, crcs


def read_host(
    fd: int | Sequence[int],
    items: Sequence[ReadItem],
    advance: Callable[[int], None] | None = None,
    populate: bool = True,
    threads: int | None = None,
) -> list[str]:
    """Direct items read straight into their memory; converting ones a chunk at a time into a
    buffer of each thread's own (``READ_CHUNK_BYTES``) and converted into place from there, so
    a model never holds a second, file-dtype copy of itself. ``threads``: at most this many
    threads read (``READ_THREADS`` if None; 1 reads on the calling thread, starting none).

    Each chunk of a checked item (its ``check``) has its CRC-32 computed by the thread that
    read it, right after the read, and the chunks' CRCs are joined per item; returns the names
    of the items whose CRC-32 differs from the one recorded. ``fd``: the file every item is
    read from, or each item's own (one call for the files of a sharded fill).
    """
    fds = [fd] * len(items) if isinstance(fd, int) else fd
    direct, converting, checked, crcs = _host_chunks(items, fds)
    tasks = [(0, k) for k in range(len(direct))] + [(1, k) for k in range(len(converting))]
    crc = crc32() if checked else zlib.crc32  # ISA-L's is imported only when it is used

    stop = threading.Event()  # set on a failure or Ctrl-C: the other threads read no more

    def share(k: int, threads: int) -> None:
        try:
            _share(k, threads)
        except BaseException:
            stop.set()
            raise

    def _share(k: int, threads: int) -> None:
        staging: torch.Tensor | None = None
        for kind, n in tasks[k::threads]:
            if stop.is_set():
                return
            if kind == 0:
                view, offset, address, fd = direct[n]
                if populate:
                    _populate(address, len(view))
                pread_exactly(fd, view, offset)
                if (0, n) in crcs:
                    crcs[0, n] = crc(view)  # while the chunk is in this core's cache
                if advance is not None:
                    advance(len(view))
                continue
            flat, first, last, offset, stored, fd = converting[n]
            nbytes = (last - first) * stored.itemsize
            if staging is None:
                staging = torch.empty(READ_CHUNK_BYTES, dtype=torch.uint8)
            raw = staging[:nbytes]
            pread_exactly(fd, byte_view(raw), offset)
            if (1, n) in crcs:
                crcs[1, n] = crc(byte_view(raw))  # the file's bytes, as stored
            flat[first:last].copy_(raw.view(stored))  # converted in place, a chunk at a time
            if advance is not None:
                advance(nbytes)

    count = thread_count(READ_THREADS if threads is None else threads, len(tasks))
    read_in_threads(share, count, stop)
    return failed_checks(
        [(crc, name, [(crcs[task], n) for task, n in chunks]) for crc, name, chunks in checked]
    )


def failed_checks(checked: Sequence[tuple[int, str, Sequence[tuple[int, int]]]]) -> list[str]:
    """The names of the checked items whose CRC-32 differs from the one recorded. Each is
    (the recorded CRC-32, its name, [(a chunk's CRC-32, its length), ...] in file order): the
    chunks' CRCs are joined (an empty item's is the CRC-32 of no bytes, 0)."""
    failed = []
    for expected, name, chunks in checked:
        crc = chunks[0][0] if chunks else 0
        for part, length in chunks[1:]:
            crc = combine(crc, part, length)
        if crc != expected:
            failed.append(name)
    return failed
