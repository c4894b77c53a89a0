"""Offloaded execution (issue 33, items 2-5): modules mapped to "cpu" or "disk" run with their
weights brought in just before their forward, a bounded window ahead, dropped after use.

The ring is checked with a fake transport that logs every fetch, wait and release and says
when a fetch's weights have arrived: a layer that runs before its weights arrived, or more
units resident than the window allows, fails the test.
"""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import torchplace
from helpers import needs_transformers_5
from torchplace.checkpoint._entries import FileChanged
from torchplace.moving import _offloaded as offloaded
from torchplace.moving._hooks import is_dispatched
from torchplace.moving._offloaded import HOME, Home, homes
from torchplace.spreading._offload import DeviceFetcher, Fetched, Unit


class MemorySource:
    """A disk tier's reader over tensors held in memory (names inside the mapped module)."""

    def __init__(self, state: dict[str, torch.Tensor], prefix: str = "") -> None:
        self.state = {k: v.clone() for k, v in state.items()}
        self.prefix = prefix
        self.where = "memory"
        self.reads = 0
        self.nbytes = sum(v.numel() * v.element_size() for k, v in self._mine().items())

    def _mine(self) -> dict[str, torch.Tensor]:
        p = self.prefix
        return {k: v for k, v in self.state.items() if not p or k.startswith(p + ".")}

    def read(self, device: torch.device) -> dict[str, torch.Tensor]:
        self.reads += 1
        return {k: v.clone().to(device) for k, v in self._mine().items()}

    def only(self, prefix: str) -> MemorySource:
        return MemorySource(self.state, prefix)


class FakeTransport:
    """Logs ("fetch", path), ("wait", path), ("release", path); weights arrive at the wait."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.arrived: set[str] = set()
        self.resident: set[str] = set()
        self.most = 0
        self.real = DeviceFetcher(torch.device("cpu"))

    def fetch(self, unit: Unit) -> Fetched:
        self.log.append(("fetch", unit.path))
        self.resident.add(unit.path)
        self.most = max(self.most, len(self.resident))
        fetched = self.real.fetch(unit)
        fetched.event = unit.path  # the "event" the compute stream waits on
        return fetched

    def ready(self, fetched: Fetched) -> list[torch.Tensor]:
        self.log.append(("wait", fetched.event))
        self.arrived.add(fetched.event)
        path, fetched.event = fetched.event, None
        tensors = self.real.ready(fetched)
        fetched.event = path
        return tensors

    def release(self, fetched: Fetched) -> None:
        self.log.append(("release", fetched.event))
        self.resident.discard(fetched.event)
        self.arrived.discard(fetched.event)


def mlp(n: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(n):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*layers).eval()


def nested_on_disk(tmp_path: Any) -> tuple[nn.Sequential, nn.Sequential]:
    """A model whose module "1" (with a submodule of its own) is left on disk by load_into, and
    the model it was saved from."""
    nested = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh())).eval()
    torch.save(nested.state_dict(), tmp_path / "nested.pt")
    loaded = torchplace.load_into(
        torchplace.skeleton(lambda: copy.deepcopy(nested)),
        tmp_path / "nested.pt",
        device_map={"": "cpu", "1": "disk"},
    )
    return nested, loaded


def on_disk(model: nn.Module, names: list[str]) -> dict[str, MemorySource]:
    """``names`` left "on disk": parameters on meta, each module holding a reader of them."""
    sources = {}
    for name in names:
        module = model.get_submodule(name)
        source = MemorySource({k: v.detach() for k, v in module.named_parameters()})
        module.to_empty(device="meta")
        module.__dict__[HOME] = Home("disk", torch.device("cpu"), source)
        sources[name] = source
    return sources


def checked(model: nn.Module, transport: FakeTransport, names: list[str]) -> list[str]:
    """Forwards (called by the ring's record, set before dispatch wraps them) that fail a layer
    running before its weights arrived."""
    ran: list[str] = []

    def check(name: str, module: nn.Module) -> Any:
        def forward(*args: Any) -> Any:
            assert name in transport.arrived, f"{name} ran before its weights arrived"
            assert all(not p.is_meta for p in module.parameters()), name
            ran.append(name)
            return type(module).forward(module, *args)

        return forward

    for name in names:
        module = model.get_submodule(name)
        module.forward = check(name, module)
    return ran


@pytest.mark.parametrize("window", [1, 2, 3])
def test_disk_layers_fetched_ahead_within_the_window(window: int) -> None:
    reference = mlp()
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = reference(x)
    model = copy.deepcopy(reference).requires_grad_(False)
    disk = ["0", "2", "4", "6"]
    on_disk(model, disk)
    transport = FakeTransport()
    device_map = {"": "cpu", **dict.fromkeys(disk, "disk")}
    ran = checked(model, transport, disk)
    torchplace.dispatch(model, device_map, offload_window=window, _transport=transport)
    got = model(x)
    assert torch.equal(got, want)
    assert ran == disk
    assert transport.most == window
    waits = [path for kind, path in transport.log if kind == "wait"]
    assert waits == disk
    # Each layer's fetch was started before the layer ahead of it was waited for.
    order = transport.log
    for ahead in range(1, window):
        for i in range(len(disk) - ahead):
            fetched = order.index(("fetch", disk[i + ahead]))
            assert fetched < order.index(("wait", disk[i]))
    assert all(p.is_meta for name in disk for p in model.get_submodule(name).parameters())


def test_a_second_call_finds_the_first_layers_prefetched() -> None:
    model = mlp()
    on_disk(model, ["0", "2"])
    transport = FakeTransport()
    torchplace.dispatch(model, {"": "cpu", "0": "disk", "2": "disk"}, _transport=transport)
    with torch.no_grad():
        model(torch.ones(1, 8))
        transport.log.clear()
        model(torch.ones(1, 8))
    # "0" came into the window as "2" ran (the ring wraps round for the next call).
    assert transport.log[:2] == [("fetch", "2"), ("wait", "0")]


def test_the_real_transport_reads_disk_layers_for_each_call() -> None:
    reference = mlp()
    model = copy.deepcopy(reference)
    sources = on_disk(model, ["2", "4"])
    torchplace.dispatch(model, {"": "cpu", "2": "disk", "4": "disk"})
    x = torch.randn(5, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert torch.equal(model(x), reference(x))
    assert sources["2"].reads >= 2 and sources["4"].reads >= 2
    assert model[2].weight.is_meta  # dropped after use


def test_gradients_reach_resident_parameters_through_a_disk_module() -> None:
    """A call with gradients on was refused ("inference only"). It runs now: the offloaded
    weights keep requires_grad as the model has them, the resident ones get the gradients a
    resident model gives, bit for bit, and nothing offloaded stays resident."""
    reference = mlp(3)
    reference[2].requires_grad_(False)
    model = copy.deepcopy(reference)
    on_disk(model, ["2"])
    torchplace.dispatch(model, {"": "cpu", "2": "disk"})
    x = torch.randn(4, 8)
    reference(x).square().sum().backward()
    out = model(x)
    assert out.requires_grad and model[2].weight.is_meta
    out.square().sum().backward()
    for name, p in model.named_parameters():
        if not name.startswith("2."):
            assert p.grad is not None and torch.equal(p.grad, reference.get_parameter(name).grad)
    assert model[2].weight.is_meta and model[2].weight.grad is None


def test_a_gradient_for_an_offloaded_weight_raises_naming_it() -> None:
    """A backward that would give an offloaded weight a gradient raises there, naming it (the
    gradient would land on a copy and be lost); forward alone with gradients on works."""
    model = mlp(2)
    on_disk(model, ["2"])
    torchplace.dispatch(model, {"": "cpu", "2": "disk"})
    out = model(torch.ones(1, 8))
    assert model[2].weight.is_meta and model[2].weight.requires_grad
    with pytest.raises(
        torchplace.TorchplaceError, match=r"model\.2\.(weight|bias) is offloaded.*Freeze"
    ):
        out.sum().backward()
    with torch.no_grad():
        model(torch.ones(1, 8))


def test_weights_in_memory_cannot_go_to_disk() -> None:
    model = mlp(2)
    with pytest.raises(torchplace.DeviceSpecError, match=r"device_map\['2'\] is 'disk'.*load_into"):
        torchplace.dispatch(model, {"": "cpu", "2": "disk"})
    assert not model[2].weight.is_meta


def test_a_modulelist_on_disk_runs_layer_by_layer() -> None:
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    reference = Stack()
    model = copy.deepcopy(reference)
    on_disk(model, ["layers"])
    transport = FakeTransport()
    torchplace.dispatch(model, {"": "cpu", "layers": "disk"}, _transport=transport)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert transport.most == 2
    assert [p for k, p in transport.log if k == "wait"] == [f"layers.{i}" for i in range(4)]


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def nested() -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(8, 8), Pair(), nn.Linear(8, 8)).eval()


def test_dispatch_refuses_an_entry_inside_a_disk_one() -> None:
    """A disk module is read whole from one source: "1.b" kept in memory inside "1" on disk
    would be read (and gathered back by move) from the checkpoint all the same."""
    reference = nested()
    model = copy.deepcopy(reference)
    on_disk(model, ["1"])
    model[1].b = copy.deepcopy(reference[1].b)  # in memory again
    with pytest.raises(
        torchplace.DeviceSpecError, match=r"device_map\['1\.b'\] is 'cpu' inside '1'.*'disk'"
    ):
        torchplace.dispatch(model, {"": "cpu", "1": "disk", "1.b": "cpu"})
    assert not is_dispatched(model) and torch.equal(model[1].b.weight, reference[1].b.weight)


def test_a_tie_between_an_offloaded_and_a_resident_holder_is_refused() -> None:
    model = mlp(2)
    model[2].weight = model[0].weight  # tied: "0" on disk, "2" resident
    with pytest.raises(torchplace.DeviceSpecError, match=r"model\.0\.weight is tied to.*'0'"):
        torchplace.dispatch(model, {"": "cpu", "0": "disk"})
    assert not is_dispatched(model) and not model[0].weight.is_meta


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize(
    ("device_map", "units", "resident"),
    [
        # the root offloaded, one layer on the GPU: the root's unit leaves that layer out
        ({"": "cpu", "layers.1": "cuda:0"}, [""], "layers.1"),
        # a container offloaded (it never runs): its children are the units, less the one
        # the map puts on the GPU
        (
            {"": "cuda:0", "layers": "cpu", "layers.1": "cuda:0"},
            ["layers.0", "layers.2"],
            "layers.1",
        ),
    ],
)
def test_the_most_specific_entry_decides_what_is_offloaded(
    device_map: dict[str, str], units: list[str], resident: str
) -> None:
    """With a GPU executing (worked out here without one: nothing is placed), a module mapped
    to the GPU inside an offloaded entry is neither in an offloaded unit nor homed on the
    host. ({"": "cpu", "model.layers": "cuda:0"} kept the layers home on the CPU.)"""
    from torchplace._model_walk import walk_model
    from torchplace.spreading import _dispatch

    model = Stack()
    tree = walk_model(model)
    entries = {k: torch.device(v) for k, v in device_map.items()}
    offload = _dispatch._offloading(entries, None)
    found = _dispatch._units(tree, offload)
    assert [u.path for u in found] == units
    slotted = {id(p) for u in found for _, _, p in u.slots}
    inner = model.get_submodule(resident)
    assert not slotted & {id(p) for p in inner.parameters()}
    homes = _dispatch._homes(tree, offload, _dispatch._targets(tree, offload.runs))
    assert {homes[id(p)] for p in inner.parameters()} == {torch.device("cuda", 0)}
    assert homes[id(model.embed.weight)] == torch.device(device_map[""])  # the root's entry


def test_load_into_refuses_an_entry_inside_a_disk_one(tmp_path: Any) -> None:
    torch.save(nested().state_dict(), tmp_path / "nested.pt")
    skeleton = torchplace.skeleton(nested)
    with pytest.raises(
        torchplace.DeviceSpecError, match=r"device_map\['1\.b'\] is 'cpu' inside '1'.*'disk'"
    ):
        torchplace.load_into(
            skeleton, tmp_path / "nested.pt", device_map={"": "cpu", "1": "disk", "1.b": "cpu"}
        )
    assert all(p.is_meta for p in skeleton.parameters())  # nothing read


def test_a_modulelist_left_on_disk_by_load_into_is_gathered_by_move(tmp_path: Any) -> None:
    """Each layer of a ModuleList on disk runs as a unit of its own, and the list keeps the
    reader of all of them: move reads them once, through the list (each layer's own reader
    names its weights from the list, and gathering through it failed: 'has no attribute 0')."""
    torch.manual_seed(3)
    reference = Stack()
    torch.save(reference.state_dict(), tmp_path / "stack.pt")
    model = torchplace.load_into(
        torchplace.skeleton(Stack), tmp_path / "stack.pt", device_map={"": "cpu", "layers": "disk"}
    )
    assert all(p.is_meta for p in model.layers.parameters())
    torchplace.move(model, "cpu")
    assert not is_dispatched(model)
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# ------------------------------------------------------------ the disk tier, for real on the CPU

tf = pytest.importorskip("transformers")


def tiny_llama() -> tuple[type[nn.Module], Any]:
    config = tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=100, max_position_embeddings=64, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return tf.LlamaForCausalLM, config


def tiny_mixtral() -> tuple[type[nn.Module], Any]:
    config = tf.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=100, max_position_embeddings=64, num_local_experts=4,
        num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return tf.MixtralForCausalLM, config


IDS = torch.tensor([[1, 5, 7, 9, 11]])


def files_under(*folders: Any) -> dict[str, int]:
    return {str(p): p.stat().st_size for f in folders for p in f.rglob("*") if p.is_file()}


@pytest.mark.parametrize("make", [tiny_llama, tiny_mixtral], ids=["llama", "mixtral"])
def test_half_the_layers_on_disk_run_as_the_whole_model(
    make: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls, config = make()
    torch.manual_seed(0)
    reference = cls(config).eval()
    saved = tmp_path / "saved"
    reference.save_pretrained(saved)
    monkeypatch.chdir(tmp_path)
    before = files_under(tmp_path)
    reads: list[str] = []
    from torchplace.checkpoint._disk_weights import CheckpointWeights

    real_read = CheckpointWeights.read

    def counted(
        self: CheckpointWeights, device: torch.device, alloc: Any = None
    ) -> dict[str, torch.Tensor]:
        reads.append(self.entry)
        return real_read(self, device, alloc)

    monkeypatch.setattr(CheckpointWeights, "read", counted)
    disk = {"model.layers.1": "disk", "model.layers.3": "disk"}
    model = torchplace.load_into(
        torchplace.skeleton(cls, config), saved, device_map={"": "cpu", **disk}
    )
    assert model.model.layers[1].self_attn.q_proj.weight.is_meta
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)
    assert sorted(set(reads)) == sorted(disk)
    want = reference.generate(IDS, max_new_tokens=6, do_sample=False)
    got = model.generate(IDS, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    assert files_under(tmp_path) == before  # the checkpoint read, never copied
    assert all(p.is_meta for p in model.model.layers[3].parameters())


# transformers 4.x's Mixtral holds block_sparse_moe, and its save_pretrained writes no hub names
hub_names = needs_transformers_5("Mixtral's save_pretrained writes no hub names")


@hub_names
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
@pytest.mark.parametrize("entry", ["model.layers.1.mlp", "model.layers.1.mlp.experts"])
def test_a_part_of_a_layer_whose_weights_have_hub_names_runs_from_disk(
    entry: str, strict: bool, tmp_path: Any
) -> None:
    """transformers 5 saves a Mixtral layer's experts under the hub name ``block_sparse_moe``,
    which ``load_into`` converts into ``mlp.experts.gate_up_proj``. A map entry inside the layer
    found no key under its name: refused (strict) as if it were another model's checkpoint, or
    loaded and failed on its first call saying the file no longer held its weights."""
    cls, config = tiny_mixtral()
    torch.manual_seed(0)
    reference = cls(config).eval()
    reference.save_pretrained(tmp_path)
    model = torchplace.load_into(
        torchplace.skeleton(cls, config), tmp_path, device_map={"": "cpu", entry: "disk"},
        strict=strict,
    )  # fmt: skip
    assert all(p.is_meta for p in model.get_submodule(entry).parameters())
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


@hub_names
def test_a_disk_layer_works_out_its_hub_name_conversion_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversion of a Mixtral layer's per-expert keys was worked out again on every read
    (most of the read's time); it is kept, and made again only when the model is cast. Its
    experts are read straight into the fused tensors (``direct_reads``), not read whole and
    converted after (``hub_plan``)."""
    from torchplace.checkpoint import _disk_weights

    made: list[str] = []
    direct_of = _disk_weights.direct_reads

    def counted(found: Any, model: nn.Module, names: Any, keys: Any) -> Any:
        made.append(found.where)
        direct = direct_of(found, model, names, keys)
        assert direct is not None and direct.fused  # the experts, read into their slices
        return direct

    def refused(label: str, model: nn.Module, state: Any) -> Any:
        raise AssertionError("the experts were read whole, then converted")

    monkeypatch.setattr(_disk_weights, "direct_reads", counted)
    monkeypatch.setattr(_disk_weights, "hub_plan", refused)
    cls, config = tiny_mixtral()
    torch.manual_seed(0)
    reference = cls(config).eval()
    reference.save_pretrained(tmp_path)
    disk = {"model.layers.1": "disk", "model.layers.2": "disk"}
    model = torchplace.load_into(
        torchplace.skeleton(cls, config), tmp_path, device_map={"": "cpu", **disk}
    )
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(IDS).logits, reference(IDS).logits)
        assert len(made) == 2  # one per disk layer
        twin = copy.deepcopy(model)  # reads for itself: its cast is its own
        twin.to(torch.float16)
        assert torch.equal(twin(IDS).logits, copy.deepcopy(reference).half()(IDS).logits)
        assert torch.equal(model(IDS).logits, reference(IDS).logits)  # still float32
        model.to(torch.bfloat16)
        reference.to(torch.bfloat16)
        for _ in range(2):
            assert torch.equal(model(IDS).logits, reference(IDS).logits)
    assert len(made) == 6  # the copy's float16 (its 2 layers), then the new dtype, once each


