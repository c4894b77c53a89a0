"""guard(): inputs on the wrong device are caught at the module that receives them.

cpu and meta are the two real devices here; FakeTensorMode supplies tensors that report cuda:0
and cuda:1 on a CPU-only build (always under no_grad: autograd on a fake CUDA tensor aborts).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import inspect
import pickle
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.modules import module as torch_module
from torch.nn.utils.rnn import PackedSequence

import torchplace.looking._guard as guard_module
from helpers import script
from torchplace._errors import DeviceMismatchError, TorchplaceError
from torchplace.looking._guard import Guard, guard

# --- helpers -----------------------------------------------------------------------------------


class Net(nn.Module):
    """model.body (Linear) -> model.head (Linear)."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.body = nn.Linear(4, 4, device=device)
        self.head = nn.Linear(4, 2, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Probe(nn.Module):
    """Holds one parameter per device given; its forward records the call and touches nothing."""

    def __init__(self, *devices: str) -> None:
        super().__init__()
        for i, device in enumerate(devices):
            self.register_parameter(f"p{i}", nn.Parameter(torch.zeros(2, device=device)))
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return args[0] if args else None


class Buffered(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(4, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Add(nn.Module):
    """No tensors of its own, two inputs."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.add = Add()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.add(self.inner(x), y)


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    mask: torch.Tensor


def fake_module(module: nn.Module, device: str) -> nn.Module:
    """Replace every parameter of a meta module by a fake one on ``device`` (in FakeTensorMode)."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            fake = torch.empty(p.shape, device=device)
            setattr(sub, name, nn.Parameter(fake, requires_grad=False))
    return module


def leftovers(model: nn.Module) -> list[str]:
    """Everything a guard could have left behind on ``model``, its classes and torch."""
    found = []
    for name, sub in model.named_modules():
        if sub._forward_pre_hooks or sub._forward_hooks:
            found.append(f"hook on {name or 'model'}")
        if "forward" in vars(sub):
            found.append(f"instance forward on {name or 'model'}")
    for cls in {type(sub) for sub in model.modules()}:
        forward = vars(cls).get("forward")
        if forward is not None and forward.__module__ == guard_module.__name__:
            found.append(f"wrapped forward on {cls.__name__}")
        if forward is not None and forward is not ORIGINAL_FORWARDS.get(cls, forward):
            found.append(f"replaced forward on {cls.__name__}")
    if guard_module._CHECKS or guard_module._PATCHES:
        found.append("guard tables not empty")
    if torch_module._global_forward_pre_hooks or torch_module._global_forward_hooks:
        found.append("global hooks")
    return found


ORIGINAL_FORWARDS = {
    cls: vars(cls)["forward"]
    for cls in (nn.Linear, nn.ReLU, nn.Sequential, nn.MSELoss, Net, Probe, Buffered, Add, Residual)
}


@pytest.fixture(autouse=True)
def _nothing_left() -> Iterator[None]:
    yield
    if guard_module._CHECKS or guard_module._PATCHES:  # a dropped guard goes when collected
        gc.collect()  # (only then: a collection of the whole run's heap costs 0.7 s a test)
    assert not guard_module._CHECKS, "a test left a guard installed"
    assert not guard_module._PATCHES, "a test left a class patched"
    for cls, forward in ORIGINAL_FORWARDS.items():
        assert vars(cls)["forward"] is forward


# --- the contract ------------------------------------------------------------------------------


def test_matching_inputs_pass_and_outputs_are_unchanged() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    x = torch.randn(5, 4)
    expected = model(x)
    with guard(model) as g:
        assert isinstance(g, Guard)
        assert g.installed
        torch.testing.assert_close(model(x), expected)
    assert not g.installed


def test_meta_module_with_cpu_input_raises_before_torch() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Probe("meta"))
    model[0].to("meta")
    with guard(model), pytest.raises(DeviceMismatchError) as info:
        model(torch.ones(1, 4))
    assert str(info.value) == (
        "model.0 (Linear) got input[0] on cpu but its parameters are on meta; "
        "move the input with x = torchplace.move(x, 'meta'), or give the module data with "
        "torchplace.load_into or Module.to_empty(device='cpu')"
    )
    # Raised by the guard itself, not wrapped around an error from torch.
    assert info.value.__cause__ is None
    assert info.value.__context__ is None


def test_the_checked_module_never_runs() -> None:
    probe = Probe("meta")
    with guard(probe), pytest.raises(DeviceMismatchError):
        probe(torch.ones(2))
    assert probe.calls == 0


def test_design_example_message_with_fake_cuda() -> None:
    with FakeTensorMode(), torch.no_grad():
        model = fake_module(Net("meta"), "cuda:0")
        with guard(model), pytest.raises(DeviceMismatchError) as info:
            model.head(torch.empty(1, 4))
    assert str(info.value) == (
        "model.head (Linear) got input[0] on cpu but its parameters are on cuda:0; "
        "move the input with x = torchplace.move(x, 'cuda:0')"
    )


@pytest.mark.fake_cuda
def test_input_on_another_gpu_is_named() -> None:
    with FakeTensorMode(), torch.no_grad():
        model = fake_module(Net("meta"), "cuda:1")
        with guard(model):
            assert model(torch.empty(3, 4, device="cuda:1")).device == torch.device("cuda:1")
            with pytest.raises(DeviceMismatchError) as info:
                model(torch.empty(3, 4, device="cuda:0"))
    assert str(info.value) == (
        "model.body (Linear) got input[0] on cuda:0 but its parameters are on cuda:1; "
        "move the input with x = torchplace.move(x, 'cuda:1')"
    )


@pytest.mark.parametrize(
    ("call", "where"),
    [
        pytest.param(lambda m, t, f: m(t, f), "input[1]", id="second-positional"),
        pytest.param(lambda m, t, f: m(t, mask=f), "input['mask']", id="keyword"),
        pytest.param(lambda m, t, f: m(t, [t, t, f]), "input[1][2]", id="list"),
        pytest.param(lambda m, t, f: m({"ids": f}), "input[0]['ids']", id="dict"),
        pytest.param(lambda m, t, f: m(t, extra={"k": (t, f)}), "input['extra']['k'][1]", id="kw"),
        pytest.param(lambda m, t, f: m(Batch(ids=t, mask=f)), "input[0].mask", id="dataclass"),
    ],
)
def test_nested_inputs_are_named_by_their_place(call: Any, where: str) -> None:
    probe = Probe("meta")
    on_meta, on_cpu = torch.ones(2, device="meta"), torch.ones(2)
    with guard(probe):
        call(probe, on_meta, on_meta)  # everything on meta: passes
        with pytest.raises(DeviceMismatchError) as info:
            call(probe, on_meta, on_cpu)
    assert str(info.value).startswith(
        f"model (Probe) got {where} on cpu but its parameters are on meta; "
        "move the input with x = torchplace.move(x, 'meta')"
    )


def test_packed_sequence_batch_sizes_may_stay_on_cpu() -> None:
    probe = Probe("meta")
    batch_sizes = torch.tensor([2, 1])  # PyTorch keeps these on the CPU by design
    with guard(probe):
        probe(PackedSequence(torch.ones(3, 2, device="meta"), batch_sizes))
        with pytest.raises(DeviceMismatchError, match=re.escape("got input[0].data on cpu")):
            probe(PackedSequence(torch.ones(3, 2), batch_sizes))


def test_zero_dim_cpu_tensors_pass_as_scalars() -> None:
    probe = Probe("meta")
    with guard(probe):
        probe(torch.ones(2, device="meta"), scale=torch.tensor(0.5))
        with pytest.raises(DeviceMismatchError, match=re.escape("input['scale'] on cpu")):
            probe(torch.ones(2, device="meta"), scale=torch.tensor([0.5]))


def test_buffers_only_module_names_its_buffer() -> None:
    module = Buffered("meta")
    with guard(module), pytest.raises(DeviceMismatchError) as info:
        module(torch.ones(4))
    assert "model (Buffered) got input[0] on cpu but its buffer is on meta;" in str(info.value)


# --- modules without tensors of their own -------------------------------------------------------


def test_parameter_free_module_with_inputs_on_two_devices() -> None:
    loss = nn.MSELoss()
    with guard(loss), pytest.raises(DeviceMismatchError) as info:
        loss(torch.ones(3), torch.ones(3, device="meta"))
    assert str(info.value) == (
        "model (MSELoss) got input[1] on meta but input[0] is on cpu, and a module's inputs "
        "must share one device; move the input with x = torchplace.move(x, 'cpu')"
    )


def test_parameter_free_submodule_is_named_by_path() -> None:
    block = Residual()
    with guard(block):
        block(torch.ones(1, 4), torch.ones(1, 4))
        with pytest.raises(DeviceMismatchError, match=re.escape("model.add (Add) got input[1]")):
            block(torch.ones(1, 4), torch.ones(1, 4, device="meta"))


def test_parameter_free_inputs_agreeing_or_scalar_pass() -> None:
    add = Add()
    with guard(add):
        assert add(torch.ones(2, device="meta"), torch.ones(2, device="meta")).is_meta
        assert add(torch.ones(2, device="meta"), torch.tensor(1.0)).is_meta
        assert add(torch.tensor(1.0), torch.ones(2, device="meta")).is_meta


def test_one_argument_modules_and_containers_are_left_alone() -> None:
    model = nn.Sequential(nn.ReLU(), nn.Linear(4, 4))
    with guard(model) as g:
        assert vars(nn.ReLU)["forward"] is ORIGINAL_FORWARDS[nn.ReLU]
        assert vars(nn.Sequential)["forward"] is ORIGINAL_FORWARDS[nn.Sequential]
        assert "1 module checked" in repr(g)


def test_ctc_loss_takes_cpu_lengths() -> None:
    ctc = nn.CTCLoss()
    with guard(ctc) as g:
        assert "0 modules checked" in repr(g)


# --- modules spread over devices, and models that move ------------------------------------------


def test_module_spread_over_devices_accepts_any_of_them() -> None:
    probe = Probe("cpu", "meta")
    with guard(probe):
        probe(torch.ones(2))
        probe(torch.ones(2, device="meta"))
        probe(torch.ones(2), torch.ones(2, device="meta"))
    assert probe.calls == 3


@pytest.mark.fake_cuda
def test_module_spread_over_fake_gpus_names_all_its_devices() -> None:
    with FakeTensorMode(), torch.no_grad():
        probe = Probe("meta", "meta")
        probe.p0 = nn.Parameter(torch.empty(2, device="cuda:0"), requires_grad=False)
        probe.p1 = nn.Parameter(torch.empty(2, device="cuda:1"), requires_grad=False)
        with guard(probe):
            probe(torch.empty(2, device="cuda:1"))
            with pytest.raises(DeviceMismatchError) as info:
                probe(torch.empty(2))
    assert str(info.value) == (
        "model (Probe) got input[0] on cpu but its parameters are on cuda:0 and cuda:1; "
        "move the input with x = torchplace.move(x, 'cuda:0')"
    )


def test_model_moved_while_guarded_is_judged_where_it_is_now() -> None:
    model = Net()
    x = torch.ones(1, 4)
    with guard(model):
        model(x)
        model.to("meta")  # replaces the Parameter objects
        with pytest.raises(DeviceMismatchError, match="its parameters are on meta"):
            model(x)
        model.to_empty(device="cpu")
        model(x)
        model.head.to("meta")
        with pytest.raises(DeviceMismatchError, match=re.escape("model.head (Linear) got")):
            model(x)


def test_parameter_removed_after_install() -> None:
    probe = Probe("meta", "cpu")
    with guard(probe):
        del probe.p0
        probe(torch.ones(2))
        with pytest.raises(DeviceMismatchError, match="parameters are on cpu"):
            probe(torch.ones(2, device="meta"))


# --- install and remove -------------------------------------------------------------------------


def test_remove_leaves_nothing_behind() -> None:
    model = nn.Sequential(Net(), Residual(), Buffered("cpu"), nn.MSELoss())
    assert leftovers(model) == []
    g = guard(model)
    assert leftovers(model) != []
    g.remove()
    assert leftovers(model) == []
    g.remove()  # twice is harmless
    assert leftovers(model) == []


def test_context_manager_removes_even_when_forward_raised() -> None:
    model = Net("meta")
    with pytest.raises(DeviceMismatchError), guard(model):
        model(torch.ones(1, 4))
    assert leftovers(model) == []
    with pytest.raises(ZeroDivisionError), guard(model):
        raise ZeroDivisionError
    assert leftovers(model) == []


def test_guard_without_with_is_installed_until_removed() -> None:
    model = Net("meta")
    g = guard(model)
    with pytest.raises(DeviceMismatchError):
        model(torch.ones(1, 4))
    with pytest.raises(DeviceMismatchError):
        model(torch.ones(1, 4))
    g.remove()
    with pytest.raises(RuntimeError) as info:
        model(torch.ones(1, 4))
    assert not isinstance(info.value, DeviceMismatchError)  # torch's own error now
    assert leftovers(model) == []


def test_nested_and_double_guards_check_once_and_clean_up() -> None:
    model = Net("meta")
    x = torch.ones(1, 4)
    with guard(model) as outer:
        with guard(model) as inner:
            assert len(guard_module._CHECKS) == 2  # shared, not doubled
        assert not inner.installed
        with pytest.raises(DeviceMismatchError):
            model(x)
        again = guard(model.head)
        again.remove()
        with pytest.raises(DeviceMismatchError, match=re.escape("model.body (Linear)")):
            model(x)
        assert outer.installed
    assert leftovers(model) == []


@pytest.mark.parametrize("inner_first", [True, False], ids=["inner-first", "outer-first"])
def test_shared_check_names_the_module_from_the_outermost_guard(inner_first: bool) -> None:
    model = Net()
    model.head.to("meta")
    x = torch.ones(1, 4)
    if inner_first:
        inner, outer = guard(model.head), guard(model)
    else:
        outer, inner = guard(model), guard(model.head)
    try:
        # One check serves both guards; it names model.head from the outermost model guarded,
        # whichever guard came first.
        with pytest.raises(DeviceMismatchError, match=r"^model\.head \(Linear\) got input"):
            model(x)
        outer.remove()  # left alone, the inner guard names it from where it stands
        with pytest.raises(DeviceMismatchError, match=r"^model \(Linear\) got input"):
            model.head(x)
    finally:
        outer.remove()
        inner.remove()
    assert leftovers(model) == []


def test_removed_guard_can_be_entered_again() -> None:
    model = Net("meta")
    g = guard(model)
    g.remove()
    with g, pytest.raises(DeviceMismatchError):
        model(torch.ones(1, 4))
    assert leftovers(model) == []


def test_other_instances_of_a_checked_class_are_untouched() -> None:
    guarded, other = nn.Linear(4, 4, device="meta"), nn.Linear(4, 4, device="meta")
    with guard(guarded), pytest.raises(RuntimeError) as info:
        other(torch.ones(1, 4))
    assert not isinstance(info.value, DeviceMismatchError)


def test_subclass_calling_super_is_checked_once() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = nn.Sequential(Scaled(4, 4), nn.Linear(4, 4)).to("meta")
    original = vars(Scaled)["forward"]
    with guard(model), pytest.raises(DeviceMismatchError, match=re.escape("model.0 (Scaled)")):
        model(torch.ones(1, 4))
    assert vars(Scaled)["forward"] is original
    assert leftovers(model) == []


def test_subclass_inheriting_forward_is_restored() -> None:
    class Plain(nn.Linear):
        pass

    model = Plain(4, 4, device="meta")
    with guard(model), pytest.raises(DeviceMismatchError, match=re.escape("model (Plain)")):
        model(torch.ones(1, 4))
    assert "forward" not in vars(Plain)


def test_signature_is_unchanged_while_guarded() -> None:
    model = Net()
    before = inspect.signature(model.forward)
    with guard(model):
        assert inspect.signature(model.forward) == before
        assert inspect.signature(model.head.forward) == inspect.signature(nn.Linear(1, 1).forward)


def test_instance_forward_gets_a_hook_and_loses_it() -> None:
    probe = Probe("meta")
    probe.forward = lambda *args: "patched"  # type: ignore[method-assign]
    with guard(probe):
        assert len(probe._forward_pre_hooks) == 1
        with pytest.raises(DeviceMismatchError):
            probe(torch.ones(2))
        assert probe(torch.ones(2, device="meta")) == "patched"
    assert not probe._forward_pre_hooks


def test_accelerate_style_module_is_trusted_to_move_its_inputs() -> None:
    probe = Probe("meta")
    probe._hf_hook = object()  # what Accelerate's add_hook_to_module sets
    with guard(probe):
        probe(torch.ones(2))
    assert probe.calls == 1


def test_copies_and_pickles_of_a_guarded_model_are_not_guarded() -> None:
    model = Net()
    with guard(model):
        twin = copy.deepcopy(model)
        thawed = pickle.loads(pickle.dumps(model))
    for clone in (twin, thawed):
        assert leftovers(clone) == []
        clone.to("meta")
        with pytest.raises(RuntimeError) as info:
            clone(torch.ones(1, 4))
        assert not isinstance(info.value, DeviceMismatchError)


def test_a_module_dropped_while_guarded_leaves_the_tables() -> None:
    model = Net()
    with guard(model):
        assert len(guard_module._CHECKS) == 2
        model.head = nn.Linear(4, 2)  # the old head is collected; the new one is not guarded
        gc.collect()
        assert len(guard_module._CHECKS) == 1


@pytest.mark.parametrize("thing", [torch.ones(2), [nn.Linear(1, 1)], "model", None])
def test_not_a_module_is_refused(thing: object) -> None:
    with pytest.raises(TorchplaceError) as info:
        guard(thing)  # type: ignore[arg-type]
    assert type(info.value) is TorchplaceError
    assert f"guard() needs an nn.Module, got {type(thing).__qualname__}" in str(info.value)


# --- any nesting --------------------------------------------------------------------------------

_leaf = st.just("ok")
_tree = st.recursive(
    _leaf,
    lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3),
        st.lists(children, min_size=1, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from(["a", "b", "mask"]), children, min_size=1, max_size=3),
    ),
    max_leaves=8,
)


