"""plan: budgets and device maps, on skeletons and fake CUDA devices, touching no device."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import torchplace
import torchplace.spreading._plan as plan_module
from torchplace import _sizes
from torchplace._errors import DeviceSpecError, TorchplaceError
from torchplace.looking._estimate import estimate
from torchplace.spreading._budgets import OPEN
from torchplace.spreading._dispatch import dispatch
from torchplace.spreading._load_by_map import load_into
from torchplace.spreading._plan import plan
from toy_models import CPU, CUDA0, CUDA1, LINEAR_BYTES, META, Block, Net, TiedLM, on_fake_cuda


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


KINDS = ["skeleton", "fake-cuda"]


def built(kind: str, factory: Callable[..., nn.Module], **kwargs: Any) -> nn.Module:
    """The model as a skeleton (parameters on meta) or with fake parameters on cuda:0."""
    model = factory(device="meta", **kwargs)
    return model if kind == "skeleton" else on_fake_cuda(model, {"": "cuda:0"})


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
    assert _sizes.parse_size(text, "here") == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("10G", r"max_memory\['cpu'\].*'10GiB'.*'10GB'"),
        ("ten", r"max_memory\['cpu'\]: cannot read the size 'ten'"),
        ("5 parsecs", r"cannot read the size"),
        (-1, r"the budget -1 is negative"),
        ("-5", r"the budget '-5' is negative"),
        ("-2GiB", r"the budget '-2GiB' is negative"),
        (-2.0, r"the budget -2.0 is negative"),
        (1.5, r"1.5 is not a whole number of bytes"),
        (float("inf"), r"cannot read the size inf"),
        (True, r"not True"),
        (None, r"cannot read the size None"),
    ],
)
def test_malformed_sizes_name_the_entry(value: object, message: str) -> None:
    with pytest.raises(DeviceSpecError, match=message):
        plan(nn.Linear(2, 2), {"cpu": value})  # type: ignore[dict-item]


def test_any_integral_or_whole_real_budget_is_bytes() -> None:
    np = pytest.importorskip("numpy")
    # Budgets computed with numpy or torch (a fraction of total memory) are integers too.
    for budget in (np.int64(10**9), np.uint32(10**9), torch.tensor(10**9), 1e9, np.float32(1e9)):
        assert _sizes.parse_size(budget, "here") == 10**9, repr(budget)
    assert plan(nn.Linear(2, 2), {"cpu": np.int64(10**9)}) == {"": CPU}


@pytest.mark.parametrize(
    ("budgets", "message"),
    [
        ({"cdua:0": "1GiB"}, r"unknown device 'cdua:0'; did you mean 'cuda'"),
        ({"gpu": "1GiB"}, r"'gpu'.*named device such as 'cuda:0'"),
        ({"auto": "1GiB"}, r"one named device.*pass max_memory='auto'"),
        ({"dsik": "1GiB"}, r"unknown device 'dsik'.*'disk'"),
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
    assert list(device_map) == ["0", "1", "2", "3", "4"]  # registration order
    assert all(p.device == META for p in model.parameters())  # the model is untouched


@pytest.mark.fake_cuda
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


class Head(nn.Module):
    """A model whose head is registered first but runs last."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.head = nn.Linear(16, 16, device=device)
        self.body = nn.Sequential(*(nn.Linear(16, 16, device=device) for _ in range(2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_plan_takes_submodules_in_registration_order_not_running_order() -> None:
    # plan never runs the model: the head, registered first, fills cuda:0 first although
    # forward calls it last. The map is still a valid one for dispatch.
    device_map = plan(Head(device="meta"), {"cuda:0": LINEAR_BYTES, "cuda:1": "1MiB"})
    assert device_map == {"head": CUDA0, "body": CUDA1}
    assert list(device_map) == ["head", "body"]


class SpecialBlock(Block):
    """A subclass of Block: a class entry in no_split covers it, the name 'Block' does not."""


def test_plan_class_entries_in_no_split_match_by_class_and_subclass() -> None:
    model = Net(blocks=2, device="meta")
    model.blocks[1] = SpecialBlock(device="meta")
    embed_bytes = (8 * 16 + 16) * 4
    budgets = {"cuda:0": embed_bytes + 3 * LINEAR_BYTES, "cuda:1": "1MiB"}
    assert plan(model, budgets)["blocks.1.b"] == CUDA1  # split by default
    # The class keeps its subclass whole; its name matches only modules of exactly that class.
    assert plan(model, budgets, no_split=[Block])["blocks.1"] == CUDA1
    assert plan(model, budgets, no_split=["Block"])["blocks.1.b"] == CUDA1
    head_bytes = (16 * 4 + 4) * 4
    tight = {"cuda:0": embed_bytes + 3 * LINEAR_BYTES, "cpu": LINEAR_BYTES + head_bytes + 10}
    with pytest.raises(TorchplaceError, match=r"SpecialBlock is a Block, in no_split.*take Block"):
        plan(model, tight, no_split=[Block])


def test_plan_refuses_a_class_that_only_shares_its_name_with_the_models() -> None:
    namesake = type("Block", (nn.Module,), {})  # another class that happens to share the name
    # Matched by name, it kept the real Block whole; it is refused, naming both classes.
    with pytest.raises(TorchplaceError, match=r"not the model's toy_models.Block.*name 'Block'"):
        plan(Net(device="meta"), {"cpu": "1GiB"}, no_split=[namesake])
    with pytest.raises(TorchplaceError, match=r"neither a module class nor a class name"):
        plan(Net(device="meta"), {"cpu": "1GiB"}, no_split=[int])
    with pytest.raises(TorchplaceError, match=r"neither a module class nor a class name"):
        plan(Net(device="meta"), {"cpu": "1GiB"}, no_split=[3])  # type: ignore[list-item]


@pytest.mark.fake_cuda
def test_plan_ignores_no_split_entries_the_model_lacks() -> None:
    # One list for several model families, as Accelerate takes it: absent entries are ignored
    # (no warning) and the present ones still keep their modules whole.
    budgets = {"cuda:0": "2KiB", "cuda:1": "1GiB"}
    assert "blocks.0.a" in plan(Net(device="meta"), budgets)  # Block splits without no_split
    for no_split in (["Conv2d", "Block"], [nn.Conv2d, Block], ["Blok", Block]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            device_map = plan(Net(device="meta"), budgets, no_split=no_split)
        assert not any(name.startswith("blocks.0.") for name in device_map), device_map


def test_plan_warns_when_no_no_split_entry_is_in_the_model() -> None:
    with pytest.warns(UserWarning, match=r"'Blok' \(did you mean 'Block'\?\).*classes present"):
        device_map = plan(Net(device="meta"), {"cpu": "1GiB"}, no_split=["Blok", nn.Conv2d])
    assert device_map == {"": torch.device("cpu")}


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16, device="meta"), nn.Linear(16, 16, device="meta")


class _Pretrained(nn.Module):
    """Declares the classes it keeps whole, as a transformers PreTrainedModel does."""

    _no_split_modules: ClassVar[list[str]] = ["_Layer"]

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(3))


@pytest.mark.fake_cuda
def test_plan_no_split_auto_reads_the_models_no_split_modules() -> None:
    budgets = {"cuda:0": 3 * LINEAR_BYTES, "cuda:1": "1GiB"}  # room for 1.5 layers
    split = plan(_Pretrained(), budgets)
    assert "layers.1.a" in split, split
    whole = plan(_Pretrained(), budgets, no_split="auto")
    assert whole == {"layers.0": CUDA0, "layers.1": CUDA1, "layers.2": CUDA1}
    with pytest.raises(TorchplaceError, match=r"no_split='auto'.*_no_split_modules.*Net"):
        plan(Net(device="meta"), {"cpu": "1GiB"}, no_split="auto")


@pytest.mark.fake_cuda
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


@pytest.mark.parametrize(
    ("cpu", "tier"),
    [(32 * 16 * 4 + 1024, CPU), (1024, "disk"), (0, "disk")],
    ids=["room-on-the-cpu", "disk-if-need-be", "all-on-disk"],
)
def test_plan_keeps_a_tie_together_on_one_tier_the_disk_included(
    tmp_path: Any, cpu: int, tier: Any
) -> None:
    """A tied embedding and head go together, to the cpu where it has room, else to the disk
    (each holder reads the tensor from the file): plan refused with a 1 TB disk budget."""
    torch.manual_seed(0)
    whole = TiedLM().eval()
    torch.save(whole.state_dict(), tmp_path / "lm.pt")
    device_map = plan(TiedLM(device="meta"), {"cpu": cpu, "disk": "1TB"})
    assert _tier("embed", device_map) == _tier("lm_head", device_map) == tier
    assert "disk" in device_map.values()
    model = torchplace.load_into(
        torchplace.skeleton(TiedLM), tmp_path / "lm.pt", device_map=device_map
    )
    tokens = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model(tokens), whole(tokens))


def test_load_into_refuses_a_tie_split_between_the_disk_and_memory(tmp_path: Any) -> None:
    torch.manual_seed(0)
    torch.save(TiedLM().state_dict(), tmp_path / "lm.pt")
    with pytest.raises(
        DeviceSpecError,
        match=r"model\.lm_head\.weight is tied to model\.embed\.weight, and the device_map puts "
        r"model\.lm_head on 'disk' but model\.embed in memory.*or 'embed' to 'disk' too",
    ):
        load_into(torchplace.skeleton(TiedLM), tmp_path / "lm.pt",
                  device_map={"": "cpu", "lm_head": "disk"})  # fmt: skip


@pytest.mark.slow  # imports transformers' Llama, saves it and loads it twice: ~5 s
def test_a_tied_llama_saved_once_runs_with_its_embedding_and_head_on_disk(tmp_path: Any) -> None:
    """transformers saves a tied head once, under the embedding's name: the head on disk reads
    that key."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    resident = transformers.LlamaForCausalLM(config).eval()
    resident.save_pretrained(tmp_path)
    assert "lm_head.weight" not in torchplace.load(tmp_path, "meta")  # the premise
    ids = torch.arange(16).reshape(2, 8)
    with torch.no_grad():
        expected = resident(ids).logits
    embed = 512 * 32 * 4
    for cpu in (0, embed // 2):  # the tie cannot stay in memory
        device_map = plan(resident, {"cpu": cpu, "disk": "1TB"}, no_split="auto")
        assert _tier("model.embed_tokens", device_map) == _tier("lm_head", device_map) == "disk"
        model = torchplace.skeleton(transformers.LlamaForCausalLM, config).eval()
        load_into(model, tmp_path, device_map=device_map)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected), device_map


@pytest.mark.parametrize("kind", KINDS)
def test_plan_model_larger_than_all_budgets_reports_the_shortfall(kind: str) -> None:
    model = built(kind, Net)
    total = estimate(model, optimizer=None, grads=False).total
    with pytest.raises(TorchplaceError, match=r"budgets hold 2.0 KiB .*short") as info:
        plan(model, {"cuda:0": "1KiB", "cpu": "1KiB"})
    assert plan_module._format_bytes(total - 2048) in str(info.value)
    # The cpu is budgeted already: the advice is to raise its budget, not to add it.
    assert "add a device" not in str(info.value)
    assert "the cpu's, if the machine has the memory" in str(info.value)
    with pytest.raises(TorchplaceError, match=r"add a device \(for example 'cpu'\)"):
        plan(model, {"cuda:0": "1KiB", "cuda:1": "1KiB"})


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


@pytest.mark.parametrize(
    ("spelling", "dtype"),
    [
        ("bf16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("fp32", torch.float32),
        ("float", torch.float32),
        ("torch.bfloat16", torch.bfloat16),
        ("double", torch.float64),
    ],
)
def test_plan_takes_every_dtype_spelling_the_command_line_takes(
    spelling: str, dtype: torch.dtype
) -> None:
    """``plan(dtype=...)`` takes what ``torchplace estimate --dtype`` takes (it refused 'bf16'),
    and plans as for the dtype itself."""
    from torchplace.cli._estimate import _dtype as cli_dtype

    assert cli_dtype(spelling) is dtype
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    budget = {"cuda:0": 64 * 64 * 2 + 64 * 2 + 8, "cpu": "1GiB"}  # one layer in 16 bits
    assert plan(model, budget, dtype=spelling) == plan(model, budget, dtype=dtype)


def test_plan_takes_an_integer_dtype_by_name_as_by_itself() -> None:
    """8-bit weights are sized by dtype=torch.int8 and by 'int8' alike (the command line's
    --dtype takes floating dtypes only: a step's dtype)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    budget = {"cuda:0": 64 * 64 + 64 + 8, "cpu": "1GiB"}  # one layer in 8 bits
    assert plan(model, budget, dtype="int8") == plan(model, budget, dtype=torch.int8)
    with pytest.raises(DeviceSpecError, match=r"dtype='int9' is not a torch dtype") as err:
        plan(model, budget, dtype="int9")
    assert "'bf16'" in str(err.value)


# --- plan: budgets read from the machine (max_memory="auto") ----------------------------------

GiB = 2**30


@contextlib.contextmanager
def machine(
    free: list[int], host: int | None, *, nvml: bool = False
) -> Iterator[pytest.MonkeyPatch]:
    """A machine with len(free) fake GPUs having these free bytes (read by NVML or, as on
    ROCm, by mem_get_info) and ``host`` bytes of available host memory; creating a CUDA
    context (torch.cuda._lazy_init) fails the test."""
    import torchplace._devices as devices_module
    import torchplace.spreading._budgets as budgets_module

    def lazy_init() -> None:
        raise AssertionError("plan created a CUDA context")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: bool(free))
        patch.setattr(torch.cuda, "device_count", lambda: len(free))
        patch.setattr(torch.cuda, "_lazy_init", lazy_init)
        patch.setattr(
            devices_module, "_nvml_free_memory", (lambda i: free[i]) if nvml else (lambda i: None)
        )
        if nvml:
            patch.setattr(torch.cuda, "mem_get_info", lambda i: pytest.fail("mem_get_info read"))
        else:
            patch.setattr(torch.cuda, "mem_get_info", lambda i: (free[i], 80 * GiB))
        patch.setattr(budgets_module, "host_available", lambda: host)
        yield patch


def _layers(count: int, width: int = 16) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(width, width, device="meta") for _ in range(count)))


