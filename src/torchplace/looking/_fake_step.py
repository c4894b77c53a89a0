"""One step of a model run on fake tensors and measured: the peak behind ``estimate``.

The model's parameters and buffers are swapped, in its own ``_parameters`` and ``_buffers``
tables, for fake tensors of the same shape, stride and dtype (``FakeTensorMode``: no memory),
and put back in a ``finally``, so the model keeps every object, hook and flag it had; the
user's own forward then runs as written (autocast, activation checkpointing, hooks). torch's
private ``MemTracker`` (``torch.distributed._tools.mem_tracker``, tried on torch 2.6, 2.13 and
2.15) watches every storage the step makes and says what each holds: parameters, buffers,
gradients, optimizer state, activations (made by the forward) and temporaries (made by the
backward, and by the optimizer step and freed before it returns: ``_opt_step``); a CUDA step
also holds cuBLAS workspaces, which no tensor owns (``_workspace``).

A backward on fake CUDA tensors needs the CUDA runtime (a CPU-only build aborts the process),
so a model on a device this machine cannot run, such as a fake ``cuda:0`` on a laptop, is run on
``meta`` and its figures are reported under its own device; its attention then runs the fused
kernel that device would pick (``_attention``), where ``meta`` would run the math path. A
model partly on ``meta`` runs wholly there. A model spread over several devices that cannot all
run here, and a torch whose tracker is
missing or differs from the one this was written against, raise ``Unmeasurable`` with the
reason: ``estimate`` then counts instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn

from .._model_walk import compiled_inner
from .._tree import iter_leaves, map_tensors
from ..moving._offloaded import disk_placeholders
from ._attention import FusedAttention
from ._fake_checks import FakeChecks
from ._opt_step import OptimizerStepBook
from ._side_values import SideValues
from ._user_opt import clone_over
from ._workspace import add_workspaces, note_matmul

__all__ = [
    "KINDS",
    "ModulePeak",
    "OperatorFailed",
    "StepMeasure",
    "Unmeasurable",
    "measure_step",
]

# What a step's bytes are held by, in the order tables list them; "inputs" is the example batch,
# "workspace" the cuBLAS workspaces of a CUDA step.
KINDS = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "activations",
    "temporaries",
    "workspace",
    "inputs",
)
# The tracker's names for them (its ``_MemRefType`` values), and its total's.
_TRACKER_KINDS = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "inputs",
}
_TOTAL = "Total"
# What of the tracker is used: a torch without one of these gets counting, with the reason.
_TRACKER_NEEDS = (
    "track_external",
    "get_tracker_snapshot",
    "_update_peak_stats",
    "_pre_fw_hook",
    "__enter__",
    "_track",
    "_delete_callback",
    "_track_optimizer_states",
    "_update_snap",
)


class Unmeasurable(Exception):
    """The step cannot be run and measured here; the message says why."""


@dataclasses.dataclass(frozen=True)
class ModulePeak:
    """A module that ran in the step: the most held on its device while it ran (forward or
    backward), its own parameters' bytes and its output's."""

    name: str
    type_name: str
    device: torch.device
    peak: int
    parameters: int
    outputs: int


@dataclasses.dataclass(frozen=True)
class StepMeasure:
    """``peaks``: per device, the bytes of each kind at that device's peak and ``"total"``;
    ``most``: per kind, the most held at once (summed over devices); ``modules``: the modules
    that ran, those with the highest peak first; ``first_peaks``: the first step's ``peaks``
    where a steady step (one with the optimizer's state held from its start) was run after it,
    else None."""

    peaks: dict[torch.device, dict[str, int]]
    most: dict[str, int]
    modules: tuple[ModulePeak, ...]
    first_peaks: dict[torch.device, dict[str, int]] | None = None


def _lacks(tracker: type) -> None:
    """``Unmeasurable`` where torch's MemTracker lacks a method estimate uses."""
    missing = [name for name in _TRACKER_NEEDS if not hasattr(tracker, name)]
    if missing:
        raise Unmeasurable(
            f"torch {torch.__version__}'s MemTracker lacks {', '.join(missing)}, which estimate "
            "uses"
        )


@functools.cache
def _tracker_class() -> type:
    """torch's MemTracker, taught to keep the most each kind holds at once."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except Exception as exc:  # absent from this build or torch, or broken
        raise Unmeasurable(
            f"torch {torch.__version__} has no torch.distributed._tools.mem_tracker.MemTracker "
            f"({type(exc).__name__}: {exc})"
        ) from None
    _lacks(MemTracker)

    class _Tracker(MemTracker):  # type: ignore[no-untyped-call]
        """MemTracker that also keeps the most each kind held at once, and updates the peaks
        of only the modules running (its own walks every module it has met after each
        operator: quadratic in the depth of the model, minutes for a 7B Llama)."""

        def __init__(self) -> None:
            super().__init__()
            self.torchplace_most: dict[torch.device, dict[Any, int]] = {}
            self.torchplace_stats: dict[str, Any] = {}  # module name -> its statistics
            self.torchplace_failed = FailedAt()
            self.torchplace_matmuls: set[tuple[torch.device, bool]] = set()
            self.torchplace_checks, self.torchplace_values = FakeChecks(), SideValues()
            self.torchplace_step = OptimizerStepBook()

        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            # weights a disk module's hooks brought in need no gradient, as frozen ones do
            _skip_frozen(self, module)
            super()._pre_fw_hook(module, inputs)
            stats = self.memory_tracking[module]
            self.torchplace_stats[stats.mod_fqn] = stats

        def _pre_bw_hook(self, module: nn.Module | None, args: Any) -> None:
            # None: a module made inside the forward and gone by its backward (a transformers
            # model's loss, CrossEntropyLoss()): nothing of it is left to measure, and torch's
            # tracker would warn "Module is None" to the user for each.
            if module is not None:
                super()._pre_bw_hook(module, args)

        def _post_bw_hook(self, module: nn.Module | None, args: Any) -> None:
            if module is not None:
                super()._post_bw_hook(module, args)

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            run = _stand_in(func, args, kwargs, self.torchplace_values)
            note_matmul(func, args, self.torchplace_matmuls)
            if self._in_opt and not self.torchplace_step.started:
                self.torchplace_step.start(self._curr_mem_snap, self.torchplace_most)
            try:
                self.torchplace_checks.before(func, args)
                out = super().__torch_dispatch__(run, types, args, kwargs)  # type: ignore[no-untyped-call]
            except Exception:
                self.torchplace_failed.note(func, self)
                raise
            self.torchplace_checks.after(func, args, kwargs, out)
            self.torchplace_values.after(func, args, kwargs, out)
            self.torchplace_step.op += 1
            return out

        def _track(self, reftype: Any, t: torch.Tensor) -> None:
            new = self._in_opt and None in _winfos(self, t)  # made by this operator
            super()._track(reftype, t)
            for winfo in _winfos(self, t) if new else ():
                self.torchplace_step.note_made(winfo)

        def _delete_callback(self, winfo: Any, w_st: Any) -> None:
            super()._delete_callback(winfo, w_st)
            self.torchplace_step.note_freed(winfo)

        def _track_optimizer_states(self, reftype: Any, optimizer: Any) -> None:
            super()._track_optimizer_states(reftype, optimizer)
            if self._in_opt and self.torchplace_step.started:  # its step is over
                _settle_step(self, optimizer)

        def _update_peak_stats(self, peak_state: Any) -> None:
            _update_peaks(self, peak_state)

    return _Tracker


@contextlib.contextmanager
def _tracker_changed(does: str) -> Iterator[None]:
    """``Unmeasurable`` where torch's private tracker ``does`` it otherwise than the block
    expects (an attribute, a key or a signature of it changed)."""
    try:
        yield
    except (AttributeError, KeyError, TypeError) as exc:
        raise Unmeasurable(
            f"torch {torch.__version__}'s MemTracker {does} otherwise ({type(exc).__name__}: {exc})"
        ) from exc


def _update_peaks(tracker: Any, peak_state: Any) -> None:
    """``_updated_peaks``; ``Unmeasurable`` where torch's tracker keeps its peaks otherwise."""
    with _tracker_changed("keeps its peaks"):
        _updated_peaks(tracker, peak_state)


def _updated_peaks(tracker: Any, peak_state: Any) -> None:
    """What MemTracker's ``_update_peak_stats`` does, for the running modules only, and the
    most each kind has held at once."""
    current = tracker._curr_mem_snap
    for name in tracker._mod_tracker.parents:
        stats = tracker.torchplace_stats.get(name)
        if stats is None or peak_state not in stats.snapshots:
            continue
        for dev, snap in current.items():
            if stats.local_peak.get(dev, 0) < snap[_TOTAL]:
                stats.local_peak[dev] = snap[_TOTAL]
                stats.snapshots[peak_state][-1][dev] = dict(snap)
    for dev, snap in current.items():
        if tracker._peak_mem.get(dev, 0) < snap[_TOTAL]:
            tracker._peak_mem[dev] = snap[_TOTAL]
            tracker._peak_mem_snap[dev] = dict(snap)
            if tracker._in_opt:
                tracker.torchplace_step.peaks[dev] = tracker.torchplace_step.op
        most = tracker.torchplace_most.setdefault(dev, {})
        for kind, nbytes in snap.items():
            if nbytes > most.get(kind, 0):
                most[kind] = nbytes


def _winfos(tracker: Any, t: torch.Tensor) -> list[Any]:
    """The tracker's records of the storages of ``t``."""
    return [tracker._WINFO.get(st, (None, None))[0] for st in _storages_of()(t)]


@functools.cache
def _storages_of() -> Callable[[torch.Tensor], Any]:
    """How torch's tracker finds the untyped storages of a tensor: a function of its own in
    later releases, a static method of its ``_WeakRefInfo`` in torch 2.6 (found once: it is
    asked for each tensor the optimizer's step makes)."""
    try:
        from torch.distributed._tools.common_utils import get_untyped_storages
    except ImportError:
        from torch.distributed._tools.mem_tracker import _WeakRefInfo

        get_untyped_storages = getattr(_WeakRefInfo, "get_untyped_storages")  # noqa: B009
    return cast(Callable[[torch.Tensor], Any], get_untyped_storages)


def _settle_step(tracker: Any, optimizer: torch.optim.Optimizer) -> None:
    """``_settled_step``; ``Unmeasurable`` where torch's tracker books a step otherwise."""
    with _tracker_changed("books the optimizer's step"):
        _settled_step(tracker, optimizer)


def _settled_step(tracker: Any, optimizer: torch.optim.Optimizer) -> None:
    """Move what the optimizer step made and does not keep from its state to the
    temporaries: in each device's peak inside the step, in the most each kind held at once,
    and in what is held now (see ``_opt_step``)."""
    from torch.distributed._tools.mem_tracker import _MemRefType, _UpdateType

    book: OptimizerStepBook = tracker.torchplace_step
    opt, temp = _MemRefType.OPT, _MemRefType.TEMP
    kept = {
        id(w)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
        for w in _winfos(tracker, value)
    }
    temps = book.temporaries(kept)
    for dev, snap in tracker._peak_mem_snap.items():
        moved = book.at_peak(temps, dev)
        snap[opt] -= moved
        snap[temp] += moved
    for winfo, made in temps:
        if made.freed is None and winfo.reftype == opt:
            winfo.reftype = temp
            tracker._update_snap(_UpdateType.REF, winfo, old_reftype=opt)
    for dev, most in tracker.torchplace_most.items():
        held_before, opt_before = book.before.get(dev, (0, 0))
        most[temp] = max(most.get(temp, 0), held_before + book.most_at_once(temps, dev))
        now = tracker._curr_mem_snap.get(dev, {}).get(opt, 0)
        most[opt] = max(opt_before, now)
    book.started = False


class OperatorFailed(Exception):
    """The step failed inside an operator: ``op`` (``aten.mm.default``), run by ``module``
    (its path, ``""`` for the model itself, or None when no module of the model was running)
    of class ``type_name`` (None when unknown); the operator's error is the cause."""

    def __init__(self, op: str, module: str | None, type_name: str | None) -> None:
        super().__init__(op, module, type_name)
        self.op, self.module, self.type_name = op, module, type_name


class FailedAt:
    """Where the step failed: the first (innermost) operator that raised, and the module
    running it, noted by the tracker as the error passes through its dispatch."""

    def __init__(self) -> None:
        self.error: OperatorFailed | None = None

    def note(self, func: Any, tracker: Any) -> None:
        if self.error is not None:  # an outer operator the inner one's error passes through
            return
        try:  # the tracker's private tables: a torch that keeps them otherwise names no module
            names = {v: k for k, v in tracker._mod_tracker._known_modules.items()}
            running = max(tracker._mod_tracker.parents, key=lambda n: n.count("."), default=None)
        except (AttributeError, TypeError):
            names, running = {}, None
        module = names.get(running)
        path = None if running is None else str(running).partition(".")[2]
        kind = None if module is None else type(module).__name__
        self.error = OperatorFailed(str(func), path, kind)


def _grouped_mm_any_dtype(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``aten._grouped_mm``'s result on fake tensors of a dtype its meta kernel refuses (it
    states the CUDA fast path's rules: bfloat16, strides of 16 bytes), shaped as the real
    kernels shape it: each group's product, stacked (3-d operands, or 2-d ones whose shared
    dimension ``offs`` cuts) or one after another (``offs`` cutting the rows)."""
    if mat_a.shape[-1] != mat_b.shape[-2] and max(mat_a.dim(), mat_b.dim()) == 3:
        raise RuntimeError(
            f"_grouped_mm: contraction dimension of mat_a {tuple(mat_a.shape)} and mat_b "
            f"{tuple(mat_b.shape)} must match"
        )
    groups = 0 if offs is None else offs.shape[0]
    if mat_a.dim() == 2:
        rows = [groups, mat_a.shape[0]] if mat_b.dim() == 2 else [mat_a.shape[0]]
    else:
        rows = [mat_a.shape[1]] if mat_b.dim() == 2 else [mat_a.shape[0], mat_a.shape[1]]
    size = [*rows, mat_b.shape[-1]]
    return torch.empty(size, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


# What the real kernels of ``_grouped_mm`` take besides bfloat16 (its CPU kernel, and CUDA's
# fallback), where its meta kernel takes bfloat16 only.
_GROUPED_MM_DTYPES = (torch.float16, torch.float32, torch.float64)


def _all_nonzero(t: torch.Tensor) -> torch.Tensor:
    """``aten.nonzero``'s result where every element is nonzero: the most it can hold."""
    return torch.empty((t.numel(), t.dim()), dtype=torch.long, device=t.device)


# The operators that take a list of indices, where a boolean mask stands for its nonzero places.
_INDEXED = (
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
)


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _masks_all_set(func: Any, t: torch.Tensor, indices: Any, *rest: Any, **kwargs: Any) -> Any:
    """``func`` with each boolean mask among ``indices`` as the long indices of its places, all
    of them taken (``_all_nonzero``)."""
    spread: list[Any] = []
    for index in indices:
        spread.extend(_all_nonzero(index).unbind(1) if _is_mask(index) else [index])
    return func(t, spread, *rest, **kwargs)


def _read(func: Any, values: SideValues, t: torch.Tensor) -> Any:
    """A tensor's value read in Python (``aten._local_scalar_dense``): the fake tensor's own
    where it knows it (a constant), else its side value (``_side_values``), else fake tensors'
    own error."""
    try:
        return func(t)
    except _unfakeable():
        try:
            return values.read(t)
        except LookupError:
            pass
        raise


def _stand_in(func: Any, args: Any, kwargs: Any, values: SideValues | None = None) -> Any:
    """What runs for ``func`` on fake tensors: itself, or for an operator whose meta kernel
    refuses what its real kernels take (``_grouped_mm`` in float32, as transformers' MoE
    layers run it on a CPU), one that sizes its result otherwise; ``nonzero``, whose result's
    size depends on values that fake tensors do not have (a boolean mask used as an index:
    wav2vec2's SpecAugment), is sized as if every element were nonzero, the most it holds; a
    read of a value in Python answered by ``values`` where the fake tensor has none."""
    if func is torch.ops.aten._local_scalar_dense.default and values is not None and not kwargs:
        return functools.partial(_read, func, values)
    if func is torch.ops.aten.nonzero.default and not kwargs:
        return _all_nonzero
    if func in _INDEXED and len(args) > 1 and any(_is_mask(i) for i in args[1]):
        return functools.partial(_masks_all_set, func)
    packet = getattr(torch.ops.aten, "_grouped_mm", None)
    if packet is None or func is not getattr(packet, "default", None) or len(args) < 2:
        return func
    dtypes = {getattr(t, "dtype", None) for t in args[:2]}
    out_dtype = (kwargs or {}).get("out_dtype")
    if len(dtypes) == 1 and dtypes <= set(_GROUPED_MM_DTYPES) and out_dtype in (None, *dtypes):
        return _grouped_mm_any_dtype
    return func


class _NoHook:
    """A hook handle with nothing to remove."""

    def remove(self) -> None:
        pass


def _skip_frozen(tracker: Any, model: nn.Module) -> None:
    """Keep the tracker from hooking parameters that need no gradient (it would try, and
    torch refuses a hook on them) by telling it they are hooked already."""
    handles = getattr(tracker, "_param_to_grad_hook_handles", None)
    if handles is None:
        raise Unmeasurable(f"torch {torch.__version__}'s MemTracker keeps no grad hook handles")
    for param in model.parameters():
        if not param.requires_grad:
            handles[param] = (_NoHook(), _NoHook())


def _runs_here(dev: torch.device) -> bool:
    """Whether a backward can run on (fake tensors of) ``dev`` on this machine."""
    if dev.type in ("cpu", "meta"):
        return True
    backend: Any = getattr(torch, dev.type, None)
    try:
        available = bool(backend.is_available()) and (dev.index or 0) < backend.device_count()
    except Exception:  # no such backend module, or one that cannot say
        return False
    return available


def _run_devices(
    model: nn.Module, disk: Mapping[int, torch.Tensor]
) -> tuple[dict[torch.device, torch.device], torch.device]:
    """Where each of the model's devices runs the step, and the device of its input (its first
    parameter's, as run).

    A model whose parameters sit on one device runs there whole (its buffers too: a skeleton
    keeps them on the cpu), on ``meta`` when that device cannot run here. A model partly on
    ``meta`` (a skeleton partly loaded, or one whose code made a tensor on the CPU whatever the
    default device, as ``torch.FloatTensor(n)`` does) runs wholly on ``meta``: its tensors there
    have no values to mix with real ones, and a fake step needs none. The placeholders of
    weights on disk (``disk``) run where their module runs: they place nothing.
    """
    params = [p.device for p in model.parameters() if id(p) not in disk] or [
        b.device for b in model.buffers()
    ]
    devices = list(dict.fromkeys(params)) or [torch.device("cpu")]
    if len(devices) == 1:
        (dev,) = devices
        run = dev if _runs_here(dev) else torch.device("meta")
        every = {t.device for t in (*model.parameters(), *model.buffers()) if id(t) not in disk} | {
            dev
        }
        return dict.fromkeys(every, run), run
    if any(d.type == "meta" for d in devices):  # a skeleton partly loaded, or partly made
        every = {t.device for t in (*model.parameters(), *model.buffers()) if id(t) not in disk}
        return dict.fromkeys(every, torch.device("meta")), torch.device("meta")
    cannot = [str(d) for d in devices if not _runs_here(d)]
    if cannot:
        raise Unmeasurable(
            f"the model is spread over {', '.join(map(str, devices))} and this machine cannot "
            f"run a step on {', '.join(cannot)}; a fake step stands in for one device only"
        )
    return {d: d for d in devices}, devices[0]


def _fake_like(t: torch.Tensor, dev: torch.device, grad: bool = True) -> torch.Tensor:
    """A fake tensor shaped and strided as ``t`` on ``dev``, requiring grad as ``t`` does (none
    where ``grad`` is False: an inference step, in which torch's module tracker would try to
    hook the gradients of what a module is given and fail on a parameter passed in whole)."""
    fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=dev)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(fake, requires_grad=t.requires_grad and grad)
    return fake.requires_grad_(t.requires_grad and grad) if t.is_leaf else fake


