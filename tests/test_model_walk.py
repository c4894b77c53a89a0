"""The one slot walk ``load_into`` (plain and sharded) and ``move`` read a model through."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import torchplace
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


def test_loadable_tensors_come_in_state_dict_order() -> None:
    """A buffer first seen where it is non-persistent takes its place where it is saved."""
    shared = torch.zeros(2)
    model = nn.Module()
    model.a = nn.Module()
    model.a.register_buffer("t", shared, persistent=False)
    model.b = nn.Linear(1, 1)
    model.c = nn.Module()
    model.c.register_buffer("t", shared)
    slots = tensor_slots(model)
    assert [s.names[0] for s in slots.loadable] == list(model.state_dict())


class SelfLinked(nn.Module):
    """A child holding a link back to its parent: the module tree has a loop."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(2, 2)
        self.child.owner = self


def test_a_move_visits_each_module_once_and_a_model_that_contains_itself_still_moves() -> None:
    model = SelfLinked()
    slots = tensor_slots(model, every_name=False)
    assert [path for path, _ in slots.modules] == ["", "child"]
    assert torchplace.move(model, "meta") is model and model.child.weight.is_meta


def test_loading_a_model_that_contains_itself_says_so() -> None:
    with pytest.raises(torchplace.TorchplaceError, match="SelfLinked model contains itself"):
        torchplace.load_into(SelfLinked(), {"child.weight": torch.ones(2, 2)})


# --- attributes that raise when read ---------------------------------------------------------


@dataclasses.dataclass
class LayerConfig:
    """A configuration that refuses to give one value for an attribute that varies per layer,
    as transformers 5's heterogeneous configs (gemma4's ``head_dim``) do."""

    width: int
    head_dim: int
    table: torch.Tensor

    def __getattribute__(self, name: str) -> Any:
        if name == "head_dim":
            raise RuntimeError("'head_dim' is a per-layer attribute; read it per layer")
        return super().__getattribute__(name)


class Lazy:
    """An object with its own .to whose property (shadowing a stored value) raises."""

    def __init__(self) -> None:
        self.values = torch.zeros(2)
        self.__dict__["broken"] = 1

    @property
    def broken(self) -> int:
        raise ValueError("not computed yet")

    def to(self, device: Any) -> Lazy:
        moved = Lazy()
        moved.values = self.values.to(device)
        return moved


class Configured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.config = LayerConfig(2, 8, torch.ones(3))  # a tensor beside the raising attribute
        self.lazy = Lazy()


def test_an_attribute_that_raises_is_skipped_by_report_verify_and_move() -> None:
    model = Configured()
    table = model.config.table
    rows = torchplace.report(model, detail=True).rows
    assert [r.path for r in rows if r.kind == "attribute"] == ["config.table", "lazy.values"]
    assert torchplace.stragglers(model, "cpu") == []
    torchplace.verify(model, "cpu")
    with pytest.warns(UserWarning, match=r"holding tensors off meta \(config, lazy\)"):
        torchplace.move(model, "meta")
    assert model.linear.weight.is_meta
    assert model.config.table is table  # left as Module.to leaves it (attributes="warn")
    names = [s.name for s in torchplace.stragglers(model, "meta")]
    assert "config.table" in names
    torchplace.move(model, "meta", attributes="move")
    assert model.config.table.is_meta
    assert model.config.width == 2  # the rebuilt config keeps what it holds...
    with pytest.raises(RuntimeError, match="per-layer"):
        model.config.head_dim  # noqa: B018 (...and still refuses what it refused)
    assert model.lazy.values.is_meta  # moved by its own .to()
    assert torchplace.stragglers(model, "meta") == []


class TakesConfig(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: torch.Tensor, config: LayerConfig) -> torch.Tensor:
        return x * self.scale


def test_a_guard_skips_an_input_attribute_that_raises() -> None:
    model = TakesConfig()
    with torchplace.guard(model):
        assert model(torch.ones(2), config=LayerConfig(2, 8, torch.ones(3))).shape == (2,)
        on_meta = LayerConfig(2, 8, torch.ones(3, device="meta"))
        with pytest.raises(torchplace.DeviceMismatchError, match=r"input\['config'\].table"):
            model(torch.ones(2), config=on_meta)
