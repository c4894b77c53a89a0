"""The data errors carry besides their message, at the public entry points that raise them.

Programs read ``err.path``, ``err.missing``, ``err.stragglers``, ``err.name`` (docs/design.md,
"Errors"; STYLE.md 10), so each test makes a real failure through the public API and asserts
the class and the data, not the wording; and every error is pickled on the way (errors cross
processes: a worker's result, torch.multiprocessing) and must come back with its data. The
wording is matched only where it is itself the contract (the entry point's name that a
``prefixed`` re-raise puts in front). Organised by error class.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch import nn

import torchplace
from helpers import TORCHRUN_VARIABLES
from torchplace import CheckpointError, MoveError, PlacementError, TorchplaceError
from torchplace._errors import prefixed
from torchplace.checkpoint._catalog import describe_file
from torchplace.checkpoint._checkpoint_cli import remap
from torchplace.checkpoint._entries import FileChanged

# Every attribute an error of the tree carries as data.
DATA = ("path", "missing", "unexpected", "mismatched", "stragglers", "name", "changes")


def data_of(err: BaseException) -> dict[str, Any]:
    return {attr: getattr(err, attr) for attr in DATA if hasattr(err, attr)}


E = TypeVar("E", bound=TorchplaceError)


def pickled(err: E) -> E:
    """``err`` back from pickling, checked to be of its class with its message and data."""
    back: E = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and back.args == err.args
    assert data_of(back) == data_of(err)
    return back


def raised(cls: type[TorchplaceError], call: Callable[[], object]) -> Any:
    """The ``cls`` that ``call`` raises (pickled and back, so its data crosses processes)."""
    with pytest.raises(cls) as info:
        call()
    return pickled(info.value)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """An ``mlp()``'s state dict, saved with torch.save."""
    path = tmp_path / "m.pt"
    torch.save(mlp().state_dict(), path)
    return path


@pytest.fixture
def on_disk(saved: Path) -> nn.Module:
    """An ``mlp()`` loaded from ``saved`` with its last layer left on disk."""
    skeleton = torchplace.skeleton(mlp)
    return torchplace.load_into(skeleton, saved, device_map={"": "cpu", "2": "disk"})


# --- CheckpointError: load() -------------------------------------------------------------------


class _RunsCode:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("unpickled",))


def test_load_of_a_plain_pickle_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "plain.pkl"
    path.write_bytes(pickle.dumps({"w": [1, 2]}))
    err = raised(CheckpointError, lambda: torchplace.load(path))
    assert err.path == path
    assert (err.missing, err.unexpected, err.mismatched) == ((), (), ())


def test_load_refusing_to_run_code_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"evil": _RunsCode()}, path)
    assert raised(CheckpointError, lambda: torchplace.load(path)).path == path


def test_load_of_a_whole_model_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "whole.pt"
    torch.save(mlp(), path)
    assert raised(CheckpointError, lambda: torchplace.load(path)).path == path


def test_load_of_a_cut_safetensors_file_names_it(tmp_path: Path) -> None:
    save_file = pytest.importorskip("safetensors.torch").save_file
    whole, cut = tmp_path / "whole.safetensors", tmp_path / "cut.safetensors"
    save_file({"w": torch.ones(4)}, str(whole))
    cut.write_bytes(whole.read_bytes()[:-4])
    assert raised(CheckpointError, lambda: torchplace.load(cut)).path == cut


def test_load_of_a_safetensors_file_with_overlapping_tensors_names_it(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(12))
    assert raised(CheckpointError, lambda: torchplace.load(path)).path == path


def test_load_of_an_index_whose_shard_lacks_a_tensor_names_the_index(tmp_path: Path) -> None:
    save_file = pytest.importorskip("safetensors.torch").save_file
    save_file({"a": torch.ones(2)}, str(tmp_path / "s1.safetensors"))
    index = tmp_path / "m.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "zz": "s1.safetensors"}}))
    assert raised(CheckpointError, lambda: torchplace.load(index)).path == index


