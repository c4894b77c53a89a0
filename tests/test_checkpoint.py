"""load, skeleton and load_into: formats, devices, safety, ties, strictness and optimizers."""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import re
import sys
import threading
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchplace
from torchplace._errors import CheckpointError, TorchplaceError
from torchplace.checkpoint._checkpoint import load, load_into, skeleton


def safetensors_torch() -> Any:
    """safetensors' writer, for the tests that make such files: only they skip without it."""
    return pytest.importorskip("safetensors.torch")


# ------------------------------------------------------------------------------------- helpers


class Net(nn.Module):
    """Tied embedding and head, a persistent and a non-persistent buffer."""

    def __init__(self, d: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((d,), 0.5))
        self.register_buffer("mask", torch.ones(4, 4).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)) * self.scale)


X = torch.tensor([[1, 2, 3, 4]])


def reference() -> Net:
    torch.manual_seed(0)
    return Net()


def save(obj: object, path: Path, *, legacy: bool = False) -> Path:
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    return path


@pytest.fixture
def saved_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch.save tag every storage "cuda:0", as a file saved on a GPU is."""
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")


def _maps_file(t: torch.Tensor, path: Path) -> bool:
    """Whether the tensor's memory lies in a mapping of ``path`` (Linux)."""
    ptr = t.untyped_storage().data_ptr()
    target = str(path.resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].strip() == target:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


# ---------------------------------------------------------------------------------------- load


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
    with pytest.raises(CheckpointError, match=r"state\.pkl: is a plain pickle"):
        load(path)


def test_refusals_name_what_was_blocked(tmp_path: Path) -> None:
    class System:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    path = save({"x": System()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"GLOBAL (posix|nt)\.system"):
        load(path)


def test_legacy_files_of_newer_pickle_protocols_are_explained(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(1)}, path, _use_new_zipfile_serialization=False, pickle_protocol=4)
    with pytest.raises(CheckpointError, match=r"Re-save it with torch\.save's default protocol"):
        load(path)
    assert torch.equal(load(path, trusted=True)["w"], torch.ones(1))


def test_trusted_loads_other_objects(tmp_path: Path) -> None:
    path = save({"args": argparse.Namespace(lr=0.5)}, tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match="trusted=True"):
        load(path)
    assert load(path, trusted=True)["args"].lr == 0.5


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
    with pytest.raises(CheckpointError, match=r"pip install safetensors"):
        load(path, mmap=True)  # mapping goes through the library
    assert torch.equal(load(path)["a"], torch.ones(2))  # reading needs no library


def _write_shards(root: Path, sd: dict[str, torch.Tensor], *, torch_shards: bool = False) -> Path:
    names = sorted(sd)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-0000{i + 1}-of-00002." + ("bin" if torch_shards else "safetensors")
        chunk = {k: sd[k].contiguous() for k in part}
        if torch_shards:
            torch.save(chunk, root / shard)
        else:
            safetensors_torch().save_file(chunk, root / shard)
        weight_map.update(dict.fromkeys(part, shard))
    index = root / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("torch_shards", [False, True], ids=["safetensors", "bin"])
def test_load_sharded_index(tmp_path: Path, torch_shards: bool) -> None:
    sd = {f"layer{i}.weight": torch.full((2,), float(i)) for i in range(5)}
    index = _write_shards(tmp_path, sd, torch_shards=torch_shards)
    out = load(index)
    assert out.keys() == sd.keys() and all(torch.equal(out[k], sd[k]) for k in sd)


def test_sharded_index_problems(tmp_path: Path) -> None:
    sd = {f"layer{i}.weight": torch.ones(2) for i in range(4)}
    index = _write_shards(tmp_path, sd)
    data = json.loads(index.read_text())
    data["weight_map"]["ghost.weight"] = data["weight_map"]["layer0.weight"]
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"ghost\.weight"):
        load(index)
    data["weight_map"] = {"a": "../elsewhere.safetensors"}
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="outside its own directory"):
        load(index)
    data["weight_map"] = {"a": "absent.safetensors"}
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"absent\.safetensors"):
        load(index)
    index.write_text('{"not": "an index"}')
    with pytest.raises(CheckpointError, match="not a shard index"):
        load(index)


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
    with pytest.raises(CheckpointError, match=message):
        load(path, device)


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
    assert "corrupt" not in str(e.value)


def test_a_safetensors_file_cut_inside_its_header_is_called_so(tmp_path: Path) -> None:
    whole = tmp_path / "whole.safetensors"
    safetensors_torch().save_file({"a": torch.ones(100)}, whole)
    cut = tmp_path / "model.safetensors"
    cut.write_bytes(whole.read_bytes()[:60])
    cut_short = r"safetensors file cut short.*has 60; .*, or the save or download was"
    with pytest.raises(CheckpointError, match=cut_short):
        load(cut)


def test_a_deeply_nested_shard_index_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_bytes(b'{"weight_map": ' + _DEEP + b"}")
    with pytest.raises(CheckpointError, match="not a readable JSON shard index"):
        load(tmp_path / "model.safetensors.index.json")


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

    monkeypatch.setattr(torch, "load", failing)  # what reads legacy and unusual files
    monkeypatch.setattr(torchplace.checkpoint._load, "read_into", failing)  # safetensors
    monkeypatch.setattr(torchplace.checkpoint._reader, "read_into", failing)  # zip files
    safetensors_torch().save_file({"w": torch.ones(2)}, tmp_path / "good.safetensors")
    for p in (path, tmp_path / "good.safetensors"):
        with pytest.raises(CheckpointError, match=message) as info:
            load(p)
        assert p.name in str(info.value) and "truncated" not in str(info.value)


