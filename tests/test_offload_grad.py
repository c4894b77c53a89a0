"""Offloaded modules under gradients, and called the ways real models call them.

Before, a call with gradients on was refused ("inference only"), ``layer.forward(...)`` called
directly met the ``meta`` placeholders, and so did a child of an offloaded module called on its
own. Each test here failed then.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchplace


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """Calls its blocks the ways models do: through ``__call__``, through ``.forward`` (as
    squeezebert and mobilebert do), and a block's child on its own."""

    def __init__(self, how: str = "call") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 3)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            if self.how == "forward":
                x = block.forward(x)
            elif self.how == "child":
                x = x + block.down(torch.tanh(block.up(x)))
            else:
                x = block(x)
        return self.head(x)


DISK = {"": "cpu", "blocks.1": "disk", "blocks.2": "disk", "blocks.3": "disk"}


def loaded(tmp_path: Path, how: str = "call", frozen: bool = False) -> tuple[Net, Net]:
    reference = Net(how).eval()
    torch.save(reference.state_dict(), tmp_path / "net.pt")
    model = torchplace.load_into(
        torchplace.skeleton(Net, how), tmp_path / "net.pt", device_map=DISK
    )
    if frozen:
        for m in (reference, model):
            m.blocks.requires_grad_(False)
    return reference, model


@pytest.mark.parametrize("how", ["call", "forward", "child"])
def test_blocks_called_any_way_get_their_weights(tmp_path: Path, how: str) -> None:
    reference, model = loaded(tmp_path, how)
    x = torch.randn(5, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert all(p.is_meta for b in model.blocks[1:] for p in b.parameters())


def test_a_layer_forward_called_alone_reads_and_lets_go(tmp_path: Path) -> None:
    reference, model = loaded(tmp_path)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model.blocks[2].forward(x), reference.blocks[2].forward(x))
        assert torch.equal(model.blocks[2].up(x), reference.blocks[2].up(x))
    assert model.blocks[2].up.weight.is_meta


@pytest.mark.parametrize("how", ["call", "forward", "child"])
def test_gradients_through_disk_blocks_equal_the_resident_models(tmp_path: Path, how: str) -> None:
    """Frozen disk blocks, trainable resident input and head: the same gradients bit for bit,
    and two optimizer steps give the same weights."""
    reference, model = loaded(tmp_path, how, frozen=True)
    opts = [
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
        for m in (reference, model)
    ]
    for step in range(2):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        for m, opt in zip((reference, model), opts, strict=True):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        for name in ("inp.weight", "inp.bias", "head.weight", "head.bias"):
            got, want = model.get_parameter(name), reference.get_parameter(name)
            assert torch.equal(got.grad, want.grad), name
            assert torch.equal(got, want), name
    assert all(p.is_meta and p.grad is None for b in model.blocks[1:] for p in b.parameters())


def test_autograd_keeps_no_offloaded_weight_between_forward_and_backward(tmp_path: Path) -> None:
    """What autograd saves of an offloaded weight is a reference: an outer saved-tensor hook
    (around the whole call) sees every tensor the graph keeps that the unit's own hooks did not
    take, and none of them shares memory with a weight read for a disk block; backward reads
    the blocks again, and gives them back when it ends."""
    _, model = loaded(tmp_path, frozen=True)
    ring = model.blocks[1].forward.ring
    fetched: set[int] = set()  # the storages read for the disk blocks
    transport = ring.transport
    ready = transport.ready

    def watching(item: Any) -> list[torch.Tensor]:
        tensors = ready(item)
        fetched.update(t.untyped_storage().data_ptr() for t in tensors)
        return tensors

    transport.ready = watching
    kept: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(torch.randn(3, 8))
    assert fetched and kept, "nothing was read, or nothing saved"
    assert not fetched & set(kept), "the graph keeps a weight read for a disk block"
    reads = len(fetched)
    out.sum().backward()
    assert len(fetched) > reads, "backward did not read the blocks again"
    assert not ring.again


