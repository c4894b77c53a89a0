"""Progress a person can see: one bar on stderr for a long load or remap, on one rank.

``reporting(total, label, asked)`` shows a rich bar (bytes, rate, time left) while its block runs
and makes it the current one, so the reader advances it from its threads by ``advance(n)`` and
pays one ``ContextVar`` look-up per file when there is none. ``asked`` is the ``progress=``
keyword: ``None`` shows the bar when stderr is a terminal and the load is large enough to take
more than a couple of seconds (``LOAD_PROGRESS_MIN_BYTES``); ``True`` and ``False`` force it
(where stderr is no terminal, a forced bar is one line saying what was read, once it is over).
On many ranks only rank 0 shows one. rich is imported only when a bar is shown.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["LOAD_PROGRESS_MIN_BYTES", "current", "progress_bar", "reporting", "wanted"]

# A load of at least this many bytes shows a bar by default (about two seconds from the page
# cache on a 2-core machine, far more from a disk or a network file system).
LOAD_PROGRESS_MIN_BYTES = 2 << 30

_CURRENT: contextvars.ContextVar[Callable[[int], None] | None] = contextvars.ContextVar(
    "torchplace_progress", default=None
)


def current() -> Callable[[int], None] | None:
    """The ``advance(nbytes)`` of the bar being shown, or None."""
    return _CURRENT.get()


def _rank() -> int:
    """This process's rank (0 where there is one process): torch.distributed's if it is set up,
    else the ``RANK`` that torchrun and SLURM launchers set."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def wanted(asked: bool | None) -> bool:
    """Whether a bar may be shown at all (before the size is known): asked for, or left to
    ``None`` with stderr a terminal; never on a rank but 0, nor inside another bar."""
    if asked is False or _CURRENT.get() is not None or _rank() != 0:
        return False
    return True if asked else sys.stderr.isatty()


@contextlib.contextmanager
def progress_bar(total: int, label: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A transient bar on stderr (bytes, rate, time left, in binary units as ``format_bytes``
    gives them) advanced by the callable it yields; where stderr is no terminal, no bar but one
    line once it is over; a callable that does nothing when not ``enabled``."""
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console

    from .._sizes import format_bytes

    console = Console(stderr=True, emoji=False)
    start = time.perf_counter()
    if console.is_terminal:
        with _live_bar(console, total, label) as advance:
            yield advance
        return
    # A log file gets no live bar (rich's, never drawn there, would leave a blank line): the
    # bytes are counted, and said in one line once it is over.
    lock = threading.Lock()
    done = 0

    def count(n: int) -> None:
        nonlocal done
        with lock:  # advanced from the reader's threads
            done += n

    yield count
    took = time.perf_counter() - start
    rate = f", {format_bytes(int(done / took))}/s" if took > 0 else ""
    console.print(f"{label}: {format_bytes(done)} in {took:.1f} s{rate}", markup=False)


@contextlib.contextmanager
def _live_bar(console: Console, total: int, label: str) -> Iterator[Callable[[int], None]]:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        ProgressColumn,
        Task,
        TextColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    from .._sizes import format_bytes

    class BinaryRateColumn(ProgressColumn):  # rich's TransferSpeedColumn is in decimal units
        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            shown = "?" if speed is None else f"{format_bytes(int(speed))}/s"
            return Text(shown, style="progress.data.speed")

    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        DownloadColumn(binary_units=True),
        BinaryRateColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=True, console=console) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


@contextlib.contextmanager
def reporting(total: int, label: str, asked: bool | None) -> Iterator[None]:
    """Show a bar for a load of ``total`` bytes while the block runs, if ``asked`` (see
    ``wanted``) and, when left to ``None``, if the load is at least
    ``LOAD_PROGRESS_MIN_BYTES``; the reader advances it through ``current()``."""
    show = wanted(asked) and (asked is True or total >= LOAD_PROGRESS_MIN_BYTES)
    if not show:
        yield
        return
    with progress_bar(total, label, True) as advance:
        token = _CURRENT.set(advance)
        try:
            yield
        finally:
            _CURRENT.reset(token)
