"""move(): tensors, batches, modules and optimizers; identity, ties, policy, all-or-nothing."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections import OrderedDict, defaultdict, namedtuple
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence

import torchplace
from torchplace.moving import _identity, _move, _transfer

META = torch.device("meta")
_COPY = _transfer.copy_tensor
CPU = torch.device("cpu")


class Tied(nn.Module):
    """Embedding tied to the output head, BatchNorm buffers, and an LSTM (aliases its weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.rnn = nn.LSTM(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.emb(ids))
        x, _ = self.rnn(x.unsqueeze(1))
        out: torch.Tensor = self.head(x.squeeze(1))
        return out


def trained(opt_cls: type[torch.optim.Optimizer] = torch.optim.Adam, **kw: Any) -> tuple[Tied, Any]:
    torch.manual_seed(0)
    model = Tied()
    opt = opt_cls(model.parameters(), lr=0.01, **kw)
    model(torch.randint(0, 10, (5,))).sum().backward()
    opt.step()
    return model, opt


def snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Everything a failed move must leave exactly as it was."""
    snap: dict[str, Any] = {
        "params": [(n, p, p.device, p.detach().clone()) for n, p in model.named_parameters()],
        "grads": [
            (n, p.grad, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None
        ],
        "buffers": [(n, b, b.clone()) for n, b in model.named_buffers()],
        "attrs": {k: v for k, v in vars(model).items() if isinstance(v, torch.Tensor)},
    }
    if opt is not None:
        snap["groups"] = [list(g["params"]) for g in opt.param_groups]
        snap["state"] = {
            id(p): {k: (v, v.device, v.clone()) for k, v in s.items()} for p, s in opt.state.items()
        }
    return snap


def assert_unchanged(model: nn.Module, before: dict[str, Any], opt: Any = None) -> None:
    after = snapshot(model, opt)
    for (n, p, dev, data), (n2, p2, dev2, data2) in zip(
        before["params"], after["params"], strict=True
    ):
        assert n == n2 and p is p2 and dev == dev2 and p.device == dev
        assert torch.equal(data, data2)
    for (n, g, data), (_, g2, data2) in zip(before["grads"], after["grads"], strict=True):
        assert g is g2, n
        assert torch.equal(data, data2)
    for (n, b, data), (_, b2, data2) in zip(before["buffers"], after["buffers"], strict=True):
        assert b is b2, n
        assert torch.equal(data, data2)
    assert before["attrs"].keys() == after["attrs"].keys()
    for key, value in before["attrs"].items():
        assert after["attrs"][key] is value
    if opt is not None:
        assert [[id(p) for p in g] for g in before["groups"]] == [
            [id(p) for p in g] for g in after["groups"]
        ]
        assert before["state"].keys() == after["state"].keys()
        for pid, state in before["state"].items():
            for key, (value, dev, data) in state.items():
                value2, dev2, _ = after["state"][pid][key]
                assert value2 is value and dev2 == dev and torch.equal(value2, data)


# -- tensors and batches ---------------------------------------------------------------------


def test_tensor_to_each_device(any_device: torch.device) -> None:
    t = torch.arange(6.0).reshape(2, 3)
    moved = torchplace.move(t, any_device)
    assert moved.device == any_device
    assert moved.shape == t.shape and moved.dtype == t.dtype
    if any_device.type != "meta":
        assert torch.equal(moved.cpu(), t)


def test_same_device_move_is_free_and_identity_preserving() -> None:
    batch = {"x": torch.ones(3), "y": [torch.zeros(2), (torch.ones(1), "label")], "n": 4}
    assert torchplace.move(batch, "cpu") is batch
    assert torchplace.move(batch["x"], CPU) is batch["x"]


def test_moved_batch_keeps_autograd_graph() -> None:
    x = torch.ones(2, requires_grad=True)
    y = torchplace.move({"y": x * 2}, "meta")["y"]
    assert y.requires_grad and y.grad_fn is not None


@dataclasses.dataclass(frozen=True)
class Frozen:
    image: torch.Tensor
    label: int
    cache: torch.Tensor = dataclasses.field(init=False, default_factory=lambda: torch.zeros(1))


@dataclasses.dataclass
class Plain:
    x: torch.Tensor
    extra: list[torch.Tensor]


Pair = namedtuple("Pair", ["left", "right"])


class ReadOnly(Mapping[str, Any]):
    """A Mapping that is not mutable but can be rebuilt from a dict."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class Tokens:
    """An object with its own .to(), like a tokenizer's BatchEncoding."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def to(self, device: torch.device, non_blocking: bool = False) -> Tokens:
        return Tokens(self.ids.to(device))


def test_every_container_kind_is_rebuilt_faithfully() -> None:
    t = torch.arange(4.0)
    dd: defaultdict[str, list[int]] = defaultdict(list)
    dd["t"] = t  # type: ignore[assignment]
    frozen = Frozen(t, 3)
    batch = {
        "od": OrderedDict([("b", t), ("a", 1)]),
        "dd": dd,
        "ro": ReadOnly({"t": t, "s": "x"}),
        "list": [t, None, 2.5],
        "tuple": (t, "x"),
        "pair": Pair(t, 7),
        "frozen": frozen,
        "plain": Plain(t, [t]),
        "tokens": Tokens(t),
        "packed": pack_sequence([torch.ones(3), torch.ones(2)]),
        "set": {1, 2},
    }
    moved = torchplace.move(batch, "meta")
    assert type(moved["od"]) is OrderedDict and list(moved["od"]) == ["b", "a"]
    assert moved["od"]["b"].device == META and moved["od"]["a"] == 1
    assert type(moved["dd"]) is defaultdict and moved["dd"].default_factory is list
    assert type(moved["ro"]) is ReadOnly and moved["ro"]["s"] == "x"
    assert moved["list"][1:] == [None, 2.5]
    assert type(moved["tuple"]) is tuple and moved["tuple"][1] == "x"
    assert type(moved["pair"]) is Pair and moved["pair"].right == 7
    assert type(moved["frozen"]) is Frozen and moved["frozen"] is not frozen
    assert moved["frozen"].label == 3 and moved["frozen"].cache.device == META
    assert frozen.image.device == CPU  # the original is untouched
    assert moved["plain"].extra[0] is moved["plain"].x  # aliasing across fields
    assert type(moved["tokens"]) is Tokens and moved["tokens"].ids.device == META
    assert moved["packed"].data.device == META
    assert moved["packed"].batch_sizes.device == CPU  # PackedSequence's own rule
    assert moved["set"] is batch["set"]
    # One tensor everywhere, one moved tensor everywhere.
    assert moved["od"]["b"] is moved["list"][0] is moved["pair"].left is moved["frozen"].image


@dataclasses.dataclass
class _Output(OrderedDict):  # type: ignore[type-arg]
    """What Hugging Face's ModelOutput is: a dataclass and an OrderedDict kept in step by its
    own item and attribute assignment."""

    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                super().__setitem__(field.name, value)

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(self.values())


def test_a_mapping_dataclass_is_rebuilt_through_its_items() -> None:
    out = _Output(logits=torch.ones(2, 3))
    moved = torchplace.move(out, "meta")
    assert type(moved) is _Output and moved is not out
    assert moved.logits is moved["logits"] is moved.to_tuple()[0]
    assert moved.logits.device == META and moved.loss is None
    assert out.logits.device == CPU and out["logits"].device == CPU  # the original untouched


def test_a_real_model_output_moves_whole() -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs")
    out = outputs.CausalLMOutputWithPast(logits=torch.ones(2, 3))
    moved = torchplace.move(out, "meta")
    assert moved.logits.device == moved["logits"].device == moved[0].device == META
    assert moved.to_tuple()[0] is moved.logits


def test_deques_and_unset_dataclass_fields() -> None:
    from collections import deque

    @dataclasses.dataclass
    class Lazy:
        x: torch.Tensor
        cache: torch.Tensor = dataclasses.field(init=False)

    t = torch.ones(2)
    moved = torchplace.move({"q": deque([t, 1], maxlen=3), "lazy": Lazy(t)}, "meta")
    assert type(moved["q"]) is deque and moved["q"].maxlen == 3
    assert moved["q"][0].device == META and moved["q"][1] == 1
    assert moved["lazy"].x.device == META and not hasattr(moved["lazy"], "cache")
    assert torchplace.devices_of(moved) == {META}


def test_shared_containers_stay_shared() -> None:
    inner = [torch.ones(1)]
    moved = torchplace.move({"a": inner, "b": inner}, "meta")
    assert moved["a"] is moved["b"]


def test_cycle_is_a_clear_error() -> None:
    batch: dict[str, Any] = {"x": [torch.ones(1)]}
    batch["x"].append(batch)
    with pytest.raises(
        torchplace.TorchplaceError, match=r"batch\['x'\]\[1\] is batch itself.*cycle"
    ):
        torchplace.move(batch, "meta")


def test_absurdly_deep_batch_is_a_clear_error() -> None:
    deep: Any = torch.ones(1)
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(torchplace.TorchplaceError, match="nested more than 200 containers deep"):
        torchplace.move(deep, "meta")


def test_meta_tensor_in_a_batch_is_named_with_advice_for_data() -> None:
    """Data on meta has no values to move: the advice is to make it with values, not the
    advice for a model's weights (load_into, to_empty), which a batch has no use for."""
    batch = {"images": [torch.ones(1), torch.ones(2, 3, dtype=torch.float16, device="meta")]}
    with pytest.raises(torchplace.MoveError) as info:
        torchplace.move(batch, "cpu")
    message = str(info.value)
    assert message.startswith("batch['images'][1] is on meta: it has a shape (2, 3) and dtype ")
    assert "no values, so there is nothing to copy to cpu" in message
    assert message.endswith("Nothing was moved")
    assert "load_into" not in message and "to_empty" not in message and "model" not in message
    assert info.value.name == "batch['images'][1]"
    # the example, typed as written, makes the entry that moves
    example = message.split("e.g. ")[1].split("), or ")[0] + ")"
    assert example == "torch.zeros(2, 3, dtype=torch.float16, device='cpu')"
    batch["images"][1] = eval(example, {"torch": torch})
    moved = torchplace.move(batch, "cpu")
    assert moved["images"][1].shape == (2, 3) and moved["images"][1].dtype == torch.float16
    # a tensor alone is data too; a module's weights in a batch keep the advice for models
    with pytest.raises(
        torchplace.MoveError, match=r"^tensor is on meta: .* torch\.zeros\(\(\), "
    ) as info:
        torchplace.move(torch.tensor(1, device="meta"), "cpu")
    assert info.value.name == "tensor"
    with pytest.raises(
        torchplace.MoveError, match=r"^batch\['m'\]\.weight is on meta.*to_empty"
    ) as info:
        torchplace.move({"m": nn.Linear(2, 2, device="meta")}, "cpu")
    assert info.value.name == "batch['m'].weight"


def test_failing_copy_in_a_batch_names_path_and_chains_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def boom(t: torch.Tensor, target: torch.device, non_blocking: bool) -> torch.Tensor:
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(_transfer, "copy_tensor", boom)
    with pytest.raises(
        torchplace.MoveError, match=r"could not move batch\['x'\] \(2x3 float32, 24 B\)"
    ) as info:
        torchplace.move({"x": torch.ones(2, 3)}, "meta")
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "nothing was moved" in str(info.value)
    assert info.value.name == "batch['x']"


def test_bad_arguments() -> None:
    with pytest.raises(torchplace.TorchplaceError, match="attributes='all' is not one of") as e:
        torchplace.move(torch.ones(1), "cpu", attributes="all")  # type: ignore[arg-type]
    assert "did you mean" not in str(e.value)
    with pytest.raises(torchplace.TorchplaceError, match=r"'ignore'; did you mean 'move'\?"):
        torchplace.move(torch.ones(1), "cpu", attributes="mvoe")  # type: ignore[arg-type]
    with pytest.raises(torchplace.TorchplaceError, match="optimizer= takes"):
        torchplace.move(nn.Linear(1, 1), "cpu", optimizer="adam")  # type: ignore[arg-type]
    with pytest.raises(torchplace.DeviceSpecError, match="did you mean 'meta'"):
        torchplace.move(torch.ones(1), "mate")
    with pytest.raises(torchplace.TorchplaceError, match="non_blocking=1"):
        torchplace.move(torch.ones(1), "cpu", non_blocking=1)  # type: ignore[arg-type]


# -- modules ---------------------------------------------------------------------------------


def test_module_move_to_meta_rebinds_optimizer_and_keeps_ties() -> None:
    model, opt = trained()
    old_weight = model.emb.weight
    assert torchplace.move(model, "meta", optimizer=opt) is model
    assert model.emb.weight is model.head.weight  # tie kept
    assert model.emb.weight is not old_weight  # PyTorch replaces Parameters on cpu<->meta
    assert all(p.device == META for p in model.parameters())
    assert all(b.device == META for b in model.buffers())
    assert model.emb.weight.grad is not None and model.emb.weight.grad.device == META
    params = list(model.parameters())
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in params]
    assert set(map(id, opt.state)) == set(map(id, params))
    state = opt.state[model.emb.weight]
    assert state["step"].device == CPU  # Adam's step stays on the CPU (not fused/capturable)
    assert state["exp_avg"].device == META and state["exp_avg"].dtype == torch.float32
    # The LSTM's cached list of its own weights follows the replacement.
    assert all(
        a is b
        for a, b in zip(
            model.rnn._flat_weights,
            model.rnn._flat_weights_names
            and [getattr(model.rnn, n) for n in model.rnn._flat_weights_names],
            strict=True,
        )
    )
    torchplace.verify(model, "meta", optimizer=opt)


