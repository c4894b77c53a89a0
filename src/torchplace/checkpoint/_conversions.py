"""Hugging Face weight conversions: a ``save_pretrained`` file's hub names fitted to the model's.

transformers 5 saves a model under its *hub* names: MoE experts the model fuses into one tensor
are written one tensor per expert (``mlp.experts.0.gate_proj.weight``, ...), and some keys are
renamed (GPT-NeoX's ``lm_head`` is ``embed_out`` on the hub). ``from_pretrained`` converts them
back on load with the model's own conversion mapping; ``load_into`` does the same, with the same
mapping, taken from the installed transformers when it is used (nothing is copied from it):

1. *Names.* Each file key goes through ``transformers.core_model_loading.rename_source_key``
   with the transforms ``transformers.conversion_mapping.get_model_conversion_mapping(model)``
   gives, and the keys one converter gathers are grouped per model tensor, in the order
   ``from_pretrained`` gathers them (``dot_natural_key``). A key whose new name the model lacks
   keeps its file name, as there.
2. *Values.* Each converter is run once on ``meta`` tensors under a ``TorchFunctionMode`` that
   records what it does. Stacking (``MergeModulelist``), concatenating (``Concatenate``),
   chunking and splitting (``Chunk``, ``Split``) and transposing (``Transpose``) are pieces into
   views: each file tensor (or a slice of it) is copied straight into its slice of the model's
   tensor, the fused tensor allocated once (``Plan.fused``). A converter that does anything else
   (``PermuteForRope``, ``Interleave``, a quantizer's ops) is run by transformers itself on the
   file's tensors once they are read (``Plan.computed``), and its result is the model's tensor.

A plan depends only on names, shapes and dtypes (a catalog), never on values, so the reader
decides how bytes reach the views: ``apply_plan`` copies tensors already read (``_fill``), and
``fused_boxes`` gives a rank of a sharded model the parts of each piece that fall in the slice it
holds (``_sharded``). Models that are not transformers models get no plan.

transformers 4.x has no conversion mapping; its ``from_pretrained`` renames each file key
instead (``_legacy_renamer``): the model's ``_fix_state_dict_key_on_load`` (``LayerNorm.gamma``
is ``LayerNorm.weight``), then, for the multimodal classes ``modeling_utils.VLMS`` names, the
first pattern of the class's ``_checkpoint_conversion_mapping`` that matches (its
``save_pretrained`` writes ``language_model.model.*`` for ``model.language_model.*``). Those
renames are the whole plan there.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import importlib.util
import re
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .._errors import CheckpointError
from ._plan_items import Box

__all__ = [
    "Computed",
    "Fused",
    "Piece",
    "Plan",
    "apply_plan",
    "apply_views",
    "conversion_plan",
    "converted",
    "fused_boxes",
    "hub_plan",
    "may_convert",
]

View = tuple[Any, ...]  # ("select", dim, i) | ("narrow", dim, start, length) | ("transpose", a, b)


def apply_views(t: torch.Tensor, views: Sequence[View], /) -> torch.Tensor:
    """``t`` seen through ``views`` in order (no copy: each step is a view).

    >>> apply_views(torch.arange(6).view(2, 3), [("transpose", 0, 1), ("select", 0, 2)])
    tensor([2, 5])
    """
    for view in views:
        kind = view[0]
        if kind == "select":
            t = t.select(view[1], view[2])
        elif kind == "narrow":
            t = t.narrow(view[1], view[2], view[3])
        else:
            t = t.transpose(view[1], view[2])
    return t


@dataclasses.dataclass(frozen=True)
class Piece:
    """One file tensor (seen through ``source_views``) that lands in ``dest_views`` of a model
    tensor: ``apply_views(dest, dest_views).copy_(apply_views(source, source_views))``."""

    source: str
    source_views: tuple[View, ...]
    dest_views: tuple[View, ...]


@dataclasses.dataclass
class Fused:
    """A model tensor assembled from pieces of file tensors, each copied into its own slice."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]


@dataclasses.dataclass
class Computed:
    """Model tensors that transformers' own converter computes from whole file tensors (read
    first, then converted, as ``from_pretrained`` does): ``run`` takes the file's tensors by name
    and returns the model's by name."""

    names: list[str]
    shapes: list[tuple[tuple[int, ...], torch.dtype]]
    sources: list[str]
    run: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclasses.dataclass
