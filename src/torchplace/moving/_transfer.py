"""Copying tensors to a device: the one engine behind ``move`` and ``DeviceLoader``.

Every byte a move sends travels through ``copy_tensor`` or the copies it stands for.
``Copier`` copies each distinct tensor once for one move: many small host tensors packed into
one consolidated copy (``_consolidate``; each result owns its storage, or, for a batch moved
with ``views=True``, lands as a view of a bounded shared buffer), large pageable ones staged
through the pinned ring (``_staging``), a model's large tensors back to the host through the
same ring, the rest one by one with ``non_blocking`` chosen per (source, target)
(``choose_non_blocking``), and the host syncs it owes remembered. ``tensor_mover`` decides
once per target what a batch move can decide once. ``object_to`` is the one rule for objects
with a ``.to`` of their own. The loader uses ``consolidate_small`` and ``pinned_copy`` on its
own stream.

To copy one host tensor to a device, staged: ``Copier(device, None).copy(t, device)`` then
``synchronize()``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._devices import free_memory
from .._errors import MoveError, first_line
from .._sizes import format_bytes
from .._tensor_size import nbytes
from ._consolidate import (
    consolidated_views,
    packed_host_copy,
    should_consolidate,
    small_host_tensors,
)
from ._staging import Stager, stageable, stageable_back

__all__ = [
    "OWNED_GROUP_BYTES",
    "Copier",
    "CopyFailed",
    "byte_groups",
    "choose_non_blocking",
    "consolidate_small",
    "copy_tensor",
    "data_meta_message",
    "is_accelerator",
    "object_to",
    "on",
    "own_to",
    "pinned_copy",
    "tensor_mover",
]


# A module's small tensors travel consolidated in groups of at most this many bytes: the owned
# split holds the landed group and its results at once, so this bounds the device memory a
# model move needs beyond the moved bytes.
OWNED_GROUP_BYTES = 64 << 20


def copy_tensor(t: torch.Tensor, target: torch.device, non_blocking: bool) -> torch.Tensor:
    """One tensor's copy to ``target``; the single place every byte of a move travels through."""
    return t.to(target, non_blocking=non_blocking)


_COPY_TENSOR = copy_tensor


def on(t: torch.Tensor, target: torch.device, /) -> bool:
    """Whether ``t`` is on ``target`` (with an index where it has one), asked without building
    a ``torch.device`` (``t.device`` costs more than the rest of a prefilled batch tensor's
    move) for the usual targets.

    >>> import torch
    >>> on(torch.ones(1), torch.device("cpu")), on(torch.ones(1), torch.device("meta"))
    (True, False)
    """
    kind = target.type
    if kind == "cuda":
        return t.is_cuda and t.get_device() == target.index
    if kind == "cpu":
        return t.is_cpu
    if kind == "meta":
        return t.is_meta
    return t.device == target


def is_accelerator(dev: torch.device) -> bool:
    return dev.type not in ("cpu", "meta")


def choose_non_blocking(
    t: torch.Tensor, target: torch.device, requested: bool | None, *, batch: bool = False
) -> bool:
    """The ``non_blocking=None`` policy: async from pinned host memory and between devices.

    Device-to-host copies of batch tensors are asynchronous too (``move`` waits for them by
    event before it returns). Those of a model's or optimizer's tensors are not: PyTorch gives
    an asynchronous device-to-host copy a pinned result, and a whole model should not land in
    page-locked memory, which the host allocator rounds up and keeps.
    """
    if requested is not None:
        return requested
    source = t.device
    if source.type == "meta" or target.type == "meta":
        return False
    if source.type == "cpu":
        return is_accelerator(target) and t.is_pinned()
    if target.type == "cpu":
        return batch
    return True  # device-to-device: PyTorch orders it on both devices' streams


class CopyFailed(Exception):
    """A copy that failed, before anyone knew the tensor's name."""

    def __init__(
        self,
        t: torch.Tensor,
        target: torch.device,
        cause: BaseException | None,
        *,
        batch: bool = False,
    ) -> None:
        super().__init__(cause)
        self.tensor = t
        self.target = target
        self.cause = cause
        self.batch = batch  # a tensor of a batch (data), not of a model or optimizer

    note = ""  # said after the message of a tensor on meta (what else the move would lose)

    def message(self, name: str) -> str:
        if self.cause is None and self.batch and not isinstance(self.tensor, torch.nn.Parameter):
            return data_meta_message(name, self.tensor, self.target) + ". Nothing was moved"
        if self.cause is None:  # the note is for the model's tensors, not the state's own
            note = "" if ".state[" in name else self.note
            return meta_message(name, self.target) + note
        return failure(name, self.tensor, self.target, self.cause)


