"""A file's bytes straight into tensors that already exist: no mapping, no second copy.

``read_into(path, items)`` fills each ``ReadItem`` (``_plan_items``: from which byte, into which
tensor, from which dtype) with the bytes of the file from its ``start`` on. On the CPU the bytes go
by ``os.preadv`` straight into each tensor's memory, cut into chunks that a few threads read side
by side (a read from the page cache is a memcpy that releases the GIL, and the page faults of fresh
memory are taken on as many cores as read; the ranks torchrun starts on one machine share its
cores). On Linux each chunk's pages are first populated in one call (``MADV_POPULATE_WRITE``),
which took 15-20% off a 512 MiB read into a fresh process against a fault per 4 KiB page; asking
for huge pages instead (``MADV_HUGEPAGE``) made warm reads 3x faster but fresh processes 3x slower
on the 2-core VM it was measured on (the host backs new huge pages slowly), so it is not done. Onto
a CUDA device the bytes go through the process's bounded pool of pinned buffers
(``moving._staging.pinned_pool``, which moves use too): ``CUDA_READ_THREADS`` threads (never more
than the pool has slots) each take a slot, read a chunk into it and queue its asynchronous copy on
the caller's current stream, then give the slot back behind the copy's event, so reads, copies and
other threads' reads overlap as ``_staging.Stager`` overlaps packing and copies for tensors already
in memory: the model never passes through a pageable copy of itself, and loads and moves share one
bounded pool. Nothing of this has been timed on a GPU yet: ``benchmarks/bench_load_gpu.py --sweep``
is to set the thread count and the pool's shape.
"""

from __future__ import annotations

import inspect
import io
import mmap
import os
import shutil
import sys
import threading
import warnings
import zipfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch

from .._errors import CheckpointError, user_stacklevel
from ..moving._staging import PinnedPool, pinned_pool
from ..moving._transport import CurrentStream, Transport
from ._crc import Crc32, combine, crc32
from ._entries import Stamp, changed_error
from ._formats import device_failure, diagnose, first_sentence, out_of_memory
from ._opened import open_file, opened, raw_file, unopenable
from ._plan_items import ReadItem
from ._progress import current
from ._zip_layout import ZipLayout

__all__ = [
    "NO_CRC",
    "READ_CHUNK_BYTES",
    "READ_THREADS",
    "SPARSE_CHECK_NOTE",
    "UNUSUAL",
    "DTypeWish",
    "OpenFiles",
    "check_records",
    "copy_file",
    "map_file",
    "read_into",
    "read_zip",
    "safetensors_load",
    "torch_load",
    "unchecked_warning",
]

READ_CHUNK_BYTES = 16 << 20
_PREADV = hasattr(os, "preadv")
_CORES = os.cpu_count() or 1  # asked once: each call cost 20-75 us of a fill's hot path
READ_THREADS = max(1, min(4, _CORES)) if _PREADV else 1


