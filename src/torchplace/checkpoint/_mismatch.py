"""What a checkpoint that does not fit a model means, said so that the fix can be typed as
written: a key prefix the file carries or lacks (DDP's ``module.``), keys that look misspelt
(with the ``rename=`` that fits them all), a training checkpoint's nested state dict, and the
tensors a ``strict=False`` load left on ``meta``. Shared by the plain and the sharded fill."""

from __future__ import annotations

import contextvars
import re
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._errors import CheckpointError, user_stacklevel
from .._model_walk import Slot
from .._suggest import close_matches

# The shapes of the file's tensors by key, and of the model's by name.
Shapes = tuple[Mapping[str, tuple[int, ...]], Mapping[str, tuple[int, ...]]]

__all__ = [
    "LEFT_ON_META",
    "REFUSE_LEFT_ON_META",
    "LeftOnMeta",
    "Shapes",
    "SkippedKeys",
    "as_pattern",
    "check_state_dict",
    "keys_hint",
    "left_on_meta",
    "listing",
    "path_of",
    "python_path",
    "skipped_keys",
    "source_name",
    "target_for",
    "warn_left_on_meta",
    "warn_skipped",
]


def listing(items: list[str], limit: int = 10) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def source_name(p: Path | str) -> str:
    """How a suggested call names the source: the file's name as Python (``'/ckpt/last.pt'``),
    or ``state_dict`` for a mapping given in memory."""
    return repr(str(p)) if isinstance(p, Path) else "state_dict"


# Prefixes that wrapping a model adds to its state dict's keys, and what adds them.
_WRAPPER_PREFIXES = (
    ("module.", "DistributedDataParallel (or DataParallel)"),
    ("_orig_mod.", "torch.compile"),
)


def keys_hint(
    p: Path | str,
    missing: list[str],
    unexpected: list[str],
    shapes: Shapes | None = None,
    tied: set[str] | None = None,
    renamed: bool = False,
) -> str:
    """Says when the file's keys differ from the model's by one prefix (``module.`` from DDP),
    else which look misspelt (``_typo_hint``).

    The prefix must account for every missing key, so that a file of another model whose keys
    merely end alike (``emb.weight`` against ``weight``) gets no false hint. ``tied``: the
    other names of missing tied tensors, any of which the file may hold. ``renamed``: the
    file's keys are as the caller's ``rename=`` gives them, so a fix changes that rename rather
    than passing another.
    """
    names = missing
    if not names or not unexpected:
        return ""
    files = set(unexpected)
    u = next((k for k in unexpected if k.endswith(names[0]) and k != names[0]), None)
    if u is not None:
        extra = u[: len(u) - len(names[0])]
        if all(extra + n in files for n in names):
            hint = _prefix_hint(p, extra, unexpected, {*names, *(tied or ())}, renamed)
            if hint:
                return hint
    # A wrapper's prefix on every key of the file, where the names under it are not the model's
    # own (a transformers model converts a file's hub names: they match no missing name).
    for wrapper, adds in _WRAPPER_PREFIXES:
        if all(k.startswith(wrapper) for k in unexpected) and not any(
            n.startswith(wrapper) for n in names
        ):
            rule = f'{{{as_pattern("^" + re.escape(wrapper))}: ""}}'
            every = "every key of the file" + ", as rename= names it," * renamed
            return (
                f"; {every} starts with {wrapper!r}, the prefix {adds} adds to the "
                f"model it wraps: {_rename_fix(p, rule, renamed, 'drop it')}"
            )
    m = next((n for n in names if n.endswith(unexpected[0]) and n != unexpected[0]), None)
    if m is not None:
        prefix = m[: len(m) - len(unexpected[0])]
        if all(prefix + k in set(names) for k in unexpected):
            same = ", rename=<the same rename>" if renamed else ""
            return (
                f"; the model's keys carry a prefix {prefix!r} the file lacks: load into that "
                f"part of the model, torchplace.load_into(model.get_submodule("
                f"{prefix.rstrip('.')!r}), {source_name(p)}{same})"
            )
    # A tied parameter is missing under every one of its names, any of which a file may hold.
    return _typo_hint(p, names, unexpected, tied or set(), shapes, renamed)


