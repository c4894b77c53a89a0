"""Checkpoint files: what a file is, and whether its header can be trusted, before any read.

``detect_format`` tells a torch zip file, a legacy torch pickle, a ``.safetensors`` file and a
shard index apart by their first bytes (and names what a foreign file is), ``safetensors_header``
reads and checks a safetensors header as strictly as a loader would, ``shards`` checks what an
index names, and ``model_file`` finds the model file in a directory as ``save_pretrained`` writes
it. The ``diagnose`` family turns what torch raised into a sentence about the file.
"""

from __future__ import annotations

import os
import pickle
import stat
import struct
import zipfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar, Union

import torch

from .._errors import CheckpointError
from . import _safetensors
from ._index import LEGACY_MAGIC, weight_map

PathLike = Union[str, "os.PathLike[str]"]

SAFETENSORS_HINT = "pip install safetensors (torchplace's [safetensors] extra)"

# safetensors dtype names, as written in a file's JSON header, that this torch can hold.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, torch_name)
    for name, (torch_name, _) in _safetensors.DTYPES.items()
    if hasattr(torch, torch_name)
}

# The first bytes of formats people mistake for checkpoints, to say what a foreign file is.
T = TypeVar("T")

_FOREIGN_MAGIC = (
    (b"\x93NUMPY", "a NumPy .npy array (load it with numpy.load)"),
    (b"\x89HDF", "an HDF5 file (Keras or h5py; load it with h5py)"),
    (b"GGUF", "a GGUF file (llama.cpp)"),
    (b"\x1f\x8b", "a gzip archive (decompress it first)"),
    (b"PK\x05\x06", "an empty zip archive"),
)
_ZIP_MAGIC = b"PK\x03\x04"
_CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".index.json")


def as_path(path: Any, /) -> Path:
    """``path`` as a ``Path``, or a ``CheckpointError`` saying what a checkpoint path is.

    >>> as_path(None)
    Traceback (most recent call last):
    ...
    torchplace.CheckpointError: a checkpoint is named by its path (a str or os.PathLike), ...
    """
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)):
        extra = (
            "; torchplace reads files by path (to map them), so write the bytes to a file "
            "first, or use torch.load for an open file"
            if hasattr(path, "read")
            else ""
        )
        raise CheckpointError(
            f"a checkpoint is named by its path (a str or os.PathLike), not "
            f"{type(path).__name__}{extra}"
        )
    return Path(path)


def detect_format(path: PathLike, /) -> str:
    """The format of a checkpoint file: ``"zip"``, ``"legacy"``, ``"safetensors"`` or ``"index"``.

    Raises ``CheckpointError`` for a missing file, a directory, an empty or a foreign file, and
    for anything that is not a regular file (a pipe would block the read for ever).
    """
    p = as_path(path)
    try:
        info = p.stat()
    except FileNotFoundError:
        hint = _near_misses(p)
        raise CheckpointError(f"{p}: no such file; check the path{hint}") from None
    except OSError as exc:  # a name too long, a permission on a parent directory, ...
        raise CheckpointError(f"{p}: cannot be read ({exc.strerror or exc})") from exc
    if stat.S_ISDIR(info.st_mode):
        found = sorted(
            q.name for q in p.iterdir() if q.is_file() and q.name.endswith(_CHECKPOINT_SUFFIXES)
        )
        which = f": pass one of its files ({', '.join(found[:5])})" if found else ""
        raise CheckpointError(f"{p}: is a directory, not a checkpoint file{which}")
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(
            f"{p}: is not a regular file (a pipe, socket or device); save the checkpoint to a "
            "file and pass its path"
        )
    size = info.st_size
    try:
        with p.open("rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot be read ({exc.strerror or exc})") from exc
    if size == 0:
        raise CheckpointError(f"{p}: is empty (0 bytes); the save was probably interrupted")
    if p.name.endswith(".json"):
        return "index"
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    if len(head) >= 9:
        (header_len,) = struct.unpack("<Q", head[:8])
        if head[8:9] == b"{" and header_len <= size - 8:
            return "safetensors"
        if head[8:9] == b"{" and p.name.endswith(".safetensors"):
            raise CheckpointError(
                f"{p}: is a safetensors file cut short: its header alone should take "
                f"{header_len + 8} bytes, and the file has {size}; the save or download was "
                "interrupted, so write or fetch it again"
            )
    if head[:1] == b"\x80":  # a pickle: torch's legacy format (torch checks its magic number)
        return "legacy"
    if head.lstrip(b" \t\r\n\xef\xbb\xbf")[:1] == b"{":  # JSON by its bytes: a shard index
        return "index"
    for magic, what in _FOREIGN_MAGIC:
        if head.startswith(magic):
            raise CheckpointError(f"{p}: is {what}, not a PyTorch or safetensors checkpoint")
    raise CheckpointError(
        f"{p}: is not a PyTorch or safetensors checkpoint (it starts with {head[:8]!r}); "
        "torchplace reads torch.save files (zip or legacy), .safetensors files and "
        "*.index.json shard maps"
    )


