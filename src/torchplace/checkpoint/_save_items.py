"""What ``save`` writes for an object: the tensors of a model or a mapping, named for the file.

A model's tensors are its state dict, every tied parameter once: under the first name it has
in the state dict, or, for a transformers model, under the name ``save_pretrained`` keeps (its
own ``remove_tied_weights_from_state_dict``), and renamed as ``save_pretrained`` renames them
(its own ``revert_weight_conversion``: a transformers 5 Mixtral's fused
``mlp.experts.gate_up_proj`` is written as the hub's per-expert ``w1``/``w3``), so that
``from_pretrained`` reads the result. Nothing is read or copied here: each ``Item`` gives its
values when the writer reaches it. A parameter that a dispatched model left in its checkpoint
(the ``meta`` placeholder of a ``"disk"`` module) is read from that checkpoint then, one module's
weights at a time; any other ``meta`` tensor is refused before anything is written.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._errors import CheckpointError, PlacementError
from .._model_walk import display
from ..moving._offloaded import Home, disk_placeholders, homes
from ._writers import Item

__all__ = ["items_of", "transformers_model"]


def transformers_model(obj: object) -> bool:
    """Whether ``obj`` is a transformers model (never imports transformers to say no)."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(obj, tf.PreTrainedModel)


def items_of(obj: object, /) -> list[Item]:
    """The tensors ``save`` writes for ``obj`` (a model or a mapping of names to tensors)."""
    if isinstance(obj, Mapping):
        return [_mapping_item(name, value) for name, value in obj.items()]
    if not isinstance(obj, nn.Module):
        raise CheckpointError(
            f"save() writes a model or a mapping of names to tensors, not a {type(obj).__name__}"
        )
    state = obj.state_dict(keep_vars=True)
    with torch.no_grad():
        if transformers_model(obj):
            state, origin = _as_transformers_saves(obj, state)
        else:
            state, origin = _untied(state), _first_names(state)
    return _model_items(obj, state, origin)


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
    t = value.detach()
    return Item(name, t.dtype, tuple(t.shape), lambda: t)


def _first_names(state: dict[str, torch.Tensor]) -> dict[int, str]:
    """The first name of each tensor object in ``state``."""
    first: dict[int, str] = {}
    for name, t in state.items():
        first.setdefault(id(t), name)
    return first


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each tensor object once, under its first name."""
    seen: set[int] = set()
    kept = {}
    for name, t in state.items():
        if id(t) not in seen:
            seen.add(id(t))
            kept[name] = t
    return kept


def _as_transformers_saves(
    model: Any, state: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[int, str]]:
    """``state`` as ``save_pretrained`` writes it: tied weights once, ignored keys left out,
    transformers' conversions reversed. Second: the model name of each tensor object that the
    reversal passed through unchanged (a disk module's placeholder is read by it)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    origin = _first_names(state)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(dict(state), model)
    return revert_weight_conversion(model, state), origin


def _model_items(
    model: nn.Module, state: dict[str, torch.Tensor], origin: dict[int, str]
) -> list[Item]:
    placeholders = disk_placeholders(model)
    units = [(path, home) for path, _, home in homes(model) if home.tier == "disk"]
    reader = _DiskReader()
    items = []
    for name, t in state.items():
        if not t.is_meta:
            items.append(_resident(name, t.detach()))
            continue
        model_name = origin.get(id(t))
        if id(t) not in placeholders or model_name is None:
            raise _no_values(model, name, model_name, id(t) in placeholders)
        unit, home = next((u, h) for u, h in units if _within(model_name, u))
        get = reader.getter(unit, home, model_name[len(unit) + 1 if unit else 0 :])
        items.append(Item(name, t.dtype, tuple(t.shape), get, resident=False))
    return items


def _resident(name: str, value: torch.Tensor) -> Item:
    return Item(name, value.dtype, tuple(value.shape), lambda: value)


def _within(name: str, unit: str) -> bool:
    return not unit or name.startswith(unit + ".")


def _no_values(model: nn.Module, name: str, model_name: str | None, disk: bool) -> Exception:
    shown = display(model_name or name)
    if disk:  # a disk weight that transformers' reversal had to compute from
        return CheckpointError(
            f"{shown} lies in its checkpoint ('disk'), and transformers' conversion of "
            f"{type(model).__name__} must compute {name!r} from it: gather the model first, "
            "torchplace.move(model, 'cpu'), then save it"
        )
    return PlacementError(
        f"{shown} is on meta and has no values to save (nothing was written); fill the model "
        "first, torchplace.load_into(model, checkpoint), or move it to a real device"
    )


class _DiskReader:
    """Reads a disk module's weights from their checkpoint, one owning module's at a time
    (the last one kept, for the tensors of the same module written next)."""

    def __init__(self) -> None:
        self._key: tuple[str, str] | None = None
        self._values: dict[str, torch.Tensor] = {}

    def getter(self, unit: str, home: Home, local: str) -> Callable[[], torch.Tensor]:
        owner = local.rpartition(".")[0]

        def get() -> torch.Tensor:
            if self._key != (unit, owner):
                self._values = {}  # the last module's weights let go before the next read
                source = home.source
                assert source is not None
                source = source.only(owner) if owner else source
                self._values = source.read(torch.device("cpu"))
                self._key = (unit, owner)
            return self._values[local]

        return get
