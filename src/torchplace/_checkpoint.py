"""Checkpoints: ``load`` a file onto a device, build a ``skeleton``, fill it with ``load_into``.

A checkpoint's journey here has three steps, each a public function:

``load(path, device)``
    Reads a torch file (zip or legacy pickle), a ``.safetensors`` file or a sharded checkpoint
    (a Hugging Face ``*.index.json`` weight map) and puts its tensors on ``device``, whatever
    device they were saved from. Untrusted files are read with ``weights_only=True``, so loading
    never runs code. Every failure (missing, truncated, corrupt, foreign or unsafe file) is a
    ``CheckpointError`` that names the file.
``skeleton(factory, *args, **kwargs)``
    Builds a model whose parameters live on ``meta`` (no memory, no random init) while buffers
    stay real, so non-persistent buffers such as masks and rotary frequencies survive. It works
    through a thread-local ``TorchFunctionMode``: nothing global is patched.
``load_into(model, path, device)``
    Fills a skeleton (or a real model) from a file. Weights are memory-mapped and assigned rather
    than copied, tied parameters stay one object, modules' load hooks run as in
    ``load_state_dict``, and a strict load lists every missing, unexpected and mis-shaped key.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import copyreg
import functools
import json
import os
import pickle
import stat
import struct
import warnings
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar, Union, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.modules.module import _IncompatibleKeys
from torch.nn.parameter import is_lazy
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ._devices import DeviceSpec
from ._devices import device as _device
from ._errors import CheckpointError, TorchplaceError

__all__ = ["load", "load_into", "skeleton"]

PathLike = Union[str, "os.PathLike[str]"]
ModuleT = TypeVar("ModuleT", bound=nn.Module)

SAFETENSORS_HINT = "pip install safetensors (torchplace's [safetensors] extra)"

# safetensors dtype names, as written in a file's JSON header.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
for _name, _attr in (
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_name] = getattr(torch, _attr)

# The first bytes of formats people mistake for checkpoints, to say what a foreign file is.
_FOREIGN_MAGIC = (
    (b"\x93NUMPY", "a NumPy .npy array (load it with numpy.load)"),
    (b"\x89HDF", "an HDF5 file (Keras or h5py; load it with h5py)"),
    (b"GGUF", "a GGUF file (llama.cpp)"),
    (b"\x1f\x8b", "a gzip archive (decompress it first)"),
    (b"PK\x05\x06", "an empty zip archive"),
)
_ZIP_MAGIC = b"PK\x03\x04"
_CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".index.json")
_MAX_HEADER = 100 * 1024 * 1024  # a safetensors header larger than this is corrupt


# --------------------------------------------------------------------------------------- formats


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


def _is_count(n: Any) -> bool:
    """A JSON number that can size a dimension: an int (not a bool, float or string), >= 0."""
    return type(n) is int and 0 <= n < 1 << 63  # what a torch size can hold


def safetensors_header(path: PathLike, /) -> dict[str, Any]:
    """The JSON header of a ``.safetensors`` file, checked for shape and offsets; no library."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with p.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{p}: is truncated (shorter than a safetensors header)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(size - 8, _MAX_HEADER):
                raise CheckpointError(
                    f"{p}: is truncated or corrupt: its safetensors header claims {header_len} "
                    f"bytes but the file holds {size} bytes"
                )
            header = json.loads(f.read(header_len))
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot be read ({exc.strerror or exc})") from exc
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # nesting past any limit
        raise CheckpointError(
            f"{p}: has a corrupt safetensors header ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{p}: has a corrupt safetensors header (not a JSON object)")
    data_len = size - 8 - header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype_name = entry.get("dtype") if isinstance(entry, dict) else None
        if isinstance(dtype_name, str) and dtype_name not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{p}: tensor {name!r} has dtype {dtype_name!r}, which this version of "
                f"torch cannot hold (supported: {', '.join(sorted(SAFETENSORS_DTYPES))})"
            )
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape, offsets = entry["shape"], entry["data_offsets"]
            if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
                raise ValueError(f"shape {shape!r} is not a list of non-negative integers")
            if not (
                isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
            ):
                raise ValueError(f"data_offsets {offsets!r} is not two non-negative integers")
            start, end = offsets
            numel = 1
            for n in shape:
                numel *= n
            itemsize = torch.empty((), dtype=dtype).element_size()
            ok = 0 <= start <= end <= data_len and end - start == numel * itemsize
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{p}: has a corrupt safetensors entry {name!r} ({exc})") from exc
        if not ok:
            raise CheckpointError(
                f"{p}: is truncated or corrupt: tensor {name!r} ({entry['dtype']}, shape {shape}) "
                f"does not fit the file's data offsets {entry['data_offsets']}"
            )
    return header


# ------------------------------------------------------------------------------------------ load


def load(
    path: PathLike, device: DeviceSpec = "cpu", /, *, mmap: bool = True, trusted: bool = False
) -> Any:
    """Load a checkpoint with its tensors on ``device``, whatever device they were saved from.

    >>> import os, tempfile, torch
    >>> from torchplace import load
    >>> path = os.path.join(tempfile.mkdtemp(), "weights.pt")
    >>> torch.save({"w": torch.ones(2)}, path)
    >>> load(path)
    {'w': tensor([1., 1.])}
    >>> load(path, "meta")["w"].device
    device(type='meta')

    Reads torch files (``.pt``, ``.pth``, ``.bin``; zip or legacy), ``.safetensors`` files
    (needs ``pip install safetensors``) and sharded checkpoints through a Hugging
    Face ``*.index.json`` weight map. Zip and safetensors files are memory-mapped when ``mmap``
    (legacy files cannot be, and are read). Files are read with ``weights_only=True`` unless
    ``trusted=True``, so an untrusted file never runs code. A missing, truncated, corrupt,
    foreign or unsafe file raises ``CheckpointError`` naming the file.
    """
    target = _device(device)
    p = as_path(path)
    kind = detect_format(p)
    if kind == "index":
        return _load_index(p, target, mmap=mmap, trusted=trusted)
    if kind == "safetensors":
        return _load_safetensors(p, target, mmap=mmap)
    return _load_torch(p, target, zip_format=kind == "zip", mmap=mmap, trusted=trusted)