def _fuzz_cases(data: bytes, seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    cases = [data[:n] for n in sorted({rng.randrange(1, len(data)) for _ in range(count)})]
    for _ in range(count):
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            flipped[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        cases.append(bytes(flipped))
    return cases


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


# ------------------------------------------------------------------------------------ skeleton


def test_skeleton_parameters_meta_buffers_real() -> None:
    model = skeleton(Net)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.head.weight is model.emb.weight
    assert model.mask.device.type == "cpu" and torch.equal(model.mask, torch.ones(4, 4).tril())
    assert torch.equal(model.scale, torch.full((8,), 0.5))


def test_skeleton_does_no_random_init() -> None:
    # the modules built inside the factory draw no random numbers: no init runs
    state = torch.random.get_rng_state()
    skeleton(lambda: nn.Sequential(nn.Linear(64, 64), nn.Embedding(10, 64), nn.Conv2d(3, 8, 3)))
    assert torch.equal(torch.random.get_rng_state(), state)


def test_skeleton_leaves_existing_parameters_alone() -> None:
    existing = nn.Linear(3, 3)
    before = existing.weight.detach().clone()
    model = skeleton(lambda: nn.Sequential(existing, nn.Linear(3, 2)))
    assert existing.weight.device.type == "cpu" and torch.equal(existing.weight, before)
    assert model[1].weight.device.type == "meta"


class _Untouched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(3))  # no torch call touches it afterwards
        self.beta = self.alpha


def test_skeleton_sweeps_untouched_parameters_and_keeps_ties() -> None:
    model = skeleton(_Untouched)
    assert model.alpha.device.type == "meta" and model.alpha is model.beta


class _SetsData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a_log = nn.Parameter(torch.empty(4))
        self.tied = self.a_log
        # as Bamba's _init_weights does under transformers 4.x
        self.a_log.data = torch.log(torch.arange(1, 6, dtype=torch.float64))


def test_skeleton_takes_values_set_through_data_on_meta() -> None:
    """A parameter's ``.data`` set to a real tensor inside the factory: the parameter (sent to
    meta as soon as a torch call touched it) takes the new shape and dtype on meta, not torch's
    RuntimeError about incompatible tensor types."""
    model = skeleton(_SetsData)
    assert model.a_log.device.type == "meta" and model.a_log is model.tied
    assert model.a_log.shape == (5,) and model.a_log.dtype == torch.float64


def test_skeleton_patches_nothing_other_threads_see() -> None:
    originals = (nn.Module.register_parameter, nn.Module.__setattr__, nn.Parameter.__new__)
    inside = threading.Event()
    built = threading.Event()
    seen: dict[str, object] = {}

    def factory() -> nn.Module:
        inside.set()
        assert built.wait(10)
        return nn.Linear(2, 2)

    def other_thread() -> None:
        assert inside.wait(10)
        seen["patched"] = (
            nn.Module.register_parameter,
            nn.Module.__setattr__,
            nn.Parameter.__new__,
        ) != originals
        seen["device"] = nn.Linear(2, 2).weight.device.type
        built.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    model = skeleton(factory)
    thread.join()
    assert seen == {"patched": False, "device": "cpu"}
    assert model.weight.device.type == "meta"


def test_skeleton_needs_a_module() -> None:
    with pytest.raises(TorchplaceError, match=r"nn\.Module"):
        skeleton(lambda: 3)
    with pytest.raises(TorchplaceError, match=r"load_into\(\) fills an nn\.Module"):
        load_into({"w": torch.ones(1)}, "unused.pt")  # type: ignore[type-var]


# ----------------------------------------------------------------------------------- load_into


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """Net's weights, saved with the head omitted as Hugging Face saves a tied head."""
    sd = reference().state_dict()
    del sd["head.weight"]
    return save(sd, tmp_path / "net.pt")


def test_load_into_skeleton_round_trip(ckpt: Path) -> None:
    model = load_into(skeleton(Net), ckpt)
    assert model.head.weight is model.emb.weight
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert all(p.requires_grad for p in model.parameters())
    assert torch.equal(model(X), reference()(X))
    assert torch.equal(model.mask, torch.ones(4, 4).tril())


def test_tied_weight_saved_under_either_name(tmp_path: Path) -> None:
    sd = reference().state_dict()
    del sd["emb.weight"]  # only the head's name this time
    model = load_into(skeleton(Net), save(sd, tmp_path / "head.pt"))
    assert model.head.weight is model.emb.weight
    assert torch.equal(model(X), reference()(X))


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_load_into_maps_the_file_without_copying(ckpt: Path, fmt: str) -> None:
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps (Linux)")
    if fmt == "safetensors":
        sd = {k: v.contiguous() for k, v in load(ckpt).items()}
        ckpt = ckpt.with_suffix(".safetensors")
        safetensors_torch().save_file(sd, ckpt)
    assert not _maps_file(load_into(skeleton(Net), ckpt).body[0].weight, ckpt)  # by default
    model = load_into(skeleton(Net), ckpt, mmap=True)
    assert _maps_file(model.body[0].weight, ckpt)
    before = ckpt.read_bytes()
    with torch.no_grad():
        model.body[0].weight.add_(1.0)  # copy-on-write: the file does not change
    assert ckpt.read_bytes() == before


def test_load_into_safetensors_and_index(tmp_path: Path) -> None:
    sd = {k: v.contiguous() for k, v in reference().state_dict().items() if k != "head.weight"}
    safetensors_torch().save_file(sd, tmp_path / "net.safetensors")
    model = load_into(skeleton(Net), tmp_path / "net.safetensors")
    assert torch.equal(model(X), reference()(X))
    shards = tmp_path / "sharded"
    shards.mkdir()
    model = load_into(skeleton(Net), _write_shards(shards, sd))
    assert torch.equal(model(X), reference()(X)) and model.head.weight is model.emb.weight


def test_load_into_keeps_declared_dtypes(tmp_path: Path) -> None:
    sd = {k: v.half() for k, v in reference().state_dict().items()}
    model = load_into(skeleton(Net), save(sd, tmp_path / "half.pt"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    half = load_into(skeleton(Net).half(), save(reference().state_dict(), tmp_path / "f.pt"))
    assert {p.dtype for p in half.parameters()} == {torch.float16}


def test_load_into_real_model_keeps_parameter_objects(ckpt: Path) -> None:
    torch.manual_seed(1)
    model = Net()
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    load_into(model, ckpt)
    assert list(model.parameters()) == params and opt.param_groups[0]["params"] == params
    assert torch.equal(model(X), reference()(X))


DISCARDED_MASK = r"load_into to meta discarded the values of 1 non-persistent buffer\(s\) \(mask\)"


def test_load_into_meta_device_checks_shapes_only(ckpt: Path) -> None:
    with pytest.warns(UserWarning, match=DISCARDED_MASK):
        model = load_into(skeleton(Net), ckpt, "meta")
    assert model.emb.weight.device.type == "meta"


def test_non_strict_names_every_tensor_it_leaves_on_meta(tmp_path: Path) -> None:
    sd = reference().state_dict()
    del sd["body.0.bias"], sd["body.1.weight"], sd["body.1.bias"]
    path = save(sd, tmp_path / "partial.pt")
    with pytest.warns(UserWarning, match="on meta") as caught:
        model = load_into(skeleton(Net), path, strict=False)
    (warning,) = caught
    text = str(warning.message)
    assert warning.filename == __file__  # pointed at the caller's line
    assert text.startswith(
        "torchplace.load_into left 3 tensor(s) of Net on meta, where they hold no values: "
        f"body.0.bias, body.1.weight, body.1.bias. {path} has no key for them (strict=False "
    )
    assert "computes garbage" in text
    # body.0 keeps its loaded weight: no to_empty of it, which would wipe that, is offered
    assert text.endswith("load them from a file that holds them, or initialise them")
    assert [n for n, t in model.state_dict().items() if t.is_meta] == [
        "body.0.bias", "body.1.weight", "body.1.bias"
    ]  # fmt: skip


def test_a_full_load_and_a_load_onto_meta_leave_nothing_to_say(ckpt: Path) -> None:
    load_into(skeleton(Net), ckpt)  # warnings are errors here
    load_into(reference(), ckpt, strict=False)  # a real model keeps its own values


def test_a_fresh_initialisation_is_offered_when_a_whole_module_is_left(tmp_path: Path) -> None:
    sd = reference().state_dict()
    del sd["body.1.weight"], sd["body.1.bias"]
    path = save(sd, tmp_path / "partial.pt")
    with pytest.warns(UserWarning, match=r"on meta") as caught:
        model = load_into(skeleton(Net), path, strict=False)
    fix = "model.get_submodule('body.1')"
    assert str(caught[0].message).endswith(
        f"or initialise them, e.g. {fix}.to_empty(device='cpu') then {fix}.reset_parameters()"
    )
    model.get_submodule("body.1").to_empty(device="cpu")  # the fix, as given
    model.get_submodule("body.1").reset_parameters()
    torchplace.verify(model, "cpu")
    assert torch.equal(model.body[1].weight, torch.ones(8))
    assert torch.equal(model.body[0].weight, reference().body[0].weight)  # the loaded one kept


@pytest.mark.parametrize("strict", [True, False])
def test_a_meta_value_is_refused_before_anything_is_written(strict: bool) -> None:
    model = reference()
    params = dict(model.named_parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: torch.full_like(v, 7.0) for k, v in model.state_dict().items()}
    state["body.1.bias"] = torch.empty(8, device="meta")  # the last key: three come before it
    with pytest.raises(CheckpointError) as info:
        load_into(model, state, strict=strict)
    assert str(info.value).startswith(
        "the state dict given to load_into: does not fit Net: tensors on meta, which hold no "
        "values to load: body.1.bias (the state dict came from a model on meta"
    )
    assert "partly filled" not in str(info.value)
    for name, p in model.named_parameters():
        assert p is params[name]
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name  # untouched, bit for bit
    skel = skeleton(Net)
    with pytest.raises(CheckpointError, match=r"tensors on meta, .*: body\.1\.bias"):
        load_into(skel, state, strict=strict)
    assert skel.emb.weight.is_meta


def test_meta_values_load_onto_meta(recwarn: pytest.WarningsRecorder) -> None:
    state = {k: torch.empty_like(v, device="meta") for k, v in reference().state_dict().items()}
    model = load_into(skeleton(Net), state, "meta")  # shapes only: nothing to refuse
    assert model.emb.weight.is_meta
    assert [str(w.message).split(" (")[0] for w in recwarn] == [
        "torchplace.load_into to meta discarded the values of 1 non-persistent buffer(s)"
    ]


def test_a_load_onto_meta_warns_as_move_does_and_the_next_load_says_why(ckpt: Path) -> None:
    with pytest.warns(UserWarning, match="discarded") as moved:
        torchplace.move(reference(), "meta")
    model = skeleton(Net)
    with pytest.warns(UserWarning, match="discarded") as loaded:
        load_into(model, ckpt, "meta")
    (by_move,), (by_load,) = moved, loaded
    assert str(by_load.message) == str(by_move.message).replace(
        "torchplace.move to meta", "torchplace.load_into to meta"
    )
    assert "non-persistent buffer(s) (mask)" in str(by_load.message)
    assert by_load.filename == __file__
    with pytest.raises(CheckpointError) as info:
        load_into(model, ckpt, "cpu")
    text = str(info.value)
    assert "mask (their values were lost when they went to meta, by a move or a load onto " in text
    assert f"then torchplace.load_into(model, {str(ckpt)!r}, 'cpu'))" in text


def test_a_warning_turned_error_leaves_the_skeleton_as_it_was(tmp_path: Path) -> None:
    sd = reference().state_dict()
    del sd["body.0.bias"]
    path = save(sd, tmp_path / "partial.pt")
    model = skeleton(Net)
    params = dict(model.named_parameters())
    with pytest.raises(UserWarning, match="left 1 tensor"):  # warnings are errors here
        load_into(model, path, strict=False)
    assert all(p.is_meta for p in model.parameters())  # all or nothing, the warning included
    assert dict(model.named_parameters()) == params


def test_strict_lists_missing_unexpected_and_mismatched(tmp_path: Path) -> None:
    sd = reference().state_dict()
    del sd["body.0.bias"]
    sd["extra.weight"] = torch.ones(1)
    sd["body.1.weight"] = torch.ones(3)
    path = save(sd, tmp_path / "bad.pt")
    model = skeleton(Net)
    with pytest.raises(CheckpointError) as info:
        load_into(model, path)
    text = str(info.value)
    for needle in ("bad.pt", "missing keys: body.0.bias", "unexpected keys: extra.weight"):
        assert needle in text
    assert "body.1.weight: file (3,), model (8,)" in text
    assert model.emb.weight.device.type == "meta"  # nothing was filled


def test_non_strict_loads_what_matches(tmp_path: Path) -> None:
    sd = reference().state_dict()
    del sd["body.0.bias"]
    sd["extra.weight"] = torch.ones(1)
    with pytest.raises(CheckpointError, match="pass strict=False to load what matches"):
        load_into(skeleton(Net), save(sd, tmp_path / "partial.pt"))
    with pytest.warns(UserWarning, match=r"left 1 tensor\(s\) of Net on meta.*: body\.0\.bias\."):
        model = load_into(skeleton(Net), save(sd, tmp_path / "partial.pt"), strict=False)
    assert model.emb.weight.device.type == "cpu" and model.body[0].bias.device.type == "meta"
    sd["body.1.weight"] = torch.ones(3)
    with pytest.raises(CheckpointError, match="shape mismatches"):
        load_into(skeleton(Net), save(sd, tmp_path / "partial.pt"), strict=False)


def test_prefixed_keys_get_a_hint_that_works(tmp_path: Path) -> None:
    class Tied(nn.Module):  # the tied weight comes first, as in a language model
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 4, bias=False)
            self.emb = nn.Embedding(4, 4)
            self.emb.weight = self.head.weight

    src = Tied()
    path = save({f"module.{k}": v for k, v in src.state_dict().items()}, tmp_path / "ddp.pt")
    with pytest.raises(CheckpointError, match=r"extra prefix 'module\.': drop it") as e:
        load_into(skeleton(Tied), path)
    assert "strict=False" not in str(e.value)  # which would load nothing
    model = skeleton(Tied)
    with pytest.raises(CheckpointError, match=r"strict=False would load nothing.*'module\.'"):
        load_into(model, path, strict=False)
    assert model.head.weight.is_meta
    # the hint, followed word for word
    hint = str(e.value).split(f"torchplace.load_into(model, {str(path)!r}, ")[1].split(")")[0]
    assert hint == 'rename={r"^module\\.": ""}'
    model = load_into(skeleton(Tied), path, rename={r"^module\.": ""})
    assert torch.equal(model.head.weight, src.head.weight) and model.emb.weight is model.head.weight


def test_keys_that_merely_end_alike_get_no_prefix_hint(tmp_path: Path) -> None:
    path = save(reference().state_dict(), tmp_path / "net.pt")  # emb.weight, body.0.weight, ...
    with pytest.raises(CheckpointError, match="does not fit Linear") as info:
        load_into(nn.Linear(8, 8), path)
    assert "prefix" not in str(info.value)


@pytest.mark.parametrize(
    ("wrong", "right", "rename"),
    [
        ("bdoy", "body", {r"^bdoy\.": "body."}),  # a transposed letter, first part
        ("wieght", "weight", {r"\.wieght$": ".weight"}),  # last part, every key alike
    ],
    ids=["first-part", "last-part"],
)
def test_misspelt_keys_get_the_rename_that_fits_them(
    tmp_path: Path, wrong: str, right: str, rename: dict[str, str]
) -> None:
    src = reference()
    sd = {
        ".".join(wrong if p == right else p for p in k.split(".")): v
        for k, v in src.state_dict().items()
    }
    path = save(sd, tmp_path / "typo.pt")
    with pytest.raises(
        CheckpointError, match=f"spell '{wrong}' where the model has '{right}'"
    ) as e:
        load_into(skeleton(Net), path)
    # the hint, followed word for word
    hint = str(e.value).split(f"torchplace.load_into(model, {str(path)!r}, ")[1].split(")")[0]
    ((pattern, replacement),) = rename.items()
    assert hint == f'rename={{r"{pattern}": "{replacement}"}}'
    model = load_into(skeleton(Net), path, rename=rename)
    for name, value in src.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_misspelt_key_in_a_state_dict_is_named_beside_the_models(tmp_path: Path) -> None:
    sd = dict(reference().state_dict())
    sd["bdoy.0.weight"] = sd.pop("body.0.weight")  # one key alone: the rename fits it too
    sd["body.1.bais"] = sd.pop("body.1.bias")  # and another, misspelt elsewhere
    with pytest.raises(CheckpointError, match="look misspelt") as e:
        load_into(skeleton(Net), sd)
    assert "bdoy.0.weight for body.0.weight" in str(e.value)
    assert "body.1.bais for body.1.bias" in str(e.value)
    assert e.value.missing == ("body.0.weight", "body.1.bias")  # the data as before


def test_a_wrappers_prefix_is_named_even_when_the_names_under_it_differ() -> None:
    """torch.compile's ``_orig_mod.`` on every key, over names that are not the model's (another
    version of it): the prefix is the first thing to drop, and the error says which wrapper
    added it; a model that has a part of that name gets no such hint."""
    model = nn.Sequential(nn.Linear(2, 2))
    state = {"_orig_mod.layer.weight": torch.ones(2, 2), "_orig_mod.layer.bias": torch.ones(2)}
    with pytest.raises(CheckpointError, match=r"torch\.compile adds") as e:
        load_into(model, state)
    assert 'rename={r"^_orig_mod\\.": ""}' in str(e.value), str(e.value)

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._orig_mod = nn.Linear(2, 2)

    with pytest.raises(CheckpointError) as e:
        load_into(Wrapped(), state)
    assert "torch.compile adds" not in str(e.value), str(e.value)


def test_a_rename_is_suggested_only_where_the_shapes_fit(tmp_path: Path) -> None:
    """A file of ``encoder.*`` (8, 4) against a model's ``decoder`` (3, 2) was told to rename
    encoder to decoder, which only moved the error to a shape mismatch; the same keys with the
    model's shapes still get the rename, which loads."""

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = nn.Linear(2, 3)

    other = {"encoder.weight": torch.ones(8, 4), "encoder.bias": torch.ones(8)}
    with pytest.raises(CheckpointError, match=r"unexpected keys: encoder\.weight") as e:
        load_into(Decoder(), other)
    assert "rename" not in str(e.value) and "misspelt" not in str(e.value), str(e.value)
    fitting = {"encoder.weight": torch.ones(3, 2), "encoder.bias": torch.ones(3)}
    with pytest.raises(CheckpointError, match=r'rename=\{r"\^encoder\\\.": "decoder\."\}'):
        load_into(Decoder(), fitting)
    model = load_into(Decoder(), fitting, rename={r"^encoder\.": "decoder."})  # as given
    assert torch.equal(model.decoder.weight, torch.ones(3, 2))


def test_another_depth_or_another_model_is_no_typo(tmp_path: Path) -> None:
    """Keys that differ only by a number (a deeper model's layers) or merely look alike as a
    whole (conv.weight, norm.weight) are not called misspelt."""
    deeper = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"unexpected keys: 2\.weight, 2\.bias") as e:
        load_into(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), deeper.state_dict())
    assert "misspelt" not in str(e.value) and "spell" not in str(e.value)

    class Conv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Linear(2, 2)

    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.Linear(2, 2)

    with pytest.raises(CheckpointError, match=r"unexpected keys: conv\.weight") as e:
        load_into(Norm(), Conv().state_dict())
    assert "misspelt" not in str(e.value) and "spell" not in str(e.value)


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


