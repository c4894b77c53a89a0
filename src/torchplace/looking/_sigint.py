"""Ctrl-C held back while a fake step runs, and raised once it has unwound.

A ``KeyboardInterrupt`` raised in the middle of a step on fake tensors can abort the process
(SIGABRT inside PyTorch's fake tensor and autograd machinery; plain PyTorch does so at the same
rate). So while ``estimate`` runs its step on the main thread, SIGINT only notes that it came;
when the step is over and the model is put back, the handler before (Python's, which raises
``KeyboardInterrupt``, or the program's own) is called with the first. Every Ctrl-C is held
until then: one raised inside the step would risk the abort this avoids, and a step ends (a
7B-parameter model's takes seconds). A program that ignores SIGINT or leaves it to the system,
and a step run off the main thread (signals reach the main thread only), are left as they
are.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["sigint_deferred"]


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """The block with SIGINT noted, not raised; raised by the handler before as it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # ignored, or the system's default action
        yield
        return
    came: list[tuple[int, FrameType | None]] = []

    def note(signum: int, frame: FrameType | None) -> None:
        came.append((signum, frame))

    signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is note:
            signal.signal(signal.SIGINT, previous)
        if came:
            previous(*came[0])
