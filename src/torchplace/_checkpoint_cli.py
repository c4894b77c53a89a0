"""``torchplace inspect`` and ``torchplace remap``: look at and rewrite checkpoint files.

``inspect`` reads a file's tensor table without running any of its pickled code and without a
GPU: torch files are read by an unpickler that builds inert records for every global it meets
(so a malicious file is described, never executed), safetensors files by their JSON header,
without importing torch (so ``torchplace inspect FILE.safetensors`` starts at once). Whatever
``load`` refuses, inspect refuses: a legacy file cut short in its storages, a safetensors header
whose tensors overlap, leave gaps or overflow.

``remap`` rewrites a torch file so that a plain ``torch.load`` puts its tensors on another
device, or every shard of a shard index. It reads files safely (``weights_only=True``,
memory-mapped), writes temporary files (``.NAME.torchplace-tmp-PID``) beside the outputs with
every storage tagged for the new device, and renames them into place only when all are
complete, so an interrupted run leaves no partial output; the temporary files of a run that was
killed outright are swept by the next remap into the same directory.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import contextlib
import functools
import io
import json
import os
import pickle
import shutil
import sys
import types
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, ClassVar, cast

from ._errors import CheckpointError, DeviceSpecError, TorchplaceError
from ._index import LEGACY_MAGIC, weight_map
from ._safetensors import DTYPES as SAFETENSORS_DTYPES
from ._safetensors import read_header as read_safetensors_header
from ._safetensors import sniff as sniff_safetensors
from ._sizes import format_bytes

__all__ = [
    "TensorRecord",
    "code_globals",
    "describe_file",
    "register",
    "remap",
    "sweep_stale_temporaries",
]

# Progress is shown for files at least this large (when the output is a terminal).
PROGRESS_MIN_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class TensorRecord:
    """One tensor as a file saved it: name, saved device, dtype, shape and bytes.

    ``nbytes`` is the tensor's own size; ``stored`` is the size of the storage the file keeps
    for it, which is larger when the tensor was saved as a view of a bigger one. ``shares``
    names the first tensor saved on the same storage (a tied weight, or another view of it):
    the file holds those bytes once, and the totals count them once.
    """

    name: str
    device: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str
    stored: int = 0
    shares: str | None = None


# ----------------------------------------------------------------------------- a safe unpickler


class _Opaque:
    """Stands for any object a pickle asks for: records the call, runs nothing."""

    qualname = "?"
    args: tuple[Any, ...]
    state: Any
    items: dict[Any, Any]
    values: list[Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> _Opaque:  # NEWOBJ calls __new__ alone
        self = super().__new__(cls)
        self.args, self.state, self.items, self.values = args, None, {}, []
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> _Opaque:
        # What a stand-in's call returns (``getattr(__import__('os'), 'system')('ls')`` calls
        # the result of a call): one more stand-in, holding the arguments.
        return _Opaque(self, *args)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value

    def append(self, value: Any) -> None:
        self.values.append(value)

    def extend(self, values: Any) -> None:
        self.values.extend(values)


@dataclass
class _StorageRef:
    dtype: str
    key: str
    location: str
    itemsize: int
    numel: int = -1  # elements of the storage, as saved; -1 where the file does not say


@dataclass
class _TensorRef:
    storage: _StorageRef | None
    dtype: str
    shape: tuple[int, ...]


class _StorageType:
    def __init__(self, dtype: str, itemsize: int) -> None:
        self.dtype, self.itemsize = dtype, itemsize


def _dtype_info(name: str) -> tuple[str, int]:
    """(dtype name, element size) for a torch dtype attribute name such as ``bfloat16``."""
    import torch

    dt = vars(torch).get(name)  # no getattr: torch's module __getattr__ imports submodules
    if isinstance(dt, torch.dtype):
        return str(dt).removeprefix("torch."), dt.itemsize  # no tensor: quantized ones warn
    return name, 1


def _shape(size: Any) -> tuple[int, ...]:
    if isinstance(size, _Opaque):  # torch.Size saved as an object
        size = size.args[0] if size.args else ()
    if not isinstance(size, (tuple, list)):
        return ()
    return tuple(int(n) if isinstance(n, int) else -1 for n in size)


def _rebuild_tensor(storage: Any, offset: Any, size: Any, *rest: Any) -> _TensorRef:
    dtype = storage.dtype if isinstance(storage, _StorageRef) else "?"
    # _rebuild_tensor_v3 passes the dtype explicitly (for untyped storages)
    if len(rest) >= 4 and isinstance(rest[3], _DType):
        dtype = rest[3].name
    ref = storage if isinstance(storage, _StorageRef) else None
    return _TensorRef(ref, dtype, _shape(size))


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data


def _rebuild_meta(dtype: Any, size: Any, *rest: Any) -> _TensorRef:
    name = dtype.name if isinstance(dtype, _DType) else "?"
    return _TensorRef(_StorageRef(name, "", "meta", 0), name, _shape(size))


@dataclass
class _WithParts:
    """A tensor that the file saves with tensors of its own (a per-channel quantized tensor's
    scales and zero points), listed as ``name`` and ``name.part``."""

    main: _TensorRef
    parts: dict[str, Any]


def _rebuild_qtensor(
    storage: Any, offset: Any, size: Any, stride: Any = None, qparams: Any = (), *rest: Any
) -> _TensorRef | _WithParts:
    ref = _rebuild_tensor(storage, offset, size)
    if isinstance(qparams, tuple) and len(qparams) == 4:  # (qscheme, scales, zero_points, axis)
        return _WithParts(ref, {"scales": qparams[1], "zero_points": qparams[2]})
    return ref


# The tensors a sparse tensor is saved as, named as its accessors are (``crow_indices()``, ...).
_SPARSE_PARTS = {
    "torch.sparse_coo": ("indices", "values"),
    "torch.sparse_csr": ("crow_indices", "col_indices", "values"),
    "torch.sparse_bsr": ("crow_indices", "col_indices", "values"),
    "torch.sparse_csc": ("ccol_indices", "row_indices", "values"),
    "torch.sparse_bsc": ("ccol_indices", "row_indices", "values"),
}


def _rebuild_sparse(layout: Any, data: Any, *rest: Any) -> Any:
    name = layout.args[0] if isinstance(layout, _Opaque) and layout.args else None
    parts = _SPARSE_PARTS.get(name) if isinstance(name, str) else None
    if parts is None or not isinstance(data, tuple):
        return _Opaque(layout, data)
    return dict(zip(parts, data, strict=False))


def _rebuild_nested(*data: Any) -> dict[str, Any]:
    return dict(zip(("buffer", "sizes", "strides", "storage_offsets"), data, strict=False))


@dataclass(frozen=True)
class _DType:
    name: str


class _InertUnpickler(pickle._Unpickler):  # pure Python: corrupt lengths fail cleanly
    """An unpickler whose every global is an inert stand-in: nothing in the file can run."""

    _TORCH_REBUILDERS: Mapping[str, Callable[..., Any]] = {
        "_rebuild_tensor": _rebuild_tensor,
        "_rebuild_tensor_v2": _rebuild_tensor,
        "_rebuild_tensor_v3": _rebuild_tensor,
        "_rebuild_parameter": _rebuild_parameter,
        "_rebuild_parameter_with_state": _rebuild_parameter,
        "_rebuild_meta_tensor_no_storage": _rebuild_meta,
        "_rebuild_qtensor": _rebuild_qtensor,
        "_rebuild_sparse_tensor": _rebuild_sparse,
        "_rebuild_nested_tensor": _rebuild_nested,
    }

    def __init__(self, f: Any) -> None:
        super().__init__(f)
        self.storages: dict[str, _StorageRef] = {}  # by key, as persistent ids name them

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch._utils" and name in self._TORCH_REBUILDERS:
            return self._TORCH_REBUILDERS[name]
        if (module, name) == ("torch.storage", "UntypedStorage"):  # dtypes with no Storage
            return _StorageType("uint8", 1)
        if module == "torch" and name.endswith("Storage"):
            import torch

            if name == "UntypedStorage":
                return _StorageType("uint8", 1)
            try:
                dt = torch.storage._get_dtype_from_pickle_storage_type(name)
            except (KeyError, AttributeError):
                return _StorageType("?", 1)
            return _StorageType(str(dt).removeprefix("torch."), dt.itemsize)
        if module == "torch" and name == "Size":
            return tuple
        if module == "torch":
            import torch

            if isinstance(vars(torch).get(name), torch.dtype):
                return _DType(_dtype_info(name)[0])
        if module == "_codecs" and name == "encode":  # bytes in protocol 2 pickles
            return _latin1_encode
        return type(name, (_Opaque,), {"qualname": f"{module}.{name}"})

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            storage_type, key, location = pid[1], pid[2], pid[3]
            numel = pid[4] if isinstance(pid[4], int) and pid[4] >= 0 else -1
            if isinstance(storage_type, _StorageType):
                ref = _StorageRef(
                    storage_type.dtype, str(key), str(location), storage_type.itemsize, numel
                )
            else:
                ref = _StorageRef("?", str(key), str(location), 1, numel)
            return self.storages.setdefault(ref.key, ref)
        return _Opaque(pid)


@functools.cache
def _loadable_globals() -> frozenset[str]:
    """The globals torch's weights-only loader accepts, which ``torchplace.load`` reads safely
    (sparse, quantized and nested tensors need some beyond the rebuilders stood in for here)."""
    from torch import _weights_only_unpickler as safe

    found: set[str] = set()
    for getter in ("_get_allowed_globals", "_get_user_allowed_globals"):
        allowed = getattr(safe, getter, None)
        if callable(allowed):
            found.update(allowed())
    return frozenset(found)


class _Recorder(_InertUnpickler):
    """The inert unpickler, noting every global it stood in for that a safe load would refuse
    (what loading would run)."""

    def __init__(self, f: Any) -> None:
        super().__init__(f)
        self.found: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        full = _stand_in_for(found)
        if full is not None and full not in _loadable_globals():
            self.found.append(full)
        return found

    def _load_reduce(self) -> None:
        """REDUCE, noting what ``getattr(module, "name")`` reaches (``os.system`` where the
        pickle builds ``getattr(__import__("os"), "system")``): the call that would run."""
        unpickler = cast(Any, self)  # the pure-Python unpickler's stack, which typeshed omits
        func, args = unpickler.stack[-2], unpickler.stack[-1]
        if _stand_in_for(func) == "builtins.getattr" and isinstance(args, tuple) and len(args) > 1:
            owner = args[0]
            if _stand_in_for(type(owner)) == "builtins.__import__" and owner.args:
                owner = owner.args[0]  # __import__("os") is the module os
            else:
                owner = _stand_in_for(owner)
            if isinstance(owner, str) and isinstance(args[1], str):
                self.found.append(f"{owner}.{args[1]}")
        unpickler.load_reduce()

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = {
        **pickle._Unpickler.dispatch,
        pickle.REDUCE[0]: _load_reduce,
    }


def _stand_in_for(obj: Any) -> str | None:
    """The global that ``obj`` stands in for, if it is a stand-in, as Python 3 names it
    (protocol 2 pickles name Python 2's modules: ``__builtin__.exec``)."""
    if not (isinstance(obj, type) and issubclass(obj, _Opaque)):
        return None
    module, _, name = obj.qualname.rpartition(".")
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


def code_globals(path: str | os.PathLike[str], /) -> list[str]:
    """The globals a torch file's pickle names beyond tensors and containers, read inertly.

    Loading the file with ``trusted=True`` would import and call these; ``inspect`` lists them.
    Safetensors files hold none; a shard index, those of its shards.
    """
    p = Path(path)
    kind = _format_of(p)
    found: list[str] = []
    if kind == "index":
        for _, shard_path, _ in _index_shards(p):
            found += code_globals(shard_path)
    with _readable(p):
        if kind == "zip":
            with zipfile.ZipFile(p) as archive:
                pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
                if pickles:
                    recorder = _Recorder(io.BytesIO(archive.read(min(pickles, key=len))))
                    recorder.load()
                    found = recorder.found
        elif kind == "legacy":
            with p.open("rb") as raw:
                f = _BoundedReader(raw, p.stat().st_size)
                for _ in range(4):  # magic number, protocol, system info, the object
                    recorder = _Recorder(f)
                    recorder.load()
                    found += recorder.found
    return list(dict.fromkeys(found))


def _latin1_encode(text: Any, encoding: Any = "latin1") -> bytes:
    return str(text).encode("latin1") if encoding == "latin1" else b""


# A path to an object in the pickle, kept as (parent path, key) links and spelt out only for the
# tensors found: spelling it at every level cost time and memory that grew with the square of
# the depth (a million nested dicts took minutes).
_Path = tuple["_Path", Any] | None


def _spell(path: _Path) -> str:
    keys: list[str] = []
    while path is not None:
        path, key = path
        keys.append(str(key))
    return ".".join(reversed(keys))


def _tensor_refs(root: Any) -> Iterator[tuple[str, _TensorRef]]:
    """Every tensor reference under ``root`` in order, with its dotted path; each container is
    visited once: a pickle that shares one object across many branches (or holds itself) cannot
    make the walk run for ever, and a stack instead of recursion reads any depth that
    ``torch.load`` reads."""
    seen: set[int] = set()
    stack: list[tuple[_Path, Any]] = [(None, root)]
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, _TensorRef):
            yield _spell(path), obj
            continue
        children: list[tuple[_Path, Any]]
        if isinstance(obj, _WithParts):
            yield _spell(path), obj.main
            children = [((path, k), v) for k, v in obj.parts.items()]
        elif not isinstance(obj, (dict, list, tuple, _Opaque)) or id(obj) in seen:
            continue
        else:
            seen.add(id(obj))
            if isinstance(obj, dict):
                children = [((path, k), v) for k, v in obj.items()]
            elif isinstance(obj, (list, tuple)):
                children = [((path, i), v) for i, v in enumerate(obj)]
            else:
                children = [(path, part) for part in (obj.args, obj.state, obj.items, obj.values)]
        stack.extend(reversed(children))


