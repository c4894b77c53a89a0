"""``load`` (``checkpoint/_load.py``): torch files, safetensors files and shard indexes read onto a
device; pickles that would run code refused; damaged files named as such."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import safetensors_torch, save, write_shards
from torchplace._errors import CheckpointError
from torchplace.checkpoint._checkpoint import load, load_into


@pytest.fixture
def saved_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch.save tag every storage "cuda:0", as a file saved on a GPU is."""
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")


# -------------------------------------------------------------------- load: torch files and devices


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "read"])
def test_load_torch_files(tmp_path: Path, legacy: bool, mmap: bool) -> None:
    sd = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    path = save(sd, tmp_path / "w.pt", legacy=legacy)
    out = load(path, mmap=mmap)
    assert out.keys() == sd.keys()
    for k in sd:
        assert torch.equal(out[k], sd[k]) and out[k].dtype == sd[k].dtype


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_load_onto_meta(tmp_path: Path, legacy: bool) -> None:
    path = save({"a": torch.ones(3, 2)}, tmp_path / "w.pt", legacy=legacy)
    out = load(path, "meta")
    assert out["a"].device.type == "meta" and out["a"].shape == (3, 2)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_file_saved_on_gpu_loads_on_cpu(
    tmp_path: Path, legacy: bool, saved_on_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = {"w": torch.arange(4.0), "nested": [torch.ones(2)]}
    path = save(sd, tmp_path / "gpu.pt", legacy=legacy)
    monkeypatch.undo()  # stop tagging; the file keeps its cuda:0 tags
    if not torch.cuda.is_available():  # the trap torchplace removes
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, weights_only=True)
    out = load(path, "cpu")
    assert out["w"].device == torch.device("cpu")
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["nested"][0], torch.ones(2))


@pytest.mark.requires_cuda
def test_load_onto_cuda(tmp_path: Path) -> None:
    path = save({"w": torch.arange(4.0)}, tmp_path / "w.pt")
    assert load(path, "cuda")["w"].device == torch.device("cuda:0")
    st = tmp_path / "w.safetensors"
    safetensors_torch().save_file({"w": torch.arange(4.0)}, st)
    assert load(st, torch.device("cuda", 0))["w"].device == torch.device("cuda:0")


# ------------------------------------------------------------------------------------ pickle safety