def test_a_file_of_one_part_of_the_model_gets_a_hint_that_works(tmp_path: Path) -> None:
    path = save(reference().body.state_dict(), tmp_path / "body.pt")
    with pytest.raises(CheckpointError, match=r"prefix 'body\.'.*get_submodule\('body'\)"):
        load_into(reference(), path)
    model = reference()
    load_into(model.get_submodule("body"), path)


@pytest.mark.parametrize(
    ("source", "shown"),
    [(123, "int (123)"), (None, "NoneType (None)"), ([1.0], "list ([1.0])")],
    ids=["int", "none", "list"],
)
def test_load_into_says_every_kind_of_source_it_reads(
    source: Any, shown: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"not {re.escape(shown)}: a path") as e:
        load_into(model, source)
    for accepted in ("checkpoint file", "shard index", "directory", "mapping of names to tensors"):
        assert accepted in str(e.value)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    # both examples, typed as written, work (given such a file, and such a model)
    assert str(e.value).endswith(
        "e.g. torchplace.load_into(model, 'model.safetensors') or "
        "torchplace.load_into(model, other.state_dict())"
    )
    other = nn.Linear(3, 2)
    monkeypatch.chdir(tmp_path)
    safetensors_torch().save_file(other.state_dict(), "model.safetensors")
    assert torch.equal(load_into(model, "model.safetensors").weight, other.weight)
    other = nn.Linear(3, 2)
    assert torch.equal(load_into(model, other.state_dict()).weight, other.weight)


