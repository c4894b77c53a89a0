"""dispatch: placing a model by a device map, on cpu, meta, fake CUDA and real CUDA devices."""

from __future__ import annotations

import collections
import copy
import dataclasses
import inspect
import pickle
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import torchplace.spreading._dispatch as dispatch_module
from torchplace._errors import (
    DeviceMismatchError,
    DeviceSpecError,
    DeviceUnavailableError,
    MoveError,
    TorchplaceError,
)
from torchplace.looking._estimate import estimate
from torchplace.spreading._dispatch import dispatch, is_dispatched, undispatch
from torchplace.spreading._plan import plan
from toy_models import CPU, CUDA0, CUDA1, META, Block, Net, TiedLM


def seeded(factory: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return factory()


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


@pytest.mark.fake_cuda
def test_a_forward_argument_that_is_a_generator_or_a_set_passes_as_it_is() -> None:
    """A batch given to move refuses them; a model's own arguments are its business: the
    hooks refused a generator keyword (found in review), which ran before."""
    seen: list[Any] = []

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, names: Any = None) -> torch.Tensor:
            seen.append(names if isinstance(names, (set, frozenset)) else list(names))
            return self.lin(x)

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Block(), Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x, names=(n for n in "pq")), names={"r", "s"})

    torch.manual_seed(0)
    model = Pair()
    x = torch.randn(2, 4)
    want = model(x)
    seen.clear()
    dispatch(model, {"a": "cpu", "b": "meta"})
    out = model(x)
    assert out.device.type == "meta" and out.shape == want.shape  # b ran on meta
    assert seen == [["p", "q"], {"r", "s"}]


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


@dataclasses.dataclass
class Batch:
    pixels: torch.Tensor


class TakesBatch(nn.Module):
    """Two layers on two devices; the input is a collection, never a bare tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, dict):
            batch = batch["inner"][0]
        pixels = batch.tensor if isinstance(batch, WithTo) else batch.pixels
        return self.b(self.a(pixels))


@pytest.mark.fake_cuda
@pytest.mark.parametrize(
    "make",
    [Batch, WithTo, lambda t: {"inner": [Batch(t)]}],
    ids=["dataclass", "own-to", "dataclass-in-a-dict"],
)
def test_output_returns_to_the_device_of_an_input_inside_any_collection(
    monkeypatch: pytest.MonkeyPatch, make: Callable[[torch.Tensor], Any]
) -> None:
    # The origin is found by the same walk that moves the input: a dataclass or an object
    # with its own .to() hides its tensor from a walk of lists, tuples and dicts only.
    monkeypatch.setattr(dispatch_module, "_device", torch.device)
    with FakeTensorMode(), torch.no_grad():
        model = dispatch(TakesBatch(), {"a": "cuda:0", "b": "cuda:1"})
        out = model(make(torch.empty(2, 4)))
    assert out.device == CPU


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


def test_a_guarded_model_dispatched_again_sees_its_inputs_moved() -> None:
    from torchplace.looking._guard import guard

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    device_map = {"0": "cpu", "2": "meta"}
    dispatch(model, device_map)
    # dispatch gave model.2 a forward of its own instance, so the guard checks it with a
    # forward pre-hook, registered after dispatch's; dispatching again must not put its
    # input-moving hook behind the guard's check.
    with guard(model):
        dispatch(model, device_map)
        order = list(model[2]._forward_pre_hooks.values())
        assert isinstance(order[0], dispatch_module._MoveInputs)
        assert model(torch.ones(3, 4)).device == META


class Cached(nn.Module):
    """Writes its input into a cache it is given, as a KV cache is filled."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.linear = nn.Linear(4, 4)
        self.seen: list[Any] = []

    def forward(self, x: torch.Tensor, cache: dict[int, Any], log: list[int]) -> torch.Tensor:
        self.seen.append((cache, log))
        cache[self.index] = x
        log.append(self.index)
        return self.linear(x)


class CachedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Cached(i) for i in range(3))

    def forward(self, x: torch.Tensor, cache: dict[int, Any], log: list[int]) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, cache, log)
        return x


def test_a_container_with_nothing_to_move_is_the_callers_own_object() -> None:
    model = dispatch(CachedStack(), {"layers.0": "cpu", "layers.1": "meta", "layers.2": "meta"})
    cache: dict[int, Any] = {}
    log: list[int] = []
    model(torch.ones(2, 4), cache, log)
    # The first layer gets the empty cache itself and fills it; the list holds no tensor, so
    # every layer appends to the caller's own.
    assert model.layers[0].seen[0][0] is cache
    assert all(layer.seen[0][1] is log for layer in model.layers)
    assert log == [0, 1, 2]
    # A cache whose tensors are already on a layer's device reaches that layer as itself.
    ready = {0: torch.zeros(2, 4, device="meta")}
    model.layers[1](torch.ones(2, 4), ready, [])
    assert model.layers[1].seen[-1][0] is ready
    assert ready[1].device == META


