"""How bytes get onto a device: the one ``Transport`` protocol and its CUDA implementations.

A transport queues asynchronous copies on a stream of its own, records events behind them and
orders streams against each other. Everything that sends bytes to a CUDA device in pieces goes
through one: the pinned ring of ``move`` (``_staging.Stager``) and the checkpoint reader's
copies onto the device (``checkpoint._cuda_read``). Tests drive both with transports that
perform the copies late, as a DMA engine does, to prove that no buffer is refilled while its
copy may still read it.

``CudaTransport`` runs the copies on ``copy_stream(device)``, one side stream per device,
ordered against the caller's stream at ``begin`` and ``finish``; ``CurrentStream`` runs them
on the caller's own stream, so that what follows is ordered after them by the stream alone.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["CudaTransport", "CurrentStream", "Transport", "copy_stream"]


class Transport(Protocol):
    """What a copier asks of a device: queued copies, events, and ordering between streams."""

    def begin(self) -> None:
        """Order what follows after the work already queued on the caller's stream."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)``; it may run later, until the next ``mark``'s event."""

    def mark(self) -> Any:
        """An event that completes once every copy queued so far has finished."""

    def finish(self) -> None:
        """Order the caller's stream after every copy queued so far."""

    def wait(self) -> None:
        """Block the host until every copy queued so far has finished."""


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the ring's transfers run on for ``device``: one per device, made once."""
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return stream


class CudaTransport:
    """The ring's transfers on ``copy_stream(device)``, ordered against the current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = copy_stream(device)
        self.caller = torch.cuda.current_stream(device)

    def begin(self) -> None:
        self.stream.wait_stream(self.caller)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def mark(self) -> Any:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event

    def finish(self) -> None:
        self.caller.wait_stream(self.stream)

    def wait(self) -> None:
        self.stream.synchronize()


class CurrentStream(CudaTransport):
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
