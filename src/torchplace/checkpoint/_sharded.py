"""``load_into`` for sharded models: each rank reads only the bytes of the slices it holds.

A model whose parameters or buffers are DTensors (FSDP2's ``fully_shard``, tensor parallelism
with ``parallelize_module``) is filled here instead of by the general ``load_into``. The steps:

1. *Locate* every tensor without reading its data: the source's catalog (``_catalog``: a
   ``.safetensors`` header, the shards of an index or a ``save_pretrained`` directory, a torch zip
   file's pickle read inertly for each tensor's offset, shape and strides, or a mapping of
   tensors in memory), each entry checked to be readable by slices.
2. *Check* the model against the file as any ``load_into`` does (missing, unexpected and
   mis-shaped keys, tied parameters saved under any one of their names). The checks depend only
   on the file and on the model's global shapes, so every rank raises the same error, and they
   all come before anything changes.
3. *Plan*: the box each rank holds of each tensor, from the DTensor's mesh and placements
   (``Shard(d)`` and ``Replicate()`` on any mesh, uneven shards included, and the strided
   shards of FSDP2 over tensor parallelism); a plain tensor in a sharded model is held whole.
4. *Fill*: meta tensors (a skeleton) are first given empty memory on the device, as
   ``to_empty`` would, leaving real buffers alone; then each rank reads its boxes straight into
   its local shards (``_boxes``). A box that is one run of the file is read into the shard with
   no copy in between (onto CUDA, through the reader's pinned slots), and runs go to the one
   reader (``_reader.OpenFiles``: its pool of threads, the files' stamps checked before and
   after); one that is not (a ``Shard(1)`` slice of a row-major matrix) goes run by run, or
   through a buffer of at most 16 MiB when the runs are short. No rank holds a full tensor and
   no collective ships weights.
5. *Compare*: the ranks of the mesh share whether each failed and the stamps of the files each
   read (a few bytes a rank; the whole errors only when one shows trouble), so that if any rank
   failed, or ranks on one machine read different versions of a file, every rank raises. They
   meet through the process group's store (``_rendezvous``), not a collective, so that a rank
   interrupted, killed or absent makes the others raise within a bound, naming it.
6. *Undo*: whichever rank fails or is interrupted (Ctrl-C), each rank puts back what its fill
   gave memory (``_Undo``: a skeleton's tensors, back on meta as they were), so that a failed
   load leaves every rank's model as it was; a shard that already had memory is filled in
   place, with no copy kept, and the error says the model is partly filled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import sys
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._devices import device as _device
from .._errors import CheckpointError, TorchplaceError, user_stacklevel
from .._model_walk import Slot, tensor_slots
from ._boxes import BoxReader, entry_dtype, queue_box
from ._catalog import catalog
from ._conversions import Fused, Plan, conversion_plan, fused_boxes
from ._entries import Catalog, Entry, Stamp
from ._keys import check_keys, does_not_fit, matches_nothing, no_data_buffers
from ._load import warn_unchecked_safetensors
from ._mismatch import left_on_meta, warn_left_on_meta, warn_skipped
from ._plan_items import Box
from ._progress import reporting
from ._rename import Rename, as_renamer, given, renamed
from ._rendezvous import ABSENT, TIMEOUT_VARIABLE, Meeting, meeting
from ._whole_files import check_records

__all__ = ["has_dtensors", "load_sharded", "strided_shards_readable"]


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


def _sharded_entries(found: Catalog) -> dict[str, Entry]:
    """The catalog's entries, each one the sharded reader can read by slices (a file's by its
    byte range, a mapping's from its ``tensor``, a DTensor gathered whole), or refused."""
    where = found.where
    entries = {}
    held: set[str] = set()  # dtypes this torch was found to hold
    for name, e in found.entries.items():
        if e.tensor is not None:
            value = e.tensor
            value = value.full_tensor() if _is_dtensor(value) else value
            entries[name] = dataclasses.replace(e, tensor=value.detach())
            continue
        if found.kind == "legacy" or (e.file is not None and e.why.startswith("it is in a legacy")):
            p = Path(str(e.file))
            raise CheckpointError(
                f"{p}: is a legacy (pre-1.6, non-zip) torch file, whose tensors cannot be read by "
                f"slice; save it again in the zip format, torch.save(torchplace.load({str(p)!r}), "
                f"{str(p.with_name(p.stem + '-zip.pt'))!r}), or as .safetensors, and load that file"
            )
        if not e.addressable:
            fix = (
                "save a contiguous copy (tensor.contiguous()) to load it into a sharded model"
                if e.why.startswith("it is saved as a view")
                else "a sharded model is filled from plain tensors, so save those with "
                "torch.save(model.state_dict(), path)"
            )
            raise CheckpointError(
                f"{e.file}: tensor {name!r} cannot be read by slice: {e.why}; {fix}"
            )
        if e.dtype not in held:
            e.torch_dtype(where)  # refused by name where this torch has no such dtype
            held.add(e.dtype)
        entries[name] = e
    return entries