def _prefix_hint(
    p: Path | str, extra: str, unexpected: list[str], wanted: set[str], renamed: bool
) -> str:
    """The rename that drops the file's extra prefix ``extra``, where that makes its keys
    under it the model's ``wanted`` ones (its missing keys and their tied names); where the
    file holds other keys besides (another module's, as a Sequential's ``1.``), the load
    that also skips those (``strict=False``). Else ''."""
    under = [k for k in unexpected if k.startswith(extra)]
    if not all(k[len(extra) :] in wanted for k in under):
        return ""  # dropping the prefix would leave keys the model has no tensor for
    keys = _the_keys(renamed)
    rule = f'{{{as_pattern("^" + re.escape(extra))}: ""}}'
    others = [k for k in unexpected if not k.startswith(extra)]
    if not others:
        return (
            f"; {keys} carry an extra prefix {extra!r}: {_rename_fix(p, rule, renamed, 'drop it')}"
        )
    if renamed:
        fix = (
            f"have the rename= given drop the prefix too, as {rule} would after what it does "
            "now, and pass strict=False, which skips the rest (a warning names them)"
        )
    else:
        fix = (
            f"drop the prefix and skip the rest, torchplace.load_into(model, {source_name(p)}, "
            f"rename={rule}, strict=False) (a warning names the keys skipped)"
        )
    return (
        f"; the file holds more than the model: {keys} under {extra!r} are the model's missing "
        f"ones with an extra prefix, and the file also holds {listing(others, 4)}, which the model "
        "has no tensor for (saved from a bigger model, or from a container of several modules "
        f"such as an nn.Sequential): load it into that, or load only the part that fits: {fix}"
    )


def _the_keys(renamed: bool) -> str:
    """How a hint names the file's keys: as the caller's ``rename=`` gave them, if ``renamed``."""
    return "the file's keys, as rename= names them," if renamed else "the file's keys"


def _rename_fix(p: Path | str, rule: str, renamed: bool, act: str) -> str:
    """The fix that does ``act`` by ``rule`` (a ``rename=`` dict, as Python) to the file's keys:
    the call, or where the caller's own ``rename=`` gave the keys, the change to make to it."""
    if renamed:
        return f"have the rename= given {act} too, as {rule} would after what it does now"
    return f"{act} as they load, torchplace.load_into(model, {source_name(p)}, rename={rule})"


def _typo_hint(
    p: Path | str,
    missing: list[str],
    unexpected: list[str],
    tied: set[str],
    shapes: Shapes | None = None,
    renamed: bool = False,
) -> str:
    """Says which of the file's keys look like misspellings of the model's missing ones
    (``dcoder.0.weight`` for ``decoder.0.weight``), and when one part of the name is misspelt
    alike in every key, the ``rename`` that fits them all (``renamed``: as ``keys_hint``)."""
    keys = _the_keys(renamed)
    pairs = _misspelt(missing, unexpected, shapes=shapes)
    if not pairs:
        return ""
    rule = _one_part_rule(pairs, unexpected, {*missing, *tied}, shapes)
    if rule is not None:
        pattern, replacement, wrong, right = rule
        fit = f'{{{as_pattern(pattern)}: "{replacement}"}}'
        return (
            f"; {keys} spell {wrong!r} where the model has {right!r}: "
            f"{_rename_fix(p, fit, renamed, 'rename them')}"
        )
    shown = ", ".join(f"{key} for {name}" for key, name in pairs)
    if renamed:
        return (
            f"; keys that look misspelt (the file's as rename= names them, for the model's): "
            f"{shown}; correct the rename= given"
        )
    return (
        f"; keys that look misspelt (the file's for the model's): {shown}; correct the names, "
        "or fit them as they load with rename= (a dict of regular expressions or a callable)"
    )


