"""Walking nested batches: which containers torchplace looks into, and how it rebuilds them.

Containers (docs/design.md): dict, OrderedDict, defaultdict (factory kept), other Mappings that can
be rebuilt, list, tuple, namedtuple (exact class), subclasses of list and tuple (exact class:
``torch.return_types`` such as ``torch.max``'s, a list subclass with its attributes) and
``UserList``, dataclasses (a new instance, frozen ones and
``init=False`` fields included), and any object with its own ``.to(device)`` method. Modules and
optimizers inside a batch are handed to the caller. A set or dict view holding tensors and an
iterator are refused (``TorchplaceError`` naming the path): passed over, their tensors would stay
behind unseen. Everything else is a leaf and passes unchanged.

``map_tensors`` is the hot path of every move, so it is a hand-written recursion that allocates
nothing for a subtree in which no tensor changed: such a subtree comes back as the very same
object (moving a batch to the device it is already on returns the batch itself). Measured against
``torch.utils._pytree`` and ``optree`` in ``benchmarks/bench_tree.py``.
"""

from __future__ import annotations

import copy
import copyreg
import dataclasses
import io
from collections import OrderedDict, UserDict, UserList, defaultdict
from collections.abc import (
    Callable,
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
    MutableSequence,
    Sequence,
)
from typing import Any, cast

import torch
from torch import nn

from ._errors import TorchplaceError
from ._model_walk import cached_property_names

__all__ = [
    "Located",
    "cached_properties",
    "format_path",
    "iter_leaves",
    "map_tensors",
    "opaque_tensors",
    "read_attribute",
    "refuse_unwalkable",
]

# How deep a batch may nest before torchplace calls it a mistake. Real batches nest a handful of
# levels; this stays far below Python's recursion limit.
MAX_DEPTH = 200

_LEAF, _TENSOR, _DICT, _LIST, _TUPLE, _NAMEDTUPLE, _MAPPING, _DATACLASS, _TO, _OWNER = range(10)
# Subclasses of list (and mutable sequences that say how to copy themselves, like UserList) and
# of tuple (torch.return_types such as torch.max's (values, indices), and users' own).
_LIST_LIKE, _TUPLE_LIKE = 10, 11
# What a walk would pass over although it may hold tensors: a set or dict view (no keys or order
# to put moved tensors back by) holding some, and any iterator (reading it would use it up).
_REFUSED = 12
_SEQUENCES = (_LIST, _TUPLE, _NAMEDTUPLE, _LIST_LIKE, _TUPLE_LIKE)
_MAPPINGS = (_DICT, _MAPPING)
_ITEMS = frozenset(_SEQUENCES + _MAPPINGS)

# The kinds of the common types, never changed; ``_kinds`` adds every other type met, once.
_BASE_KINDS: dict[type, int] = {
    torch.Tensor: _TENSOR,
    nn.Parameter: _TENSOR,
    dict: _DICT,
    list: _LIST,
    tuple: _TUPLE,
    int: _LEAF,
    float: _LEAF,
    str: _LEAF,
    bytes: _LEAF,
    bool: _LEAF,
    type(None): _LEAF,
}
_kinds: dict[type, int] = dict(_BASE_KINDS)


def _classify(cls: type) -> int:
    """The kind of ``cls``, worked out once per type (``_kind_of``) and remembered."""
    kind = _kinds.get(cls)
    if kind is None:
        kind = _kinds[cls] = _kind_of(cls)
    return kind


