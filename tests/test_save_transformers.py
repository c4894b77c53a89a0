"""``torchplace.save`` of transformers models (issue 52): the directory ``save_pretrained``
writes, its tensors under the names it writes them (conversions reversed, tied weights once),
read back by ``from_pretrained`` bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import torchplace

transformers = pytest.importorskip("transformers")

import hf_architectures as hf  # noqa: E402  (tests/ is on the path, as for helpers)


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                assert key not in out, f"{key} written twice"
                out[key] = f.get_tensor(key)
    return out


def built(model_type: str, tie: bool | None) -> torch.nn.Module:
    config = hf.tiny_config(model_type)
    if tie is not None:
        config.tie_word_embeddings = tie
    torch.manual_seed(0)
    model: torch.nn.Module = hf.maker(model_type)(config)
    return model


@pytest.mark.parametrize(
    ("model_type", "tie"),
    [("llama", True), ("llama", False), ("mixtral", None), ("qwen2_moe", None), ("llava", None)],
    ids=["llama-tied", "llama-untied", "mixtral", "qwen2_moe", "llava"],
)
def test_saved_as_save_pretrained_and_read_back_by_from_pretrained(
    tmp_path: Path, model_type: str, tie: bool | None
) -> None:
    model = built(model_type, tie)
    torchplace.save(model, tmp_path / "ours", max_shard_size="200KB")
    model.save_pretrained(tmp_path / "theirs", max_shard_size="200KB")
    ours, theirs = tensors(tmp_path / "ours"), tensors(tmp_path / "theirs")
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    for name in ("config.json", "generation_config.json"):
        if (tmp_path / "theirs" / name).exists():
            mine = json.loads((tmp_path / "ours" / name).read_text())
            assert mine == json.loads((tmp_path / "theirs" / name).read_text()), name
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ours)
    loaded = type(model).from_pretrained(tmp_path / "ours")
    assert hf.differences(model, loaded) == []


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_a_model_with_layers_on_disk_saves_as_the_whole_model(
    tmp_path: Path, model_type: str
) -> None:
    model = built(model_type, None)
    model.save_pretrained(tmp_path / "source")
    skeleton = torchplace.skeleton(hf.maker(model_type), model.config)
    loaded = torchplace.load_into(
        skeleton, tmp_path / "source", device_map={"": "cpu", "model.layers.1": "disk"}
    )
    assert all(p.is_meta for p in loaded.model.layers[1].parameters())
    torchplace.save(loaded, tmp_path / "out")
    ours, theirs = tensors(tmp_path / "out"), tensors(tmp_path / "source")
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_a_compiled_model_is_saved_as_the_model_inside(tmp_path: Path) -> None:
    model = built("llama", True)
    torchplace.save(torch.compile(model, backend="eager"), tmp_path / "out")
    assert (tmp_path / "out" / "config.json").exists()
    assert not any(key.startswith("_orig_mod") for key in tensors(tmp_path / "out"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert hf.differences(model, loaded) == []