def test_moving_a_model_with_disk_modules_by_to_says_to_gather_it_and_moves_nothing(
    tmp_path: Any,
) -> None:
    """model.to("cpu") and .cpu() raised torch's "Cannot copy out of meta tensor", advising
    to_empty (which loses the weights), after the modules before the disk one had moved. A
    cast still goes through; once gathered with move, .to() is torch's again."""
    model = mlp(2).eval()
    torch.save(model.state_dict(), tmp_path / "m.pt")
    loaded = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "m.pt", device_map={"": "cpu", "2": "disk"}
    )
    first = loaded[0].weight
    for move in (lambda: loaded.to("cpu"), loaded.cpu, loaded[2].cpu):  # the module itself too
        with pytest.raises(
            torchplace.TorchplaceError,
            match=r"model\.2 is offloaded to 'disk' .* torchplace\.move\(model, 'cpu'\).*nothing "
            "was moved",
        ):
            move()
        assert loaded[0].weight is first and not first.is_meta  # nothing moved
    x = torch.randn(3, 8)
    loaded.double()  # a cast goes through, the disk weights read in the new dtype
    with torch.no_grad():
        assert torch.equal(loaded(x.double()), copy.deepcopy(model).double()(x.double()))
    torchplace.move(loaded, "cpu")
    assert "_apply" not in loaded.__dict__
    loaded.float().to("cpu")
    assert torch.equal(loaded(x), model(x))


def test_a_conversion_transformers_computes_is_not_kept_by_the_disk_reader(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Such a plan holds the model (its converter runs on it), and the model holds the reader:
    kept, it would tie the model into a reference cycle."""
    from torchplace.checkpoint import _disk_weights
    from torchplace.checkpoint._conversions import Computed, Plan

    torch.save(mlp(2).state_dict(), tmp_path / "m.pt")
    model = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "m.pt", device_map={"": "cpu", "2": "disk"}
    )
    reader = model[2].__dict__[HOME].source
    computed = Plan(computed=[Computed([], [], [], lambda tensors: {})])
    monkeypatch.setattr(_disk_weights, "hub_plan", lambda *args: computed)
    assert reader._conversion(model, {}, {}) is computed
    assert reader._plan is None
    monkeypatch.setattr(_disk_weights, "hub_plan", lambda *args: Plan())
    kept = reader._conversion(model, {}, {})
    assert reader._plan == (((), ()), kept)


@pytest.mark.parametrize("name", ["m.pt", "m.safetensors"])
def test_a_checkpoint_removed_under_a_disk_module_is_said_to_be_gone(
    name: str, tmp_path: Any
) -> None:
    """It was reported as a truncated safetensors file (a torch file too), with the raw
    FileNotFoundError; the error now says the file is gone and what to do."""
    from safetensors.torch import save_file

    path = tmp_path / name
    state = mlp(2).state_dict()
    save_file(state, str(path)) if name.endswith(".safetensors") else torch.save(state, path)
    model = torchplace.load_into(
        torchplace.skeleton(mlp, 2), path, device_map={"": "cpu", "2": "disk"}
    )
    path.unlink()
    gone = pytest.raises(torchplace.CheckpointError, match=rf"{name}: no longer exists")
    with gone as caught, torch.no_grad():
        model(torch.ones(1, 8))
    assert "truncated" not in str(caught.value) and "safetensors (" not in str(caught.value)
    assert caught.value.path == path


def test_a_state_dict_cannot_be_left_on_disk() -> None:
    model = mlp(2)
    with pytest.raises(torchplace.CheckpointError, match=r"model\.2.*mapping.*save it first"):
        torchplace.load_into(
            torchplace.skeleton(mlp, 2), model.state_dict(), device_map={"": "cpu", "2": "disk"}
        )


def test_a_disk_module_the_checkpoint_lacks_is_refused_before_anything_is_filled(
    tmp_path: Any,
) -> None:
    # It loaded without a word (strict=True) and failed on its first call, saying that the
    # file "no longer holds" tensors it never held.
    model = mlp(4)
    torch.save({k: v for k, v in model.state_dict().items() if not k.startswith("2.")},
               tmp_path / "partial.pt")  # fmt: skip
    target = torchplace.skeleton(mlp, 4)
    with pytest.raises(
        torchplace.CheckpointError,
        match=r"model\.2 on 'disk'.*partial\.pt holds no tensor under '2\.'",
    ) as caught:
        torchplace.load_into(target, tmp_path / "partial.pt", device_map={"": "cpu", "2": "disk"})
    assert caught.value.missing == ("2.weight", "2.bias")
    assert all(p.is_meta for p in target.parameters())  # nothing filled
    assert not is_dispatched(target)
    # a module on disk with no parameters of its own (a Tanh, a rotary embedding) needs none
    torch.save(model.state_dict(), tmp_path / "whole.pt")
    loaded = torchplace.load_into(
        torchplace.skeleton(mlp, 4),
        tmp_path / "whole.pt",
        device_map={"": "cpu", "1": "disk", "2": "disk"},
    )
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
def test_a_disk_module_missing_one_weight_is_refused_before_anything_is_filled(
    strict: bool, tmp_path: Any
) -> None:
    """It loaded without a word, strict or not, and failed on its first call saying the file
    "no longer holds" the weight it never held; a key under it that fills nothing went unsaid."""
    model = mlp(4)
    state = dict(model.state_dict())
    del state["2.bias"]
    state["2.extra"] = torch.zeros(2)
    torch.save(state, tmp_path / "gap.pt")
    target = torchplace.skeleton(mlp, 4)
    with pytest.raises(torchplace.CheckpointError) as caught:
        torchplace.load_into(
            target, tmp_path / "gap.pt", device_map={"": "cpu", "2": "disk"}, strict=strict
        )
    said = str(caught.value)
    assert "missing keys: 2.bias;" in said and "map '2' to 'cpu' or to a device" in said, said
    assert "give it values first where it is still on meta" in said, said  # a skeleton's is
    assert caught.value.missing == ("2.bias",)
    assert caught.value.unexpected == (("2.extra",) if strict else ())
    assert all(p.is_meta for p in target.parameters())  # nothing filled
    assert not is_dispatched(target)
    # a key under a disk module that fills nothing: refused only with strict
    torch.save({**model.state_dict(), "2.extra": torch.zeros(2)}, tmp_path / "extra.pt")
    where = {"": "cpu", "2": "disk"}
    with pytest.raises(torchplace.CheckpointError, match=r"unexpected keys: 2\.extra; pass strict"):
        torchplace.load_into(torchplace.skeleton(mlp, 4), tmp_path / "extra.pt", device_map=where)
    with pytest.warns(UserWarning, match=r"strict=False skipped 1 key: its 2\.extra") as w:
        loaded = torchplace.load_into(
            torchplace.skeleton(mlp, 4), tmp_path / "extra.pt", device_map=where, strict=False
        )
    assert [(x.message.missing, x.message.unexpected) for x in w] == [((), ("2.extra",))]
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
def test_a_disk_module_whose_weight_has_another_shape_is_refused_before_anything_is_filled(
    strict: bool, tmp_path: Any
) -> None:
    """It loaded, and its first call failed with torch's own matmul error."""
    state = dict(mlp(4).state_dict())
    state["2.weight"] = torch.zeros(3, 5)
    torch.save(state, tmp_path / "odd.pt")
    target = torchplace.skeleton(mlp, 4)
    with pytest.raises(
        torchplace.CheckpointError,
        match=r"shape mismatches: 2\.weight: file \(3, 5\), model \(8, 8\); the model is untouched",
    ) as caught:
        torchplace.load_into(
            target, tmp_path / "odd.pt", device_map={"": "cpu", "2": "disk"}, strict=strict
        )
    assert caught.value.mismatched == ("2.weight",)
    assert all(p.is_meta for p in target.parameters())


@hub_names
def test_a_disk_layer_missing_an_expert_says_the_shape_its_pieces_make(tmp_path: Any) -> None:
    from safetensors.torch import load_file, save_file

    cls, config = tiny_mixtral()
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(torchplace.CheckpointError) as caught:
        torchplace.load_into(
            torchplace.skeleton(cls, config),
            tmp_path,
            device_map={"": "cpu", "model.layers.1": "disk"},
        )
    said = "model.layers.1.mlp.experts.down_proj: file (3, 32, 64), model (4, 32, 64)"
    assert said in str(caught.value), caught.value
    assert caught.value.unexpected == ()


def test_a_disk_layer_whose_hub_named_keys_are_renamed_loads(tmp_path: Any) -> None:
    """rename= and the hub-name conversion together: the check of a disk module's weights
    compared each per-expert piece with the fused tensor it goes into, and refused a good
    checkpoint (found in review)."""
    from safetensors.torch import load_file, save_file

    cls, config = tiny_mixtral()
    torch.manual_seed(0)
    reference = cls(config).eval()
    reference.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    path = tmp_path / "prefixed.safetensors"
    save_file({"foo." + k: v for k, v in state.items()}, path, metadata={"format": "pt"})
    model = torchplace.load_into(
        torchplace.skeleton(cls, config),
        path,
        rename=lambda k: k.removeprefix("foo."),
        device_map={"": "cpu", "model.layers.1": "disk"},
    )
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


def test_a_lazy_parameter_cannot_be_left_on_disk(tmp_path: Any) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    torch.save(model.state_dict(), tmp_path / "m.pt")
    lazy = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(2))
    with pytest.raises(torchplace.DeviceSpecError, match=r"model\.1\.weight is a lazy parameter"):
        torchplace.load_into(lazy, tmp_path / "m.pt", device_map={"": "cpu", "1": "disk"})


@hub_names
@pytest.mark.parametrize("entry", ["model.layers.1", "model.layers.1.mlp"])
def test_a_disk_module_whose_expert_lacks_one_projection_names_the_key(
    entry: str, tmp_path: Any
) -> None:
    """The fused tensor is missing, for the file key it lacks; its other pieces are not called
    unexpected (the check said they were, and a whole layer on disk loaded without a word)."""
    from safetensors.torch import load_file, save_file

    cls, config = tiny_mixtral()
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    gap = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    del state[gap]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    target = torchplace.skeleton(cls, config)
    with pytest.raises(torchplace.CheckpointError) as caught:
        torchplace.load_into(target, tmp_path, device_map={"": "cpu", entry: "disk"})
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert f"{fused} (fused from the file's tensors, which lack {gap})" in str(caught.value)
    assert caught.value.missing == (fused,) and caught.value.unexpected == ()
    assert all(p.is_meta for p in target.parameters())