def _near_misses(p: Path) -> str:
    """A hint naming checkpoint files beside a path that does not exist."""
    parent = p.parent if str(p.parent) else Path(".")
    try:
        stem = p.name.split(".")[0]
        found = sorted(
            q.name
            for q in parent.iterdir()
            if q.is_file() and q.name.endswith(_CHECKPOINT_SUFFIXES) and q.name.startswith(stem)
        )
    except OSError:
        return ""
    return f" (found nearby: {', '.join(found[:5])})" if found else ""


def safetensors_header(path: PathLike, /) -> dict[str, Any]:
    """The JSON header of a ``.safetensors`` file, checked whole (offsets tile the data, shapes
    fit their bytes and torch's indices, metadata is strings), with dtypes this torch holds."""
    p = Path(path)
    header = _safetensors.read_header(p)
    for name, entry in header.items():
        if name != "__metadata__" and entry["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{p}: tensor {name!r} has dtype {entry['dtype']!r}, which this version of "
                f"torch cannot hold (supported: {', '.join(sorted(SAFETENSORS_DTYPES))})"
            )
    return header


def has_data_pkl(p: Path) -> bool:
    """Whether a zip file holds a pickle as torch.save writes one (so it is not someone else's).

    An archive that cannot be read at all says nothing either way, and counts as having one: its
    failure is then described as a truncated or corrupt file.
    """
    try:
        with zipfile.ZipFile(p) as archive:
            return any(n.endswith("data.pkl") for n in archive.namelist())
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        return True


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not loaded here")


def has_legacy_magic(p: Path) -> bool:
    """Whether the first pickled object of ``p`` is torch's magic number (nothing is run)."""
    try:
        with p.open("rb") as f:
            first = _NoGlobals(f).load()
    except Exception:
        return False
    return isinstance(first, int) and not isinstance(first, bool) and first == LEGACY_MAGIC


