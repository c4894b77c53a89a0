"""Checkpoint paths as every path source takes them: ``~`` expanded as the shell would, an empty
path refused (never read as the current directory), a mapping given to ``load`` pointed at
``load_into``."""

from __future__ import annotations

import io
import os
import shlex
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import save
from torchplace import estimate
from torchplace._errors import CheckpointError, TorchplaceError
from torchplace.checkpoint._catalog import catalog
from torchplace.checkpoint._checkpoint import load, load_into, skeleton
from torchplace.checkpoint._checkpoint_cli import describe_file, remap
from torchplace.cli import main

STATE = {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.tensor([1.0, -2.0])}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home directory (``~``) holding ``x.pt``, the current directory elsewhere."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    torch.save(STATE, home / "x.pt")
    return home


def _equal(got: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(STATE)
    for name, tensor in STATE.items():
        assert torch.equal(got[name], tensor), name


def test_load_expands_a_leading_tilde(home: Path) -> None:
    _equal(load("~/x.pt"))
    _equal(load(Path("~/x.pt")))


def test_load_into_expands_a_leading_tilde(home: Path) -> None:
    model = load_into(skeleton(nn.Linear, 3, 2), "~/x.pt")
    assert torch.equal(model.weight.detach(), STATE["weight"])
    assert torch.equal(model.bias.detach(), STATE["bias"])


def test_inspect_and_catalog_expand_a_leading_tilde(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert {r.name for r in describe_file("~/x.pt")} == set(STATE)
    assert set(catalog("~/x.pt").entries) == set(STATE)
    assert main(["inspect", "--json", "~/x.pt"]) == 0
    assert "weight" in capsys.readouterr().out


def test_remap_expands_a_leading_tilde_in_source_and_output(home: Path) -> None:
    out = remap("~/x.pt", "~/y.pt", to="cuda:1")
    assert out == home / "y.pt"
    assert {r.device for r in describe_file(home / "y.pt")} == {"cuda:1"}
    assert main(["remap", "~/x.pt", "--to", "cpu", "-o", "~/z.pt"]) == 0
    _equal(load(home / "z.pt"))
    assert not Path("~").exists()  # nothing written under a directory named "~"


def test_estimate_of_a_tilde_path_suggests_a_command_the_shell_can_run(home: Path) -> None:
    with pytest.raises(TorchplaceError) as info:
        estimate("~/x.pt")  # type: ignore[arg-type]
    command = str(info.value).rpartition("run: ")[2]
    # Quoted, a ~ is not expanded by the shell: the command names the file itself.
    assert shlex.split(command) == ["torchplace", "inspect", str(home / "x.pt")]


@pytest.mark.parametrize("empty", ["", b""])
def test_an_empty_path_is_refused_by_load_and_load_into(
    empty: str | bytes, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(home)  # a directory holding a checkpoint: "" must not read it
    for call in (
        lambda: load(empty),  # type: ignore[arg-type]
        lambda: load_into(skeleton(nn.Linear, 3, 2), empty),  # type: ignore[arg-type]
        lambda: catalog(empty),  # type: ignore[arg-type]
        lambda: remap(empty, "out.pt", to="cpu"),  # type: ignore[arg-type]
        lambda: remap("x.pt", empty, to="cpu"),  # type: ignore[arg-type]
    ):
        with pytest.raises(CheckpointError, match="an empty path names no checkpoint"):
            call()
    assert sorted(p.name for p in home.iterdir()) == ["x.pt"]  # nothing written


@pytest.mark.parametrize(
    "argv",
    [["inspect", ""], ["inspect", "--json", ""], ["remap", "", "--to", "cpu", "-o", "out.pt"]],
)
def test_an_empty_path_is_an_error_on_the_command_line(
    argv: list[str], home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(home)
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "an empty path names no checkpoint" in captured.err
    assert captured.out == ""


def test_remap_to_an_empty_output_is_an_error(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(home)
    assert main(["remap", "x.pt", "--to", "cpu", "-o", ""]) == 1
    assert "an empty path names no checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in home.iterdir()) == ["x.pt"]


def test_load_of_a_state_dict_points_at_load_into() -> None:
    with pytest.raises(CheckpointError) as info:
        load(dict(STATE))  # type: ignore[arg-type]
    message = str(info.value)
    assert "not a dict already in memory" in message
    assert "torchplace.load_into(model, state_dict)" in message


@pytest.mark.parametrize("command", ["inspect", "remap"])
def test_help_says_directories_and_indexes_are_accepted(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # as one line, whatever the wrapping
    assert "a shard index (*.index.json)" in text
    assert "a save_pretrained directory" in text


# ------------------------------------------------------------------------- paths that are not files


@pytest.mark.parametrize(
    ("path", "message", "into"),
    [
        (None, "not NoneType", "not NoneType"),
        (123, "not int", "not int"),
        (
            io.BytesIO(b"PK"),
            "not BytesIO; torchplace reads files by path",
            r"not an open file \(BytesIO\).*torchplace reads files by path",
        ),
        ("x" * 5000, "cannot be read", "cannot be read"),  # longer than the file system allows
    ],
    ids=["none", "int", "file-object", "name-too-long"],
)
def test_bad_paths_are_checkpoint_errors(path: object, message: str, into: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        load(path)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=into):  # a mapping too (see below)
        load_into(nn.Linear(1, 1), path)  # type: ignore[arg-type]


def test_bytes_paths_are_read(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    assert torch.equal(load(os.fsencode(tmp_path / "w.pt"))["w"], torch.ones(2))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_pipe_is_refused_not_read_for_ever(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.pt")  # opening it for reading would block with no writer
    with pytest.raises(CheckpointError, match="not a regular file"):
        load(tmp_path / "model.pt")


@pytest.mark.parametrize(
    ("given", "found"),
    [
        ("model.pth", "model.pt"),  # the same stem: found before, found now
        ("model", "model.pt"),
        ("modle.pt", "model.pt"),  # letters transposed
        ("mode.pt", "model.pt"),  # a letter dropped
        ("optimzer.pt", "optimizer.pt"),
    ],
)
def test_a_missing_file_names_the_one_meant(tmp_path: Path, given: str, found: str) -> None:
    save({"w": torch.ones(1)}, tmp_path / "model.pt")
    save({"w": torch.ones(1)}, tmp_path / "optimizer.pt")
    with pytest.raises(
        CheckpointError, match=r"no such file; check the path \(found nearby: (.*)\)$"
    ) as e:
        load(tmp_path / given)
    assert str(e.value).rsplit("found nearby: ", 1)[1].rstrip(")").split(", ")[0] == found
    with pytest.raises(CheckpointError, match=r"no such file; check the path$"):
        load(tmp_path / "zebra.pt")


# --- a flat shard index ({name: file}), as Accelerate takes one ---------------------------------


def _flat_index(tmp_path: Path, torch_shards: bool) -> tuple[Path, dict[str, torch.Tensor]]:
    import json

    from helpers import write_shards

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    index = write_shards(tmp_path, sd, torch_shards=torch_shards)
    flat = tmp_path / "weights.index.json"
    flat.write_text(json.dumps(json.loads(index.read_text())["weight_map"]))
    index.unlink()
    return flat, sd


@pytest.mark.parametrize("torch_shards", [False, True], ids=["safetensors", "bin"])
def test_a_flat_index_is_read_as_the_weight_map_form(tmp_path: Path, torch_shards: bool) -> None:
    """A flat {name: file} index loads, fills a model and is inspected like the "weight_map"
    form (it was refused as "not a shard index")."""
    flat, sd = _flat_index(tmp_path, torch_shards)
    loaded = load(flat)
    assert sorted(loaded) == sorted(sd)
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    model = load_into(skeleton(lambda: nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))), flat)
    assert all(torch.equal(model.state_dict()[k], sd[k]) for k in sd)
    assert load(tmp_path).keys() == sd.keys()  # the directory: its one index
    assert sorted(t.name for t in describe_file(flat)) == sorted(sd)


def test_json_that_is_no_index_in_either_form_is_refused(tmp_path: Path) -> None:
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(CheckpointError, match="is JSON but not a shard index") as err:
        load(config)
    assert err.value.path == config
    assert "as the whole object ({name: file}" in str(err.value)