def test_a_model_with_disk_modules_compiles_and_matches_eager(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The offload hooks were traced by torch.compile, their reads run on its fake tensors:
    the call failed calling the intact file truncated. They now run as they are, each call."""
    from torchplace.checkpoint import _disk_weights

    reads: list[str] = []
    read = _disk_weights.CheckpointWeights.read

    def counted(self: Any, device: torch.device, alloc: Any = None) -> Any:
        reads.append(self.entry)
        return read(self, device, alloc)

    monkeypatch.setattr(_disk_weights.CheckpointWeights, "read", counted)
    model = mlp(2).eval()
    torch.save(model.state_dict(), tmp_path / "m.pt")
    loaded = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "m.pt", device_map={"": "cpu", "2": "disk"}
    )
    compiled = torch.compile(loaded, backend="aot_eager")  # its fake tensors met the reads
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 8)
            assert torch.equal(compiled(x), model(x))
    assert reads == ["2"] * 3  # read on each call, as in eager
    assert loaded[2].weight.is_meta


def test_compiling_a_model_with_disk_modules_whole_says_why_it_cannot(tmp_path: Any) -> None:
    """fullgraph=True cannot hold the reads: the error said to remove torch.compiler.disable,
    pointing into torchplace (found in review). torch 2.6's Dynamo does not give the reason."""
    from torchplace._dynamo_compat import dynamo_supports

    if not dynamo_supports("exceptions"):
        pytest.skip("torch 2.6's Dynamo does not say a disabled function's reason")
    torch.save(mlp(2).state_dict(), tmp_path / "m.pt")
    loaded = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "m.pt", device_map={"": "cpu", "2": "disk"}
    )
    compiled = torch.compile(loaded, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"compile without fullgraph=True"), torch.no_grad():
        compiled(torch.randn(3, 8))


@pytest.mark.slow
def test_running_a_model_with_disk_modules_does_not_import_the_compiler(tmp_path: Any) -> None:
    """The hooks' guard against tracing is made only once torch.compile is loaded: importing
    it takes 1.5-2 s, which a model never compiled does not pay."""
    code = (
        "import sys, torch, torchplace\n"
        "from torch import nn\n"
        "make = lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))\n"
        f"torch.save(make().state_dict(), {str(tmp_path / 's.pt')!r})\n"
        f"m = torchplace.load_into(torchplace.skeleton(make), {str(tmp_path / 's.pt')!r},\n"
        "                          device_map={'': 'cpu', '1': 'disk'})\n"
        "with torch.no_grad():\n"
        "    m(torch.ones(1, 4))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "False", done.stdout + done.stderr


def test_to_empty_and_share_memory_of_a_model_with_disk_modules_are_refused_untouched(
    tmp_path: Any,
) -> None:
    """to_empty() gave the disk module's placeholders (and every other weight) uninitialised
    memory without a word; share_memory() raised torch's "only available on CPU". Both are
    refused before anything changes."""
    model = mlp(2).eval()
    torch.save(model.state_dict(), tmp_path / "m.pt")
    loaded = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "m.pt", device_map={"": "cpu", "2": "disk"}
    )
    first, values = loaded[0].weight, loaded[0].weight.detach().clone()
    with pytest.raises(
        torchplace.TorchplaceError,
        match=r"model\.2 is offloaded to 'disk' .*so to_empty\(\) would give them new, "
        r"uninitialised memory.*nothing was changed",
    ):
        loaded.to_empty(device="cpu")
    with pytest.raises(torchplace.TorchplaceError, match=r"share_memory\(\) cannot move it"):
        loaded.share_memory()
    if not torch.backends.mps.is_built():  # a device this build lacks: torch's own error stands
        with pytest.raises(RuntimeError, match="not linked with support for mps"):
            loaded.to("mps")
    assert loaded[0].weight is first and torch.equal(first, values) and loaded[2].weight.is_meta
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_estimate_of_a_model_with_disk_modules_reads_nothing(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """estimate's fake step ran the disk reads on fake tensors (a false "truncated" error); the
    disk weights now count where they run, with no read."""
    from torchplace.checkpoint import _disk_weights

    def refused(self: Any, device: torch.device) -> Any:
        raise AssertionError("the estimate read the checkpoint")

    model = mlp(2).eval()
    torch.save(model.state_dict(), tmp_path / "m.pt")
    loaded = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "m.pt", device_map={"": "cpu", "2": "disk"}
    )
    monkeypatch.setattr(_disk_weights.CheckpointWeights, "read", refused)
    x = torch.randn(3, 8)
    offloaded = torchplace.estimate(loaded, example_input=x, step="forward")
    whole = torchplace.estimate(model, example_input=x, step="forward")
    cpu = torch.device("cpu")  # the disk layer's weights count where it runs, while it runs
    assert offloaded.peak_by_device()[cpu] == whole.peak_by_device()[cpu]
    # Their meta placeholders are on no device: not a "meta" row (they were), but on_disk.
    layer = sum(p.numel() * p.element_size() for p in model[2].parameters())
    assert set(offloaded.peak_by_device()) == set(offloaded.by_device()) == {cpu}
    assert offloaded.on_disk == layer and offloaded.parameters == whole.parameters - layer
    assert offloaded.parameter_count == whole.parameter_count
    assert "disk (read as run)" in str(offloaded) and "meta" not in str(offloaded)
    assert offloaded.to_dict()["on_disk"] == layer
    # A disk layer larger than the rest: its placeholders made "meta" the device of the modules
    # that ran beside it in the module table.
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 2048)).eval()
    torch.save(wide.state_dict(), tmp_path / "wide.pt")
    on_disk = torchplace.load_into(
        torchplace.skeleton(lambda: copy.deepcopy(wide)),
        tmp_path / "wide.pt",
        device_map={"": "cpu", "2": "disk"},
    )
    found = torchplace.estimate(on_disk, example_input=torch.ones(1, 64), step="forward")
    assert {m.device for m in found.modules} == {cpu} and set(found.peak_by_device()) == {cpu}
    # A disk entry with submodules of its own: torch's tracker refused the hook on their weights
    # brought in for the call (no gradient), and the step went unmeasured.
    nested, loaded_nested = nested_on_disk(tmp_path)
    measured = torchplace.estimate(loaded_nested, example_input=x, step="forward")
    assert measured.fallback is None and measured.activations > 0
    with pytest.raises(
        torchplace.TorchplaceError,
        match=r"estimate\(\): model\.1 is offloaded .* not measured.*pass step='forward'",
    ):
        torchplace.estimate(loaded_nested, example_input=x)  # step="train", the default
    assert (
        measured.peak_by_device()
        == torchplace.estimate(nested, example_input=x, step="forward").peak_by_device()
    )
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert loaded[2].weight.is_meta


def test_a_module_inside_a_disk_module_counts_its_weights_on_disk_and_is_not_measured_alone(
    tmp_path: Any,
) -> None:
    """estimate(model[1][0]) where model.1 is on disk: its weights were a "meta" row and its
    step ran on meta, as a skeleton's; they are on disk, read when model.1 runs. Counted, they
    are on_disk; a step of it alone is refused, naming the disk module (and verify's fix names
    it too); once gathered, it is measured as any module."""
    nested, loaded = nested_on_disk(tmp_path)
    inner = loaded[1][0]
    counted = torchplace.estimate(inner)
    assert counted.on_disk == 8 * 8 * 4 + 8 * 4 and counted.rows == ()
    assert "meta" not in str(counted) and "disk (read as run)" in str(counted)
    x = torch.randn(3, 8)
    with pytest.raises(
        torchplace.TorchplaceError,
        match=r"estimate\(\): Linear lies inside the module offloaded to 'disk' at model\.1 .*"
        r"estimate that module or the whole model",
    ):
        torchplace.estimate(inner, example_input=x, step="forward")
    assert torchplace.estimate(loaded[1], example_input=x, step="forward").on_disk == 288
    # verify's fix for it said "on meta it has no values; load them with load_into"
    with pytest.raises(
        torchplace.PlacementError,
        match=r"weight .* on meta; fix: its values stay on disk with the module offloaded at "
        r"model\.1, .*torchplace\.verify\(model, device_map\)",
    ) as placed:
        torchplace.verify(inner, "cpu")
    assert [s.name for s in placed.value.stragglers] == ["weight", "bias"]
    torchplace.move(loaded, "cpu")  # gathered: its weights real again, unmarked
    alone = torchplace.estimate(loaded[1][0], example_input=x, step="forward")
    assert alone.on_disk == 0 and alone.parameters == 288
    with torch.no_grad():
        assert torch.equal(loaded(x), nested(x))


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_of_a_model_with_a_disk_module_is_refused_before_anything_loads(
    tmp_path: Any, assign: bool
) -> None:
    """model.load_state_dict(new) went through: the layers in memory took the new weights, the
    disk layer kept the file's (torch copied into its meta placeholders as a no-op, or with
    assign=True the next call read the file's over them), and the outputs matched neither
    model. It is refused by the first module it meets, nothing loaded; gathered, it loads."""
    old = mlp(2)
    torch.save(old.state_dict(), tmp_path / "old.pt")
    torch.manual_seed(1)
    new = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()).eval()
    loaded = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "old.pt", device_map={"": "cpu", "2": "disk"}
    )
    x = torch.randn(3, 8)
    for target, state in ((loaded, new.state_dict()), (loaded[2], new[2].state_dict())):
        with pytest.raises(
            torchplace.TorchplaceError,
            match=r"load_state_dict\(\): model\.2 is offloaded to 'disk' .* would not be kept.*"
            r"torchplace\.move\(model, 'cpu'\).*nothing was loaded",
        ):
            target.load_state_dict(state, assign=assign)
    assert torch.equal(loaded[0].weight, old[0].weight) and loaded[2].weight.is_meta
    with torch.no_grad():
        assert torch.equal(loaded(x), old(x))
    loaded[0].load_state_dict(new[0].state_dict())  # a module with no disk module under it
    head = {"0.weight": new[0].weight.detach().clone()}  # a state dict giving the disk none
    assert loaded.load_state_dict(head, strict=False).missing_keys == [
        "0.bias",
        "2.weight",
        "2.bias",
    ]
    assert torch.equal(loaded[0].weight, new[0].weight)
    torchplace.move(loaded, "cpu")
    loaded.load_state_dict(new.state_dict(), assign=assign)
    with torch.no_grad():
        assert torch.equal(loaded(x), new(x))


def test_load_state_dict_into_a_module_inside_a_disk_module_is_refused(tmp_path: Any) -> None:
    _, loaded = nested_on_disk(tmp_path)
    with pytest.raises(
        torchplace.TorchplaceError, match=r"model\.1 is offloaded to 'disk'.*\('weight'\)"
    ):
        loaded[1][0].load_state_dict(nn.Linear(8, 8).state_dict(), assign=True)
    assert loaded[1][0].weight.is_meta
    torch.save(nn.Linear(8, 8).state_dict(), tmp_path / "inner.pt")
    with pytest.raises(
        torchplace.CheckpointError,
        match=r"load_into\(\): Linear lies inside model\.1, which is offloaded to 'disk'.*gather",
    ):
        torchplace.load_into(loaded[1][0], tmp_path / "inner.pt")
    assert loaded[1][0].weight.is_meta
    torchplace.move(loaded, "cpu")  # gathered: the hooks are gone
    loaded[1][0].load_state_dict(nn.Linear(8, 8).state_dict())


def test_a_failed_gather_keeps_nothing_of_what_it_read(tmp_path: Any) -> None:
    """A move that failed after reading a disk module's weights back left them alive, held by
    the record of their replacement (its finalizer), for as long as the model lived."""
    import gc

    from torchplace.moving import _identity

    big = nn.Sequential(nn.Linear(8, 8), nn.Linear(512, 512)).eval()
    torch.save(big.state_dict(), tmp_path / "big.pt")
    loaded = torchplace.load_into(
        torchplace.skeleton(lambda: copy.deepcopy(big)),
        tmp_path / "big.pt",
        device_map={"": "cpu", "1": "disk"},
    )
    wrong = torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1)  # another model's

    def alive() -> int:
        gc.collect()
        return sum(
            1
            for o in gc.get_objects()
            if type(o) in (torch.Tensor, nn.Parameter) and not o.is_meta and o.shape == (512, 512)
        )

    before = alive()
    for _ in range(2):
        with pytest.raises(torchplace.MoveError, match="holds none of the parameters"):
            torchplace.move(loaded, "cpu", optimizer=wrong)
        assert loaded[1].weight.is_meta and alive() == before
    assert not _identity._replaced or all(r() is not None for r, _ in _identity._replaced.values())


def test_an_optimizer_built_before_a_load_by_map_is_re_bound_when_the_model_is_gathered(
    tmp_path: Any,
) -> None:
    """The disk layer's parameters were replaced by placeholders unrecorded: after gathering,
    the optimizer kept training the old tensors, and verify and stragglers passed. The
    placeholders are recorded as replacements: verify names the stale optimizer, and
    move(..., optimizer=opt) re-binds it with its state."""
    model = mlp(2).train()
    torch.save(model.state_dict(), tmp_path / "m.pt")
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    old_weight = model[2].weight
    moments = opt.state[old_weight]["exp_avg"].clone()
    torchplace.load_into(model, tmp_path / "m.pt", device_map={"": "cpu", "2": "disk"})
    assert model[2].weight.is_meta and model[2].weight is not old_weight
    torchplace.move(model, "cpu")  # gathered without the optimizer
    with pytest.raises(
        torchplace.PlacementError,
        match=r"optimizer\.state\[2\.weight\]\..* held for a replaced parameter.*re-bind it: "
        r"torchplace\.move\(model, 'cpu', optimizer=opt\)",
    ) as placed:
        torchplace.verify(model, "cpu", optimizer=opt)
    assert placed.value.stragglers[0].name == "optimizer.state[2.weight].step"
    assert {s.kind for s in placed.value.stragglers} == {"optimizer_state"}
    assert torchplace.stragglers(model, "cpu", optimizer=opt)
    torchplace.move(model, "cpu", optimizer=opt)
    torchplace.verify(model, "cpu", optimizer=opt)
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    assert {id(p) for p in model.parameters()} == held
    assert torch.equal(opt.state[model[2].weight]["exp_avg"], moments)
    before = model[2].weight.detach().clone()
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    assert not torch.equal(model[2].weight, before)