def _threads(cap: int, tasks: int) -> int:
    """How many threads read ``tasks`` chunks: ``cap``, but a share of the cores when torchrun
    started several processes on this machine (``LOCAL_WORLD_SIZE``), since its ranks read at
    once. Two ranks of two threads each on two cores filled shards 1.27-1.34x as slowly as each
    rank reading its own rows in one thread; one thread each, 1.05-1.09x (``bench_sharded.py``)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:  # the device picker says what is wrong with it; reading needs no more
        local = 1
    if local > 1:
        cap = min(cap, max(1, _CORES // local))
    return max(1, min(cap, tasks))


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


def _converting(item: ReadItem) -> torch.dtype | None:
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
    """``_read_host``'s items (each read from the file of its ``fds``) cut into chunks of at
    most ``READ_CHUNK_BYTES``: the direct chunks, the converting ones, the checked items, and a
    CRC-32 slot per checked chunk."""
    direct: list[_Direct] = []
    converting: list[_Converting] = []
    checked: list[_Checked] = []
    crcs: dict[tuple[int, int], int] = {}  # a checked chunk's task -> its file bytes' CRC-32
    for item, fd in zip(items, fds, strict=True):
        offset, t, stored = item.start, item.into, _converting(item)
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


def _read_host(
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
                _pread_exactly(fd, view, offset)
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
            _pread_exactly(fd, _memory(raw), offset)
            if (1, n) in crcs:
                crcs[1, n] = crc(_memory(raw))  # the file's bytes, as stored
            flat[first:last].copy_(raw.view(stored))  # converted in place, a chunk at a time
            if advance is not None:
                advance(nbytes)

    count = _threads(READ_THREADS if threads is None else threads, len(tasks))
    _read_in_threads(share, count, stop)
    return _failed_checks(
        [(crc, name, [(crcs[task], n) for task, n in chunks]) for crc, name, chunks in checked]
    )


def _failed_checks(checked: Sequence[tuple[int, str, Sequence[tuple[int, int]]]]) -> list[str]:
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


# Threads that read onto a CUDA device, set by ``benchmarks/bench_load_gpu.py --sweep`` on an
# H200 host (2026-11-28): 8 threads on the pool's 8 slots of 8 MiB read 1 GiB onto the GPU at
# 29 GB/s; 16 threads on 16 slots of 4 MiB, 15 GB/s. At most one thread per slot of the pool
# reads at a time, so the pool's shape caps this.
CUDA_READ_THREADS = max(1, min(8, _CORES)) if _PREADV else 1

# One chunk onto the device: (where it lands, the file's dtype if it differs from the landing
# tensor's, where it starts in the file, its bytes, its index among checked chunks or -1).
_Send = tuple[torch.Tensor, torch.dtype | None, int, int, int]


def _cuda_sends(
    items: Sequence[ReadItem], chunk: int
) -> tuple[list[_Send], list[tuple[int, int, str, list[int]]], int]:
    """``_read_cuda``'s items cut into chunks of at most ``chunk`` bytes (whole elements of the
    file's dtype): the sends, the checked items (CRC-32, first checked chunk, name, chunk
    lengths) and how many chunks are checked."""
    sends: list[_Send] = []
    checked: list[tuple[int, int, str, list[int]]] = []
    crc_chunks = 0
    for item in items:
        offset, t, stored = item.start, item.into, _converting(item)
        check = item.check  # the file's bytes, as staged
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
    return sends, checked, crc_chunks


def _send(
    sent: _Send,
    fd: int,
    pool: PinnedPool,
    transport: Transport,
    crcs: list[int],
    crc: Crc32,
) -> None:
    """One chunk of ``_read_cuda`` read into a slot taken from ``pool`` (its CRC-32 into
    ``crcs`` where checked) and its copy queued; the slot goes back behind the copy's event,
    also where the read or the queuing fails or is interrupted."""
    part, stored, offset, nbytes, crc_at = sent
    slot = pool.take(nbytes)  # waits only for this slot's last copy
    event = None
    queued = False  # a copy from the slot may be in flight: it is given back behind it
    try:
        staged = slot.buffer[:nbytes]
        _pread_exactly(fd, _memory(staged), offset)
        if crc_at >= 0:
            crcs[crc_at] = crc(_memory(staged))  # while it is in this core's cache
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


def _read_cuda(
    fd: int,
    items: Sequence[ReadItem],
    device: torch.device,
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
    in disjoint bytes, and a checked item's CRC-32 is joined from its chunks' own. A chunk of
    another dtype than its tensor is converted by the copy itself, on the device, through a
    temporary of a chunk (peak device memory: the model plus a chunk per thread). A failure or
    Ctrl-C in any thread stops the others at their next chunk; every copy already queued was
    given back with its slot behind an event, and no thread outlives the call. ``pool`` and
    ``transport`` are for tests; by default the copies run on the device's current stream (from
    every thread), so the model's first use is ordered after them."""
    pool = pool if pool is not None else pinned_pool()
    transport = transport if transport is not None else CurrentStream(device)
    sends, checked, crc_chunks = _cuda_sends(items, pool.slot_bytes)  # a chunk: a slot
    crcs = [0] * crc_chunks  # each checked chunk's CRC-32, written by the thread that read it
    crc = crc32() if checked else zlib.crc32  # ISA-L's is imported only when it is used
    stop = threading.Event()  # set on a failure or Ctrl-C: the other threads read no more

    def share(k: int, threads: int) -> None:
        try:
            for n in range(k, len(sends), threads):
                if stop.is_set():
                    return
                _send(sends[n], fd, pool, transport, crcs, crc)
                if advance is not None:
                    advance(sends[n][3])
        except BaseException:
            stop.set()
            raise

    slots = max(1, pool.limit // pool.slot_bytes)
    threads = _threads(min(CUDA_READ_THREADS, slots), len(sends))
    _read_in_threads(share, threads, stop)
    return _failed_checks(
        [
            (crc, name, [(crcs[first + k], n) for k, n in enumerate(lengths)])
            for crc, first, name, lengths in checked
        ]
    )


class OpenFiles:
    """Files open for reading by path, each the file its catalog parsed: its stamp (size, mtime,
    inode, ctime) is checked when it is opened and again by ``verify`` after the reads, so that a
    file rewritten while it was read raises ``CheckpointError`` instead of mixing old and new
    bytes.

    ``read_into`` reads one file's items this way; a fill (``_boxes.BoxReader``, plain or
    sharded) keeps one ``OpenFiles`` for a whole load, reading every box through it.

    Each file is an ``io.FileIO``, which opens its descriptor and holds it in one C call, closes
    it at most once, and closes it when dropped: wherever a ``KeyboardInterrupt`` lands (just
    after the open, part-way through ``close``, where a ``with`` block skips ``__exit__``), no
    descriptor outlives the interrupt, and none is closed twice (a number another file may have
    taken by then).
    """

    def __init__(self, stamps: Mapping[Path, Stamp | None] | None = None) -> None:
        self.stamps = {p: s for p, s in (stamps or {}).items() if s is not None}
        self.files: dict[Path, io.FileIO] = {}  # its own, closed by close()
        self.shared: dict[Path, io.FileIO] = {}  # the call's (``_opened``), closed by the call

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fd(self, path: Path) -> int:
        """The open file of ``path`` (opened, and its stamp checked, on first use)."""
        file = self.files.get(path) or self.shared.get(path)
        if file is None:
            shared = raw_file(path)  # the call's open file, if a call holds one
            if shared is not None:
                file = self.shared[path] = shared
            else:
                file = self.files[path] = open_file(path)  # recorded at once: close() closes it
            try:
                _same_file(path, file.fileno(), self.stamps.get(path))
            except BaseException:
                if shared is None:
                    file.close()
                    del self.files[path]
                else:
                    del self.shared[path]
                raise
        return file.fileno()

    def read(
        self,
        path: Path,
        items: Sequence[ReadItem],
        fresh: bool = True,
        threads: int | None = None,
    ) -> None:
        """``read_into``'s reads from the open file of ``path``; its stamp is checked again
        only by ``verify`` (and before a CRC-32 failure is reported: a changed file says so)."""
        host: list[ReadItem] = []
        elsewhere: list[ReadItem] = []
        for i in items:  # one pass, no device objects made (a fill reads hundreds of items)
            if i.into.nbytes:
                (host if i.into.is_cpu else elsewhere).append(i)
        fd = self.fd(path)
        advance = current()  # the progress bar shown, if any (None: nothing to pay)
        failed = _read_host(fd, host, advance, fresh, threads)
        by_device: dict[torch.device, list[ReadItem]] = {}
        for item in elsewhere:
            by_device.setdefault(item.into.device, []).append(item)
        for dev, group in by_device.items():
            if dev.type == "cuda":
                failed += _read_cuda(fd, group, dev, advance)
                continue
            for item in group:  # another accelerator: a tensor at a time through the host
                t = item.into
                bounce = torch.empty(t.shape, dtype=_converting(item) or t.dtype)
                failed += _read_host(fd, [ReadItem(item.start, bounce, None, item.check)], advance)
                t.copy_(bounce)
        if failed:
            _same_file(path, fd, self.stamps.get(path))
            raise CheckpointError(
                f"{path}: is corrupt: {', '.join(failed[:5])} "
                f"{'fails its' if len(failed) == 1 else 'fail their'} CRC-32 check (the bytes "
                "of the tensors were damaged after the file was written); save or fetch it again",
                path=path,
            )

    def read_files(
        self,
        pending: Mapping[Path, Sequence[ReadItem]],
        fresh: bool = True,
        threads: int | None = None,
    ) -> None:
        """``read`` of each file's items in ``pending``; where every item lands whole on the
        host, unchecked (a sharded fill's on the CPU), all files' items in one go (one pool of
        threads, one set-up: a call per file cost 0.3-0.6 ms of a 30 ms fill)."""
        items = [i for group in pending.values() for i in group]
        if len(pending) < 2 or any(i.check is not None or not i.into.is_cpu for i in items):
            for path, group in pending.items():
                self.read(path, group, fresh, threads)
            return
        fds = [self.fd(path) for path, group in pending.items() for _ in group]
        _read_host(fds, items, current(), fresh, threads)

    def verify(self) -> None:
        """Every file read is still the one catalogued (``CheckpointError`` if not)."""
        for p, file in [*self.files.items(), *self.shared.items()]:
            _same_file(p, file.fileno(), self.stamps.get(p))

    def close(self) -> None:
        """Every file closed, whatever interrupts arrive meanwhile (a closed one is skipped);
        the first of them is raised once the last file is closed."""
        interrupted: BaseException | None = None
        while True:
            try:
                for file in self.files.values():
                    file.close()
                break
            except BaseException as exc:  # a Ctrl-C part-way: close the rest, then raise it
                interrupted = interrupted or exc
        self.files.clear()
        self.shared.clear()
        if interrupted is not None:
            raise interrupted


def read_into(
    path: Path,
    items: Sequence[ReadItem],
    /,
    stamp: Stamp | None = None,
    fresh: bool = True,
    threads: int | None = None,
) -> None:
    """Fill each ``ReadItem`` of ``items`` with ``path``'s bytes from its ``start`` on.

    >>> import os, tempfile, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "bytes")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(bytes(range(8)))
    >>> a, b = torch.empty(2, dtype=torch.uint8), torch.empty(3, dtype=torch.uint8)
    >>> read_into(path, [ReadItem(1, a), ReadItem(5, b)])
    >>> a.tolist(), b.tolist()
    ([1, 2], [5, 6, 7])

    Each tensor must be contiguous and hold exactly the bytes to read (its ``nbytes``), on the
    CPU or an accelerator; an item with a ``stored`` dtype reads elements of that dtype from
    the file and converts them into the tensor's own dtype a chunk at a time (so the tensor's
    bytes plus a chunk per reading thread is all the memory the read takes). Raises ``OSError``
    for a read that fails and ``EOFError`` for a file that ends too soon; the tensors then hold
    what was read so far. With the ``stamp`` the file had when its catalog was made, the open
    file must still match it before the first read and after the last (its size, mtime,
    inode and ctime), or ``CheckpointError`` says that it changed while it was read. An item's
    ``check`` is the CRC-32 its bytes must have and a name for them (a zip record's), and an item
    that fails it raises ``CheckpointError`` naming it. ``fresh=False`` says the host
    tensors' pages are already resident (a model's own memory, filled in place), so they are not
    populated first (that costs about 40% of a read from the page cache into resident memory).
    ``threads``: at most this many threads read into host memory (``READ_THREADS`` if None; 1
    reads on the calling thread).
    """
    with OpenFiles({path: stamp}) as files:
        files.read(path, items, fresh, threads)
        files.verify()  # no write landed while it was read


def _read_in_threads(
    share: Callable[[int, int], None], threads: int, stop: threading.Event
) -> None:
    """``share(0, 1)`` in this thread where one thread reads, else ``_run_shares``."""
    if threads <= 1:
        share(0, 1)
    else:
        _run_shares(share, threads, stop)


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


# ------------------------------------------------------------------ a torch zip file, by its layout
# The catalog's layout of a zip file (where each record's bytes are) and torch's own weights-only
# unpickler: each storage record read by ``read_into`` straight into its storage on the target.

DTypeWish = Callable[[str], "torch.dtype | None"]  # the dtype wanted for a file's tensor, by name


UNUSUAL = object()  # what read_zip returns for a file it leaves to torch.load


class _Unusual(Exception):
    """A zip file laid out in a way read_zip does not read (torch.load reads it instead)."""


def read_zip(
    layout: ZipLayout,
    target: torch.device,
    when: Stamp,
    check_crc: bool,
    dtype_of: DTypeWish | None = None,
    wanted: Callable[[str], bool] | None = None,
) -> Any:
    """A torch zip file's objects, each record read into a storage on ``target``.

    Returns ``UNUSUAL`` for anything it does not read itself, or that fails: a refused
    global, a compressed or mis-sized record, a file written big-endian. ``torch.load`` then
    reads it, or raises the error the caller turns into a sentence about the file. Only a lack
    of memory or a failing device is reported here, since it would fail there again.

    With ``dtype_of`` (``load_into``'s wish: the model's floating dtype by the file's name), a
    state dict's storages are first unpickled onto ``meta``; a floating storage whose tensors
    all want one other floating dtype is then allocated in that dtype and converted a chunk at a
    time as it is read, so the file's dtype never lands whole on the target. There, a storage
    whose every tensor's name ``wanted`` refuses is not read at all, and those names are not in
    the result (a load by map's disk modules, keys ``rename`` drops).
    """
    mine = sys.byteorder.encode()
    if layout.byteorder != mine and (layout.byteorder is not None or mine != b"little"):
        return UNUSUAL
    if dtype_of is None and wanted is not None:  # unpickled on meta first all the same: each
        dtype_of = _as_saved  # storage's names are known before it is read, or skipped
    if dtype_of is not None:
        read = _read_zip_once(layout, target, when, check_crc, dtype_of, wanted)
        if read is not UNUSUAL:
            return read
    return _read_zip_once(layout, target, when, check_crc, None)


def _as_saved(name: str) -> torch.dtype | None:
    """A dtype wish for no tensor: each read in its file's dtype."""
    return None


class _Record:
    """A storage record of a zip file as the unpickler met it: where its bytes are, its dtype
    in the file and elements, its CRC-32 to check (if asked), the bytes given to the unpickler
    (on ``meta`` while the dtype it is read in waits for the tensors' wishes), and the typed
    storage over them that the unpickler was handed."""

    __slots__ = ("check", "data", "dtype", "numel", "start", "storage")

    def __init__(
        self,
        start: int,
        dtype: torch.dtype,
        numel: int,
        check: tuple[int, str] | None,
        data: torch.Tensor,
    ) -> None:
        self.start, self.dtype, self.numel, self.check, self.data = start, dtype, numel, check, data
        self.storage = torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
            wrap_storage=data.untyped_storage(), dtype=dtype, _internal=True
        )


