"""load_into on sharded models: slices read from the file, and 2 ranks under torchrun (Gloo).

The 2-rank job also checks ``torchplace.distributed.verify``, which needs real ranks.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import torchplace
from helpers import TORCHRUN_VARIABLES, fsdp2_cannot_train_on_cpu, torchrun_two_cpu
from torchplace._errors import CheckpointError
from torchplace.checkpoint import _sharded


def test_a_strided_view_that_is_not_dense_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"every_other": torch.randn(8, 4)[::2]}, path)
    with pytest.raises(CheckpointError, match=r"'every_other'.*saved as a view.*contiguous"):
        _sharded._file_entries(path)


def test_a_legacy_torch_file_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match=r"legacy.*save it again in the zip format") as info:
        _sharded._file_entries(path)
    fixed = tmp_path / "old-zip.pt"
    fix = f"torch.save(torchplace.load({str(path)!r}), {str(fixed)!r})"
    assert fix in str(info.value)
    exec(fix, {"torch": torch, "torchplace": torchplace})  # the fix, as given
    assert list(_sharded._file_entries(fixed)) == ["w"]


def test_an_index_that_names_a_tensor_its_shard_lacks_is_refused(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "s1.safetensors"))
    index = {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}
    (tmp_path / "m.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"says 'b' is in 's1.safetensors'"):
        _sharded._file_entries(tmp_path / "m.index.json")


@pytest.mark.slow
def test_a_plain_model_does_not_take_the_sharded_path(tmp_path: Path) -> None:
    """Nor does it pay for importing DTensor: a process that never imported it has none."""
    assert not _sharded.has_dtensors(torch.nn.Linear(2, 2))
    path = tmp_path / "linear.pt"
    torch.save(torch.nn.Linear(3, 2).state_dict(), path)
    code = (
        "import sys, torch, torchplace\n"
        f"torchplace.load_into(torchplace.skeleton(torch.nn.Linear, 3, 2), {str(path)!r})\n"
        "print('torch.distributed.tensor' in sys.modules)\n"
    )
    env = os.environ | {"PYTHONPATH": str(Path(torchplace.__file__).parent.parent)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert done.stdout.strip() == "False", done.stdout + done.stderr


def test_a_torch_whose_fsdp_has_no_fsdp2_loads_plain_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.distributed.fsdp without FSDPModule (before torch 2.6; importing transformers
    imports it) is a torch without FSDP2 models, not a bare AttributeError."""
    import torch.distributed.fsdp as fsdp
    import torch.distributed.tensor  # imported, as in a process that uses DTensor

    monkeypatch.delattr(fsdp, "FSDPModule")
    assert not _sharded.has_dtensors(torch.nn.Linear(2, 2))
    state = torch.nn.Linear(3, 2).state_dict()
    torch.save(state, tmp_path / "linear.pt")
    model = torchplace.load_into(torchplace.skeleton(torch.nn.Linear, 3, 2), tmp_path / "linear.pt")
    assert torch.equal(model.weight, state["weight"])


class _MeshAt:
    """A 2 x 2 mesh seen from one coordinate (the fake world plays rank 0 only)."""

    def __init__(self, coordinate: tuple[int, int]) -> None:
        self.coordinate = coordinate

    def get_coordinate(self) -> list[int]:
        return list(self.coordinate)

    def size(self, mesh_dim: int) -> int:
        return 2


STRIDED = pytest.mark.skipif(
    not _sharded.strided_shards_readable(),
    reason=f"strided shards are read with torch 2.13 or later (this is {torch.__version__})",
)


def _fsdp2_over_tensor_parallel(hidden: int, out: int) -> tuple[torch.nn.Module, Any]:
    """A 2 x 2 mesh of the fake world: FSDP2 over TP on the same dim (strided shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Linear(hidden, out))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def test_strided_shards_on_a_torch_that_cannot_tell_them_are_refused_untouched(
    fake_world: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before torch 2.13 (played here by hiding what it lacks), the error names the version."""
    from torch.distributed.tensor import placement_types

    monkeypatch.delattr(placement_types, "_StridedShardOffsetMode", raising=False)
    model, _ = _fsdp2_over_tensor_parallel(8, 4)  # torch 2.6 shards FSDP2 over TP evenly only
    path = tmp_path / "m.safetensors"
    save_file({k: torch.ones(v.shape) for k, v in model.state_dict().items()}, str(path))
    with pytest.raises(CheckpointError, match=r"0\.weight is placed as .*_StridedShard") as info:
        torchplace.load_into(model, path)
    assert f"torch 2.13 or later, and this is torch {torch.__version__}" in str(info.value)
    assert "pip install 'torch>=2.13'" in str(info.value)
    assert all(p.is_meta for p in model.parameters())


@STRIDED
def test_fsdp2_over_tensor_parallel_slices_match_dtensor_on_every_rank(fake_world: object) -> None:
    """A 2 x 2 mesh (FSDP2 over TP on the same dim): strided shards of uneven sizes."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    model, mesh = _fsdp2_over_tensor_parallel(10, 7)
    strided = 0
    for name, p in model.named_parameters():
        strided += "_StridedShard" in str(p.placements)
        full = torch.arange(p.numel(), dtype=torch.float32).view(p.shape)
        # Rank 0, as this process is: the very values DTensor gives it.
        shape, pieces = _sharded._pieces(p, name)
        got = torch.full(shape, -1.0)
        for (offsets, lengths), into in pieces:
            index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
            (got[into] if into else got).copy_(full[index])
        expected = distribute_tensor(full, mesh, p.placements, src_data_rank=None)
        assert torch.equal(got, expected.to_local()), (name, p.placements, pieces)
        # Every coordinate: the shape and first offsets DTensor computes for it.
        for coordinate in itertools.product(range(2), range(2)):
            shape, pieces = _sharded._strided_pieces(p, name, p.placements, _MeshAt(coordinate))
            want_shape, want_offsets = _compute_local_shape_and_global_offset(
                p.shape, (2, 2), list(coordinate), p.placements
            )
            assert shape == tuple(want_shape), (name, coordinate)
            assert [box[0] for box, _ in pieces][:1] == [tuple(want_offsets)], (name, coordinate)
    assert strided == 2  # the column-parallel weight and bias


def test_a_sharded_model_is_filled_where_it_is_or_refused_untouched(
    fake_world: object, tmp_path: Path
) -> None:
    """Rank 0 of 4 (fake world): a quarter of each weight, and device= cannot move shards."""
    from torch.distributed.fsdp import fully_shard

    path = tmp_path / "m.safetensors"
    state = {"weight": torch.randn(10, 3), "bias": torch.randn(10)}
    save_file(state, str(path))
    with torch.device("meta"):
        model = torch.nn.Linear(3, 10)
    fully_shard(model, mesh=fake_world)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.weight.to_local().fill_(7.0)
    with pytest.raises(
        CheckpointError,
        match=r"device='meta' holds no data.*leave the device out, "
        r"torchplace\.load_into\(model, source\)",
    ):
        torchplace.load_into(model, path, "meta")
    assert bool((model.weight.to_local() == 7.0).all())
    torchplace.load_into(model, path)
    assert torch.equal(model.weight.to_local(), state["weight"][:3])  # rows 0-2 of 10 on rank 0
    assert torch.equal(model.bias.to_local(), state["bias"][:3])


def test_a_file_cut_short_during_a_sharded_read_is_said_to_have_changed(
    fake_world: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sharded path said "EOFError: the file ends at byte ..." where the plain path says
    the file changed while it was read: a writer truncating it is now named as such."""
    from torch.distributed.fsdp import fully_shard

    from torchplace.checkpoint import _host_read

    path = tmp_path / "m.safetensors"
    save_file({"weight": torch.randn(64, 64), "bias": torch.randn(64)}, str(path))
    with torch.device("meta"):
        model = torch.nn.Linear(64, 64)
    fully_shard(model, mesh=fake_world)
    real = _host_read.pread_exactly

    def cut_first(fd: int, view: memoryview, offset: int) -> None:
        os.truncate(path, 100)  # a writer starts over, mid-load
        real(fd, view, offset)

    monkeypatch.setattr(_host_read, "pread_exactly", cut_first)
    with pytest.raises(CheckpointError, match=r"changed while it was read.*put back as it was"):
        torchplace.load_into(model, path)
    assert model.weight.is_meta and model.bias.is_meta  # the skeleton, as before the load