def test_a_disk_module_over_a_legacy_torch_file_is_refused_with_the_fix(tmp_path: Any) -> None:
    """A legacy (pre-1.6) file is read only whole: the load went through, then every call
    failed, with no fix."""
    model = mlp(2)
    path = tmp_path / "legacy.pt"
    torch.save(model.state_dict(), path, _use_new_zipfile_serialization=False)
    target = torchplace.skeleton(mlp, 2)
    with pytest.raises(
        torchplace.CheckpointError,
        match=r"model\.2 on 'disk'.*cannot give its weight '2\.weight' on its own: it is in a "
        r"legacy .*save the checkpoint again with torch\.save .* or map '2' to 'cpu'",
    ) as caught:
        torchplace.load_into(target, path, device_map={"": "cpu", "2": "disk"})
    assert caught.value.path == path
    assert all(p.is_meta for p in target.parameters())
    loaded = torchplace.load_into(target, path, device_map={"": "cpu", "2": "cpu"})
    x = torch.randn(3, 8)
    assert torch.equal(loaded(x), model(x))
    # a weight saved as a view with gaps (every other column of a wider tensor): not one range
    state = dict(model.state_dict())
    state["2.weight"] = torch.cat([state["2.weight"]] * 2, dim=1)[:, ::2]
    torch.save(state, tmp_path / "strided.pt")
    with pytest.raises(
        torchplace.CheckpointError, match=r"cannot give its weight '2\.weight'"
    ) as caught:
        torchplace.load_into(
            torchplace.skeleton(mlp, 2),
            tmp_path / "strided.pt",
            device_map={"": "cpu", "2": "disk"},
        )
    assert caught.value.path == tmp_path / "strided.pt"


@pytest.mark.parametrize("device_map", [None, {"": "cpu", "2": "disk"}], ids=["plain", "by-map"])
def test_load_into_refuses_a_model_with_offloaded_modules_until_it_is_gathered(
    device_map: Any, tmp_path: Any
) -> None:
    """Filled in place, the disk module went on reading the old checkpoint at each call: the
    output mixed two checkpoints without a word (and verify's fix pointed at load_into)."""
    torch.manual_seed(0)
    first, second = mlp(2).eval(), mlp(2).eval()
    torch.save(first.state_dict(), tmp_path / "first.pt")
    torch.save(second.state_dict(), tmp_path / "second.pt")
    model = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "first.pt", device_map={"": "cpu", "2": "disk"}
    )
    with pytest.raises(torchplace.PlacementError) as said:
        torchplace.verify(model, "cpu")
    assert "offloaded to disk by a device map" in str(said.value)
    assert [s.name for s in said.value.stragglers] == ["2.weight", "2.bias"]
    assert "torchplace.move(model, 'cpu')" in str(said.value)
    assert "load_into" not in str(said.value)
    device = "cpu" if device_map is None else None
    with pytest.raises(
        torchplace.CheckpointError,
        match=r"model\.2 \(Linear\) is offloaded to disk .* torchplace\.move\(model, 'cpu'\)",
    ):
        torchplace.load_into(model, tmp_path / "second.pt", device, device_map=device_map)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(model(x), first(x))  # untouched: still the first checkpoint's
    torchplace.move(model, "cpu")  # gathered, hooks removed
    torchplace.load_into(model, tmp_path / "second.pt")
    assert torch.equal(model(x), second(x))


def test_load_into_by_a_map_keeps_the_data_of_its_errors(tmp_path: Any) -> None:
    # The re-raise that puts "load_into(): " in front dropped .missing and .path (and dispatch,
    # plan and estimate theirs): a program acting on err.missing found it empty.
    model = mlp(2)
    torch.save({"0.weight": model[0].weight, "0.bias": model[0].bias}, tmp_path / "part.pt")
    with pytest.raises(torchplace.CheckpointError, match=r"^load_into\(\): ") as caught:
        torchplace.load_into(
            torchplace.skeleton(mlp, 2), tmp_path / "part.pt", device_map={"": "cpu"}
        )
    assert caught.value.missing == ("2.weight", "2.bias")
    assert caught.value.path == tmp_path / "part.pt"


def saved_llama(tmp_path: Any) -> tuple[nn.Module, Any, Any]:
    cls, config = tiny_llama()
    torch.manual_seed(0)
    reference = cls(config).eval()
    reference.save_pretrained(tmp_path / "saved")
    return reference, cls, config


def test_move_gathers_a_disk_offloaded_model(tmp_path: Any) -> None:
    reference, cls, config = saved_llama(tmp_path)
    model = torchplace.load_into(
        torchplace.skeleton(cls, config),
        tmp_path / "saved",
        device_map={"": "cpu", "model.layers.0": "disk", "model.layers.2": "disk"},
    )
    torchplace.move(model, "cpu")
    assert not is_dispatched(model)
    torchplace.verify(model, "cpu")
    assert torchplace.where(model) == torch.device("cpu")
    for (name, got), want in zip(
        model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(got, want), name
    assert list(homes(model)) == []
    model(IDS).logits.sum().backward()  # a gathered model trains again


def test_move_says_how_much_is_missing_and_changes_nothing(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, cls, config = saved_llama(tmp_path)
    model = torchplace.load_into(
        torchplace.skeleton(cls, config),
        tmp_path / "saved",
        device_map={"": "cpu", "model.layers.0": "disk", "model.layers.2": "disk"},
    )
    layer = sum(p.numel() * 4 for p in reference.model.layers[0].parameters())
    monkeypatch.setattr(offloaded, "host_available", lambda: 1000)
    with pytest.raises(torchplace.MoveError, match=rf"needs {layer * 2 // 1024}\.\d KiB.*missing"):
        torchplace.move(model, "cpu")
    assert is_dispatched(model)
    assert model.model.layers[0].self_attn.q_proj.weight.is_meta
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


def test_report_where_and_verify_show_offloaded_modules(tmp_path: Any) -> None:
    reference, cls, config = saved_llama(tmp_path)
    device_map = {"": "cpu", "model.layers.1": "disk", "model.layers.3": "disk"}
    model = torchplace.load_into(torchplace.skeleton(cls, config), tmp_path / "saved",
                                 device_map=device_map)  # fmt: skip
    found = torchplace.report(model)
    rows = {row.path: row.device for row in found.rows}
    assert rows["model.layers.1.self_attn.q_proj"] == "disk, runs on cpu"
    assert rows["model.layers.2.self_attn.q_proj"] == "cpu"
    layers = sum(p.numel() * 4 for i in (1, 3) for p in reference.model.layers[i].parameters())
    assert found.to_dict()["totals"]["by_device"]["disk, runs on cpu"]["bytes"] == layers
    assert "disk, runs on cpu" in str(found)
    assert torchplace.where(model) == torch.device("cpu")
    torchplace.verify(model, device_map)
    with pytest.raises(torchplace.PlacementError, match=r"model\.layers\.1\..*offloaded to disk"):
        torchplace.verify(model, {"": "cpu"})
    model.model.norm.to("meta")
    with pytest.raises(
        torchplace.PlacementError,
        match=r"model\.norm\.weight \(parameter\): it is on meta, the map says cpu",
    ) as placed:
        torchplace.verify(model, device_map)
    assert [s.name for s in placed.value.stragglers] == ["model.norm.weight"]
    assert placed.value.stragglers[0].device == torch.device("meta")


def test_verify_reads_a_map_as_dispatch_does_and_refuses_a_module_the_model_lacks() -> None:
    """A key naming no module was passed over: verify passed a map dispatch refuses."""

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)])

    model = Two()
    refused = [
        ({"": "cpu", "3": "disk"}, r"device_map\['3'\]: the model has no submodule '3'"),
        ({"": "cpu", "layer.1": "cuda:0"}, r"no submodule 'layer\.1'; did you mean 'layers\.1'"),
        ({"": "cpu", "layers.1.weight": "cpu"}, r"is a tensor, not a module.*'layers\.1'"),
        ({"": "cpu", "layers.0": "dsk"}, r"device_map\['layers\.0'\].*did you mean 'disk'"),
    ]
    for device_map, message in refused:
        with pytest.raises(torchplace.DeviceSpecError, match=r"^verify\(\): .*" + message):
            torchplace.verify(model, device_map)
        with pytest.raises(torchplace.DeviceSpecError, match=message):
            torchplace.dispatch(model, device_map)  # the same words
    torchplace.verify(model, {"": "cpu", "layers.1": "cpu"})
    # Its devices need not be on this machine: the map is read, not carried out.
    with pytest.raises(
        torchplace.PlacementError, match=r"layers\.1\.weight .*the map says cuda:0"
    ) as placed:
        torchplace.verify(model, {"": "cpu", "layers.1": "cuda:0"})
    assert [s.name for s in placed.value.stragglers] == ["layers.1.weight", "layers.1.bias"]


class Scaled(nn.Module):
    """A layer with a buffer its state dict leaves out: made, not read, it stays in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_verify_accepts_the_whole_model_map_it_was_loaded_and_dispatched_with(
    tmp_path: Any,
) -> None:
    """verify(model, {"": "disk"}) failed on the non-persistent buffer, which stays where the
    model runs, and its fix, dispatch(model, {"": "disk"}), said the weights were in memory."""
    torch.manual_seed(0)
    whole = Scaled().eval()
    torch.save(whole.state_dict(), tmp_path / "scaled.pt")
    x = torch.ones(2, 4)
    for device_map in ({"": "disk"}, {"": "cpu"}):
        model = torchplace.load_into(
            torchplace.skeleton(Scaled), tmp_path / "scaled.pt", device_map=device_map
        )
        torchplace.verify(model, device_map)
        torchplace.dispatch(model, device_map)  # dispatched again by the same map
        torchplace.verify(model, device_map)
        with torch.no_grad():
            assert torch.equal(model(x), whole(x))
    with pytest.raises(torchplace.PlacementError, match=r"lin\.weight .*on cpu, the map says disk"):
        torchplace.verify(Scaled(), {"": "disk"})


def test_verify_accepts_the_host_tier_map_with_another_device_executing() -> None:
    """{"": "cpu"} beside an accelerator (meta stands in for it): the blocks live on the host,
    the non-persistent buffer where the model runs; verify read it as the whole model on cpu."""
    model = torchplace.dispatch(Scaled(), {"": "cpu"}, execution_device="meta")
    assert model.scale.is_meta and model.lin.weight.device == torch.device("cpu")
    torchplace.verify(model, {"": "cpu"})


def test_verify_by_map_suggests_a_fix_that_works(tmp_path: Any) -> None:
    """A model in memory checked against {"": "disk"} was told to dispatch, which writes no
    weights to disk: the fix is to load it by the map. Each fix is followed to the letter."""
    torch.manual_seed(0)
    torch.save(Scaled().state_dict(), tmp_path / "scaled.pt")
    device_map = {"": "disk"}
    with pytest.raises(torchplace.PlacementError) as placed:
        torchplace.verify(Scaled(), device_map)
    fix = "torchplace.load_into(skeleton, checkpoint, device_map=device_map)"
    assert fix in str(placed.value)
    assert "dispatch(model" not in str(placed.value)
    skeleton, checkpoint = torchplace.skeleton(Scaled), tmp_path / "scaled.pt"
    model = eval(fix, {"torchplace": torchplace, **locals()})
    torchplace.verify(model, device_map)
    # weights on disk, the map puts them in memory: gather them first, then dispatch
    with pytest.raises(torchplace.PlacementError) as placed:
        torchplace.verify(model, {"": "cpu", "lin": "meta"})
    fix = "torchplace.move(model, 'cpu'), then torchplace.dispatch(model, device_map)"
    assert fix in str(placed.value)
    device_map = {"": "cpu", "lin": "meta"}
    torchplace.move(model, "cpu")
    torchplace.dispatch(model, device_map)
    torchplace.verify(model, device_map)


def test_verify_accepts_a_llama_loaded_whole_on_disk(tmp_path: Any) -> None:
    """Llama's rotary_emb.inv_freq is not saved: it stays where the model runs."""
    reference, cls, config = saved_llama(tmp_path)
    model = torchplace.load_into(
        torchplace.skeleton(cls, config), tmp_path / "saved", device_map={"": "disk"}
    )
    assert model.model.rotary_emb.inv_freq.device == torch.device("cpu")
    torchplace.verify(model, {"": "disk"})
    torchplace.dispatch(model, {"": "disk"})
    torchplace.verify(model, {"": "disk"})
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


# ------------------------------------------------- the CUDA transport's streams, with fake ones


class FakeStream:
    def __init__(self, name: str, cuda: FakeCuda) -> None:
        self.name, self.cuda = name, cuda

    def wait_stream(self, other: FakeStream) -> None:
        self.cuda.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait_event", self.name, event.name))


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda, self.name = cuda, ""

    def record(self, stream: FakeStream) -> None:
        self.cuda.events += 1
        self.name = f"event{self.cuda.events}"
        self.cuda.log.append(("record", stream.name, self.name))


