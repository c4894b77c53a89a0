"""A file's bytes straight into tensors that already exist: no mapping, no second copy.

``read_into(path, pieces)`` fills each ``(offset, tensor)`` with the bytes of the file from
``offset`` on. On the CPU the bytes go by ``os.preadv`` straight into each tensor's memory, cut
into chunks that a few threads read side by side (a read from the page cache is a memcpy that
releases the GIL, and the page faults of fresh memory are taken on as many cores as read). On Linux
each chunk's pages are first populated in one call (``MADV_POPULATE_WRITE``), which took 15-20% off
a 512 MiB read into a fresh process against a fault per 4 KiB page; asking for huge pages instead
(``MADV_HUGEPAGE``) made warm reads 3x faster but fresh processes 3x slower on the 2-core VM it was
measured on (the host backs new huge pages slowly), so it is not done. Onto a CUDA device the bytes
go through the process's bounded pool of pinned buffers (``moving._staging.pinned_pool``, which
moves use too): ``CUDA_READ_THREADS`` threads (never more than the pool has slots) each take a
slot, read a chunk into it and queue its asynchronous copy on the caller's current stream, then
give the slot back behind the copy's event, so reads, copies and other threads' reads overlap
as ``_staging.Stager`` overlaps packing and copies for tensors already in memory: the model never
passes through a pageable copy of itself, and loads and moves share one bounded pool. Nothing of
this has been timed on a GPU yet: ``benchmarks/bench_load_gpu.py --sweep`` is to set the thread
count and the pool's shape.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch

from .._errors import CheckpointError
from ..moving._staging import (
    CudaTransport,
    PinnedPool,
    Transport,
    pinned_pool,
)
from ._catalog import Stamp, changed_error
from ._crc import combine
from ._progress import current

__all__ = ["READ_CHUNK_BYTES", "READ_THREADS", "Piece", "read_into"]

READ_CHUNK_BYTES = 16 << 20
_PREADV = hasattr(os, "preadv")
READ_THREADS = max(1, min(4, os.cpu_count() or 1)) if _PREADV else 1


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
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


def _memory(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 host tensor's bytes (no copy)."""
    return memoryview(cast(Any, t.numpy()))