@pytest.mark.fake_cuda
@pytest.mark.parametrize("nvml", [True, False])
def test_plan_auto_budgets_are_free_memory_less_a_tenth(nvml: bool) -> None:
    free = [40 * LINEAR_BYTES, 20 * LINEAR_BYTES]  # a tenth of each is a whole number of bytes
    with machine(free, host=100 * LINEAR_BYTES, nvml=nvml):
        device_map = plan(_layers(60))
        fake = plan(on_fake_cuda(_layers(60), {"": "cuda:1"}))
    # 36 layers fit in 90% of cuda:0, 18 in 90% of cuda:1, the last 6 go to the host.
    expected = {str(i): CUDA0 for i in range(36)}
    expected.update({str(i): CUDA1 for i in range(36, 54)})
    expected.update({str(i): CPU for i in range(54, 60)})
    assert device_map == expected == fake
    assert type(device_map) is not dict and isinstance(device_map, dict)
    assert device_map.budgets == {CUDA0: 36 * LINEAR_BYTES, CUDA1: 18 * LINEAR_BYTES,
                                  CPU: 90 * LINEAR_BYTES, "disk": OPEN}  # fmt: skip
    assert {d: h.bytes for d, h in device_map.headroom.items()} == {
        CUDA0: 4 * LINEAR_BYTES,
        CUDA1: 2 * LINEAR_BYTES,
        CPU: 10 * LINEAR_BYTES,
        "disk": 0,
    }
    assert device_map.headroom[CUDA0].how.startswith("10% of the free memory")
    assert "no example_input" in device_map.headroom[CUDA1].how
    assert "process" in device_map.headroom[CPU].how  # the host runs nothing here