class _RunsCode:
    """Pickles into a call of exec that would create a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


@pytest.mark.parametrize("how", ["zip", "legacy", "plain-pickle"])
def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path: Path, how: str) -> None:
    marker = tmp_path / "ran.txt"
    payload = {"w": torch.ones(2), "evil": _RunsCode(marker)}
    path = tmp_path / "evil.pt"
    if how == "plain-pickle":
        path.write_bytes(pickle.dumps(payload, protocol=2))
    else:
        save(payload, path, legacy=how == "legacy")
    with pytest.raises(CheckpointError, match=r"evil\.pt") as info:
        load(path)
    assert info.value.path == path
    assert not marker.exists()
    if how == "plain-pickle":  # refused before any unpickling: there is no cause to chain
        assert "is a plain pickle, not a torch.save file" in str(info.value)
    else:
        assert "trusted=True" in str(info.value)
        assert info.value.__cause__ is not None


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_plain_pickle_is_named_as_such(tmp_path: Path, protocol: int) -> None:
    path = tmp_path / "state.pkl"
    path.write_bytes(pickle.dumps({"a": 1}, protocol=protocol))
    with pytest.raises(CheckpointError, match=r"state\.pkl: is a plain pickle") as info:
        load(path)
    assert info.value.path == path


def test_refusals_name_what_was_blocked(tmp_path: Path) -> None:
    class System:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    path = save({"x": System()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"GLOBAL (posix|nt)\.system") as info:
        load(path)
    assert info.value.path == path


def test_legacy_files_of_newer_pickle_protocols_are_explained(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(1)}, path, _use_new_zipfile_serialization=False, pickle_protocol=4)
    with pytest.raises(
        CheckpointError, match=r"Re-save it with torch\.save's default protocol"
    ) as e:
        load(path)
    assert e.value.path == path
    assert torch.equal(load(path, trusted=True)["w"], torch.ones(1))


def test_trusted_loads_other_objects(tmp_path: Path) -> None:
    path = save({"args": argparse.Namespace(lr=0.5)}, tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match="trusted=True") as info:
        load(path)
    assert info.value.path == path
    assert load(path, trusted=True)["args"].lr == 0.5


def test_a_whole_pickled_model_is_refused_with_a_fix_that_works_when_followed(
    tmp_path: Path,
) -> None:
    """torch.save(model) pickles the classes: the advice leads to its state dict, which
    load_into takes, not to trusted=True on load_into (which has no such argument)."""
    source = nn.Sequential(nn.Linear(2, 3))
    path = tmp_path / "whole.pt"
    torch.save(source, path)
    model = nn.Sequential(nn.Linear(2, 3))
    for attempt in (lambda: load(path), lambda: load_into(model, path)):
        with pytest.raises(CheckpointError, match="holds a whole model") as info:
            attempt()
        assert info.value.path == path
        fix = f"torchplace.load({str(path)!r}, trusted=True).state_dict()"
        assert fix in str(info.value) and "Nothing was run" in str(info.value)
    load_into(model, load(path, trusted=True).state_dict())  # the fix, as given
    assert torch.equal(model[0].weight, source[0].weight)


# -------------------------------------------------------------------- safetensors and shard indexes


def test_load_safetensors(tmp_path: Path) -> None:
    sd = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    path = tmp_path / "w.safetensors"
    safetensors_torch().save_file(sd, path)
    for mmap in (True, False):
        out = load(path, mmap=mmap)
        assert all(torch.equal(out[k], sd[k]) for k in sd)
    meta = load(path, "meta")
    assert meta["a"].device.type == "meta" and meta["b"].dtype == torch.bfloat16


def test_safetensors_missing_gives_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "w.safetensors"
    safetensors_torch().save_file({"a": torch.ones(2)}, path)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(CheckpointError, match=r"pip install safetensors") as info:
        load(path, mmap=True)  # mapping goes through the library
    assert info.value.path == path
    assert torch.equal(load(path)["a"], torch.ones(2))  # reading needs no library


@pytest.mark.parametrize("torch_shards", [False, True], ids=["safetensors", "bin"])
def test_load_sharded_index(tmp_path: Path, torch_shards: bool) -> None:
    sd = {f"layer{i}.weight": torch.full((2,), float(i)) for i in range(5)}
    index = write_shards(tmp_path, sd, torch_shards=torch_shards)
    out = load(index)
    assert out.keys() == sd.keys() and all(torch.equal(out[k], sd[k]) for k in sd)


def test_sharded_index_problems(tmp_path: Path) -> None:
    sd = {f"layer{i}.weight": torch.ones(2) for i in range(4)}
    index = write_shards(tmp_path, sd)
    data = json.loads(index.read_text())
    data["weight_map"]["ghost.weight"] = data["weight_map"]["layer0.weight"]
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"ghost\.weight") as info:
        load(index)
    assert info.value.path == index
    data["weight_map"] = {"a": "../elsewhere.safetensors"}
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="outside its own directory"):
        load(index)
    data["weight_map"] = {"a": "absent.safetensors"}
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"absent\.safetensors"):
        load(index)
    index.write_text('{"not": "an index"}')
    with pytest.raises(CheckpointError, match="not a shard index") as info:
        load(index)
    assert info.value.path == index


def test_shard_indexes_that_name_an_index_are_refused(tmp_path: Path) -> None:
    index = tmp_path / "model.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "model.index.json"}}))
    with pytest.raises(CheckpointError, match="itself a shard index"):
        load(index)
    from torchplace.checkpoint._catalog import describe_file as describe

    with pytest.raises(CheckpointError, match="itself a shard index"):
        describe(index)


def test_a_shard_spelt_two_ways_is_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchplace.checkpoint import _load as _checkpoint

    safetensors_torch().save_file(
        {"a": torch.ones(2), "b": torch.arange(3.0)}, tmp_path / "s1.safetensors"
    )
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "./s1.safetensors"}}))
    from torchplace.checkpoint._reader import OpenFiles

    reads: list[Path] = []
    real = OpenFiles.read

    def counting(files: OpenFiles, path: Path, *args: object, **kwargs: object) -> None:
        reads.append(Path(path))
        real(files, path, *args, **kwargs)

    monkeypatch.setattr(OpenFiles, "read", counting)
    out = _checkpoint.load(index)
    assert reads == [(tmp_path / "s1.safetensors").resolve()]
    assert torch.equal(out["a"], torch.ones(2)) and torch.equal(out["b"], torch.arange(3.0))


# ------------------------------------------------------------------------------------ damaged files


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        (b"", "is empty"),
        (b"\x93NUMPY\x01\x00v\x00", "NumPy"),
        (b"hello, this is text and not a checkpoint", "not a PyTorch or safetensors"),
        (pickle.dumps({"a": 1}, protocol=2), "not a torch.save file"),
        (b"PK\x03\x04" + bytes(100), "ckpt.pt"),
    ],
    ids=["missing", "empty", "numpy", "text", "plain-pickle", "broken-zip"],
)
def test_bad_files(tmp_path: Path, content: bytes | None, message: str) -> None:
    path = tmp_path / "ckpt.pt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(CheckpointError, match=message) as info:
        load(path)
    assert "ckpt.pt" in str(info.value)


def _safetensors_bytes(header: bytes, data: bytes = bytes(8)) -> bytes:
    return len(header).to_bytes(8, "little") + header + data


_DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b'{"a": ' + _DEEP + b"}", "RecursionError"),
        (b'{"a": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 4]}}', r"\[inf\]"),
        (b'{"a": {"dtype": "F32", "shape": "12", "data_offsets": [0, 4]}}', "'12'"),
        (b'{"a": {"dtype": "F32", "shape": [2.7], "data_offsets": [0, 8]}}', r"\[2\.7\]"),
        (b'{"a": {"dtype": "F32", "shape": [true, 2], "data_offsets": [0, 8]}}', "True"),
        (
            b'{"a": {"dtype": "F32", "shape": [0, 1180591620717411303424], '
            b'"data_offsets": [0, 0]}}',
            "non-negative integers",
        ),
        (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}}', "data_offsets"),
    ],
    ids=["deep", "infinite", "string", "float", "bool", "huge", "float-offset"],
)
def test_malformed_safetensors_headers(
    tmp_path: Path, header: bytes, message: str, device: str
) -> None:
    """Every header the safetensors library itself would refuse is a CheckpointError, on meta
    (where torchplace reads the header alone) as on the CPU."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(_safetensors_bytes(header))
    with pytest.raises(CheckpointError, match=message) as info:
        load(path, device)
    assert info.value.path == path


