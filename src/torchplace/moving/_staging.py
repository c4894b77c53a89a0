"""Large copies between pageable host memory and a CUDA device, through a ring of pinned buffers.

A plain ``tensor.to("cuda")`` from pageable memory goes through the driver's own small staging
buffers, one tensor at a time, at a fraction of the bus's speed (8 GB/s against 55 GB/s pinned on
an H100 host, see ``benchmarks/RESULTS.md``). ``Stager`` cuts each large tensor into chunks,
copies a chunk into a pinned buffer on the host (PyTorch's ``copy_`` uses every intra-op thread),
and queues its asynchronous transfer while the next chunk is being packed into the next buffer::

    pageable tensor --chunk--> pinned slot i --async copy, on the ring's own stream--> result
                               (STAGE_BUFFERS slots from the pool, each reused once its
                                transfer's event has completed)

Device to host runs the ring the other way (``Stager.copy_back``): up to ``STAGE_BUFFERS``
chunks are in flight into pinned slots while the host copies each finished one into the pageable
result, so a model comes back to the host at pinned speed without landing in page-locked memory.

**Overlap by construction.** The transfers run on a stream of their own per device
(``_transport.copy_stream``), never on the caller's: nothing else the caller or the move queues
on the current stream (a blocking ``.to()``, a kernel, a ``synchronize``) can sit between two
chunks or drain the ring, and the host never waits for anything but the event of the slot it is
about to reuse. The ring's stream first waits for the current stream, once per landing tensor
(its memory may have been freed by work queued there), and the current stream waits for the
ring's stream in ``finish``, so results are ordered on the current stream as a ``.to()`` would
be.

**The pool.** Slots come from ``pinned_pool()``, one process-wide ``PinnedPool`` of at most
``STAGE_BUFFERS`` slots of ``STAGE_CHUNK_BYTES`` (64 MiB of pinned memory), kept between moves
(the first move of a process pays for pinning once, later moves and loads reuse the slots) and
released by ``release_pinned_memory()``, when pinning fails for lack of memory, and when the
host runs low on memory (less than ``LOW_MEMORY_BYTES`` available: it then keeps nothing). The
checkpoint reader may take its slots from the same pool: ``pinned_pool().take(n)`` and
``give(slot, event)``.

**Testing without a GPU.** The ring talks to the device only through a ``Transport``
(``_transport``: queue a copy, record an event, make one stream wait for another);
``CudaTransport`` is the real one, and the tests drive the ring with one that performs copies
late, as a DMA engine does, to prove that no slot is refilled while its transfer may still read
it.

On an H100 host (``benchmarks/RESULTS.md``, 2026-11-22, with the pool's earlier shape of 4
slots of 16 MiB) the ring alone copied 1.5 GiB of 16 MiB tensors at 47-52 GB/s, against 55 GB/s
for one pinned copy; the pool's shape is now set by loads (see ``STAGE_BUFFERS``).
``STAGE_MIN_BYTES`` matches the largest tensor a consolidated copy takes
(``_consolidate.MAX_TENSOR_BYTES``).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .._devices import host_available
from .._tensor_size import PLAIN_TYPES
from ._transport import CudaTransport, Transport

__all__ = [
    "LOW_MEMORY_BYTES",
    "STAGE_BUFFERS",
    "STAGE_CHUNK_BYTES",
    "STAGE_MIN_BYTES",
    "PinnedPool",
    "Slot",
    "Stager",
    "pinned_pool",
    "release_pinned_memory",
    "stageable",
    "stageable_back",
]

STAGE_MIN_BYTES = 1 << 20
# 8 slots of 8 MiB (64 MiB), as measured on H200 hosts (benchmarks/RESULTS.md, 2026-11-28
# night): a load onto the GPU read 24.6-29 GB/s with 8 threads on 8 x 8 MiB, 20-26.5 on
# 8 x 16 MiB, 15-22 on 4 x 16 MiB (a thread holds one slot: 4 slots cap the reader at 4
# threads), and a bf16 model converted from fp32 on the GPU peaks at its bytes + 64 MiB (one
# slot's chunk per thread; 128 MiB with 16 MiB slots). Moves showed no shape clearly better.
STAGE_CHUNK_BYTES = 8 << 20
STAGE_BUFFERS = 8
# Below this much available host memory (Linux's MemAvailable) the pool keeps no slot after use.
LOW_MEMORY_BYTES = 1 << 30


def stageable(t: torch.Tensor, target: torch.device) -> bool:
    """Whether ``t`` goes to ``target`` through the pinned ring rather than ``Tensor.to``.

    Large, contiguous, pageable host tensors of a plain type bound for a CUDA device, with no
    autograd history to record (the ring copies bytes, which ``.to()`` would record as a step of
    the graph).

    >>> import torch
    >>> from torchplace.moving._staging import stageable
    >>> big = torch.empty(1 << 20)
    >>> stageable(big, torch.device("cuda", 0)), stageable(big, torch.device("cpu"))
    (True, False)
    >>> stageable(big.t() if big.dim() == 2 else big[::2], torch.device("cuda", 0))
    False
    """
    return (
        target.type == "cuda"
        and t.is_cpu
        and _plain_large(t)
        and not t.is_pinned()  # last: a driver call
    )


def stageable_back(t: torch.Tensor, target: torch.device) -> bool:
    """Whether ``t`` (on a CUDA device) comes back to the host ``target`` through the ring.

    >>> import torch
    >>> from torchplace.moving._staging import stageable_back
    >>> stageable_back(torch.empty(1 << 20), torch.device("cpu"))  # already on the host
    False
    """
    return target.type == "cpu" and t.is_cuda and _plain_large(t)


def _plain_large(t: torch.Tensor) -> bool:
    return (
        type(t) in PLAIN_TYPES
        and t.layout is torch.strided
        and t.nbytes >= STAGE_MIN_BYTES
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_quantized
        and not (t.requires_grad and torch.is_grad_enabled())
    )


# --- the pool ------------------------------------------------------------------------------------


class Slot:
    """One pinned buffer of the pool (``buffer``, uint8) and the event of its last transfer."""

    __slots__ = ("buffer", "event", "kept")

    def __init__(self, buffer: torch.Tensor, *, kept: bool) -> None:
        self.buffer = buffer
        self.event: Any = None
        self.kept = kept  # counted in the pool's bytes (False: dropped when given back)


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PinnedPool:
    """A bounded set of pinned host buffers that moves and loads take and give back.

    ``take(nbytes)`` returns a ``Slot`` whose buffer holds at least ``nbytes`` and whose last
    transfer has finished (it waits for that transfer's event if needed); ``give(slot, event)``
    returns it with the event recorded behind the transfer just queued from or into it. At most
    ``limit`` bytes are kept between uses, in slots of ``slot_bytes``; a request beyond that (or
    larger than a slot) gets a buffer of its own that is dropped when given back. Thread-safe.

    >>> from torchplace.moving._staging import PinnedPool
    >>> pool = PinnedPool(limit=64, slot_bytes=32, allocate=lambda n: torch.empty(n))
    >>> a, b, c = pool.take(32), pool.take(8), pool.take(8)
    >>> pool.kept_bytes, c.kept  # two slots of 32 kept, the third beyond the limit
    (64, False)
    >>> for slot in (a, b, c):
    ...     pool.give(slot, None)
    >>> d = pool.take(16)
    >>> d is a, pool.allocations  # reused: an idle slot, oldest first
    (True, 3)
    >>> pool.give(d, None)
    >>> pool.release(), pool.kept_bytes  # the idle slots go
    (64, 0)
    """

    def __init__(
        self,
        limit: int,
        slot_bytes: int,
        *,
        allocate: Callable[[int], torch.Tensor] = _pinned,
        available: Callable[[], int | None] = host_available,
    ) -> None:
        self.limit = limit
        self.slot_bytes = slot_bytes
        self._allocate = allocate
        self._available = available
        self._free: collections.deque[Slot] = collections.deque()
        self._lock = threading.Lock()
        self.kept_bytes = 0  # bytes of the slots the pool owns, free or taken
        self.allocations = 0  # pinned allocations made: a warm pool makes none
        self._checked = time.monotonic()  # when available host memory was last read

    def take(self, nbytes: int) -> Slot:
        """A slot of at least ``nbytes`` whose last transfer is done."""
        fits = nbytes <= self.slot_bytes
        with self._lock:
            # A slot whose transfer is done; else a new slot while under the limit; only then
            # the oldest busy one, waited for. Taking a busy slot while the pool may still grow
            # would make a ring wait for each transfer in turn: no overlap at all.
            slot = self._idle() if fits else None
            grow = slot is None and fits and self.kept_bytes + self.slot_bytes <= self.limit
            if grow:
                low = self._available()
                grow = low is None or low >= LOW_MEMORY_BYTES
            if grow:
                self.kept_bytes += self.slot_bytes  # reserved now, allocated below
            elif slot is None and fits and self._free:
                slot = self._free.popleft()
            if slot is None:
                self.allocations += 1  # made below; counted here, where threads cannot race
        if slot is not None:
            if slot.event is not None:
                slot.event.synchronize()  # the transfer out of (or into) it has finished
                slot.event = None
            return slot
        size = self.slot_bytes if grow else nbytes
        try:
            buffer = self._grow(size)
        except BaseException:
            if grow:
                with self._lock:
                    self.kept_bytes -= self.slot_bytes
            raise
        return Slot(buffer, kept=grow)

    def _idle(self) -> Slot | None:
        """The first free slot whose last transfer has finished (asked, not waited for)."""
        for slot in self._free:
            if slot.event is None or slot.event.query():
                self._free.remove(slot)
                slot.event = None
                return slot
        return None

    def _grow(self, nbytes: int) -> torch.Tensor:
        """A new pinned buffer; on failure (memory pressure) the idle slots and PyTorch's own
        cache of pinned blocks are released and it is tried once more."""
        try:
            return self._allocate(nbytes)
        except RuntimeError:
            self.release()
            _empty_torch_host_cache()
            return self._allocate(nbytes)

    def give(self, slot: Slot, event: Any) -> None:
        """Return ``slot``; ``event`` completes when the transfer just queued with it is done."""
        slot.event = event
        if not slot.kept:
            if event is not None:  # the pinned allocator keeps the block until then anyway
                event.synchronize()
            return
        now = time.monotonic()
        low = None
        if now - self._checked >= 1.0:  # reading /proc/meminfo costs 20 us: once a second
            self._checked = now
            low = self._available()
        with self._lock:
            pressure = low is not None and low < LOW_MEMORY_BYTES
            if pressure:  # the host runs low on memory: keep nothing
                self.kept_bytes -= self.slot_bytes
                slot.kept = False
            else:
                self._free.append(slot)
        if not slot.kept and event is not None:
            event.synchronize()
        if pressure:
            self.release()

    def release(self) -> int:
        """Drop every idle slot (after its transfer is done); returns the bytes released."""
        with self._lock:
            idle = list(self._free)
            self._free.clear()
            released = len(idle) * self.slot_bytes
            self.kept_bytes -= released
        for slot in idle:
            if slot.event is not None:
                slot.event.synchronize()
        return released


_POOL: PinnedPool | None = None
_POOL_LOCK = threading.Lock()


def pinned_pool() -> PinnedPool:
    """The process's pool of pinned staging buffers: ``STAGE_BUFFERS`` slots of
    ``STAGE_CHUNK_BYTES``, made on first use (no memory until a slot is taken). A benchmark that
    changes those constants gets a pool of the new shape (the old one is released)."""
    global _POOL
    limit, slot = STAGE_BUFFERS * STAGE_CHUNK_BYTES, STAGE_CHUNK_BYTES
    with _POOL_LOCK:
        old = pool = _POOL
        if pool is None or pool.limit != limit or pool.slot_bytes != slot:
            pool = _POOL = PinnedPool(limit, slot)
    if old is not None and old is not pool:
        old.release()
    return pool


def release_pinned_memory() -> int:
    """Give back the pinned host memory torchplace keeps for staging; returns the bytes freed.

    Moves and loads keep a bounded pool of pinned buffers (64 MiB at most) so that only
    the first one in a process pays for pinning memory. This frees that pool, waiting for any
    transfer still using it, and asks PyTorch to empty its own cache of pinned blocks (the
    staging of consolidated copies and of ``DeviceLoader``) where it can. The next move pins
    again. Call it when the host needs the memory back, for instance before forking workers.

    >>> from torchplace.moving import release_pinned_memory
    >>> release_pinned_memory() >= 0
    True
    """
    released = _POOL.release() if _POOL is not None else 0
    _empty_torch_host_cache()
    return released


def _empty_torch_host_cache() -> None:
    """Empty PyTorch's cache of pinned blocks, where this torch offers it (2.8 on) and CUDA
    is already in use (asking an uninitialised CUDA would initialise it)."""
    empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if callable(empty_host_cache) and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        empty_host_cache()


# --- the ring ------------------------------------------------------------------------------------


class Stager:
    """Copies large tensors between pageable host memory and one CUDA device through the ring.

    One ``Stager`` serves one ``move``. ``copy`` queues a host tensor's transfer and returns its
    device tensor at once; ``copy_back`` returns a device tensor's pageable host copy, complete.
    ``finish`` orders the current stream after every queued transfer (``move`` calls it before
    returning), ``synchronize`` waits for them on the host, ``abandon`` waits for them before
    results are dropped after a failure. ``transport`` and ``pool`` are for tests.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        transport: Transport | None = None,
        pool: PinnedPool | None = None,
    ) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.transport: Transport = transport if transport is not None else CudaTransport(device)
        self.pool = pool if pool is not None else pinned_pool()
        self.chunk = min(STAGE_CHUNK_BYTES, self.pool.slot_bytes)
        self.depth = STAGE_BUFFERS
        self.pending = False  # transfers queued since the last finish

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A new tensor on the device with ``t``'s values bit for bit, dtype, shape and strides.

        ``t`` may change as soon as this returns: its bytes are in the ring or already sent.
        """
        transport, pool, chunk = self.transport, self.pool, self.chunk
        with torch.no_grad():
            out = torch.empty_like(t, device=self.device)
            source = t.detach().reshape(-1).view(torch.uint8)
            landing = out.view(-1).view(torch.uint8)
            transport.begin()  # out's memory may have been freed by work queued before
            total = source.numel()
            for start in range(0, total, chunk):
                stop = min(start + chunk, total)
                slot = pool.take(stop - start)  # waits only for this slot's last transfer
                try:
                    staged = slot.buffer[: stop - start]
                    staged.copy_(source[start:stop])
                    transport.copy(landing[start:stop], staged)
                finally:
                    pool.give(slot, transport.mark())
        self.pending = True
        return out

    def copy_back(self, t: torch.Tensor) -> torch.Tensor:
        """A new pageable host tensor with the values of ``t`` (on the device), complete.

        Up to ``STAGE_BUFFERS`` chunks are in flight into pinned slots while the host copies
        each finished one into the result.
        """
        transport, pool, chunk = self.transport, self.pool, self.chunk
        with torch.no_grad():
            out = torch.empty_like(t, device="cpu")
            source = t.detach().reshape(-1).view(torch.uint8)
            landing = out.view(-1).view(torch.uint8)
            transport.begin()  # the device tensor's producers come first
            flight: collections.deque[tuple[Slot, Any, int, int]] = collections.deque()
            try:
                for start in range(0, source.numel(), chunk):
                    if len(flight) == self.depth:
                        self._land(flight.popleft(), landing)
                    stop = min(start + chunk, source.numel())
                    slot = pool.take(stop - start)
                    try:
                        transport.copy(slot.buffer[: stop - start], source[start:stop])
                        event = transport.mark()
                    except BaseException:
                        pool.give(slot, None)
                        raise
                    flight.append((slot, event, start, stop))
                while flight:
                    self._land(flight.popleft(), landing)
            finally:
                for slot, event, _, _ in flight:  # after a failure: give back once done
                    pool.give(slot, event)
        return out

    def _land(self, item: tuple[Slot, Any, int, int], landing: torch.Tensor) -> None:
        slot, event, start, stop = item
        try:
            event.synchronize()
            landing[start:stop].copy_(slot.buffer[: stop - start])
        finally:
            self.pool.give(slot, None)

    def finish(self) -> None:
        """Order the current stream after every transfer queued so far (no host wait)."""
        if self.pending:
            self.transport.finish()
            self.pending = False

    def synchronize(self) -> None:
        """Wait on the host for every transfer queued so far."""
        self.finish()
        self.transport.wait()

    def abandon(self) -> None:
        """After a failure: wait for queued transfers, so no result is freed while written."""
        self.transport.wait()
        self.pending = False