def test_parameter_identity_kept_where_pytorch_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under swap_module_params_on_conversion PyTorch keeps Parameter objects even cpu<->meta."""
    monkeypatch.setattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: True)
    model, opt = trained(torch.optim.SGD, momentum=0.9)
    before = dict(model.named_parameters())
    torchplace.move(model, "meta", optimizer=opt)
    for name, p in model.named_parameters():
        assert p is before[name] and p.device == META
        assert p.grad is not None and p.grad.device == META
    assert model.emb.weight is model.head.weight
    assert opt.state[model.emb.weight]["momentum_buffer"].device == META
    torchplace.verify(model, "meta", optimizer=opt)


def test_overwrite_flag_replaces_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "_has_compatible_shallow_copy_type", lambda a, b: True)
    monkeypatch.setattr(torch.__future__, "get_overwrite_module_params_on_conversion", lambda: True)
    model, opt = trained()
    old = model.emb.weight
    torchplace.move(model, "meta", optimizer=opt)
    assert model.emb.weight is not old and opt.param_groups[0]["params"][0] is model.emb.weight


def test_parameter_subclass_and_attributes_survive_replacement() -> None:
    class Tagged(nn.Parameter):
        pass

    model = nn.Linear(2, 2)
    model.weight = Tagged(model.weight.detach())
    model.weight.shard_info = "rows"  # type: ignore[attr-defined]
    torchplace.move(model, "meta")
    assert type(model.weight) is Tagged and model.weight.shard_info == "rows"  # type: ignore[attr-defined]
    assert model.weight.requires_grad


def test_parameter_subclass_with_slots_survives_replacement() -> None:
    """_identity.parameter_like keeps a subclass whose slots change its layout, and the slots'
    values (assigning __class__ to such a class fails, which once left a plain Parameter)."""

    class Slotted(nn.Parameter):
        __slots__ = ("tag",)

    model = nn.Linear(2, 2)
    model.weight = Slotted(model.weight.detach())
    model.weight.tag = "rows"  # type: ignore[attr-defined]
    torchplace.move(model, "meta")
    assert type(model.weight) is Slotted and model.weight.tag == "rows"  # type: ignore[attr-defined]
    assert model.weight.is_meta and model.weight.requires_grad


@pytest.mark.parametrize("fused", [False, True])
def test_step_follows_pytorchs_policy(fused: bool) -> None:
    model = nn.Linear(3, 3)
    opt = torch.optim.Adam(model.parameters(), fused=fused)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    torchplace.move(model, "meta", optimizer=opt)
    step = opt.state[model.weight]["step"]
    assert step.device == (META if fused else CPU)
    assert step.dtype == torch.float32
    assert torchplace.stragglers(model, "meta", optimizer=opt) == []


def test_optimizer_state_lands_where_verify_expects_it() -> None:
    """move and verify read one rule book (_optim_state): NAdam's mu_product stays on the CPU,
    where NAdam makes it; ASGD's step goes with its parameter, where ASGD makes it."""
    model = nn.Linear(3, 3)
    nadam = torch.optim.NAdam([model.weight])
    asgd = torch.optim.ASGD([model.bias])
    model(torch.ones(2, 3)).sum().backward()
    nadam.step()
    asgd.step()
    mu = nadam.state[model.weight]["mu_product"].clone()
    torchplace.move(model, "meta", optimizer=[nadam, asgd])
    assert nadam.state[model.weight]["mu_product"].device == CPU
    assert torch.equal(nadam.state[model.weight]["mu_product"], mu)
    assert nadam.state[model.weight]["step"].device == CPU
    assert asgd.state[model.bias]["step"].device == META
    assert asgd.state[model.bias]["eta"].device == META
    torchplace.verify(model, "meta", optimizer=[nadam, asgd])


