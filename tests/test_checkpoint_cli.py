"""``torchplace inspect`` and ``torchplace remap``: safe reading, atomic rewriting."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import check_golden, script
from torchplace._errors import CheckpointError, DeviceSpecError
from torchplace.checkpoint import _checkpoint_cli, _pickle_reader, _safetensors
from torchplace.checkpoint._checkpoint import load
from torchplace.checkpoint._checkpoint_cli import describe_file, remap
from torchplace.cli import main

safetensors_torch = pytest.importorskip("safetensors.torch")

STATE = {
    "model": {"w": torch.arange(6.0).reshape(2, 3), "h": torch.ones(4, dtype=torch.bfloat16)},
    "steps": [torch.tensor(3)],
}


@pytest.fixture
def gpu_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkpoint whose storages are tagged cuda:0, as if saved on a GPU."""
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(STATE, tmp_path / "gpu.pt")
    return tmp_path / "gpu.pt"


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_describe_torch_file(gpu_file: Path, tmp_path: Path, legacy: bool) -> None:
    path = gpu_file
    if legacy:
        path = tmp_path / "legacy.pt"
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
            torch.save(STATE, path, _use_new_zipfile_serialization=False)
    records = {r.name: r for r in describe_file(path)}
    assert set(records) == {"model.w", "model.h", "steps.0"}
    w = records["model.w"]
    assert (w.device, w.dtype, w.shape, w.nbytes) == ("cuda:0", "float32", (2, 3), 24)
    assert (records["model.h"].dtype, records["model.h"].nbytes) == ("bfloat16", 8)
    assert records["steps.0"].shape == ()


def test_inspect_json(gpu_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(gpu_file), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "zip"
    assert report["totals"]["by_device"] == {"cuda:0": {"count": 3, "bytes": 24 + 8 + 8}}
    assert report["totals"]["by_dtype"]["bfloat16"] == {"count": 1, "bytes": 8}
    assert {t["name"] for t in report["tensors"]} == {"model.w", "model.h", "steps.0"}


def test_inspect_table(gpu_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(gpu_file)]) == 0
    out = capsys.readouterr().out
    for needle in ("model.w", "cuda:0", "bfloat16", "[2, 3]", "totals"):
        assert needle in out


