"""``torchplace.save`` (issue 52): round trips bit for bit, sharding, tied weights, refusals,
atomic replacement under real signals and write failures, background saves, a model with
layers left on disk, and DTensor models saved collectively on two ranks (a directory's files
split among them)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

import torchplace
from helpers import torchrun_two_cpu

REPO = Path(__file__).resolve().parents[1]


def tricky() -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and layouts: a transposed view, a slice of a larger tensor, a
    scalar, an empty one."""
    torch.manual_seed(0)
    base = torch.randn(10)
    return {
        "transposed": torch.randn(3, 4).t(),
        "slice": base[2:7],
        "bf16": torch.randn(4, 2).to(torch.bfloat16),
        "ints": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "flags": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 2),
    }


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    files = [folder] if folder.is_file() else sorted(folder.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                assert key not in out, f"{key} written twice"
                out[key] = f.get_tensor(key)
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("name", ["w.safetensors", "w.pt", "w.pth", "folder"])
def test_a_mapping_round_trips_bit_for_bit(tmp_path: Path, name: str) -> None:
    state = tricky()
    path = tmp_path / name
    assert torchplace.save(state, path) is None
    if name.endswith((".pt", ".pth")):
        assert_same(torch.load(path, weights_only=True), state)
    else:
        assert_same(read_safetensors(path), state)
    assert_same(torchplace.load(path), state)
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporaries left


DTYPES = [torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
          torch.uint8, torch.bool, torch.complex64, torch.uint16, torch.uint32, torch.uint64,
          torch.float8_e4m3fn, torch.float8_e5m2]  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("name", ["all.pt", "all.safetensors"])
def test_every_dtype_round_trips(tmp_path: Path, name: str) -> None:
    base = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    state = {str(dt): base.to(dt).t() for dt in DTYPES}  # transposed: written through a copy
    if name.endswith(".pt"):
        state["complex128"] = base.to(torch.complex128)
    torchplace.save(state, tmp_path / name)
    got = torch.load(tmp_path / name, weights_only=True) if name.endswith(".pt") else (
        read_safetensors(tmp_path / name))  # fmt: skip
    for key, value in state.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(_bits(got[key]), _bits(value)), key


def test_a_dtype_safetensors_lacks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(torchplace.CheckpointError, match=r"c is torch.complex128.*\.pt path"):
        torchplace.save({"c": torch.ones(2, dtype=torch.complex128)}, tmp_path / "c.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_a_pt_file_is_device_neutral_and_holds_only_each_view(tmp_path: Path) -> None:
    big = torch.randn(1000)
    torchplace.save({"view": big[:3]}, tmp_path / "v.pt")
    assert os.path.getsize(tmp_path / "v.pt") < 2000  # the slice, not its 4000-byte base
    from torchplace.checkpoint._catalog import catalog

    assert {e.device for e in catalog(tmp_path / "v.pt").entries.values()} == {"cpu"}


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.tensor(7))


def test_sharded_directory_has_an_index_covering_every_key_once(tmp_path: Path) -> None:
    model = Tied()
    torchplace.save(model, tmp_path / "ckpt", max_shard_size=300)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 1 and files == [*shards, "model.safetensors.index.json"]
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    written = read_safetensors(tmp_path / "ckpt")
    assert set(index["weight_map"]) == set(written)
    assert "head.weight" not in written  # tied: once, under its first name
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in written.values())
    for key, shard in index["weight_map"].items():
        with safe_open(str(tmp_path / "ckpt" / shard), "pt") as f:
            assert key in f.keys()  # noqa: SIM118
    loaded = torchplace.load_into(torchplace.skeleton(Tied), tmp_path / "ckpt")
    assert loaded.head.weight is loaded.embed.weight
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt", "m"])
def test_a_model_round_trips_through_load_into(tmp_path: Path, name: str) -> None:
    model = Tied()
    model.body.weight.data = model.body.weight.data.t().contiguous().t()  # not contiguous
    torchplace.save(model, tmp_path / name)
    loaded = torchplace.load_into(torchplace.skeleton(Tied), tmp_path / name)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.head.weight is loaded.embed.weight


