"""estimate(example_input=...): one step run on fake tensors, measured per device and kind."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import subprocess
import sys
import textwrap
import warnings
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import checkpoint

from estimate_truth import train_peaks
from helpers import needs_transformers_5
from torchplace._errors import DeviceSpecError, TorchplaceError
from torchplace.looking import _fake_step
from torchplace.looking._estimate import estimate
from toy_models import CPU, CUDA0, META, on_fake_cuda

B, IN, H, OUT = 64, 256, 1024, 128  # batch, in, hidden, out of the hand-computed MLP
MLP_PARAMS = (IN * H + H + H * OUT + OUT) * 4


def mlp(device: str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, H, device=device), nn.ReLU(), nn.Linear(H, OUT, device=device)
    )


def has_data(t: torch.Tensor) -> bool:
    return t.device.type != "meta" and not isinstance(t, FakeTensor)


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything estimate must leave as it was: tensor objects and bits, grads, flags, hooks."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return {
        "objects": {name: id(t) for name, t in tensors.items()},
        "values": {n: t.detach().clone() for n, t in tensors.items() if has_data(t)},
        "grads": {n: id(p.grad) for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": [m.training for m in model.modules()],
        "hooks": [
            (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
            for m in model.modules()
        ],
    }


def assert_same(before: dict[str, Any], model: nn.Module) -> None:
    after = snapshot(model)
    assert after["objects"] == before["objects"]
    assert after.keys() == before.keys()
    for name, value in before["values"].items():
        now = after["values"][name]
        assert now.dtype == value.dtype and torch.equal(now, value), name
    for key in ("grads", "requires_grad", "training", "hooks"):
        assert after[key] == before[key], key


# --- a hand-computable MLP --------------------------------------------------------------------


def test_train_step_of_an_mlp_matches_the_hand_count() -> None:
    est = estimate(mlp(), example_input=torch.ones(B, IN), optimizer="adam")
    assert est.step == "train" and est.fallback is None
    # counted, to the byte: weights, their gradients, Adam's two moments and its step scalars
    assert (est.parameters, est.gradients) == (MLP_PARAMS, MLP_PARAMS)
    assert est.optimizer_state == 2 * MLP_PARAMS + 4 * 4
    (row,) = est.peaks  # the peak is in the optimizer step: every gradient is there
    assert (row.device, row.parameters, row.gradients) == (CPU, MLP_PARAMS, MLP_PARAMS)
    assert row.inputs == B * IN * 4
    assert row.optimizer_state >= 2 * MLP_PARAMS + 16
    # activations: the hidden layer's output and the ReLU's, both alive as the ReLU returns
    assert est.activations == pytest.approx(2 * B * H * 4, rel=0.10)
    assert est.temporaries > 0
    assert est.peak == row.total >= row.parameters + row.gradients + row.optimizer_state
    assert est.peak_by_device() == {CPU: est.peak}


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd-momentum", "adagrad"])
def test_the_optimizer_steps_temporaries_are_not_its_state(optimizer: str) -> None:
    # torch's tracker books all the optimizer step makes as its state; what the step frees
    # before it returns (Adam's denominators) is a temporary: the peak holds the state the
    # optimizer keeps, to the byte as counted (and as a real optimizer keeps, see test_estimate)
    est = estimate(mlp(), example_input=torch.ones(B, IN), optimizer=optimizer)
    (row,) = est.peaks
    assert row.optimizer_state == est.optimizer_state
    kinds = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs")
    assert row.total == sum(getattr(row, kind) for kind in kinds)
    assert est.temporaries >= row.temporaries
    if optimizer in ("adam", "adamw", "adagrad"):  # the peak is in the step: sqrt(v) and more
        assert row.temporaries >= H * IN * 4
        assert row.gradients == MLP_PARAMS


def test_forward_step_has_no_gradients_or_optimizer_state() -> None:
    est = estimate(mlp(), example_input=(torch.ones(B, IN),), step="forward")
    assert (est.optimizer, est.grads, est.gradients, est.optimizer_state) == (None, False, 0, 0)
    (row,) = est.peaks
    assert (row.gradients, row.optimizer_state, row.temporaries) == (0, 0, 0)
    assert est.activations == pytest.approx(2 * B * H * 4, rel=0.10)
    assert row.total == pytest.approx(MLP_PARAMS + B * IN * 4 + 2 * B * H * 4, rel=0.02)


def test_a_skeleton_and_a_callable_input_run_on_meta() -> None:
    made: list[torch.device] = []

    def batch(dev: torch.device) -> dict[str, torch.Tensor]:
        made.append(dev)
        return {"input": torch.ones(B, IN, device=dev)}

    est = estimate(mlp("meta"), example_input=batch, optimizer="sgd")
    assert made == [META]
    assert est.peak_by_device() == {META: est.peak}
    # SGD keeps no state: the peak is in the backward, the second layer's gradients made
    assert est.peaks[0].parameters == MLP_PARAMS
    assert est.peaks[0].gradients == (H * OUT + OUT) * 4
    assert est.activations == pytest.approx(2 * B * H * 4, rel=0.10)
    assert [m.name for m in est.modules] == ["0", "1", "2"]  # the first layer's peak is highest
    assert est.modules[0].parameters == (IN * H + H) * 4


def test_the_model_is_left_as_it_was() -> None:
    model = nn.Sequential(nn.Linear(IN, H), nn.BatchNorm1d(H), nn.Linear(H, OUT))
    model[0].requires_grad_(False)
    model[2].weight.grad = torch.full_like(model[2].weight, 3.0)
    calls: list[str] = []
    model[2].register_forward_hook(lambda m, i, o: calls.append("hook"))
    model[1].eval()
    before = snapshot(model)
    est = estimate(model, example_input=torch.ones(B, IN))
    # the user's hook ran once a step: the first (which makes Adam's state) and the steady one
    assert est.fallback is None and calls == ["hook", "hook"]
    assert est.trainable_count == H * OUT + OUT + 2 * H
    assert_same(before, model)
    model(torch.ones(2, IN))  # and the model still runs, on its own tensors
    assert calls == ["hook"] * 3


@pytest.mark.slow  # a subprocess
def test_a_compiled_model_is_measured_as_the_model_it_wraps(
    recwarn: pytest.WarningsRecorder,
) -> None:
    # torch.compile(model) ran compiled code under the tracker: its gradients were booked as
    # temporaries, no module was seen, and torch warned about the tracker's global hooks
    plain = estimate(mlp(), example_input=torch.ones(B, IN))
    model = mlp()
    inner = torch.compile(model[2])
    model[2] = inner
    compiled = torch.compile(model)
    recwarn.clear()  # torch's own warnings on compiling
    for est in (estimate(compiled, example_input=torch.ones(B, IN)),
                estimate(model, example_input=torch.ones(B, IN))):  # fmt: skip
        assert est.peaks == plain.peaks and est.rows == plain.rows
        assert (est.activations, est.temporaries) == (plain.activations, plain.temporaries)
        assert [m.name for m in est.modules] == [m.name for m in plain.modules] == ["0", "1", "2"]
    assert [str(w.message) for w in recwarn] == []
    assert model[2] is inner and compiled._orig_mod is model


def test_nothing_real_is_allocated() -> None:
    """A 16 GiB batch through a real model, in a process that cannot map 4 GiB more."""
    code = textwrap.dedent(
        """
        import resource, torch, torchplace
        from torch import nn
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 30), resource.RLIM_INFINITY))
        est = torchplace.estimate(model, example_input=lambda d: torch.ones(1 << 26, 64, device=d))
        print(est.fallback, est.activations >= 2 * (1 << 26) * 64 * 4)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.split() == ["None", "True"], done.stderr[-2000:]