def _read_zip_once(
    layout: ZipLayout,
    target: torch.device,
    when: Stamp,
    check_crc: bool,
    dtype_of: DTypeWish | None,
    wanted: Callable[[str], bool] | None = None,
) -> Any:
    p = layout.path
    defer = dtype_of is not None  # storages on meta until every tensor's wish is known
    records: dict[str, _Record] = {}
    try:

        def persistent_load(saved_id: Any) -> Any:
            if not isinstance(saved_id, tuple) or len(saved_id) != 5:
                raise _Unusual(f"persistent id {saved_id!r}")
            typename, storage_type, key, _location, numel = saved_id
            if typename not in ("storage", b"storage") or not isinstance(key, str):
                raise _Unusual(f"persistent id {saved_id!r}")
            if key in records:
                return records[key].storage
            if storage_type is torch.UntypedStorage:
                dtype = torch.uint8
            else:
                dtype = storage_type.dtype
            nbytes = numel * dtype.itemsize
            name = f"{layout.prefix}data/{key}"
            info = layout.records.get(name)
            start = layout.starts.get(name, -1)
            if info is None or info.compress_type != 0 or info.file_size != nbytes or start < 0:
                raise _Unusual(f"record data/{key}")
            check = (info.CRC, info.filename) if check_crc and info.CRC else None  # 0: none
            data = torch.empty(nbytes, dtype=torch.uint8, device="meta" if defer else target)
            records[key] = _Record(start, dtype, numel, check, data)
            return records[key].storage

        from torch import _weights_only_unpickler

        unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(layout.pickle), encoding="utf-8")
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
        result = unpickler.load()  # type: ignore[no-untyped-call]
        if dtype_of is not None:
            reads = _read_in_wished_dtypes(result, records, target, dtype_of, wanted)
        else:
            reads = [ReadItem(r.start, r.data, None, r.check) for r in records.values()]
        read_into(p, reads, when)
        _check_sparse()  # once their bytes are in: before, they hold what the allocator left
    except CheckpointError:  # the file changed while it was read
        _forget_sparse_checks()
        raise
    except KeyboardInterrupt:
        _forget_sparse_checks()
        raise
    except Exception as exc:
        _forget_sparse_checks()  # queued by this read: torch.load would check them next
        if out_of_memory(exc) or device_failure(exc):
            raise CheckpointError(f"{p}: {diagnose(exc, True, target)}", path=p) from exc
        return UNUSUAL
    return result