def _file_entries(p: Path) -> dict[str, Entry]:
    """The entries of a file, index or directory as the sharded reader reads them."""
    return _sharded_entries(catalog(p))


@functools.cache
def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_dtensor(t: object) -> bool:
    return isinstance(t, _dtensor_type())


def _renamed(entries: dict[str, Entry], rename: Rename | None, where: str) -> dict[str, Entry]:
    """``entries`` under the names ``rename=`` gives them, by the one set of rename rules."""
    if rename is None:
        return entries
    return renamed(where, entries, as_renamer(rename))


def _converted(
    where: str, conversions: Plan, entries: dict[str, Entry]
) -> tuple[dict[str, Entry], dict[str, Fused]]:
    """The entries under the model's names, and the fused tensors, by model name, that each
    rank fills from the parts of the file's tensors that fall in its slices."""
    if conversions.computed:
        first = conversions.computed[0]
        raise CheckpointError(
            f"{where}: {first.names[0]} is computed by transformers from whole tensors of the "
            f"file ({', '.join(first.sources[:2])}), which a sharded model does not read by "
            "slice; load the model unsharded (load_into before fully_shard), then shard it"
        )
    for f in conversions.fused:
        if fused_boxes(f, ((0,) * len(f.shape), f.shape)) is None:
            raise CheckpointError(
                f"{where}: {f.name} is assembled from transposed tensors of the file, which a "
                "sharded model does not read by slice; load the model unsharded (load_into "
                "before fully_shard), then shard it"
            )
    used = conversions.consumed()
    out = {k: e for k, e in entries.items() if k not in used}
    for new, old in conversions.renames.items():
        out[new] = entries[old]
    for name, shape in conversions.mismatched.items():  # reported as a shape mismatch
        out[name] = Entry(name, "float32", shape, 0)
    return out, {f.name: f for f in conversions.fused}


# ------------------------------------------------------------------------------ the model side


# A box of the tensor (global offsets, as in the file) that this rank holds, and where it lands
# in the rank's shard (no slices: all of it).
Held = tuple[Box, tuple[slice, ...]]


# The boxes of shapes placed alike, by (global shape, the mesh's id, placements): each a
# (weak reference to the mesh, this rank's local shape, its global offsets). A model's layers
# repeat, and a process fills the same model again (torch works each box out in 60-80 us); the
# weak reference tells a mesh from a later one that reuses its id.
_BOXES: dict[tuple[Any, ...], tuple[Any, tuple[int, ...], tuple[int, ...]]] = {}
_MOST_BOXES = 4096  # forgotten all at once beyond this many shapes


def _pieces(t: torch.Tensor, name: str) -> tuple[tuple[int, ...], list[Held]]:
    """The shape of the part of ``t`` this rank holds, and the boxes of the file it is made of.

    One box for ``Shard(d)`` and ``Replicate()`` placements; FSDP2's ``_StridedShard`` (FSDP2
    over tensor parallelism on the same dim) may hold several, one per run of global indices.
    """
    if not _is_dtensor(t):
        return tuple(t.shape), [(((0,) * t.dim(), tuple(t.shape)), ())]
    placements = tuple(t.placements)  # type: ignore[attr-defined]
    mesh = t.device_mesh  # type: ignore[attr-defined]
    key = (tuple(t.shape), id(mesh), placements)
    known = _BOXES.get(key)
    if known is not None and known[0]() is mesh:
        return known[1], [((known[2], known[1]), ())]
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

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
    local, at = tuple(local_shape), tuple(offsets)
    if len(_BOXES) >= _MOST_BOXES:
        _BOXES.clear()
    with contextlib.suppress(TypeError):  # a mesh that takes no weak reference: not kept
        _BOXES[key] = (weakref.ref(mesh), local, at)
    return local, [((at, local), ())]


def _strided_pieces(
    t: torch.Tensor, name: str, placements: Any, mesh: Any
) -> tuple[tuple[int, ...], list[Held]]:
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
    pieces: list[Held] = []
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
    """The tensor a rank holds of ``t`` (its local shard for a DTensor), without autograd."""
    if _is_dtensor(t):
        if not torch.is_grad_enabled():  # to_local gives its shard as it is, no autograd node
            local = getattr(t, "_local_tensor", None)  # what it gives, without the call
            return local if isinstance(local, torch.Tensor) else t.to_local()  # type: ignore[attr-defined]
        with torch.no_grad():
            return t.to_local()  # type: ignore[attr-defined, no-any-return]
    return t.detach()


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


