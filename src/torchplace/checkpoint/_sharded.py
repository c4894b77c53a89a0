"""``load_into`` for sharded models: each rank reads only the bytes of the slices it holds.

A model whose parameters or buffers are DTensors (FSDP2's ``fully_shard``, tensor parallelism
with ``parallelize_module``) is filled here instead of by the general ``load_into``. The steps:

1. *Locate* every tensor of the checkpoint without reading its data: a ``.safetensors`` header,
   the shards of a ``*.index.json`` map, or the pickle of a torch zip file read inertly (no code
   runs) for each tensor's storage record, offset, shape and strides. A mapping of tensors
   already in memory is its own locator.
2. *Check* the model against the file as any ``load_into`` does (missing, unexpected and
   mis-shaped keys, tied parameters saved under any one of their names). The checks depend only
   on the file and on the model's global shapes, so every rank raises the same error, and they
   all come before anything changes.
3. *Plan*: the box each rank holds of each tensor, from the DTensor's mesh and placements
   (``Shard(d)`` and ``Replicate()`` on any mesh, uneven shards included, and the strided
   shards of FSDP2 over tensor parallelism); a plain tensor in a sharded model is held whole.
4. *Fill*: meta tensors (a skeleton) are first given empty memory on the device, as
   ``to_empty`` would, leaving real buffers alone; then each rank reads its boxes straight into
   its local shards. A box that is one run of the file is read into the shard with no copy in
   between; one that is not (a ``Shard(1)`` slice of a row-major matrix) goes run by run, or
   through a buffer of at most 16 MiB when the runs are short. No rank holds a full tensor and no
   collective ships weights.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import itertools
import math
import os
import struct
import sys
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._devices import device as _device
from .._errors import CheckpointError, TorchplaceError
from .._model_walk import Slot, tensor_slots
from ._pickle_reader import (
    InertUnpickler,
    TensorRef,
    readable,
    rebuild_tensor,
    shape_of,
    tensor_refs,
)
from ._rename import Rename, as_renamer, renamed

__all__ = ["has_dtensors", "load_sharded", "strided_shards_readable"]

_BUFFER = 16 * 1024 * 1024  # the most a non-contiguous slice reads ahead of its copy
_DIRECT_RUN = 256 * 1024  # runs at least this long are read straight into the shard


def has_dtensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is a DTensor (a sharded model)."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:  # never imported, so no DTensor exists (and plain models pay no import)
        return False
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(fsdp, "FSDPModule", None)  # FSDP2 is public from torch 2.6
    if fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules()):
        return True  # FSDP2, even while it holds its parameters unsharded (plain tensors)
    DTensor = module.DTensor
    tensors = itertools.chain(model.parameters(), model.buffers())
    return any(isinstance(t, DTensor) for t in tensors)


# ------------------------------------------------------------------------------------ locating


@dataclasses.dataclass
class _Entry:
    """Where a tensor of the checkpoint lies: ``file`` from byte ``start``, or in memory."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path | None = None
    start: int = 0
    order: tuple[int, ...] = ()  # the file's dims in storage order (row-major: 0, 1, ...)
    tensor: torch.Tensor | None = None  # a mapping source's own tensor


@dataclasses.dataclass
class _Located(TensorRef):
    """A tensor reference that also keeps the storage offset and strides."""

    offset: int = 0
    stride: tuple[int, ...] | None = None


def _rebuild_located(storage: Any, offset: Any, size: Any, stride: Any = None, *rest: Any) -> Any:
    ref = rebuild_tensor(storage, offset, size, stride, *rest)
    strides = shape_of(stride) if isinstance(stride, (tuple, list)) else None
    where = offset if isinstance(offset, int) else -1
    return _Located(ref.storage, ref.dtype, ref.shape, where, strides)


class _Locator(InertUnpickler):
    """The inert unpickler of ``torchplace inspect``, keeping each tensor's offset and strides."""

    _TORCH_REBUILDERS: Mapping[str, Callable[..., Any]] = {
        **InertUnpickler._TORCH_REBUILDERS,
        "rebuild_tensor": _rebuild_located,
        "_rebuild_tensor_v2": _rebuild_located,
        "_rebuild_tensor_v3": _rebuild_located,
    }