def test_plan_auto_without_an_accelerator_keeps_the_hosts_room_for_activations() -> None:
    with machine([], host=50 * LINEAR_BYTES):
        device_map = plan(_layers(3))
    assert device_map == {"": CPU}
    assert device_map.budgets == {CPU: 45 * LINEAR_BYTES, "disk": OPEN}
    assert device_map.headroom[CPU].bytes == 5 * LINEAR_BYTES
    assert "kept for activations" in device_map.headroom[CPU].how


def test_plan_auto_says_when_no_memory_can_be_read() -> None:
    with machine([], host=None), pytest.raises(TorchplaceError, match=r"'auto' could read the"):
        plan(_layers(3))


def test_plan_auto_leaves_out_a_host_it_cannot_read() -> None:
    with machine([10 * LINEAR_BYTES], host=None):
        device_map = plan(_layers(3))
    assert device_map == {"": CUDA0}
    assert CPU not in device_map.budgets
    assert "left out" in device_map.headroom[CPU].how


class _Step:
    """What an estimate of a step reports: its peak, parameters and buffers."""

    def __init__(self, peak: int, parameters: int) -> None:
        self.peak, self.parameters, self.buffers = peak, parameters, 0


@pytest.mark.fake_cuda
def test_plan_auto_keeps_the_estimated_activations_of_an_example_input() -> None:
    import torchplace.looking._estimate as estimate_module

    calls: list[dict[str, Any]] = []

    def measuring(model: nn.Module, /, *, example_input: Any = None, **kw: Any) -> _Step:
        calls.append({"example_input": example_input, **kw})
        return _Step(peak=8 * LINEAR_BYTES + 3000, parameters=8 * LINEAR_BYTES)

    batch = torch.ones(2, 16)
    with machine([10 * LINEAR_BYTES] * 2, host=100 * LINEAR_BYTES) as patch:
        patch.setattr(estimate_module, "estimate", measuring)
        device_map = plan(_layers(8), example_input=batch)
    assert calls == [{"example_input": batch, "optimizer": None, "grads": False, "step": "forward"}]
    assert {d: h.bytes for d, h in device_map.headroom.items()} == {
        CUDA0: 3000,
        CUDA1: 3000,
        CPU: 10 * LINEAR_BYTES,
        "disk": 0,
    }
    assert "example_input, as estimated" in device_map.headroom[CUDA0].how
    assert device_map.budgets[CUDA0] == 10 * LINEAR_BYTES - 3000  # room for 7 layers
    assert device_map == {**{str(i): CUDA0 for i in range(7)}, "7": CUDA1}


