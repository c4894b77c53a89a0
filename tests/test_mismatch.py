"""A checkpoint that does not fit the model (``checkpoint/_mismatch.py``): missing, unexpected and
mismatched keys listed, and hints (prefixes, misspelt keys, a part of the model, a training
checkpoint) that work when followed as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace
from helpers import Net, reference, save
from torchplace._errors import CheckpointError
from torchplace.checkpoint._checkpoint import load, load_into, skeleton


def test_strict_lists_missing_unexpected_and_mismatched(tmp_path: Path) -> None:
    sd = reference().state_dict()
    del sd["body.0.bias"]
    sd["extra.weight"] = torch.ones(1)
    sd["body.1.weight"] = torch.ones(3)
    path = save(sd, tmp_path / "bad.pt")
    model = skeleton(Net)
    with pytest.raises(CheckpointError) as info:
        load_into(model, path)
    err = info.value
    assert (err.path, err.missing, err.unexpected) == (path, ("body.0.bias",), ("extra.weight",))
    assert err.mismatched == ("body.1.weight",)
    text = str(info.value)
    for needle in ("bad.pt", "missing keys: body.0.bias", "unexpected keys: extra.weight"):
        assert needle in text
    assert "body.1.weight: file (3,), model (8,)" in text
    assert model.emb.weight.device.type == "meta"  # nothing was filled


def test_non_strict_loads_what_matches(tmp_path: Path) -> None:
    sd = reference().state_dict()
    del sd["body.0.bias"]
    sd["extra.weight"] = torch.ones(1)
    with pytest.raises(CheckpointError, match="pass strict=False to load what matches") as e:
        load_into(skeleton(Net), save(sd, tmp_path / "partial.pt"))
    assert (e.value.missing, e.value.unexpected) == (("body.0.bias",), ("extra.weight",))
    with pytest.warns(UserWarning, match=r"left 1 tensor\(s\) of Net on meta.*: body\.0\.bias\."):
        model = load_into(skeleton(Net), save(sd, tmp_path / "partial.pt"), strict=False)
    assert model.emb.weight.device.type == "cpu" and model.body[0].bias.device.type == "meta"
    sd["body.1.weight"] = torch.ones(3)
    with pytest.raises(CheckpointError, match="shape mismatches") as e:
        load_into(skeleton(Net), save(sd, tmp_path / "partial.pt"), strict=False)
    # strict=False: only the mismatch stops the load, so only it is listed
    assert (e.value.missing, e.value.unexpected, e.value.mismatched) == ((), (), ("body.1.weight",))


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
    assert e.value.unexpected == ("module.head.weight", "module.emb.weight")
    model = skeleton(Tied)
    with pytest.raises(
        CheckpointError, match=r"strict=False would load nothing.*'module\.'"
    ) as nothing:
        load_into(model, path, strict=False)
    assert nothing.value.path == path
    assert nothing.value.unexpected == ("module.head.weight", "module.emb.weight")
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
    assert (info.value.path, info.value.missing) == (path, ("weight", "bias"))


def test_a_file_of_several_modules_gets_a_prefix_hint_that_works(tmp_path: Path) -> None:
    """A Sequential's file loaded into one Linear was told to drop '0.', which left its '1.'
    keys unexpected: the rename offered keeps only the part that fits, and loads."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    path = save(seq.state_dict(), tmp_path / "c1.pt")
    with pytest.raises(CheckpointError) as e:
        load_into(nn.Linear(4, 4), path)
    text = str(e.value)
    assert "the file holds more than the model" in text and "1.weight, 1.bias" in text
    call = text.split("drop the prefix and skip the rest, ")[1].split(" (a warning")[0]
    model = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match=r"strict=False skipped .*1\.weight, 1\.bias"):
        model = eval(call, {"torchplace": torchplace, "model": model})  # followed to the letter
    assert torch.equal(model.weight, seq[0].weight) and torch.equal(model.bias, seq[0].bias)
    # keys under the prefix that the model lacks: dropping it would not fit, so it is not said
    more = {f"0.{k}": v for k, v in seq[0].state_dict().items()}
    path = save({**more, "0.extra": torch.ones(1)}, tmp_path / "more.pt")
    with pytest.raises(CheckpointError) as e:
        load_into(nn.Linear(4, 4), path)
    assert "prefix" not in str(e.value) and "rename=" not in str(e.value)


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
    assert e.value.missing == ("decoder.weight", "decoder.bias")
    assert e.value.unexpected == ("encoder.weight", "encoder.bias")
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
    assert (e.value.path, e.value.missing, e.value.unexpected) == (None, (), ("2.weight", "2.bias"))

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


def test_a_file_of_one_part_of_the_model_gets_a_hint_that_works(tmp_path: Path) -> None:
    path = save(reference().body.state_dict(), tmp_path / "body.pt")
    with pytest.raises(CheckpointError, match=r"prefix 'body\.'.*get_submodule\('body'\)") as e:
        load_into(reference(), path)
    assert e.value.path == path
    assert e.value.unexpected == ("0.weight", "0.bias", "1.weight", "1.bias")
    model = reference()
    load_into(model.get_submodule("body"), path)


