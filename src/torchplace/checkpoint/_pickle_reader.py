"""Reading a checkpoint file's table of tensors without running its code or importing torch.

A torch file's pickle is read by an unpickler that builds inert records for every global it
meets, so a malicious file is described, never executed (``RecordingUnpickler`` notes what it
would run); a legacy file's storages are checked as ``torch.load`` reads them; safetensors files by
their header (``_safetensors``), shard indexes by their weight map (``_index``). ``_catalog``
builds its entries from what these find, for ``inspect``, ``load`` and the sharded loader alike.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import functools
import io
import os
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar, cast

from .._errors import CheckpointError
from ._index import LEGACY_MAGIC
from ._opened import opened, unopenable
from ._source import WRITER_HINT

__all__ = [
    "MAX_PICKLE_OBJECTS",
    "WHOLE_MODEL",
    "InertUnpickler",
    "PickleTooLarge",
    "RecordingUnpickler",
    "TensorRecord",
    "TensorRef",
    "cut_short",
    "legacy_code",
    "legacy_records",
    "pickles_a_model",
    "plain_values",
    "readable",
    "rebuild_tensor",
    "shape_of",
    "tensor_refs",
    "too_large",
    "within_bound",
]


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
class TensorRef:
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


def shape_of(size: Any) -> tuple[int, ...]:
    if isinstance(size, _Opaque):  # torch.Size saved as an object
        size = size.args[0] if size.args else ()
    if not isinstance(size, (tuple, list)):
        return ()
    return tuple(int(n) if isinstance(n, int) else -1 for n in size)


def rebuild_tensor(storage: Any, offset: Any, size: Any, *rest: Any) -> TensorRef:
    dtype = storage.dtype if isinstance(storage, _StorageRef) else "?"
    # _rebuild_tensor_v3 passes the dtype explicitly (for untyped storages)
    if len(rest) >= 4 and isinstance(rest[3], _DType):
        dtype = rest[3].name
    ref = storage if isinstance(storage, _StorageRef) else None
    return TensorRef(ref, dtype, shape_of(size))


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data


def _rebuild_meta(dtype: Any, size: Any, *rest: Any) -> TensorRef:
    name = dtype.name if isinstance(dtype, _DType) else "?"
    return TensorRef(_StorageRef(name, "", "meta", 0), name, shape_of(size))


@dataclass
class _WithParts:
    """A tensor that the file saves with tensors of its own (a per-channel quantized tensor's
    scales and zero points), listed as ``name`` and ``name.part``."""

    main: TensorRef
    parts: dict[str, Any]


def _rebuild_qtensor(
    storage: Any, offset: Any, size: Any, stride: Any = None, qparams: Any = (), *rest: Any
) -> TensorRef | _WithParts:
    ref = rebuild_tensor(storage, offset, size)
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


# The most objects a pickle may place in containers (members of lists and sets, keys and
# values of dicts, members of tuples longer than a tensor's arguments) before its reading stops
# with ``PickleTooLarge``. A state dict costs 2 a tensor (its name and itself), so 1,000,000
# reads 500,000 tensors, while a pickle of 20 million integers, which took 42 s and 3.8 GB to
# read whole, stops a twentieth of the way in. TORCHPLACE_MAX_PICKLE_OBJECTS sets another bound.
MAX_PICKLE_OBJECTS = 1_000_000
_MAX_OBJECTS_VARIABLE = "TORCHPLACE_MAX_PICKLE_OBJECTS"


class PickleTooLarge(Exception):
    """A pickle placed more objects in containers than the bound; ``readable`` names its file."""

    def __init__(self, count: int, bound: int) -> None:
        super().__init__(count, bound)
        self.count, self.bound = count, bound


def _max_objects() -> int:
    """The bound on a pickle's objects: ``TORCHPLACE_MAX_PICKLE_OBJECTS``, else the default."""
    text = os.environ.get(_MAX_OBJECTS_VARIABLE, "").strip()
    if not text:
        return MAX_PICKLE_OBJECTS
    if not text.isdecimal():
        raise CheckpointError(
            f"{_MAX_OBJECTS_VARIABLE}={text!r} is not a number of objects; set it to a whole "
            f"number such as {MAX_PICKLE_OBJECTS * 4}, or unset it for {MAX_PICKLE_OBJECTS}"
        )
    return int(text)


