"""Resuming training: a model filled by ``load_into`` and its optimizer's state read by ``load``,
the step on the device PyTorch's policy puts it on."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchplace
from helpers import DISCARDED_MASK, Net, X, reference, save
from torchplace.checkpoint._checkpoint import load, load_into, skeleton


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(X).square().mean().backward()
        opt.step()


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resume_optimizer_saved_on_gpu(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make = OPTIMIZERS[name]
    model = reference()
    opt = make(model.parameters())
    _train(model, opt, 3)
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    weights = save(model.state_dict(), tmp_path / "model.pt")
    state = save(opt.state_dict(), tmp_path / "optim.pt")
    monkeypatch.undo()

    resumed = load_into(skeleton(Net), weights)
    new_opt = make(resumed.parameters())
    new_opt.load_state_dict(load(state))
    for group in new_opt.param_groups:
        for p in group["params"]:
            for key, value in new_opt.state[p].items():
                if not isinstance(value, torch.Tensor):
                    continue
                on_param = key != "step" or group.get("fused") or group.get("capturable")
                assert value.device == (p.device if on_param else torch.device("cpu")), key

    _train(model, opt, 2)
    _train(resumed, new_opt, 2)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_optimizer_state_read_onto_the_device_keeps_step_there(tmp_path: Path) -> None:
    # why the recipe reads optimizer state onto the CPU: PyTorch leaves a plain group's step
    # where it was loaded, and a non-capturable Adam rejects a step on an accelerator
    model = reference()
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 1)
    path = save(opt.state_dict(), tmp_path / "optim.pt")
    with pytest.warns(UserWarning, match=DISCARDED_MASK):
        target = load_into(skeleton(Net), _weights(model, tmp_path), "meta")
    for read_on, step_on in (("meta", "meta"), ("cpu", "cpu")):
        new_opt = torch.optim.Adam(target.parameters())
        new_opt.load_state_dict(load(path, read_on))
        assert new_opt.state[target.emb.weight]["step"].device.type == step_on


def test_resume_restores_saved_hyperparameters(tmp_path: Path) -> None:
    # PyTorch takes lr, fused and capturable from the file, not from the new optimizer
    model = reference()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, opt, 1)
    state = save(opt.state_dict(), tmp_path / "optim.pt")
    new_opt = torch.optim.Adam(load_into(skeleton(Net), _weights(model, tmp_path)).parameters())
    new_opt.load_state_dict(load(state))
    assert new_opt.param_groups[0]["lr"] == 1e-3 and not new_opt.param_groups[0]["capturable"]


@pytest.mark.parametrize(
    ("flag", "device", "step_on"),
    [("plain", "meta", "cpu"), ("capturable", "meta", "meta"), ("fused", "cpu", "cpu")],
)
def test_resumed_step_follows_pytorchs_policy(
    tmp_path: Path, flag: str, device: str, step_on: str
) -> None:
    # meta stands in for "another device": step stays on the CPU unless capturable or fused
    model = reference()
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 1)
    path = save(opt.state_dict(), tmp_path / "optim.pt")
    with pytest.warns(UserWarning, match=DISCARDED_MASK) if device == "meta" else nullcontext():
        target = load_into(skeleton(Net), _weights(model, tmp_path), device)
    kwargs = {} if flag == "plain" else {flag: True}
    new_opt = torch.optim.Adam(target.parameters(), **kwargs)
    state = load(path)
    for group in state["param_groups"]:  # switch the group's flags before loading
        group.update(kwargs)
    new_opt.load_state_dict(state)
    p = target.emb.weight
    assert new_opt.state[p]["step"].device.type == step_on
    assert new_opt.state[p]["step"].dtype == torch.float32
    assert new_opt.state[p]["exp_avg"].device.type == device
    if device == "cpu":
        _train(target, new_opt, 1)


def _weights(model: nn.Module, tmp_path: Path) -> Path:
    return save(model.state_dict(), tmp_path / "w.pt")


@pytest.mark.requires_cuda
@pytest.mark.parametrize("flag", ["plain", "fused", "capturable"])
def test_resume_optimizer_on_cuda(tmp_path: Path, flag: str) -> None:
    model = reference()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    weights, state = _weights(model, tmp_path), save(opt.state_dict(), tmp_path / "o.pt")
    resumed = load_into(skeleton(Net), weights, "cuda")
    kwargs = {} if flag == "plain" else {flag: True}
    new_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2, **kwargs)
    saved = load(state)
    for group in saved["param_groups"]:
        group.update(kwargs)
    new_opt.load_state_dict(saved)
    step = new_opt.state[resumed.emb.weight]["step"]
    assert step.device.type == ("cpu" if flag == "plain" else "cuda")
    new_opt.zero_grad()
    resumed(X.cuda()).square().mean().backward()
    new_opt.step()  # would fail if step sat on the wrong device


def test_the_way_back_from_meta_that_the_error_gives_keeps_a_tie_and_its_optimizer(
    tmp_path: Any,
) -> None:
    """The error offered to_empty, then re-binding the optimizer: on a tied model to_empty
    makes new, untied parameters, and the re-bind failed; the error now says which way keeps
    them (load_into), and what to_empty asks for after it."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    model[1].weight = model[0].weight
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    torch.save(model.state_dict(), tmp_path / "m.pt")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    torchplace.move(model, "meta", optimizer=opt)
    with pytest.raises(torchplace.MoveError) as said:
        torchplace.move(model, "cpu", optimizer=opt)
    assert "load_into(model, checkpoint, 'cpu') (ties kept)" in str(said.value)
    assert "to_empty makes new parameters" in str(said.value)
    assert "after to_empty, which makes new parameters, build a new optimizer" in str(said.value)
    torchplace.load_into(model, tmp_path / "m.pt", "cpu")  # the way that keeps them
    opt.state.clear()
    torchplace.move(model, "cpu", optimizer=opt)
    torchplace.verify(model, "cpu", optimizer=opt)
    assert model[1].weight is model[0].weight
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # the optimizer steps the model's own parameters
    assert opt.param_groups[0]["params"][0] is model[0].weight
