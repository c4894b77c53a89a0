"""Property-based: any tree of supported containers and tensors survives move() unchanged in shape.

Structure, exact types, aliasing and non-tensor leaves are compared after a move to ``meta`` (on
every machine) and after a round trip through CUDA (values bit for bit) where a GPU exists.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict, UserList, defaultdict, namedtuple
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchplace

Point = namedtuple("Point", ["x", "y"])


class Tagged(list):  # type: ignore[type-arg]
    """A list subclass with an attribute, which a move must keep."""

    tag = "class"


def tagged(items: list[Any]) -> Tagged:
    out = Tagged(items)
    out.tag = "instance"
    return out


class Pair(tuple):  # type: ignore[type-arg]
    """A tuple subclass that is not a namedtuple."""


@dataclasses.dataclass(frozen=True)
class Box:
    content: Any
    tag: str = "box"


LEAVES = st.one_of(st.none(), st.integers(), st.text(max_size=3), st.floats(allow_nan=False))
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.int64, torch.bool, torch.bfloat16])


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    dtype = draw(DTYPES)
    return (
        (torch.arange(int(torch.tensor(shape).prod()) if shape else 1) % 5).reshape(shape).to(dtype)
    )


def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.text(min_size=1, max_size=3)
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(keys, children, max_size=4).map(OrderedDict),
        st.dictionaries(keys, children, max_size=4).map(lambda d: defaultdict(list, d)),
        st.tuples(children, children).map(lambda t: Point(*t)),
        st.tuples(children, children).map(torch.return_types.max),  # what torch.max returns
        st.lists(children, max_size=4).map(tagged),
        st.lists(children, max_size=4).map(Pair),
        st.lists(children, max_size=4).map(UserList),
        children.map(Box),
    )


TREES = st.recursive(st.one_of(LEAVES, tensors()), containers, max_leaves=20)


@st.composite
def aliased_trees(draw: st.DrawFn) -> Any:
    """A tree in which one tensor object appears in two places."""
    shared = draw(tensors())
    return {"a": draw(TREES), "shared": [shared, {"again": shared}]}


def assert_same_shape(before: Any, after: Any, device: torch.device, memo: dict[int, int]) -> None:
    """Same structure and types; tensors on ``device`` with aliasing mirrored one to one."""
    assert type(after) is type(before)
    if isinstance(before, torch.Tensor):
        assert after.device == device
        assert (after.shape, after.dtype) == (before.shape, before.dtype)
        if id(before) in memo:
            assert memo[id(before)] == id(after)  # same input tensor -> same output tensor
        memo[id(before)] = id(after)
    elif isinstance(before, dict):
        assert list(after) == list(before)
        if isinstance(before, defaultdict):
            assert after.default_factory is before.default_factory
        for key in before:
            assert_same_shape(before[key], after[key], device, memo)
    elif isinstance(before, (list, tuple, UserList)):
        if isinstance(before, Tagged):
            assert after.tag == before.tag
        assert len(after) == len(before)
        for x, y in zip(before, after, strict=True):
            assert_same_shape(x, y, device, memo)
    elif isinstance(before, Box):
        assert after.tag == before.tag
        assert_same_shape(before.content, after.content, device, memo)
    else:
        assert after == before or (after is before)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(TREES)
def test_any_tree_moves_to_meta_with_its_structure(tree: Any) -> None:
    moved = torchplace.move(tree, "meta")
    assert_same_shape(tree, moved, torch.device("meta"), {})
    assert torchplace.move(tree, "cpu") is tree  # already there: the very same object


@settings(max_examples=50, deadline=None)
@given(aliased_trees())
def test_aliasing_survives(tree: Any) -> None:
    moved = torchplace.move(tree, "meta")
    assert moved["shared"][0] is moved["shared"][1]["again"]
    assert_same_shape(tree, moved, torch.device("meta"), {})


@pytest.mark.requires_cuda
@settings(max_examples=25, deadline=None)
@given(TREES)
def test_any_tree_round_trips_through_cuda_bit_for_bit(tree: Any) -> None:
    there = torchplace.move(tree, "cuda:0")
    back = torchplace.move(there, "cpu")
    assert_same_shape(tree, back, torch.device("cpu"), {})
    for before, after in zip(_tensors(tree), _tensors(back), strict=True):
        assert torch.equal(before, after)


def _tensors(tree: Any) -> list[torch.Tensor]:
    from torchplace._tree import iter_leaves

    return [leaf for _, leaf in iter_leaves(tree) if isinstance(leaf, torch.Tensor)]


class _Refuses:
    def to(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("refused")


def test_paths_name_namedtuple_fields_and_none_keys() -> None:
    """An error or a straggler is named as the user's code names it: batch['pair'].boxes, and
    a dict key of None is a key like any other."""
    Pair = namedtuple("Pair", "boxes labels")
    batch = {"pair": Pair(torch.ones(1), 3), None: [_Refuses()]}
    stragglers = torchplace.stragglers({"pair": batch["pair"]}, "meta")
    assert [s.name for s in stragglers] == ["batch['pair'].boxes"]
    with pytest.raises(torchplace.MoveError, match=r"batch\[None\]\[0\]") as info:
        torchplace.move(batch, "meta")
    assert info.value.name == "batch[None][0]"
    with pytest.raises(torchplace.MoveError) as info:
        torchplace.move({"pair": Pair(1, _Refuses())}, "meta")
    assert info.value.name == "batch['pair'].labels"


def test_refusal_names_a_class_with_its_article() -> None:
    class Endless:  # an iterator whose name starts with a capital vowel
        def __iter__(self) -> Endless:
            return self

        def __next__(self) -> torch.Tensor:
            return torch.zeros(1)

    with pytest.raises(torchplace.TorchplaceError, match="was given an Endless, an iterator"):
        torchplace.move(Endless(), "meta")


def test_a_set_or_iterator_below_the_top_is_refused_naming_its_path() -> None:
    """Not passed over with its tensors left behind: refused with the path and what to put
    there, the caller's batch untouched; a set holding no tensor passes as it is."""
    t = torch.ones(1)
    model = torch.nn.Linear(2, 2)
    cases = [
        ({"ids": {t}, "x": t}, r"batch\['ids'\] is a set holding tensors.*a list or a dict"),
        ({"params": model.parameters()}, r"batch\['params'\] is a generator.*list\(\.\.\.\)"),
        ([(1, frozenset({t}))], r"batch\[0\]\[1\] is a frozenset holding tensors"),
        ({"d": {"a": t}.values()}, r"batch\['d'\] is a dict_values holding.*the dict itself"),
    ]
    for batch, message in cases:
        with pytest.raises(torchplace.TorchplaceError, match=message):
            torchplace.move(batch, "meta")
    assert next(iter(cases[0][0]["ids"])) is t and t.device.type == "cpu"
    assert next(model.parameters()).device.type == "cpu"  # the generator was not read
    plain = {"tags": {1, 2}, "x": t}
    out = torchplace.move(plain, "meta")
    assert out["tags"] is plain["tags"] and out["x"].is_meta


