"""Accelerate's big-modeling cases, run through torchplace's API.

The models and maps are those of Accelerate's own tests (a Linear, a BatchNorm and a Linear; a
bigger model of five modules; tied weights; a model with an unused submodule), and so is the
tolerance they check (``atol=1e-5``); torchplace is also held to bit for bit. Accelerate itself
passes each of these on the same machine; before this round torchplace refused many of them
(a BatchNorm on disk, a whole model on disk, a call with gradients, a flat index).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace

ATOL = 1e-5  # Accelerate's tests compare with this tolerance


class ModelForTest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.batchnorm(self.linear1(x)))


class BiggerModelForTest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.linear2 = nn.Linear(4, 5)
        self.batchnorm = nn.BatchNorm1d(5)
        self.linear3 = nn.Linear(5, 6)
        self.linear4 = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear4(self.linear3(self.batchnorm(self.linear2(self.linear1(x)))))


class WithUnusedSubmodule(ModelForTest):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(5, 5)  # never called by forward


class TiedWeights(nn.Module):
    """Accelerate's tied-weights model: two Linears sharing one weight, a BatchNorm between."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(4, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 4)
        self.linear2.weight = self.linear1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.batchnorm(self.linear1(x)))


def trained(make: type[nn.Module]) -> nn.Module:
    """The model with BatchNorm statistics of its own (not the initial ones), in eval mode."""
    torch.manual_seed(0)
    model = make()
    with torch.no_grad():
        model.train()
        model(torch.randn(16, model.linear1.in_features))
    return model.eval()


def saved(model: nn.Module, where: Path, *, flat_index: bool = False) -> Path:
    """The model's state dict as safetensors: one file, or two shards with an index."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if not flat_index:
        save_file(state, str(where / "model.safetensors"))
        return where / "model.safetensors"
    keys = sorted(state)
    half = len(keys) // 2
    index: dict[str, str] = {}
    for name, part in (("a.safetensors", keys[:half]), ("b.safetensors", keys[half:])):
        save_file({k: state[k] for k in part}, str(where / name))
        index.update(dict.fromkeys(part, name))
    (where / "index.json").write_text(json.dumps(index))  # Accelerate's flat form
    return where / "index.json"


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.allclose(got, want, atol=ATOL)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "device_map",
    [
        {"": "disk"},
        {"linear1": "disk", "batchnorm": "cpu", "linear2": "disk"},
        {"linear1": "cpu", "batchnorm": "disk", "linear2": "cpu"},
        {"linear1": "disk", "batchnorm": "disk", "linear2": "disk"},
    ],
)
def test_model_for_test_on_disk(tmp_path: Path, device_map: dict[str, str]) -> None:
    """Accelerate's ``disk_offload`` and ``dispatch_model`` with disk entries, BatchNorm's
    statistics among the disk module's state."""
    model = trained(ModelForTest)
    path = saved(model, tmp_path)
    x = torch.randn(2, 3)
    with torch.no_grad():
        want = model(x)
        loaded = torchplace.load_into(
            torchplace.skeleton(ModelForTest), path, device_map=device_map
        )
        check(loaded.eval()(x), want)


def test_bigger_model_loaded_and_dispatched_from_a_flat_index(tmp_path: Path) -> None:
    """``load_checkpoint_and_dispatch`` of Accelerate's bigger model, its checkpoint sharded
    with the flat ``{name: file}`` index Accelerate takes."""
    model = trained(BiggerModelForTest)
    path = saved(model, tmp_path, flat_index=True)
    device_map = {
        "linear1": "cpu",
        "linear2": "cpu",
        "batchnorm": "cpu",
        "linear3": "disk",
        "linear4": "disk",
    }
    x = torch.randn(2, 3)
    with torch.no_grad():
        want = model(x)
        loaded = torchplace.load_into(
            torchplace.skeleton(BiggerModelForTest), path, device_map=device_map
        )
        check(loaded.eval()(x), want)
    assert loaded.linear3.weight.is_meta and loaded.linear4.weight.is_meta


def test_an_unused_submodule_on_disk_is_never_read(tmp_path: Path) -> None:
    model = trained(WithUnusedSubmodule)
    path = saved(model, tmp_path)
    device_map = {"linear1": "cpu", "batchnorm": "cpu", "linear2": "disk", "unused": "disk"}
    x = torch.randn(2, 3)
    with torch.no_grad():
        loaded = torchplace.load_into(
            torchplace.skeleton(WithUnusedSubmodule), path, device_map=device_map
        )
        check(loaded.eval()(x), model(x))
    assert loaded.unused.weight.is_meta


def test_gradients_through_disk_modules_as_accelerate_gives_them(tmp_path: Path) -> None:
    """A forward and backward with gradients on (Accelerate runs it): a trainable resident
    module gets the resident model's gradient; the disk modules, frozen, stay offloaded."""
    model = trained(BiggerModelForTest)
    path = saved(model, tmp_path)
    device_map = {"": "cpu", "linear3": "disk", "linear4": "disk"}
    loaded = torchplace.load_into(
        torchplace.skeleton(BiggerModelForTest), path, device_map=device_map
    )
    loaded.eval()
    for m in (model, loaded):
        m.linear3.requires_grad_(False)
        m.linear4.requires_grad_(False)
    x = torch.randn(4, 3)
    model(x).sum().backward()
    loaded(x).sum().backward()
    for name in ("linear1.weight", "linear2.bias", "batchnorm.weight"):
        got, want = loaded.get_parameter(name).grad, model.get_parameter(name).grad
        assert got is not None and want is not None
        check(got, want)
    assert loaded.linear4.weight.is_meta


def test_dropped_keys_are_named_as_accelerate_logs_them(tmp_path: Path) -> None:
    """``strict=False`` with a key the model lacks: Accelerate logs it; torchplace warns with
    the keys as data."""
    model = trained(ModelForTest)
    state = dict(model.state_dict())
    state["extra.weight"] = torch.zeros(2)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "m.safetensors"))
    with pytest.warns(UserWarning, match="strict=False skipped") as caught:
        torchplace.load_into(
            torchplace.skeleton(ModelForTest),
            tmp_path / "m.safetensors",
            strict=False,
            device_map={"": "cpu", "linear2": "disk"},
        )
    (warning,) = [w.message for w in caught if "skipped" in str(w.message)]
    assert tuple(getattr(warning, "unexpected", ())) == ("extra.weight",)


@pytest.mark.parametrize(
    "device_map",
    [
        {"linear1": "disk", "batchnorm": "disk", "linear2": "disk"},
        {"": "disk"},
        {"linear1": "cpu", "batchnorm": "cpu", "linear2": "cpu"},
    ],
)
def test_tied_weights_on_disk(tmp_path: Path, device_map: dict[str, str]) -> None:
    """Accelerate's tied model with both holders of the tie on disk: each reads the one saved
    tensor when it runs; the tie stays one object in the model."""
    from safetensors.torch import save_model

    model = trained(TiedWeights)
    save_model(model, str(tmp_path / "m.safetensors"))  # the tie saved once
    x = torch.randn(2, 4)
    with torch.no_grad():
        loaded = torchplace.load_into(
            torchplace.skeleton(TiedWeights), tmp_path / "m.safetensors", device_map=device_map
        )
        check(loaded.eval()(x), model(x))
    assert loaded.linear1.weight is loaded.linear2.weight