# --- the user's own code: autocast, activation checkpointing ----------------------------------


W = 256  # the width of Deep's layers, small beside its batch so activations dominate


class Deep(nn.Module):
    """Four blocks of four Linear+ReLU layers; the forward as a user writes it."""

    def __init__(self, *, autocast: bool = False, checkpointed: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(W, W), nn.ReLU())))
            for _ in range(4)
        )
        self.autocast, self.checkpointed = autocast, checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            for block in self.blocks:
                if self.checkpointed:
                    x = checkpoint(block, x, use_reentrant=False)
                else:
                    x = block(x)
        return x


def test_autocast_in_the_forward_halves_the_activations() -> None:
    x = torch.ones(16 * B, W)
    plain = estimate(Deep(), example_input=x, optimizer="sgd")
    mixed = estimate(Deep(autocast=True), example_input=x, optimizer="sgd")
    assert mixed.fallback is None
    assert mixed.activations < 0.65 * plain.activations
    assert mixed.parameters == plain.parameters  # the weights stay float32


def test_activation_checkpointing_keeps_fewer_activations() -> None:
    x = torch.ones(16 * B, W)
    plain = estimate(Deep(), example_input=x, optimizer="sgd")
    saved = estimate(Deep(checkpointed=True), example_input=x, optimizer="sgd")
    assert saved.fallback is None
    # the blocks' outputs, and one block's layers again while its backward recomputes them
    assert saved.activations < 0.6 * plain.activations
    assert saved.peak < plain.peak


# --- transformers models from a skeleton, on fake cuda:0 --------------------------------------


def tiny(architecture: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    small = {"vocab_size": 128, "max_position_embeddings": 64}
    configs = {
        "llama": lambda: transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            **small,
        ),
        "gpt2": lambda: transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64
        ),
    }
    config = configs[architecture]()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model


def tokens(dev: torch.device) -> dict[str, torch.Tensor]:
    ids = torch.zeros(2, 32, dtype=torch.long, device=dev)
    return {"input_ids": ids, "labels": ids}