def test_capturable_group_moves_step_with_parameters() -> None:
    model, opt = trained()
    opt.param_groups[0]["capturable"] = True
    torchplace.move(model, "meta", optimizer=opt)
    assert opt.state[model.emb.weight]["step"].device == META


def test_step_wrongly_on_device_is_brought_back_to_cpu() -> None:
    model, opt = trained()
    for state in opt.state.values():
        state["step"] = state["step"].to("meta")
    problems = torchplace.stragglers(model, "cpu", optimizer=opt)
    assert {s.kind for s in problems} == {"optimizer_state"}
    assert all(s.name.endswith(".step") for s in problems)
    # on meta the steps have no values: the fix says so, and following it to the letter works
    with pytest.raises(torchplace.PlacementError, match=r"lost.*opt\.state\.clear\(\)") as info:
        torchplace.verify(model, "cpu", optimizer=opt)
    assert [s.name for s in info.value.stragglers] == [s.name for s in problems]
    assert {s.kind for s in info.value.stragglers} == {"optimizer_state"}
    opt.state.clear()
    torchplace.verify(model, "cpu", optimizer=opt)


def test_stale_optimizer_is_reported_then_rebound() -> None:
    model, opt = trained()
    torchplace.move(model, "meta")  # optimizer forgotten: it now holds the old cpu parameters
    assert opt.param_groups[0]["params"][0] is not model.emb.weight
    problems = torchplace.stragglers(model, "meta", optimizer=opt)
    names = {s.name for s in problems}
    assert "optimizer.state[emb.weight].exp_avg" in names
    assert all(s.kind == "optimizer_state" for s in problems)  # stale params not listed apart
    torchplace.move(model, "meta", optimizer=opt)  # passing it now re-binds it
    assert opt.param_groups[0]["params"][0] is model.emb.weight
    assert opt.state[model.emb.weight]["exp_avg"].device == META
    assert torchplace.stragglers(model, "meta", optimizer=opt) == []


