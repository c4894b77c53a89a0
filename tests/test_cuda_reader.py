"""The CUDA reader's threads (``_cuda_read.read_cuda``), driven on the CPU.

Several threads each take a slot of a small pool, read a chunk into it and queue its copy on a
transport that runs copies late (only when an event behind them is waited for), as a copy
engine may; the pool used here refuses to hand out a slot while a copy from it is still pending.
So the values show any chunk sent from a slot refilled too early, and the pool names the moment.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import zlib
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

from test_interrupts import Interrupter
from test_staging import _Event, _LateTransport
from torchplace.checkpoint import _cuda_read
from torchplace.checkpoint._plan_items import ReadItem
from torchplace.moving import _staging
from torchplace.moving._staging import PinnedPool, Slot

SLOT = 64  # bytes per slot of the test pools: a few elements per chunk, many chunks per piece
HOST = torch.device("cpu")


def _checked(items: list[ReadItem], checks: dict[int, tuple[int, str]]) -> list[ReadItem]:
    """``items`` with the CRC-32 each must have, from ``checks`` by start: (CRC-32, name)."""
    return [item._replace(check=checks.get(item.start)) for item in items]


class _LateCopies(_LateTransport):
    """The ring tests' late copy engine (one queue, as one CUDA stream is), noting which host
    threads queued copies and letting another thread in between a read and its copy."""

    def __init__(self) -> None:
        super().__init__()
        self.queued = 0  # copies queued so far
        self.threads: set[str] = set()  # the threads that queued copies

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        time.sleep(0)  # let another thread in between the read and the copy
        with self.lock:
            super().copy(dst, src)
            self.queued += 1
            self.threads.add(threading.current_thread().name)

    def pending_from(self, buffer: torch.Tensor) -> bool:
        """Whether a queued copy still reads from ``buffer``'s bytes."""
        low = buffer.data_ptr()
        high = low + buffer.nbytes
        with self.lock:
            return any(low <= src.data_ptr() < high for _, src in self.queue)


