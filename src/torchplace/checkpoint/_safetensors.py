"""The ``.safetensors`` format, read without torch: its dtype names, its header, and the checks
that every reader of such a file makes before it trusts a byte.

``load``, ``load_into``, the sharded reader, ``inspect`` and ``remap`` all read a safetensors
header through ``read_header``, so none can accept a file that another refuses. No torch here:
``torchplace inspect FILE.safetensors`` starts at once.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

from .._errors import CheckpointError
from ._opened import opened
from ._opened import raw_file as call_file
from ._source import WRITER_HINT

__all__ = [
    "DTYPES",
    "MAX_HEADER",
    "Kind",
    "Row",
    "header_bytes",
    "read_header",
    "read_layout",
    "read_layout_and_bytes",
    "sniff",
]

# safetensors dtype names, as written in a file's JSON header -> (torch's name for the dtype,
# bytes per element).
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "C64": ("complex64", 8),
    "U16": ("uint16", 2),
    "U32": ("uint32", 4),
    "U64": ("uint64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
MAX_HEADER = 100 * 1024 * 1024  # a safetensors header larger than this is corrupt
_MAX_INDEX = 1 << 63  # torch sizes and strides are int64
# What a tensor's dtype and shape come to: torch's name for its dtype, its shape, its bytes.
Kind = tuple[str, tuple[int, ...], int]
# One tensor of a checked header: its name, its first byte and the byte past its last
# (counted from the start of the data, as its data_offsets), and its ``Kind``, which tensors
# of the same dtype and shape share.
Row = tuple[str, int, int, Kind]
_RESAVE = "the file is damaged or was not written by a safetensors writer; save it again"


def sniff(p: Path, /) -> bool:
    """Whether ``p`` looks like a safetensors file: a regular file (not JSON) whose first 8
    bytes give a header length that fits, followed by ``{``."""
    try:
        info = p.stat()
        if not stat.S_ISREG(info.st_mode) or p.name.endswith(".json"):
            return False
        with opened(p) as f:
            head = f.read(9)
    except OSError:
        return False
    if len(head) < 9 or head.startswith(b"PK\x03\x04"):
        return False
    (header_len,) = struct.unpack("<Q", head[:8])
    return head[8:9] == b"{" and header_len <= info.st_size - 8


def read_header(path: str | os.PathLike[str], /) -> dict[str, Any]:
    """The JSON header of a safetensors file, checked whole (see ``_check_layout``); raises
    ``CheckpointError`` naming the file, and the tensor where one is at fault."""
    return read_header_and_start(path)[0]


def read_header_and_start(path: str | os.PathLike[str], /) -> tuple[dict[str, Any], int]:
    """``read_header``'s header, and where the data it describes starts in the file (its
    offsets count from there), both from one read of the file."""
    header, start, _ = read_layout(path)
    return header, start


def read_layout(path: str | os.PathLike[str], /) -> tuple[dict[str, Any], int, list[Row]]:
    """``read_header_and_start``'s header and start, and a ``Row`` for each tensor, in the
    order of the header: what its checks found, so that a catalog need not look again."""
    header, start, rows, _ = read_layout_and_bytes(path)
    return header, start, rows


def header_bytes(path: Path, /) -> bytes | None:
    """The first bytes of a safetensors file up to the end of its header (its length and its
    JSON) as they are, unchecked; None where they cannot be read whole. Two ``pread`` calls on
    the call's open file (``raw_file``), where the platform has them."""
    try:
        raw_file = call_file(path)
        if raw_file is None or not hasattr(os, "pread"):
            with opened(path) as f:
                raw_len = f.read(8)
                header_len = struct.unpack("<Q", raw_len)[0] if len(raw_len) == 8 else -1
                raw = f.read(header_len) if 0 <= header_len <= MAX_HEADER else b""
        else:
            fd = raw_file.fileno()
            raw_len = os.pread(fd, 8, 0)
            header_len = struct.unpack("<Q", raw_len)[0] if len(raw_len) == 8 else -1
            raw = os.pread(fd, header_len, 8) if 0 <= header_len <= MAX_HEADER else b""
    except OSError:
        return None
    return raw_len + raw if header_len >= 0 and len(raw) == header_len else None


