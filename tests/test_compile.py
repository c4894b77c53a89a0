"""move() inside torch.compile(fullgraph=True): a batch traces whole, results as in eager.

Compiling is slow: every test shares a few compiled functions (backend "eager": Dynamo's trace
is what is tested, not a code generator), and a device or batch shape each makes one graph.
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from typing import Any

import pytest
import torch
from torch import nn

import torchplace


def dynamo_supports(feature: str) -> bool:
    """``_dynamo_compat.dynamo_supports``, imported when a test first asks: it imports
    torch._dynamo (about 2 s), which collecting the suite does not need."""
    from torchplace._dynamo_compat import dynamo_supports as supports

    return supports(feature)


# torch 2.6's Dynamo can neither raise nor catch an exception of a user's class: no torchplace
# error leaves a trace with its message there (fullgraph=True reports "Observed exception").
# There torchplace raises its error while tracing, from outside the trace: it names what it met
# but not where (test_an_old_dynamo_refuses_by_what_it_met), and no fallback to eager follows.
# (The skip conditions are strings, evaluated when a test runs, not at collection.)
needs_traced_errors = pytest.mark.skipif(
    "not dynamo_supports('exceptions')",
    reason="this torch's Dynamo (2.6) cannot raise or catch a user's exception class in a "
    "trace: the error's path in the batch and the eager fallback without fullgraph need "
    "torch >= 2.7",
)

Pair = namedtuple("Pair", "boxes labels")


@dataclasses.dataclass
class Sample:
    pixels: torch.Tensor
    label: int = 0


@dataclasses.dataclass(frozen=True)
class Frozen:
    mask: torch.Tensor


class OwnTo:
    """An object with its own .to(), as a tokenizer's BatchEncoding."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: Any) -> OwnTo:
        return OwnTo(self.t.to(device))


def make_batch() -> dict[str, Any]:
    shared = torch.arange(6.0, requires_grad=True)
    return {
        "x": shared,
        "ids": [torch.arange(3), (torch.ones(2, 2), 7), "name"],
        "pair": Pair(torch.zeros(1, 4), torch.tensor([1])),
        "sample": Sample(torch.rand(3), 5),
        "frozen": Frozen(torch.tensor([True, False])),
        "ordered": OrderedDict(a=torch.ones(1), b=None),
        "again": shared,  # the same tensor twice: one copy, met twice
        "max": torch.max(torch.arange(6.0).view(2, 3), 1),  # torch.return_types, a tuple kind
    } | ({"counts": defaultdict(list, n=torch.zeros(2))} if dynamo_supports("defaultdict") else {})


def _move(batch: Any, device: str | None) -> Any:
    return torchplace.move(batch, device)


def _move_model(batch: Any) -> Any:
    return torchplace.move(batch, "meta")


def _move_with_optimizer(t: torch.Tensor, opt: torch.optim.Optimizer) -> Any:
    return torchplace.move(t, "meta", optimizer=opt)


@functools.cache
def _compiled_once(fn: Any) -> Any:
    """``torch.compile(fn)``, made when a test first calls it and shared by every test after:
    ``torch.compile`` imports torch._dynamo (about 2 s), which collection does not need."""
    return torch.compile(fn, fullgraph=True, backend="eager")


def _compiled(batch: Any, device: str | None) -> Any:
    return _compiled_once(_move)(batch, device)


def _compiled_model(batch: Any) -> Any:
    return _compiled_once(_move_model)(batch)


