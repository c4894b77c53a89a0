"""Catalogs: a checkpoint source resolved once into a table of entries, before any tensor is read.

The second step of a checkpoint's path through ``checkpoint/`` (after ``_source``, which says
what a path names). ``catalog(source)`` takes a file of any supported kind, a shard index, a
directory as ``save_pretrained`` writes it, or a mapping of tensors, and returns a ``Catalog``:
one ``Entry`` per tensor, with its name, file, first byte, dtype, shape and layout (the order
of its dims in the file), and a ``Stamp`` of every file it parsed. ``load``, ``load_into``
(plain and sharded), ``inspect`` and ``remap`` all start here, so they accept the same sources,
refuse the same files with the same words, and list the same tensors.

As in ``torch.distributed.checkpoint``, the catalog is the *metadata*: what the source holds
and where. A *plan* (which entry, or which box of it, goes where in the model) is the filler's
(``_fill``, ``_sharded``), and the *storage reader* is ``_reader``, which reads an entry's
byte range straight into given memory and checks the file's stamp before and after, so that a
file rewritten while it was read raises instead of mixing old and new tensors.

Nothing here runs a file's code: a torch zip file's pickle is read by the inert unpickler of
``_pickle_reader``, and a ``.safetensors`` catalog imports no torch (``torchplace inspect
FILE.safetensors`` starts at once).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import io
import math
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from .._errors import CheckpointError
from ._entries import Catalog, Entry, Stamp, changed_error, file_entry, stamp
from ._opened import once_per_call, opened
from ._pickle_reader import (
    RecordingUnpickler,
    TensorRecord,
    TensorRef,
    legacy_code,
    legacy_records,
    plain_values,
    readable,
    rebuild_tensor,
    shape_of,
    tensor_refs,
)
from ._safetensors import header_bytes as safetensors_header_bytes
from ._safetensors import read_header as read_safetensors_header
from ._safetensors import read_layout_and_bytes as read_safetensors_layout  # and its rows
from ._safetensors import sniff as sniff_safetensors
from ._source import (
    PathLike,
    as_path,
    detect_format,
    is_dir,
    model_file,
    shards,
)
from ._zip_layout import ZipLayout, has_data_pkl, has_legacy_magic, record_start, zip_layout

__all__ = [
    "Catalog",
    "Entry",
    "Stamp",
    "ZipLayout",
    "catalog",
    "changed_error",
    "code_globals",
    "contiguous_strides",
    "describe_file",
    "format_of",
    "gc_paused",
    "has_data_pkl",
    "has_legacy_magic",
    "left_out_values",
    "record_start",
    "safetensors_header",
    "stamp",
    "zip_layout",
]


# ----------------------------------------------------------------------------------- catalog


def catalog(source: PathLike | Mapping[str, Any], /) -> Catalog:
    """The ``Catalog`` of a path (a file, a shard index, a directory) or a mapping of tensors.

    >>> import os, tempfile, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "w.pt")
    >>> torch.save({"w": torch.ones(2, 3)}, path)
    >>> w = catalog(path).entries["w"]
    >>> w.dtype, w.shape, w.nbytes, w.order
    ('float32', (2, 3), 24, (0, 1))
    """
    if isinstance(source, Mapping):
        return _mapping_catalog(source)
    p = as_path(source)
    if is_dir(p):  # a folder's catalog is its model file's (asked for by either name)
        p = model_file(p)
    # Within a load or load_into, the source is resolved into its catalog once: every step
    # below the entry point that asks for it again is given the same one.
    return once_per_call(("catalog", p), lambda: _catalog_of(p))


def _catalog_of(p: Path) -> Catalog:
    """The catalog of the file or index ``p`` (a directory's model file), made now, or kept
    from an earlier call (``_kept_catalog``)."""
    kept = _kept_catalog(p)
    if kept is not None:
        return kept
    kind = format_of(p)
    with gc_paused():
        return _CATALOGUERS[kind](p)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cycle collector held off while a catalog is made (and restored after, as it
    was): a header of 100,000 tensors makes hundreds of thousands of objects, none in a cycle,
    and the collections they set off took a fifth of the catalog's time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def format_of(p: Path, /) -> str:
    """``detect_format(p)``, telling a ``.safetensors`` file by its header alone."""
    return "safetensors" if sniff_safetensors(p) else detect_format(p)


def describe_file(path: PathLike, /) -> list[TensorRecord]:
    """Every tensor a checkpoint holds (a file, an index, a directory), read without running its
    code or needing a GPU: ``catalog(path).records()``.

    >>> import os, tempfile, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "w.pt")
    >>> torch.save({"w": torch.ones(2, 3)}, path)
    >>> w = describe_file(path)[0]
    >>> w.name, w.device, w.dtype, w.shape, w.nbytes, w.shares
    ('w', 'cpu', 'float32', (2, 3), 24, None)
    """
    return catalog(path).records()


def safetensors_header(path: PathLike, /) -> dict[str, Any]:
    """The JSON header of a ``.safetensors`` file, checked whole (offsets tile the data, shapes
    fit their bytes and torch's indices, metadata is strings), with dtypes this torch holds."""
    from ._formats import SAFETENSORS_DTYPES as holdable  # torch's dtypes: imported when asked

    p = Path(path)
    header = read_safetensors_header(p)
    for name, entry in header.items():
        if name != "__metadata__" and entry["dtype"] not in holdable:
            raise CheckpointError(
                f"{p}: tensor {name!r} has dtype {entry['dtype']!r}, which this version of "
                f"torch cannot hold (supported: {', '.join(sorted(holdable))})",
                path=p,
            )
    return header


def code_globals(source: PathLike, /) -> list[str]:
    """The globals a checkpoint's pickles name beyond tensors and containers, read inertly:
    ``catalog(source).code``, what loading it with ``trusted=True`` would import and call.

    >>> import os, tempfile, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
    >>> torch.save(torch.nn.Linear(1, 1), path)
    >>> code_globals(path)
    ['torch.nn.modules.linear.Linear']

    A file whose catalog is refused (a record missing or compressed, say) still has its pickle
    read alone, so that a refusal can say what the file would run.
    """
    try:
        return catalog(source).code
    except CheckpointError:
        p = as_path(source)
        p = model_file(p) if is_dir(p) else p
        kind = format_of(p)
        if kind != "index":
            return _pickle_code(p, kind)
        from ._index import weight_map

        found: list[str] = []
        for _, shard_path, _ in shards(p, weight_map(p)):
            found += code_globals(shard_path)
        return list(dict.fromkeys(found))


def _pickle_code(p: Path, kind: str) -> list[str]:
    """The code globals of a torch file's pickles alone, none of its records read."""
    found: list[str] = []
    with readable(p):
        if kind == "zip":
            with opened(p) as f, zipfile.ZipFile(f) as archive:
                name = _pickle_record(archive)
                if name is not None:
                    recorder = RecordingUnpickler(io.BytesIO(archive.read(name)))
                    recorder.load()
                    found = recorder.found
        elif kind == "legacy":
            found = legacy_code(p)
    return list(dict.fromkeys(found))


def _stamped(p: Path, parse: Callable[[], dict[str, Entry]]) -> tuple[dict[str, Entry], Stamp]:
    """``parse()``'s entries and ``p``'s stamp, refused if the file changed while parsed."""
    before = stamp(p)
    entries = parse()
    now = stamp(p)
    if now != before:
        raise changed_error(p, before, now)
    return entries, before


# Safetensors files catalogued, by path, kept across calls: each one's size, its header's bytes
# and its entries, which a file of that size and those header bytes has again, whenever it was
# written and whatever its timestamps' granularity (a header's JSON made again took 0.2 ms warm,
# and 1 ms of a sharded fill's 30 ms, where a large read has just flushed the CPU's caches). A
# catalog given again carries the file's stamp of now. At most ``_KEPT_ENTRIES`` entries are kept
# in files and as many in indexes (an index's entries are its shards', shared), and no header of
# more than ``_KEPT_HEADER`` bytes (a large ``__metadata__``). Shared by threads without a lock:
# each change is one call of the C ``OrderedDict`` (atomic under the GIL), so no interrupt, at
# whatever instruction it lands, can leave a lock held for every later load to wait on; a
# change interrupted half-way leaves at worst an entry too many, dropped by the next ``_keep``.
_KEPT: collections.OrderedDict[Path, tuple[int, bytes, dict[str, Entry]]] = (
    collections.OrderedDict()
)
_KEPT_ENTRIES = 20_000
_KEPT_HEADER = 4 << 20


def _kept_catalog(p: Path) -> Catalog | None:
    """The catalog of ``p`` kept from an earlier call (a safetensors file or an index of them)
    where ``p`` holds the same header (and its shards the same) as then, else None."""
    try:
        kept = _KEPT.get(p)
        if kept is not None:
            now = stamp(p)
            if now.size != kept[0] or safetensors_header_bytes(p) != kept[1]:
                return None
            _used(_KEPT, p)
            return Catalog(str(p), "safetensors", p, dict(kept[2]), {p: now}, {p: "safetensors"})
        index = _KEPT_INDEXES.get(p)
        stamps = None if index is None else _index_stamps(p, *index[:2])
    except CheckpointError:  # gone or unreadable: made again, which says what is wrong
        return None
    if index is None or stamps is None:
        return None
    _used(_KEPT_INDEXES, p)
    c = index[2]
    return Catalog(c.where, c.kind, c.path, dict(c.entries), stamps, dict(c.kinds), list(c.code))


def _used(kept: collections.OrderedDict[Path, Any], p: Path) -> None:
    with contextlib.suppress(KeyError):  # dropped by another thread meanwhile
        kept.move_to_end(p)


def _keep(kept: collections.OrderedDict[Path, Any], p: Path, value: Any, entries: int) -> None:
    """``value`` (of ``entries`` entries) kept for later calls under ``p``, the least recently
    used dropped beyond ``_KEPT_ENTRIES`` entries in all (a larger one is not kept). Lock-free
    (see ``_KEPT``): the values are listed in one C call before they are counted."""
    if entries > _KEPT_ENTRIES:
        return
    kept[p] = value
    _used(kept, p)
    while sum(_entries(v) for v in list(kept.values())) > _KEPT_ENTRIES:
        try:
            kept.popitem(last=False)
        except KeyError:  # emptied by another thread meanwhile
            break


def _entries(kept: tuple[Any, ...]) -> int:
    """The entries of a kept file's (its dict, last) or index's (its catalog, last)."""
    last = kept[-1]
    return len(last) if isinstance(last, dict) else len(last.entries)


def _safetensors_catalog(p: Path) -> Catalog:
    raw = b""

    def parse() -> dict[str, Entry]:
        nonlocal raw
        _, base, rows, raw = read_safetensors_layout(p)  # rows: checked, dtypes named
        orders = [tuple(range(n)) for n in range(9)]  # row-major, shared by rank
        entries = {}
        for name, start, _, (dtype, shape, nbytes) in rows:
            rank = len(shape)
            order = orders[rank] if rank < 9 else tuple(range(rank))
            entries[name] = file_entry(name, dtype, shape, nbytes, p, base + start, order)
        return entries

    entries, when = _stamped(p, parse)
    if len(raw) <= _KEPT_HEADER:
        _keep(_KEPT, p, (when.size, raw, entries), len(entries))
    return Catalog(str(p), "safetensors", p, dict(entries), {p: when}, {p: "safetensors"})


# A torch zip file: the pickle read inertly, each tensor's storage offset and strides kept.


@dataclasses.dataclass
class _Located(TensorRef):
    offset: int = 0
    stride: tuple[int, ...] | None = None
    bits: tuple[str, ...] = ()  # saved metadata that changes its values ("conj", "neg")


def _rebuild_located(storage: Any, offset: Any, size: Any, stride: Any = None, *rest: Any) -> Any:
    ref = rebuild_tensor(storage, offset, size, stride, *rest)
    strides = shape_of(stride) if isinstance(stride, (tuple, list)) else None
    where = offset if isinstance(offset, int) else -1
    # the metadata dict torch saves last (its backward hooks are an OrderedDict): a conjugate
    # or negative view's bit, which its bytes alone do not show
    bits = tuple(str(k) for x in rest if type(x) is dict for k, v in x.items() if v is not False)
    return _Located(ref.storage, ref.dtype, ref.shape, where, strides, bits)


class _Locator(RecordingUnpickler):
    """The inert unpickler of ``inspect``, keeping each tensor's offset and strides (and noting
    the globals a safe load would refuse)."""

    _TORCH_REBUILDERS: Mapping[str, Callable[..., Any]] = {
        **RecordingUnpickler._TORCH_REBUILDERS,
        "rebuild_tensor": _rebuild_located,
        "_rebuild_tensor_v2": _rebuild_located,
        "_rebuild_tensor_v3": _rebuild_located,
    }


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a row-major tensor of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _storage_order(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...] | None:
    """The dims of a dense tensor from outermost to innermost in memory, or None if not dense."""
    if len(stride) != len(shape):
        return None
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    return tuple(order)


def _itemsize(dtype: str) -> int:
    import torch

    found = vars(torch).get(dtype)
    return found.itemsize if isinstance(found, torch.dtype) else 1


def _pickle_record(archive: zipfile.ZipFile) -> str | None:
    """The name of a torch zip file's pickle record (the top one, ``archive/data.pkl``), or
    None where it has none."""
    pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
    return min(pickles, key=len) if pickles else None


_NOT_PLAIN = "it is not a plain tensor with data (a sparse, quantized or meta tensor)"


def _zip_root(
    p: Path, archive: zipfile.ZipFile, raw: BinaryIO, code: list[str]
) -> tuple[str, Any, dict[str, zipfile.ZipInfo], bool]:
    """A torch zip file's record prefix, its pickle unpickled into tensor references (the code
    globals it names added to ``code``), its records by name, and whether it was written on a
    big-endian machine."""
    pickle_name = _pickle_record(archive)
    if pickle_name is None:
        raise CheckpointError(
            f"{p}: is a zip archive but not a torch.save file (no data.pkl)", path=p
        )
    prefix = pickle_name[: -len("data.pkl")]
    locator = _Locator(io.BytesIO(archive.read(pickle_name)))
    try:
        root = locator.load()
    finally:
        code.extend(dict.fromkeys(locator.found))
    records = {info.filename: info for info in archive.infolist()}
    order_record = records.get(f"{prefix}byteorder")
    big_endian = False
    if order_record is not None:
        raw.seek(record_start(raw, order_record))
        big_endian = raw.read(order_record.file_size) == b"big"
    return prefix, root, records, big_endian


def left_out_values(found: Catalog, /) -> list[tuple[str, str]]:
    """The values of ``found``'s torch zip files that are not tensors and hold none, with their
    names as the catalog spells its tensors' and their type names (``("epoch", "int")``): what
    a copy of its tensors leaves out. Read inertly, as the catalog reads them."""
    out: list[tuple[str, str]] = []
    for p, kind in found.kinds.items():
        if kind != "zip":
            continue
        with readable(p), opened(p) as raw, zipfile.ZipFile(raw) as archive:
            root = _zip_root(p, archive, raw, [])[1]
        out += plain_values(root)
    return out


def _dataless(p: Path, name: str, ref: TensorRef, nbytes: int) -> Entry:
    """The entry of a tensor saved without data of its own (no storage, or an empty one on
    ``meta``): a sparse, quantized or meta tensor, not readable by offset."""
    storage = ref.storage
    return Entry(
        name,
        ref.dtype,
        ref.shape,
        0 if storage is not None else nbytes,
        p,
        device=storage.location if storage is not None else "?",
        why=_NOT_PLAIN,
    )


def _not_by_offset(
    ref: _Located, stride: tuple[int, ...], order: tuple[int, ...] | None, big_endian: bool
) -> str:
    """Why a tensor whose storage was found is still not read by its offset: a view with gaps,
    a big-endian file, or a conjugate or negative bit that its bytes do not show."""
    if order is None:
        return (
            f"it is saved as a view with strides {stride} of shape {ref.shape}, "
            "with gaps between its elements"
        )
    if big_endian:
        return "the file was written on a big-endian machine"
    bits = " and ".join(ref.bits)
    return f"it is saved with its {bits} bit set, which its bytes do not show"


def _zip_entries(p: Path, code: list[str]) -> dict[str, Entry]:
    # any other failure than a CheckpointError (zipfile's NotImplementedError for a damaged
    # version field included): the file is damaged
    with readable(p), opened(p) as raw, zipfile.ZipFile(raw) as archive:
        prefix, root, records, big_endian = _zip_root(p, archive, raw, code)
        starts: dict[str, tuple[int, int]] = {}  # storage key -> (first byte, bytes)
        entries: dict[str, Entry] = {}
        for name, ref in tensor_refs(root):
            name = name or "<root>"
            storage = ref.storage
            itemsize = _itemsize(ref.dtype)
            numel = math.prod(max(n, 0) for n in ref.shape)
            if storage is None or (storage.location == "meta" and not storage.key):
                entries[name] = _dataless(p, name, ref, numel * itemsize)
                continue
            stored = storage.numel * storage.itemsize if storage.numel >= 0 else numel * itemsize
            if storage.key not in starts:
                info = records.get(f"{prefix}data/{storage.key}")
                if info is None or info.compress_type != zipfile.ZIP_STORED:
                    raise CheckpointError(
                        f"{p}: the data of {name!r} is missing or compressed in the zip; "
                        "save it again with torch.save",
                        path=p,
                    )
                starts[storage.key] = (record_start(raw, info), info.file_size)
            first, size = starts[storage.key]
            why, start, order = "", -1, None
            if not isinstance(ref, _Located) or ref.offset < 0:
                why = _NOT_PLAIN
            else:
                stride = ref.stride if ref.stride is not None else contiguous_strides(ref.shape)
                order = _storage_order(ref.shape, stride)
                if numel and (ref.offset + numel) * itemsize > size:
                    raise CheckpointError(
                        f"{p}: is truncated or corrupt: tensor {name!r} runs past its storage",
                        path=p,
                    )
                start = first + ref.offset * itemsize
                if order is None or big_endian or ref.bits:  # read whole by torch
                    why, order = _not_by_offset(ref, stride, order, big_endian), None
            entries[name] = Entry(
                name,
                ref.dtype,
                ref.shape,
                numel * itemsize,
                p,
                start,
                order,
                storage.location,
                storage.key,
                stored,
                why,
            )
    return entries


def _zip_catalog(p: Path) -> Catalog:
    code: list[str] = []
    entries, when = _stamped(p, lambda: _zip_entries(p, code))
    return Catalog(str(p), "zip", p, entries, {p: when}, {p: "zip"}, code)


def _legacy_catalog(p: Path) -> Catalog:
    code: list[str] = []

    def parse() -> dict[str, Entry]:
        records, found = legacy_records(p)
        code.extend(found)
        return {
            r.name: Entry(
                r.name,
                r.dtype,
                r.shape,
                r.nbytes,
                p,
                device=r.device,
                storage=r.shares or r.name,
                stored=r.stored,
                why="it is in a legacy (pre-1.6, non-zip) torch file, read only whole",
            )
            for r in records
        }

    entries, when = _stamped(p, parse)
    return Catalog(str(p), "legacy", p, entries, {p: when}, {p: "legacy"}, code)


# Shard indexes of safetensors files catalogued, by path, kept across calls as those files are
# (``_KEPT``): each one's bytes, its shards (as the index spells them, and resolved) and its
# catalog, given again while the index's bytes and every shard's header are as they were.
_KEPT_INDEXES: collections.OrderedDict[Path, tuple[bytes, list[tuple[Path, Path]], Catalog]] = (
    collections.OrderedDict()
)


def _index_catalog(p: Path) -> Catalog:
    from ._index import index_bytes, weight_map

    entries: dict[str, Entry] = {}
    stamps: dict[Path, Stamp] = {}
    kinds: dict[Path, str] = {}
    code: list[str] = []
    index_stamp = stamp(p)
    raw = index_bytes(p)
    found = shards(p, weight_map(p, raw))
    for shard, shard_path, names in found:
        part = catalog(shard_path)
        if part.kind == "index":
            raise CheckpointError(
                f"{p}: names shard {shard!r}, which is itself a shard index; an index lists "
                "the files that hold the tensors",
                path=p,
            )
        stamps.update(part.stamps)
        kinds.update(part.kinds)
        code += part.code
        if _check_listed(p, shard, names, part.entries):  # the shard holds these alone
            entries.update(part.entries)
            continue
        wanted = set(names)
        for name, entry in part.entries.items():
            if name in wanted or not wanted.isdisjoint(_prefixes(name)):
                entries[name] = entry
    stamps[p] = index_stamp
    made = Catalog(str(p), "index", p, entries, stamps, kinds, list(dict.fromkeys(code)))
    if set(kinds.values()) == {"safetensors"}:
        spelt = [(p.parent / shard, shard_path) for shard, shard_path, _ in found]
        _keep(_KEPT_INDEXES, p, (raw, spelt, made), len(entries))
        made = Catalog(made.where, made.kind, p, dict(entries), dict(stamps), dict(kinds))
    return made


def _index_stamps(p: Path, raw: bytes, spelt: list[tuple[Path, Path]]) -> dict[Path, Stamp] | None:
    """The stamps of now of the index ``p`` and its shards, where its bytes are ``raw`` as when
    it was kept and each shard, where the index spells it, is the file it was (not another one
    a link leads to now) with the header kept in ``_KEPT``; else None."""
    from ._index import index_bytes

    stamps = {p: stamp(p)}
    if index_bytes(p) != raw:
        return None
    for where, shard_path in spelt:
        kept = _KEPT.get(shard_path)
        now = stamp(where)
        if kept is None or now.size != kept[0]:
            return None
        if where != shard_path and stamp(shard_path) != now:
            return None
        if safetensors_header_bytes(shard_path) != kept[1]:
            return None
        stamps[shard_path] = now
    return stamps


def _prefixes(name: str) -> list[str]:
    """``name`` and every dotted prefix of it: ``a.b.c``, ``a.b``, ``a``."""
    return [name.rsplit(".", k)[0] for k in range(name.count(".") + 1)]


def _check_listed(p: Path, shard: str, names: list[str], held: Mapping[str, Entry]) -> bool:
    """Refuse an index that lists a name its shard does not hold; True when the names are
    exactly the shard's entries. A name holds a tensor, or (sparse, quantized) tensors listed
    under ``name.part``: those prefixes are built only when some name is not an entry itself."""
    missing = [name for name in names if name not in held]
    if not missing:
        return len(names) == len(held)  # the names of a weight map are unique
    parents = {prefix for n in held for prefix in _prefixes(n)}
    for name in missing:
        if name not in parents:
            raise CheckpointError(
                f"{p}: says {name!r} is in {shard!r}, but that shard does not hold it; the "
                "index and its shards do not match",
                path=p,
            )
    return False


def _mapping_catalog(source: Mapping[Any, Any]) -> Catalog:
    import torch

    where = "the state dict passed to load_into"
    entries = {}
    for name, value in source.items():
        if not isinstance(name, str):
            raise CheckpointError(f"{where} has a key {name!r} that is not a str")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{where} holds a {type(value).__name__} under {name!r}; a model is filled "
                "from tensors"
            )
        dtype = str(value.dtype).removeprefix("torch.")
        shape = tuple(value.shape)
        entries[name] = Entry(
            name,
            dtype,
            shape,
            math.prod(shape) * value.element_size(),
            device=str(value.device),
            tensor=value,
        )
    return Catalog(where, "mapping", None, entries, {})


_CATALOGUERS: dict[str, Callable[[Path], Catalog]] = {
    "zip": _zip_catalog,
    "legacy": _legacy_catalog,
    "safetensors": _safetensors_catalog,
    "index": _index_catalog,
}