def test_optimizer_alone_moves_its_state() -> None:
    model, opt = trained(torch.optim.SGD, momentum=0.9)
    assert torchplace.move(opt, "meta") is opt
    assert all(s["momentum_buffer"].device == META for s in opt.state.values())
    assert model.emb.weight.device == CPU  # parameters belong to the model


def test_several_optimizers() -> None:
    model = Tied()
    first = torch.optim.Adagrad(model.emb.parameters())
    second = torch.optim.Adagrad(model.rnn.parameters())
    torchplace.move(model, "meta", optimizer=[first, second])
    assert first.state[model.emb.weight]["sum"].device == META
    assert second.state[model.rnn.weight_ih_l0]["sum"].device == META


class WithAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.scale = torch.ones(2)  # plain attribute: Module.to() does not move it
        self.tables = [torch.zeros(3)]  # tensors in a list do not move either
        self.helpers = [nn.Linear(2, 2)]  # nor does a module kept in a list


def test_attributes_warn_by_default() -> None:
    model = WithAttribute()
    with pytest.warns(
        UserWarning,
        match=r"left 3 plain attribute\(s\) holding tensors off meta \(helpers\[0\], scale, tab",
    ) as record:
        torchplace.move(model, "meta")
    assert record[0].filename == __file__  # the warning points at the caller's line
    assert model.lin.weight.device == META and model.scale.device == CPU
    assert model.helpers[0].weight.device == CPU
    kinds = {s.name: s.kind for s in torchplace.stragglers(model, "meta")}
    assert kinds == {
        "scale": "attribute",
        "tables[0]": "attribute",
        "helpers[0].weight": "attribute",
        "helpers[0].bias": "attribute",
    }
    with pytest.raises(torchplace.PlacementError) as info:
        torchplace.verify(model, "meta")
    found = [s.name for s in info.value.stragglers]
    assert found == ["scale", "tables[0]", "helpers[0].weight", "helpers[0].bias"]
    lines = {line.split()[1]: line for line in str(info.value).splitlines()[1:]}
    assert "register_buffer('scale'" in lines["scale"]
    for name in ("helpers[0].weight", "tables[0]"):  # no register_buffer('weight') here
        assert "nn.ModuleList" in lines[name] and "register_buffer('" not in lines[name]


def test_attributes_move_and_ignore() -> None:
    model = WithAttribute()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchplace.move(model, "meta", attributes="move")
    assert model.scale.device == META and model.tables[0].device == META
    assert model.helpers[0].weight.device == META
    torchplace.verify(model, "meta")
    other = WithAttribute()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchplace.move(other, "meta", attributes="ignore")
    assert other.scale.device == CPU


def test_module_on_meta_to_real_device_is_refused_and_untouched() -> None:
    model = nn.Linear(2, 2, device="meta")
    with pytest.raises(torchplace.MoveError, match=r"^weight is on meta.*to_empty") as info:
        torchplace.move(model, "cpu")
    assert info.value.name == "weight"
    assert model.weight.device == META


def test_modules_and_optimizers_inside_a_batch() -> None:
    model, opt = trained()
    batch = {"model": model, "opt": opt, "x": torch.ones(1)}
    moved = torchplace.move(batch, "meta")
    assert moved["model"] is model and moved["opt"] is opt and moved["x"].device == META
    assert opt.param_groups[0]["params"][0] is model.emb.weight
    torchplace.verify(moved, "meta")


# -- all or nothing ----------------------------------------------------------------------------


def _count_copies(
    model: nn.Module, opt: torch.optim.Optimizer, monkeypatch: pytest.MonkeyPatch
) -> int:
    calls = 0
    real = _transfer.copy_tensor

    def counting(t: torch.Tensor, target: torch.device, non_blocking: bool) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return real(t, target, non_blocking)

    monkeypatch.setattr(_transfer, "copy_tensor", counting)
    torchplace.move(model, "meta", optimizer=opt, attributes="move")
    monkeypatch.setattr(_transfer, "copy_tensor", real)
    return calls