def _leaves(obj: Any) -> list[Any]:
    """Every tensor and plain value in order, with the containers' types, to compare trees."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [
            type(obj),
            *(x for f in dataclasses.fields(obj) for x in _leaves(getattr(obj, f.name))),
        ]
    if isinstance(obj, dict):
        return [type(obj), *(x for k, v in obj.items() for x in (k, *_leaves(v)))]
    if isinstance(obj, (list, tuple)):
        return [type(obj), *(x for v in obj for x in _leaves(v))]
    return [obj]


def assert_same_tree(got: Any, want: Any) -> None:
    got_leaves, want_leaves = _leaves(got), _leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for a, b in zip(got_leaves, want_leaves, strict=True):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor)
            assert (a.device, a.dtype, a.shape, a.requires_grad) == (
                b.device,
                b.dtype,
                b.shape,
                b.requires_grad,
            )
            if not b.is_meta:
                assert torch.equal(a, b)  # bit for bit
        else:
            assert a == b


@pytest.fixture(autouse=True)
def _counters() -> Any:
    torch._dynamo.utils.counters.clear()
    yield
    assert not torch._dynamo.utils.counters["graph_break"]  # nothing fell out of the graph


def test_a_batch_already_there_traces_whole_and_comes_back_itself() -> None:
    batch = make_batch()
    got = _compiled(batch, "cpu")
    assert got is torchplace.move(batch, "cpu") is batch


def test_a_nested_batch_moves_as_in_eager() -> None:
    batch = make_batch()
    before = _leaves(batch)
    got = _compiled(batch, "meta")
    assert_same_tree(got, torchplace.move(batch, "meta"))
    assert got["x"] is got["again"]  # met twice, copied once, as in eager
    assert isinstance(got["pair"], Pair) and isinstance(got["frozen"], Frozen)
    # torch 2.6's Dynamo hands a defaultdict made in a trace back as a plain dict
    assert not dynamo_supports("defaultdict") or got["counts"].default_factory is list
    assert type(got["max"]) is type(batch["max"]) and got["max"].indices.is_meta
    assert all(a is b for a, b in zip(_leaves(batch), before, strict=True))  # caller's untouched


def test_values_cross_bit_for_bit_and_keep_autograd() -> None:
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    moved = _compiled({"y": [x], "half": torch.ones(2, dtype=torch.float16)}, "meta")
    assert moved["y"][0].is_meta and moved["half"].dtype == torch.float16
    assert moved["y"][0].requires_grad  # the copy is part of the graph, as Tensor.to is

    a = torch.randn(4, 3, dtype=torch.bfloat16)
    step = lambda b: torchplace.move(b, "cpu")["a"] * 1  # noqa: E731
    out = torch.compile(step, fullgraph=True, backend="aot_eager")({"a": a})  # through AOT
    assert torch.equal(out, a)


@pytest.mark.parametrize("spec", ["auto", None])
def test_auto_resolves_as_outside(spec: str | None) -> None:
    # "auto" asks the drivers how many devices there are, which Dynamo cannot trace.
    moved = _compiled({"a": torch.ones(1)}, spec)
    assert moved["a"].device == torchplace.device(spec)


def test_a_wrong_device_spec_says_so() -> None:
    with pytest.raises(RuntimeError) as excinfo:
        _compiled({"a": torch.ones(1)}, "cdua")
    assert "unknown device spec 'cdua'; did you mean 'cuda'?" in _message(excinfo)


def test_no_graph_break_reported_by_explain() -> None:
    explained = torch._dynamo.explain(_move)(make_batch(), "meta")
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1


def _move_again(batch: Any) -> Any:
    return torchplace.move(batch, "meta")


@pytest.mark.slow
def test_new_batches_and_types_met_elsewhere_compile_nothing_again() -> None:
    # A type torchplace meets for the first time, in the trace or outside, must not change
    # anything Dynamo guards on: each such change would compile the step again.
    compiled = torch.compile(_move_again, fullgraph=True, backend="eager")
    compiled(make_batch())

    @dataclasses.dataclass
    class Fresh:
        t: torch.Tensor

    torchplace.move(Fresh(torch.ones(1)), "meta")  # eager, a type never seen before
    compiled(make_batch())
    compiled(make_batch())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def _message(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    """What the user reads: torch.compile reports the exception it observed, chained."""
    text = str(excinfo.value)
    cause = excinfo.value.__cause__
    return text + (f"\n{cause}" if cause is not None else "")


@needs_traced_errors
@pytest.mark.parametrize(
    ("what", "name"),
    [
        ("module", "batch['model'] is a module (Linear)"),
        ("own_to", "batch['encoding'] is a OwnTo with its own .to()"),
        ("optimizer", "batch['opt'] is an optimizer (SGD)"),
    ],
)
def test_what_cannot_trace_is_refused_by_name(what: str, name: str) -> None:
    model = nn.Linear(2, 2)
    found = {
        "module": model,
        "own_to": OwnTo(torch.ones(1)),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
    }
    key = {"module": "model", "own_to": "encoding", "optimizer": "opt"}[what]
    batch = {"x": torch.ones(1), key: found[what]}
    with pytest.raises(RuntimeError) as excinfo:
        _compiled_model(batch)
    message = _message(excinfo)
    assert name in message and "move it outside the compiled function" in message
    assert model.weight.device.type == "cpu"  # nothing moved


class Tagged(list):  # type: ignore[type-arg]
    """A list subclass: Dynamo's copy of one (or of a mapping class) may lose items."""