def _torch_dtype(p: Path, name: str, dtype: str) -> torch.dtype:
    found = vars(torch).get(dtype)
    if not isinstance(found, torch.dtype):
        raise CheckpointError(f"{p}: tensor {name!r} has dtype {dtype!r}, which torch cannot hold")
    return found


def _storage_order(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...] | None:
    """The dims of a dense tensor from outermost to innermost in memory, or None if not dense."""
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    return tuple(order)


def _zip_entries(p: Path) -> dict[str, _Entry]:
    # any other failure than a CheckpointError: the file is damaged
    with readable(p), zipfile.ZipFile(p) as archive, p.open("rb") as raw:
        pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
        if not pickles:
            raise CheckpointError(f"{p}: is a zip archive but not a torch.save file (no data.pkl)")
        pickle_name = min(pickles, key=len)
        prefix = pickle_name[: -len("data.pkl")]
        root = _Locator(io.BytesIO(archive.read(pickle_name))).load()
        records = {info.filename: info for info in archive.infolist()}
        starts: dict[str, tuple[int, int]] = {}  # storage key -> (first byte, bytes)
        entries: dict[str, _Entry] = {}
        for name, ref in tensor_refs(root):
            storage = ref.storage
            if not isinstance(ref, _Located) or storage is None or storage.location == "meta":
                raise CheckpointError(
                    f"{p}: tensor {name or '<root>'!r} is not a plain tensor with data "
                    "(a sparse, quantized or meta tensor); a sharded model is filled from "
                    "plain tensors, so save those with torch.save(model.state_dict(), path)"
                )
            if storage.key not in starts:
                info = records.get(f"{prefix}data/{storage.key}")
                if info is None or info.compress_type != zipfile.ZIP_STORED:
                    raise CheckpointError(
                        f"{p}: the data of {name!r} is missing or compressed in the zip; "
                        "save it again with torch.save"
                    )
                raw.seek(info.header_offset)
                local = raw.read(30)
                if len(local) < 30 or local[:4] != b"PK\x03\x04":
                    raise CheckpointError(f"{p}: is corrupt (a bad zip record for {name!r})")
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                first = info.header_offset + 30 + name_len + extra_len
                starts[storage.key] = (first, info.file_size)
            first, size = starts[storage.key]
            dtype = _torch_dtype(p, name, ref.dtype)
            shape = ref.shape
            stride = ref.stride if ref.stride is not None else _contiguous(shape)
            order = _storage_order(shape, stride)
            numel = math.prod(shape)
            if order is None or ref.offset < 0 or min(shape, default=0) < 0:
                raise CheckpointError(
                    f"{p}: tensor {name!r} is saved as a view with strides {stride} of "
                    f"shape {shape}; save a contiguous copy (tensor.contiguous()) to load "
                    "it into a sharded model"
                )
            nbytes = (ref.offset + numel) * dtype.itemsize
            if numel and nbytes > size:
                raise CheckpointError(
                    f"{p}: is truncated or corrupt: tensor {name!r} runs past its storage"
                )
            entries[name] = _Entry(
                name, dtype, shape, p, first + ref.offset * dtype.itemsize, order
            )
    return entries


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _safetensors_entries(p: Path) -> dict[str, _Entry]:
    from ._formats import SAFETENSORS_DTYPES, safetensors_header

    header = safetensors_header(p)
    with p.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    base = 8 + header_len
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = tuple(entry["shape"])
        entries[name] = _Entry(
            name,
            SAFETENSORS_DTYPES[entry["dtype"]],
            shape,
            p,
            base + entry["data_offsets"][0],
            tuple(range(len(shape))),
        )
    return entries


def _index_entries(p: Path) -> dict[str, _Entry]:
    from ._formats import gather_index

    return gather_index(p, _file_entries)


def _file_entries(p: Path) -> dict[str, _Entry]:
    from ._formats import detect_format

    readers = {"safetensors": _safetensors_entries, "index": _index_entries, "zip": _zip_entries}
    read = readers.get(detect_format(p))
    if read is not None:
        return read(p)
    raise CheckpointError(
        f"{p}: is a legacy (pre-1.6, non-zip) torch file, whose tensors cannot be read by "
        "slice; save it again in the zip format, torch.save(torchplace.load(path), new_path), "
        "or as .safetensors, and load new_path"
    )


