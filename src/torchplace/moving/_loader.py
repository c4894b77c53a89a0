"""``DeviceLoader``: batches arrive on the device, their copies hidden behind the compute.

On CUDA, a background thread takes batches from the source, pins their host memory (unless a
``DataLoader(pin_memory=True)`` already did) and copies them on a dedicated stream, ``prefetch``
batches ahead of the consumer. Each batch carries the event recorded after its copy::

    source --next--> pin (thread) --copy on side stream, record event--> queue
    consumer <--current stream waits on the event, record_stream(current)-- queue

Waiting on the event orders the consumer's kernels after the copy without blocking the host.
``record_stream`` tells PyTorch's caching allocator that the consumer's stream uses memory that
was allocated on the side stream, so it is not handed out again before the consumer is done.
Pinned host buffers need no such care: the pinned-memory allocator keeps a block until the copies
reading from it have finished. Many small tensors in one batch travel as one consolidated copy.

``meta`` runs the same thread and queue without streams (which is how it is tested on a CPU).
A ``cpu`` target adds nothing: no thread, no copy; other accelerators copy each batch when it is
asked for. The thread never holds a reference to the iterator, so an iterator dropped by an early
``break`` is closed at once: the thread is stopped and joined and its batches released.
"""

from __future__ import annotations

import _thread
import contextlib
import operator
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch

from .._devices import DeviceSpec
from .._devices import device as _parse_device
from .._errors import DeviceSpecError, DeviceUnavailableError, MoveError, TorchplaceError
from .._sizes import format_bytes
from .._tree import Located, iter_leaves, map_tensors
from ._consolidate import small_host_tensors
from ._transfer import consolidate_small, data_meta_message, own_to, pinned_copy

__all__ = ["DeviceLoader"]

T = TypeVar("T")

# How long closing an iterator waits for the thread, which may be inside the source's __next__.
# A thread still running after that stops on its own as soon as that call returns, dropping its
# batch and closing the source; waiting longer would only hold up a consumer that is leaving
# (a break, Ctrl-C).
_JOIN_SECONDS = 2.0
_THREAD_NAME = "torchplace-DeviceLoader"


def _check_iterable(iterable: object) -> None:
    """Refuse what DeviceLoader cannot take batches from (a tensor, whose rows it would take)."""
    if not isinstance(iterable, Iterable) and not hasattr(type(iterable), "__getitem__"):
        raise TorchplaceError(
            f"DeviceLoader(iterable=...) needs an iterable of batches (a DataLoader, a list, "
            f"a generator), got {type(iterable).__name__} ({_short(iterable)})"
        )
    if isinstance(iterable, torch.Tensor):  # iterating one would hand over its rows
        raise TorchplaceError(
            f"DeviceLoader(iterable=...) needs an iterable of batches, got a tensor of shape "
            f"{tuple(iterable.shape)}, whose rows it would hand over one by one; wrap it in "
            "a DataLoader (DataLoader(TensorDataset(x), batch_size=...)), or move it "
            "whole with x = torchplace.move(x, device)"
        )