class Plan:
    """How a file's names become the model's: whole tensors renamed, fused ones, computed ones.

    ``renames`` maps a model name to the file name that holds it whole; file keys that are in
    none of the three keep their names (the model's own, or unexpected). ``mismatched`` gives
    the shape a converter would build for a model tensor whose shape differs (a file missing an
    expert), and ``mismatched_sources`` the file keys it would be built from (each with the
    first model tensor of its converter). ``lacking`` gives
    the file keys a model tensor cannot be built without, where the file holds some of its
    pieces but not all (one projection of one expert), and ``lacking_sources`` those it holds
    (each file key, with the model tensor it is a piece of): taken by the plan, so that the
    tensor is reported missing for what the file lacks, not its pieces as unexpected.
    """

    renames: dict[str, str] = dataclasses.field(default_factory=dict)
    fused: list[Fused] = dataclasses.field(default_factory=list)
    computed: list[Computed] = dataclasses.field(default_factory=list)
    mismatched: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    mismatched_sources: dict[str, str] = dataclasses.field(default_factory=dict)
    lacking: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    lacking_sources: dict[str, str] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.renames or self.fused or self.computed or self.mismatched or self.lacking)

    def consumed(self) -> set[str]:
        """Every file key the plan takes."""
        used = set(self.renames.values())
        used.update(p.source for f in self.fused for p in f.pieces)
        used.update(s for c in self.computed for s in c.sources)
        return used | set(self.mismatched_sources) | set(self.lacking_sources)


# ------------------------------------------------------------------------- what transformers offers


def _hf_api() -> Any | None:
    """transformers' loading API when the installed release has one, else None (4.x).

    transformers is imported only when it is already imported (a transformers model exists),
    and only the names that 5.x releases share are used: ``get_model_conversion_mapping`` (which
    PEFT relies on), and ``rename_source_key``, ``dot_natural_key``, ``WeightConverter`` and
    ``WeightRenaming`` from ``core_model_loading``.
    """
    if "transformers" not in sys.modules:
        return None
    try:
        if importlib.util.find_spec("transformers.core_model_loading") is None:
            return None
        if importlib.util.find_spec("transformers.conversion_mapping") is None:
            return None
    except (ImportError, ValueError):
        return None
    import transformers.conversion_mapping as mapping
    import transformers.core_model_loading as loading

    needed = ("rename_source_key", "dot_natural_key", "WeightConverter", "WeightRenaming")
    if not hasattr(mapping, "get_model_conversion_mapping") or not all(
        hasattr(loading, n) for n in needed
    ):
        return None

    return types.SimpleNamespace(
        get_model_conversion_mapping=mapping.get_model_conversion_mapping,
        rename_source_key=loading.rename_source_key,
        dot_natural_key=loading.dot_natural_key,
        WeightConverter=loading.WeightConverter,
        WeightRenaming=loading.WeightRenaming,
    )


def _legacy_renamer(model: nn.Module) -> Callable[[str], str] | None:
    """How a transformers 4.x ``from_pretrained`` renames a file key for ``model``, or None
    where the installed transformers does not rename keys so (5.x has conversion mappings).

    As 4.x's ``_get_key_renaming_mapping``: the model's ``_fix_state_dict_key_on_load``, then
    the first pattern of the class's ``_checkpoint_conversion_mapping`` that matches, replaced
    with ``re.subn`` (only for a class whose name, or a base's, holds one of
    ``modeling_utils.VLMS``, as ``from_pretrained`` decides it).
    """
    fix = getattr(model, "_fix_state_dict_key_on_load", None)
    if not callable(fix):
        return None
    vlms = getattr(sys.modules.get("transformers.modeling_utils"), "VLMS", None) or ()
    mapping = getattr(type(model), "_checkpoint_conversion_mapping", None)
    rules: list[tuple[re.Pattern[str], str]] = []
    if isinstance(mapping, Mapping) and any(
        name in cls.__name__.lower() for cls in type(model).__mro__[:-1] for name in vlms
    ):
        rules = [(re.compile(p), r) for p, r in mapping.items()]

    def rename(key: str) -> str:
        new = fix(key)[0]
        for pattern, replacement in rules:
            new, count = pattern.subn(replacement, new)
            if count:
                break
        return str(new)

    return rename


