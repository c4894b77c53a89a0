"""DeviceLoader: order, identity, len, re-iteration, early exits, failures, workers, CUDA safety."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
from collections import namedtuple
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchplace._errors import DeviceSpecError, DeviceUnavailableError, MoveError, TorchplaceError
from torchplace.moving._consolidate import MIN_COUNT
from torchplace.moving._loader import DeviceLoader

Pair = namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass
class Sample:
    pixels: torch.Tensor
    label: int


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "torchplace-DeviceLoader"]


@pytest.fixture(autouse=True)
def _no_thread_left() -> Iterator[None]:
    yield
    if loader_threads():  # an abandoned loop's thread stops once its iterator is collected
        gc.collect()  # (only then: a collection of the whole run's heap costs 0.7 s a test)
    assert loader_threads() == []


def numbered(n: int) -> list[dict[str, Any]]:
    return [{"x": torch.full((2, 3), float(i)), "i": i} for i in range(n)]


class Counting:
    """A re-iterable source that counts the batches taken from it and can fail at one index."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n = n
        self.fail_at = fail_at
        self.pulled = 0
        self.closed = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise KeyError(f"sample {i} is corrupt")
                self.pulled += 1
                yield {"x": torch.full((4,), float(i)), "i": i}
        finally:
            self.closed += 1


class Closing:
    """A re-iterable source whose iterators hold something until closed (a file, a connection)
    and have no ``__del__``; ``closed`` counts their ``close()`` calls. ``item(n)`` gives the
    n-th item, counted from 1, or raises."""

    def __init__(self, item: Callable[[int], Any]) -> None:
        self.item = item
        self.closed = 0

    def __iter__(self) -> _ClosingReader:
        return _ClosingReader(self)


class _ClosingReader:
    def __init__(self, source: Closing) -> None:
        self.source = source
        self.n = 0

    def __iter__(self) -> _ClosingReader:
        return self

    def __next__(self) -> Any:
        self.n += 1
        return self.source.item(self.n)

    def close(self) -> None:
        self.source.closed += 1


class Broken:
    """A batch object that cannot be moved."""

    def to(self, device: torch.device, non_blocking: bool = False) -> Broken:
        raise RuntimeError("no room")


# --- CPU: passthrough ---------------------------------------------------------------------


def test_cpu_yields_the_very_batches_in_order() -> None:
    batches = numbered(5)
    out = list(DeviceLoader(batches, "cpu"))
    assert len(out) == 5
    assert all(a is b for a, b in zip(out, batches, strict=True))


def test_cpu_starts_no_thread() -> None:
    source = Counting(3)
    it = iter(DeviceLoader(source, "cpu", prefetch=4))
    next(it)
    assert loader_threads() == []
    assert source.pulled == 1  # nothing is read ahead on the CPU


def test_cpu_names_a_batch_that_cannot_come_back() -> None:
    batch = {"ok": torch.ones(2), "ghost": torch.empty(3, device="meta")}
    with pytest.raises(MoveError, match=r"batch 0 .*batch\['ghost'\]") as e:
        list(DeviceLoader([batch], "cpu"))
    assert e.value.name == "batch['ghost']"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.requires_cuda)])
def test_a_meta_tensor_in_a_batch_gets_advice_for_data(device: str) -> None:
    """It says the entry, that it has no values, and how to make it with values; not the
    advice for a model's weights (load_into, to_empty)."""
    batch = {"ok": torch.ones(2), "ghost": [torch.empty(3, dtype=torch.int64, device="meta")]}
    with pytest.raises(MoveError) as info:
        list(DeviceLoader([batch], device))
    message = str(info.value)
    assert message.startswith(
        f"DeviceLoader could not copy batch 0 to {device}: batch['ghost'][0] is on meta: it "
        "has a shape (3,) and dtype int64 but no values"
    )
    assert f"e.g. torch.zeros(3, dtype=torch.int64, device='{device}')" in message
    assert "load_into" not in message and "to_empty" not in message
    assert info.value.name == "batch['ghost'][0]"