class DeviceLoader(Generic[T]):
    """Wrap an iterable of batches so that each batch arrives on ``device``.

    >>> import torch
    >>> from torchplace.moving._loader import DeviceLoader
    >>> batches = [{"x": torch.ones(2, 3), "id": 7}, {"x": torch.zeros(2, 3), "id": 8}]
    >>> loader = DeviceLoader(batches, "meta")
    >>> len(loader), [(b["x"].device.type, b["id"]) for b in loader]
    (2, [('meta', 7), ('meta', 8)])
    >>> cpu = DeviceLoader(batches, "cpu")
    >>> next(iter(cpu)) is batches[0]  # the CPU adds nothing: no copy, no thread
    True

    Batches follow the collection rules of ``move`` (dicts, lists, tuples, namedtuples,
    dataclasses, objects with ``.to``, moved as a copy when their ``.to`` works in place, as a
    ``BatchEncoding``'s does, so the source's batches stay where they were); anything else
    passes unchanged. On CUDA, up to
    ``prefetch`` batches are pinned and copied ahead on a dedicated stream while the consumer
    computes; the consumer's stream waits for each batch's copy, so values are always complete.
    ``prefetch=0`` copies each batch when it is asked for. ``pin_memory=None`` pins on CUDA;
    ``False`` copies straight from pageable memory (the copy then blocks the thread that makes
    it). ``non_blocking=False`` hands a batch over only once its copy has finished. A batch's
    many small tensors travel as one copy and are split into tensors that each own their
    storage, as with ``move``, so a tensor kept after its batch (labels kept for a metric)
    keeps nothing else alive. ``views=True`` lets them land as views of shared device buffers
    of at most 1 MiB each (faster, for loops that drop their batches): a tensor kept then keeps
    its buffer alive, and growing one in place (``resize_``, ``set_``) reaches its neighbours.

    ``len()`` is the source's. Each ``iter()`` starts a new pass over the source, so the loader
    is re-iterable when the source is; a one-shot source (a generator) can have one live
    iterator at a time. An exception raised by the source reaches the consumer after the
    batches before it, and ends the pass; a failed copy raises ``MoveError`` naming the batch
    and the tensor. Leaving a loop early releases the thread and its batches at once; a
    generator passed in stays open, short of the batches already read ahead.

    With a thread (``meta``, or CUDA with ``prefetch > 0``), the source is read and its
    batches copied with the consumer's grad mode, inference mode and current CUDA device. The
    global random generator is shared by both threads, so random transforms done by the source
    in this process (``DataLoader(num_workers=0)``) draw in an order that varies from run to
    run; give them a ``torch.Generator`` of their own, use DataLoader workers, or
    ``prefetch=0`` for seeded runs. Modules and optimizers inside a batch pass unchanged (move
    them once, with ``move``).
    """

    def __init__(
        self,
        iterable: Iterable[T],
        device: DeviceSpec,
        /,
        *,
        prefetch: int = 2,
        pin_memory: bool | None = None,
        non_blocking: bool = True,
        views: bool = False,
    ) -> None:
        _check_iterable(iterable)
        try:
            target = _parse_device(device)
        except DeviceSpecError as exc:
            raise DeviceSpecError(f"DeviceLoader(device={device!r}): {exc}") from exc
        except DeviceUnavailableError as exc:
            raise DeviceUnavailableError(f"DeviceLoader(device={device!r}): {exc}") from exc
        try:
            count = -1 if isinstance(prefetch, bool) else operator.index(prefetch)
        except TypeError:
            count = -1
        if count < 0:
            raise TorchplaceError(
                f"DeviceLoader(prefetch={prefetch!r}): prefetch is how many batches are copied "
                "ahead of the consumer, a whole number 0 or more (2 is usual, 0 copies each "
                "batch when it is asked for)"
            )
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise TorchplaceError(
                f"DeviceLoader(pin_memory={pin_memory!r}): pin_memory is True, False or None "
                "(None pins host batches when the device is a CUDA GPU)"
            )
        if not isinstance(non_blocking, bool):
            raise TorchplaceError(
                f"DeviceLoader(non_blocking={non_blocking!r}): non_blocking is True or False"
            )
        if not isinstance(views, bool):
            raise TorchplaceError(
                f"DeviceLoader(views={views!r}): views is True (a batch's small tensors share "
                "bounded device buffers) or False (each tensor owns its storage)"
            )
        self.views = views
        self.iterable = iterable
        self.device = target
        self.prefetch = count
        # The last threaded iterator and its thread, which may outlive it inside next(source).
        self._live: tuple[weakref.ref[_Prefetcher], threading.Thread] | None = None
        self.pin_memory = pin_memory
        self.non_blocking = non_blocking

    def __iter__(self) -> Iterator[T]:
        source = iter(self.iterable)
        target = self.device
        if target.type == "cpu":
            return _synchronous(source, _Copier(target, pin=False, non_blocking=False, side=False))
        cuda = target.type == "cuda"
        pin = cuda and self.pin_memory is not False
        if self.prefetch == 0 or target.type not in ("cuda", "meta"):
            # Other accelerators have no stream protocol here: copy when asked, blocking.
            copier = _Copier(
                target,
                pin=pin,
                non_blocking=cuda and self.non_blocking,
                side=False,
                views=self.views,
            )
            return _synchronous(source, copier)
        one_shot = source is self.iterable  # a generator or another iterator: the user's own
        if one_shot and self._live is not None:
            last, thread = self._live
            live = last()
            if (live is not None and live.running) or thread.is_alive():
                raise TorchplaceError(
                    f"DeviceLoader({_short(self.iterable)}): this source is a one-shot "
                    "iterator, still being read by an earlier iterator of this loader in its "
                    "thread (a loop left early waits for it 2 s at most); finish the first "
                    "loop before starting another, or pass a source that can be iterated "
                    "again (a list, a DataLoader)"
                )
        copier = _Copier(
            target, pin=pin, non_blocking=self.non_blocking, side=cuda, views=self.views
        )
        prefetcher = _Prefetcher(source, copier, self.prefetch, close_source=not one_shot)
        self._live = (weakref.ref(prefetcher), prefetcher._thread)
        return prefetcher

    def __len__(self) -> int:
        try:
            return len(self.iterable)  # type: ignore[arg-type]
        except TypeError as exc:
            raise TypeError(
                f"DeviceLoader has no len() because its source, a {type(self.iterable).__name__},"
                f" has none ({exc})"
            ) from exc

    def __repr__(self) -> str:
        return (
            f"DeviceLoader({_short(self.iterable)}, device='{self.device}', "
            f"prefetch={self.prefetch}, pin_memory={self.pin_memory}, "
            f"non_blocking={self.non_blocking}, views={self.views})"
        )


