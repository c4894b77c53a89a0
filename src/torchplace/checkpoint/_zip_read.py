"""A torch zip file read by the catalog's layout of it (where each record's bytes are) and torch's
own weights-only unpickler: each storage record read by ``read_into`` straight into its storage
on the target, a floating one converted as it is read where the model wants another dtype.
Anything unusual (a refused global, a compressed record, a big-endian file) is left to
``torch.load``.
"""

from __future__ import annotations

import inspect
import io
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._errors import CheckpointError
from ._entries import Stamp
from ._formats import device_failure, diagnose, out_of_memory
from ._plan_items import ReadItem
from ._reader import read_into
from ._zip_layout import ZipLayout

__all__ = ["SPARSE_CHECK_NOTE", "UNUSUAL", "DTypeWish", "read_zip"]

DTypeWish = Callable[[str], "torch.dtype | None"]  # the dtype wanted for a file's tensor, by name


UNUSUAL = object()  # what read_zip returns for a file it leaves to torch.load

# torch 2.15's note that checking sparse tensors takes time: torchplace's to take, not the user's
SPARSE_CHECK_NOTE = "Validating sparse tensor invariants"


class _Unusual(Exception):
    """A zip file laid out in a way read_zip does not read (torch.load reads it instead)."""


def read_zip(
    layout: ZipLayout,
    target: torch.device,
    when: Stamp,
    check_crc: bool,
    dtype_of: DTypeWish | None = None,
    wanted: Callable[[str], bool] | None = None,
) -> Any:
    """A torch zip file's objects, each record read into a storage on ``target``.

    Returns ``UNUSUAL`` for anything it does not read itself, or that fails: a refused
    global, a compressed or mis-sized record, a file written big-endian. ``torch.load`` then
    reads it, or raises the error the caller turns into a sentence about the file. Only a lack
    of memory or a failing device is reported here, since it would fail there again.

    With ``dtype_of`` (``load_into``'s wish: the model's floating dtype by the file's name), a
    state dict's storages are first unpickled onto ``meta``; a floating storage whose tensors
    all want one other floating dtype is then allocated in that dtype and converted a chunk at a
    time as it is read, so the file's dtype never lands whole on the target. There, a storage
    whose every tensor's name ``wanted`` refuses is not read at all, and those names are not in
    the result (a load by map's disk modules, keys ``rename`` drops).
    """
    mine = sys.byteorder.encode()
    if layout.byteorder != mine and (layout.byteorder is not None or mine != b"little"):
        return UNUSUAL
    if dtype_of is None and wanted is not None:  # unpickled on meta first all the same: each
        dtype_of = _as_saved  # storage's names are known before it is read, or skipped
    if dtype_of is not None:
        read = _read_zip_once(layout, target, when, check_crc, dtype_of, wanted)
        if read is not UNUSUAL:
            return read
    return _read_zip_once(layout, target, when, check_crc, None)


def _as_saved(name: str) -> torch.dtype | None:
    """A dtype wish for no tensor: each read in its file's dtype."""
    return None


class _Record:
    """A storage record of a zip file as the unpickler met it: where its bytes are, its dtype
    in the file and elements, its CRC-32 to check (if asked), the bytes given to the unpickler
    (on ``meta`` while the dtype it is read in waits for the tensors' wishes), and the typed
    storage over them that the unpickler was handed."""

    __slots__ = ("check", "data", "dtype", "numel", "start", "storage")

    def __init__(
        self,
        start: int,
        dtype: torch.dtype,
        numel: int,
        check: tuple[int, str] | None,
        data: torch.Tensor,
    ) -> None:
        self.start, self.dtype, self.numel, self.check, self.data = start, dtype, numel, check, data
        self.storage = torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
            wrap_storage=data.untyped_storage(), dtype=dtype, _internal=True
        )