# --- meta: the threaded pipeline ------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 1, 2, 5])
def test_meta_keeps_order_and_structure(prefetch: int) -> None:
    batches = numbered(7)
    out = list(DeviceLoader(batches, "meta", prefetch=prefetch))
    assert [b["i"] for b in out] == list(range(7))
    for b in out:
        assert b["x"].device.type == "meta"
        assert b["x"].shape == (2, 3)
        assert b["x"].dtype == torch.float32


def test_meta_nested_batches_and_leaves() -> None:
    shared = torch.ones(3)
    marker = object()
    batch: dict[str, Any] = {
        "pair": Pair(torch.zeros(2), [shared, shared]),
        "sample": Sample(torch.ones(1, 2, 2), 3),
        "text": ["a", "b"],
        "marker": marker,
        "nothing": None,
    }
    (out,) = list(DeviceLoader([batch], "meta"))
    assert type(out["pair"]) is Pair
    assert out["pair"].left.device.type == "meta"
    left, right = out["pair"].right
    assert left is right  # one tensor twice stays one tensor twice
    assert isinstance(out["sample"], Sample)
    assert out["sample"].pixels.device.type == "meta"
    assert out["sample"].label == 3
    assert out["text"] is batch["text"]
    assert out["marker"] is marker
    assert out["nothing"] is None
    assert batch["pair"].left.device.type == "cpu"  # the source batch is untouched


def test_unsupported_objects_pass_unchanged() -> None:
    things = [object(), "text", 3, None, {1, 2}]
    for target in ("cpu", "meta"):
        out = list(DeviceLoader(things, target))
        assert all(a is b for a, b in zip(out, things, strict=True))


def test_the_device_loader_refuses_a_set_batch() -> None:
    for device in ("meta", "cpu"):
        with pytest.raises(TorchplaceError, match=r"batch is a set holding tensors"):
            next(iter(DeviceLoader([{torch.ones(1)}], device)))
        with pytest.raises(TorchplaceError, match=r"batch\['m'\] is a set holding"):
            next(iter(DeviceLoader([{"m": {torch.ones(1)}}], device)))


def test_bare_tensor_batches() -> None:
    out = list(DeviceLoader([torch.ones(2), torch.zeros(3)], "meta"))
    assert [tuple(t.shape) for t in out] == [(2,), (3,)]


def test_objects_with_their_own_to() -> None:
    class Encoding:
        def __init__(self, ids: torch.Tensor) -> None:
            self.ids = ids

        def to(self, device: torch.device, non_blocking: bool = False) -> Encoding:
            return Encoding(self.ids.to(device, non_blocking=non_blocking))

    (out,) = list(DeviceLoader([{"enc": Encoding(torch.ones(2))}], "meta"))
    assert out["enc"].ids.device.type == "meta"


def test_own_to_follows_the_rule_move_follows() -> None:
    """One rule (_transfer.object_to): a .to() that takes no non_blocking is asked again
    without it; a TypeError of its own is not retried and surfaces, naming the batch."""

    class Plain:
        def __init__(self, ids: torch.Tensor) -> None:
            self.ids = ids

        def to(self, device: torch.device) -> Plain:
            return Plain(self.ids.to(device))

    class Picky:
        calls = 0

        def to(self, device: torch.device, non_blocking: bool = False) -> Picky:
            Picky.calls += 1
            raise TypeError("to() got a dtype it does not know")

    (out,) = list(DeviceLoader([{"enc": Plain(torch.ones(2))}], "meta", non_blocking=True))
    assert out["enc"].ids.device.type == "meta"
    with pytest.raises(MoveError, match=r"batch 0 .*dtype it does not know") as e:
        list(DeviceLoader([{"enc": Picky()}], "meta", non_blocking=True))
    assert e.value.name == "batch['enc']"
    assert Picky.calls == 1