def _counting(op: bytes, items: Callable[[Any], int]) -> Callable[[Any], None]:
    """The pure-Python unpickler's handler of ``op``, counting the objects it places first."""
    handler = pickle._Unpickler.dispatch[op[0]]

    def load(self: Any) -> None:
        self.objects += items(self)
        if self.objects > self.max_objects:
            raise PickleTooLarge(self.objects, self.max_objects)
        handler(self)

    return load


def _marked(self: Any) -> int:
    return len(self.stack)  # the objects pushed since the last MARK


def _long_tuple(self: Any) -> int:
    """The members of a tuple built at once, if more than a tensor's arguments (at most 7)."""
    return len(self.stack) if len(self.stack) > 8 else 0


_COUNTED = {
    pickle.APPEND[0]: _counting(pickle.APPEND, lambda self: 1),
    pickle.APPENDS[0]: _counting(pickle.APPENDS, _marked),
    pickle.SETITEM[0]: _counting(pickle.SETITEM, lambda self: 2),
    pickle.SETITEMS[0]: _counting(pickle.SETITEMS, _marked),
    pickle.ADDITEMS[0]: _counting(pickle.ADDITEMS, _marked),
    pickle.TUPLE[0]: _counting(pickle.TUPLE, _long_tuple),
}


class InertUnpickler(pickle._Unpickler):  # pure Python: corrupt lengths fail cleanly
    """An unpickler whose every global is an inert stand-in: nothing in the file can run, and
    a pickle of more objects than ``MAX_PICKLE_OBJECTS`` stops with ``PickleTooLarge``."""

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = {
        **pickle._Unpickler.dispatch,
        **_COUNTED,
    }

    _TORCH_REBUILDERS: Mapping[str, Callable[..., Any]] = {
        "rebuild_tensor": rebuild_tensor,
        "_rebuild_tensor_v2": rebuild_tensor,
        "_rebuild_tensor_v3": rebuild_tensor,
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
        self.objects, self.max_objects = 0, _max_objects()

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
        if (
            isinstance(pid, tuple)
            and len(pid) >= 2
            and pid[0] == "module"
            and isinstance(pid[1], type)
        ):
            return pid[1]  # a legacy file's module class (saved with its source): its stand-in
        return _Opaque(pid)


@functools.cache
def _default_loadable_globals() -> frozenset[str]:
    """The globals the installed torch's weights-only loader accepts by default (a list that
    changes between releases: 2.15 no longer accepts nested tensors)."""
    from torch import _weights_only_unpickler as safe

    allowed = getattr(safe, "_get_allowed_globals", None)
    return frozenset(allowed()) if callable(allowed) else frozenset()


def _loadable_globals() -> frozenset[str]:
    """The globals torch's weights-only loader accepts, which ``torchplace.load`` reads safely
    (sparse, quantized and nested tensors need some beyond the rebuilders stood in for here):
    its defaults, and those ``torch.serialization.add_safe_globals`` allows at this moment."""
    from torch import _weights_only_unpickler as safe

    users = getattr(safe, "_get_user_allowed_globals", None)
    return _default_loadable_globals() | (frozenset(users()) if callable(users) else frozenset())


class RecordingUnpickler(InertUnpickler):
    """The inert unpickler, noting every global it stood in for that a safe load would refuse
    (what loading would run)."""

    def __init__(self, f: Any) -> None:
        super().__init__(f)
        self.found: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        full = _stand_in_for(found)
        if full is None and module == "torch._utils":  # a rebuilder read here, not stood in for
            full = f"{module}.{name}"  # which the installed torch may still refuse (2.15: nested)
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
        **InertUnpickler.dispatch,
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


def pickles_a_model(found: list[str]) -> bool:
    """Whether a file's code globals (``Catalog.code``) show a whole model saved with
    ``torch.save(model)``: its modules are pickled as the classes they are."""
    return any(name.startswith("torch.nn.modules.") for name in found)


WHOLE_MODEL = (
    "holds a whole model saved with torch.save(model), whose classes loading would import "
    "and run. Nothing was run. If you trust where the file came from, its weights are "
    "torchplace.load({path}, trusted=True).state_dict(), run where the model's class can be "
    "imported (as for torch.load)"
)


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


def tensor_refs(root: Any) -> Iterator[tuple[str, TensorRef]]:
    """Every tensor reference under ``root`` in order, with its dotted path; each container is
    visited once: a pickle that shares one object across many branches (or holds itself) cannot
    make the walk run for ever, and a stack instead of recursion reads any depth that
    ``torch.load`` reads."""
    seen: set[int] = set()
    stack: list[tuple[_Path, Any]] = [(None, root)]
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, TensorRef):
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
            if isinstance(obj, dict):  # only what may hold a tensor: a list of a million
                # numbers is walked without a path made for each
                children = [((path, k), v) for k, v in obj.items() if isinstance(v, _WALKED)]
            elif isinstance(obj, (list, tuple)):
                children = [((path, i), v) for i, v in enumerate(obj) if isinstance(v, _WALKED)]
            else:
                children = _module_children(path, obj.state) or [
                    (path, part) for part in (obj.args, obj.state, obj.items, obj.values)
                ]
        stack.extend(reversed(children))