class FakeCuda:
    """Streams and events that log what is asked of them (torch.cuda's names)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.events = 0
        self.current = FakeStream("compute", self)

    def Stream(self, device: torch.device) -> FakeStream:
        return FakeStream("side", self)

    def Event(self) -> FakeEvent:
        return FakeEvent(self)

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.current

    def stream(self, s: FakeStream) -> Any:
        cuda = self

        class Using:
            def __enter__(self) -> None:
                self.previous, cuda.current = cuda.current, s

            def __exit__(self, *exc: object) -> None:
                cuda.current = self.previous

        return Using()


class LoggingTransport(DeviceFetcher):
    """The real transport's logic over fake streams: copies are clones, logged with the stream
    they were queued on."""

    names: dict[int, str]

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        self.cuda.log.append(("copy", self.cuda.current.name, self.names[id(host)]))
        return host.clone()

    def record(self, t: torch.Tensor, stream: Any) -> None:
        self.cuda.log.append(("record_stream", stream.name, ""))


def _host_tier_on_fake_cuda(model: nn.Module) -> tuple[FakeCuda, LoggingTransport, list[Unit]]:
    """``mlp(3)``'s Linears as host-tier units executed on a fake ``cuda:0``."""
    cuda = FakeCuda()
    transport = LoggingTransport(torch.device("cuda:0"), cuda)
    transport.names = {id(p): n for n, p in model.named_parameters()}
    units = []
    for name in ("0", "2", "4"):
        module = model.get_submodule(name)
        slots = [(module, leaf, p) for leaf, p in module.named_parameters()]
        home = Home("cpu", torch.device("cuda:0"))
        units.append(Unit(name, module, slots, [s[1] for s in slots], home))
    return cuda, transport, units


def test_host_tier_copies_run_on_a_side_stream_that_compute_waits_for() -> None:
    from torchplace.spreading._dispatch import _hook_units

    reference = mlp(3)
    model = copy.deepcopy(reference).requires_grad_(False)
    cuda, transport, units = _host_tier_on_fake_cuda(model)
    for unit in units:

        def forward(x: torch.Tensor, name: str = unit.path, module: nn.Module = unit.module) -> Any:
            cuda.log.append(("run", "compute", name))  # the forward itself, weights in place
            return type(module).forward(module, x)

        unit.module.forward = forward
    _hook_units(units, 2, transport)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    log = cuda.log
    for name in ("0", "2", "4"):
        ran = log.index(("run", "compute", name))
        copies = [
            i for i, e in enumerate(log[:ran]) if e[0] == "copy" and e[2].startswith(name + ".")
        ]
        assert all(log[i][1] == "side" for i in copies), "copied on the compute stream"
        assert log[copies[0] - 1] == ("wait_stream", "side", "compute")
        record = log[copies[-1] + 1]
        assert record[:2] == ("record", "side")
        waited = log.index(("wait_event", "compute", record[2]))
        assert waited < ran, f"{name} ran before compute waited for its copies"
        released = [i for i, e in enumerate(log) if e[0] == "record_stream" and i > ran]
        assert released, f"{name}'s copies were released without record_stream"
    # 3 layers x (weight, bias), and layer 0's again, fetched ahead for the next call
    assert sum(e[0] == "copy" for e in log) == 8


def test_a_unit_fetched_ahead_is_fetched_again_when_its_weights_changed_meanwhile() -> None:
    """The last unit of a call fetches the first one ahead for the next call; a weight edited
    in place (or the model cast) between the calls left that fetch stale, and the next call ran
    with the old weights. A fetch now notes what it read from, and is made again if it
    changed."""
    from torchplace.spreading._dispatch import _hook_units

    reference = mlp(3)
    model = copy.deepcopy(reference).requires_grad_(False)
    cuda, transport, units = _host_tier_on_fake_cuda(model)
    _hook_units(units, 2, transport)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert ("copy", "side", "0.weight") in cuda.log[-6:]  # layer 0 fetched ahead
        model[0].weight.mul_(2)
        reference[0].weight.mul_(2)
        assert torch.equal(model(x), reference(x))


@pytest.mark.requires_cuda
def test_host_and_disk_tiers_on_a_gpu_match_the_model_on_the_gpu(tmp_path: Any) -> None:
    reference, cls, config = saved_llama(tmp_path)
    on_gpu = copy.deepcopy(reference).to("cuda:0")
    device_map = {"": "cuda:0", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.3": "cpu"}  # fmt: skip
    model = torchplace.load_into(
        torchplace.skeleton(cls, config), tmp_path / "saved", device_map=device_map
    )
    assert model.model.layers[0].self_attn.q_proj.weight.is_pinned()
    ids = IDS.to("cuda:0")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, on_gpu(ids).logits)
        assert torch.equal(model(ids).logits, on_gpu(ids).logits)
    want = on_gpu.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want)
    torchplace.verify(model, device_map)
    torchplace.move(model, "cuda:0")
    torchplace.verify(model, "cuda:0")


def test_a_unit_that_calls_itself_keeps_its_weights_until_the_outer_call_ends() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, again: bool = True) -> torch.Tensor:
            x = self.inner(x)
            return self(x, again=False) + self.inner.weight.sum() if again else x

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(2)
            self.block = Twice()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(x)

    reference = Model()
    model = copy.deepcopy(reference)
    on_disk(model, ["block"])
    torchplace.dispatch(model, {"": "cpu", "block": "disk"})
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert model.block.inner.weight.is_meta


@pytest.mark.parametrize(
    ("device_map", "read_onto"),
    [
        ({"": "cpu", "2": "disk"}, torch.device("cpu")),
        ({"": "meta", "2": "disk"}, torch.device("meta")),
        ({"": "cpu", "0": "meta", "2": "disk"}, None),
    ],
    ids=["one-device", "meta", "two-devices"],
)
def test_the_modules_in_memory_are_read_straight_onto_their_one_device(
    device_map: dict[str, str], read_onto: torch.device | None, tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from torchplace.spreading import _load_by_map

    torch.save(mlp(2).state_dict(), tmp_path / "mlp.pt")
    asked: list[object] = []
    real = _load_by_map.fill

    def spy(model: nn.Module, source: Any, device: Any = None, /, **kw: Any) -> nn.Module:
        asked.append(device)
        return real(model, source, device, **kw)

    monkeypatch.setattr(_load_by_map, "fill", spy)
    torchplace.load_into(torchplace.skeleton(mlp, 2), tmp_path / "mlp.pt", device_map=device_map)
    assert asked == [read_onto]


def test_a_checkpoint_rewritten_under_a_running_model_raises(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchplace.checkpoint._disk_weights import CheckpointWeights

    torch.save(mlp(2).state_dict(), tmp_path / "mlp.pt")
    model = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "mlp.pt", device_map={"": "cpu", "2": "disk"}
    )
    reads: list[str] = []
    real_read = CheckpointWeights.read

    def counted(
        self: CheckpointWeights, device: torch.device, alloc: Any = None
    ) -> dict[str, torch.Tensor]:
        reads.append(self.entry)
        return real_read(self, device, alloc)

    with torch.no_grad():
        model(torch.ones(1, 8))
        torch.save({"other": torch.zeros(3)}, tmp_path / "mlp.pt")
        monkeypatch.setattr(CheckpointWeights, "read", counted)
        for _ in range(2):
            with pytest.raises(torchplace.CheckpointError, match=r"mlp\.pt") as caught:
                model(torch.ones(1, 8))
            assert caught.value.path == tmp_path / "mlp.pt"
            assert isinstance(caught.value, FileChanged) and caught.value.changes
    assert reads == ["2", "2"]  # the failed read is read again, not kept and re-raised
    assert model[2].weight.is_meta


def test_a_checkpoint_rewritten_before_the_first_forward_raises(tmp_path: Any) -> None:
    # The disk tier used to catalog the file at its first read, so a file rewritten between
    # load_into and the first forward was read as the new file, without a word.
    torch.save(mlp(2).state_dict(), tmp_path / "mlp.pt")
    model = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "mlp.pt", device_map={"": "cpu", "2": "disk"}
    )
    other = {k: v + 1 for k, v in mlp(2).state_dict().items()}
    torch.save(other, tmp_path / "mlp.pt")  # the same keys, other values
    with (
        torch.no_grad(),
        pytest.raises(
            torchplace.CheckpointError,
            match=r"mlp\.pt: the checkpoint that model\.2 \(offloaded to 'disk'\) reads its "
            r"weights from when it runs has changed since the model was loaded \(.*its "
            r"modification time changed.*load the model again from it .*torchplace\.move\(model, "
            r"'cpu'\)",
        ) as caught,
    ):
        model(torch.ones(1, 8))
    assert caught.value.path == tmp_path / "mlp.pt"


_INTERRUPTED_CHILD = """
import os, signal, sys, time
import torch
from torch import nn
import torchplace

class Interrupting(nn.Linear):
    armed = False

    def forward(self, x):
        if Interrupting.armed:  # a real Ctrl-C, landing inside this offloaded layer's forward
            Interrupting.armed = False
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        return super().forward(x)

def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Interrupting(8, 8), nn.Linear(8, 8))

reference = make()
torch.save(reference.state_dict(), sys.argv[1])
model = torchplace.load_into(torchplace.skeleton(make), sys.argv[1],
                             device_map={"": "cpu", "1": "disk", "2": "disk"})
x = torch.randn(2, 8)
with torch.no_grad():
    Interrupting.armed = True
    try:
        model(x)
        print("no interrupt came")
    except KeyboardInterrupt:
        print("interrupted; on meta:", model[1].weight.is_meta)
    print("again:", torch.equal(model(x), reference(x)), "; on meta:", model[1].weight.is_meta)
"""


@pytest.mark.slow  # a subprocess
def test_ctrl_c_inside_an_offloaded_forward_drops_its_weights(tmp_path: Any) -> None:
    """PyTorch runs ``always_call`` forward hooks for an ``Exception`` only: a Ctrl-C inside an
    offloaded module's forward must not leave its fetched weights in place for good (and the
    ring taking every later call for a call from inside it)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_CHILD, str(tmp_path / "m.pt")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["interrupted; on meta: True", "again: True ; on meta: True"]


class TiedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 8, bias=False)
        self.block = TiedBlock()
        self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("head", r"model\.head\.weight is tied to model\.embed\.weight.*map 'head' to 'cpu'"),
        ("embed", r"model\.embed\.weight is tied to model\.head\.weight.*map 'embed' to 'cpu'"),
    ],
)
def test_a_tie_half_on_disk_is_refused(entry: str, message: str, tmp_path: Any) -> None:
    """A tie is one tensor in memory: one holder resident and the other on disk would cut it
    (the resident one's values, the disk one's placeholder). The map is refused up front,
    naming the tie."""
    torch.save(Tied().state_dict(), tmp_path / "tied.pt")
    skeleton = torchplace.skeleton(Tied)
    with pytest.raises(torchplace.DeviceSpecError, match=message):
        torchplace.load_into(skeleton, tmp_path / "tied.pt", device_map={"": "cpu", entry: "disk"})
    assert skeleton.head.weight is skeleton.embed.weight and skeleton.head.weight.is_meta
    assert not is_dispatched(skeleton)


def test_a_tie_whose_holders_are_all_on_disk_runs(tmp_path: Any) -> None:
    """Both holders of a tie mapped to 'disk' under entries of their own (as plan maps a tied
    embedding and head that find no room in memory): each reads the tensor from the file, and
    the outputs are the resident model's; it was refused."""
    torch.manual_seed(0)
    resident = Tied()
    torch.save(resident.state_dict(), tmp_path / "tied.pt")
    both = {"": "cpu", "embed": "disk", "head": "disk"}
    model = torchplace.load_into(torchplace.skeleton(Tied), tmp_path / "tied.pt", device_map=both)
    assert model.head.weight.is_meta and model.embed.weight.is_meta
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), resident(x))


def test_a_tie_inside_one_disk_module_is_refused_naming_the_fix(tmp_path: Any) -> None:
    """Two holders of a tie inside one disk module: it reads each of its weights from a key of
    its own, so the map is refused up front, saying to map the holders one by one."""
    torch.save(Tied().state_dict(), tmp_path / "tied.pt")
    skeleton = torchplace.skeleton(Tied)
    with pytest.raises(torchplace.DeviceSpecError, match=r"both inside model\.block.*one by one"):
        torchplace.load_into(
            skeleton, tmp_path / "tied.pt", device_map={"": "cpu", "block": "disk"}
        )
    assert not is_dispatched(skeleton)