class _Undo:
    """What a sharded fill can put back, recorded before it changes anything: the tensors it
    gives memory (on meta before, a skeleton's) at each of their homes, FSDP2's own record of
    their sharded data, and a copy of each buffer that already had memory (a skeleton's are
    real, and they are small). A load that fails or is interrupted, on this rank or on another
    of the mesh, puts them back (``put_back``): the very objects as before, on meta, and the
    buffers' values, so that every rank holds what it held before the load. Parameters that
    already had memory are filled in place with no copy kept (a copy would double each rank's
    memory): ``in_place`` says that some were, and then a failed load leaves the model partly
    filled."""

    def __init__(self) -> None:
        self.homes: list[tuple[dict[str, Any], str, torch.Tensor]] = []  # (table, name, tensor)
        self.fsdp: list[tuple[Any, torch.Tensor]] = []  # (FSDPParam, its sharded data on meta)
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a buffer, its values)
        self.in_place = False  # the fill writes into memory a parameter already had
        self.changed = False  # the fill may have changed the model

    def record(self, model: nn.Module, slots: list[Slot]) -> None:
        """Keep what ``put_back`` needs of ``slots`` (the fill's), before anything changes."""
        for slot in slots:
            if not slot.tensor.is_meta:
                if slot.is_param:
                    self.in_place = True
                else:
                    local = _local(slot.tensor)
                    self.buffers.append((local, local.clone()))
                continue
            kind = "_parameters" if slot.is_param else "_buffers"
            for module, attr in slot.homes:
                table = getattr(module, kind)
                self.homes.append((table, attr, table[attr]))
        if self.homes:  # a skeleton's: FSDP2's record of its sharded data, on meta too
            found = [(p, p._sharded_param_data) for p in _fsdp_params(model)]
            self.fsdp = [(p, data) for p, data in found if data.is_meta]

    def said(self, what: str) -> str:
        """What a failed load leaves of the model (called ``what``), once put back."""
        if not self.changed:
            return f"{what} is untouched"
        if self.in_place:
            return f"{what} is partly filled, so build it again"
        return f"{what} is put back as it was"

    def put_back(self, model: nn.Module) -> None:
        """The recorded tensors back at their homes, on meta, as before the fill (``_apply``
        takes those given memory back to meta first, so that FSDP2 registers them again, and
        no memory is kept for them). Done to the end whatever interrupts arrive meanwhile (it
        can be done again), the first of them raised once it is over."""
        interrupted: BaseException | None = None
        while True:
            try:
                self._put_back(model)
                break
            except BaseException as exc:
                if isinstance(exc, Exception):
                    raise
                interrupted = interrupted or exc  # a Ctrl-C part-way: put the rest back
        if interrupted is not None:
            raise interrupted

    def _put_back(self, model: nn.Module) -> None:
        with torch.no_grad():
            for buffer, values in self.buffers:
                buffer.copy_(values)
        given = set()
        for table, attr, _ in self.homes:
            t = table.get(attr)
            if t is not None and not t.is_meta:
                given.add(id(t))
        if given:

            def meta(t: torch.Tensor) -> torch.Tensor:
                return torch.empty_like(t, device="meta") if id(t) in given else t

            with torch.no_grad():
                model._apply(meta)  # type: ignore[no-untyped-call]
        for table, attr, original in self.homes:
            table[attr] = original
        for param, data in self.fsdp:
            local = getattr(param.sharded_param, "_local_tensor", None)
            if isinstance(local, torch.Tensor) and local.is_meta:
                param._sharded_param_data = data  # what _apply does not reset for meta


def _fsdp_params(model: nn.Module) -> list[Any]:
    """FSDP2's record of each parameter it shards in ``model`` (its private ``FSDPParam``s;
    none where this torch keeps them elsewhere)."""
    try:
        from torch.distributed.fsdp import FSDPModule

        found: list[Any] = []
        for module in model.modules():
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state()
                groups = getattr(state, "_fsdp_param_groups", None)
                groups = groups or [getattr(state, "_fsdp_param_group", None)]
                found.extend(p for g in groups if g is not None for p in g.fsdp_params)
        for p in found:
            assert isinstance(p._sharded_param_data, torch.Tensor)
        return found
    except Exception:  # a torch without them: put_back keeps the memory FSDP2 still refers to
        return []


_SELF_LOADING: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()  # per class


def _loads_itself(cls: type) -> bool:
    """Whether modules of ``cls`` load themselves: a ``_load_from_state_dict`` of their own
    (norms' only upgrade old norm files, and are followed)."""
    known = _SELF_LOADING.get(cls)
    if known is None:
        from torch.nn.modules.batchnorm import _NormBase
        from torch.nn.modules.instancenorm import _InstanceNorm

        owner = next((k for k in cls.__mro__ if "_load_from_state_dict" in vars(k)), nn.Module)
        known = _SELF_LOADING[cls] = owner not in (nn.Module, _NormBase, _InstanceNorm)
    return known


