"""``estimate`` across the kinds of model transformers builds: encoder-decoders, vision and
audio models with their own input names, CTC heads, LayerDrop, learned attention biases; from
Python on a skeleton, and from ``torchplace estimate DIR``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from estimate_truth import train_peaks
from helpers import needs_transformers_5
from torchplace._errors import TorchplaceError
from torchplace.cli import main
from torchplace.cli._inputs import example_batch
from torchplace.looking._estimate import estimate

transformers = pytest.importorskip("transformers")

# transformers 4.x's audio models read a tensor's value in their step (``.item()``), which
# fake tensors lack: counted only there (the sweep's estimate leg runs on 5 alone, as well)
READS_VALUES_ON_4 = needs_transformers_5("the step reads tensor values (.item()): counted only")
NOT_ON_4 = needs_transformers_5("no such model")
# torch 2.6 has no meta kernel for weight norm's backward (wav2vec2's and HuBERT's positional
# convolution), so their training step cannot run on fake tensors there
WEIGHT_NORM_BACKWARD = pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 7),
    reason="torch 2.6 has no meta kernel for weight norm's backward",
)

# model type, class, and what the class takes as its main input
KINDS = [
    ("t5", "T5ForConditionalGeneration", "input_ids"),
    ("vit", "ViTForImageClassification", "pixel_values"),
    pytest.param("wav2vec2", "Wav2Vec2ForCTC", "input_values", marks=READS_VALUES_ON_4),
    pytest.param("hubert", "HubertForCTC", "input_values", marks=READS_VALUES_ON_4),
    pytest.param(
        "whisper", "WhisperForConditionalGeneration", "input_features", marks=READS_VALUES_ON_4
    ),
    ("xlnet", "XLNetLMHeadModel", "input_ids"),
    ("doge", "DogeForCausalLM", "input_ids"),
    # a layer given a parameter whole in an inference forward (torch's tracker hooked its grad)
    pytest.param("nemotron_h", "NemotronHForCausalLM", "input_ids", marks=NOT_ON_4),
    # steps that read a tensor's value in Python, answered by side values (_side_values): XLM's
    # lengths.max().item(), JetMoE's expert_size.tolist(); checked on transformers 5
    pytest.param("xlm", "XLMWithLMHeadModel", "input_ids", marks=READS_VALUES_ON_4),
    pytest.param("jetmoe", "JetMoeForCausalLM", "input_ids", marks=READS_VALUES_ON_4),
]


def tiny(model_type: str) -> Any:
    from hf_architectures import tiny_config

    config = tiny_config(model_type)
    if model_type == "vit":
        config.image_size = 32
    return config


def build(model_type: str, cls: str, device: str = "meta") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        model: nn.Module = getattr(transformers, cls)(tiny(model_type))
    return model


@pytest.mark.parametrize(("model_type", "cls", "main_input"), KINDS)
@pytest.mark.parametrize("step", ["forward", "train"])
def test_a_skeleton_of_each_kind_is_measured(
    model_type: str, cls: str, main_input: str, step: str
) -> None:
    if step == "train" and model_type in ("wav2vec2", "hubert"):
        old_torch = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 7)
        if old_torch:
            pytest.skip("torch 2.6 has no meta kernel for weight norm's backward")
    model = build(model_type, cls)
    batch, _ = example_batch(model, tiny(model_type), 2, 16, step == "train")
    assert main_input in batch(torch.device("meta"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning, no warning of ours
        warnings.filterwarnings("ignore", module="transformers")
        est = estimate(model, example_input=batch, step=step)
    assert est.fallback is None and est.peak > est.total
    layerdrops = [getattr(model.config, n, 0.0) for n in ("layerdrop", "encoder_layerdrop")]
    assert layerdrops == [
        getattr(tiny(model_type), n, 0.0) for n in ("layerdrop", "encoder_layerdrop")
    ]


@pytest.mark.parametrize(
    ("model_type", "cls"),
    [
        ("t5", "T5ForConditionalGeneration"),
        pytest.param("wav2vec2", "Wav2Vec2ForCTC", marks=READS_VALUES_ON_4),
        pytest.param("xlm", "XLMWithLMHeadModel", marks=READS_VALUES_ON_4),
        pytest.param("jetmoe", "JetMoeForCausalLM", marks=READS_VALUES_ON_4),
    ],
)
def test_the_training_peak_is_the_real_ones(model_type: str, cls: str) -> None:
    # T5's learned position bias is a mask that requires grad: the CPU runs the math path for
    # it (its flash kernel cannot differentiate a mask); wav2vec2 masks frames by a boolean
    # index (SpecAugment), sized as if every frame were masked; XLM and JetMoE read values
    model = build(model_type, cls, "cpu")
    batch = example_batch(model, tiny(model_type), 2, 16, True)[0](torch.device("cpu"))
    if model_type == "wav2vec2":
        model.config.mask_time_prob = 0.0  # the real step then masks nothing, a known size
    est = estimate(model, example_input=batch)
    _, *steady = train_peaks(model, batch)
    assert est.fallback is None
    assert est.peak == pytest.approx(max(steady), rel=0.05)


@READS_VALUES_ON_4
@WEIGHT_NORM_BACKWARD
def test_layerdrop_is_off_in_the_step_and_put_back() -> None:
    model = build("wav2vec2", "Wav2Vec2ForCTC")
    model.config.layerdrop = 0.3
    batch = example_batch(model, model.config, 1, 16, True)[0]
    est = estimate(model, example_input=batch)
    assert est.fallback is None and model.config.layerdrop == 0.3


def test_a_mask_that_requires_grad_runs_the_math_path_on_the_cpu() -> None:
    class Biased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(1, 2, 64, 64))
            self.proj = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.proj(x).view(1, 64, 2, 8).transpose(1, 2)
            return nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=self.bias)

    model = Biased().to("meta")
    est = estimate(model, example_input=torch.ones(1, 64, 16))
    assert est.fallback is None
    real = Biased()
    _, *steady = train_peaks(real, torch.ones(1, 64, 16))
    assert est.peak == pytest.approx(max(steady), rel=0.02)


@pytest.mark.parametrize(
    ("model_type", "cls", "said"),
    [
        ("t5", "T5ForConditionalGeneration", "2 x 16 tokens of input_ids, 16 decoder tokens"),
        ("vit", "ViTForImageClassification", "2 x images of 32 x 32"),
        pytest.param(
            "hubert", "HubertForCTC", "2 x 5120 audio samples (16 frames)", marks=READS_VALUES_ON_4
        ),
    ],
)
@pytest.mark.parametrize("step", ["forward", "train"])
def test_the_command_line_gives_each_model_its_own_inputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model_type: str, cls: str, said: str,
    step: str,
) -> None:  # fmt: skip
    config = tiny(model_type)
    config.architectures = [cls]
    config.save_pretrained(tmp_path)
    argv = [str(tmp_path), "--step", step, "--batch", "2", "--seq", "16", "--device", "cpu"]
    status = main(["estimate", *argv, "--json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    report = json.loads(out)
    assert (report["architecture"], report["input"], report["fallback"]) == (cls, said, None)
    assert report["peak"] > report["total"]


def test_a_missing_input_is_named() -> None:
    model = build("vit", "ViTForImageClassification")
    with pytest.raises(TorchplaceError, match=r"it lacks 'pixel_values', the input ViTForImage"):
        estimate(model, example_input={"labels": torch.zeros(2, dtype=torch.long)})


class _Stateful(nn.Module):
    """A forward that stores on ``self``: a head made lazily, a parameter made in the forward,
    the last activations, a history list, a replaced attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.history: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "head"):
            self.head = nn.Linear(16, 4)
            self.gate = nn.Parameter(torch.ones(16))
        h = self.body(x) * self.gate
        self.last = h
        self.history.append(h)
        self.scale = 2.0
        self.body.seen = h  # on a submodule too
        return self.head(h)