def test_the_disk_tier_reads_into_memory_without_populating_it_first(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each unit's weights are read into memory the previous unit's weights just gave back, so
    faulting its pages in ahead of the read (``read_into``'s ``fresh``) only costs: 7.9 ms
    against 3.0 ms a 16 MiB layer, read on one thread from the page cache (bench_offload)."""
    from torchplace.checkpoint._reader import OpenFiles

    torch.save(mlp(2).state_dict(), tmp_path / "mlp.pt")
    model = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "mlp.pt", device_map={"": "cpu", "2": "disk"}
    )
    asked: list[bool] = []
    real = OpenFiles.read

    def spy(files: OpenFiles, path: Any, items: Any, fresh: bool = True, threads: Any = None):  # type: ignore[no-untyped-def]
        asked.append(fresh)
        return real(files, path, items, fresh, threads)

    monkeypatch.setattr(OpenFiles, "read", spy)
    with torch.no_grad():
        assert torch.equal(model(torch.ones(1, 8)), mlp(2)(torch.ones(1, 8)))
    assert asked and not any(asked)


def test_disk_layers_executed_on_the_cpu_are_read_as_they_run_on_the_calling_thread(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Executed on the CPU, a disk layer's read in a background thread (and the reader's own
    threads, started for each read) only took cores from the forward's threads: 16 layers of
    ``Linear(2048)`` at batch 16 ran at 1.38-1.50x the floor (bench_offload). Each layer is now
    read when it runs, on the thread that calls the model, starting no thread."""
    import threading

    from safetensors.torch import save_file

    from torchplace.checkpoint import _host_read

    reference = mlp(3)
    save_file(reference.state_dict(), str(tmp_path / "mlp.safetensors"))
    disk = ["0", "2", "4"]
    model = torchplace.load_into(
        torchplace.skeleton(mlp, 3),
        tmp_path / "mlp.safetensors",
        device_map={"": "cpu", **dict.fromkeys(disk, "disk")},
    )
    monkeypatch.setattr(_host_read, "READ_THREADS", 4)  # as on a machine with cores to spare
    log: list[tuple[str, Any]] = []
    real_pread, real_start = _host_read.pread_exactly, threading.Thread.start

    def pread(fd: int, view: memoryview, offset: int) -> None:
        log.append(("read", threading.current_thread()))
        real_pread(fd, view, offset)

    def start(thread: threading.Thread) -> None:
        log.append(("thread started", thread.name))
        real_start(thread)

    monkeypatch.setattr(_host_read, "pread_exactly", pread)
    monkeypatch.setattr(threading.Thread, "start", start)
    for name in disk:
        model.get_submodule(name).register_forward_hook(
            lambda m, args, out, name=name: log.append(("ran", name))
        )
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    me = threading.current_thread()
    # each layer's weight and bias read on this thread just before it runs, none ahead
    assert log == [e for name in disk for e in [("read", me), ("read", me), ("ran", name)]]


class CpuSource(MemorySource):
    """A disk tier's reader that reads onto the CPU whatever device it is asked for (the fake
    CUDA device of the stream tests)."""

    def read(self, device: torch.device) -> dict[str, torch.Tensor]:
        return super().read(torch.device("cpu"))

    def only(self, prefix: str) -> CpuSource:
        return CpuSource(self.state, prefix)


def test_the_side_stream_is_made_once_on_the_callers_thread() -> None:
    """A disk unit fetched first used to make the side stream in the reading thread, while the
    caller could make another at once for a host unit: a host unit's copies could then be
    queued on one stream and the event its compute waits on recorded on the other."""
    import threading

    from torchplace.spreading._dispatch import _hook_units

    reference = mlp(2)
    model = copy.deepcopy(reference).requires_grad_(False)
    made: list[threading.Thread] = []

    class Cuda(FakeCuda):
        def Stream(self, device: torch.device) -> FakeStream:
            made.append(threading.current_thread())
            return super().Stream(device)

    transport = LoggingTransport(torch.device("cuda:0"), Cuda())
    transport.names = {id(p): n for n, p in model.named_parameters()}
    units = []
    for name, tier in (("0", "disk"), ("2", "cpu")):
        module = model.get_submodule(name)
        slots = [(module, leaf, p) for leaf, p in module.named_parameters()]
        source = CpuSource({k: v.detach() for k, v in module.named_parameters()})
        home = Home(tier, torch.device("cuda:0"), source if tier == "disk" else None)
        units.append(Unit(name, module, slots, [s[1] for s in slots], home))
    _hook_units(units, 2, transport)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert made == [threading.main_thread()]


class SlowSource(MemorySource):
    """A disk tier's reader that takes a while, so that two threads wait for one read."""

    def read(self, device: torch.device) -> dict[str, torch.Tensor]:
        import time

        time.sleep(0.01)
        return super().read(device)

    def only(self, prefix: str) -> SlowSource:
        return SlowSource(self.state, prefix)


def test_two_threads_running_one_offloaded_model_each_get_their_output() -> None:
    """Two threads waiting for one unit's read both swapped its weights in, and the first to
    finish swapped them out under the other (which then met ``meta`` weights)."""
    import concurrent.futures

    reference = mlp(3)
    model = copy.deepcopy(reference).requires_grad_(False)
    for name in ("0", "2", "4"):
        module = model.get_submodule(name)
        module.__dict__[HOME] = Home(
            "disk",
            torch.device("cpu"),
            SlowSource({k: v.detach() for k, v in module.named_parameters()}),
        )
        module.to_empty(device="meta")
    torchplace.dispatch(model, {"": "cpu", "0": "disk", "2": "disk", "4": "disk"})
    xs = [torch.randn(2, 8) for _ in range(2)]

    def run(x: torch.Tensor) -> bool:
        with torch.no_grad():
            return all(torch.equal(model(x), reference(x)) for _ in range(15))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(run, xs, timeout=120)) == [True, True]
    assert all(p.is_meta for p in model.parameters())


def test_a_model_cast_after_loading_reads_its_disk_weights_in_the_new_dtype(
    tmp_path: Any,
) -> None:
    """``model.to(torch.float64)`` casts the ``meta`` parameters a disk module keeps at home;
    its weights were still read in the dtype the model had when it was loaded (float32 into a
    float64 matmul: a raw RuntimeError), and ``move`` gathered them so."""
    reference = mlp(2)
    torch.save(reference.state_dict(), tmp_path / "mlp.pt")
    model = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "mlp.pt", device_map={"": "cpu", "2": "disk"}
    )
    model.to(torch.float64)
    reference.to(torch.float64)
    x = torch.randn(3, 8, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    torchplace.move(model, "cpu")
    assert model[2].weight.dtype == torch.float64
    assert torch.equal(model[2].weight, reference[2].weight)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"offload_window": 0}, r"offload_window must be at least 1, not 0"),
        ({"execution_device": "bogus"}, r"execution_device: unknown device spec 'bogus'"),
    ],
)
def test_load_into_checks_the_offload_options_before_reading_the_checkpoint(
    options: dict[str, Any], error: str, tmp_path: Any
) -> None:
    """A typo in ``offload_window`` or ``execution_device`` was found by ``dispatch``, once the
    whole checkpoint had been read, and left the skeleton filled but not dispatched."""
    torch.save(mlp(2).state_dict(), tmp_path / "mlp.pt")
    skeleton = torchplace.skeleton(mlp, 2)
    with pytest.raises(torchplace.DeviceSpecError, match=error):
        torchplace.load_into(
            skeleton, tmp_path / "mlp.pt", device_map={"": "cpu", "2": "disk"}, **options
        )
    assert all(p.is_meta for p in skeleton.parameters())
    assert list(homes(skeleton)) == [] and not is_dispatched(skeleton)


def test_two_threads_calling_one_unit_share_its_weights_and_leave_it_offloaded() -> None:
    """A call of a unit while another thread's call of it runs (here with gradients on, which
    was refused before) finds its weights in place; the last call to end lets them go."""
    import threading

    class Waiting(nn.Linear):
        inside, go = threading.Event(), threading.Event()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled():
                Waiting.inside.set()
                assert Waiting.go.wait(60)
            return super().forward(x)

    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(Waiting(8, 8), nn.Tanh(), nn.Linear(8, 8))

    reference = make()
    model = make()
    on_disk(model, ["0"])
    torchplace.dispatch(model, {"": "cpu", "0": "disk"})
    x = torch.randn(2, 8)
    got: list[torch.Tensor] = []

    def run() -> None:
        with torch.no_grad():
            got.append(model(x))

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert Waiting.inside.wait(60)
        assert torch.equal(model(x).detach(), reference(x).detach())  # gradients on
    finally:
        Waiting.go.set()
        thread.join(60)
    with torch.no_grad():
        assert len(got) == 1 and torch.equal(got[0], reference(x))
    assert model[0].weight.is_meta


def test_state_dict_of_a_disk_module_says_to_gather_first_and_moving_lifts_it(
    tmp_path: Any,
) -> None:
    """A module left on disk has meta parameters: ``state_dict()`` (what ``save_pretrained`` and
    ``torch.save`` call) would hold no values and failed deep inside torch; it now says to gather
    the model, and after ``move`` the state dict is the saved one, bit for bit."""
    reference = mlp(2)
    torch.save(reference.state_dict(), tmp_path / "mlp.pt")
    model = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "mlp.pt", device_map={"": "cpu", "2": "disk"}
    )
    with pytest.raises(torchplace.TorchplaceError, match=r"model\.2 is offloaded to 'disk'.*move"):
        model.state_dict()
    assert model.state_dict(keep_vars=True)["2.weight"].is_meta  # torchplace's own walks pass
    torchplace.move(model, "cpu")
    got = model.state_dict()
    for name, want in reference.state_dict().items():
        assert torch.equal(got[name], want), name


def test_a_disk_offloaded_model_refuses_pickling_and_deep_copies_read_for_the_copy(
    tmp_path: Any,
) -> None:
    import pickle

    reference = mlp(2)
    torch.save(reference.state_dict(), tmp_path / "mlp.pt")
    model = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "mlp.pt", device_map={"": "cpu", "2": "disk"}
    )
    with pytest.raises(torchplace.TorchplaceError, match=r"cannot be pickled.*torchplace\.move"):
        pickle.dumps(model)
    twin = copy.deepcopy(model)
    twin.to(torch.float64)  # the copy's reader must read in the copy's dtypes, not the model's
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(twin(x.double()), reference.double()(x.double()))
        assert torch.equal(model(x), reference.float()(x))


def test_dispatching_a_disk_module_elsewhere_says_to_gather_first(tmp_path: Any) -> None:
    reference = mlp(2)
    torch.save(reference.state_dict(), tmp_path / "mlp.pt")
    model = torchplace.load_into(
        torchplace.skeleton(mlp, 2), tmp_path / "mlp.pt", device_map={"": "cpu", "2": "disk"}
    )
    with pytest.raises(torchplace.MoveError, match=r"model\.2 is offloaded.*torchplace\.move") as e:
        torchplace.dispatch(model, {"": "cpu"})
    assert e.value.name == "2"
    torchplace.dispatch(model, {"": "cpu", "2": "disk"}, offload_window=1)  # kept on disk: fine
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    torchplace.move(model, "cpu")
    torchplace.dispatch(model, {"": "cpu"})  # gathered: any map
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_key_errors_of_a_load_by_map_speak_of_a_rename_only_where_one_was_given(
    tmp_path: Any,
) -> None:
    """load_into(..., device_map=) drops the disk modules' keys from the fill itself: with no
    rename= given, its errors spoke of one ("as rename= names them", "rename= dropped all");
    with one that moves a disk module's keys away, the error said the file held none."""
    model = mlp(2)
    path = tmp_path / "m.pt"
    torch.save({**model.state_dict(), "extra": torch.zeros(1)}, path)
    disk = {"": "cpu", "2": "disk"}
    with pytest.raises(torchplace.CheckpointError, match=r"unexpected keys: extra;") as e:
        torchplace.load_into(torchplace.skeleton(mlp, 2), path, device_map=disk)
    assert "rename" not in str(e.value)
    assert (e.value.path, e.value.unexpected) == (path, ("extra",))
    for rename, kept in (({r".*": None}, r"it dropped every one"), ({r"^": "x."}, "x.0.bias")):
        with pytest.raises(
            torchplace.CheckpointError,
            match=rf"model\.2 on 'disk', but after the rename= given none of the keys of .*m\.pt "
            rf"is under '2\.' \(.*{kept}.*\).*fix the rename",
        ) as e:
            torchplace.load_into(torchplace.skeleton(mlp, 2), path, device_map=disk, rename=rename)
        assert (e.value.path, e.value.missing) == (path, ("2.weight", "2.bias"))


def test_strict_false_by_map_leaving_a_resident_tensor_on_meta_is_refused_untouched(
    tmp_path: Any,
) -> None:
    """strict=False filled what the file held, then dispatch raised MoveError on the tensor left
    on meta: the skeleton half-filled. It is refused before anything stays filled, and what
    the caller initialises first stays as the rest loads."""
    model = mlp(2)
    path = tmp_path / "partial.pt"
    torch.save({k: v for k, v in model.state_dict().items() if k != "0.bias"}, path)
    disk = {"": "cpu", "2": "disk"}
    target = torchplace.skeleton(mlp, 2)
    with pytest.raises(
        torchplace.CheckpointError,
        match=r"strict=False would leave 1 tensor\(s\) of Sequential on meta.*: 0\.bias; .*"
        r"partial\.pt has no key for them.*Nothing was filled",
    ) as left:
        torchplace.load_into(target, path, device_map=disk, strict=False)
    assert (left.value.path, left.value.missing) == (path, ("0.bias",))
    assert all(p.is_meta for p in target.parameters()) and not is_dispatched(target)
    # A model partly real: its real weights are not overwritten (the fill wrote in place).
    half = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8, device="meta"), nn.Tanh())
    torch.save({k: v for k, v in model.state_dict().items() if k != "2.bias"}, path)
    before = half[0].weight.detach().clone()
    with pytest.raises(torchplace.CheckpointError, match=r"2\.bias;.*Nothing was filled") as left:
        torchplace.load_into(half, path, device_map={"": "cpu"}, strict=False)
    assert (left.value.path, left.value.missing) == (path, ("2.bias",))
    assert torch.equal(half[0].weight, before) and half[2].weight.is_meta
    torch.save({k: v for k, v in model.state_dict().items() if k != "0.bias"}, path)
    target[0].bias = nn.Parameter(model[0].bias.detach().clone())  # given a value first
    with pytest.warns(UserWarning, match=r"strict=False skipped 1 key: the model's 0\.bias") as w:
        loaded = torchplace.load_into(target, path, device_map=disk, strict=False)
    assert [(x.message.missing, x.message.unexpected) for x in w] == [(("0.bias",), ())]
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_a_hooked_model_left_on_meta_by_map_is_refused_by_its_fill_in_that_thread_only(
    tmp_path: Any,
) -> None:
    """A model with a load post-hook may yet fill a tensor the file lacks, so a strict=False
    load by map leaves the refusal to its fill, which raises where it would warn. That was a
    warnings filter, the whole process's: a plain load in another thread at the same moment
    had its own warning raised as an error. It is a context variable now."""
    import re
    import threading
    import warnings

    from torchplace.checkpoint._mismatch import (
        LEFT_ON_META,
        REFUSE_LEFT_ON_META,
        warn_left_on_meta,
    )
    from torchplace.spreading import _load_by_map

    model = mlp(2)
    path = tmp_path / "partial.pt"
    torch.save({k: v for k, v in model.state_dict().items() if k != "0.bias"}, path)
    hooked = torchplace.skeleton(mlp, 2)
    hooked.register_load_state_dict_post_hook(lambda module, keys: None)
    with pytest.raises(
        torchplace.CheckpointError,
        match=LEFT_ON_META + r".*0\.bias.*; with a device_map the load stops here",
    ) as left:
        torchplace.load_into(hooked, path, device_map={"": "cpu"}, strict=False)
    assert (left.value.path, left.value.missing) == (path, ("0.bias",))  # the hook's leftovers
    assert not is_dispatched(hooked)
    assert all(p.is_meta for p in hooked.parameters())  # put back, as for any failed fill

    entered, leave = threading.Event(), threading.Event()
    after: list[object] = []

    def waiting() -> None:  # inside a load by map's fill, in another thread
        entered.set()
        after.append(leave.wait(10))
        warn_left_on_meta("torchplace.load_into left 1 tensor(s) of X on meta")  # still refused

    def refusing() -> None:
        try:
            _load_by_map._left_on_meta_refused(waiting)
        except torchplace.CheckpointError as refused:
            after.append(refused)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # then the other thread's load, entered over it
        other = threading.Thread(target=refusing)
        other.start()
        try:
            assert entered.wait(10)
            plain = torchplace.load_into(torchplace.skeleton(mlp, 2), path, strict=False)
        finally:
            leave.set()
            other.join()
    assert after[0] is True  # the other load was still inside its fill throughout
    assert "the load stops here" in str(after[1])  # and still refused there
    left = [w for w in seen if re.match(LEFT_ON_META, str(w.message))]
    assert len(left) == 1 and len(seen) == 1, [str(w.message) for w in seen]
    assert plain[0].bias.is_meta and torch.equal(plain[0].weight, model[0].weight)

    def interrupted() -> None:  # Ctrl-C inside the fill: this thread is left warning
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _load_by_map._left_on_meta_refused(interrupted)
    assert REFUSE_LEFT_ON_META.get() is False


