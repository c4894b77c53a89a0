"""torchplace estimate PATH: a model directory's step from its config, a checkpoint's bytes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import torchplace
from torchplace.cli import main

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved by save_pretrained, its weights then made unreadable garbage."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not weights")  # never read
    return folder


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["estimate", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_a_model_directory_is_built_from_its_config_and_stepped(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--batch", "2", "--seq", "16", "--optimizer", "adamw", "--dtype", "bf16", "--json"]
    status, out, _ = run(capsys, str(tiny_dir), *argv)
    assert status == 0
    report: dict[str, Any] = json.loads(out)
    assert (report["kind"], report["architecture"]) == ("transformers", "LlamaForCausalLM")
    assert (report["batch"], report["seq"], report["optimizer"]) == (2, 16, "adamw")
    assert report["fallback"] is None and report["step"] == "train"
    model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(tiny_dir))
    params = sum(p.numel() for p in model.parameters())
    assert report["parameter_count"] == params
    (cuda,) = [row for row in report["rows"] if row["device"] == "cuda:0" and row["parameters"]]
    assert (cuda["dtype"], cuda["parameters"], cuda["gradients"]) == (
        "bfloat16",
        2 * params,
        2 * params,
    )
    assert set(report["peak_by_device"]) == {"cuda:0", "cpu"}
    assert report["activations"] > 2 * 16 * 128 * 2  # at least the logits
    assert report["peak"] > report["total"]


def test_a_model_directory_prints_the_tables(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = run(capsys, str(tiny_dir), "--step", "forward")
    assert status == 0
    assert (
        "LlamaForCausalLM, one forward step of 1 x 64 tokens of input_ids on cuda:0" in out
    )  # seq capped
    for text in ("Peak of one forward step", "activations", "Modules at the highest peaks"):
        assert text in out
    assert "model.layers." in out


def test_a_seq_beyond_a_learned_position_table_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=100, n_positions=64)
    config.save_pretrained(tmp_path)
    status, out, err = run(capsys, str(tmp_path), "--seq", "1000", "--device", "cpu")
    assert (status, out) == (1, "")
    assert "wpe (Embedding) raises IndexError: index out of range in self" in err
    assert "(positions 0..999 in a table of 64 rows)" in err
    # the fix is the command's (it said to pass a batch as model(**batch), from Python)
    assert "1 x 1000 tokens of input_ids: the train step" in err and "model(**batch)" not in err
    assert (
        "pass a --seq and --batch this model takes (this config's max_position_embeddings is 64)"
        in err
    )
    status, out, _ = run(capsys, str(tmp_path), "--seq", "64", "--device", "cpu")
    assert status == 0 and "Peak of one train step" in out


def test_a_safetensors_file_is_counted_by_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.safetensors"
    tensors = {
        "w": torch.ones(64, 32),
        "h": torch.ones(100, dtype=torch.float16),
        "n": torch.ones(3, dtype=torch.int64),
    }
    safetensors_torch.save_file(tensors, path)
    status, out, _ = run(capsys, str(path), "--json", "--device", "cpu")
    assert status == 0
    report = json.loads(out)
    rows = {(r["device"], r["dtype"]): r for r in report["rows"]}
    assert rows["cpu", "float32"]["parameters"] == 64 * 32 * 4
    assert rows["cpu", "float32"]["gradients"] == 64 * 32 * 4
    # Adam: two moments per floating tensor, and a float32 step for each on the cpu
    assert rows["cpu", "float32"]["optimizer_state"] == 2 * 64 * 32 * 4 + 2 * 4
    assert rows["cpu", "float16"]["optimizer_state"] == 2 * 200
    assert (rows["cpu", "int64"]["parameters"], rows["cpu", "int64"]["gradients"]) == (24, 0)
    status, out, _ = run(capsys, str(path))
    assert status == 0 and "no step: no model code" in out and "float16" in out


def test_a_checkpoints_norm_statistics_count_as_buffers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file alone does not say which tensors are buffers: BatchNorm's running statistics were
    counted as trainable parameters, with gradients and Adam's state. They are buffers, as
    ``estimate`` of the module itself counts them."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
    torch.save(model.state_dict(), tmp_path / "bn.pt")
    status, out, _ = run(capsys, str(tmp_path / "bn.pt"), "--json", "--device", "cpu")
    assert status == 0
    report = json.loads(out)
    want = torchplace.estimate(model, optimizer="adam")
    assert report["parameter_count"] == report["trainable_count"] == 8 * 16 + 16 + 2 * 16
    rows = {(r["device"], r["dtype"]): r for r in report["rows"]}
    assert rows["cpu", "float32"]["buffers"] == 2 * 16 * 4 == want.buffers - 8
    assert rows["cpu", "int64"]["buffers"] == 8 and rows["cpu", "int64"]["parameters"] == 0
    assert rows["cpu", "float32"]["gradients"] == want.gradients


def test_a_training_checkpoint_counts_the_model_not_its_optimizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A last.pt of {'model', 'optimizer', 'epoch'} was counted three times over: Adam's saved
    state as parameters, then gradients and Adam's state again on top."""
    model = torch.nn.Linear(100, 10)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 100)).sum().backward()
    opt.step()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1},
               tmp_path / "last.pt")  # fmt: skip
    reports = []
    for name in ("weights.pt", "last.pt"):
        status, out, _ = run(capsys, str(tmp_path / name), "--json", "--device", "cpu")
        assert status == 0
        reports.append(json.loads(out))
    assert reports[1]["rows"] == reports[0]["rows"]
    assert reports[1]["parameter_count"] == 1010
    assert reports[1]["left_out"] == ["optimizer"] and reports[0]["left_out"] == []
    status, out, _ = run(capsys, str(tmp_path / "last.pt"))
    assert "the checkpoint's weights on cuda:0, leaving out its 'optimizer'" in out  # the default
    # a model's own submodule named like a training loop's part is counted
    torch.save({"scaler.weight": torch.ones(4, 4)}, tmp_path / "own.pt")
    status, out, _ = run(capsys, str(tmp_path / "own.pt"), "--json", "--device", "cpu")
    assert json.loads(out)["parameter_count"] == 16 and json.loads(out)["left_out"] == []