class _PatientLock:
    """The pool's lock, but one that gives up after a while: a test that leaves it held fails
    instead of hanging."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> None:
        if not self._lock.acquire(timeout=10):
            raise AssertionError("the pool's lock was left held")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class _WatchedPool(PinnedPool):
    """A pool of ordinary host memory that refuses to hand out a slot a copy still reads."""

    def __init__(self, copies: _LateCopies, slots: int) -> None:
        super().__init__(
            slots * SLOT,
            SLOT,
            allocate=lambda n: torch.full((n,), 0xEE, dtype=torch.uint8),
            available=lambda: None,
        )
        self.copies = copies
        self._lock = _PatientLock()  # type: ignore[assignment]

    def take(self, nbytes: int) -> Slot:
        slot = super().take(nbytes)
        if self.copies.pending_from(slot.buffer):
            raise AssertionError("a slot was handed out while a copy from it was pending")
        return slot

    def settled(self) -> bool:
        """Every slot the pool keeps is back, and none has a copy pending once taken."""
        if len(self._free) * SLOT != self.kept_bytes:
            return False
        taken = [self.take(SLOT) for _ in range(len(self._free))]
        for slot in taken:
            self.give(slot, None)
        return True


def _reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("torchplace-read")]


class _Case:
    """A file of a few tensors at odd offsets, and empty tensors to read them into: direct
    pieces of several dtypes, and converting ones (the file's dtype differs)."""

    def __init__(self, tmp_path: Path) -> None:
        gen = torch.Generator().manual_seed(0)
        self.sources = [
            torch.randn(86, generator=gen),  # 344 bytes: five whole chunks and a part
            torch.randint(0, 256, (123,), dtype=torch.uint8, generator=gen),
            torch.randn(40, generator=gen),  # read as float32, landing in bfloat16
            torch.randn(50, generator=gen).half(),  # read as float16, landing in float32
            torch.randint(-(2**40), 2**40, (8,), generator=gen),  # one chunk exactly
        ]
        self.targets = [None, None, torch.bfloat16, torch.float32, None]
        blob = bytearray(b"head!!!")  # 7 bytes: no piece is aligned
        self.offsets = []
        for t in self.sources:
            self.offsets.append(len(blob))
            blob += t.numpy().tobytes()
        self.data = bytes(blob)
        self.path = tmp_path / "bytes"
        self.path.write_bytes(self.data)
        self.chunks = 0
        for t in self.sources:  # each in the file's dtype
            per = SLOT // t.element_size() * t.element_size()  # whole elements per chunk
            self.chunks += -(-t.nbytes // per)

    def pieces(self) -> tuple[list[Any], list[torch.Tensor]]:
        into, pieces = [], []
        for offset, t, target in zip(self.offsets, self.sources, self.targets, strict=True):
            if target is None:
                out = torch.empty_like(t)
                pieces.append(ReadItem(offset, out))
            else:
                out = torch.empty(t.shape, dtype=target)
                pieces.append(ReadItem(offset, out, t.dtype))
            into.append(out)
        return pieces, into

    def expected(self) -> list[torch.Tensor]:
        return [
            t if target is None else t.to(target)
            for t, target in zip(self.sources, self.targets, strict=True)
        ]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize(
    ("threads", "slots"),
    [(1, 2), (3, 3), (8, 2), (8, 5)],
    ids=["1-thread", "3-threads-3-slots", "8-threads-2-slots", "8-threads-5-slots"],
)
def test_threads_read_every_chunk_bit_for_bit_through_a_bounded_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int, slots: int
) -> None:
    """Values bit for bit, converting pieces too, whatever the thread count against the pool's
    slots: at most one thread per slot reads, the pool never grows beyond its slots nor hands
    out a buffer of its own, and a second read pins nothing new."""
    monkeypatch.setattr(_cuda_read, "CUDA_READ_THREADS", threads)
    case = _Case(tmp_path)
    copies = _LateCopies()
    pool = _WatchedPool(copies, slots)
    fd = os.open(case.path, os.O_RDONLY)
    try:
        for _ in range(2):
            pieces, into = case.pieces()
            advanced: list[int] = []
            failed = _cuda_read.read_cuda(
                fd, pieces, HOST, advanced.append, pool=pool, transport=copies
            )
            assert copies.queue  # copies still pending when the call returned: they ran late
            copies.wait()  # what the device's stream does before the tensors are used
            assert failed == []
            for out, want in zip(into, case.expected(), strict=True):
                assert _same_bits(out, want)
            assert sum(advanced) == len(case.data) - 7 and len(advanced) == case.chunks
    finally:
        os.close(fd)
    assert pool.allocations == slots and pool.kept_bytes == slots * SLOT  # bounded, reused
    assert 1 <= len(copies.threads) <= min(threads, slots)  # never more threads than slots
    assert not _reader_threads() and pool.settled()


def test_the_pool_check_catches_a_slot_reused_before_its_copy(tmp_path: Path) -> None:
    """The check the tests above rely on can fail: a pool that forgets the event it is given
    hands the slot out again under a pending copy, and the read stops there."""

    class Careless(_WatchedPool):
        def give(self, slot: Slot, event: Any) -> None:
            super().give(slot, None)

    case = _Case(tmp_path)
    copies = _LateCopies()
    fd = os.open(case.path, os.O_RDONLY)
    try:
        pieces, _ = case.pieces()
        with pytest.raises(AssertionError, match="handed out while a copy from it was pending"):
            _cuda_read.read_cuda(fd, pieces, HOST, pool=Careless(copies, 1), transport=copies)
    finally:
        os.close(fd)


def test_crc_of_a_piece_read_in_parallel_chunks_names_only_the_damaged_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks arrive in any order; each piece's CRC-32 is joined from its chunks' own."""
    monkeypatch.setattr(_cuda_read, "CUDA_READ_THREADS", 3)
    first = os.urandom(10 * SLOT + 5)  # eleven chunks, read by three threads
    second = os.urandom(3 * SLOT)
    expected = {0: (zlib.crc32(first), "first"), len(first): (zlib.crc32(second), "second")}
    path = tmp_path / "records"
    copies = _LateCopies()
    pool = _WatchedPool(copies, 3)
    for damaged, names in [(None, []), (5 * SLOT + 3, ["first"]), (len(first) + 1, ["second"])]:
        data = bytearray(first + second)
        if damaged is not None:
            data[damaged] ^= 0x10  # one bit flipped after the CRCs were recorded
        path.write_bytes(bytes(data))
        a = torch.empty(len(first), dtype=torch.uint8)
        b = torch.empty(len(second), dtype=torch.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            failed = _cuda_read.read_cuda(
                fd,
                _checked([ReadItem(0, a), ReadItem(len(first), b)], expected),
                HOST,
                pool=pool,
                transport=copies,
            )
        finally:
            os.close(fd)
        assert failed == names
        copies.wait()
        assert a.numpy().tobytes() + b.numpy().tobytes() == bytes(data)
    assert pool.settled()


def test_crc_of_a_converting_piece_is_of_the_files_bytes(tmp_path: Path) -> None:
    """A piece read in the file's dtype and converted by its copy (a zip file's fp32 record into a
    bf16 model) is checked too: the CRC-32 is of the staged bytes, as the file holds them."""
    case = _Case(tmp_path)
    copies = _LateCopies()
    pool = _WatchedPool(copies, 2)
    converting = [k for k, target in enumerate(case.targets) if target is not None]
    fd = os.open(case.path, os.O_RDONLY)
    try:
        pieces, _ = case.pieces()
        sound = {
            case.offsets[k]: (zlib.crc32(case.sources[k].numpy().tobytes()), f"r{k}")
            for k in converting
        }
        checked = _checked(pieces, sound)
        assert _cuda_read.read_cuda(fd, checked, HOST, pool=pool, transport=copies) == []
        copies.wait()
        wrong = {case.offsets[k]: (zlib.crc32(b"other"), f"r{k}") for k in converting}
        checked = _checked(pieces, wrong)
        failed = _cuda_read.read_cuda(fd, checked, HOST, pool=pool, transport=copies)
        copies.wait()
        assert failed == [f"r{k}" for k in converting]
    finally:
        os.close(fd)
    assert pool.settled()


class _FailingCopies(_LateCopies):
    """The copy of the chunk landing at ``fail_at`` raises ``exc``; every other copy waits
    until that failure has stopped the read (``stop``, the read's own event, set), so the
    other threads can only go on afterwards, whatever the machine's speed."""

    def __init__(self, fail_at: int, exc: BaseException) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.exc = exc
        self.stop = threading.Event()  # replaced by the read's own as it starts its threads

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.data_ptr() == self.fail_at:
            raise self.exc
        if not self.stop.wait(60):
            raise AssertionError("the failing chunk never stopped the read")
        super().copy(dst, src)


@pytest.mark.parametrize(
    "exc", [RuntimeError("simulated copy failure"), KeyboardInterrupt()], ids=["error", "ctrl-c"]
)
def test_a_failure_in_one_thread_stops_the_others_and_leaves_no_thread_nor_slot_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    monkeypatch.setattr(_cuda_read, "CUDA_READ_THREADS", 3)
    data = os.urandom(40 * SLOT)
    path = tmp_path / "bytes"
    path.write_bytes(data)
    into = torch.zeros(len(data), dtype=torch.uint8)
    copies = _FailingCopies(into[SLOT:].data_ptr(), exc)  # thread 1's first chunk
    real_run = _cuda_read.read_in_threads

    def caught(share: Any, threads: int, stop: threading.Event) -> None:
        copies.stop = stop
        real_run(share, threads, stop)

    monkeypatch.setattr(_cuda_read, "read_in_threads", caught)
    pool = _WatchedPool(copies, 3)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(type(exc)):
            _cuda_read.read_cuda(fd, [ReadItem(0, into)], HOST, pool=pool, transport=copies)
        after = copies.queued
        time.sleep(0.1)
        assert copies.queued == after  # nothing queues any more once the call is over
    finally:
        os.close(fd)
    assert not _reader_threads()  # no thread outlives the call
    assert copies.queued <= 2  # threads 0 and 2 stopped after the chunk they had in hand
    assert pool.settled()  # every slot back, none handed out under a pending copy
    copies.wait()
    landed = into.numpy().tobytes()
    whole = [landed[k : k + SLOT] == data[k : k + SLOT] for k in range(0, len(data), SLOT)]
    untouched = [not any(landed[k : k + SLOT]) for k in range(0, len(data), SLOT)]
    assert all(w or u for w, u in zip(whole, untouched, strict=True))
    assert sum(whole) == copies.queued  # each copy queued landed whole, nothing else did


def test_a_mark_that_fails_after_its_copy_still_fences_the_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy queued, then the event behind it fails to record: the slot goes back behind a
    second event (or a wait), never bare."""
    monkeypatch.setattr(_cuda_read, "CUDA_READ_THREADS", 2)

    class FlakyMark(_LateCopies):
        marks = 0

        def mark(self) -> _Event:
            with self.lock:
                self.marks += 1
                if self.marks == 3:
                    raise RuntimeError("simulated: event record failed")
            return super().mark()

    data = os.urandom(12 * SLOT)
    path = tmp_path / "bytes"
    path.write_bytes(data)
    copies = FlakyMark()
    pool = _WatchedPool(copies, 2)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(RuntimeError, match="event record failed"):
            _cuda_read.read_cuda(
                fd, [ReadItem(0, torch.empty(len(data), dtype=torch.uint8))], HOST, pool=pool,
                transport=copies,
            )  # fmt: skip
    finally:
        os.close(fd)
    assert not _reader_threads() and pool.settled()


class _Interrupter(Interrupter):
    """``test_interrupts``' interrupter (``KeyboardInterrupt`` at the ``at``-th line torchplace
    runs in this thread), not in ``_run_shares``, the host reader's too: an interrupt injected at
    the first lines of its ``finally`` (before the ``try`` that waits for the threads) skips the
    wait, a window a real SIGINT does not seem to reach (CPython checks for signals at calls and
    backward jumps, not at those lines) but one this injection does."""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_name == "_run_shares":
            return None
        return super().__call__(frame, event, arg)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_ctrl_c_at_any_line_leaves_no_thread_and_no_slot_under_a_pending_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """An interrupt between any two lines the caller's thread runs (with one thread, that is
    every read, copy and give): the call ends with no reader thread left, and no slot is handed
    out again before the copies queued from it ran (a slot the interrupt kept from the pool is
    lost to it, which is safe)."""
    monkeypatch.setattr(_cuda_read, "CUDA_READ_THREADS", threads)
    case = _Case(tmp_path)
    fd = os.open(case.path, os.O_RDONLY)

    def once(at: int) -> tuple[_Interrupter, _LateCopies, _WatchedPool, list[torch.Tensor]]:
        copies = _LateCopies()
        pool = _WatchedPool(copies, 2)
        pieces, into = case.pieces()
        interrupter = _Interrupter(at)
        sys.settrace(interrupter)
        try:
            _cuda_read.read_cuda(fd, pieces, HOST, pool=pool, transport=copies)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        return interrupter, copies, pool, into

    try:
        clean, copies, _, into = once(0)
        copies.wait()
        assert all(_same_bits(o, e) for o, e in zip(into, case.expected(), strict=True))
        broken = []
        for at in range(1, clean.count + 1):
            _, copies, pool, _ = once(at)
            if _reader_threads():
                broken.append(f"{at}: a reader thread outlived the call")
            if not pool._lock.acquire(blocking=False):
                continue  # interrupted where a with block exits (CPython's limit): not ours
            pool._lock.release()
            free = list(pool._free)
            try:
                for _ in free:
                    pool.give(pool.take(SLOT), None)
            except AssertionError as e:
                broken.append(f"{at}: {e}")
    finally:
        os.close(fd)
    assert clean.count > 50
    assert not broken, broken[:5]


# --- CUDA --------------------------------------------------------------------------------------


@pytest.mark.requires_cuda
def test_cuda_threads_copy_on_the_callers_stream_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four threads, chunks of 64 KiB: direct, checked and converting pieces land bit for bit,
    and a kernel queued on the caller's (non-default) stream right after the read sees them
    all while the default stream is still busy: every thread queued its copies on the caller's
    stream, not on its own thread's default one."""
    monkeypatch.setattr(_cuda_read, "CUDA_READ_THREADS", 4)
    monkeypatch.setattr(_staging, "STAGE_CHUNK_BYTES", 64 << 10)
    gen = torch.Generator().manual_seed(0)
    direct = torch.randn(3 << 18, generator=gen)  # 3 MiB: 48 chunks
    converted = torch.randn(1 << 18, generator=gen)  # float32 in the file, bfloat16 on the GPU
    data = direct.numpy().tobytes() + converted.numpy().tobytes()
    path = tmp_path / "bytes"
    path.write_bytes(data)
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    fd = os.open(path, os.O_RDONLY)
    try:
        torch.cuda._sleep(200_000_000)  # type: ignore[attr-defined]  # the default stream: busy
        with torch.cuda.stream(side):
            a = torch.zeros(direct.shape, device=dev)
            b = torch.zeros(converted.shape, dtype=torch.bfloat16, device=dev)
            checks = {0: (zlib.crc32(direct.numpy().tobytes()), "direct")}
            pieces = [ReadItem(0, a), ReadItem(direct.nbytes, b, torch.float32)]
            failed = _cuda_read.read_cuda(fd, _checked(pieces, checks), dev)
            sums = torch.stack([a.double().sum(), b.double().sum()])
    finally:
        os.close(fd)
    torch.cuda.synchronize()
    assert failed == []
    expected = torch.stack([direct.double().sum(), converted.to(torch.bfloat16).double().sum()])
    torch.testing.assert_close(sums.cpu(), expected, rtol=1e-9, atol=1e-6)  # not zeros: landed
    assert torch.equal(a.cpu(), direct)
    assert torch.equal(b.cpu(), converted.to(torch.bfloat16))
    assert not _reader_threads()
