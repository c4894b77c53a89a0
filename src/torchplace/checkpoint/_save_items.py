"""What ``save`` writes for an object: the tensors of a model or a mapping, named for the file.

A model's tensors are its state dict, every tied parameter once: under the first name it has
in the state dict, or, for a transformers model, under the name ``save_pretrained`` keeps (its
own ``remove_tied_weights_from_state_dict``), and renamed as ``save_pretrained`` renames them
(its own ``revert_weight_conversion``: a transformers 5 Mixtral's fused
``mlp.experts.gate_up_proj`` is written as the hub's per-expert ``w1``/``w3``), so that
``from_pretrained`` reads the result. Nothing is read or copied here: each ``Item`` gives its
values when the writer reaches it. A parameter that a dispatched model left in its checkpoint
(the ``meta`` placeholder of a ``"disk"`` module) is read from that checkpoint then: one leaf
module's weights at a time, or, where transformers' reversal computes the saved tensors from
them (a Mixtral layer's fused experts split again), one disk module's at a time. Its name and
shape are known before, from the reversal run on the placeholders themselves. Any other
``meta`` tensor is refused before anything is written.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._errors import CheckpointError, PlacementError
from .._model_walk import display
from ..moving._offloaded import Home, disk_placeholders, homes
from ._atomic import model_file
from ._disk_weights import CheckpointWeights
from ._writers import Item

__all__ = ["check_not_read_from", "items_of", "transformers_model"]


def transformers_model(obj: object) -> bool:
    """Whether ``obj`` is a transformers model (never imports transformers to say no)."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(obj, tf.PreTrainedModel)


def items_of(obj: object, /) -> list[Item]:
    """The tensors ``save`` writes for ``obj`` (a model or a mapping of names to tensors)."""
    if isinstance(obj, Mapping):
        return _shared([_mapping_item(name, value) for name, value in obj.items()], obj)
    if not isinstance(obj, nn.Module):
        raise CheckpointError(
            f"save() writes a model or a mapping of names to tensors, not a {type(obj).__name__}"
        )
    state = obj.state_dict(keep_vars=True)
    with torch.no_grad():
        if not transformers_model(obj):
            return _model_items(obj, _untied(state), dict)
        return _model_items(obj, _transformers_kept(obj, state), _reversal(obj))


def check_not_read_from(obj: object, target: Path, directory: bool) -> None:
    """Refuse a save of ``obj`` to ``target`` (a file, or a directory: its model files) where a
    ``"disk"`` module of ``obj`` reads its weights from a file that the save would replace:
    every later read of that module would find its checkpoint changed (``FileChanged``). A
    directory's other files are linked into the new one as they are: reading them is fine."""
    if not isinstance(obj, nn.Module):
        return
    replaced = _spellings(target)
    checked: set[int] = set()  # the disk modules of one load share its catalog: checked once
    for path, _, home in homes(obj):
        if not isinstance(home.source, CheckpointWeights) or id(home.source.found) in checked:
            continue
        found = home.source.found
        checked.add(id(found))
        for file in [*found.stamps, *([found.path] if found.path is not None else [])]:
            read = _spellings(Path(file))
            if read & replaced or (
                directory and any(f.parent in replaced and model_file(f.name) for f in read)
            ):
                raise CheckpointError(
                    f"{target}: {display(path)} is on disk and reads its weights from {file}, "
                    "which this save would replace (nothing was written); save to another "
                    "path, or gather the model first with torchplace.move(model, 'cpu'), "
                    "then save",
                    path=target,
                )


def _spellings(path: Path) -> set[Path]:
    """``path`` with its directories' links resolved, and with its own too: a link in a
    snapshot directory (a Hugging Face cache's, into its blobs) is replaced by a save to that
    directory, and the file it names by a save to that file."""
    path = Path(os.path.abspath(path))
    return {path.parent.resolve() / path.name, path.resolve()}


def _reversal(model: Any) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """transformers' own reversal of its conversions (transformers 5), else nothing to
    reverse (transformers 4 converts nothing on load; its legacy names are ``_kept``'s)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return dict
    return functools.partial(revert_weight_conversion, model)


def _mapping_item(name: object, value: object) -> Item:
    if not isinstance(name, str):
        raise CheckpointError(f"save() names tensors with strings, not {name!r}")
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(
            f"[{name!r}] is a {type(value).__name__}, not a tensor; a checkpoint file holds "
            "tensors only (save other values beside it, in a JSON file)"
        )
    if value.is_meta:
        raise PlacementError(
            f"[{name!r}] is on meta and has no values to save; fill it first (load_into)"
        )
    _check_strided(f"[{name!r}]", value)
    t = value.detach()
    return Item(name, t.dtype, tuple(t.shape), lambda: t)


def _check_strided(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor a checkpoint file cannot hold as it is: a sparse one (or another layout
    than strided, as ``mkldnn``), before anything is written."""
    if t.layout != torch.strided:
        layout = str(t.layout).removeprefix("torch.")
        raise CheckpointError(
            f"{name} is a {layout} tensor, and a checkpoint file holds dense tensors only "
            "(nothing was written); save it dense, with .to_dense()"
        )