def test_inspect_safetensors_and_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    safetensors_torch.save_file({"a": torch.ones(2, 2)}, tmp_path / "part-1.safetensors")
    safetensors_torch.save_file({"b": torch.ones(3)}, tmp_path / "part-2.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    weight_map = {"a": "part-1.safetensors", "b": "part-2.safetensors"}
    index.write_text(json.dumps({"weight_map": weight_map}))
    records = describe_file(index)
    assert [(r.name, r.device, r.dtype, r.nbytes, r.file) for r in records] == [
        ("a", "-", "float32", 16, "part-1.safetensors"),
        ("b", "-", "float32", 12, "part-2.safetensors"),
    ]
    assert main(["inspect", str(index)]) == 0
    assert "part-2.safetensors" in capsys.readouterr().out


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_inspect_never_runs_pickled_code(tmp_path: Path, legacy: bool) -> None:
    marker = tmp_path / "ran.txt"
    path = tmp_path / "evil.pt"
    torch.save(
        {"w": torch.ones(2), "evil": _RunsCode(marker)},
        path,
        _use_new_zipfile_serialization=not legacy,
    )
    assert [r.name for r in describe_file(path)] == ["w"]
    assert main(["inspect", str(path), "--json"]) == 0
    assert not marker.exists()


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_inspect_names_the_code_a_file_would_run(
    tmp_path: Path, legacy: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "ran.txt"
    path = tmp_path / "evil.pt"
    torch.save({"evil": _RunsCode(marker)}, path, _use_new_zipfile_serialization=not legacy)
    assert _checkpoint_cli.code_globals(path) == ["builtins.exec"]
    assert main(["inspect", str(path)]) == 0
    assert "would import and call builtins.exec" in capsys.readouterr().out
    assert main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["code_globals"] == ["builtins.exec"]
    assert not marker.exists()
    clean = tmp_path / "clean.pt"
    torch.save({"w": torch.ones(1)}, clean)
    assert _checkpoint_cli.code_globals(clean) == []


@pytest.mark.parametrize(
    "content",
    [None, b"", b"not a checkpoint at all", pickle.dumps([1, 2]), b"PK\x03\x04" + bytes(64)],
    ids=["missing", "empty", "text", "plain-pickle", "broken-zip"],
)
def test_inspect_bad_files(
    tmp_path: Path, content: bytes | None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.pt"
    if content is not None:
        path.write_bytes(content)
    assert main(["inspect", str(path)]) == 1
    assert "bad.pt" in capsys.readouterr().err


def test_remap_gpu_file_to_cpu(gpu_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "cpu.pt"
    assert main(["remap", str(gpu_file), "--to", "cpu", "-o", str(out)]) == 0
    assert {r.device for r in describe_file(out)} == {"cpu"}
    assert out.stat().st_mode == gpu_file.stat().st_mode  # permissions follow the source
    plain = torch.load(out, weights_only=True)  # no map_location needed any more
    assert torch.equal(plain["model"]["w"], STATE["model"]["w"])
    assert plain["model"]["h"].dtype == torch.bfloat16


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_remap_to_a_gpu_without_one(tmp_path: Path, legacy: bool) -> None:
    src = tmp_path / "src.pt"
    torch.save(STATE, src, _use_new_zipfile_serialization=not legacy)
    out = remap(src, tmp_path / "out.pt", to="cuda")
    assert {r.device for r in describe_file(out)} == {"cuda:0"}
    back = load(out, "cpu")
    assert torch.equal(back["model"]["w"], STATE["model"]["w"])


def test_remap_shows_progress_when_asked(tmp_path: Path) -> None:
    src = tmp_path / "src.pt"
    torch.save(STATE, src)
    out = remap(src, tmp_path / "out.pt", to="meta", progress=True)
    assert {r.device for r in describe_file(out)} == {"meta"}


def test_remap_safetensors_is_copied(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "w.safetensors"
    safetensors_torch.save_file({"a": torch.ones(2)}, src)
    assert main(["remap", str(src), "--to", "cuda:0", "-o", str(tmp_path / "o.safetensors")]) == 0
    assert (tmp_path / "o.safetensors").read_bytes() == src.read_bytes()
    assert "copied unchanged: a safetensors file stores no device" in capsys.readouterr().out


def test_interrupted_remap_leaves_no_partial_output(
    gpu_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out.pt"
    written: list[int] = []
    real_progress = _checkpoint_cli._progress

    @contextlib.contextmanager
    def interrupt_half_way(
        total: int, label: str, enabled: bool
    ) -> Iterator[Callable[[int], None]]:
        def advance(n: int) -> None:  # Ctrl-C arrives once half of the file is written
            written.append(n)
            if sum(written) > total // 2:
                raise KeyboardInterrupt

        with real_progress(total, label, enabled):
            yield advance

    monkeypatch.setattr(_checkpoint_cli, "_progress", interrupt_half_way)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(KeyboardInterrupt):
        remap(gpu_file, out, to="cpu")
    assert written  # it did get half-way
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no temp file

    out.write_bytes(b"previous contents")  # replaced only once complete, even with --force
    assert main(["remap", str(gpu_file), "--to", "cpu", "-o", str(out), "--force"]) == 130
    assert out.read_bytes() == b"previous contents"


@pytest.mark.parametrize(
    "content",
    [None, b"garbage", b"PK\x03\x04" + bytes(64)],
    ids=["missing", "foreign", "corrupt"],
)
def test_remap_bad_input_touches_no_output(
    tmp_path: Path, content: bytes | None, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.pt"
    if content is not None:
        src.write_bytes(content)
    out = tmp_path / "out.pt"
    out.write_bytes(b"keep me")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["remap", str(src), "--to", "cpu", "-o", str(out), "--force"]) == 1
    assert "in.pt" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_remap_refuses_unsafe_file_and_bad_targets(tmp_path: Path) -> None:
    marker = tmp_path / "ran.txt"
    src = tmp_path / "evil.pt"
    torch.save({"evil": _RunsCode(marker)}, src)
    with pytest.raises(
        CheckpointError, match=r"builtins\.exec.*remap never runs.*trusted=True"
    ) as e:
        remap(src, tmp_path / "out.pt", to="cpu")
    assert e.value.path == src
    assert not marker.exists() and not (tmp_path / "out.pt").exists()
    with pytest.raises(CheckpointError, match="would write over it") as e:
        remap(src, tmp_path, to="cpu")  # into its own directory, under its own name
    assert e.value.path == src
    assert f"torchplace remap {src} --to DEVICE -o {src}" in str(e.value)
    with pytest.raises(CheckpointError, match="does not exist") as e:
        remap(src, tmp_path / "no" / "out.pt", to="cpu")
    assert e.value.path == tmp_path / "no" / "out.pt"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["zip", "legacy", "safetensors"])
def test_describe_fuzzed_files(tmp_path: Path, fmt: str) -> None:
    src = tmp_path / "src"
    if fmt == "safetensors":
        safetensors_torch.save_file(STATE["model"], src)
    else:
        torch.save(STATE, src, _use_new_zipfile_serialization=fmt == "zip")
    data = src.read_bytes()
    rng = random.Random(7)
    path = tmp_path / "fuzzed"
    refused = 0
    for i in range(60):
        case = bytearray(data[: rng.randrange(1, len(data))] if i % 3 == 0 else data)
        if i % 3:
            for _ in range(rng.randint(1, 6)):
                case[rng.randrange(len(case))] = rng.randrange(256)
        path.write_bytes(bytes(case))
        try:
            describe_file(path)
        except CheckpointError:  # any other exception type fails the test
            refused += 1
    assert refused > 0


def test_remap_bad_device_is_bad_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "a.pt"
    torch.save(STATE, src)
    assert main(["remap", str(src), "--to", "cdua", "-o", str(tmp_path / "b.pt")]) == 2
    assert "did you mean 'cuda'" in capsys.readouterr().err
    assert not (tmp_path / "b.pt").exists()


def test_torchscript_archive_is_described_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "scripted.pt"
    scripted = script(torch.nn.Linear(2, 3))
    scripted.save(str(path))
    with pytest.raises(CheckpointError, match="TorchScript") as e:
        load(path)
    assert e.value.path == path
    shapes = sorted(r.shape for r in describe_file(path))
    assert shapes == [(3,), (3, 2)]


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_inspect_counts_tied_weights_and_views_once(
    tmp_path: Path,
    legacy: bool,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps cells to the terminal's width
    linear = torch.nn.Linear(4, 4)
    head = torch.nn.Linear(4, 4, bias=False)
    head.weight = linear.weight  # tied: saved once
    big = torch.arange(100.0)
    state = {"linear": linear.state_dict(), "head": head.state_dict(), "view": big[:3]}
    path = tmp_path / "tied.pt"
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)

    records = {r.name: r for r in describe_file(path)}
    assert records["head.weight"].shares == "linear.weight"
    assert records["linear.weight"].shares is None
    assert (records["head.weight"].nbytes, records["head.weight"].stored) == (64, 64)
    view = records["view"]
    assert (view.nbytes, view.stored, view.shares) == (12, 400, None)

    assert main(["inspect", str(path), "--json"]) == 0
    totals = json.loads(capsys.readouterr().out)["totals"]
    stored = 64 + 16 + 400  # the tied weight once, the view's whole storage
    assert totals["bytes"] == stored
    assert totals["count"] == 4
    assert totals["by_device"] == {"cpu": {"count": 4, "bytes": stored}}

    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "shares linear.weight's storage" in out
    assert "a view of 400 B, all stored" in out
    assert "view.clone()" in " ".join(out.split())


def test_inspect_shows_names_as_plain_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names come from the file: rich markup or emoji codes in them are shown as written."""
    monkeypatch.setenv("COLUMNS", "200")
    names = ["[/]", "[bold]w", ":thumbs_up:"]
    torch.save({name: torch.ones(1) for name in names}, tmp_path / "m.pt")
    assert main(["inspect", str(tmp_path / "m.pt")]) == 0
    out = capsys.readouterr().out
    for name in names:
        assert name in out


@pytest.mark.parametrize("spec", ["cpu:0", "CPU", "meta:0"])
def test_remap_tags_single_devices_as_torch_load_reads_them(tmp_path: Path, spec: str) -> None:
    """torch.load restores "cpu" and "meta" but no "cpu:0": the tag must be the bare name."""
    torch.save({"w": torch.arange(3.0)}, tmp_path / "a.pt")
    remap(tmp_path / "a.pt", tmp_path / "b.pt", to=spec)
    loaded = torch.load(tmp_path / "b.pt")["w"]
    assert loaded.device.type == spec.lower().partition(":")[0]
    if loaded.device.type == "cpu":
        assert torch.equal(loaded, torch.arange(3.0))


@pytest.mark.parametrize(
    ("spec", "message"),
    [("cpu:1", "one cpu device"), ("meta:3", "one meta device"), ("fpga", "cannot restore")],
)
def test_remap_refuses_tags_torch_load_cannot_read(tmp_path: Path, spec: str, message: str) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "a.pt")
    with pytest.raises(DeviceSpecError, match=message):
        remap(tmp_path / "a.pt", tmp_path / "b.pt", to=spec)
    assert not (tmp_path / "b.pt").exists()


def test_remap_to_an_unwritable_place_is_a_checkpoint_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "a.pt")
    out = tmp_path / ("y" * 300)  # a name longer than the file system allows
    assert main(["remap", str(tmp_path / "a.pt"), "--to", "cpu", "-o", str(out)]) == 1
    assert "cannot be written" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]


def test_inspect_counts_a_shard_spelt_two_ways_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    safetensors_torch.save_file(
        {"a": torch.ones(2, 2), "b": torch.ones(3)}, tmp_path / "s1.safetensors"
    )
    safetensors_torch.save_file({"c": torch.ones(4)}, tmp_path / "s2.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    weight_map = {"a": "s1.safetensors", "b": "./s1.safetensors", "c": "sub/../s2.safetensors"}
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert [(r.name, r.file) for r in describe_file(index)] == [
        ("a", "s1.safetensors"),
        ("b", "s1.safetensors"),
        ("c", "s2.safetensors"),
    ]
    assert main(["inspect", str(index), "--json"]) == 0
    totals = json.loads(capsys.readouterr().out)["totals"]
    assert (totals["count"], totals["bytes"]) == (3, 16 + 12 + 16)


@pytest.mark.parametrize("member", ["foo.txt", "archive/foo.txt"])
def test_remap_of_a_zip_that_is_not_a_torch_file_says_so(tmp_path: Path, member: str) -> None:
    import zipfile

    src = tmp_path / "weights.pt"
    with zipfile.ZipFile(src, "w") as archive:
        archive.writestr(member, "not weights")
    with pytest.raises(CheckpointError, match=r"a zip archive but not a torch\.save file") as info:
        remap(src, tmp_path / "out.pt", to="cpu")
    assert info.value.path == src
    assert "truncated" not in str(info.value)
    assert not (tmp_path / "out.pt").exists()


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # quantized tensors are deprecated in recent releases
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_tensor(torch.ones(4), 0.5, 0, torch.qint8)


def _safe_but_unusual() -> dict[str, torch.Tensor]:
    """Tensors torch's weights-only loader reads through globals beyond the usual storages."""
    with warnings.catch_warnings():  # sparse CSR and nested tensors warn that they are new
        warnings.simplefilter("ignore", UserWarning)
        return {
            "coo": torch.eye(3).to_sparse(),
            "csr": torch.eye(3).to_sparse_csr(),
            "q": _quantized(),
            "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            "u16": torch.ones(2, dtype=torch.uint16),  # saved on an UntypedStorage
            "f8": torch.ones(2, dtype=torch.float8_e4m3fn),
        }


@pytest.mark.parametrize("name", ["coo", "csr", "f8", "nested", "q", "u16"])
def test_inspect_warns_only_of_code_a_safe_load_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """Sparse, quantized, nested and new-dtype tensors: inspect lists code exactly when the
    installed torch's safe loader refuses the file, and names what it refuses (torch 2.15
    refuses nested tensors, which earlier releases read)."""
    path = tmp_path / "unusual.pt"
    torch.save({name: _safe_but_unusual()[name]}, path)
    found = _checkpoint_cli.code_globals(path)
    assert main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["code_globals"] == found
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if not found:
            load(path)  # torchplace.load reads it without trusted=True
            return
        with pytest.raises(CheckpointError, match="refused to unpickle") as info:
            load(path)
    assert found[0] in str(info.value)


class _AllowedLater:
    """A class a file may hold, refused until ``torch.serialization.add_safe_globals`` allows it."""


def test_inspect_follows_the_safe_globals_allowed_since_its_last_call(tmp_path: Path) -> None:
    path = tmp_path / "custom.pt"
    torch.save({"w": torch.ones(1), "extra": _AllowedLater()}, path)
    qualified = f"{__name__}._AllowedLater"
    assert _checkpoint_cli.code_globals(path) == [qualified]
    with pytest.raises(CheckpointError, match="refused to unpickle") as e:
        load(path)
    assert e.value.path == path
    with torch.serialization.safe_globals([_AllowedLater]):
        assert _checkpoint_cli.code_globals(path) == []
        assert isinstance(load(path)["extra"], _AllowedLater)
    assert _checkpoint_cli.code_globals(path) == [qualified]


def test_inspect_lists_quantized_and_sparse_tensors_by_their_names(tmp_path: Path) -> None:
    path = tmp_path / "unusual.pt"
    torch.save(_safe_but_unusual(), path)
    records = {r.name: r for r in describe_file(path)}
    q = records["q"]  # was left out: no tensor, no bytes
    assert (q.dtype, q.shape, q.nbytes) == ("qint8", (4,), 4)
    assert (records["coo.indices"].shape, records["coo.values"].nbytes) == ((2, 3), 12)
    assert {"csr.crow_indices", "csr.col_indices", "csr.values"} <= set(records)
    assert records["nested.buffer"].nbytes == 20
    assert (records["u16"].dtype, records["f8"].nbytes) == ("uint16", 2)


def test_inspect_refuses_an_index_its_shards_contradict(tmp_path: Path) -> None:
    safetensors_torch.save_file({"a": torch.ones(2)}, tmp_path / "s1.safetensors")
    torch.save({"b": torch.ones(3), "c": {"d": torch.ones(1)}}, tmp_path / "s2.bin")
    index = tmp_path / "model.safetensors.index.json"
    weight_map = {"a": "s1.safetensors", "b": "s2.bin", "c": "s2.bin"}
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert [r.name for r in describe_file(index)] == ["a", "b", "c.d"]
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "zz": "s1.safetensors"}}))
    with pytest.raises(
        CheckpointError, match=r"'zz' is in 's1\.safetensors'.*does not hold it"
    ) as e:
        describe_file(index)
    assert e.value.path == index
    for bad in ({"weight_map": {"a": 5}}, {"weight_map": {"a": None}}, [1, 2]):
        index.write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match="not a shard index") as e:
            describe_file(index)
        assert e.value.path == index