def _load_torch(
    p: Path, target: torch.device, *, zip_format: bool, mmap: bool, trusted: bool
) -> Any:
    use_mmap = mmap and zip_format and target.type != "meta"
    if not zip_format and not _has_legacy_magic(p):
        raise CheckpointError(
            f"{p}: is a plain pickle, not a torch.save file (it does not open with torch's "
            "magic number); a pickle is not a checkpoint, and torchplace does not unpickle it"
        )
    try:
        with warnings.catch_warnings():  # torch's note on pickle protocols is not the user's
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(p, map_location=target, mmap=use_mmap, weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        reason = _refusal_reason(text)
        if "Weights only load failed" in text and "operand" in reason:
            raise CheckpointError(
                f"{p}: was pickled with an instruction torch's safe loader does not read "
                f"({reason}; a newer pickle protocol). Nothing was run. Re-save it with "
                "torch.save's default protocol, or pass trusted=True if you trust its source"
            ) from exc
        if "Weights only load failed" in text:
            raise CheckpointError(
                f"{p}: refused to unpickle it, because loading it would run code or build "
                f"objects other than tensors and containers ({reason}). "
                "Nothing was run. If you trust where the file came from, pass trusted=True to "
                "torchplace.load, or allow that class with torch.serialization.add_safe_globals"
            ) from exc
        raise CheckpointError(f"{p}: is corrupt ({_first_sentence(text)})") from exc
    except Exception as exc:
        if zip_format and not _has_data_pkl(p):
            raise CheckpointError(
                f"{p}: is a zip archive but not a torch.save file (no data.pkl); torchplace "
                "reads torch.save files, .safetensors files and *.index.json shard maps"
            ) from exc
        raise CheckpointError(f"{p}: {_diagnose(exc, zip_format, target)}") from exc


def _has_data_pkl(p: Path) -> bool:
    """Whether a zip file holds a pickle as torch.save writes one (so it is not someone else's).

    An archive that cannot be read at all says nothing either way, and counts as having one: its
    failure is then described as a truncated or corrupt file.
    """
    try:
        with zipfile.ZipFile(p) as archive:
            return any(n.endswith("data.pkl") for n in archive.namelist())
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        return True


# torch's legacy (non-zip) files open with this number, pickled on its own.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not loaded here")


def _has_legacy_magic(p: Path) -> bool:
    """Whether the first pickled object of ``p`` is torch's magic number (nothing is run)."""
    try:
        with p.open("rb") as f:
            first = _NoGlobals(f).load()
    except Exception:
        return False
    return isinstance(first, int) and not isinstance(first, bool) and first == _LEGACY_MAGIC


def _refusal_reason(text: str) -> str:
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


def _out_of_memory(exc: BaseException) -> bool:
    text = str(exc)
    return (
        isinstance(exc, (MemoryError, _OUT_OF_MEMORY))
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    )


def _device_failure(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("CUDA error", "CUDA driver", "HIP error", "XPU error")
    )


def _diagnose(exc: BaseException, zip_format: bool, target: torch.device) -> str:
    text = _first_sentence(str(exc) or type(exc).__name__)
    if _out_of_memory(exc):
        return (
            f"ran out of memory while being read onto {target} ({type(exc).__name__}: {text}); "
            "free memory, read it with mmap=True (the file is then mapped, not copied), or load "
            "it onto another device. If the file is far smaller than the free memory, a length "
            "in it is damaged"
        )
    if _device_failure(exc):
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


def _first_sentence(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:300]


def _safetensors_device(target: torch.device) -> str:
    # safetensors takes a device *string*; "mps:0" is spelt "mps".
    return "mps" if target.type == "mps" else str(target)


def _load_safetensors(p: Path, target: torch.device, *, mmap: bool) -> dict[str, torch.Tensor]:
    header = safetensors_header(p)
    if target.type == "meta":  # safetensors rejects meta; the header says all there is to know
        return {
            name: torch.empty(
                entry["shape"], dtype=SAFETENSORS_DTYPES[entry["dtype"]], device="meta"
            )
            for name, entry in header.items()
            if name != "__metadata__"
        }
    try:
        import safetensors
        import safetensors.torch
    except ImportError as exc:
        raise CheckpointError(
            f"{p}: is a safetensors file, and reading it needs the safetensors package; "
            f"install it with {SAFETENSORS_HINT}"
        ) from exc
    try:
        if not mmap:
            data = safetensors.torch.load(p.read_bytes())
            return {k: v.to(target) for k, v in data.items()}
        with safetensors.safe_open(str(p), framework="pt", device=_safetensors_device(target)) as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as exc:
        if _out_of_memory(exc) or _device_failure(exc):
            raise CheckpointError(f"{p}: {_diagnose(exc, True, target)}") from exc
        raise CheckpointError(
            f"{p}: cannot be read as safetensors ({_first_sentence(str(exc))}); it is truncated "
            "or corrupt"
        ) from exc


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


def _load_index(p: Path, target: torch.device, *, mmap: bool, trusted: bool) -> dict[str, Any]:
    try:
        index = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{p}: is not a readable JSON shard index ({exc})") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{p}: is JSON but not a shard index; a sharded checkpoint's index maps every tensor "
            'name to its file under "weight_map"'
        )
    result: dict[str, Any] = {}
    for shard, shard_path, names in shards(p, weight_map):
        part = load(shard_path, target, mmap=mmap, trusted=trusted)
        if not isinstance(part, Mapping):
            raise CheckpointError(f"{shard_path}: holds a {type(part).__name__}, not tensors")
        for name in names:
            if name not in part:
                raise CheckpointError(
                    f"{p}: says {name!r} is in {shard!r}, but that shard does not hold it; the "
                    "index and its shards do not match"
                )
            result[name] = part[name]
    return result


