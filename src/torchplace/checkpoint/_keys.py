"""The one key check of every fill: which of a model's tensors a source holds, and under which
name; what is missing, unexpected or mis-shaped, as data.

The plain fill (``_fill``) and the sharded fill (``_sharded``) both ask ``check_keys`` and both
say what it found with ``does_not_fit``, so that they refuse the same files with the same words.
A tied tensor is one ``Missing`` with the other names it goes by (``tied``), and a shape
mismatch a ``Mismatch`` with what the file and the model hold: messages render them, and
``CheckpointError.missing`` and ``.mismatched`` take their names, with nothing parsed back out
of a sentence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

from .._errors import CheckpointError
from .._model_walk import Slot
from ._mismatch import Shapes, keys_hint, listing, source_name

__all__ = [
    "KeyCheck",
    "Mismatch",
    "Missing",
    "check_keys",
    "does_not_fit",
    "matches_nothing",
    "no_data_buffers",
]


@dataclasses.dataclass(frozen=True)
class Missing:
    """A model tensor the source does not hold under any of its names: ``name``, the names it
    is ``tied`` to (a tied parameter saved under any one of them counts as present), and the
    file keys it ``lacks`` where the source holds some of the pieces it is fused from."""

    name: str
    tied: tuple[str, ...] = ()
    lacks: tuple[str, ...] = ()

    def __str__(self) -> str:
        said = f"{self.name} (tied to {', '.join(self.tied)})" if self.tied else self.name
        if self.lacks:
            said += f" (fused from the file's tensors, which lack {listing(list(self.lacks), 5)})"
        return said


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """A source tensor that cannot fill the model's: its ``name`` and what differs (``file
    (2, 3), model (3, 2)``, or what the file holds instead of a tensor)."""

    name: str
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


T = TypeVar("T")

# What the source holds under a name, as the check compares it: a shape and whether its dtype is
# complex, or (not a tensor) the name of its type.
Held = tuple[tuple[int, ...], bool] | str


@dataclasses.dataclass
class KeyCheck:
    """What ``check_keys`` found: each model tensor the source fills (``matched``: the slot and
    every name the source holds it under, in the slot's order), what it lacks, holds besides,
    and holds in another shape. ``renamed``: where the caller gave ``rename=``, how many keys
    the source held before it and how many it kept (the keys above are as it gives them)."""

    matched: list[tuple[Slot, list[str]]]
    missing: list[Missing]
    unexpected: list[str]
    mismatched: list[Mismatch]
    renamed: tuple[int, int] | None = None

    @property
    def missing_names(self) -> list[str]:
        return [m.name for m in self.missing]

    @property
    def tied_names(self) -> set[str]:
        """The other names of the missing tied tensors, any of which a source may hold."""
        return {n for m in self.missing for n in m.tied}

    @property
    def mismatched_names(self) -> list[str]:
        return [m.name for m in self.mismatched]

    def shape_problems(self) -> list[str]:
        """The problem the mis-shaped tensors make, as every fill says it (none: empty)."""
        if not self.mismatched:
            return []
        return [f"shape mismatches: {listing([str(m) for m in self.mismatched])}"]

    def listed_missing(self) -> list[str]:
        """The missing tensors as messages list them, ties noted."""
        return [str(m) for m in self.missing]

    def add_missing(self, names: Iterable[str]) -> None:
        """Names found missing besides the model's tensors (extra states, what pre-hooks said),
        each once."""
        known = {n for m in self.missing for n in (m.name, *m.tied)}
        for name in names:
            if name not in known:
                known.add(name)
                self.missing.append(Missing(name))


def check_keys(
    slots: Iterable[Slot],
    held: Mapping[str, T],
    describe: Callable[[T], Held],
    *,
    built: Callable[[Slot], bool] = lambda slot: False,
    takes_any_shape: Callable[[Slot], bool] = lambda slot: False,
    complex_must_agree: bool = False,
    lacking: Mapping[str, tuple[str, ...]] | None = None,
) -> KeyCheck:
    """Each slot against what the source ``held`` under its names (``describe``: what a held
    value is, as the check compares it).

    ``built(slot)``: the slot is made from other tensors (a fused tensor a conversion builds),
    so it is matched even where the source holds none of its names. ``takes_any_shape(slot)``:
    it takes the file's shape (a lazy parameter). ``complex_must_agree``: a complex tensor
    cannot fill a real one, nor the reverse. Every name held under is checked, so a tied
    tensor saved under two names in two shapes is a mismatch wherever it is filled.
    ``lacking``: the file keys each model tensor built from pieces lacks (``Plan.lacking``).
    """
    lacking = lacking or {}
    check = KeyCheck([], [], [], [])
    used: set[str] = set()
    for slot in slots:
        present = [n for n in slot.names if n in held]
        used.update(present)
        if not present:
            if built(slot):
                check.matched.append((slot, []))
            else:
                lacks = next((lacking[n] for n in slot.names if n in lacking), ())
                check.missing.append(Missing(slot.names[0], tuple(slot.names[1:]), lacks))
            continue
        bad = [
            m
            for m in (
                _mismatch(slot, n, describe(held[n]), takes_any_shape, complex_must_agree)
                for n in present
            )
            if m is not None
        ]
        if bad:
            check.mismatched += bad
        else:
            check.matched.append((slot, present))
    check.unexpected = [k for k in held if k not in used]
    return check


def _mismatch(
    slot: Slot,
    name: str,
    held: Held,
    takes_any_shape: Callable[[Slot], bool],
    complex_must_agree: bool,
) -> Mismatch | None:
    if isinstance(held, str):
        return Mismatch(name, f"the file holds a {held}")
    shape, is_complex = held
    if not takes_any_shape(slot) and shape != tuple(slot.tensor.shape):
        return Mismatch(name, f"file {shape}, model {tuple(slot.tensor.shape)}")
    if complex_must_agree and is_complex != slot.tensor.dtype.is_complex:
        return Mismatch(
            name, f"file {'complex' if is_complex else 'real'}, model {slot.tensor.dtype}"
        )
    return None


def no_data_buffers(names: list[str], p: Path | str, device: str | None) -> str:
    """The problem of non-persistent buffers on meta: no checkpoint holds their values, and the
    model must be built again to have them (the same advice from every fill). ``device``: the
    one the suggested call names (None: a sharded model, filled where its shards are)."""
    call = source_name(p) if device is None else f"{source_name(p)}, {device!r}"
    return (
        f"non-persistent buffers on meta that no checkpoint holds: {listing(names)} "
        "(their values were lost when they went to meta, by a move or a load onto "
        "'meta'; build the model again with torchplace.skeleton(YourModel, ...), which "
        f"keeps such buffers real, then torchplace.load_into(model, {call}))"
    )


_AS_RENAMED = " (as rename= names them)"


def _kept_none(held: int) -> str:
    """Said where ``rename=`` dropped every one of the ``held`` keys of the source."""
    if held == 0:
        return "the file holds none"
    if held == 1:
        return "rename= dropped the file's one key (it returned None for it)"
    return f"rename= dropped all {held} of the file's keys (it returned None for each)"


def matches_nothing(
    p: Path | str,
    model_name: str,
    check: KeyCheck,
    shapes: Shapes | None,
    named: Path | str | None = None,
) -> CheckpointError:
    """The error for ``strict=False`` where not one of the source's keys fits the model
    (``named``: how a suggested call names the source, if not as ``p``)."""
    unexpected = check.unexpected
    if unexpected:
        held = f"the file has{_AS_RENAMED * (check.renamed is not None)} {listing(unexpected, 5)}"
    elif check.renamed and not check.renamed[1]:
        held = _kept_none(check.renamed[0])
    else:
        held = "the file holds none"
    said = p if named is None else named
    renamed = check.renamed is not None
    hint = keys_hint(said, check.missing_names, unexpected, shapes, check.tied_names, renamed)
    return CheckpointError(
        f"{p}: not one of its keys matches {model_name}, so strict=False would load nothing: "
        f"the model has {listing(check.listed_missing(), 5)}; {held}{hint}",
        path=p if isinstance(p, Path) else None,
        missing=check.missing_names,
        unexpected=unexpected,
        mismatched=check.mismatched_names,
    )


def does_not_fit(
    p: Path | str,
    model_name: str,
    check: KeyCheck,
    problems: list[str],
    *,
    strict: bool,
    fix: str,
    shapes: Shapes | None,
    missing: list[Missing] | None = None,
    unexpected: list[str] | None = None,
    path: Path | None = None,
    tail: str = "",
    named: Path | str | None = None,
) -> CheckpointError:
    """The error for a source that does not fit: missing and unexpected keys (with
    ``strict``), then ``problems``, a hint at what the key lists mean, and ``fix``.

    ``missing`` and ``unexpected``: the keys left, where they differ from the check's (after a
    module's own loader or a post-hook ran). The lists stop at ten names; the error holds
    them whole, and says so before ``tail`` (what became of the model). ``named``: how a
    suggested call names the source, if not as ``p``.
    """
    missing = check.missing if missing is None else missing
    unexpected = check.unexpected if unexpected is None else unexpected
    keys = []
    if strict and missing:
        keys.append(f"missing keys: {listing([str(m) for m in missing])}")
    renamed = check.renamed is not None
    if strict and unexpected:
        keys.append(f"unexpected keys{_AS_RENAMED * renamed}: {listing(unexpected)}")
    elif strict and missing and check.renamed and not check.renamed[1]:
        keys.append(_kept_none(check.renamed[0]))
    names = [m.name for m in missing]
    tied = {n for m in missing for n in m.tied}
    said = p if named is None else named
    hint = keys_hint(said, names, unexpected, shapes, tied, renamed) if strict else ""
    cut = [
        attribute
        for attribute, items in (
            ("missing", missing if strict else []),
            ("unexpected", unexpected if strict else []),
            ("mismatched", check.mismatched),
        )
        if len(items) > 10
    ]
    if cut:
        fix += f" (every key: CheckpointError.{', .'.join(cut)})"
    return CheckpointError(
        f"{p}: does not fit {model_name}: {'; '.join(keys + problems)}{hint}{fix}{tail}",
        path=path,
        missing=names if strict else [],
        unexpected=unexpected if strict else [],
        mismatched=check.mismatched_names,
    )
