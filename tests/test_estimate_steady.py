"""``estimate``'s training peak is a steady step's: Adam's state held from its start, the
optimizer implementation PyTorch picks on the device, nothing for frozen parameters; checked
against real steps measured by PyTorch's own tracker (``estimate_truth``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from estimate_truth import forward_peak, train_peaks
from torchplace.looking._estimate import estimate


def tiny(kind: str, device: str = "cpu") -> nn.Module:
    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":
        config: Any = transformers.GPT2Config(
            n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        make: Any = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128,
        )  # fmt: skip
        make = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        return cast_module(make(config))


def cast_module(model: Any) -> nn.Module:
    assert isinstance(model, nn.Module)
    return model


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_peak_is_the_steady_steps_over_three_real_ones(kind: str) -> None:
    model, inputs = tiny(kind), batch()
    est = estimate(model, example_input=inputs)
    skeleton = estimate(tiny(kind, "meta"), example_input=inputs)
    first, *steady = train_peaks(model, inputs)
    assert steady[0] == steady[1] > first  # the state made by the first step stays
    assert est.peak == pytest.approx(max(steady), rel=0.01)
    assert est.first_step_peak == pytest.approx(first, rel=0.01)
    # a skeleton on meta runs the single-tensor loop, as its parameters on the CPU would
    assert skeleton.peak == pytest.approx(max(steady), rel=0.01)


def test_the_forward_peak_is_the_real_ones() -> None:
    model, inputs = tiny("llama"), batch()
    est = estimate(model, example_input=inputs, step="forward")
    assert est.first_step_peak is None
    assert est.peak == pytest.approx(forward_peak(model, inputs), rel=0.01)


def adam_paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The Adam loops that run, by name: torch 2.6's AdamW has loops of its own (``adamw``),
    later ones run Adam's; either is named as Adam's."""
    import torch.optim.adam as adam
    import torch.optim.adamw as adamw

    ran: list[str] = []
    for module, suffix in ((adam, ""), (adamw, "w")):
        for name in ("_single_tensor_adam", "_multi_tensor_adam"):
            real = getattr(module, name + suffix, None)
            if real is None:
                continue

            def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
                ran.append(_name)
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, name + suffix, spy)
    return ran


def test_on_the_cpu_and_meta_adam_runs_its_single_tensor_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran = adam_paths(monkeypatch)
    for device in ("cpu", "meta"):
        estimate(nn.Linear(8, 8, device=device), example_input=torch.ones(2, 8))
    assert set(ran) == {"_single_tensor_adam"}


def test_on_cuda_adam_runs_foreach(monkeypatch: pytest.MonkeyPatch) -> None:
    from toy_models import on_fake_cuda

    ran = adam_paths(monkeypatch)
    model = on_fake_cuda(nn.Linear(8, 8, device="meta"), {"": "cuda:0"}).requires_grad_(True)
    estimate(model, example_input=torch.ones(2, 8))
    assert set(ran) == {"_multi_tensor_adam"}


def test_frozen_parameters_get_no_gradient_or_state() -> None:
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 8))
    model[0].requires_grad_(False)  # a frozen backbone, a trained head
    est = estimate(model, example_input=torch.ones(4, 512))
    head = (512 * 8 + 8) * 4
    assert (est.gradients, est.optimizer_state) == (head, 2 * head + 2 * 4)
    assert max(row.gradients for row in est.peaks) <= head
    _, *steady = train_peaks(model, torch.ones(4, 512))
    assert est.peak == pytest.approx(max(steady), rel=0.01)


def test_sgd_without_momentum_has_one_kind_of_step() -> None:
    est = estimate(nn.Linear(64, 64), example_input=torch.ones(4, 64), optimizer="sgd")
    assert est.first_step_peak is None and est.peak > est.total


def test_the_users_optimizer_runs_with_its_own_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = tiny("gpt2"), batch()

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, amsgrad=True, foreach=True)

    user = make(list(model.parameters()))
    ran = adam_paths(monkeypatch)
    est = estimate(model, example_input=inputs, optimizer=user)
    assert set(ran) == {"_multi_tensor_adam"} and not user.state  # foreach, as it says
    assert est.optimizer == "AdamW"
    assert est.optimizer_state == 3 * est.parameters + 4 * len(list(model.parameters()))
    monkeypatch.undo()
    _, *steady = train_peaks(model, inputs, make)
    assert est.peak == pytest.approx(max(steady), rel=0.01)