def _places(tree: Any, where: str) -> Iterator[str]:
    if isinstance(tree, (list, tuple)):
        for i, item in enumerate(tree):
            yield from _places(item, f"{where}[{i}]")
    elif isinstance(tree, dict):
        for key, item in tree.items():
            yield from _places(item, f"{where}[{key!r}]")
    else:
        yield where


def _fill(tree: Any, where: str, bad: str) -> Any:
    if isinstance(tree, (list, tuple)):
        return type(tree)(_fill(item, f"{where}[{i}]", bad) for i, item in enumerate(tree))
    if isinstance(tree, dict):
        return {key: _fill(item, f"{where}[{key!r}]", bad) for key, item in tree.items()}
    return torch.ones(1, device="cpu" if where == bad else "meta")


@settings(max_examples=40, deadline=None)
@given(tree=_tree, data=st.data())
def test_any_nested_input_is_named_exactly(tree: Any, data: st.DataObject) -> None:
    bad = data.draw(st.sampled_from(list(_places(tree, "input[0]"))))
    probe = Probe("meta")
    with guard(probe):
        probe(_fill(tree, "input[0]", bad="nowhere"))
        with pytest.raises(DeviceMismatchError) as info:
            probe(_fill(tree, "input[0]", bad=bad))
    assert str(info.value).startswith(f"model (Probe) got {bad} on cpu but")


