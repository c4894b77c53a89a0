"""``load_into`` (``checkpoint/_fill.py``): a model filled from a checkpoint, all or nothing:
devices, meta, sources, ties, views in the file, Parameter subclasses, a real third-party model."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchplace
from helpers import DISCARDED_MASK, Net, X, reference, safetensors_torch, save, write_shards
from torchplace._errors import CheckpointError, DeviceSpecError
from torchplace.checkpoint._checkpoint import load, load_into, skeleton


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


# ---------------------------------------------------------------------------------------- load_into


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
    model = load_into(skeleton(Net), write_shards(shards, sd))
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


@pytest.mark.requires_cuda
def test_load_into_cuda(ckpt: Path) -> None:
    model = load_into(skeleton(Net), ckpt, "cuda")
    assert {t.device for t in [*model.parameters(), *model.buffers()]} == {torch.device("cuda:0")}
    assert model.head.weight is model.emb.weight
    assert torch.allclose(model(X.cuda()).cpu(), reference()(X), atol=1e-5)


# ------------------------------------------------ meta: shapes only, and what a load leaves on meta


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
    assert info.value.path is None  # a state dict: no file
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
    assert info.value.path == ckpt
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


def test_meta_model_loses_non_persistent_buffers(ckpt: Path) -> None:
    with torch.device("meta"):
        model = Net()
    with pytest.raises(CheckpointError, match=r"mask.*torchplace.skeleton") as info:
        load_into(model, ckpt)
    assert info.value.path == ckpt


# ----------------------------------------------------------------------------- sources and failures


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


def test_load_into_from_a_model_says_to_pass_its_state_dict() -> None:
    other = nn.Linear(2, 2)
    model = nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match=r"not from a Linear model.*other\.state_dict\(\)"):
        load_into(model, other)  # type: ignore[arg-type]
    load_into(model, other.state_dict())
    assert torch.equal(model.weight, other.weight)


def test_load_into_bad_file_names_it(tmp_path: Path) -> None:
    path = tmp_path / "nothing.pt"
    with pytest.raises(CheckpointError, match=r"nothing\.pt"):
        load_into(skeleton(Net), path)


def test_an_error_loading_a_directory_names_the_file_read_in_it(tmp_path: Path) -> None:
    torch.save({"other.weight": torch.ones(2, 2)}, tmp_path / "model.pt")
    with pytest.raises(CheckpointError) as info:
        load_into(nn.Linear(2, 2), tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'model.pt'}: does not fit Linear")
    assert info.value.path == tmp_path / "model.pt"


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
    with pytest.raises(CheckpointError, match="the model is untouched") as info:
        load_into(model, path)
    assert info.value.path == path
    monkeypatch.setattr(torch.Tensor, "to", real)
    for name, p in model.named_parameters():
        assert p is before[name] and p.device.type == "meta"


# ------------------------------------------------------------------------------------- tied weights


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
    with pytest.raises(
        CheckpointError, match=r"emb\.weight and head\.weight .*keeps them apart"
    ) as info:
        load_into(model, path, strict=strict)
    assert info.value.path == path
    assert model.emb.weight.device.type == "meta"


def test_tied_weights_saved_twice_with_equal_values_load(tmp_path: Path) -> None:
    w = torch.tensor([[1.0, float("nan")], [2.0, 3.0], [4.0, 5.0]])
    path = save({"emb.weight": w, "head.weight": w.clone()}, tmp_path / "same.pt")
    model = load_into(skeleton(_TiedLM), path)
    assert model.head.weight is model.emb.weight
    assert torch.equal(model.emb.weight.nan_to_num(), w.nan_to_num())


# ---------------------------------------------------------------------- overlapping views in a file


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


# -------------------------------------------------------------- Parameter subclasses and attributes


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


# ------------------------------------------------------------------------- a real third-party model


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


@pytest.mark.slow
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


@pytest.mark.parametrize(
    ("call", "option"),
    [("load", "check_crc"), ("load", "mmap"), ("load", "progress"), ("load_into", "strict"),
     ("load_into", "check_crc"), ("load_into", "mmap")],
)  # fmt: skip
def test_an_on_off_option_given_a_string_is_refused_by_name(
    tmp_path: Path, call: str, option: str
) -> None:
    """check_crc="no" ran the check, strict="no" was strict: a string is true in Python."""
    path = tmp_path / "w.pt"
    torch.save({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, path)
    run: Any = (
        (lambda: torchplace.load(path, **{option: "no"}))
        if call == "load"
        else (lambda: torchplace.load_into(torch.nn.Linear(2, 2), path, **{option: "no"}))
    )
    with pytest.raises(DeviceSpecError, match=rf"{option}='no' is not True.*{option}=False"):
        run()
    if call == "load_into":  # what equals True or False passes, as torch's own options take
        torchplace.load_into(torch.nn.Linear(2, 2), path, **{option: 0})


# --- strict=False names what it skipped: as data, in one warning ---------------------------------


def _two_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


@pytest.fixture
def skipping(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A file that lacks the model's 1.bias and holds a key the model does not take."""
    sd = {k: v.detach().clone() for k, v in _two_layers().state_dict().items() if k != "1.bias"}
    sd["head.scale"] = torch.ones(2)
    return save(sd, tmp_path / "partial.pt"), sd


def test_strict_false_names_the_skipped_keys_in_one_warning(
    skipping: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, sd = skipping
    model = _two_layers()
    kept = model[1].bias.detach().clone()
    with pytest.warns(UserWarning, match=r"partial\.pt: strict=False skipped 2 keys") as w:
        load_into(model, path, strict=False)
    assert len(w) == 1
    skipped = w[0].message
    assert (skipped.path, skipped.missing, skipped.unexpected) == (
        path,
        ("1.bias",),
        ("head.scale",),
    )
    assert "keep the values they had" in str(skipped)
    assert torch.equal(model[1].bias, kept)  # the key the file lacks kept its value
    assert torch.equal(model[0].weight, sd["0.weight"])


def test_strict_false_on_a_skeleton_warns_once_naming_both_kinds(
    skipping: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """Left on meta is the one warning then: it names the unexpected keys too, and carries
    every skipped key as data."""
    path, _ = skipping
    with pytest.warns(UserWarning, match=r"1\.bias") as w:
        model = load_into(skeleton(_two_layers), path, strict=False)
    assert len(w) == 1
    skipped = w[0].message
    assert (skipped.missing, skipped.unexpected) == (("1.bias",), ("head.scale",))
    assert "head.scale" in str(skipped)
    assert model[1].bias.is_meta


def test_the_skipped_keys_warning_is_silenced_by_the_standard_filters(
    skipping: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    import warnings

    path, sd = skipping
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=r".*strict=False skipped")
        model = load_into(_two_layers(), path, strict=False)
    assert torch.equal(model[0].weight, sd["0.weight"])
    # a state dict in memory: the same warning, with no path
    with pytest.warns(UserWarning, match="strict=False skipped 2 keys") as w:
        load_into(_two_layers(), sd, strict=False)
    assert w[0].message.path is None


def test_a_source_that_fits_says_nothing_with_strict_false(ckpt: Path) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_into(Net(), ckpt, strict=False)


def test_the_skipped_keys_warning_as_an_error_leaves_the_model_untouched(
    skipping: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """Given before anything is written: under -W error the load stops with the model as it
    was (it was given after the fill, which wrote a real model's weights in place)."""
    import warnings

    path, _ = skipping
    model = _two_layers()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="strict=False skipped 2 keys"):
            load_into(model, path, strict=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