def plain_values(root: Any) -> list[tuple[str, str]]:
    """The values under ``root`` that are neither tensors nor hold any (``epoch``, an
    optimizer's ``param_groups``), each with its dotted path and type name, in order: what a
    copy of the file's tensors leaves out. Objects a pickle would build by running code are
    not listed (their code is: ``Catalog.code``)."""
    out: list[tuple[str, str]] = []
    seen: set[int] = set()
    stack: list[tuple[_Path, Any]] = [(None, root)]
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, (TensorRef, _WithParts, _Opaque)) or id(obj) in seen:
            continue
        if not isinstance(obj, (dict, list, tuple)) or not _holds_tensor(obj):
            out.append((_spell(path) or "<root>", type(obj).__name__))
            continue
        seen.add(id(obj))
        pairs = obj.items() if isinstance(obj, dict) else enumerate(obj)
        stack.extend(reversed([((path, k), v) for k, v in pairs]))
    return out


def _holds_tensor(obj: Any) -> bool:
    return any(True for _ in tensor_refs(obj))


_MODULE_PARTS = ("_parameters", "_buffers", "_modules")
_WALKED = (TensorRef, _WithParts, dict, list, tuple, _Opaque)  # what tensor_refs looks into


def _module_children(path: _Path, state: Any) -> list[tuple[_Path, Any]] | None:
    """The parts of a pickled ``nn.Module`` (a whole model saved with ``torch.save(model)``),
    named as its ``state_dict`` names them: ``0.weight``, not ``_modules.0._parameters.weight``.
    Its other attributes keep their own names. None when ``state`` is not a module's."""
    if not isinstance(state, dict) or not all(
        isinstance(state.get(part), dict) for part in ("_parameters", "_modules")
    ):
        return None
    children: list[tuple[_Path, Any]] = []
    for part in _MODULE_PARTS:
        held = state.get(part)
        if isinstance(held, dict):
            children += [((path, key), value) for key, value in held.items()]
    children += [((path, k), v) for k, v in state.items() if k not in _MODULE_PARTS]
    return children


def _records(root: Any, file: str, owners: dict[str, str] | None = None) -> list[TensorRecord]:
    """The tensors under an unpickled ``root``; ``owners`` is filled with the first tensor saved
    on each storage, by the storage's key."""
    out = []
    owners = {} if owners is None else owners
    for name, ref in tensor_refs(root):
        name = name or "<root>"
        numel = 1
        for n in ref.shape:
            numel *= max(n, 0)
        itemsize = _dtype_info(ref.dtype)[1] if ref.dtype != "?" else 1
        storage = ref.storage
        device = storage.location if storage is not None else "?"
        # A meta tensor saved as such has no storage record and no bytes; a file remapped to
        # meta keeps every storage's bytes under a meta tag, and they count.
        no_data = storage is not None and device == "meta" and not storage.key
        nbytes = 0 if no_data else numel * itemsize
        stored, shares = nbytes, None
        if storage is not None and not no_data:
            if storage.numel >= 0:
                stored = storage.numel * storage.itemsize
            shares = owners.setdefault(storage.key, name)
            if shares == name:
                shares = None
        out.append(TensorRecord(name, device, ref.dtype, ref.shape, nbytes, file, stored, shares))
    return out