def test_load_of_an_index_that_is_not_json_names_it(tmp_path: Path) -> None:
    index = tmp_path / "m.index.json"
    index.write_text("{not json")
    assert raised(CheckpointError, lambda: torchplace.load(index)).path == index


def test_load_of_json_that_is_no_index_names_it(tmp_path: Path) -> None:
    index = tmp_path / "m.index.json"
    index.write_text(json.dumps({"metadata": {}}))
    assert raised(CheckpointError, lambda: torchplace.load(index)).path == index


def _empty(tmp_path: Path) -> Path:
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    return path


def _text(tmp_path: Path) -> Path:
    path = tmp_path / "notes.pt"
    path.write_text("these are notes, not tensors")
    return path


def _cut_zip(tmp_path: Path) -> Path:
    whole, cut = tmp_path / "whole.pt", tmp_path / "cut.pt"
    torch.save(mlp().state_dict(), whole)
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    return cut


def _empty_directory(tmp_path: Path) -> Path:
    path = tmp_path / "nothing"
    path.mkdir()
    return path


@pytest.mark.parametrize(
    "make",
    [lambda d: d / "absent.pt", _empty, _text, _cut_zip, _empty_directory],
    ids=["absent", "empty", "not-a-checkpoint", "cut-zip", "empty-directory"],
)
def test_load_of_an_unreadable_file_names_it(tmp_path: Path, make: Callable[[Path], Path]) -> None:
    path = make(tmp_path)
    assert raised(CheckpointError, lambda: torchplace.load(path)).path == path


# --- CheckpointError: load_into() --------------------------------------------------------------


def test_load_into_a_model_of_other_shapes_lists_the_mismatched(saved: Path) -> None:
    wider = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 4))
    err = raised(CheckpointError, lambda: torchplace.load_into(wider, saved))
    assert err.path == saved
    assert err.mismatched == ("0.weight", "0.bias", "2.weight")
    assert (err.missing, err.unexpected) == ((), ())


def test_load_into_lists_the_missing_and_unexpected_keys(tmp_path: Path) -> None:
    path = tmp_path / "partial.pt"
    state = mlp().state_dict()
    state["extra"] = state.pop("2.bias")
    torch.save(state, path)
    err = raised(CheckpointError, lambda: torchplace.load_into(mlp(), path))
    assert (err.path, err.missing, err.unexpected, err.mismatched) == (
        path,
        ("2.bias",),
        ("extra",),
        (),
    )


def test_load_into_with_strict_false_and_nothing_matching_lists_both_sides(
    tmp_path: Path,
) -> None:
    path = tmp_path / "other.pt"
    torch.save({"encoder.weight": torch.ones(4, 4)}, path)
    err = raised(CheckpointError, lambda: torchplace.load_into(mlp(), path, strict=False))
    assert err.path == path
    assert err.missing == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert err.unexpected == ("encoder.weight",)


def test_load_into_from_a_state_dict_has_no_path_but_the_keys() -> None:
    state = mlp().state_dict()
    del state["0.bias"]
    err = raised(CheckpointError, lambda: torchplace.load_into(mlp(), state))
    assert err.path is None
    assert err.missing == ("0.bias",) and err.unexpected == ()


def test_load_into_of_a_nested_dict_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "trainer.pt"
    torch.save({"model": mlp().state_dict(), "step": 3}, path)
    assert raised(CheckpointError, lambda: torchplace.load_into(mlp(), path)).path == path


def _raises_key_error(key: str) -> str:
    raise KeyError(key)


@pytest.mark.parametrize(
    "rename",
    [_raises_key_error, lambda key: "same", lambda key: 3],
    ids=["raises", "two-to-one", "not-a-str"],
)
def test_load_into_with_a_failing_rename_names_the_file(
    saved: Path, rename: Callable[[str], Any]
) -> None:
    err = raised(CheckpointError, lambda: torchplace.load_into(mlp(), saved, rename=rename))
    assert err.path == saved