def test_plan_auto_falls_back_to_a_tenth_when_estimate_cannot_run_a_step() -> None:
    import torchplace.looking._estimate as estimate_module

    def weights_only(model: nn.Module, /, *, optimizer: Any = None, grads: bool = True) -> None:
        raise AssertionError("called although it takes no example_input")

    with machine([10 * LINEAR_BYTES], host=100 * LINEAR_BYTES) as patch:
        patch.setattr(estimate_module, "estimate", weights_only)
        device_map = plan(_layers(2), example_input=torch.ones(1, 16))
    assert device_map.headroom[CUDA0].bytes == LINEAR_BYTES
    assert "cannot run a step with example_input" in device_map.headroom[CUDA0].how


def test_plan_example_input_with_given_budgets_is_refused() -> None:
    with pytest.raises(TorchplaceError, match=r"example_input.*used as given.*'auto'"):
        plan(_layers(2), {"cpu": "1GiB"}, example_input=torch.ones(1, 16))
    given = plan(_layers(2), {"cpu": "1GiB"})
    assert given.budgets == {CPU: GiB}
    assert given.headroom[CPU].bytes == 0


# --- plan: the disk tier ---------------------------------------------------------------------


def test_plan_fills_the_disk_after_the_accelerators_and_the_cpu() -> None:
    budgets = {"disk": "1TB", "cuda:0": 2 * LINEAR_BYTES, "cpu": 3 * LINEAR_BYTES}
    with cuda_forbidden():
        device_map = plan(_layers(8), budgets)  # listed first, the disk still comes last
    assert device_map == {"0": CUDA0, "1": CUDA0, "2": CPU, "3": CPU, "4": CPU,
                          "5": "disk", "6": "disk", "7": "disk"}  # fmt: skip
    assert list(device_map.budgets) == [CUDA0, CPU, "disk"]
    assert device_map.budgets["disk"] == 10**12
    assert plan(_layers(8), {"cpu": 0, "disk": 10**6}) == {str(i): "disk" for i in range(8)}


def test_plan_of_a_model_wholly_on_disk_maps_its_parts_so_load_into_takes_it(
    tmp_path: Any,
) -> None:
    # {"": "disk"} is refused by load_into (the disk tier streams the parts that run): a plan
    # that puts everything on the disk names the parts, and load_into runs the model by it.
    torch.manual_seed(0)
    whole = _layers(3).to_empty(device="cpu")
    for p in whole.parameters():
        nn.init.normal_(p)
    torch.save(whole.state_dict(), tmp_path / "layers.pt")
    device_map = plan(_layers(3), {"cpu": 0, "disk": "1GB"})
    assert device_map == {"0": "disk", "1": "disk", "2": "disk"}
    model = load_into(_layers(3), tmp_path / "layers.pt", device_map=device_map)
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(model(x), whole(x))


def test_plan_result_is_a_dict_that_keeps_its_budgets_through_copies() -> None:
    import copy
    import pickle

    device_map = plan(_layers(2), {"cpu": 100 * LINEAR_BYTES, "disk": "1TB"})
    assert device_map == {"": CPU} and dict(device_map) == {"": CPU}
    for copied in (copy.copy(device_map), copy.deepcopy(device_map)):
        assert copied == device_map and copied.budgets == device_map.budgets
    back = pickle.loads(pickle.dumps(device_map))
    assert back.budgets == {CPU: 100 * LINEAR_BYTES, "disk": 10**12}
    assert back.headroom == device_map.headroom