def data_meta_message(name: str, t: torch.Tensor, target: torch.device) -> str:
    """Why a tensor of a batch (data, not a model's weight) on meta cannot move, and what to
    do instead; ``name`` is its path in the batch (``batch['x']``)."""
    dtype = str(t.dtype).removeprefix("torch.")
    size = ", ".join(str(s) for s in t.shape) or "()"
    return (
        f"{name} is on meta: it has a shape {tuple(t.shape)} and dtype {dtype} but "
        f"no values, so there is nothing to copy to {target}. Data needs real values: create "
        f"this tensor on a real device where it is made on meta (torch.empty(..., "
        "device='meta') or under `with torch.device('meta')`), e.g. "
        f"torch.zeros({size}, dtype=torch.{dtype}, device='{target}'), or from the real data "
        "it stands for"
    )


def meta_message(name: str, target: torch.device) -> str:
    head = (
        f"{name} is on meta, which holds shapes but no data, so it cannot be copied to "
        f"{target} ('Cannot copy out of meta tensor')"
    )
    if ".state[" in name:  # an optimizer's: load_into does not fill those
        return (
            f"{head}; its values were lost when the optimizer's state moved to meta: clear it "
            "with opt.state.clear() (the optimizer starts afresh at its next step) or load a "
            "saved one with opt.load_state_dict(saved), then move again. Nothing was moved"
        )
    if name.endswith(".grad"):
        return (
            f"{head}; a gradient on meta has no values: drop it with model.zero_grad(), then "
            "move again. Nothing was moved"
        )
    return (
        f"{head}; load its values with torchplace.load_into(model, checkpoint, '{target}') "
        "(ties kept), or allocate it with "
        f"model.to_empty(device='{target}') and initialise it (to_empty makes new parameters: "
        "tie tied weights again, and build an optimizer anew on them). Nothing was moved"
    )


def describe_tensor(t: torch.Tensor) -> str:
    """``4x8 float32, 128 B``; for a tensor with no plain shape (nested), its layout instead."""
    dtype = str(t.dtype).replace("torch.", "")
    try:
        shape = "x".join(str(s) for s in t.shape) or "scalar"
        return f"{shape} {dtype}, {format_bytes(nbytes(t))}"
    except Exception:  # a nested tensor has no sizes, and says so by raising
        kind = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
        return f"a {kind} {dtype} tensor"


def _first_line(exc: BaseException) -> str:
    """The gist of an error: its first line, or first sentence when that line runs long (a
    dispatcher error lists every backend it knows); the whole error stays chained."""
    line = first_line(exc)
    if len(line) > 300:
        end = line.find(". ", 40)
        line = (line[: end + 1] if end > 0 else line[:300] + "...") + " (full error chained)"
    return line


def failure(name: str, t: torch.Tensor, target: torch.device, exc: BaseException) -> str:
    text = (
        f"could not move {name} ({describe_tensor(t)}) from {t.device} to {target}: "
        f"{_first_line(exc)}"
    )
    free = free_memory(target) if is_accelerator(target) else None
    if free is not None:
        text += f" ({format_bytes(free)} free on {target})"
    return text + "; nothing was moved"


