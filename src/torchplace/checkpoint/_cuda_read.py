"""Byte ranges of a file onto a CUDA device, through the process's bounded pool of pinned buffers
(``moving._staging.pinned_pool``, which moves use too): ``CUDA_READ_THREADS`` threads (never
more than the pool has slots) each take a slot, read a chunk into it and queue its asynchronous
copy through a ``moving._transport.Transport`` (by default on the caller's current stream), then
give the slot back behind the copy's event, so reads, copies and other threads' reads overlap as
``_staging.Stager`` overlaps packing and copies for tensors already in memory: the model never
passes through a pageable copy of itself, and loads and moves share one bounded pool.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Sequence

import torch

from ..moving._staging import PinnedPool, pinned_pool
from ..moving._transport import CurrentStream, Transport
from ._crc import Crc32, crc32
from ._host_read import PREADV, as_bytes, byte_view, converted_from, failed_checks, pread_exactly
from ._plan_items import ReadItem
from ._read_threads import CORES, read_in_threads, thread_count

__all__ = ["CUDA_READ_THREADS", "read_cuda"]


# Threads that read onto a CUDA device, set by ``benchmarks/bench_load_gpu.py --sweep`` on an
# H200 host (2026-11-28): 8 threads on the pool's 8 slots of 8 MiB read 1 GiB onto the GPU at
# 29 GB/s; 16 threads on 16 slots of 4 MiB, 15 GB/s. At most one thread per slot of the pool
# reads at a time, so the pool's shape caps this.
CUDA_READ_THREADS = max(1, min(8, CORES)) if PREADV else 1

# One chunk onto the device: (where it lands, the file's dtype if it differs from the landing
# tensor's, where it starts in the file, its bytes, its index among checked chunks or -1).
_Send = tuple[torch.Tensor, torch.dtype | None, int, int, int]


def _cuda_sends(
    items: Sequence[ReadItem], chunk: int
) -> tuple[list[_Send], list[tuple[int, int, str, list[int]]], int]:
    """``read_cuda``'s items cut into chunks of at most ``chunk`` bytes (whole elements of the
    file's dtype): the sends, the checked items (CRC-32, first checked chunk, name, chunk
    lengths) and how many chunks are checked."""
    sends: list[_Send] = []
    checked: list[tuple[int, int, str, list[int]]] = []
    crc_chunks = 0
    for item in items:
        offset, t, stored = item.start, item.into, converted_from(item)
        check = item.check  # the file's bytes, as staged
        size = 1 if stored is None else stored.itemsize
        step = chunk // size * size  # whole elements per chunk
        if stored is None:
            landing = as_bytes(t)
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
    """One chunk of ``read_cuda`` read into a slot taken from ``pool`` (its CRC-32 into
    ``crcs`` where checked) and its copy queued; the slot goes back behind the copy's event,
    also where the read or the queuing fails or is interrupted."""
    part, stored, offset, nbytes, crc_at = sent
    slot = pool.take(nbytes)  # waits only for this slot's last copy
    event = None
    queued = False  # a copy from the slot may be in flight: it is given back behind it
    try:
        staged = slot.buffer[:nbytes]
        pread_exactly(fd, byte_view(staged), offset)
        if crc_at >= 0:
            crcs[crc_at] = crc(byte_view(staged))  # while it is in this core's cache
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


def read_cuda(
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
    threads = thread_count(min(CUDA_READ_THREADS, slots), len(sends))
    read_in_threads(share, threads, stop)
    return failed_checks(
        [
            (crc, name, [(crcs[first + k], n) for k, n in enumerate(lengths)])
            for crc, first, name, lengths in checked
        ]
    )