def test_load_into_of_an_open_file_says_how_to_read_it(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    torch.save(reference().state_dict(), buffer)
    buffer.seek(0)
    f = buffer
    with pytest.raises(CheckpointError, match=r"not an open file \(BytesIO\)") as e:
        load_into(skeleton(Net), f)
    fix = str(e.value).rsplit(", torchplace.load_into(", 1)[1]
    assert fix == "model, torch.load(f, weights_only=True))"
    model = load_into(skeleton(Net), torch.load(f, weights_only=True))  # the fix, as written
    assert torch.equal(model.emb.weight, reference().emb.weight)


def test_whole_training_checkpoint_gets_a_hint(tmp_path: Path) -> None:
    path = save({"model": reference().state_dict(), "epoch": 3}, tmp_path / "all.pt")
    with pytest.raises(
        CheckpointError, match=r"not a state dict.*load\('.*all\.pt'\)\['model'\]\)$"
    ):
        load_into(skeleton(Net), path)
    model = load_into(skeleton(Net), load(path)["model"])  # the hint, followed
    assert torch.equal(model.emb.weight, reference().emb.weight)


def test_meta_model_loses_non_persistent_buffers(ckpt: Path) -> None:
    with torch.device("meta"):
        model = Net()
    with pytest.raises(CheckpointError, match=r"mask.*torchplace.skeleton"):
        load_into(model, ckpt)


class _WithExtra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.note = "unset"

    def get_extra_state(self) -> str:
        return self.note

    def set_extra_state(self, state: object) -> None:
        self.note = str(state)


def test_extra_state_round_trip(tmp_path: Path) -> None:
    src = _WithExtra()
    src.note = "v2"
    model = load_into(skeleton(_WithExtra), save(src.state_dict(), tmp_path / "x.pt"))
    assert model.note == "v2" and torch.equal(model.lin.weight, src.lin.weight)


class _Picky(nn.Module):
    """Two modules with extra state; the second refuses any state but "ok"."""

    def __init__(self) -> None:
        super().__init__()
        self.first = _WithExtra()
        self.second = _WithExtra()
        self.second.set_extra_state = self._refuse  # type: ignore[method-assign]

    def _refuse(self, state: object) -> None:
        if state != "ok":
            raise ValueError(f"version {state!r} is not supported")
        self.second.note = "ok"


def test_a_refused_extra_state_leaves_the_model_untouched(tmp_path: Path) -> None:
    src = _Picky()
    src.first.note, src.second.note = "new", "v9"
    path = save(src.state_dict(), tmp_path / "x.pt")
    model = _Picky()
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(CheckpointError, match=r"second\._extra_state.*v9.*untouched"):
        load_into(model, path)
    assert model.first.note == "unset"  # set, then put back
    after = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_load_into_gives_the_model_its_own_layout(tmp_path: Path) -> None:
    """A weight saved as a transposed view loads contiguous, as load_state_dict's copy does."""
    src = nn.Linear(3, 2)
    state = {"weight": src.weight.detach().t().contiguous().t(), "bias": src.bias.detach()}
    assert not state["weight"].is_contiguous()
    path = save(state, tmp_path / "t.pt")
    for model in (load_into(nn.Linear(3, 2), path), load_into(skeleton(nn.Linear, 3, 2), path)):
        assert model.weight.is_contiguous()
        assert torch.equal(model.weight.view(-1), src.weight.detach().reshape(-1))


def test_load_into_keeps_a_channels_last_model_channels_last(tmp_path: Path) -> None:
    src = nn.Conv2d(3, 4, 3)
    path = save(src.state_dict(), tmp_path / "conv.pt")  # saved contiguous
    built = skeleton(nn.Conv2d, 3, 4, 3).to(memory_format=torch.channels_last)
    model = load_into(built, path)  # swaps new tensors in (a skeleton holds no memory)
    assert model.weight.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(model.weight, src.weight)


def test_load_into_bad_file_names_it(tmp_path: Path) -> None:
    path = tmp_path / "nothing.pt"
    with pytest.raises(CheckpointError, match=r"nothing\.pt"):
        load_into(skeleton(Net), path)


@pytest.mark.requires_cuda
def test_load_into_cuda(ckpt: Path) -> None:
    model = load_into(skeleton(Net), ckpt, "cuda")
    assert {t.device for t in [*model.parameters(), *model.buffers()]} == {torch.device("cuda:0")}
    assert model.head.weight is model.emb.weight
    assert torch.allclose(model(X.cuda()).cpu(), reference()(X), atol=1e-5)


# --------------------------------------------------------------------- a real third-party model


def _tiny_transformer(kind: str) -> tuple[type[nn.Module], object]:
    """A Hugging Face model class and a tiny config for it, built here (no download)."""
    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel, config
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM, config


@pytest.mark.parametrize(
    ("kind", "shard"),
    [("llama", False), ("llama", True), ("gpt2", False)],
    ids=["llama", "llama-sharded", "gpt2"],
)
def test_transformers_model_round_trip(tmp_path: Path, kind: str, shard: bool) -> None:
    cls, config = _tiny_transformer(kind)
    torch.manual_seed(0)
    ref = cls(config).eval()
    ref.save_pretrained(tmp_path, max_shard_size="20KB" if shard else "5GB")
    files = sorted(p.name for p in tmp_path.iterdir())
    path = tmp_path / ("model.safetensors.index.json" if shard else "model.safetensors")
    assert path.name in files

    model = load_into(skeleton(cls, config), path).eval()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    if kind == "llama":  # the rotary frequencies: a non-persistent buffer, kept
        assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


# ------------------------------------------------------------------ resuming an optimizer


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(X).square().mean().backward()
        opt.step()


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resume_optimizer_saved_on_gpu(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make = OPTIMIZERS[name]
    model = reference()
    opt = make(model.parameters())
    _train(model, opt, 3)
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    weights = save(model.state_dict(), tmp_path / "model.pt")
    state = save(opt.state_dict(), tmp_path / "optim.pt")
    monkeypatch.undo()

    resumed = load_into(skeleton(Net), weights)
    new_opt = make(resumed.parameters())
    new_opt.load_state_dict(load(state))
    for group in new_opt.param_groups:
        for p in group["params"]:
            for key, value in new_opt.state[p].items():
                if not isinstance(value, torch.Tensor):
                    continue
                on_param = key != "step" or group.get("fused") or group.get("capturable")
                assert value.device == (p.device if on_param else torch.device("cpu")), key

    _train(model, opt, 2)
    _train(resumed, new_opt, 2)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_optimizer_state_read_onto_the_device_keeps_step_there(tmp_path: Path) -> None:
    # why the recipe reads optimizer state onto the CPU: PyTorch leaves a plain group's step
    # where it was loaded, and a non-capturable Adam rejects a step on an accelerator
    model = reference()
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 1)
    path = save(opt.state_dict(), tmp_path / "optim.pt")
    with pytest.warns(UserWarning, match=DISCARDED_MASK):
        target = load_into(skeleton(Net), _weights(model, tmp_path), "meta")
    for read_on, step_on in (("meta", "meta"), ("cpu", "cpu")):
        new_opt = torch.optim.Adam(target.parameters())
        new_opt.load_state_dict(load(path, read_on))
        assert new_opt.state[target.emb.weight]["step"].device.type == step_on


def test_resume_restores_saved_hyperparameters(tmp_path: Path) -> None:
    # PyTorch takes lr, fused and capturable from the file, not from the new optimizer
    model = reference()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, opt, 1)
    state = save(opt.state_dict(), tmp_path / "optim.pt")
    new_opt = torch.optim.Adam(load_into(skeleton(Net), _weights(model, tmp_path)).parameters())
    new_opt.load_state_dict(load(state))
    assert new_opt.param_groups[0]["lr"] == 1e-3 and not new_opt.param_groups[0]["capturable"]