def test_a_container_with_tensors_to_move_reaches_the_part_as_a_copy() -> None:
    # Documented: the submodule on meta gets a moved copy of the cache, because the caller's
    # dict holds a cpu tensor that must not move under its feet; its writes stay in the copy.
    model = dispatch(CachedStack(), {"layers.0": "cpu", "layers.1": "meta", "layers.2": "meta"})
    cache: dict[int, Any] = {}
    model(torch.ones(2, 4), cache, [])
    copied = model.layers[1].seen[0][0]
    assert copied is not cache
    assert copied[0].device == META and copied[1].device == META
    assert list(cache) == [0]  # the caller's cache: only the write of the part on cpu
    assert cache[0].device == CPU


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
        MoveError, match=r"model.blocks.2 \(Block\) runs on cpu but got args\[0\] on meta"
    ) as e:
        model(torch.ones(2, 8))
    assert e.value.name == "args[0]"


class _Rotary(nn.Module):
    """Takes its position embeddings as a keyword, as a transformers decoder layer does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, position_embeddings: tuple[Any, ...]) -> torch.Tensor:
        cos, sin = position_embeddings
        return self.proj(x) * cos + sin


class _RotaryNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rope = nn.Linear(8, 8)
        self.layer = _Rotary()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        emb = self.rope(x)
        return self.layer(x, position_embeddings=(emb, emb))


def test_meta_keyword_input_to_a_real_part_is_explained() -> None:
    # A meta tensor reaching a part by keyword (a Llama's position_embeddings over cpu+meta)
    # gets the same MoveError as a positional one, naming the keyword, not torch's bare
    # "Cannot copy out of meta tensor".
    model = dispatch(_RotaryNet(), {"": "cpu", "rope": "meta"})
    with pytest.raises(
        MoveError,
        match=r"model.layer \(_Rotary\) runs on cpu but got "
        r"kwargs\['position_embeddings'\]\[0\] on meta",
    ) as caught:
        model(torch.ones(2, 8))
    assert caught.value.name == "kwargs['position_embeddings'][0]"


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


# --- containers: the hooks go on the modules that run ------------------------------------------


class Stack(nn.Module):
    """An embedding and a ModuleList of layers its own forward runs one by one, as a
    transformer's stack does: the list itself is never called."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def inputs_seen(model: nn.Module, paths: list[str]) -> dict[str, torch.device]:
    """Records the device of the first input of each module named, as it runs."""
    seen: dict[str, torch.device] = {}
    for path in paths:
        model.get_submodule(path).register_forward_pre_hook(
            lambda m, args, p=path: seen.__setitem__(p, args[0].device)
        )
    return seen


@pytest.mark.fake_cuda
@pytest.mark.skipif(
    torch.version.cuda is not None and not torch.cuda.is_available(),
    reason="a CUDA build of torch with no usable GPU runs part of a fake CUDA embedding for real",
)
def test_a_module_list_on_its_own_device_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch_module, "_device", torch.device)
    with FakeTensorMode(), torch.no_grad():
        model = Stack()
        emb_bytes = model.emb.weight.nbytes
        device_map = plan(model, {"cuda:0": emb_bytes, "cuda:1": "1MiB"})
        assert device_map == {"emb": CUDA0, "layers": CUDA1}  # the list is one entry...
        dispatch(model, device_map)
        seen = inputs_seen(model, ["layers.0", "layers.1", "layers.2"])
        out = model(torch.zeros(2, 3, dtype=torch.long))
    assert seen == {"layers.0": CUDA1, "layers.1": CUDA1, "layers.2": CUDA1}  # ...its layers run
    assert out.device == CPU and out.shape == (2, 3, 8)
    assert not model.layers._forward_pre_hooks  # nothing left on the list, which never runs
    assert "forward" not in model.layers.__dict__