def test_plan_that_does_not_fit_even_on_disk_names_the_shortfall_and_the_largest_part() -> None:
    model = nn.Sequential(
        nn.Linear(16, 16, device="meta"),  # 1088 B: cuda:0
        nn.Linear(16, 32, device="meta"),  # 2176 B: the disk
        nn.Linear(32, 16, device="meta"),  # 2112 B: no room left
        nn.Linear(16, 16, device="meta"),  # 1088 B: no room left
    )
    budgets = {"cuda:0": 1088, "disk": 2200}
    short = 1088 + 2176 + 2112 + 1088 - 1088 - 2200
    with pytest.raises(TorchplaceError) as info:
        plan(model, budgets)
    message = str(info.value)
    assert f"{plan_module._format_bytes(short)} ({short} bytes) short" in message
    assert "the largest part left without room is model.2 (Linear, 2.1 KiB)" in message
    assert "disk: 2.1 KiB" in message
    assert "add a 'disk' budget" not in message  # there is one
    with pytest.raises(TorchplaceError, match=r"add a 'disk' budget"):
        plan(model, {"cuda:0": 1088})


def test_plan_auto_spills_the_last_layers_to_the_disk() -> None:
    """With "auto" budgets the disk is open (the checkpoint is the disk): a model larger than
    the accelerators and the host goes to the disk from where they are full; it raised."""
    with machine([LINEAR_BYTES * 10], host=LINEAR_BYTES * 10):
        device_map = plan(_layers(20))
    # 9 layers in 90% of cuda:0, 9 in 90% of the host, the last 2 on the disk
    assert device_map == _spread(9, 9, 2, device_of=[CUDA0, CPU, "disk"].__getitem__)
    assert device_map.budgets["disk"] == OPEN
    assert "checkpoint" in device_map.headroom["disk"].how


def test_plan_auto_spills_an_8b_llama_skeleton_to_the_disk() -> None:
    """An 8B Llama (16 GB in bfloat16) on a host with 8 GiB available and no accelerator: the
    first layers on the cpu, the last ones on the disk, and load_into's checks take the map."""
    transformers = pytest.importorskip("transformers")
    from torchplace._model_walk import walk_model
    from torchplace.spreading._dispatch import check_offloading

    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    with machine([], host=8 * GiB):
        device_map = plan(model, no_split="auto")
    layers = [device_map.get(f"model.layers.{i}") for i in range(32)]
    first_disk = layers.index("disk")
    assert 0 < first_disk < 32 and layers[first_disk:] == ["disk"] * (32 - first_disk)
    assert device_map["lm_head"] == "disk" and device_map["model.rotary_emb"] == CPU
    on_cpu = sum(p.nbytes for n, p in model.named_parameters() if _tier(n, device_map) == CPU)
    assert device_map.budgets[CPU] - 2 * 2**30 < on_cpu <= device_map.budgets[CPU]
    check_offloading(walk_model(model), dict(device_map), None, 2)  # the map load_into checks


def _tier(name: str, device_map: dict[str, Any]) -> Any:
    """Where the map puts the tensor or module ``name``: its most specific entry's value."""
    entry = max((k for k in device_map if k == "" or name == k or name.startswith(f"{k}.")),
                key=len)  # fmt: skip
    return device_map[entry]


def test_plan_that_does_not_fit_with_a_given_disk_budget_names_the_shortfall() -> None:
    with pytest.raises(TorchplaceError, match=r"budgets hold .*disk: 2.1 KiB.*short"):
        plan(_layers(20), {"cpu": LINEAR_BYTES * 10, "disk": LINEAR_BYTES * 2})


# --- plan: balanced strategies ---------------------------------------------------------------


def _gpus(count: int, budget: int | str = "1MiB") -> dict[str, int | str]:
    return {f"cuda:{i}": budget for i in range(count)}


def _spread(
    *counts: int, device_of: Callable[[int], Any] = lambda i: torch.device("cuda", i)
) -> dict[str, Any]:
    """The map of consecutive layers, counts[i] of them on device_of(i)."""
    out: dict[str, Any] = {}
    for index, count in enumerate(counts):
        out.update({str(len(out) + k): device_of(index) for k in range(count)})
    return out


@pytest.mark.parametrize(
    ("gpus", "strategy", "counts"),
    [
        (2, "balanced", (4, 4)),
        (4, "balanced", (2, 2, 2, 2)),
        (3, "balanced", (3, 2, 3)),  # 8/3 layers each: each layer goes where its middle falls
        (2, "sequential", (8,)),
        (3, "balanced_low_0", (0, 4, 4)),  # the first gets what the others cannot hold
        (4, "balanced_low_0", (0, 3, 2, 3)),
    ],
)
def test_plan_balanced_spreads_layers_evenly_over_the_gpus(
    gpus: int, strategy: str, counts: tuple[int, ...]
) -> None:
    with cuda_forbidden():
        device_map = plan(_layers(8), _gpus(gpus), strategy=strategy)
    expected = {"": CUDA0} if counts == (8,) else _spread(*counts)
    assert device_map == expected