def test_inspect_table_of_names_no_terminal_can_print(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A lone surrogate in a name (any pickle can hold one) is shown escaped, not a crash."""
    torch.save({"\ud800w": torch.ones(1)}, tmp_path / "m.pt")
    assert main(["inspect", str(tmp_path / "m.pt")]) == 0
    assert "\\ud800w" in capsys.readouterr().out
    out = tmp_path / os.fsdecode(b"\xff.pt")  # a file name that is not UTF-8
    assert main(["remap", str(tmp_path / "m.pt"), "--to", "cpu", "-o", str(out)]) == 0
    assert "\\udcff.pt" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0


class _ClosedPipe(io.StringIO):
    """stdout whose reader went away (`torchplace inspect big.pt | head -1`)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        return self.fd


def test_inspect_into_a_closed_pipe_is_not_a_failure(
    gpu_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (tmp_path / "sink").open("w") as sink:
        monkeypatch.setattr(sys, "stdout", _ClosedPipe(sink.fileno()))
        assert main(["inspect", str(gpu_file)]) == 0  # rich exits 1 on a broken pipe
        assert main(["inspect", str(gpu_file), "--json"]) == 0


def test_interrupted_inspect_says_so_without_a_traceback(
    gpu_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(path: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_checkpoint_cli, "catalog", interrupted)
    assert main(["inspect", str(gpu_file)]) == 130
    assert "torchplace inspect: interrupted" in capsys.readouterr().err


def test_remap_of_a_newer_pickle_protocol_is_not_called_code(tmp_path: Path) -> None:
    """torch's safe loader refuses protocol 4's opcodes: that is no code to run."""
    src = tmp_path / "p4.pt"
    torch.save({"w": torch.ones(2)}, src, pickle_protocol=4)
    assert _checkpoint_cli.code_globals(src) == []
    with pytest.raises(CheckpointError, match=r"p4\.pt") as info:
        remap(src, tmp_path / "out.pt", to="cpu")
    assert info.value.path == src
    assert "would run code" not in str(info.value)
    assert not (tmp_path / "out.pt").exists()


def test_inspect_of_an_index_names_the_code_its_shards_would_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran.txt"
    torch.save({"w": torch.ones(1), "evil": _RunsCode(marker)}, tmp_path / "s1.bin")
    torch.save({"v": torch.ones(1)}, tmp_path / "s2.bin")
    index = tmp_path / "pytorch_model.bin.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "s1.bin", "v": "s2.bin"}}))
    assert _checkpoint_cli.code_globals(index) == ["builtins.exec"]
    assert not marker.exists()


def test_inspect_lists_tensors_nested_deeper_than_any_limit(tmp_path: Path) -> None:
    """torch.load reads any depth; tensors past a walk's depth limit were silently left out."""
    deep: dict[str, object] = {"w": torch.ones(1)}
    for _ in range(300):
        deep = {"x": deep}
    torch.save({"top": torch.ones(2), "deep": deep}, tmp_path / "deep.pt")
    assert [r.name for r in describe_file(tmp_path / "deep.pt")] == [
        "top",
        "deep" + ".x" * 300 + ".w",
    ]


def test_remap_refuses_a_corrupt_safetensors_file(tmp_path: Path) -> None:
    """A corrupt torch file is refused; a corrupt safetensors file was copied as if fine."""
    src = tmp_path / "w.safetensors"
    safetensors_torch.save_file({"a": torch.ones(2)}, src)
    data = bytearray(src.read_bytes())
    data[9] = ord("!")  # the header's JSON no longer parses
    src.write_bytes(bytes(data))
    assert main(["remap", str(src), "--to", "cpu", "-o", str(tmp_path / "o.safetensors")]) == 1
    assert not (tmp_path / "o.safetensors").exists()


@pytest.fixture
def no_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for backend in (getattr(torch.backends, "mps", None), getattr(torch, "xpu", None)):
        if backend is not None:
            monkeypatch.setattr(backend, "is_available", lambda: False)


@pytest.mark.usefixtures("no_accelerator")
@pytest.mark.parametrize(
    ("spec", "tag"),
    [("cuda", "cuda:0"), ("gpu", "cuda:0"), ("GPU:1", "cuda:1"), ("0", "cuda:0"), ("2", "cuda:2")],
)
def test_remap_to_gpu_or_a_number_needs_no_gpu_as_cuda_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, tag: str
) -> None:
    """ "gpu", "gpu:N" and a bare N (the int device() takes) name the machine's accelerator
    type, cuda on a machine without one: a rewrite of saved tags needs no device present."""
    torch.save({"w": torch.ones(1)}, tmp_path / "a.pt")
    assert main(["remap", str(tmp_path / "a.pt"), "--to", spec, "-o", str(tmp_path / "b.pt")]) == 0
    assert f"tensors load on {tag}" in capsys.readouterr().out
    assert [r.device for r in describe_file(tmp_path / "b.pt")] == [tag]


@pytest.mark.usefixtures("no_accelerator")
@pytest.mark.parametrize("spec", ["auto", "best"])
def test_remap_to_auto_or_best_without_a_gpu_is_the_cpu(tmp_path: Path, spec: str) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"w": torch.ones(1)}, tmp_path / "a.pt")
    assert main(["remap", str(tmp_path / "a.pt"), "--to", spec, "-o", str(tmp_path / "b.pt")]) == 0
    assert [r.device for r in describe_file(tmp_path / "b.pt")] == ["cpu"]