@pytest.mark.parametrize(
    ("flag", "device", "step_on"),
    [("plain", "meta", "cpu"), ("capturable", "meta", "meta"), ("fused", "cpu", "cpu")],
)
def test_resumed_step_follows_pytorchs_policy(
    tmp_path: Path, flag: str, device: str, step_on: str
) -> None:
    # meta stands in for "another device": step stays on the CPU unless capturable or fused
    model = reference()
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 1)
    path = save(opt.state_dict(), tmp_path / "optim.pt")
    with pytest.warns(UserWarning, match=DISCARDED_MASK) if device == "meta" else nullcontext():
        target = load_into(skeleton(Net), _weights(model, tmp_path), device)
    kwargs = {} if flag == "plain" else {flag: True}
    new_opt = torch.optim.Adam(target.parameters(), **kwargs)
    state = load(path)
    for group in state["param_groups"]:  # switch the group's flags before loading
        group.update(kwargs)
    new_opt.load_state_dict(state)
    p = target.emb.weight
    assert new_opt.state[p]["step"].device.type == step_on
    assert new_opt.state[p]["step"].dtype == torch.float32
    assert new_opt.state[p]["exp_avg"].device.type == device
    if device == "cpu":
        _train(target, new_opt, 1)


def _weights(model: nn.Module, tmp_path: Path) -> Path:
    return save(model.state_dict(), tmp_path / "w.pt")


@pytest.mark.requires_cuda
@pytest.mark.parametrize("flag", ["plain", "fused", "capturable"])
def test_resume_optimizer_on_cuda(tmp_path: Path, flag: str) -> None:
    model = reference()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    weights, state = _weights(model, tmp_path), save(opt.state_dict(), tmp_path / "o.pt")
    resumed = load_into(skeleton(Net), weights, "cuda")
    kwargs = {} if flag == "plain" else {flag: True}
    new_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2, **kwargs)
    saved = load(state)
    for group in saved["param_groups"]:
        group.update(kwargs)
    new_opt.load_state_dict(saved)
    step = new_opt.state[resumed.emb.weight]["step"]
    assert step.device.type == ("cpu" if flag == "plain" else "cuda")
    new_opt.zero_grad()
    resumed(X.cuda()).square().mean().backward()
    new_opt.step()  # would fail if step sat on the wrong device


def test_checkpoint_writes_nothing_on_failure(tmp_path: Path) -> None:
    path = tmp_path / "bad.pt"
    path.write_bytes(b"PK\x03\x04garbage")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(CheckpointError):
        load_into(skeleton(Net), path)
    assert sorted(os.listdir(tmp_path)) == before


def test_a_failed_placement_leaves_the_model_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    path = tmp_path / "two.pt"
    torch.save(source.state_dict(), path)
    model = skeleton(lambda: nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)))
    before = dict(model.named_parameters())
    calls = 0
    real = torch.Tensor.to

    def failing_to(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", failing_to)
    with pytest.raises(CheckpointError, match="the model is untouched"):
        load_into(model, path)
    monkeypatch.setattr(torch.Tensor, "to", real)
    for name, p in model.named_parameters():
        assert p is before[name] and p.device.type == "meta"


def test_weights_tied_in_the_file_stay_apart_in_a_model_that_keeps_them_apart(
    tmp_path: Path,
) -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(2, 2, bias=False)
            self.head = nn.Linear(2, 2, bias=False)

    saved = Pair()
    saved.head.weight = saved.emb.weight  # the file holds one storage under both names
    path = tmp_path / "tied.pt"
    torch.save(saved.state_dict(), path)
    model = load_into(skeleton(Pair), path)
    assert torch.equal(model.emb.weight, model.head.weight)
    with torch.no_grad():
        model.emb.weight.add_(1)
    assert not torch.equal(model.emb.weight, model.head.weight)  # separate, as declared


def test_shard_indexes_that_name_an_index_are_refused(tmp_path: Path) -> None:
    index = tmp_path / "model.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "model.index.json"}}))
    with pytest.raises(CheckpointError, match="itself a shard index"):
        load(index)
    from torchplace.checkpoint._catalog import describe_file as describe

    with pytest.raises(CheckpointError, match="itself a shard index"):
        describe(index)


def test_inspect_walks_shared_objects_once(tmp_path: Path) -> None:
    from torchplace.checkpoint._catalog import describe_file as describe

    shared: list[object] = [torch.ones(1)]
    for _ in range(60):
        shared = [shared, shared]  # 2**60 paths, 61 objects
    path = tmp_path / "dag.pt"
    torch.save(shared, path)
    records = describe(path)
    assert len(records) == 1


# ------------------------------------------------------------------ overlapping views in a file


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(4, 3))
        self.b = nn.Parameter(torch.zeros(2, 3))


def _byte_range(t: torch.Tensor) -> range:
    return range(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())


@pytest.mark.parametrize("rows", [slice(0, 2), slice(1, 3)], ids=["head", "middle"])
def test_overlapping_views_in_the_file_load_into_separate_memory(
    tmp_path: Path, rows: slice
) -> None:
    big = torch.arange(12.0).reshape(4, 3)
    path = save({"a": big, "b": big[rows]}, tmp_path / "overlap.pt")  # b shares a's storage
    model = load_into(skeleton(_Two), path)
    assert torch.equal(model.a, big) and torch.equal(model.b, big[rows])
    a, b = _byte_range(model.a), _byte_range(model.b)
    assert a.stop <= b.start or b.stop <= a.start  # no byte in common
    b_before = model.b.detach().clone()
    with torch.no_grad():
        model.a.add_(100.0)  # a step on a alone
    assert torch.equal(model.b, b_before)


def test_views_of_disjoint_parts_of_one_storage_are_not_copied(tmp_path: Path) -> None:
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps (Linux)")

    class Halves(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.zeros(2, 3))
            self.b = nn.Parameter(torch.zeros(2, 3))

    big = torch.arange(12.0).reshape(4, 3)
    path = save({"a": big[:2], "b": big[2:]}, tmp_path / "halves.pt")
    model = load_into(skeleton(Halves), path, mmap=True)
    assert torch.equal(model.a, big[:2]) and torch.equal(model.b, big[2:])
    # Their bytes do not overlap, so both stay in the mapping: no second copy.
    assert _maps_file(model.a, path) and _maps_file(model.b, path)
    assert model.a.untyped_storage().data_ptr() == model.b.untyped_storage().data_ptr()