def test_plan_balanced_low_0_puts_on_the_first_gpu_only_what_the_others_cannot_hold() -> None:
    budgets = {"cuda:0": "1MiB", "cuda:1": 3 * LINEAR_BYTES, "cuda:2": 3 * LINEAR_BYTES}
    assert plan(_layers(8), budgets, strategy="balanced_low_0") == _spread(2, 3, 3)


def test_plan_balanced_follows_budgets_too_small_for_an_even_share() -> None:
    budgets = {"cuda:0": "1MiB", "cuda:1": LINEAR_BYTES, "cuda:2": "1MiB", "cuda:3": "1MiB"}
    # cuda:1 holds one layer; the other seven share the rest evenly, in order
    assert plan(_layers(8), budgets, strategy="balanced") == _spread(2, 1, 3, 2)


def test_plan_balanced_leaves_no_gpu_empty_for_a_layer_past_its_share() -> None:
    big = nn.Linear(16, 160, device="meta")  # 10880 B, ten small layers' worth
    model = nn.Sequential(big, *_layers(2))
    # 12 layers' worth over three GPUs: 4 each. The big layer's middle (5) is past cuda:0's
    # share, but cuda:0 is still empty, so it stays there rather than leave cuda:0 unused.
    device_map = plan(model, _gpus(3), strategy="balanced")
    assert device_map == {"0": CUDA0, "1": CUDA1, "2": torch.device("cuda", 2)}


def test_plan_balanced_fills_the_cpu_and_disk_after_full_gpus() -> None:
    budgets = {**_gpus(2, 2 * LINEAR_BYTES), "cpu": LINEAR_BYTES, "disk": "1GiB"}
    device_map = plan(_layers(8), budgets, strategy="balanced")
    places: list[Any] = [CUDA0, CUDA1, CPU, "disk"]
    assert device_map == _spread(2, 2, 1, 3, device_of=places.__getitem__)


@pytest.mark.fake_cuda
@pytest.mark.parametrize("kind", KINDS)
def test_plan_balanced_keeps_no_split_and_ties(kind: str) -> None:
    # Net: embed 576 B, three Blocks of 2176 B, head 272 B; 7376 B over two GPUs: 3688 each.
    model = built(kind, Net)
    split = plan(model, _gpus(2), strategy="balanced")
    assert split == {"embed": CUDA0, "blocks.0": CUDA0, "blocks.1.a": CUDA0,
                     "blocks.1.b": CUDA1, "blocks.2": CUDA1, "head": CUDA1}  # fmt: skip
    whole = plan(model, _gpus(2), strategy="balanced", no_split=[Block])
    # blocks.1 spans 2752..4928 B: its middle, 3840, is past 3688
    assert whole == {"embed": CUDA0, "blocks.0": CUDA0, "blocks.1": CUDA1,
                     "blocks.2": CUDA1, "head": CUDA1}  # fmt: skip
    tied = plan(TiedLM(device="meta"), _gpus(2), strategy="balanced")
    assert tied["embed"] == tied["lm_head"]


def test_plan_balanced_falls_back_to_sequential_when_it_cannot_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Targets that send everything past cuda:0 overflow cuda:1; sequential packing fits.
    monkeypatch.setattr(plan_module, "_targets", lambda *args: [0.0, None])
    budgets = _gpus(2, 4 * LINEAR_BYTES)
    assert plan(_layers(8), budgets, strategy="balanced") == _spread(4, 4)
    assert plan(_layers(3), budgets, strategy="balanced") == {"": CUDA1}


@pytest.mark.parametrize("strategy", ["balance", "even", 3])
def test_plan_unknown_strategy_names_the_valid_ones(strategy: Any) -> None:
    with pytest.raises(DeviceSpecError, match=r"'sequential', 'balanced', 'balanced_low_0'"):
        plan(_layers(2), {"cpu": "1GiB"}, strategy=strategy)


# --- plan: a transformers model --------------------------------------------------------------


def _tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def test_plan_balances_a_tiny_llama_by_its_decoder_layers() -> None:
    model = _tiny_llama()
    # Bytes: embed_tokens 16384, each decoder layer 37120, norm 128, lm_head 16384, in all
    # 181408 with the rotary buffers; two GPUs: 90704 each, four: 45352 each.
    layers = [f"model.layers.{i}" for i in range(4)]
    tail = ["model.norm", "model.rotary_emb", "lm_head"]
    with cuda_forbidden():
        two = plan(model, _gpus(2), no_split="auto", strategy="balanced")
        four = plan(model, _gpus(4), no_split="auto", strategy="balanced")
        low = plan(model, _gpus(3), no_split="auto", strategy="balanced_low_0")
    assert two == {"model.embed_tokens": CUDA0, layers[0]: CUDA0, layers[1]: CUDA0,
                   layers[2]: CUDA1, layers[3]: CUDA1} | dict.fromkeys(tail, CUDA1)  # fmt: skip
    # layer 0 ends at 53504 B, past 45352, but its middle (34944) is not: it stays on cuda:0
    assert four == {"model.embed_tokens": CUDA0, layers[0]: CUDA0, layers[1]: CUDA1,
                    layers[2]: torch.device("cuda", 2), layers[3]: torch.device("cuda", 3)
                    } | dict.fromkeys(tail, torch.device("cuda", 3))  # fmt: skip
    cuda2 = torch.device("cuda", 2)
    assert low == {"model.embed_tokens": CUDA1, layers[0]: CUDA1, layers[1]: CUDA1,
                   layers[2]: cuda2, layers[3]: cuda2} | dict.fromkeys(tail, cuda2)  # fmt: skip
    assert all(p.device == META for p in model.parameters())


