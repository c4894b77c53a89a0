"""Fused tensors read straight into their memory: a transformers model's tensor built from
several file tensors (experts stacked, projections side by side) is allocated once, in the
model's dtype, and each file tensor read into its slice of it, where the file's names would
otherwise be read whole and copied in (``apply_plan``). Shared by ``load_into``'s plain fill and
the disk tier's reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ._conversions import Fused, Plan, conversion_plan, converted, fused_boxes
from ._entries import Catalog
from ._load import Alloc, read_assembled, whole_plan
from ._plan_items import Assembled, Part
from ._zip_read import DTypeWish

__all__ = ["Direct", "direct_reads", "read_direct", "with_fused"]


@dataclasses.dataclass
class Direct:
    """A file source whose fused tensors are read straight into their memory: the catalog, the
    fused tensors (by the model's name) as boxes of catalog entries, the file names read whole,
    and the rest of the conversion plan (applied once those are read)."""

    found: Catalog
    fused: dict[str, Assembled]
    whole: list[str]
    rest: Plan


def direct_reads(
    found: Catalog,
    model: nn.Module,
    names: Mapping[str, str],
    keys: list[str] | None = None,
) -> Direct | None:
    """How to read the catalog's entries ``names`` (the name the plan knows -> the file's key)
    so that each fused model tensor whose pieces are whole entries is read straight into its
    slices; None where nothing is (no conversion plan, nothing fused that is a box of whole
    entries). ``keys``: the file keys read whole besides (default: every entry of the
    catalog). A conversion's error propagates as ``conversion_plan`` raises it."""
    shapes = {}
    for new, key in names.items():
        e = found.entries[key]
        shapes[new] = (e.shape, e.torch_dtype(found.where))
    plan = conversion_plan(model, shapes)
    if plan is None or not plan.fused:
        return None
    uses = _source_uses(plan)
    straight: dict[str, Assembled] = {}
    kept: list[Fused] = []
    for f in plan.fused:
        made = _assembled(found, names, f, uses)
        if made is None or f.name in names:
            kept.append(f)
        else:
            straight[f.name] = made
    if not straight:
        return None
    taken = {names[piece.source] for f in plan.fused if f.name in straight for piece in f.pieces}
    whole = [k for k in (found.entries if keys is None else keys) if k not in taken]
    rest = dataclasses.replace(plan, fused=kept)
    return Direct(found, straight, whole, rest)


def _source_uses(plan: Plan) -> dict[str, int]:
    """How many times the plan uses each file tensor: renamed, computed from, fused, or one a
    model tensor whose shape differs would be built from (``mismatched_sources``)."""
    uses: dict[str, int] = {}
    for source in [*plan.renames.values(), *(s for c in plan.computed for s in c.sources)]:
        uses[source] = uses.get(source, 0) + 1
    for f in plan.fused:
        for piece in f.pieces:
            uses[piece.source] = uses.get(piece.source, 0) + 1
    for source in plan.mismatched_sources:
        uses[source] = uses.get(source, 0) + 1
    return uses


def _assembled(
    found: Catalog, names: Mapping[str, str], f: Fused, uses: Mapping[str, int]
) -> Assembled | None:
    """``f`` as boxes of catalog entries for ``read_assembled``, or None where a piece is not a
    whole entry at one box (a chunk of it, a transpose, a stack along a later dim) or feeds
    another tensor too."""
    boxes = fused_boxes(f, ((0,) * len(f.shape), f.shape))
    if boxes is None or len(boxes) != len(f.pieces):
        return None
    pieces = []
    for source, _, index in boxes:
        entry = found.entries[names[source]]
        if uses.get(source) != 1 or not entry.addressable:
            return None
        lead = len(index) - len(entry.shape)
        if lead < 0 or not all(isinstance(i, int) for i in index[:lead]):
            return None  # the entry's dims are not the destination's trailing ones
        if not all(isinstance(i, slice) for i in index[lead:]):
            return None
        at = tuple(i if isinstance(i, int) else i.start for i in index)
        pieces.append(Part(entry, at))
    return Assembled(f.shape, f.dtype, pieces)


def read_direct(
    direct: Direct,
    read_on: torch.device,
    wish: DTypeWish | None,
    *,
    fresh: bool = True,
    threads: int | None = None,
    alloc: Alloc | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The file's tensors read whole (by the file's names) and the fused ones (by the model's),
    read side by side in one pass over the files (``fresh``, ``threads``: as ``read_into``
    takes them)."""
    found = direct.found
    plan = whole_plan(found, list(direct.whole), wish)
    fused_keys = {name: _apart(f"{name} (fused)", found.entries) for name in direct.fused}
    plan.update({fused_keys[name]: made for name, made in direct.fused.items()})
    read = read_assembled(found, plan, read_on, fresh=fresh, threads=threads, alloc=alloc)
    assembled = {name: read.pop(key) for name, key in fused_keys.items()}
    return read, assembled


def _apart(key: str, taken: Mapping[str, Any]) -> str:
    """``key``, primed until no file key has its name (a file may hold any name)."""
    while key in taken:
        key += "'"
    return key


def with_fused(
    label: str,
    model_name: str,
    rest: Plan,
    state: Mapping[str, Any],
    assembled: Mapping[str, torch.Tensor],
) -> Any:
    """``state`` (renamed) under the model's names: the rest of the plan applied, then the fused
    tensors read straight into their memory added (no file key holds their names: a fused
    tensor whose name the file holds too stays in the rest of the plan)."""
    out: Any = converted(label, model_name, rest, state, owned=True)
    out.update(assembled)
    return out