def _legacy_plan(
    rename: Callable[[str], str],
    catalog: Mapping[str, Any],
    expected: Mapping[str, Any],
) -> Plan | None:
    """The renames of a transformers 4.x ``from_pretrained`` (``_legacy_renamer``); a key whose
    new name the model lacks keeps its file name, as a 5.x plan does."""
    plan = Plan()
    for key in catalog:
        new = rename(key)
        if new != key and new in expected:
            plan.renames[new] = key
    return plan if plan else None


def _is_transformers_model(model: nn.Module) -> bool:
    module = sys.modules.get("transformers.modeling_utils")
    base = getattr(module, "PreTrainedModel", None)
    return isinstance(base, type) and isinstance(model, base)


# ---------------------------------------------------------------------------------- tracing


class _Node:
    """How a traced tensor is made from file tensors."""

    __slots__ = ("args", "kind", "shape")

    def __init__(self, kind: str, shape: tuple[int, ...], *args: Any) -> None:
        self.kind, self.shape, self.args = kind, shape, args


class _Opaque(Exception):
    """A converter did something that is not pieces into views."""


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


class _Tracer(TorchFunctionMode):
    """Records stacks, concatenations, chunks, splits and transposes of traced meta tensors;
    anything else done to one marks the run opaque."""

    _SAME = frozenset({"contiguous", "clone", "detach"})

    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[int, _Node] = {}
        self.alive: list[torch.Tensor] = []  # ids stay unique while traced tensors live
        self.opaque: str | None = None

    def leaf(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device="meta")
        self._record(t, _Node("leaf", shape, key))
        return t

    def node(self, t: Any) -> _Node | None:
        return self.nodes.get(id(t)) if isinstance(t, torch.Tensor) else None

    def _record(self, t: torch.Tensor, node: _Node) -> torch.Tensor:
        self.nodes[id(t)] = node
        self.alive.append(t)
        return t

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if self.opaque is None:
            try:
                self._follow(name, args, kwargs, out)
            except _Opaque as why:
                self.opaque = str(why)
        return out

    def _follow(self, name: str, args: Sequence[Any], kwargs: Any, out: Any) -> None:
        flat = [a for a in args if isinstance(a, torch.Tensor)]
        for a in args:
            if isinstance(a, (list, tuple)):
                flat += [t for t in a if isinstance(t, torch.Tensor)]
        flat += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        traced = [self.node(t) for t in flat]
        if not any(n is not None for n in traced):
            return  # nothing of the file's is involved
        made = isinstance(out, torch.Tensor) or (
            isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out)
        )
        in_place = name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))
        if in_place:
            raise _Opaque(f"{name} changes a file tensor in place")
        if not made:
            return  # a question about a tensor (its shape, its dtype): nothing is made
        if None in traced:
            raise _Opaque(f"{name} mixes file tensors with others")
        first = flat[0]
        node = traced[0]
        assert node is not None
        if name in self._SAME:
            self._record(out, node)
        elif name in ("stack", "cat", "concat", "concatenate"):
            seq = args[0] if args else kwargs.get("tensors")
            nodes = [self.node(t) for t in seq]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            dim = _dim(dim, out.dim())
            self._record(
                out, _Node("stack" if name == "stack" else "cat", tuple(out.shape), dim, nodes)
            )
        elif name in ("transpose", "swapaxes", "swapdims"):
            d0 = kwargs.get("dim0", args[1] if len(args) > 1 else None)
            d1 = kwargs.get("dim1", args[2] if len(args) > 2 else None)
            if d0 is None or d1 is None:
                raise _Opaque(name)
            nd = first.dim()
            self._record(
                out, _Node("transpose", tuple(out.shape), node, _dim(d0, nd), _dim(d1, nd))
            )
        elif name == "t" and first.dim() == 2:
            self._record(out, _Node("transpose", tuple(out.shape), node, 0, 1))
        elif name in ("chunk", "split", "tensor_split", "unbind") and isinstance(out, tuple):
            if name == "unbind":
                raise _Opaque(name)
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
            dim = _dim(dim, first.dim())
            start = 0
            for part in out:
                length = part.shape[dim]
                self._record(part, _Node("narrow", tuple(part.shape), node, dim, start, length))
                start += length
        elif name == "narrow":
            dim = _dim(args[1] if len(args) > 1 else kwargs["dim"], first.dim())
            start = args[2] if len(args) > 2 else kwargs["start"]
            length = args[3] if len(args) > 3 else kwargs["length"]
            self._record(out, _Node("narrow", tuple(out.shape), node, dim, int(start), int(length)))
        else:
            raise _Opaque(name)