# ------------------------------------------------------- Parameter subclasses and attributes


class _TaggedParam(nn.Parameter):
    """A Parameter subclass, as some libraries use to mark special weights."""


class _SlottedParam(nn.Parameter):
    __slots__ = ("group",)


class _Tagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.lin.weight.no_decay = True  # type: ignore[attr-defined]  # set after init touched it
        self.scale = _TaggedParam(torch.ones(2))  # untouched by torch calls: swept to meta
        self.scale.role = "scale"  # type: ignore[attr-defined]
        self.shift = _SlottedParam(torch.empty(2))
        self.shift.group = 7
        self.shift.note = "set before init"  # type: ignore[attr-defined]
        nn.init.zeros_(self.shift)  # init touches it after the attributes were set


def _check_tags(model: _Tagged) -> None:
    assert type(model.lin.weight) is nn.Parameter
    assert model.lin.weight.no_decay is True  # type: ignore[attr-defined]
    assert type(model.scale) is _TaggedParam and model.scale.role == "scale"  # type: ignore[attr-defined]
    assert type(model.shift) is _SlottedParam and model.shift.group == 7
    assert model.shift.note == "set before init"  # type: ignore[attr-defined]


def test_skeleton_keeps_parameter_subclasses_and_attributes() -> None:
    model = skeleton(_Tagged)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    _check_tags(model)


@pytest.mark.parametrize("build", ["skeleton", "real"])
def test_load_into_keeps_parameter_subclasses_and_attributes(tmp_path: Path, build: str) -> None:
    torch.manual_seed(0)
    source = _Tagged()
    with torch.no_grad():
        source.shift.add_(3.0)
    path = save(source.state_dict(), tmp_path / "tagged.pt")
    model = skeleton(_Tagged) if build == "skeleton" else _Tagged()
    before = dict(model.named_parameters())
    load_into(model, path)
    for name, p in model.named_parameters():
        assert p is before[name] and torch.equal(p, source.state_dict()[name])
    _check_tags(model)


# ------------------------------------------------------- load_state_dict hooks and versions


def _old_batchnorm_file(tmp_path: Path, version: int | None) -> Path:
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    source.train()(torch.randn(5, 2))  # running stats that are not the defaults
    sd = source.state_dict()
    del sd["1.num_batches_tracked"]  # a file saved before PyTorch 1.0 has none
    if version is None:
        del sd._metadata  # type: ignore[attr-defined]
    else:
        sd._metadata["1"]["version"] = version  # type: ignore[attr-defined]
    return save(sd, tmp_path / "old_bn.pt")


@pytest.mark.parametrize("version", [None, 1])
@pytest.mark.parametrize("build", ["skeleton", "real"])
def test_an_old_batchnorm_file_loads_as_load_state_dict_loads_it(
    tmp_path: Path, version: int | None, build: str
) -> None:
    path = _old_batchnorm_file(tmp_path, version)

    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))

    expected = factory()
    expected.load_state_dict(torch.load(path, weights_only=True))
    model = load_into(skeleton(factory) if build == "skeleton" else factory(), path)
    got, want = model.state_dict(), expected.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype, k
    assert model[1].num_batches_tracked.item() == 0


def test_a_current_batchnorm_file_still_needs_num_batches_tracked(tmp_path: Path) -> None:
    path = _old_batchnorm_file(tmp_path, 2)  # version 2 files have it: its absence is real
    with pytest.raises(RuntimeError, match="num_batches_tracked"):
        nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).load_state_dict(torch.load(path))
    with pytest.raises(CheckpointError, match=r"missing keys: 1\.num_batches_tracked"):
        load_into(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), path)


def test_old_instance_norm_running_stats_are_refused_as_load_state_dict_refuses(
    tmp_path: Path,
) -> None:
    path = save({"running_mean": torch.zeros(3), "running_var": torch.ones(3)}, tmp_path / "in.pt")
    with pytest.raises(RuntimeError, match="track_running_stats=False"):
        nn.InstanceNorm1d(3).load_state_dict(torch.load(path), strict=False)
    with pytest.raises(CheckpointError, match=r"running_mean and running_var.*InstanceNorm1d"):
        load_into(nn.InstanceNorm1d(3), path, strict=False)


class _OldLayout(nn.Module):
    """A layer whose early files stored ``w`` transposed, upgraded by a load pre-hook."""

    def __init__(self, public: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, 3))
        if public:
            self.register_load_state_dict_pre_hook(
                lambda module, sd, prefix, *rest: self._upgrade(sd, prefix, *rest)
            )
        else:
            self._register_load_state_dict_pre_hook(self._upgrade)

    def _upgrade(self, sd: dict[str, torch.Tensor], prefix: str, *rest: object) -> None:
        key = prefix + "w"
        if key in sd and sd[key].shape == (3, 2):
            sd[key] = sd[key].t()
        if prefix + "old_w" in sd:  # an even older name for it
            sd[key] = sd.pop(prefix + "old_w").t()


class _Holder(nn.Module):
    def __init__(self, public: bool = False) -> None:
        super().__init__()
        self.inner = _OldLayout(public)


@pytest.mark.parametrize("public", [False, True], ids=["private", "public"])
@pytest.mark.parametrize("build", ["skeleton", "real"])
@pytest.mark.parametrize("key", ["w", "old_w"])
def test_load_state_dict_pre_hooks_run_as_load_state_dict_runs_them(
    tmp_path: Path, public: bool, build: str, key: str
) -> None:
    old = torch.arange(6.0).reshape(3, 2)
    path = save({f"inner.{key}": old}, tmp_path / "old.pt")
    expected = _Holder(public)
    expected.load_state_dict(torch.load(path, weights_only=True))  # strict: old_w is renamed
    model = skeleton(_Holder, public) if build == "skeleton" else _Holder(public)
    load_into(model, path)
    assert torch.equal(model.inner.w, expected.inner.w) and torch.equal(model.inner.w, old.t())
    assert model.inner.w.is_contiguous()


def test_pre_hooks_get_the_arguments_load_state_dict_gives(tmp_path: Path) -> None:
    calls: dict[str, list[tuple[object, ...]]] = {"torch": [], "torchplace": []}
    who = "torch"

    def build() -> nn.Module:
        model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))

        def hook(
            module: nn.Module, sd: dict[str, torch.Tensor], prefix: str, *rest: object
        ) -> None:
            local_metadata, strict = rest[0], rest[1]
            calls[who].append((type(module).__name__, prefix, sorted(sd), local_metadata, strict))

        for m in model.modules():
            m.register_load_state_dict_pre_hook(hook)
        return model

    path = save(build().state_dict(), tmp_path / "nested.pt")
    build().load_state_dict(torch.load(path, weights_only=True))
    who = "torchplace"
    load_into(skeleton(build), path)
    assert calls["torchplace"] == calls["torch"] and len(calls["torch"]) == 4


def test_a_pre_hook_that_reports_an_error_refuses_the_file(tmp_path: Path) -> None:
    model = skeleton(nn.Linear, 2, 2)
    model.register_load_state_dict_pre_hook(
        lambda module, sd, prefix, meta, strict, missing, unexpected, errors: errors.append(
            "weight: saved by an incompatible release"
        )
    )
    path = save(nn.Linear(2, 2).state_dict(), tmp_path / "lin.pt")
    with pytest.raises(CheckpointError, match="incompatible release"):
        load_into(model, path, strict=False)
    assert model.weight.device.type == "meta"

    def raising(*args: object) -> None:
        raise KeyError("no such layout")

    model = skeleton(nn.Linear, 2, 2)
    model._register_load_state_dict_pre_hook(raising)
    with pytest.raises(CheckpointError, match=r"pre-hook .*raising.*KeyError.*nothing was loaded"):
        load_into(model, path)
    assert model.weight.device.type == "meta"


