"""One test per device-placement trap of docs/design.md: PyTorch's behaviour, torchplace's answer.

Traps that only exist on a real accelerator (4's CUDA error, 9, 10, 11's GPU-saved file) assert
PyTorch's documented behaviour where a CPU can show it and run for real under ``requires_cuda``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace

META = torch.device("meta")
CPU = torch.device("cpu")


def test_trap_01_plain_attributes_and_tensor_lists_do_not_follow_module_to() -> None:
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.scale = torch.ones(2)
            self.tables = [torch.zeros(2)]

    layer = Layer().to("meta")  # PyTorch: submodules move, the attribute and the list do not
    assert layer.lin.weight.device == META
    assert layer.scale.device == CPU and layer.tables[0].device == CPU
    kinds = {s.name: s.kind for s in torchplace.stragglers(layer, "meta")}
    assert kinds == {"scale": "attribute", "tables[0]": "attribute"}
    with pytest.warns(UserWarning, match="scale, tables"):
        torchplace.move(Layer(), "meta")
    moved = torchplace.move(Layer(), "meta", attributes="move")
    torchplace.verify(moved, "meta")


def test_trap_02_meta_moves_replace_parameters_and_strand_optimizers() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.to("meta")  # PyTorch: new Parameter objects; opt still holds the old cpu ones
    assert opt.param_groups[0]["params"][0] is not model.weight
    fresh = nn.Linear(2, 2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    torchplace.move(fresh, "meta", optimizer=fresh_opt)
    assert fresh_opt.param_groups[0]["params"][0] is fresh.weight


def test_trap_03_meta_round_trips_untie_weights_but_not_with_torchplace() -> None:
    def tied() -> nn.Module:
        model = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))
        model[1].weight = model[0].weight
        return model

    plain = tied().to("meta")  # PyTorch replaces each slot's Parameter separately: untied
    assert plain[0].weight is not plain[1].weight
    sd = {k: torch.zeros_like(v, device="cpu") for k, v in tied().state_dict().items()}
    loaded = tied().to("meta")
    loaded.load_state_dict(sd, assign=True)  # assign=True unties them too
    assert loaded[0].weight is not loaded[1].weight
    model = tied()
    torchplace.move(model, "meta")
    assert model[0].weight is model[1].weight


def test_trap_04_adam_step_stays_on_the_cpu() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert opt.state[model.weight]["step"].device == CPU  # PyTorch's own placement
    torchplace.move(model, "meta", optimizer=opt)
    assert opt.state[model.weight]["step"].device == CPU
    assert torchplace.stragglers(model, "meta", optimizer=opt) == []


def test_trap_05_adagrad_state_exists_before_any_step() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.Adagrad(model.parameters())
    assert opt.state[model.weight]["sum"].device == CPU  # created at construction
    model.to("meta")
    assert any(
        s.kind == "optimizer_state" for s in torchplace.stragglers(model, "meta", optimizer=opt)
    )
    model = nn.Linear(2, 2)
    opt = torch.optim.Adagrad(model.parameters())
    torchplace.move(model, "meta", optimizer=opt)
    assert opt.state[model.weight]["sum"].device == META


def test_trap_06_gradients_move_with_their_parameters() -> None:
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    assert {s.kind for s in torchplace.stragglers(model, "meta")} == {"parameter", "grad"}
    torchplace.move(model, "meta")
    assert model.weight.grad is not None and model.weight.grad.device == META
    assert model.bias.grad is not None and model.bias.grad.device == META


@pytest.mark.requires_cuda
def test_trap_06_param_data_assignment_leaves_grad_behind() -> None:
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    values = [g.clone() for g in grads if g is not None]
    for p in model.parameters():
        p.data = p.data.to("cuda")  # the by-hand loop: .grad stays on the CPU
    found = [s.name for s in torchplace.stragglers(model, "cuda:0") if s.kind == "grad"]
    assert found == ["weight.grad", "bias.grad"]
    torchplace.move(model, "cuda:0")
    torchplace.verify(model, "cuda:0")
    moved = [p.grad for p in model.parameters()]
    assert all(a is b for a, b in zip(moved, grads, strict=True))  # the same objects
    assert all(torch.equal(g.cpu(), v) for g, v in zip(moved, values, strict=True) if g is not None)


def test_trap_07_non_persistent_buffers_are_not_in_the_state_dict(tmp_path: Path) -> None:
    class Rotary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("freqs", torch.arange(4.0), persistent=False)

    model = Rotary()
    assert "freqs" not in model.state_dict()
    with pytest.warns(UserWarning, match=r"discarded the values of 1 non-persistent.*freqs"):
        torchplace.move(model, "meta")
    assert model.freqs.device == META  # moved like any buffer, found by looking
    assert {s.name for s in torchplace.stragglers(Rotary(), "meta")} == {"freqs"}
    # no way back but a rebuild: the error and verify say so, and the fix they give works
    with pytest.raises(torchplace.MoveError, match=r"freqs: a non-persistent.*skeleton") as e:
        torchplace.move(model, "cpu")
    assert e.value.name == "freqs"
    with pytest.raises(torchplace.PlacementError, match=r"freqs.*fix: a non-persistent.*skel") as e:
        torchplace.verify(model, "cpu")
    assert [s.name for s in e.value.stragglers] == ["freqs"]
    torch.save(model.state_dict(), tmp_path / "rotary.pt")  # nothing in it: freqs is not saved
    rebuilt = torchplace.skeleton(Rotary)
    torchplace.load_into(rebuilt, tmp_path / "rotary.pt", "cpu")
    torchplace.verify(rebuilt, "cpu")
    assert torch.equal(rebuilt.freqs, torch.arange(4.0))


def test_trap_08_meta_to_real_needs_to_empty() -> None:
    model = nn.Linear(2, 2, device="meta")
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        model.to("cpu")
    with pytest.raises(torchplace.MoveError, match="to_empty") as e:
        torchplace.move(model, "cpu")
    assert e.value.name == "weight"
    assert model.weight.device == META  # nothing half-moved


def test_trap_09_device_to_host_copies_are_synchronised(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch leaving a (fake) GPU is copied asynchronously and waited for before move returns."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchplace.moving import _transfer

    waited: list[set[torch.device]] = []
    monkeypatch.setattr(
        _transfer.Copier, "synchronize", lambda self: waited.append(set(self.sync_sources))
    )
    modes: list[bool] = []
    real = _transfer.copy_tensor

    def spy(t: torch.Tensor, target: torch.device, non_blocking: bool) -> torch.Tensor:
        modes.append(non_blocking)
        return real(t, target, False)

    monkeypatch.setattr(_transfer, "copy_tensor", spy)
    with FakeTensorMode():
        batch = {"x": torch.empty(4, device="cuda:0")}
        out = torchplace.move(batch, "cpu")
    assert out["x"].device == CPU
    assert modes == [True]  # asynchronous...
    assert waited == [{torch.device("cuda:0")}]  # ...and waited for before returning


@pytest.mark.requires_cuda
def test_trap_09_cuda_non_blocking_to_host_is_synchronised() -> None:
    big = torch.full((32, 1024, 1024), 3.0, device="cuda")
    for _ in range(3):
        big = big * 1.0  # queue work so the copy is really asynchronous
    out = torchplace.move(big, "cpu", non_blocking=True)
    assert bool((out == 3.0).all())


def test_trap_10_non_blocking_from_pageable_memory_is_not_chosen() -> None:
    from torchplace.moving._transfer import choose_non_blocking as _choose_non_blocking

    host = torch.ones(2)
    assert not host.is_pinned()
    assert _choose_non_blocking(host, torch.device("cuda:0"), None) is False
    assert _choose_non_blocking(host, META, None) is False


def test_trap_11_untrusted_pickles_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (exec, (f"open({str(marker)!r}, 'w').write('pwned')",))

    evil = tmp_path / "evil.pt"
    torch.save({"x": Evil()}, evil)
    with pytest.raises(torchplace.CheckpointError, match=r"evil\.pt") as e:
        torchplace.load(evil)
    assert e.value.path == evil
    assert not marker.exists()  # weights_only: nothing ran
    weights = tmp_path / "weights.pt"
    torch.save({"w": torch.arange(3.0)}, weights)
    loaded = torchplace.load(weights, "meta")
    assert loaded["w"].device == META and loaded["w"].shape == (3,)


def test_trap_12_a_spread_model_has_no_single_device() -> None:
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1, device="meta"))
    assert next(model.parameters()).device == CPU  # the lie: half the model is elsewhere
    with pytest.raises(torchplace.MixedDevicesError, match="spread over 2 devices"):
        torchplace.where(model)


def test_trap_13_a_module_without_parameters_has_no_device() -> None:
    with pytest.raises(StopIteration):
        next(nn.ReLU().parameters())
    with pytest.raises(torchplace.NoTensorsError, match="holds no tensors"):
        torchplace.where(nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torchplace.move(nn.ReLU(), "meta") is not None