def test_remap_to_gpu_is_the_machines_accelerator_type(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    torch.save({"w": torch.ones(1)}, tmp_path / "a.pt")
    remap(tmp_path / "a.pt", tmp_path / "b.pt", to="gpu")
    assert [r.device for r in describe_file(tmp_path / "b.pt")] == ["mps"]


# --------------------------------------------------------------- inspect and remap agree with load

LONG_NAMES = [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkvo"]


def _narrow_terminal(width: int) -> tuple[object, io.StringIO]:
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True, color_system=None, emoji=False)
    return console, out


@pytest.mark.parametrize("width", [30, 60, 200])
def test_inspect_never_cuts_a_name_on_a_terminal(tmp_path: Path, width: int) -> None:
    """Names were cut at the terminal's width (``model.layers.0.self_a…`` for q, k, v and o)."""
    path = tmp_path / "m.pt"
    torch.save({name: torch.ones(2, 2) for name in LONG_NAMES}, path)
    console, out = _narrow_terminal(width)
    records = describe_file(path)
    _checkpoint_cli._render(console, "m.pt", records, [])
    text = out.getvalue()
    assert "…" not in text
    lines = text.splitlines()
    for name in LONG_NAMES:  # whole, on one line
        assert any(name in line for line in lines), name
    assert ("┃ name" in text) == (width == 200)  # the table where it fits, plain lines elsewhere


def test_inspect_into_a_pipe_prints_names_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "40")  # a narrow default: a pipe keeps to no width
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file({name: torch.ones(2, 2) for name in LONG_NAMES}, path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    for name in LONG_NAMES:
        assert any(name in line and "[2, 2]" in line for line in out.splitlines()), name


def _truncations(data: bytes, start: int) -> list[bytes]:
    return [data[:n] for n in sorted({start, start + 4, len(data) - 20, len(data) - 1})]


def test_inspect_refuses_a_legacy_file_cut_short_in_its_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A legacy file cut in its storages (after the pickles) was listed as whole, exit 0."""
    src = tmp_path / "whole.pt"
    torch.save(STATE, src, _use_new_zipfile_serialization=False)
    data = src.read_bytes()
    pickles_end = data.index(b"]q\x00(X")  # the list of storage keys, just before the data
    path = tmp_path / "cut.pt"
    for cut in _truncations(data, pickles_end + 60):
        path.write_bytes(cut)
        with pytest.raises(CheckpointError):
            load(path)
        assert main(["inspect", str(path)]) == 1
        err = capsys.readouterr().err
        assert "cut.pt" in err and "truncated" in err
        assert main(["inspect", str(path), "--json"]) == 1
        capsys.readouterr()
    path.write_bytes(data + b"\0" * 8)  # bytes beyond the last storage: torch.load reads it
    assert {r.name for r in describe_file(path)} == {"model.w", "model.h", "steps.0"}


class _Import:
    def __init__(self, module: str) -> None:
        self.module = module

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (__import__, (self.module,))


class _Attribute:
    """Pickles as ``getattr(__import__(module), name)``: a call whose result is called."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: object) -> None:  # pickle wants the function callable
        raise AssertionError("never called here")

    def __reduce__(self) -> tuple[object, tuple[object, str]]:
        return (getattr, (_Import(self.module), self.name))


class _RunsShell:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (_Attribute("os", "system"), (f"touch {self.marker}",))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_inspect_names_code_that_calls_what_it_built(
    tmp_path: Path, legacy: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """``getattr(__import__('os'), 'system')(...)`` was called "truncated or corrupt"; what it
    reaches (``os.system``) is named with the globals it calls."""
    marker = tmp_path / "ran.txt"
    path = tmp_path / "evil.pt"
    state = {"w": torch.ones(2), "evil": _RunsShell(marker)}
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)
    assert [r.name for r in describe_file(path)] == ["w"]
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    calls = "builtins.getattr, builtins.__import__, os.system"
    assert f"would import and call {calls}" in " ".join(out.split())
    assert main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["code_globals"] == [
        "builtins.getattr",
        "builtins.__import__",
        "os.system",
    ]
    with pytest.raises(CheckpointError, match=r"would run code .*getattr.*os\.system") as info:
        remap(path, tmp_path / "out.pt", to="cpu")
    assert info.value.path == path
    assert "truncated" not in str(info.value)
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def _deep_zip(path: Path, depth: int) -> None:
    """A torch zip file holding ``{"x": {"x": ... {"w": tensor}}}`` ``depth`` dicts deep, its
    pickle written directly (torch.save would recurse past any limit)."""
    import zipfile

    torch.save({"w": torch.ones(1)}, path)
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    key = next(name for name in members if name.endswith("/data.pkl"))
    inner = members[key]
    assert inner[:2] == b"\x80\x02" and inner[-1:] == b"."
    dict_and_key = b"}X\x01\x00\x00\x00x"  # EMPTY_DICT, BINUNICODE "x"
    members[key] = b"\x80\x02" + dict_and_key * depth + inner[2:-1] + b"s" * depth + b"."
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def test_inspect_reads_a_very_deep_file_quickly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paths were spelt out at every level, in time and memory growing with the square of the
    depth: 1,000,000 nested dicts took 97 s. Now a path is spelt once, for a tensor found."""
    spelt: list[str] = []
    spell = _pickle_reader._spell

    def counted(path: Any) -> str:
        spelt.append(spell(path))
        return spelt[-1]

    monkeypatch.setattr(_pickle_reader, "_spell", counted)
    depth = 200_000
    _deep_zip(tmp_path / "deep.pt", depth)
    (record,) = describe_file(tmp_path / "deep.pt")
    assert record.name == "x." * depth + "w"
    assert (record.shape, record.nbytes) == ((1,), 4)
    assert spelt == [record.name]  # one path spelt, not one per level


# Each damaged safetensors header and the tensor its error must name.
_BAD_LAYOUTS = {
    "overlap": (
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        12,
        "'b'",
    ),
    "gap": (
        {
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
        },
        12,
        "'b'",
    ),
    "gap-at-start": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8, "'a'"),
    "gap-at-end": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 8, "'a'"),
    "overflow": (
        {
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "big": {"dtype": "F32", "shape": [0, 2**62, 4], "data_offsets": [4, 4]},
        },
        4,
        "'big'",
    ),
    "metadata": (
        {
            "__metadata__": {"format": "pt", "step": 3},
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        },
        4,
        "__metadata__",
    ),
}


def _write_safetensors(path: Path, header: dict[str, object], data_len: int) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(data_len))


@pytest.mark.parametrize("case", list(_BAD_LAYOUTS))
def test_inspect_and_remap_refuse_a_safetensors_layout_load_refuses(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """These were listed by inspect and copied by remap as if sound."""
    header, data_len, culprit = _BAD_LAYOUTS[case]
    path = tmp_path / "bad.safetensors"
    _write_safetensors(path, header, data_len)
    with pytest.raises(CheckpointError, match=r"bad\.safetensors") as info:
        describe_file(path)
    assert info.value.path == path
    assert culprit in str(info.value)
    assert main(["inspect", str(path), "--json"]) == 1
    assert culprit in capsys.readouterr().err
    out = tmp_path / "out.safetensors"
    assert main(["remap", str(path), "--to", "cpu", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "bad.safetensors" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors"]


# `load` and `safetensors_header` refuse every layout that inspect and remap refuse: all read
# the header through torchplace.checkpoint._safetensors.
@pytest.mark.parametrize("case", list(_BAD_LAYOUTS))
def test_load_refuses_the_layouts_inspect_refuses(tmp_path: Path, case: str) -> None:
    header, data_len, culprit = _BAD_LAYOUTS[case]
    path = tmp_path / "bad.safetensors"
    _write_safetensors(path, header, data_len)
    with pytest.raises(CheckpointError, match=r"bad\.safetensors") as e:
        load(path)
    assert e.value.path == path
    from torchplace.checkpoint._checkpoint import safetensors_header

    with pytest.raises(CheckpointError, match=culprit) as e:
        safetensors_header(path)
    assert e.value.path == path


def test_safetensors_read_without_torch_matches_load_on_damaged_files(tmp_path: Path) -> None:
    """inspect reads safetensors headers without torch: whatever load refuses, it refuses."""
    src = tmp_path / "src.safetensors"
    safetensors_torch.save_file(
        {"a": torch.ones(2, 3), "b": torch.arange(4, dtype=torch.int64), "e": torch.ones(0)},
        src,
        metadata={"format": "pt"},
    )
    data = src.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    rng = random.Random(11)
    path = tmp_path / "fuzzed.safetensors"
    outcomes = {"both refuse": 0, "both read": 0}
    for i in range(150):
        case = bytearray(data)
        if i % 5 == 0:
            case = case[: rng.randrange(1, len(case))]
        else:
            for _ in range(rng.randint(1, 3)):
                case[rng.randrange(8, header_end)] = ord(rng.choice('0123456789,:[]{}" xF'))
        path.write_bytes(bytes(case))
        try:
            load(path)
            loaded = True
        except CheckpointError:
            loaded = False
        try:
            describe_file(path)
            described = True
        except CheckpointError:  # any other exception fails the test
            described = False
        assert described <= loaded, bytes(case[: header_end + 8])  # never list what load refuses
        if described == loaded:
            outcomes["both read" if loaded else "both refuse"] += 1
    assert min(outcomes.values()) > 0


def test_safetensors_dtypes_without_torch_are_loads() -> None:
    from torchplace.checkpoint import _checkpoint, _safetensors

    loads = {
        name: (str(dtype).removeprefix("torch."), dtype.itemsize)
        for name, dtype in _checkpoint.SAFETENSORS_DTYPES.items()
    }
    assert loads == {k: v for k, v in _safetensors.DTYPES.items() if k in loads}


def test_safetensors_sniffed_without_torch_as_detect_format_says(tmp_path: Path) -> None:
    from torchplace.checkpoint._checkpoint import detect_format

    safetensors_torch.save_file({"a": torch.ones(2)}, tmp_path / "a.safetensors")
    whole = (tmp_path / "a.safetensors").read_bytes()
    torch.save(STATE, tmp_path / "z.pt")
    torch.save(STATE, tmp_path / "l.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "cut.safetensors").write_bytes(whole[:20])
    (tmp_path / "cut.bin").write_bytes(whole[:20])
    (tmp_path / "st.json").write_bytes(whole)
    (tmp_path / "text.txt").write_bytes(b"hello world, no checkpoint")
    for path in sorted(tmp_path.iterdir()):
        try:
            kind = detect_format(path)
        except CheckpointError:
            kind = "refused"
        assert _safetensors.sniff(path) == (kind == "safetensors"), path.name


# ------------------------------------------------------------------------- remap of a shard index


def _sharded(tmp_path: Path) -> Path:
    """A shard index over a safetensors shard, a torch shard saved "on a GPU" and a torch shard
    in a sub-directory; returns the index."""
    src = tmp_path / "src"
    (src / "more").mkdir(parents=True)
    safetensors_torch.save_file({"a": torch.arange(4.0)}, src / "s1.safetensors")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"b": torch.arange(6.0).reshape(2, 3)}, src / "s2.bin")
    torch.save({"c": torch.ones(2, dtype=torch.bfloat16)}, src / "more" / "s3.bin")
    index = src / "model.index.json"
    weight_map = {"a": "s1.safetensors", "b": "s2.bin", "c": "more/s3.bin"}
    index.write_text(json.dumps({"metadata": {"total_size": 36}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("output", ["directory", "index-file"])
def test_remap_rewrites_every_shard_of_an_index(
    tmp_path: Path, output: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """remap refused a shard index ("remap each shard it lists")."""
    index = _sharded(tmp_path)
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" if output == "directory" else tmp_path / "out" / "new.index.json"
    assert main(["remap", str(index), "--to", "cpu", "-o", str(out)]) == 0
    new = out / index.name if output == "directory" else out
    assert "wrote" in capsys.readouterr().out
    assert new.read_bytes() == index.read_bytes()
    assert (tmp_path / "out" / "s1.safetensors").read_bytes() == (
        index.parent / "s1.safetensors"
    ).read_bytes()
    assert {r.name: r.device for r in describe_file(new)} == {"a": "-", "b": "cpu", "c": "cpu"}
    plain = torch.load(tmp_path / "out" / "s2.bin", weights_only=True)  # no map_location
    assert torch.equal(plain["b"], torch.arange(6.0).reshape(2, 3))
    loaded = load(new, "cpu")
    assert torch.equal(loaded["c"], torch.ones(2, dtype=torch.bfloat16))
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == sorted(
        [new.name, "s1.safetensors", "s2.bin", "more", "s3.bin"]
    )


@pytest.mark.parametrize(
    ("shards", "said"),
    [
        (
            ["s1.safetensors", "s2.bin"],
            "(tensors load on cpu; safetensors shards are copied unchanged)",
        ),
        (["s1.bin", "s2.bin"], "(tensors load on cpu)"),
        (
            ["s1.safetensors", "s2.safetensors"],
            "(shards copied unchanged: a safetensors file stores no device)",
        ),
    ],
    ids=["mixed", "bin-only", "safetensors-only"],
)
def test_remap_of_an_index_says_what_it_did_to_the_shards_it_has(
    tmp_path: Path, shards: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An index of .bin shards alone was told "safetensors shards are copied unchanged"."""
    src = tmp_path / "src"
    src.mkdir()
    for i, shard in enumerate(shards):
        tensors = {f"t{i}": torch.full((2,), float(i))}
        if shard.endswith(".safetensors"):
            safetensors_torch.save_file(tensors, src / shard)
        else:
            torch.save(tensors, src / shard)
    index = src / "model.index.json"
    index.write_text(json.dumps({"weight_map": {f"t{i}": s for i, s in enumerate(shards)}}))
    assert main(["remap", str(index), "--to", "cpu", "-o", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    new = tmp_path / "out" / index.name
    assert out == f"wrote {new} and its shards beside it {said}\n"


def test_remap_of_a_save_pretrained_directory_writes_a_new_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """remap refused the directory inspect and load take ("is a directory, not a checkpoint")."""
    index = _sharded(tmp_path)
    assert main(["remap", str(index.parent), "--to", "cpu", "-o", str(tmp_path / "copy")]) == 0
    assert "wrote" in capsys.readouterr().out
    new = tmp_path / "copy" / index.name
    assert new.read_bytes() == index.read_bytes()
    assert {r.name: r.device for r in describe_file(new)} == {"a": "-", "b": "cpu", "c": "cpu"}
    loaded = load(tmp_path / "copy", "cpu")  # the copy is a directory load takes too
    assert torch.equal(loaded["b"], torch.arange(6.0).reshape(2, 3))


def test_remap_of_a_hugging_face_cache_snapshot_writes_the_files_it_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every file of a cache snapshot links into ../../blobs: remap placed each shard by where
    its link led and failed with a raw ValueError ("is not in the subpath")."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    torch.save({"a": torch.ones(2)}, blobs / "b1")
    torch.save({"b": torch.arange(3.0)}, blobs / "b2")
    names = {"a": "model-00001-of-00002.bin", "b": "model-00002-of-00002.bin"}
    (blobs / "b3").write_text(json.dumps({"weight_map": names}))
    for blob, name in (("b1", names["a"]), ("b2", names["b"]), ("b3", "model.bin.index.json")):
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob))
    for source, out in ((snapshot, "out1"), (snapshot / "model.bin.index.json", "out2/")):
        assert main(["remap", str(source), "--to", "meta", "-o", str(tmp_path / out)]) == 0
        written = tmp_path / out.rstrip("/")
        assert sorted(p.name for p in written.iterdir()) == sorted(
            [*names.values(), "model.bin.index.json"]
        )
        assert not any(p.is_symlink() for p in written.iterdir())
        loaded = load(written, "cpu")
        assert torch.equal(loaded["b"], torch.arange(3.0)) and torch.equal(
            loaded["a"], torch.ones(2)
        )
        assert {r.name: r.device for r in describe_file(written)} == {"a": "meta", "b": "meta"}
    capsys.readouterr()


def test_remap_of_a_directory_that_fails_leaves_no_directory_behind(tmp_path: Path) -> None:
    index = _sharded(tmp_path)
    (index.parent / "more" / "s3.bin").write_bytes(b"PK\x03\x04" + bytes(64))  # corrupt, last
    with pytest.raises(CheckpointError, match=r"s3\.bin"):
        remap(index.parent, tmp_path / "copy", to="cpu")
    assert not (tmp_path / "copy").exists()


def test_remap_of_a_directory_refused_before_writing_leaves_no_directory(tmp_path: Path) -> None:
    index = _sharded(tmp_path)
    (index.parent / "s2.bin").unlink()  # a shard the index names is gone: refused up front
    with pytest.raises(CheckpointError, match=r"s2\.bin"):
        remap(index.parent, tmp_path / "copy", to="cpu")
    assert not (tmp_path / "copy").exists()


def test_remap_of_an_index_writes_nothing_unless_every_shard_is_written(tmp_path: Path) -> None:
    index = _sharded(tmp_path)
    (index.parent / "more" / "s3.bin").write_bytes(b"PK\x03\x04" + bytes(64))  # corrupt, last
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match=r"s3\.bin"):
        remap(index, tmp_path / "out", to="cpu")
    assert list((tmp_path / "out").iterdir()) == []  # no shard, no temporary, no sub-directory


