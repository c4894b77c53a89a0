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

Every open of a checkpoint's file goes through ``open_file``: the path is asked (``stat``) before
it is opened, so a named pipe, a socket or a device is refused at once (opening a pipe for
reading waits for a writer, for ever), and a file that cannot be opened raises a
``CheckpointError`` saying why (permission denied, a directory), never one that calls it
damaged.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import io
import os
import shlex
import stat
import weakref
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import BinaryIO, TypeVar, cast

from .._errors import CheckpointError

__all__ = [
    "file_kind",
    "made_in_call",
    "not_a_file",
    "once_per_call",
    "one_open_each",
    "open_file",
    "opened",
    "raw_file",
    "regular_file",
    "unopenable",
]

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


def made_in_call(key: Hashable) -> bool:
    """Whether the call under way has made what ``once_per_call(key, ...)`` keeps."""
    call = _current()
    return call is not None and key in call.kept


# ------------------------------------------------------------------------ what a path names

_KINDS = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "named pipe (FIFO)"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


def file_kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) that is not a regular file is: ``"named pipe
    (FIFO)"``, ``"socket"``, ``"character device"``, ...

    >>> file_kind(stat.S_IFIFO)
    'named pipe (FIFO)'
    """
    return next((what for test, what in _KINDS if test(mode)), "special file")


_WHY_NOT = " (reading one waits for a writer, for ever)"  # said of a pipe


def not_a_file(p: Path, mode: int) -> CheckpointError:
    """The error for ``p``, found to be a ``mode`` other than a regular file's."""
    if stat.S_ISDIR(mode):
        return CheckpointError(
            f"{p}: is a directory where a checkpoint file was expected; name the checkpoint "
            "file itself",
            path=p,
        )
    return CheckpointError(
        f"{p}: is not a regular file but a {file_kind(mode)}, which torchplace does not read"
        f"{_WHY_NOT if stat.S_ISFIFO(mode) else ''}; save the checkpoint to a file and pass "
        "that file's path",
        path=p,
    )


def unopenable(p: Path, exc: OSError, *, asked: bool = False) -> CheckpointError:
    """The error for ``p``, which could not be opened (or, ``asked``, not even asked about)
    for ``exc``: permission denied and a directory are said as such, anything else with the
    system's words."""
    if isinstance(exc, PermissionError):
        where = (
            "this user cannot reach it (a directory on its path may not be searched); give "
            "that directory search permission (chmod a+x, as its owner) or load it as a user "
            "who may read it"
            if asked
            else f"this user cannot read it; give it read permission (chmod a+r "
            f"{shlex.quote(str(p))}, as its owner or root) or load it as a user who may read it"
        )
        return CheckpointError(f"{p}: permission denied: {where}", path=p)
    if isinstance(exc, IsADirectoryError) or exc.errno == errno.EISDIR:
        return not_a_file(p, stat.S_IFDIR)
    return CheckpointError(f"{p}: cannot be read ({exc.strerror or exc})", path=p)


def regular_file(p: Path) -> os.stat_result:
    """What ``os.stat`` says of ``p``, which must be a regular file: ``CheckpointError`` (see
    ``not_a_file``, ``unopenable``) for anything else, and ``FileNotFoundError`` where nothing
    is there (its caller says where it went)."""
    try:
        info = os.stat(p)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise unopenable(p, exc, asked=True) from exc
    if not stat.S_ISREG(info.st_mode):
        raise not_a_file(p, info.st_mode)
    return info


def open_file(p: Path) -> io.FileIO:
    """``p`` opened for reading, once ``stat`` has shown it to be a regular file (a pipe is
    never opened: that waits for a writer). ``CheckpointError`` where it is not one or cannot
    be opened; ``FileNotFoundError`` where it does not exist."""
    regular_file(p)
    try:
        return io.FileIO(p)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise unopenable(p, exc) from exc


def raw_file(p: Path) -> io.FileIO | None:
    """The call's open file of ``p`` (opened now, on first use), or None outside a call. The
    caller must not close it: the call does."""
    call = _current()
    if call is None:
        return None
    file = call.files.get(p)
    if file is None or file.closed:
        file = call.files[p] = open_file(p)  # recorded at once; the call's end closes it
        call.callback(file.close)
    return file


@contextlib.contextmanager
def opened(p: Path) -> Iterator[BinaryIO]:
    """``p`` open for buffered reading from its first byte: the call's file (left open for the
    rest of the call), or, outside a call, a file of its own, closed on leaving."""
    raw = raw_file(p)
    if raw is None:
        with io.BufferedReader(open_file(p)) as f:
            yield f
        return
    raw.seek(0)
    buffered = io.BufferedReader(raw)
    try:
        yield buffered
    finally:
        buffered.detach()  # the raw file stays open: the call closes it