def _stop_at(monkeypatch: pytest.MonkeyPatch, fraction: float, stop: Any) -> list[float]:
    """``stop()`` runs inside the next sharded fill once ``fraction`` of the bytes of its shards
    are read into them (the reader's progress callback counts them; one reading thread, so
    nothing more is read after it); returns the list it appends the fraction read then to."""
    from torchplace.checkpoint import _host_read, _progress

    monkeypatch.setattr(_host_read, "READ_THREADS", 1)
    reporting = _sharded.reporting
    at: list[float] = []

    @contextlib.contextmanager
    def counted(total: int, label: str, asked: bool | None) -> Iterator[None]:
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            if done >= fraction * total and not at:
                at.append(done / total)
                stop()

        with reporting(total, label, asked):
            token = _progress._CURRENT.set(advance)
            try:
                yield
            finally:
                _progress._CURRENT.reset(token)

    monkeypatch.setattr(_sharded, "reporting", counted)
    return at


def _interrupt() -> None:
    raise KeyboardInterrupt


def _deep(tmp_path: Path, mesh: Any, *, skeleton: bool) -> tuple[torch.nn.Module, Path]:
    """A model of 32 layers sharded over the fake world of 4 (each rank's part of each layer
    about 1/32 of its fill, read as one chunk) and a buffer of 3s read before them, as a
    skeleton or with its parameters' memory set to 7, and its file."""
    from torch.distributed.fsdp import fully_shard

    path = tmp_path / "deep.safetensors"
    state = {f"{i}.weight": torch.randn(16, 16) for i in range(32)} | {"scale": torch.randn(4)}
    save_file(state, str(path))
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(16, 16, bias=False) for _ in range(32)))
    model.register_buffer("scale", torch.full((4,), 3.0))
    fully_shard(model, mesh=mesh)
    if not skeleton:
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(7.0)
            model.scale.fill_(3.0)
    return model, path


def test_a_sharded_strict_false_load_names_the_skipped_keys(
    fake_world: object, tmp_path: Path
) -> None:
    """strict=False over a sharded model names what it skipped in one warning, as data, as the
    plain load does: the file lacks 31.weight and holds a key the model does not take."""
    model, path = _deep(tmp_path, fake_world, skeleton=False)
    state = {f"{i}.weight": torch.randn(16, 16) for i in range(31)} | {"scale": torch.randn(4)}
    save_file(state | {"extra": torch.ones(1)}, str(path))
    with pytest.warns(UserWarning, match=r"strict=False skipped 2 keys") as w:
        torchplace.load_into(model, path, strict=False)
    assert [(x.message.path, x.message.missing, x.message.unexpected) for x in w] == [
        (path, ("31.weight",), ("extra",))
    ]
    assert bool((model[31].weight.to_local() == 7.0).all())  # kept the value it had


