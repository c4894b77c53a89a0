"""estimate, plan and dispatch: several devices, tested on cpu, meta and fake CUDA devices."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import inspect
import json
import pickle
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import torchplace._dispatch as dispatch_module
from torchplace._dispatch import (
    Estimate,
    dispatch,
    estimate,
    is_dispatched,
    plan,
    undispatch,
)
from torchplace._errors import (
    DeviceMismatchError,
    DeviceSpecError,
    DeviceUnavailableError,
    MoveError,
    TorchplaceError,
)

CPU, META = torch.device("cpu"), torch.device("meta")
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)

LINEAR_BYTES = (16 * 16 + 16) * 4  # nn.Linear(16, 16) in float32: 1088 bytes


# --- models ----------------------------------------------------------------------------------


class Block(nn.Module):
    """A residual block: its own forward adds its input to its children's output.

    The sum goes through torch.cat, which refuses a cpu/meta mix (a plain + lets it through).
    """

    def __init__(self, width: int = 16, device: str | None = None) -> None:
        super().__init__()
        self.a = nn.Linear(width, width, device=device)
        self.b = nn.Linear(width, width, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.b(torch.relu(self.a(x)))]).view(2, *x.shape).sum(0)


class Net(nn.Module):
    """Embedding-like input layer, a stack of blocks and a head."""

    def __init__(self, blocks: int = 3, device: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16, device=device)
        self.blocks = nn.ModuleList(Block(device=device) for _ in range(blocks))
        self.head = nn.Linear(16, 4, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TiedLM(nn.Module):
    """A language-model shape: the head shares the embedding's weight."""

    def __init__(self, vocab: int = 32, width: int = 16, device: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, device=device)
        self.body = nn.Sequential(*(nn.Linear(width, width, device=device) for _ in range(3)))
        self.lm_head = nn.Linear(width, vocab, device=device)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(self.embed(tokens)))