@pytest.mark.parametrize(("device", "prefetch"), [("meta", 2), ("meta", 0)])
def test_a_batch_that_moves_in_place_is_yielded_as_a_copy(device: str, prefetch: int) -> None:
    """A BatchEncoding / BatchFeature's .to() works in place: the loader moves a copy, as move
    does, so host batches kept for the next epoch stay on the host, their tensors untouched."""
    transformers = pytest.importorskip("transformers")
    ids = torch.arange(6).view(2, 3)
    pixels = torch.ones(2, 3)
    batches = [
        transformers.BatchEncoding({"input_ids": ids}),
        transformers.BatchFeature({"pixel_values": pixels}),
    ]
    for _epoch in range(2):
        out = list(DeviceLoader(batches, device, prefetch=prefetch))
        assert [type(b) for b in out] == [type(b) for b in batches]
        assert all(a is not b for a, b in zip(out, batches, strict=True))
        assert out[0]["input_ids"].device.type == out[1]["pixel_values"].device.type == device
        assert batches[0]["input_ids"] is ids and batches[1]["pixel_values"] is pixels
        assert batches[0].input_ids is ids  # its attribute view of the items, too


def test_a_batch_with_its_own_to_passes_the_cpu_as_it_is_unless_it_must_move() -> None:
    """Already on the CPU: the very batch (no copy). Elsewhere: moved as a copy by its own
    in-place .to(), the caller's batch left where it was."""
    transformers = pytest.importorskip("transformers")
    here = transformers.BatchEncoding({"input_ids": torch.arange(3)})
    (same,) = list(DeviceLoader([here], "cpu"))
    assert same is here

    class Materialises:  # an in-place .to() that can leave meta (a real one needs a GPU)
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def to(self, device: torch.device) -> Materialises:
            self.t = torch.zeros(self.t.shape, device=device)
            return self

    elsewhere = Materialises(torch.empty(2, device="meta"))
    (out,) = list(DeviceLoader([elsewhere], "cpu"))
    assert out is not elsewhere and out.t.is_cpu and torch.equal(out.t, torch.zeros(2))
    assert elsewhere.t.is_meta


def test_reads_at_most_prefetch_batches_ahead() -> None:
    source = Counting(12)
    taken = 0
    for _ in DeviceLoader(source, "meta", prefetch=3):
        taken += 1
        assert source.pulled <= taken + 3
    assert taken == 12


# --- len and re-iteration -----------------------------------------------------------------


def test_len_delegates() -> None:
    assert len(DeviceLoader(numbered(4), "meta")) == 4
    assert len(DeviceLoader(Counting(9), "cpu")) == 9


def test_len_of_a_source_without_one() -> None:
    loader = DeviceLoader((b for b in numbered(2)), "meta")
    with pytest.raises(TypeError, match="source, a generator, has none"):
        len(loader)
    assert len(list(loader)) == 2  # list() still works: it only asks for a length hint


@pytest.mark.parametrize("target", ["cpu", "meta"])
def test_re_iterable_when_the_source_is(target: str) -> None:
    source = Counting(3)
    loader = DeviceLoader(source, target)
    first = [b["i"] for b in loader]
    second = [b["i"] for b in loader]
    assert first == second == [0, 1, 2]


@pytest.mark.parametrize("target", ["cpu", "meta"])
def test_a_one_shot_source_runs_once(target: str) -> None:
    loader = DeviceLoader(iter(numbered(3)), target)
    assert len(list(loader)) == 3
    assert list(loader) == []


# --- leaving early and failing --------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [1, 2, 8])
def test_break_leaves_no_thread(prefetch: int) -> None:
    source = Counting(50)
    for batch in DeviceLoader(source, "meta", prefetch=prefetch):
        if batch["i"] == 2:
            break
    assert loader_threads() == []  # closed when the loop dropped the iterator, no gc needed
    assert source.closed == 1  # and the source's iterator was closed
    assert source.pulled <= 3 + prefetch