# --- plan: modules with nothing in a checkpoint stay off the disk ----------------------------


class _Rotary(nn.Module):
    """Holds only a non-persistent buffer, as a rotary embedding's ``inv_freq``."""

    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(8, device=device), persistent=False)


_LINEAR64 = (64 * 64 + 64) * 4  # nn.Linear(64, 64) in float32


class _WithRotary(nn.Module):
    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        self.embed = nn.Linear(64, 64, device=device)
        self.layers = nn.Sequential(*(nn.Linear(64, 64, device=device) for _ in range(3)))
        self.rotary = _Rotary("cpu" if device == "meta" else device)
        self.head = nn.Linear(64, 64, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.rotary.inv_freq.to(x.device).sum()
        return self.head(self.layers(self.embed(x)) * scale)  # type: ignore[no-any-return]


def _buffers_only(module: nn.Module) -> bool:
    """Whether the module holds buffers and no parameter: nothing the disk tier keeps."""
    return next(module.parameters(), None) is None and next(module.buffers(), None) is not None


def _weightless_on_disk(model: nn.Module, device_map: dict[str, Any]) -> list[str]:
    """The modules the map leaves on 'disk' that hold buffers but no parameter."""
    found = []
    for name, module in model.named_modules():
        entry = max((k for k in device_map if k == "" or name == k or name.startswith(f"{k}.")),
                    key=len, default=None)  # fmt: skip
        if entry is not None and device_map[entry] == "disk" and _buffers_only(module):
            found.append(name)
    return found


@pytest.mark.parametrize(
    ("budgets", "home"),
    [
        ({"cpu": _LINEAR64, "disk": "1GB"}, CPU),
        ({"cpu": 0, "disk": "1GB"}, CPU),
        ({"disk": "1GB"}, CPU),
        ({"cuda:0": _LINEAR64, "cpu": 0, "disk": "1GB"}, CUDA0),
    ],
    ids=["cpu-then-disk", "all-disk", "disk-only", "cuda-then-disk"],
)
def test_plan_never_puts_a_module_without_weights_on_disk(
    budgets: dict[str, Any], home: torch.device
) -> None:
    model = _WithRotary()
    with cuda_forbidden():
        device_map = plan(model, budgets)
    assert device_map["rotary"] == home  # where the disk's modules run
    assert _weightless_on_disk(model, device_map) == []
    assert device_map["head"] == "disk"


class _WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3)))
        self.norm = nn.BatchNorm1d(64)  # its running statistics are persistent buffers
        self.head = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers(x)))  # type: ignore[no-any-return]


def test_a_module_with_persistent_buffers_goes_to_the_disk_and_loads(tmp_path: Any) -> None:
    # load_into keeps a "disk" module's persistent buffers in memory, read from the file
    torch.manual_seed(0)
    resident = _WithNorm().eval()
    resident.norm.running_mean.uniform_()  # not the initial values, so a load is seen
    torch.save(resident.state_dict(), tmp_path / "model.pt")
    device_map = plan(resident, {"cpu": 0, "disk": "1GB"})
    assert device_map["norm"] == device_map["layers"] == "disk"
    model = load_into(_WithNorm().eval(), tmp_path / "model.pt", device_map=device_map)
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(model(x), resident(x))


class _ScaledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(64))  # held by the block itself (a layer scale)
        self.fc = nn.Linear(64, 64)
        self.norm = nn.BatchNorm1d(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x)) * self.scale  # type: ignore[no-any-return]


class _Stateful(nn.Linear):
    def get_extra_state(self) -> Any:
        return {"calibrated": True}

    def set_extra_state(self, state: Any) -> None:
        assert state == {"calibrated": True}


class _WithBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(64, 64)
        self.block = _ScaledBlock()
        self.calibrated = _Stateful(64, 64)
        self.head = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.calibrated(self.block(self.first(x))))  # type: ignore[no-any-return]


def test_a_block_goes_to_disk_whole_and_no_disk_entry_holds_an_extra_state(tmp_path: Any) -> None:
    # the block holds a parameter itself and a BatchNorm below it: on disk whole, its
    # statistics read into memory; an extra state cannot stay in the file
    torch.manual_seed(0)
    resident = _WithBlocks().eval()
    resident.block.norm.running_mean.uniform_()
    torch.save(resident.state_dict(), tmp_path / "model.pt")
    device_map = plan(resident, {"cpu": 0, "disk": "1GB"})
    assert device_map["block"] == "disk" and "block.norm" not in device_map
    assert device_map["calibrated"] == CPU and device_map["first"] == "disk"
    model = load_into(_WithBlocks().eval(), tmp_path / "model.pt", device_map=device_map)
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(model(x), resident(x))


def test_a_plan_over_disk_loads_and_runs_bit_for_bit(tmp_path: Any) -> None:
    torch.manual_seed(0)
    resident = _WithRotary("cpu").eval()
    torch.save(resident.state_dict(), tmp_path / "model.pt")
    x = torch.randn(4, 64)
    device_map = plan(resident, {"cpu": _LINEAR64, "disk": "1GB"})
    assert device_map["layers"] == "disk" and device_map["rotary"] == CPU
    model = load_into(_WithRotary(), tmp_path / "model.pt", device_map=device_map)
    with torch.no_grad():
        assert torch.equal(model(x), resident(x))


