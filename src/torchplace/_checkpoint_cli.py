"""``torchplace inspect`` and ``torchplace remap``: look at and rewrite checkpoint files.

``inspect`` reads a file's tensor table without running any of its pickled code and without a
GPU: torch files are read by an unpickler that builds inert records for every global it meets
(so a malicious file is described, never executed), safetensors files by their JSON header.

``remap`` rewrites a torch file so that a plain ``torch.load`` puts its tensors on another
device. It reads the file safely (``weights_only=True``, memory-mapped), writes a temporary file
beside the output with every storage tagged for the new device, and renames it into place only
when complete, so an interrupted run leaves no partial output.
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
import tempfile
import types
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, cast

from ._errors import CheckpointError, DeviceSpecError, TorchplaceError
from ._inspect import format_bytes

__all__ = ["TensorRecord", "describe", "register", "remap"]

# Progress is shown for files at least this large (when the output is a terminal).
PROGRESS_MIN_BYTES = 16 * 1024 * 1024
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


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
                return _StorageRef(
                    storage_type.dtype, str(key), str(location), storage_type.itemsize, numel
                )
            return _StorageRef("?", str(key), str(location), 1, numel)
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
        if isinstance(found, type) and issubclass(found, _Opaque):
            # Protocol 2 pickles name Python 2 modules (__builtin__): say what Python 3 runs.
            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            full = f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"
            if full not in _loadable_globals():
                self.found.append(full)
        return found


def code_globals(path: str | os.PathLike[str], /) -> list[str]:
    """The globals a torch file's pickle names beyond tensors and containers, read inertly.

    Loading the file with ``trusted=True`` would import and call these; ``inspect`` lists them.
    Safetensors files hold none; a shard index, those of its shards.
    """
    from ._checkpoint import detect_format

    p = Path(path)
    kind = detect_format(p)
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


def _walk(obj: Any, path: str) -> Iterator[tuple[str, _TensorRef]]:
    """Every tensor reference under ``obj`` in order, each container visited once: a pickle
    that shares one object across many branches (or holds itself) cannot make the walk run for
    ever, and a stack instead of recursion reads any depth that ``torch.load`` reads."""
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [(path, obj)]

    def under(path: str, key: Any) -> str:
        return f"{path}.{key}" if path else str(key)

    while stack:
        path, obj = stack.pop()
        if isinstance(obj, _TensorRef):
            yield path, obj
            continue
        children: list[tuple[str, Any]]
        if isinstance(obj, _WithParts):
            yield path, obj.main
            children = [(under(path, k), v) for k, v in obj.parts.items()]
        elif not isinstance(obj, (dict, list, tuple, _Opaque)) or id(obj) in seen:
            continue
        else:
            seen.add(id(obj))
            if isinstance(obj, dict):
                children = [(under(path, k), v) for k, v in obj.items()]
            elif isinstance(obj, (list, tuple)):
                children = [(under(path, i), v) for i, v in enumerate(obj)]
            else:
                children = [(path, part) for part in (obj.args, obj.state, obj.items, obj.values)]
        stack.extend(reversed(children))


def _records(root: Any, file: str) -> list[TensorRecord]:
    out = []
    owners: dict[str, str] = {}  # storage key -> the first tensor saved on it
    for name, ref in _walk(root, ""):
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
        if magic != _LEGACY_MAGIC:
            raise CheckpointError(
                f"{p}: is a pickle but not a torch.save file (wrong magic number); a plain "
                "pickle is not a checkpoint"
            )
        _InertUnpickler(f).load()  # protocol version
        _InertUnpickler(f).load()  # system info
        root = _InertUnpickler(f).load()
    return _records(root, p.name)


def _describe_safetensors(p: Path) -> list[TensorRecord]:
    from ._checkpoint import SAFETENSORS_DTYPES, safetensors_header

    out = []
    for name, entry in safetensors_header(p).items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        dtype = str(SAFETENSORS_DTYPES[entry["dtype"]]).removeprefix("torch.")
        # safetensors stores no device: the reader chooses one
        nbytes = end - start
        out.append(TensorRecord(name, "-", dtype, tuple(entry["shape"]), nbytes, p.name, nbytes))
    return out


def describe(path: str | os.PathLike[str], /) -> list[TensorRecord]:
    """Every tensor a checkpoint file holds, read without running its code or needing a GPU.

    >>> import os, tempfile, torch
    >>> from torchplace._checkpoint_cli import describe
    >>> path = os.path.join(tempfile.mkdtemp(), "w.pt")
    >>> torch.save({"w": torch.ones(2, 3)}, path)
    >>> w = describe(path)[0]
    >>> w.name, w.device, w.dtype, w.shape, w.nbytes, w.shares
    ('w', 'cpu', 'float32', (2, 3), 24, None)
    """
    from ._checkpoint import detect_format

    p = Path(path)
    kind = detect_format(p)
    if kind == "zip":
        return _describe_zip(p)
    if kind == "legacy":
        return _describe_legacy(p)
    if kind == "safetensors":
        return _describe_safetensors(p)
    return _describe_index(p)


def _index_shards(p: Path) -> list[tuple[str, Path, list[str]]]:
    """The shards a shard index lists: (name in the index, path, tensor names) each."""
    try:
        index = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{p}: is not a readable JSON shard index ({exc})") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            f"{p}: is JSON but not a shard index; a sharded checkpoint's index maps every tensor "
            'name to its file under "weight_map"'
        )
    from ._checkpoint import shards

    return shards(p, weight_map)


def _describe_index(p: Path) -> list[TensorRecord]:
    out: list[TensorRecord] = []
    for shard, shard_path, names in _index_shards(p):
        records = describe(shard_path)
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


def _totals(records: list[TensorRecord], key: str) -> dict[str, dict[str, int]]:
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


def _inspect(args: argparse.Namespace) -> int:
    try:
        records = describe(args.file)
        from ._checkpoint import detect_format

        kind = detect_format(args.file)
        code = code_globals(args.file)
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
            "by_device": _totals(records, "device"),
            "by_dtype": _totals(records, "dtype"),
        },
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    # Names come from the file, which may be anyone's: shown as plain text, never as markup.
    sharded = len({r.file for r in records}) > 1
    table = Table(title=Text(_printable(f"{args.file} ({kind}, {len(records)} tensors)")))
    table.add_column("name")
    if sharded:
        table.add_column("file")
    for col in ("saved device", "dtype", "shape", "bytes"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    notes = [_note(r) for r in records]
    if any(notes):
        table.add_column("note")
    for r, note in zip(records, notes, strict=True):
        shape = "[" + ", ".join(map(str, r.shape)) + "]"
        cells = [r.name, *([r.file] if sharded else []), r.device, r.dtype, shape]
        extra = [note] if any(notes) else []
        table.add_row(*(Text(_printable(c)) for c in [*cells, format_bytes(r.nbytes), *extra]))
    totals = Table(title="totals")
    for col in ("by", "", "tensors", "bytes"):
        totals.add_column(col, justify="right" if col in ("tensors", "bytes") else "left")
    for key, label in (("device", "device"), ("dtype", "dtype")):
        for value, entry in _totals(records, key).items():
            totals.add_row(
                label, Text(_printable(value)), str(entry["count"]), format_bytes(entry["bytes"])
            )
    total = sum(_stored(r) for r in records)
    totals.add_row("all", "", str(len(records)), format_bytes(total))
    console = Console(emoji=False)
    if code:
        console.print(
            f"[bold red]Warning:[/bold red] loading this file would import and call "
            f"{escape(_printable(', '.join(code)))}; torchplace.load refuses it unless "
            "trusted=True"
        )
    console.print(table)
    console.print(totals)
    if any(r.device == "-" for r in records):
        console.print("safetensors files store no device: tensors load wherever they are asked to")
    if any(r.shares is None and r.stored > r.nbytes for r in records):
        console.print(
            "a tensor saved as a view stores its whole storage; save view.clone() to keep "
            "only its own bytes"
        )
    return 0


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


def remap(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    /,
    *,
    to: Any,
    progress: bool | None = None,
) -> Path:
    """Rewrite a checkpoint so that ``torch.load`` puts its tensors on ``to``; returns ``out``.

    >>> import os, tempfile, torch
    >>> from torchplace._checkpoint_cli import describe, remap
    >>> d = tempfile.mkdtemp()
    >>> torch.save({"w": torch.ones(2)}, os.path.join(d, "a.pt"))
    >>> out = remap(os.path.join(d, "a.pt"), os.path.join(d, "b.pt"), to="cuda:1")
    >>> describe(out)[0].device
    'cuda:1'

    The file is read without running code. The result is written to a temporary file beside
    ``out`` and renamed only when complete: an interrupted or failed remap leaves ``out`` as it
    was. A safetensors file stores no device, so it is copied unchanged.
    """
    from ._checkpoint import as_path, detect_format, load, safetensors_header

    src, dst = as_path(path), as_path(out)
    target = _parse_target(to) if isinstance(to, str) else to
    kind = detect_format(src)
    if kind == "index":
        raise CheckpointError(
            f"{src}: is a shard index; remap rewrites one file, so remap each shard it lists "
            "(safetensors shards need no remap: they store no device)"
        )
    try:
        if dst.is_dir():
            raise CheckpointError(f"{dst}: is a directory; give the output file's name with -o")
        if not dst.parent.is_dir():
            raise CheckpointError(f"{dst}: its directory {dst.parent} does not exist")
    except OSError as exc:
        raise CheckpointError(f"{dst}: cannot be written ({exc.strerror or exc})") from exc
    total = src.stat().st_size
    show = (sys.stderr.isatty() and total >= PROGRESS_MIN_BYTES) if progress is None else progress
    try:
        # A safetensors file is copied as it is, once its header shows it whole.
        obj = safetensors_header(src) if kind == "safetensors" else load(src, "cpu")
    except CheckpointError as exc:
        # Refused for the code it would run, or for pickle opcodes the safe loader does not
        # read (a newer protocol), which load's own message already explains.
        found = code_globals(src) if "trusted=True" in str(exc) else []
        if not found:
            raise
        calls = ", ".join(found)
        raise CheckpointError(
            f"{src}: would run code when loaded ({calls}), "
            "and remap never runs a file's code. If you trust its source, rewrite it yourself: "
            "torch.save(torchplace.load(path, 'cpu', trusted=True), out), then remap out"
        ) from exc
    try:
        fd, tmp_name = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    except OSError as exc:
        raise CheckpointError(
            f"{dst}: cannot be written ({exc.strerror or exc}: no file could be created in "
            f"{dst.parent}); choose another output with -o. Nothing was written"
        ) from exc
    tmp = Path(tmp_name)
    writer: _CountingWriter | None = None
    try:
        with os.fdopen(fd, "wb") as raw, _progress(total, f"remap {src.name}", show) as advance:
            writer = _CountingWriter(raw, advance)
            if kind == "safetensors":
                with src.open("rb") as f:
                    shutil.copyfileobj(f, writer, 16 * 1024 * 1024)
            else:
                import torch

                torch.save(
                    obj, cast(IO[bytes], writer), pickle_module=_relocating_pickle(str(target))
                )
            raw.flush()
            os.fsync(raw.fileno())
        shutil.copymode(dst if dst.exists() else src, tmp)  # not mkstemp's private 0600
        os.replace(tmp, dst)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if writer is not None and writer.failure is not None and writer.failure is not exc:
            if not isinstance(writer.failure, Exception):  # Ctrl-C while torch was writing
                raise writer.failure from None
            exc = writer.failure
        if isinstance(exc, (TorchplaceError, KeyboardInterrupt, SystemExit)):
            raise
        if isinstance(exc, Exception):
            raise CheckpointError(
                f"{src}: could not be rewritten to {dst} ({type(exc).__name__}: {exc}); "
                f"{dst} was not touched"
            ) from exc
        raise
    return dst


def _remap(args: argparse.Namespace) -> int:
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
    if str(args.file).endswith(".safetensors") or _is_safetensors(Path(args.file)):
        print(f"wrote {_printable(out)} (copied unchanged: a safetensors file stores no device)")
    else:
        print(f"wrote {_printable(out)} (tensors load on {_parse_target(args.to)})")
    return 0


def _is_safetensors(p: Path) -> bool:
    from ._checkpoint import detect_format

    try:
        return detect_format(p) == "safetensors"
    except TorchplaceError:
        return False


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
    inspect.set_defaults(func=_inspect)

    remap_cmd = subparsers.add_parser(
        "remap",
        help="rewrite a checkpoint so that it loads on another device",
        description="Rewrite a checkpoint so that torch.load puts its tensors on DEVICE. The "
        "output is written to a temporary file and renamed only when complete.",
    )
    remap_cmd.add_argument("file", metavar="FILE", help="the checkpoint to read")
    remap_cmd.add_argument("--to", required=True, metavar="DEVICE", help="e.g. cpu or cuda:0")
    remap_cmd.add_argument("-o", "--output", required=True, metavar="OUT", help="file to write")
    remap_cmd.set_defaults(func=_remap)
