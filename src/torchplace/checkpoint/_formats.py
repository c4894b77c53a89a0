"""Checkpoint formats: whether a file's header can be trusted, and what torch's errors mean.

``safetensors_header`` reads and checks a safetensors header as strictly as a loader would with
dtypes this torch holds, ``zip_layout`` finds a torch zip file's records and checks its pickle's
CRC-32, and the ``diagnose`` family turns what torch raised into a sentence about the file.
Telling a path's format and resolving a directory or an index is ``_source``'s (re-exported
here for the modules that used to find it here).
"""

from __future__ import annotations

import pickle
import re
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError
from . import _safetensors
from ._index import LEGACY_MAGIC
from ._source import (
    ZIP_MAGIC,
    PathLike,
    as_path,
    detect_format,
    is_dir,
    model_file,
    shards,
)

__all__ = [
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_HINT",
    "PathLike",
    "ZipLayout",
    "as_path",
    "detect_format",
    "device_failure",
    "diagnose",
    "first_sentence",
    "has_data_pkl",
    "has_legacy_magic",
    "is_dir",
    "model_file",
    "out_of_memory",
    "record_start",
    "refusal_reason",
    "safetensors_header",
    "shards",
    "zip_layout",
]

SAFETENSORS_HINT = "pip install safetensors (torchplace's [safetensors] extra)"

# safetensors dtype names, as written in a file's JSON header, that this torch can hold.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, torch_name)
    for name, (torch_name, _) in _safetensors.DTYPES.items()
    if hasattr(torch, torch_name)
}


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
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, NotImplementedError):
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
        if "central directory" in text:  # torch's words for it carry a miniz internal note
            text = "its zip central directory is missing"
        return (
            f"is truncated ({text}); another process may be writing it right now (load it "
            "again once the writer is done), or its save was interrupted (save it again)"
        )
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
    missing_class = re.match(r"Can't get attribute '([\w.]+)' on <module '([\w.]+)'", text)
    if isinstance(exc, AttributeError) and missing_class:
        cls, module = missing_class.groups()
        return (
            f"pickles an object of class {cls} from module {module}, which this program does not "
            f"define; the file may be sound: import or define {cls} (as the program that saved "
            "it did) before loading it"
        )
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return (
            f"pickles objects from module {exc.name}, which this program cannot import; the file "
            f"may be sound: load it where {exc.name} is installed and importable"
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
        with zipfile.ZipFile(p) as archive:
            infos = archive.infolist()
            pickles = [i for i in infos if i.filename.rpartition("/")[2] == "data.pkl"]
            if len(pickles) != 1 or pickles[0].compress_type != zipfile.ZIP_STORED:
                return None
            info = pickles[0]
            with archive.open(info):  # zipfile checks the record's local header against the
                pass  # directory, as the catalog does: a damaged one is refused alike
            with p.open("rb") as f:
                start = record_start(f, info)
                f.seek(start)
                data = f.read(info.file_size)
    except NotImplementedError as exc:  # a version field zipfile does not know: a damaged one
        raise CheckpointError(
            f"{p}: is truncated or corrupt (NotImplementedError: {exc}); save or fetch it again"
        ) from exc
    except zipfile.BadZipFile as exc:  # the catalog refuses it too: load agrees, whatever
        # the installed torch's own zip reader would make of it
        if "not a zip file" in str(exc):  # no central directory: cut short, or being written
            raise CheckpointError(
                f"{p}: is truncated (its zip central directory is missing); another process may "
                "be writing it right now (load it again once the writer is done), or its save "
                "was interrupted (save it again)"
            ) from exc
        raise CheckpointError(
            f"{p}: is truncated or corrupt (BadZipFile: {exc}); save or fetch it again"
        ) from exc
    except (OSError, ValueError, EOFError, struct.error):
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