def test_load_into_by_a_device_map_keeps_the_data_through_its_prefix(saved: Path) -> None:
    deeper = nn.Sequential(*mlp(), nn.Linear(4, 4))
    err = raised(
        CheckpointError, lambda: torchplace.load_into(deeper, saved, device_map={"": "cpu"})
    )
    assert str(err).startswith("load_into(): ")  # the prefix names the entry point
    assert (err.path, err.missing, err.unexpected) == (saved, ("3.weight", "3.bias"), ())


# --- CheckpointError: a disk-offloaded model's file, remap, inspect ----------------------------


def test_a_disk_module_whose_file_is_gone_names_it(saved: Path, on_disk: nn.Module) -> None:
    saved.unlink()
    with torch.no_grad():
        err = raised(CheckpointError, lambda: on_disk(torch.ones(1, 4)))
    assert err.path == saved


def test_a_disk_module_whose_file_changed_says_what_changed(
    saved: Path, on_disk: nn.Module
) -> None:
    torch.save({k: v + 1 for k, v in mlp().state_dict().items()}, saved)
    with torch.no_grad():
        err = raised(FileChanged, lambda: on_disk(torch.ones(1, 4)))
    assert err.path == saved
    assert err.changes and all(isinstance(change, str) for change in err.changes)


def test_remap_of_a_file_that_runs_code_names_it(tmp_path: Path) -> None:
    src = tmp_path / "evil.pt"
    torch.save({"evil": _RunsCode()}, src)
    err = raised(CheckpointError, lambda: remap(src, tmp_path / "out.pt", to="cpu"))
    assert err.path == src