@contextlib.contextmanager
def readable(p: Path) -> Iterator[None]:
    """Any failure while reading ``p`` becomes a CheckpointError saying the file is damaged."""
    try:
        yield
    except CheckpointError:
        raise
    except PickleTooLarge as exc:
        raise too_large(p, exc) from None
    except OSError as exc:  # it cannot be opened or read: said as such, not as damage
        raise unopenable(p, exc) from exc
    except Exception as exc:
        if isinstance(exc, zipfile.BadZipFile) and "not a zip file" in str(exc):
            raise cut_short(p) from exc
        raise CheckpointError(
            f"{p}: is truncated or corrupt ({type(exc).__name__}: {exc}); {WRITER_HINT}, or "
            "save or fetch it again",
            path=p,
        ) from exc


def too_large(p: Path, exc: PickleTooLarge, *, trusted: bool = False) -> CheckpointError:
    """The error for ``p``, whose pickle placed more objects than the bound (``exc``);
    ``trusted``: a trusted load would read it (``load``'s and ``load_into``'s read of a file,
    not ``inspect``'s), so the error says how."""
    anyway = (
        f"set {_MAX_OBJECTS_VARIABLE} to a larger bound to read it anyway, or, for a file you "
        f"made yourself or got from a source you trust, read it with torchplace.load({str(p)!r}"
        ", trusted=True) (torch.load reads it as it is; load_into takes the state dict it "
        "returns)"
        if trusted
        else f"set {_MAX_OBJECTS_VARIABLE} to a larger bound to read it anyway"
    )
    return CheckpointError(
        f"{p}: its pickle holds more than {exc.bound:,} objects besides tensors' own (lists, "
        f"dicts, tuples and their members; reading stopped at {exc.count:,}), more than a "
        f"checkpoint's table of tensors needs; nothing was run. If it is the file you meant, "
        f"{anyway} (its objects take memory and time in proportion)",
        path=p,
    )


def within_bound(p: Path, data: bytes | None = None, *, zip_format: bool = True) -> None:
    """Refuse ``p`` (``too_large``'s ``CheckpointError``, naming ``trusted=True``) where its
    pickle places more objects than the bound, before a reader without one (torch's, which
    ``load`` and ``load_into`` read a torch file with) builds
    them all: counted by the inert unpickler, which stops at the bound as ``inspect``'s does
    (the two refuse the same files). ``data``: a zip file's pickle record, where it is at hand;
    a legacy file's (``zip_format=False``) pickles are read from the file.

    A pickle of no more bytes than the bound cannot pass it (each object it places was pushed
    by an instruction of a byte at least), so a zip file's pickle record of fewer than about
    9,000 tensors is not read twice; a legacy file's pickles are not sized apart from its
    data, so one of more bytes than the bound has them read twice (they are its small part).
    A pickle the count cannot read is left to the reader that follows, which says what is
    wrong with it.
    """
    bound = _max_objects()
    try:
        if zip_format:
            data = _zip_pickle(p, bound) if data is None else data
            if data is None or len(data) <= bound:
                return
            InertUnpickler(io.BytesIO(data)).load()
            return
        size = os.stat(p).st_size
        if size <= bound:
            return
        with opened(p) as raw:
            f = _BoundedReader(raw, size)
            for _ in range(4):  # magic number, protocol, system info, the object
                InertUnpickler(f).load()
    except PickleTooLarge as exc:
        raise too_large(p, exc, trusted=True) from None
    except CheckpointError:
        raise
    except Exception:  # damaged: the read that follows says how
        return