def _pieces(node: _Node, dest: tuple[View, ...], out: list[Piece]) -> None:
    """The pieces a traced tensor is made of, each with where it goes in ``dest``."""
    if node.kind == "leaf":
        out.append(Piece(node.args[0], (), dest))
    elif node.kind in ("stack", "cat"):
        dim, children = node.args
        start = 0
        for i, child in enumerate(children):
            if node.kind == "stack":
                _pieces(child, (*dest, ("select", dim, i)), out)
            else:
                length = child.shape[dim]
                _pieces(child, (*dest, ("narrow", dim, start, length)), out)
                start += length
    elif node.kind == "transpose":
        child, d0, d1 = node.args
        _pieces(child, (*dest, ("transpose", d0, d1)), out)
    else:  # a narrow of the file tensor: only over transposes of one file tensor
        source_views: list[View] = []
        at = node
        while at.kind in ("narrow", "transpose"):
            if at.kind == "narrow":
                child, dim, start, length = at.args
                source_views.insert(0, ("narrow", dim, start, length))
            else:
                child, d0, d1 = at.args
                source_views.insert(0, ("transpose", d0, d1))
            at = child
        if at.kind != "leaf":
            raise _Opaque("a slice of a fused tensor")
        out.append(Piece(at.args[0], tuple(source_views), dest))


# ------------------------------------------------------------------------------------ planning


def may_convert(model: nn.Module, /) -> bool:
    """Whether ``model`` may need hub names converted at all: a transformers model, with a
    transformers release that has conversions (cheap: no file is looked at)."""
    return _is_transformers_model(model) and _hf_api() is not None