@pytest.mark.slow
def test_failure_at_every_copy_leaves_everything_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    probe, probe_opt = trained()
    probe.scale = torch.ones(1)
    total = _count_copies(probe, probe_opt, monkeypatch)
    assert total > 20
    for k in range(total):
        model, opt = trained()
        model.scale = torch.ones(1)
        before = snapshot(model, opt)
        calls = 0

        def failing(
            t: torch.Tensor, target: torch.device, non_blocking: bool, k: int = k
        ) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == k + 1:
                raise RuntimeError(f"injected failure at copy {k}")
            return _COPY(t, target, non_blocking)

        monkeypatch.setattr(_transfer, "copy_tensor", failing)
        with pytest.raises(torchplace.MoveError, match=f"injected failure at copy {k}") as info:
            torchplace.move(model, "meta", optimizer=opt, attributes="move")
        monkeypatch.setattr(_transfer, "copy_tensor", _COPY)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert_unchanged(model, before, opt)
        assert model.emb.weight is model.head.weight


@pytest.mark.slow
def test_failure_at_every_commit_step_is_rolled_back(monkeypatch: pytest.MonkeyPatch) -> None:
    applied = 0
    real_apply = _identity.UndoLog.apply

    def counting(self: Any, do: Any, undo: Any) -> None:
        nonlocal applied
        applied += 1
        real_apply(self, do, undo)

    probe, probe_opt = trained()
    monkeypatch.setattr(_identity.UndoLog, "apply", counting)
    torchplace.move(probe, "meta", optimizer=probe_opt)
    total = applied
    assert total > 10
    for k in range(total):
        model, opt = trained()
        before = snapshot(model, opt)
        calls = 0

        def failing(self: Any, do: Any, undo: Any, k: int = k) -> None:
            nonlocal calls
            calls += 1
            if calls == k + 1:
                raise RuntimeError(f"injected commit failure {k}")
            real_apply(self, do, undo)

        monkeypatch.setattr(_identity.UndoLog, "apply", failing)
        with pytest.raises(torchplace.MoveError, match=f"injected commit failure {k}"):
            torchplace.move(model, "meta", optimizer=opt)
        assert_unchanged(model, before, opt)
        assert model.emb.weight is model.head.weight


# -- real accelerators -------------------------------------------------------------------------


@pytest.mark.requires_cuda
def test_cuda_round_trip_keeps_identity_values_and_policy() -> None:
    model, opt = trained()
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    state = {k: v.clone() for k, v in opt.state[model.emb.weight].items()}
    torchplace.move(model, "cuda", optimizer=opt)
    torchplace.verify(model, "cuda:0", optimizer=opt)
    assert opt.state[model.emb.weight]["step"].device == CPU
    model(torch.randint(0, 10, (5,), device="cuda")).sum().backward()  # runs: no device mixing
    torchplace.move(model, "cpu", optimizer=opt)
    for name, p in model.named_parameters():
        assert p is params[name]
        assert torch.equal(p.detach(), before[name])
    for key, value in opt.state[model.emb.weight].items():
        assert torch.equal(value, state[key])


@pytest.mark.requires_cuda
def test_cuda_to_host_results_are_ready_when_returned() -> None:
    big = torch.randn(64, 1024, 1024, device="cuda")
    out = torchplace.move({"big": big}, "cpu")["big"]  # non_blocking chosen, synced by event
    assert out.device == CPU and out.is_pinned()  # an asynchronous copy lands in pinned memory
    assert torch.equal(out, big.cpu())


@pytest.mark.requires_cuda
def test_cuda_model_to_host_is_not_left_in_pinned_memory() -> None:
    model = torchplace.move(nn.Linear(64, 64), "cuda:0")
    torchplace.move(model, "cpu")
    assert not model.weight.is_pinned()


def test_moving_a_dispatched_model_gathers_it_and_removes_every_hook() -> None:
    from torchplace.spreading._dispatch import is_dispatched

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    expected = model(torch.ones(1, 4))
    torchplace.dispatch(model, {"0": "cpu", "2": "meta"})
    assert torchplace.devices_of(model) == {CPU, META}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torchplace.move(model, "meta", optimizer=opt)
    assert not is_dispatched(model)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    torchplace.verify(model, "meta", optimizer=opt)
    assert model(torch.ones(1, 4, device="meta")).shape == expected.shape


def test_many_small_tensors_to_an_accelerator_go_as_one_consolidated_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wiring of consolidation, with meta standing in for an accelerator."""
    calls: list[list[torch.Tensor]] = []
    outputs: list[torch.Tensor] = []

    def consolidated(
        tensors: list[torch.Tensor], device: torch.device, *, non_blocking: bool
    ) -> list[torch.Tensor]:
        calls.append(list(tensors))
        moved = [t.to(device) for t in tensors]
        outputs.extend(moved)
        return moved

    for module in (_move, _transfer):
        monkeypatch.setattr(module, "is_accelerator", lambda dev: dev.type != "cpu")
    monkeypatch.setattr(_transfer, "should_consolidate", lambda tensors, dev: len(tensors) >= 8)
    monkeypatch.setattr(_transfer, "packed_host_copy", consolidated)

    def as_views(
        tensors: list[torch.Tensor], device: torch.device, *, pin: bool, non_blocking: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return consolidated(tensors, device, non_blocking=non_blocking), []

    monkeypatch.setattr(_transfer, "consolidated_views", as_views)  # a batch's path
    model, opt = trained()
    torchplace.move(model, "meta", optimizer=opt)
    assert len(calls) == 1
    # parameters, grads, Adam's exp_avg and exp_avg_sq (not its 0-dim step), and 3 buffers
    assert len(calls[0]) == len({id(p) for p in model.parameters()}) * 4 + 3
    assert any(model.norm.running_mean is o for o in outputs)  # the consolidated copy is used
    state = opt.state[model.norm.weight]
    assert any(state["exp_avg"] is o for o in outputs) and state["step"].device == CPU
    batch = {"xs": [torch.ones(1) for _ in range(10)]}
    batch["again"] = batch["xs"][0]
    moved = torchplace.move(batch, "meta")
    assert len(calls) == 2 and len(calls[1]) == 10  # each distinct tensor once
    assert moved["xs"][0] is moved["again"] and any(moved["xs"][3] is o for o in outputs)
    few = torchplace.move([torch.ones(1)] * 3, "meta")
    assert len(calls) == 2 and few[0].device == META  # below the threshold: one by one


# -- findings of review -------------------------------------------------------------------------


def test_host_sync_per_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each accelerator is waited for with its own API: MPS's synchronize takes no argument."""
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda *args: calls.append(("mps", *args)))
    copier = _transfer.Copier(CPU, None)
    copier.sync_sources.add(torch.device("mps", 0))
    copier.synchronize()
    assert calls == [("mps",)]