def _kind_of(cls: type) -> int:
    """The kind of ``cls``, worked out afresh: while torch.compile traces, a type met for the
    first time would change ``_kinds``, on which Dynamo guards, compiling every function that
    moves anything again at its next call."""
    kind = _BASE_KINDS.get(cls)
    if kind is not None:
        return kind
    if issubclass(cls, torch.Tensor):
        kind = _TENSOR
    elif issubclass(cls, (nn.Module, torch.optim.Optimizer)):
        kind = _OWNER
    elif callable(getattr(cls, "to", None)) and getattr(cls, "to", None) is not getattr(
        tuple, "to", None
    ):
        kind = _TO
    elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
        kind = _NAMEDTUPLE
    elif issubclass(cls, tuple):
        kind = _TUPLE_LIKE
    elif issubclass(cls, list) or (
        issubclass(cls, MutableSequence) and getattr(cls, "__copy__", None) is not None
    ):
        kind = _LIST_LIKE
    elif issubclass(cls, Mapping) and (not dataclasses.is_dataclass(cls) or issubclass(cls, dict)):
        # A dict that is a dataclass (Hugging Face's ModelOutput) is rebuilt as a mapping: only
        # its item assignment keeps its items, its attributes and to_tuple() in step. Other
        # mapping dataclasses are rebuilt field by field, as dataclasses.
        kind = _MAPPING
    elif dataclasses.is_dataclass(cls):
        kind = _DATACLASS
    elif issubclass(cls, (set, frozenset, *_VIEWS)) or (
        issubclass(cls, Iterator) and not issubclass(cls, io.IOBase)  # a file is no batch part
    ):
        kind = _REFUSED
    else:
        kind = _LEAF
    if issubclass(cls, (UserDict, UserList)) and torch.compiler.is_compiling():
        from ._dynamo_compat import traced_supports  # only while tracing: it needs Dynamo

        if not traced_supports("exceptions"):  # torch 2.6 cannot even look inside one
            raise _untraceable(cls)
    return kind


_NO_KEY = object()  # no key is being walked (a dict key may be None)
_VIEWS: tuple[type, ...] = (type({}.keys()), type({}.values()), type({}.items()))


class Located(Exception):
    """Carries an exception raised at some leaf up to the entry point, gathering its path.

    Made as ``Located(cause, [])``: with no ``__init__`` of its own, torch.compile can trace
    building one (it cannot trace a call to a built-in exception's ``__init__``).
    """

    @property
    def cause(self) -> BaseException:
        return cast(BaseException, self.args[0])

    @property
    def keys(self) -> list[tuple[bool, Any]]:
        """(is_attribute, key) pairs, innermost first."""
        return cast("list[tuple[bool, Any]]", self.args[1])

    def path(self, root: str) -> str:
        return format_path(root, reversed(self.keys))


def format_path(root: str, keys: Any) -> str:
    """``batch['images'][2]`` or ``batch.pixels`` from a root name and (is_attribute, key) pairs.

    >>> from torchplace._tree import format_path
    >>> format_path("batch", [(False, "images"), (False, 2), (True, "mask")])
    "batch['images'][2].mask"
    """
    parts = [root]
    for is_attr, key in keys:
        parts.append(f".{key}" if is_attr else f"[{key!r}]")
    return "".join(parts)


class _TooDeep(Exception):
    pass


class _Unwalkable(Exception):
    """A set or dict view holding tensors, or an iterator, met below the top of a walk: carried
    up as the cause of a ``Located`` for its path, then said as a ``TorchplaceError``."""

    @property
    def node(self) -> Any:
        return self.args[0]


_UNSET = object()


def _rebuild_mapping(obj: Mapping[Any, Any], changed: dict[Any, Any]) -> Mapping[Any, Any]:
    """A new mapping of ``obj``'s exact type with the changed values, ``obj`` left untouched."""
    if torch.compiler.is_compiling():
        return _rebuild_traced(obj, changed)
    if isinstance(obj, dict) or (
        isinstance(obj, MutableMapping) and getattr(type(obj), "__copy__", None) is not None
    ):
        # A dict subclass (OrderedDict, a defaultdict with its factory, one with attributes or
        # another constructor) or a mapping that says how to copy itself (UserDict): copy, then
        # set. Other mutable mappings may keep their items in a shared attribute, where a
        # shallow copy's writes would land in the caller's batch.
        new = copy.copy(obj)
        for key, value in changed.items():
            new[key] = value
        return new
    items = {key: changed.get(key, value) for key, value in obj.items()}
    try:
        return type(obj)(items)  # type: ignore[call-arg]
    except Exception as exc:
        raise TypeError(
            f"cannot rebuild the {type(obj).__name__} mapping with moved tensors: "
            f"{type(obj).__name__}(dict) failed ({exc}); use a dict, give the class a __copy__ "
            "or a constructor that takes a dict"
        ) from exc


def _rebuild_traced(obj: Any, changed: dict[Any, Any]) -> Mapping[Any, Any]:
    """A mapping rebuilt while torch.compile traces, by its constructor: the copy that
    ``_rebuild_mapping`` makes can lose items under Dynamo (an OrderedDict's None values), so
    kinds other than these are refused rather than rebuilt wrong."""
    from ._dynamo_compat import traced_supports  # only while tracing: it needs Dynamo

    cls = type(obj)
    if cls is OrderedDict:
        return OrderedDict((key, changed.get(key, value)) for key, value in obj.items())
    if cls is defaultdict and traced_supports("defaultdict"):  # else one comes back a dict
        items = {key: changed.get(key, value) for key, value in obj.items()}
        return defaultdict(obj.default_factory, items)
    raise _untraceable(cls)