def _records(root: Any, file: str, owners: dict[str, str] | None = None) -> list[TensorRecord]:
    """The tensors under an unpickled ``root``; ``owners`` is filled with the first tensor saved
    on each storage, by the storage's key."""
    out = []
    owners = {} if owners is None else owners
    for name, ref in _tensor_refs(root):
        name = name or "<root>"
        numel = 1
        for n in ref.shape:
            numel *= max(n, 0)
        itemsize = _dtype_info(ref.dtype)[1] if ref.dtype != "?" else 1
        storage = ref.storage
        device = storage.location if storage is not None else "?"
        nbytes = 0 if device == "meta" else numel * itemsize
        stored, shares = nbytes, None
        if storage is not None and device != "meta":
            if storage.numel >= 0:
                stored = storage.numel * storage.itemsize
            shares = owners.setdefault(storage.key, name)
            if shares == name:
                shares = None
        out.append(TensorRecord(name, device, ref.dtype, ref.shape, nbytes, file, stored, shares))
    return out


@contextlib.contextmanager
def _readable(p: Path) -> Iterator[None]:
    """Any failure while reading ``p`` becomes a CheckpointError saying the file is damaged."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{p}: is truncated or corrupt ({type(exc).__name__}: {exc})"
        ) from exc


def _describe_zip(p: Path) -> list[TensorRecord]:
    with _readable(p):
        with zipfile.ZipFile(p) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if not pickles:
                raise CheckpointError(
                    f"{p}: is a zip archive but not a torch.save file (no data.pkl)"
                )
            data = archive.read(min(pickles, key=len))
        root = _InertUnpickler(io.BytesIO(data)).load()
    return _records(root, p.name)


class _BoundedReader:
    """A file for the unpickler that refuses reads past the end of the file up front.

    A corrupt length in a pickle would otherwise make the unpickler allocate that much first.
    """

    def __init__(self, f: IO[bytes], size: int) -> None:
        self.f, self.size = f, size

    def read(self, n: int = -1) -> bytes:
        if n > self.size - self.f.tell():
            raise pickle.UnpicklingError(f"a record of {n} bytes runs past the end of the file")
        return self.f.read(n)

    def readline(self) -> bytes:
        return self.f.readline()


def _describe_legacy(p: Path) -> list[TensorRecord]:
    with _readable(p), p.open("rb") as raw:
        f = _BoundedReader(raw, p.stat().st_size)
        magic = _InertUnpickler(f).load()
        if magic != LEGACY_MAGIC:
            raise CheckpointError(
                f"{p}: is a pickle but not a torch.save file (wrong magic number); a plain "
                "pickle is not a checkpoint"
            )
        _InertUnpickler(f).load()  # protocol version
        _InertUnpickler(f).load()  # system info
        unpickler = _InertUnpickler(f)
        owners: dict[str, str] = {}  # storage key -> the first tensor saved on it
        records = _records(unpickler.load(), p.name, owners)
        _check_legacy_storages(p, f, unpickler.storages, owners)
    return records


def _check_legacy_storages(
    p: Path, f: _BoundedReader, storages: dict[str, _StorageRef], owners: dict[str, str]
) -> None:
    """Check that the storages after a legacy file's pickles are all there, as ``torch.load``
    does: a list of storage keys, then for each an element count and the elements. A file cut
    short in its data (the commonest damage: an interrupted save or copy) is refused here, as
    ``load`` refuses it, instead of being described as whole."""
    keys = _InertUnpickler(f).load()
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CheckpointError(f"{p}: is corrupt: its list of storages is not a list of keys")
    end = p.stat().st_size
    cut_short = "the save or copy was cut short, so save or fetch the file again"
    for key in keys:
        ref = storages.get(key)
        if ref is None:
            raise CheckpointError(
                f"{p}: is corrupt: it lists data for storage {key}, which no tensor uses"
            )
        tensor = owners.get(key, f"storage {key}")
        head = f.f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{p}: is truncated before the data of {tensor}; {cut_short}")
        numel = int.from_bytes(head, "little", signed=True)
        if numel < 0 or (ref.numel >= 0 and numel != ref.numel):
            raise CheckpointError(
                f"{p}: is corrupt: the data of {tensor} holds {numel} elements, where the "
                f"tensor's record says {ref.numel}"
            )
        wanted, left = numel * ref.itemsize, end - f.f.tell()
        if wanted > left:
            raise CheckpointError(
                f"{p}: is truncated: the data of {tensor} takes {wanted} bytes, and the file "
                f"ends {left} bytes later; {cut_short}"
            )
        f.f.seek(wanted, os.SEEK_CUR)


# ------------------------------------------------------------------------------------ safetensors
#
def _format_of(p: Path) -> str:
    """``detect_format(p)``, without importing torch for a safetensors file."""
    if sniff_safetensors(p):
        return "safetensors"
    from ._checkpoint import detect_format

    return detect_format(p)


def _describe_safetensors(p: Path) -> list[TensorRecord]:
    out = []
    for name, entry in read_safetensors_header(p).items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        dtype = SAFETENSORS_DTYPES[entry["dtype"]][0]
        # safetensors stores no device: the reader chooses one
        nbytes = end - start
        out.append(TensorRecord(name, "-", dtype, tuple(entry["shape"]), nbytes, p.name, nbytes))
    return out


def describe_file(path: str | os.PathLike[str], /) -> list[TensorRecord]:
    """Every tensor a checkpoint file holds, read without running its code or needing a GPU.

    >>> import os, tempfile, torch
    >>> from torchplace._checkpoint_cli import describe_file
    >>> path = os.path.join(tempfile.mkdtemp(), "w.pt")
    >>> torch.save({"w": torch.ones(2, 3)}, path)
    >>> w = describe_file(path)[0]
    >>> w.name, w.device, w.dtype, w.shape, w.nbytes, w.shares
    ('w', 'cpu', 'float32', (2, 3), 24, None)
    """
    p = Path(path)
    kind = _format_of(p)
    if kind == "zip":
        return _describe_zip(p)
    if kind == "legacy":
        return _describe_legacy(p)
    if kind == "safetensors":
        return _describe_safetensors(p)
    return _describe_index(p)


# The old name, still imported by tests/test_checkpoint.py (another branch's file); it reads as
# _inspect.describe (an object's description), so new code says describe_file. Drop it once
# those imports are renamed.
describe = describe_file


def _index_shards(p: Path) -> list[tuple[str, Path, list[str]]]:
    """The shards a shard index lists: (name in the index, path, tensor names) each."""
    mapping = weight_map(p)
    from ._checkpoint import shards

    return shards(p, mapping)


def _describe_index(p: Path) -> list[TensorRecord]:
    out: list[TensorRecord] = []
    for shard, shard_path, names in _index_shards(p):
        records = describe_file(shard_path)
        # A name holds a tensor, or (sparse, quantized) tensors listed under name.part.
        held = {r.name.rsplit(".", n)[0] for r in records for n in range(r.name.count(".") + 1)}
        for name in names:
            if name not in held:
                raise CheckpointError(
                    f"{p}: says {name!r} is in {shard!r}, but that shard does not hold it; the "
                    "index and its shards do not match"
                )
        out.extend(records)
    return out


def _stored(r: TensorRecord) -> int:
    """The bytes ``r`` adds to its file: its storage's, once per storage."""
    return 0 if r.shares is not None else r.stored