def _shared(items: list[Item], mapping: Mapping[str, torch.Tensor]) -> list[Item]:
    """``items`` of ``mapping``, each key whose tensor is one written before (the same values:
    the same storage, offset, shape and strides) marked ``same_as`` that key's: every key is
    written, and a torch file gives them one storage, as ``torch.save`` does."""
    first: dict[tuple[Any, ...], str] = {}
    for it in items:
        t = mapping[it.name]
        if t.numel() == 0 or type(t) not in (torch.Tensor, nn.Parameter):
            continue
        where = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype,
                 tuple(t.shape), t.stride())  # fmt: skip
        it.same_as = first.setdefault(where, it.name)
        if it.same_as == it.name:
            it.same_as = None
    return items


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each tensor object once, under its first name."""
    seen: set[int] = set()
    kept = {}
    for name, t in state.items():
        if id(t) not in seen:
            seen.add(id(t))
            kept[name] = t
    return kept


def _transformers_kept(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` as ``save_pretrained`` keeps it before its conversions are reversed: tied
    weights once (under the name it keeps), the keys it ignores on save left out."""
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # transformers 4
        return _as_transformers_4_keeps(model, state)
    kept: dict[str, torch.Tensor] = remove_tied_weights_from_state_dict(dict(state), model)
    return kept


def _as_transformers_4_keeps(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What transformers 4's ``save_pretrained`` keeps: a multimodal model's keys renamed to
    its legacy names (its ``_checkpoint_conversion_mapping`` reversed), then of each group of
    tied names those its ``_tied_weights_keys`` match dropped (by sorted name, one kept)."""
    from transformers import modeling_utils

    vlms = getattr(modeling_utils, "VLMS", ())
    if any(v in c.__name__.lower() for c in type(model).__mro__[:-1] for v in vlms):
        mapping = getattr(model, "_checkpoint_conversion_mapping", None) or {}
        state = {_legacy_name(key, mapping): t for key, t in state.items()}
    patterns = modeling_utils._get_tied_weight_keys(model) or []
    groups: dict[int, list[str]] = {}
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    dropped: set[str] = set()
    for names in groups.values():
        matched = [n for n in sorted(names) if any(re.search(p, n) for p in patterns)]
        dropped.update(matched[: len(names) - 1])
    return _untied({name: t for name, t in state.items() if name not in dropped})


def _legacy_name(key: str, mapping: dict[str, str]) -> str:
    """``key`` renamed by the first pattern of ``mapping`` reversed that matches it, as
    transformers 4's ``save_pretrained`` renames it."""
    for pattern, replacement in {v: k for k, v in mapping.items()}.items():
        replacement = re.sub(r"\(.*\)", "", replacement.lstrip("^"))
        key, n = re.subn(pattern, replacement, key)
        if n:
            break
    return key


def _model_items(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    revert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
) -> list[Item]:
    """The items of ``state`` (the model's names), renamed by ``revert``: the tensors in
    memory at once; each disk module's by reverting its placeholders (on ``meta``: names and
    shapes only), read from the checkpoint when written."""
    placeholders = disk_placeholders(model)
    units = {path: home for path, _, home in homes(model) if home.tier == "disk"}
    resident: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}  # disk module -> its placeholders
    for name, t in state.items():
        if not t.is_meta:
            _check_strided(display(name), t)
            resident[name] = t
        elif id(t) in placeholders:
            unit = next(u for u in units if _within(name, u))
            parts.setdefault(unit, {})[name] = t
        else:
            raise PlacementError(
                f"{display(name)} is on meta and has no values to save (nothing was written); "
                "fill the model first, torchplace.load_into(model, checkpoint), or move it to "
                "a real device"
            )
    items = [_resident(name, t.detach()) for name, t in revert(resident).items()]
    reader = _DiskReader(revert)
    for unit, part in parts.items():
        names = {id(t): name for name, t in part.items()}
        reverted = revert(part)
        passed = all(id(t) in names for t in reverted.values())  # renamed at most
        for name, t in reverted.items():
            local = names[id(t)][len(unit) + 1 if unit else 0 :] if passed else None
            get = reader.getter(unit, units[unit], local, list(part), name)
            items.append(Item(name, t.dtype, tuple(t.shape), get, resident=False))
    return items


def _resident(name: str, value: torch.Tensor) -> Item:
    """The item of a tensor in memory; a DTensor's is its gather (``full_tensor``), which
    every rank takes part in."""
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is not None and isinstance(value, tensor_module.DTensor):
        return Item(name, value.dtype, tuple(value.shape), value.full_tensor, collective=True)
    return Item(name, value.dtype, tuple(value.shape), lambda: value)


def _within(name: str, unit: str) -> bool:
    return not unit or name.startswith(unit + ".")


class _DiskReader:
    """Reads a disk module's weights from their checkpoint when they are written: one owning
    module's at a time where the names were only changed, else the whole disk module's,
    converted as ``revert`` converts them (a transformers 5 Mixtral layer's experts); the last
    read is kept, for the tensors written next."""

    def __init__(self, revert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]):
        self.revert = revert
        self._key: tuple[str, str | None] | None = None
        self._values: dict[str, torch.Tensor] = {}

    def getter(
        self, unit: str, home: Home, local: str | None, names: list[str], saved: str
    ) -> Callable[[], torch.Tensor]:
        """What gives the tensor saved as ``saved``: the weight ``local`` of the disk module
        ``unit``, or (``local`` None) the one ``revert`` makes of the module's ``names``."""
        owner = local.rpartition(".")[0] if local is not None else None

        def get() -> torch.Tensor:
            if self._key != (unit, owner):
                self._values = {}  # the last read let go before the next
                self._values = self._read(unit, home, owner, names)
                self._key = (unit, owner)
            return self._values[local if local is not None else saved]

        return get

    def _read(
        self, unit: str, home: Home, owner: str | None, names: list[str]
    ) -> dict[str, torch.Tensor]:
        source = home.source
        assert source is not None
        if owner is not None:
            return (source.only(owner) if owner else source).read(torch.device("cpu"))
        head = f"{unit}." if unit else ""
        read = source.read(torch.device("cpu"))
        wanted = set(names)
        with torch.no_grad():
            return self.revert({head + k: v for k, v in read.items() if head + k in wanted})
