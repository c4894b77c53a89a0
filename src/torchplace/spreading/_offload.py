"""Running offloaded modules: weights brought to the execution device just before each forward.

A module that ``dispatch`` offloads (mapped to ``"cpu"`` or ``"disk"`` while another device
executes it, or to ``"disk"`` with the CPU executing) is a ``Unit``. Its parameters keep their
home between calls (pinned host memory, or ``meta`` with the bytes left in the checkpoint) and
the ``Ring`` of a model holds at most ``window`` units' weights on the execution device at once:
before unit ``i`` runs, it and the ``window - 1`` units after it (in the order the model's first
call ran them, registration order until that is known, wrapping round for the next call, as
generation calls the model again) are fetched if they are not already,
the current stream is ordered after unit ``i``'s copies, its parameters are swapped for the
fetched ones, and after its forward they are swapped back and the fetched memory released.

The ``Fetcher`` does the copies: ``DeviceFetcher`` copies host tiers on a side CUDA stream
(ordered by events; the fetched tensors are marked with ``record_stream`` on the compute stream
when released, so the caching allocator reuses their memory only once the compute that read
them is done) and reads disk tiers in a background thread under that stream, so that the next
units' reads overlap the current unit's compute. Executed on the CPU, a disk unit is read when
it runs, on the calling thread: there is no transfer to overlap, and a reading thread beside
the forward only takes cores from its own threads (with a background read, 16 layers of
``Linear(2048)`` at batch 16 ran at 1.38-1.50x the floor of reading their bytes and running
them resident, on 2 cores; see ``benchmarks/bench_offload.py``). Tests give the ring a fake
transport and check the order, the bound and the waits.

Gradients go through offloaded units (``_through``): with gradients on, what autograd would
keep of a fetched weight is kept as a reference and the unit is fetched again at backward
(``Ring.refetch``), and a gradient for an offloaded weight that requires grad raises, naming it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from .._devices import faking
from .._model_walk import display
from ..moving._offloaded import DEFAULT_WINDOW, Home
from ._through import Kept, requiring

__all__ = [
    "DEFAULT_WINDOW",
    "SHIELD",
    "DeviceFetcher",
    "Fetched",
    "Fetcher",
    "Ring",
    "Shield",
    "Unit",
]


@dataclasses.dataclass
class Unit:
    """One offloaded module: its path, the module, its parameter slots and its home."""

    path: str
    module: nn.Module
    slots: list[tuple[nn.Module, str, nn.Parameter]]  # (owner, name, the parameter at home)
    names: list[str]  # each slot's name inside its map entry, for the disk tier's reader
    home: Home
    entry: str | None = None  # the map entry the names start from (None: ``path``)

    def full_name(self, name: str) -> str:
        """A slot's name in the model."""
        top = self.path if self.entry is None else self.entry
        return f"{top}.{name}" if top else name

    @property
    def nbytes(self) -> int:
        if self.home.source is not None:
            return self.home.source.nbytes
        seen = {id(p): p.numel() * p.element_size() for _, _, p in self.slots}
        return sum(seen.values())


@dataclasses.dataclass
class Unread:
    """A disk unit's weights that ``ready`` reads on the calling thread (executed on the CPU)."""

    unit: Unit


@dataclasses.dataclass
class Fetched:
    """A unit's weights on their way to (or on) the execution device."""

    tensors: Any  # list[torch.Tensor] in slot order, a future of it, or ``Unread``
    event: Any = None  # what the compute stream waits on before reading them
    # where the weights view a mapped file: hands the pages under one back (``used``)
    page_out: Callable[[torch.Tensor], None] | None = None
    made_for: tuple[Any, ...] = ()  # ``_made_for`` the unit when its fetch began


class Fetcher(Protocol):
    """Brings a unit's weights to the execution device and gives their memory back, a unit at
    a time (the bytes of each copy onto a CUDA device that the checkpoint reader makes go
    through ``moving._transport.Transport``, the one protocol for that)."""

    def fetch(self, unit: Unit) -> Fetched:
        """Start bringing ``unit``'s weights; returns at once."""
        ...

    def ready(self, fetched: Fetched) -> list[torch.Tensor]:
        """The fetched tensors, with the compute stream ordered after their copies."""
        ...

    def release(self, fetched: Fetched) -> None:
        """The compute stream is done queuing work on ``fetched``: its memory may be reused
        once that work has run."""
        ...