def test_close_releases_the_batches_read_ahead() -> None:
    import weakref

    kept: list[weakref.ref[torch.Tensor]] = []

    def source() -> Iterator[torch.Tensor]:
        for _ in range(10):
            t = torch.ones(2)
            kept.append(weakref.ref(t))
            yield t

    it = iter(DeviceLoader(source(), "meta", prefetch=4))
    next(it)
    it.close()  # type: ignore[attr-defined]
    assert loader_threads() == []
    gc.collect()
    assert all(ref() is None for ref in kept)
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize(("target", "prefetch"), [("cpu", 2), ("meta", 0), ("meta", 2)])
def test_source_exception_arrives_at_its_batch(target: str, prefetch: int) -> None:
    source = Counting(10, fail_at=4)
    it = iter(DeviceLoader(source, target, prefetch=prefetch))
    assert [next(it)["i"] for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="sample 4 is corrupt"):
        next(it)


def test_source_exception_is_the_same_object() -> None:
    error = ValueError("bad shard")

    def source() -> Iterator[torch.Tensor]:
        yield torch.ones(1)
        raise error

    it = iter(DeviceLoader(source(), "meta"))
    next(it)
    with pytest.raises(ValueError, match="bad shard") as info:
        next(it)
    assert info.value is error
    with pytest.raises(StopIteration):  # the pass is over
        next(it)


def test_failed_copy_names_batch_and_path() -> None:
    batches: list[dict[str, Any]] = [{"ok": torch.ones(1)}, {"ok": torch.ones(1), "bad": Broken()}]
    it = iter(DeviceLoader(batches, "meta"))
    assert next(it)["ok"].device.type == "meta"
    with pytest.raises(MoveError, match=r"batch 1 to meta: batch\['bad'\].*no room") as e:
        next(it)
    assert e.value.name == "batch['bad']"


@pytest.mark.parametrize("end", ["exhausted", "source fails", "copy fails"])
def test_the_source_iterator_is_closed_however_the_pass_ends(end: str) -> None:
    def item(n: int) -> Any:
        if n < 3:
            return torch.ones(1)
        if end == "exhausted":
            raise StopIteration
        if end == "source fails":
            raise KeyError("corrupt sample")
        return Broken()

    source = Closing(item)
    it = iter(DeviceLoader(source, "meta"))
    got = []
    with contextlib.suppress(KeyError, MoveError):
        got.extend(it)
    assert len(got) == 2
    for thread in loader_threads():
        thread.join(10)
    assert source.closed == 1


# --- DataLoader with workers ----------------------------------------------------------------


@pytest.mark.parametrize("target", ["cpu", "meta"])
def test_multi_worker_dataloader(target: str) -> None:
    data = TensorDataset(torch.arange(24.0).reshape(12, 2), torch.arange(12))
    source = DataLoader(data, batch_size=3, num_workers=2)
    loader = DeviceLoader(source, target)
    assert len(loader) == 4
    labels = []
    for features, label in loader:
        assert features.device.type == target
        assert features.shape == (3, 2)
        if target == "cpu":
            labels.extend(label.tolist())
    if target == "cpu":
        assert labels == list(range(12))


def test_multi_worker_dataloader_break() -> None:
    data = TensorDataset(torch.arange(40.0).reshape(20, 2))
    loader = DeviceLoader(DataLoader(data, batch_size=2, num_workers=2), "meta", prefetch=2)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    assert loader_threads() == []


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [-1, 1.5, True, "2", None])
def test_bad_prefetch_is_named(prefetch: Any) -> None:
    with pytest.raises(TorchplaceError, match=r"prefetch="):
        DeviceLoader([], "cpu", prefetch=prefetch)


def test_bad_device_is_named() -> None:
    with pytest.raises(DeviceSpecError, match=r"DeviceLoader\(device='cdua'\)"):
        DeviceLoader([], "cdua")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_absent_device_is_named() -> None:
    with pytest.raises(DeviceUnavailableError, match=r"DeviceLoader\(device='cuda:7'\)"):
        DeviceLoader([], "cuda:7")


def test_a_tensor_is_no_iterable_of_batches() -> None:
    """It would hand over its rows one by one, silently."""
    with pytest.raises(TorchplaceError, match=r"got a tensor of shape \(3,\).*DataLoader"):
        DeviceLoader(torch.ones(3), "cpu")


def test_bad_flags_are_named() -> None:
    with pytest.raises(TorchplaceError, match="pin_memory="):
        DeviceLoader([], "cpu", pin_memory="yes")  # type: ignore[arg-type]
    with pytest.raises(TorchplaceError, match="non_blocking="):
        DeviceLoader([], "cpu", non_blocking=None)  # type: ignore[arg-type]