def _totals_by(records: list[TensorRecord], key: str) -> dict[str, dict[str, int]]:
    totals: dict[str, dict[str, int]] = {}
    for r in records:
        entry = totals.setdefault(getattr(r, key), {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += _stored(r)
    return totals


def _note(r: TensorRecord) -> str:
    if r.shares is not None:
        return f"shares {r.shares}'s storage"
    if r.stored > r.nbytes:
        return f"a view of {format_bytes(r.stored)}, all stored"
    return ""


def _printable(text: Any) -> str:
    """``text`` as stdout can encode it: a lone surrogate (a pickle's string, or a file name
    that is not UTF-8) is shown escaped instead of failing the print."""
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


def _run_inspect(args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        kind = _format_of(path)
        records = describe_file(path)
        code = code_globals(path)
    except CheckpointError as exc:
        print(f"torchplace inspect: error: {exc}", file=sys.stderr)
        return 1
    summary = {
        "file": str(args.file),
        "format": kind,
        "code_globals": code,
        "tensors": [{**asdict(r), "shape": list(r.shape)} for r in records],
        "totals": {
            "count": len(records),
            "bytes": sum(_stored(r) for r in records),
            "by_device": _totals_by(records, "device"),
            "by_dtype": _totals_by(records, "dtype"),
        },
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    from rich.console import Console  # rich is imported only to render

    _render(Console(emoji=False), f"{args.file} ({kind}, {len(records)} tensors)", records, code)
    return 0


def _render(console: Any, title: str, records: list[TensorRecord], code: list[str]) -> None:
    """Print ``inspect``'s tables on a rich ``console``. No cell is ever cut: into a pipe or a
    file, a table takes the width it needs; on a terminal too narrow for it, each row is printed
    as plain lines instead (a tensor's name whole on a line of its own, the rest below)."""
    from rich.markup import escape

    sharded = len({r.file for r in records}) > 1
    notes = [_note(r) for r in records]
    headers = ["name", *(["file"] if sharded else []), "saved device", "dtype", "shape", "bytes"]
    headers += ["note"] if any(notes) else []
    rows = []
    for r, note in zip(records, notes, strict=True):
        shape = "[" + ", ".join(map(str, r.shape)) + "]"
        cells = [r.name, *([r.file] if sharded else []), r.device, r.dtype, shape]
        rows.append([*cells, format_bytes(r.nbytes), *([note] if any(notes) else [])])
    totals = []
    for key in ("device", "dtype"):
        for value, entry in _totals_by(records, key).items():
            totals.append([key, value, str(entry["count"]), format_bytes(entry["bytes"])])
    total = sum(_stored(r) for r in records)
    totals.append(["all", "", str(len(records)), format_bytes(total)])

    if code:
        console.print(
            f"[bold red]Warning:[/bold red] loading this file would import and call "
            f"{escape(_printable(', '.join(code)))}; torchplace.load refuses it unless "
            "trusted=True"
        )
    _print_rows(console, title, headers, rows, right=("bytes",))
    _print_rows(
        console, "totals", ["by", "", "tensors", "bytes"], totals, right=("tensors", "bytes")
    )
    if any(r.device == "-" for r in records):
        console.print("safetensors files store no device: tensors load wherever they are asked to")
    if any(r.shares is None and r.stored > r.nbytes for r in records):
        console.print(
            "a tensor saved as a view stores its whole storage; save view.clone() to keep "
            "only its own bytes"
        )


def _print_rows(
    console: Any, title: str, headers: list[str], rows: list[list[str]], right: tuple[str, ...]
) -> None:
    """One table, printed whole: see ``_render``."""
    from rich.cells import cell_len
    from rich.table import Table
    from rich.text import Text

    # Cells come from the file, which may be anyone's: shown as plain text, never as markup.
    table = Table(title=Text(_printable(title)))
    for col in headers:
        table.add_column(col, justify="right" if col in right else "left", no_wrap=True)
    for row in rows:
        table.add_row(*(Text(_printable(c)) for c in row))
    # The width the table takes with no cell wrapped (squeezing it is what cut names short):
    # each column's widest cell and a space either side, and a border between and around them.
    widths = [
        max(cell_len(_printable(c)) for c in column) for column in zip(headers, *rows, strict=True)
    ]
    needed = sum(widths) + 3 * len(widths) + 1
    if needed <= console.width or not console.is_terminal:  # a pipe or a file: no width to keep
        console.width = max(needed, console.width)
        console.print(table)
        return
    console.print(Text(_printable(title), style="italic"), soft_wrap=True)
    for head, *rest in rows:  # the first cell whole on a line of its own, the rest indented
        details = "  ".join(
            f"{h}: {c}" if h else c for h, c in zip(headers[1:], rest, strict=True) if c
        )
        console.print(Text(_printable(head), style="bold"), soft_wrap=True)
        console.print(Text("    " + _printable(details)), soft_wrap=True)


# ---------------------------------------------------------------------------------------- remap


def _parse_target(spec: str) -> Any:
    """A device to tag storages with; it need not exist on this machine (no GPU needed)."""
    import torch

    from ._devices import device as resolve

    text = spec.strip().lower()
    if text in ("auto", "best", "gpu"):
        return resolve(text)
    if text.isdecimal():  # accelerator N, as the int N is to torchplace.device
        return resolve(int(text))
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        resolve(text)  # raises DeviceSpecError with a suggestion
        raise DeviceSpecError(f"unknown device {spec!r}") from None
    single = ("cpu", "meta", "mps")  # torch.load restores these tags only without an index
    indexed = ("cuda", "xpu", "hpu", "mtia", torch._C._get_privateuse1_backend_name())
    if dev.type in single:
        if dev.index not in (None, 0):
            raise DeviceSpecError(
                f"--to {spec}: there is one {dev.type} device, and torch.load reads a file "
                f"tagged {dev} nowhere; use --to {dev.type}"
            )
        return torch.device(dev.type)
    if dev.type not in indexed:
        raise DeviceSpecError(
            f"--to {spec}: torch.load cannot restore storages tagged {dev.type}; use one of "
            f"{', '.join(single)} or {', '.join(t + ':N' for t in indexed[:3])}"
        )
    if dev.index is None:
        dev = torch.device(dev.type, 0)
    return dev


class _CountingWriter(io.RawIOBase):
    """A binary file wrapper that reports how many bytes went through it."""

    def __init__(self, raw: IO[bytes], advance: Callable[[int], None]) -> None:
        super().__init__()
        self.raw, self.advance = raw, advance

    def writable(self) -> bool:
        return True

    failure: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            n = self.raw.write(data)
            self.advance(len(memoryview(data)))
        except BaseException as exc:  # torch's C++ writer turns it into a RuntimeError: keep it
            self.failure = exc
            raise
        return n if n is not None else 0

    def flush(self) -> None:
        self.raw.flush()


def _relocating_pickle(location: str) -> types.ModuleType:
    """A pickle module whose Pickler tags every saved storage with ``location``."""
    module = types.ModuleType("torchplace_relocating_pickle")

    class Pickler(pickle._Pickler):  # pure Python: it looks persistent_id up on each object
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            inner = self.persistent_id

            def persistent_id(obj: Any) -> Any:
                pid = inner(obj)
                if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
                    return (*pid[:3], location, *pid[4:])
                return pid

            self.persistent_id = persistent_id  # type: ignore[method-assign]

    module.Pickler = Pickler  # type: ignore[attr-defined]
    return module


@contextlib.contextmanager
def _progress(total: int, label: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=True, console=Console(stderr=True, emoji=False)) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


# Temporary files are named for their output and the process writing them
# (``.model.pt.torchplace-tmp-4242``), so that a remap can tell its own leftovers from a run
# that was killed (its process is gone) and sweep them.
_TMP_MARK = ".torchplace-tmp-"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # it exists, and belongs to someone else
        return True
    return True


def sweep_stale_temporaries(directory: str | os.PathLike[str], /) -> list[Path]:
    """Remove the temporary files that killed ``remap`` runs left in ``directory``; returns
    those it removed. A file is remap's by its name (``.OUT.torchplace-tmp-PID``) and stale
    when no process ``PID`` runs; a live run's files are left alone.

    >>> import tempfile
    >>> from torchplace._checkpoint_cli import sweep_stale_temporaries
    >>> sweep_stale_temporaries(tempfile.mkdtemp())
    []
    """
    if os.name != "posix":  # os.kill(pid, 0) would end the process on Windows: say, don't sweep
        return []
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        pid = entry.name.rpartition(_TMP_MARK)[2].partition("-")[0]
        if not entry.name.startswith(".") or _TMP_MARK not in entry.name or not pid.isdecimal():
            continue
        if int(pid) == os.getpid() or _process_alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


class _PendingOutputs:
    """Files written under temporary names beside their outputs, and renamed into place only
    once every one of them is complete (in the order added: an index after its shards). On any
    failure, every temporary file is removed and no output is touched."""

    def __init__(self) -> None:
        self.files: list[tuple[Path, Path]] = []  # (temporary, output)
        self.made_dirs: list[Path] = []

    def open(self, out: Path) -> tuple[Path, int]:
        """A new temporary file for ``out``: its path and an open descriptor."""
        missing = [d for d in (out.parent, *out.parent.parents) if not d.exists()]
        for d in reversed(missing):  # a shard in a sub-directory of the index's
            d.mkdir()
            self.made_dirs.append(d)
        for n in range(100):
            tmp = out.with_name(f".{out.name}{_TMP_MARK}{os.getpid()}" + (f"-{n}" if n else ""))
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            self.files.append((tmp, out))
            return tmp, fd
        raise FileExistsError(f"{out.parent}: too many temporary files named for {out.name}")

    def commit(self, modes_from: list[Path]) -> None:
        """Rename every file into place, in order. Only a failing rename (the files are on one
        file system, so hardly ever) can leave some renamed: shards, never the index after."""
        for (tmp, out), source in zip(self.files, modes_from, strict=True):
            shutil.copymode(out if out.exists() else source, tmp)  # not O_CREAT's private 0600
        for tmp, out in self.files:
            os.replace(tmp, out)
        self.files = []

    def discard(self) -> None:
        for tmp, _ in self.files:
            tmp.unlink(missing_ok=True)
        for d in reversed(self.made_dirs):
            with contextlib.suppress(OSError):
                d.rmdir()
        self.files, self.made_dirs = [], []


def _read_for_remap(src: Path, kind: str) -> Any:
    """What remap writes for ``src``: its loaded contents, or ``None`` for a safetensors file
    (copied as it is, once its header is checked as ``load`` checks it)."""
    from ._checkpoint import load, safetensors_header

    if kind == "safetensors":
        safetensors_header(src)
        return None
    try:
        return load(src, "cpu")
    except CheckpointError as exc:
        # Refused for the code it would run, or for pickle opcodes the safe loader does not
        # read (a newer protocol), which load's own message already explains.
        found = code_globals(src) if "trusted=True" in str(exc) else []
        if not found:
            raise
        raise CheckpointError(
            f"{src}: would run code when loaded ({', '.join(found)}), "
            "and remap never runs a file's code. If you trust its source, rewrite it yourself: "
            "torch.save(torchplace.load(path, 'cpu', trusted=True), out), then remap out"
        ) from exc


def _write_remapped(
    src: Path, obj: Any, fd: int, target: Any, advance: Callable[[int], None]
) -> None:
    """Write ``obj`` (or, when ``None``, ``src`` as it is) to the open file ``fd``, its storages
    tagged for ``target``, and flush it to disk."""
    with os.fdopen(fd, "wb") as raw:
        writer = _CountingWriter(raw, advance)
        try:
            if obj is None:
                with src.open("rb") as f:
                    shutil.copyfileobj(f, writer, 16 * 1024 * 1024)
            else:
                import torch

                torch.save(
                    obj, cast(IO[bytes], writer), pickle_module=_relocating_pickle(str(target))
                )
        except BaseException as exc:
            # torch's C++ writer turns what the file raised (Ctrl-C, a full disk) into a
            # RuntimeError: raise the original.
            if writer.failure is not None and writer.failure is not exc:
                raise writer.failure from None
            raise
        raw.flush()
        os.fsync(raw.fileno())


def _output_file(dst: Path) -> None:
    """Refuse an output that cannot be a file: a directory, or one in a missing directory."""
    try:
        if dst.is_dir():
            raise CheckpointError(f"{dst}: is a directory; give the output file's name with -o")
        if not dst.parent.is_dir():
            raise CheckpointError(f"{dst}: its directory {dst.parent} does not exist")
    except OSError as exc:
        raise CheckpointError(f"{dst}: cannot be written ({exc.strerror or exc})") from exc


def _index_outputs(src: Path, dst: Path) -> tuple[Path, list[tuple[Path, Path, str]]]:
    """Where remapping the shard index ``src`` to ``dst`` writes: the new index, and each shard
    (source, output, format), laid out beside the new index as the old ones lie beside theirs.
    ``dst`` names the new index, or a directory to write it into under its old name."""
    try:
        if dst.is_dir() or str(dst).endswith(("/", os.sep)):
            dst = dst / src.name
        if not dst.parent.is_dir():
            raise CheckpointError(f"{dst}: its directory {dst.parent} does not exist")
    except OSError as exc:
        raise CheckpointError(f"{dst}: cannot be written ({exc.strerror or exc})") from exc
    root = src.parent.resolve()
    outputs = []
    for _, shard_path, _ in _index_shards(src):
        out = dst.parent / shard_path.relative_to(root)
        outputs.append((shard_path, out, _format_of(shard_path)))
    reading = {src.resolve(), *(shard for shard, _, _ in outputs)}
    for out in [dst, *(out for _, out, _ in outputs)]:
        if out.resolve() in reading:
            raise CheckpointError(
                f"{src}: remapping it to {dst} would write over {out}, which it reads; give "
                "-o a new directory (or an index file in one) for the remapped shards"
            )
    return dst, outputs


def remap(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    /,
    *,
    to: Any,
    progress: bool | None = None,
) -> Path:
    """Rewrite a checkpoint so that ``torch.load`` puts its tensors on ``to``; returns the file
    written (for a shard index, the new index).

    >>> import os, tempfile, torch
    >>> from torchplace._checkpoint_cli import describe_file, remap
    >>> d = tempfile.mkdtemp()
    >>> torch.save({"w": torch.ones(2)}, os.path.join(d, "a.pt"))
    >>> out = remap(os.path.join(d, "a.pt"), os.path.join(d, "b.pt"), to="cuda:1")
    >>> describe_file(out)[0].device
    'cuda:1'

    The file is read without running code. The result is written to a temporary file beside
    ``out`` (``.OUT.torchplace-tmp-PID``) and renamed only when complete: an interrupted or
    failed remap leaves ``out`` as it was, and the next remap into that directory removes what
    a killed one left. A safetensors file stores no device, so it is copied unchanged once its
    header is checked as ``load`` checks it.

    A shard index (``*.index.json``) is remapped whole: every shard it lists is rewritten (or,
    for safetensors, copied) beside the new index, laid out as beside the old one, and the
    index is copied last. ``out`` names the new index, or a directory to write it into under
    its own name; it may not be where the shards are read from. Nothing is renamed into place
    until every shard is written.
    """
    from ._checkpoint import as_path

    src, dst = as_path(path), as_path(out)
    target = _parse_target(to) if isinstance(to, str) else to
    kind = _format_of(src)
    if kind == "index":
        dst, shards = _index_outputs(src, dst)
    else:
        _output_file(dst)
        shards = []
    jobs = [*shards, (src, dst, kind)]  # the index, or the one file, last
    total = sum(job[0].stat().st_size for job in jobs)
    show = (sys.stderr.isatty() and total >= PROGRESS_MIN_BYTES) if progress is None else progress
    for d in {job[1].parent for job in jobs}:
        sweep_stale_temporaries(d)
    pending = _PendingOutputs()
    try:
        with _progress(total, f"remap {src.name}", show) as advance:
            for source, output, fmt in jobs:
                # the index itself is copied as it is: its shards keep their names
                obj = None if fmt == "index" else _read_for_remap(source, fmt)
                try:
                    _, fd = pending.open(output)
                except OSError as exc:
                    raise CheckpointError(
                        f"{output}: cannot be written ({exc.strerror or exc}: no file could be "
                        f"created in {output.parent}); choose another output with -o. Nothing "
                        "was written"
                    ) from exc
                _write_remapped(source, obj, fd, target, advance)
        pending.commit([job[0] for job in jobs])
    except BaseException as exc:
        pending.discard()
        if isinstance(exc, (TorchplaceError, KeyboardInterrupt, SystemExit)):
            raise
        if isinstance(exc, Exception):
            raise CheckpointError(
                f"{src}: could not be rewritten to {dst} ({type(exc).__name__}: {exc}); "
                f"{dst} was not touched"
            ) from exc
        raise
    return dst


def _run_remap(args: argparse.Namespace) -> int:
    try:
        out = remap(args.file, args.output, to=args.to)
    except DeviceSpecError as exc:  # bad usage, not a bad file
        print(f"torchplace remap: error: {exc}", file=sys.stderr)
        return 2
    except TorchplaceError as exc:
        print(f"torchplace remap: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"torchplace remap: interrupted; {args.output} was not written", file=sys.stderr)
        return 130
    kind = _format_of(Path(args.file))
    if kind == "safetensors":
        print(f"wrote {_printable(out)} (copied unchanged: a safetensors file stores no device)")
    elif kind == "index":
        print(
            f"wrote {_printable(out)} and its shards beside it (tensors load on "
            f"{_parse_target(args.to)}; safetensors shards are copied unchanged)"
        )
    else:
        print(f"wrote {_printable(out)} (tensors load on {_parse_target(args.to)})")
    return 0


def register(subparsers: Any) -> None:
    """Add ``inspect`` and ``remap`` to the ``torchplace`` command line.

    >>> import argparse
    >>> from torchplace._checkpoint_cli import register
    >>> parser = argparse.ArgumentParser(prog="torchplace")
    >>> register(parser.add_subparsers())
    >>> parser.parse_args(["remap", "a.pt", "--to", "cpu", "-o", "b.pt"]).output
    'b.pt'
    """
    inspect = subparsers.add_parser(
        "inspect",
        help="list a checkpoint's tensors by saved device, dtype and size (runs no code)",
        description="List every tensor of a checkpoint with its saved device, dtype, shape and "
        "bytes, and totals per device and dtype. Pickled code is never run and no GPU is needed.",
    )
    inspect.add_argument(
        "file", metavar="FILE", help="a torch.save file, a .safetensors file or an *.index.json"
    )
    inspect.add_argument("--json", action="store_true", help="print JSON instead of tables")
    inspect.set_defaults(func=_run_inspect)

    remap_cmd = subparsers.add_parser(
        "remap",
        help="rewrite a checkpoint (or every shard of one) to load elsewhere",
        description="Rewrite a checkpoint so that torch.load puts its tensors on DEVICE. For a "
        "shard index (*.index.json), every shard it lists is rewritten beside the new index, "
        "laid out as beside the old one (safetensors shards are copied: they store no device), "
        "and the index is copied last. Output is written to temporary files named "
        ".NAME.torchplace-tmp-PID and renamed only when all are complete, so a failure leaves "
        "no partial output; those a killed run left are removed by the next remap into the "
        "same directory.",
    )
    remap_cmd.add_argument(
        "file", metavar="FILE", help="the checkpoint to read: a file or an *.index.json"
    )
    remap_cmd.add_argument("--to", required=True, metavar="DEVICE", help="e.g. cpu or cuda:0")
    remap_cmd.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT",
        help="file to write; for an index, the new index file, or a directory to write it "
        "into under its own name (not the directory its shards are read from)",
    )
    remap_cmd.set_defaults(func=_run_remap)