def test_a_sharded_fill_interrupted_late_puts_the_skeleton_back(
    fake_world: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt at 90-95% of a skeleton's fill is raised as itself, with every
    parameter back on meta, the very objects, FSDP2 keeping no memory for them, and the
    buffer the fill read first holding its values again."""
    model, path = _deep(tmp_path, fake_world, skeleton=True)
    before = [(id(p), p.placements, p.to_local().shape) for p in model.parameters()]
    at = _stop_at(monkeypatch, 0.9, _interrupt)
    with pytest.raises(KeyboardInterrupt):
        torchplace.load_into(model, path)
    assert 0.9 <= at[0] <= 0.95, at  # the buffer, then 29 of 32 equal chunks
    assert all(p.is_meta for p in model.parameters())
    assert torch.equal(model.scale, torch.full((4,), 3.0))
    assert [(id(p), p.placements, p.to_local().shape) for p in model.parameters()] == before
    assert all(p._sharded_param_data.is_meta for p in _sharded._fsdp_params(model))
    torchplace.load_into(model, path)  # and it loads again
    assert not any(p.is_meta for p in model.parameters())


def test_a_real_sharded_model_interrupted_late_says_it_is_partly_filled(
    fake_world: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards of parameters that had memory are filled in place with no copy kept (it would
    double each rank's memory): a KeyboardInterrupt at 90-95% is raised again as a
    KeyboardInterrupt saying the model is partly filled, on every Python (its buffer is put
    back)."""
    model, path = _deep(tmp_path, fake_world, skeleton=False)
    at = _stop_at(monkeypatch, 0.9, _interrupt)
    with pytest.raises(KeyboardInterrupt) as info:
        torchplace.load_into(model, path)
    assert 0.9 <= at[0] <= 0.95, at
    assert isinstance(info.value, _sharded.LoadInterrupted)
    assert "Sequential is partly filled on this rank" in str(info.value)
    assert type(info.value.__cause__) is KeyboardInterrupt
    still = [bool((p.to_local() == 7.0).all()) for p in model.parameters()]
    assert still == [False] * 29 + [True] * 3, still
    assert torch.equal(model.scale, torch.full((4,), 3.0))


def test_a_same_size_sharded_rewrite_with_its_mtime_put_back_raises(
    fake_world: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sharded reader checks the inode change time too (``touch -r`` after a rewrite)."""
    from torch.distributed.fsdp import fully_shard

    from test_catalog import rewrite_keeping_mtime

    path = tmp_path / "m.safetensors"
    save_file({"weight": torch.randn(64, 64), "bias": torch.randn(64)}, str(path))
    with torch.device("meta"):
        model = torch.nn.Linear(64, 64)
    fully_shard(model, mesh=fake_world)
    done = rewrite_keeping_mtime(monkeypatch, path)
    with pytest.raises(CheckpointError, match=r"changed while it was read.*inode change time"):
        torchplace.load_into(model, path)
    assert done


def test_a_rank_stopped_after_telling_the_others_its_fill_went_through_keeps_it() -> None:
    """A rank stopped (Ctrl-C) as the ranks compare: where it has told the others nothing, it
    tells them it failed (and puts its fill back); where it told them its fill went through,
    it keeps it (they may have kept theirs) and its row stays as posted; where they gave up on
    it, it puts its fill back."""
    import torch.distributed as dist

    from torchplace.checkpoint import _rendezvous

    def meets() -> _rendezvous.Meeting:
        return _rendezvous.Meeting(dist.HashStore(), "t", (0, 1), 0, 1, 10.0)

    stopped = meets()
    assert stopped.own_row() is None
    assert not _sharded._told_filled(stopped, KeyboardInterrupt())
    row = stopped.own_row()
    assert row is not None and row.startswith("1,")  # failed, as the others read it
    assert "KeyboardInterrupt" in stopped.fulls([0])[0]
    filled = meets()
    mine = _sharded._Outcome.of(stamps={})
    assert filled.post(_sharded._row(mine), _sharded._full(mine))
    assert _sharded._told_filled(filled, KeyboardInterrupt())
    assert filled.own_row() == _sharded._row(mine)  # unchanged
    given_up = meets()
    given_up.store.compare_set("t/1/row/0", "", _rendezvous.ABSENT)
    assert not _sharded._told_filled(given_up, KeyboardInterrupt())
    assert given_up.own_row() == _rendezvous.ABSENT


def test_the_ranks_compare_the_inode_change_time_of_each_file(tmp_path: Path) -> None:
    """Two ranks whose stamps differ only in ctime read two versions: their rows differ."""
    from torchplace.checkpoint._entries import Stamp
    from torchplace.checkpoint._sharded import _digest, _Outcome

    p = tmp_path / "m.safetensors"
    first, second = Stamp(8, 1, 2, 3, 4), Stamp(8, 1, 2, 3, 5)
    a, b = _Outcome.of(stamps={p: first}), _Outcome.of(stamps={p: second})
    assert a.stamps != b.stamps
    assert _digest(repr(a.stamps)) != _digest(repr(b.stamps))


class _SelfLoading(torch.nn.Linear):
    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("never called")


def test_a_module_that_loads_itself_is_refused_by_name(fake_world: object, tmp_path: Path) -> None:
    from torch.distributed.fsdp import fully_shard

    path = tmp_path / "m.safetensors"
    save_file({"0.weight": torch.ones(4, 2), "0.bias": torch.ones(4)}, str(path))
    with torch.device("meta"):
        model = torch.nn.Sequential(_SelfLoading(2, 4))
    fully_shard(model, mesh=fake_world)
    with pytest.raises(CheckpointError, match=r"0 \(_SelfLoading\) overrides _load_from"):
        torchplace.load_into(model, path)
    assert model[0].weight.is_meta


# ------------------------------------------------------------------------ 2 ranks, torchrun

WORKER = r"""
import os, sys, traceback
import torch
import torch.distributed as dist
from torch import nn
from safetensors.torch import load_file

import torchplace
from torchplace._errors import CheckpointError
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel, RowwiseParallel, parallelize_module,
)
CANNOT_TRAIN = sys.argv[2] if len(sys.argv) > 2 else None  # why FSDP2 cannot train here

folder = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
reference = load_file(os.path.join(folder, "net.safetensors"))
mlp_reference = load_file(os.path.join(folder, "mlp.safetensors"))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 7)  # 7 rows: uneven over 2 ranks (FSDP2 pads rank 1)
        self.b = nn.Linear(7, 3)  # 3 rows: uneven too
        self.c = nn.Linear(3, 1)  # 1 row: rank 1 holds none of it
        self.register_buffer("scale", torch.ones(3))  # a plain tensor in a sharded model

    def forward(self, x):
        return self.c(self.b(torch.relu(self.a(x))) * self.scale)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(9, 4)
        self.head = nn.Linear(4, 9, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.embed(x))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def fsdp(model):
    for child in list(model.children()):
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tp(model):
    return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def check_equal(model, expected, what):
    names = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, t in names.items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        want = expected[name].to(full.dtype)
        assert torch.equal(full, want), f"{what}: {name} differs"
        if isinstance(t, DTensor):
            local = t.to_local()
            assert local.device.type == "cpu" and not local.is_meta, (name, local.device)
    return names


def train_step(model, x):
    # One SGD step; False, doing nothing, where this torch's FSDP2 cannot run on the CPU
    # (there, the loads alone are checked).
    if CANNOT_TRAIN and isinstance(model, FSDPModule):
        return False
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).float().sum().backward()
    opt.step()
    opt.zero_grad()
    return True


results = []


def case(name):
    def run(fn):
        try:
            fn()
            results.append(f"CASE {name} rank {rank}: ok")
        except Exception:
            trace = traceback.format_exc().replace("\n", " | ")
            results.append(f"CASE {name} rank {rank}: FAIL {trace}")
        return fn
    return run


@case("fsdp2-safetensors-to_empty")
def _():
    with torch.device("meta"):
        model = fsdp(Net())
    model.to_empty(device="cpu")
    torchplace.load_into(model, os.path.join(folder, "net.safetensors"))
    check_equal(model, reference, "loaded")
    if train_step(model, torch.randn(4, 6)):
        stepped = model.a.weight.full_tensor()
        assert not torch.equal(stepped, reference["a.weight"]), "the step changed nothing"


@case("fsdp2-index-after-training-unsharded")
def _():
    torch.manual_seed(1)
    for child in (Net_a := Net()).children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, reshard_after_forward=False)
    model = fully_shard(Net_a, mesh=mesh, reshard_after_forward=False)
    if train_step(model, torch.randn(2, 6)):  # lazy init done: FSDP2's padded storage in use
        model(torch.randn(2, 6))  # and the parameters are left unsharded
    torchplace.load_into(model, os.path.join(folder, "net.index.json"))
    check_equal(model, reference, "loaded")
    train_step(model, torch.randn(4, 6))