def held(tensors: Any, block: int) -> int:
    """The bytes of ``tensors``, each taken in whole blocks of ``block`` bytes."""
    return sum(-(-t.numel() * t.element_size() // block) * block for t in tensors)


def cuda_block() -> int:
    """How the fake step on cuda:0 counts a tensor: where CUDA is, it runs on cuda:0, whose
    caching allocator (and so torch's MemTracker) takes each one in blocks of 512 bytes; on a
    machine without, it runs on meta, byte for byte."""
    caching = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") == "0"
    return 512 if torch.cuda.is_available() and caching else 1


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_transformers_skeleton_on_fake_cuda(architecture: str) -> None:
    model = on_fake_cuda(tiny(architecture), {"": "cuda:0"}).requires_grad_(True)
    before = snapshot(model)
    est = estimate(model, example_input=tokens)
    assert est.fallback is None
    assert set(est.peak_by_device()) == {CUDA0, CPU}  # Adam's step scalars live on the cpu
    params, buffers = list(model.parameters()), list(model.buffers())
    assert (est.parameters, est.buffers, est.gradients) == (
        held(params, 1),
        held(buffers, 1),
        held(params, 1),
    )
    row = next(r for r in est.peaks if r.device == CUDA0)
    block = cuda_block()
    assert (row.parameters, row.buffers) == (held(params, block), held(buffers, block))
    # the steady step holds Adam's two moments from its start (foreach, as on CUDA)
    assert row.optimizer_state == 2 * held(params, block)
    assert est.first_step_peak is not None and est.first_step_peak < est.peak
    assert est.activations > 2 * 32 * 128 * 4  # at least the logits
    assert any(m.name.endswith("layers.0") or m.name.endswith("h.0") for m in est.modules)
    assert all(m.device == CUDA0 for m in est.modules)
    assert_same(before, model)
    assert {p.device for p in model.parameters()} == {CUDA0}


def test_transformers_skeleton_on_meta_forward() -> None:
    model = tiny("llama")
    est = estimate(model, example_input=tokens, step="forward")
    assert est.fallback is None
    assert set(est.peak_by_device()) == {META}
    assert est.peaks[0].gradients == 0 and est.activations > 0


# --- operators whose fake kernels are narrower than their real ones ---------------------------


class GroupedExperts(nn.Module):
    """Two experts run as one grouped matmul, in float32, as transformers' MoE layers run
    ``grouped_mm`` on a CPU (whose kernel takes float32, where its meta kernel takes bf16)."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.ones(2, 16, 32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offs = torch.tensor([x.shape[0] // 2, x.shape[0]], dtype=torch.int32, device=x.device)
        y = torch.nn.functional.grouped_mm(x, self.experts, offs=offs)
        return y * y


@pytest.mark.skipif(
    not hasattr(torch.nn.functional, "grouped_mm"), reason="this torch has no grouped_mm"
)
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_grouped_mm_in_float32_is_measured(device: str) -> None:
    model = GroupedExperts(device)
    if device == "cpu":
        model(torch.ones(8, 16)).sum().backward()  # the real kernels take it
        model.experts.grad = None
    before = snapshot(model)
    est = estimate(model, example_input=torch.ones(64, 16), optimizer="sgd")
    assert est.fallback is None
    assert est.activations >= 64 * 32 * 4  # the grouped product, float32, saved for y * y
    assert est.temporaries >= 64 * 32 * 4  # its gradient, in the backward
    assert_same(before, model)


@functools.cache
def picky_op() -> Any:
    """An operator whose fake kernel refuses float32, which its real kernel takes."""

    @torch.library.custom_op("torchplace_tests::picky", mutates_args=())
    def picky(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @picky.register_fake  # type: ignore[untyped-decorator,misc]
    def _(x: torch.Tensor) -> torch.Tensor:
        torch._check(x.dtype == torch.bfloat16, lambda: f"picky takes bfloat16, not {x.dtype}")
        return torch.empty_like(x)

    return picky


class Picky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return picky_op()(self.lin(x))  # type: ignore[no-any-return]


def test_an_operator_fake_tensors_cannot_run_is_named_not_blamed_on_the_input() -> None:
    model = nn.Sequential(nn.Linear(IN, IN), Picky())
    model(torch.ones(2, IN))  # the input is fine: the real model takes it
    before = snapshot(model)
    with pytest.raises(TorchplaceError) as caught:
        estimate(model, example_input=torch.ones(B, IN))
    text = str(caught.value)
    assert "failed in the operator torchplace_tests.picky.default, in model.1 (Picky)" in text
    assert "picky takes bfloat16, not torch.float32" in text
    assert "this operator cannot run on fake tensors" in text
    assert "estimate without example_input" in text
    assert_same(before, model)


class Routed(nn.Module):
    """A router that reads its tokens' counts per expert in Python (``.tolist()``), as
    JetMoE's does, and checks a value with ``.item()``, as XLM does."""

    def __init__(self, experts: int = 4, width: int = 32) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.Parameter(torch.randn(experts, width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert (x.shape[0] - (x[:, 0] != x[:, 0]).sum()).item() <= x.shape[0]
        top = self.router(x).argmax(-1)
        chosen = torch.zeros(x.shape[0], len(self.experts), device=x.device)
        sizes = chosen.scatter(1, top[:, None], 1).long().sum(0).tolist()
        parts = x[top.argsort()].split(sizes)
        return torch.cat([p @ w for p, w in zip(parts, self.experts, strict=True)])


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_value_read_in_python_is_answered_by_a_small_side_value(device: str) -> None:
    torch.manual_seed(0)
    real = Routed()
    model = Routed().to(device)
    est = estimate(model, example_input=lambda dev: torch.randn(64, 32, device=dev))
    assert est.fallback is None
    _, *steady = train_peaks(real, torch.randn(64, 32))
    assert est.peak == pytest.approx(max(steady), rel=0.05)


class Unpadded(nn.Module):
    """Sizes a tensor by the tokens of its batch that are not padding (id 0), read in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = int((ids != 0).sum().item())
        work = torch.zeros(n, 1 << 14, device=ids.device)  # 64 KiB per real token
        return self.emb(ids).sum() + work.sum()


def test_a_value_read_from_the_batch_is_the_batchs_own() -> None:
    """The batch's tensors were made fake and a read of one took a stand-in's zeros: a step
    sized by the tokens that are not padding came out as if there were none, without a word.
    A read of the example batch reads the caller's values."""
    torch.manual_seed(0)
    ids = torch.randint(1, 100, (2, 16))
    est = estimate(Unpadded().to("meta"), example_input=ids)
    assert est.fallback is None
    _, *steady = train_peaks(Unpadded(), ids)
    assert est.peak == pytest.approx(max(steady), rel=0.05)
    assert est.peak > 32 * (1 << 14) * 4  # the 32 real tokens' work


def test_the_side_valued_run_leaves_the_callers_random_stream_alone() -> None:
    """The second run computes side values with real operators: random ones (``rand``,
    dropout) drew from the caller's global generator."""

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = nn.functional.dropout(self.proj(x) + torch.rand(4, 8, device=x.device), 0.5)
            return y[:, : int((x > 0).sum().item()) % 8 + 1]

    model = Noisy().to("meta")
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    est = estimate(model, example_input=torch.ones(4, 8))
    assert est.fallback is None
    assert torch.equal(torch.rand(3), want)


def test_a_value_read_of_a_large_tensor_still_falls_back() -> None:
    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(1024, 1024)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            big = self.proj(x).argmax(0)  # made from a tensor too large for a side value
            return self.proj(x)[: int(big.max().item()) + 1]

    with pytest.warns(UserWarning, match="DataDependentOutputException"):
        est = estimate(Reads().to("meta"), example_input=torch.ones(2048, 1024))
    assert est.fallback is not None and "DataDependentOutputException" in est.fallback


def test_a_side_value_the_step_refuses_falls_back_as_before() -> None:
    class Refuses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert (x != x).sum().item() > 0, "no NaN in the batch"  # a side value says 0
            return self.proj(x)

    with pytest.warns(UserWarning, match="DataDependentOutputException"):
        est = estimate(Refuses().to("meta"), example_input=torch.ones(4, 8))
    assert est.fallback is not None and "DataDependentOutputException" in est.fallback


def tiny_mixtral() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config)


# transformers 4.x routes a Mixtral's tokens with nonzero() and builds a padding mask with
# .item(): sizes fake tensors do not know, so the step is counted, not measured (the estimate
# says so); transformers 5 does both without reading values.
values_read = needs_transformers_5("the step reads tensor values (nonzero, .item()): counted only")


@pytest.mark.slow  # a transformers MoE model: ~3 s on two cores
@values_read
def test_a_float32_mixtral_skeleton_is_measured() -> None:
    model = tiny_mixtral()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    est = estimate(model, example_input=tokens)
    assert est.fallback is None
    assert est.peak > est.parameters + est.gradients + est.optimizer_state
    assert est.activations > 2 * 32 * 128 * 4  # at least the logits
    assert any(m.name == "model.layers.0.mlp.experts" for m in est.modules)


# --- modules made inside the forward ----------------------------------------------------------


class LossInside(nn.Module):
    """Makes its loss module in its forward, as transformers' T5 does: gone by the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.CrossEntropyLoss()(self.lin(x), labels)  # type: ignore[no-any-return]


def test_a_module_made_in_the_forward_warns_nothing(recwarn: pytest.WarningsRecorder) -> None:
    batch = {"x": torch.ones(B, IN), "labels": torch.zeros(B, dtype=torch.long)}
    est = estimate(LossInside(), example_input=batch, optimizer="sgd")
    assert [str(w.message) for w in recwarn] == []
    assert est.fallback is None
    assert est.activations >= B * OUT * 4  # the logits, saved for the loss's backward
    assert est.temporaries >= B * OUT * 4  # their gradient, in the backward


def test_t5_is_measured_without_warnings(recwarn: pytest.WarningsRecorder) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        d_model=32,
        d_ff=64,
        d_kv=8,
        num_heads=4,
        num_layers=2,
        num_decoder_layers=2,
        vocab_size=128,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(config)
    recwarn.clear()
    est = estimate(model, example_input=tokens)
    assert [str(w.message) for w in recwarn] == []
    assert est.fallback is None
    assert est.peak > est.parameters + est.gradients + est.optimizer_state
    assert est.activations > 2 * 32 * 128 * 4  # at least the logits
    assert {m.name for m in est.modules} >= {"encoder", "decoder", "lm_head"}


# --- when the step cannot be measured: counting, with the reason ------------------------------


@pytest.fixture
def fresh_tracker() -> Any:
    _fake_step._tracker_class.cache_clear()
    yield
    _fake_step._tracker_class.cache_clear()


def assert_counted(est: Any, counted: Any, reason: str) -> None:
    assert est.fallback is not None and reason in est.fallback
    assert (est.peaks, est.activations, est.temporaries) == ((), 0, 0)
    assert est.peak == est.total == counted.total
    assert est.to_dict()["fallback"] == est.fallback


def test_falls_back_when_the_tracker_is_missing(
    monkeypatch: pytest.MonkeyPatch, fresh_tracker: None
) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed._tools.mem_tracker", None)
    model = mlp()
    before = snapshot(model)
    with pytest.warns(UserWarning, match=r"train step was not measured.*has no .*MemTracker"):
        est = estimate(model, example_input=torch.ones(B, IN))
    assert_counted(est, estimate(model), "MemTracker")
    assert "not measured" in str(est)
    assert_same(before, model)


def test_falls_back_when_the_tracker_changed(
    monkeypatch: pytest.MonkeyPatch, fresh_tracker: None
) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    monkeypatch.delattr(MemTracker, "_update_peak_stats")
    with pytest.warns(UserWarning, match="lacks _update_peak_stats"):
        est = estimate(mlp(), example_input=torch.ones(B, IN))
    assert_counted(est, estimate(mlp()), "_update_peak_stats")


def test_falls_back_when_the_tracker_fails_inside(
    monkeypatch: pytest.MonkeyPatch, fresh_tracker: None
) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    def broken(self: Any, module: nn.Module, args: Any) -> None:
        raise AttributeError("'_ModMemStats' object has no attribute 'renamed'")

    monkeypatch.setattr(MemTracker, "_pre_bw_hook", broken)
    model = mlp()
    before = snapshot(model)
    with pytest.warns(UserWarning, match="MemTracker failed"):
        est = estimate(model, example_input=torch.ones(B, IN))
    assert_counted(est, estimate(model), "renamed")
    assert_same(before, model)


def test_falls_back_for_a_model_on_several_devices_this_machine_lacks() -> None:
    if torch.cuda.is_available():
        pytest.skip("a machine with CUDA runs the step on the devices themselves")
    model = on_fake_cuda(mlp("meta"), {"0": "cuda:0", "2": "cuda:1"})
    with pytest.warns(UserWarning, match=r"spread over cuda:0, cuda:1"):
        est = estimate(model, example_input=torch.ones(B, IN), optimizer=None)
    assert_counted(est, estimate(model, optimizer=None), "cannot run a step on cuda:0, cuda:1")


# --- bad arguments ----------------------------------------------------------------------------


def test_an_input_the_model_cannot_take_names_the_model() -> None:
    model = mlp()
    before = snapshot(model)
    with pytest.raises(
        TorchplaceError, match=r"example_input.*Sequential.*RuntimeError.*\[64, 5\]"
    ):
        estimate(model, example_input=torch.ones(B, 5))
    assert_same(before, model)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_a_batch_in_a_dtype_the_model_cannot_take_raises(dtype: torch.dtype) -> None:
    # the meta kernel of addmm takes a float64 or int64 batch into float32 weights; the real
    # kernels raise "mat1 and mat2 must have the same dtype"
    model = mlp()
    with pytest.raises(RuntimeError, match="same dtype"):
        model(torch.ones(B, IN, dtype=dtype))
    before = snapshot(model)
    said = str(dtype).removeprefix("torch.")
    with pytest.raises(
        TorchplaceError,
        match=rf"the train step of Sequential cannot run on it: the operator aten.addmm.default, "
        rf"in model.0 \(Linear\) raises RuntimeError: addmm: its operands are in different "
        rf"dtypes \(float32 and {said}\), as its real kernel does; pass a batch",
    ):
        estimate(model, example_input=torch.ones(B, IN, dtype=dtype))
    assert_same(before, model)
    double = estimate(mlp().double(), example_input=torch.ones(B, IN, dtype=torch.float64))
    assert double.fallback is None and double.peaks[0].parameters == 2 * MLP_PARAMS


def test_positions_beyond_a_learned_position_table_raise() -> None:
    # GPT-2 looks its positions (torch.arange(seq)) up in a table of n_positions rows: a real
    # step at a longer sequence raises IndexError, which fake tensors (no values) let through
    model = tiny("gpt2")  # n_positions=64
    ids = torch.zeros(1, 65, dtype=torch.long)
    with pytest.raises(
        TorchplaceError,
        match=r"GPT2LMHeadModel cannot run on it: the operator aten.embedding.default, in "
        r"model.transformer.wpe \(Embedding\) raises IndexError: index out of range in self "
        r"\(positions 0..64 in a table of 64 rows\)",
    ):
        estimate(model, example_input={"input_ids": ids, "labels": ids})
    fits = estimate(model, example_input={"input_ids": ids[:, :64], "labels": ids[:, :64]})
    assert fits.fallback is None and fits.activations > 0


class _CastsUnderAutocast(nn.Module):
    """A forward that casts its input to bfloat16 inside autocast: the real kernel gets both
    operands cast, while on meta autocast does nothing (found in review)."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.lin(x.to(torch.bfloat16))


class _PositionsCut(nn.Module):
    """Positions cut from a longer arange, or clamped in place, looked up in a short table:
    each runs for real (found in review)."""

    def __init__(self, how: str, device: str | None = None) -> None:
        super().__init__()
        self.how = how
        self.table = nn.Embedding(16, 4, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "slice":
            positions = torch.arange(2048, device=x.device)[: x.shape[1]]
        elif self.how == "clamp_":
            positions = torch.arange(x.shape[1] + 8, device=x.device)  # 0..19
            positions.clamp_(max=15)
        else:  # changed in place through a view of it: 0..9, 0..9
            positions = torch.arange(20, device=x.device)
            positions[10:] -= 10
        return x + self.table(positions).sum()


@pytest.mark.parametrize(
    "make",
    [
        _CastsUnderAutocast,
        lambda **kw: _PositionsCut("slice", **kw),
        lambda **kw: _PositionsCut("clamp_", **kw),
        lambda **kw: _PositionsCut("view", **kw),
    ],
    ids=["autocast", "sliced-positions", "clamped-positions", "positions-changed-by-a-view"],
)
@pytest.mark.parametrize("step", ["forward", "train"])
def test_what_runs_for_real_is_measured_on_a_skeleton_too(make: Any, step: str) -> None:
    x = torch.randn(2, 12) if make is not _CastsUnderAutocast else torch.randn(2, 8)
    make()(x).sum().backward()  # runs for real, forward and backward
    for model in (make(), make(device="meta")):
        found = estimate(model, example_input=x, step=step, optimizer="sgd")
        assert found.fallback is None and found.peak > 0


def test_a_product_autocast_does_not_cast_is_still_refused() -> None:
    """CPU autocast casts linear and matmul, not mv: mixed dtypes there fail for real (the
    first fix for autocast let every product through while it was on)."""

    class Mv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return torch.mv(self.w, x.to(torch.bfloat16))

    with pytest.raises(RuntimeError, match=r"same dtype|expected scalar type"):  # 2.6: the latter
        Mv()(torch.ones(4))
    with pytest.raises(TorchplaceError, match=r"aten.mv.default.*different dtypes"):
        estimate(Mv(), example_input=torch.ones(4), step="forward")


def test_an_input_the_model_cannot_take_logs_no_traceback_of_torch() -> None:
    # FakeTensorMode logs the failing operator with a full traceback at ERROR before it
    # re-raises; estimate's own error already carries torch's message, so the user saw the
    # same failure twice, first as a wall of "E... fake_tensor.py" lines.
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        with pytest.raises(TorchplaceError, match=r"example_input.*\[64, 5\]"):
            estimate(mlp(), example_input=torch.ones(B, 5))
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == []
    assert logger.filters == []  # nothing left installed


def test_bad_step_and_grads_say_what_to_pass() -> None:
    with pytest.raises(DeviceSpecError, match=r"step='backward'.*'train' or 'forward'"):
        estimate(mlp(), example_input=torch.ones(B, IN), step="backward")
    with pytest.raises(TorchplaceError, match=r"grads=False.*step='forward'"):
        estimate(mlp(), example_input=torch.ones(B, IN), grads=False)


def test_without_an_input_the_peak_is_the_count() -> None:
    est = estimate(mlp())
    assert (est.step, est.peaks) == (None, ())
    assert est.peak == est.total and est.peak_by_device() == est.by_device()
    assert "step" not in est.to_dict()


# --- cuBLAS workspaces of a CUDA step ---------------------------------------------------------

HOPPER_WORKSPACE = 32 << 20  # PyTorch's default on compute capability 9 and later


def mlp_on_fake_cuda() -> nn.Module:
    return on_fake_cuda(mlp("meta"), {"": "cuda:0"}).requires_grad_(True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default size is the GPU's here")
@pytest.mark.parametrize(("step", "threads"), [("forward", 1), ("train", 2)])
def test_a_cuda_step_holds_a_cublas_workspace_per_thread(step: str, threads: int) -> None:
    # measured on an H200: an inference forward holds one 32 MiB workspace (the caller's
    # thread), a training step two (autograd runs the backward on a thread of its own)
    on_cuda = estimate(mlp_on_fake_cuda(), example_input=torch.ones(B, IN), step=step)
    on_meta = estimate(mlp("meta"), example_input=torch.ones(B, IN), step=step)
    cuda_row = next(r for r in on_cuda.peaks if r.device == CUDA0)
    meta_row = next(r for r in on_meta.peaks if r.device == META)
    assert cuda_row.workspace == threads * HOPPER_WORKSPACE
    assert meta_row.workspace == 0
    # the optimizer's temporaries differ: foreach on CUDA, the single-tensor loop on meta
    assert cuda_row.total - cuda_row.temporaries == (
        meta_row.total - meta_row.temporaries + threads * HOPPER_WORKSPACE
    )
    assert "cuBLAS" in str(on_cuda)


def test_cublas_workspace_config_sizes_the_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    est = estimate(mlp_on_fake_cuda(), example_input=torch.ones(B, IN), step="forward")
    (row,) = est.peaks
    assert row.workspace == 4096 * 1024 * 2 + 16 * 1024 * 8


def test_no_workspace_without_a_matrix_product_or_off_cuda() -> None:
    norm = on_fake_cuda(nn.Sequential(nn.LayerNorm(IN, device="meta")), {"": "cuda:0"})
    (row,) = estimate(norm, example_input=torch.ones(B, IN), step="forward").peaks
    assert row.workspace == 0
    (row,) = estimate(mlp(), example_input=torch.ones(B, IN), step="forward").peaks
    assert row.workspace == 0


# --- against a real step on the cpu: the allocator's own figures ------------------------------


def allocator_peak(step: Any) -> int:
    """The most the cpu allocator held over ``step()`` above what it held before (the
    profiler's allocation events carry the allocator's running total)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():  # torch 2.11 warns that a cycle's events are cleared
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    events, totals = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while events:
        event = events.pop()
        events.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            totals.append((event.start_time_ns, fields.total_allocated, fields.alloc_size))
    totals.sort()
    return max(total for _, total, _ in totals) - (totals[0][1] - totals[0][2])


@pytest.mark.parametrize("step", ["forward", "train"])
def test_the_peak_is_the_real_steps_on_the_cpu(step: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train(step == "train")
    ids = torch.randint(0, 1000, (4, 64))
    batch = {"input_ids": ids, "labels": ids}
    est = estimate(model, example_input=batch, step=step)
    opt = torch.optim.Adam(model.parameters())

    def real() -> None:  # as estimate runs it: a training step keeps its output to the end
        if step == "forward":
            with torch.no_grad():
                model(**batch)
            return
        output = model(**batch)
        output.loss.backward()
        opt.step()
        opt.zero_grad()
        del output

    if step == "train":  # the steady step is measured: Adam's state is made by the first
        real()
    state = [t for s in opt.state.values() for t in s.values()]
    held = sum(t.nbytes for t in (*model.parameters(), *model.buffers(), ids, *state))
    assert est.peak == pytest.approx(held + allocator_peak(real), rel=0.03)


def test_the_peak_table_shows_the_workspace_only_where_one_is_held() -> None:
    assert "cuBLAS" not in str(estimate(mlp(), example_input=torch.ones(B, IN), step="forward"))


# --- scaled_dot_product_attention on meta: the fused kernel the device would run -------------


def sdpa_llama(skeleton: bool, dropout: float = 0.0, step: str = "forward") -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=100, max_position_embeddings=256,
        attention_dropout=dropout, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    if skeleton:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config).train(step == "train")
    return transformers.LlamaForCausalLM(config).train(step == "train")


SDPA_IDS = torch.zeros(1, 256, dtype=torch.long)
PADDED = torch.ones(1, 256, dtype=torch.long).index_fill_(1, torch.arange(40), 0)


@pytest.mark.parametrize("step", ["forward", "train"])
@pytest.mark.parametrize(
    "padded",
    [False, pytest.param(True, marks=values_read)],
    ids=["causal", "padding-mask"],
)
def test_a_skeletons_sdpa_is_the_cpus_fused_kernel(step: str, padded: bool) -> None:
    # on meta, SDPA ran the math path and held (heads, seq, seq) matrices: 18x the real
    # attention memory; the CPU runs its flash kernel, which holds the output and log-sum-exp
    batch = {"input_ids": SDPA_IDS, "labels": SDPA_IDS}
    if padded:  # a boolean mask: the kernel takes it as an additive float one
        batch["attention_mask"] = PADDED
    on_meta = estimate(sdpa_llama(True, step=step), example_input=batch, step=step)
    model = sdpa_llama(False, step=step)
    on_cpu = estimate(model, example_input=batch, step=step)
    assert on_meta.activations == on_cpu.activations
    meta_row = next(r for r in on_meta.peaks if r.device == META)
    cpu_row = next(r for r in on_cpu.peaks if r.device == CPU)
    kinds = ("parameters", "gradients", "activations", "temporaries", "inputs")
    assert [getattr(meta_row, k) for k in kinds] == [getattr(cpu_row, k) for k in kinds]
    from torchplace.looking import _attention

    # and the real step's allocator agrees, where the CPU runs its flash kernel for this
    # grouped-query model (torch 2.6 runs the math path: the matrices are then real too)
    if step == "forward" and not padded and _attention._cpu_flash_takes_grouped_query():
        with torch.no_grad():
            real = allocator_peak(lambda: model(**batch))
        held = sum(t.nbytes for t in (*model.parameters(), *model.buffers(), *batch.values()))
        assert on_meta.peak == pytest.approx(held + real, rel=0.03)
        math_matrices = 2 * 8 * 256 * 256 * 4  # a layer's scores and softmax, float32
        assert on_meta.activations < math_matrices


def test_a_skeletons_sdpa_with_dropout_stays_the_math_path() -> None:
    # the CPU's flash kernel takes no dropout: a training step with attention dropout runs
    # the math path, which holds the attention matrices, on the CPU as on meta
    batch = {"input_ids": SDPA_IDS, "labels": SDPA_IDS}
    on_meta = estimate(sdpa_llama(True, 0.1, "train"), example_input=batch)
    on_cpu = estimate(sdpa_llama(False, 0.1, "train"), example_input=batch)
    assert on_meta.activations == on_cpu.activations
    assert on_meta.activations > 2 * 2 * 8 * 256 * 256 * 4  # two layers' matrices kept


def sdpa_kernel(device: str, dtype: torch.dtype, **kwargs: Any) -> str:
    from torchplace.looking import _attention

    head = kwargs.pop("head", 64)
    q = torch.empty(1, 8, 128, head, dtype=dtype, device="meta")
    kv = torch.empty(1, kwargs.pop("kv_heads", 8), 128, head, dtype=dtype, device="meta")
    found = _attention._arguments(q, kv, kv, **kwargs)
    return _attention._kernel(torch.device(device), found)


def test_the_sdpa_kernel_follows_pytorchs_dispatch_rules() -> None:
    from torchplace.looking import _attention

    bf16, f32 = torch.bfloat16, torch.float32
    mask = torch.ones(128, 128, dtype=torch.bool, device="meta")
    assert sdpa_kernel("cuda:0", bf16, is_causal=True) == "flash"
    assert sdpa_kernel("cuda:0", bf16, kv_heads=2, enable_gqa=True) == "flash"
    assert sdpa_kernel("cuda:0", bf16, attn_mask=mask) == "efficient"
    assert sdpa_kernel("cuda:0", f32) == "efficient"
    assert sdpa_kernel("cuda:0", f32, dropout_p=0.1) == "efficient"
    assert sdpa_kernel("cuda:0", f32, head=12) == "efficient"  # a multiple of 4 in float32
    assert sdpa_kernel("cuda:0", f32, head=10) == "math"
    assert sdpa_kernel("cuda:0", bf16, head=12, attn_mask=mask) == "math"  # 8 in bfloat16
    assert sdpa_kernel("cuda:0", bf16, head=320) == "efficient"  # flash takes 256 at most
    # grouped-query runs on flash or the math path only, on CUDA (found in review)
    assert sdpa_kernel("cuda:0", f32, kv_heads=2, enable_gqa=True) == "math"
    assert sdpa_kernel("cuda:0", bf16, kv_heads=2, enable_gqa=True, attn_mask=mask) == "math"
    assert sdpa_kernel("cuda:0", torch.float64) == "math"
    assert sdpa_kernel("cuda:0", f32, kv_heads=2) == "math"  # heads differ, gqa not asked
    for device in ("cpu", "meta"):
        assert sdpa_kernel(device, f32, attn_mask=mask) == "cpu"
        grouped = "cpu" if _attention._cpu_flash_takes_grouped_query() else "math"  # 2.6: math
        assert sdpa_kernel(device, bf16, kv_heads=2, enable_gqa=True) == grouped
        assert sdpa_kernel(device, torch.float64, head=12) == "cpu"
        assert sdpa_kernel(device, f32, dropout_p=0.1) == "math"
        # as torch._fused_sdp_choice picks on the CPU (found in review)
        mask3 = torch.ones(1, 128, 128, dtype=torch.bool, device="meta")
        assert sdpa_kernel(device, f32, attn_mask=mask3) == "math"
    q = torch.empty(2, 8, 128, 64, device="meta")
    one = torch.empty(1, 8, 128, 64, device="meta")  # a batch broadcast
    none = torch.empty(2, 8, 0, 64, device="meta")  # no keys
    from torchplace.looking import _attention

    for k in (one, none):
        assert _attention._kernel(torch.device("cpu"), _attention._arguments(q, k, k)) == "math"


def test_the_cpus_grouped_query_answer_does_not_depend_on_where_it_is_first_asked() -> None:
    """Asked first under ``with torch.device("meta")`` or a math-only ``sdpa_kernel``, the
    probe said no, and kept it: a later skeleton's attention was sized 150x (found in
    review)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from torchplace.looking import _attention

    q, kv = torch.zeros(1, 2, 4, 8), torch.zeros(1, 1, 4, 8)
    expected = torch._fused_sdp_choice(q, kv, kv, enable_gqa=True) != 0  # asked plainly
    for context in (torch.device("meta"), sdpa_kernel([SDPBackend.MATH])):
        _attention._cpu_flash_takes_grouped_query.cache_clear()
        with context:
            assert _attention._cpu_flash_takes_grouped_query() == expected
    _attention._cpu_flash_takes_grouped_query.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA runs it on cuda:0")
def test_a_fake_cuda_sdpa_model_holds_no_attention_matrix() -> None:
    model = on_fake_cuda(sdpa_llama(True).to(torch.bfloat16), {"": "cuda:0"})
    batch = {"input_ids": SDPA_IDS, "labels": SDPA_IDS}
    est = estimate(model, example_input=batch, step="forward")
    assert est.activations < 8 * 256 * 256 * 2  # one layer's bf16 scores would be more


def test_a_model_partly_on_meta_runs_wholly_on_meta() -> None:
    """A model with one layer still on meta (a skeleton partly loaded, or one whose code makes
    a tensor on the CPU whatever the default device) fell back to counting, "spread over cpu
    and meta"; a fake step needs no values, so it runs wholly on meta, and is measured as the
    same model wholly on the CPU is."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, device="meta"))
    found = estimate(model, example_input=torch.ones(2, 4))
    whole = estimate(model.to_empty(device="cpu"), example_input=torch.ones(2, 4))
    assert found.fallback is None and found.peak == whole.peak
    assert found.parameters == 2 * (16 + 4) * 4
    assert {p.device.type for p in model.parameters()} == {"cpu"}

    class Unused(torch.nn.Module):  # its meta part never runs: the step is measured
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4, device="meta")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)

    measured = estimate(Unused(), example_input=torch.ones(2, 4))
    assert measured.fallback is None and measured.activations > 0


# --- torch's tracker's own warnings stay inside the estimate ----------------------------------


class _Func(nn.Module):
    """A function made a module and kept as a plain attribute, registered nowhere, as the
    kernels package makes transformers' hub functions: one calling another of its class makes
    torch's module tracker see ``Func`` entered inside ``Func`` and warn that its hierarchy
    "maybe be messed up" (the figures stay right)."""

    def __init__(self, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.__dict__["inner"] = inner  # not a child: a plain attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.__dict__["inner"]
        return x * 2 if inner is None else inner(x) + 1


class _CallsFuncs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.__dict__["rotate"] = _Func(_Func())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.__dict__["rotate"](self.linear(x)))


@pytest.mark.parametrize("step", ["forward", "train"])
def test_the_trackers_hierarchy_warning_is_not_shown_and_nothing_process_wide_changes(
    step: str,
) -> None:
    model = nn.Sequential(_CallsFuncs(), _CallsFuncs())
    shown, filters = warnings.formatwarning, list(warnings.filters)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as the suite and -W error run it
        est = estimate(model, example_input=torch.ones(4, 8), step=step)
    assert est.fallback is None
    assert est.parameters == 2 * (8 * 8 + 8) * 4
    assert warnings.formatwarning is shown  # torch's tracker replaces it when it warns
    assert warnings.filters == filters
    # only inside the run: the same warning outside it is heard
    with pytest.warns(UserWarning, match="hierarchy tracking maybe be messed up"):
        warnings.warn("The module hierarchy tracking maybe be messed up.", stacklevel=1)


def test_a_llama_estimate_under_w_error_with_the_kernels_package() -> None:
    """transformers 5 pulls in the kernels package, whose hub layers wrap Llama's rotary
    embedding; estimate of a Llama must pass under -W error there (it raised the tracker's
    warning), in a process of its own as a user's script runs."""
    pytest.importorskip("transformers")
    assert importlib.util.find_spec("kernels") is not None, (
        "the test extra installs the kernels package (transformers 5 pulls it in)"
    )
    script = textwrap.dedent(
        """
        import warnings
        import torch, transformers, torchplace
        shown = warnings.formatwarning
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        ids = torch.zeros(2, 32, dtype=torch.long)
        for step in ("forward", "train"):
            est = torchplace.estimate(model, example_input={"input_ids": ids, "labels": ids},
                                      step=step)
            assert est.fallback is None, est.fallback
        assert warnings.formatwarning is shown
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