def test_with_saved_tensor_hooks_turned_off_a_call_with_gradients_still_runs(
    tmp_path: Path,
) -> None:
    """Under ``disable_saved_tensors_hooks`` the unit's hooks cannot be set: autograd keeps the
    weights as it would for a resident model, and the gradients are the same."""
    reference, model = loaded(tmp_path, frozen=True)
    x = torch.randn(3, 8)
    with torch.autograd.graph.disable_saved_tensors_hooks("a library's own reason"):
        model(x).sum().backward()
    reference(x).sum().backward()
    assert torch.equal(model.inp.weight.grad, reference.inp.weight.grad)


def test_hooks_of_an_offloaded_module_see_its_weights(tmp_path: Path) -> None:
    """The weights came in inside forward, so the module's own forward pre-hooks and hooks saw
    the placeholders (``weight_norm`` computes its weight in a pre-hook: silently wrong outputs
    on the CPU). They come in before the module's hooks run and go out after."""

    def make() -> nn.Sequential:
        torch.manual_seed(0)
        with pytest.warns(FutureWarning):
            normed = nn.utils.weight_norm(nn.Linear(8, 8))
        return nn.Sequential(nn.Linear(8, 8), normed, nn.Linear(8, 2))

    reference = make()
    torch.save(reference.state_dict(), tmp_path / "m.pt")
    model = torchplace.load_into(
        torchplace.skeleton(make), tmp_path / "m.pt", device_map={"": "cpu", "1": "disk"}
    )
    seen: list[str] = []
    model[1].register_forward_pre_hook(lambda m, a: seen.append(m.weight_v.device.type))
    model[1].register_forward_hook(lambda m, a, o: seen.append(m.weight_g.device.type))
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert seen == ["cpu", "cpu"] and model[1].weight_v.is_meta


def test_fetched_under_inference_mode_the_weights_serve_a_later_call_with_gradients(
    tmp_path: Path,
) -> None:
    """Weights read under ``inference_mode`` were inference tensors: a later call with
    gradients could not save them for backward. They are read as plain tensors now."""
    reference, model = loaded(tmp_path, frozen=True)
    x = torch.randn(3, 8)
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
    model(x).sum().backward()
    reference(x).sum().backward()
    assert torch.equal(model.inp.weight.grad, reference.inp.weight.grad)


def test_backward_into_an_offloaded_weight_that_requires_grad_names_it(tmp_path: Path) -> None:
    _, model = loaded(tmp_path)
    out = model(torch.randn(3, 8))
    with pytest.raises(
        torchplace.TorchplaceError,
        match=r"model\.blocks\.3\.\w+\.(weight|bias) is offloaded.*Freeze",
    ):
        out.sum().backward()
    assert all(p.is_meta for b in model.blocks[1:] for p in b.parameters())