def test_post_hooks_run_after_the_weights_are_in_place(tmp_path: Path) -> None:
    source = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    path = save(source.state_dict(), tmp_path / "two.pt")
    seen: list[tuple[str, bool, list[str], list[str]]] = []

    def build() -> nn.Module:
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
        for name, m in model.named_modules():

            def hook(module: nn.Module, keys: object, name: str = name) -> None:
                loaded = all(p.device.type == "cpu" for p in module.parameters())
                seen.append((name, loaded, list(keys.missing_keys), list(keys.unexpected_keys)))  # type: ignore[attr-defined]

            m.register_load_state_dict_post_hook(hook)
        return model

    build().load_state_dict(torch.load(path, weights_only=True), strict=False)
    from_torch, seen[:] = list(seen), []
    with pytest.warns(UserWarning, match=r"left 2 tensor\(s\) of Sequential on meta.*: 2.weight"):
        model = load_into(skeleton(build), path, strict=False)
    assert [s[0] for s in seen] == [s[0] for s in from_torch] == ["0", "1", "2", ""]
    assert torch.equal(model[1].weight, source[1].weight)
    assert seen[0][1] and seen[1][1]  # the loaded layers hold their weights when their hook runs
    assert seen[-1][2] == from_torch[-1][2] == ["2.weight", "2.bias"]


def _forgiving(*names: str) -> Callable[[nn.Module, Any], None]:
    """A post-hook that clears the named keys from the missing and unexpected ones."""

    def hook(module: nn.Module, keys: Any) -> None:
        for name in names:
            for listed in (keys.missing_keys, keys.unexpected_keys):
                if name in listed:
                    listed.remove(name)

    return hook


def _with_extra_layer() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))


def test_post_hooks_may_clear_keys_before_the_strict_check(tmp_path: Path) -> None:
    source = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    path = save({**source.state_dict(), "old.scale": torch.ones(1)}, tmp_path / "two.pt")
    forgive = _forgiving("2.weight", "2.bias", "old.scale")
    reference = _with_extra_layer()
    reference.register_load_state_dict_post_hook(forgive)
    reference.load_state_dict(torch.load(path, weights_only=True))  # strict: torch lets it

    for model in (_with_extra_layer(), skeleton(_with_extra_layer)):
        model.register_load_state_dict_post_hook(forgive)
        if model[2].weight.is_meta:  # left there, and said: the hooks let the load go ahead
            with pytest.warns(UserWarning, match=r"on meta.*\(the model's load post-hooks let"):
                assert load_into(model, path) is model
        else:
            assert load_into(model, path) is model
        for name, value in source.state_dict().items():
            assert torch.equal(model.state_dict()[name], value)
        if model[2].weight.device.type == "meta":  # a skeleton's unloaded layer stays meta
            continue
        assert torch.equal(model[2].weight, reference[2].weight)  # the real one as it was


def test_keys_a_post_hook_leaves_undo_the_load(tmp_path: Path) -> None:
    source = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    path = save(source.state_dict(), tmp_path / "two.pt")

    model = _with_extra_layer()
    model.register_load_state_dict_post_hook(_forgiving("2.weight"))  # not 2.bias
    params = dict(model.named_parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"missing keys: 2\.bias$|missing keys: 2\.bias;"):
        load_into(model, path)
    for name, p in model.named_parameters():
        assert p is params[name] and torch.equal(p, before[name])  # filled in place, put back

    model = skeleton(_with_extra_layer)
    model.register_load_state_dict_post_hook(_forgiving("2.weight"))
    params = dict(model.named_parameters())
    with pytest.raises(CheckpointError, match=r"missing keys: 2\.bias"):
        load_into(model, path, "cpu")
    for name, p in model.named_parameters():
        assert p is params[name] and p.device.type == "meta"  # swapped in, swapped back

    def failing(module: nn.Module, keys: Any) -> None:
        raise ValueError("cannot map the old layout")

    model = skeleton(_with_extra_layer)
    model.register_load_state_dict_post_hook(failing)
    with pytest.raises(CheckpointError, match=r"failing.*ValueError.*put back as it was"):
        load_into(model, path)
    assert all(p.device.type == "meta" for p in model.parameters())