@case("fsdp2-torch-zip-skeleton")
def _():
    model = fsdp(torchplace.skeleton(Net))  # meta parameters, real buffer
    torchplace.load_into(model, os.path.join(folder, "net.pt"))
    check_equal(model, reference, "loaded")
    train_step(model, torch.randn(4, 6))


@case("fsdp2-directory-skeleton")
def _():
    # A save_pretrained directory: its index names the shards beside it.
    model = fsdp(torchplace.skeleton(Net))
    torchplace.load_into(model, os.path.join(folder, "pretrained"))
    check_equal(model, reference, "loaded")
    train_step(model, torch.randn(4, 6))


@case("fsdp2-tied-skeleton")
def _():
    tied_reference = load_file(os.path.join(folder, "tied.safetensors"))
    model = torchplace.skeleton(Tied)
    fully_shard(model, mesh=mesh)
    torchplace.load_into(model, os.path.join(folder, "tied.safetensors"))
    assert model.head.weight is model.embed.weight, "the tie is broken"
    full = model.embed.weight.full_tensor()
    assert torch.equal(full, tied_reference["embed.weight"]), "tied weight differs"
    train_step(model, torch.tensor([[1, 2, 3]]))


@case("fsdp2-bf16-file-into-float32")
def _():
    with torch.device("meta"):
        model = fsdp(Net())
    model.to_empty(device="cpu")
    torchplace.load_into(model, os.path.join(folder, "net-bf16.safetensors"))
    expected = {k: v.to(torch.bfloat16).float() for k, v in reference.items()}
    check_equal(model, expected, "loaded")


@case("fsdp2-mapping")
def _():
    with torch.device("meta"):
        model = fsdp(Net())
    model.to_empty(device="cpu")
    torchplace.load_into(model, dict(reference))
    check_equal(model, reference, "loaded")


@case("tp-safetensors")
def _():
    torch.manual_seed(2)
    model = tp(MLP())
    torchplace.load_into(model, os.path.join(folder, "mlp.safetensors"))
    names = check_equal(model, mlp_reference, "loaded")
    assert names["down.weight"].placements[0].dim == 1, "down is not row-wise"
    model(torch.randn(3, 8)).sum().backward()


@case("tp-zip-skeleton")
def _():
    model = tp(torchplace.skeleton(MLP))
    torchplace.load_into(model, os.path.join(folder, "mlp.pt"))
    check_equal(model, mlp_reference, "loaded")
    model(torch.randn(3, 8)).sum().backward()


@case("missing-key")
def _():
    with torch.device("meta"):
        model = fsdp(Net())
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(7.0)
    try:
        torchplace.load_into(model, os.path.join(folder, "net-no-bias.safetensors"))
    except CheckpointError as exc:
        results.append(f"ERROR {exc}")
        assert "missing keys: a.bias" in str(exc), str(exc)
    else:
        raise AssertionError("a missing key loaded")
    for p in model.parameters():
        assert bool((p.to_local() == 7.0).all()), "the model changed"


@case("strict-false-leaves-what-the-file-lacks-on-meta")
def _():
    import warnings

    model = fsdp(torchplace.skeleton(Net))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        torchplace.load_into(model, os.path.join(folder, "net-no-bias.safetensors"), strict=False)
    words = [str(w.message) for w in said if issubclass(w.category, UserWarning)]
    assert any("Net on meta" in w and ": a.bias." in w for w in words), words
    where = [w.filename for w in said if "on meta" in str(w.message)]
    assert where == [__file__], where  # the user's line, not torchplace's
    assert model.a.bias.is_meta, "a parameter the file lacks got uninitialized memory"
    assert "to_empty" not in words[0], words  # a.weight loaded: to_empty would wipe it
    model = fsdp(torchplace.skeleton(Net))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        torchplace.load_into(model, os.path.join(folder, "net-no-c.safetensors"), strict=False)
    (words,) = [str(w.message) for w in said if issubclass(w.category, UserWarning)]
    assert "model.c.to_empty(device='cpu') then model.c.reset_parameters()" in words, words
    model.c.to_empty(device="cpu")  # the fix, as given
    model.c.reset_parameters()
    assert not model.c.weight.is_meta and not model.c.weight.to_local().is_meta
    assert torch.equal(model.a.weight.full_tensor(), reference["a.weight"]), "a.weight wiped"
    train_step(model, torch.randn(2, 6))
    with warnings.catch_warnings():  # where warnings are errors, nothing has been read yet
        warnings.simplefilter("error")
        again = fsdp(torchplace.skeleton(Net))
        lacking = os.path.join(folder, "net-no-bias.safetensors")
        try:
            torchplace.load_into(again, lacking, strict=False)
        except UserWarning:
            pass
        else:
            raise AssertionError("no warning raised as an error")
    assert again.a.weight.is_meta, "the model was filled before the warning"


@case("ddp-prefix-is-named-with-the-rename-that-drops-it")
def _():
    model = fsdp(torchplace.skeleton(Net))
    path = os.path.join(folder, "net-ddp.safetensors")
    try:
        torchplace.load_into(model, path)
    except CheckpointError as exc:
        fix = f'torchplace.load_into(model, {path!r}, rename={{r"^module\\.": ""}})'
        assert fix in str(exc), str(exc)
    else:
        raise AssertionError("a prefixed file loaded")
    torchplace.load_into(model, path, rename={r"^module\.": ""})  # the fix, as given
    check_equal(model, reference, "loaded")
    assert torch.equal(model.a.weight.full_tensor(), reference["a.weight"]), "a.weight differs"
    assert torch.equal(model.b.bias.full_tensor(), reference["b.bias"]), "b.bias differs"


@case("a-failure-on-one-rank-raises-on-every-rank")
def _():
    model = fsdp(torchplace.skeleton(Net))
    path = "net.safetensors" if rank == 0 else "mlp.safetensors"  # rank 1's does not fit
    try:
        torchplace.load_into(model, os.path.join(folder, path))
    except CheckpointError as exc:
        if rank == 0:
            assert "rank 1 could not fill its part of FSDPNet" in str(exc), str(exc)
            assert "missing keys" in str(exc) and "put back as it was" in str(exc), str(exc)
        else:
            assert "missing keys" in str(exc), str(exc)
    else:
        raise AssertionError("a rank loaded while the other failed")
    assert all(p.is_meta for p in model.parameters()), "a rank kept its part of the fill"


