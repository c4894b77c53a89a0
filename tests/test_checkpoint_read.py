"""Checkpoints read into the process's own memory: the resume loop, sources, renames, integrity.

The resume loop runs in a subprocess, so a crash (SIGBUS from a tensor whose file was truncated
under it) fails the test instead of killing pytest.
"""

from __future__ import annotations

import gc
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as safetensors_torch
import torch
from torch import nn

import torchplace
from torchplace._errors import CheckpointError, TorchplaceError
from torchplace.checkpoint._checkpoint import load, load_into, safetensors_header, skeleton

SRC = str(Path(torchplace.__file__).resolve().parents[1])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        self.register_buffer("mask", torch.ones(4), persistent=False)


def reference() -> Net:
    torch.manual_seed(0)
    return Net()


def _maps(path: Path) -> bool:
    """Whether this process maps ``path`` (any tensor of a memory-mapped load would)."""
    target = str(path.resolve())
    maps = Path("/proc/self/maps").read_text().splitlines()
    return any(line.rstrip().endswith(target) for line in maps)


# --------------------------------------------------------------------------- the resume loop

_RESUME = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from torchplace import load
    from torchplace import load_into
    from torchplace import skeleton

    def save(sd, path):
        sd = {k: v.detach().contiguous() for k, v in sd.items()}
        if path.endswith(".safetensors"):
            from safetensors.torch import save_file
            save_file(sd, path)
        else:
            torch.save(sd, path)

    def build():
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))

    for path in sys.argv[1:]:
        for way in ("load_into", "load"):
            print(way, path, flush=True)  # the last line printed names a crash
            torch.manual_seed(0)
            save(build().state_dict(), path)
            for round in range(2):
                if way == "load_into":
                    model = load_into(skeleton(build), path)
                    opt = torch.optim.SGD(model.parameters(), lr=0.1)
                    for _ in range(20):  # train 20 steps
                        opt.zero_grad()
                        model(torch.randn(4, 64)).square().mean().backward()
                        opt.step()
                    expected = {k: v.clone() for k, v in model.state_dict().items()}
                    save(model.state_dict(), path)  # back to the file it was loaded from
                    model(torch.randn(4, 64))  # and use every weight again
                else:
                    sd = load(path)
                    for v in sd.values():
                        v.add_(1.0)
                    expected = {k: v.clone() for k, v in sd.items()}
                    save(sd, path)  # load, then re-save to the same path
                    sd = {k: v * 1 for k, v in sd.items()}  # and read every value again
                again = load(path)
                assert set(again) == set(expected)
                for k, v in expected.items():
                    assert again[k].dtype == v.dtype and torch.equal(again[k], v), k
    print("ok")
    """
)


@pytest.mark.slow
def test_the_resume_loop_and_load_then_resave_survive(tmp_path: Path) -> None:
    """load_into a skeleton, train 20 steps, save to the same path (and load, re-save), for a
    .pt and a .safetensors file, in a subprocess: a crash there fails the test (SIGBUS: -7)."""
    script = tmp_path / "resume.py"
    script.write_text(_RESUME)
    paths = [str(tmp_path / "last.pt"), str(tmp_path / "last.safetensors")]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, str(script), *paths],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (
        f"exit {done.returncode} (-7 is SIGBUS) during: {done.stdout.splitlines()[-1:]}\n"
        f"{done.stderr[-2000:]}"
    )
    assert done.stdout.splitlines()[-1] == "ok"
    assert all(Path(p).stat().st_size > 0 for p in paths)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
@pytest.mark.parametrize("fmt", ["pt", "safetensors", "index"])
def test_nothing_loaded_is_backed_by_the_file(tmp_path: Path, fmt: str) -> None:
    sd = reference().state_dict()
    if fmt == "pt":
        path = tmp_path / "w.pt"
        torch.save(sd, path)
        files = [path]
    else:
        files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
        names = sorted(sd)
        safetensors_torch.save_file({k: sd[k] for k in names[:2]}, files[0])
        safetensors_torch.save_file({k: sd[k] for k in names[2:]}, files[1])
        path = files[0]
        if fmt == "index":
            path = tmp_path / "model.safetensors.index.json"
            weight_map = {k: ("a" if k in names[:2] else "b") + ".safetensors" for k in names}
            path.write_text(json.dumps({"weight_map": weight_map}))
    out = load(path)
    if fmt == "safetensors":  # the first of two files: what the other holds stays on meta
        with pytest.warns(UserWarning, match=r"left 3 tensor\(s\) of Net on meta"):
            model = load_into(skeleton(Net), path, strict=False)
    else:
        model = load_into(skeleton(Net), path)
    assert not any(_maps(f) for f in files)
    for k, v in out.items():
        assert torch.equal(v, sd[k]) and v.dtype == sd[k].dtype
    mapped = load(path, mmap=True)
    assert any(_maps(f) for f in files)  # mmap=True still maps, when asked
    del mapped, model


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64],
)
def test_read_values_are_bit_for_bit(tmp_path: Path, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    base = torch.randn(5, 7, dtype=torch.complex64 if dtype.is_complex else torch.float32)
    value = base.to(dtype) if dtype != torch.bool else base.real > 0
    sd = {"v": value, "t": value.t(), "row": value[2], "empty": value[:0], "scalar": value[0, 0]}
    torch.save(sd, tmp_path / "w.pt")
    out = load(tmp_path / "w.pt")
    for k, v in sd.items():
        assert out[k].dtype == v.dtype and out[k].stride() == v.stride() and torch.equal(out[k], v)
    # views of one storage in the file stay views of one storage, as torch.load gives them
    assert out["t"].untyped_storage().data_ptr() == out["v"].untyped_storage().data_ptr()
    flat = {k: v.clone(memory_format=torch.contiguous_format) for k, v in sd.items()}
    safetensors_torch.save_file(flat, tmp_path / "w.safetensors")
    out = load(tmp_path / "w.safetensors")
    for k, v in flat.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v)


def test_large_tensors_read_in_chunks_by_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchplace.checkpoint import _host_read

    monkeypatch.setattr(_host_read, "READ_CHUNK_BYTES", 4096)
    monkeypatch.setattr(_host_read, "READ_THREADS", 3)
    sd = {"a": torch.arange(10_000, dtype=torch.float32), "b": torch.arange(777.0)}
    torch.save(sd, tmp_path / "w.pt")
    safetensors_torch.save_file(sd, tmp_path / "w.safetensors")
    for name in ("w.pt", "w.safetensors"):
        out = load(tmp_path / name)
        assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_a_file_cut_short_is_a_checkpoint_error(tmp_path: Path) -> None:
    safetensors_torch.save_file({"a": torch.ones(100)}, tmp_path / "w.safetensors")
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "w.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"w\.safetensors: is truncated"):
        load(tmp_path / "w.safetensors")
    torch.save({"a": torch.ones(100_000)}, tmp_path / "w.pt")
    data = (tmp_path / "w.pt").read_bytes()
    (tmp_path / "w.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"w\.pt: is truncated") as info:
        load(tmp_path / "w.pt")
    # a save still being written looks the same: the advice covers both, in our own words
    assert "another process may be writing it" in str(info.value)
    assert "miniz" not in str(info.value)


_WRITER = "another process may be writing it right now (load it again once the writer is done)"


def _half_written(tmp_path: Path, state: str) -> Path:
    """A file in one of the states a reader meets while another process saves over it."""
    sd = {f"w{i}": torch.full((1000,), float(i)) for i in range(4)}
    if state == "empty":  # truncated to 0 bytes, nothing written yet
        path = tmp_path / "f.pt"
        path.write_bytes(b"")
    elif state == "first-bytes":  # the first few bytes flushed
        path = tmp_path / "f.pt"
        path.write_bytes(b"\x05\x00\x00")
    elif state == "zip-directory":  # an end record pointing where no directory record starts
        path = tmp_path / "f.pt"
        torch.save(sd, path)
        data = bytearray(path.read_bytes())
        at = data.find(b"PK\x01\x02")
        data[at : at + 4] = b"PK\x00\x00"
        path.write_bytes(bytes(data))
    elif state == "safetensors-data":  # the header whole, the data cut inside a tensor
        path = tmp_path / "f.safetensors"
        safetensors_torch.save_file(sd, path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 2500])
    else:  # "safetensors-header": cut inside the header
        path = tmp_path / "f.safetensors"
        safetensors_torch.save_file(sd, path)
        path.write_bytes(path.read_bytes()[:60])
    return path


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (
            "empty",
            r"f\.pt: is empty \(0 bytes\); .*, or its save was interrupted \(save it again\)",
        ),
        ("first-bytes", r"f\.pt: is not a PyTorch .* at 3 bytes it is too short to be one: "),
        (
            "zip-directory",
            r"f\.pt: is truncated or corrupt \(BadZipFile: Bad magic number for central "
            r"directory\); .*, or save or fetch it again$",
        ),
        (
            "safetensors-data",
            r"f\.safetensors: is truncated or corrupt: tensor 'w3' \(F32, shape \[1000\]\) "
            r"takes 4000 bytes, which do not fit its data offsets \[12000, 16000\] in the "
            r"file's 13500 bytes of data; .*, or its save was interrupted",
        ),
        ("safetensors-header", r"f\.safetensors: is a safetensors file cut short: .* has 60; "),
    ],
    ids=["empty", "first-bytes", "zip-directory", "safetensors-data", "safetensors-header"],
)
def test_a_file_being_written_may_be_named_so(tmp_path: Path, state: str, message: str) -> None:
    """What a reader finds while another process saves over the file (torch.save, or
    safetensors' save_file: each truncates it, then writes) is said to be possibly that, the
    advice for a damaged file kept beside it."""
    path = _half_written(tmp_path, state)
    for what in (load, lambda p: load_into(reference(), p)):
        with pytest.raises(CheckpointError, match=message) as info:
            what(path)
        assert _WRITER in str(info.value)


def test_damage_that_no_writer_makes_is_not_blamed_on_one(tmp_path: Path) -> None:
    """A tensor whose offsets do not span its bytes is damage, whatever the file's length."""
    header = json.dumps({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "f.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointError, match="do not fit its data offsets") as info:
        load(path)
    assert "another process" not in str(info.value)
    path.write_bytes(b"0123456789")  # long enough to start a checkpoint: just a foreign file
    with pytest.raises(CheckpointError, match="not a PyTorch or safetensors") as info:
        load(path)
    assert "another process" not in str(info.value)


def test_a_safetensors_file_cut_short_after_it_was_cataloged_may_be_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cut between reading the header and reading the data, as a writer truncating it does:
    the read runs out of file (the tester's EOFError)."""
    from torchplace.checkpoint._reader import OpenFiles

    path = tmp_path / "f.safetensors"
    safetensors_torch.save_file({"a": torch.ones(1000), "b": torch.ones(1000)}, path)
    data = path.read_bytes()
    real = OpenFiles.read

    def truncate_then_read(files: OpenFiles, where: Path, *args: Any, **options: Any) -> Any:
        path.write_bytes(data[: len(data) // 2])
        files.stamps.pop(where, None)  # the stamp of the file cut: it changes no more
        return real(files, where, *args, **options)

    monkeypatch.setattr(OpenFiles, "read", truncate_then_read)
    with pytest.raises(CheckpointError, match=r"f\.safetensors: cannot be read .*EOFError") as e:
        load_into(reference(), path, strict=False)
    assert _WRITER in str(e.value)


def test_a_file_that_shrinks_as_it_is_opened_is_said_to_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size seen, then fewer bytes read: a writer truncated it in between (the tester's
    "it starts with b''")."""
    path = tmp_path / "f.pt"
    torch.save({"w": torch.ones(10)}, path)
    size = path.stat().st_size
    path.write_bytes(b"")  # the writer's open(path, "wb"), after the reader's stat
    real_stat = Path.stat

    def stat_before_truncation(self: Path, **kwargs: Any) -> os.stat_result:
        got = real_stat(self, **kwargs)
        if self != path:
            return got
        fields = list(got[:10])
        fields[6] = size  # st_size
        return os.stat_result(fields)

    monkeypatch.setattr(Path, "stat", stat_before_truncation)
    went = rf"its size went from {size} to 0 bytes\)"
    with pytest.raises(
        CheckpointError, match=rf"f\.pt: the file changed while it was read \({went}"
    ):
        load(path)
    with pytest.raises(CheckpointError, match=re.escape(_WRITER)):
        load(path)


# ---------------------------------------------------------------------------------- sources


def test_load_into_from_a_mapping_takes_copies_of_its_own(tmp_path: Path) -> None:
    sd = reference().state_dict()
    model = load_into(skeleton(Net), sd)
    for name, p in model.named_parameters():
        assert torch.equal(p, sd[name]) and p.data_ptr() != sd[name].data_ptr()
    with torch.no_grad():
        model.body[0].weight.add_(1.0)
    assert torch.equal(sd["body.0.weight"], reference().body[0].weight)  # the caller's, as was
    with pytest.raises(CheckpointError, match=r"the state dict given to load_into: does not fit"):
        load_into(skeleton(Net), {k: v for k, v in sd.items() if k != "emb.weight"})


def test_load_into_from_a_lightning_checkpoint_follows_its_hint(tmp_path: Path) -> None:
    sd = reference().state_dict()
    ckpt = {
        "epoch": 3,
        "state_dict": OrderedDict((f"model.{k}", v) for k, v in sd.items()),
        "optimizer_states": [{}],
    }
    path = tmp_path / "epoch=3.ckpt"
    torch.save(ckpt, path)
    with pytest.raises(CheckpointError) as info:
        load_into(skeleton(Net), path)
    hint = str(info.value).split("; load the part that holds the weights, ")[1]
    assert hint == (
        f"torchplace.load_into(model, torchplace.load({str(path)!r})['state_dict'], "
        """rename={r"^model\\.": ""})"""
    )
    # followed to the letter
    namespace = {"torchplace": torchplace, "model": skeleton(Net)}
    exec(hint, namespace)
    model = namespace["model"]
    for name, p in model.named_parameters():
        assert torch.equal(p, sd[name])


def test_load_into_a_directory_as_save_pretrained_writes_it(tmp_path: Path) -> None:
    sd = reference().state_dict()
    one = tmp_path / "one"
    one.mkdir()
    safetensors_torch.save_file(sd, one / "model.safetensors")
    (one / "config.json").write_text("{}")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(sd)
    weight_map = {}
    for i, part in enumerate((names[:2], names[2:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        safetensors_torch.save_file({k: sd[k] for k in part}, sharded / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    both = tmp_path / "both"  # a Hub snapshot may hold the safetensors file and the .bin
    both.mkdir()
    safetensors_torch.save_file(sd, both / "model.safetensors")
    torch.save({k: torch.zeros_like(v) for k, v in sd.items()}, both / "pytorch_model.bin")
    for root in (one, sharded, both):
        model = load_into(skeleton(Net), root)
        for name, p in model.named_parameters():
            assert torch.equal(p, sd[name]), (root.name, name)
        assert set(load(root)) == set(sd)


def test_a_directory_from_transformers_save_pretrained_loads(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    src = transformers.BertModel(config)
    src.save_pretrained(tmp_path, max_shard_size="10KB")  # sharded: an index and its files
    assert any(p.name.endswith(".index.json") for p in tmp_path.iterdir())
    model = load_into(skeleton(transformers.BertModel, config), tmp_path)
    for name, p in src.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name


# ---------------------------------------------------------------------------------- rename=


def test_rename_as_regular_expressions_in_order(tmp_path: Path) -> None:
    sd = reference().state_dict()
    path = tmp_path / "ddp.pt"
    torch.save({f"module.net.{k}": v for k, v in sd.items()}, path)
    model = load_into(skeleton(Net), path, rename={r"^module\.": "", r"^net\.": ""})
    assert all(torch.equal(p, sd[n]) for n, p in model.named_parameters())


def test_rename_as_a_callable_drops_keys_it_maps_to_none(tmp_path: Path) -> None:
    sd = reference().state_dict()
    path = tmp_path / "w.pt"
    torch.save({**sd, "head.weight": torch.ones(3), "step": torch.tensor(5)}, path)
    with pytest.raises(CheckpointError, match=r"unexpected keys: head\.weight, step"):
        load_into(skeleton(Net), path)
    keep = set(sd)
    model = load_into(skeleton(Net), path, rename=lambda k: k if k in keep else None)
    assert all(torch.equal(p, sd[n]) for n, p in model.named_parameters())


def test_rename_as_a_dict_drops_keys_whose_pattern_maps_to_none(tmp_path: Path) -> None:
    """A pattern mapped to None drops the keys it matches, in the dict's order: it sees each
    name as the patterns before it left it."""
    sd = reference().state_dict()
    path = tmp_path / "ddp.pt"
    extra = {"head.weight": torch.ones(3), "step": torch.tensor(5)}
    torch.save({f"module.{k}": v for k, v in {**sd, **extra}.items()}, path)
    model = load_into(
        skeleton(Net), path, rename={r"^module\.": "", r"^head\.": None, r"^step$": None}
    )
    assert all(torch.equal(p, sd[n]) for n, p in model.named_parameters())
    # Before the prefix is taken off, "^head\." matches nothing: the key stays, unexpected.
    with pytest.raises(
        CheckpointError, match=r"unexpected keys \(as rename= names them\): head\.weight;"
    ):
        load_into(skeleton(Net), path, rename={r"^head\.": None, r"^module\.": "", "step": None})
    with pytest.raises(TorchplaceError, match=r"replacements \(str, or None.*'x': 3"):
        load_into(skeleton(Net), path, rename={"x": 3})  # type: ignore[dict-item]


def test_rename_that_merges_two_keys_is_refused(tmp_path: Path) -> None:
    sd = reference().state_dict()
    path = tmp_path / "w.pt"
    torch.save(sd, path)
    model = skeleton(Net)
    with pytest.raises(CheckpointError, match=r"w\.pt: rename= gives 'body.0.weight' and "):
        load_into(model, path, rename={r"^body\.\d\.": "body.0."})
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(CheckpointError, match=r"turned 'emb.weight' into 3"):
        load_into(model, path, rename=lambda k: 3)  # type: ignore[arg-type,return-value]
    with pytest.raises(TorchplaceError, match=r"not a regular expression"):
        load_into(model, path, rename={"(": ""})
    with pytest.raises(TorchplaceError, match=r"rename= takes a callable"):
        load_into(model, path, rename=["module."])  # type: ignore[arg-type]


def test_rename_keeps_the_version_metadata_of_renamed_modules(tmp_path: Path) -> None:
    class WithNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

    src = WithNorm()
    src.bn.running_mean.fill_(2.0)
    sd = src.state_dict()
    old = OrderedDict((f"module.{k}", v) for k, v in sd.items() if "num_batches" not in k)
    old._metadata = OrderedDict(  # type: ignore[attr-defined]
        [("", {"version": 1}), ("module", {"version": 1}), ("module.bn", {"version": 1})]
    )  # an old file: norm version 1 has no num_batches_tracked
    path = tmp_path / "old.pt"
    torch.save(old, path)
    model = load_into(skeleton(WithNorm), path, rename={r"^module\.": ""})
    assert torch.equal(model.bn.running_mean, torch.full((3,), 2.0))
    assert int(model.bn.num_batches_tracked) == 0


# ------------------------------------------------------------------------------ integrity


def _record_span(path: Path, suffix: str) -> tuple[int, int]:
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    with path.open("rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    return start, start + info.file_size


@pytest.mark.parametrize(
    "how", [{}, {"trusted": True}, {"mmap": True}, {"device": "meta"}], ids=str
)
def test_a_flipped_byte_in_the_pickle_record_is_caught(tmp_path: Path, how: dict[str, Any]) -> None:
    path = tmp_path / "w.pt"
    torch.save({"weight": torch.ones(2), "wbias": torch.zeros(2)}, path)
    start, end = _record_span(path, "data.pkl")
    data = bytearray(path.read_bytes())
    at = data.index(b"wbias", start, end)
    data[at] = ord("x")  # "xbias": still a valid pickle, a key silently renamed
    path.write_bytes(bytes(data))
    how = dict(how)
    device = how.pop("device", "cpu")
    with pytest.raises(CheckpointError, match=r"w\.pt: is corrupt: its pickle record .*CRC-32"):
        load(path, device, **how)
    with pytest.raises(CheckpointError, match=r"CRC-32"):
        load_into(skeleton(nn.Linear, 2, 2), path)


def test_a_file_written_without_crcs_still_loads(tmp_path: Path) -> None:
    config = pytest.importorskip(
        "torch.utils.serialization.config",
        reason="this torch cannot turn off the CRCs of torch.save",
    )

    sd = {"w": torch.arange(4.0)}
    old = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        torch.save(sd, tmp_path / "w.pt")
    finally:
        config.save.compute_crc32 = old
    assert torch.equal(load(tmp_path / "w.pt")["w"], sd["w"])


class _Refused:
    """A class torch's safe loader refuses (as pickled, it names this module's global)."""


def _garbage_empty(real: Any) -> Any:
    """``torch.empty`` whose byte buffers hold 0xFF, as memory the allocator reused may."""

    def empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        out = real(*size, **kwargs)
        if out.dtype == torch.uint8 and not out.is_meta:
            out.fill_(255)
        return out

    return empty


def test_sparse_tensors_are_checked_once_their_bytes_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With torch's sparse checks on (always on in torch 2.6), a sound COO and CSR tensor load;
    checked before their bytes were in, their indices were garbage and the file 'corrupt'."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # sparse CSR is in beta
        torch.save(
            {"coo": torch.eye(3).to_sparse(), "csr": torch.eye(3).to_sparse_csr()},
            tmp_path / "s.pt",
        )
    monkeypatch.setattr(torch, "empty", _garbage_empty(torch.empty))

    def no_second_read(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torchplace's own read gave up and left the file to torch.load")

    monkeypatch.setattr(torch, "load", no_second_read)
    with torch.sparse.check_sparse_tensor_invariants(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = load(tmp_path / "s.pt")
    assert torch.equal(out["coo"].to_dense(), torch.eye(3))
    assert torch.equal(out["csr"].to_dense(), torch.eye(3))


def test_a_refused_read_leaves_no_sparse_tensor_for_the_next_load_to_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read abandoned after a sparse tensor was built (here: a refused class further on) must
    not leave it queued: the next torch.load would check its unread indices and fail."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.save({"a": torch.eye(3).to_sparse(), "b": _Refused()}, tmp_path / "bad.pt")
        torch.save({"w": torch.eye(2).to_sparse()}, tmp_path / "good.pt")
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", _garbage_empty(torch.empty))
        with pytest.raises(CheckpointError, match="refused to unpickle"):
            load(tmp_path / "bad.pt")
    with torch.sparse.check_sparse_tensor_invariants(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = torch.load(tmp_path / "good.pt", weights_only=True)
    assert torch.equal(out["w"].to_dense(), torch.eye(2))


def test_bad_sparse_indices_are_refused_where_torchs_safe_loader_refuses_them(
    tmp_path: Path,
) -> None:
    """An index past the end (which a later read would follow out of bounds): torchplace.load
    refuses the file exactly where this torch's weights-only torch.load does (2.15: always)."""
    bad = torch.sparse_coo_tensor(torch.tensor([[5]]), torch.ones(1), (3,), check_invariants=False)
    torch.save({"bad": bad}, tmp_path / "bad.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # 2.15 notes that its check takes time
        try:
            torch.load(tmp_path / "bad.pt", weights_only=True)
        except RuntimeError:
            refused = True
        else:
            refused = False
    if not refused:
        assert load(tmp_path / "bad.pt")["bad"]._indices().tolist() == [[5]]
        return
    with pytest.raises(CheckpointError, match=r"bad\.pt.*index 5"):
        load(tmp_path / "bad.pt")


def _safetensors(path: Path, header: dict[str, Any], data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
            bytes(12),
            r"tensor 'b' \(bytes 4 to 12\) overlaps tensor 'a' \(which ends at byte 8\)",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
             "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}},
            bytes(12),
            r"tensor 'b' starts at byte 8, leaving 4 bytes after tensor 'a' that no tensor",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
            bytes(8),
            r"tensor 'a' starts at byte 4, leaving 4 bytes at the start of the data",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
            bytes(8),
            r"holds 8 bytes of data, and 4 bytes after tensor 'a' are no tensor's",
        ),
        (
            {"a": {"dtype": "F64", "shape": [1 << 40, 1 << 22], "data_offsets": [0, 0]}},
            b"",
            r"tensor 'a' has shape \[1099511627776, 4194304\], .* \(its size overflows\)",
        ),
        (
            {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
            bytes(8),
            r"tensor 'a' \(F32, shape \[3\]\) takes 12 bytes, which do not fit",
        ),
        (
            {"__metadata__": {"format": "pt", "epoch": 3},
             "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
            bytes(4),
            r"corrupt __metadata__ \(\{'format': 'pt', 'epoch': 3\}\): safetensors metadata",
        ),
        (
            {"__metadata__": ["pt"], "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
            bytes(4),
            r"corrupt __metadata__ \(\['pt'\]\): safetensors metadata maps strings",
        ),
    ],
    ids=["overlap", "gap", "not-from-0", "trailing", "overflow", "size", "meta-int", "meta-list"],
)  # fmt: skip
def test_safetensors_header_refuses_what_a_loader_refuses(
    tmp_path: Path, header: dict[str, Any], data: bytes, message: str
) -> None:
    path = _safetensors(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(CheckpointError, match=r"bad\.safetensors: .*" + message):
        safetensors_header(path)
    with pytest.raises(CheckpointError, match=message):
        load(path)
    if "tensor '" in message[:12]:  # the safetensors library refuses it too
        with pytest.raises(Exception):  # noqa: B017, PT011
            safetensors_torch.load_file(path)


def test_safetensors_header_accepts_empty_tensors_between_others(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
    }
    path = _safetensors(tmp_path / "ok.safetensors", header, struct.pack("<ff", 1.0, 2.0))
    out = load(path)
    assert out["a"].tolist() == [1.0] and out["b"].tolist() == [2.0] and out["e"].numel() == 0


# ------------------------------------------------------------------------------------- CUDA


@pytest.mark.requires_cuda
@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_reads_onto_cuda_go_through_pinned_staging(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchplace.checkpoint._reader as readinto

    staged: list[int] = []
    real = readinto.read_cuda

    def counting(fd: int, pieces: Any, device: torch.device, *rest: Any) -> list[str]:
        staged.extend(piece[1].nbytes for piece in pieces)
        return real(fd, pieces, device, *rest)

    monkeypatch.setattr(readinto, "read_cuda", counting)

    sd = {"big": torch.randn(5 << 20), "small": torch.arange(3.0), "e": torch.empty(0)}
    path = tmp_path / f"w.{fmt}"
    if fmt == "pt":
        torch.save(sd, path)
    else:
        safetensors_torch.save_file(sd, path)
    out = load(path, "cuda")
    for k, v in sd.items():
        assert out[k].device.type == "cuda" and torch.equal(out[k].cpu(), v)
    assert sum(staged) == sum(v.nbytes for v in sd.values())  # every byte through the ring
    model = load_into(skeleton(nn.Linear, 1024, 1024), _linear_file(tmp_path, fmt), "cuda")
    assert model.weight.is_cuda and model.weight.requires_grad
    reference = nn.Linear(1024, 1024)
    reference.load_state_dict(load(_linear_file(tmp_path, fmt)))
    assert torch.equal(model.weight.cpu(), reference.weight)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_bf16_model_from_an_fp32_file_is_converted_on_the_gpu_chunk_by_chunk(
    tmp_path: Path, suffix: str
) -> None:
    """Peak GPU memory: the model's bytes plus a few staging chunks, not the fp32 tensors too."""
    torch.manual_seed(0)
    weights = {f"{i}.weight": torch.randn(4096, 1024) for i in range(16)}  # 256 MiB of fp32
    path = _saved(tmp_path / f"fp32{suffix}", weights)
    layers = skeleton(lambda: nn.Sequential(*(nn.Linear(1024, 4096, bias=False) for _ in "x" * 16)))
    model = layers.to(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    load_into(model, path, "cuda")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    model_bytes = sum(p.nbytes for p in model.parameters())
    assert peak <= model_bytes + (64 << 20), (peak, model_bytes)
    for i, layer in enumerate(model):
        assert layer.weight.is_cuda and layer.weight.dtype == torch.bfloat16
        assert torch.equal(layer.weight.cpu(), weights[f"{i}.weight"].to(torch.bfloat16)), i


def _saved(path: Path, weights: dict[str, torch.Tensor]) -> Path:
    """``weights`` saved to ``path`` by its suffix: safetensors or ``torch.save``."""
    if path.suffix == ".safetensors":
        safetensors_torch.save_file(weights, path)
    else:
        torch.save(weights, path)
    return path


def _linear_file(tmp_path: Path, fmt: str) -> Path:
    torch.manual_seed(0)
    return _saved(tmp_path / f"lin.{fmt}", nn.Linear(1024, 1024).state_dict())


# ------------------------------------------------------------------------------------- Ctrl-C

_PACKAGE = str(Path(torchplace.__file__).resolve().parent)


class _Interrupter:
    """A trace function that raises ``KeyboardInterrupt`` at the ``at``-th line event run in
    torchplace's own code (0: never), counting them all."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.count = 0
        self.where = ""
        self.fired = False  # whether its interrupt came through to the caller

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(_PACKAGE):
            return None
        return self.local

    def local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.count += 1
            if self.count == self.at:
                self.where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                raise KeyboardInterrupt
        return self.local


def _traced_load(model: nn.Module, path: Path, at: int) -> _Interrupter:
    """``load_into(model, path)`` under an ``_Interrupter`` at ``at`` (0: never), returned.

    An interrupt raised where a with block calls ``__exit__`` skips it (CPython's own limit),
    leaving a file to the garbage collector, or ``torch.no_grad()`` on: not what the tests look
    at, so both are tidied after each run."""
    interrupter = _Interrupter(at)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        sys.settrace(interrupter)
        try:
            load_into(model, path)
        except KeyboardInterrupt:
            interrupter.fired = True
        finally:
            sys.settrace(None)
            torch.set_grad_enabled(True)
    return interrupter


class _Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.head = nn.Linear(3, 3, bias=False)
        self.head.weight = self.lin.weight  # tied
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("mask", torch.ones(3), persistent=False)
        self.note = "before"

    def get_extra_state(self) -> Any:
        return {"note": self.note}

    def set_extra_state(self, state: Any) -> None:
        self.note = state["note"]


def _snapshot(model: nn.Module) -> list[tuple[str, Any, Any, torch.device, torch.Tensor | None]]:
    out = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        value = None if t.is_meta else t.detach().clone()
        out.append((name, t, type(t), t.device, value))
    return out


def _same(model: nn.Module, before: list[Any], note: str) -> bool:
    now = _snapshot(model)
    if len(now) != len(before) or getattr(model, "note", None) != note:
        return False
    for (n1, t1, c1, d1, v1), (n2, t2, c2, d2, v2) in zip(now, before, strict=True):
        if n1 != n2 or t1 is not t2 or c1 is not c2 or d1 != d2:
            return False
        if (v1 is None) != (v2 is None) or (v1 is not None and not torch.equal(v1, v2)):
            return False
    return True


@pytest.mark.slow
def test_ctrl_c_at_any_point_of_load_into_leaves_the_skeleton_as_it_was(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = _Stateful()
    src.note = "after"
    src.bn.running_mean.fill_(5.0)
    path = tmp_path / "w.pt"
    torch.save(src.state_dict(), path)
    load_into(skeleton(_Stateful), path)  # warm: caches filled once change no later count
    model = skeleton(_Stateful)
    clean = _traced_load(model, path, 0)
    assert clean.count > 100 and model.note == "after" and not model.lin.weight.is_meta
    broken = []
    for at in range(1, clean.count + 1):
        model = skeleton(_Stateful)
        before = _snapshot(model)
        interrupter = _traced_load(model, path, at)
        if not interrupter.fired:
            broken.append(f"{at}: no interrupt came through ({interrupter.where})")
        if at % 500 == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                gc.collect()
        if not _same(model, before, "before"):
            broken.append(f"{at}: the model changed ({interrupter.where})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    assert not broken, f"{len(broken)} of {clean.count}: {broken[:5]}"


def test_the_names_others_import_stay_importable_from_checkpoint() -> None:
    import torchplace.checkpoint._checkpoint as checkpoint

    names = [
        "load", "load_into", "skeleton", "as_path", "detect_format", "safetensors_header",
        "shards", "SAFETENSORS_DTYPES", "SAFETENSORS_HINT", "PathLike",
    ]  # fmt: skip
    assert all(hasattr(checkpoint, n) for n in names)
    assert checkpoint.load is torchplace.load
    # torchplace.load_into (spreading's, which also fills by a device map) hands a call without
    # a map to this one
    from torchplace.spreading import _load_by_map

    assert checkpoint.load_into is _load_by_map.fill


@pytest.mark.slow
def test_ctrl_c_at_any_point_of_load_into_a_real_model_leaves_it_before_or_loaded(
    tmp_path: Path,
) -> None:
    """A real model's memory is filled in place, with no copy kept: every read and check comes
    first, and the writes are one call, so an interrupt finds it as it was or wholly loaded."""
    torch.manual_seed(0)
    src = _Stateful()
    src.note = "after"
    src.bn.running_mean.fill_(5.0)
    path = tmp_path / "w.pt"
    torch.save(src.state_dict(), path)
    loaded_values = {k: v.clone() for k, v in src.state_dict().items() if k != "_extra_state"}
    load_into(_Stateful(), path)  # warm
    clean = _traced_load(_Stateful(), path, 0)
    mixed = []
    for at in range(1, clean.count + 1):
        torch.manual_seed(1)
        model = _Stateful()
        before = {k: v.clone() for k, v in model.state_dict().items() if k != "_extra_state"}
        interrupter = _traced_load(model, path, at)
        now = model.state_dict()
        as_before = all(torch.equal(now[k], before[k]) for k in before)
        as_loaded = all(torch.equal(now[k], loaded_values[k]) for k in before)
        if not (as_before or as_loaded):
            mixed.append(f"{at}: {interrupter.where}")
    gc.collect()
    assert not mixed, f"{len(mixed)} of {clean.count}: {mixed[:8]}"


_SIGINT_CHILD = """
import ctypes, json, os, queue, signal, sys, threading, time
import torch
from torch import nn
from safetensors.torch import load_file
import torchplace

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(256, 256, bias=False)  # the first written, watched
        self.rest = nn.Sequential(*(nn.Linear(512, 512, bias=False) for _ in range(4)))
        self.norm = nn.BatchNorm1d(512)  # buffers: kept to put back, so a half state shows

paths = sys.argv[1:3]
rounds = int(sys.argv[3])
values = [load_file(p) for p in paths]
model = Net()
model.load_state_dict(values[0])
mine = {t.data_ptr() for t in model.state_dict().values()}
current, half = 0, []

def settle(where):  # after a load of the other file: loaded, kept, or half (put right)
    global current
    now, target = model.state_dict(), 1 - current
    if all(torch.equal(now[k], values[target][k]) for k in now):
        current = target
        return "loaded"
    if all(torch.equal(now[k], values[current][k]) for k in now):
        return "kept"
    half.append(where)
    model.load_state_dict(values[current])
    return "half"

# 1. A real SIGINT sent from inside the in-place write, as its k-th tensor is reached: the
# write of the model's tensors (torch._foreach_copy_, one C call) is done here a part at a
# time, the first k tensors copied, then the signal sent. CPython raises KeyboardInterrupt
# in os.kill itself (3.11 on) or at its next check, in the loop below: either way it leaves
# the write with k of its tensors written, wherever k falls, whatever the machine's speed.
real_copy = torch._foreach_copy_
armed, sizes = None, []

def copy_signalling_at_k(targets, sources, *args, **kwargs):
    global armed
    if not targets or not all(t.data_ptr() in mine for t in targets):
        return real_copy(targets, sources, *args, **kwargs)  # not the model's write
    sizes.append(len(targets))
    if armed is None:
        return real_copy(targets, sources, *args, **kwargs)
    k, armed = armed, None  # once: a write the interrupt leads to runs whole
    if k:
        real_copy(list(targets[:k]), list(sources[:k]), *args, **kwargs)
    os.kill(os.getpid(), signal.SIGINT)
    end = time.monotonic() + 60
    while time.monotonic() < end:  # were it not raised in os.kill, at the next check
        time.sleep(0.001)
    raise AssertionError("the SIGINT sent from the write never came")

torch._foreach_copy_ = copy_signalling_at_k
torchplace.load_into(model, paths[1])  # a plain load: how many tensors the write copies
assert settle("plain load") == "loaded", "a load with no signal did not load"
written = sizes[-1]
at_k = []
for k in range(written + 1):  # before the first tensor ... after the last, as it returns
    armed = k
    try:
        torchplace.load_into(model, paths[1 - current])
        came = False
    except KeyboardInterrupt:
        came = True
    at_k.append({"k": k, "came": came, "armed_left": armed is not None, "state": settle(k)})
torch._foreach_copy_ = real_copy

# 2. Real SIGINTs timed by another thread, sent the moment the write is seen to have begun
# (where it lands, inside the load or just after it, depends on the machine's speed).
watch = model.first.weight
jobs, sent = queue.Queue(), threading.Event()

def watcher():
    while (job := jobs.get()) is not None:
        address, before = job
        cell = ctypes.c_float.from_address(address)
        while cell.value == before:
            time.sleep(0.0002)  # lets the main thread run its Python; polls while it is in C
        os.kill(os.getpid(), signal.SIGINT)
        sent.set()

threading.Thread(target=watcher, daemon=True).start()
timed = {"in_load": 0, "after": 0, "loaded": 0, "kept": 0, "half": 0}
for i in range(rounds):
    sent.clear()
    jobs.put((watch.data_ptr(), watch.view(-1)[0].item()))
    inside = True
    try:
        torchplace.load_into(model, paths[1 - current])
        inside = False
        sent.wait(60)
        for _ in range(1000):  # the signal sent late lands here at the latest
            time.sleep(0.001)
        raise AssertionError("no interrupt came")
    except KeyboardInterrupt:
        timed["in_load" if inside else "after"] += 1
    timed[settle(f"timed {i}")] += 1
jobs.put(None)
print(json.dumps({"written": written, "at_k": at_k, "timed": timed, "half": half}))
"""


@pytest.mark.slow
def test_a_real_sigint_during_the_in_place_write_leaves_the_model_before_or_loaded(
    tmp_path: Path,
) -> None:
    """A real Ctrl-C sent while the weights are being written into a real model's memory: the
    model is as it was, or wholly loaded, every parameter and buffer bit for bit, never some
    of each. The signal is sent from inside the write, at each of its tensors from the first
    to the last (so it lands there whatever the machine's speed), and by a thread at times the
    machine sets (for those, only the outcome is checked, never how many landed inside)."""
    torch.manual_seed(0)
    first = {k: v.clone() for k, v in _SigintNet().state_dict().items()}
    second = {k: v + 1 for k, v in first.items()}
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for path, weights in zip(paths, (first, second), strict=True):
        safetensors_torch.save_file(weights, str(path))
    rounds = 20
    child = [sys.executable, "-c", _SIGINT_CHILD, *map(str, paths), str(rounds)]
    done = subprocess.run(child, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert not report["half"], f"interrupts left the model half-loaded: {report}"
    at_k = report["at_k"]
    assert report["written"] >= 3, report  # a first, a middle and a last tensor to send at
    assert [r["k"] for r in at_k] == list(range(report["written"] + 1)), report
    # each signal was sent from inside the write and came out of load_into as the interrupt
    assert all(r["came"] and not r["armed_left"] for r in at_k), report
    assert sum(report["timed"][s] for s in ("loaded", "kept")) == rounds, report


class _SigintNet(nn.Module):
    """The child's model, as built here to write its two checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(256, 256, bias=False)
        self.rest = nn.Sequential(*(nn.Linear(512, 512, bias=False) for _ in range(4)))
        self.norm = nn.BatchNorm1d(512)


_PEAK_CHILD = """
import sys, torch
from torch import nn
import torchplace
from torchplace.checkpoint._host_read import READ_CHUNK_BYTES, READ_THREADS

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

path = sys.argv[1]
model = torchplace.skeleton(
    lambda: nn.Sequential(*(nn.Linear(1024, 4096, bias=False) for _ in range(16)))
).to(torch.bfloat16)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak starts again from here
base = rss()
torchplace.load_into(model, path)
extra = hwm() - base
model_bytes = sum(p.nbytes for p in model.parameters())
assert all(p.dtype == torch.bfloat16 for p in model.parameters())
print(extra, model_bytes, READ_THREADS * READ_CHUNK_BYTES)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_bf16_model_from_an_fp32_file_peaks_at_its_own_bytes_plus_staging(
    tmp_path: Path, suffix: str
) -> None:
    """Tensors are converted chunk by chunk as they are read, from a safetensors file and a
    torch zip file alike: the fp32 file is never held whole (before, the peak was the fp32
    tensors plus the bf16 model, 3x the model's bytes; for a zip file until this release)."""
    torch.manual_seed(0)
    weights = {f"{i}.weight": torch.randn(4096, 1024) for i in range(16)}  # 256 MiB of fp32
    path = _saved(tmp_path / f"fp32{suffix}", weights)
    path.read_bytes()  # in the page cache, which no process's peak counts
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_CHILD, str(path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    extra, model_bytes, staging = map(int, done.stdout.split())
    assert extra <= model_bytes + staging + (32 << 20), (extra, model_bytes, staging)
    layers = skeleton(lambda: nn.Sequential(*(nn.Linear(1024, 4096, bias=False) for _ in "x" * 16)))
    model = load_into(layers.to(torch.bfloat16), path)
    for i, layer in enumerate(model):
        assert torch.equal(layer.weight, weights[f"{i}.weight"].to(torch.bfloat16)), i


def test_a_trusted_whole_model_whose_class_is_gone_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not "truncated or corrupt": the file is sound, the class is not defined here."""
    import sys
    import types

    module = types.ModuleType("tp_models")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

    Net.__module__ = "tp_models"
    Net.__qualname__ = "Net"
    module.Net = Net  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tp_models", module)
    torch.save(Net(), tmp_path / "whole.pt")
    del module.Net  # type: ignore[attr-defined]
    with pytest.raises(CheckpointError, match=r"class Net from module tp_models.*may be sound"):
        load(tmp_path / "whole.pt", "cpu", trusted=True)
    monkeypatch.delitem(sys.modules, "tp_models")
    with pytest.raises(CheckpointError, match=r"module tp_models, which this program cannot"):
        load(tmp_path / "whole.pt", "cpu", trusted=True)


class _Mixed(nn.Module):
    """A bf16 model that keeps its norm in fp32 (as transformers' ``_keep_in_fp32_modules``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8).to(torch.bfloat16)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))


def _mixed_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    sd = {k: torch.randn_like(v, dtype=torch.float32) for k, v in _Mixed().state_dict().items()}
    sd["proj.weight"][0, :3] = torch.tensor([1.0 + 2**-10, 3.3, -7e-5])  # bits bf16 rounds
    sd["steps"] = torch.tensor([3, 4])
    return sd


def test_a_zip_file_is_converted_to_the_models_dtypes_as_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each fp32 record wanted in bf16 is read converting (a 3-tuple piece, never an fp32
    tensor of its own); the fp32 norm and the int64 buffer are read as saved."""
    from torchplace.checkpoint import _zip_read

    sd = _mixed_state()
    path = tmp_path / "m.pt"
    torch.save(sd, path)
    reads: list[tuple[Any, ...]] = []
    real = _zip_read.read_into

    def recording(p: Path, pieces: Any, *args: Any) -> None:
        reads.extend(pieces)
        real(p, pieces, *args)

    monkeypatch.setattr(_zip_read, "read_into", recording)
    model = load_into(skeleton(_Mixed), path)
    converting = [p.into.dtype for p in reads if p.stored is not None]
    assert converting == [torch.bfloat16, torch.bfloat16]  # proj.weight, proj.bias
    assert all(p.into.dtype == torch.uint8 for p in reads if p.stored is None)  # read as saved
    for name, value in model.state_dict().items():
        assert torch.equal(value, sd[name].to(value.dtype)), name
    assert model.proj.weight.dtype == torch.bfloat16 and model.norm.weight.dtype == torch.float32


def test_views_of_one_storage_are_converted_together_and_stay_views(tmp_path: Path) -> None:
    from torchplace.checkpoint._load import load_state

    base = torch.randn(6, 4)
    sd = {"whole": base, "rows": base[2:5], "column": base[:, 1]}
    path = tmp_path / "views.pt"
    torch.save(sd, path)
    got = load_state(path, torch.device("cpu"), mmap=False, dtype_of=lambda n: torch.bfloat16)
    for name, value in sd.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], value.bfloat16())
    storage = got["whole"].untyped_storage().data_ptr()
    assert got["rows"].untyped_storage().data_ptr() == storage
    assert got["column"].untyped_storage().data_ptr() == storage
    assert got["column"].stride() == (4,) and got["rows"].storage_offset() == 8
    # names of one storage that want different dtypes: read as saved, each converted after
    mixed = load_state(
        path,
        torch.device("cpu"),
        mmap=False,
        dtype_of=lambda n: torch.float16 if n == "rows" else torch.bfloat16,
    )
    assert all(mixed[n].dtype == torch.float32 and torch.equal(mixed[n], sd[n]) for n in sd)


@pytest.mark.parametrize(
    "saved",
    [
        {"w": nn.Parameter(torch.randn(3, 2))},  # a parameter, not a plain tensor
        {"outer": {"w": torch.randn(3, 2)}},  # nested
        {"w": torch.randn(3, 2), "n": 3},  # not only tensors
        {"w": torch._neg_view(torch.randn(3, 2))},  # a negative bit, which the bytes lack
        {"w": torch.randn(3, 2), "z": torch.randn(3, dtype=torch.complex64).conj()},
    ],
    ids=["parameter", "nested", "not-a-tensor", "negative-view", "conjugate-view"],
)
def test_anything_but_a_dict_of_plain_tensors_is_read_as_saved(
    tmp_path: Path, saved: dict[str, Any]
) -> None:
    from torchplace.checkpoint._load import load_state

    path = tmp_path / "odd.pt"
    torch.save(saved, path)
    got = load_state(path, torch.device("cpu"), mmap=False, dtype_of=lambda n: torch.bfloat16)
    assert type(got) is type(saved) and got.keys() == saved.keys()
    for name, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert type(got[name]) is type(value) and got[name].dtype == value.dtype
            assert torch.equal(got[name], value)
    if "outer" in saved:
        assert torch.equal(got["outer"]["w"], saved["outer"]["w"])


def test_conjugate_and_negative_views_load_into_a_model_with_their_values(tmp_path: Path) -> None:
    """Saved with their bit set, not negated in their bytes: a rebuilt view of the bytes alone
    would give the conjugate's conjugate; the catalog marks them as read only whole."""
    from torchplace.checkpoint._catalog import catalog

    class WithComplex(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.z = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
            self.register_buffer("n", torch.zeros(3))

    z = torch.tensor([1 + 2j, 3 - 4j, -5 + 6j])
    sd = {**WithComplex().state_dict(), "z": z.conj(), "n": torch._neg_view(z.real.clone())}
    path = tmp_path / "bits.pt"
    torch.save(sd, path)
    bf16 = WithComplex()
    bf16.lin.to(torch.bfloat16)
    bf16.n = bf16.n.to(torch.bfloat16)
    for model in (WithComplex(), bf16):  # the file's tensors converted as read, or not
        load_into(model, path)
        assert torch.equal(model.z.data.resolve_conj(), z.conj().resolve_conj())
        assert torch.equal(model.n, -z.real.to(model.n.dtype))
    entries = catalog(path).entries
    assert not entries["z"].addressable and "conj bit" in entries["z"].why
    assert not entries["n"].addressable and "neg bit" in entries["n"].why


def test_a_whole_model_the_catalog_refuses_is_still_called_a_whole_model(tmp_path: Path) -> None:
    """Its data records deflated (the catalog reads only stored ones): the pickle alone is read
    for what the file would run, so the refusal still says what it is and what to do."""
    from torchplace.checkpoint._catalog import catalog, code_globals

    saved = tmp_path / "saved.pt"
    torch.save(nn.Linear(2, 2), saved)
    path = tmp_path / "deflated.pt"
    with zipfile.ZipFile(saved) as src, zipfile.ZipFile(path, "w") as out:
        for info in src.infolist():
            packed = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            out.writestr(info.filename, src.read(info), compress_type=packed)
    with pytest.raises(CheckpointError, match="compressed"):
        catalog(path)
    assert code_globals(path) == ["torch.nn.modules.linear.Linear"]
    with pytest.raises(CheckpointError, match=r"holds a whole model saved with torch\.save"):
        load(path)


@pytest.mark.slow
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_whole_models_tensors_are_named_as_its_state_dict_names_them(
    tmp_path: Path, legacy: bool
) -> None:
    """``0.weight``, not ``_modules.0._parameters.weight``: the names inspect shows are the keys
    the model's state dict would have, nested modules and buffers included; a non-persistent
    buffer is listed too (it is in the file) under its own name."""
    from torchplace.checkpoint._catalog import catalog

    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.BatchNorm1d(4)))
    model.register_buffer("scratch", torch.zeros(2), persistent=False)
    path = tmp_path / "whole.pt"
    torch.save({"model": model, "step": 3}, path, _use_new_zipfile_serialization=not legacy)
    want = [f"model.{k}" for k in model.state_dict()] + ["model.scratch"]
    assert sorted(catalog(path).entries) == sorted(want)
    shown = subprocess.run(
        [sys.executable, "-m", "torchplace", "inspect", str(path)],
        capture_output=True, text=True, check=True, env={**os.environ, "COLUMNS": "200"},
    ).stdout  # fmt: skip
    assert "model.2.0.running_mean" in shown and "_parameters" not in shown


def test_a_whole_model_in_the_legacy_format_is_described_and_named(tmp_path: Path) -> None:
    """Its module classes are saved as persistent ids with their source: the inert reader
    stands in for them as classes, so inspect lists the weights and load names the model."""
    from torchplace.checkpoint._catalog import catalog, code_globals

    path = tmp_path / "legacy-model.pt"
    torch.save(nn.Linear(2, 2), path, _use_new_zipfile_serialization=False)
    assert code_globals(path) == ["torch.nn.modules.linear.Linear"]
    assert [e.shape for e in catalog(path).entries.values()] == [(2, 2), (2,)]
    with pytest.raises(CheckpointError, match=r"holds a whole model saved with torch\.save"):
        load(path)


# ------------------------------------------------------------------------------ rename= that raises


def test_a_rename_callable_that_raises_is_a_checkpoint_error(tmp_path: Path) -> None:
    torch.save(nn.Linear(2, 2).state_dict(), tmp_path / "w.pt")

    def rename(key: str) -> str:
        return {"weight": "weight"}[key]  # no entry for "bias"

    with pytest.raises(CheckpointError, match=r"w\.pt: rename= raised KeyError on key 'bias'"):
        load_into(skeleton(nn.Linear, 2, 2), tmp_path / "w.pt", rename=rename)