@contextlib.contextmanager
def _swapped(
    model: nn.Module,
    where: dict[torch.device, torch.device],
    disk: Mapping[int, torch.Tensor],
    grad: bool = True,
) -> Iterator[dict[int, torch.Tensor]]:
    """The model with fake parameters and buffers (each tied tensor one fake; none requiring
    grad unless ``grad``) while the block runs; the model's own tensors are put back however
    the block ends. The placeholders of weights on disk (``disk``) stay: their module's hooks
    bring fake weights in as it runs."""
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    fakes: dict[int, torch.Tensor] = {}  # id of the model's tensor -> its fake
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in list(table.items()):
                    if t is None or id(t) in disk:
                        continue
                    if id(t) not in fakes:
                        fakes[id(t)] = _fake_like(t, where[t.device], grad)
                    saved.append((table, name, t))
                    table[name] = fakes[id(t)]  # type: ignore[assignment]
        yield fakes
    finally:
        for table, name, t in reversed(saved):
            table[name] = t


def _fake_batch(example_input: Any, dev: torch.device, mode: Any, values: SideValues) -> Any:
    """The example batch as fake tensors on ``dev`` (a callable is called with ``dev``); each
    real tensor of it gives its fake one its values as a side value (``_side_values``: a
    step that reads the batch, ``(ids != pad).sum().item()``, reads the real tokens)."""
    batch = example_input(dev) if callable(example_input) else example_input

    def fake(t: torch.Tensor) -> torch.Tensor:
        if getattr(t, "fake_mode", None) is mode and t.device == dev:
            return t
        made = _fake_like(t, dev)
        values.remember(made, t)
        return made

    return map_tensors(batch, fake, root="example_input")


