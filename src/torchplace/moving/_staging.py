"""Large host-to-device copies from pageable memory, staged through a ring of pinned buffers.

A plain ``tensor.to("cuda")`` from pageable memory goes through the driver's own small staging
buffers, one tensor at a time, at a fraction of the bus's speed (8 GB/s against 55 GB/s pinned on
an H100 host, see ``benchmarks/RESULTS.md``). ``Stager`` cuts each large tensor into chunks,
copies a chunk into a pinned buffer on the host (PyTorch's ``copy_`` uses every intra-op thread),
and queues its asynchronous transfer while the next chunk is being packed into the next buffer::

    pageable tensor --chunk--> pinned buffer i --async copy--> its slice of the result
                               (a ring of STAGE_BUFFERS, reused once their copy has finished)

A buffer is reused only after the event recorded behind its last transfer has completed, so no
transfer reads bytes being overwritten. The host tensor may change as soon as ``copy`` returns:
its bytes are in the ring or already on the device. The results are ordered on the current
stream, as a ``.to()`` from pageable memory is. The buffers come from PyTorch's pinned-memory
allocator, which keeps each one until the copies queued from it are done, and caches it for the
next move.

On an H100 host (``benchmarks/RESULTS.md``), chunks of 16 MiB in a ring of 4 copied 1.5 GiB
of 16 MiB tensors at 47-52 GB/s, against 55 GB/s for one pinned copy; smaller chunks did worse
in that run, and ``benchmarks/bench_move.py --sweep`` inside whole moves found no setting
clearly better, within the host's noise. ``STAGE_MIN_BYTES`` matches the largest tensor a
consolidated copy takes (``_consolidate.MAX_TENSOR_BYTES``).
"""

from __future__ import annotations

import torch

from .._tensor_size import PLAIN_TYPES

__all__ = ["STAGE_BUFFERS", "STAGE_CHUNK_BYTES", "STAGE_MIN_BYTES", "Stager", "stageable"]

STAGE_MIN_BYTES = 1 << 20
STAGE_CHUNK_BYTES = 16 << 20
STAGE_BUFFERS = 4


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
        and type(t) in PLAIN_TYPES
        and t.layout is torch.strided
        and t.nbytes >= STAGE_MIN_BYTES
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_quantized
        and not (t.requires_grad and torch.is_grad_enabled())
        and not t.is_pinned()  # last: a driver call
    )


class Stager:
    """Copies large pageable host tensors to one CUDA device through a ring of pinned buffers.

    One ``Stager`` serves one ``move``; its buffers go back to PyTorch's pinned-memory cache when
    it is dropped. ``synchronize`` waits until every queued transfer has finished.
    """

    def __init__(self, device: torch.device) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        self._next = 0

    def _buffer(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next buffer of the ring (its index, and ``nbytes`` of it) once its copy is done."""
        i = self._next
        self._next = (i + 1) % STAGE_BUFFERS
        if i == len(self._buffers):
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
            self._events.append(None)
        event = self._events[i]
        if event is not None:
            event.synchronize()
        if self._buffers[i].numel() < nbytes:  # grown to the largest chunk seen, at most a chunk
            self._buffers[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return i, self._buffers[i][:nbytes]

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A new tensor on the device with ``t``'s values bit for bit, dtype, shape and strides."""
        with torch.no_grad():
            out = torch.empty_like(t, device=self.device)
            source = t.detach().reshape(-1).view(torch.uint8)
            landing = out.view(-1).view(torch.uint8)
            stream = torch.cuda.current_stream(self.device)
            total = source.numel()
            for start in range(0, total, STAGE_CHUNK_BYTES):
                stop = min(start + STAGE_CHUNK_BYTES, total)
                i, buffer = self._buffer(stop - start)
                buffer.copy_(source[start:stop])
                landing[start:stop].copy_(buffer, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                self._events[i] = event
        return out

    def synchronize(self) -> None:
        """Wait for every transfer queued so far."""
        for event in self._events:
            if event is not None:
                event.synchronize()