def _short(obj: object) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else f"<{type(obj).__name__}>"


class _Copier:
    """Copies one batch to the device (``prepare``) and hands it to the consumer (``finish``).

    With ``side=True`` (CUDA with prefetch), ``prepare`` runs in the loader's thread and copies
    on a dedicated stream, and ``finish`` runs in the consumer's thread.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        pin: bool,
        non_blocking: bool,
        side: bool,
        views: bool = False,
    ):
        self.device = device
        self.views = views
        self.pin = pin
        self.non_blocking = non_blocking
        self.stream = torch.cuda.Stream(device) if side else None  # type: ignore[no-untyped-call]

    def prepare(self, batch: Any, index: int) -> tuple[Any, Any, list[Any]]:
        created: list[Any] = []
        stream = self.stream
        if stream is None:
            out = self._copy(batch, index, created)
            return out, None, created
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            out = self._copy(batch, index, created)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        if not self.non_blocking:
            event.synchronize()
        return out, event, created

    def finish(self, item: tuple[Any, Any, list[Any]]) -> Any:
        out, event, created = item
        if event is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(event)
            for obj in created:
                _record_stream(obj, consumer)
        return out

    def _copy(self, batch: Any, index: int, created: list[Any]) -> Any:
        """``batch`` with every tensor on the device; what was allocated goes to ``created``."""
        device = self.device
        if device.type == "cpu":  # no copy for what is already there (that is everything, mostly)
            return _located(index, device, batch, lambda: map_tensors(batch, self._one, to=_to_cpu))
        found: dict[int, torch.Tensor] = {}

        def look(t: torch.Tensor) -> torch.Tensor:
            if t.device != device:
                found.setdefault(id(t), t)
            return t

        map_tensors(batch, look)
        if self.stream is not None:
            # A batch already on another GPU was written by that device's stream: the side
            # stream must not read it before that work is done.
            for source in {t.device for t in found.values() if t.device.type == "cuda"}:
                self.stream.wait_stream(torch.cuda.current_stream(source))
        small = small_host_tensors(found.values())
        try:
            moved, storages = consolidate_small(
                small, device, non_blocking=self.non_blocking, views=self.views
            )
        except Exception as exc:
            raise MoveError(
                f"DeviceLoader could not copy batch {index} to {device}: its "
                f"{len(small)} small tensors, packed into one consolidated copy of "
                f"{format_bytes(sum(t.nbytes for t in small))}, failed: {exc}"
            ) from exc
        created.extend(storages)  # each owned result, or the shared buffers of views

        def one(t: torch.Tensor) -> torch.Tensor:
            out = moved.get(id(t))
            if out is None:
                out = self._one(t)
                if out is not t:
                    moved[id(t)] = out
                    created.append(out)
            return out

        def to(obj: Any) -> Any:
            if self.pin and callable(getattr(obj, "pin_memory", None)):
                obj = obj.pin_memory()
            # On a shallow copy, as move does: a .to() that works in place (BatchEncoding)
            # leaves the caller's batch, which may be yielded again next epoch, on the host.
            out = own_to(obj, device, asynchronous=self.non_blocking)
            created.append(out)
            return out

        return _located(index, device, batch, lambda: map_tensors(batch, one, to=to))

    def _one(self, t: torch.Tensor) -> torch.Tensor:
        return pinned_copy(t, self.device, pin=self.pin, non_blocking=self.non_blocking)


def _to_cpu(obj: Any) -> Any:
    """An object with its own ``.to`` whose tensors are all on the CPU passes as it is (no
    copy); one holding others moves by a shallow copy, the caller's object left as it was."""
    for _, leaf in iter_leaves(obj):
        if isinstance(leaf, torch.Tensor) and not leaf.is_cpu:
            return own_to(obj, _CPU, asynchronous=False)
    return obj