def _fakes_in(model: nn.Module) -> list[str]:
    from torch._subclasses.fake_tensor import FakeTensor

    found = []
    for path, module in model.named_modules():
        for name, value in vars(module).items():
            values = value.values() if isinstance(value, dict) else value
            items = values if isinstance(value, (list, dict)) else [value]
            if any(isinstance(v, FakeTensor) for v in items):
                found.append(f"{path}.{name}")
    return found


@pytest.mark.parametrize("step", ["forward", "train"])
def test_state_the_forward_stores_on_self_is_undone(step: str) -> None:
    model = _Stateful()
    before = {id(m): dict(vars(m)) for m in model.modules()}
    modules = list(model.modules())
    est = estimate(model, example_input=torch.ones(8, 16), step=step)
    assert est.fallback is None and est.peak > 0
    assert list(model.modules()) == modules
    assert {id(m): dict(vars(m)) for m in model.modules()} == before
    assert not hasattr(model, "head") and not hasattr(model, "gate")
    assert (model.history, model.last, model.scale) == ([], None, 1.0)
    assert not hasattr(model.body, "seen") and _fakes_in(model) == []
    assert model(torch.ones(2, 16)).shape == (2, 4)  # and it still runs, for real


@NOT_ON_4
@pytest.mark.parametrize("heads", [4, 2])  # as many key and value heads as heads, or fewer
def test_an_mla_config_is_measured_or_its_sizes_blamed_not_the_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], heads: int
) -> None:
    config = tiny("minicpm3")
    config.num_key_value_heads = heads  # MLA takes no grouped-query: 2 of 4 is no model
    if heads != 4:  # the class's own latent widths, as a real config gives them: with fewer
        defaults = type(config)()  # key and value heads, the real model refuses the batch
        for field in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"):
            setattr(config, field, getattr(defaults, field))
        config.q_lora_rank, config.head_dim = defaults.q_lora_rank, defaults.head_dim
    config.architectures = ["MiniCPM3ForCausalLM"]
    config.save_pretrained(tmp_path)
    argv = [str(tmp_path), "--batch", "2", "--seq", "16", "--device", "cpu", "--json"]
    status = main(["estimate", *argv])
    out, err = capsys.readouterr()
    if heads == 4:
        assert status == 0 and json.loads(out)["fallback"] is None, err
        return
    assert status == 1 and "fails too, so the config's sizes disagree" in err, err
    assert "pass a --seq" not in err