def test_device_to_host_policy_keeps_models_out_of_pinned_memory() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        on_gpu = torch.empty(4, device="cuda:0")
    choose = _transfer.choose_non_blocking
    assert choose(on_gpu, CPU, None) is False  # a model's tensors: synchronous, not pinned
    assert choose(on_gpu, CPU, None, batch=True) is True  # a batch: async, then event sync
    assert choose(on_gpu, torch.device("cuda:1"), None) is True
    assert choose(on_gpu, CPU, False, batch=True) is False  # the caller decides when asked


def test_rebinding_rekeys_empty_optimizer_state() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.weight]  # reading a defaultdict creates an empty entry
    torchplace.move(model, "meta", optimizer=opt)
    assert set(map(id, opt.state)) <= {id(p) for p in model.parameters()}
    assert opt.state_dict()["param_groups"][0]["params"] == [0, 1]


class Store(MutableMapping[str, Any]):
    """A mapping that keeps its items in an attribute: a shallow copy would share them."""

    def __init__(self, items: dict[str, Any] | None = None) -> None:
        self._d = dict(items or {})

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._d[key] = value

    def __delitem__(self, key: str) -> None:
        del self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


def test_a_mutable_mapping_is_rebuilt_not_written_through() -> None:
    store = Store({"x": torch.ones(1), "n": 1})
    moved = torchplace.move(store, "meta")
    assert type(moved) is Store and moved["x"].device == META and moved["n"] == 1
    assert store["x"].device == CPU  # the caller's batch is untouched


class InPlace:
    """Moves itself in place, as a tokenizer's BatchEncoding does."""

    def __init__(self) -> None:
        self.ids = torch.ones(2)

    def to(self, device: torch.device) -> InPlace:
        self.ids = self.ids.to(device)
        return self


def test_objects_with_their_own_to_move_after_every_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    encoding = InPlace()
    calls = 0

    def failing_second(t: torch.Tensor, target: torch.device, non_blocking: bool) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("injected")
        return _COPY(t, target, non_blocking)

    monkeypatch.setattr(_transfer, "copy_tensor", failing_second)
    with pytest.raises(torchplace.MoveError, match=r"batch\[2\]") as info:
        torchplace.move([torch.ones(1), encoding, torch.ones(1)], "meta")
    assert info.value.name == "batch[2]"
    assert encoding.ids.device == CPU  # never reached: nothing of the batch moved
    monkeypatch.setattr(_transfer, "copy_tensor", _COPY)
    moved = torchplace.move([torch.ones(1), encoding], "meta")
    assert moved[1].ids.device == META
    assert moved[1] is not encoding and encoding.ids.device == CPU  # moved as a copy


def test_a_failing_own_to_undoes_the_modules_moved_before_it() -> None:
    class Broken:
        def to(self, device: torch.device) -> Broken:
            raise RuntimeError("no such device here")

    model = nn.Linear(2, 2)
    weight = model.weight
    with pytest.raises(
        torchplace.MoveError, match=r"could not move batch\['enc'\] to meta"
    ) as info:
        torchplace.move({"model": model, "enc": Broken()}, "meta")
    assert info.value.name == "batch['enc']"
    assert model.weight is weight and weight.device == CPU


def test_a_forgotten_optimizer_does_not_block_swapping_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Linear(2, 2)
    torch.optim.SGD(model.parameters(), lr=0.1)  # not passed: its parameters go stale
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    torchplace.move(model, "meta")
    monkeypatch.setattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: True)
    model.to_empty(device="cpu")  # PyTorch's swap path: no weak reference may stand in the way
    assert model.weight.device == CPU
    assert stale.param_groups[0]["params"][0] is not model.weight


def test_cyclic_configuration_on_a_module_does_not_block_moves() -> None:
    model = nn.Linear(2, 2)
    config: dict[str, Any] = {"name": "x"}
    config["self"] = config
    model.config = config
    torchplace.move(model, "meta")
    assert model.weight.device == META and model.config is config
    assert torchplace.stragglers(model, "meta") == []


def test_a_parameter_beside_its_model_in_a_batch_stays_the_models() -> None:
    model = nn.Linear(2, 2)
    out = torchplace.move({"model": model, "w": model.weight, "x": torch.ones(1)}, "meta")
    assert out["model"] is model and out["w"] is model.weight and out["x"].device == META


def test_modules_inside_a_batch_are_named_by_their_place() -> None:
    model = nn.Linear(2, 2, device="meta")
    with pytest.raises(torchplace.MoveError, match=r"^batch\['model'\]\.weight is on meta") as e:
        torchplace.move({"model": model}, "cpu")
    assert e.value.name == "batch['model'].weight"


class _TwoArgs(tuple):  # type: ignore[type-arg]
    def __new__(cls, a: Any, b: Any) -> _TwoArgs:
        return super().__new__(cls, (a, b))