def _refuse_own_loaders(where: str, model: nn.Module) -> None:
    """A module that loads itself (its own ``_load_from_state_dict``) cannot be followed here."""
    for name, module in model.named_modules():
        if not _loads_itself(type(module)) and "_load_from_state_dict" not in vars(module):
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
    check_crc: bool | None = None,
    progress: bool | None = None,
) -> nn.Module:
    """Fill a model holding DTensors from ``source``, each rank reading only its own slices;
    then the ranks of its mesh compare what they did, so that every rank raises or none does.

    ``check_crc=True``: every record of a zip file is checked in a pass of its own first (a rank
    reads slices, never a whole record); the default, ``None``, does not make that pass.

    All or nothing: where any rank fails or is interrupted, every rank raises (the interrupted
    one its ``KeyboardInterrupt``, the others ``CheckpointError`` naming it), each with what its
    fill gave memory put back as it was (``_Undo``)."""
    meets = _meeting_of(model, _mesh_of(model))
    undo = _Undo()
    try:
        how = {"strict": strict, "rename": rename, "check_crc": check_crc, "progress": progress}
        with meets.beating() if meets is not None else contextlib.nullcontext():
            read = _fill_sharded(model, source, device, undo, **how)
        _compared(model, meets, _Outcome.of(stamps=read), undo)
    except CheckpointError as exc:  # this rank's own, or the comparison's: every rank raises
        _told_filled(meets, exc)  # the others told, where this rank had told them nothing
        _put_back(model, undo, exc)
        raise
    except BaseException as exc:  # an interrupt too: the others hear of it now, not later
        name = type(model).__name__
        if _told_filled(meets, exc):  # the others may have kept theirs: so does this rank
            _note(
                exc,
                f"torchplace: this rank's shards of {name} are filled: the load stopped as the "
                "ranks of its mesh compared their loads, after this rank told them its fill "
                f"went through, so if another rank failed, {name} differs across ranks: load "
                "it again on every rank",
            )
            raise
        _put_back(model, undo, exc)
        if undo.changed and undo.in_place:
            _note(
                exc,
                f"torchplace: the load stopped part-way, and {name} is partly filled on this "
                "rank (its shards that had memory are filled in place, with no copy kept), so "
                "build it again",
            )
        raise
    return model


def _told_filled(meets: Meeting | None, exc: BaseException) -> bool:
    """Whether this rank had told the others of its mesh that its fill went through when its
    load stopped on ``exc`` (in the comparison: they may have kept theirs); where it had told
    them nothing, it tells them it failed, at once (they raise naming it, without waiting)."""
    if meets is None:
        return False
    with contextlib.suppress(Exception):  # this rank's own error is the one to raise
        row = meets.own_row()
        if row is not None and row != ABSENT:  # ABSENT: the others gave up on this rank
            return row.startswith("0,")
        mine = _Outcome.of(failure=exc)
        meets.post(_row(mine), _full(mine))
    return False


def _put_back(model: nn.Module, undo: _Undo, exc: BaseException) -> None:
    """``undo.put_back``, after a failed load (``exc``); where that fails, ``CheckpointError``
    saying so."""
    try:
        undo.put_back(model)
    except Exception as failure:
        raise CheckpointError(
            f"{type(model).__name__}: its load failed ({type(exc).__name__}: {exc}), and what "
            f"the load changed could not be put back ({type(failure).__name__}: {failure}); "
            "build it again"
        ) from exc


class LoadInterrupted(KeyboardInterrupt):
    """A Ctrl-C that stopped a sharded load leaving the model partly filled, saying so: still a
    ``KeyboardInterrupt`` (nothing catching torchplace's errors swallows it), its message the
    state the model is in, on every Python (a note needs 3.11)."""


def _note(exc: BaseException, text: str) -> None:
    """``text`` said with ``exc``: a ``KeyboardInterrupt`` is raised again as a
    ``LoadInterrupted`` saying it (chained from it); another exception gets it as a note
    (Python 3.11 and later)."""
    if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, LoadInterrupted):
        raise LoadInterrupted(text) from exc
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(text)


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """What one rank's fill did, as the ranks compare it: its failure (empty if none), and the
    stamp of each file it read, by host (copies of a checkpoint on two machines differ);
    ``arrived`` False for a rank given up on (it did not come within the bound)."""

    rank: int
    host: str
    failure: str
    stamps: tuple[tuple[str, int, int, int, int, int], ...]
    arrived: bool = True

    @classmethod
    def of(
        cls, *, failure: BaseException | None = None, stamps: Mapping[Path, Stamp] | None = None
    ) -> _Outcome:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        said = ""
        if failure is not None:
            try:
                said = str(failure) or type(failure).__name__
            except Exception:  # an error that cannot say itself still counts as one
                said = type(failure).__name__
        files = tuple(
            (str(p), s.size, s.mtime_ns, s.inode, s.device, s.ctime_ns)
            for p, s in sorted((stamps or {}).items())
        )
        return cls(rank, _host(), said, files)


@functools.cache
def _host() -> str:
    """This machine's name (asked once: ``gethostname`` cost 0.15 ms a fill)."""
    import socket

    return socket.gethostname()


