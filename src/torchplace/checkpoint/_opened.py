"""A call's open files: within one ``load`` or ``load_into``, each file is opened once.

The public entry points hold ``one_open_each()`` for the call; below them, every reader of a
file's bytes (the format's sniff, a header, an index's JSON, a zip file's directory, the reader's
threads) takes its file from ``opened(path)``, so a call resolves its source into its catalog
and reads it through one descriptor per file, opened once: one path lookup, one file for
every read of the call (a file replaced under its name part-way is still caught by its stamp),
and every descriptor closed when the call ends, through a ``KeyboardInterrupt`` too. Outside
such a call (``inspect``, a catalog asked for on its own) ``opened`` opens and closes the file
as ``open`` would. What a call works out from its files once (the source's catalog) is kept
for the call too (``once_per_call``), so the steps below the entry point that ask for it again
are given the same one. No torch here (``torchplace inspect FILE.safetensors`` starts without it).
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import weakref
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import BinaryIO, TypeVar, cast

__all__ = ["once_per_call", "one_open_each", "opened", "raw_file"]

_T = TypeVar("_T")


class _Call(contextlib.ExitStack):
    """One call's scope: its open files by path, each one's ``close`` on the stack, and what
    it worked out from them once (``once_per_call``)."""

    files: dict[Path, io.FileIO]
    kept: dict[Hashable, object]


# The scope of the call under way, if any: a weak reference, so that a scope an interrupt left
# unentered (between its making and the ``with``) is dropped, its files with it, and is not
# taken for a later call's.
_CALL: contextvars.ContextVar[weakref.ref[_Call] | None] = contextvars.ContextVar(
    "torchplace_checkpoint_files", default=None
)


def _current() -> _Call | None:
    ref = _CALL.get()
    return None if ref is None else ref()


def one_open_each() -> contextlib.AbstractContextManager[object]:
    """The scope of one call: files opened within it stay open until it ends, then are closed.
    Nested (``load_into`` of a wrapped model calling itself, a fill calling ``load``), the
    outer call's scope holds.

    Leaving it runs no line of torchplace's: the scope is an ``ExitStack`` of C calls (each
    file's ``close``, the context variable's ``reset``), so once a fill is done, nothing of
    torchplace's is left to run that an interrupt could land in.
    """
    if _current() is not None:
        return contextlib.nullcontext()
    call = _Call()
    call.files = {}
    call.kept = {}
    call.callback(_CALL.reset, _CALL.set(weakref.ref(call)))  # run last: files close first
    return call


def once_per_call(key: Hashable, make: Callable[[], _T]) -> _T:
    """``make()``, made once in a call: within a call's scope the first result for ``key`` is
    kept (a failure is not) and given again; outside a call, made each time."""
    call = _current()
    if call is None:
        return make()
    if key not in call.kept:
        call.kept[key] = make()
    return cast(_T, call.kept[key])


def raw_file(p: Path) -> io.FileIO | None:
    """The call's open file of ``p`` (opened now, on first use), or None outside a call. The
    caller must not close it: the call does."""
    call = _current()
    if call is None:
        return None
    file = call.files.get(p)
    if file is None or file.closed:
        file = call.files[p] = io.FileIO(p)  # recorded at once; the call's end closes it
        call.callback(file.close)
    return file


@contextlib.contextmanager
def opened(p: Path) -> Iterator[BinaryIO]:
    """``p`` open for buffered reading from its first byte: the call's file (left open for the
    rest of the call), or, outside a call, a file of its own, closed on leaving."""
    raw = raw_file(p)
    if raw is None:
        with open(p, "rb") as f:
            yield f
        return
    raw.seek(0)
    buffered = io.BufferedReader(raw)
    try:
        yield buffered
    finally:
        buffered.detach()  # the raw file stays open: the call closes it