def test_not_iterable_is_named() -> None:
    with pytest.raises(TorchplaceError, match="iterable of batches"):
        DeviceLoader(5, "cpu")  # type: ignore[arg-type]


def test_repr() -> None:
    text = repr(DeviceLoader([1, 2], "meta", prefetch=3))
    assert text == (
        "DeviceLoader([1, 2], device='meta', prefetch=3, pin_memory=None, non_blocking=True, "
        "views=False)"
    )


# --- the stream protocol, with stand-ins for CUDA streams and events --------------------------


class FakeEvent:
    def __init__(self) -> None:
        self.stream: Any = None
        self.synchronized = False

    def record(self, stream: Any) -> None:
        self.stream = stream

    def synchronize(self) -> None:
        self.synchronized = True


class FakeStream:
    def __init__(self, device: Any = None) -> None:
        self.waited: list[FakeEvent] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)


@pytest.fixture
def consumer(monkeypatch: pytest.MonkeyPatch) -> FakeStream:
    """CUDA's stream protocol replaced by stand-ins that record it; the consumer's stream."""
    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    return stream


@pytest.mark.parametrize("non_blocking", [True, False])
def test_stream_protocol(
    monkeypatch: pytest.MonkeyPatch, consumer: FakeStream, non_blocking: bool
) -> None:
    """Each batch is copied under the side stream and its event recorded there; the consumer's
    stream waits on that event before the batch is handed over, and every tensor the loader
    allocated is marked as used by the consumer's stream."""
    from torchplace.moving import _loader

    recorded: list[tuple[Any, Any]] = []
    monkeypatch.setattr(_loader, "_record_stream", lambda obj, s: recorded.append((obj, s)))

    copier = _loader._Copier(torch.device("meta"), pin=False, non_blocking=non_blocking, side=True)
    assert isinstance(copier.stream, FakeStream)
    already = torch.empty(2, device="meta")
    batches = [{"x": torch.ones(3), "y": [torch.zeros(1)], "z": already, "i": i} for i in range(5)]
    seen = 0
    for batch in _loader._Prefetcher(iter(batches), copier, 2, close_source=True):
        assert len(consumer.waited) == seen + 1  # waited before the batch was handed over
        event = consumer.waited[-1]
        assert event.stream is copier.stream
        assert event.synchronized is not non_blocking
        mine = recorded[-2:]
        assert {id(obj) for obj, _ in mine} == {id(batch["x"]), id(batch["y"][0])}
        assert all(s is consumer for _, s in mine)
        assert batch["z"] is already  # already there: neither copied nor recorded
        seen += 1
    assert seen == 5
    assert len(recorded) == 10