def _mesh_of(model: nn.Module) -> Any:
    """The device mesh whose ranks fill the model together: that of its DTensors, or of its
    FSDP2 modules where FSDP2 holds them unsharded (``unshard()``, or
    ``reshard_after_forward=False`` after a forward), when they are plain tensors for now.
    Where the DTensors lie on several meshes of one root (a 2-D mesh's ``dp`` and ``tp``), the
    root; where they lie on meshes of different roots, the first (only its ranks compare)."""
    meshes: list[Any] = []
    for t in itertools.chain(model.parameters(), model.buffers()):
        if _is_dtensor(t) and all(t.device_mesh is not m for m in meshes):  # type: ignore[attr-defined]
            meshes.append(t.device_mesh)  # type: ignore[attr-defined]
    if not meshes:
        for module in model.modules():
            try:  # FSDP2's own record of its mesh (a private attribute: absent, no mesh)
                state = module._get_fsdp_state()  # type: ignore[operator]
                meshes.append(state._fsdp_param_group.mesh_info.mesh)
                break
            except Exception:
                continue
    if len(meshes) <= 1:
        return meshes[0] if meshes else None
    try:
        roots = {id(m._get_root_mesh()): m._get_root_mesh() for m in meshes}
    except Exception:  # a torch without root meshes
        return meshes[0]
    return next(iter(roots.values())) if len(roots) == 1 else meshes[0]


def _digest(text: str) -> int:
    """A 64-bit digest of ``text`` that every process computes alike (``hash`` is salted)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


# The global ranks of each mesh a fill met on, by the mesh's id (a weak reference tells a mesh
# from a later one that reuses its id); None for a mesh with nothing to compare.
_RANKS: dict[int, tuple[Any, list[int] | None]] = {}


def _ranks_of(mesh: Any) -> list[int] | None:
    """The global ranks of ``mesh``; None where this rank is not in it, or where it is
    PyTorch's fake process group (tests that play every rank in one process)."""
    import torch.distributed as dist

    kept = _RANKS.get(id(mesh))
    if kept is not None and kept[0]() is mesh:
        return kept[1]
    ranks: list[int] | None = None
    if mesh.get_coordinate() is not None and dist.get_backend(mesh.get_group(0)) != "fake":
        ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if len(_RANKS) >= 64:
        _RANKS.clear()
    with contextlib.suppress(TypeError):  # a mesh that takes no weak reference: not kept
        _RANKS[id(mesh)] = (weakref.ref(mesh), ranks)
    return ranks


def _meeting_of(model: nn.Module, mesh: Any) -> Meeting | None:
    """This call's round of the comparison across ``mesh``; None where there is nothing to
    compare: no process group, only PyTorch's fake one (tests that play every rank in one
    process), or a rank that holds no part of the model."""
    import torch.distributed as dist

    if mesh is None or not dist.is_available() or not dist.is_initialized():
        return None
    ranks = _ranks_of(mesh)
    if ranks is None:
        return None
    from torch.distributed import distributed_c10d

    store_of = getattr(distributed_c10d, "_get_default_store", None)  # every torch since 1.8
    if store_of is None:  # a torch that dropped it: say so rather than skip the check unseen
        warnings.warn(
            "torchplace cannot reach the process group's store in this torch "
            "(torch.distributed.distributed_c10d._get_default_store is gone), so the ranks did "
            "not compare their loads: a rank that failed is not noticed by the others; please "
            "report it to torchplace",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        return None
    try:
        return meeting(store_of(), ranks, dist.get_rank())
    except TorchplaceError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{type(model).__name__}: the process group's store cannot be reached "
            f"({type(exc).__name__}: {exc}), as when the process holding it (rank 0's, unless "
            "torchrun's agent holds it) has died, so the ranks of its mesh cannot compare their "
            "loads; the model is untouched"
        ) from exc


def _row(o: _Outcome) -> str:
    """What every rank reads of ``o``: failed or not, its host's and its stamps' digests."""
    return f"{int(bool(o.failure))},{_digest(o.host)},{_digest(repr(o.stamps))}"


def _full(o: _Outcome) -> str:
    """All of ``o``, read only when some row shows trouble."""
    return json.dumps([o.rank, o.host, o.failure, o.stamps])


def _outcome(text: str) -> _Outcome:
    rank, host, failure, stamps = json.loads(text)
    return _Outcome(rank, host, failure, tuple(tuple(s) for s in stamps))