class _HookedPair(nn.Module):
    """Two layers and a post-hook that keeps a view of a loaded weight (a cached transpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)
        self.register_load_state_dict_post_hook(_HookedPair.cache)

    @staticmethod
    def cache(module: nn.Module, keys: Any) -> None:
        module.cached = module.a.weight.t()  # type: ignore[union-attr]


def test_an_undo_a_post_hook_made_impossible_is_said_not_raised_raw(tmp_path: Path) -> None:
    sd = _HookedPair().state_dict()
    del sd["b.bias"]
    path = save(sd, tmp_path / "pair.pt")
    with pytest.raises(CheckpointError, match=r"missing keys: b\.bias.*could not be put back"):
        load_into(skeleton(_HookedPair), path)


def test_keys_a_post_hook_adds_to_a_clean_strict_load_raise_as_in_torch(tmp_path: Path) -> None:
    path = save(nn.Linear(2, 2).state_dict(), tmp_path / "lin.pt")

    def demanding(module: nn.Module, keys: Any) -> None:
        keys.missing_keys.append("calibration")

    reference = nn.Linear(2, 2)
    reference.register_load_state_dict_post_hook(demanding)
    with pytest.raises(RuntimeError, match="calibration"):
        reference.load_state_dict(torch.load(path, weights_only=True))
    model = nn.Linear(2, 2)
    model.register_load_state_dict_post_hook(demanding)
    with pytest.raises(CheckpointError, match=r"missing keys: calibration.*post-hooks"):
        load_into(model, path)
    model = nn.Linear(2, 2)
    model.register_load_state_dict_post_hook(demanding)
    load_into(model, path, strict=False)  # as torch: not strict, not raised


def test_an_empty_file_under_strict_false_says_it_holds_nothing(tmp_path: Path) -> None:
    path = save({}, tmp_path / "empty.pt")
    with pytest.raises(CheckpointError, match=r"the model has weight, bias; the file holds none"):
        load_into(nn.Linear(2, 2), path, strict=False)


def test_a_swap_that_fails_midway_puts_back_the_ones_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchplace.checkpoint._fill as checkpoint

    path = save(nn.Linear(2, 2).state_dict(), tmp_path / "lin.pt")
    model = skeleton(nn.Linear, 2, 2)
    params = dict(model.named_parameters())
    real = checkpoint.parameter_like
    calls = []

    def second_fails(p: nn.Parameter, data: torch.Tensor, **kw: bool) -> nn.Parameter:
        calls.append(p)
        if len(calls) == 2:
            raise RuntimeError("simulated failure")
        return real(p, data, **kw)

    monkeypatch.setattr(checkpoint, "parameter_like", second_fails)
    with pytest.raises(CheckpointError, match=r"simulated failure.*the model is untouched"):
        load_into(model, path)
    assert len(calls) == 2
    for name, p in model.named_parameters():
        assert p is params[name] and p.device.type == "meta"


class _SelfLoading(nn.Linear):
    def _load_from_state_dict(self, state_dict, prefix, *args):  # type: ignore[no-untyped-def]
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"] * 2
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_a_module_that_loads_itself_is_run_as_load_state_dict_runs_it(tmp_path: Path) -> None:
    """Its _load_from_state_dict (here: doubling the weight) runs once its tensors are in
    place, so load_into gives what load_state_dict gives."""
    path = save({"0.weight": torch.ones(2, 2), "0.bias": torch.ones(2)}, tmp_path / "lin.pt")
    model = load_into(skeleton(lambda: nn.Sequential(_SelfLoading(2, 2))), path)
    real = nn.Sequential(_SelfLoading(2, 2))
    real.load_state_dict(load(path))
    assert torch.equal(model[0].weight, torch.full((2, 2), 2.0))
    assert torch.equal(model[0].weight, real[0].weight)
    assert torch.equal(model[0].bias, real[0].bias)


class _Refusing(nn.Linear):
    def _load_from_state_dict(self, state_dict, prefix, *args):  # type: ignore[no-untyped-def]
        self.seen = True
        raise ValueError("this file is from another version")


def test_a_module_that_loads_itself_and_fails_leaves_the_model_untouched(tmp_path: Path) -> None:
    path = save({"0.weight": torch.ones(2, 2), "0.bias": torch.ones(2)}, tmp_path / "lin.pt")
    model = skeleton(lambda: nn.Sequential(_Refusing(2, 2)))
    before = dict(model.named_parameters())
    with pytest.raises(CheckpointError, match=r"0 \(_Refusing\) loads itself.*another version"):
        load_into(model, path)
    for name, p in model.named_parameters():
        assert p is before[name] and p.device.type == "meta"
    assert not hasattr(model[0], "seen")  # its attributes put back too


# ------------------------------------------------------------------------------- lazy modules


@pytest.mark.parametrize("device", [None, "cpu"])
def test_load_into_a_lazy_module_materializes_it_as_load_state_dict_does(
    tmp_path: Path, device: str | None
) -> None:
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    path = save(source.state_dict(), tmp_path / "lin.pt")
    expected = nn.Sequential(nn.LazyLinear(2), nn.LazyBatchNorm1d())
    expected.load_state_dict(torch.load(path, weights_only=True))
    model = nn.Sequential(nn.LazyLinear(2), nn.LazyBatchNorm1d())
    weight = model[0].weight
    load_into(model, path, device)
    assert model[0].weight is weight and type(weight) is nn.Parameter
    got, want = model.state_dict(), expected.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype, k
    x = torch.randn(4, 3)
    assert torch.equal(model.eval()(x), expected.eval()(x))
    assert type(model[0]) is nn.Linear  # the first forward finishes it, as after load_state_dict


def test_a_skeleton_of_lazy_modules_stays_lazy_and_loads(tmp_path: Path) -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2), nn.LazyBatchNorm1d())

    torch.manual_seed(0)
    source = build()
    source(torch.randn(8, 3))  # materialized: 3 inputs
    path = save(source.state_dict(), tmp_path / "lazy.pt")
    model = skeleton(build)
    assert nn.parameter.is_lazy(model[0].weight) and model[2].weight.is_meta
    load_into(model, path)
    got = model.state_dict()
    for k, want in source.state_dict().items():
        assert torch.equal(got[k], want) and got[k].device.type == "cpu", k
    x = torch.randn(4, 3)
    assert torch.equal(model.eval()(x), source.eval()(x))


def test_a_refused_load_leaves_a_lazy_module_lazy(tmp_path: Path) -> None:
    path = save({"weight": torch.ones(2, 3)}, tmp_path / "no_bias.pt")
    model = nn.LazyLinear(2)
    with pytest.raises(CheckpointError, match="missing keys: bias"):
        load_into(model, path)
    assert nn.parameter.is_lazy(model.weight) and nn.parameter.is_lazy(model.bias)


# --------------------------------------------------------------- tied weights saved apart


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(3, 2)
        self.head = nn.Linear(2, 3, bias=False)
        self.head.weight = self.emb.weight


@pytest.mark.parametrize("strict", [True, False])
def test_tied_weights_saved_with_different_values_are_refused(tmp_path: Path, strict: bool) -> None:
    path = save(
        {"emb.weight": torch.ones(3, 2), "head.weight": torch.zeros(3, 2)}, tmp_path / "c.pt"
    )
    model = skeleton(_TiedLM)
    with pytest.raises(CheckpointError, match=r"emb\.weight and head\.weight .*keeps them apart"):
        load_into(model, path, strict=strict)
    assert model.emb.weight.device.type == "meta"


def test_tied_weights_saved_twice_with_equal_values_load(tmp_path: Path) -> None:
    w = torch.tensor([[1.0, float("nan")], [2.0, 3.0], [4.0, 5.0]])
    path = save({"emb.weight": w, "head.weight": w.clone()}, tmp_path / "same.pt")
    model = load_into(skeleton(_TiedLM), path)
    assert model.head.weight is model.emb.weight
    assert torch.equal(model.emb.weight.nan_to_num(), w.nan_to_num())


# ----------------------------------------------------------------------- shards and zip files


def test_a_shard_spelt_two_ways_is_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchplace.checkpoint import _load as _checkpoint

    safetensors_torch().save_file(
        {"a": torch.ones(2), "b": torch.arange(3.0)}, tmp_path / "s1.safetensors"
    )
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "./s1.safetensors"}}))
    reads: list[Path] = []
    real = _checkpoint.read_into

    def counting(path: Path, *args: object, **kwargs: object) -> None:
        reads.append(Path(path))
        real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_checkpoint, "read_into", counting)
    out = _checkpoint.load(index)
    assert reads == [(tmp_path / "s1.safetensors").resolve()]
    assert torch.equal(out["a"], torch.ones(2)) and torch.equal(out["b"], torch.arange(3.0))


@pytest.mark.parametrize("member", ["foo.txt", "archive/foo.txt"])
def test_a_zip_that_is_not_a_torch_file_is_named_as_such(tmp_path: Path, member: str) -> None:
    import zipfile

    path = tmp_path / "weights.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, "not weights")
    with pytest.raises(CheckpointError, match=r"a zip archive but not a torch\.save file"):
        load(path)


class FrozenBatchNorm2d(nn.Module):
    """As torchvision (and Hugging Face's DETR family) write it: fixed statistics, and a
    _load_from_state_dict that drops the num_batches_tracked an ordinary BatchNorm saves."""

    def __init__(self, n: int) -> None:
        super().__init__()
        for name, value in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0)):
            self.register_buffer(name, torch.full((n,), value))
        self.register_buffer("running_var", torch.ones(n))

    def _load_from_state_dict(self, state_dict, prefix, *args):  # type: ignore[no-untyped-def]
        state_dict.pop(prefix + "num_batches_tracked", None)
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_frozen_batch_norms_load_a_batch_norm_file(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    source[1].running_mean.uniform_()
    path = save(source.state_dict(), tmp_path / "bn.pt")  # holds 1.num_batches_tracked
    expected = nn.Sequential(nn.Conv2d(3, 4, 1), FrozenBatchNorm2d(4))
    expected.load_state_dict(torch.load(path, weights_only=True))
    model = load_into(
        skeleton(lambda: nn.Sequential(nn.Conv2d(3, 4, 1), FrozenBatchNorm2d(4))), path
    )
    for (name, a), (_, b) in zip(
        model.state_dict().items(), expected.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


# ------------------------------------------------------- a whole model saved with torch.save


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
        fix = f"torchplace.load({str(path)!r}, trusted=True).state_dict()"
        assert fix in str(info.value) and "Nothing was run" in str(info.value)
    load_into(model, load(path, trusted=True).state_dict())  # the fix, as given
    assert torch.equal(model[0].weight, source[0].weight)


def test_load_into_from_a_model_says_to_pass_its_state_dict() -> None:
    other = nn.Linear(2, 2)
    model = nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match=r"not from a Linear model.*other\.state_dict\(\)"):
        load_into(model, other)  # type: ignore[arg-type]
    load_into(model, other.state_dict())
    assert torch.equal(model.weight, other.weight)


def test_an_error_loading_a_directory_names_the_file_read_in_it(tmp_path: Path) -> None:
    torch.save({"other.weight": torch.ones(2, 2)}, tmp_path / "model.pt")
    with pytest.raises(CheckpointError) as info:
        load_into(nn.Linear(2, 2), tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'model.pt'}: does not fit Linear")
    assert info.value.path == tmp_path / "model.pt"


def test_skeleton_of_a_built_model_says_to_pass_its_class() -> None:
    with pytest.raises(
        TorchplaceError, match=r"not a Linear already built: skeleton\(Linear, \.\.\.\)"
    ):
        skeleton(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_skeleton_of_something_not_callable_says_what_it_takes() -> None:
    with pytest.raises(TorchplaceError, match=r"not a Tensor: torchplace\.skeleton\(YourModel"):
        skeleton(torch.ones(2))  # type: ignore[arg-type]


def test_a_long_key_list_points_to_the_error_that_holds_it_whole() -> None:
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(8)])
    with pytest.raises(CheckpointError, match=r"and 6 more.*CheckpointError\.missing") as info:
        load_into(model, {f"x{i}": torch.ones(1) for i in range(3)})
    assert len(info.value.missing) == 16


def test_a_rename_callable_that_raises_is_a_checkpoint_error(tmp_path: Path) -> None:
    torch.save(nn.Linear(2, 2).state_dict(), tmp_path / "w.pt")

    def rename(key: str) -> str:
        return {"weight": "weight"}[key]  # no entry for "bias"

    with pytest.raises(CheckpointError, match=r"w\.pt: rename= raised KeyError on key 'bias'"):
        load_into(skeleton(nn.Linear, 2, 2), tmp_path / "w.pt", rename=rename)