def test_meta_tensors_are_refused_and_nothing_is_written(tmp_path: Path) -> None:
    torchplace.save({"w": torch.ones(2)}, tmp_path / "old.safetensors")
    before = (tmp_path / "old.safetensors").read_bytes()
    model = torchplace.skeleton(Tied)
    with pytest.raises(torchplace.PlacementError, match=r"model\.embed\.weight is on meta"):
        torchplace.save(model, tmp_path / "old.safetensors")
    with pytest.raises(torchplace.PlacementError, match=r"\['w'\] is on meta"):
        torchplace.save({"w": torch.empty(2, device="meta")}, tmp_path / "folder")
    assert (tmp_path / "old.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.safetensors"]


def test_a_directory_keeps_the_files_it_does_not_write(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    torchplace.save(Tied(), folder, max_shard_size=300)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "logs" / "empty").mkdir(parents=True)
    (folder / "logs" / "run.txt").write_text("step 1")
    (folder / "latest").symlink_to("logs")
    torchplace.save(Tied(), folder)  # one file now: the old shards go, the rest stays
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["latest", "logs", "model.safetensors", "tokenizer.json"]
    assert (folder / "logs" / "empty").is_dir()
    assert (folder / "latest" / "run.txt").read_text() == "step 1"
    assert os.readlink(folder / "latest") == "logs"


def test_progress_says_what_was_written(tmp_path: Path, capsys: Any) -> None:
    torchplace.save({"w": torch.ones(1000)}, tmp_path / "w.safetensors", progress=True)
    assert "save w.safetensors: 3.9 KiB in" in capsys.readouterr().err
    torchplace.save({"w": torch.ones(1000)}, tmp_path / "w.safetensors")  # small: no line
    assert capsys.readouterr().err == ""