def byte_groups(tensors: list[torch.Tensor], limit: int, /) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive runs of ``tensors`` holding at most ``limit`` bytes each
    (a tensor larger than that alone).

    >>> import torch
    >>> byte_groups([torch.zeros(2), torch.zeros(2), torch.zeros(4), torch.zeros(1)], 16)
    [(0, 2), (2, 3), (3, 4)]
    """
    groups = []
    start = 0
    while start < len(tensors):
        stop, size = start + 1, tensors[start].nbytes
        while stop < len(tensors) and size + tensors[stop].nbytes <= limit:
            size += tensors[stop].nbytes
            stop += 1
        groups.append((start, stop))
        start = stop
    return groups


class Copier:
    """Copies tensors for one move, each distinct tensor once, remembering host syncs owed."""

    def __init__(self, target: torch.device, non_blocking: bool | None) -> None:
        self.target = target
        self.non_blocking = non_blocking
        self.copies: dict[int, torch.Tensor] = {}
        self.sync_sources: set[torch.device] = set()
        # id(copy of a parameter) -> the parameter that now holds it, so that a batch holding
        # both a model and one of its parameters gets the model's own parameter back.
        self.finals: dict[int, torch.Tensor] = {}
        self.stagers: dict[torch.device, Stager] = {}
        # Non-persistent buffers whose values a move to meta discards, to warn about.
        self.discarded: list[str] = []
        # Said after the error for a model tensor on meta: the optimizers' state lost too.
        self.meta_note = ""

    def _stager(self, target: torch.device) -> Stager:
        stager = self.stagers.get(target)
        if stager is None:
            stager = self.stagers[target] = Stager(target)
        return stager

    def prefill(
        self, tensors: Iterable[torch.Tensor], *, detach: bool = False, views: bool = False
    ) -> None:
        """Send many small host tensors bound for an accelerator as one consolidated copy.

        The results wait in ``copies`` for ``copy`` to hand out. ``detach`` (module moves, done
        without autograd) lets parameters travel as plain data. ``views`` (a batch's tensors)
        lands them as views of bounded shared buffers (``_consolidate.consolidated_views``);
        otherwise each owns its storage. Either way they go in groups of at most
        ``OWNED_GROUP_BYTES``, which bounds the pinned staging and, for owned results, the
        device memory beyond the moved bytes. Any failure here falls back to per-tensor
        copies, which then name the tensor that cannot travel.
        """
        if not is_accelerator(self.target):
            return
        copies = self.copies
        unique: dict[int, torch.Tensor] = {}
        for t in tensors:
            if t.is_cpu:
                unique.setdefault(id(t), t)
        for done in copies.keys() & unique.keys() if copies else ():
            del unique[done]
        if detach:  # module moves: fewer tensors, each with its detached twin
            pairs = [(t, t.detach()) for t in unique.values()]
            small = {id(t) for t in small_host_tensors([d for _, d in pairs])}
            originals = [t for t, d in pairs if id(d) in small]
            todo = [d for _, d in pairs if id(d) in small]
        else:  # a batch: as little work per tensor as can be (large ones go through the ring)
            originals = todo = small_host_tensors(unique.values())
        if not should_consolidate(todo, self.target):
            return
        non_blocking = self.non_blocking is not False
        pin = self.target.type == "cuda"
        for start, stop in byte_groups(todo, OWNED_GROUP_BYTES):  # bounded staging, both ways
            group = todo[start:stop]
            try:
                if views:
                    results, _ = consolidated_views(
                        group, self.target, pin=pin, non_blocking=non_blocking, eligible=True
                    )
                else:
                    results = packed_host_copy(group, self.target, non_blocking=non_blocking)
            except Exception:
                return
            for t, new in zip(originals[start:stop], results, strict=True):
                self.copies[id(t)] = new

    def copy(self, t: torch.Tensor, target: torch.device, *, batch: bool = False) -> torch.Tensor:
        """``t`` on ``target``; raises ``CopyFailed`` (no name known here) when it cannot.

        ``batch`` marks tensors of a batch, as opposed to a model's or optimizer's.
        """
        done = self.copies.get(id(t))  # first: a batch's tensors mostly wait there, prefilled
        if done is not None and on(done, target):
            return done
        if on(t, target):
            return t
        if t.is_meta:
            failed = CopyFailed(t, target, None, batch=batch)
            if self.meta_note:
                failed.note = self.meta_note
            raise failed
        staged = stageable(t, target)  # asks is_pinned (a driver call) once for both
        back = not staged and not batch and stageable_back(t, target)
        asynchronous = not (staged or back) and choose_non_blocking(
            t, target, self.non_blocking, batch=batch
        )
        try:
            if staged:
                new = self._stager(target).copy(t)
            elif back:  # a model's tensor: pageable on the host, at pinned speed, complete
                new = self._stager(t.device).copy_back(t)
            else:
                new = copy_tensor(t, target, asynchronous)
        except Exception as exc:
            raise CopyFailed(t, target, exc) from exc
        if asynchronous and target.type == "cpu" and is_accelerator(t.device):
            self.sync_sources.add(t.device)
        self.copies[id(t)] = new
        return new

    def __call__(
        self, t: torch.Tensor, name: str, target: torch.device | None = None
    ) -> torch.Tensor:
        """``copy`` for a tensor whose name is known: failures become ``MoveError``."""
        try:
            return self.copy(t, self.target if target is None else target)
        except CopyFailed as failed:
            raise MoveError(failed.message(name), name=name) from failed.cause

    def synchronize(self) -> None:
        """Order the current stream after the staged copies; wait, by event, for device-to-host
        copies so no caller reads bytes not yet there.

        With ``non_blocking=False`` also for staged host-to-device copies, as ``.to()`` would.
        """
        for stager in self.stagers.values():
            if self.non_blocking is False:
                stager.synchronize()
            else:
                stager.finish()
        for source in self.sync_sources:
            if source.type == "cuda":
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(source))
                event.synchronize()
            elif source.type == "mps":
                torch.mps.synchronize()  # one device, no argument
            else:
                module = getattr(torch, source.type, None)
                if module is not None and hasattr(module, "synchronize"):
                    module.synchronize(source)

    def abandon(self) -> None:
        """After a failure, before the copies are dropped: wait for staged transfers still
        writing into them (their memory must not be handed out while being written)."""
        for stager in self.stagers.values():
            with contextlib.suppress(Exception):
                stager.abandon()


def tensor_mover(target: torch.device, copier: Copier) -> Callable[[torch.Tensor], torch.Tensor]:
    """The per-tensor step of a batch move, decided once per target rather than per tensor.

    Moving a batch to where it already is must cost next to nothing, so the "already there?"
    test avoids building a ``torch.device`` per tensor (``t.device`` is the slowest way to ask).
    Towards meta no bytes travel: nothing to stage, pack or wait for, so a tensor seen for the
    first time is copied straight away, and one seen before (a batch may hold it twice) comes
    back as the same copy.
    """
    copy = copier.copy
    if target.type == "cpu":
        return lambda t: t if t.is_cpu else copy(t, target, batch=True)
    if target.type == "meta":
        copies = copier.copies
        copy_one = copy_tensor  # read now: a test may have replaced it
        # The genuine copy_tensor is t.to(target): called without its frame, a third of the
        # cost of a tensor sent to meta. A test that replaces copy_tensor gets it called.
        direct: Callable[[torch.Tensor, torch.device], torch.Tensor] = (
            torch.Tensor.to
            if copy_one is _COPY_TENSOR
            else lambda t, target: copy_one(t, target, False)
        )

        def to_meta(t: torch.Tensor) -> torch.Tensor:
            if t.is_meta:  # a batch already there costs next to nothing
                return t
            try:  # a tensor met twice comes back as its first copy (no bytes: copying is free)
                done = copies.get(id(t))
                return done if done is not None else copies.setdefault(id(t), direct(t, target))
            except Exception as exc:
                raise CopyFailed(t, target, exc) from exc

        return to_meta
    if target.type == "cuda":
        index = target.index
        copies = copier.copies

        def to_cuda(t: torch.Tensor) -> torch.Tensor:
            # Copier.copy's first two questions, asked here without its call: a batch's small
            # tensors mostly wait in the prefilled copies.
            done = copies.get(id(t))
            if done is not None and done.is_cuda and done.get_device() == index:
                return done
            if t.is_cuda and t.get_device() == index:
                return t
            return copy(t, target, batch=True)

        return to_cuda
    return lambda t: copy(t, target, batch=True)


def own_to(node: Any, target: torch.device, *, asynchronous: bool) -> Any:
    """``node.to(target)`` for an object with its own ``.to``, called on a shallow copy.

    Some such methods work in place and return ``self`` (a tokenizer's BatchEncoding): the
    copy keeps the caller's object as it was, as for any other batch. A result that is not of
    the object's kind (``None``, from a ``.to`` that forgot to return) is refused.
    """
    try:
        subject = copy.copy(node)
    except Exception:  # an object that cannot be copied is asked as it is
        subject = node
    # Asynchronous only towards an accelerator: nothing here could wait for a host copy.
    result = object_to(subject, target, non_blocking=asynchronous and is_accelerator(target))
    if not isinstance(result, type(node)):
        cls = type(node).__name__
        raise TypeError(
            f"its own {cls}.to() returned {type(result).__name__} instead of the moved "
            f"{cls}; a .to() must return the moved object (return self when it works in place)"
        )
    return result


def object_to(obj: Any, target: torch.device, *, non_blocking: bool) -> Any:
    """``obj.to(target, non_blocking=...)`` for an object with a ``.to`` of its own.

    One that takes no ``non_blocking`` (an older tokenizer output) is asked again without it;
    any other TypeError is its own and is raised.
    """
    if non_blocking:
        try:
            return obj.to(target, non_blocking=True)
        except TypeError as exc:
            if "non_blocking" not in str(exc):
                raise
    return obj.to(target)


def pinned_copy(
    t: torch.Tensor, target: torch.device, *, pin: bool, non_blocking: bool
) -> torch.Tensor:
    """``t`` on ``target``, through pinned host memory when ``pin`` asks (the loader's copy)."""
    if t.device == target:
        return t
    if pin and t.is_cpu and not t.is_pinned():
        t = t.pin_memory()
    return copy_tensor(t, target, non_blocking)


def consolidate_small(
    tensors: Iterable[torch.Tensor], target: torch.device, *, non_blocking: bool, views: bool
) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
    """The small host tensors among ``tensors``, packed into one copy to ``target`` when that
    pays (``_consolidate.should_consolidate``): id(tensor) -> its copy, and the tensors whose
    storage holds every copy (with ``views=True``: the shared buffers and the loose copies; else
    the copies); both empty when it does not pay. Raises what the packed copy raised."""
    small = small_host_tensors(tensors)
    if not should_consolidate(small, target):
        return {}, []
    if views:
        pin = target.type == "cuda"
        outs, buffers = consolidated_views(
            small, target, pin=pin, non_blocking=non_blocking, eligible=True
        )
    else:
        outs = packed_host_copy(small, target, non_blocking=non_blocking)
        buffers = outs
    return {id(t): out for t, out in zip(small, outs, strict=True)}, buffers
