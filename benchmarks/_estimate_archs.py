"""``estimate`` against real steps across transformers architectures (``bench_estimate.py
--archs``). Not a benchmark itself (no ``bench_`` prefix).

Each architecture is built from a tiny config (``tests/hf_architectures.py``: hidden size 64,
two layers), once on the CPU with real weights and once as a skeleton on ``meta``; the batch is
what ``torchplace estimate DIR`` gives the model (``cli._inputs``: its main input, decoder
tokens, labels), 2 examples of 32 tokens or frames. Predicted: the skeleton's ``estimate``
(``.peak``) for a training step with Adam and for an inference forward. Measured: PyTorch's own
``MemTracker`` on the real model, the highest peak over three real training steps (forward,
backward, ``Adam.step``, ``zero_grad``) and one forward under ``no_grad``
(``tests/estimate_truth.py``). Target (DESIGN.md section 5): training within 5% for 95% of
them, forwards exact.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

# (model type, what it is, the class built: None for AutoModelForCausalLM, config overrides)
ARCHS: list[tuple[str, str, str | None, dict[str, Any]]] = [
    ("gpt2", "decoder", None, {}),
    ("llama", "decoder", None, {}),
    ("mistral", "decoder", None, {}),
    ("qwen2", "decoder", None, {}),
    ("qwen3", "decoder", None, {}),
    ("gemma", "decoder", None, {}),
    ("phi", "decoder", None, {}),
    ("opt", "decoder", None, {}),
    ("gpt_neox", "decoder", None, {}),
    ("falcon", "decoder", None, {}),
    ("bloom", "decoder", None, {}),
    ("mixtral", "MoE", None, {}),
    ("qwen2_moe", "MoE", None, {}),
    ("olmoe", "MoE", None, {}),
    ("jetmoe", "MoE (routing read in Python)", None, {}),
    ("deepseek_v3", "MoE + MLA", None, {"num_key_value_heads": 4}),
    ("minicpm3", "MLA", None, {"num_key_value_heads": 4}),
    ("glm4_moe_lite", "MLA", None, {"num_key_value_heads": 4}),
    ("bert", "encoder", "BertForMaskedLM", {}),
    ("roberta", "encoder", "RobertaForMaskedLM", {}),
    ("distilbert", "encoder", "DistilBertForMaskedLM", {}),
    ("electra", "encoder", "ElectraForMaskedLM", {}),
    ("deberta-v2", "encoder", "DebertaV2ForMaskedLM", {}),
    ("t5", "encoder-decoder", "T5ForConditionalGeneration", {}),
    ("bart", "encoder-decoder", "BartForConditionalGeneration", {}),
    ("pegasus", "encoder-decoder", "PegasusForConditionalGeneration", {}),
    ("vit", "vision", "ViTForImageClassification", {"image_size": 64}),
    ("deit", "vision", "DeiTForImageClassification", {"image_size": 64}),
    ("resnet", "vision", "ResNetForImageClassification", {"image_size": 64}),
    ("dinov2", "vision", "Dinov2ForImageClassification", {"image_size": 56}),
    ("whisper", "audio encoder-decoder", "WhisperForConditionalGeneration", {}),
    ("wav2vec2", "audio, CTC", "Wav2Vec2ForCTC", {}),
    ("hubert", "audio, CTC", "HubertForCTC", {}),
    ("wavlm", "audio, CTC", "WavLMForCTC", {}),
    ("xlnet", "xlnet", "XLNetLMHeadModel", {}),
    ("xlm", "encoder (lengths read in Python)", None, {}),
]


def _build(model_type: str, cls: str | None, overrides: dict[str, Any], device: str) -> Any:
    import transformers

    from hf_architectures import tiny_config

    config = tiny_config(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    make = getattr(transformers, cls)._from_config if cls else None
    make = make or transformers.AutoModelForCausalLM.from_config
    torch.manual_seed(0)
    with torch.device(device):
        return make(config), config


def _one(model_type: str, cls: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    from estimate_truth import forward_peak, train_peaks
    from torchplace.cli._inputs import example_batch
    from torchplace.looking._estimate import estimate

    real, config = _build(model_type, cls, overrides, "cpu")
    skeleton, _ = _build(model_type, cls, overrides, "meta")
    out: dict[str, Any] = {"type": model_type, "class": type(real).__name__}
    for step in ("train", "forward"):
        make, _ = example_batch(real, config, 2, 32, step == "train")
        skeleton.train(step == "train")  # inference in eval mode, as from_pretrained gives it
        started = time.perf_counter()
        est = estimate(skeleton, example_input=make, step=step)
        out[f"{step}_s"] = time.perf_counter() - started
        out[f"{step}_fallback"] = est.fallback
        batch = make(torch.device("cpu"))
        real.train(step == "train")
        truth = max(train_peaks(real, batch)) if step == "train" else forward_peak(real, batch)
        out[step] = (est.peak, truth)
    return out


def run(only: list[str]) -> list[dict[str, Any]]:
    """Each architecture's predicted and measured peaks, printed as they come."""
    found = []
    for model_type, kind, cls, overrides in ARCHS:
        if only and model_type not in only:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                row = _one(model_type, cls, overrides)
            except Exception as exc:  # reported, and counted as missed
                row = {"type": model_type, "class": cls, "error": f"{type(exc).__name__}: {exc}"}
        row["kind"] = kind
        found.append(row)
        print(_line(row), flush=True)
    return found


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"| {row['type']} | {row['kind']} | failed: {row['error'][:120]} | | | |"
    cells = []
    for step in ("train", "forward"):
        predicted, measured = row[step]
        mark = "" if row[f"{step}_fallback"] is None else " (fallback)"
        cells.append(f"{predicted / measured:.3f}{mark}")
    return (
        f"| {row['type']} | {row['kind']} | {row['train'][0]:,} / {row['train'][1]:,} | "
        f"{cells[0]} | {row['forward'][0]:,} / {row['forward'][1]:,} | {cells[1]} |"
    )


HEADER = (
    "| type | kind | training: predicted / measured (bytes) | ratio | forward: predicted / "
    "measured (bytes) | ratio |\n| --- | --- | --- | --- | --- | --- |"
)


def summary(rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if "error" not in r]
    near = [r for r in ok if abs(r["train"][0] / r["train"][1] - 1) <= 0.05]
    exact = [r for r in ok if r["forward"][0] == r["forward"][1]]
    close = [r for r in ok if abs(r["forward"][0] / r["forward"][1] - 1) <= 0.01]
    return (
        f"{len(rows)} architectures, {len(rows) - len(ok)} failed; training within 5%: "
        f"{len(near)} of {len(rows)}; forward exact to the byte: {len(exact)}, within 1%: "
        f"{len(close)}"
    )