# --- a load by map reads only what stays resident ------------------------------------------------


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of each read the checkpoint reader makes from now on, in order."""
    from torchplace.checkpoint import _host_read

    read: list[int] = []
    pread = _host_read.pread_exactly

    def counting(fd: int, view: memoryview, offset: int) -> None:
        read.append(view.nbytes)
        pread(fd, view, offset)

    monkeypatch.setattr(_host_read, "pread_exactly", counting)
    return read


@pytest.mark.parametrize("form", ["file", "index", "pt"])
def test_a_load_by_map_reads_no_byte_of_the_disk_modules(
    tmp_path: Any, form: str, bytes_read: list[int]
) -> None:
    """A load by map read the whole checkpoint into memory, the disk modules' layers too (all
    of a 192 MiB file for one resident layer of 16 MiB): now the bytes read from the file are
    those of the resident modules, to the byte, and the disk modules read theirs as they run."""
    from helpers import safetensors_torch, write_shards

    model = mlp(6)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if form == "file":
        path = tmp_path / "m.safetensors"
        safetensors_torch().save_file(sd, str(path))
    elif form == "pt":
        path = tmp_path / "m.pt"
        torch.save(sd, path)
    else:
        path = write_shards(tmp_path, sd)
    disk = {"": "cpu", "2": "disk", "4": "disk"}
    resident = sum(v.nbytes for k, v in sd.items() if not k.startswith(("2.", "4.")))
    loaded = torchplace.load_into(torchplace.skeleton(mlp, 6), path, device_map=disk)
    assert sum(bytes_read) == resident
    bytes_read.clear()
    x = torch.randn(3, 8)
    with torch.no_grad():
        got = loaded(x)
    assert (
        sum(bytes_read)
        == sd["2.weight"].nbytes + sd["2.bias"].nbytes + sd["4.weight"].nbytes + sd["4.bias"].nbytes
    )
    with torch.no_grad():
        assert torch.equal(got, model(x))


_SHIELDED_CHILD = """
import os, random, signal, sys, threading, time
import torch
from torch import nn
import torchplace

def make():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(256, 256) for _ in range(6)))

reference = make()
torch.save(reference.state_dict(), sys.argv[1])
disk = {"": "cpu", "1": "disk", "3": "disk", "4": "disk"}
x = torch.randn(4, 256)
want = reference(x)

def resident(model):
    return [i for i in ("1", "3", "4") if not model.get_submodule(i).weight.is_meta]

def spin():  # Python work while the signal is handled (a covered stretch keeps it)
    end = time.monotonic() + 0.05
    while time.monotonic() < end:
        pass

def sigint(*_):
    os.kill(os.getpid(), signal.SIGINT)
    spin()

for where in ("pre-hook", "post-hook"):
    model = torchplace.skeleton(make)
    hook = (model[3].register_forward_pre_hook if where == "pre-hook"
            else model[3].register_forward_hook)
    handle = hook(sigint)
    model = torchplace.load_into(model, sys.argv[1], device_map=disk)
    with torch.no_grad():
        try:
            model(x)
            print(where, "no interrupt came")
        except KeyboardInterrupt:
            print(where, "interrupted; resident:", resident(model))
        handle.remove()
        print(where, "again:", torch.equal(model(x), want), "; resident:", resident(model))
print("handler put back:", signal.getsignal(signal.SIGINT) is signal.default_int_handler)

# real SIGINTs at random moments of many calls: never a weight left resident
model = torchplace.load_into(torchplace.skeleton(make), sys.argv[1], device_map=disk)
random.seed(0)
landed, left = 0, 0
with torch.no_grad():
    began = time.perf_counter()
    model(x)
    took = time.perf_counter() - began
    for _ in range(int(sys.argv[2])):
        timer = threading.Timer(random.uniform(0, 2 * took),
                                lambda: os.kill(os.getpid(), signal.SIGINT))
        try:
            timer.start()
            model(x)
        except KeyboardInterrupt:
            landed += 1
        while True:  # a signal that comes after the call is taken here, outside the model
            try:
                timer.join()
                spin()
                break
            except KeyboardInterrupt:
                pass
        left += bool(resident(model))
    print("left resident:", left, "; right after:", torch.equal(model(x), want),
          "; some landed inside:", landed > 0)
"""


@pytest.mark.slow  # a subprocess, real signals
def test_ctrl_c_anywhere_around_an_offloaded_forward_leaves_no_weight_resident(
    tmp_path: Any,
) -> None:
    """A SIGINT landing in an offloaded module's own pre-hook or post-hook (after its weights
    came in, where PyTorch runs no always_call hook for a KeyboardInterrupt) left its weights
    resident for good; now it is held until the forward starts, or until they went out, then
    raised. Real signals at random moments of many calls leave none resident either."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _SHIELDED_CHILD, str(tmp_path / "m.pt"), "150"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[:5] == [
        "pre-hook interrupted; resident: []",
        "pre-hook again: True ; resident: []",
        "post-hook interrupted; resident: []",
        "post-hook again: True ; resident: []",
        "handler put back: True",
    ], done.stdout
    assert lines[5].startswith("left resident: 0 ; right after: True"), done.stdout


# --- persistent buffers inside disk modules ----------------------------------------------------


class _Router(nn.Module):
    """A MoE router's shape of state: a weight and a persistent bias buffer it adds."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 8)
        self.register_buffer("e_score_correction_bias", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x) + self.e_score_correction_bias


def _with_buffers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8),
        nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)),
        _Router(),
        nn.Linear(8, 8),
    )


def _trained_buffers() -> nn.Sequential:
    model = _with_buffers()
    model[1][1].running_mean.normal_()
    model[1][1].running_var.uniform_(0.5, 2.0)
    model[1][1].num_batches_tracked.fill_(7)
    model[2].e_score_correction_bias.normal_()
    return model.eval()


_BUFFERED_DISK = {"": "cpu", "1": "disk", "2": "disk"}


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_disk_module_with_persistent_buffers_loads_and_runs_bit_for_bit(
    tmp_path: Any, suffix: str
) -> None:
    """BatchNorm statistics and a router's bias inside disk modules were refused ("the disk
    tier leaves only parameters in the file"): their buffers now live in memory, read with the
    load, and the parameters stay in the file."""
    from helpers import safetensors_torch

    reference = _trained_buffers()
    path = tmp_path / f"m{suffix}"
    if suffix == ".pt":
        torch.save(reference.state_dict(), path)
    else:
        safetensors_torch().save_file(reference.state_dict(), str(path))
    model = torchplace.load_into(
        torchplace.skeleton(_with_buffers), path, device_map=_BUFFERED_DISK
    )
    model.eval()
    assert model[1][0].weight.is_meta and model[2].gate.weight.is_meta  # left in the file
    for name, buffer in reference.named_buffers():
        assert torch.equal(model.get_buffer(name), buffer), name
        assert model.get_buffer(name).dtype == buffer.dtype, name
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    # a real model keeps its buffer objects, written in place
    real = _with_buffers()
    stats = real[1][1].running_mean
    torchplace.load_into(real, path, device_map=_BUFFERED_DISK)
    assert real[1][1].running_mean is stats
    assert torch.equal(stats, reference[1][1].running_mean)


def test_a_disk_modules_buffer_the_file_lacks_is_missing(tmp_path: Any) -> None:
    reference = _trained_buffers()
    state = {k: v for k, v in reference.state_dict().items() if k != "2.e_score_correction_bias"}
    path = tmp_path / "m.pt"
    torch.save(state, path)
    target = torchplace.skeleton(_with_buffers)
    before = {k: (v.device, v) for k, v in target.state_dict(keep_vars=True).items()}
    with pytest.raises(torchplace.CheckpointError, match=r"missing keys: 2\.e_score") as err:
        torchplace.load_into(target, path, device_map=_BUFFERED_DISK)
    assert (err.value.path, err.value.missing) == (path, ("2.e_score_correction_bias",))
    after = {k: (v.device, v) for k, v in target.state_dict(keep_vars=True).items()}
    assert after.keys() == before.keys()
    assert all(after[k][1] is before[k][1] for k in before)  # nothing filled, nothing swapped
    # strict=False: the buffer keeps the value it had (a skeleton's buffers are made real, as
    # its class's __init__ gives them), named in the skipped keys' warning
    for model in (target, _with_buffers()):
        with pytest.warns(UserWarning, match="strict=False skipped 1 key") as w:
            torchplace.load_into(model, path, device_map=_BUFFERED_DISK, strict=False)
        assert [x.message.missing for x in w] == [("2.e_score_correction_bias",)]
        assert not model[2].e_score_correction_bias.any()
        assert torch.equal(model[1][1].running_var, reference[1][1].running_var)


# --- the whole model on disk: {"": "disk"} --------------------------------------------------------


def test_the_whole_model_on_disk_runs_block_by_block(tmp_path: Any, bytes_read: list[int]) -> None:
    """{"": "disk"} was refused ("map the model's parts"), where Accelerate's disk_offload puts
    a whole model on disk: it now means every block on disk, each its own unit, read as it
    runs; nothing is read by the load, and the output is the model's bit for bit."""
    model = mlp(4)
    path = tmp_path / "m.pt"
    torch.save(model.state_dict(), path)
    loaded = torchplace.load_into(torchplace.skeleton(mlp, 4), path, device_map={"": "disk"})
    assert bytes_read == []  # nothing stays resident, so nothing is read
    assert [p for p, _, _ in homes(loaded)] == ["0", "2", "4", "6"]
    assert all(p.is_meta for p in loaded.parameters())
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    with pytest.raises(torchplace.DeviceSpecError, match=r"give \{'': 'disk'\} alone"):
        torchplace.load_into(torchplace.skeleton(mlp, 4), path, device_map={"": "disk", "0": "cpu"})


def _saved_llama(transformers: Any, where: Any) -> tuple[Any, nn.Module]:
    """A tiny untied Llama's config and the model, saved to ``where`` by save_pretrained."""
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(where)
    return config, reference