def _exchanged(meets: Meeting | None, mine: _Outcome) -> list[_Outcome]:
    """Every rank's outcome across the mesh where some rank failed, did not arrive, or ranks
    on one machine read different files; else only this rank's. Each rank posts its row
    (failed, its host's digest, its stamps' digest) and reads everyone's; only when a row
    shows trouble are the whole outcomes read. Only this rank's where there is no one to
    compare with; only this rank's, not arrived, where the others gave up on it."""
    if meets is None:
        return [mine]
    if not meets.post(_row(mine), _full(mine)):
        return [dataclasses.replace(mine, arrived=False)]
    rows = meets.rows()
    late = [r for r, row in rows.items() if row == ABSENT]
    if late:
        return [_Outcome(r, "", "", (), arrived=False) for r in late]
    versions: dict[str, set[str]] = {}
    any_failed = False
    for row in rows.values():
        failed, host, stamps = row.split(",")
        versions.setdefault(host, set()).add(stamps)
        any_failed = any_failed or failed == "1"
    if not any_failed and all(len(v) == 1 for v in versions.values()):
        return [mine]
    return [_outcome(text) for text in meets.fulls(sorted(rows)).values()]


def _compared(model: nn.Module, meets: Meeting | None, mine: _Outcome, undo: _Undo) -> None:
    """Raise ``CheckpointError`` on a rank whose own fill went through when another rank's
    failed or did not arrive within the bound, when the comparison itself failed, or when
    ranks on one machine read different versions of a file (it was rewritten between their
    reads): either way the model mixes what it should not, so the caller puts back what
    ``undo`` can, and the messages say so."""
    name = type(model).__name__
    filled = "this rank's shards are filled" if undo.in_place else "this rank filled its shards"
    again = (
        f"{name} may differ across ranks: load it again on every rank"
        if undo.in_place
        else f"this rank puts {name} back as it was: load it again on every rank"
    )
    try:
        everyone = _exchanged(meets, mine)
    except Exception as exc:  # the store gone with the process that held it
        raise CheckpointError(
            f"{name}: {filled}, but it cannot compare them with the other "
            f"ranks of its mesh: the process group's store failed ({type(exc).__name__}: {exc}),"
            " as when the process holding it (rank 0's, unless torchrun's agent holds it) has "
            f"died; {again}"
        ) from exc
    late = [o.rank for o in everyone if not o.arrived]
    if late and meets is not None:
        bound = f"{meets.timeout:g} s ({TIMEOUT_VARIABLE} sets it)"
        if late == [mine.rank]:
            raise CheckpointError(
                f"{name}: {filled}, but the other ranks of its mesh gave "
                f"up waiting for it: it came more than {bound} after their fills; {again}"
            )
        raise CheckpointError(
            f"{name}: {filled}, but rank {', '.join(map(str, late))} did "
            f"not arrive within {bound}: interrupted, killed, or not calling load_into, which "
            f"every rank of the mesh must call; {again}"
        )
    failed = [o for o in everyone if o.failure]
    if failed:
        first = failed[0]
        ranks = ", ".join(str(o.rank) for o in failed)
        left = (
            f"this rank's shards are filled, so {name} is partly filled across ranks: every "
            "rank raises, so build it again once that is fixed"
            if undo.in_place
            else f"every rank raises, and this rank's {name} is put back as it was: load it "
            "again once that is fixed"
        )
        raise CheckpointError(
            f"rank {ranks} could not fill its part of {name} (rank {first.rank}: "
            f"{first.failure}); {left}"
        )
    _refuse_other_sources(name, everyone, undo)
    seen: dict[tuple[str, str], dict[tuple[int, ...], list[int]]] = {}
    for o in everyone:
        for path, *version in o.stamps:
            seen.setdefault((o.host, path), {}).setdefault(tuple(version), []).append(o.rank)
    for (_, path), versions in seen.items():
        if len(versions) > 1:
            who = "; ".join(
                f"rank {', '.join(map(str, ranks))} read {size} bytes modified at {mtime} ns"
                f" (inode {inode}, changed at {ctime} ns)"
                for (size, mtime, inode, _, ctime), ranks in versions.items()
            )
            fix = "build the model again and load" if undo.in_place else "load it again"
            raise CheckpointError(
                f"{path}: the ranks read different versions of it ({who}): it was rewritten "
                f"between their reads, so {name} mixes two checkpoints. Every rank raises; "
                f"{fix} once the writer is done"
            )


def _refuse_other_sources(name: str, everyone: list[_Outcome], undo: _Undo) -> None:
    """``CheckpointError`` where ranks on one machine read different files (told by device and
    inode, however a path spells them): copies or not, torchplace cannot tell without reading
    both, and where they differ the model mixes them. Ranks that read the same paths, one file
    rewritten between their reads, are left to the comparison of versions."""
    by_host: dict[str, dict[tuple[tuple[int, int], ...], list[_Outcome]]] = {}
    for o in everyone:
        files = tuple(sorted((device, inode) for _, _, _, inode, device, _ in o.stamps))
        by_host.setdefault(o.host, {}).setdefault(files, []).append(o)
    for sources in by_host.values():
        paths = {tuple(sorted(p for p, *_ in read[0].stamps)) for read in sources.values()}
        if len(sources) > 1 and len(paths) > 1:
            who = "; ".join(
                f"rank {', '.join(str(o.rank) for o in read)} read "
                f"{', '.join(path for path, *_ in read[0].stamps) or 'no file'}"
                for read in sources.values()
            )
            raise CheckpointError(
                f"{name}: the ranks of its mesh on one machine read different files ({who}). "
                "Copies or not, torchplace cannot tell without reading both, and where they "
                f"differ {name} mixes two checkpoints. Every rank raises; give every rank on a "
                "machine the same file (links and bind mounts of one file count as one), "
                f"{'build the model again and load it' if undo.in_place else 'and load it again'}"
            )


