"""Resolve once: one ``load`` or ``load_into`` opens each file of its source once, whatever the
source's kind (docs/design.md, "Flow of one call").

Opens are counted by Python's ``open`` audit event, which ``open``, ``io.open``, ``Path.open``,
``io.FileIO`` and ``os.open`` all raise, so every way the code could open a file is seen. (A
file that torch or safetensors maps by its path, ``mmap=True``, is opened by C code, which no
audit event shows; those calls are not counted here.)
"""

from __future__ import annotations

import collections
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import torchplace

_counting: list[collections.Counter[Path]] = []  # the counter of the call under way, if any


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if _counting and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _counting[-1][Path(os.fsdecode(args[0])).resolve()] += 1


sys.addaudithook(_hook)  # audit hooks cannot be removed: it counts only inside _opens


def _opens(call: Callable[[], object], folder: Path) -> dict[str, int]:
    """How often ``call`` opened each file under ``folder``, by file name."""
    counter: collections.Counter[Path] = collections.Counter()
    _counting.append(counter)
    try:
        call()
    finally:
        _counting.pop()
    root = folder.resolve()
    return {p.name: n for p, n in counter.items() if p.is_relative_to(root)}


_STATE = {"weight": torch.arange(12.0).view(4, 3), "bias": torch.arange(4.0)}


def _source(kind: str, folder: Path) -> tuple[Path | dict[str, torch.Tensor], list[str]]:
    """A checkpoint of ``_STATE`` of ``kind``, and the files a load must read."""
    if kind == "zip":
        torch.save(_STATE, folder / "m.pt")
        return folder / "m.pt", ["m.pt"]
    if kind == "legacy":
        torch.save(_STATE, folder / "m.pt", _use_new_zipfile_serialization=False)
        return folder / "m.pt", ["m.pt"]
    if kind == "safetensors":
        save_file(_STATE, str(folder / "m.safetensors"))
        return folder / "m.safetensors", ["m.safetensors"]
    if kind == "directory":
        save_file(_STATE, str(folder / "model.safetensors"))
        return folder, ["model.safetensors"]
    if kind in ("index", "torch-index"):
        suffix = ".safetensors" if kind == "index" else ".bin"
        for name, tensor in _STATE.items():
            if kind == "index":
                save_file({name: tensor}, str(folder / f"{name}{suffix}"))
            else:
                torch.save({name: tensor}, folder / f"{name}{suffix}")
        index = folder / f"model{suffix}.index.json"
        index.write_text(json.dumps({"weight_map": {n: f"{n}{suffix}" for n in _STATE}}))
        return index, [index.name, *(f"{n}{suffix}" for n in _STATE)]
    assert kind == "mapping"
    return dict(_STATE), []


KINDS = ["zip", "legacy", "safetensors", "index", "torch-index", "directory", "mapping"]


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "mapping"])
def test_load_opens_each_file_of_its_source_once(tmp_path: Path, kind: str) -> None:
    source, files = _source(kind, tmp_path)
    loaded: dict[str, Any] = {}
    opens = _opens(lambda: loaded.update(torchplace.load(source)), tmp_path)  # type: ignore[arg-type]
    assert opens == dict.fromkeys(files, 1)
    assert all(torch.equal(loaded[k], v) for k, v in _STATE.items())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skeleton", [False, True], ids=["built", "skeleton"])
def test_load_into_opens_each_file_of_its_source_once(
    tmp_path: Path, kind: str, skeleton: bool
) -> None:
    source, files = _source(kind, tmp_path)
    model = torchplace.skeleton(nn.Linear, 3, 4) if skeleton else nn.Linear(3, 4)
    opens = _opens(lambda: torchplace.load_into(model, source), tmp_path)
    assert opens == dict.fromkeys(files, 1)
    assert torch.equal(model.weight, _STATE["weight"]) and torch.equal(model.bias, _STATE["bias"])


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "legacy"])
def test_a_sharded_load_into_opens_each_file_of_its_source_once(
    fake_world: Any, tmp_path: Path, kind: str
) -> None:
    from torch.distributed.fsdp import fully_shard

    source, files = _source(kind, tmp_path)
    with torch.device("meta"):
        model = nn.Linear(3, 4)
    fully_shard(model, mesh=fake_world)
    model.to_empty(device="cpu")
    opens = _opens(lambda: torchplace.load_into(model, source), tmp_path)
    assert opens == dict.fromkeys(files, 1)
    assert torch.equal(model.weight.to_local(), _STATE["weight"][:1])  # rank 0 of 4: one row