def _pread_exactly(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` with the file's bytes from ``offset``; ``EOFError`` where the file ends."""
    done = 0
    total = len(view)
    while done < total:
        if _PREADV:
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


Piece = tuple[int, torch.Tensor] | tuple[int, torch.Tensor, torch.dtype]


def _split(piece: Piece) -> tuple[int, torch.Tensor, torch.dtype | None]:
    """(offset, tensor, the file's dtype where it differs from the tensor's, else None)."""
    if len(piece) == 3:
        offset, t, stored = piece
        return offset, t, (None if stored == t.dtype else stored)
    offset, t = piece
    return offset, t, None


Checks = Mapping[int, tuple[int, str]]  # a piece's offset -> (its record's CRC-32, its name)


def _read_host(
    fd: int,
    pieces: Sequence[Piece],
    checks: Checks | None = None,
    advance: Callable[[int], None] | None = None,
    populate: bool = True,
) -> list[str]:
    """Direct pieces read straight into their memory; converting ones a chunk at a time into a
    buffer of each thread's own (``READ_CHUNK_BYTES``) and converted into place from there, so
    a model never holds a second, file-dtype copy of itself.

    With ``checks``, each chunk of a checked piece has its CRC-32 computed by the thread that
    read it, right after the read, and the chunks' CRCs are joined per piece; returns the names
    of the pieces whose CRC-32 differs from the one recorded.
    """
    # (where to, from where, its address) for a direct chunk; (tensor's elements, first and
    # last element, from where, the file's dtype) for a converting one
    direct: list[tuple[memoryview, int, int]] = []
    converting: list[tuple[torch.Tensor, int, int, int, torch.dtype]] = []
    checked: list[tuple[int, int, str, list[int]]] = []  # CRC, 1st chunk, name, chunk lengths
    crcs: dict[int, int] = {}  # a checked chunk's index in ``direct`` -> its CRC-32
    for piece in pieces:
        offset, t, stored = _split(piece)
        if stored is None:
            data = _as_bytes(t)
            view = _memory(data)
            address = data.data_ptr()
            check = checks.get(offset) if checks else None
            if check is not None:
                lengths = [
                    min(READ_CHUNK_BYTES, len(view) - a)
                    for a in range(0, len(view), READ_CHUNK_BYTES)
                ]
                checked.append((check[0], len(direct), check[1], lengths))
            for start in range(0, len(view), READ_CHUNK_BYTES):
                chunk = view[start : start + READ_CHUNK_BYTES]
                if check is not None:
                    crcs[len(direct)] = 0
                direct.append((chunk, offset + start, address + start))
            continue
        flat = t.detach().reshape(-1)
        step = READ_CHUNK_BYTES // stored.itemsize
        for first in range(0, flat.numel(), step):
            last = min(first + step, flat.numel())
            converting.append((flat, first, last, offset + first * stored.itemsize, stored))
    tasks = [(0, k) for k in range(len(direct))] + [(1, k) for k in range(len(converting))]

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
                view, offset, address = direct[n]
                if populate:
                    _populate(address, len(view))
                _pread_exactly(fd, view, offset)
                if n in crcs:
                    crcs[n] = zlib.crc32(view)  # while the chunk is in this core's cache
                if advance is not None:
                    advance(len(view))
                continue
            flat, first, last, offset, stored = converting[n]
            nbytes = (last - first) * stored.itemsize
            if staging is None:
                staging = torch.empty(READ_CHUNK_BYTES, dtype=torch.uint8)
            raw = staging[:nbytes]
            _pread_exactly(fd, _memory(raw), offset)
            flat[first:last].copy_(raw.view(stored))  # converted in place, a chunk at a time
            if advance is not None:
                advance(nbytes)

    threads = min(READ_THREADS, len(tasks))
    if threads <= 1:
        share(0, 1)
    else:
        _run_shares(share, threads, stop)
    failed = []
    for expected, first, name, lengths in checked:
        crc = crcs[first]
        for k, length in enumerate(lengths[1:], start=1):
            crc = combine(crc, crcs[first + k], length)
        if crc != expected:
            failed.append(name)
    return failed


class _CurrentStream(CudaTransport):
    """Copies queued on the current stream of one CUDA device, events recorded behind them:
    what reads onto the device do after them (a conversion, the model's first use) is ordered
    after them by the stream alone, so there is nothing to order at the start or the end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = self.caller = torch.cuda.current_stream(device)

    def begin(self) -> None:
        """Nothing to order: the copies run on the caller's own stream."""

    def finish(self) -> None:
        """Nothing to order: the copies run on the caller's own stream."""


# Threads that read onto a CUDA device. A guess from the H200 host (positional reads
# into pinned memory: 4-5 GB/s with 1 thread, 21-30 with 8, 33-39 with 16), never measured on a
# GPU with this reader: set it by ``benchmarks/bench_load_gpu.py --sweep`` on a GPU host (which
# also sweeps the pool's shape, since at most one thread per slot of the pool reads at a time:
# with today's pool of 4 slots of 16 MiB, 4 threads read however large this is).
CUDA_READ_THREADS = max(1, min(8, os.cpu_count() or 1)) if _PREADV else 1

# One chunk onto the device: (where it lands, the file's dtype if it differs from the landing
# tensor's, where it starts in the file, its bytes, its index among checked chunks or -1).
_Send = tuple[torch.Tensor, torch.dtype | None, int, int, int]


def _read_cuda(
    fd: int,
    pieces: Sequence[Piece],
    device: torch.device,
    checks: Checks | None = None,
    advance: Callable[[int], None] | None = None,
    *,
    pool: PinnedPool | None = None,
    transport: Transport | None = None,
) -> list[str]:
    """Chunks read by several threads, each into a pinned slot of the process's pool
    (``moving._staging.pinned_pool``, the bounded pool that moves take theirs from too) and
    sent on with an asynchronous copy; the slot goes back to the pool behind the copy's event
    and is taken again only once that copy is done (the pool waits for its event).

    Threads: ``CUDA_READ_THREADS``, but never more than the pool has slots (a thread holds one
    slot from its read until its copy is queued), so the staging area stays the pool's size
    whatever the thread count. Chunks go to threads in turn and arrive in any order: they land
    in disjoint bytes, and a checked piece's CRC-32 is joined from its chunks' own. A chunk of
    another dtype than its tensor is converted by the copy itself, on the device, through a
    temporary of a chunk (peak device memory: the model plus a chunk per thread). A failure or
    Ctrl-C in any thread stops the others at their next chunk; every copy already queued was
    given back with its slot behind an event, and no thread outlives the call. ``pool`` and
    ``transport`` are for tests; by default the copies run on the device's current stream (from
    every thread), so the model's first use is ordered after them."""
    pool = pool if pool is not None else pinned_pool()
    transport = transport if transport is not None else _CurrentStream(device)
    chunk = pool.slot_bytes  # a chunk fills a slot
    sends: list[_Send] = []
    checked: list[tuple[int, int, str, list[int]]] = []  # CRC, 1st chunk, name, chunk lengths
    crc_chunks = 0
    for piece in pieces:
        offset, t, stored = _split(piece)
        check = checks.get(offset) if checks and stored is None else None
        size = 1 if stored is None else stored.itemsize
        step = chunk // size * size  # whole elements per chunk
        if stored is None:
            landing = _as_bytes(t)
            total = landing.numel()
        else:
            landing = t.detach().reshape(-1)
            total = landing.numel() * size
        lengths = [min(step, total - start) for start in range(0, total, step)]
        if check is not None:
            checked.append((check[0], crc_chunks, check[1], lengths))
        for k, start in enumerate(range(0, total, step)):
            part = landing[start // size : (start + lengths[k]) // size]
            crc_at = crc_chunks + k if check is not None else -1
            sends.append((part, stored, offset + start, lengths[k], crc_at))
        if check is not None:
            crc_chunks += len(lengths)
    crcs = [0] * crc_chunks  # each checked chunk's CRC-32, written by the thread that read it
    stop = threading.Event()  # set on a failure or Ctrl-C: the other threads read no more

    def send(n: int) -> None:
        part, stored, offset, nbytes, crc_at = sends[n]
        slot = pool.take(nbytes)  # waits only for this slot's last copy
        event = None
        queued = False  # a copy from the slot may be in flight: it is given back behind it
        try:
            staged = slot.buffer[:nbytes]
            _pread_exactly(fd, _memory(staged), offset)
            if crc_at >= 0:
                crcs[crc_at] = zlib.crc32(_memory(staged))  # while it is in this core's cache
            queued = True
            # converted into the tensor's dtype by the copy where the file's dtype differs
            transport.copy(part, staged if stored is None else staged.view(stored))
            event = transport.mark()
        finally:
            if event is None and queued:  # failed or interrupted after queuing the copy
                try:
                    event = transport.mark()
                except BaseException:
                    transport.wait()
            pool.give(slot, event)
        if advance is not None:
            advance(nbytes)

    def share(k: int, threads: int) -> None:
        try:
            for n in range(k, len(sends), threads):
                if stop.is_set():
                    return
                send(n)
        except BaseException:
            stop.set()
            raise

    slots = max(1, pool.limit // pool.slot_bytes)
    threads = min(CUDA_READ_THREADS, slots, len(sends))
    if threads <= 1:
        share(0, 1)
    else:
        _run_shares(share, threads, stop)
    failed = []
    for expected, first, name, lengths in checked:
        crc = crcs[first] if lengths else 0  # an empty piece: the CRC-32 of no bytes
        for k, length in enumerate(lengths[1:], start=1):
            crc = combine(crc, crcs[first + k], length)
        if crc != expected:
            failed.append(name)
    return failed


def read_into(
    path: Path,
    pieces: Sequence[Piece],
    /,
    stamp: Stamp | None = None,
    checks: Checks | None = None,
    fresh: bool = True,
) -> None:
    """Fill each ``(offset, tensor)`` of ``pieces`` with ``path``'s bytes from ``offset`` on.

    >>> import os, tempfile, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "bytes")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(bytes(range(8)))
    >>> a, b = torch.empty(2, dtype=torch.uint8), torch.empty(3, dtype=torch.uint8)
    >>> read_into(path, [(1, a), (5, b)])
    >>> a.tolist(), b.tolist()
    ([1, 2], [5, 6, 7])

    Each tensor must be contiguous and hold exactly the bytes to read (its ``nbytes``), on the
    CPU or an accelerator; a piece ``(offset, tensor, dtype)`` reads elements of ``dtype`` from
    the file and converts them into the tensor's own dtype a chunk at a time (so the tensor's
    bytes plus a chunk per reading thread is all the memory the read takes). Raises ``OSError``
    for a read that fails and ``EOFError`` for a file that ends too soon; the tensors then hold
    what was read so far. With the ``stamp`` the file had when its catalog was made, the open
    file must still match it before the first read and after the last (its size, mtime and
    inode), or ``CheckpointError`` says that it changed while it was read. ``checks`` maps a
    piece's offset to the CRC-32 its bytes must have and a name for them (a zip record's), and
    a piece that fails it raises ``CheckpointError`` naming it. ``fresh=False`` says the host
    tensors' pages are already resident (a model's own memory, filled in place), so they are not
    populated first (that costs about 40% of a read from the page cache into resident memory).
    """
    host = [p for p in pieces if p[1].device.type == "cpu" and p[1].nbytes]
    elsewhere = [p for p in pieces if p[1].device.type != "cpu" and p[1].nbytes]
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        _same_file(path, fd, stamp)
        advance = current()  # the progress bar shown, if any (None: nothing to pay)
        failed = _read_host(fd, host, checks, advance, fresh)
        by_device: dict[torch.device, list[Piece]] = {}
        for piece in elsewhere:
            by_device.setdefault(piece[1].device, []).append(piece)
        for dev, group in by_device.items():
            if dev.type == "cuda":
                failed += _read_cuda(fd, group, dev, checks, advance)
                continue
            for piece in group:  # another accelerator: a tensor at a time through the host
                offset, t, stored = _split(piece)
                bounce = torch.empty(t.shape, dtype=stored or t.dtype)
                failed += _read_host(fd, [(offset, bounce)], checks, advance)
                t.copy_(bounce)
        _same_file(path, fd, stamp)  # no write landed while it was read
        if failed:
            raise CheckpointError(
                f"{path}: is corrupt: {', '.join(failed[:5])} "
                f"{'fails its' if len(failed) == 1 else 'fail their'} CRC-32 check (the bytes "
                "of the tensors were damaged after the file was written); save or fetch it again"
            )
    finally:
        os.close(fd)


def _run_shares(share: Callable[[int, int], None], threads: int, stop: threading.Event) -> None:
    """Run ``share(k, threads)`` on ``threads`` threads and re-raise the first failure.

    A failure or Ctrl-C stops the others at their next chunk, and this returns only once every
    thread has finished, whatever interrupts arrive meanwhile: the caller closes the file the
    threads read from, and a number closed under a live read could be reused by another file.
    """
    pool = ThreadPoolExecutor(threads, thread_name_prefix="torchplace-read")
    interrupted: BaseException | None = None
    try:
        futures = [pool.submit(share, k, threads) for k in range(threads)]
        for future in futures:
            future.result()
    except BaseException:
        stop.set()
        raise
    finally:
        while True:
            try:
                pool.shutdown(wait=True, cancel_futures=True)
                break
            except BaseException as exc:  # a second Ctrl-C: stop is set, keep waiting
                stop.set()
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted


def _same_file(path: Path, fd: int, stamp: Stamp | None) -> None:
    if stamp is not None:
        now = Stamp.of(os.fstat(fd))
        if now != stamp:
            raise changed_error(path, stamp, now)