def _untraceable(cls: type) -> TypeError:
    """Called only while torch.compile traces."""
    from ._dynamo_compat import raise_in_trace, traced_supports

    message = (
        f"torchplace cannot rebuild a {cls.__name__} inside torch.compile; use a dict, list, "
        "tuple, namedtuple or dataclass there, or move it outside the compiled function"
    )
    if not traced_supports("exceptions"):  # torch 2.6: said now, as it cannot say where
        raise_in_trace(TypeError, message)
    return TypeError(message)


def _rebuild_dataclass_traced(node: Any, updates: dict[str, Any]) -> Any:
    """A dataclass rebuilt with ``updates`` while torch.compile traces: copied and updated as
    in eager where Dynamo can copy it, else (torch 2.6) by its constructor, which only gives
    the same object for a class whose fields all go through ``__init__`` and that has no
    ``__post_init__`` to run again; any other class is refused rather than rebuilt wrong."""
    from ._dynamo_compat import traced_supports  # only while tracing: it needs Dynamo

    if traced_supports("copy"):
        result = copy.copy(node)
    else:
        cls = type(node)
        fields = dataclasses.fields(node)
        if hasattr(cls, "__post_init__") or not all(field.init for field in fields):
            raise _untraceable(cls)
        result = cls(**{field.name: getattr(node, field.name) for field in fields})
    for name, value in updates.items():
        object.__setattr__(result, name, value)  # frozen dataclasses too
    return result


def _rebuild_sequence(obj: Sequence[Any], values: list[Any]) -> Sequence[Any]:
    """A new sequence of ``obj``'s exact type holding ``values``, ``obj`` left untouched."""
    if isinstance(obj, tuple):
        # torch.return_types take one sequence, as tuple does; a subclass whose constructor
        # takes its items one by one would wrap them instead, so the result is checked.
        cls: Any = type(obj)
        for star in (False, True):
            try:
                rebuilt = cls(*values) if star else cls(values)
            except Exception:
                continue
            if len(rebuilt) == len(values) and all(
                a is b for a, b in zip(rebuilt, values, strict=True)
            ):
                return rebuilt  # type: ignore[no-any-return]
        raise TypeError(
            f"cannot rebuild the {cls.__name__} tuple with moved tensors: neither "
            f"{cls.__name__}([...]) nor {cls.__name__}(*items) gives back the items; use a "
            "tuple or a namedtuple, or give the class a constructor that takes one sequence"
        )
    if torch.compiler.is_compiling():  # copying it may lose items under Dynamo
        raise _untraceable(type(obj))
    new = copy.copy(obj)  # a list subclass keeps its attributes; UserList copies its items
    if isinstance(new, list):
        new[:] = values
    else:  # UserList, deque (maxlen kept) and other mutable sequences
        new.clear()  # type: ignore[attr-defined]
        new.extend(values)  # type: ignore[attr-defined]
    return new