class Ring:
    """The resident window over a model's units, in their order (see the module docstring)."""

    def __init__(self, units: list[Unit], window: int, transport: Fetcher) -> None:
        self.units = units
        self.window = min(window, len(units))
        self.transport = transport
        self.resident: dict[int, Fetched] = {}
        self.attached: dict[int, list[tuple[nn.Module, str, nn.Parameter]]] = {}
        self.inner: dict[int, int] = {}  # calls of a unit while it runs (itself, a thread)
        # Threads running the model at once take turns in the bookkeeping (one waiting for a
        # read holds it): each unit is swapped in once and out by the last call to end.
        self.lock = threading.RLock()
        self.calls = threading.local()  # per thread: (unit, whether ``before`` let it run)
        self.tensors: dict[int, list[torch.Tensor]] = {}  # what each attached unit fetched
        self.again: dict[int, tuple[Fetched, list[torch.Tensor]]] = {}  # fetched by backward
        self.forgetting = False  # a callback gives ``again`` back as the backward pass ends
        self.task: int | None = None  # the backward pass ``again`` belongs to
        self.seen: list[int] = []  # units in the order the first call ran them
        self.order: list[int] | None = None  # that order, once known; ``place``: each's index
        self.place: dict[int, int] | None = None
        self.last = 0  # the unit that ran last

    def _calls(self) -> list[tuple[int, bool]]:
        calls: list[tuple[int, bool]] | None = getattr(self.calls, "stack", None)
        if calls is None:
            calls = self.calls.stack = []
        return calls

    def before(self, i: int) -> None:
        # A call refused here still gets PyTorch's always_call forward hook (``after``): it
        # finds the call refused on its thread's stack and leaves the unit alone (another
        # call may be running it).
        unit = self.units[i]
        try:
            _refuse_foreign_meta(unit)
            with self.lock:
                self._before(i)
        except Exception:
            self._calls().append((i, False))
            raise
        self._calls().append((i, True))

    def _before(self, i: int) -> None:
        unit = self.units[i]
        if i in self.attached:  # called again from inside itself: its weights are in place
            self.inner[i] = self.inner.get(i, 0) + 1
            return
        if self.again and _graph_task() == -1:  # a backward pass ended without its callback
            self.forget()
        if faking():  # estimate's fake step: weights of their shapes where they run, no read
            fake = [torch.empty_like(p, device=unit.home.execution) for _, _, p in unit.slots]
            self.attached[i] = _swap_in(unit, fake)
            return
        wanted = self._ahead(i)
        for j in [j for j in self.resident if j not in self.attached]:
            if j not in wanted or self.resident[j].made_for != _made_for(self.units[j]):
                self.transport.release(self.resident.pop(j))  # not wanted, or stale
        # Fetched as plain tensors whatever the caller's mode: fetched ahead under
        # inference_mode, they would be inference tensors that a later call with gradients
        # cannot save for backward, nor a later call mark as requiring grad.
        with torch.inference_mode(False):
            for j in wanted:
                if j not in self.resident:
                    fetched = self.resident[j] = self.transport.fetch(self.units[j])
                    fetched.made_for = _made_for(self.units[j])
            try:
                tensors = self.transport.ready(self.resident[i])
            except BaseException:
                del self.resident[i]  # a failed read is not kept: the next call reads again
                raise
        self.tensors[i] = tensors
        self.attached[i] = _swap_in(unit, tensors)

    def _ahead(self, i: int) -> list[int]:
        """Unit ``i`` and the ones to fetch ahead of it: the next in the order the first call
        ran them (a model may call its layers in any order), registration order until then.
        The first call's order is kept once a unit runs twice (the next call has begun) or
        every unit has run; a unit that runs out of that order (a layer called alone before
        the model, a model that changed its path) has it learned again from there."""
        if self.order is not None and self.place is not None:
            expected = self.order[(self.place[self.last] + 1) % len(self.order)]
            if i != expected and i != self.last:
                self.order, self.place, self.seen = None, None, []
        self.last = i
        if self.order is None:
            if i in self.seen:
                self._keep_order()
            else:
                self.seen.append(i)
                if len(self.seen) == len(self.units):
                    self._keep_order()
        order, place = (self.order, self.place) if self.order is not None else (None, None)
        n = len(self.units)
        if order is None or place is None:
            return [(i + k) % n for k in range(self.window)]
        at = place[i]
        return [order[(at + k) % n] for k in range(self.window)]

    def _keep_order(self) -> None:
        order = self.seen + [j for j in range(len(self.units)) if j not in self.seen]
        self.order, self.place = order, {j: k for k, j in enumerate(order)}

    def running(self, i: int) -> bool:
        """Whether a call of unit ``i`` is under way on this thread (its weights in place)."""
        return any(j == i and ran for j, ran in self._calls())

    def kept(self, i: int) -> Kept | None:
        """The saved-tensor hooks for a call of unit ``i`` with gradients on (None when its
        weights are not fetched ones: a fake step, or a host tier run where it lives)."""
        if not torch.is_grad_enabled() or not _hooks_enabled():
            return None  # (hooks turned off: autograd keeps the weights, as it would anyway)
        tensors = self.tensors.get(i)
        return None if tensors is None else Kept(i, tensors, self.refetch)

    def refetch(self, i: int) -> list[torch.Tensor]:
        """Unit ``i``'s weights again, for a backward that unpacks them: the last ``window``
        units fetched so are kept while the backward pass runs, and given back as it ends."""
        with self.lock:
            task = _graph_task()
            if task != self.task:  # another backward pass (one interrupted kept its units)
                self.forget()
                self.task = task
                # what the forward fetched ahead for the next call goes: the window bounds
                # what backward holds too
                for j in [j for j in self.resident if j not in self.attached]:
                    self.transport.release(self.resident.pop(j))
            got = self.again.get(i)
            if got is not None:
                return got[1]
            while len(self.again) >= self.window:  # room first: at most a window at once
                self.transport.release(self.again.pop(next(iter(self.again)))[0])
            with torch.inference_mode(False):
                fetched = self.transport.fetch(self.units[i])
                tensors = self.transport.ready(fetched)
            self.again[i] = (fetched, tensors)
            if not self.forgetting:
                try:  # only inside a backward pass; elsewhere nothing is kept
                    engine = torch.autograd.Variable._execution_engine
                    engine.queue_callback(self.forget)
                    self.forgetting = True
                except RuntimeError:
                    self.transport.release(self.again.pop(i)[0])
            return tensors

    def forget(self) -> None:
        """Give back what backward fetched (the backward pass ended)."""
        with self.lock:
            self.forgetting, self.task = False, None
            while self.again:
                self.transport.release(self.again.popitem()[1][0])

    def used(self, i: int, module: nn.Module) -> None:
        """``module``, inside unit ``i``, returned while the unit runs: where the unit's weights
        view a mapped file (``mmap=True``), the pages under its own weights leave the resident
        set now, not with the unit, so that one module's weights are resident at a time, as
        transformers' hooks keep them (a later use faults them in again from the page cache)."""
        fetched = self.resident.get(i)
        page_out = None if fetched is None else fetched.page_out
        if page_out is None:
            return
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None and _unwritten(t):  # a write lives in its pages until the call ends
                page_out(t)

    def began(self, i: int) -> bool:
        """Whether this thread's latest call ``before`` saw (run or refused) is unit ``i``'s:
        the one ``after(i)`` ends."""
        calls = self._calls()
        return bool(calls) and calls[-1][0] == i

    def after(self, i: int) -> None:
        calls = self._calls()
        if not calls or calls[-1][0] != i:  # ``before`` never ran for this call
            return
        if not calls.pop()[1]:  # ``before`` refused it
            return
        with self.lock:
            self._after(i)

    def _after(self, i: int) -> None:
        if self.inner.get(i):
            self.inner[i] -= 1
            return
        slots = self.attached.pop(i, None)
        self.tensors.pop(i, None)
        if slots is None:
            return
        for owner, name, home in slots:
            owner._parameters[name] = home
        fetched = self.resident.pop(i, None)
        if fetched is not None:
            self.transport.release(fetched)

    def __getstate__(self) -> dict[str, Any]:  # a copy starts with nothing resident
        state = dict(self.__dict__)
        state["resident"], state["attached"], state["inner"] = {}, {}, {}
        state["tensors"], state["again"], state["forgetting"], state["task"] = {}, {}, False, None
        del state["lock"], state["calls"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock, self.calls = threading.RLock(), threading.local()


def _unwritten(t: torch.Tensor) -> bool:
    """Whether no in-place operator has changed ``t`` since it was fetched (its version counter
    is where a fetch leaves it). A change made through ``.data`` is not counted."""
    try:
        return t._version == 0
    except RuntimeError:  # an inference tensor keeps no count
        return False


def _made_for(unit: Unit) -> tuple[Any, ...]:
    """What a fetch of ``unit`` reads from: its homes' dtypes, memory and in-place changes. A
    unit fetched ahead of its call is read again where these changed meanwhile (a cast of the
    model between two calls, an edit of a host-tier weight): fetched at the end of one call for
    the next, it would run with the old weights."""
    made: list[Any] = []
    for _, _, home in unit.slots:
        try:
            made.append((home.dtype, home.data_ptr(), home._version))
        except RuntimeError:  # an inference tensor keeps no count, a sparse one no data_ptr:
            made.append(object())  # never the same, so fetched again for each call
    return tuple(made)


def _hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be set (``disable_saved_tensors_hooks`` turns them off,
    and setting one then raises)."""
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return True if enabled is None else bool(enabled())


def _graph_task() -> int | None:
    """The backward pass running on this thread (-1 when none; None where torch cannot say)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return None if current is None else int(current())


def _refuse_foreign_meta(unit: Unit) -> None:
    """``PlacementError`` for a parameter on ``meta`` inside an offloaded unit that is none of
    its placeholders: added after the model was mapped (PEFT puts an adapter's weights on the
    device of the layer's weight, a placeholder's ``meta``), it holds no values, and the unit
    would compute garbage without a word."""
    homes = {id(p) for _, _, p in unit.slots}
    for name, p in unit.module.named_parameters():
        if p.is_meta and id(p) not in homes:
            from .._errors import PlacementError, Straggler

            full = f"{unit.path}.{name}" if unit.path else name
            owner = full.rpartition(".")[0]
            raise PlacementError(
                f"{display(full)} is on meta inside {display(unit.path)}, which is offloaded to "
                f"{unit.home.tier}, and it is none of the weights the offload brings in: it was "
                "added after the model was mapped (as PEFT adds an adapter's weights on the "
                "device of the layer's weight, here a placeholder), so it holds no values and "
                f"the module would compute garbage. Give it values first (model.get_submodule("
                f"{owner!r}).to_empty(device={str(unit.home.execution)!r}), then initialise or "
                "load them), or map the module to a device, where the adapter's weights are "
                "made real",
                stragglers=[Straggler(full, "parameter", p.device, 0)],
            )


def _swap_in(unit: Unit, tensors: list[torch.Tensor]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Put the fetched tensors in the unit's slots (tied slots share one); returns the slots
    with their parameters at home, to put back. ``requires_grad`` is as the model has it:
    kernels choose by it (Mamba's do), so the same ones run as on the model held whole; with
    gradients on, such a weight is ``_through``'s non-leaf, which autograd does not hold."""
    made: dict[int, torch.Tensor] = {}
    grad = torch.is_grad_enabled()
    for (_, _, home), t, slot in zip(unit.slots, tensors, unit.names, strict=True):
        if id(home) not in made:  # every one made before any is put in: all or nothing
            wants = home.requires_grad and (t.is_floating_point() or t.is_complex())
            if wants and grad:
                made[id(home)] = requiring(t, unit.full_name(slot))
            else:
                made[id(home)] = nn.Parameter(t, requires_grad=wants)
    for owner, name, home in unit.slots:
        owner._parameters[name] = made[id(home)]  # type: ignore[assignment]
    return list(unit.slots)


class DeviceFetcher:
    """Real copies: host tiers on a side CUDA stream, disk tiers read in a background thread
    under that stream (executed on the CPU: read by ``ready``, on the calling thread). ``cuda``
    is ``torch.cuda`` (tests give a fake one that logs streams and events)."""

    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        self.device = device
        self.cuda = cuda if cuda is not None else torch.cuda
        self._stream: Any = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.buffers = HostBuffers()

    def __getstate__(self) -> dict[str, Any]:
        return {"device": self.device, "cuda": None, "_stream": None, "_pool": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.cuda = torch.cuda
        self.buffers = HostBuffers()

    @property
    def stream(self) -> Any:
        if self._stream is None and self.device.type == "cuda":
            self._stream = self.cuda.Stream(self.device)
        return self._stream

    def _in_background(self, work: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "torchplace-offload")
        return self._pool.submit(work)

    def _marked(self, stream: Any) -> Any:
        """An event recorded on ``stream`` after the work queued on it so far."""
        event = self.cuda.Event()
        event.record(stream)
        return event

    def fetch(self, unit: Unit) -> Fetched:
        stream = self.stream  # made here, on the caller's thread, never in the reading one
        if unit.home.source is not None:
            if stream is None:  # executed on the CPU: nothing to overlap a read with
                return Fetched(Unread(unit))
            return Fetched(self._in_background(lambda: self._read(unit, stream)))
        if stream is None:  # a host tier executed on the host: nothing to copy
            return Fetched([p for _, _, p in unit.slots])
        # The side stream first waits for the compute queued so far: memory the allocator
        # hands these copies may have been released by compute still in flight.
        stream.wait_stream(self.cuda.current_stream(self.device))
        with self.cuda.stream(stream):
            tensors = [self.copy(p) for _, _, p in unit.slots]
        return Fetched(tensors, self._marked(stream))

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        """One pinned host tensor's asynchronous copy to the device (on the current stream)."""
        return host.to(self.device, non_blocking=True)

    def _read(self, unit: Unit, stream: Any) -> Fetched:
        """A disk unit's weights read: on the CPU (no ``stream``) into the reused host buffers,
        or as views of the mapped file with their ``page_out``; else under ``stream``, with the
        event the compute stream waits on."""
        assert unit.home.source is not None
        if stream is None:
            source = unit.home.source
            if getattr(source, "takes_buffers", False):  # read into the reused host buffers
                by_name = source.read(self.device, alloc=self.buffers.carver(source.nbytes))  # type: ignore[call-arg]
            else:
                by_name = source.read(self.device)
            tensors = [by_name[n] for n in unit.names]
            return Fetched(tensors, page_out=getattr(by_name, "page_out", None))
        with self.cuda.stream(stream):
            by_name = unit.home.source.read(self.device)
            event = self._marked(stream)
        return Fetched([by_name[n] for n in unit.names], event)

    def ready(self, fetched: Fetched) -> list[torch.Tensor]:
        got = None
        if isinstance(fetched.tensors, Unread):  # executed on the CPU: read here, now
            got = self._read(fetched.tensors.unit, None)
        elif isinstance(fetched.tensors, concurrent.futures.Future):
            got = fetched.tensors.result()
        if got is not None:  # what the ring noted of the fetch (``made_for``) stays
            fetched.tensors, fetched.event, fetched.page_out = got.tensors, got.event, got.page_out
        if fetched.event is not None:
            self.cuda.current_stream(self.device).wait_event(fetched.event)
        tensors: list[torch.Tensor] = fetched.tensors
        return tensors

    def release(self, fetched: Fetched) -> None:
        if isinstance(fetched.tensors, concurrent.futures.Future):
            fetched.tensors.cancel()  # never used; one already running finishes on its own
            return
        if isinstance(fetched.tensors, Unread) or self.stream is None:  # nothing to keep
            return
        compute = self.cuda.current_stream(self.device)
        for t in fetched.tensors:
            self.record(t, compute)

    def record(self, t: torch.Tensor, stream: Any) -> None:
        """Keep ``t``'s memory from reuse until the work queued on ``stream`` has run."""
        t.record_stream(stream)


class HostBuffers:
    """Host memory the disk tier reads into when the CPU executes, kept from one call to the
    next: memory freed after each call went back to the system and was faulted in again by the
    next read (115k page faults a token for a 1 GB model, which doubled its time per token).
    A buffer is handed out again only once no tensor views it any longer (a module that kept
    a view of its weight keeps its buffer; a new one is made); at most ``keep`` are kept, as
    many units as are read at once (one running, and what a backward holds)."""

    ALIGN = 64

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self.kept: list[torch.Tensor] = []

    @staticmethod
    def _free(buffer: torch.Tensor) -> bool:
        count = getattr(torch._C, "_storage_Use_Count", None)
        if count is None:  # this torch cannot tell: never handed out twice
            return False
        return int(count(buffer.untyped_storage()._cdata)) <= 2  # itself, and the ask

    def _take(self, nbytes: int) -> torch.Tensor:
        for buffer in self.kept:
            if buffer.numel() >= nbytes and self._free(buffer):
                return buffer
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if len(self.kept) < self.keep:
            self.kept.append(buffer)
        else:  # the smallest that is free makes room, or this one is not kept
            free = [b for b in self.kept if self._free(b)]
            if free:
                self.kept.remove(min(free, key=lambda b: b.numel()))
                self.kept.append(buffer)
        return buffer

    def carver(self, nbytes: int) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor | None]:
        """Hands out a read's tensors one after another from one buffer of ``nbytes`` and a
        little room for alignment (None once it is full: the reader allocates the rest)."""
        room = nbytes + self.ALIGN * 64
        buffer = self._take(room)
        at = [0]

        def carve(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
            size = math.prod(shape) * dtype.itemsize
            start = -(-at[0] // self.ALIGN) * self.ALIGN
            if size == 0 or start + size > buffer.numel():
                return None
            at[0] = start + size
            return buffer[start : start + size].view(dtype).view(shape)

        return carve


class Shield:
    """Ctrl-C held back while an offloaded module's weights come in or go out, so that no
    SIGINT, wherever it lands, leaves them in place for good.

    PyTorch runs ``always_call`` forward hooks for an ``Exception`` only: a ``KeyboardInterrupt``
    landing after the module's weights came in (in its pre-hooks, between them and its
    forward, or after its forward returned, before the hook that lets them go) skipped the
    letting go, and the weights stayed resident (8 of 600 real SIGINTs during ``generate``).
    While the outermost offloaded call of the main thread runs, a handler of SIGINT wraps the
    one before it (Python's ``default_int_handler``, or the program's own): in the covered
    stretches (from ``before`` to the forward's first line, and from its last to the end of
    ``after``) a SIGINT is kept and delivered as the stretch ends, inside the code that lets
    the weights go on an error; elsewhere it is delivered at once, as it would have been, and
    so is a second SIGINT in a covered stretch (a read of the weights that hangs). A
    program whose SIGINT is ignored or left to the system's default action, or another
    thread's call (signals reach the main thread only), is not covered. The handler before is
    put back when the outermost call ends.
    """

    def __init__(self) -> None:
        self.depth = 0  # offloaded calls under way on the main thread, nested
        self.covered = False
        self.pending: tuple[int, Any] | None = None
        self.previous: Any = None  # the handler wrapped, while ours is installed
        self.handler = self._handle  # one bound method, so that it is told by identity

    @staticmethod
    def _main() -> bool:
        return threading.current_thread() is threading.main_thread()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.covered and self.pending is None:
            self.pending = (signum, frame)
            return
        # a second Ctrl-C in a covered stretch (a read that hangs) is raised at once, as is
        # one outside them
        self.pending = None
        (self.previous or signal_default())(signum, frame)

    def enter(self) -> None:
        """An offloaded call begins (its weights are about to come in): covered from now."""
        if not self._main():
            return
        self.covered = True  # first: a SIGINT once ours is installed finds it covered
        if self.depth == 0:
            import signal

            current = signal.getsignal(signal.SIGINT)
            if callable(current) and current is not self.handler:
                self.previous = current
                signal.signal(signal.SIGINT, self.handler)
        self.depth += 1

    def lift(self) -> None:
        """The forward runs: a SIGINT is the program's again (one kept meanwhile raised now).
        Inside a ``torch.compile`` trace nothing is done (it would trace the thread look-up):
        a compiled forward stays covered, and a SIGINT in it is raised as its unit ends."""
        if torch.compiler.is_compiling() or not self._main() or not self.depth:
            return
        self.covered = False
        self._deliver()

    def cover(self) -> None:
        """The forward ended: the weights are about to go out."""
        if not torch.compiler.is_compiling() and self._main() and self.depth:
            self.covered = True

    def leave(self, *, deliver: bool = True) -> None:
        """The call ended (its weights went out): the outermost puts the handler back, and a
        SIGINT kept meanwhile is delivered (not where another already ends the call)."""
        if not self._main() or not self.depth:
            return
        self.depth -= 1
        self.covered = False
        if self.depth == 0 and self.previous is not None:
            import signal

            previous, self.previous = self.previous, None
            if signal.getsignal(signal.SIGINT) is self.handler:
                signal.signal(signal.SIGINT, previous)
            if self.pending is not None and deliver:
                signum, frame = self.pending
                self.pending = None
                previous(signum, frame)
        if not deliver:
            self.pending = None
        else:
            self._deliver()

    def _deliver(self) -> None:
        if self.pending is not None and self.previous is not None:
            signum, frame = self.pending
            self.pending = None
            self.previous(signum, frame)


def signal_default() -> Any:
    """Python's own handler of SIGINT, which raises ``KeyboardInterrupt``."""
    import signal

    return signal.default_int_handler


SHIELD = Shield()
