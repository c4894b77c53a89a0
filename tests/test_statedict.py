"""``load_into`` as ``load_state_dict`` would load (``checkpoint/_statedict.py``): extra state,
versioned layouts, load_state_dict hooks, modules that load themselves, lazy modules."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers import save
from torchplace._errors import CheckpointError
from torchplace.checkpoint._checkpoint import load, load_into, skeleton

# -------------------------------------------------------------------------------------- extra state


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
    with pytest.raises(CheckpointError, match=r"second\._extra_state.*v9.*untouched") as e:
        load_into(model, path)
    assert e.value.path == path
    assert model.first.note == "unset"  # set, then put back
    after = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert all(torch.equal(before[k], after[k]) for k in before)


# --------------------------------------------------------------- load_state_dict hooks and versions


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
    with pytest.raises(CheckpointError, match=r"missing keys: 1\.num_batches_tracked") as e:
        load_into(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), path)
    assert (e.value.path, e.value.missing) == (path, ("1.num_batches_tracked",))


def test_old_instance_norm_running_stats_are_refused_as_load_state_dict_refuses(
    tmp_path: Path,
) -> None:
    path = save({"running_mean": torch.zeros(3), "running_var": torch.ones(3)}, tmp_path / "in.pt")
    with pytest.raises(RuntimeError, match="track_running_stats=False"):
        nn.InstanceNorm1d(3).load_state_dict(torch.load(path), strict=False)
    with pytest.raises(CheckpointError, match=r"running_mean and running_var.*InstanceNorm1d") as e:
        load_into(nn.InstanceNorm1d(3), path, strict=False)
    assert e.value.path == path


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
    with pytest.raises(CheckpointError, match="incompatible release") as e:
        load_into(model, path, strict=False)
    assert e.value.path == path
    assert model.weight.device.type == "meta"

    def raising(*args: object) -> None:
        raise KeyError("no such layout")

    model = skeleton(nn.Linear, 2, 2)
    model._register_load_state_dict_pre_hook(raising)
    with pytest.raises(
        CheckpointError, match=r"pre-hook .*raising.*KeyError.*nothing was loaded"
    ) as e:
        load_into(model, path)
    assert e.value.path == path
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
    with pytest.raises(
        CheckpointError, match=r"missing keys: 2\.bias$|missing keys: 2\.bias;"
    ) as e:
        load_into(model, path)
    assert (e.value.path, e.value.missing) == (path, ("2.bias",))
    for name, p in model.named_parameters():
        assert p is params[name] and torch.equal(p, before[name])  # filled in place, put back

    model = skeleton(_with_extra_layer)
    model.register_load_state_dict_post_hook(_forgiving("2.weight"))
    params = dict(model.named_parameters())
    with pytest.raises(CheckpointError, match=r"missing keys: 2\.bias") as e:
        load_into(model, path, "cpu")
    assert (e.value.path, e.value.missing) == (path, ("2.bias",))
    for name, p in model.named_parameters():
        assert p is params[name] and p.device.type == "meta"  # swapped in, swapped back

    def failing(module: nn.Module, keys: Any) -> None:
        raise ValueError("cannot map the old layout")

    model = skeleton(_with_extra_layer)
    model.register_load_state_dict_post_hook(failing)
    with pytest.raises(CheckpointError, match=r"failing.*ValueError.*put back as it was") as e:
        load_into(model, path)
    assert e.value.path == path
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
    with pytest.raises(CheckpointError, match=r"missing keys: b\.bias.*could not be put back") as e:
        load_into(skeleton(_HookedPair), path)
    assert (e.value.path, e.value.missing) == (path, ("b.bias",))


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
    with pytest.raises(CheckpointError, match=r"missing keys: calibration.*post-hooks") as e:
        load_into(model, path)
    assert (e.value.path, e.value.missing) == (path, ("calibration",))
    model = nn.Linear(2, 2)
    model.register_load_state_dict_post_hook(demanding)
    load_into(model, path, strict=False)  # as torch: not strict, not raised


def test_an_empty_file_under_strict_false_says_it_holds_nothing(tmp_path: Path) -> None:
    path = save({}, tmp_path / "empty.pt")
    with pytest.raises(
        CheckpointError, match=r"the model has weight, bias; the file holds none"
    ) as e:
        load_into(nn.Linear(2, 2), path, strict=False)
    assert (e.value.path, e.value.missing) == (path, ("weight", "bias"))


def test_a_swap_that_fails_midway_puts_back_the_ones_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchplace.checkpoint._apply as checkpoint

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
    with pytest.raises(CheckpointError, match=r"simulated failure.*the model is untouched") as e:
        load_into(model, path)
    assert e.value.path == path
    assert len(calls) == 2
    for name, p in model.named_parameters():
        assert p is params[name] and p.device.type == "meta"


# --------------------------------------------------------------------- modules that load themselves


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
    with pytest.raises(
        CheckpointError, match=r"0 \(_Refusing\) loads itself.*another version"
    ) as e:
        load_into(model, path)
    assert e.value.path == path
    for name, p in model.named_parameters():
        assert p is before[name] and p.device.type == "meta"
    assert not hasattr(model[0], "seen")  # its attributes put back too


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


# ------------------------------------------------------------------------------------- lazy modules


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
    with pytest.raises(CheckpointError, match="missing keys: bias") as e:
        load_into(model, path)
    assert (e.value.path, e.value.missing) == (path, ("bias",))
    assert nn.parameter.is_lazy(model.weight) and nn.parameter.is_lazy(model.bias)