_CPU = torch.device("cpu")


def _located(index: int, device: torch.device, batch: Any, walk: Callable[[], Any]) -> Any:
    """Runs a walk over ``batch``, turning a failure into ``MoveError`` naming the tensor."""
    try:
        return walk()
    except Located as located:
        cause = located.cause
        path = located.path("batch")
        what = path
        if isinstance(batch, torch.Tensor) or path != "batch":
            for leaf_path, leaf in iter_leaves(batch):
                if leaf_path == path and isinstance(leaf, torch.Tensor):
                    if leaf.is_meta and not isinstance(leaf, torch.nn.Parameter):
                        raise MoveError(
                            f"DeviceLoader could not copy batch {index} to {device}: "
                            f"{data_meta_message(path, leaf, device)}",
                            name=path,
                        ) from cause
                    size = format_bytes(leaf.nbytes)
                    what = f"{path} ({leaf.dtype}, shape {tuple(leaf.shape)}, {size})"
                    break
        raise MoveError(
            f"DeviceLoader could not copy batch {index} to {device}: {what} failed: "
            f"{type(cause).__name__}: {cause}",
            name=path,
        ) from cause


def _record_stream(obj: Any, stream: torch.cuda.Stream) -> None:
    """Marks the device memory of ``obj`` (a tensor, or an object moved with ``.to``) as used on
    ``stream``, so the caching allocator does not reuse it before that stream is done with it."""
    if isinstance(obj, torch.Tensor):
        obj.record_stream(stream)
        return
    record = getattr(obj, "record_stream", None)
    if callable(record):  # TensorDict and friends know their own tensors
        record(stream)
        return
    for _, leaf in iter_leaves(obj):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
            leaf.record_stream(stream)


def _synchronous(source: Iterator[Any], copier: _Copier) -> Iterator[Any]:
    """Batches copied one at a time when asked for: the CPU, ``prefetch=0``, other devices."""
    for index, batch in enumerate(source):
        yield copier.finish(copier.prepare(batch, index))


class _End:
    """The source is exhausted."""