@case("a-failure-on-one-rank-raises-on-every-rank-with-fsdp2-unsharded")
def _():
    if CANNOT_TRAIN:  # FSDP2 cannot unshard on this torch's CPU
        return
    model = fsdp(Net())
    model.unshard()  # FSDP2 holds plain tensors now: the ranks still find their mesh
    path = "net.safetensors" if rank == 0 else "mlp.safetensors"
    try:
        torchplace.load_into(model, os.path.join(folder, path))
    except CheckpointError as exc:
        assert rank == 1 or "rank 1 could not fill" in str(exc), str(exc)
    else:
        raise AssertionError("a rank loaded while the other failed")
    model.reshard()


@case("ranks-that-read-two-versions-of-a-file-raise")
def _():
    import shutil
    import time

    from torchplace.checkpoint import _sharded

    path = os.path.join(folder, "net-rewritten.safetensors")
    read_by_0 = os.path.join(folder, "net-rewritten-read-by-0")
    if rank == 0:
        shutil.copy(os.path.join(folder, "net.safetensors"), path)
    dist.barrier()
    model = fsdp(torchplace.skeleton(Net))
    fill = _sharded._fill_sharded
    if rank == 0:  # says so once its fill has read the file (and taken its stamp)

        def filled_then_said(*args, **kwargs):
            read = fill(*args, **kwargs)
            open(read_by_0, "w").close()
            return read

        _sharded._fill_sharded = filled_then_said
    if rank == 1:  # rank 0 has read it and waits to compare: now "rewrite" it, then read
        end = time.monotonic() + 60  # however long rank 0 takes to read it; fails a hang
        while not os.path.exists(read_by_0):
            assert time.monotonic() < end, "rank 0 never said it read the file"
            time.sleep(0.01)
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        torchplace.load_into(model, path)
    except CheckpointError as exc:
        assert "the ranks read different versions of it" in str(exc), str(exc)
        assert "mixes two checkpoints" in str(exc), str(exc)
    else:
        raise AssertionError("ranks that read two versions loaded")
    finally:
        _sharded._fill_sharded = fill


@case("ranks-given-two-checkpoints-raise-and-one-file-spelt-two-ways-loads")
def _():
    import shutil

    copy = os.path.join(folder, "net-copy.safetensors")
    if rank == 0:
        shutil.copy(os.path.join(folder, "net.safetensors"), copy)
    dist.barrier()
    model = fsdp(torchplace.skeleton(Net))
    # each rank filled its shards from its own file, and a model from two checkpoints would
    # mix them without a word: a copy cannot be told from another checkpoint unread
    path = os.path.join(folder, "net.safetensors") if rank == 0 else copy
    try:
        torchplace.load_into(model, path)
    except CheckpointError as exc:
        assert "the ranks of its mesh on one machine read different files (rank 0 read" in str(
            exc
        )
        assert "net-copy.safetensors" in str(exc) and "Every rank raises" in str(exc), str(exc)
        assert "cannot tell without reading both" in str(exc), str(exc)
    else:
        raise AssertionError("ranks given two checkpoints loaded")
    model = fsdp(torchplace.skeleton(Net))
    spelt = "net.safetensors" if rank == 0 else os.path.join(".", "net.safetensors")
    here = os.getcwd()
    os.chdir(folder)
    try:
        torchplace.load_into(model, spelt)  # one file, however each rank spells it
    finally:
        os.chdir(here)
    check_equal(model, reference, "loaded")


@case("wrong-shape")
def _():
    model = fsdp(torchplace.skeleton(Net))
    try:
        torchplace.load_into(model, os.path.join(folder, "net-wide.safetensors"))
    except CheckpointError as exc:
        assert "shape mismatches: a.weight: file (7, 5), model (7, 6)" in str(exc), str(exc)
    else:
        raise AssertionError("a mis-shaped file loaded")
    try:
        torchplace.load_into(model, os.path.join(folder, "mlp.safetensors"))
    except CheckpointError as exc:
        assert "missing keys: scale, a.weight" in str(exc), str(exc)
        assert "unexpected keys: down.bias, down.weight" in str(exc), str(exc)
    else:
        raise AssertionError("a foreign file loaded")
    assert model.a.weight.is_meta, "the model changed"


@case("verify-names-stragglers-by-rank")
def _():
    import torchplace.distributed
    from torchplace._errors import DeviceSpecError, PlacementError

    model = Net()
    torchplace.distributed.verify(model, "cpu")  # every rank in place: every rank returns
    if rank == 1:
        model.scale = torch.empty(3, device="meta")
    pair = dist.new_group([0, 1])
    try:
        torchplace.distributed.verify(model, "cpu", group=pair)
    except PlacementError as exc:
        results.append(f"ERROR {exc}")
        assert "rank 1: scale (buffer) is on meta" in str(exc), str(exc)
        assert "rank 0" not in str(exc), str(exc)
    else:
        raise AssertionError("a straggler on rank 1 passed")
    try:  # rank 0's own check fails: rank 1 must not hang, and both raise the same error
        torchplace.distributed.verify(Net(), "cdua" if rank == 0 else "cpu")
    except DeviceSpecError as exc:
        results.append(f"ERROR {exc}")
        assert "rank 0: the check itself failed: DeviceSpecError" in str(exc), str(exc)
    else:
        raise AssertionError("a failed check passed")


with open(os.path.join(folder, f"results-{rank}.txt"), "w") as f:
    f.write("\n".join(results))
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""

CASES = (
    "fsdp2-safetensors-to_empty",
    "fsdp2-index-after-training-unsharded",
    "fsdp2-torch-zip-skeleton",
    "fsdp2-directory-skeleton",
    "fsdp2-tied-skeleton",
    "fsdp2-bf16-file-into-float32",
    "fsdp2-mapping",
    "tp-safetensors",
    "tp-zip-skeleton",
    "missing-key",
    "strict-false-leaves-what-the-file-lacks-on-meta",
    "ddp-prefix-is-named-with-the-rename-that-drops-it",
    "a-failure-on-one-rank-raises-on-every-rank",
    "a-failure-on-one-rank-raises-on-every-rank-with-fsdp2-unsharded",
    "ranks-that-read-two-versions-of-a-file-raise",
    "wrong-shape",
    "verify-names-stragglers-by-rank",
)