def _read_in_wished_dtypes(
    result: Any,
    records: Mapping[str, _Record],
    target: torch.device,
    dtype_of: DTypeWish,
    wanted: Callable[[str], bool] | None = None,
) -> list[ReadItem]:
    """A state dict unpickled onto ``meta`` given real storages on ``target``, in place: a
    floating storage whose tensors all wish for one other floating dtype in that dtype (read
    converting), any other in the file's bytes. Returns what to read into them.

    Raises ``_Unusual`` for anything but a dict of plain dense tensors (a parameter, a sparse
    or quantized tensor, a nested object, a tensor saved with a conjugate or negative bit or
    attributes of its own), which is then read as saved."""
    if not isinstance(result, dict):
        raise _Unusual("not a state dict")
    by_storage = {r.data.untyped_storage()._cdata: r for r in records.values()}
    users: dict[int, list[tuple[Any, torch.Tensor]]] = {}
    for name, t in result.items():
        if type(t) is not torch.Tensor or t.layout != torch.strided or not isinstance(name, str):
            raise _Unusual(f"{name!r} is not a plain tensor")
        if t.is_conj() or t.is_neg() or t.__dict__:  # saved state a rebuilt view would lose
            raise _Unusual(f"{name!r} carries a conjugate or negative bit, or attributes")
        key = t.untyped_storage()._cdata
        record = by_storage.get(key)
        if record is None or t.dtype != record.dtype:
            raise _Unusual(f"{name!r} views a storage of another dtype")
        users.setdefault(key, []).append((name, t))
    reads: list[ReadItem] = []
    for key, record in by_storage.items():
        held = users.get(key, [])
        if wanted is not None and held and not any(wanted(name) for name, _ in held):
            for name, _ in held:  # none of its tensors is wanted: not read, not given
                del result[name]
            continue
        wishes = {dtype_of(name) for name, _ in held}
        want = wishes.pop() if len(wishes) == 1 else None
        dtype = record.dtype
        floating = want is not None and want.is_floating_point and dtype.is_floating_point
        if floating and want != dtype:
            assert want is not None
            real = torch.empty(record.numel, dtype=want, device=target)
            reads.append(ReadItem(record.start, real, dtype, record.check))  # a chunk at a time
            dtype = want
        else:
            real = torch.empty(record.numel * dtype.itemsize, dtype=torch.uint8, device=target)
            reads.append(ReadItem(record.start, real, None, record.check))
        for name, t in users.get(key, []):
            made = torch.empty(0, dtype=dtype, device=target)
            made.set_(real.untyped_storage(), t.storage_offset(), t.size(), t.stride())
            result[name] = made.requires_grad_(t.requires_grad)
    return reads


