"""``torchplace convert`` (issue 52): every source ``load`` reads to safetensors or ``.pt``,
bit for bit, without running pickled code, refusing an existing output without ``--force``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import torchplace
from torchplace.cli._main import main


def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed.weight": torch.randn(16, 8),
        "head.weight": torch.randn(4, 8).to(torch.bfloat16),
        "steps": torch.tensor(7),
    }


def sources(tmp_path: Path) -> dict[str, Path]:
    """The same tensors as a zip .pt, a legacy .bin, a safetensors file, a shard index and a
    save_pretrained directory."""
    sd = state()
    torch.save(sd, tmp_path / "zip.pt")
    torch.save(sd, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    torchplace.save(sd, tmp_path / "file.safetensors")
    torchplace.save(sd, tmp_path / "sharded", max_shard_size=300)
    torchplace.save(sd, tmp_path / "folder")
    return {
        "zip": tmp_path / "zip.pt",
        "legacy": tmp_path / "legacy.bin",
        "safetensors": tmp_path / "file.safetensors",
        "index": tmp_path / "sharded" / "model.safetensors.index.json",
        "directory": tmp_path / "folder",
    }


@pytest.mark.parametrize("kind", ["zip", "legacy", "safetensors", "index", "directory"])
@pytest.mark.parametrize("dest", ["out.safetensors", "out.pt", "out"])
def test_every_source_converts_bit_for_bit(
    tmp_path: Path, kind: str, dest: str, capsys: Any
) -> None:
    source = sources(tmp_path)[kind]
    out = tmp_path / "converted" / dest
    out.parent.mkdir()
    assert main(["convert", str(source), "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    got = torch.load(out, weights_only=True) if dest == "out.pt" else torchplace.load(out)
    want = state()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    if dest == "out.safetensors":
        with safe_open(str(out), "pt") as f:
            assert sorted(f.keys()) == sorted(want)


def test_an_existing_destination_needs_force(tmp_path: Path, capsys: Any) -> None:
    source = sources(tmp_path)["zip"]
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"keep me")
    assert main(["convert", str(source), "-o", str(out)]) == 1
    assert "exists already; give --force" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"
    assert main(["convert", str(source), "-o", str(out), "--force"]) == 0
    assert torch.equal(torchplace.load(out)["embed.weight"], state()["embed.weight"])


class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_pickle_is_converted_without_running_it(tmp_path: Path, capsys: Any) -> None:
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(3), "payload": Evil(marker)}, tmp_path / "evil.pt")
    out = tmp_path / "clean.safetensors"
    assert main(["convert", str(tmp_path / "evil.pt"), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "left out" in said and "system" in said and "none of it was run" in said
    assert not marker.exists()
    assert list(torchplace.load(out)) == ["w"]


def test_a_legacy_pickle_naming_code_is_refused_without_running_it(
    tmp_path: Path, capsys: Any
) -> None:
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(3), "payload": Evil(marker)}, tmp_path / "evil.bin",
               _use_new_zipfile_serialization=False)  # fmt: skip
    assert main(["convert", str(tmp_path / "evil.bin"), "-o", str(tmp_path / "o.pt")]) == 1
    assert "error" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "o.pt").exists()


def test_a_bad_shard_size_is_a_usage_error(tmp_path: Path) -> None:
    source = sources(tmp_path)["zip"]
    assert main(["convert", str(source), "-o", str(tmp_path / "d"), "--max-shard-size", "5G"]) == 2


def test_a_directory_keeps_its_other_files(tmp_path: Path) -> None:
    source = tmp_path / "hub"
    source.mkdir()
    torch.save(state(), source / "pytorch_model.bin")
    (source / "config.json").write_text('{"model_type": "toy"}')
    (source / "tokenizer.json").write_text("{}")
    assert main(["convert", str(source), "-o", str(tmp_path / "out")]) == 0
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (tmp_path / "out" / "config.json").read_text() == '{"model_type": "toy"}'
    got = torchplace.load(tmp_path / "out")
    assert all(torch.equal(got[k], v) for k, v in state().items())


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_values_that_are_not_tensors_are_said_to_be_left_out(
    tmp_path: Path, capsys: Any, legacy: bool
) -> None:
    optimizer = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1}]}
    saved = {"w": torch.ones(2), "epoch": 3, "name": "run1", "opt": optimizer}
    saved |= {f"n{i}": i for i in range(12)}
    torch.save(saved, tmp_path / "a.pt", _use_new_zipfile_serialization=not legacy)
    assert main(["convert", str(tmp_path / "a.pt"), "-o", str(tmp_path / "a.safetensors")]) == 0
    err = capsys.readouterr().err
    assert "left out 15 values that are not tensors" in err
    assert "epoch (int), name (str), opt.param_groups (list), n0 (int)" in err
    assert "n6 (int), and 5 more" in err
    assert sorted(torchplace.load(tmp_path / "a.safetensors")) == ["opt.state.0.step", "w"]


def test_an_output_ending_in_a_slash_is_a_directory(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(3)}, tmp_path / "a.pt")
    out = f"{tmp_path / 'out.safetensors'}/"
    assert main(["convert", str(tmp_path / "a.pt"), "-o", out]) == 0
    assert sorted(os.listdir(tmp_path / "out.safetensors")) == ["model.safetensors"]
    assert torch.equal(torchplace.load(tmp_path / "out.safetensors")["w"], torch.ones(3))