def test_containers_within_containers_hand_their_hooks_down() -> None:
    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.parts = nn.ModuleDict({"stack": nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])})
            self.parts["stack"].append(nn.Sequential(nn.Linear(4, 2)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.first(x)
            for part in self.parts["stack"]:
                x = part(x)
            return x

    model = dispatch(Nested(), {"first": "cpu", "parts": "meta"})
    seen = inputs_seen(model, ["parts.stack.0", "parts.stack.1", "parts.stack.2.0"])
    out = model(torch.ones(3, 4))
    assert seen == {"parts.stack.0": META, "parts.stack.1": META, "parts.stack.2.0": META}
    assert out.device == META and out.shape == (3, 2)


def test_a_sequential_whose_layers_are_run_one_by_one_is_hooked_both_ways() -> None:
    class Iterates(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

        def forward(self, x: torch.Tensor, whole: bool = False) -> torch.Tensor:
            x = self.first(x)
            if whole:
                return self.layers(x)  # type: ignore[no-any-return]
            for layer in self.layers:
                x = layer(x)
            return x

    model = dispatch(Iterates(), {"first": "cpu", "layers": "meta"})
    seen = inputs_seen(model, ["layers.0", "layers.1"])
    for whole in (False, True):
        seen.clear()
        out = model(torch.ones(3, 4), whole=whole)
        assert seen == {"layers.0": META, "layers.1": META}
        assert out.device == META and out.shape == (3, 2)


def test_a_module_list_on_its_own_device_gives_the_same_values() -> None:
    reference = seeded(Net)
    model = dispatch(copy.deepcopy(reference), {"": "cpu", "blocks": "cpu"})
    x = torch.randn(4, 8)
    assert torch.equal(model(x), reference(x))
    spread = dispatch(copy.deepcopy(reference), {"": "cpu", "blocks": "meta", "head": "meta"})
    seen = inputs_seen(spread, ["blocks.0", "blocks.2", "head"])
    assert spread(x).shape == reference(x).shape
    assert seen == {"blocks.0": META, "blocks.2": META, "head": META}


def test_the_model_combining_parts_on_two_devices_is_not_told_to_use_one_device() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.a(x), self.b(x)])

    model = dispatch(Two(), {"a": "cpu", "b": "meta"})
    with pytest.raises(DeviceMismatchError) as info:
        model(torch.ones(1, 2))
    message = str(info.value)
    assert message.startswith("model (Two) is split across devices (a on cpu, b on meta)")
    assert "map the submodules whose results the model's forward combines" in message
    assert "no_split" not in message and "one device ('')" not in message


# --- dispatch: bad input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device_map", "error", "message"),
    [
        ({"embd": "cpu"}, DeviceSpecError, r"\['embd'\]: the model has no submodule.*'embed'"),
        ({"head.weight": "cpu"}, DeviceSpecError, r"is a tensor, not a module; map .* 'head'"),
        ({"embed": "cpu"}, DeviceSpecError, r"leaves 'blocks.0.a.weight'.* without a device"),
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
    with pytest.raises(MoveError, match=r"embed.weight is on meta.*load_into") as e:
        dispatch(Net(device="meta"), {"": "cpu"})
    assert e.value.name == "embed.weight"


def test_a_failed_dispatch_puts_back_what_it_moved() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    first = model[0].weight
    with pytest.raises(MoveError, match=r"1.weight is on meta") as e:
        dispatch(model, {"0": "meta", "1": "cpu"})
    assert e.value.name == "1.weight"
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
    # "cpu" beside a GPU is the offload tier: the head's weights stay home on the CPU and
    # run on cuda:0.
    reference = seeded(Net)
    model = dispatch(copy.deepcopy(reference), {"": "cuda:0", "head": "cpu"})
    assert model.embed.weight.device == CUDA0
    assert model.head.weight.device == CPU and model.head.weight.is_pinned()
    x = torch.randn(4, 8)
    with pytest.raises(TorchplaceError, match=r"model\.head \(Linear\).*no_grad"):
        model(x)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), **CLOSE)
        out = model(x.to("cuda:0"))
    assert out.device == CUDA0


def test_a_rejected_redispatch_keeps_the_earlier_dispatch_whole() -> None:
    from torchplace.spreading._dispatch import is_dispatched

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    dispatch(model, {"0": "cpu", "2": "meta"})
    with pytest.raises(DeviceSpecError):
        dispatch(model, {"0": "cpu", "9": "meta"})
    assert is_dispatched(model)
    assert model(torch.ones(1, 4)).device == META  # the hooks of the first dispatch still work


def test_each_thread_gets_its_own_output_device() -> None:
    import threading

    model = nn.Sequential(nn.Linear(4, 4))
    dispatch(model, {"": "meta"})
    stack = next(h.origins for h in model._forward_hooks.values() if hasattr(h, "origins"))
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(len(stack.stack)))
    stack.stack.append(CPU)
    worker.start()
    worker.join()
    assert seen == [0] and stack.stack == [CPU]  # another thread sees its own, empty, stack


@pytest.mark.parametrize("spec", ["dsk", "Disk", "dist"])
def test_a_misspelt_disk_in_a_map_is_named_with_the_word_it_misses(spec: str) -> None:
    """'disk' is a map's own word, not a device spec, so ``device()``'s suggestions never
    offered it (a new-user trial typed "dsk")."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(
        DeviceSpecError, match=rf"device_map\['1'\]: .*{spec!r}; did you mean 'disk'"
    ):
        dispatch(model, {"0": "cpu", "1": spec})
    assert not is_dispatched(model)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_tensors_a_map_leaves_out_are_named_as_its_keys_are() -> None:
    """A child called "model" (as transformers names it) was shown as model.model.model.1."""

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

    with pytest.raises(DeviceSpecError) as caught:
        dispatch(Outer(), {"model.0": "cpu"})
    assert "leaves 'model.1.weight', 'model.1.bias' without a device" in str(caught.value)
    assert "an entry for 'model.1'" in str(caught.value)


def test_none_in_a_map_is_refused_naming_the_entry() -> None:
    """``device(None)`` is "auto", but a None in a map is a lookup that missed (a new-user
    trial's ``{"1": devices.get("decoder")}`` put module 1 on the CPU without a word)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(DeviceSpecError, match=r"device_map\['1'\]: None is no device"):
        dispatch(model, {"0": "cpu", "1": None})
    assert not is_dispatched(model)
