"""``skeleton`` (``checkpoint/_skeleton.py``): a model built with its parameters on meta, its
buffers real, nothing initialised at random and nothing patched that other threads see."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from helpers import Net
from torchplace._errors import TorchplaceError
from torchplace.checkpoint._checkpoint import load_into, skeleton


def test_skeleton_parameters_meta_buffers_real() -> None:
    model = skeleton(Net)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.head.weight is model.emb.weight
    assert model.mask.device.type == "cpu" and torch.equal(model.mask, torch.ones(4, 4).tril())
    assert torch.equal(model.scale, torch.full((8,), 0.5))


def test_skeleton_does_no_random_init() -> None:
    # the modules built inside the factory draw no random numbers: no init runs
    state = torch.random.get_rng_state()
    skeleton(lambda: nn.Sequential(nn.Linear(64, 64), nn.Embedding(10, 64), nn.Conv2d(3, 8, 3)))
    assert torch.equal(torch.random.get_rng_state(), state)


def test_skeleton_leaves_existing_parameters_alone() -> None:
    existing = nn.Linear(3, 3)
    before = existing.weight.detach().clone()
    model = skeleton(lambda: nn.Sequential(existing, nn.Linear(3, 2)))
    assert existing.weight.device.type == "cpu" and torch.equal(existing.weight, before)
    assert model[1].weight.device.type == "meta"


class _Untouched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(3))  # no torch call touches it afterwards
        self.beta = self.alpha


def test_skeleton_sweeps_untouched_parameters_and_keeps_ties() -> None:
    model = skeleton(_Untouched)
    assert model.alpha.device.type == "meta" and model.alpha is model.beta


class _SetsData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a_log = nn.Parameter(torch.empty(4))
        self.tied = self.a_log
        # as Bamba's _init_weights does under transformers 4.x
        self.a_log.data = torch.log(torch.arange(1, 6, dtype=torch.float64))


def test_skeleton_takes_values_set_through_data_on_meta() -> None:
    """A parameter's ``.data`` set to a real tensor inside the factory: the parameter (sent to
    meta as soon as a torch call touched it) takes the new shape and dtype on meta, not torch's
    RuntimeError about incompatible tensor types."""
    model = skeleton(_SetsData)
    assert model.a_log.device.type == "meta" and model.a_log is model.tied
    assert model.a_log.shape == (5,) and model.a_log.dtype == torch.float64


def test_skeleton_patches_nothing_other_threads_see() -> None:
    originals = (nn.Module.register_parameter, nn.Module.__setattr__, nn.Parameter.__new__)
    inside = threading.Event()
    built = threading.Event()
    seen: dict[str, object] = {}

    def factory() -> nn.Module:
        inside.set()
        assert built.wait(10)
        return nn.Linear(2, 2)

    def other_thread() -> None:
        assert inside.wait(10)
        seen["patched"] = (
            nn.Module.register_parameter,
            nn.Module.__setattr__,
            nn.Parameter.__new__,
        ) != originals
        seen["device"] = nn.Linear(2, 2).weight.device.type
        built.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    model = skeleton(factory)
    thread.join()
    assert seen == {"patched": False, "device": "cpu"}
    assert model.weight.device.type == "meta"


def test_skeleton_needs_a_module() -> None:
    with pytest.raises(TorchplaceError, match=r"nn\.Module"):
        skeleton(lambda: 3)
    with pytest.raises(TorchplaceError, match=r"load_into\(\) fills an nn\.Module"):
        load_into({"w": torch.ones(1)}, "unused.pt")  # type: ignore[type-var]


def test_skeleton_of_a_built_model_says_to_pass_its_class() -> None:
    with pytest.raises(
        TorchplaceError, match=r"not a Linear already built: skeleton\(Linear, \.\.\.\)"
    ):
        skeleton(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_skeleton_of_something_not_callable_says_what_it_takes() -> None:
    with pytest.raises(TorchplaceError, match=r"not a Tensor: torchplace\.skeleton\(YourModel"):
        skeleton(torch.ones(2))  # type: ignore[arg-type]
