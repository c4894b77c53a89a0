"""The one slot walk ``load_into`` (plain and sharded) and ``move`` read a model through."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchplace._model_walk import tensor_slots


class Shared(nn.Module):
    """A module under two names, a tied weight, a non-persistent buffer and extra state."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(3, 3)
        self.alias = self.enc  # one module, two names
        self.head = nn.Linear(3, 3)
        self.head.weight = self.enc.weight  # tied
        self.register_buffer("mask", torch.ones(3), persistent=False)
        self.register_buffer("scale", torch.full((1,), 2.0))

    def get_extra_state(self) -> Any:
        return {"v": 1}

    def set_extra_state(self, state: Any) -> None:
        pass


def test_slots_list_each_tensor_once_in_state_dict_order_with_all_its_names() -> None:
    model = Shared()
    slots = tensor_slots(model)
    names = [name for slot in slots.loadable for name in slot.names]
    assert sorted(names) == sorted(k for k in model.state_dict() if k != "_extra_state")
    assert [slot.names[0] for slot in slots.loadable] == [
        "scale",
        "enc.weight",
        "enc.bias",
        "head.bias",
    ]
    weight = slots.loadable[1]
    assert weight.tensor is model.enc.weight and weight.is_param
    assert weight.names == ["enc.weight", "alias.weight", "head.weight"]
    # every module holding it, each once: the aliased module is one home under two names
    assert [(m, a) for m, a in weight.homes] == [(model.enc, "weight"), (model.head, "weight")]


def test_non_persistent_buffers_are_transient_and_extra_state_owners_are_named() -> None:
    model = Shared()
    slots = tensor_slots(model)
    assert [(s.names, s.persistent, s.tensor is model.mask) for s in slots.transient] == [
        (["mask"], False, True)
    ]
    assert slots.extra_state == {"_extra_state": model}


def test_a_buffer_registered_persistent_anywhere_is_loaded_under_those_names() -> None:
    shared = torch.zeros(2)
    model = nn.Module()
    model.a = nn.Module()
    model.b = nn.Module()
    model.a.register_buffer("table", shared, persistent=False)
    model.b.register_buffer("table", shared)
    slots = tensor_slots(model)
    assert slots.transient == []
    (slot,) = slots.loadable
    assert slot.names == list(model.state_dict()) == ["b.table"]
    assert slot.homes == [(model.a, "table"), (model.b, "table")]  # both get the loaded tensor