def seeded(factory: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return factory()


@contextlib.contextmanager
def cuda_forbidden() -> Iterator[None]:
    """Any CUDA call inside fails the test: plan must never touch the devices it plans for."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("plan touched CUDA")

    with pytest.MonkeyPatch.context() as patch:
        for name in ("is_available", "device_count", "current_device", "set_device"):
            patch.setattr(torch.cuda, name, forbidden)
        patch.setattr(torch.cuda, "mem_get_info", forbidden)
        patch.setattr(torch.cuda, "_lazy_init", forbidden)
        yield


def on_fake_cuda(model: nn.Module, placement: dict[str, str]) -> nn.Module:
    """Give a meta-built model fake parameters reporting CUDA devices (DESIGN.md §4).

    Tied parameters stay tied: each parameter object is replaced once, everywhere it appears.
    """
    replaced: dict[int, nn.Parameter] = {}
    with FakeTensorMode():
        for prefix, dev in placement.items():
            for module in model.get_submodule(prefix).modules():
                for name, param in list(module._parameters.items()):
                    if param is None:
                        continue
                    if id(param) not in replaced:
                        fake = torch.empty(param.shape, dtype=param.dtype, device=dev)
                        replaced[id(param)] = nn.Parameter(fake, requires_grad=False)
                    setattr(module, name, replaced[id(param)])
    return model


KINDS = ["skeleton", "fake-cuda"]


def built(kind: str, factory: Callable[..., nn.Module], **kwargs: Any) -> nn.Module:
    """The model as a skeleton (parameters on meta) or with fake parameters on cuda:0."""
    model = factory(device="meta", **kwargs)
    return model if kind == "skeleton" else on_fake_cuda(model, {"": "cuda:0"})


# --- estimate --------------------------------------------------------------------------------


def test_estimate_adam_counts_parameters_gradients_and_state() -> None:
    est = estimate(nn.Linear(16, 16), optimizer="adam")
    assert isinstance(est, Estimate)
    assert (est.parameters, est.gradients) == (LINEAR_BYTES, LINEAR_BYTES)
    # exp_avg and exp_avg_sq like each parameter, plus a float32 step per parameter on the cpu
    assert est.optimizer_state == 2 * LINEAR_BYTES + 2 * 4
    assert est.total == 4 * LINEAR_BYTES + 8
    assert est.by_device() == {CPU: est.total}


@pytest.mark.parametrize(
    ("optimizer", "state"),
    [
        ("sgd", 0),
        ("sgd-momentum", LINEAR_BYTES),
        ("momentum", LINEAR_BYTES),
        ("adamw", 2 * LINEAR_BYTES + 8),
        ("adagrad", LINEAR_BYTES + 8),
        (None, 0),
    ],
)
def test_estimate_optimizer_state_per_kind(optimizer: str | None, state: int) -> None:
    assert estimate(nn.Linear(16, 16), optimizer=optimizer).optimizer_state == state


@pytest.mark.parametrize(
    ("kind", "factory"),
    [
        ("sgd-momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
        ("adam", lambda p: torch.optim.Adam(p)),
        ("adamw", lambda p: torch.optim.AdamW(p)),
        ("adagrad", lambda p: torch.optim.Adagrad(p)),
    ],
)
def test_estimate_matches_the_state_pytorch_creates(
    kind: str, factory: Callable[[Any], torch.optim.Optimizer]
) -> None:
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 2))
    optimizer = factory(model.parameters())
    model(torch.ones(3, 16)).sum().backward()
    optimizer.step()
    state_bytes = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    assert estimate(model, optimizer=kind).optimizer_state == state_bytes


def test_estimate_skeleton_sizes_like_the_real_model() -> None:
    real = estimate(Net())
    skeleton = estimate(Net(device="meta"))
    assert skeleton.total == real.total
    assert {row.device for row in skeleton.rows} == {META, CPU}  # Adam's step lives on the cpu


def test_estimate_frozen_parameters_need_no_gradients_or_state() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    model[0].requires_grad_(False)
    est = estimate(model, optimizer="sgd-momentum")
    assert est.parameters == 2 * LINEAR_BYTES
    assert est.gradients == est.optimizer_state == LINEAR_BYTES
    assert est.trainable_count == est.parameter_count // 2
    assert estimate(model, optimizer=None, grads=False).total == 2 * LINEAR_BYTES


def test_estimate_counts_tied_parameters_once_and_buffers() -> None:
    model = TiedLM()
    model.register_buffer("mask", torch.ones(10, dtype=torch.bool))
    est = estimate(model, optimizer=None, grads=False)
    unique = sum(p.numel() * 4 for p in model.parameters())
    assert est.parameters == unique
    assert est.buffers == 10
    assert {(row.device, row.dtype) for row in est.rows} == {
        (CPU, torch.float32),
        (CPU, torch.bool),
    }


def test_estimate_per_device_and_dtype_on_fake_cuda() -> None:
    model = on_fake_cuda(Net(device="meta"), {"embed": "cuda:0", "blocks": "cuda:1"})
    model.head.half()
    est = estimate(model, optimizer=None, grads=False)
    rows = {(row.device, row.dtype): row.parameters for row in est.rows}
    assert rows == {
        (CUDA0, torch.float32): (8 * 16 + 16) * 4,
        (CUDA1, torch.float32): 6 * LINEAR_BYTES,
        (META, torch.float16): (16 * 4 + 4) * 2,
    }


def test_estimate_summary_is_readable_and_json_able() -> None:
    est = estimate(Net(), optimizer="adam")
    text = str(est)
    for word in ("parameters", "gradients", "optimizer", "total", "cpu", "float32", "adam"):
        assert word in text
    assert "KiB" in text
    data = json.loads(json.dumps(est.to_dict()))
    assert data["total"] == est.total
    assert data["by_device"] == {"cpu": est.total}


def test_estimate_rejects_unknown_optimizer_with_a_suggestion() -> None:
    with pytest.raises(DeviceSpecError, match=r"'adma'.*did you mean 'adam'"):
        estimate(nn.Linear(2, 2), optimizer="adma")


# --- plan: budgets ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1024, 1024),
        ("1024", 1024),
        ("10GiB", 10 * 2**30),
        ("500MB", 500 * 10**6),
        ("1.5KiB", 1536),
        (" 2 gb ", 2 * 10**9),
        ("0", 0),
    ],
)
def test_sizes_are_read_as_given(text: int | str, expected: int) -> None:
    assert dispatch_module._parse_size(text, "here") == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("10G", r"max_memory\['cpu'\].*'10GiB'.*'10GB'"),
        ("ten", r"max_memory\['cpu'\]: cannot read the size 'ten'"),
        ("5 parsecs", r"cannot read the size"),
        (-1, r"negative"),
        (True, r"not True"),
        (None, r"cannot read the size None"),
    ],
)
def test_malformed_sizes_name_the_entry(value: object, message: str) -> None:
    with pytest.raises(DeviceSpecError, match=message):
        plan(nn.Linear(2, 2), {"cpu": value})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("budgets", "message"),
    [
        ({"cdua:0": "1GiB"}, r"unknown device 'cdua:0'; did you mean 'cuda'"),
        ({"gpu": "1GiB"}, r"'gpu'.*named device such as 'cuda:0'"),
        ({"disk": "1GiB"}, r"disk is not supported"),
        ({"cuda": 10, "cuda:0": 10}, r"names cuda:0 twice"),
        ({"cpu:3": 10}, r"no index 3"),
        ({-1: 10}, r"negative"),
        ({}, r"non-empty dict"),
    ],
)
def test_budgets_for_unknown_devices_name_the_entry(budgets: Any, message: str) -> None:
    with pytest.raises(DeviceSpecError, match=message):
        plan(nn.Linear(2, 2), budgets)


def test_budget_keys_normalise_without_touching_devices() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    with cuda_forbidden():
        assert plan(model, {"cuda": LINEAR_BYTES, 1: "1MiB"}) == {"0": CUDA0, "1": CUDA1}
        assert plan(model, {torch.device("cuda"): "1MiB"}) == {"": CUDA0}


# --- plan: placement -------------------------------------------------------------------------


def test_plan_fills_devices_in_order_on_a_skeleton() -> None:
    model = nn.Sequential(*(nn.Linear(16, 16, device="meta") for _ in range(5)))
    with cuda_forbidden():
        device_map = plan(model, {"cuda:0": 2 * LINEAR_BYTES, "cuda:1": "2KiB", "cpu": "1GiB"})
    assert device_map == {"0": CUDA0, "1": CUDA0, "2": CUDA1, "3": CPU, "4": CPU}
    assert list(device_map) == ["0", "1", "2", "3", "4"]  # execution order
    assert all(p.device == META for p in model.parameters())  # the model is untouched


def test_plan_on_fake_cuda_devices_matches_the_skeleton() -> None:
    budgets = {"cuda:0": "3KiB", "cuda:1": "3KiB", "cpu": "1MiB"}
    fake = on_fake_cuda(Net(device="meta"), {"embed": "cuda:1", "blocks": "cuda:0"})
    assert fake.embed.weight.device == CUDA1
    with cuda_forbidden():
        skeleton_map = plan(Net(device="meta"), budgets)
        assert set(skeleton_map.values()) == {CUDA0, CUDA1, CPU}
        assert plan(fake, budgets) == skeleton_map


def test_plan_budget_is_taken_as_given_without_a_reserve() -> None:
    model = Net(device="meta")
    total = estimate(model, optimizer=None, grads=False).total
    assert plan(model, {"cuda:0": total}) == {"": CUDA0}
    with pytest.raises(TorchplaceError, match=r"1 B short"):
        plan(model, {"cuda:0": total - 1})


@pytest.mark.parametrize("kind", KINDS)
def test_plan_collapses_children_of_one_device_to_their_parent(kind: str) -> None:
    model = built(kind, Net)
    embed_bytes = (8 * 16 + 16) * 4
    device_map = plan(model, {"cuda:0": embed_bytes + 2 * LINEAR_BYTES, "cuda:1": "1MiB"})
    # blocks.0 is one entry, not blocks.0.a and blocks.0.b; blocks.1 and 2 and head share cuda:1
    assert device_map == {"embed": CUDA0, "blocks.0": CUDA0, "blocks.1": CUDA1,
                          "blocks.2": CUDA1, "head": CUDA1}  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_plan_splits_a_module_unless_it_is_in_no_split(kind: str) -> None:
    model = built(kind, Net, blocks=2)
    embed_bytes = (8 * 16 + 16) * 4
    budgets = {"cuda:0": embed_bytes + LINEAR_BYTES, "cuda:1": "1MiB"}
    split = plan(model, budgets)
    assert split["blocks.0.a"] == CUDA0
    assert split["blocks.0.b"] == CUDA1
    for no_split in ([Block], ["Block"], Block, "Block"):
        whole = plan(model, budgets, no_split=no_split)
        assert whole == {"embed": CUDA0, "blocks": CUDA1, "head": CUDA1}


def test_plan_rejects_unknown_no_split_names() -> None:
    with pytest.raises(DeviceSpecError, match=r"'Blok'.*did you mean 'Block'"):
        plan(Net(device="meta"), {"cpu": "1GiB"}, no_split=["Blok"])
    with pytest.raises(DeviceSpecError, match=r"neither a module class nor a class name"):
        plan(Net(device="meta"), {"cpu": "1GiB"}, no_split=[3])  # type: ignore[list-item]


@pytest.mark.parametrize("kind", ["skeleton", "fake-cuda"])
def test_plan_keeps_tied_parameters_on_one_device(kind: str) -> None:
    model = TiedLM(device="meta")
    if kind == "fake-cuda":
        model = on_fake_cuda(model, {"": "cuda:1"})
        assert model.lm_head.weight is model.embed.weight
        assert model.embed.weight.device == CUDA1
    embed = 32 * 16 * 4
    # Room for the embedding and one body layer on cuda:0, but the tied head (weight and bias)
    # comes along with the embedding, placed when its first member is: its bias takes the room.
    device_map = plan(model, {"cuda:0": embed + LINEAR_BYTES, "cuda:1": "1MiB"})
    assert device_map["embed"] == device_map["lm_head"] == CUDA0
    assert device_map["body"] == CUDA1
    assert list(device_map) == ["embed", "body", "lm_head"]
    if kind == "skeleton":
        dispatch(model, dict.fromkeys(device_map, "meta"))  # a map dispatch accepts


def test_plan_ties_make_a_group_that_does_not_fit_say_so() -> None:
    model = TiedLM(device="meta")
    budgets = {"cuda:0": 2100, "cuda:1": 2100, "cpu": 2100}  # the group needs 2048 + 128 bytes
    with pytest.raises(TorchplaceError, match=r"model.embed \(Embedding\).*bring model.lm_head"):
        plan(model, budgets)


@pytest.mark.parametrize("kind", KINDS)
def test_plan_model_larger_than_all_budgets_reports_the_shortfall(kind: str) -> None:
    model = built(kind, Net)
    total = estimate(model, optimizer=None, grads=False).total
    with pytest.raises(TorchplaceError, match=r"budgets hold 2.0 KiB .*short") as info:
        plan(model, {"cuda:0": "1KiB", "cpu": "1KiB"})
    assert dispatch_module._format_bytes(total - 2048) in str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_plan_names_a_no_split_module_that_fits_nowhere(kind: str) -> None:
    model = built(kind, Net, blocks=1)
    embed = (8 * 16 + 16) * 4
    budgets = {"cuda:0": embed + LINEAR_BYTES, "cpu": LINEAR_BYTES + (16 * 4 + 4) * 4 + 10}
    with pytest.raises(TorchplaceError, match=r"model.blocks.0 \(Block\).*Block is in no_split"):
        plan(model, budgets, no_split=["Block"])


def test_plan_dtype_sizes_floating_tensors_as_cast() -> None:
    model = Net(device="meta")
    half = estimate(model, optimizer=None, grads=False).total // 2
    assert plan(model, {"cuda:0": half}, dtype=torch.float16) == {"": CUDA0}
    assert plan(model, {"cuda:0": half}, dtype="bfloat16") == {"": CUDA0}
    with pytest.raises(DeviceSpecError, match=r"dtype='float17'"):
        plan(model, {"cuda:0": half}, dtype="float17")


# --- dispatch on the cpu ---------------------------------------------------------------------


def test_dispatch_on_cpu_gives_identical_outputs_and_gradients() -> None:
    reference = seeded(Net)
    model = copy.deepcopy(reference)
    x = torch.randn(5, 8)
    device_map = {"embed": "cpu", "blocks.0": "cpu", "blocks.1.a": "cpu", "": "cpu"}
    assert dispatch(model, device_map) is model
    assert is_dispatched(model)
    assert model._forward_pre_hooks  # one device: only the model itself needs a hook...
    assert not model.blocks[1].a._forward_pre_hooks
    out = model(x)
    assert torch.equal(out, reference(x))  # ...and change nothing on one device
    out.sum().backward()
    reference(x).sum().backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert got.grad is not None, name
        assert torch.equal(got.grad, want.grad), name


def test_dispatch_moves_inputs_to_each_submodule() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    dispatch(model, {"0": "cpu", "2": "meta"})
    assert model[0].weight.device == CPU
    assert model[2].weight.device == META
    seen: dict[str, torch.device] = {}
    for name, sub in model.named_children():
        sub.register_forward_hook(lambda m, args, out, n=name: seen.__setitem__(n, args[0].device))
    out = model(torch.ones(3, 4))
    assert seen == {"0": CPU, "1": CPU, "2": META}
    assert out.device == META
    assert out.shape == (3, 2)


@dataclasses.dataclass(frozen=True)
class Frozen:
    tensor: torch.Tensor
    label: str


class WithTo:
    """An input that knows how to move itself, like a tokenizer's output."""

    def __init__(self, tensor: torch.Tensor, moved_to: torch.device | None = None) -> None:
        self.tensor = tensor
        self.moved_to = moved_to

    def to(self, device: torch.device) -> WithTo:
        return WithTo(self.tensor.to(device), device)


def test_dispatch_moves_keyword_and_nested_inputs() -> None:
    class Pair(NamedTuple):
        left: torch.Tensor
        right: torch.Tensor

    class Taker(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))
            self.seen: list[Any] = []

        def forward(self, x: torch.Tensor, *, extra: dict[str, Any]) -> torch.Tensor:
            self.seen.append((x, extra))
            return x * self.scale

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(2, 2)
            self.taker = Taker()

        def forward(self, x: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor:
            return self.taker(self.first(x), extra=extra)

    model = dispatch(Outer(), {"first": "cpu", "taker": "meta"})
    empty: collections.defaultdict[str, int] = collections.defaultdict(int)
    counts: collections.defaultdict[str, Any] = collections.defaultdict(list, {"t": torch.ones(1)})
    extra = {
        "pair": Pair(torch.ones(1), torch.zeros(1)),
        "list": [torch.ones(2), "text", 3],
        "empty": empty,
        "counts": counts,
        "frozen": Frozen(torch.ones(1), "tag"),
        "own": WithTo(torch.ones(1)),
    }
    model(torch.ones(1, 2), extra)
    x, got = model.taker.seen[0]
    assert x.device == META
    assert isinstance(got["pair"], Pair)
    assert got["pair"].left.device == META
    assert got["list"][0].device == META
    assert got["list"][1:] == ["text", 3]
    assert got["empty"] is empty  # nothing to move: the same object
    assert got["counts"]["t"].device == META
    assert got["counts"].default_factory is list
    assert isinstance(got["frozen"], Frozen)
    assert got["frozen"].tensor.device == META
    assert got["frozen"].label == "tag"
    assert got["own"].moved_to == META  # its own .to() was used
    assert extra["pair"].left.device == CPU  # the caller's inputs are untouched
    assert counts["t"].device == CPU


def test_dispatch_output_returns_to_the_input_device_on_fake_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # device() checks that a CUDA device exists; fake CUDA devices only exist inside the mode.
    monkeypatch.setattr(dispatch_module, "_device", torch.device)
    seen: dict[str, torch.device] = {}
    with FakeTensorMode(), torch.no_grad():
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        dispatch(model, {"0": "cuda:0", "2": "cuda:1"})
        assert (model[0].weight.device, model[2].weight.device) == (CUDA0, CUDA1)
        for name, sub in model.named_children():
            sub.register_forward_hook(
                lambda m, args, out, n=name: seen.__setitem__(n, args[0].device)
            )
        out = model(torch.empty(3, 4))
        wrapped = dispatch(Wrapper(), {"inner": "cuda:1"})
        result = wrapped(torch.empty(3, 4))
    assert seen == {"0": CUDA0, "1": CUDA0, "2": CUDA1}
    assert out.device == CPU
    assert isinstance(result, Result)  # the output's type survives the trip back
    assert result.values.device == CPU
    assert [t.device for t in result.extra] == [CPU]


@dataclasses.dataclass
class Result:
    values: torch.Tensor
    extra: list[torch.Tensor]


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Result:
        y = self.inner(x)
        return Result(y, [y])


def test_dispatch_keeps_ties_and_rejects_maps_that_split_them() -> None:
    model = TiedLM()
    dispatch(model, {"embed": "meta", "body": "cpu", "lm_head": "meta"})
    assert model.lm_head.weight is model.embed.weight
    assert model.embed.weight.device == META
    with pytest.raises(
        DeviceSpecError, match=r"model.embed.weight is tied to model.lm_head.weight"
    ):
        dispatch(TiedLM(), {"embed": "cpu", "body": "cpu", "lm_head": "meta"})


def test_dispatch_keeps_parameter_identity_on_the_same_kind_of_device() -> None:
    model = Net()
    before = list(model.parameters())
    dispatch(model, {"": "cpu", "head": "cpu"})
    assert all(a is b for a, b in zip(model.parameters(), before, strict=True))


def test_dispatch_gathers_back_with_undispatch_and_to() -> None:
    reference = seeded(Net)
    model = copy.deepcopy(reference)
    model.blocks[0].forward = model.blocks[0].forward  # an instance forward that must survive
    kept = model.blocks[0].__dict__["forward"]
    dispatch(model, {"embed": "cpu", "blocks": "cpu", "blocks.1": "meta", "head": "meta"})
    assert model.blocks[1].a.weight.device == META
    undispatch(model)
    assert not is_dispatched(model)
    for module in model.modules():
        assert not module._forward_pre_hooks
        assert not module._forward_hooks
        assert "_torchplace_dispatch" not in module.__dict__
    assert model.blocks[0].__dict__["forward"] is kept
    assert all("forward" not in m.__dict__ for m in model.modules() if m is not model.blocks[0])
    model.to("meta")
    assert {p.device for p in model.parameters()} == {META}


def test_dispatch_again_replaces_the_hooks() -> None:
    model = Net()
    dispatch(model, {"": "cpu", "head": "meta"})
    dispatch(model, {"": "cpu", "head": "meta"})
    assert len(model._forward_pre_hooks) == 1
    assert len(model.head._forward_pre_hooks) == 1


def test_a_dispatched_model_can_be_copied_and_pickled() -> None:
    model = dispatch(seeded(Net), {"": "cpu", "blocks.2": "meta", "head": "meta"})
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert is_dispatched(twin)
        assert twin.blocks[2].a.weight.device == META
        with torch.no_grad():
            twin.embed.weight.zero_()  # the copy runs its own parameters, not the original's
        assert twin.blocks[0](torch.ones(1, 16)).shape == (1, 16)
        assert twin(torch.ones(2, 8)).device == META
        undispatch(twin)
        assert not is_dispatched(twin)
    assert is_dispatched(model)
    assert bool(model.embed.weight.abs().sum() > 0)
    split = dispatch(Net(), {"": "cpu", "blocks.1.b": "meta"})
    with pytest.raises(DeviceMismatchError, match=r"model.blocks.1 \(Block\)"):
        copy.deepcopy(split)(torch.ones(2, 8))


def test_meta_input_to_a_real_part_is_explained() -> None:
    model = dispatch(Net(), {"": "cpu", "blocks.1": "meta"})
    with pytest.raises(
        MoveError, match=r"model.blocks.2 \(Block\) runs on cpu but got an input on meta"
    ):
        model(torch.ones(2, 8))


def test_signature_of_a_wrapped_forward_is_kept() -> None:
    model = dispatch(Net(), {"": "cpu", "head": "meta"})
    assert "forward" in model.__dict__
    assert list(inspect.signature(model.forward).parameters) == ["x"]


def test_parent_mixing_children_on_two_devices_points_at_no_split() -> None:
    model = Net()
    dispatch(model, {"": "cpu", "blocks.1.b": "meta"})
    with pytest.raises(
        DeviceMismatchError, match=r"model.blocks.1 \(Block\).*no_split=\['Block'\]"
    ):
        model(torch.ones(2, 8))


def test_a_plain_tensor_attribute_is_named_as_the_cause() -> None:
    class WithAttribute(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)
            self.offset = torch.ones(2)  # not registered: dispatch cannot see it

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) + self.offset

    model = nn.Sequential(nn.Linear(2, 2), WithAttribute())
    dispatch(model, {"0": "cpu", "1": "meta"})
    with pytest.raises(DeviceMismatchError, match=r"model.1 \(WithAttribute\).*register_buffer"):
        model(torch.ones(1, 2))