def _mapping_entries(source: Mapping[Any, Any]) -> dict[str, _Entry]:
    entries = {}
    for name, value in source.items():
        if not isinstance(name, str):
            raise CheckpointError(
                f"the state dict passed to load_into has a key {name!r} that is not a str"
            )
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"the state dict passed to load_into holds a {type(value).__name__} under "
                f"{name!r}; a sharded model is filled from tensors"
            )
        value = value.full_tensor() if _is_dtensor(value) else value  # type: ignore[attr-defined]
        entries[name] = _Entry(name, value.dtype, tuple(value.shape), tensor=value.detach())
    return entries


def _is_dtensor(t: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _renamed(entries: dict[str, _Entry], rename: Rename | None, where: str) -> dict[str, _Entry]:
    """``entries`` under the names ``rename=`` gives them, by the one set of rename rules."""
    if rename is None:
        return entries
    return renamed(where, entries, as_renamer(rename))


# ------------------------------------------------------------------------------ the model side


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offsets, lengths), one per dim
Piece = tuple[Box, tuple[slice, ...]]  # a box of the file, and where it goes in the shard


def _pieces(t: torch.Tensor, name: str) -> tuple[tuple[int, ...], list[Piece]]:
    """The shape of the part of ``t`` this rank holds, and the boxes of the file it is made of.

    One box for ``Shard(d)`` and ``Replicate()`` placements; FSDP2's ``_StridedShard`` (FSDP2
    over tensor parallelism on the same dim) may hold several, one per run of global indices.
    """
    if not _is_dtensor(t):
        return tuple(t.shape), [(((0,) * t.dim(), tuple(t.shape)), ())]
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = t.placements  # type: ignore[attr-defined]
    mesh = t.device_mesh  # type: ignore[attr-defined]
    strided = [p for p in placements if type(p).__name__ == "_StridedShard"]
    odd = [p for p in placements if type(p) not in (Shard, Replicate) and p not in strided]
    if odd:
        raise CheckpointError(
            f"{name} is a DTensor placed as {odd[0]}; load_into fills Shard(d), Replicate() "
            "and FSDP2's strided shards"
        )
    if strided:
        return _strided_pieces(t, name, placements, mesh)
    local_shape, offsets = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    return tuple(local_shape), [((tuple(offsets), tuple(local_shape)), ())]


def _strided_pieces(
    t: torch.Tensor, name: str, placements: Any, mesh: Any
) -> tuple[tuple[int, ...], list[Piece]]:
    """The global indices this rank holds on each dim, sharding left to right as DTensor does."""
    if not strided_shards_readable():  # the same answer on every rank, before anything changes
        raise CheckpointError(
            f"{name} is placed as {placements} (FSDP2 over tensor parallelism on the same dim): "
            f"load_into reads such strided shards with torch 2.13 or later, and this is torch "
            f"{torch.__version__}; upgrade it (pip install 'torch>=2.13'), or load this model "
            "with torch.distributed.checkpoint; the model is untouched"
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not in the mesh: holds nothing
        return (0,) * t.dim(), []
    indices = [list(range(n)) for n in t.shape]
    try:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.placement_types import _StridedShardOffsetMode

        for mesh_dim, placement in enumerate(placements):
            if not hasattr(placement, "dim"):  # Replicate
                continue
            here = indices[placement.dim]
            chunks, rank = mesh.size(mesh_dim), coordinate[mesh_dim]
            if type(placement) is Shard:
                size, first = Shard.local_shard_size_and_offset(len(here), chunks, rank)
                indices[placement.dim] = here[first : first + size]
            else:
                size, where = placement.local_shard_size_and_offset(
                    len(here), chunks, rank, _StridedShardOffsetMode.ALL
                )
                indices[placement.dim] = [here[i] for i in where] if size else []
    except (ImportError, AttributeError, TypeError) as exc:
        raise CheckpointError(
            f"{name} is placed as {placements}, whose slices this version of torch "
            f"({torch.__version__}) does not tell ({type(exc).__name__}: {exc}); load it "
            "with torch.distributed.checkpoint instead"
        ) from exc
    runs_per_dim = []
    for dim_indices in indices:
        runs: list[tuple[int, int, int]] = []  # (global start, length, local start)
        for local, index in enumerate(dim_indices):
            if runs and runs[-1][0] + runs[-1][1] == index:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1, runs[-1][2])
            else:
                runs.append((index, 1, local))
        runs_per_dim.append(runs)
    pieces: list[Piece] = []
    for combo in itertools.product(*runs_per_dim):
        box = (tuple(r[0] for r in combo), tuple(r[1] for r in combo))
        pieces.append((box, tuple(slice(r[2], r[2] + r[1]) for r in combo)))
    return tuple(len(i) for i in indices), pieces