def _checked_plan(
    model: nn.Module,
    slots: list[Slot],
    located: _Located,
    *,
    strict: bool,
    meta_transient: list[str],
) -> list[tuple[Slot, Entry | Fused]]:
    """What fills each slot (an entry, or a fused tensor built from several), after the one key
    check of every fill: a source that does not fit raises, the model untouched."""
    entries, fused = located.entries, located.fused
    where = located.catalog.where
    named = located.catalog.path or where  # how a suggested call names the source
    check = check_keys(
        slots,
        entries,
        lambda e: (e.shape, entry_dtype(e).is_complex),
        built=lambda slot: any(n in fused for n in slot.names),
        complex_must_agree=True,
        lacking=located.lacking,
    )
    check.renamed = located.renamed
    plan: list[tuple[Slot, Entry | Fused]] = [
        (slot, entries[present[0]] if present else next(fused[n] for n in slot.names if n in fused))
        for slot, present in check.matched
    ]
    problems = check.shape_problems()
    if strict and meta_transient:
        problems.append(no_data_buffers(meta_transient, named, None))
    shapes = (  # what the key lists mean, weighed by shapes
        {n: e.shape for n, e in entries.items()},
        {n: tuple(s.tensor.shape) for s in slots for n in s.names},
    )
    if problems or (strict and (check.missing or check.unexpected)):
        fix = "; pass strict=False to load what matches" if plan and not problems else ""
        raise does_not_fit(
            where,
            type(model).__name__,
            check,
            problems,
            strict=strict,
            fix=fix,
            shapes=shapes,
            tail="; the model is untouched",
            named=named,
        )
    if not strict and not plan and slots:
        raise matches_nothing(where, type(model).__name__, check, shapes, named)
    planned = {id(slot) for slot, _ in plan}
    left = any(s.tensor.is_meta and id(s) not in planned for s in slots)  # warned of later
    if not strict and not left and (check.missing or check.unexpected):  # nothing changed yet
        warn_skipped(where, located.catalog.path, check.missing_names, list(check.unexpected))
    return plan


@dataclasses.dataclass
class _Located:
    """Step 1's findings: the source's catalog, its entries by the model's names, the entries as
    the file names them (what fused tensors are read from), the fused tensors a conversion
    builds, the file keys those it cannot build lack (``Plan.lacking``), and where the caller
    gave ``rename=``, how many keys the source held before it and how many it kept."""

    catalog: Catalog
    entries: dict[str, Entry]
    sources: dict[str, Entry]
    fused: dict[str, Fused]
    lacking: Mapping[str, tuple[str, ...]]
    renamed: tuple[int, int] | None


def _located(
    model: nn.Module, source: Any, rename: Rename | None, check_crc: bool | None
) -> _Located:
    """Step 1: the source catalogued (its zip records' CRC-32s checked, with ``check_crc``),
    its entries renamed and converted to the model's names."""
    source_catalog = catalog(source)  # a file, an index, a directory or a mapping
    if check_crc:
        for path, fmt in source_catalog.kinds.items():
            if fmt == "zip":
                check_records(path)
        read = source_catalog.path
        if read is not None:
            warn_unchecked_safetensors(read, source_catalog.kind, source_catalog.kinds)
    where = source_catalog.where
    held = _sharded_entries(source_catalog)
    entries = _renamed(held, rename, where)
    counts = (len(held), len(entries)) if given(rename) else None  # what the caller's kept
    # A transformers model's hub names: renamed entries, and fused tensors read piece by piece.
    conversions = conversion_plan(model, {n: (e.shape, entry_dtype(e)) for n, e in entries.items()})
    if conversions is None:
        return _Located(source_catalog, entries, entries, {}, {}, counts)
    converted, fused = _converted(where, conversions, entries)
    return _Located(source_catalog, converted, entries, fused, conversions.lacking, counts)


