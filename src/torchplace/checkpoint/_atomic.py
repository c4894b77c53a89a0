"""Putting a new checkpoint in place of the old one atomically.

``save`` builds the new checkpoint beside its path under a temporary name
(``.NAME.torchplace-tmp-PID-N``, a file or a directory), flushes every file to disk, and only
then puts it in place: a file by ``os.replace``; a directory by exchanging the two names at
once (Linux ``renameat2(RENAME_EXCHANGE)``), so that the path names the old directory whole or
the new one whole at every moment, then removes the old one. The files of the old directory
that the new one does not write (a tokenizer, a README) are linked into the new one first; its
old model files are not. The parent directory is flushed after the rename, so that the rename
itself survives a power cut. A failure or a Ctrl-C before the rename removes the temporary and
leaves the old checkpoint as it was; the temporaries a killed process left (its PID gone) are
swept by the next save to that path.

A collective save to a directory of several shards (``_save_collective``) takes the same steps
apart: rank 0 makes the temporary directory (``staging``), every rank writes its files into it
(``created``) and flushes them (``flushed``), and once every rank has, rank 0 puts it in place
(``put_in_place``); ``replacing`` is the three in one process.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "TMP_MARK",
    "created",
    "flushed",
    "model_file",
    "put_in_place",
    "replacing",
    "staging",
    "synced",
]

TMP_MARK = ".torchplace-tmp-"
# What a directory's old model files are called: not carried into the new directory.
_MODEL_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


def model_file(name: str) -> bool:
    """Whether a file called ``name`` at the top of a directory is one of its model files,
    which a save of the directory replaces (its other files are kept: linked into the new one).

    >>> model_file("model-00001-of-00002.safetensors"), model_file("tokenizer.json")
    (True, False)
    """
    return _MODEL_FILES.match(name) is not None


@contextlib.contextmanager
def created(path: Path) -> Iterator[IO[bytes]]:
    """``path`` made and opened for writing (an error if it is there already)."""
    with open(path, "xb") as f:
        yield f


@contextlib.contextmanager
def synced(path: Path) -> Iterator[IO[bytes]]:
    """``path`` opened for writing, flushed to disk when the block ends."""
    with created(path) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def flushed(paths: Iterable[Path]) -> None:
    """Flush the files ``paths``, written and closed, to disk."""
    for path in paths:
        with open(path, "rb+") as f:
            os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _sweep(target: Path) -> None:
    """Remove the temporaries that killed saves to ``target`` left beside it."""
    head = f".{target.name}{TMP_MARK}"
    with contextlib.suppress(OSError):
        for entry in os.scandir(target.parent):
            pid = entry.name[len(head) :].partition("-")[0]
            if not entry.name.startswith(head) or not pid.isdecimal():
                continue
            if int(pid) != os.getpid() and not _alive(int(pid)):
                _remove(Path(entry.path))


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _temporary(target: Path, directory: bool) -> Path:
    for n in range(1000):
        tmp = target.with_name(f".{target.name}{TMP_MARK}{os.getpid()}-{n}")
        try:
            if directory:
                tmp.mkdir()
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                tmp.unlink()  # the writer creates it again (exclusively)
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{target.parent}: too many temporary files named for {target.name}")


@contextlib.contextmanager
def replacing(target: Path, directory: bool) -> Iterator[Path]:
    """A temporary path beside ``target`` (a new directory, or a file name) for the block to
    write, put in place of ``target`` when the block ends, or removed if it raises."""
    with staging(target, directory) as tmp:
        yield tmp
        put_in_place(tmp, target, directory)


@contextlib.contextmanager
def staging(target: Path, directory: bool) -> Iterator[Path]:
    """A temporary path beside ``target`` (a new directory, or a file name), removed when the
    block ends: by then ``put_in_place`` has put it in place (its name holds the old directory,
    if any), or the save failed."""
    _sweep(target)
    tmp: Path | None = None
    try:
        with _interrupts_deferred():  # made and known to the cleanup at once
            tmp = _temporary(target, directory)
        yield tmp
    finally:
        with _interrupts_deferred():
            if tmp is not None:
                _remove(tmp)  # on success, the old directory (exchanged to this name), if any


def put_in_place(tmp: Path, target: Path, directory: bool) -> None:
    """Put the temporary ``tmp``, written and flushed, at ``target``: a file renamed, a
    directory exchanged with the old one (given the old one's other files first)."""
    with _interrupts_deferred():
        if directory:
            _carry_other_files(target, tmp)
            _fsync_dir(tmp)
            _swap_directory(tmp, target)
        else:
            os.replace(tmp, target)
        _fsync_dir(target.parent)


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) until the block is over, then deliver it: the steps that make or
    remove a temporary, or put the new checkpoint in place, are not left half done. Only on
    the main thread, where Python delivers signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, Any]] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(*caught[0])
        elif caught and previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def _carry_other_files(old: Path, new: Path) -> None:
    """Link into ``new`` what the directory ``old`` holds that ``new`` lacks, but for its model
    files: files hard-linked (copied where links cannot be made), symbolic links made again,
    subdirectories (empty ones too) made."""
    if not old.is_dir():
        return
    for top, folders, files in os.walk(old):  # symbolic links to folders: listed, not entered
        here = Path(top)
        into = new / here.relative_to(old)
        for name in [*folders, *files]:
            src, dst = here / name, into / name
            if TMP_MARK in name or os.path.lexists(dst):
                continue
            if here == old and _MODEL_FILES.match(name):
                continue
            if src.is_symlink():
                os.symlink(os.readlink(src), dst)
            elif src.is_dir():
                dst.mkdir()
            else:
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _swap_directory(new: Path, target: Path) -> None:
    """Put the directory ``new`` at ``target``; the old one, if any, ends at ``new``'s name."""
    if not target.exists():
        os.rename(new, target)
        return
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is not None:
        done = renameat2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(target),
                         _RENAME_EXCHANGE)  # fmt: skip
        if done == 0:
            return
    # No atomic exchange here (not Linux, or a file system without it): two renames, with a
    # moment where the path names nothing (the old directory is whole under the backup name).
    backup = _temporary(target, directory=False)
    os.rename(target, backup)
    os.rename(new, target)
    os.rename(backup, new)