def map_tensors(
    obj: Any,
    fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    to: Callable[[Any], Any] | None = None,
    owner: Callable[[Any], Any] | None = None,
    root: str = "batch",
    refuse: bool = True,
) -> Any:
    """Apply ``fn`` to every tensor in ``obj``, rebuilding only the containers that changed.

    ``to`` handles objects with their own ``.to`` method and ``owner`` modules and optimizers
    (both default to passing the object through). An exception from any of them is re-raised as
    ``Located`` carrying the path of the object that failed; cycles, absurd nesting and, with
    ``refuse`` (a batch given to torchplace), a set or dict view holding tensors and an iterator
    raise ``TorchplaceError`` naming the path. Without it (a model's own arguments, which
    ``dispatch`` moves as they come) those pass as they are.

    No exception of torchplace's own is raised here with ``raise ... from``: the Dynamo of
    torch 2.11 fails inside itself setting the ``__cause__`` of a user's exception class
    while it traces, and the user would read that instead of the error (eagerly, Python still
    chains the exception handled as ``__context__``).

    >>> import torch
    >>> from torchplace._tree import map_tensors
    >>> batch = {"x": [torch.ones(2)], "n": 3}
    >>> map_tensors(batch, lambda t: t * 2)
    {'x': [tensor([2., 2.])], 'n': 3}
    >>> map_tensors(batch, lambda t: t) is batch
    True
    """
    # Containers met before, by id, so that one shared (or met twice) is rebuilt once. Not while
    # torch.compile traces: the Dynamo of older torch (2.6) cannot take the id of a dict, list
    # or tuple.
    tracing = torch.compiler.is_compiling()
    memo: dict[int, Any] | None = None if tracing else {}
    classify, kinds, dataclass_items = (
        (_kind_of, _BASE_KINDS, _dataclass_items_traced)
        if tracing
        else (_classify, _kinds, _dataclass_items)
    )
    tensor_cls = torch.Tensor  # read once: a global and an attribute per value otherwise

    def walk(node: Any, depth: int) -> Any:
        """``node`` rebuilt with ``fn`` applied, or None when nothing in it changed: never
        compared with ``node`` by identity, which torch.compile cannot do for a rebuilt tuple."""
        cls = type(node)
        kind = kinds.get(cls)
        if kind is None:
            kind = classify(cls)
        if kind == _TENSOR:
            try:
                new = fn(node)
            except Exception as exc:
                raise Located(exc, [])  # noqa: B904 (no `from`: see the docstring)
            return None if new is node else new
        if kind == _LEAF:
            return None
        if memo is not None:
            done = memo.get(id(node))
            if done is not None:
                return done
        if depth > MAX_DEPTH:
            raise _TooDeep
        depth += 1
        key: Any = _NO_KEY  # the key being walked, for the path of an error below it
        is_attr = False
        try:
            if kind in _ITEMS:  # one loop for mappings and sequences, by key or index
                # What changed, allocated only when something moves: the new values by key for
                # a mapping, a copy of a sequence with its new values in place.
                is_mapping = kind in _MAPPINGS
                changed: Any = None
                for key, value in node.items() if is_mapping else enumerate(node):
                    leaf = type(value)  # the common leaves, without a call to walk
                    if leaf is tensor_cls:
                        try:
                            new = fn(value)
                        except Exception as exc:
                            raise Located(exc, [])  # noqa: B904 (no `from`: see the docstring)
                        if new is value:
                            continue
                    elif kinds.get(leaf) == _LEAF:
                        continue
                    else:
                        new = walk(value, depth)
                        if new is None:
                            continue
                    if changed is None:
                        changed = {} if is_mapping else list(node)
                    changed[key] = new
                if changed is None:
                    return None
                key = _NO_KEY
                if kind == _DICT:
                    result: Any = dict(node)  # a copy and an update, both in C: keys keep order
                    result.update(changed)
                elif kind == _MAPPING:
                    result = _rebuild_mapping(node, changed)
                else:
                    values = changed
                    if kind == _LIST:
                        result = values
                    elif kind == _TUPLE:
                        result = tuple(values)
                    elif kind == _NAMEDTUPLE:
                        result = cls(*values)
                    else:
                        result = _rebuild_sequence(node, values)
            elif kind == _DATACLASS:
                is_attr = True
                updates = {}
                for key, value in dataclass_items(node):
                    new = walk(value, depth)
                    if new is not None:
                        updates[key] = new
                if not updates:
                    return None
                key = _NO_KEY
                if tracing:
                    result = _rebuild_dataclass_traced(node, updates)
                else:
                    result = copy.copy(node)
                    for name, value in updates.items():
                        object.__setattr__(result, name, value)  # frozen dataclasses too
            else:
                if kind == _REFUSED:
                    if refuse and (isinstance(node, Iterator) or _holds_tensors(node)):
                        raise _Unwalkable(node)
                    return None
                handler = to if kind == _TO else owner
                if handler is None:
                    return None
                result = handler(node)
                if result is node:
                    return None
        except Located as located:
            if key is not _NO_KEY:  # None is a key like any other
                # Named by its field for a namedtuple: batch.pair.boxes, not [0]. A new Located
                # rather than the list appended to: torch.compile would drop that change.
                here = (True, node._fields[key]) if kind == _NAMEDTUPLE else (is_attr, key)
                raise Located(located.cause, [*located.keys, here])  # noqa: B904
            raise
        except _TooDeep:
            raise
        except Exception as exc:  # rebuilding failed, or a .to() / owner handler raised
            raise Located(exc, [])  # noqa: B904 (no `from`: see the docstring)
        if memo is not None:
            memo[id(node)] = result
        return result

    too_deep = False
    unwalkable: Located | None = None
    try:
        new = walk(obj, 0)
    except (_TooDeep, RecursionError):
        too_deep = True  # raised below, outside this handler: no RecursionError chained to it
    except Located as located:
        if not isinstance(located.cause, _Unwalkable):
            raise
        unwalkable = located  # raised below, outside this handler, as too_deep is
    finally:
        # walk refers to itself through its closure: a cycle holding the memo (and so every
        # rebuilt container) until the garbage collector runs. Broken here, it is freed at once;
        # by rebinding, not `del`, which torch.compile cannot trace (DELETE_DEREF).
        walk = None  # type: ignore[assignment]
    if too_deep:
        raise TorchplaceError(_depth_message(obj, root))
    if unwalkable is not None:
        cause = cast(_Unwalkable, unwalkable.cause)
        raise TorchplaceError(_unwalkable_message(cause.node, unwalkable.path(root)))
    return obj if new is None else new


