"""What a catalog holds: one ``Entry`` per tensor of a checkpoint (name, file, first byte, dtype,
shape, layout), the ``Stamp`` of each file parsed, the ``Catalog`` of them, and the error for a
file that changed under its stamp. Plain Python, no torch (``inspect`` of a safetensors file
starts at once); ``_catalog`` builds them."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from .._errors import CheckpointError
from ._pickle_reader import (
    TensorRecord,
)

__all__ = [
    "Catalog",
    "Entry",
    "FileChanged",
    "Stamp",
    "changed_error",
    "file_entry",
    "frozen",
    "stamp",
]

_T = TypeVar("_T")

# ------------------------------------------------------------------------------------- stamps


@dataclasses.dataclass(frozen=True)
class Stamp:
    """What says a file is the one that was read: its size, modification time, inode and
    inode change time.

    A file rewritten in place changes its size or its mtime; one replaced by another (a save
    that writes a new file and renames it over the old) changes its inode. A rewrite of the
    same size whose mtime is put back (``touch -r``, ``os.utime``) changes the ctime, which no
    call can set.
    """

    size: int
    mtime_ns: int
    inode: int
    device: int
    ctime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> Stamp:
        return cls(info.st_size, info.st_mtime_ns, info.st_ino, info.st_dev, info.st_ctime_ns)


def stamp(p: Path, /) -> Stamp:
    """The stamp of ``p`` now (``CheckpointError`` where it cannot be asked)."""
    try:
        return Stamp.of(os.stat(p))
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot be read ({exc.strerror or exc})", path=p) from exc


# ------------------------------------------------------------------------------------ entries


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint, and where its bytes lie.

    ``dtype`` is torch's name for it (``"float32"``, ``"bfloat16"``). ``start`` is the file
    offset of its first element, or -1 where it cannot be read as one range of bytes (``why``
    says why: a legacy file, a quantized, sparse or data-less tensor). ``order`` lists its dims
    from outermost to innermost in the file (``(0, 1)`` row-major, ``(1, 0)`` a transposed view),
    or is ``None`` for a view with gaps. ``device`` is where the file says it was saved from
    (``"-"`` for safetensors, which says none), ``storage`` the key of the storage record it
    views and ``stored`` that record's bytes. A mapping source's entries hold the ``tensor``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: Path | None = None
    start: int = -1
    order: tuple[int, ...] | None = None
    device: str = "-"
    storage: str = ""
    stored: int = 0
    why: str = ""
    tensor: Any = None

    @property
    def addressable(self) -> bool:
        """Whether the entry's elements are one dense range of its file (readable by offset)."""
        return self.file is not None and self.start >= 0 and self.order is not None

    def torch_dtype(self, where: str) -> Any:
        """The ``torch.dtype``, or ``CheckpointError`` where this torch has none of that name."""
        import torch

        found = vars(torch).get(self.dtype)
        if not isinstance(found, torch.dtype):
            raise CheckpointError(
                f"{where}: tensor {self.name!r} has dtype {self.dtype!r}, which this version of "
                f"torch ({torch.__version__}) cannot hold",
                path=self.file,
            )
        return found


def file_entry(
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    nbytes: int,
    file: Path,
    start: int,
    order: tuple[int, ...],
) -> Entry:
    """``Entry(name, dtype, shape, nbytes, file, start, order, stored=nbytes)``, made in half
    the time (``frozen``): a safetensors header of 100,000 tensors spent most of its catalog
    in the frozen dataclass's ``__init__``."""
    return frozen(
        Entry,
        {
            "name": name,
            "dtype": dtype,
            "shape": shape,
            "nbytes": nbytes,
            "file": file,
            "start": start,
            "order": order,
            "device": "-",
            "storage": "",
            "stored": nbytes,
            "why": "",
            "tensor": None,
        },
    )


def frozen(cls: type[_T], fields: dict[str, Any]) -> _T:
    """An instance of the frozen dataclass ``cls`` whose ``fields`` (every one, in order) are
    set as its ``__init__`` sets them, in one step instead of one ``object.__setattr__``
    each."""
    made = object.__new__(cls)
    made.__dict__.update(fields)
    return made


@dataclasses.dataclass
class Catalog:
    """A source's tensors by name, the files they lie in, and how those files were found.

    ``where`` names the source in messages (the file resolved, or "the state dict ..."),
    ``kind`` is ``"zip"``, ``"legacy"``, ``"safetensors"``, ``"index"`` or ``"mapping"``,
    ``path`` the file a path resolved to (None for a mapping), ``stamps`` the stamp of every
    file at the moment it was parsed, and ``code`` the globals its pickles name that a safe load
    refuses (read inertly: safetensors files hold none, an index those of its shards).
    """

    where: str
    kind: str
    path: Path | None
    entries: dict[str, Entry]
    stamps: dict[Path, Stamp]
    kinds: dict[Path, str] = dataclasses.field(default_factory=dict)  # each file's format
    # the globals its pickles name beyond tensors and containers: what a load with
    # trusted=True would import and call (inspect lists them, load's refusals name them)
    code: list[str] = dataclasses.field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """The bytes of every entry's own data."""
        return sum(e.nbytes for e in self.entries.values())

    def check_unchanged(self, p: Path, now: Stamp | None = None) -> None:
        """``CheckpointError`` if ``p`` is no longer the file this catalog parsed."""
        before = self.stamps.get(p)
        if before is None:
            return
        now = stamp(p) if now is None else now
        if now != before:
            raise changed_error(p, before, now)

    def records(self) -> list[TensorRecord]:
        """The entries as ``inspect`` lists them, a shared storage's bytes counted once."""
        owners: dict[tuple[Path | None, str], str] = {}
        names: dict[Path | None, str] = {None: "-"}  # each file's name, asked once
        out = []
        for e in self.entries.values():
            shares = None
            if e.storage:
                first = owners.setdefault((e.file, e.storage), e.name)
                shares = None if first == e.name else first
            name = names.get(e.file) or names.setdefault(e.file, e.file.name)  # type: ignore[union-attr]
            out.append(
                frozen(
                    TensorRecord,
                    {
                        "name": e.name,
                        "device": e.device,
                        "dtype": e.dtype,
                        "shape": e.shape,
                        "nbytes": e.nbytes,
                        "file": name,
                        "stored": e.stored,
                        "shares": shares,
                    },
                )
            )
        return out


def changed_error(p: Path, before: Stamp, now: Stamp) -> CheckpointError:
    """The error for a file that changed between two stamps, saying what changed."""
    what = []
    if now.size != before.size:
        what.append(f"its size went from {before.size} to {now.size} bytes")
    if now.mtime_ns != before.mtime_ns:
        what.append("its modification time changed")
    if (now.inode, now.device) != (before.inode, before.device):
        what.append("it is another file now (replaced under the same name)")
    elif not what and now.ctime_ns != before.ctime_ns:
        what.append(
            "its inode change time changed: rewritten with its modification time put back, "
            "or its metadata changed"
        )
    return FileChanged(
        f"{p}: the file changed while it was read ({'; '.join(what)}), so what was read may mix "
        "old and new tensors; nothing read from it is kept. Load it again once the writer is "
        "done",
        path=p,
        changes=what,
    )


class FileChanged(CheckpointError):
    """``changed_error``'s: ``changes`` says what changed, for a reader that says what the
    change means for it (the disk tier: since the model was loaded)."""

    def __init__(self, *args: object, changes: Iterable[str] = (), **data: Any) -> None:
        super().__init__(*args, **data)
        self.changes = tuple(changes)

    def _data(self) -> dict[str, Any]:
        return {**super()._data(), "changes": self.changes}