def _check_sparse() -> None:
    """torch's check of the sparse tensors just read, as its safe loader makes it: always from
    torch 2.15 (bad indices would be read out of bounds later), before only when
    ``torch.sparse.check_sparse_tensor_invariants`` is on (torch 2.6: always too)."""
    validate: Any = torch._utils._validate_loaded_sparse_tensors  # its signature varies
    if "weights_only" not in inspect.signature(validate).parameters:
        validate()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SPARSE_CHECK_NOTE)
        validate(weights_only=True)


def _forget_sparse_checks() -> None:
    """Drop the sparse tensors an abandoned read queued for torch's check on their indices.

    torch keeps them in a list that the next load empties; left there, a read that failed
    half-way would have ``torch.load`` check tensors never filled, and refuse a sound file as
    corrupt."""
    getter = getattr(torch._utils, "_get_sparse_tensors_to_validate", None)  # torch 2.15
    queued = (
        getter() if callable(getter) else getattr(torch._utils, "_sparse_tensors_to_validate", None)
    )
    if isinstance(queued, list):
        queued.clear()


# ------------------------------------------------------------------------- whole files, by others
# What torchplace does not read itself is read here by its own library, the file's stamp checked
# after: torch.load (a trusted file, a mapped one, a legacy or unusual zip file) and the
# safetensors package (a mapped file, a big-endian machine). The caller turns their failures into
# a sentence about the file.