def _checkpoints(folder: Path) -> None:
    torch.manual_seed(0)
    net = {
        "a.weight": torch.randn(7, 6),
        "a.bias": torch.randn(7),
        "b.weight": torch.randn(3, 7),
        "b.bias": torch.randn(3),
        "c.weight": torch.randn(1, 3),
        "c.bias": torch.randn(1),
        "scale": torch.randn(3),
    }
    save_file(net, str(folder / "net.safetensors"))
    save_file(
        {k: v.to(torch.bfloat16) for k, v in net.items()}, str(folder / "net-bf16.safetensors")
    )
    save_file(
        {k: v for k, v in net.items() if k != "a.bias"}, str(folder / "net-no-bias.safetensors")
    )
    save_file(net | {"a.weight": torch.randn(7, 5)}, str(folder / "net-wide.safetensors"))
    save_file({f"module.{k}": v for k, v in net.items()}, str(folder / "net-ddp.safetensors"))
    no_c = {k: v for k, v in net.items() if not k.startswith("c.")}
    save_file(no_c, str(folder / "net-no-c.safetensors"))
    torch.save(net, folder / "net.pt")
    first = {k: net[k] for k in ("a.weight", "scale")}
    second = {k: net[k] for k in ("a.bias", "b.weight", "b.bias", "c.weight", "c.bias")}
    save_file(first, str(folder / "net-1.safetensors"))
    save_file(second, str(folder / "net-2.safetensors"))
    weight_map = dict.fromkeys(first, "net-1.safetensors") | dict.fromkeys(
        second, "net-2.safetensors"
    )
    (folder / "net.index.json").write_text(json.dumps({"weight_map": weight_map}))
    pretrained = folder / "pretrained"  # as save_pretrained writes a sharded model
    pretrained.mkdir()
    save_file(first, str(pretrained / "model-00001-of-00002.safetensors"))
    save_file(second, str(pretrained / "model-00002-of-00002.safetensors"))
    names = dict.fromkeys(first, "model-00001-of-00002.safetensors") | dict.fromkeys(
        second, "model-00002-of-00002.safetensors"
    )
    index = {"metadata": {"total_size": 0}, "weight_map": names}
    (pretrained / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"embed.weight": torch.randn(9, 4)}, str(folder / "tied.safetensors"))
    mlp = {
        "up.weight": torch.randn(16, 8),
        "up.bias": torch.randn(16),
        "down.weight": torch.randn(8, 16),
        "down.bias": torch.randn(8),
    }
    save_file(mlp, str(folder / "mlp.safetensors"))
    torch.save(mlp, folder / "mlp.pt")


@pytest.mark.slow
def test_two_ranks_fill_fsdp2_and_tensor_parallel_models_bit_for_bit(tmp_path: Path) -> None:
    _checkpoints(tmp_path)
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    # Where FSDP2 cannot train on the CPU (torch 2.6), the workers check the loads only.
    cannot = fsdp2_cannot_train_on_cpu()
    output = torchrun_two_cpu(script, str(tmp_path), *([cannot] if cannot else []), timeout=180)
    lines = [(tmp_path / f"results-{rank}.txt").read_text().splitlines() for rank in (0, 1)]
    failures = [line for found in lines for line in found if "FAIL" in line]
    assert not failures, "\n".join(failures)
    for name in CASES:
        for rank in (0, 1):
            assert f"CASE {name} rank {rank}: ok" in lines[rank], output
    errors = [[line for line in found if line.startswith("ERROR")] for found in lines]
    assert errors[0] == errors[1] and len(errors[0]) == 3, errors  # the same errors on each rank


# ------------------------------------- 2 ranks where one stops: the others fail in bounded time

STOPPING = r"""
import contextlib, os, signal, sys, time
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import torchplace
from torchplace.checkpoint import _host_read, _progress, _sharded

folder, scenario = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_*: rank 0 holds the store
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
bound = float(os.environ["TORCHPLACE_COMPARE_TIMEOUT"])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 7)
        self.b = nn.Linear(7, 3)


def say(text):
    with open(os.path.join(folder, f"said-{rank}.txt"), "a") as f:
        f.write(text.replace("\n", " | ") + "\n")


def build():
    model = torchplace.skeleton(Net)
    fully_shard(model, mesh=mesh)
    return model


def load(model=None, name="net.safetensors"):
    model = model or build()
    began = time.monotonic()
    try:
        torchplace.load_into(model, os.path.join(folder, name))
    except BaseException as exc:
        say(f"{type(exc).__name__} after {time.monotonic() - began:.0f} s: {exc}")
    else:
        say(f"loaded after {time.monotonic() - began:.0f} s")


def during_fill(action):  # ``action`` runs on this rank inside load_into, before the compare
    fill = _sharded._fill_sharded

    def acting(*args, **kwargs):
        action()
        return fill(*args, **kwargs)

    _sharded._fill_sharded = acting


def interrupt():  # a real SIGINT, as Ctrl-C in a notebook: KeyboardInterrupt in the sleep
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)


def at_fraction(action, fraction=0.9):
    # ``action`` runs inside this rank's next fill, once ``fraction`` of the bytes of its shards
    # are read into them: the reader's progress callback counts them, and reads on the calling
    # thread (one thread), so nothing more is read after the action.
    _host_read.READ_THREADS = 1
    reporting = _sharded.reporting

    @contextlib.contextmanager
    def counted(total, label, asked):
        done = 0

        def advance(n):
            nonlocal done
            done += n
            if done >= fraction * total and _sharded.reporting is counted:
                _sharded.reporting = reporting  # once: the next load reads to the end
                say(f"interrupted at {done / total:.3f} of the fill")
                action()

        with reporting(total, label, asked):
            token = _progress._CURRENT.set(advance)
            try:
                yield
            finally:
                _progress._CURRENT.reset(token)

    _sharded.reporting = counted


def raise_interrupt():
    raise KeyboardInterrupt


class Deep(nn.Module):  # each rank's part of each layer is about 1/32 of its fill, one chunk
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 3.0))  # real in a skeleton, read first
        self.layers = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(32))
        self.register_buffer("steps", torch.arange(4.0), persistent=False)  # not in the file


def held(model):  # each tensor's object, class, dtype, shapes, device, placements and bits
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        local = t.to_local() if isinstance(t, DTensor) else t
        bits = None if local.is_meta else local.detach().clone().view(torch.uint8)
        where = (str(local.device), tuple(local.shape), getattr(t, "placements", None))
        out[name] = (id(t), type(t).__name__, t.dtype, tuple(t.shape), where, bits)
    return out


def differences(before, after):  # the tensors ``after`` holds unlike ``before``, bit for bit
    if before.keys() != after.keys():
        return f"names {sorted(before.keys() ^ after.keys())}"
    wrong = []
    for name, (*kind, bits) in before.items():
        *now, now_bits = after[name]
        same_bits = (bits is None) == (now_bits is None)
        if same_bits and bits is not None:
            same_bits = torch.equal(bits, now_bits)
        if kind != now or not same_bits:
            wrong.append(f"{name}: {kind[2:5]} -> {now[2:5]}")
    return "; ".join(wrong)


def fsdp_memory(model):  # the devices of FSDP2's own record of each sharded parameter's data
    state = model._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
    return {str(p._sharded_param_data.device) for g in groups for p in g.fsdp_params}


def interrupted_late(action):
    # Rank 1 interrupted at 90-95% of its fill of a skeleton: each rank says what it raised,
    # whether its model holds what it held before, bit for bit, then loads again.
    model = torchplace.skeleton(Deep)
    fully_shard(model, mesh=mesh)
    before = held(model)
    if rank == 1:
        at_fraction(action)
    load(model, "deep.safetensors")
    say(f"held before: {differences(before, held(model)) or 'all'}")
    say(f"FSDP2 keeps its shards on {sorted(fsdp_memory(model))}")
    load(model, "deep.safetensors")
    file = load_file(os.path.join(folder, "deep.safetensors"))
    loaded = {n: p.full_tensor() for n, p in model.named_parameters()} | {"scale": model.scale}
    say(f"differs from the file: {[n for n, t in loaded.items() if not torch.equal(t, file[n])]}")


def die_once_rank_1_fills():
    while not os.path.exists(os.path.join(folder, "filling-1")):
        time.sleep(0.05)
    time.sleep(0.2)
    os._exit(3)


if scenario == "store-host-killed" and rank == 1:
    during_fill(lambda: open(os.path.join(folder, "filling-1"), "w").close())
late = 1 if scenario != "store-host-killed" else 0
if rank == late:
    if scenario == "interrupted":
        during_fill(interrupt)
    elif scenario == "killed":
        during_fill(lambda: os._exit(3))
    elif scenario == "store-host-killed":  # once the other rank is filling or comparing
        during_fill(die_once_rank_1_fills)
    elif scenario == "slow":
        during_fill(lambda: time.sleep(2.5 * bound))
if scenario == "absent" and rank == 1:  # never calls load_into, until rank 0 calls it again
    model = build()
    while not os.path.exists(os.path.join(folder, "again")):
        time.sleep(0.05)
elif scenario == "late-raised":  # KeyboardInterrupt raised from inside rank 1's fill
    interrupted_late(raise_interrupt)
elif scenario == "late-signalled":  # a real SIGINT from inside rank 1's fill, as Ctrl-C
    interrupted_late(interrupt)
else:
    load()
if scenario == "absent" and rank == 0:  # rank 1 calls again once this rank's next round began
    from torchplace.checkpoint import _rendezvous

    raise_latest = _rendezvous._raise_latest

    def raised_then_said(store, key, round_):  # the round a late rank moves on to
        raise_latest(store, key, round_)
        open(os.path.join(folder, "again"), "w").close()

    _rendezvous._raise_latest = raised_then_said
    load()
if scenario == "absent" and rank == 1:
    load(model)
if scenario in ("absent", "slow", "late-raised", "late-signalled"):  # rank 0's store outlives
    dist.barrier()  # rank 1's last look at it
say("done")
time.sleep(0 if scenario != "interrupted" else 600)  # an interrupted notebook lives on
os._exit(0)
"""