def test_the_looks_refuse_a_set_or_iterator_below_the_top_naming_its_path() -> None:
    """``where``, ``verify``, ``stragglers``, ``devices_of`` and ``report`` saw only the tensors
    beside a set: a meta tensor inside one passed ``verify(batch, "cpu")``. They now refuse it
    as ``move`` does, naming its path; a set of plain values is looked past."""
    t = torch.ones(1)
    hidden = torch.zeros(1, device="meta")
    batch = {"x": t, "ids": {hidden}}
    looks = [
        lambda b: torchplace.where(b),
        lambda b: torchplace.verify(b, "cpu"),
        lambda b: torchplace.stragglers(b, "cpu"),
        lambda b: torchplace.devices_of(b),
        lambda b: torchplace.report(b),
    ]
    for look in looks:
        with pytest.raises(
            torchplace.TorchplaceError,
            match=r"batch\['ids'\] is a set holding tensors: it has no keys or order to name its "
            r"tensors by, so they would go unseen",
        ):
            look(batch)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(torchplace.TorchplaceError, match=r"batch\[0\] is a generator.*unseen"):
        torchplace.where([model.parameters()])
    assert next(model.parameters()).device.type == "cpu"  # the generator was not read
    plain = {"tags": {1, 2}, "x": t}
    assert torchplace.where(plain) == torch.device("cpu")
    torchplace.verify(plain, "cpu")
    # A set of modules hides their tensors as well (move refuses it too).
    meta_model = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(torchplace.TorchplaceError, match=r"batch\['models'\] is a set holding"):
        torchplace.verify({"x": t, "models": {meta_model}}, "cpu")
    with pytest.raises(torchplace.TorchplaceError, match=r"batch\['models'\] is a set holding"):
        torchplace.move({"x": t, "models": {meta_model}}, "cpu")

    # Inside an object with its own .to(), which move hands the move to, nothing is refused.
    class GraphBatch:
        def __init__(self) -> None:
            self.x = torch.ones(2)
            self.ids = itertools.count()

        def to(self, device: object) -> GraphBatch:
            self.x = self.x.to(device)  # type: ignore[arg-type]
            return self

    graph = GraphBatch()
    assert torchplace.move(graph, "cpu").x.device.type == "cpu"
    assert torchplace.where(graph) == torch.device("cpu")
    torchplace.verify(graph, "cpu")
    # A list met first inside such an object, then beside it: refused where met beside it,
    # whichever comes first.
    inner = [{torch.zeros(1), torch.ones(1)}]
    for batch in ({"a": GraphBatch(), "b": inner}, {"b": inner, "a": GraphBatch()}):
        batch["a"].held = inner  # type: ignore[attr-defined]
        with pytest.raises(torchplace.TorchplaceError, match=r"batch\['b'\]\[0\] is a set"):
            torchplace.where(batch)