# --- dispatch: bad input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device_map", "error", "message"),
    [
        ({"embd": "cpu"}, DeviceSpecError, r"\['embd'\]: the model has no submodule.*'embed'"),
        ({"head.weight": "cpu"}, DeviceSpecError, r"is a tensor, not a module; map .* 'head'"),
        ({"embed": "cpu"}, DeviceSpecError, r"leaves model.blocks.0.a.weight.* without a device"),
        ({"": "cdua"}, DeviceSpecError, r"device_map\[''\]: unknown device spec 'cdua'"),
        (["cpu"], DeviceSpecError, r"device_map must be a dict"),
    ],
)
def test_bad_device_maps_name_the_entry(device_map: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        dispatch(Net(), device_map)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_dispatch_to_an_absent_device_says_what_is_visible() -> None:
    with pytest.raises(DeviceUnavailableError, match=r"device_map\['head'\]: cuda:0 requested"):
        dispatch(Net(), {"": "cpu", "head": "cuda:0"})


def test_dispatch_of_a_skeleton_to_a_real_device_points_at_load_into() -> None:
    with pytest.raises(MoveError, match=r"embed.weight is on meta.*load_into"):
        dispatch(Net(device="meta"), {"": "cpu"})


def test_a_failed_dispatch_puts_back_what_it_moved() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    first = model[0].weight
    with pytest.raises(MoveError, match=r"1.weight is on meta"):
        dispatch(model, {"0": "meta", "1": "cpu"})
    assert model[0].weight is first
    assert first.device == CPU
    assert not is_dispatched(model)


# --- CUDA ------------------------------------------------------------------------------------

CLOSE = {"rtol": 1e-4, "atol": 1e-5}  # GPU and CPU kernels may round differently


@pytest.mark.requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_dispatch_across_two_cuda_devices() -> None:
    reference = seeded(Net)
    model = copy.deepcopy(reference)
    total = estimate(model, optimizer=None, grads=False).total
    device_map = plan(model, {"cuda:0": total // 2, "cuda:1": total}, no_split=[Block])
    assert set(device_map.values()) == {CUDA0, CUDA1}
    dispatch(model, device_map)
    x = torch.randn(4, 8)
    out = model(x)
    assert out.device == CPU
    torch.testing.assert_close(out, reference(x), **CLOSE)
    out.sum().backward()
    assert model.embed.weight.grad is not None
    undispatch(model)
    model.to("cpu")
    torch.testing.assert_close(model(x), reference(x), **CLOSE)


@pytest.mark.requires_cuda
def test_dispatch_between_cpu_and_cuda() -> None:
    reference = seeded(Net)
    model = dispatch(copy.deepcopy(reference), {"": "cuda:0", "head": "cpu"})
    assert model.embed.weight.device == CUDA0
    assert model.head.weight.device == CPU
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), reference(x), **CLOSE)
    out = model(x.to("cuda:0"))
    assert out.device == CUDA0