class _Star(tuple):  # type: ignore[type-arg]
    def __new__(cls, *items: Any) -> _Star:
        return super().__new__(cls, items)


class _Scaled(tuple):  # type: ignore[type-arg]
    def __new__(cls, items: Any, scale: float) -> _Scaled:
        return super().__new__(cls, items)


def test_tuple_subclasses_are_rebuilt_or_named() -> None:
    out = torchplace.move(torch.max(torch.arange(6.0).reshape(2, 3), 1), "meta")
    assert type(out) is torch.return_types.max
    assert out.values.device.type == "meta" and out.indices.dtype == torch.int64
    # Constructors that take the items one by one: Star(*items) would wrap a list in one item.
    for odd_class in (_TwoArgs, _Star):
        moved = torchplace.move(odd_class(torch.ones(2), 7), "meta")
        assert type(moved) is odd_class and len(moved) == 2
        assert moved[0].device.type == "meta" and moved[1] == 7
    kept = torch.ones(1)
    odd = {"ok": kept, "odd": _Scaled((torch.ones(1), 2), 0.5)}
    with pytest.raises(torchplace.MoveError, match=r"_Scaled.*constructor that takes one") as e:
        torchplace.move(odd, "meta")
    assert e.value.name == "batch['odd']"
    assert odd["ok"] is kept and odd["odd"][0].device.type == "cpu"


def test_an_optimizer_of_another_model_is_refused_before_anything_moves() -> None:
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    other(torch.ones(1, 2)).sum().backward()
    opt.step()
    weight = model.weight
    with pytest.raises(torchplace.MoveError, match=r"holds none of the parameters.*2 belong") as e:
        torchplace.move(model, "meta", optimizer=opt)
    assert e.value.name == "optimizer"
    assert model.weight is weight and weight.device.type == "cpu"
    # one optimizer over two models (a GAN's, say) moves the state of the model being moved
    both = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1, momentum=0.9)
    torchplace.move(model, "meta", optimizer=both)
    assert model.weight.device.type == "meta" and other.weight.device.type == "cpu"


def test_an_own_to_without_non_blocking_is_called_plainly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Towards an accelerator move asks .to(device, non_blocking=True); a .to(device) of an
    object's own that takes no such argument is then called with the device alone."""
    for module in (_move, _transfer):  # meta stands in for a GPU
        monkeypatch.setattr(module, "is_accelerator", lambda dev: True)
    encoding = InPlace()  # def to(self, device)
    moved = torchplace.move({"enc": encoding}, "meta", non_blocking=True)
    assert moved["enc"].ids.device == META
    assert moved["enc"] is not encoding and encoding.ids.device == CPU  # the caller's untouched