def conversion_plan(
    model: nn.Module, catalog: Mapping[str, tuple[tuple[int, ...], torch.dtype]], /
) -> Plan | None:
    """How the file names of ``catalog`` (name -> shape, dtype) become ``model``'s, or None.

    None when there is nothing to convert: not a transformers model, a transformers release
    without conversions, or every name already the model's. A file in the model's own names
    (``torch.save(model.state_dict())``) is taken as it is, even where a converter keeps a name
    and changes the values (a rope permutation): nothing in such a file says it was written by
    ``save_pretrained``, and loading it converted would change weights that round-trip.
    """
    if not _is_transformers_model(model):
        return None
    api = _hf_api()
    legacy = _legacy_renamer(model) if api is None else None
    if api is None and legacy is None:
        return None
    expected = {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict(keep_vars=True).items()}
    if all(k in expected for k in catalog):
        return None  # the model's own names (a torchplace or load_state_dict file)
    if api is None:
        assert legacy is not None
        return _legacy_plan(legacy, catalog, expected)
    try:
        transforms = api.get_model_conversion_mapping(model)
    except Exception:  # a model transformers cannot map (custom code, an odd config)
        return None
    renamings = [t for t in transforms if isinstance(t, api.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, api.WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None) or None
    plan = Plan()
    groups: dict[str, Any] = {}  # the first model name of a converter -> its own copy
    sources: dict[str, list[str]] = {}  # that name -> the file keys it gathers
    for key in sorted(catalog, key=api.dot_natural_key):
        new, pattern = api.rename_source_key(key, renamings, converters, prefix, expected)
        if new not in expected and key in expected:
            new, pattern = key, None
        if new not in expected:
            continue  # unexpected: reported under its file name
        if pattern is None:
            if new != key:
                plan.renames[new] = key
            continue
        group = groups.get(new)
        if group is None:
            group = groups[new] = copy.deepcopy(by_pattern[pattern])
        group.add_tensor(new, key, pattern, key)  # the key stands for its tensor while planning
        sources.setdefault(new, []).append(key)
    for first, group in groups.items():
        _plan_group(model, plan, first, group, sources[first], catalog, expected)
    return plan if plan else None


def _lacking(
    gathered: Mapping[str, list[str]], catalog: Mapping[str, Any], into: Sequence[str]
) -> tuple[str, ...]:
    """The file keys a converter's patterns call for beside the ones it ``gathered`` (by
    pattern), which the ``catalog`` lacks: each gathered key's ``*`` values spelt into every
    pattern of ``into`` (``experts.3.w3`` calls for ``experts.3.w1``), a single ``*``'s numbers
    with the holes between the least and the most filled in (``experts.0`` and ``experts.2``
    call for ``experts.1``). Empty where a pattern is not plain text and stars."""
    if any(_star_pattern(p) is None for p in (*gathered, *into)):
        return ()  # a regular expression: its counterparts cannot be spelt
    seen: dict[tuple[str, str], set[tuple[str, ...]]] = {}  # (before, after) -> stars' values
    for pattern, keys in gathered.items():
        for key in keys:
            match = _star_pattern(pattern).search(key)  # type: ignore[union-attr]
            if match is not None:
                around = (key[: match.start()], key[match.end() :])
                seen.setdefault(around, set()).add(match.groups())
    wanted: set[str] = set()
    for (before, after), values in seen.items():
        for groups in _with_holes(values):
            for pattern in into:
                if pattern.count("*") == len(groups):
                    spelt = pattern
                    for value in groups:
                        spelt = spelt.replace("*", value, 1)
                    wanted.add(before + spelt + after)
    return tuple(sorted(k for k in wanted if k not in catalog))


_STAR_PATTERN: dict[str, re.Pattern[str] | None] = {}  # a converter's pattern, as a regex


def _star_pattern(pattern: str) -> re.Pattern[str] | None:
    """``pattern`` (plain text, ``*`` for a number) as a regular expression, made once; None
    for a pattern that is a regular expression itself."""
    if pattern not in _STAR_PATTERN:
        plain = not re.search(r"[\\^$()\[\]{}+?|]", pattern)
        made = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)")) if plain else None
        _STAR_PATTERN[pattern] = made
    return _STAR_PATTERN[pattern]


def _with_holes(values: set[tuple[str, ...]]) -> set[tuple[str, ...]]:
    """A single ``*``'s numbers from the least to the most (experts are numbered from 0, so a
    number between two held ones was saved too); ``values`` as they are for several."""
    if any(len(v) != 1 for v in values):
        return values
    numbers = [int(v[0]) for v in values]
    return {(str(n),) for n in range(min(numbers), max(numbers) + 1)} | values


def _run(group: Any, first: str, model: nn.Module) -> dict[str, Any]:
    """What a converter returns for its gathered tensors (5.x releases return a dict, or a dict
    and the errors)."""
    config = getattr(model, "config", None)
    result = group.convert(first, model=model, config=config)
    if isinstance(result, tuple):
        result = result[0]
    return {k: (v[0] if isinstance(v, list) else v) for k, v in result.items()}


def _as_fused(
    tracer: _Tracer,
    out: Mapping[str, torch.Tensor],
    names: list[str],
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
) -> tuple[list[Fused], str | None]:
    """Each traced model tensor as the pieces of file tensors it is made of; or (as the second
    item) why the trace cannot say, so that the conversion is run at load instead."""
    fused: list[Fused] = []
    opaque = tracer.opaque
    if opaque is None:
        try:
            for name in names:
                node = tracer.node(out[name])
                if node is None:
                    raise _Opaque(name)
                pieces: list[Piece] = []
                _pieces(node, (), pieces)
                fused.append(Fused(name, expected[name][0], expected[name][1], pieces))
        except _Opaque as why:
            opaque = str(why)
    return fused, opaque


def _lacks(plan: Plan, first: str, lacking: tuple[str, ...], keys: list[str]) -> None:
    """``first`` cannot be built: the file lacks ``lacking`` (none, where the patterns cannot
    say), and its ``keys`` are taken."""
    if lacking:
        plan.lacking[first] = lacking
        plan.lacking_sources.update(dict.fromkeys(keys, first))


