"""``load_into``'s second half: the state read fitted to the model (``Fit``: each key's slot, what
is missing, unexpected or mis-shaped), every transfer that may fail done first (``prepare_fit``),
then swapped and filled in one step with post-hooks and own loaders (``apply_fit``), all or
nothing."""

from __future__ import annotations

import bisect
import contextlib
import functools
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._errors import CheckpointError, MoveError, user_stacklevel
from .._model_walk import Slot
from ..moving._identity import parameter_like
from ..moving._move import discarded_warning
from ..moving._own_moves import AttributeSnapshot, run_own_moves
from ._formats import first_sentence
from ._keys import (
    Held,
    KeyCheck,
    Missing,
    check_keys,
    does_not_fit,
    matches_nothing,
    no_data_buffers,
)
from ._mismatch import (
    Shapes,
    left_on_meta,
    listing,
    target_for,
    warn_left_on_meta,
    warn_skipped,
)
from ._skeleton import swap
from ._statedict import (
    has_post_hooks,
    run_post_hooks,
    set_extra_states,
)

__all__ = ["Fit", "apply_fit", "prepare_fit", "warn_skipped_first"]


def _place(slot: Slot, value: torch.Tensor, undos: list[Callable[[], object]]) -> None:
    """Put ``value`` in the slot, keeping the Parameter object (and so ties and optimizers).

    What puts the slot back is appended to ``undos`` before anything changes, and it checks
    whether the change was made, so an interrupt at any point leaves an undo that is right.
    """
    current = slot.tensor
    if slot.is_param:
        assert isinstance(current, nn.Parameter)
        new = parameter_like(current, value, materialize=True)
        before = current._cdata  # swap_tensors exchanges the tensors' implementations

        def unswap() -> None:
            if current._cdata != before:
                swap(current, new)  # new holds what current held

        undos.append(unswap)
        try:
            swap(current, new)
            return
        except (RuntimeError, TypeError):  # weak references or autograd holds it: rebind
            undos.pop()
            replacement: torch.Tensor = new
    else:
        replacement = value

    def rebind(to: torch.Tensor) -> None:
        for module, name in slot.homes:
            if slot.is_param:
                module._parameters[name] = to  # type: ignore[assignment]
            else:
                module._buffers[name] = to
        slot.tensor = to

    undos.append(functools.partial(rebind, current))
    rebind(replacement)


_MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