# torch 2.15's note that checking sparse tensors takes time: torchplace's to take, not the user's
SPARSE_CHECK_NOTE = "Validating sparse tensor invariants"


def torch_load(path: Path, target: torch.device, *, mmap: bool, trusted: bool, stamp: Stamp) -> Any:
    """``torch.load`` of a whole torch file onto ``target`` (``weights_only`` unless
    ``trusted``), refused with ``CheckpointError`` if the file no longer has ``stamp`` after."""
    with warnings.catch_warnings():  # torch's note on pickle protocols is not the user's
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        warnings.filterwarnings("ignore", message=SPARSE_CHECK_NOTE)
        if mmap:  # torch maps the file by its path
            loaded = torch.load(path, map_location=target, mmap=True, weights_only=not trusted)
        else:
            with opened(path) as f:
                loaded = torch.load(f, map_location=target, weights_only=not trusted)
    now = Stamp.of(os.stat(path))
    if now != stamp:  # torch read it by its path: a rewrite shows in the stamp
        raise changed_error(path, stamp, now)
    return loaded


def safetensors_load(
    path: Path, target: torch.device, *, mmap: bool, stamp: Stamp | None = None
) -> dict[str, torch.Tensor]:
    """A ``.safetensors`` file's tensors on ``target`` by the safetensors package: mapped
    (``mmap=True``), or read whole and converted to the machine's byte order; refused with
    ``CheckpointError`` if the file no longer has ``stamp`` (its catalog's) after."""
    import safetensors
    import safetensors.torch

    if not mmap:
        with opened(path) as f:
            data = safetensors.torch.load(f.read())
        out = {k: v.to(target) for k, v in data.items()}
    else:
        device = _safetensors_device(target)
        with safetensors.safe_open(str(path), framework="pt", device=device) as f:
            out = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    if stamp is not None:
        now = Stamp.of(os.stat(path))
        if now != stamp:
            raise changed_error(path, stamp, now)
    return out