@needs_traced_errors
@pytest.mark.parametrize("container", [UserDict(a=torch.ones(1)), Tagged([torch.ones(1)])])
def test_a_container_that_cannot_be_rebuilt_faithfully_is_refused(container: Any) -> None:
    with pytest.raises(RuntimeError) as excinfo:
        _compiled({"x": container}, "meta")
    message = _message(excinfo)
    cls = type(container).__name__
    assert "batch['x']" in message and f"cannot rebuild a {cls} inside torch.compile" in message


@needs_traced_errors
def test_a_module_or_optimizer_argument_is_refused() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError) as excinfo:
        _compiled_model(model)
    assert "given a module (Linear)" in _message(excinfo)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(_move_with_optimizer, fullgraph=True, backend="eager")
    with pytest.raises(RuntimeError) as excinfo:
        compiled(torch.ones(1), opt)
    assert "given an optimizer (SGD)" in _message(excinfo)


@needs_traced_errors
def test_a_meta_tensor_of_a_batch_has_no_values_to_bring_back() -> None:
    with pytest.raises(RuntimeError) as excinfo:
        _compiled({"x": [torch.ones(1), torch.empty(2, device="meta")]}, "cpu")
    assert "batch['x'][1] is on meta" in _message(excinfo)


def _move_of(batch: Any, device: str) -> Any:
    return torchplace.move(batch, device)