def test_a_whole_transformers_model_on_disk_is_one_unit_per_decoder_layer(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    config, reference = _saved_llama(transformers, tmp_path)
    skeleton = torchplace.skeleton(transformers.LlamaForCausalLM, config)
    model = torchplace.load_into(skeleton, tmp_path, device_map={"": "disk"}).eval()
    assert [p for p, _, _ in homes(model)] == [
        "model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2",
        "model.norm", "lm_head",
    ]  # fmt: skip
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


_HUNG_READ_CHILD = """
import os, signal, sys, threading, time
import torch
from torch import nn
import torchplace
from torchplace.checkpoint import _disk_weights

def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

torch.save(make().state_dict(), sys.argv[1])
model = torchplace.load_into(torchplace.skeleton(make), sys.argv[1],
                             device_map={"": "cpu", "1": "disk"})
read = _disk_weights.CheckpointWeights.read

def hung(self, device, alloc=None):  # a read that hangs (a stalled network mount)
    time.sleep(30)
    return read(self, device, alloc)

_disk_weights.CheckpointWeights.read = hung
for delay in (0.3, 0.6):
    threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
began = time.monotonic()
with torch.no_grad():
    try:
        model(torch.ones(1, 8))
    except KeyboardInterrupt:
        print("interrupted in time:", time.monotonic() - began < 20)
_disk_weights.CheckpointWeights.read = read
print("on meta:", model[1].weight.is_meta,
      "; handler put back:", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
with torch.no_grad():
    print("again:", torch.equal(model(torch.ones(1, 8)), make()(torch.ones(1, 8))))
"""


@pytest.mark.slow  # a subprocess, real signals
def test_a_second_ctrl_c_interrupts_a_disk_read_that_hangs(tmp_path: Any) -> None:
    """A SIGINT while a disk module's weights are read is held until the read ends; a second
    one (the read hangs) is raised at once, leaving nothing resident and the handler as it
    was (it waited out the read: 6 s for two SIGINTs during 3 s reads)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _HUNG_READ_CHILD, str(tmp_path / "m.pt")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "interrupted in time: True",
        "on meta: True ; handler put back: True",
        "again: True",
    ], done.stdout


def test_a_disk_modules_buffer_of_another_shape_is_refused_untouched(tmp_path: Any) -> None:
    reference = _trained_buffers()
    state = dict(reference.state_dict())
    state["2.e_score_correction_bias"] = torch.zeros(7)
    path = tmp_path / "m.pt"
    torch.save(state, path)
    for strict in (True, False):
        real = _with_buffers()
        kept = real[2].e_score_correction_bias
        with pytest.raises(torchplace.CheckpointError, match="shape mismatches") as err:
            torchplace.load_into(real, path, device_map=_BUFFERED_DISK, strict=strict)
        assert err.value.mismatched == ("2.e_score_correction_bias",)
        assert real[2].e_score_correction_bias is kept and kept.shape == (8,)


class _SharedBuffers(nn.Module):
    """Two disk modules sharing one buffer object, saved once (as a tie is)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Router(), _Router()
        self.b.e_score_correction_bias = self.a.e_score_correction_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_buffer_two_disk_modules_share_is_read_once_from_either_name(tmp_path: Any) -> None:
    from helpers import safetensors_torch

    torch.manual_seed(0)
    reference = _SharedBuffers().eval()
    reference.a.e_score_correction_bias.normal_()
    state = {k: v for k, v in reference.state_dict().items() if k != "b.e_score_correction_bias"}
    path = tmp_path / "m.safetensors"
    safetensors_torch().save_file(state, str(path))
    model = torchplace.load_into(
        torchplace.skeleton(_SharedBuffers), path, device_map={"a": "disk", "b": "disk"}
    )
    assert model.a.e_score_correction_bias is model.b.e_score_correction_bias  # still one
    assert torch.equal(model.b.e_score_correction_bias, reference.a.e_score_correction_bias)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_a_transformers_moe_loaded_by_map_reads_only_its_resident_layers(
    tmp_path: Any, bytes_read: list[int]
) -> None:
    """A Mixtral saved with hub names: its experts fused straight into the model's tensors,
    the disk layers' keys were read whole all the same; now they are not read at all."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, num_local_experts=4, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.MixtralForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    disk = {"": "cpu", "model.layers.1": "disk", "model.layers.2": "disk"}
    on_disk = ("model.layers.1.", "model.layers.2.")
    resident = sum(v.nbytes for k, v in reference.state_dict().items() if not k.startswith(on_disk))
    skeleton = torchplace.skeleton(transformers.MixtralForCausalLM, config)
    model = torchplace.load_into(skeleton, tmp_path, device_map=disk).eval()
    assert sum(bytes_read) == resident
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


class _SeesRequiresGrad(nn.Linear):
    """A layer whose forward records whether its weight requires grad, as kernels that choose
    by it (Mamba's) look."""

    seen: ClassVar[list[bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _SeesRequiresGrad.seen.append(self.weight.requires_grad)
        return super().forward(x)


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_a_disk_modules_weights_require_grad_as_the_model_has_them(
    tmp_path: Any, frozen: bool
) -> None:
    """They came back with requires_grad=False whatever the model said, so a kernel that
    chooses by it ran another path than on the whole model (falcon_mamba, mamba: not bit for
    bit)."""

    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), _SeesRequiresGrad(8, 8))

    torch.save(make().state_dict(), tmp_path / "m.pt")
    model = torchplace.load_into(
        torchplace.skeleton(make), tmp_path / "m.pt", device_map={"": "cpu", "1": "disk"}
    )
    model.requires_grad_(not frozen)
    _SeesRequiresGrad.seen.clear()
    with torch.no_grad():
        model(torch.ones(1, 8))
    assert _SeesRequiresGrad.seen == [not frozen]


# peft calls transformers 5's deprecated is_gradient_checkpointing
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_lora_on_disk_layers_is_refused_then_runs_once_given_values(tmp_path: Any) -> None:
    """PEFT's LoRA over a model with disk layers put the adapter's weights of those layers on
    meta, and logits came out wrong without a word: the first call is refused, naming the
    weight; given values as the message says, the adapted model matches the same adapter on a
    resident model bit for bit. Wrapping a layer inside a disk module (PEFT's LoRA layers hold
    the base layer) raised a raw AttributeError: its weights are found by the module objects."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config, reference = _saved_llama(transformers, tmp_path)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    resident = peft.get_peft_model(reference, lora)
    disk = {"": "cpu", "model.layers.1": "disk", "model.layers.2": "disk"}
    skeleton = torchplace.skeleton(transformers.LlamaForCausalLM, config)
    model = peft.get_peft_model(torchplace.load_into(skeleton, tmp_path, device_map=disk), lora)
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad(), pytest.raises(torchplace.PlacementError, match="lora_A") as err:
        model(ids)
    assert err.value.stragglers[0].name.endswith("layers.1.self_attn.q_proj.lora_A.default.weight")
    values = dict(resident.named_parameters())
    for name, p in list(model.named_parameters()):
        if "lora_" in name and p.is_meta:  # the fix the message gives, then the values
            owner = model.get_submodule(name.rpartition(".")[0])
            owner.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(values[name])
        assert torch.equal(model(ids).logits, resident(ids).logits)


def test_the_whole_model_in_host_memory_runs_block_by_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``{"": "cpu"}`` with an accelerator executing made the whole model one unit: all of it
    on the device at once. Each block is its own unit now, a window of them resident."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchplace.spreading import _dispatch as dispatch_module

    monkeypatch.setattr(dispatch_module, "_device", torch.device)  # fake CUDA, inside the mode
    monkeypatch.setattr(dispatch_module, "_pin", lambda units, execution: None)  # no fake pins
    with FakeTensorMode(), torch.no_grad():
        model = mlp(4)
        torchplace.dispatch(model, {"": "cpu"}, execution_device="cuda:0")
        out = model(torch.empty(2, 8))
    ring = model[0].forward.ring
    assert [unit.path for unit in ring.units] == ["0", "2", "4", "6"]  # each block a unit
    assert {unit.home.tier for unit in ring.units} == {"cpu"} and ring.window == 2
    assert out.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_prefetch_follows_the_order_the_first_call_ran_the_units() -> None:
    """A model that runs its layers out of registration order (here in reverse) had the wrong
    units fetched ahead: each read waited. From the second call on, the unit fetched ahead of
    each one is the one that runs next."""

    class Reversed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in reversed(self.layers):
                x = torch.tanh(layer(x))
            return x

    reference = Reversed()
    model = copy.deepcopy(reference).requires_grad_(False)
    disk = [f"layers.{i}" for i in range(4)]
    on_disk(model, disk)
    transport = FakeTransport()
    torchplace.dispatch(model, {"": "cpu", **dict.fromkeys(disk, "disk")}, _transport=transport)
    x = torch.randn(2, 8)
    with torch.no_grad():
        model(x)
        transport.log.clear()
        assert torch.equal(model(x), reference(x))
    log = transport.log
    runs = list(reversed(disk))
    for now, following in itertools.pairwise(runs):
        assert log.index(("fetch", following)) < log.index(("wait", now)), (now, following)


class _Seeing(nn.Linear):
    """Notes whether its weight, as its forward sees it, is memory of its own (a storage torch
    allocated, resizable) or a view of a buffer it does not own (a mapped file's)."""

    seen: ClassVar[list[bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Seeing.seen.append(not self.weight.untyped_storage().resizable())
        return super().forward(x)


def _seeing() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), _Seeing(8, 8), nn.Tanh(), nn.Linear(8, 8))


def test_mmap_true_maps_the_disk_modules_weights_instead_of_copying_them(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``mmap=True`` a disk module's weights, in the model's dtype, are views of the mapped
    file when it runs (no copy per call, as transformers' disk offload maps its files); a
    weight in another dtype is read by copy as before. Outputs bit for bit either way."""
    from torchplace.checkpoint import _disk_weights

    safetensors_torch = pytest.importorskip("safetensors.torch")
    reference = _seeing()
    safetensors_torch.save_file(reference.state_dict(), str(tmp_path / "m.safetensors"))
    device_map = {"": "cpu", "2": "disk", "4": "disk"}
    model = torchplace.load_into(
        torchplace.skeleton(_seeing), tmp_path / "m.safetensors", device_map=device_map, mmap=True
    )
    copies: list[str] = []
    real = _disk_weights.read_entries
    monkeypatch.setattr(
        _disk_weights, "read_entries", lambda *a, **k: copies.append("read") or real(*a, **k)
    )
    x = torch.randn(3, 8)
    _Seeing.seen.clear()
    with torch.no_grad():
        want = reference(x)
        _Seeing.seen.clear()
        assert torch.equal(model(x), want)
    assert copies == [] and _Seeing.seen == [True]  # a view of the file, no copy of its own
    assert model[2].weight.is_meta
    model.double()  # the model's dtype differs from the file's now: read by copy
    _Seeing.seen.clear()
    with torch.no_grad():
        assert torch.equal(model(x.double()), reference.double()(x.double()))
    assert copies == ["read", "read"] and _Seeing.seen[0] is False


def _rss_file() -> int:
    """The process's resident file-backed bytes (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_mmap_true_hands_back_each_inner_modules_pages_as_it_returns(tmp_path: Any) -> None:
    """A mapped disk unit kept every page its call touched until the call ended: a whole
    layer's weights at once, where transformers' hooks hold one module's (its peak was 14%
    under ours). Each module inside the unit now hands its pages back as it returns, so when
    the second Linear starts the first's 16 MiB are out of the resident set; outputs stay bit
    for bit, a second call included (the pages fault in again from the page cache)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")

    def block() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Sequential(nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 2048)))

    reference = block()
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file(reference.state_dict(), str(path))
    model = torchplace.load_into(
        torchplace.skeleton(block), path, device_map={"": "cpu", "0": "disk"}, mmap=True
    )
    grown: list[int] = []
    model[0][2].register_forward_pre_hook(lambda *_: grown.append(_rss_file() - before))
    x = torch.randn(3, 2048)
    with torch.no_grad():
        want = reference(x)
        for _ in range(2):
            before = _rss_file()
            assert torch.equal(model(x), want)
    first = 2048 * 2048 * 4
    assert len(grown) == 2 and all(g < first // 2 for g in grown), grown


class _Clamped(nn.Module):
    """Constrains its Linear's weight in place, then runs the Linear twice in one call."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2048, 4)  # a 32 KiB weight: 8 whole pages

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.a.weight.clamp_(min=0)
        return torch.stack([self.a(x), self.a(x)])


def test_a_mapped_weight_changed_in_place_keeps_its_change_for_the_call(tmp_path: Any) -> None:
    """Pages handed back as a module returned dropped a write to its mapped weight (the
    copy-on-write page held it): the second use in the same call read the file's bytes again.
    A weight written in place keeps its pages until the call ends, as a copy keeps its change."""
    safetensors_torch = pytest.importorskip("safetensors.torch")

    def block() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(_Clamped())

    reference = block()
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file(reference.state_dict(), str(path))
    x = torch.randn(1, 2048)
    with torch.no_grad():
        want = copy.deepcopy(reference)(x)
        for mmap in (False, True):
            model = torchplace.load_into(
                torchplace.skeleton(block), path, device_map={"": "cpu", "0": "disk"}, mmap=mmap
            )
            assert torch.equal(model(x), want), mmap


def test_a_mapped_disk_module_raises_when_its_checkpoint_is_rewritten(tmp_path: Any) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    reference = mlp(2)
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file(reference.state_dict(), str(path))
    model = torchplace.load_into(
        torchplace.skeleton(mlp, 2), path, device_map={"": "cpu", "2": "disk"}, mmap=True
    )
    with torch.no_grad():
        model(torch.ones(1, 8))
        safetensors_torch.save_file(
            {k: v + 1 for k, v in reference.state_dict().items()}, str(path)
        )
        with pytest.raises(torchplace.CheckpointError, match=r"changed since the model was loaded"):
            model(torch.ones(1, 8))
    assert model[2].weight.is_meta


def test_a_layer_called_alone_first_does_not_fix_a_wrong_prefetch_order() -> None:
    """The order was learned from the first units to run, for good: a layer called alone
    before the model left every later call fetching the wrong units ahead. A unit that runs
    out of the learned order has it learned again."""
    reference = mlp(4)
    model = copy.deepcopy(reference).requires_grad_(False)
    disk = ["0", "2", "4", "6"]
    on_disk(model, disk)
    transport = FakeTransport()
    torchplace.dispatch(model, {"": "cpu", **dict.fromkeys(disk, "disk")}, _transport=transport)
    x = torch.randn(2, 8)
    with torch.no_grad():
        model[4](x)  # alone, before the model
        model(x)
        model(x)
        transport.log.clear()
        assert torch.equal(model(x), reference(x))
    log = transport.log
    for now, following in itertools.pairwise(disk):
        assert log.index(("fetch", following)) < log.index(("wait", now)), (now, following)


def test_a_module_shared_by_two_disk_units_is_refused(tmp_path: Any) -> None:
    """One block object reached under two names (as Zamba shares a block), each name in a disk
    entry of its own: each unit brought its weights in and out under the other's call, and the
    outputs came out wrong. The map is refused, naming both."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            self.b = nn.Sequential(self.a[0], nn.Tanh())  # the same Linear under b.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    torch.save(Shared().state_dict(), tmp_path / "s.pt")
    with pytest.raises(torchplace.DeviceSpecError, match=r"model\.a\.0 and model\.b\.0 are one"):
        torchplace.load_into(
            torchplace.skeleton(Shared), tmp_path / "s.pt", device_map={"a": "disk", "b": "disk"}
        )


def test_a_shared_module_without_weights_across_disk_units_is_fine(tmp_path: Any) -> None:
    """GPT's one activation module shared by every layer: no weights, nothing to bring in."""

    class SharedAct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            act = nn.Tanh()
            self.a = nn.Sequential(nn.Linear(8, 8), act)
            self.b = nn.Sequential(nn.Linear(8, 8), act)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    reference = SharedAct()
    torch.save(reference.state_dict(), tmp_path / "s.pt")
    model = torchplace.load_into(
        torchplace.skeleton(SharedAct), tmp_path / "s.pt", device_map={"a": "disk", "b": "disk"}
    )
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


class _Leaky(nn.Linear):
    """Returns a view of its own weight beside its output (as a model keeping a weight's slice)."""

    def forward(self, x: torch.Tensor) -> Any:
        return super().forward(x), self.weight[0]


def test_disk_reads_on_the_cpu_reuse_one_host_buffer_but_never_one_still_viewed(
    tmp_path: Any,
) -> None:
    """Each call's read went into fresh memory, given back to the system after the call and
    faulted in again by the next (half the time per token of an all-disk decode). The reads
    reuse a kept buffer now; a buffer a tensor still views (a module returned a view of its
    weight) is never handed out again, so what the caller holds keeps its values."""

    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), _Leaky(8, 8))

    reference = make()
    torch.save(reference.state_dict(), tmp_path / "m.pt")
    model = torchplace.load_into(
        torchplace.skeleton(make), tmp_path / "m.pt", device_map={"": "cpu", "1": "disk"}
    )
    buffers = model[1].forward.ring.transport.buffers
    x = torch.randn(2, 8)
    with torch.no_grad():
        out, row = model(x)
        first = [b.data_ptr() for b in buffers.kept]
        held = row.clone()
        model(x)  # the first buffer is still viewed by ``row``: not reused
        assert torch.equal(row, held) and len(buffers.kept) == 2
        del out, row
        model(x)
        again = [b.data_ptr() for b in buffers.kept]
        assert torch.equal(model(x)[0], reference(x)[0])
    assert first[0] in again and len(again) == 2  # reused, nothing more allocated