class _MovesInPlace:
    """Like Hugging Face's BatchEncoding: .to() moves its tensors and returns the same object."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: torch.device, non_blocking: bool = False) -> _MovesInPlace:
        self.t = self.t.to(device)
        return self


def test_objects_moved_in_place_are_marked_for_the_consumer_stream(
    monkeypatch: pytest.MonkeyPatch, consumer: FakeStream
) -> None:
    from torchplace.moving import _loader

    recorded: list[Any] = []
    monkeypatch.setattr(_loader, "_record_stream", lambda obj, s: recorded.append(obj))
    copier = _loader._Copier(torch.device("meta"), pin=False, non_blocking=True, side=True)
    batches = [{"enc": _MovesInPlace(torch.ones(2, 8)), "labels": torch.zeros(2)}]
    for batch in _loader._Prefetcher(iter(batches), copier, 2, close_source=True):
        assert batch["enc"].t.device == torch.device("meta")
        assert any(obj is batch["enc"] for obj in recorded)
        assert any(obj is batch["labels"] for obj in recorded)


def test_the_source_runs_with_the_callers_grad_mode_and_inference_mode() -> None:
    w = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        for device, prefetch in (("cpu", 2), ("meta", 0), ("meta", 2)):
            batch = next(iter(DeviceLoader((w * i for i in range(3)), device, prefetch=prefetch)))
            assert not batch.requires_grad, (device, prefetch)
    with torch.inference_mode():
        batch = next(iter(DeviceLoader((torch.ones(2) * i for i in range(3)), "meta")))
        assert batch.is_inference()


def test_a_users_generator_is_left_open_after_a_break() -> None:
    def numbers() -> Iterator[torch.Tensor]:
        for i in range(10):
            yield torch.tensor([float(i)])

    for device, prefetch in (("cpu", 2), ("meta", 0), ("meta", 2)):
        source = numbers()
        for taken, _ in enumerate(DeviceLoader(source, device, prefetch=prefetch), start=1):
            if taken == 3:
                break
        left = sum(1 for _ in source)
        # The thread reads up to `prefetch` batches ahead; the rest stay in the generator.
        assert 10 - 3 - prefetch <= left <= 7, (device, prefetch, left)


def test_two_live_iterators_over_a_generator_are_refused() -> None:
    loader = DeviceLoader((torch.ones(1) for _ in range(100)), "meta")
    first = iter(loader)
    next(first)
    with pytest.raises(TorchplaceError, match=r"one-shot iterator.*earlier iterator"):
        iter(loader)
    del first
    gc.collect()
    assert sum(1 for _ in loader) > 0  # the first one is gone: a new pass may start
    again = DeviceLoader([torch.ones(1)] * 3, "meta")  # re-iterable: any number at once
    assert sum(1 for _ in zip(iter(again), iter(again), strict=True)) == 3


def test_ctrl_c_while_waiting_for_a_stalled_source_is_handed_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torchplace.moving import _loader

    class Stuck(threading.Thread):
        def join(self, timeout: float | None = None) -> None:
            raise KeyboardInterrupt  # Ctrl-C while the finalizer waits for the thread

    interrupted: list[bool] = []
    monkeypatch.setattr(_loader._thread, "interrupt_main", lambda: interrupted.append(True))
    thread = Stuck(target=lambda: None)
    thread.start()
    stop = threading.Event()
    _loader._shut_down(thread, _loader.queue.SimpleQueue(), threading.Semaphore(0), stop)
    assert stop.is_set() and interrupted == [True]


def test_prefetch_accepts_any_integer() -> None:
    numpy = pytest.importorskip("numpy")
    assert DeviceLoader([], "meta", prefetch=numpy.int64(3)).prefetch == 3
    for bad in (True, 2.5, "2", -1):
        with pytest.raises(TorchplaceError, match="prefetch="):
            DeviceLoader([], "meta", prefetch=bad)  # type: ignore[arg-type]


# --- CUDA ---------------------------------------------------------------------------------


def cuda_batches(n: int, numel: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        bits = torch.randint(-(2**31), 2**31 - 1, (numel,), dtype=torch.int32)
        out.append(
            {
                "f32": bits.view(torch.float32),  # arbitrary bit patterns, NaN payloads included
                "bf16": bits[: numel // 2].view(torch.bfloat16),
                "mask": bits[:64] > 0,
                # enough small tensors that the batch travels as one consolidated copy
                "small": [torch.full((3,), i, dtype=torch.int8) for _ in range(MIN_COUNT)],
                "i": i,
            }
        )
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.contiguous(), b.contiguous()
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.requires_cuda
@pytest.mark.parametrize("pin_memory", [None, False])
@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_cuda_values_bit_identical(prefetch: int, pin_memory: bool | None) -> None:
    batches = cuda_batches(8, 1 << 16)
    loader = DeviceLoader(batches, "cuda:0", prefetch=prefetch, pin_memory=pin_memory)
    for host, dev in zip(batches, loader, strict=True):
        assert dev["f32"].device == torch.device("cuda:0")
        assert dev["i"] == host["i"]
        for key in ("f32", "bf16", "mask"):
            assert same_bits(dev[key].cpu(), host[key])
        for a, b in zip(dev["small"], host["small"], strict=True):
            assert same_bits(a.cpu(), b)


@pytest.mark.requires_cuda
def test_cuda_already_pinned_batches() -> None:
    batches = [torch.arange(1000.0).pin_memory() for _ in range(4)]
    out = [t.cpu() for t in DeviceLoader(batches, "cuda:0")]
    assert all(torch.equal(a, b) for a, b in zip(out, batches, strict=True))


@pytest.mark.requires_cuda
def test_cuda_reader_never_overtakes_a_slow_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy is held back on the side stream by a long GPU sleep queued before it, while
    the consumer checks each batch with a kernel the moment it gets it. Without the event wait
    the check would read memory the copy has not written yet."""
    from torchplace.moving import _loader

    original = _loader._Copier._one

    def slow_one(self: Any, t: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]  # the side stream
        return original(self, t)

    monkeypatch.setattr(_loader._Copier, "_one", slow_one)
    n = 24
    batches = [torch.full((1 << 20,), float(i)) for i in range(n)]
    checks = []
    for i, batch in enumerate(DeviceLoader(batches, "cuda:0", prefetch=2)):
        checks.append((batch == float(i)).all())  # fast reader on the consumer's stream
    assert torch.stack(checks).all().item()