def _plan_group(
    model: nn.Module,
    plan: Plan,
    first: str,
    group: Any,
    keys: list[str],
    catalog: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
) -> None:
    gathered = {p: list(v) for p, v in group.collected_tensors.items()}
    # A pattern short of a tensor the others have (an expert's gate, not its up projection), or
    # experts numbered apart (the wrong ones paired): missing, for the keys it lacks (``_lacks``)
    lacking = _lacking(gathered, catalog, list(gathered))
    if lacking or len({len(v) for v in gathered.values()}) > 1:
        _lacks(plan, first, lacking, keys)
        return
    traced = copy.deepcopy(group)
    tracer = _Tracer()
    traced.collected_tensors.clear()
    for pattern, names in gathered.items():
        for name in names:
            traced.collected_tensors[pattern].append(tracer.leaf(name, *catalog[name]))
    try:
        with tracer:
            out = _run(traced, first, model)
    except Exception as exc:
        # a pattern the file holds nothing of (every up projection of a layer): said as such
        lacking = _lacking(gathered, catalog, list(group.source_patterns))
        if lacking:
            _lacks(plan, first, lacking, keys)
            return
        raise CheckpointError(
            f"transformers' conversion for {first} (from {', '.join(keys[:3])}"
            f"{' ...' if len(keys) > 3 else ''}) failed on the file's shapes "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    names = [n for n in out if n in expected]
    wrong = {n: tuple(out[n].shape) for n in names if tuple(out[n].shape) != expected[n][0]}
    if wrong:
        plan.mismatched.update(wrong)
        plan.mismatched_sources.update(dict.fromkeys(keys, first))
        return
    fused, opaque = _as_fused(tracer, out, names, expected)
    if opaque is None:
        plan.fused += fused
        return
    dtype = expected[first][1]

    def run(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # As from_pretrained: each file tensor in the model's dtype, then transformers' ops.
        real = copy.deepcopy(group)
        real.collected_tensors.clear()
        for pattern, keys_of in gathered.items():
            for key in keys_of:
                real.collected_tensors[pattern].append(tensors[key].to(dtype))
        with torch.no_grad():
            result = _run(real, first, model)
        return {n: t for n, t in result.items() if n in names}

    plan.computed.append(Computed(names, [expected[n] for n in names], keys, run))


# ------------------------------------------------------------------------------------ applying


def apply_plan(plan: Plan, state: Mapping[str, Any], /, *, owned: bool) -> Mapping[str, Any]:
    """``state`` (the file's tensors, read) under the model's names, as ``plan`` says.

    Each fused tensor is allocated once, in the model's dtype on the device its file tensors are
    on, and each piece copied straight into its slice. ``owned``: the state was read for this
    load, so it is changed in place and each file tensor is let go as soon as it is used (the
    weights are never held twice over); otherwise a new mapping is returned. Keys the plan does
    not take keep their names. A model tensor a converter would build in another shape becomes
    a ``meta`` tensor of that shape, so the caller reports it as mismatched.
    """
    work: Any = state
    out: Any = state if owned else {}
    uses = collections.Counter(plan.renames.values())
    uses.update(p.source for f in plan.fused for p in f.pieces)
    uses.update(k for c in plan.computed for k in c.sources)

    def take(key: str) -> Any:
        """A file tensor, let go with its last use when the state is owned (one file tensor
        may feed several model tensors: a fused QKV chunked into three)."""
        uses[key] -= 1
        return work.pop(key) if owned and uses[key] == 0 else work[key]

    # Every result is written once all file tensors are taken: a model name may be another
    # file key's name (renames that chain, a fused tensor named as a hub key), and writing it
    # into an owned state early would replace a file tensor not yet read.
    results: dict[str, Any] = {}
    with torch.no_grad():
        for new, old in plan.renames.items():
            results[new] = take(old)
        for fused in plan.fused:
            device = work[fused.pieces[0].source].device
            dest = torch.empty(fused.shape, dtype=fused.dtype, device=device)
            for piece in fused.pieces:
                source = take(piece.source)
                if device.type != "meta":
                    view = apply_views(dest, piece.dest_views)
                    view.copy_(apply_views(source, piece.source_views))
                del source
            results[fused.name] = dest
        for computed in plan.computed:
            tensors = {k: take(k) for k in computed.sources}
            if any(t.device.type == "meta" for t in tensors.values()):  # no values to convert
                for name, (shape, dtype) in zip(computed.names, computed.shapes, strict=True):
                    results[name] = torch.empty(shape, dtype=dtype, device="meta")
            else:
                results.update(computed.run(tensors))
            del tensors
    for name, file_shape in plan.mismatched.items():
        results[name] = torch.empty(file_shape, device="meta")
    if owned:
        for key in plan.consumed():  # taken: only keys a result replaces may still be there
            if key not in results:
                out.pop(key, None)
    out.update(results)
    if owned:
        return out  # type: ignore[no-any-return]
    return _with_untaken(out, state, plan)


def _with_untaken(out: dict[str, Any], state: Mapping[str, Any], plan: Plan) -> Mapping[str, Any]:
    """A new mapping's results with the keys the plan does not take, and the state's metadata."""
    used = plan.consumed()
    out.update({k: v for k, v in state.items() if k not in used and k not in out})
    metadata = getattr(state, "_metadata", None)
    if metadata is None:
        return out
    result: Any = collections.OrderedDict(out)
    result._metadata = metadata
    return result  # type: ignore[no-any-return]


def fused_boxes(fused: Fused, box: Box, /) -> list[tuple[str, Box, tuple[Any, ...]]] | None:
    """The parts of ``fused``'s pieces that fall in ``box`` of the model tensor (the slice a
    rank holds): ``(file key, box of the file tensor, index into the box)``, so that
    ``held[index].copy_(file_tensor[file box])`` fills the slice; None when a piece goes through
    a transpose (no box of the file lands in a box of the model tensor).

    >>> f = Fused("w", (2, 4), torch.float32, [Piece("a", (), (("select", 0, 0),)),
    ...                                        Piece("b", (), (("select", 0, 1),))])
    >>> fused_boxes(f, ((1, 2), (1, 2)))
    [('b', ((2,), (2,)), (0, slice(0, 2, None)))]
    """
    offsets, lengths = box
    out: list[tuple[str, Box, tuple[Any, ...]]] = []
    for piece in fused.pieces:
        if piece.source_views or any(v[0] == "transpose" for v in piece.dest_views):
            return None
        start = [0] * len(fused.shape)
        size = list(fused.shape)
        dims = list(range(len(fused.shape)))  # the model tensor's dims the view still has
        for view in piece.dest_views:
            d = dims[view[1]]
            if view[0] == "select":
                start[d] += view[2]
                size[d] = 1
                dims.remove(d)
            else:
                start[d] += view[2]
                size[d] = view[3]
        low = [max(s, o) for s, o in zip(start, offsets, strict=True)]
        high = [min(s + n, o + m) for s, n, o, m in zip(start, size, offsets, lengths, strict=True)]
        if any(h <= lo for lo, h in zip(low, high, strict=True)):
            continue
        source_box = (
            tuple(low[d] - start[d] for d in dims),
            tuple(high[d] - low[d] for d in dims),
        )
        index = tuple(
            slice(low[d] - offsets[d], high[d] - offsets[d]) if d in dims else low[d] - offsets[d]
            for d in range(len(fused.shape))
        )
        out.append((piece.source, source_box, index))
    return out


def hub_plan(label: Path | str, model: nn.Module, state: Mapping[str, Any], /) -> Plan | None:
    """``conversion_plan`` for the tensors of ``state`` (``label`` names the source in
    errors)."""
    catalog = {
        k: (tuple(v.shape), v.dtype)
        for k, v in state.items()
        if isinstance(k, str) and isinstance(v, torch.Tensor)
    }
    try:
        return conversion_plan(model, catalog)
    except CheckpointError as exc:
        raise CheckpointError(
            f"{label}: {exc}", path=label if isinstance(label, Path) else None
        ) from exc


def converted(
    label: Path | str, model_name: str, plan: Plan, state: Mapping[str, Any], /, *, owned: bool
) -> Any:
    """``apply_plan``, with what goes wrong in it (out of memory for a fused tensor,
    transformers' own op failing) a ``CheckpointError`` naming the source ``label``."""
    try:
        return apply_plan(plan, state, owned=owned)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{label}: converting its hub names to {model_name}'s failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); the model "
            "is untouched",
            path=label if isinstance(label, Path) else None,
        ) from exc