def _two_ranks_where_one_stops(folder: Path, scenario: str, timeout: float = 60) -> list[str]:
    """Run STOPPING on two processes (Gloo, rank 0 holding the store) until each surviving rank
    said "done"; what each said (a list per rank). Fails the test on a hang."""
    import socket
    import time

    save_file(
        {
            "a.weight": torch.randn(7, 6),
            "a.bias": torch.randn(7),
            "b.weight": torch.randn(3, 7),
            "b.bias": torch.randn(3),
        },
        str(folder / "net.safetensors"),
    )
    script = folder / "stopping.py"
    script.write_text(STOPPING)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env |= {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    env |= {"TORCHPLACE_COMPARE_TIMEOUT": "4", "GLOO_SOCKET_IFNAME": "lo"}
    env["PYTHONPATH"] = str(Path(torchplace.__file__).parent.parent)
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(folder), scenario],
            env=env | {"RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]
    said = [folder / f"said-{rank}.txt" for rank in (0, 1)]
    killed = {"killed": 1, "store-host-killed": 0}.get(scenario)
    deadline = time.monotonic() + timeout
    alive = [r for r in (0, 1) if r != killed]
    try:
        while time.monotonic() < deadline:
            if all(said[r].exists() and "done" in said[r].read_text() for r in alive):
                break
            time.sleep(0.1)
    finally:
        for process in ranks:
            process.kill()
        output = b"".join(process.communicate()[0] for process in ranks).decode(errors="replace")
    lines = [p.read_text().splitlines() if p.exists() else [] for p in said]
    if not all("done" in lines[r] for r in alive):
        pytest.fail(f"{scenario}: a surviving rank did not finish in {timeout} s: {lines} {output}")
    assert killed is None or ranks[killed].returncode == 3, output
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["interrupted", "killed"])
def test_a_rank_that_stops_in_a_sharded_load_fails_the_other_with_checkpoint_error(
    tmp_path: Path, scenario: str
) -> None:
    """Interrupted (its process lives on, as a notebook's) or killed: the other rank raises
    ``CheckpointError`` naming it and saying its own skeleton is put back as it was, instead
    of waiting for the process group's timeout or raising Gloo's own error."""
    said = _two_ranks_where_one_stops(tmp_path, scenario)
    (first, done) = said[0]
    assert done == "done", said
    assert first.startswith("CheckpointError after "), said
    assert "rank 1" in first and "back as it was: load it again" in first, said
    if scenario == "interrupted":
        # its own interrupt, not an error of waiting (the seconds it took are this machine's)
        interrupted, done_1 = said[1]
        assert re.fullmatch(r"KeyboardInterrupt after \d+ s: ", interrupted), said
        assert done_1 == "done", said


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raised", "signalled"])
def test_a_rank_interrupted_late_in_its_fill_puts_every_rank_back_as_it_was(
    tmp_path: Path, how: str
) -> None:
    """Rank 1 is interrupted once 90-95% of its shards are read (a KeyboardInterrupt raised,
    or a real SIGINT sent, from inside its fill): it raises KeyboardInterrupt, rank 0 raises
    ``CheckpointError`` naming rank 1 and its interrupt, and on both ranks the skeleton holds
    what it held before, bit for bit (its parameters back on meta, the same objects, FSDP2
    keeping no memory for them; its real buffers' values, one of them read before the
    interrupt, as they were). Then both load it again."""
    torch.manual_seed(0)
    deep = {f"layers.{i}.weight": torch.randn(16, 16) for i in range(32)}
    deep["scale"] = torch.randn(4)
    save_file(deep, str(tmp_path / "deep.safetensors"))
    said = _two_ranks_where_one_stops(tmp_path, f"late-{how}")
    interrupted, *rest = said[1]
    assert interrupted.startswith("interrupted at "), said
    assert 0.9 <= float(interrupted.split()[2]) <= 0.95, said  # the buffer, 28 of 32 layers
    assert re.fullmatch(r"KeyboardInterrupt after \d+ s: ", rest[0]), said
    first = said[0][0]
    assert re.match(r"CheckpointError after \d+ s: rank 1 could not fill its part of", first), said
    assert "FSDPDeep (rank 1: KeyboardInterrupt)" in first, said
    assert "put back as it was" in first and "partly filled" not in first, said
    for lines in (said[0][1:], rest[1:]):
        assert lines[0] == "held before: all", said
        assert lines[1] == "FSDP2 keeps its shards on ['meta']", said
        assert lines[2].startswith("loaded after "), said
        assert lines[3:] == ["differs from the file: []", "done"], said