def refuse_unwalkable(obj: Any, verb: str) -> None:
    """Refuse, with the way out, an object handed to ``move`` or a look (``verify``, ``where``)
    that torchplace would silently pass over although it holds tensors.

    An iterator (``model.parameters()`` is a generator) would be used up by reading it; a set
    or a dict view has no keys or order to put moved tensors back by; a bound method
    (``model.state_dict`` without its call) is the method, not its result. Below the top,
    ``map_tensors`` refuses the first two itself, naming their path.
    """
    cls = type(obj)
    if (_kind_of(cls) if torch.compiler.is_compiling() else _classify(cls)) not in (
        _LEAF,
        _REFUSED,
    ):
        return
    what = _a(cls)
    rest = ", ..." if verb in ("move", "verify", "stragglers") else ""  # the device, and more
    if isinstance(obj, Iterator):
        raise TorchplaceError(
            f"torchplace.{verb} was given {what}, an iterator ({_ITERATOR_HINT}), which it "
            f"would use up by reading it; pass the model itself, torchplace.{verb}(model{rest}), "
            "or a list of what the iterator yields, list(...)"
        )
    if isinstance(obj, (set, frozenset, *_VIEWS)):
        if _holds_tensors(cast(Iterable[Any], obj)):
            raise TorchplaceError(
                f"torchplace.{verb} was given {what} holding tensors: it has no keys or order "
                f"to name the tensors by or to put moved ones back by; pass {_set_fix(obj)}"
            )
        return
    owner = getattr(obj, "__self__", None)
    if callable(obj) and isinstance(owner, (nn.Module, torch.optim.Optimizer)):
        name = getattr(obj, "__name__", "method")
        raise TorchplaceError(
            f"torchplace.{verb} was given the method {type(owner).__name__}.{name}, not what "
            f"it returns; call it: torchplace.{verb}(model.{name}(){rest})"
        )


def _a(cls: type) -> str:
    return ("an " if cls.__name__[0].lower() in "aeiou" else "a ") + cls.__name__


def _holds_tensors(items: Iterable[Any]) -> bool:
    """Whether a set or dict view holds a tensor, or a module or optimizer (which hold them),
    at any depth (items of plain types, the usual set of strings, are passed without a walk of
    their own)."""
    return any(True for item in items if type(item) not in _PLAIN for _ in iter_leaves(item))


_PLAIN = frozenset({str, int, float, bool, bytes, type(None)})


def _set_fix(obj: Any) -> str:
    return "the dict itself" if isinstance(obj, _VIEWS) else "a list or a dict of them"


def _unwalkable_message(node: Any, path: str, *, looking: bool = False) -> str:
    """Why ``node``, met at ``path`` inside a batch, is refused, and what to put there
    (``looking``: by a look, which names tensors, rather than by a move)."""
    what = _a(type(node))
    if isinstance(node, Iterator):
        left = "unseen" if looking else "where they are"
        return (
            f"{path} is {what}, an iterator ({_ITERATOR_HINT}), which torchplace would use up "
            f"by reading it, its tensors left {left}; put a list of what it yields there, "
            "list(...)"
        )
    if looking:
        return (
            f"{path} is {what} holding tensors: it has no keys or order to name its tensors "
            f"by, so they would go unseen (and move refuses it); put {_set_fix(node)} there"
        )
    return (
        f"{path} is {what} holding tensors: it has no keys or order to put moved tensors back "
        f"by, so they would be left where they are; put {_set_fix(node)} there"
    )


