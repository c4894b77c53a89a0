"""devices_of(), where(), stragglers(), verify(): every tensor found, named, and explained."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import torchplace

CPU = torch.device("cpu")
META = torch.device("meta")


def split_model() -> nn.Module:
    """A model spread over cuda:0 and cuda:1, built on fake CUDA tensors (no GPU needed)."""
    model = nn.Sequential(nn.Linear(8, 8, device="meta"), nn.Linear(8, 2, device="meta"))
    with FakeTensorMode():
        for index, layer in enumerate(model):
            assert isinstance(layer, nn.Linear)
            dev = f"cuda:{index}"
            layer.weight = nn.Parameter(torch.empty(layer.weight.shape, device=dev))
            layer.bias = nn.Parameter(torch.empty(layer.bias.shape, device=dev))
    return model


@pytest.mark.fake_cuda
def test_a_split_model_has_no_single_device() -> None:
    model = split_model()
    assert torchplace.devices_of(model) == {torch.device("cuda:0"), torch.device("cuda:1")}
    with pytest.raises(torchplace.MixedDevicesError) as info:
        torchplace.where(model)
    message = str(info.value)
    assert "spread over 2 devices" in message
    assert "cuda:0 (2 tensors, 288 B: 0.weight, 0.bias)" in message
    assert "cuda:1 (2 tensors, 72 B: 1.weight, 1.bias)" in message
    assert "torchplace.move(obj, device)" in message


def test_mixed_error_shows_at_most_three_examples() -> None:
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(3)], nn.Linear(1, 1, device="meta"))
    with pytest.raises(
        torchplace.MixedDevicesError,
        match=r"cpu \(6 tensors, 24 B: 0.weight, 0.bias, 1.weight, \.\.\.\)",
    ):
        torchplace.where(model)


def test_a_module_without_parameters() -> None:
    with pytest.raises(torchplace.NoTensorsError, match="the ReLU model holds no tensors") as info:
        torchplace.where(nn.ReLU())
    assert "StopIteration" in str(info.value)
    assert torchplace.devices_of(nn.ReLU()) == frozenset()
    assert torchplace.stragglers(nn.ReLU(), "meta") == []
    torchplace.verify(nn.ReLU(), "meta")  # nothing to be out of place
    with pytest.raises(torchplace.NoTensorsError):
        torchplace.where({"name": "no tensors here"})


def test_where_of_tensors_batches_and_optimizers() -> None:
    assert torchplace.where(torch.ones(1)) == CPU
    assert torchplace.where({"a": [torch.ones(1, device="meta")]}) == META
    model = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    torchplace.move(model, "meta", optimizer=opt)
    # Adam's step stays on the CPU by PyTorch's policy: it does not make the optimizer "mixed".
    assert torchplace.where(opt) == META
    assert torchplace.devices_of(opt) == {META}


def test_straggler_kinds_and_names() -> None:
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Linear(2, 2)
            self.register_buffer("mask", torch.ones(2))
            self.cache = torch.zeros(2)

    model = Custom()
    opt = torch.optim.Adam(model.parameters())
    model.encoder(torch.ones(1, 2)).sum().backward()
    opt.step()
    found = torchplace.stragglers(model, "meta", optimizer=opt)
    by_name = {s.name: s for s in found}
    assert by_name["encoder.weight"] == torchplace.Straggler("encoder.weight", "parameter", CPU, 16)
    assert by_name["encoder.weight.grad"].kind == "grad"
    assert by_name["mask"].kind == "buffer"
    assert by_name["cache"].kind == "attribute"
    assert by_name["optimizer.state[encoder.weight].exp_avg"].kind == "optimizer_state"
    assert "optimizer.state[encoder.weight].step" not in by_name  # CPU by policy
    assert len(found) == 2 + 2 + 1 + 1 + 4  # params, grads, buffer, attribute, exp_avg(_sq)


def test_verify_lists_ten_and_counts_the_rest() -> None:
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(6)])
    with pytest.raises(torchplace.PlacementError) as info:
        torchplace.verify(model, "meta")
    message = str(info.value)
    assert message.startswith("12 tensors of the Sequential model are not on meta:")
    assert message.count("\n  - ") == 10
    assert "... and 2 more (torchplace.stragglers lists them all)" in message
    assert "  - 0.weight (parameter, 4 B) is on cpu; fix: torchplace.move(model, 'meta')" in message


def test_verify_explains_attributes_and_optimizer_state() -> None:
    model = nn.Linear(2, 2)
    model.custom = torch.ones(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    torchplace.move(model, "meta", attributes="ignore")
    with pytest.raises(torchplace.PlacementError) as info:
        torchplace.verify(model, "meta", optimizer=opt)
    message = str(info.value)
    assert re.search(r"custom \(attribute, 4 B\) is on cpu; fix: a plain tensor attribute", message)
    assert "self.register_buffer('custom', ...) or pass attributes='move'" in message
    assert "optimizer.state[weight].momentum_buffer (optimizer_state" in message
    assert "torchplace.move(model, 'meta', optimizer=opt)" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="says so only where CUDA is absent")
def test_verify_says_when_its_fixes_cannot_run_here() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(torchplace.PlacementError) as info:
        torchplace.verify(model, "cuda")
    message = str(info.value)
    assert "fix: torchplace.move(model, 'cuda:0')" in message
    assert message.count("note: the fixes above cannot run here (cuda:0 requested but") == 1
    assert "torchplace.device('auto')" in message
    with pytest.raises(torchplace.PlacementError) as info:
        torchplace.verify(model, "meta")  # meta exists everywhere: no note
    assert "note:" not in str(info.value)


@pytest.mark.fake_cuda
def test_verify_on_fake_cuda_names_the_device() -> None:
    model = split_model()
    with pytest.raises(torchplace.PlacementError, match=r"2 tensors .* not on cuda:0") as info:
        torchplace.verify(model, torch.device("cuda:0"))  # torch.device: no availability check
    assert "1.weight (parameter, 64 B) is on cuda:1" in str(info.value)


def test_stragglers_in_a_batch_are_named_by_path() -> None:
    batch = {"images": [torch.ones(1, device="meta"), torch.ones(1)], "ids": (torch.ones(1),)}
    names = [s.name for s in torchplace.stragglers(batch, "meta")]
    assert names == ["batch['images'][1]", "batch['ids'][0]"]
    assert {s.kind for s in torchplace.stragglers(batch, "meta")} == {"tensor"}


def test_several_optimizers_are_labelled() -> None:
    model = nn.Linear(2, 2)
    first = torch.optim.Adagrad([model.weight])
    second = torch.optim.Adagrad([model.bias])
    names = {s.name for s in torchplace.stragglers(model, "meta", optimizer=[first, second])}
    assert "optimizer[0].state[weight].sum" in names
    assert "optimizer[1].state[bias].sum" in names


def test_optimizer_alone_lists_its_parameters() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = [s.name for s in torchplace.stragglers(opt, "meta")]
    assert names == [
        "optimizer.param_groups[0]['params'][0]",
        "optimizer.param_groups[0]['params'][1]",
    ]


def test_bad_inputs() -> None:
    with pytest.raises(torchplace.DeviceSpecError):
        torchplace.verify(nn.Linear(1, 1), "nowhere")
    with pytest.raises(torchplace.TorchplaceError, match="optimizer= takes"):
        torchplace.stragglers(nn.Linear(1, 1), "cpu", optimizer=[1, 2])
    cyclic: list[object] = [torch.ones(1)]
    cyclic.append(cyclic)
    with pytest.raises(torchplace.TorchplaceError, match="cycle"):
        torchplace.devices_of(cyclic)


def test_torch_return_types_and_list_subclasses_are_looked_into() -> None:
    """torch.max returns a tuple subclass: its tensors are seen, not passed over as a leaf."""

    class Batch(list):  # type: ignore[type-arg]
        pass

    out = torch.max(torch.randn(3, 4), 0)
    batch = {"max": out, "extra": Batch([torch.ones(1)])}
    assert torchplace.where(batch) == torch.device("cpu")
    names = [s.name for s in torchplace.stragglers(batch, "meta")]
    assert names == ["batch['max'][0]", "batch['max'][1]", "batch['extra'][0]"]
    with pytest.raises(torchplace.PlacementError, match=r"batch\['max'\]\[0\]"):
        torchplace.verify(batch, "meta")


class _Graph:
    """A batch class with its own .to() that holds its tensors in plain attributes."""

    __slots__ = ("edges", "parent", "x")

    def __init__(self, x: torch.Tensor, edges: torch.Tensor) -> None:
        self.x, self.edges, self.parent = x, edges, None

    def to(self, device: object) -> _Graph:
        return _Graph(self.x.to(device), self.edges.to(device))  # type: ignore[arg-type]


class _Node:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.children: list[_Node] = []
        self.up: _Node | None = None

    def to(self, device: object) -> _Node:
        return _Node(self.x.to(device))  # type: ignore[arg-type]


def test_objects_with_their_own_to_are_looked_into() -> None:
    graph = _Graph(torch.randn(4, 3), torch.zeros(2, 5, dtype=torch.long))
    batch = {"g": graph}
    assert torchplace.devices_of(batch) == {torch.device("cpu")}
    assert torchplace.where(graph) == torch.device("cpu")
    names = [s.name for s in torchplace.stragglers(batch, "meta")]
    assert names == ["batch['g'].edges", "batch['g'].x"]
    with pytest.raises(torchplace.PlacementError, match=r"batch\['g'\]\.edges"):
        torchplace.verify(batch, "meta")
    torchplace.verify(torchplace.move(batch, "meta"), "meta")
    # A link back to a parent is not a cycle worth refusing: it is not followed.
    root = _Node(torch.ones(1))
    child = _Node(torch.ones(2))
    root.children.append(child)
    child.up = root
    assert len(torchplace.stragglers(root, "meta", optimizer=None)) == 2


def test_an_optimizer_holding_replaced_parameters_fails_verify_even_without_state() -> None:
    # Trap 2 before the first step: nothing in the state would give the stale parameters away.
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torchplace.move(model, "meta")  # replaces the parameters; the optimizer was not passed
    names = [s.name for s in torchplace.stragglers(model, "meta", optimizer=opt)]
    assert names == [
        "optimizer.param_groups[0]['params'][0]",
        "optimizer.param_groups[0]['params'][1]",
    ]
    with pytest.raises(torchplace.PlacementError, match="held for a replaced parameter") as info:
        torchplace.verify(model, "meta", optimizer=opt)
    assert "torchplace.move(model, 'meta', optimizer=opt)" in str(info.value)
    torchplace.move(model, "meta", optimizer=opt)  # re-binds
    torchplace.verify(model, "meta", optimizer=opt)
    assert opt.param_groups[0]["params"][0] is model.weight


def test_state_moved_apart_from_its_replaced_parameters_is_still_reported() -> None:
    model = nn.Linear(3, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    torchplace.move(model, "meta")
    torchplace.move(opt, "meta")  # the state is on meta now, but still keyed by stale tensors
    found = torchplace.stragglers(model, "meta", optimizer=opt)
    assert {s.name for s in found} >= {"optimizer.state[weight].exp_avg"}
    assert all(s.kind == "optimizer_state" for s in found)
    torchplace.move(model, "meta", optimizer=opt)
    assert torchplace.stragglers(model, "meta", optimizer=opt) == []


@pytest.mark.fake_cuda
def test_asgd_keeps_its_step_beside_the_parameter() -> None:
    with FakeTensorMode():
        model = nn.Linear(4, 4, device="meta")
        model.weight = nn.Parameter(torch.empty(4, 4, device="cuda:0"))
        model.bias = nn.Parameter(torch.empty(4, device="cuda:0"))
        for p in model.parameters():
            p.grad = torch.empty_like(p)
        opt = torch.optim.ASGD(model.parameters())
        opt._init_group(opt.param_groups[0], [], [], [], [], [], [])  # as step() begins
        assert opt.state[model.weight]["step"].device.type == "cuda"
        torchplace.verify(model, torch.device("cuda:0"), optimizer=opt)
        adam = torch.optim.Adam(model.parameters())  # Adam's step on the GPU is still wrong
        for p in model.parameters():
            adam.state[p]["step"] = torch.zeros((), device="cuda:0")
        with pytest.raises(torchplace.PlacementError, match="expected cpu"):
            torchplace.verify(model, torch.device("cuda:0"), optimizer=adam)


def test_lazy_modules_can_be_looked_at() -> None:
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU())
    assert torchplace.where(model) == CPU
    assert [s.nbytes for s in torchplace.stragglers(model, "meta")] == [0, 0]
    assert "0 B" in str(torchplace.report(model))
    with pytest.raises(torchplace.PlacementError, match=r"0\.weight"):
        torchplace.verify(model, "meta")


def test_bytes_count_the_memory_a_tensor_holds() -> None:
    emb = nn.Embedding(1000, 16, sparse=True)
    emb(torch.tensor([1, 2, 3])).sum().backward()
    grad = emb.weight.grad
    assert grad is not None and grad.is_sparse
    held = grad._indices().nbytes + grad._values().nbytes
    found = {s.name: s.nbytes for s in torchplace.stragglers(emb, "meta")}
    assert found == {"weight": 1000 * 16 * 4, "weight.grad": held}
    # An expanded view counts what it takes once moved (.to() makes it dense).
    expanded = torchplace.stragglers({"mask": torch.zeros(1).expand(1000)}, "meta")
    assert [s.nbytes for s in expanded] == [4000]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        csr = torch.eye(50).to_sparse_csr()
    assert torchplace.stragglers(csr, "meta")[0].nbytes == sum(
        t.nbytes for t in (csr.crow_indices(), csr.col_indices(), csr.values())
    )


@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
def test_old_style_weight_norm_weight_is_not_a_straggler(norm: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # weight_norm is deprecated
        model = getattr(torch.nn.utils, norm)(nn.Conv1d(2, 2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "plain tensor attribute" warning from move
        torchplace.move(model, "meta")
    torchplace.verify(model, "meta")
    assert all(s.kind != "attribute" for s in torchplace.stragglers(model, "cpu"))


# ----------------------------------------------- objects a look or a move would pass over


def _unwalkable(model: torch.nn.Module) -> dict[str, tuple[Any, str]]:
    """What a user plausibly passes instead of the model or a batch, and the fix to expect."""
    return {
        "model.parameters()": (model.parameters(), "pass the model itself"),
        "a set of tensors": ({model.weight}, "pass a list or a dict of them"),
        "state_dict().values()": (model.state_dict().values(), "pass the dict itself"),
        "model.state_dict": (model.state_dict, "call it: torchplace."),
    }


@pytest.mark.parametrize("what", list(_unwalkable(torch.nn.Linear(1, 1))))
@pytest.mark.parametrize("verb", ["verify", "move", "where", "report", "stragglers", "devices_of"])
def test_what_torchplace_would_pass_over_is_refused_with_the_way_out(what: str, verb: str) -> None:
    """A generator would be used up, a set or a dict view cannot take moved tensors back, and a
    method is not its result: each used to pass (verify) or come back unmoved (move)."""
    model = torch.nn.Linear(2, 2)
    obj, fix = _unwalkable(model)[what]
    call = {
        "verify": lambda: torchplace.verify(obj, "meta"),
        "move": lambda: torchplace.move(obj, "meta"),
        "where": lambda: torchplace.where(obj),
        "report": lambda: torchplace.report(obj),
        "stragglers": lambda: torchplace.stragglers(obj, "meta"),
        "devices_of": lambda: torchplace.devices_of(obj),
    }[verb]
    with pytest.raises(torchplace.TorchplaceError, match=f"torchplace.{verb} was given") as info:
        call()
    assert fix in str(info.value)
    assert model.weight.device.type == "cpu"  # nothing moved


def test_sets_and_views_without_tensors_and_sets_inside_batches_are_left_as_they_were() -> None:
    torchplace.verify({1, 2}, "meta")
    torchplace.verify({"a": 1}.values(), "meta")
    batch = {"x": torch.ones(1), "tags": {"a", "b"}}
    moved = torchplace.move(batch, "meta")
    assert moved["x"].is_meta and moved["tags"] is batch["tags"]


def test_verify_refuses_another_models_optimizer_as_move_does() -> None:
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(torchplace.TorchplaceError, match=r"holds none of the model's parameters"):
        torchplace.verify(model, "cpu", optimizer=opt)
    with pytest.raises(torchplace.MoveError, match="holds none of the parameters"):
        torchplace.move(model, "cpu", optimizer=opt)
    torchplace.verify(model, "cpu", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