def strided_shards_readable() -> bool:
    """Whether this torch tells which indices a strided shard holds (the offset mode of
    ``_StridedShard.local_shard_size_and_offset``, torch 2.13 and later)."""
    try:
        from torch.distributed.tensor import placement_types
    except ImportError:  # a build without torch.distributed holds no DTensor
        return False
    return hasattr(placement_types, "_StridedShardOffsetMode")


def _local(t: torch.Tensor) -> torch.Tensor:
    if _is_dtensor(t):
        with torch.no_grad():
            return t.to_local()  # type: ignore[attr-defined, no-any-return]
    return t.detach()


def _listing(items: list[str], limit: int = 10) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


# ---------------------------------------------------------------------------------- reading


def _writable(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable (any dtype: no numpy)."""
    n = t.numel() * t.element_size()
    held = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    if n > held:  # a storage FSDP2 freed (resized to 0): writing there would crash the process
        raise RuntimeError(f"a tensor of {n} bytes has only {held} bytes of storage")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class _Reader:
    """Open files by path, reading byte ranges into given memory."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}
        self.buffer: torch.Tensor | None = None

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def readinto(self, p: Path, start: int, out: memoryview) -> None:
        fd = self.fds.get(p)
        if fd is None:
            fd = self.fds[p] = os.open(p, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        done, size = 0, len(out)
        while done < size:
            got = os.preadv(fd, [out[done:]], start + done)
            if got <= 0:
                raise OSError(f"{p} ended {size - done} bytes early")
            done += got

    def block(
        self, p: Path, start: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """``shape`` elements of ``dtype`` from byte ``start``, in the reusable buffer."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = torch.empty(max(nbytes, 0), dtype=torch.uint8)
        raw = self.buffer[:nbytes]
        self.readinto(p, start, _writable(raw))
        return raw.view(dtype).view(shape)


def _read_box(
    reader: _Reader,
    entry: _Entry,
    start: int,
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    dest: torch.Tensor,
) -> None:
    """Copy the box ``offsets``/``lengths`` of a row-major tensor at ``start`` into ``dest``."""
    assert entry.file is not None
    if 0 in lengths or 0 in shape:
        return
    itemsize, dtype = entry.dtype.itemsize, entry.dtype
    nd = len(shape)
    partial = [d for d in range(nd) if lengths[d] != shape[d]]
    last = partial[-1] if partial else -1
    inner = math.prod(shape[last + 1 :])
    run = (lengths[last] if last >= 0 else 1) * inner  # elements in one contiguous run
    direct = dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous()
    if direct and (last <= 0 or run * itemsize >= _DIRECT_RUN):
        strides = _contiguous(shape)
        memory = _writable(dest)
        run_bytes = run * itemsize
        outer = itertools.product(
            *(range(offsets[d], offsets[d] + lengths[d]) for d in range(last))
        )
        tail = offsets[last] * strides[last] if last >= 0 else 0
        for n, index in enumerate(outer):
            element = sum(i * s for i, s in zip(index, strides, strict=False)) + tail
            reader.readinto(
                entry.file, start + element * itemsize, memory[n * run_bytes : (n + 1) * run_bytes]
            )
        return
    if nd == 0:
        dest.copy_(reader.block(entry.file, start, dtype, ()))
        return
    slab = math.prod(shape[1:]) * itemsize  # bytes of one index of dim 0
    if slab > _BUFFER and nd > 1:
        for r in range(lengths[0]):
            where = start + (offsets[0] + r) * slab
            _read_box(reader, entry, where, shape[1:], offsets[1:], lengths[1:], dest[r])
        return
    rows = max(1, _BUFFER // max(slab, 1))
    inside = (
        slice(None),
        *(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:], strict=True)),
    )
    for r0 in range(0, lengths[0], rows):
        n = min(rows, lengths[0] - r0)
        block = reader.block(entry.file, start + (offsets[0] + r0) * slab, dtype, (n, *shape[1:]))
        dest[r0 : r0 + n].copy_(block[inside])


def _fill(reader: _Reader, entry: _Entry, box: Box, dest: torch.Tensor) -> None:
    offsets, lengths = box
    if entry.tensor is not None:
        index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
        dest.copy_(entry.tensor[index])
        return
    order = entry.order
    if order == tuple(range(len(order))):
        _read_box(reader, entry, entry.start, entry.shape, offsets, lengths, dest)
        return
    # Saved as a permuted view (a transposed weight): the file holds the permuted tensor
    # row-major, so read the permuted box and lay it out as the model's.
    shape = tuple(entry.shape[d] for d in order)
    permuted = torch.empty(tuple(lengths[d] for d in order), dtype=dest.dtype, device=dest.device)
    _read_box(
        reader,
        entry,
        entry.start,
        shape,
        tuple(offsets[d] for d in order),
        tuple(lengths[d] for d in order),
        permuted,
    )
    inverse = sorted(range(len(order)), key=lambda d: order[d])
    dest.copy_(permuted.permute(inverse))


# ------------------------------------------------------------------------------------ loading


def _materialize(model: nn.Module, slots: list[Slot], target: torch.device) -> None:
    """Give meta tensors empty memory on ``target`` as ``to_empty`` would, keeping real ones."""

    loading = {id(slot.tensor) for slot in slots}  # what stays on meta (strict=False) stays

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, device=target) if t.is_meta and id(t) in loading else t

    model._apply(empty)  # type: ignore[no-untyped-call]  # FSDP2's own _apply re-pads and re-registers its sharded parameters
    for slot in slots:  # _apply made one tensor per place: tied parameters are one again
        kind = "_parameters" if slot.is_param else "_buffers"
        module, attr = slot.homes[0]
        first = getattr(module, kind)[attr]
        for module, attr in slot.homes[1:]:
            getattr(module, kind)[attr] = first
        slot.tensor = first


def _refuse_own_loaders(where: str, model: nn.Module) -> None:
    """A module that loads itself (its own ``_load_from_state_dict``) cannot be followed here."""
    from torch.nn.modules.batchnorm import _NormBase
    from torch.nn.modules.instancenorm import _InstanceNorm

    followed = (nn.Module, _NormBase, _InstanceNorm)  # theirs only upgrade old norm files
    for name, module in model.named_modules():
        owner = next(
            (k for k in type(module).__mro__ if "_load_from_state_dict" in vars(k)), nn.Module
        )
        if owner in followed and "_load_from_state_dict" not in vars(module):
            continue
        what = f"{name} ({type(module).__name__})" if name else type(module).__name__
        raise CheckpointError(
            f"{where}: cannot be loaded into this sharded model: {what} overrides "
            "_load_from_state_dict, and load_into reads each rank's slices itself, so it cannot "
            "follow that code; the model is untouched"
        )


def _reshard(model: nn.Module) -> None:
    """FSDP2 modules hold their sharded parameters (as before a load_state_dict)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def load_sharded(
    model: nn.Module,
    source: Any,
    device: Any = None,
    /,
    *,
    strict: bool = True,
    rename: Rename | None = None,
) -> nn.Module:
    """Fill a model holding DTensors from ``source``, each rank reading only its own slices."""
    from ._formats import as_path

    if isinstance(source, Mapping):
        where = "the state dict passed to load_into"
        entries = _renamed(_mapping_entries(source), rename, where)
    else:
        p = as_path(source)
        where = str(p)
        entries = _renamed(_file_entries(p), rename, where)
    target = None if device is None else _device(device)
    _refuse_own_loaders(where, model)
    try:
        _reshard(model)  # FSDP2 registers its sharded parameters again (values unchanged)
    except Exception as exc:
        raise CheckpointError(
            f"{where}: FSDP2 could not reshard {type(model).__name__} before the load "
            f"({type(exc).__name__}: {exc}); the model is untouched"
        ) from exc
    found = tensor_slots(model)
    slots = found.loadable
    meta_transient = [name for s in found.transient if s.tensor.is_meta for name in s.names]

    missing: list[str] = []
    mismatched: list[str] = []
    plan: list[tuple[Slot, _Entry]] = []
    used: set[str] = set()
    for slot in slots:
        present = [n for n in slot.names if n in entries]
        used.update(present)
        if not present:
            also = f" (tied to {', '.join(slot.names[1:])})" if len(slot.names) > 1 else ""
            missing.append(slot.names[0] + also)
            continue
        entry = entries[present[0]]
        if entry.shape != tuple(slot.tensor.shape):
            mismatched.append(f"{present[0]}: file {entry.shape}, model {tuple(slot.tensor.shape)}")
            continue
        if entry.dtype.is_complex != slot.tensor.dtype.is_complex:
            mismatched.append(f"{present[0]}: file {entry.dtype}, model {slot.tensor.dtype}")
            continue
        plan.append((slot, entry))
    unexpected = [k for k in entries if k not in used]
    problems = []
    if strict and missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {_listing(mismatched)}")
    if strict and meta_transient:
        problems.append(
            f"non-persistent buffers on meta that no checkpoint holds: {_listing(meta_transient)} "
            "(build the model with torchplace.skeleton so buffers stay real)"
        )
    if problems:
        fix = "; pass strict=False to load what matches" if plan and not mismatched else ""
        raise CheckpointError(
            f"{where}: does not fit {type(model).__name__}: {'; '.join(problems)}{fix}; the "
            "model is untouched",
            missing=[m.split(" (tied to ")[0] for m in missing] if strict else [],
            unexpected=unexpected if strict else [],
            mismatched=[m.split(": ")[0] for m in mismatched],
        )
    if not strict and not plan and slots:
        raise CheckpointError(
            f"{where}: not one of its keys matches {type(model).__name__}, so strict=False would "
            f"load nothing: the model has {_listing(missing, 5)}"
        )

    if target is not None and target.type == "meta":
        raise CheckpointError(
            f"{where}: device='meta' holds no data, so a sharded model cannot be filled there; "
            "pass device=None to fill each rank's shards where they are"
        )
    # Meta tensors get memory on ``device``; by default on the device type of the mesh.
    meshes = [getattr(slot.tensor, "device_mesh", None) for slot, _ in plan]
    mesh_types = [mesh.device_type for mesh in meshes if mesh is not None]
    new_home = target or (_device(mesh_types[0]) if mesh_types else torch.device("cpu"))
    pieces = []
    materialize_on: torch.device | None = None
    for slot, _ in plan:
        t = slot.tensor
        name = slot.names[0]
        pieces.append(_pieces(t, name))
        if t.is_meta:
            materialize_on = new_home
        elif target is not None and t.device != target:
            raise CheckpointError(
                f"{name} is on {t.device}, not on device={target}: load_into fills a sharded "
                "model's tensors where they are; pass device=None, or build the model on "
                f"{target} (or call model.to_empty(device={str(target)!r})) first"
            )
        if _is_dtensor(t):
            mesh_type = t.device_mesh.device_type  # type: ignore[attr-defined]
            kind = materialize_on if t.is_meta else t.device
            if kind is not None and kind.type != mesh_type:
                raise CheckpointError(
                    f"{name}: its device mesh is on {mesh_type} but it would be filled on "
                    f"{kind}; pass device={mesh_type!r}"
                )

    reader = _Reader()
    changed = False
    try:
        if materialize_on is not None:
            changed = True
            _materialize(model, [slot for slot, _ in plan], materialize_on)
        with torch.no_grad():
            for (slot, entry), (shape, parts) in zip(plan, pieces, strict=True):
                dest = _local(slot.tensor)
                if tuple(dest.shape) != shape:  # FSDP2 may keep a padded shard: fill its part
                    dest = dest[tuple(slice(0, n) for n in shape)]
                changed = True
                for box, into in parts:
                    _fill(reader, entry, box, dest[into] if into else dest)
    except TorchplaceError:
        raise
    except Exception as exc:
        state = (
            "the model is partly filled, so build it again" if changed else "the model is untouched"
        )
        raise CheckpointError(
            f"{where}: could not be read into {type(model).__name__} ({type(exc).__name__}: "
            f"{exc}); {state}"
        ) from exc
    finally:
        reader.close()
    return model