# --- with dispatch ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "guard_first", [True, False], ids=["guard-then-dispatch", "dispatch-then-guard"]
)
def test_dispatched_model_is_not_flagged_for_inputs_dispatch_moves(guard_first: bool) -> None:
    dispatch = pytest.importorskip("torchplace.spreading._dispatch").dispatch
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2), nn.Linear(2, 2))
    device_map = {"0": "cpu", "1": "cpu", "2": "meta", "3": "meta"}
    if guard_first:
        g = guard(model)
        dispatch(model, device_map)
    else:
        dispatch(model, device_map)
        g = guard(model)
    with g:
        model(torch.ones(3, 4))  # dispatch moves the input of model.2 to meta before the check


# --- odd modules and odd inputs -----------------------------------------------------------------


def test_scripted_module_is_skipped() -> None:
    scripted = script(nn.Linear(2, 2))
    with guard(scripted) as g:
        assert "0 modules checked" in repr(g)
        scripted(torch.ones(1, 2))


def test_forward_that_is_not_a_function_gets_a_hook() -> None:
    class Static(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2, device="meta"))

        forward = staticmethod(lambda x: x)

    module = Static()
    with guard(module):
        assert len(module._forward_pre_hooks) == 1
        with pytest.raises(DeviceMismatchError, match=re.escape("model (Static) got input[0]")):
            module(torch.ones(2))
    assert not module._forward_pre_hooks
    assert isinstance(vars(Static)["forward"], staticmethod)