def _read_zip_once(
    layout: ZipLayout,
    target: torch.device,
    when: Stamp,
    check_crc: bool,
    dtype_of: DTypeWish | None,
    wanted: Callable[[str], bool] | None = None,
) -> Any:
    p = layout.path
    defer = dtype_of is not None  # storages on meta until every tensor's wish is known
    records: dict[str, _Record] = {}
    try:

        def persistent_load(saved_id: Any) -> Any:
            if not isinstance(saved_id, tuple) or len(saved_id) != 5:
                raise _Unusual(f"persistent id {saved_id!r}")
            typename, storage_type, key, _location, numel = saved_id
            if typename not in ("storage", b"storage") or not isinstance(key, str):
                raise _Unusual(f"persistent id {saved_id!r}")
            if key in records:
                return records[key].storage
            if storage_type is torch.UntypedStorage:
                dtype = torch.uint8
            else:
                dtype = storage_type.dtype
            nbytes = numel * dtype.itemsize
            name = f"{layout.prefix}data/{key}"
            info = layout.records.get(name)
            start = layout.starts.get(name, -1)
            if info is None or info.compress_type != 0 or info.file_size != nbytes or start < 0:
                raise _Unusual(f"record data/{key}")
            check = (info.CRC, info.filename) if check_crc and info.CRC else None  # 0: none
            data = torch.empty(nbytes, dtype=torch.uint8, device="meta" if defer else target)
            records[key] = _Record(start, dtype, numel, check, data)
            return records[key].storage

        from torch import _weights_only_unpickler

        unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(layout.pickle), encoding="utf-8")
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
        result = unpickler.load()  # type: ignore[no-untyped-call]
        if dtype_of is not None:
            reads = _read_in_wished_dtypes(result, records, target, dtype_of, wanted)
        else:
            reads = [ReadItem(r.start, r.data, None, r.check) for r in records.values()]
        read_into(p, reads, when)
        _check_sparse()  # once their bytes are in: before, they hold what the allocator left
    except CheckpointError:  # the file changed while it was read
        _forget_sparse_checks()
        raise
    except KeyboardInterrupt:
        _forget_sparse_checks()
        raise
    except Exception as exc:
        _forget_sparse_checks()  # queued by this read: torch.load would check them next
        if out_of_memory(exc) or device_failure(exc):
            raise CheckpointError(f"{p}: {diagnose(exc, True, target)}", path=p) from exc
        return UNUSUAL
    return result


def _read_in_wished_dtypes(
    result: Any,
    records: Mapping[str, _Record],
    target: torch.device,
    dtype_of: DTypeWish,
    wanted: Callable[[str], bool] | None = None,
) -> list[ReadItem]:
    """A state dict unpickled onto ``meta`` given real storages on ``target``, in place: a
    floating storage whose tensors all wish for one other floating dtype in that dtype (read
    converting), any other in the file's bytes. Returns what to read into them.

    Raises ``_Unusual`` for anything but a dict of plain dense tensors (a parameter, a sparse
    or quantized tensor, a nested object, a tensor saved with a conjugate or negative bit or
    attributes of its own), which is then read as saved."""
    if not isinstance(result, dict):
        raise _Unusual("not a state dict")
    by_storage = {r.data.untyped_storage()._cdata: r for r in records.values()}
    users: dict[int, list[tuple[Any, torch.Tensor]]] = {}
    for name, t in result.items():
        if type(t) is not torch.Tensor or t.layout != torch.strided or not isinstance(name, str):
            raise _Unusual(f"{name!r} is not a plain tensor")
        if t.is_conj() or t.is_neg() or t.__dict__:  # saved state a rebuilt view would lose
            raise _Unusual(f"{name!r} carries a conjugate or negative bit, or attributes")
        key = t.untyped_storage()._cdata
        record = by_storage.get(key)
        if record is None or t.dtype != record.dtype:
            raise _Unusual(f"{name!r} views a storage of another dtype")
        users.setdefault(key, []).append((name, t))
    reads: list[ReadItem] = []
    for key, record in by_storage.items():
        held = users.get(key, [])
        if wanted is not None and held and not any(wanted(name) for name, _ in held):
            for name, _ in held:  # none of its tensors is wanted: not read, not given
                del result[name]
            continue
        wishes = {dtype_of(name) for name, _ in held}
        want = wishes.pop() if len(wishes) == 1 else None
        dtype = record.dtype
        floating = want is not None and want.is_floating_point and dtype.is_floating_point
        if floating and want != dtype:
            assert want is not None
            real = torch.empty(record.numel, dtype=want, device=target)
            reads.append(ReadItem(record.start, real, dtype, record.check))  # a chunk at a time
            dtype = want
        else:
            real = torch.empty(record.numel * dtype.itemsize, dtype=torch.uint8, device=target)
            reads.append(ReadItem(record.start, real, None, record.check))
        for name, t in users.get(key, []):
            made = torch.empty(0, dtype=dtype, device=target)
            made.set_(real.untyped_storage(), t.storage_offset(), t.size(), t.stride())
            result[name] = made.requires_grad_(t.requires_grad)
    return reads


def _check_sparse() -> None:
    """torch's check of the sparse tensors just read, as its safe loader makes it: always from
    torch 2.15 (bad indices would be read out of bounds later), before only when
    ``torch.sparse.check_sparse_tensor_invariants`` is on (torch 2.6: always too)."""
    validate: Any = torch._utils._validate_loaded_sparse_tensors  # its signature varies
    if "weights_only" not in inspect.signature(validate).parameters:
        validate()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SPARSE_CHECK_NOTE)
        validate(weights_only=True)


def _forget_sparse_checks() -> None:
    """Drop the sparse tensors an abandoned read queued for torch's check on their indices.

    torch keeps them in a list that the next load empties; left there, a read that failed
    half-way would have ``torch.load`` check tensors never filled, and refuse a sound file as
    corrupt."""
    getter = getattr(torch._utils, "_get_sparse_tensors_to_validate", None)  # torch 2.15
    queued = (
        getter() if callable(getter) else getattr(torch._utils, "_sparse_tensors_to_validate", None)
    )
    if isinstance(queued, list):
        queued.clear()