def test_whole_training_checkpoint_gets_a_hint(tmp_path: Path) -> None:
    path = save({"model": reference().state_dict(), "epoch": 3}, tmp_path / "all.pt")
    with pytest.raises(
        CheckpointError, match=r"not a state dict.*load\('.*all\.pt'\)\['model'\]\)$"
    ) as e:
        load_into(skeleton(Net), path)
    assert e.value.path == path
    model = load_into(skeleton(Net), load(path)["model"])  # the hint, followed
    assert torch.equal(model.emb.weight, reference().emb.weight)


def test_a_long_key_list_points_to_the_error_that_holds_it_whole() -> None:
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(8)])
    with pytest.raises(CheckpointError, match=r"and 6 more.*CheckpointError\.missing") as info:
        load_into(model, {f"x{i}": torch.ones(1) for i in range(3)})
    assert len(info.value.missing) == 16


def test_a_rename_that_drops_every_key_is_said_so(tmp_path: Path) -> None:
    """Where the caller's ``rename=`` drops every key, the error says so, not that the file
    holds none."""
    path = save(reference().state_dict(), tmp_path / "w.pt")
    held = len(reference().state_dict())
    for strict in (True, False):
        with pytest.raises(CheckpointError) as e:
            load_into(skeleton(Net), path, strict=strict, rename=lambda k: None)
        text = str(e.value)
        assert f"rename= dropped all {held} of the file's keys (it returned None" in text
        assert "holds none" not in text
        assert e.value.path == path and e.value.unexpected == ()
        assert e.value.missing == tuple(n for n in reference().state_dict() if n != "head.weight")


def test_a_hint_under_rename_changes_the_rename_given(tmp_path: Path) -> None:
    """The keys a hint speaks of are the ones ``rename=`` gave: the fix is a change to that
    rename (which, made as said, loads), not another ``rename=`` that would replace it."""
    sd = reference().state_dict()
    path = save({f"model.{k}": v for k, v in sd.items()}, tmp_path / "lightning.pt")

    def mine(key: str) -> str:
        return "x." + key.removeprefix("model.")  # a rename that is wrong: adds "x."

    with pytest.raises(CheckpointError) as e:
        load_into(skeleton(Net), path, rename=mine)
    text = str(e.value)
    assert re.search(r"unexpected keys \(as rename= names them\): x\.\w+", text)
    assert (
        r"""the file's keys, as rename= names them, carry an extra prefix 'x.': have the """
        r"""rename= given drop it too, as {r"^x\.": ""} would after what it does now"""
    ) in text
    assert "torchplace.load_into(model" not in text
    model = load_into(skeleton(Net), path, rename=lambda k: mine(k).removeprefix("x."))
    assert all(torch.equal(p, sd[n]) for n, p in model.named_parameters())
    # A misspelling the rename made: the rule offered is one more step of that rename.
    with pytest.raises(CheckpointError) as e:
        load_into(skeleton(Net), path, rename=lambda k: k.replace("model.body", "bdy"))
    assert "spell 'bdy' where the model has 'body': have the rename= given rename them" in str(
        e.value
    )


# Importing Dynamo fresh (torch.compile's first use in a process) may warn of torch.jit.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_wrapper_prefix_alone_is_no_rename_given(tmp_path: Path) -> None:
    """A compiled model takes its file through the model inside, torchplace taking the
    wrapper's prefix off: with no ``rename=`` given, the hint is the plain call."""
    sd = reference().state_dict()
    path = save({f"x.{k}": v for k, v in sd.items()}, tmp_path / "w.pt")
    compiled = torch.compile(skeleton(Net))
    with pytest.raises(CheckpointError) as e:
        load_into(compiled, path)
    text = str(e.value)
    assert "as rename= names them" not in text
    assert r"""drop it as they load, torchplace.load_into(model, """ in text


def test_a_rename_of_any_mapping_or_callable_class_loads(tmp_path: Path) -> None:
    """An ``OrderedDict`` (or another unhashable mapping) and a dataclass with ``__call__`` are
    renames like any other: telling the caller's rename from torchplace's own raised
    ``TypeError: unhashable type`` for them."""
    import collections
    import dataclasses

    @dataclasses.dataclass
    class Strip:
        prefix: str

        def __call__(self, key: str) -> str:
            return key.removeprefix(self.prefix)

    sd = reference().state_dict()
    path = save({f"module.{k}": v for k, v in sd.items()}, tmp_path / "ddp.pt")
    for rename in (collections.OrderedDict({r"^module\.": ""}), Strip("module.")):
        model = load_into(skeleton(Net), path, rename=rename)  # type: ignore[arg-type]
        assert all(torch.equal(p, sd[n]) for n, p in model.named_parameters())


def test_a_rename_that_kept_keys_of_the_wrong_shape_is_not_said_to_drop_them(
    tmp_path: Path,
) -> None:
    """Nothing matched, but rename= kept the key: the shape is the problem, not the rename."""
    path = save({"net.body.0.weight": torch.zeros(5, 4)}, tmp_path / "w.pt")
    for strict in (True, False):
        with pytest.raises(CheckpointError, match=r"shape mismatches: body\.0\.weight") as e:
            load_into(skeleton(Net), path, strict=strict, rename={r"^net\.": ""})
        assert "dropped" not in str(e.value)
        assert e.value.path == path and e.value.mismatched == ("body.0.weight",)