@pytest.mark.parametrize("dtype", [torch.uint16, torch.float8_e4m3fn])
def test_a_legacy_file_of_a_dtype_torch_cannot_read_back_is_not_called_corrupt(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    path = tmp_path / "old.pt"
    torch.save({"u": torch.ones(2).to(dtype)}, path, _use_new_zipfile_serialization=False)
    try:
        torch.load(path, weights_only=True)
    except AttributeError:
        pass  # the PyTorch limitation this is about
    else:
        pytest.skip(f"torch {torch.__version__} reads legacy {dtype} files back")
    with pytest.raises(CheckpointError, match=r"legacy-format file .* default zip format") as e:
        load(path)
    assert "corrupt" not in str(e.value) and e.value.path == path


def test_a_safetensors_file_cut_inside_its_header_is_called_so(tmp_path: Path) -> None:
    whole = tmp_path / "whole.safetensors"
    safetensors_torch().save_file({"a": torch.ones(100)}, whole)
    cut = tmp_path / "model.safetensors"
    cut.write_bytes(whole.read_bytes()[:60])
    cut_short = r"safetensors file cut short.*has 60; .*, or the save or download was"
    with pytest.raises(CheckpointError, match=cut_short):
        load(cut)


def test_a_torch_shard_cut_short_is_called_so_with_the_fix(tmp_path: Path) -> None:
    """A torch shard of an index cut short (no zip central directory) said only "BadZipFile:
    File is not a zip file"; it is now called truncated, with what to do, as a lone file is."""
    torch.save({"a": torch.ones(100)}, tmp_path / "s1.bin")
    torch.save({"b": torch.ones(100)}, tmp_path / "s2.bin")
    data = (tmp_path / "s2.bin").read_bytes()
    (tmp_path / "s2.bin").write_bytes(data[:-100])
    index = tmp_path / "pytorch_model.bin.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.bin", "b": "s2.bin"}}))
    cut = r"s2\.bin: is truncated \(its zip central directory is missing\); another process"
    for source in (index, tmp_path):
        with pytest.raises(CheckpointError, match=cut):
            load(source)


def test_a_deeply_nested_shard_index_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_bytes(b'{"weight_map": ' + _DEEP + b"}")
    with pytest.raises(CheckpointError, match="not a readable JSON shard index") as info:
        load(tmp_path / "model.safetensors.index.json")
    assert info.value.path == tmp_path / "model.safetensors.index.json"


@pytest.mark.parametrize("member", ["foo.txt", "archive/foo.txt"])
def test_a_zip_that_is_not_a_torch_file_is_named_as_such(tmp_path: Path, member: str) -> None:
    import zipfile

    path = tmp_path / "weights.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, "not weights")
    with pytest.raises(CheckpointError, match=r"a zip archive but not a torch\.save file") as e:
        load(path)
    assert e.value.path == path