def test_activation_checkpointing_around_a_disk_block_still_recomputes(tmp_path: Path) -> None:
    """torch.utils.checkpoint around an offloaded block: its hooks still see the activations
    (ours defer to them), the block runs again at backward, and the gradients are equal."""
    from torch.utils.checkpoint import checkpoint

    from torchplace.spreading._through import outer_hooks

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        if outer_hooks() is None:  # torch 2.6 cannot say (2.13 can)
            pytest.skip("this torch cannot tell the saved-tensor hooks around a call")
    reference, model = loaded(tmp_path, frozen=True)
    calls = {"n": 0}
    inner = model.blocks[2].forward

    def counting(*args: Any) -> Any:
        calls["n"] += 1
        return inner(*args)

    x = torch.randn(3, 8)
    for m in (reference, model):
        h = m.blocks[0](m.inp(x))
        run = counting if m is model else m.blocks[2].forward
        h = checkpoint(run, m.blocks[1](h), use_reentrant=False)
        m.head(m.blocks[3](h)).sum().backward()
    assert calls["n"] == 2, "the checkpointed block was not recomputed at backward"
    assert torch.equal(model.inp.weight.grad, reference.inp.weight.grad)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_lora_on_resident_layers_trains_through_disk_layers(tmp_path: Path) -> None:
    """PEFT LoRA on the resident layers of a model whose other layers are on disk: training
    steps equal those on the resident model, bit for bit; the base stays frozen and offloaded."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).eval()
    base.save_pretrained(tmp_path / "base")
    disk = {"": "cpu", "model.layers.2": "disk", "model.layers.3": "disk"}
    skeleton = torchplace.skeleton(transformers.LlamaForCausalLM, config)
    offloaded = torchplace.load_into(skeleton, tmp_path / "base", device_map=disk)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], layers_to_transform=[0, 1])
    models = []
    for m in (copy.deepcopy(base), offloaded):
        torch.manual_seed(1)
        models.append(peft.get_peft_model(m, lora))
    opts = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in models
    ]
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        losses = []
        for m, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1])
    want = dict(models[0].named_parameters())
    trained = [(n, p) for n, p in models[1].named_parameters() if p.requires_grad]
    assert trained and all(torch.equal(p, want[n]) for n, p in trained)
    assert offloaded.model.layers[3].mlp.up_proj.weight.is_meta


def test_squeezebert_calling_its_layers_forward_runs_with_layers_on_disk(tmp_path: Path) -> None:
    """squeezebert's encoder calls ``layer.forward(...)``: with its second layer on disk the
    call met the placeholders; now the output is the resident model's, bit for bit."""
    transformers = pytest.importorskip("transformers")
    config = transformers.SqueezeBertConfig(
        vocab_size=50,
        hidden_size=32,
        embedding_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        q_groups=1,
        k_groups=1,
        v_groups=1,
        post_attention_groups=1,
        intermediate_groups=1,
        output_groups=1,
    )
    torch.manual_seed(0)
    model = transformers.SqueezeBertModel(config).eval()
    model.save_pretrained(tmp_path)
    loaded = torchplace.load_into(
        torchplace.skeleton(transformers.SqueezeBertModel, config),
        tmp_path,
        device_map={"": "cpu", "encoder.layers.1": "disk"},
    ).eval()
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).last_hidden_state
        assert torch.equal(loaded(input_ids=ids).last_hidden_state, want)
    assert all(p.is_meta for p in loaded.encoder.layers[1].parameters())


_INTERRUPTED_TRAINING = """
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
model = torchplace.load_into(torchplace.skeleton(make), sys.argv[1], device_map=disk)
for m in (model, reference):
    for i in (1, 3, 4):
        m[i].requires_grad_(False)
x = torch.randn(4, 256)
reference(x).square().sum().backward()
want = reference[0].weight.grad.clone()
ring = model[1].forward.ring

def step():
    model.zero_grad()
    model(x).square().sum().backward()

def resident():
    return [i for i in ("1", "3", "4") if not model.get_submodule(i).weight.is_meta]

random.seed(0)
times = []
for _ in range(3):  # warm steps: the first is slower, and timers past the step land nowhere
    began = time.perf_counter()
    step()
    times.append(time.perf_counter() - began)
took = min(times)
landed = left = 0
for _ in range(int(sys.argv[2])):
    when = random.uniform(0, took)
    timer = threading.Timer(when, lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        timer.start()
        step()
    except KeyboardInterrupt:
        landed += 1
    while True:  # a signal after the step is taken here
        try:
            timer.join()
            time.sleep(0.01)
            break
        except KeyboardInterrupt:
            pass
    left += bool(resident())
step()
print("left resident:", left, "; right after:", torch.equal(model[0].weight.grad, want),
      "; kept by backward:", len(ring.again), "; some landed:", landed > 0)
"""


@pytest.mark.slow  # a subprocess, real signals
def test_ctrl_c_during_training_through_disk_layers_leaves_nothing_resident(
    tmp_path: Path,
) -> None:
    """Real SIGINTs at random moments of forward and backward with disk layers: no weight stays
    in a module, backward's fetched units are given back, and the next step is right."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_TRAINING, str(tmp_path / "m.pt"), "120"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.splitlines()[-1]
    assert (
        last == "left resident: 0 ; right after: True ; kept by backward: 0 ; some landed: True"
    ), done.stdout
