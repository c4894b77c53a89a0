"""plan: budgets and device maps, on skeletons and fake CUDA devices, touching no device."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import torchplace.spreading._plan as plan_module
from torchplace import _sizes
from torchplace._errors import DeviceSpecError, TorchplaceError
from torchplace.looking._estimate import estimate
from torchplace.spreading._dispatch import dispatch
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