def read_layout_and_bytes(
    path: str | os.PathLike[str], /
) -> tuple[dict[str, Any], int, list[Row], bytes]:
    """``read_layout``'s header, start and rows, and the bytes they were read from
    (``header_bytes``)."""
    p = Path(path)
    odd: list[str] = []  # floats, NaN or infinities the JSON holds (no count is one)
    try:
        with opened(p) as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(
                    f"{p}: is truncated (shorter than a safetensors header); {WRITER_HINT}, or "
                    "its save was interrupted (save it again)",
                    path=p,
                )
            (header_len,) = struct.unpack("<Q", raw_len)
            size = os.fstat(f.fileno()).st_size
            if header_len > min(size - 8, MAX_HEADER):
                cut = (  # a length past the end: the file may still be growing
                    f"; {WRITER_HINT}, or its save was interrupted (save it again)"
                    if header_len <= MAX_HEADER
                    else ""
                )
                raise CheckpointError(
                    f"{p}: is truncated or corrupt: its safetensors header claims {header_len} "
                    f"bytes but the file holds {size} bytes{cut}",
                    path=p,
                )
            raw = f.read(header_len)
            noted = _noted(odd)
            header = json.loads(raw, parse_float=noted, parse_constant=noted)
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot be read ({exc.strerror or exc})", path=p) from exc
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # nesting past any limit
        raise CheckpointError(
            f"{p}: has a corrupt safetensors header ({type(exc).__name__}: {exc})", path=p
        ) from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{p}: has a corrupt safetensors header (not a JSON object)", path=p)
    # 1 == True == 1.0: the quick pass, which looks at each (dtype, shape) once, is for JSON
    # whose numbers can only be ints (a name that spells true or false takes the long way)
    quick = not odd and b"true" not in raw and b"false" not in raw
    rows = _check_layout(p, header, size - 8 - header_len, quick)
    return header, 8 + header_len, rows, raw_len + raw


def _noted(odd: list[str]) -> Any:
    """JSON's parser of floats (and of NaN and the infinities), noting each one in ``odd``."""

    def note(text: str) -> float:
        odd.append(text)
        return float(text)

    return note


def _printable(text: Any) -> str:
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


def _is_count(n: Any) -> bool:
    """A JSON number that can size a dimension: an int (not a bool, float or string), >= 0."""
    return type(n) is int and 0 <= n < _MAX_INDEX


def _check_layout(
    path: Path, header: dict[str, Any], data_len: int, quick: bool = False
) -> list[Row]:
    """Refuse a header no reader should trust: an entry without a known dtype, a list of counts
    for its shape and two offsets that hold exactly its bytes; a shape whose sizes overflow
    torch's 64-bit indices; tensors whose bytes overlap, or leave a gap between them or at the
    end of the file; ``__metadata__`` that is not a map of strings to strings. Returns each
    tensor's ``Row``, in the order of the header.

    ``quick`` (JSON whose numbers are all ints) first tries ``_quick_rows``; a header it does
    not take is checked entry by entry, which names what is wrong."""
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CheckpointError(
            f"{path}: has corrupt __metadata__ ({_printable(repr(meta))[:200]}): safetensors "
            f"metadata maps strings to strings; {_RESAVE}",
            path=path,
        )
    rows = _quick_rows(header, data_len) if quick else None
    if rows is not None:
        return rows
    rows = []
    for name, entry in header.items():
        if name != "__metadata__":
            start, end = _span(path, name, entry, data_len)
            shape = tuple(entry["shape"])
            nbytes = end - start
            rows.append((name, start, end, (DTYPES[entry["dtype"]][0], shape, nbytes)))
    spans = sorted((start, end, name) for name, start, end, _ in rows)
    reached, last = 0, None  # bytes accounted for so far, by tensor ``last``
    for start, end, name in spans:
        if start < reached:
            raise CheckpointError(
                f"{path}: tensor {name!r} (bytes {start} to {end}) overlaps tensor {last!r} "
                f"(which ends at byte {reached}): each tensor owns its bytes; {_RESAVE}",
                path=path,
            )
        if start > reached:
            after = f"after tensor {last!r}" if last is not None else "at the start of the data"
            raise CheckpointError(
                f"{path}: tensor {name!r} starts at byte {start}, leaving {start - reached} "
                f"bytes {after} that no tensor holds; {_RESAVE}",
                path=path,
            )
        reached, last = end, name
    if reached != data_len:
        after = f"after tensor {last!r}" if last is not None else "in a file of no tensors"
        raise CheckpointError(
            f"{path}: is truncated or corrupt: it holds {data_len} bytes of data, and "
            f"{data_len - reached} bytes {after} are no tensor's; {_RESAVE}",
            path=path,
        )
    return rows


def _quick_rows(header: dict[str, Any], data_len: int) -> list[Row] | None:
    """``_check_layout``'s rows where every check passes, else None; for JSON whose numbers
    are all ints. A header of 100,000 tensors holds a few dozen (dtype, shape) pairs: each is
    checked once (``_kind``), and each entry costs a look-up, its offsets and where it ends.
    Entries whose offsets follow one another (as safetensors writes them) need no sort.

    An entry that is not a map, a dtype that is a list, offsets that are not two ints (None, a
    string, a list) all raise KeyError, TypeError or ValueError here: None too. Without floats
    or bools, a shape whose ``tuple`` equals a valid one is that list of ints (a string's or a
    map's ``tuple`` holds strings), so the one check of its pair holds for it."""
    kinds: dict[tuple[Any, tuple[Any, ...]], Kind] = {}
    rows: list[Row] = []
    reached = 0
    ordered = True
    try:
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            key = (entry["dtype"], tuple(entry["shape"]))
            kind = kinds.get(key)
            if kind is None:
                kind = _kind(*key)
                if kind is None:
                    return None
                kinds[key] = kind
            start, end = entry["data_offsets"]
            if not 0 <= start <= end <= data_len or end - start != kind[2]:
                return None
            ordered = ordered and start == reached
            reached = end
            rows.append((name, start, end, kind))
    except (KeyError, TypeError, ValueError):
        return None
    if not ordered:  # sorted, each starts where the one before ends
        spans = sorted((start, end) for _, start, end, _ in rows)
        reached = 0
        for start, end in spans:
            if start != reached:
                return None
            reached = end
    return rows if reached == data_len else None