def _call(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple, else ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple):
        return model(*batch)
    return model(batch)


def _loss(output: Any) -> torch.Tensor | None:
    """What the step's backward starts from: the output's ``.loss`` (a transformers model given
    labels), else the sum of every floating tensor of the output that needs a gradient."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    parts = [
        t.sum()
        for _, t in iter_leaves(output, "output")
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    return functools.reduce(torch.add, parts) if parts else None


_OPTIMIZER_CLASSES: dict[
    str, Callable[[list[nn.Parameter], bool | None], torch.optim.Optimizer]
] = {
    "sgd": lambda ps, foreach: torch.optim.SGD(ps, lr=0.1, foreach=foreach),
    "sgd-momentum": lambda ps, foreach: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=foreach),
    "adam": lambda ps, foreach: torch.optim.Adam(ps, foreach=foreach),
    "adamw": lambda ps, foreach: torch.optim.AdamW(ps, foreach=foreach),
    "adagrad": lambda ps, foreach: torch.optim.Adagrad(ps, foreach=foreach),
}


def _optimizer(
    model: nn.Module,
    name: str | torch.optim.Optimizer | None,
    foreach: bool | None,
    fakes: Mapping[int, torch.Tensor],
) -> torch.optim.Optimizer | None:
    """The step's optimizer over the model's fake parameters that require grad: the named one
    with the implementation PyTorch picks on the device (``foreach``), or a copy of the user's
    own (its flags as they are) over the fakes of its parameters."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if name is None or not trainable:
        return None
    if isinstance(name, torch.optim.Optimizer):
        return clone_over(name, lambda p: fakes.get(id(p)))
    return _OPTIMIZER_CLASSES[name](trainable, foreach)