def test_remap_into_a_missing_directory_names_the_output(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "no" / "out.pt"
    assert raised(CheckpointError, lambda: remap(saved, out, to="cpu")).path == out


def test_remap_over_an_existing_output_names_it(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    out.write_bytes(b"keep me")
    err = raised(CheckpointError, lambda: remap(saved, out, to="cpu"))
    assert err.path == out


def test_inspect_of_a_corrupt_safetensors_file_names_it(tmp_path: Path) -> None:
    path = tmp_path / "odd.safetensors"
    raw = json.dumps({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(4))
    assert raised(CheckpointError, lambda: describe_file(path)).path == path


# --- MoveError ----------------------------------------------------------------------------------


def test_move_of_a_meta_model_names_the_first_tensor() -> None:
    with torch.device("meta"):
        model = mlp()
    assert raised(MoveError, lambda: torchplace.move(model, "cpu")).name == "0.weight"


def test_move_of_a_batch_names_the_tensor_by_its_path() -> None:
    batch = {"x": [torch.ones(1), torch.empty(1, device="meta")]}
    assert raised(MoveError, lambda: torchplace.move(batch, "cpu")).name == "batch['x'][1]"


class _FailingTo:
    """An object with its own .to() that fails."""

    def __init__(self) -> None:
        self.t = torch.ones(1)

    def to(self, *args: Any, **kwargs: Any) -> _FailingTo:
        raise RuntimeError("this .to() fails")


def test_move_of_an_object_whose_own_to_fails_names_it() -> None:
    err = raised(MoveError, lambda: torchplace.move({"enc": _FailingTo()}, "meta"))
    assert err.name == "batch['enc']"
    model = mlp()
    model.extra = _FailingTo()  # type: ignore[assignment]
    err = raised(MoveError, lambda: torchplace.move(model, "meta", attributes="move"))
    assert err.name == "extra"


def test_move_with_the_optimizer_of_another_model_names_the_optimizer() -> None:
    other = torch.optim.SGD(mlp().parameters(), lr=0.1)
    err = raised(MoveError, lambda: torchplace.move(mlp(), "meta", optimizer=other))
    assert err.name == "optimizer"


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(2), persistent=False)


def test_move_of_a_lost_non_persistent_buffer_names_it() -> None:
    with torch.device("meta"):
        model = _Masked()
    assert raised(MoveError, lambda: torchplace.move(model, "cpu")).name == "mask"


def test_device_loader_names_the_part_of_the_batch_that_failed() -> None:
    loader = torchplace.DeviceLoader([{"enc": _FailingTo()}], "meta")
    assert raised(MoveError, lambda: list(loader)).name == "batch['enc']"
    on_meta = torchplace.DeviceLoader([{"x": torch.empty(1, device="meta")}], "cpu")
    assert raised(MoveError, lambda: list(on_meta)).name == "batch['x']"


def test_a_move_error_made_for_torch_compile_pickles_with_its_name() -> None:
    """The class torch.compile can build (the built-in __init__, no name=) failed to unpickle:
    MoveError's rebuild passed name= to it."""
    from torchplace.moving._compiled import _TracedMoveError

    err = _TracedMoveError("batch['x'][1] is on meta")  # as _error builds it (torch >= 2.7)
    err.name = "batch['x'][1]"
    assert isinstance(err, MoveError)
    assert pickled(err).name == "batch['x'][1]"


def test_dispatch_taking_a_module_off_disk_names_it_through_its_prefix(
    on_disk: nn.Module,
) -> None:
    err = raised(MoveError, lambda: torchplace.dispatch(on_disk, {"": "cpu"}))
    assert str(err).startswith("dispatch(): ")
    assert err.name == "2"


# --- PlacementError -----------------------------------------------------------------------------


def test_verify_lists_each_straggler_with_its_kind_device_and_size() -> None:
    model = mlp()
    err = raised(PlacementError, lambda: torchplace.verify(model, "meta"))
    assert [s.name for s in err.stragglers] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert {s.kind for s in err.stragglers} == {"parameter"}
    assert {s.device for s in err.stragglers} == {torch.device("cpu")}
    assert [s.nbytes for s in err.stragglers] == [64, 16, 64, 16]
    assert list(err.stragglers) == torchplace.stragglers(model, "meta")


def test_verify_against_a_device_map_lists_what_is_out_of_place() -> None:
    model = mlp()
    err = raised(PlacementError, lambda: torchplace.verify(model, {"0": "cpu", "2": "meta"}))
    assert [s.name for s in err.stragglers] == ["2.weight", "2.bias"]
    assert {s.device for s in err.stragglers} == {torch.device("cpu")}


@pytest.fixture
def group_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A Gloo process group of this process alone, destroyed afterwards."""
    dist = pytest.importorskip("torch.distributed")
    if torch.cuda.is_available():
        pytest.skip("the device would be cuda:0")
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    torchplace.distributed.setup(single_process=True)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_collective_verify_lists_the_stragglers_of_every_rank(group_of_one: None) -> None:
    model = mlp()
    err = raised(PlacementError, lambda: torchplace.distributed.verify(model, "meta"))
    assert list(err.stragglers) == torchplace.stragglers(model, "meta")


# --- prefixed: an entry point's re-raise keeps the data -----------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        CheckpointError("c", path="m.pt", missing=["a"], unexpected=["b"], mismatched=["c"]),
        FileChanged("f", path="m.pt", changes=["its size went from 1 to 2 bytes"]),
        MoveError("m", name="batch['x'][1]"),
        PlacementError(
            "p", stragglers=[torchplace.Straggler("w", "parameter", torch.device("cpu"), 4)]
        ),
    ],
    ids=lambda e: type(e).__name__,
)
def test_prefixed_keeps_the_class_and_the_data(error: TorchplaceError) -> None:
    again = prefixed(error, "load_into()")
    assert type(again) is type(error) and str(again) == f"load_into(): {error}"
    assert data_of(again) == data_of(error)
    pickled(again)
