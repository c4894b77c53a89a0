"""The exception tree: what each error carries besides its message, that the drawing in
``_errors.py`` tells the truth, and the main messages as golden files (regenerate with
``pytest --regen-golden`` after an intended change, then read the diff)."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace
from helpers import check_golden
from torchplace import (
    CheckpointError,
    DeviceSpecError,
    DeviceUnavailableError,
    MixedDevicesError,
    MoveError,
    PlacementError,
    TorchplaceError,
    _devices,
    _errors,
)

SRC = Path(_errors.__file__).parent
META = torch.device("meta")


# --- the data errors carry --------------------------------------------------------------------


def test_a_message_alone_still_raises_and_carries_empty_data() -> None:
    for cls in (PlacementError, MoveError, CheckpointError):
        with pytest.raises(cls, match=r"^plain$") as info:
            raise cls("plain")
        assert info.value.args == ("plain",)
    assert PlacementError("x").stragglers == ()
    assert MoveError("x").name is None
    empty = CheckpointError("x")
    assert (empty.path, empty.missing, empty.unexpected, empty.mismatched) == (None, (), (), ())


def test_data_is_keyword_only_and_kept_as_given() -> None:
    straggler = torchplace.Straggler("weight", "parameter", torch.device("cpu"), 16)
    placed = PlacementError("1 tensor", stragglers=iter([straggler]))
    assert placed.stragglers == (straggler,) and placed.stragglers[0] is straggler
    assert MoveError("m", name="batch['x'][2]").name == "batch['x'][2]"
    err = CheckpointError(
        "m", path="ckpt/model.pt", missing=["a.bias"], unexpected=("z",), mismatched=["a.weight"]
    )
    assert err.path == Path("ckpt/model.pt")
    assert (err.missing, err.unexpected, err.mismatched) == (("a.bias",), ("z",), ("a.weight",))
    positional = MoveError("m", "encoder.weight")  # data is never taken by position
    assert positional.name is None and positional.args == ("m", "encoder.weight")
    with pytest.raises(TypeError):
        CheckpointError("m", missing=["a"], unknown=1)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "error",
    [
        PlacementError(
            "p", stragglers=[torchplace.Straggler("w", "grad", torch.device("meta"), 4)]
        ),
        MoveError("m", name="encoder.weight"),
        CheckpointError("c", path="m.pt", missing=["x"], unexpected=["y"], mismatched=["z"]),
        CheckpointError("c"),
        DeviceSpecError("bad spec"),
        TorchplaceError("root", "second arg"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_survive_pickling_with_their_data(error: TorchplaceError) -> None:
    """Errors cross processes (torch.multiprocessing, a worker's result): data must too."""
    error.__notes__ = ["a note"]  # set by add_note; travels in __dict__
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and back.args == error.args
    assert back.__notes__ == ["a note"]
    for attr in ("stragglers", "name", "path", "missing", "unexpected", "mismatched"):
        assert getattr(back, attr, "absent") == getattr(error, attr, "absent")


# --- the drawing in _errors.py ------------------------------------------------------------------


def test_every_public_error_is_drawn_and_none_other() -> None:
    drawing = (_errors.__doc__ or "").split("::", 1)[1]
    drawn = re.findall(r"(\w+Error)\b", drawing)
    public = [name for name in torchplace.__all__ if name.endswith("Error")]
    assert sorted(set(drawn) & set(public)) == sorted(public)
    assert all(issubclass(getattr(torchplace, n), TorchplaceError) for n in public)
    assert issubclass(DeviceSpecError, ValueError)


def _raises(cls: str) -> list[str]:
    """The modules (file stems) that raise ``cls`` by name, every src file read."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if re.search(rf"raise {cls}\(", path.read_text()):
            found.append(path.stem)
    return found


def test_bare_root_error_sites_are_the_ones_the_drawing_describes() -> None:
    """The drawing lists what a bare TorchplaceError means; a module that starts raising one
    must be added there (this test then names it)."""
    described = {
        "_bench",  # --device meta
        "_checkpoint",  # skeleton() factory, load_into() of a non-module
        "_fill",  # load_into() of a non-module
        "_rename",  # rename= of the wrong kind
        "_skeleton",  # a skeleton() factory that returns no module
        "_dispatch",  # a non-module, state_dict() of a model with modules left on disk
        "_disk_weights",  # pickling a model with modules left on disk
        "_offload",  # an offloaded module called with gradients on, offload_window < 1
        "_load_by_map",  # load_into() of a non-module, execution_device= without a map
        "_estimate",  # a non-module, a lazy module
        "_config_checks",  # a config.json no model is built from (not an object, too deep)
        "_guard",  # a non-module
        "_inspect",  # verify() with another model's optimizer
        "_optim_state",  # optimizer= of the wrong kind
        "_loader",  # DeviceLoader's arguments, a one-shot source read twice
        "_move",  # attributes=, non_blocking=
        "_plan",  # a non-module, a model that does not fit, example_input beside budgets
        "_budgets",  # max_memory="auto" where no memory can be read
        "_model_walk",  # a model that contains itself (plan, dispatch)
        "_tree",  # cycles and absurd depth
        "distributed",  # setup() outside torchrun / no distributed / no group; verify()
        "_watch",  # raise_on=, ignore=, and the event that raise_on forbids
    }
    unexplained = set(_raises("TorchplaceError")) - described
    assert not unexplained, (
        f"{sorted(unexplained)} raise a bare TorchplaceError: say for what in the drawing of "
        "_errors.py (or raise a subclass), then add the module to `described` here"
    )


# --- golden messages ------------------------------------------------------------------------


def test_placement_error_from_verify_golden(regen_golden: bool) -> None:
    model = nn.Linear(2, 2)
    model.scale = torch.ones(1)  # a plain attribute: Module.to() does not move it
    with pytest.raises(PlacementError) as info:
        torchplace.verify(model, "meta")
    check_golden("error_verify.txt", str(info.value) + "\n", regen_golden)


def test_mixed_devices_error_from_where_golden(regen_golden: bool) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].to("meta")
    model[3].to("meta")
    with pytest.raises(MixedDevicesError) as info:
        torchplace.where(model)
    check_golden("error_where.txt", str(info.value) + "\n", regen_golden)


def test_move_error_for_a_meta_tensor_golden(regen_golden: bool) -> None:
    model = nn.Sequential(nn.Linear(2, 2, device="meta"))
    with pytest.raises(MoveError) as info:
        torchplace.move(model, "cpu")
    assert model[0].weight.is_meta  # nothing moved
    check_golden("error_move_meta.txt", str(info.value) + "\n", regen_golden)


def test_device_unavailable_error_golden(
    regen_golden: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A machine with a CPU-only torch and no GPU, whatever this one has.
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(_devices, "_nvml_free_memory", lambda i: None)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch, "__version__", "X.Y.Z+cpu")  # not the installed build's
    with pytest.raises(DeviceUnavailableError) as info:
        torchplace.device("cuda:1")
    check_golden("error_device_unavailable.txt", str(info.value) + "\n", regen_golden)


def _strict_load_error(tmp_path: Path) -> CheckpointError:
    source = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    state = source.state_dict()
    saved = {("layers." + k if k.startswith("1.") else k): v for k, v in state.items()}
    saved["extra.scale"] = torch.ones(1)
    path = tmp_path / "model.pt"
    torch.save(saved, path)
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    with pytest.raises(CheckpointError) as info:
        torchplace.load_into(model, path)
    return info.value


def test_checkpoint_error_for_a_strict_load_golden(regen_golden: bool, tmp_path: Path) -> None:
    err = _strict_load_error(tmp_path)
    text = str(err).replace(str(tmp_path), "<tmp>")
    check_golden("error_load_strict.txt", text + "\n", regen_golden)


# --- what the raise sites pass -----------------------------------------------------------------


def test_verify_passes_every_straggler() -> None:
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(6)])  # 12 tensors, more than 10 shown
    with pytest.raises(PlacementError) as info:
        torchplace.verify(model, "meta")
    assert info.value.stragglers == tuple(torchplace.stragglers(model, "meta"))
    assert len(info.value.stragglers) == 12


def test_strict_load_passes_its_keys(tmp_path: Path) -> None:
    err = _strict_load_error(tmp_path)
    assert err.path == tmp_path / "model.pt"
    assert set(err.missing) == {"1.weight", "1.bias"}
    assert set(err.unexpected) == {"layers.1.weight", "layers.1.bias", "extra.scale"}
    assert err.mismatched == ()


def test_move_error_names_the_tensor() -> None:
    model = nn.Sequential(nn.Linear(2, 2, device="meta"))
    with pytest.raises(MoveError) as info:
        torchplace.move(model, "cpu")
    assert info.value.name == "0.weight"


def test_rename_collision_says_how_to_drop_a_key_with_a_dict(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    path = tmp_path / "m.pt"
    torch.save(model.state_dict(), path)
    with pytest.raises(torchplace.CheckpointError) as info:
        torchplace.load_into(nn.Linear(2, 2), path, rename={"^bias$": "weight"})
    message = str(info.value)
    assert "the same name 'weight'" in message
    assert "a pattern to None in a dict" in message


# --- one prefix: the entry point the user called ------------------------------------------------


def _two_linears() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"device_map": {"0": "cpu"}}, "the device map leaves '1.weight', '1.bias' without"),
        ({"offload_window": 0}, "offload_window must be at least 1"),
        ({"offload_window": "2"}, "offload_window='2' is not a whole number"),
        ({"offload_window": 1.5}, "offload_window=1.5 is not a whole number"),
    ],
    ids=["dispatch-refuses-the-map", "window-0", "window-str", "window-float"],
)
def test_an_error_under_load_into_carries_load_intos_prefix_alone(
    tmp_path: Path, options: dict[str, object], says: str
) -> None:
    """load_into(..., device_map=) ends in dispatch; its errors read "load_into(): ...", once
    (a map dispatch refused read "load_into(): dispatch(): ..."). A window that is no number
    is refused as such (it raised a raw TypeError, comparing it with 1)."""
    path = tmp_path / "m.pt"
    torch.save(_two_linears().state_dict(), path)
    model = _two_linears()
    kwargs = {"device_map": {"0": "cpu", "1": "disk"}, **options}
    with pytest.raises(torchplace.DeviceSpecError) as err:
        torchplace.load_into(model, path, **kwargs)
    message = str(err.value)
    assert message.startswith(f"load_into(): {says}"), message
    assert message.count("(): ") == 1, message


def test_prefixed_replaces_an_inner_entry_points_prefix_and_keeps_the_data() -> None:
    from torchplace._errors import prefixed

    inner = torchplace.CheckpointError("dispatch(): load(): m.pt: bad", path="m.pt", missing=["b"])
    again = prefixed(inner, "load_into()")
    assert str(again) == "load_into(): m.pt: bad"
    assert type(again) is torchplace.CheckpointError
    assert (again.path, again.missing) == (Path("m.pt"), ("b",))
    # a name with "(): " later in the message is the message's, and stays
    assert str(prefixed(torchplace.TorchplaceError("x: call f(): no"), "plan()")) == (
        "plan(): x: call f(): no"
    )
    # so does a leading name that is no entry point of torchplace's: it says what was refused
    lead = torchplace.TorchplaceError("state_dict(): layers.1 is offloaded")
    assert str(prefixed(lead, "estimate()")) == "estimate(): state_dict(): layers.1 is offloaded"