# -------------------------------------------------------------------------------------- skeleton


def _storage_ptr(t: torch.Tensor) -> int:
    if is_lazy(t):  # a lazy module's parameter: no storage until its first forward
        return 0
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # no storage
        return 0


# swap_tensors exchanges two tensors' contents in place, so a Parameter object (and every tie
# and optimizer that holds it) survives a change of device that .data cannot make (meta <-> cpu).
_swap = cast(Callable[[torch.Tensor, torch.Tensor], None], torch.utils.swap_tensors)


def _parameter_like(model_param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A Parameter holding ``data`` (not copied), of ``model_param``'s class, with its attributes.

    swap_tensors exchanges ``__class__``, ``__dict__`` and slots along with the data, so swapping
    in a plain ``nn.Parameter`` would strip a Parameter subclass and the attributes set on the
    parameter (``p.no_decay = True``, read by optimizer grouping): the new one carries them over.
    A lazy parameter becomes the class its ``materialize`` would make it.
    """
    cls = type(model_param)
    if is_lazy(model_param):
        cls = cast(Any, model_param).cls_to_become
    if not issubclass(cls, nn.Parameter) or type(data) not in (torch.Tensor, nn.Parameter):
        # A tensor subclass made a parameter (nn.Parameter(DTensor) keeps the DTensor's class,
        # and its attributes are its own) or a subclass in the file: nn.Parameter decides.
        return nn.Parameter(data, requires_grad=model_param.requires_grad)
    new = torch.Tensor._make_subclass(cls, data, model_param.requires_grad)
    new.__dict__.update(model_param.__dict__)
    for slot in copyreg._slotnames(cls):  # type: ignore[attr-defined]
        if hasattr(model_param, slot):
            setattr(new, slot, getattr(model_param, slot))
    return new


def _meta_copy(p: nn.Parameter) -> nn.Parameter:
    return _parameter_like(p, torch.empty_like(p, device="meta"))


class _SkeletonMode(TorchFunctionMode):
    """Sends parameters born inside it to ``meta`` and skips ``nn.init`` on them.

    Torch function modes are thread-local, so other threads building models are unaffected.
    Only parameters whose storage was allocated inside the mode are sent to ``meta``; a
    parameter that existed before (a pretrained module handed to the factory) is left alone.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fresh: set[int] = set()

    def is_fresh(self, t: torch.Tensor) -> bool:
        ptr = _storage_ptr(t)
        return ptr != 0 and ptr in self.fresh

    def to_meta(self, p: nn.Parameter) -> None:
        with contextlib.suppress(RuntimeError, TypeError):  # else the sweep after the factory
            _swap(p, _meta_copy(p))

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        inputs, _ = tree_flatten((args, kwargs))
        input_ptrs = set()
        for a in inputs:
            if isinstance(a, torch.Tensor):
                if isinstance(a, nn.Parameter) and a.device.type != "meta" and self.is_fresh(a):
                    self.to_meta(a)
                input_ptrs.add(_storage_ptr(a))
        if getattr(func, "__module__", None) == "torch.nn.init":
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.device.type == "meta":
                return target  # no init work for a parameter that has no data
        result = func(*args, **kwargs)
        outputs, _ = tree_flatten(result)
        for out in outputs:
            if isinstance(out, torch.Tensor) and out.device.type != "meta":
                ptr = _storage_ptr(out)
                if ptr and ptr not in input_ptrs:
                    self.fresh.add(ptr)
        return result


def skeleton(factory: Callable[..., ModuleT], /, *args: Any, **kwargs: Any) -> ModuleT:
    """Build ``factory(*args, **kwargs)`` with parameters on ``meta`` and buffers real.

    >>> import torch
    >>> from torchplace import skeleton
    >>> model = skeleton(torch.nn.Linear, 4096, 4096)  # no memory, no random init
    >>> model.weight.device, model.weight.shape
    (device(type='meta'), torch.Size([4096, 4096]))

    Parameters take no memory and get no random init (``nn.init`` calls on them are skipped),
    while buffers are computed for real, so non-persistent buffers that no checkpoint holds
    (masks, rotary frequencies) survive. Fill the result with ``load_into``. It works through a
    thread-local torch function mode: ``nn.Module`` is not patched, other threads are unaffected.
    Parameters created before the call (a module passed to the factory) are left as they are.
    Lazy modules stay lazy until ``load_into`` gives them the file's shapes.
    """
    mode = _SkeletonMode()
    with mode:
        model = factory(*args, **kwargs)
    if not isinstance(model, nn.Module):
        raise TorchplaceError(
            f"skeleton() needs a factory that returns an nn.Module, but {factory!r} returned "
            f"{type(model).__name__}"
        )
    # Parameters that no torch call touched inside the mode (nn.Parameter(torch.zeros(n)) set
    # and left alone) are still real: send the fresh ones to meta now, ties kept.
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.device.type == "meta" or not mode.is_fresh(p):
                continue
            if id(p) in replaced:
                module._parameters[name] = replaced[id(p)]
                continue
            try:
                _swap(p, _meta_copy(p))
                replaced[id(p)] = p
            except (RuntimeError, TypeError):
                replaced[id(p)] = module._parameters[name] = _meta_copy(p)
    return model


# ------------------------------------------------------------------------------------- load_into


class _Slot:
    """One tensor of the model, under every name it has (tied parameters, shared buffers)."""

    __slots__ = ("homes", "is_param", "names", "tensor")

    def __init__(self, tensor: torch.Tensor, is_param: bool) -> None:
        self.tensor = tensor
        self.is_param = is_param
        self.names: list[str] = []
        self.homes: list[tuple[nn.Module, str]] = []


def _slots(model: nn.Module) -> tuple[list[_Slot], list[_Slot], dict[str, nn.Module]]:
    """Parameters and persistent buffers (to load), non-persistent buffers, extra-state owners."""
    by_id: dict[int, _Slot] = {}
    loadable: list[_Slot] = []
    transient: list[_Slot] = []
    extra: dict[str, nn.Module] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                slot = by_id.get(id(p))
                if slot is None:
                    slot = by_id[id(p)] = _Slot(p, True)
                    loadable.append(slot)
                slot.names.append(dot + name)
                slot.homes.append((module, name))
        for name, b in module._buffers.items():
            if b is None:
                continue
            persistent = name not in module._non_persistent_buffers_set
            slot = by_id.get(id(b))
            if slot is None:
                slot = by_id[id(b)] = _Slot(b, False)
                (loadable if persistent else transient).append(slot)
            slot.names.append(dot + name)
            slot.homes.append((module, name))
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            extra[dot + "_extra_state"] = module
    return loadable, transient, extra


def _listing(items: list[str], limit: int = 10) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str:
    """Says when the file's keys differ from the model's by one prefix (``module.`` from DDP).

    The prefix must account for every missing key, so that a file of another model whose keys
    merely end alike (``emb.weight`` against ``weight``) gets no false hint.
    """
    names = [m.split(" (tied to ")[0] for m in missing]  # missing keys as listed, ties noted
    if not names or not unexpected:
        return ""
    files = set(unexpected)
    u = next((k for k in unexpected if k.endswith(names[0]) and k != names[0]), None)
    if u is not None:
        extra = u[: len(u) - len(names[0])]
        if all(extra + n in files for n in names):
            return (
                f"; the file's keys carry an extra prefix {extra!r}: save them without it, "
                f"torch.save({{k.removeprefix({extra!r}): v for k, v in "
                "torchplace.load(path).items()}, fixed_path), and load fixed_path"
            )
    m = next((n for n in names if n.endswith(unexpected[0]) and n != unexpected[0]), None)
    if m is not None:
        prefix = m[: len(m) - len(unexpected[0])]
        if all(prefix + k in set(names) for k in unexpected):
            return (
                f"; the model's keys carry a prefix {prefix!r} the file lacks: load into that "
                f"part of the model, load_into(model.get_submodule({prefix.rstrip('.')!r}), path)"
            )
    return ""


def _target_for(slot: _Slot, target: torch.device | None) -> torch.device:
    if target is not None:
        return target
    here = slot.tensor.device
    return torch.device("cpu") if here.type == "meta" else here


def _place(slot: _Slot, value: torch.Tensor) -> Callable[[], None]:
    """Put ``value`` in the slot, keeping the Parameter object (and so ties and optimizers).

    Returns what puts the slot back as it was.
    """
    current = slot.tensor
    if slot.is_param:
        assert isinstance(current, nn.Parameter)
        new = _parameter_like(current, value)
        try:
            _swap(current, new)
            return lambda: _swap(current, new)  # new holds what current held
        except (RuntimeError, TypeError):  # weak references or autograd holds it: rebind
            replacement: torch.Tensor = new
    else:
        replacement = value

    def rebind(to: torch.Tensor) -> None:
        for module, name in slot.homes:
            if slot.is_param:
                module._parameters[name] = to  # type: ignore[assignment]
            else:
                module._buffers[name] = to
        slot.tensor = to

    rebind(replacement)
    return lambda: rebind(current)


_MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


def _in_layout_of(model_tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` laid out as ``model_tensor`` is (contiguous, or channels-last), when it is."""
    for memory_format in _MEMORY_FORMATS:
        if model_tensor.is_contiguous(memory_format=memory_format):
            return value.contiguous(memory_format=memory_format)
    return value


def _set_extra_states(
    p: Path, model: nn.Module, extra: Mapping[str, nn.Module], state: Mapping[str, Any]
) -> Callable[[], None]:
    """``set_extra_state`` for each module whose extra state the file holds; all or none.

    Returns what sets the states back as they were.
    """
    done: list[tuple[nn.Module, Any]] = []

    def undo() -> None:
        for module, before in reversed(done):
            with contextlib.suppress(Exception):  # it took this state a moment ago
                module.set_extra_state(before)

    key = ""
    try:
        for key, module in extra.items():
            if key in state:
                before = module.get_extra_state()
                module.set_extra_state(state[key])
                done.append((module, before))
    except Exception as exc:
        undo()
        raise CheckpointError(
            f"{p}: {key} was refused by {type(extra[key]).__name__}.set_extra_state "
            f"({type(exc).__name__}: {_first_sentence(str(exc))}); the model is untouched"
        ) from exc
    return undo


# Classes whose _load_from_state_dict load_into follows: Module's own (pre-hooks, then each
# parameter and persistent buffer by name) and the norm layers' versioned upgrades, which
# _upgrade_norm repeats. Any other override does its own loading, which load_into cannot run
# without it touching the model.
_FOLLOWED_LOADERS = (nn.Module, _NormBase, _InstanceNorm)


def _loader_class(module: nn.Module) -> type:
    """The class whose ``_load_from_state_dict`` a module runs."""
    for klass in type(module).__mro__:
        if "_load_from_state_dict" in vars(klass):
            return klass
    return nn.Module


def _is_frozen_norm(module: nn.Module) -> bool:
    """torchvision's ``FrozenBatchNorm2d`` and the copies of it in Hugging Face models (DETR and
    its family): their ``_load_from_state_dict`` only drops ``num_batches_tracked``, which a
    file saved from an ordinary BatchNorm holds, and ``_as_load_state_dict_sees`` does that."""
    return _loader_class(module).__name__.endswith("FrozenBatchNorm2d")


def _refuse_own_loaders(p: Path, model: nn.Module) -> None:
    """A ``CheckpointError`` for a module that loads itself in a way load_into cannot follow."""
    for name, module in model.named_modules():
        klass = _loader_class(module)
        if "_load_from_state_dict" not in vars(module) and (
            klass in _FOLLOWED_LOADERS or _is_frozen_norm(module)
        ):
            continue
        where = f"{name} ({type(module).__name__})" if name else type(module).__name__
        owner = "on the instance" if "_load_from_state_dict" in vars(module) else klass.__qualname__
        raise CheckpointError(
            f"{p}: cannot be loaded by load_into: {where} overrides _load_from_state_dict (in "
            f"{owner}), and load_into assigns tensors itself, so it cannot follow "
            "that code. Build the model without skeleton and load it with "
            "model.load_state_dict(torchplace.load(path)); the model is untouched"
        )


def _hook_name(hook: Any) -> str:
    inner = getattr(hook, "hook", hook)  # _register_load_state_dict_pre_hook wraps it
    return str(getattr(inner, "__qualname__", None) or type(inner).__name__)


def _is_lazy_hook(hook: Any) -> bool:
    """Whether a pre-hook is a lazy module's: load_into does its work itself, after the checks.

    The hook materializes uninitialized parameters at once, so running it would change the
    model before a refusal; load_into instead gives a lazy parameter the file's shape when it
    swaps the weight in, which is what the hook and the copy after it amount to.
    """
    inner = getattr(hook, "hook", hook)
    return getattr(inner, "__func__", None) is LazyModuleMixin._lazy_load_hook


class _Seen:
    """The state dict as ``load_state_dict`` would hand it to each module, after its hooks.

    ``own`` holds each module's parameters, persistent buffers and extra state by full name,
    taken from that module's view of the file once its version upgrade and pre-hooks ran;
    ``unexpected`` the keys no module takes, found as each module finds them; ``missing`` and
    ``errors`` what pre-hooks (and the norm layers' upgrade) reported.
    """

    __slots__ = ("errors", "missing", "own", "unexpected")

    def __init__(self) -> None:
        self.own: dict[str, Any] = {}
        self.unexpected: list[str] = []
        self.missing: list[str] = []
        self.errors: list[str] = []


def _upgrade_norm(
    module: _NormBase, local: dict[str, Any], prefix: str, version: Any, errors: list[str]
) -> None:
    """What ``_InstanceNorm`` and ``_NormBase._load_from_state_dict`` do to an older file."""
    if isinstance(module, _InstanceNorm) and version is None and not module.track_running_stats:
        # Before 0.4 instance norms kept running stats by default; loading them would be wrong.
        stats = [prefix + n for n in ("running_mean", "running_var") if prefix + n in local]
        if stats:
            errors.append(
                f"{' and '.join(stats)}: running stats for {type(module).__name__} with "
                "track_running_stats=False (a file saved before PyTorch 0.4); remove these keys, "
                "or build the layer with track_running_stats=True"
            )
            for key in stats:
                local.pop(key)
    if (version is None or version < 2) and module.track_running_stats:
        # num_batches_tracked came with version 2: an older file starts it from 0.
        key = prefix + "num_batches_tracked"
        if key not in local:
            current = module.num_batches_tracked
            ok = current is not None and current.device.type != "meta"
            local[key] = current if ok else torch.tensor(0, dtype=torch.long)


def _as_load_state_dict_sees(
    p: Path, model: nn.Module, state: Mapping[str, Any], extra: Mapping[str, nn.Module]
) -> _Seen:
    """Walk the model as ``load_state_dict`` does, running each module's pre-hooks on its view.

    Each module gets the keys under its prefix (a fresh dict, so a hook's changes reach the
    module and its children only), its metadata (the ``version`` that norm layers upgrade by)
    and the same arguments PyTorch passes, strict included (PyTorch always passes True there).
    """
    seen = _Seen()
    metadata = getattr(state, "_metadata", None)
    top: dict[str, Any] = collections.OrderedDict(state)
    if metadata is not None:
        top._metadata = metadata  # type: ignore[attr-defined]

    def visit(module: nn.Module, local: dict[str, Any], prefix: str) -> None:
        local_metadata = {} if metadata is None else metadata.get(prefix[:-1], {})
        if isinstance(module, _NormBase):
            _upgrade_norm(module, local, prefix, local_metadata.get("version"), seen.errors)
        elif _is_frozen_norm(module):
            local.pop(prefix + "num_batches_tracked", None)
        for hook in module._load_state_dict_pre_hooks.values():
            if _is_lazy_hook(hook):
                continue
            try:
                hook(
                    local, prefix, local_metadata, True, seen.missing, seen.unexpected, seen.errors
                )
            except Exception as exc:
                where = prefix[:-1] or "the model"
                raise CheckpointError(
                    f"{p}: the load_state_dict pre-hook {_hook_name(hook)} of {where} "
                    f"({type(module).__name__}) raised {type(exc).__name__}: "
                    f"{_first_sentence(str(exc))}; nothing was loaded"
                ) from exc
        names = {n for n, t in module._parameters.items() if t is not None}
        names.update(
            n
            for n, b in module._buffers.items()
            if b is not None and n not in module._non_persistent_buffers_set
        )
        for name in names:
            if prefix + name in local:
                seen.own[prefix + name] = local[prefix + name]
        extra_key = prefix + "_extra_state"
        if extra_key in extra:
            if extra_key in local:
                seen.own[extra_key] = local[extra_key]
        elif extra_key in local:
            seen.unexpected.append(extra_key)
        children: dict[str, dict[str, Any]] = {}
        for key, value in local.items():
            if not key.startswith(prefix) or key == extra_key:
                continue
            head, dot, _ = key[len(prefix) :].partition(".")
            if dot and head in module._modules:
                children.setdefault(head, {})[key] = value
            elif dot or head not in names:
                seen.unexpected.append(key)
        for name, child in module._modules.items():
            if child is not None:
                visit(child, children.get(name, {}), f"{prefix}{name}.")

    visit(model, top, "")
    return seen


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of a file hold the same values (NaN equal to NaN); meta ones match."""
    if a.shape != b.shape:
        return False
    if a.device.type == "meta" or b.device.type == "meta":
        return True  # no data to compare: a load onto meta checks shapes only
    if (a.dtype, a.device, a.stride()) == (b.dtype, b.device, b.stride()) and (
        a.data_ptr() == b.data_ptr()
    ):
        return True  # one tensor saved under both names, as a tied model saves it: not read
    if torch.equal(a, b):
        return True
    return (
        a.dtype == b.dtype
        and (a.is_floating_point() or a.is_complex())
        and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())
    )


class _Spans:
    """The bytes already given to the model's tensors, per device, kept sorted and disjoint.

    A file may hold one storage under several names (tied weights) or overlapping views of it
    (``{"a": big, "b": big[:2]}``); assigned as they are, weights the model keeps apart would
    share memory, and a step on one would change the other. Bytes are compared by address, so
    tensors mapped from one file, each on its own storage, are told apart by their ranges.
    """

    def __init__(self) -> None:
        self.starts: dict[torch.device, list[int]] = {}
        self.ends: dict[torch.device, list[int]] = {}

    def claim(self, t: torch.Tensor) -> bool:
        """Record the bytes ``t`` shows; False (nothing recorded) when another tensor has some."""
        if t.device.type == "meta" or t.numel() == 0:
            return True
        try:
            start = t.data_ptr()
        except (RuntimeError, NotImplementedError):  # no addressable storage: nothing to share
            return True
        extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        end = start + (extent + 1) * t.element_size()
        starts = self.starts.setdefault(t.device, [])
        ends = self.ends.setdefault(t.device, [])
        i = bisect.bisect_right(starts, start)
        if (i > 0 and ends[i - 1] > start) or (i < len(starts) and starts[i] < end):
            return False
        starts.insert(i, start)
        ends.insert(i, end)
        return True


def _has_post_hooks(model: nn.Module) -> bool:
    return any(m._load_state_dict_post_hooks for m in model.modules())


def _run_post_hooks(
    p: Path,
    model: nn.Module,
    missing: list[str],
    unexpected: list[str],
    then: Callable[[], str],
) -> None:
    """Every module's load_state_dict post-hooks, children first, as load_state_dict runs them.

    They may change ``missing`` and ``unexpected`` in place. When a hook fails, ``then`` deals
    with the model (puts it back, say) and says what state it is left in.
    """
    keys = _IncompatibleKeys(missing, unexpected)

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.")
        for hook in module._load_state_dict_post_hooks.values():
            where = f"{prefix[:-1] or 'the model'} ({type(module).__name__})"
            try:
                out = hook(module, keys)
            except Exception as exc:
                raise CheckpointError(
                    f"{p}: the load_state_dict post-hook {_hook_name(hook)} of {where} raised "
                    f"{type(exc).__name__}: {_first_sentence(str(exc))}; {then()}"
                ) from exc
            if out is not None:
                raise CheckpointError(
                    f"{p}: the load_state_dict post-hook {_hook_name(hook)} of {where} returned "
                    "a value; post-hooks change the incompatible keys in place and return "
                    f"None; {then()}"
                )

    visit(model, "")


def load_into(
    model: ModuleT, path: PathLike, device: DeviceSpec = None, /, *, strict: bool = True
) -> ModuleT:
    """Fill ``model`` (a skeleton or a real model) from a checkpoint, weights on ``device``.

    >>> import os, tempfile, torch
    >>> from torchplace import load_into, skeleton
    >>> path = os.path.join(tempfile.mkdtemp(), "linear.pt")
    >>> torch.save(torch.nn.Linear(3, 2).state_dict(), path)
    >>> model = load_into(skeleton(torch.nn.Linear, 3, 2), path)
    >>> model.weight.device, model.weight.requires_grad
    (device(type='cpu'), True)

    ``device`` defaults to where each tensor already is, or the CPU for a skeleton's ``meta``
    parameters. On the CPU the file is memory-mapped and assigned, copy-on-write, so no second
    copy of the weights is made (the file must not be rewritten in place while the model uses
    it: save to a new name and rename). A parameter that already holds memory on the target is
    filled in place. Parameter objects are kept, with their class and attributes, so tied
    weights stay tied and optimizers stay valid; a tied parameter saved under any one of its
    names counts as present, and one saved under two names with different values raises. Weights
    the model keeps apart never share memory, even where the file holds them in one storage
    (those, and only those, are copied). The model's declared dtypes and memory layouts are kept
    (the file's tensors are converted, and one saved as a transposed view loads contiguous).

    As ``load_state_dict`` does, each module's load pre-hooks run on its part of the file, older
    BatchNorm files without ``num_batches_tracked`` load, lazy modules take the file's shapes,
    and load post-hooks run once the weights are in place. As with ``load_state_dict``, they may
    clear missing or unexpected keys before the strict check; when keys are missing or
    unexpected and the model has post-hooks, the load goes ahead (keeping a copy of the weights
    it fills in place) and is undone if any key is left after them. A module that overrides
    ``_load_from_state_dict`` (beyond PyTorch's norm layers and the ``FrozenBatchNorm2d`` of
    torchvision and Hugging Face, whose override only drops ``num_batches_tracked``) is refused
    before anything changes.
    A module whose ``set_extra_state`` refuses the file's extra state raises ``CheckpointError``
    with the model untouched. With ``strict``, missing and unexpected keys and shape mismatches
    raise ``CheckpointError`` listing them by name, and the model is left untouched; without it,
    keys that do not match are skipped (a shape mismatch still raises, and so does a file of
    which not one key matches, unless the model has load post-hooks).
    """
    if not isinstance(model, nn.Module):
        raise TorchplaceError(
            f"load_into() fills an nn.Module, not {type(model).__name__}; build the model "
            "first, e.g. load_into(torchplace.skeleton(MyModel, ...), path)"
        )
    from ._sharded import has_dtensors, load_sharded

    if has_dtensors(model):  # FSDP2, tensor parallelism: each rank reads its own slices
        return cast(ModuleT, load_sharded(model, path, device, strict=strict))
    target = None if device is None else _device(device)
    p = as_path(path)
    _refuse_own_loaders(p, model)
    loadable, transient, extra = _slots(model)
    read_on = target if target is not None and target.type == "meta" else torch.device("cpu")
    state = load(p, read_on)
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise CheckpointError(f"{p}: holds a {type(state).__name__}, not a state dict")
    nested = [k for k, v in state.items() if isinstance(v, Mapping)]
    if nested and not any(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f"{p}: holds a dict of {_listing(sorted(nested), 5)}, not a state dict; save the "
            f"part you need on its own, torch.save(torchplace.load(path)[{nested[0]!r}], "
            "weights_path), and load_into the model from weights_path"
        )
    # What each module would be given by load_state_dict: older norm layers upgraded, every
    # pre-hook run (a layout converted, a key renamed), so values and shapes match its result.
    seen = _as_load_state_dict_sees(p, model, state, extra)
    own = seen.own

    missing: list[str] = []
    not_loaded: list[str] = []  # every name of what stays as it was, for post-hooks
    mismatched: list[str] = []
    conflicts: list[str] = []
    plan: list[tuple[_Slot, torch.Tensor]] = []
    for slot in loadable:
        present = [n for n in slot.names if n in own]
        if not present:
            also = f" (tied to {', '.join(slot.names[1:])})" if len(slot.names) > 1 else ""
            missing.append(slot.names[0] + also)
            not_loaded += slot.names
            continue
        # A lazy parameter takes the file's shape, as its load_state_dict pre-hook (which
        # load_into does not run: it would materialize before the checks) lets it.
        lazy = is_lazy(slot.tensor)
        bad = False
        for name in present:
            value = own[name]
            if not isinstance(value, torch.Tensor):
                mismatched.append(f"{name}: the file holds a {type(value).__name__}")
                bad = True
            elif not lazy and value.shape != slot.tensor.shape:
                mismatched.append(
                    f"{name}: file {tuple(value.shape)}, model {tuple(slot.tensor.shape)}"
                )
                bad = True
        if bad:
            continue
        value = own[present[0]]
        # A tied parameter is one tensor: a file that gives its names different values was
        # saved from a model that kept them apart, and either value would be a guess.
        conflicts += [
            f"{present[0]} and {n}" for n in present[1:] if not _same_values(value, own[n])
        ]
        plan.append((slot, value))
    missing_extra = [k for k in extra if k not in own]
    missing += missing_extra
    not_loaded += missing_extra
    listed = {m.split(" (tied to ")[0] for m in missing} | set(not_loaded)
    missing += [k for k in seen.missing if k not in listed]  # what pre-hooks reported
    not_loaded += [k for k in seen.missing if k not in listed]
    unexpected = seen.unexpected
    no_data = [
        s.names[0] for s in transient if s.tensor.device.type == "meta" and read_on.type != "meta"
    ]

    problems = []
    if mismatched:
        problems.append(f"shape mismatches: {_listing(mismatched)}")
    if conflicts:
        drop = conflicts[0].split(" and ")[1]
        problems.append(
            f"tied weights saved with different values: {_listing(conflicts)} (the file was "
            "saved from a model that keeps them apart; keep the value you want, e.g. "
            f"torch.save({{k: v for k, v in torchplace.load(path).items() if k != {drop!r}}}, "
            "fixed_path), and load fixed_path)"
        )
    if seen.errors:
        problems.append(f"refused by the model: {_listing(seen.errors)}")
    if strict and no_data:
        problems.append(
            f"non-persistent buffers on meta that no checkpoint holds: {_listing(no_data)} "
            "(build the model with torchplace.skeleton so buffers stay real)"
        )
    # Keys alone: post-hooks may clear them, as load_state_dict lets them (its strict check
    # comes after its post-hooks). Then the load goes ahead, and is undone if any key is left.
    keys_only = strict and bool(missing or unexpected) and not problems
    hooked = _has_post_hooks(model)
    deferred = keys_only and hooked
    matched = bool(plan) or any(k in own for k in extra)  # whether strict=False would load any
    if (strict and (missing or unexpected) and not deferred) or problems:
        raise _does_not_fit(
            p, model, problems, missing if strict else [], unexpected, strict, matched
        )
    if not strict and not matched and loadable and not hooked:
        held = f"the file has {_listing(unexpected, 5)}" if unexpected else "the file holds none"
        raise CheckpointError(
            f"{p}: not one of its keys matches {type(model).__name__}, so strict=False would "
            f"load nothing: the model has {_listing(missing, 5)}; {held}"
            f"{_prefix_hint(missing, unexpected)}"
        )

    # Phase 1: everything that can fail for lack of memory or a bad device (the transfers and
    # conversions) happens before the model changes, so a failure leaves it untouched.
    fills: list[tuple[_Slot, torch.Tensor]] = []  # memory already on the target: filled in place
    places: list[tuple[_Slot, torch.Tensor]] = []  # a new tensor swapped in
    spans = _Spans()  # the bytes given to a slot so far
    backups: list[tuple[torch.Tensor, torch.Tensor]] = []  # filled tensors' values, if deferred
    try:
        for slot, value in plan:
            dev = _target_for(slot, target)
            current = slot.tensor
            lazy = is_lazy(current)
            if current.device == dev and dev.type != "meta" and not lazy:
                fills.append((slot, value))
                if deferred:
                    backups.append((current, current.detach().clone()))
                continue
            placed = value.to(device=dev, dtype=current.dtype)
            if not lazy and placed.stride() != current.stride():
                # The file keeps the layout it was saved in (a transposed view, say); the model
                # keeps its own, as load_state_dict's copy would, so .view() works as before.
                placed = _in_layout_of(current, placed)
            if not spans.claim(placed):
                # The file holds these bytes under another name too (tied in the file, or a
                # view of a bigger tensor): a model that keeps the two apart gets its own copy.
                placed = placed.clone()
                spans.claim(placed)
            places.append((slot, placed))
        for slot in transient:
            here = slot.tensor.device
            if target is not None and here.type != "meta" and here != target:
                places.append((slot, slot.tensor.to(target)))
    except Exception as exc:
        raise CheckpointError(
            f"{p}: could not be placed into {type(model).__name__} ({type(exc).__name__}: "
            f"{_first_sentence(str(exc))}); the model is untouched"
        ) from exc
    # Extra state goes first: a module's set_extra_state may refuse what the file holds, and
    # the states already set are put back, so the refusal leaves the model untouched.
    undos = [_set_extra_states(p, model, extra, own)]

    def put_back() -> str:
        """Undo what phase 2 did, every step tried; what could not be undone ("" if nothing)."""
        restores: list[Callable[[], object]] = [
            functools.partial(torch.Tensor.copy_, t, before) for t, before in backups
        ]
        failures = []
        with torch.no_grad():
            for undo in [*restores, *reversed(undos)]:
                try:
                    undo()
                except Exception as exc:  # a post-hook made a view of a swapped parameter, ...
                    failures.append(f"{type(exc).__name__}: {_first_sentence(str(exc))}")
        return failures[0] if failures else ""

    def state_after_put_back() -> str:
        failure = put_back()
        if failure:
            return f"the model could not be put back as it was ({failure}), so build it again"
        return "the model is put back as it was"

    # Phase 2: swap in and fill. Swaps of tensors that are ready and copies into memory that
    # exists do not run out of memory; should one fail all the same, what was done is undone
    # (the filled tensors only when a deferred check kept their values).
    filled = False
    try:
        for slot, value in places:
            undos.append(_place(slot, value))
        with torch.no_grad():
            for slot, value in fills:
                filled = True
                slot.tensor.copy_(value)  # copy_ converts the dtype
    except Exception as exc:
        failure = put_back()
        state = "the model is untouched"
        if failure or (filled and not deferred):
            state = "the model is partly filled, so build it again"
        raise CheckpointError(
            f"{p}: could not be placed into {type(model).__name__} ({type(exc).__name__}: "
            f"{_first_sentence(str(exc))}); {state}"
        ) from exc
    left_missing, left_unexpected = list(not_loaded), list(unexpected)
    if not deferred:
        _run_post_hooks(p, model, left_missing, left_unexpected, lambda: "the weights are loaded")
        if strict and (left_missing or left_unexpected):  # a hook added keys: as torch, raise
            raise CheckpointError(
                f"{_does_not_fit(p, model, [], left_missing, left_unexpected, strict, True)} "
                "(reported by the model's load post-hooks once the weights were loaded, so "
                "they are loaded)"
            )
        return model
    try:
        _run_post_hooks(p, model, left_missing, left_unexpected, state_after_put_back)
    except CheckpointError:  # a hook failed, and the model is put back already
        raise
    except BaseException:  # Ctrl-C inside a hook
        put_back()
        raise
    if left_missing or left_unexpected:
        error = _does_not_fit(p, model, [], left_missing, left_unexpected, strict, matched)
        raise CheckpointError(f"{error}; {state_after_put_back()}")
    return model


def _does_not_fit(
    p: Path,
    model: nn.Module,
    problems: list[str],
    missing: list[str],
    unexpected: list[str],
    strict: bool,
    matched: bool,
) -> CheckpointError:
    """The error for a file that does not fit: missing and unexpected keys first.

    ``matched``: some key matches, so ``strict=False`` would load something.
    """
    keys = []
    if missing:
        keys.append(f"missing keys: {_listing(missing)}")
    if strict and unexpected:
        keys.append(f"unexpected keys: {_listing(unexpected)}")
    hint = _prefix_hint(missing, unexpected) if strict else ""
    fix = "; pass strict=False to load what matches" if matched and not problems else ""
    return CheckpointError(
        f"{p}: does not fit {type(model).__name__}: {'; '.join(keys + problems)}{hint}{fix}"
    )