def _placed(
    plan: list[tuple[Slot, Entry | Fused]], target: torch.device | None, where: str
) -> tuple[list[Any], torch.device | None, torch.device]:
    """Step 3: each planned tensor's boxes on this rank, the device meta tensors get memory on
    (None: none is on meta), and where new memory goes; refused where a tensor cannot be
    filled where it is."""
    if target is not None and target.type == "meta":
        raise CheckpointError(
            f"{where}: device='meta' holds no data, so a sharded model cannot be filled there; "
            "leave the device out, torchplace.load_into(model, source), to fill each rank's "
            "shards where they are"
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
                "model's tensors where they are; leave the device out, "
                "torchplace.load_into(model, source), or build the model on "
                f"{target} (or call model.to_empty(device={str(target)!r})) first"
            )
        if _is_dtensor(t):
            mesh_type = t.device_mesh.device_type  # type: ignore[attr-defined]
            kind = materialize_on if t.is_meta else t.device
            if kind is not None and kind.type != mesh_type:
                raise CheckpointError(
                    f"{name}: its device mesh is on {mesh_type} but it would be filled on "
                    f"{kind}; pass that device, torchplace.load_into(model, source, "
                    f"{mesh_type!r})"
                )

    return pieces, materialize_on, new_home


def _read_plan(
    model: nn.Module,
    where: str,
    stamps: Mapping[Path, Stamp],
    plan: list[tuple[Slot, Entry | Fused]],
    pieces: list[Any],
    sources: Mapping[str, Entry],
    materialize_on: torch.device | None,
    progress: bool | None,
    undo: _Undo,
) -> None:
    """Step 4: meta tensors given memory, then every box read into its local shard, what
    ``undo`` puts back recorded first; a failure says what the model is left as."""
    # shards already resident (no skeleton) are filled in place, their pages not touched first
    reader = BoxReader(stamps, fresh=materialize_on is not None)
    total = sum(
        math.prod(shape) * (e.dtype if isinstance(e, Fused) else entry_dtype(e)).itemsize
        for (_, e), (shape, _) in zip(plan, pieces, strict=True)
    )
    shown = contextlib.ExitStack()  # the progress bar, closed in the finally below
    shown.enter_context(reporting(total, f"load_into {Path(where).name}", progress))
    try:
        undo.record(model, [slot for slot, _ in plan])
        if materialize_on is not None:
            undo.changed = True
            _materialize(model, [slot for slot, _ in plan], materialize_on)
        with torch.no_grad():
            for (slot, filled_from), (shape, parts) in zip(plan, pieces, strict=True):
                dest = _local(slot.tensor)
                if tuple(dest.shape) != shape:  # FSDP2 may keep a padded shard: fill its part
                    dest = dest[tuple(slice(0, n) for n in shape)]
                undo.changed = True
                for box, into in parts:
                    held = dest[into] if into else dest
                    if isinstance(filled_from, Fused):  # each piece of the file into its part
                        for key, part, index in fused_boxes(filled_from, box) or []:
                            queue_box(reader, sources[key], part, held[index])
                        continue
                    queue_box(reader, filled_from, box, held)
        reader.flush()  # every queued run, one read call per file
        reader.verify()  # the files are still those catalogued: no mix of old and new bytes
    except CheckpointError as exc:
        if not undo.changed:
            raise
        raise CheckpointError(f"{exc}; {undo.said(type(model).__name__)}") from exc
    except TorchplaceError:
        raise
    except Exception as exc:
        state = undo.said("the model")
        try:  # a file cut short or rewritten under the read: say that it changed
            reader.verify()
        except CheckpointError as moved:
            raise CheckpointError(f"{moved}; {state}") from exc
        raise CheckpointError(
            f"{where}: could not be read into {type(model).__name__} ({type(exc).__name__}: "
            f"{exc}); {state}"
        ) from exc
    finally:
        try:
            reader.close()  # closes every file even through a Ctrl-C, then raises it
        finally:
            shown.close()


def _fill_sharded(
    model: nn.Module, source: Any, device: Any, undo: _Undo, **how: Any
) -> Mapping[Path, Stamp]:
    """``load_sharded``'s fill on this rank (``how``: its keywords), what ``undo`` puts back
    recorded; returns the stamps of the checkpoint's files."""
    strict: bool = how["strict"]
    rename: Rename | None = how["rename"]
    check_crc: bool | None = how["check_crc"]
    progress: bool | None = how["progress"]
    located = _located(model, source, rename, check_crc)
    source_catalog = located.catalog
    where = source_catalog.where
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

    plan = _checked_plan(model, slots, located, strict=strict, meta_transient=meta_transient)

    pieces, materialize_on, new_home = _placed(plan, target, where)

    # Tensors that stay on meta (keys the file lacks, with strict=False): said before any read,
    # so that where warnings are errors, the model is untouched.
    planned = {id(slot) for slot, _ in plan}
    left = [s for s in (*slots, *found.transient) if s.tensor.is_meta and id(s) not in planned]
    if left:
        warn_left_on_meta(
            left_on_meta(model, where, left, strict, new_home, located.renamed is not None),
            path=source_catalog.path,
            missing=[s.names[0] for s in left],
        )
    stamps = source_catalog.stamps
    sources = located.sources
    _read_plan(model, where, stamps, plan, pieces, sources, materialize_on, progress, undo)
    return source_catalog.stamps