def _misspelt(
    missing: list[str], unexpected: list[str], limit: int = 3, shapes: Shapes | None = None
) -> list[tuple[str, str]]:
    """Up to ``limit`` pairs (the file's key, the model's missing key) that differ by a typo,
    each name used once. Keys are compared a dotted part at a time (a typo within one part of
    names alike in every other), which stays fast for models of any size; a few keys are also
    compared whole (a dot dropped or added), and paired only when nearly equal. Names that
    differ only in numbers (``layers.5`` for ``layers.4``: another depth, not a typo) are no
    pair, nor are names whose tensors' ``shapes`` differ (the rename would only move the error)."""
    blanked: dict[str, list[str]] = {}  # a missing key with one part blanked: the keys
    for name in missing:
        parts = name.split(".")
        for i in range(len(parts)):
            blanked.setdefault(_blank(parts, i), []).append(name)
    whole = len(missing) * len(unexpected) <= 2500
    pairs: list[tuple[str, str]] = []
    taken: set[str] = set()
    for key in unexpected:
        parts = key.split(".")
        found: list[str] = []
        for i, part in enumerate(parts):
            options: dict[str, str] = {}  # the part a missing key has in place of this one
            for name in blanked.get(_blank(parts, i), []):
                if name not in taken and _fits(shapes, key, name):
                    options.setdefault(name.split(".")[i], name)
            found += [options[c] for c in close_matches(part, options, n=1, cutoff=0.75)]
        if not found and whole:
            free = [n for n in missing if n not in taken and _fits(shapes, key, n)]
            found = close_matches(key, free, n=1, cutoff=0.9)
        found = [n for n in found if _digitless(n) != _digitless(key)]
        if found:
            pairs.append((key, found[0]))
            taken.add(found[0])
            if len(pairs) == limit:
                break
    return pairs


def _blank(parts: list[str], i: int) -> str:
    """A dotted name with its part ``i`` blanked out."""
    return ".".join([*parts[:i], "\0", *parts[i + 1 :]])


def _digitless(key: str) -> str:
    return re.sub(r"\d+", "#", key)


def _one_part_rule(
    pairs: list[tuple[str, str]],
    unexpected: list[str],
    missing: set[str],
    shapes: Shapes | None = None,
) -> tuple[str, str, str, str] | None:
    """``(pattern, replacement, wrong, right)`` when the first pair differs in one dotted part,
    and renaming that part so in every file key fits each pair and takes each key it changes to
    a missing key of the model; otherwise None."""
    key, name = pairs[0]
    have, want = key.split("."), name.split(".")
    if len(have) != len(want):
        return None
    differ = [i for i, (a, b) in enumerate(zip(have, want, strict=True)) if a != b]
    if len(differ) != 1 or not re.fullmatch(r"[\w-]+", want[differ[0]]):
        return None
    (i,) = differ
    first, last = i == 0, i == len(have) - 1
    pattern = ("^" if first else r"\.") + re.escape(have[i]) + ("$" if last else r"\.")
    replacement = ("" if first else ".") + want[i] + ("" if last else ".")
    compiled = re.compile(pattern)
    if any(compiled.sub(replacement, k) != n for k, n in pairs):
        return None
    moves = [(k, compiled.sub(replacement, k)) for k in unexpected if compiled.search(k)]
    changed = [n for _, n in moves]
    if len(set(changed)) != len(changed) or not all(k in missing for k in changed):
        return None
    if not all(_fits(shapes, k, n) for k, n in moves):
        return None
    return pattern, replacement, have[i], want[i]


def _fits(shapes: Shapes | None, key: str, name: str) -> bool:
    """Whether the file's ``key`` may hold the model's ``name``: their shapes agree, or one is
    not known."""
    if shapes is None:
        return True
    have, want = shapes[0].get(key), shapes[1].get(name)
    return have is None or want is None or have == want


def as_pattern(regex: str) -> str:
    """A regular expression as Python source, raw where that reads better."""
    return f'r"{regex}"' if '"' not in regex and not regex.endswith("\\") else repr(regex)


def check_state_dict(p: Path | str, model: nn.Module, state: Any, loadable: list[Slot]) -> None:
    """A ``CheckpointError`` for what is not a state dict, with the way to the one inside."""
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise CheckpointError(
            f"{p}: holds a {type(state).__name__}, not a state dict",
            path=p if isinstance(p, Path) else None,
        )
    nested = [k for k, v in state.items() if isinstance(v, Mapping)]
    if nested and not any(isinstance(v, torch.Tensor) for v in state.values()):
        key = "state_dict" if "state_dict" in nested else nested[0]
        inner = state[key]
        names = {n for slot in loadable for n in slot.names}
        rename = ""
        if inner and not any(k in names for k in inner):
            first = next(iter(inner))
            head = first.split(".", 1)[0] + "." if "." in first else ""
            fits = any(k[len(head) :] in names for k in inner)
            if head and fits and all(k.startswith(head) for k in inner):
                rename = f', rename={{r"^{re.escape(head)}": ""}}'
        where = "state_dict" if isinstance(p, str) else f"torchplace.load({source_name(p)})"
        raise CheckpointError(
            f"{p}: holds a dict of {listing(sorted(nested), 5)}, not a state dict; load the "
            f"part that holds the weights, torchplace.load_into(model, {where}[{key!r}]{rename})",
            path=p if isinstance(p, Path) else None,
        )