def test_outside_a_call_a_file_is_opened_and_closed_as_usual(tmp_path: Path) -> None:
    """``catalog`` asked for on its own (as ``inspect`` asks) opens what it reads and keeps
    nothing open."""
    from torchplace.checkpoint._catalog import catalog

    source, _ = _source("index", tmp_path)
    before = len(os.listdir("/proc/self/fd")) if Path("/proc/self/fd").is_dir() else None
    found = catalog(source)  # type: ignore[arg-type]
    assert set(found.entries) == set(_STATE)
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before


def _count_catalogues(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """How often a catalog is made of each file (by name) from now on in the test."""
    from torchplace.checkpoint import _catalog

    made: collections.Counter[str] = collections.Counter()
    for fmt, real in list(_catalog._CATALOGUERS.items()):

        def counted(p: Path, real: Callable[[Path], Any] = real) -> Any:
            made[p.name] += 1
            return real(p)

        monkeypatch.setitem(_catalog._CATALOGUERS, fmt, counted)
    return made


def _two_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


@pytest.mark.parametrize("kind", ["zip", "safetensors", "index", "directory"])
def test_a_load_into_by_device_map_opens_each_file_once(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``load_into(..., device_map=)`` with a module left on "disk" is one call: it opens each
    file of its source once and catalogues it once (a directory by its model file's name
    too), though it checks the disk module against the catalog, fills the rest and hands the
    disk module a reader of the file. The disk tier's reads while the model runs are calls of
    their own (each forward reads the module's bytes again) and are not counted here."""
    made = _count_catalogues(monkeypatch)
    torch.manual_seed(0)
    state = _two_layers().state_dict()
    if kind == "zip":
        torch.save(state, tmp_path / "m.pt")
        source, files = tmp_path / "m.pt", ["m.pt"]
    elif kind in ("safetensors", "directory"):
        save_file(state, str(tmp_path / "model.safetensors"))
        source = tmp_path / "model.safetensors" if kind == "safetensors" else tmp_path
        files = ["model.safetensors"]
    else:
        for layer in ("0", "1"):
            part = {k: v for k, v in state.items() if k.startswith(layer + ".")}
            save_file(part, str(tmp_path / f"l{layer}.safetensors"))
        index = tmp_path / "model.safetensors.index.json"
        weight_map = {k: f"l{k.split('.')[0]}.safetensors" for k in state}
        index.write_text(json.dumps({"weight_map": weight_map}))
        source, files = index, [index.name, "l0.safetensors", "l1.safetensors"]
    model = torchplace.skeleton(_two_layers)
    device_map = {"0": "cpu", "1": "disk"}
    opens = _opens(lambda: torchplace.load_into(model, source, device_map=device_map), tmp_path)
    assert opens == dict.fromkeys(files, 1)
    assert made and set(made.values()) == {1}, made
    assert model[1].weight.is_meta  # left in the file
    assert torch.equal(model[0].weight, state["0.weight"])
    x = torch.ones(1, 3)
    with torch.no_grad():
        expected = x @ state["0.weight"].T + state["0.bias"]
        expected = expected @ state["1.weight"].T + state["1.bias"]
        assert torch.equal(model(x), expected)


@pytest.mark.parametrize("kind", ["safetensors", "index", "torch-index", "directory"])
@pytest.mark.parametrize("call", ["load", "load_into"])
def test_a_call_resolves_its_source_into_one_catalog(
    tmp_path: Path, kind: str, call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below the public entry point, every step that asks for the source's catalog (the
    check_crc warning, the progress bar's size, the reader) is given the one the call made:
    each file is catalogued once per call (an index's shards within its own catalog)."""
    import warnings

    made = _count_catalogues(monkeypatch)
    source, files = _source(kind, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # check_crc=True on safetensors: nothing to check
        if call == "load":
            loaded = torchplace.load(source, check_crc=True, progress=True)  # type: ignore[arg-type]
        else:
            model = nn.Linear(3, 4)
            torchplace.load_into(model, source, check_crc=True, progress=True)
            loaded = model.state_dict()
    assert made and set(made) <= set(files) and set(made.values()) == {1}, made
    assert all(torch.equal(loaded[k], v) for k, v in _STATE.items())