def test_a_relative_path_is_where_it_was_when_saved(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    saving = torchplace.save({"w": torch.ones(2**20)}, "w.safetensors", background=True)
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert saving is not None
    saving.wait()
    assert (tmp_path / "w.safetensors").is_file()
    assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.requires_cuda
def test_a_model_on_the_gpu_is_saved_as_cpu_tensors(tmp_path: Path) -> None:
    from torchplace.checkpoint._catalog import catalog

    model = Tied().to("cuda")
    want = {k: v.cpu() for k, v in model.state_dict().items() if k != "head.weight"}
    torchplace.save(model, tmp_path / "m.pt")
    assert {e.device for e in catalog(tmp_path / "m.pt").entries.values()} == {"cpu"}
    assert_same(torch.load(tmp_path / "m.pt", weights_only=True), want)
    saving = torchplace.save(model, tmp_path / "bg.safetensors", background=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert saving is not None
    saving.wait()
    assert_same(read_safetensors(tmp_path / "bg.safetensors"), want)


def test_flags_are_true_or_false(tmp_path: Path) -> None:
    with pytest.raises(torchplace.DeviceSpecError, match="background='yes' is not True or False"):
        torchplace.save({"w": torch.ones(1)}, tmp_path / "w.pt", background="yes")  # type: ignore[arg-type]
    with pytest.raises(torchplace.DeviceSpecError, match="max_shard_size"):
        torchplace.save({"w": torch.ones(1)}, tmp_path / "d", max_shard_size="5G")
    assert list(tmp_path.iterdir()) == []


def test_a_file_in_the_way_of_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("not a directory")
    with pytest.raises(torchplace.CheckpointError, match="is a file"):
        torchplace.save(Tied(), tmp_path / "ckpt")


def test_background_save_holds_the_values_of_the_call(tmp_path: Path) -> None:
    model = Tied()
    want = {k: v.clone() for k, v in model.state_dict().items() if k != "head.weight"}
    saving = torchplace.save(model, tmp_path / "bg.safetensors", background=True)
    assert isinstance(saving, torchplace.Saving)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    saving.wait()
    assert saving.done()
    assert_same(read_safetensors(tmp_path / "bg.safetensors"), want)


def test_background_save_of_every_dtype(tmp_path: Path) -> None:
    state = {str(dt): torch.tensor([[1, 2, 3]], dtype=torch.int32).to(dt) for dt in DTYPES}
    state["odd"] = torch.ones(3, dtype=torch.bool)  # 3 bytes: the next one starts unaligned
    saving = torchplace.save(state, tmp_path / "all.safetensors", background=True)
    assert saving is not None
    saving.wait()
    got = read_safetensors(tmp_path / "all.safetensors")
    assert all(torch.equal(_bits(got[k]), _bits(v)) for k, v in state.items())


def test_background_saves_to_one_path_land_in_call_order(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    savings = [
        torchplace.save({"w": torch.full((256, 256), float(i))}, path, background=True)
        for i in range(4)
    ]
    for saving in savings:
        assert saving is not None
        saving.wait()
    assert torch.equal(read_safetensors(path)["w"], torch.full((256, 256), 3.0))


def test_wait_raises_the_writes_error(tmp_path: Path, monkeypatch: Any) -> None:
    from torchplace.checkpoint import _save

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    torchplace.save({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    monkeypatch.setattr(_save, "write_safetensors", full_disk)
    saving = torchplace.save({"w": torch.zeros(2)}, tmp_path / "w.safetensors", background=True)
    assert saving is not None
    with pytest.raises(torchplace.CheckpointError, match=r"No space left.*unchanged"):
        saving.wait()
    assert saving.done()
    assert torch.equal(torchplace.load(tmp_path / "w.safetensors")["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def test_a_model_with_layers_on_disk_saves_equal_to_the_original(tmp_path: Path) -> None:
    torch.manual_seed(0)
    original = nn.Sequential(
        nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)), nn.Linear(4, 2)
    )
    torch.save(original.state_dict(), tmp_path / "source.pt")
    loaded = torchplace.load_into(
        torchplace.skeleton(lambda: copy.deepcopy(original)),
        tmp_path / "source.pt",
        device_map={"": "cpu", "1": "disk"},
    )
    assert loaded[1][0].weight.is_meta
    for name in ("out.safetensors", "out.pt", "out"):
        torchplace.save(loaded, tmp_path / name)
        assert_same(torchplace.load(tmp_path / name), original.state_dict())
    assert loaded[1][0].weight.is_meta  # still on disk: read for the save, not kept


# ------------------------------------------------------------------ crashes and write failures

_SAVER = """
import os, sys, torch, torchplace
path, kind = sys.argv[1], sys.argv[2]
versions = [{f"t{i}": torch.full((256, 1024), float(v)) for i in range(24)} for v in (1, 2)]
print("ready", flush=True)
n = 0
while True:
    torchplace.save(versions[n % 2], path)
    n += 1
"""


def _whole_version(path: Path) -> float:
    """The one value every tensor of the checkpoint at ``path`` holds (1.0 or 2.0)."""
    state = torchplace.load(path)
    assert sorted(state) == sorted(f"t{i}" for i in range(24))
    values = {float(t[0, 0]) for t in state.values()}
    assert len(values) == 1, f"a mix of versions: {values}"
    (value,) = values
    for t in state.values():
        assert torch.equal(t, torch.full((256, 1024), value))
    return value


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ckpt", "ckpt.safetensors", "ckpt.pt"])
def test_real_sigints_leave_the_old_or_the_new_checkpoint(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    torchplace.save({f"t{i}": torch.full((256, 1024), 1.0) for i in range(24)}, path)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    seen = set()
    import random

    rng = random.Random(52)
    for _ in range(8):
        child = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(path), name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.05, 0.6))
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
        assert b"KeyboardInterrupt" in err
        seen.add(_whole_version(path))
        leftovers = [p.name for p in tmp_path.iterdir() if p.name != name]
        assert leftovers == [], leftovers
    assert seen <= {1.0, 2.0}


_LIMITED = """
import resource, signal, sys, torch, torchplace
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (2 * 2**20, 2 * 2**20))
try:
    torchplace.save({"w": torch.full((2**20,), 2.0)}, sys.argv[1])
except torchplace.CheckpointError as exc:
    print("refused:", exc)
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ckpt", "ckpt.safetensors", "ckpt.pt"])
def test_a_write_past_the_file_size_limit_leaves_the_old_checkpoint(
    tmp_path: Path, name: str
) -> None:
    path = tmp_path / name
    torchplace.save({"w": torch.ones(1000)}, path)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_LIMITED), str(path)],
        capture_output=True,
        env=env,
        timeout=120,
    )
    assert b"refused:" in done.stdout and b"unchanged" in done.stdout, done.stderr
    assert torch.equal(torchplace.load(path)["w"], torch.ones(1000))
    assert [p.name for p in tmp_path.iterdir()] == [name]


_PEAK = """
import json, sys, torch, torchplace
# 640 MiB in ten tensors of 64 MiB; half of them transposed views (written through a copy)
state = {f"t{i}": torch.ones(4096, 4096) for i in range(10)}
state = {k: (v.t() if i % 2 else v) for i, (k, v) in enumerate(state.items())}
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) back to what is resident now
before = status("VmRSS")
torchplace.save(state, sys.argv[1])
print(json.dumps({"growth": status("VmHWM") - before}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's /proc")
@pytest.mark.parametrize("name", ["big", "big.pt"])
def test_peak_host_memory_while_saving_640_mib(tmp_path: Path, name: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, str(tmp_path / name)],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    growth = json.loads(done.stdout.strip().splitlines()[-1])["growth"]
    largest = 64 * 2**20
    assert growth <= 64 * 2**20 + largest, f"{growth / 2**20:.0f} MiB above the state"


# ------------------------------------------------------------- FSDP2: a collective on 2 ranks

FSDP2_WORKER = r"""
import os
import sys
from pathlib import Path
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import torchplace

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 7), nn.LayerNorm(7))
model.register_buffer("steps", torch.tensor(5))
if rank == 0:  # one process saving the same model
    torchplace.save(model, out / "single.safetensors")
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
assert any(type(p).__name__ == "DTensor" for p in model.parameters())
torchplace.save(model, out / "sharded.safetensors")
torchplace.save(model, out / "sharded.pt")
torchplace.save(model, out / "sharded", max_shard_size=600)
saving = torchplace.save(model, out / "background.safetensors", background=True)
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)  # after the snapshot: not in the file
saving.wait()
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
torch.manual_seed(1)
tp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
if rank == 0:
    torchplace.save(tp, out / "tp-single.safetensors")
parallelize_module(tp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
torchplace.save(tp, out / "tp.safetensors")
if rank == 0:  # a full disk on the writing rank, after its first tensor
    from torchplace.checkpoint import _save, _writers

    def full_disk(f, items, metadata=None, advance=None):
        _writers.host_tensor(_writers.safetensors_order(list(items))[0])
        raise OSError(28, "No space left on device")

    _save.write_safetensors = full_disk
try:
    torchplace.save(model, out / "sharded.safetensors")
except torchplace.CheckpointError as exc:
    print(f"rank {rank} refused: {exc}", flush=True)
try:  # a path rank 0 cannot write to: every rank raises, before any gather
    torchplace.save(model, out / f"missing-{rank}" / "m.safetensors")
except torchplace.CheckpointError as exc:
    print(f"rank {rank} bad path: {exc}", flush=True)
dist.barrier()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
# Skip interpreter teardown: Gloo's background threads sometimes abort the process at exit
# ("terminate called without an active exception") after all work is done.
os._exit(0)
"""


@pytest.mark.slow
def test_fsdp2_and_tensor_parallel_models_save_what_one_process_saves(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(FSDP2_WORKER)
    output = torchrun_two_cpu(script, str(tmp_path), timeout=180)
    assert "rank 0 done" in output and "rank 1 done" in output, output
    assert "rank 0 refused" in output and "No space left" in output, output
    assert "rank 1 refused: the collective save failed on rank 0" in output, output
    assert "rank 0 bad path: " in output and "missing-0 does not exist" in output, output
    assert "rank 1 bad path: the collective save was refused on rank 0" in output, output
    want = read_safetensors(tmp_path / "single.safetensors")
    assert sorted(want) == ["0.bias", "0.weight", "2.bias", "2.weight", "3.bias", "3.weight",
                            "steps"]  # fmt: skip
    for name in ("sharded.safetensors", "sharded", "background.safetensors"):
        assert_same(read_safetensors(tmp_path / name), want)
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    assert_same(torch.load(tmp_path / "sharded.pt", weights_only=True), want)
    tensor_parallel = read_safetensors(tmp_path / "tp.safetensors")
    assert_same(tensor_parallel, read_safetensors(tmp_path / "tp-single.safetensors"))
    assert not [p for p in tmp_path.iterdir() if ".torchplace-tmp-" in p.name]


SPLIT_WORKER = r"""
import os
import resource
import signal
import sys
from pathlib import Path
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
import torchplace

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
os.umask(0o022 if rank == 0 else 0o027)  # the mode of a file says which rank made it
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 7), nn.LayerNorm(7))
torch.manual_seed(1)
tp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
if rank == 0:  # one process saving the same models
    torchplace.save(model, out / "single", max_shard_size=600)
    torchplace.save(tp, out / "tp-single", max_shard_size=1000)
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
parallelize_module(tp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
torchplace.save(model, out / "split", max_shard_size=600)
torchplace.save(tp, out / "tp-split", max_shard_size=1000)
with torch.no_grad():  # what the save that fails would have written
    for p in model.parameters():
        p.add_(1.0)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
for limited in (1, 0):  # a write past the file size limit on one rank only
    if rank == limited:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
    try:
        torchplace.save(model, out / "split", max_shard_size=600)
    except torchplace.CheckpointError as exc:
        print(f"rank {rank}, {limited} limited: {exc}", flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
dist.barrier()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
os._exit(0)  # as FSDP2_WORKER: Gloo's threads sometimes abort the interpreter's teardown
"""


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_a_collective_save_to_a_directory_splits_its_files_among_the_ranks(
    tmp_path: Path,
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(SPLIT_WORKER)
    output = torchrun_two_cpu(script, str(tmp_path), timeout=180)
    assert "rank 0 done" in output and "rank 1 done" in output, output
    for split, single in (("split", "single"), ("tp-split", "tp-single")):
        # bit for bit what one process saving the whole model writes: shards and index
        assert _files(tmp_path / split) == _files(tmp_path / single), split
        # shard i by rank i % 2 (the files rank 1 made have its umask's mode); the index by 0
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / split).iterdir()}
        assert modes == {
            "model-00001-of-00004.safetensors": 0o644,
            "model-00002-of-00004.safetensors": 0o640,
            "model-00003-of-00004.safetensors": 0o644,
            "model-00004-of-00004.safetensors": 0o640,
            "model.safetensors.index.json": 0o644,
        }, split
    # The saves past one rank's file size limit raised on both ranks, and left the old
    # checkpoint (what "single" holds: the new one's values differ) and no temporary (when rank
    # 0 failed, rank 1's files were in it).
    for limited, other in ((1, 0), (0, 1)):
        mine = f"rank {limited}, {limited} limited: {tmp_path / 'split'}: could not be saved"
        assert f"{mine} (File too large); the checkpoint that was there is unchanged" in output
        theirs = f"rank {other}, {limited} limited: the collective save failed on rank {limited}"
        assert f"{theirs} (its error there says why); the checkpoint" in output, output
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "single", "split", "tp-single", "tp-split", "worker.py"
    ]  # fmt: skip


def test_a_data_parallel_model_is_saved_under_its_own_names(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    torchplace.save(nn.DataParallel(model), tmp_path / "w.safetensors")
    saved = read_safetensors(tmp_path / "w.safetensors")
    assert sorted(saved) == ["bias", "weight"]
    assert_same(saved, model.state_dict())


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
@pytest.mark.parametrize("name", ["source.safetensors", "source"])
def test_saving_over_the_checkpoint_a_disk_module_reads_is_refused(
    tmp_path: Path, name: str, mmap: bool
) -> None:
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    torchplace.save(original, tmp_path / name)
    loaded = torchplace.load_into(
        torchplace.skeleton(lambda: copy.deepcopy(original)),
        tmp_path / name,
        device_map={"": "cpu", "1": "disk"},
        mmap=mmap,
    )
    before = {p: (p.read_bytes(), p.stat().st_ino) for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(torchplace.CheckpointError, match=r"(?s)model\.1 .*another path.*move"):
        torchplace.save(loaded, tmp_path / name)
    after = {p: (p.read_bytes(), p.stat().st_ino) for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # nothing written
    x = torch.randn(2, 8)
    assert torch.equal(loaded(x), original(x))  # still reads its checkpoint
    torchplace.save(loaded, tmp_path / "elsewhere.safetensors")
    assert_same(torchplace.load(tmp_path / "elsewhere.safetensors"), original.state_dict())


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("name", ["w.safetensors", "w.pt", "folder"])
def test_a_sparse_tensor_is_refused_before_anything_is_written(tmp_path: Path, name: str) -> None:
    with pytest.raises(torchplace.CheckpointError, match=r"\['s'\] is a sparse_coo.*to_dense"):
        torchplace.save({"w": torch.ones(2), "s": torch.eye(3).to_sparse()}, tmp_path / name)
    model = nn.Linear(2, 2)
    model.register_buffer("s", torch.eye(2).to_sparse_csr())
    with pytest.raises(torchplace.CheckpointError, match=r"model\.s is a sparse_csr.*to_dense"):
        torchplace.save(model, tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_a_path_ending_in_a_slash_is_a_directory(tmp_path: Path) -> None:
    model = nn.Linear(2, 3)
    torchplace.save(model, f"{tmp_path / 'slashdir.pt'}/")
    assert sorted(os.listdir(tmp_path / "slashdir.pt")) == ["model.safetensors"]
    assert_same(torchplace.load(tmp_path / "slashdir.pt"), model.state_dict())
    torchplace.save(model, tmp_path / "file.pt")
    with pytest.raises(torchplace.CheckpointError, match=r"ends in a slash.*remove the file"):
        torchplace.save(model, f"{tmp_path / 'file.pt'}/")


@pytest.mark.parametrize("background", [False, True], ids=["now", "background"])
def test_a_mapping_writes_every_key_and_a_pt_file_keeps_one_tensor_shared(
    tmp_path: Path, background: bool
) -> None:
    model = Tied()
    state = model.state_dict()  # tied: two keys, one storage
    tied = [k for k in state if state[k].data_ptr() == model.embed.weight.data_ptr()]
    assert len(tied) == 2
    for name in ("w.pt", "w.safetensors"):
        saving = torchplace.save(state, tmp_path / name, background=background)
        if saving is not None:
            saving.wait()
        assert_same(torchplace.load(tmp_path / name), state)  # each key written
    loaded = torch.load(tmp_path / "w.pt", weights_only=True)
    assert loaded[tied[0]].data_ptr() == loaded[tied[1]].data_ptr()  # as torch.save keeps it


def test_a_disk_module_reading_a_link_or_another_file_of_the_directory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    (tmp_path / "blobs").mkdir()
    torchplace.save(original, tmp_path / "blobs" / "abc123.safetensors")
    for name, refused in (("model.safetensors", True), ("other.safetensors", False)):
        folder = tmp_path / name.split(".")[0]
        folder.mkdir()
        (folder / name).symlink_to(tmp_path / "blobs" / "abc123.safetensors")
        loaded = torchplace.load_into(
            torchplace.skeleton(lambda: copy.deepcopy(original)),
            folder / name,
            device_map={"": "cpu", "1": "disk"},
        )
        if refused:  # the link is a model file of the folder: the save replaces it
            with pytest.raises(torchplace.CheckpointError, match="another path"):
                torchplace.save(loaded, folder)
        else:  # kept in the new folder as it was
            torchplace.save(loaded, folder)
            assert sorted(os.listdir(folder)) == ["model.safetensors", "other.safetensors"]
        x = torch.randn(2, 8)
        assert torch.equal(loaded(x), original(x))