def _zip_pickle(p: Path, bound: int) -> bytes | None:
    """The pickle record of the torch zip file ``p`` (its top ``data.pkl``), where it holds one
    of more than ``bound`` bytes; else None."""
    with opened(p) as f, zipfile.ZipFile(f) as archive:
        pickles = [i for i in archive.infolist() if i.filename.endswith("data.pkl")]
        if not pickles:
            return None
        info = min(pickles, key=lambda i: len(i.filename))
        return archive.read(info) if info.file_size > bound else None


def cut_short(p: Path) -> CheckpointError:
    """The error for a torch zip file without its central directory: cut short, or still being
    written (the catalog and the readers say it alike)."""
    return CheckpointError(
        f"{p}: is truncated (its zip central directory is missing); {WRITER_HINT}, or its "
        "save was interrupted (save it again)",
        path=p,
    )


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


def legacy_code(p: Path) -> list[str]:
    """The globals a legacy torch file's pickles name that a safe load refuses, read alone
    (its storages unchecked)."""
    found: list[str] = []
    with opened(p) as raw:
        f = _BoundedReader(raw, p.stat().st_size)
        for _ in range(4):  # magic number, protocol, system info, the object
            recorder = RecordingUnpickler(f)
            recorder.load()
            found += recorder.found
    return found


def legacy_records(p: Path) -> tuple[list[TensorRecord], list[str]]:
    """The tensors of a legacy (non-zip) torch file, its storages checked as torch reads them,
    and the globals its pickles name that a safe load refuses (what loading would run)."""
    code: list[str] = []

    def load(f: _BoundedReader) -> Any:
        recorder = RecordingUnpickler(f)
        try:
            return recorder.load()
        finally:
            code.extend(recorder.found)

    with readable(p), opened(p) as raw:
        f = _BoundedReader(raw, p.stat().st_size)
        magic = load(f)
        if magic != LEGACY_MAGIC:
            raise CheckpointError(
                f"{p}: is a pickle but not a torch.save file (wrong magic number); a plain "
                "pickle is not a checkpoint",
                path=p,
            )
        load(f)  # protocol version
        load(f)  # system info
        unpickler = RecordingUnpickler(f)
        owners: dict[str, str] = {}  # storage key -> the first tensor saved on it
        records = _records(unpickler.load(), p.name, owners)
        code.extend(unpickler.found)
        _check_legacy_storages(p, f, unpickler.storages, owners)
    return records, list(dict.fromkeys(code))


def _check_legacy_storages(
    p: Path, f: _BoundedReader, storages: dict[str, _StorageRef], owners: dict[str, str]
) -> None:
    """Check that the storages after a legacy file's pickles are all there, as ``torch.load``
    does: a list of storage keys, then for each an element count and the elements. A file cut
    short in its data (the commonest damage: an interrupted save or copy) is refused here, as
    ``load`` refuses it, instead of being described as whole."""
    keys = InertUnpickler(f).load()
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CheckpointError(
            f"{p}: is corrupt: its list of storages is not a list of keys", path=p
        )
    end = p.stat().st_size
    cut_short = "the save or copy was cut short, so save or fetch the file again"
    for key in keys:
        ref = storages.get(key)
        if ref is None:
            raise CheckpointError(
                f"{p}: is corrupt: it lists data for storage {key}, which no tensor uses", path=p
            )
        tensor = owners.get(key, f"storage {key}")
        head = f.f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{p}: is truncated before the data of {tensor}; {cut_short}", path=p
            )
        numel = int.from_bytes(head, "little", signed=True)
        if numel < 0 or (ref.numel >= 0 and numel != ref.numel):
            raise CheckpointError(
                f"{p}: is corrupt: the data of {tensor} holds {numel} elements, where the "
                f"tensor's record says {ref.numel}",
                path=p,
            )
        wanted, left = numel * ref.itemsize, end - f.f.tell()
        if wanted > left:
            raise CheckpointError(
                f"{p}: is truncated: the data of {tensor} takes {wanted} bytes, and the file "
                f"ends {left} bytes later; {cut_short}",
                path=p,
            )
        f.f.seek(wanted, os.SEEK_CUR)