@pytest.mark.requires_cuda
def test_cuda_memory_not_reused_while_the_consumer_reads() -> None:
    """The consumer reads each batch after a long GPU sleep and drops it at once; the loader's
    later copies must not land in that memory before the read (``record_stream``)."""
    n = 16
    batches = [torch.full((1 << 20,), float(i)) for i in range(n)]
    sums = []
    for batch in DeviceLoader(batches, "cuda:0", prefetch=3):
        torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]
        sums.append(batch.sum())
        del batch
    expected = [float(i) * (1 << 20) for i in range(n)]
    assert [s.item() for s in sums] == expected


@pytest.mark.requires_cuda
def test_cuda_break_leaves_no_thread() -> None:
    for i, _ in enumerate(DeviceLoader(cuda_batches(10, 1024), "cuda:0", prefetch=4)):
        if i == 1:
            break
    assert loader_threads() == []


@pytest.mark.requires_cuda
def test_cuda_consumer_on_another_stream() -> None:
    batches = [torch.full((1 << 16,), float(i)) for i in range(6)]
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    checks = []
    with torch.cuda.stream(stream):
        for i, batch in enumerate(DeviceLoader(batches, "cuda:0")):
            checks.append((batch == float(i)).all())
    stream.synchronize()
    assert torch.stack(checks).all().item()


def test_a_source_still_in_next_when_the_loop_stops_waiting_is_closed_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torchplace.moving import _loader

    monkeypatch.setattr(_loader, "_JOIN_SECONDS", 0.05)  # as after a Ctrl-C during the join
    release, inside = threading.Event(), threading.Event()

    def item(n: int) -> torch.Tensor:
        if n == 2:
            inside.set()
            release.wait(10)  # the thread is inside next() when the loop breaks
        return torch.ones(1)

    source = Closing(item)
    for _ in DeviceLoader(source, "meta"):
        assert inside.wait(10)  # on a busy machine the thread may not have asked yet
        break
    assert source.closed == 0 and len(loader_threads()) == 1  # the join gave up waiting
    release.set()
    for thread in loader_threads():
        thread.join(10)
    assert source.closed == 1  # the thread closed the source once next() returned


def test_a_second_loop_while_the_thread_still_reads_the_generator_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torchplace.moving import _loader

    monkeypatch.setattr(_loader, "_JOIN_SECONDS", 0.05)
    release, inside = threading.Event(), threading.Event()

    def slow() -> Iterator[torch.Tensor]:
        yield torch.ones(1)
        inside.set()
        release.wait(10)  # the thread is inside next() when the first loop breaks
        yield torch.ones(1)

    loader = DeviceLoader(slow(), "meta")
    for _ in loader:
        assert inside.wait(10)  # on a busy machine the thread may not have asked yet
        break
    try:
        with pytest.raises(TorchplaceError, match="one-shot iterator"):
            iter(loader)
    finally:
        release.set()
        for thread in loader_threads():  # it stops on its own once next() returns
            thread.join(10)