@needs_traced_errors
@pytest.mark.parametrize(
    ("batch", "device", "says"),
    [
        ({"m": nn.Linear(1, 1)}, "meta", ["batch['m'] is a module (Linear)"]),
        ({"x": [Tagged([torch.ones(1)])]}, "meta", ["batch['x'][0]", "cannot rebuild a Tagged"]),
        ({"x": [torch.empty(1, device="meta")]}, "cpu", ["batch['x'][0] is on meta"]),
    ],
)
def test_a_refusal_chains_no_exception_of_its_own_in_the_trace(
    batch: Any, device: str, says: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch 2.11's Dynamo cannot trace `raise <a user's exception> from ...`: setting its
    # __cause__ failed inside Dynamo (AttributeError: 'UserDefinedExceptionObjectVariable'
    # object has no attribute 'call_setattr'), so the user read that instead of the refusal.
    # Such a Dynamo is simulated here: the refusal must come through all the same.
    from torch._dynamo.variables.user_defined import UserDefinedExceptionObjectVariable

    traced = UserDefinedExceptionObjectVariable.call_method

    def call_method(self: Any, tx: Any, name: str, args: Any, kwargs: Any) -> Any:
        if name == "__setattr__" and getattr(args[0], "value", None) == "__cause__":
            raise AttributeError("this Dynamo cannot set __cause__ on a user's exception")
        return traced(self, tx, name, args, kwargs)

    monkeypatch.setattr(UserDefinedExceptionObjectVariable, "call_method", call_method)
    compiled = torch.compile(_move_of, fullgraph=True, backend="eager")
    with pytest.raises(RuntimeError) as excinfo:
        compiled(batch, device)
    message = _message(excinfo)
    assert all(part in message for part in says), message
    assert "__cause__" not in message


def _move_to_meta(batch: Any) -> Any:
    return torchplace.move(batch, "meta")


@pytest.mark.slow
@needs_traced_errors
def test_without_fullgraph_what_cannot_trace_moves_eagerly() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    compiled = torch.compile(_move_to_meta, backend="eager")  # Dynamo falls back to eager
    moved = compiled({"model": model, "opt": opt, "x": torch.ones(1)})
    assert moved["model"] is model and moved["x"].is_meta
    assert model.weight.is_meta and opt.state[model.weight]["momentum_buffer"].is_meta
    torch._dynamo.utils.counters.clear()  # that fallback is a graph break, as it must be


@pytest.mark.slow
def test_importing_and_moving_eagerly_never_imports_dynamo() -> None:
    # torch._dynamo takes seconds to import: torchplace loads what it needs for tracing only
    # once torch.compile traces a move.
    code = (
        "import sys, torch, torchplace\n"
        "torchplace.move({'x': [torch.ones(2)]}, 'meta')\n"
        "torchplace.move(torch.nn.Linear(2, 2), 'meta')\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.strip() == "False", done.stdout + done.stderr


def _move_sample(sample: Sample) -> Any:
    return torchplace.move({"s": sample}, "meta")


def test_a_dataclass_field_that_changes_between_calls_still_traces() -> None:
    # At the second call Dynamo makes the int field dynamic; torch 2.6's then failed inside.
    compiled = torch.compile(_move_sample, fullgraph=True, backend="eager")
    for label in range(3):
        got = compiled(Sample(torch.full((2,), float(label)), label))["s"]
        assert got.label == label and got.pixels.is_meta


@dataclasses.dataclass
class Doubled:
    pixels: torch.Tensor
    scale: float = 1.0

    def __post_init__(self) -> None:
        self.scale *= 2  # made again by its constructor, it would double again


def test_a_dataclass_is_copied_not_made_again() -> None:
    batch = {"d": Doubled(torch.ones(2))}
    if not dynamo_supports("copy"):  # torch 2.6 cannot copy it: refused, not rebuilt wrong
        with pytest.raises(RuntimeError, match=r"cannot rebuild a Doubled inside torch\.compile"):
            _compiled(batch, "meta")
        return
    got = _compiled(batch, "meta")
    assert got["d"].scale == batch["d"].scale == 2.0 and got["d"].pixels.is_meta


@dataclasses.dataclass
class InitFalse:
    pixels: torch.Tensor
    step: int = dataclasses.field(init=False, default=3)


def test_a_dataclass_with_a_field_outside_init_moves_as_in_eager() -> None:
    batch = {"i": InitFalse(torch.ones(2))}
    batch["i"].step = 4
    if not dynamo_supports("copy"):  # torch 2.6 cannot copy it: refused, not rebuilt wrong
        with pytest.raises(RuntimeError, match=r"cannot rebuild a InitFalse inside torch\.compile"):
            _compiled(batch, "meta")
        return
    got = _compiled(batch, "meta")
    assert got["i"].step == 4 and got["i"].pixels.is_meta


def _old_dynamo_cases() -> dict[str, tuple[Any, str, str]]:
    """(what is moved, the device, what the error says) for each refusal."""
    model = nn.Linear(2, 2)
    holds = "the batch holds "
    return {
        "module": ({"m": model}, "meta", holds + "a module (Linear)"),
        "own_to": ({"o": OwnTo(torch.ones(1))}, "meta", holds + "a OwnTo with its own .to()"),
        "optimizer": (
            {"o": torch.optim.SGD(model.parameters(), lr=0.1)},
            "meta",
            holds + "an optimizer (SGD)",
        ),
        "module_argument": (model, "meta", "was given a module (Linear)"),
        "defaultdict": (
            {"d": defaultdict(list, n=torch.ones(1))},
            "meta",
            "cannot rebuild a defaultdict inside torch.compile",
        ),
        "init_false": ({"i": InitFalse(torch.ones(1))}, "meta", "cannot rebuild a InitFalse"),
        "userdict": ({"u": UserDict(a=1)}, "meta", "cannot rebuild a UserDict"),  # no tensor
        "meta": (
            {"x": torch.empty(2, device="meta")},
            "cpu",
            "a tensor of the batch is on meta: it has a shape (2,)",
        ),
    }


# the cases by name, so that collecting builds none (an optimizer's making imports Dynamo)
_OLD_DYNAMO_CASES = (
    "module", "own_to", "optimizer", "module_argument", "defaultdict", "init_false", "userdict",
    "meta",
)  # fmt: skip


@pytest.mark.skipif(
    "dynamo_supports('exceptions')", reason="torch >= 2.7 names the path (tests above)"
)
@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("case", _OLD_DYNAMO_CASES)
def test_an_old_dynamo_refuses_by_what_it_met(case: str, fullgraph: bool) -> None:
    cases = _old_dynamo_cases()
    assert tuple(cases) == _OLD_DYNAMO_CASES
    obj, spec, says = cases[case]
    before = [t for t in _leaves(obj) if isinstance(t, torch.Tensor)]
    compiled = torch.compile(_move, fullgraph=fullgraph, backend="eager")
    with pytest.raises(RuntimeError) as excinfo:
        compiled(obj, spec)
    message = _message(excinfo)
    assert says in message
    assert "move it outside the compiled function" in message or case == "meta"
    assert all(t.device.type == ("meta" if case == "meta" else "cpu") for t in before)
    held = [*obj.values()] if isinstance(obj, dict) else [obj]
    modules = [m for m in held if isinstance(m, nn.Module)]
    assert all(m.weight.device.type == "cpu" for m in modules)  # nothing moved