def test_forward_replaced_on_the_class_while_guarded_is_kept() -> None:
    class Custom(nn.Linear):
        pass

    def theirs(self: nn.Linear, x: torch.Tensor) -> str:
        return "theirs"

    module = Custom(2, 2, device="meta")
    with guard(module):
        Custom.forward = theirs  # type: ignore[method-assign,assignment]
    assert vars(Custom)["forward"] is theirs
    assert module(torch.ones(2)) == "theirs"


def test_cyclic_input_does_not_recurse_forever() -> None:
    cycle: list[Any] = [torch.ones(2, device="meta")]
    cycle.append(cycle)
    probe = Probe("meta")
    with guard(probe):
        probe(cycle)
        cycle[0] = torch.ones(2)
        with pytest.raises(DeviceMismatchError, match=re.escape("got input[0][0] on cpu")):
            probe(cycle)


def test_long_repr_is_shortened_in_the_refusal() -> None:
    with pytest.raises(TorchplaceError, match=r"got list: \[0, 1, 2, .*\.\.\.; pass the model"):
        guard(list(range(100)))  # type: ignore[arg-type]


@pytest.mark.requires_cuda
def test_real_cuda_module_with_cpu_input() -> None:
    model = Net("cuda:0")
    with guard(model):
        model(torch.ones(1, 4, device="cuda:0"))
        model.head(torch.ones(1, 4, device="cuda:0") * torch.tensor(2.0))
        with pytest.raises(DeviceMismatchError) as info:
            model.head(torch.ones(1, 4))
    assert str(info.value) == (
        "model.head (Linear) got input[0] on cpu but its parameters are on cuda:0; "
        "move the input with x = torchplace.move(x, 'cuda:0')"
    )


def test_guards_installed_and_removed_from_many_threads_leave_nothing() -> None:
    import threading

    class Local(nn.Linear):
        pass

    original = Local.__dict__.get("forward")
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for _ in range(200):
                with guard(Local(2, 2)):
                    pass
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert Local.__dict__.get("forward") is original  # no wrapper left on the class


def test_a_wrapped_model_is_named_as_the_user_names_it() -> None:
    """A wrapper's attribute (DataParallel's module, torch.compile's _orig_mod, Fabric's
    _forward_module) showed in the name, where report and stragglers leave it out."""
    wrapped = torch.nn.DataParallel(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with guard(wrapped), pytest.raises(DeviceMismatchError) as said:
        wrapped(torch.ones(1, 2, device="meta"))
    assert str(said.value).startswith("model.0 (Linear) got input[0] on meta"), said.value