def test_remap_of_an_index_refuses_to_write_over_what_it_reads(tmp_path: Path) -> None:
    index = _sharded(tmp_path)
    before = {p: p.read_bytes() for p in index.parent.rglob("*") if p.is_file()}
    for out in (index.parent, index.parent / "other.index.json"):
        with pytest.raises(CheckpointError, match="would write over") as e:
            remap(index, out, to="cpu")
        assert e.value.path == index
    assert {p: p.read_bytes() for p in index.parent.rglob("*") if p.is_file()} == before


def _dead_pid() -> int:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="tells dead processes by os.kill(pid, 0)")
def test_remap_sweeps_the_temporary_files_of_a_killed_run(tmp_path: Path) -> None:
    """A remap killed mid-write (SIGKILL: no clean-up runs) left its temporary file for ever."""
    import subprocess

    src = tmp_path / "a.pt"
    torch.save(STATE, src)
    out = tmp_path / "b.pt"
    killed_mid_write = (
        "import contextlib, os, signal, sys\n"
        "from torchplace.checkpoint import _checkpoint_cli\n"
        "@contextlib.contextmanager\n"
        "def progress(total, label, enabled):\n"
        "    yield lambda n: os.kill(os.getpid(), signal.SIGKILL)\n"
        "_checkpoint_cli._progress = progress\n"
        "_checkpoint_cli.remap(sys.argv[1], sys.argv[2], to='cpu')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", killed_mid_write, str(src), str(out)], env=env)
    assert run.returncode == -9
    (left,) = [p.name for p in tmp_path.iterdir() if p.name.startswith(".b.pt.torchplace-tmp-")]
    alive = tmp_path / f".b.pt.torchplace-tmp-{os.getppid()}"  # a running remap's: kept
    alive.write_bytes(b"in progress")
    other = tmp_path / f".notes.torchplace-tmp-{_dead_pid()}"  # remap's too, for another output
    other.write_bytes(b"stale")
    assert main(["remap", str(src), "--to", "cpu", "-o", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a.pt", "b.pt", alive.name])
    assert left not in {p.name for p in tmp_path.iterdir()}
    assert torch.equal(torch.load(out, weights_only=True)["model"]["w"], STATE["model"]["w"])


@pytest.mark.parametrize("names", [LONG_NAMES, ["w", "重み.权重"]], ids=["ascii", "wide"])
def test_inspect_table_fills_a_terminal_exactly_as_wide_as_it(
    tmp_path: Path, names: list[str]
) -> None:
    """The table is drawn at the terminal's width when it fits to the column, else as lines."""
    path = tmp_path / "m.pt"
    torch.save({name: torch.ones(2, 2) for name in names}, path)
    records = describe_file(path)
    console, out = _narrow_terminal(1000)
    _checkpoint_cli._render(console, "m.pt", records, [])
    from rich.cells import cell_len

    width = max(cell_len(line) for line in out.getvalue().splitlines())
    for fits in (width, width - 1):
        console, out = _narrow_terminal(fits)
        _checkpoint_cli._render(console, "m.pt", records, [])
        assert ("┃ name" in out.getvalue()) == (fits == width)
        assert "…" not in out.getvalue()


@pytest.mark.parametrize(
    ("golden", "width", "terminal"),
    [("inspect_pipe.txt", 40, False), ("inspect_narrow.txt", 40, True)],
    ids=["pipe", "narrow-terminal"],
)
def test_inspect_output_golden(
    tmp_path: Path, golden: str, width: int, terminal: bool, regen_golden: bool
) -> None:
    """inspect's output as a pipe and a 40-column terminal see it (`pytest --regen-golden`)."""
    from rich.console import Console

    path = tmp_path / "model.safetensors"
    tensors = {name: torch.ones(2, 2, dtype=torch.bfloat16) for name in LONG_NAMES[:2]}
    safetensors_torch.save_file({**tensors, "lm_head.bias": torch.zeros(3)}, path)
    out = io.StringIO()
    console = Console(
        file=out, width=width, force_terminal=terminal, color_system=None, emoji=False
    )
    _checkpoint_cli._render(
        console, "model.safetensors (safetensors, 3 tensors)", describe_file(path), []
    )
    check_golden(golden, out.getvalue(), regen_golden)


def test_an_index_remapped_to_a_name_without_json_makes_a_directory_that_loads(
    tmp_path: Path,
) -> None:
    """`-o NAME` without the .json an index is found by used to write the index under the bare
    name beside its shards, a file nothing finds as an index: NAME is now a directory made for
    the index (under its own name) and its shards, which load takes; an existing file of that
    name is refused, untouched."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"a": torch.arange(3.0)}, src / "s1.safetensors")
    save_file({"b": torch.ones(2)}, src / "s2.safetensors")
    index = src / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    out = tmp_path / "out"
    out.mkdir()
    assert main(["remap", str(index), "--to", "cpu", "-o", str(out / "remapped")]) == 0
    made = out / "remapped"
    assert sorted(p.name for p in made.iterdir()) == sorted(
        [index.name, "s1.safetensors", "s2.safetensors"]
    )
    assert list(out.iterdir()) == [made]
    loaded = load(made)
    assert torch.equal(loaded["a"], torch.arange(3.0)) and torch.equal(loaded["b"], torch.ones(2))
    (out / "taken").write_bytes(b"mine")
    with pytest.raises(CheckpointError, match=r"taken: is a file, not a directory.*\.json") as e:
        remap(index, out / "taken", to="cpu")
    assert e.value.path == out / "taken"
    assert (out / "taken").read_bytes() == b"mine"


def test_a_file_remapped_to_meta_still_counts_its_bytes(tmp_path: Path) -> None:
    """remap --to meta keeps the data (tagged meta): inspect counts it, as a real meta tensor
    (no data saved) counts nothing."""
    src = tmp_path / "w.pt"
    torch.save({"w": torch.ones(4, 4)}, src)
    assert main(["remap", str(src), "--to", "meta", "-o", str(tmp_path / "m.pt")]) == 0
    (record,) = describe_file(tmp_path / "m.pt")
    assert (record.device, record.nbytes) == ("meta", 64)
    torch.save({"w": torch.ones(4, 4, device="meta")}, tmp_path / "real_meta.pt")
    (record,) = describe_file(tmp_path / "real_meta.pt")
    assert (record.device, record.nbytes) == ("meta", 0)


def _json_goldens(tmp_path: Path) -> dict[str, Path]:
    """A training checkpoint (.pt: views, shared storage, an argparse.Namespace, optimizer
    state) and a two-shard safetensors index, each under a name relative to ``tmp_path``."""
    import argparse

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    base = torch.arange(8.0)
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "half": base[:4],  # a view: its whole storage is saved
            "same": base,  # the storage "half" views
            "mask": torch.ones(2, dtype=torch.bool),
            "args": argparse.Namespace(lr=0.1),
            "epoch": 3,
        },
        tmp_path / "train.pt",
    )
    safetensors_torch.save_file({"a": torch.ones(2, 2, dtype=torch.bfloat16)}, tmp_path / "s1.st")
    safetensors_torch.save_file({"b": torch.zeros(3, dtype=torch.int8)}, tmp_path / "s2.st")
    weight_map = {"a": "s1.st", "b": "s2.st"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {
        "inspect_pt.json": Path("train.pt"),
        "inspect_index.json": Path("model.safetensors.index.json"),
    }


@pytest.mark.parametrize("golden", ["inspect_pt.json", "inspect_index.json"])
def test_inspect_json_golden(
    tmp_path: Path,
    golden: str,
    regen_golden: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`inspect --json` is an interface programs parse: its keys and values are fixed here
    (`pytest --regen-golden` after an intended change)."""
    path = _json_goldens(tmp_path)[golden]
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", str(path), "--json"]) == 0
    out = capsys.readouterr().out
    check_golden(golden, out, regen_golden)
    summary = json.loads(out)  # and it is JSON whose totals add up
    assert summary["totals"]["count"] == len(summary["tensors"])


def test_remap_of_a_whole_pickled_model_gives_a_rewrite_that_remap_then_takes(
    tmp_path: Path,
) -> None:
    """Saving the loaded object again would pickle the model again: the fix saves its weights."""
    import torchplace

    path = tmp_path / "whole.pt"
    torch.save(torch.nn.Sequential(torch.nn.Linear(2, 2)), path)
    with pytest.raises(CheckpointError, match="remap never runs") as info:
        remap(path, tmp_path / "x.pt", to="cpu")
    assert info.value.path == path
    out = tmp_path / "whole-weights.pt"  # named after the file, beside it
    fix = f"torch.save(torchplace.load({str(path)!r}, 'cpu', trusted=True).state_dict(), "
    fix += f"{str(out)!r})"
    assert str(info.value).endswith(f"{fix}, then remap {str(out)!r}")
    exec(fix, {"torch": torch, "torchplace": torchplace})  # the fix, as given
    remap(out, tmp_path / "x.pt", to="cpu")
    assert set(load(tmp_path / "x.pt")) == {"0.weight", "0.bias"}


def test_remap_of_a_dict_holding_an_object_gives_a_rewrite_that_remap_then_takes(
    tmp_path: Path,
) -> None:
    """Saving the loaded dict again would pickle its object again (and the advice would loop):
    the fix keeps its tensors."""
    import fractions

    import torchplace

    path = tmp_path / "mixed.pt"
    torch.save({"w": torch.arange(3.0), "ratio": fractions.Fraction(1, 3)}, path)
    with pytest.raises(CheckpointError, match="remap never runs") as info:
        remap(path, tmp_path / "x.pt", to="cpu")
    assert info.value.path == path
    found = re.search(r"(torch\.save\(.*\)), then remap", str(info.value))
    assert found is not None
    fix = found.group(1)
    assert "isinstance(v, torch.Tensor)" in fix
    exec(fix, {"torch": torch, "torchplace": torchplace})  # the fix, as given
    remap(tmp_path / "mixed-weights.pt", tmp_path / "x.pt", to="cpu")
    assert torch.equal(load(tmp_path / "x.pt")["w"], torch.arange(3.0))
    assert set(load(tmp_path / "x.pt")) == {"w"}


def test_remap_of_a_file_into_a_directory_writes_it_there_under_its_own_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`-o newdir/` wrote a file named newdir (the slash was dropped); `-o existing_dir` was
    refused while an index or a directory source took it. Now, as cp takes it: a directory
    (made if its parent exists) gets the file under its own name; a file named with a slash
    is refused, untouched."""
    src = tmp_path / "model.pt"
    torch.save({"w": torch.arange(3.0)}, src)
    assert main(["remap", str(src), "--to", "meta", "-o", f"{tmp_path / 'new'}/"]) == 0
    assert "new/model.pt" in capsys.readouterr().out
    assert describe_file(tmp_path / "new" / "model.pt")[0].device == "meta"
    (tmp_path / "there").mkdir()
    assert main(["remap", str(src), "--to", "meta", "-o", str(tmp_path / "there")]) == 0
    assert [p.name for p in (tmp_path / "there").iterdir()] == ["model.pt"]
    (tmp_path / "taken").write_bytes(b"mine")
    with pytest.raises(CheckpointError, match=r"taken: is a file, not a directory.*model\.pt") as e:
        remap(src, f"{tmp_path / 'taken'}/", to="cpu")
    assert e.value.path == tmp_path / "taken"
    assert (tmp_path / "taken").read_bytes() == b"mine"
    assert torch.equal(torch.load(src)["w"], torch.arange(3.0))  # the source untouched


# ----------------------------------------------------------- remap's outputs: refused, or copied


def _listing(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_remap_refuses_an_existing_output_file_unless_forced(
    gpu_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "other.pt"
    torch.save({"unrelated": torch.zeros(3)}, out)
    before = _listing(tmp_path)
    assert main(["remap", str(gpu_file), "--to", "cpu", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{out}: exists already" in err and "--force" in err and "Nothing was written" in err
    assert _listing(tmp_path) == before  # untouched, no temporary file left
    assert main(["remap", str(gpu_file), "--to", "cpu", "-o", str(out), "--force"]) == 0
    assert {r.device for r in describe_file(out)} == {"cpu"}
    assert torch.equal(load(out)["model"]["w"], STATE["model"]["w"])


def test_the_remap_function_refuses_an_existing_output_unless_forced(
    gpu_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "other.pt"
    out.write_bytes(b"someone else's file")
    with pytest.raises(CheckpointError, match=r"exists already.*force=True") as e:
        remap(gpu_file, out, to="cpu")
    assert e.value.path == out
    assert out.read_bytes() == b"someone else's file"
    assert remap(gpu_file, out, to="cpu", force=True) == out
    assert {r.device for r in describe_file(out)} == {"cpu"}


def test_remap_in_place_needs_no_force(gpu_file: Path) -> None:
    assert main(["remap", str(gpu_file), "--to", "cuda:1", "-o", str(gpu_file)]) == 0
    assert {r.device for r in describe_file(gpu_file)} == {"cuda:1"}
    assert remap(gpu_file, gpu_file, to="cpu") == gpu_file
    assert {r.device for r in describe_file(gpu_file)} == {"cpu"}


def test_remap_into_a_directory_refuses_the_file_it_would_replace(
    gpu_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "out").mkdir()
    taken = tmp_path / "out" / gpu_file.name
    taken.write_bytes(b"keep me")
    assert main(["remap", str(gpu_file), "--to", "cpu", "-o", str(tmp_path / "out")]) == 1
    assert f"{taken}: exists already" in capsys.readouterr().err
    assert taken.read_bytes() == b"keep me"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [gpu_file.name]


@pytest.mark.parametrize("output", ["directory", "index-file"])
def test_remap_of_an_index_refuses_existing_outputs(
    tmp_path: Path, output: str, capsys: pytest.CaptureFixture[str]
) -> None:
    index = _sharded(tmp_path)
    (tmp_path / "out" / "more").mkdir(parents=True)
    taken = tmp_path / "out" / "more" / "s3.bin"  # one shard's output, deep in the layout
    taken.write_bytes(b"keep me")
    dst = tmp_path / "out" / ("" if output == "directory" else "new.index.json")
    before = _listing(tmp_path / "out")
    assert main(["remap", str(index), "--to", "cpu", "-o", str(dst)]) == 1
    assert f"{taken}: exists already" in capsys.readouterr().err
    assert _listing(tmp_path / "out") == before
    assert main(["remap", str(index), "--to", "cpu", "-o", str(dst), "--force"]) == 0
    assert torch.equal(load(taken)["c"], torch.ones(2, dtype=torch.bfloat16))


def test_remap_of_a_directory_copies_its_other_files(tmp_path: Path) -> None:
    index = _sharded(tmp_path)
    folder = index.parent
    (folder / "config.json").write_text('{"model_type": "x"}')
    (folder / "tokenizer.json").write_bytes(bytes(range(256)))
    (folder / "extra" / "deep").mkdir(parents=True)
    (folder / "extra" / "deep" / "notes.txt").write_text("kept as it is")
    os.utime(folder / "config.json", (1_000_000, 1_000_000))
    (folder / "tokenizer.json").chmod(0o640)
    remap(folder, tmp_path / "copy", to="cpu")
    new = tmp_path / "copy"
    for name in ("config.json", "tokenizer.json", "extra/deep/notes.txt"):
        assert (new / name).read_bytes() == (folder / name).read_bytes(), name
    assert (new / "config.json").stat().st_mtime == 1_000_000  # copied as shutil.copy2 does
    assert (new / "tokenizer.json").stat().st_mode & 0o777 == 0o640
    assert {r.device for r in describe_file(new / "more" / "s3.bin")} == {"cpu"}  # rewritten
    assert sorted(_listing(new)) == sorted(_listing(folder))  # nothing else, nothing missing


def test_remap_of_a_directory_refuses_an_existing_copy_of_its_other_files(
    tmp_path: Path,
) -> None:
    index = _sharded(tmp_path)
    (index.parent / "config.json").write_text("{}")
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "config.json").write_text("mine")
    with pytest.raises(CheckpointError, match=r"config\.json: exists already") as e:
        remap(index.parent, tmp_path / "copy", to="cpu")
    assert e.value.path == tmp_path / "copy" / "config.json"
    assert _listing(tmp_path / "copy") == {"config.json": b"mine"}


@pytest.mark.parametrize("saved", ["sharded-safetensors", "torch-on-gpu"])
def test_remap_of_a_save_pretrained_directory_loads_with_from_pretrained(
    tmp_path: Path, saved: str
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    src = tmp_path / "src"
    if saved == "sharded-safetensors":
        model.save_pretrained(src, max_shard_size="10KB")
        assert (src / "model.safetensors.index.json").exists()
    else:  # a torch file saved on a GPU, beside the config save_pretrained writes
        model.save_pretrained(src)
        (src / "model.safetensors").unlink()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
            torch.save(model.state_dict(), src / "pytorch_model.bin")
    (src / "tokenizer_config.json").write_text('{"model_max_length": 32}')
    assert (src / "generation_config.json").exists()
    assert main(["remap", str(src), "--to", "cpu", "-o", str(tmp_path / "new")]) == 0
    new = tmp_path / "new"
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert (new / name).read_bytes() == (src / name).read_bytes(), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(new)  # config.json decides
    want, got = model.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].device == torch.device("cpu"), name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