def test_a_config_transformers_cannot_build_names_its_architecture(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {"model_type": "nosuchmodel", "architectures": ["NoSuchForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    status, out, err = run(capsys, str(tmp_path))
    assert (status, out) == (1, "")
    assert "cannot build architecture NoSuchForCausalLM (model_type 'nosuchmodel')" in err
    assert "Traceback" not in err


def test_without_transformers_it_says_what_to_install(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    status, out, err = run(capsys, str(tiny_dir))
    assert (status, out) == (1, "")
    assert err.strip().endswith("is not installed: pip install transformers")
    assert "config.json" in err


def _index(root: Path, count: int, shards: int = 8) -> Path:
    """A shard index of ``count`` 2x2 tensors (float32, and every tenth one int64)."""
    import struct

    names = [f"model.layers.{i // 100}.mlp.experts.{i % 100}.w" for i in range(count)]
    per, weight_map = -(-count // shards), {}
    for s in range(shards):
        part = names[s * per : (s + 1) * per]
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, at = {}, 0
        for k, name in enumerate(part):
            size = 32 if k % 10 == 0 else 16
            dtype = "I64" if size == 32 else "F32"
            header[name] = {"dtype": dtype, "shape": [2, 2], "data_offsets": [at, at + size]}
            at += size
        raw = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
        (root / shard).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(at))
        weight_map.update(dict.fromkeys(part, shard))
    index = root / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.slow  # writes and reads a 100k-tensor index
def test_an_index_of_100k_tensors_is_counted_from_its_shapes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted from the catalog's shapes: no tensor is made for any of the index's entries (a
    fake parameter each took 13-16 s; the time is benchmarks/bench_estimate_index.py's)."""
    index = _index(tmp_path, 100_000)
    made: list[Any] = []
    real = torch.empty

    def empty(*shape: Any, **kwargs: Any) -> torch.Tensor:
        made.append(shape)
        return real(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    status, out, err = run(capsys, str(index), "--json", "--device", "cpu", "--optimizer", "adamw")
    assert status == 0, err
    assert len(made) < 100, len(made)  # not one per tensor
    report = json.loads(out)
    floats, ints = 90_000, 10_000
    rows = {(r["device"], r["dtype"]): r for r in report["rows"]}
    assert report["parameter_count"] == 4 * 100_000 and report["trainable_count"] == 4 * floats
    assert (
        rows["cpu", "float32"]["parameters"] == rows["cpu", "float32"]["gradients"] == 16 * floats
    )
    # AdamW: two moments per floating tensor, and a float32 step for each on the cpu
    assert rows["cpu", "float32"]["optimizer_state"] == 2 * 16 * floats + 4 * floats
    assert (rows["cpu", "int64"]["parameters"], rows["cpu", "int64"]["gradients"]) == (32 * ints, 0)