def test_tensors_without_plain_sizes_fail_with_their_name() -> None:
    """A nested tensor cannot go to meta; the error still names it (its sizes cannot be read)
    and gives the gist of PyTorch's error, not the dispatcher's list of every backend."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors warn that they are a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(torchplace.MoveError) as info:
        torchplace.move({"n": nested}, "meta")
    message = str(info.value)
    assert "batch['n'] (a nested float32 tensor)" in message
    assert info.value.name == "batch['n']"
    assert "full error chained" in message and len(message) < 400
    assert "Could not run" in str(info.value.__cause__)


def test_buffers_and_attributes_that_require_grad_keep_it() -> None:
    model = nn.Linear(2, 2)
    model.register_buffer("mask", torch.ones(2, requires_grad=True))
    model.scale = torch.ones(1, requires_grad=True)
    torchplace.move(model, "meta", attributes="move")
    assert model.mask.device == META and model.mask.requires_grad and model.mask.is_leaf
    assert model.scale.device == META and model.scale.requires_grad and model.scale.is_leaf


def test_tags_on_a_replaced_parameter_survive() -> None:
    model = nn.Linear(2, 2)
    model.weight.no_weight_decay = True  # type: ignore[attr-defined]
    before = model.weight
    torchplace.move(model, "meta")  # cpu -> meta replaces the Parameter objects
    assert model.weight is not before and model.weight.device == META
    assert getattr(model.weight, "no_weight_decay", None) is True


@dataclasses.dataclass
class _FieldsAsMapping(Mapping):  # type: ignore[type-arg]
    """A dataclass that reads as a mapping but is no dict: rebuilt field by field."""

    x: torch.Tensor
    y: int = 0

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(("x", "y"))

    def __len__(self) -> int:
        return 2


def test_a_mapping_dataclass_that_is_no_dict_is_rebuilt_by_its_fields() -> None:
    moved = torchplace.move(_FieldsAsMapping(torch.ones(2), 5), "meta")
    assert type(moved) is _FieldsAsMapping and moved.y == 5 and moved.x.device == META


def _adam_trained() -> tuple[nn.Linear, torch.optim.Optimizer]:
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _trains(model: nn.Module, opt: torch.optim.Optimizer) -> bool:
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("way", ["load_into", "to_empty"])
def test_the_way_back_from_meta_with_an_optimizer_works_as_written(
    tmp_path: Path, way: str
) -> None:
    """Both ways the error gives, followed with what it says of the optimizer, train again."""
    model, opt = _adam_trained()
    torch.save(model.state_dict(), tmp_path / "w.pt")
    torchplace.move(model, "meta", optimizer=opt)
    with pytest.raises(torchplace.MoveError) as info:
        torchplace.move(model, "cpu", optimizer=opt)
    assert info.value.name == "weight"
    text = str(info.value)
    assert "load_into(model, checkpoint, 'cpu')" in text and "to_empty(device='cpu')" in text
    assert "opt.state.clear()" in text and "torchplace.move(model, 'cpu', optimizer=opt)" in text
    if way == "load_into":
        torchplace.load_into(model, tmp_path / "w.pt", "cpu")
    else:
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.reset_parameters()  # "and initialise it"
    opt.state.clear()
    torchplace.move(model, "cpu", optimizer=opt)
    torchplace.verify(model, "cpu", optimizer=opt)
    assert _trains(model, opt)


def test_verify_after_to_empty_and_a_cleared_state_says_to_rebind() -> None:
    model, opt = _adam_trained()
    torchplace.move(model, "meta", optimizer=opt)
    model.to_empty(device="cpu")  # replaces the parameters: the optimizer holds the old ones
    opt.state.clear()
    with pytest.raises(torchplace.PlacementError) as info:
        torchplace.verify(model, "cpu", optimizer=opt)
    assert "opt.state.clear()" not in str(info.value)  # done already: not asked again
    assert "re-bind it: torchplace.move(model, 'cpu', optimizer=opt)" in str(info.value)
    torchplace.move(model, "cpu", optimizer=opt)
    torchplace.verify(model, "cpu", optimizer=opt)
    assert opt.param_groups[0]["params"][0] is model.weight


class _Masked(nn.Linear):
    @functools.cached_property
    def mask(self) -> torch.Tensor:
        return torch.ones_like(self.weight)


def test_a_modules_cached_property_moves_with_it_without_a_warning() -> None:
    model = _Masked(2, 2)
    assert model.mask.device == CPU  # computed, cached in the instance
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchplace.move(model, "meta")
    assert model.mask.device == META
    torchplace.verify(model, "meta")
    model.__dict__["mask"] = torch.ones(2, 2)  # a stale cached value: found, and the fix works
    with pytest.raises(torchplace.PlacementError, match=r"cached_property.*del model\.mask") as e:
        torchplace.verify(model, "meta")
    assert [s.name for s in e.value.stragglers] == ["mask"]
    del model.mask
    torchplace.verify(model, "meta")


def test_an_optimizer_shared_with_another_model_is_named_as_such_and_the_fix_works() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1, momentum=0.9)
    (a(torch.ones(1, 2)).sum() + b(torch.ones(1, 2)).sum()).backward()
    opt.step()
    torchplace.move(a, "meta", optimizer=opt)
    with pytest.raises(torchplace.PlacementError) as info:
        torchplace.verify(a, "meta", optimizer=opt)
    text = str(info.value)
    assert "not part of this model" in text
    assert "torchplace.move(other_model, 'meta', optimizer=opt)" in text
    other_model = b
    torchplace.move(other_model, "meta", optimizer=opt)
    torchplace.verify(a, "meta", optimizer=opt)


class _Opaque:
    """Neither a container torchplace walks nor an object with its own .to()."""

    def __init__(self) -> None:
        self.x = torch.ones(2)


def test_an_object_move_cannot_walk_is_said_and_seen() -> None:
    obj = _Opaque()
    with pytest.warns(UserWarning, match=r"left the _Opaque as it is.*batch\.x.*\.to\(device\)"):
        assert torchplace.move(obj, "meta") is obj
    assert obj.x.device == CPU
    with pytest.raises(torchplace.PlacementError, match=r"batch\.x .*held by _Opaque") as info:
        torchplace.verify(obj, "meta")
    assert [(s.name, s.device) for s in info.value.stragglers] == [("batch.x", CPU)]
    assert torchplace.where(obj) == CPU  # no longer "holds no tensors"


class _Tracked(nn.Module):
    """Moves a state of its own in _apply, as a torchmetrics metric does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.lin.cache = torch.ones(1)  # a plain attribute of a plain child: nobody moves it
        self.total = torch.zeros(1)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        this = super()._apply(fn, recurse)
        self.total = fn(self.total)
        return this


def test_only_a_self_moving_module_s_own_state_gets_the_move_fix() -> None:
    model = _Tracked()
    with pytest.raises(torchplace.PlacementError) as info:
        torchplace.verify(model, "meta")
    found = [s.name for s in info.value.stragglers]
    assert found == ["lin.weight", "lin.bias", "total", "lin.cache"]
    lines = {line.split(" (")[0].strip("- "): line for line in str(info.value).splitlines()[1:]}
    assert "moves it itself (_Tracked's _apply)" in lines["total"]
    assert (
        "self.register_buffer('cache', ...) in its module's __init__ in place of self.cache = "
        "..., or pass attributes='move'"
    ) in lines["lin.cache"]
    torchplace.move(model, "meta", attributes="move")  # the fix given for lin.cache, followed
    torchplace.verify(model, "meta")


class _OwnTo:
    """A batch-like object with its own .to(), as a tokenizer's BatchEncoding has."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: Any, non_blocking: bool = False) -> _OwnTo:
        return _OwnTo(self.t.to(device, non_blocking=non_blocking))


def test_an_attribute_with_its_own_to_moves_by_it_under_attributes_move() -> None:
    """The fix verify gives for such an attribute (attributes='move') works when followed."""
    model = nn.Linear(2, 2)
    kept = _OwnTo(torch.arange(3.0))
    model.extra = kept  # type: ignore[assignment]
    with pytest.raises(torchplace.PlacementError, match="attributes='move'") as info:
        torchplace.verify(model, "meta")
    assert [s.name for s in info.value.stragglers] == ["weight", "bias", "extra.t"]
    torchplace.move(model, "meta", attributes="move")
    assert model.extra.t.device.type == "meta"  # type: ignore[union-attr]
    assert kept.t.device.type == "cpu"  # the caller's object is left as it was
    torchplace.verify(model, "meta")


def test_an_attribute_with_its_own_to_left_behind_is_warned_about() -> None:
    model = nn.Linear(2, 2)
    model.extra = _OwnTo(torch.arange(3.0))  # type: ignore[assignment]
    with pytest.warns(UserWarning, match=r"\(extra\)"):
        torchplace.move(model, "meta")
    assert model.extra.t.device.type == "cpu"  # type: ignore[union-attr]
