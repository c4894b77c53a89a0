"""What a file is, quickly: a torch zip file's record layout (where each record's bytes start,
for the fast read by offset), and the magic bytes of zip and legacy torch files, read without
parsing the file (no torch)."""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

from .._errors import CheckpointError
from ._index import LEGACY_MAGIC
from ._opened import opened
from ._pickle_reader import (
    cut_short,
)
from ._source import (
    WRITER_HINT,
    ZIP_MAGIC,
)

__all__ = ["ZipLayout", "has_data_pkl", "has_legacy_magic", "record_start", "zip_layout"]

# --------------------------------------------------------------------- what a file is, quickly
# Questions a load asks of a file before (or instead of) its whole catalog: the layout of a zip
# file's records for the fast zip read, and whether a file is torch's at all for its errors.


class ZipLayout:
    """Where a torch zip file's records lie, and its pickle record, its CRC-32 checked.

    ``prefix`` is the archive's top folder (``archive/``), ``pickle`` the bytes of ``data.pkl``,
    ``records`` every entry by name, ``starts`` the first byte of each data record's bytes
    (-1 where its local header is damaged), and ``byteorder`` what the file's ``byteorder``
    record says (``None`` where it has none: files before torch 1.10, written little-endian).
    """

    __slots__ = ("byteorder", "path", "pickle", "prefix", "records", "starts")

    def __init__(
        self,
        path: Path,
        prefix: str,
        pickle: bytes,
        records: dict[str, zipfile.ZipInfo],
        starts: dict[str, int],
        byteorder: bytes | None,
    ) -> None:
        self.path = path
        self.prefix = prefix
        self.pickle = pickle
        self.records = records
        self.starts = starts
        self.byteorder = byteorder


def record_start(f: Any, info: zipfile.ZipInfo) -> int:
    """Where a zip record's bytes begin in the open file ``f``, read from its local header.

    The local header's name and extra field may differ in length from the central directory's,
    so the header itself is read: 30 bytes, then the name, then the extra field.
    """
    f.seek(info.header_offset)
    local = f.read(30)
    if len(local) != 30 or not local.startswith(ZIP_MAGIC):
        raise zipfile.BadZipFile(f"record {info.filename} has no local header")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return int(info.header_offset) + 30 + int(name_len) + int(extra_len)


def zip_layout(p: Path, /) -> ZipLayout | None:
    """The layout of a torch zip file, or None where it is not one zipfile can read.

    Raises ``CheckpointError`` when the pickle record fails its CRC-32 (a damaged byte there
    would otherwise unpickle into other names or values). A CRC of 0 is taken as "not recorded"
    (torch writes none with ``compute_crc32`` off).
    """
    try:
        with opened(p) as f, zipfile.ZipFile(f) as archive:
            infos = archive.infolist()
            pickles = [i for i in infos if i.filename.rpartition("/")[2] == "data.pkl"]
            if len(pickles) != 1 or pickles[0].compress_type != zipfile.ZIP_STORED:
                return None
            info = pickles[0]
            with archive.open(info):  # zipfile checks the record's local header against the
                pass  # directory, as the catalog does: a damaged one is refused alike
            prefix = info.filename[: -len("data.pkl")]
            start = record_start(f, info)
            f.seek(start)
            data = f.read(info.file_size)
            starts = {  # the records a read may need: data, and the byte order
                i.filename: _data_start(f, i)
                for i in infos
                if i.filename.startswith(f"{prefix}data/") or i.filename == f"{prefix}byteorder"
            }
            order = archive.NameToInfo.get(f"{prefix}byteorder")
            byteorder = None
            if order is not None:
                first = starts.get(order.filename, -1)
                f.seek(first)
                byteorder = f.read(order.file_size) if first >= 0 else b"?"
    except NotImplementedError as exc:  # a version field zipfile does not know: a damaged one
        raise CheckpointError(
            f"{p}: is truncated or corrupt (NotImplementedError: {exc}); {WRITER_HINT}, or "
            "save or fetch it again",
            path=p,
        ) from exc
    except zipfile.BadZipFile as exc:  # the catalog refuses it too: load agrees, whatever
        # the installed torch's own zip reader would make of it
        if "not a zip file" in str(exc):  # no central directory: cut short, or being written
            raise cut_short(p) from exc
        raise CheckpointError(  # a directory that does not match the records: a save rewriting
            # the file under it looks so, as does damage
            f"{p}: is truncated or corrupt (BadZipFile: {exc}); {WRITER_HINT}, or save or fetch "
            "it again",
            path=p,
        ) from exc
    except (OSError, ValueError, EOFError, struct.error):
        return None
    if len(data) != info.file_size:
        return None
    if info.CRC and zlib.crc32(data) != info.CRC:
        raise CheckpointError(
            f"{p}: is corrupt: its pickle record {info.filename} fails its CRC-32 check (the "
            "bytes that name and shape the tensors were damaged after it was written); save or "
            "fetch it again",
            path=p,
        )
    records = {i.filename: i for i in infos}
    return ZipLayout(p, prefix, data, records, starts, byteorder)


def _data_start(f: Any, info: zipfile.ZipInfo) -> int:
    """``record_start``, or -1 for a record whose local header is damaged."""
    try:
        return record_start(f, info)
    except (zipfile.BadZipFile, OSError, ValueError, OverflowError):  # offset past any file
        return -1


def has_data_pkl(p: Path) -> bool:
    """Whether a zip file holds a pickle as torch.save writes one (so it is not someone else's).

    An archive that cannot be read at all says nothing either way, and counts as having one: its
    failure is then described as a truncated or corrupt file.
    """
    try:
        with opened(p) as f, zipfile.ZipFile(f) as archive:
            return any(n.endswith("data.pkl") for n in archive.namelist())
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, NotImplementedError):
        return True


# The bytes that hold torch's magic number pickled, with room for any protocol's framing.
_MAGIC_BYTES = 64


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not loaded here")


def has_legacy_magic(p: Path) -> bool:
    """Whether the first pickled object of ``p`` is torch's magic number (nothing is run).

    Only its first bytes are unpickled, enough for that number (15 bytes as torch writes it):
    a plain pickle's first object is all of it, which unpickling whole would build first."""
    try:
        with opened(p) as f:
            head = f.read(_MAGIC_BYTES)
    except OSError:
        return False
    try:
        first = _NoGlobals(io.BytesIO(head)).load()
    except Exception:  # longer than the number, or not a pickle
        return False
    return isinstance(first, int) and not isinstance(first, bool) and first == LEGACY_MAGIC