def _safetensors_device(target: torch.device) -> str:
    # safetensors takes a device *string*; "mps:0" is spelt "mps".
    return "mps" if target.type == "mps" else str(target)


def check_records(p: Path) -> None:
    """Every record of a zip file that records a CRC-32 read through ``zipfile``, which checks
    it (a CRC of 0 is "not recorded": torch writes none with its CRC-32 option off); a warning
    where no record has one, since nothing could be checked."""
    checked = 0
    try:
        with opened(p) as f, zipfile.ZipFile(f) as archive:
            for info in archive.infolist():
                if not info.CRC:
                    continue
                checked += 1
                with archive.open(info) as record:
                    while record.read(16 << 20):
                        pass
    except (PermissionError, IsADirectoryError) as exc:  # not damage: said as it is
        raise unopenable(p, exc) from exc
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, NotImplementedError) as exc:
        raise CheckpointError(
            f"{p}: is corrupt ({type(exc).__name__}: {first_sentence(str(exc))}); the bytes were "
            "damaged after the file was written, so save or fetch it again",
            path=p,
        ) from exc
    if not checked:
        unchecked_warning(p, NO_CRC)


NO_CRC = "it records no CRC-32 (saved with torch.serialization.set_crc32_options(False))"


def unchecked_warning(p: Path, why: str) -> None:
    """Say that ``check_crc=True`` could check nothing in ``p``, and why."""
    warnings.warn(
        f"{p}: check_crc=True, but {why}, so nothing was checked: its bytes are read as they are",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def copy_file(path: Path, out: Any) -> None:
    """Every byte of ``path`` written to the file object ``out`` as it is, ``CheckpointError``
    if the file changed while it was copied (its stamp before and after)."""
    with open_file(path) as f:  # a pipe put there is refused, not read
        before = Stamp.of(os.fstat(f.fileno()))
        shutil.copyfileobj(f, out, READ_CHUNK_BYTES)
        now = Stamp.of(os.fstat(f.fileno()))
    if now != before:
        raise changed_error(path, before, now)


def map_file(path: Path) -> mmap.mmap:
    """``path`` mapped copy-on-write: the page cache's pages, each copied only where written
    (nothing here writes), for tensors that view a file's bytes (the disk tier with
    ``mmap=True``). Opened as every checkpoint is (``open_file``: a pipe is never opened)."""
    with open_file(path) as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