def test_a_directory_of_several_checkpoints_is_refused_with_its_files_named(
    tmp_path: Path,
) -> None:
    safetensors_torch().save_file({"a": torch.ones(1)}, tmp_path / "a.safetensors")
    safetensors_torch().save_file({"a": torch.ones(1)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match=r"several checkpoints \(a\.safetensors, b\.saf"):
        load(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty: is a directory holding no checkpoint"):
        load(tmp_path / "empty")


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (RuntimeError("DefaultCPUAllocator: can't allocate memory"), "ran out of memory while"),
        (MemoryError(), "ran out of memory while"),
        (RuntimeError("CUDA error: unspecified launch failure"), "the device failing"),
    ],
    ids=["allocator", "memory-error", "device"],
)
def test_failures_that_are_not_the_files_fault_say_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception, message: str
) -> None:
    path = save({"w": torch.ones(2)}, tmp_path / "good.pt")

    def failing(*args: object, **kwargs: object) -> object:
        raise error

    import torchplace.checkpoint._load
    import torchplace.checkpoint._reader
    import torchplace.checkpoint._zip_read

    monkeypatch.setattr(torch, "load", failing)  # what reads legacy and unusual files
    monkeypatch.setattr(torchplace.checkpoint._reader.OpenFiles, "read", failing)  # safetensors
    monkeypatch.setattr(torchplace.checkpoint._zip_read, "read_into", failing)  # zip files
    safetensors_torch().save_file({"w": torch.ones(2)}, tmp_path / "good.safetensors")
    for p in (path, tmp_path / "good.safetensors"):
        with pytest.raises(CheckpointError, match=message) as info:
            load(p)
        assert p.name in str(info.value) and "truncated" not in str(info.value)
        assert info.value.path == p


def _fuzz_cases(data: bytes, seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    cases = [data[:n] for n in sorted({rng.randrange(1, len(data)) for _ in range(count)})]
    for _ in range(count):
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            flipped[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        cases.append(bytes(flipped))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["zip", "legacy", "safetensors"])
def test_fuzzed_files_load_or_raise_checkpoint_error(tmp_path: Path, fmt: str) -> None:
    sd = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(3, dtype=torch.int64)}
    src = tmp_path / "src"
    if fmt == "safetensors":
        safetensors_torch().save_file(sd, src)
    else:
        save(sd, src, legacy=fmt == "legacy")
    data = src.read_bytes()
    path = tmp_path / f"fuzzed.{fmt}"
    messages: list[str] = []
    for i, case in enumerate(_fuzz_cases(data, seed=len(data), count=40)):
        path.write_bytes(case)
        try:
            out = load(path, mmap=i % 2 == 0)
        except CheckpointError as exc:  # any other exception type fails the test
            messages.append(str(exc))
        else:
            assert isinstance(out, dict)
    assert messages, "some of the damaged files must be refused"
    assert all(str(path) in m for m in messages)


def test_one_registry_picks_the_reader_by_format_and_device_type() -> None:
    from torchplace.checkpoint import _load

    formats = ("index", "legacy", "safetensors", "zip")
    assert set(_load.READERS) == {(k, d) for k in formats for d in _load.DEVICE_TYPES}
    assert _load.reader_for("safetensors", torch.device("meta")) is _load._safetensors_on_meta
    assert _load.reader_for("zip", torch.device("cuda", 1)) is _load.READERS["zip", "cuda"]
    assert _load.reader_for("zip", torch.device("mps")) is _load.READERS["zip", "other"]
    with pytest.raises(CheckpointError, match=r"no reader reads a 'npz' checkpoint onto cpu"):
        _load.reader_for("npz", torch.device("cpu"))


def test_an_index_in_the_hugging_face_cache_layout_loads(tmp_path: Path) -> None:
    """The Hugging Face cache links each file of a snapshot to ../../blobs/<hash>: a shard is
    named inside the index's directory and leads outside it, which is the cache's choice. It
    was refused as "outside its own directory"; a name spelt outside it still is."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    sd = {"a.weight": torch.arange(4.0), "b.weight": torch.ones(2, 2)}
    for name, tensor in sd.items():
        safetensors_torch().save_file({name: tensor}, str(blobs / name))
        (snapshot / f"{name}.safetensors").symlink_to(f"../../blobs/{name}")
    index = {"weight_map": {name: f"{name}.safetensors" for name in sd}}
    (blobs / "index").write_text(json.dumps(index))
    (snapshot / "model.safetensors.index.json").symlink_to("../../blobs/index")
    out = load(snapshot)
    assert out.keys() == sd.keys() and all(torch.equal(out[k], sd[k]) for k in sd)
    (blobs / "index").write_text(json.dumps({"weight_map": {"a.weight": "../../blobs/a.weight"}}))
    with pytest.raises(CheckpointError, match="outside its own directory"):
        load(snapshot / "model.safetensors.index.json")


def test_a_shard_linked_to_nothing_is_named_as_a_link(tmp_path: Path) -> None:
    """An unfinished download leaves the cache's link to a blob that is not there: the file is
    listed beside the index, so "missing" alone puzzled a new-user trial."""
    (tmp_path / "s.safetensors").symlink_to("../blobs/0123abcd")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "s.safetensors"}}))
    with pytest.raises(
        CheckpointError, match=r"a link to nothing: 's\.safetensors' -> '\.\./blobs/0123abcd'"
    ):
        load(index)