def _run(
    model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None, train: bool
) -> None:
    """One step as a training loop writes it: forward, backward, optimizer step (the output
    kept until the step is over); or a forward without gradients."""
    if not train:
        with torch.no_grad():
            _call(model, batch)
        return
    output = _call(model, batch)
    loss = _loss(output)
    if loss is not None:
        loss.backward()  # type: ignore[no-untyped-call]
    if optimizer is not None:
        optimizer.step()
    del output, loss


def _kind(key: Any) -> str:
    """The tracker's key for a kind (an enum of strings, or its total) as one of ``KINDS``."""
    name = str(getattr(key, "value", key))
    if name == _TOTAL:
        return "total"
    if name not in _TRACKER_KINDS:
        raise Unmeasurable(f"torch {torch.__version__}'s MemTracker reports a kind {name!r}")
    return _TRACKER_KINDS[name]


def _by_kind(snapshot: Mapping[Any, int]) -> dict[str, int]:
    out = dict.fromkeys((*KINDS, "total"), 0)
    for key, nbytes in snapshot.items():
        out[_kind(key)] += int(nbytes)
    return out


def _module_peaks(
    tracker: Any,
    model: nn.Module,
    label: Callable[[torch.device], torch.device],
    shown: Callable[[torch.device], bool] = lambda dev: True,
) -> tuple[ModulePeak, ...]:
    """Every module that ran but the whole model, by the most held while it ran on a device
    ``shown`` keeps (not the ``meta`` of disk placeholders)."""
    found = []
    for module, stats in list(tracker.memory_tracking.items()):
        name = str(stats.mod_fqn).partition(".")[2]  # the tracker names the root by its class
        if module is model or not name:
            continue
        best: tuple[int, torch.device] = (0, torch.device("meta"))
        for state, snaps in stats.snapshots.items():
            for snap in snaps if "Peak" in str(getattr(state, "value", state)) else ():
                for dev, dev_snap in snap.items():
                    if shown(dev):
                        best = max(best, (int(dev_snap.get(_TOTAL, 0)), dev), key=lambda b: b[0])
        found.append(
            ModulePeak(
                name,
                type(module).__name__,
                label(best[1]),
                best[0],
                int(getattr(stats, "parameter_mem", 0)),
                int(getattr(stats, "output_mem", 0)),
            )
        )
    found.sort(key=lambda m: (-m.peak, m.name.count("."), m.name))
    return tuple(found)