@pytest.mark.slow  # imports transformers' Llama, saves and loads it three times: ~12 s here
def test_plan_of_a_tiny_llama_over_disk_loads_and_runs_bit_for_bit(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    from torchplace.checkpoint._skeleton import skeleton

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    resident = transformers.LlamaForCausalLM(config).eval()
    resident.save_pretrained(tmp_path)
    ids = torch.arange(16).reshape(2, 8)
    with torch.no_grad():
        expected = resident(ids).logits
    names = dict(resident.named_modules())
    for cpu in (0, 20_000, 40_000):  # all on disk; the embedding on the cpu; a layer too
        device_map = plan(resident, {"cpu": cpu, "disk": "1GB"})
        assert "disk" in device_map.values()
        assert set(device_map) <= set(names)
        assert _weightless_on_disk(resident, device_map) == []
        assert device_map["model.rotary_emb"] == CPU
        model = skeleton(transformers.LlamaForCausalLM, config).eval()
        load_into(model, tmp_path, device_map=device_map)
        with torch.no_grad():
            got = model(ids).logits
        assert got.dtype == expected.dtype and torch.equal(got, expected), device_map


def test_plan_of_a_llama_names_its_modules_as_named_modules_does() -> None:
    # A LlamaForCausalLM's layers are model.layers.N: a map never says model.model.layers.N
    # (only messages do, where "model" is the object itself: display() of the path).
    model = _tiny_llama()
    names = set(dict(model.named_modules()))
    total = sum(p.numel() * 4 for p in model.parameters())
    for budget in range(0, total, total // 7):
        for no_split in ((), "auto"):
            device_map = plan(model, {"cpu": budget, "disk": "1GB"}, no_split=no_split)
            assert set(device_map) <= names, device_map
            assert not any(key.startswith("model.model.") for key in device_map)


# --- plan: every map it returns is one load_into takes ----------------------------------------


class _RotaryLayer(nn.Module):
    """A layer as Sam3's ViT or FalconMamba's mixer has it: a parameter of its own, and a
    child that holds buffers only (a rotary embedding) beside its weights."""

    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(64, device=device))
        self.rotary = _Rotary("cpu" if device == "meta" else device)
        self.fc = nn.Linear(64, 64, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale * self.rotary.inv_freq.to(x.device).sum()  # type: ignore[no-any-return]


class _Router(nn.Module):
    """A MoE router: a weight, and a persistent bias it corrects scores with (DeepSeek's
    ``e_score_correction_bias``)."""

    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 64, device=device))
        self.register_buffer("bias", torch.zeros(4, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight.t() + self.bias).softmax(-1)


class _Decoder(nn.Module):
    """A decoder layer kept whole (``no_split``) that holds a router."""

    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        self.attn = nn.Linear(64, 64, device=device)
        self.gate = _Router(device)
        self.experts = nn.Linear(64, 256, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn(x)
        weights = self.gate(h)
        return (self.experts(h).view(*h.shape[:-1], 4, 64) * weights[..., None]).sum(-2)  # type: ignore[no-any-return]


class _Stacked(nn.Module):
    def __init__(self, layer: Callable[[str], nn.Module], device: str = "meta") -> None:
        super().__init__()
        self.embed = nn.Linear(64, 64, device=device)
        self.layers = nn.ModuleList(layer(device) for _ in range(4))
        self.head = nn.Linear(64, 8, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)  # type: ignore[no-any-return]


def _each_map_loads(tmp_path: Any, layer: Callable[[str], nn.Module], no_split: Any) -> list[Any]:
    """plan's map of a _Stacked of ``layer`` at every cpu budget from nothing to the whole model,
    each loaded by load_into and run against the resident model bit for bit; the maps."""
    torch.manual_seed(0)
    resident = _Stacked(layer, "cpu").eval()
    for name, b in resident.named_buffers():
        if name in resident.state_dict():
            b.uniform_()  # not a skeleton's values, so that a buffer left unread is seen
    torch.save(resident.state_dict(), tmp_path / "model.pt")
    x = torch.randn(2, 64)
    with torch.no_grad():
        expected = resident(x)
    total = sum(t.nbytes for t in resident.state_dict().values())
    maps = []
    for cpu in range(0, total, total // 9):
        device_map = plan(_Stacked(layer), {"cpu": cpu, "disk": "1TB"}, no_split=no_split)
        model = load_into(_Stacked(layer), tmp_path / "model.pt", device_map=device_map).eval()
        with torch.no_grad():
            assert torch.equal(model(x), expected), device_map
        maps.append(device_map)
    return maps


def test_a_buffer_only_child_stays_inside_its_disk_block(tmp_path: Any) -> None:
    """Sam3's ViT layers, FalconMamba's mixers: plan moved the rotary embedding out of a layer
    on disk, to the cpu, and load_into refused the map (a disk module is read whole)."""
    maps = _each_map_loads(tmp_path, _RotaryLayer, ())
    on_disk = [m for m in maps if _tier("layers.3", m) == "disk"]
    assert on_disk and all(_tier("layers.3.rotary", m) == "disk" for m in on_disk)


def test_a_no_split_block_holding_a_router_bias_is_never_split(tmp_path: Any) -> None:
    """DeepSeek's decoder layers: plan kept the router (its persistent bias) and the layer's
    own tensors off the disk, splitting a ``no_split`` block; it goes to the disk whole."""
    maps = _each_map_loads(tmp_path, _Decoder, [_Decoder])
    for device_map in maps:
        assert not [k for k in device_map if k.count(".") > 1], device_map  # no layer split
    assert any(_tier("layers.3", m) == "disk" for m in maps)