def target_for(slot: Slot, target: torch.device | None) -> torch.device:
    if target is not None:
        return target
    here = slot.tensor.device
    return torch.device("cpu") if here.type == "meta" else here


def path_of(model: nn.Module, module: nn.Module) -> str:
    path: str = next(name for name, m in model.named_modules() if m is module)
    return path


def python_path(path: str) -> str:
    """How code names the submodule of ``model`` at ``path``: ``model.lm_head``, or
    ``model.get_submodule('layers.0')`` where attribute access cannot spell it."""
    if all(part.isidentifier() for part in path.split(".")):
        return "model." + path
    return f"model.get_submodule({path!r})"


def _tied_hint(model: nn.Module, left: list[Slot]) -> tuple[str, torch.Tensor | None]:
    """Says when a weight left on meta is the output embedding of a Hugging Face model whose
    input embedding loaded with the same shape: the file looks saved from a model with tied
    embeddings (``tie_word_embeddings``), which saves the weight they share once. Returns the
    words and that weight, or ``("", None)``."""
    inputs = getattr(model, "get_input_embeddings", None)
    outputs = getattr(model, "get_output_embeddings", None)
    if not (callable(inputs) and callable(outputs)):
        return "", None
    try:
        src, dst = inputs(), outputs()
    except Exception:  # a model that has none raises NotImplementedError
        return "", None
    weight = getattr(src, "weight", None)
    meta = getattr(dst, "weight", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(meta, torch.Tensor):
        return "", None
    if weight.is_meta or not meta.is_meta or weight.shape != meta.shape:
        return "", None
    if not any(s.tensor is meta for s in left):
        return "", None
    out_path, in_path = path_of(model, dst), path_of(model, src)
    flag = getattr(getattr(model, "config", None), "tie_word_embeddings", None)
    built = ", and this model was built with tie_word_embeddings=False" if flag is False else ""
    words = (
        " The file looks saved from a model with tied embeddings (tie_word_embeddings=True): "
        f"such a model shares one weight between {out_path} and {in_path} and saves it once, "
        f"as {in_path}.weight{built}. Tie them as it did, {python_path(out_path)}.weight = "
        f"{python_path(in_path)}.weight, or build the model with tie_word_embeddings=True."
    )
    return words, meta


# How the warning of ``left_on_meta`` begins (the tests match it).
LEFT_ON_META = r"torchplace\.load_into left \d+ tensor\(s\) of .* on meta"

# Whether tensors a load leaves on meta are refused, not warned of: set for its fill by a load by
# device_map (``spreading._load_by_map``), which must not dispatch a tensor with no values. A
# context variable, so that a load in another thread at the same time still only warns (a
# warnings filter would be the whole process's).
REFUSE_LEFT_ON_META: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torchplace_refuse_left_on_meta", default=False
)


class LeftOnMeta(Exception):
    """The warning of ``left_on_meta``, raised where the load under way refuses it
    (``REFUSE_LEFT_ON_META``): not a ``CheckpointError``, so that the fill puts the model back
    as for any failure; the load that refuses it says what it means for it. ``path`` and
    ``missing``: the file and the tensors left on meta, for that load's ``CheckpointError``."""

    def __init__(self, text: str, *, path: Path | None = None, missing: Iterable[str] = ()) -> None:
        super().__init__(text)
        self.path = path
        self.missing = tuple(missing)