def _in_tracker(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by torch's tracker itself, not by the model or the operators
    it called: its innermost Python frame is in ``torch/distributed/_tools``, or a frame there
    other than the dispatch through which every operator of the step passes."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [_is_tools(f.filename) for f in frames]
    return bool(frames) and (
        ours[-1]
        or any(o and f.name != "__torch_dispatch__" for o, f in zip(ours, frames, strict=True))
    )


def _is_tools(filename: str) -> bool:
    return "_tools" in filename.replace("\\", "/").split("/")


def _unfakeable() -> tuple[type[BaseException], ...]:
    """The errors by which fake tensors say an operator cannot run without data."""
    from torch._subclasses import fake_tensor

    names = (
        "UnsupportedOperatorException",
        "DataDependentOutputException",
        "DynamicOutputShapeException",
    )
    return tuple(getattr(fake_tensor, n) for n in names if hasattr(fake_tensor, n))


def measure_step(
    model: nn.Module,
    example_input: Any,
    *,
    optimizer: str | torch.optim.Optimizer | None,
    train: bool,
) -> StepMeasure:
    """Run one step of ``model`` on fake tensors and measure it (see the module docstring).

    Raises ``Unmeasurable`` when it cannot be done here; an error of the model's own (an input
    of the wrong shape) propagates as raised, or, when an operator raised it, as
    ``OperatorFailed`` naming the operator and the module that ran it (the error its cause).
    """
    _tracker_class()
    if any(type(t).__name__ == "DTensor" for t in (*model.parameters(), *model.buffers())):
        raise Unmeasurable("the model's parameters are sharded (DTensor); its shards are counted")
    disk = disk_placeholders(model)
    where, run = _run_devices(model, disk)
    first = next((p for p in model.parameters() if id(p) not in disk), None)
    shown = first.device if first is not None else run

    def label(dev: torch.device) -> torch.device:  # the stand-in is shown as what it stands for
        return shown if dev == run else dev

    failed = FailedAt()
    try:
        step = functools.partial(_measure, model, example_input, (where, disk), run, label)
        return _measured(step, optimizer, train, failed)
    except _unfakeable() as exc:
        raise Unmeasurable(
            f"fake tensors cannot run the step ({type(exc).__name__}: {exc})"
        ) from exc
    except Exception as exc:
        if isinstance(exc, Unmeasurable):
            raise
        if _in_tracker(exc):
            raise Unmeasurable(
                f"torch {torch.__version__}'s MemTracker failed ({type(exc).__name__}: {exc})"
            ) from exc
        if failed.error is not None:
            raise failed.error from exc
        raise


def _measured(
    step: Callable[..., StepMeasure],
    optimizer: str | torch.optim.Optimizer | None,
    train: bool,
    failed: FailedAt,
) -> StepMeasure:
    """The step measured, and measured again with side values (``_side_values``) where it read
    in Python a value that fake tensors lack: a step without such a read pays nothing for
    them (a small copy computed beside each small tensor). Where the second run fails too,
    the first run's error stands (``estimate`` counts, as it did without side values)."""
    try:
        return step(optimizer, train, failed, values=False)
    except _unfakeable() as exc:
        if getattr(exc, "func", None) is not torch.ops.aten._local_scalar_dense.default:
            raise
        first = exc
    failed.error = None
    try:  # its side values run real operators: random ones leave the caller's stream alone
        with torch.random.fork_rng(devices=[]):
            return step(optimizer, train, failed, values=True)
    except Exception:
        failed.error = None
        raise first from None


def _measure(
    model: nn.Module,
    example_input: Any,
    placing: tuple[dict[torch.device, torch.device], Mapping[int, torch.Tensor]],
    run: torch.device,
    label: Callable[[torch.device], torch.device],
    optimizer: str | torch.optim.Optimizer | None,
    train: bool,
    failed: FailedAt,
    *,
    values: bool,
) -> StepMeasure:
    from torch._subclasses.fake_tensor import FakeTensorMode

    where, disk = placing  # each device's stand-in; the placeholders of weights on disk
    foreach = _foreach_default(where)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    quiet = contextlib.ExitStack()
    quiet.enter_context(_tracker_unheard())
    quiet.enter_context(_quiet_failed_operators())
    quiet.enter_context(_state_kept(model))
    quiet.enter_context(_no_layerdrop(model))
    swapped = _swapped(model, where, disk, train)
    with quiet, _compiled_unwrapped(model), mode, swapped as fakes:
        tracker = _tracker_class()()
        tracker.torchplace_failed = failed
        tracker.torchplace_values.on = values
        batch = _fake_batch(example_input, run, mode, tracker.torchplace_values)
        opt = _optimizer(model, optimizer, foreach, fakes) if train else None
        _skip_frozen(tracker, model)
        inputs = (t for _, t in iter_leaves(batch, "example_input"))
        tracker.track_external(model, *([opt] if opt is not None else []), *inputs)
        on_meta = run.type == "meta"
        fused = FusedAttention(label(run)) if on_meta else contextlib.nullcontext()
        autocast = _meta_autocast() if on_meta else contextlib.nullcontext()
        with tracker, _eager(), fused, autocast, tracker.torchplace_checks.seen():
            first = _steps(tracker, model, batch, opt, train)

        def shown(dev: torch.device) -> bool:  # the placeholders' meta is on no device
            return dev in where.values() or not (disk and dev.type == "meta")

        def by_device(snapshot: Mapping[torch.device, Any]) -> dict[torch.device, dict[str, int]]:
            out: dict[torch.device, dict[str, int]] = {}
            for dev, snap in snapshot.items():
                if shown(dev):  # meta standing in for the cpu adds to the cpu's own (scalars)
                    kinds, held = _by_kind(snap), out.setdefault(label(dev), {})
                    out[label(dev)] = {k: held.get(k, 0) + n for k, n in kinds.items()}
            add_workspaces(out, tracker.torchplace_matmuls, label)
            return out

        return StepMeasure(
            peaks=by_device(tracker.get_tracker_snapshot("peak")),
            most=_most(tracker.torchplace_most),
            modules=_module_peaks(tracker, model, label, shown),
            first_peaks=by_device(first) if first is not None else None,
        )


def _steps(
    tracker: Any,
    model: nn.Module,
    batch: Any,
    opt: torch.optim.Optimizer | None,
    train: bool,
) -> dict[torch.device, dict[Any, int]] | None:
    """The step as a training loop runs it again and again: the first, and where that one
    made the optimizer's state (Adam's moments), a second one, the steady step, which runs
    with that state held from its start; the tracker's peaks are then the steady step's, and
    the first step's peak snapshot is returned (None where one step is all there is)."""
    _run(model, batch, opt, train)
    if opt is None or not _holds_state(opt):
        return None
    first: dict[torch.device, dict[Any, int]] = tracker.get_tracker_snapshot("peak")
    opt.zero_grad(set_to_none=True)  # the loop's: no gradient is held through the forward
    with _tracker_changed("restarts its peaks"):
        tracker.reset_mod_stats()
        tracker.torchplace_stats.clear()
        tracker._peak_mem_snap = tracker.get_tracker_snapshot()
        tracker._peak_mem = {dev: snap[_TOTAL] for dev, snap in tracker._peak_mem_snap.items()}
        tracker.torchplace_most = {}
    _run(model, batch, opt, train)
    return first


def _holds_state(opt: torch.optim.Optimizer) -> bool:
    """Whether the optimizer keeps a tensor in its state after a step (SGD without momentum
    keeps none: its steps are all alike)."""
    return any(
        isinstance(value, torch.Tensor) for state in opt.state.values() for value in state.values()
    )


def _foreach_default(where: Mapping[torch.device, torch.device]) -> bool:
    """The optimizer implementation PyTorch picks for parameters on the model's devices (the
    devices themselves, not the fake or ``meta`` ones the step runs on): ``foreach`` where
    every one has foreach kernels (CUDA), the single-tensor loop elsewhere (the CPU, and
    ``meta``, where a skeleton's parameters are)."""
    from torch.optim import optimizer

    supported = optimizer._get_foreach_kernels_supported_devices()  # type: ignore[attr-defined]
    return all(dev.type in supported for dev in where)


@contextlib.contextmanager
def _meta_autocast() -> Iterator[None]:
    """``torch.autocast`` taking ``device_type="meta"`` while a step runs on meta, as the CPU's
    (which changes nothing for meta tensors): a model that switches autocast off around its
    own code for the device its input is on (transformers 4.x's rotary embeddings:
    ``torch.autocast(device_type=x.device.type, enabled=False)``) raised "unsupported
    autocast device_type 'meta'", so its step could not be measured. ``torch.autocast`` and
    ``torch.amp.autocast`` are a subclass that passes every other device type on as it is,
    for the step only, then put back."""
    plain = torch.amp.autocast_mode.autocast

    class _Autocast(plain):  # type: ignore[misc, valid-type]
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    saved = torch.autocast, torch.amp.autocast
    torch.autocast = torch.amp.autocast = _Autocast  # type: ignore[misc]
    try:
        yield
    finally:
        torch.autocast, torch.amp.autocast = saved  # type: ignore[misc]


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Every module of the model as it was before the block, however it ends: what its forward
    stored on ``self`` (a head made lazily, cached activations, a parameter made in the forward:
    fake tensors all) removed, what it replaced put back, and its lists and dicts (its tables of
    parameters, buffers, submodules and hooks among them) given back their entries."""
    saved = [(module, dict(vars(module))) for module in model.modules()]
    contents = {
        id(value): (value, list(value) if isinstance(value, list) else dict(value))
        for _, attrs in saved
        for value in attrs.values()
        if isinstance(value, (list, dict))
    }
    try:
        yield
    finally:
        for module, attrs in saved:
            for name in [n for n in vars(module) if n not in attrs]:
                del vars(module)[name]
            vars(module).update(attrs)
        for value, entries in contents.values():
            if isinstance(value, list):
                value[:] = entries
            else:
                value.clear()
                value.update(entries)


def _layerdrop_holders(model: nn.Module) -> Iterator[tuple[Any, str]]:
    """Each (object, attribute) of the model that sets a LayerDrop rate above 0: a module's
    ``layerdrop``, its transformers config's ``layerdrop``, ``encoder_layerdrop`` and the like."""
    seen: set[int] = set()
    for module in model.modules():
        for holder in (module, getattr(module, "config", None)):
            if holder is None or id(holder) in seen:
                continue
            seen.add(id(holder))
            for name in _LAYERDROPS:
                rate = getattr(holder, name, None)
                if isinstance(rate, float) and rate > 0:
                    yield holder, name


_LAYERDROPS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop", "speech_encoder_layerdrop")


@contextlib.contextmanager
def _no_layerdrop(model: nn.Module) -> Iterator[None]:
    """LayerDrop off while the step runs, put back after: a training step skips each layer
    when a random draw falls under the rate (``torch.rand([]) < layerdrop``), a test of a
    value fake tensors do not have; with every layer run, the step measured is the most a
    step of the model can hold."""
    saved = [(holder, name, getattr(holder, name)) for holder, name in _layerdrop_holders(model)]
    try:
        for holder, name, _ in saved:
            setattr(holder, name, 0.0)
        yield
    finally:
        for holder, name, rate in reversed(saved):
            setattr(holder, name, rate)


@contextlib.contextmanager
def _compiled_unwrapped(model: nn.Module) -> Iterator[None]:
    """The model with each ``torch.compile``'d submodule replaced by the module it wraps
    while the block runs (so the step and its module names are the eager model's), put back
    however the block ends."""
    saved: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for parent in list(model.modules()):
            for name, child in list(parent._modules.items()):
                inner = compiled_inner(child)
                if child is not None and inner is not None:
                    saved.append((parent, name, child))
                    parent._modules[name] = inner
        yield
    finally:
        for parent, name, child in reversed(saved):
            parent._modules[name] = child


@contextlib.contextmanager
def _eager() -> Iterator[None]:
    """Compiled code in the model (a ``torch.compile``'d layer or function) run eagerly, so the
    tracker sees its operators, and without torch's warning that the tracker's global module
    hooks fire twice around a compiled module (they do not: its ``_orig_mod`` is tracked)."""
    stance = getattr(torch.compiler, "set_stance", None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there")
        with stance("force_eager") if stance is not None else contextlib.nullcontext():
            yield


# What torch's module tracker warns when a module is entered again while it runs (a wrapper
# calling the module's own forward, as the kernels package's hub layers do in transformers 5): a
# note to PyTorch's developers about its hierarchy, not about the user's model; the figures stay
# right (the module's bytes are counted once).
_TRACKER_REENTERED = r"The module hierarchy tracking maybe be messed up"


@contextlib.contextmanager
def _tracker_unheard() -> Iterator[None]:
    """The step with torch's tracker's internal warning about its module hierarchy ignored (that
    one warning alone, and only while the step runs), and ``warnings.formatwarning`` as it was
    afterwards: torch's tracker replaces it for the whole process when it warns so. The filter
    is ``warnings.catch_warnings``', the one Python offers before 3.14's context-local ones:
    process-wide while the step runs (another thread warning so meanwhile is not shown either),
    and the filters put back as they were when it ends."""
    shown = warnings.formatwarning
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_TRACKER_REENTERED, category=UserWarning)
            yield
    finally:
        warnings.formatwarning = shown


class _DropTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.exc_info is None


@contextlib.contextmanager
def _quiet_failed_operators() -> Iterator[None]:
    """FakeTensorMode logs an operator that fails (a batch of the wrong shape) with its
    traceback before re-raising; the error reaches the user anyway, with torch's message in
    estimate's, so the log is only noise: dropped while the step runs."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    quiet = _DropTracebacks()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _most(most: Mapping[torch.device, Mapping[Any, int]]) -> dict[str, int]:
    """The most each kind held at once on each device, summed over the devices."""
    out = dict.fromkeys(KINDS, 0)
    for snap in most.values():
        for kind, nbytes in _by_kind(snap).items():
            if kind != "total":
                out[kind] += nbytes
    return out