@pytest.mark.slow
def test_a_rank_that_never_arrives_is_named_after_the_bound_and_the_next_load_agrees(
    tmp_path: Path,
) -> None:
    """Rank 1 skips a load: rank 0 raises naming it once it has not arrived within
    TORCHPLACE_COMPARE_TIMEOUT (4 s here); then both load again, and both succeed."""
    said = _two_ranks_where_one_stops(tmp_path, "absent")
    assert said[0][0].startswith("CheckpointError after "), said
    assert "rank 1 did not arrive within 4 s" in said[0][0], said
    assert "this rank filled its shards" in said[0][0], said
    assert "this rank puts FSDPNet back as it was" in said[0][0], said
    assert said[0][1].startswith("loaded after ") and said[0][2] == "done", said
    assert said[1][0].startswith("loaded after ") and said[1][1] == "done", said


@pytest.mark.slow
def test_the_rank_holding_the_store_killed_fails_the_other_with_checkpoint_error(
    tmp_path: Path,
) -> None:
    said = _two_ranks_where_one_stops(tmp_path, "store-host-killed")
    (first, done) = said[1]
    assert done == "done" and first.startswith("CheckpointError after "), said
    assert "this rank filled its shards" in first and "rank 0" in first, said
    assert "back as it was" in first, said


@pytest.mark.slow
def test_a_slow_rank_that_is_alive_is_waited_for(tmp_path: Path) -> None:
    """Rank 1 fills 10 s longer than rank 0, over twice the bound: still working, so waited
    for (the bound counts from its last sign of life, not from rank 0's arrival)."""
    said = _two_ranks_where_one_stops(tmp_path, "slow")
    assert said[0][0].startswith("loaded after ") and said[1][0].startswith("loaded after "), said


@pytest.mark.parametrize("text", ["abc", "0", "-3", "inf", "nan"])
def test_a_compare_timeout_that_is_not_seconds_is_named(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    from torchplace.checkpoint import _rendezvous

    monkeypatch.setenv("TORCHPLACE_COMPARE_TIMEOUT", text)
    with pytest.raises(CheckpointError, match=rf"TORCHPLACE_COMPARE_TIMEOUT='{text}': expected"):
        _rendezvous.compare_timeout()
    monkeypatch.setenv("TORCHPLACE_COMPARE_TIMEOUT", " 2.5 ")
    assert _rendezvous.compare_timeout() == 2.5
    monkeypatch.delenv("TORCHPLACE_COMPARE_TIMEOUT")
    assert _rendezvous.compare_timeout() == _rendezvous.DEFAULT_TIMEOUT == 10.0


_NO_STORE = """
import socket, warnings
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import init_device_mesh
from torchplace.checkpoint import _sharded

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
assert _sharded._meeting_of(object(), mesh) is not None  # the store is there: a meeting
del distributed_c10d._get_default_store
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert _sharded._meeting_of(object(), mesh) is None
print([str(w.message) for w in caught])
"""


@pytest.mark.slow
def test_a_torch_without_the_store_says_the_ranks_did_not_compare() -> None:
    # Should a torch drop the private accessor of the process group's store, the comparison is
    # skipped with a warning, never silently. (A subprocess: it initialises a Gloo group.)
    done = subprocess.run(
        [sys.executable, "-c", _NO_STORE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ranks did not compare their loads" in done.stdout, done.stdout


def test_a_channels_last_one_by_one_convolution_beside_shards_is_filled(
    fake_world: Any, tmp_path: Path
) -> None:
    """A plain tensor in a sharded model is read whole; a 1x1 convolution's weight in
    channels_last is contiguous by torch's rule (its size-1 dims are not checked) though its
    last stride is not 1: the one-run read took a dtype view of it, which torch refuses."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(4, 4), nn.Conv2d(8, 16, 1))
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in saved.state_dict().items()}, str(path))
    model = nn.Sequential(nn.Linear(4, 4), nn.Conv2d(8, 16, 1))
    model[1].to(memory_format=torch.channels_last)
    fully_shard(model[0], mesh=fake_world)
    weight = model[1].weight
    assert weight.is_contiguous() and weight.stride(-1) != 1  # the case: contiguous, odd stride
    torchplace.load_into(model, path)
    assert model[1].weight is weight and weight.stride() == (8, 1, 8, 8)
    assert torch.equal(weight, saved[1].weight) and torch.equal(model[1].bias, saved[1].bias)
    assert torch.equal(model[0].weight.to_local(), saved[0].weight.detach()[:1])  # rank 0 of 4


def test_a_sharded_fill_says_what_rename_did_to_the_keys(
    fake_world: object, tmp_path: Path
) -> None:
    """The sharded fill's key errors speak of the keys as ``rename=`` gave them, as the plain
    fill's do: a rename that drops every key is said so, and a hint changes that rename."""
    from torch.distributed.fsdp import fully_shard

    path = tmp_path / "m.safetensors"
    save_file({"weight": torch.randn(10, 3), "bias": torch.randn(10)}, str(path))
    with torch.device("meta"):
        model = torch.nn.Linear(3, 10)
    fully_shard(model, mesh=fake_world)
    model.to_empty(device="cpu")
    with pytest.raises(CheckpointError, match=r"rename= dropped all 2 of the file's keys"):
        torchplace.load_into(model, path, rename=lambda k: None)
    with pytest.raises(
        CheckpointError,
        match=r"unexpected keys \(as rename= names them\): x\.bias, x\.weight; .*have the "
        r"rename= given drop it too",
    ):
        torchplace.load_into(model, path, rename=lambda k: "x." + k)