_ITERATOR_HINT = "model.parameters(), .buffers() and .named_parameters() are generators"


def _depth_message(obj: Any, root: str) -> str:
    """Explains why a walk went too deep: a cycle (with its path) or absurd nesting."""
    on_path: dict[int, str] = {}

    def search(node: Any, path: str, depth: int) -> str | None:
        if _classify(type(node)) in (_LEAF, _TENSOR, _TO, _OWNER, _REFUSED):
            return None
        if id(node) in on_path:
            return (
                f"{path} is {on_path[id(node)]} itself: the object contains a cycle, which "
                "torchplace cannot move or inspect; break the cycle (store a key or index "
                "instead of the container)"
            )
        if depth > MAX_DEPTH:
            return (
                f"{path} is nested more than {MAX_DEPTH} containers deep; torchplace walks "
                "batches recursively and stops here: flatten the structure"
            )
        on_path[id(node)] = path
        for is_attr, key, child in _children(node):
            child_path = path + (f".{key}" if is_attr else f"[{key!r}]")
            found = search(child, child_path, depth + 1)  # noqa: F821 (deleted once done)
            if found:
                return found
        del on_path[id(node)]
        return None

    try:
        found = search(obj, root, 0)
    except RecursionError:
        found = None
    finally:
        del search  # it refers to itself: break the cycle so it is freed at once
    return found or f"{root} is nested too deeply for torchplace to walk; flatten the structure"


def _children(node: Any) -> Iterator[tuple[bool, Any, Any]]:
    """The (is_attribute, key, child) triples of a container, for looking (not rebuilding)."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield False, key, value
    elif _classify(type(node)) == _NAMEDTUPLE:  # named by its fields, as its code names them
        for name, value in zip(node._fields, node, strict=True):
            yield True, name, value
    elif isinstance(node, Sequence):  # only containers reach here: never str or bytes
        for index, value in enumerate(node):
            yield False, index, value
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for key, value in _dataclass_items(node):
            yield True, key, value
    elif _classify(type(node)) == _TO:  # its own .to() moves what its attributes hold
        for name, value in _attributes(node):
            yield True, name, value


_cached_names: dict[type, tuple[str, ...]] = {}


def cached_properties(cls: type) -> tuple[str, ...]:
    """The names of ``cls``'s ``functools.cached_property`` attributes (their values live in
    the instance's ``__dict__`` once computed)."""
    if torch.compiler.is_compiling():  # remembered, it would make Dynamo compile again
        from ._dynamo_compat import traced_cached_property_names

        return traced_cached_property_names(cls)
    names = _cached_names.get(cls)
    if names is None:
        names = _cached_names[cls] = cached_property_names(cls)
    return names


def read_attribute(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.name``, or ``default`` when reading it raises anything at all.

    What cannot be read holds no tensor a walk could find: an unset field or slot, or a
    property that raises (a Hugging Face config refuses to give one value for a per-layer
    ``head_dim``). ``Module.to`` never reads such attributes, so a walk skips them and a
    rebuilt object keeps them as they were, rather than failing over them.
    """
    try:
        return getattr(obj, name)
    except Exception:
        return default


def _dataclass_items(node: Any) -> Iterator[tuple[str, Any]]:
    """A dataclass's fields that are set (an ``init=False`` field may not be), then the values
    its ``cached_property`` attributes computed, so that no cached tensor stays behind."""
    for field in dataclasses.fields(node):
        value = read_attribute(node, field.name, _UNSET)
        if value is not _UNSET:
            yield field.name, value
    cached = cached_properties(type(node))
    if cached:
        attrs = getattr(node, "__dict__", {})
        for name in cached:
            value = attrs.get(name, _UNSET)
            if value is not _UNSET:
                yield name, value


def _dataclass_items_traced(node: Any) -> Iterator[tuple[str, Any]]:
    """``_dataclass_items`` while torch.compile traces, telling ``_UNSET`` by its type: torch
    2.6's Dynamo fails on ``is`` between it and an int field that it has made dynamic (one that
    changed from one call to the next)."""
    for key, value in _dataclass_items_unset(node):
        if type(value) is not object:
            yield key, value


def _dataclass_items_unset(node: Any) -> Iterator[tuple[str, Any]]:
    for field in dataclasses.fields(node):
        yield field.name, read_attribute(node, field.name, _UNSET)
    cached = cached_properties(type(node))
    if cached:
        attrs = getattr(node, "__dict__", {})
        for name in cached:
            yield name, attrs.get(name, _UNSET)


def opaque_tensors(obj: Any, root: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors an object of no kind torchplace walks keeps in its attributes (one level,
    then their contents): ``move`` leaves such an object as it is, so they stay where they are.
    Nothing for a tensor, a container, a module, an object with its own ``.to``, or a plain
    value."""
    if _classify(type(obj)) != _LEAF:
        return
    for name, value in _attributes(obj):
        for path, leaf in iter_leaves(value, f"{root}.{name}", skip_cycles=True):
            if isinstance(leaf, torch.Tensor):
                yield path, leaf