class _Failed:
    """The source, or the copy of a batch, raised ``error``."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Prefetcher(Iterator[Any]):
    """The iterator of a ``DeviceLoader`` that copies ahead in a thread.

    ``slots`` holds one permit per batch that may be prepared ahead of the consumer; the thread
    takes one before each batch and the consumer gives one back for each batch it takes.
    """

    def __init__(
        self, source: Iterator[Any], copier: _Copier, depth: int, *, close_source: bool
    ) -> None:
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._slots = threading.Semaphore(depth)
        self._stop = threading.Event()
        self._finish = copier.finish
        thread = threading.Thread(
            target=_produce,
            args=(source, copier.prepare, self._items, self._slots, self._stop, _caller_state()),
            kwargs={"close_source": close_source},
            name=_THREAD_NAME,
            daemon=True,
        )
        self._closer = weakref.finalize(
            self, _shut_down, thread, self._items, self._slots, self._stop
        )
        thread.start()
        self._thread = thread

    @property
    def running(self) -> bool:
        """Whether this iterator may still read its source (not exhausted, failed or closed)."""
        return self._closer.alive

    def __iter__(self) -> _Prefetcher:
        return self

    def __next__(self) -> Any:
        if not self._closer.alive:
            raise StopIteration
        item = self._items.get()
        if isinstance(item, _End):
            self.close()
            raise StopIteration
        if isinstance(item, _Failed):
            self.close()
            raise item.error
        self._slots.release()
        return self._finish(item)

    def close(self) -> None:
        """Stop the thread, release the batches copied ahead and close the source iterator."""
        self._closer()


def _caller_state() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """The thread-local state of the calling thread that a source's code may depend on, as a
    context manager factory that sets it up in another thread: grad mode, inference mode and
    the current CUDA device (asked only where CUDA is already initialised)."""
    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    cuda = (
        torch.cuda.current_device()
        if torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        else None
    )

    @contextlib.contextmanager
    def state() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            if inference:
                stack.enter_context(torch.inference_mode())
            if cuda is not None:
                stack.enter_context(torch.cuda.device(cuda))
            yield

    return state


def _produce(
    source: Iterator[Any],
    prepare: Callable[[Any, int], Any],
    items: queue.SimpleQueue[Any],
    slots: threading.Semaphore,
    stop: threading.Event,
    state: Callable[[], contextlib.AbstractContextManager[None]],
    *,
    close_source: bool,
) -> None:
    """The loader's thread: takes a permit, then a batch from the source, copies, queues it.

    The source is read, and its batches copied, with the consumer's grad mode, inference mode
    and CUDA device. However the pass ends (the source exhausted or failed, a copy failed, or
    the consumer said stop), the thread closes the source iterator (when ``iter()`` made it: a
    generator the user passed stays theirs, open) on its way out: it alone may, as it may be
    inside ``next()`` on it when the consumer gives up waiting for it.
    """
    index = 0
    try:
        while True:
            slots.acquire()
            if stop.is_set():
                return
            try:
                with state():
                    batch = next(source)
            except StopIteration:
                items.put(_End())
                return
            except BaseException as exc:  # the source failed: the consumer raises it in turn
                items.put(_Failed(exc))
                return
            if stop.is_set():
                return
            with state():  # copies made as the consumer would make them (autograd, inference)
                items.put(prepare(batch, index))
            del batch  # hold no batch while waiting for the next permit
            index += 1
    except BaseException as exc:  # a copy failed (MoveError), or something unforeseen
        items.put(_Failed(exc))
    finally:  # the pass is over however it ended: exhausted, failed, or told to stop
        close = getattr(source, "close", None) if close_source else None
        if callable(close):
            with state():
                close()


def _shut_down(
    thread: threading.Thread,
    items: queue.SimpleQueue[Any],
    slots: threading.Semaphore,
    stop: threading.Event,
) -> None:
    """Stops the thread (which closes the source on its way out), waits for it a while and
    drops the queued batches."""
    stop.set()
    slots.release()  # wakes the thread if it waits for a permit
    if thread is threading.current_thread():  # finalized by a garbage collection in the thread
        return
    if thread.ident is not None:
        try:
            thread.join(_JOIN_SECONDS)
        except KeyboardInterrupt:
            # A finalizer swallows exceptions: hand the Ctrl-C back to the main thread, which
            # raises it as soon as this returns, and stop waiting.
            _thread.interrupt_main()
            return
    while True:
        try:
            items.get_nowait()
        except queue.Empty:
            break
