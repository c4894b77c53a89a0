"""estimate: bytes per device and dtype, on cpu, meta and fake CUDA devices."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchplace
from torchplace._errors import DeviceSpecError, TorchplaceError
from torchplace.cli import main
from torchplace.looking._estimate import Estimate, estimate
from toy_models import CPU, CUDA0, CUDA1, LINEAR_BYTES, META, Net, TiedLM, on_fake_cuda

# --- estimate --------------------------------------------------------------------------------


def test_estimate_adam_counts_parameters_gradients_and_state() -> None:
    est = estimate(nn.Linear(16, 16), optimizer="adam")
    assert isinstance(est, Estimate)
    assert (est.parameters, est.gradients) == (LINEAR_BYTES, LINEAR_BYTES)
    # exp_avg and exp_avg_sq like each parameter, plus a float32 step per parameter on the cpu
    assert est.optimizer_state == 2 * LINEAR_BYTES + 2 * 4
    assert est.total == 4 * LINEAR_BYTES + 8
    assert est.by_device() == {CPU: est.total}


def test_estimate_of_a_forward_step_counts_no_gradients_or_state_without_an_input() -> None:
    """step="forward" was ignored without an example_input: gradients and Adam's state were
    counted (4x an inference model's bytes), where the CLI's --step forward counted none."""
    model = torch.nn.Linear(1000, 1000)
    forward = torchplace.estimate(model, step="forward")
    assert (forward.parameters, forward.gradients, forward.optimizer_state) == (4004000, 0, 0)
    assert forward.total == 4004000
    train = torchplace.estimate(model, step="train")
    assert (train.gradients, train.optimizer_state) == (4004000, 8008008)
    with pytest.raises(torchplace.DeviceSpecError, match=r"step='fwd': use 'train' or 'forward'"):
        torchplace.estimate(model, step="fwd")


@pytest.mark.parametrize(
    ("optimizer", "state"),
    [
        ("sgd", 0),
        ("sgd-momentum", LINEAR_BYTES),
        ("momentum", LINEAR_BYTES),
        ("adamw", 2 * LINEAR_BYTES + 8),
        ("adagrad", LINEAR_BYTES + 8),
        (None, 0),
    ],
)
def test_estimate_optimizer_state_per_kind(optimizer: str | None, state: int) -> None:
    assert estimate(nn.Linear(16, 16), optimizer=optimizer).optimizer_state == state


@pytest.mark.parametrize(
    ("kind", "factory"),
    [
        ("sgd-momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
        ("adam", lambda p: torch.optim.Adam(p)),
        ("adamw", lambda p: torch.optim.AdamW(p)),
        ("adagrad", lambda p: torch.optim.Adagrad(p)),
    ],
)
def test_estimate_matches_the_state_pytorch_creates(
    kind: str, factory: Callable[[Any], torch.optim.Optimizer]
) -> None:
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 2))
    optimizer = factory(model.parameters())
    model(torch.ones(3, 16)).sum().backward()
    optimizer.step()
    state_bytes = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    assert estimate(model, optimizer=kind).optimizer_state == state_bytes


def test_estimate_skeleton_sizes_like_the_real_model() -> None:
    real = estimate(Net())
    skeleton = estimate(Net(device="meta"))
    assert skeleton.total == real.total
    assert {row.device for row in skeleton.rows} == {META, CPU}  # Adam's step lives on the cpu


def test_estimate_frozen_parameters_need_no_gradients_or_state() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    model[0].requires_grad_(False)
    est = estimate(model, optimizer="sgd-momentum")
    assert est.parameters == 2 * LINEAR_BYTES
    assert est.gradients == est.optimizer_state == LINEAR_BYTES
    assert est.trainable_count == est.parameter_count // 2
    assert estimate(model, optimizer=None, grads=False).total == 2 * LINEAR_BYTES


def test_estimate_counts_tied_parameters_once_and_buffers() -> None:
    model = TiedLM()
    model.register_buffer("mask", torch.ones(10, dtype=torch.bool))
    est = estimate(model, optimizer=None, grads=False)
    unique = sum(p.numel() * 4 for p in model.parameters())
    assert est.parameters == unique
    assert est.buffers == 10
    assert {(row.device, row.dtype) for row in est.rows} == {
        (CPU, torch.float32),
        (CPU, torch.bool),
    }


@pytest.mark.fake_cuda
def test_estimate_per_device_and_dtype_on_fake_cuda() -> None:
    model = on_fake_cuda(Net(device="meta"), {"embed": "cuda:0", "blocks": "cuda:1"})
    model.head.half()
    est = estimate(model, optimizer=None, grads=False)
    rows = {(row.device, row.dtype): row.parameters for row in est.rows}
    assert rows == {
        (CUDA0, torch.float32): (8 * 16 + 16) * 4,
        (CUDA1, torch.float32): 6 * LINEAR_BYTES,
        (META, torch.float16): (16 * 4 + 4) * 2,
    }


def test_estimate_summary_is_readable_and_json_able() -> None:
    est = estimate(Net(), optimizer="adam")
    text = str(est)
    for word in ("parameters", "gradients", "optimizer", "total", "cpu", "float32", "adam"):
        assert word in text
    assert "KiB" in text
    data = json.loads(json.dumps(est.to_dict()))
    assert data["total"] == est.total
    assert data["by_device"] == {"cpu": est.total}


def test_estimate_rejects_unknown_optimizer_with_a_suggestion() -> None:
    with pytest.raises(DeviceSpecError, match=r"'adma'.*did you mean 'adam'"):
        estimate(nn.Linear(2, 2), optimizer="adma")


NAMES = "'sgd', 'sgd-momentum', 'adam', 'adamw', 'adagrad', 'momentum', None or an Optimizer"


def test_estimate_sizes_the_users_own_optimizer_by_its_flags() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    model[1].requires_grad_(False)
    weights = (8 * 8 + 8) * 4  # what requires grad
    cases = [
        (torch.optim.AdamW(model.parameters(), amsgrad=True), 3 * weights + 2 * 4),
        (torch.optim.SGD(model.parameters(), momentum=0.9), weights),
        (torch.optim.SGD(model.parameters()), 0),
        (torch.optim.RMSprop(model.parameters(), centered=True, momentum=0.9), 3 * weights + 8),
    ]
    for optimizer, state in cases:
        groups = [dict(g) for g in optimizer.param_groups]
        est = estimate(model, optimizer=optimizer)
        assert (est.optimizer, est.optimizer_state) == (type(optimizer).__name__, state)
        assert est.gradients == weights
        assert not optimizer.state and optimizer.param_groups == groups  # left alone
    with pytest.raises(DeviceSpecError) as caught:
        estimate(model, optimizer=3)  # type: ignore[arg-type]
    assert str(caught.value) == (
        f"estimate(): optimizer=int(...) is neither an optimizer's name nor a "
        f"torch.optim.Optimizer; give one of {NAMES}"
    )
    with pytest.raises(DeviceSpecError) as caught:
        estimate(model, optimizer="adma")
    assert str(caught.value).endswith(f"use one of {NAMES}")


def test_estimate_sizes_the_local_shard_of_fsdp2_parameters(fake_world: object) -> None:
    fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard
    model = nn.Linear(8, 8)
    fully_shard(model, mesh=fake_world)
    est = estimate(model, optimizer="sgd")
    assert est.parameter_count == 72  # the whole model
    assert est.parameters == (16 + 2) * 4  # this rank's quarter of the weight and bias


def test_estimate_of_a_lazy_module_says_its_size_is_not_known_yet() -> None:
    """A lazy module's parameters have no shape before the first forward (a raw ValueError)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(4))
    with pytest.raises(TorchplaceError, match=r"estimate\(\): 1\.weight .*LazyLinear.*forward"):
        estimate(model)
    model(torch.ones(1, 4))  # initialized: sized as usual
    assert estimate(model, optimizer=None, grads=False).parameters == 2 * (4 * 4 + 4) * 4


def test_estimate_of_a_path_suggests_sizing_a_skeleton(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint's path is not a model: the message says so once (no doubled prefix), and
    both suggestions run as typed."""
    folder = tmp_path / "my model"
    folder.mkdir()
    torch.save({"weight": torch.ones(3, 4)}, folder / "pytorch_model.bin")
    for given in (str(folder), folder):
        with pytest.raises(TorchplaceError) as info:
            estimate(given)  # type: ignore[arg-type]
        message = str(info.value)
        assert message.startswith(f"estimate(): sizes a model, not a path ({str(folder)!r}); ")
        assert message.count("estimate()") == 1
    code = re.search(r"(torchplace\.estimate\(torchplace\.skeleton\(.*?\)\))", message)
    command = re.search(r"run: (torchplace inspect .*)$", message)
    assert code is not None and command is not None

    class YourModel(nn.Module):
        def __init__(self, config: dict[str, int]) -> None:
            super().__init__()
            self.linear = nn.Linear(config["width"], config["width"])

    namespace = {"torchplace": torchplace, "YourModel": YourModel, "config": {"width": 10}}
    assert eval(code.group(1), namespace).parameters == 440  # the code the message gives
    assert main(shlex.split(command.group(1))[1:]) == 0
    assert "weight" in capsys.readouterr().out


def test_estimate_of_something_else_names_its_type_once() -> None:
    with pytest.raises(TorchplaceError) as info:
        estimate(3)  # type: ignore[arg-type]
    assert str(info.value) == "estimate(): sizes an nn.Module, not int; pass the model"