def _attributes(obj: Any) -> Iterator[tuple[str, Any]]:
    """The instance attributes of ``obj``: its ``__dict__`` and the slots of its classes."""
    names = dict.fromkeys(getattr(obj, "__dict__", {}))
    names.update(dict.fromkeys(copyreg._slotnames(type(obj))))  # type: ignore[attr-defined]
    for name in names:
        value = read_attribute(obj, name, _UNSET)
        if value is not _UNSET:
            yield name, value


def iter_leaves(
    obj: Any, root: str = "batch", *, skip_cycles: bool = False, refuse: bool = False
) -> Iterator[tuple[str, Any]]:
    """Every tensor, module and optimizer in ``obj`` with its path, each object once.

    Looks inside objects with their own ``.to`` method: into their items when they are mappings,
    sequences or dataclasses (tokenizer outputs, TensorDict), else into their attributes (a
    graph batch class), so that nothing ``move`` moves goes unseen.
    A cycle raises ``TorchplaceError``, unless ``skip_cycles`` (a module's own attributes, which
    ``Module.to`` never walks, may be cyclic configuration): then the way back is not followed.
    With ``refuse`` (the looks: ``verify``, ``where``, ``report``), a set or dict view holding
    tensors, or an iterator, raises ``TorchplaceError`` naming its path, as ``move`` refuses it:
    its tensors would go unseen (not inside an object with its own ``.to()``, which ``move``
    hands the move to). Else it is passed over.

    >>> import torch
    >>> from torchplace._tree import iter_leaves
    >>> t = torch.zeros(1)
    >>> [path for path, _ in iter_leaves({"a": [t, t], "b": 1})]
    ["batch['a'][0]"]
    """
    seen: set[int] = set()  # the leaves yielded
    walked: dict[int, bool] = {}  # the containers walked, and whether refusing then
    on_path: set[int] = set()

    def visit(node: Any, path: str, depth: int, refusing: bool) -> Iterator[tuple[str, Any]]:
        kind = _classify(type(node))
        if kind == _LEAF:
            return
        if kind in (_TENSOR, _OWNER):
            if id(node) not in seen:
                seen.add(id(node))
                yield path, node
            return
        if id(node) in on_path and (skip_cycles or kind == _TO):
            return  # a .to() object's attributes may point back at it (a parent link)
        if id(node) in on_path or depth > MAX_DEPTH:
            raise TorchplaceError(_depth_message(obj, root))
        if id(node) in walked and (walked[id(node)] or not refusing):
            return  # walked already, refusing as now or more (first met below a .to(): again)
        if kind == _REFUSED:
            if refusing and (isinstance(node, Iterator) or _holds_tensors(node)):
                raise TorchplaceError(_unwalkable_message(node, path, looking=True))
            return
        walked[id(node)] = refusing
        on_path.add(id(node))
        # Below an object with its own .to(), move refuses nothing (its .to() moves it): nor do
        # the looks.
        below = refusing and kind != _TO
        for is_attr, key, child in _children(node):
            child_path = path + (f".{key}" if is_attr else f"[{key!r}]")
            yield from visit(child, child_path, depth + 1, below)  # noqa: F821 (deleted once done)
        on_path.discard(id(node))

    try:
        yield from visit(obj, root, 0, refuse)
    except RecursionError:
        raise TorchplaceError(_depth_message(obj, root)) from None
    finally:
        del visit  # it refers to itself: break the cycle so it is freed at once