class SkippedKeys(UserWarning):
    """The one warning of a ``strict=False`` load that skipped keys, carrying them as data:
    ``path`` (the file, or None for a mapping), ``missing`` (the model's keys the source lacks:
    they keep the values they had, or stay on meta), ``unexpected`` (the source's keys the
    model takes no tensor for). A ``UserWarning``, so the standard filters silence it (by its
    message, which holds "strict=False skipped", or by this class).

    >>> w = SkippedKeys("m.pt: strict=False skipped 1 key", missing=["bias"])
    >>> isinstance(w, UserWarning), w.missing, w.unexpected
    (True, ('bias',), ())
    """

    def __init__(
        self,
        text: str,
        *,
        path: Path | None = None,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
    ) -> None:
        super().__init__(text)
        self.path = path
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)


def skipped_keys(p: Path | str, missing: list[str], unexpected: list[str]) -> str:
    """What a ``strict=False`` load that skipped ``missing`` and ``unexpected`` keys says."""
    parts = []
    if missing:
        parts.append(
            f"the model's {listing(missing)}, which it lacks (they keep the values they had)"
        )
    if unexpected:
        parts.append(f"its {listing(unexpected)}, which the model takes no tensor for")
    count = len(missing) + len(unexpected)
    return (
        f"{p}: strict=False skipped {count} key{'s' * (count != 1)}: {'; and '.join(parts)}. "
        "The keys are in this warning's .missing and .unexpected; pass strict=True to refuse "
        "a source that does not fit"
    )


def warn_skipped(
    where: Path | str, path: Path | None, missing: list[str], unexpected: list[str]
) -> None:
    """The one warning of a ``strict=False`` load of ``where`` that skipped ``missing`` and
    ``unexpected`` keys (a ``SkippedKeys`` carrying them), at the user's line."""
    text = skipped_keys(where, missing, unexpected)
    skipped = SkippedKeys(text, path=path, missing=missing, unexpected=unexpected)
    warnings.warn(skipped, stacklevel=user_stacklevel())


def warn_left_on_meta(
    text: str,
    *,
    path: Path | None = None,
    missing: Iterable[str] = (),
    unexpected: Iterable[str] = (),
) -> None:
    """The warning ``text`` of ``left_on_meta`` (a ``SkippedKeys`` carrying ``missing`` and
    ``unexpected``), or ``LeftOnMeta`` (with ``path`` and ``missing``) where the load under
    way refuses it."""
    if REFUSE_LEFT_ON_META.get():
        raise LeftOnMeta(text, path=path, missing=missing)
    skipped = SkippedKeys(text, path=path, missing=missing, unexpected=unexpected)
    warnings.warn(skipped, stacklevel=user_stacklevel())


def left_on_meta(
    model: nn.Module,
    p: Path | str,
    left: list[Slot],
    strict: bool,
    target: torch.device | None,
    renamed: bool = False,
) -> str:
    """The warning for tensors that a load onto a real device left on meta (keys ``p`` lacks,
    with ``strict=False``; ``renamed``: once the caller's ``rename=`` is applied): they hold
    no values and make the model compute garbage."""
    names = [s.names[0] for s in left]
    tied, meta = _tied_hint(model, left)
    rest = [s for s in left if s.tensor is not meta]
    fix = ""
    if rest:
        fix = (
            " Give them values before the model runs: load them from a file that holds them, "
            "or initialise them"
        )
        holder = rest[0].homes[0][0]
        own = [*holder._parameters.values(), *holder._buffers.values()]
        staying = {id(s.tensor) for s in left}
        if (
            hasattr(holder, "reset_parameters")
            and holder is not model
            and all(t is None or id(t) in staying for t in own)  # else to_empty wipes what loaded
        ):
            code = python_path(path_of(model, holder))
            dev = target_for(rest[0], target)
            fix += f", e.g. {code}.to_empty(device={str(dev)!r}) then {code}.reset_parameters()"
    why = "strict=False" if not strict else "the model's load post-hooks"
    return (
        f"torchplace.load_into left {len(names)} tensor(s) of {type(model).__name__} on meta, "
        f"where they hold no values: {listing(names)}. {p} has no key for them"
        f"{' once the rename= given is applied' * renamed} "
        f"({why} let the load go ahead), and a model with tensors on meta fails or, "
        "worse, computes garbage (F.linear of a real input and a meta weight returns "
        f"uninitialised values).{tied}{fix}"
    )