def refusal_reason(text: str) -> str:
    """The line of torch's weights-only refusal that names what was blocked."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line or "unsupported" in line:
            return line
    for i, line in enumerate(lines):
        if "error:" in line:
            rest = line.split("error:", 1)[1].strip()
            return rest or (lines[i + 1] if i + 1 < len(lines) else "an object it cannot build")
    return "it holds objects beyond tensors and containers"


_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch < 2.5


def out_of_memory(exc: BaseException) -> bool:
    text = str(exc)
    return (
        isinstance(exc, (MemoryError, _OUT_OF_MEMORY))
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    )


def device_failure(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("CUDA error", "CUDA driver", "HIP error", "XPU error")
    )


def diagnose(exc: BaseException, zip_format: bool, target: torch.device) -> str:
    text = first_sentence(str(exc) or type(exc).__name__)
    if out_of_memory(exc):
        return (
            f"ran out of memory while being read onto {target} ({type(exc).__name__}: {text}); "
            "free memory, read it with mmap=True (the file is then mapped, not copied), or load "
            "it onto another device. If the file is far smaller than the free memory, a length "
            "in it is damaged"
        )
    if device_failure(exc):
        return (
            f"could not be placed onto {target} ({text}); the file may be sound and the device "
            "failing: run torchplace doctor, or load it onto the CPU"
        )
    if isinstance(exc, EOFError) or "failed finding central directory" in text:
        return f"is truncated ({text}); the save was probably interrupted, save it again"
    if "TorchScript" in text:
        return (
            "is a TorchScript archive (torch.jit.save), not a checkpoint of weights; load it "
            "with torch.jit.load, which runs its code, so only if you trust it"
        )
    if "magic number" in text.lower():
        return (
            f"is not a torch.save file ({text}); a plain pickle or a foreign file is not a "
            "checkpoint"
        )
    if not zip_format and "UntypedStorage' has no attribute 'dtype'" in text:
        return (
            "is a legacy-format file (torch.save with _use_new_zipfile_serialization=False) "
            "holding a dtype that PyTorch cannot read back from that format (uint16, uint32, "
            "uint64 or a float8); the file may be sound: save it again in the default zip "
            "format where it was written"
        )
    fmt = "zip" if zip_format else "legacy"
    return f"is truncated or corrupt ({type(exc).__name__}: {text}); this {fmt} file cannot be read"


def first_sentence(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:300]


def shards(p: Path, weight_map: Mapping[str, str]) -> list[tuple[str, Path, list[str]]]:
    """The shards an index names, checked: (name in the index, path, tensor names) each.

    A shard must be a file inside the index's own directory and not an index itself (an index
    naming itself, or two naming each other, would never end). A shard spelt two ways
    (``s1.safetensors`` and ``./s1.safetensors``) is one file, listed (and read) once under the
    first spelling.
    """
    root = p.parent.resolve()
    by_shard: dict[Path, tuple[str, list[str]]] = {}
    for name, shard in weight_map.items():
        try:
            where = (p.parent / str(shard)).resolve()
        except (OSError, ValueError) as exc:  # a NUL in the name, a loop of links
            raise CheckpointError(
                f"{p}: names shard {shard!r}, which is not a usable file name ({exc})"
            ) from exc
        by_shard.setdefault(where, (str(shard), []))[1].append(name)
    found = []
    for shard_path, (shard, names) in by_shard.items():
        if root not in shard_path.parents:
            raise CheckpointError(
                f"{p}: names shard {shard!r} outside its own directory; refusing to read it"
            )
        if not shard_path.is_file():
            raise CheckpointError(
                f"{p}: names shard {shard!r}, which is missing from {p.parent.resolve()}; "
                "download or copy "
                "every shard the index lists"
            )
        if detect_format(shard_path) == "index":
            raise CheckpointError(
                f"{p}: names shard {shard!r}, which is itself a shard index; an index lists "
                "the files that hold the tensors"
            )
        found.append((shard, shard_path, names))
    return found


# The files save_pretrained writes, in the order a directory is searched for its one model file.
def gather_index(p: Path, read: Callable[[Path], Mapping[str, T]]) -> dict[str, T]:
    """Every tensor a shard index lists, each read by ``read`` from the shard it names; an
    index that names a tensor its shard lacks raises ``CheckpointError``."""
    result: dict[str, T] = {}
    for shard, shard_path, names in shards(p, weight_map(p)):
        part = read(shard_path)
        for name in names:
            if name not in part:
                raise CheckpointError(
                    f"{p}: says {name!r} is in {shard!r}, but that shard does not hold it; the "
                    "index and its shards do not match"
                )
            result[name] = part[name]
    return result


_MODEL_FILE_KINDS = (".safetensors.index.json", ".index.json", ".safetensors")


def is_dir(p: Path, /) -> bool:
    """Whether ``p`` is a directory; for a path that cannot be asked, ``detect_format`` says why."""
    try:
        return stat.S_ISDIR(p.stat().st_mode)
    except (OSError, ValueError):
        return False


def model_file(p: Path, /) -> Path:
    """The checkpoint a directory holds, as ``save_pretrained`` writes one: its index or its file.

    An index (``*.index.json``) names the shards beside it, so a directory with one index means
    that index; without one, a directory with one checkpoint file means that file. Where several
    could be meant, one safetensors index (or, without any index, one ``.safetensors`` file) is
    what ``save_pretrained`` would have written; anything else is a ``CheckpointError`` that lists
    the files to choose from.
    """
    try:
        found = sorted(
            q for q in p.iterdir() if q.name.endswith(_CHECKPOINT_SUFFIXES) and q.is_file()
        )
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot be read ({exc.strerror or exc})") from exc
    indexes = [q for q in found if q.name.endswith(".index.json")]
    candidates = indexes or found
    if len(candidates) == 1:
        return candidates[0]
    for suffix in _MODEL_FILE_KINDS:
        preferred = [q for q in candidates if q.name.endswith(suffix)]
        if len(preferred) == 1:
            return preferred[0]
    if not candidates:
        raise CheckpointError(
            f"{p}: is a directory holding no checkpoint (no *.safetensors, *.bin, *.pt, *.pth, "
            "*.ckpt or *.index.json file); pass the checkpoint's own path"
        )
    names = ", ".join(q.name for q in candidates[:6])
    raise CheckpointError(
        f"{p}: is a directory holding several checkpoints ({names}), and which one is meant "
        f"cannot be told; pass its path, e.g. {str(p / candidates[0].name)!r}"
    )


class ZipLayout:
    """Where a torch zip file's records lie, and its pickle record, its CRC-32 checked.

    ``prefix`` is the archive's top folder (``archive/``), ``pickle`` the bytes of ``data.pkl``,
    ``records`` every entry by name; ``record_start`` says where a record's bytes begin.
    """

    __slots__ = ("path", "pickle", "prefix", "records")

    def __init__(self, path: Path, prefix: str, pickle: bytes, records: dict[str, Any]) -> None:
        self.path = path
        self.prefix = prefix
        self.pickle = pickle
        self.records: dict[str, zipfile.ZipInfo] = records


def record_start(f: Any, info: zipfile.ZipInfo) -> int:
    """Where a zip record's bytes begin in the open file ``f``, read from its local header.

    The local header's name and extra field may differ in length from the central directory's,
    so the header itself is read: 30 bytes, then the name, then the extra field.
    """
    f.seek(info.header_offset)
    local = f.read(30)
    if len(local) != 30 or not local.startswith(_ZIP_MAGIC):
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
        with zipfile.ZipFile(p) as archive:
            infos = archive.infolist()
            pickles = [i for i in infos if i.filename.rpartition("/")[2] == "data.pkl"]
            if len(pickles) != 1 or pickles[0].compress_type != zipfile.ZIP_STORED:
                return None
            info = pickles[0]
            with p.open("rb") as f:
                start = record_start(f, info)
                f.seek(start)
                data = f.read(info.file_size)
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, struct.error):
        return None
    if len(data) != info.file_size:
        return None
    if info.CRC and zlib.crc32(data) != info.CRC:
        raise CheckpointError(
            f"{p}: is corrupt: its pickle record {info.filename} fails its CRC-32 check (the "
            "bytes that name and shape the tensors were damaged after it was written); save or "
            "fetch it again"
        )
    prefix = info.filename[: -len("data.pkl")]
    return ZipLayout(p, prefix, data, {i.filename: i for i in infos})