def _kind(dtype: Any, shape: tuple[Any, ...]) -> Kind | None:
    """What a dtype and shape come to, where both are sound (see ``_plain_span``), else None."""
    if type(dtype) is not str or dtype not in DTYPES:
        return None
    numel = extent = 1
    for n in shape:
        if type(n) is not int or n < 0:
            return None
        numel *= n
        extent *= n or 1  # a size past 2**63 takes extent past it too
    name, itemsize = DTYPES[dtype]
    nbytes = numel * itemsize
    return (name, shape, nbytes) if extent < _MAX_INDEX and nbytes < _MAX_INDEX else None


def _span(path: Path, name: str, entry: Any, data_len: int) -> tuple[int, int]:
    """One entry's data offsets, checked against its dtype, shape and the data's length.

    Called once per tensor (an index of the largest checkpoints lists 100,000): an entry that
    passes every check of ``_checked_span`` is taken in one pass (``_plain_span``), without the
    words of its errors; any other is left to ``_checked_span``, which says what is wrong."""
    found = _plain_span(entry, data_len) if type(entry) is dict else None
    return found if found is not None else _checked_span(path, name, entry, data_len)


def _plain_span(entry: dict[str, Any], data_len: int) -> tuple[int, int] | None:
    """``_checked_span``'s offsets where every one of its checks passes, else None."""
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not (type(dtype) is str and dtype in DTYPES and type(shape) is list):
        return None
    if not (type(offsets) is list and len(offsets) == 2):
        return None
    numel = extent = 1
    for n in shape:
        if type(n) is not int or n < 0:
            return None
        numel *= n
        extent *= n or 1  # a size past 2**63 takes extent past it too
    start, end = offsets
    nbytes = numel * DTYPES[dtype][1]
    plain = type(start) is int and type(end) is int and 0 <= start <= end <= data_len
    if plain and end - start == nbytes and extent < _MAX_INDEX and nbytes < _MAX_INDEX:
        return start, end
    return None


def _checked_span(path: Path, name: str, entry: Any, data_len: int) -> tuple[int, int]:
    """``_span``, each check made in turn and an error raised for the first that fails."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(
            f"{where} has a corrupt entry ({_printable(repr(entry))[:200]}): it should map "
            f"dtype, shape and data_offsets; {_RESAVE}",
            path=path,
        )
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:  # a list or a map is no dtype name
        raise CheckpointError(
            f"{where} has dtype {dtype!r}, which this version of torch cannot hold "
            f"(supported: {', '.join(sorted(DTYPES))})",
            path=path,
        )
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise CheckpointError(
            f"{where} has shape {shape!r}, which is not a list of non-negative integers; {_RESAVE}",
            path=path,
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise CheckpointError(
            f"{where} has data_offsets {offsets!r}, which are not two non-negative integers; "
            f"{_RESAVE}",
            path=path,
        )
    extent, numel = 1, 1
    for n in shape:
        extent *= max(n, 1)  # what torch's strides multiply up to, even beside a 0
        numel *= n
    if extent >= _MAX_INDEX:
        raise CheckpointError(
            f"{where} has shape {shape}, whose sizes multiply past 2**63 (its size overflows): "
            f"torch cannot index it; {_RESAVE}",
            path=path,
        )
    start, end = offsets
    nbytes = numel * DTYPES[dtype][1]
    if nbytes >= _MAX_INDEX:
        raise CheckpointError(
            f"{where} has shape {shape}, which would take {nbytes} bytes of {dtype}, more than "
            f"any tensor can hold (its size overflows); {_RESAVE}",
            path=path,
        )
    if not start <= end <= data_len or end - start != nbytes:
        cut = (  # its bytes would be there, the file longer: a save still writing it looks so
            f"; {WRITER_HINT}, or its save was interrupted (save it again)"
            if start <= end and end - start == nbytes
            else ""
        )
        raise CheckpointError(
            f"{path}: is truncated or corrupt: tensor {name!r} ({dtype}, shape {shape}) "
            f"takes {nbytes} bytes, which do not fit its data offsets {offsets} in the "
            f"file's {data_len} bytes of data{cut}",
            path=path,
        )
    return start, end