def _in_layout_of(model_tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` laid out as ``model_tensor`` is (contiguous, or channels-last), when it is."""
    for memory_format in _MEMORY_FORMATS:
        if model_tensor.is_contiguous(memory_format=memory_format):
            return value.contiguous(memory_format=memory_format)
    return value


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of a file hold the same values (NaN equal to NaN); meta ones match."""
    if a.shape != b.shape:
        return False
    if a.device.type == "meta" or b.device.type == "meta":
        return True  # no data to compare: a load onto meta checks shapes only
    if (a.dtype, a.device, a.stride()) == (b.dtype, b.device, b.stride()) and (
        a.data_ptr() == b.data_ptr()
    ):
        return True  # one tensor saved under both names, as a tied model saves it: not read
    if torch.equal(a, b):
        return True
    return (
        a.dtype == b.dtype
        and (a.is_floating_point() or a.is_complex())
        and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())
    )


class _Spans:
    """The bytes already given to the model's tensors, per device, kept sorted and disjoint.

    A file may hold one storage under several names (tied weights) or overlapping views of it
    (``{"a": big, "b": big[:2]}``); assigned as they are, weights the model keeps apart would
    share memory, and a step on one would change the other. Bytes are compared by address, so
    tensors mapped from one file, each on its own storage, are told apart by their ranges.
    """

    def __init__(self) -> None:
        self.starts: dict[torch.device, list[int]] = {}
        self.ends: dict[torch.device, list[int]] = {}

    def claim(self, t: torch.Tensor) -> bool:
        """Record the bytes ``t`` shows; False (nothing recorded) when another tensor has some."""
        if t.device.type == "meta" or t.numel() == 0:
            return True
        try:
            start = t.data_ptr()
        except (RuntimeError, NotImplementedError):  # no addressable storage: nothing to share
            return True
        extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        end = start + (extent + 1) * t.element_size()
        starts = self.starts.setdefault(t.device, [])
        ends = self.ends.setdefault(t.device, [])
        i = bisect.bisect_right(starts, start)
        if (i > 0 and ends[i - 1] > start) or (i < len(starts) and starts[i] < end):
            return False
        starts.insert(i, start)
        ends.insert(i, end)
        return True


def warn_skipped_first(fit: Fit) -> None:
    """The one warning of a ``strict=False`` load that skips keys, given before anything of the
    model changes; where the fill will leave tensors on ``meta``, its warning after the fill
    is that one instead (``_warn_after_fill``), naming the skipped keys too."""
    if fit.strict or not (fit.check.missing or fit.check.unexpected):
        return
    planned = {id(slot) for slot, _ in fit.plan}
    if fit.read_on.type != "meta" and any(
        s.tensor.is_meta and id(s) not in planned for s in (*fit.loadable, *fit.transient)
    ):
        return
    path = fit.p if isinstance(fit.p, Path) else None
    warn_skipped(fit.p, path, fit.check.missing_names, list(fit.check.unexpected))


def _warn_after_fill(fit: Fit) -> None:
    """The warnings of a load that went through: values a load onto meta discarded, as ``move``
    gives them, and tensors that a load onto a real device left on meta (a key the file lacks,
    with ``strict=False``), which hold no values and make the model compute garbage.

    Given as the last step of the load, inside its all or nothing: where warnings are errors,
    the model is put back as it was before the error goes on.
    """
    if fit.discarded:
        warnings.warn(
            discarded_warning("load_into", fit.discarded), UserWarning, stacklevel=user_stacklevel()
        )
    path = fit.p if isinstance(fit.p, Path) else None
    missing = [] if fit.strict else fit.check.missing_names
    unexpected = [] if fit.strict else list(fit.check.unexpected)
    left = [s for s in (*fit.loadable, *fit.transient) if s.tensor.is_meta]
    if left and fit.read_on.type != "meta":  # the one warning: it names what was skipped too
        text = left_on_meta(
            fit.model, fit.p, left, fit.strict, fit.target, fit.check.renamed is not None
        )
        if unexpected:
            text += f" It skipped the source's {listing(unexpected)} too (the model takes none)."
        on_meta = [s.names[0] for s in left]
        every = on_meta + [n for n in missing if n not in set(on_meta)]
        warn_left_on_meta(text, path=path, missing=every, unexpected=unexpected)


class Fit:
    """How a state dict fits the model: what goes where, and what is missing or refused.

    Raises ``CheckpointError`` (the model untouched) for a file that does not fit, unless the
    model's post-hooks may yet clear its missing or unexpected keys (``deferred``).
    """

    def __init__(
        self,
        p: Path | str,
        model: nn.Module,
        seen: Any,
        loadable: list[Slot],
        transient: list[Slot],
        extra: Mapping[str, nn.Module],
        read_on: torch.device,
        strict: bool,
        file_shapes: Mapping[str, tuple[int, ...]] | None = None,
        lacking: Mapping[str, tuple[str, ...]] | None = None,
        renamed: tuple[int, int] | None = None,
    ) -> None:
        self.p, self.model, self.strict, self.transient = p, model, strict, transient
        # What key hints weigh: a rename is suggested only where the shapes agree.
        self.shapes: Shapes = (
            file_shapes or {},
            {n: tuple(s.tensor.shape) for s in loadable if not is_lazy(s.tensor) for n in s.names},
        )
        self.read_on, self.loadable = read_on, loadable
        # A load onto meta discards the values of the non-persistent buffers it moves there.
        self.discarded = [
            s.names[0] for s in transient if read_on.type == "meta" and not s.tensor.is_meta
        ]
        self.target: torch.device | None = None  # set by prepare_fit: where tensors go
        self.loaders = seen.loaders
        own = seen.own
        # A lazy parameter takes the file's shape, as its load_state_dict pre-hook (which
        # load_into does not run: it would materialize before the checks) lets it.
        check = check_keys(
            loadable, own, _held, takes_any_shape=lambda s: is_lazy(s.tensor), lacking=lacking
        )
        check.renamed = renamed  # the keys as the caller's rename= gave them, if it gave one
        self.plan, empty, conflicts = _values(check, own, read_on)
        check.add_missing(k for k in extra if k not in own)
        check.add_missing(seen.missing)  # what pre-hooks reported
        check.unexpected = list(seen.unexpected)
        self.check = check
        # Every name of what stays as it was, for post-hooks.
        self.not_loaded = [n for m in check.missing for n in (m.name, *m.tied)]
        self.unexpected = check.unexpected
        problems = self._problems(seen.errors, empty, conflicts, transient)
        # Keys alone: post-hooks may clear them, as load_state_dict lets them (its strict check
        # comes after its post-hooks). Then the load goes ahead, and is undone if any is left.
        keys = bool(check.missing or check.unexpected)
        self.hooked = has_post_hooks(model)
        self.deferred = strict and keys and not problems and self.hooked
        self.matched = bool(self.plan) or any(k in own for k in extra)  # strict=False loads any
        if (strict and keys and not self.deferred) or problems:
            raise self._does_not_fit(problems)
        if not strict and not self.matched and loadable and not self.hooked:
            raise matches_nothing(p, type(model).__name__, check, self.shapes)

    def _does_not_fit(self, problems: list[str]) -> CheckpointError:
        """The refusal of a file whose keys or values do not fit (the model untouched)."""
        fix = "; pass strict=False to load what matches" if self.matched and not problems else ""
        p = self.p
        return does_not_fit(
            p,
            type(self.model).__name__,
            self.check,
            problems,
            strict=self.strict,
            fix=fix,
            shapes=self.shapes,
            path=p if isinstance(p, Path) else None,
        )

    def _problems(
        self,
        errors: list[str],
        empty: list[str],
        conflicts: list[tuple[str, str]],
        transient: list[Slot],
    ) -> list[str]:
        """What stops the load besides keys: mis-shaped tensors, tied weights saved with two
        values, a module's refusal, values with no data, buffers no checkpoint holds."""
        problems = self.check.shape_problems()
        if conflicts:
            drop = conflicts[0][1]
            problems.append(
                f"tied weights saved with different values: "
                f"{listing([f'{a} and {b}' for a, b in conflicts])} (the file was "
                "saved from a model that keeps them apart; keep the value you want and drop the "
                f"other, e.g. rename=lambda k: None if k == {drop!r} else k)"
            )
        if errors:
            problems.append(f"refused by the model: {listing(errors)}")
        if empty:
            problems.append(
                f"tensors on meta, which hold no values to load: {listing(empty)} (the state "
                "dict came from a model on meta or a skeleton not yet filled; load the weights "
                "from the file they were saved to, or load onto 'meta' to check shapes only)"
            )
        read_on = self.read_on
        no_data = [
            s.names[0]
            for s in transient
            if s.tensor.device.type == "meta" and read_on.type != "meta"
        ]
        if self.strict and no_data:
            problems.append(no_data_buffers(no_data, self.p, str(read_on)))
        return problems


def _held(value: Any) -> Held:
    """What the key check compares of a state dict's value."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.is_complex()
    return type(value).__name__


def _values(
    check: KeyCheck, own: Mapping[str, Any], read_on: torch.device
) -> tuple[list[tuple[Slot, torch.Tensor]], list[str], list[tuple[str, str]]]:
    """The value each matched slot takes, the names whose values hold no data (on meta, bound
    for a real device; found now, before anything is written), and the tied names saved with
    different values."""
    plan: list[tuple[Slot, torch.Tensor]] = []
    empty: list[str] = []
    conflicts: list[tuple[str, str]] = []
    for slot, present in check.matched:
        meta = [n for n in present if own[n].device.type == "meta" and read_on.type != "meta"]
        if meta:
            empty += meta
            continue
        value = own[present[0]]
        # A tied parameter is one tensor: a file that gives its names different values was
        # saved from a model that kept them apart, and either value would be a guess.
        conflicts += [(present[0], n) for n in present[1:] if not _same_values(value, own[n])]
        plan.append((slot, value))
    return plan, empty, conflicts


class _Prepared:
    """Phase 1's result: tensors to fill in place, tensors to swap in, values kept for undo."""

    __slots__ = ("backups", "fills", "places", "writing", "written")

    def __init__(self) -> None:
        self.fills: list[tuple[Slot, torch.Tensor]] = []  # memory on the target: filled
        self.places: list[tuple[Slot, torch.Tensor]] = []  # a new tensor swapped in
        self.backups: list[tuple[torch.Tensor, torch.Tensor]] = []  # filled tensors' values
        self.writing = False  # the fills may have begun: set before the write's call
        self.written = False  # the fills are done: values with no copy kept were overwritten


def prepare_fit(fit: Fit, target: torch.device | None, *, copy: bool) -> _Prepared:
    """Phase 1: every transfer and conversion, which may fail for lack of memory or a bad
    device, done before the model changes, so that such a failure leaves it untouched.

    ``copy``: the values are the caller's (a mapping), so the model gets copies of its own.
    """
    out = _Prepared()
    fit.target = target
    spans = _Spans()  # the bytes given to a slot so far
    try:
        for slot, value in fit.plan:
            dev = target_for(slot, target)
            current = slot.tensor
            lazy = is_lazy(current)
            if current.device == dev and dev.type != "meta" and not lazy:
                out.fills.append((slot, value))
                if fit.deferred or not slot.is_param:
                    # Kept to put back: all that is filled when post-hooks may yet undo the
                    # load, and buffers always (a skeleton's are real, and they are small), so
                    # that only a real model's parameters can be left partly filled.
                    out.backups.append((current, current.detach().clone()))
                continue
            placed = value.to(device=dev, dtype=current.dtype, copy=copy)
            if not lazy and placed.stride() != current.stride():
                # The file keeps the layout it was saved in (a transposed view, say); the model
                # keeps its own, as load_state_dict's copy would, so .view() works as before.
                placed = _in_layout_of(current, placed)
            if not spans.claim(placed):
                # The file holds these bytes under another name too (tied in the file, or a
                # view of a bigger tensor): a model that keeps the two apart gets its own copy.
                placed = placed.clone()
                spans.claim(placed)
            out.places.append((slot, placed))
        for slot in fit.transient:
            here = slot.tensor.device
            if target is not None and here.type != "meta" and here != target:
                out.places.append((slot, slot.tensor.to(target)))
    except Exception as exc:
        raise CheckpointError(
            f"{fit.p}: could not be placed into {type(fit.model).__name__} ({type(exc).__name__}"
            f": {first_sentence(str(exc))}); the model is untouched",
            path=fit.p if isinstance(fit.p, Path) else None,
        ) from exc
    return out


def _write_fills(ready: _Prepared) -> None:
    """Every value of ``ready.fills`` copied into its tensor, in one call."""
    targets = [slot.tensor for slot, _ in ready.fills]
    values = [value for _, value in ready.fills]
    if targets:
        with torch.no_grad():
            # One C call: no line of Python runs between two copies.
            torch._foreach_copy_(targets, values)


def _lost_on_undo(fit: Fit, ready: _Prepared) -> bool:
    """Whether the fills overwrite parameters in place with no copy kept to put back."""
    return not fit.deferred and any(slot.is_param for slot, _ in ready.fills)


def apply_fit(
    fit: Fit, ready: _Prepared, extra: Mapping[str, nn.Module], own: Mapping[str, Any]
) -> nn.Module:
    """Phase 2: extra state set, tensors swapped in and filled, post-hooks run, warnings given;
    all or nothing.

    Each step records how to undo it before it is taken (and the undo checks whether it was),
    so an error or a ``KeyboardInterrupt`` at any point puts the model back as it was, except
    values filled in place into a real model's memory with no copy kept: an error in that write
    says the model is partly filled, and an interrupt once it may have begun finishes it, so
    that every weight is loaded. The steps run in a frame of their own, so that wherever an
    interrupt lands in them, it reaches the handler here through a call.
    """
    undos: list[Callable[[], object]] = []

    def put_back() -> str:
        """Undo what phase 2 did, every step tried; what could not be undone ("" if nothing)."""
        restores: list[Callable[[], object]] = [
            functools.partial(torch.Tensor.copy_, t, before) for t, before in ready.backups
        ]
        failures = []
        with torch.no_grad():
            for undo in [*restores, *reversed(undos)]:
                try:
                    undo()
                except Exception as exc:  # a post-hook made a view of a swapped parameter, ...
                    failures.append(f"{type(exc).__name__}: {first_sentence(str(exc))}")
        return failures[0] if failures else ""

    try:
        _apply_steps(fit, ready, extra, own, undos, put_back)
        _own_moves_after(fit, undos, put_back)
        _warn_after_fill(fit)
        return fit.model
    except CheckpointError:  # said what state the model is in, and put it back where it could
        raise
    except BaseException:  # Ctrl-C (or a bug): the model goes back as it was
        if ready.writing and _lost_on_undo(fit, ready):
            # Parameters are (or may be) overwritten in place with no copy kept, so putting
            # the rest back would mix old and new values: every weight stays loaded instead.
            if not ready.written:  # it came as the write began or returned: finish it
                with contextlib.suppress(Exception):  # a write that failed said so already
                    _write_fills(ready)  # a value copied twice is the same value
            raise
        put_back()
        raise


def _apply_steps(
    fit: Fit,
    ready: _Prepared,
    extra: Mapping[str, nn.Module],
    own: Mapping[str, Any],
    undos: list[Callable[[], object]],
    put_back: Callable[[], str],
) -> None:
    p, model = fit.p, fit.model

    def state_after_put_back() -> str:
        failure = put_back()
        if failure:
            return f"the model could not be put back as it was ({failure}), so build it again"
        return "the model is put back as it was"

    # Extra state first: a module's set_extra_state may refuse what the file holds, and the
    # states already set are put back, so the refusal leaves the model untouched.
    set_extra_states(p, model, extra, own, undos)
    filled = False
    try:
        for slot, value in ready.places:
            _place(slot, value, undos)
        filled = _lost_on_undo(fit, ready)  # said if the write below fails part way
        # Every read and check is done: the in-place writes are one call (copy_ converts the
        # dtype). A real Ctrl-C that comes during the call is raised as it returns, before any
        # line after it, so ``writing`` is set before the call: an interrupt from here on
        # finds it set and the write finished (see apply_fit), one before it the model put back.
        ready.writing = True
        _write_fills(ready)
        ready.written = True
    except Exception as exc:
        failure = put_back()
        state = "the model is untouched"
        if failure or filled:
            state = "the model is partly filled, so build it again"
        raise CheckpointError(
            f"{p}: could not be placed into {type(model).__name__} ({type(exc).__name__}: "
            f"{first_sentence(str(exc))}); {state}",
            path=p if isinstance(p, Path) else None,
        ) from exc
    left_missing, left_unexpected = list(fit.not_loaded), list(fit.unexpected)
    _run_own_loaders(fit, undos, left_missing, left_unexpected, put_back)
    if fit.strict and not fit.deferred and left_unexpected:  # keys a self-loader did not take
        error = _keys_left(fit, left_missing, left_unexpected, matched=True)
        raise _said_more(error, f"; {state_after_put_back()}")
    if not fit.deferred:
        run_post_hooks(p, model, left_missing, left_unexpected, lambda: "the weights are loaded")
        if fit.strict and (left_missing or left_unexpected):  # a hook added keys: as torch does
            raise _said_more(
                _keys_left(fit, left_missing, left_unexpected, matched=True),
                " (reported by the model's load post-hooks once the weights were loaded, so "
                "they are loaded)",
            )
        return
    run_post_hooks(p, model, left_missing, left_unexpected, state_after_put_back)
    if left_missing or left_unexpected:
        error = _keys_left(fit, left_missing, left_unexpected, matched=fit.matched)
        raise _said_more(error, f"; {state_after_put_back()}")


def _own_moves_after(
    fit: Fit, undos: list[Callable[[], object]], put_back: Callable[[], str]
) -> None:
    """Once every tensor is in place on one device, the overrides of modules that move state of
    their own run as ``Module.to`` would run them: metric states follow the weights, and
    Lightning's ``.device`` says where they are."""
    model = fit.model
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) != 1:
        return

    def apply(do: Callable[[], None], undo: Callable[[], None]) -> None:
        undos.append(undo)
        do()

    try:
        run_own_moves([("", model)], next(iter(devices)), apply)
    except MoveError as exc:
        failure = put_back()
        state = (
            "the model is put back as it was"
            if not failure
            else (f"the model could not be put back as it was ({failure}), so build it again")
        )
        raise CheckpointError(
            f"{fit.p}: the weights fit, but {exc}; {state}",
            path=fit.p if isinstance(fit.p, Path) else None,
        ) from exc


def _run_own_loaders(
    fit: Fit,
    undos: list[Callable[[], object]],
    missing: list[str],
    unexpected: list[str],
    put_back: Callable[[], str],
) -> None:
    """Run the ``_load_from_state_dict`` of each module that loads itself, as ``load_state_dict``
    would, now that its parameters and buffers hold memory: it is handed its own keys (a
    metric's states, a weight it converts on load) and does what it does with them. Its
    attributes and its own tensors' values are saved first, so that a failure puts them back."""
    with torch.no_grad():
        for module, prefix, metadata, handed in fit.loaders:
            saved = AttributeSnapshot([module])
            tensors = [
                (t, t.detach().clone())
                for t in [*module._parameters.values(), *module._buffers.values()]
                if t is not None and t.device.type != "meta"
            ]
            undos.append(saved.restore)
            undos.extend(functools.partial(torch.Tensor.copy_, t, before) for t, before in tensors)
            reported: list[str] = []
            errors: list[str] = []
            try:
                module._load_from_state_dict(
                    dict(handed), prefix, metadata, True, reported, unexpected, errors
                )
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {first_sentence(str(exc))}")
            where = prefix[:-1] or type(fit.model).__name__
            if errors:
                failure = put_back()
                state = (
                    "the model is put back as it was"
                    if not failure
                    else (
                        f"the model could not be put back as it was ({failure}), so build it again"
                    )
                )
                raise CheckpointError(
                    f"{fit.p}: {where} ({type(module).__name__}) loads itself "
                    f"(_load_from_state_dict) and refused the file: {listing(errors)}; {state}",
                    path=fit.p if isinstance(fit.p, Path) else None,
                )
            missing += [k for k in reported if k not in missing and k not in fit.not_loaded]


def _keys_left(
    fit: Fit, missing: list[str], unexpected: list[str], *, matched: bool
) -> CheckpointError:
    """The error for the keys left once the weights are in place (a module that loads itself
    took some, a post-hook added some); ``matched``: ``strict=False`` would load something."""
    return does_not_fit(
        fit.p,
        type(fit.model).__name__,
        fit.check,
        [],
        strict=fit.strict,
        fix="; pass strict=False to load what matches" if matched else "",
        shapes=fit.shapes,
        missing=[Missing(name) for name in missing],
        unexpected=unexpected,
        path=fit.p if isinstance(fit.p, Path) else None,
    )


def _said_more(error: CheckpointError, more: str) -> CheckpointError:
    """``error`` with ``more`` said after its message, its data kept."""
    return CheckpointError(
        f"{error}{more}",
        path=error.path,
        missing=error.missing,
        unexpected=error.unexpected,
        mismatched=error.mismatched,
    )
