"""Large pageable host tensors reach a CUDA device (and come back) through a ring of pinned
buffers taken from a bounded pool; the ring's logic is driven on the CPU by a transport that
performs its copies late, as a DMA engine does."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import torchplace
from torchplace.moving import _staging, _transfer
from torchplace.moving._staging import (
    STAGE_MIN_BYTES,
    PinnedPool,
    Slot,
    Stager,
    stageable,
    stageable_back,
)

CUDA = torch.device("cuda", 0)
META = torch.device("meta")


def big(**kwargs: object) -> torch.Tensor:
    return torch.empty(STAGE_MIN_BYTES // 4, **kwargs)  # type: ignore[call-overload]


def test_stageable_takes_only_large_plain_contiguous_host_tensors_for_cuda() -> None:
    assert stageable(big(), CUDA)
    assert not stageable(big(), torch.device("cpu"))
    assert not stageable(big(), META)
    assert not stageable(torch.empty(STAGE_MIN_BYTES // 4 - 1), CUDA)  # small: one copy
    assert not stageable(big().reshape(2, -1).t(), CUDA)  # not contiguous
    assert not stageable(big(dtype=torch.complex64).conj(), CUDA)  # a lazy conjugate
    assert not stageable(big().to_sparse(), CUDA)


def test_stageable_leaves_autograd_to_tensor_to() -> None:
    leaf = big(requires_grad=True)
    assert not stageable(leaf, CUDA)  # .to() records the copy in the graph
    with torch.no_grad():
        assert stageable(leaf, CUDA)  # module moves run without autograd
    assert stageable(nn.Parameter(big()).detach(), CUDA)


class _FakeStager:
    """Stands in for ``Stager`` on a machine without CUDA: copies to meta and records calls."""

    made: list[_FakeStager] = []  # noqa: RUF012

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copied: list[torch.Tensor] = []
        self.synced = 0
        _FakeStager.made.append(self)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        self.copied.append(t)
        return t.detach().to(self.device)

    def synchronize(self) -> None:
        self.synced += 1

    def finish(self) -> None:
        self.finished += 1

    def abandon(self) -> None:
        self.abandoned += 1

    finished = 0
    abandoned = 0


@pytest.fixture
def fake_stager(monkeypatch: pytest.MonkeyPatch) -> type[_FakeStager]:
    _FakeStager.made = []
    monkeypatch.setattr(_transfer, "Stager", _FakeStager)
    monkeypatch.setattr(_transfer, "stageable", lambda t, target: t.numel() * 4 >= STAGE_MIN_BYTES)
    return _FakeStager


@pytest.mark.parametrize(("non_blocking", "syncs"), [(None, 0), (True, 0), (False, 1)])
def test_move_sends_large_tensors_through_one_stager(
    fake_stager: type[_FakeStager], non_blocking: bool | None, syncs: int
) -> None:
    """The wiring, with meta standing in for CUDA: one ring per move, waited on only if asked."""
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 4))
    weight = model[0].weight
    torchplace.move(model, "meta", non_blocking=non_blocking)
    (stager,) = fake_stager.made
    assert [t is weight for t in stager.copied] == [True]  # the only large tensor
    assert model[0].weight.device == META  # (to meta the parameter is replaced, by design)
    assert stager.synced == syncs
    assert stager.finished == 1 - syncs  # the current stream is ordered after the ring
    assert stager.abandoned == 0


def test_a_failed_move_waits_for_the_ring_before_dropping_its_copies(
    fake_stager: type[_FakeStager], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies the ring still writes into must not go back to the allocator: ``abandon`` first."""
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 4))

    def failing(t: torch.Tensor, target: torch.device, non_blocking: bool) -> torch.Tensor:
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(_transfer, "copy_tensor", failing)  # the small bias after the weight
    with pytest.raises(torchplace.MoveError, match=r"0\.bias"):
        torchplace.move(model, "meta")
    (stager,) = fake_stager.made
    assert len(stager.copied) == 1 and stager.abandoned == 1 and stager.finished == 0
    assert model[0].weight.device.type == "cpu"  # nothing was moved


def test_stageable_back_takes_only_large_plain_device_tensors_for_the_host() -> None:
    meta_big = torch.empty(STAGE_MIN_BYTES // 4, device="meta")
    assert not stageable_back(meta_big, torch.device("cpu"))  # not on CUDA
    assert not stageable_back(big(), torch.device("cpu"))  # already on the host


# --- the pool -----------------------------------------------------------------------------------


class _Event:
    """An event that runs the copies queued before it when waited for (see ``_LateTransport``)."""

    def __init__(self, transport: _LateTransport, upto: int) -> None:
        self.transport = transport
        self.upto = upto
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1
        self.transport.run(self.upto)

    def query(self) -> bool:
        return self.transport.done >= self.upto


def host_pool(limit: int = 3 * 64, slot: int = 64, **kwargs: object) -> PinnedPool:
    """A pool of ordinary host memory: the pool's logic is the same for pinned memory."""
    made: list[int] = []

    def allocate(n: int) -> torch.Tensor:
        made.append(n)
        return torch.full((n,), 0xEE, dtype=torch.uint8)

    pool = PinnedPool(limit, slot, allocate=allocate, **kwargs)  # type: ignore[arg-type]
    pool.made = made  # type: ignore[attr-defined]
    return pool


def test_pool_hands_out_idle_slots_first_and_waits_only_when_full() -> None:
    pool = host_pool(limit=2 * 64)
    transport = _LateTransport()
    a, b = pool.take(64), pool.take(10)
    assert a.kept and b.kept and pool.kept_bytes == 128 and pool.allocations == 2
    transport.copy(torch.empty(4, dtype=torch.uint8), a.buffer[:4])
    event_a = transport.mark()
    pool.give(a, event_a)  # a's transfer is still pending
    pool.give(b, None)
    assert pool.take(64) is b and event_a.waited == 0  # the idle one, without waiting
    assert pool.take(64) is a and event_a.waited == 1 and not transport.queue  # full: waits
    assert pool.allocations == 2  # a warm pool allocates nothing


def test_pool_is_bounded_and_hands_out_buffers_of_their_own_beyond_it() -> None:
    pool = host_pool(limit=2 * 64)
    slots = [pool.take(64) for _ in range(3)]
    assert [s.kept for s in slots] == [True, True, False] and pool.kept_bytes == 128
    large = pool.take(1000)  # larger than a slot: its own buffer, never kept
    assert not large.kept and large.buffer.numel() == 1000
    for slot in (*slots, large):
        pool.give(slot, None)
    assert pool.kept_bytes == 128 and len(pool._free) == 2


def test_pool_release_frees_idle_slots_after_their_transfer() -> None:
    pool = host_pool()
    transport = _LateTransport()
    slot = pool.take(64)
    transport.copy(torch.empty(8, dtype=torch.uint8), slot.buffer[:8])
    event = transport.mark()
    pool.give(slot, event)
    assert pool.release() == 64 and event.waited == 1 and pool.kept_bytes == 0
    assert pool.release() == 0
    assert pool.take(64) is not slot and pool.allocations == 2  # pins again when needed


def test_pool_keeps_nothing_when_the_host_runs_low(monkeypatch: pytest.MonkeyPatch) -> None:
    available = [1 << 40]
    pool = host_pool(available=lambda: available[0])
    kept = pool.take(64)
    pool.give(kept, None)
    available[0] = 1 << 20  # a MiB left: memory pressure
    refused = pool.take(32)  # the idle slot is reused; growing is refused
    assert refused is kept
    beyond = pool.take(32)
    assert not beyond.kept and pool.kept_bytes == 64
    monkeypatch.setattr(pool, "_checked", -1e9)  # the next give reads the host's memory
    pool.give(refused, None)
    assert pool.kept_bytes == 0 and not pool._free  # released under pressure


def test_pool_releases_and_retries_when_pinning_fails() -> None:
    calls: list[int] = []

    def allocate(n: int) -> torch.Tensor:
        calls.append(n)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return torch.empty(n, dtype=torch.uint8)

    pool = PinnedPool(128, 64, allocate=allocate)
    first = pool.take(64)
    pool.give(first, None)
    pool.take(64)  # reuses first
    second = pool.take(64)  # pinning fails once: the idle slots go, then it succeeds
    assert len(calls) == 3 and second.kept and pool.kept_bytes == 128


def test_pool_gives_consistent_accounts_across_threads() -> None:
    pool = host_pool(limit=4 * 64)

    def work() -> None:
        for _ in range(200):
            slot = pool.take(48)
            pool.give(slot, None)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.kept_bytes == 64 * len(pool._free) <= 4 * 64


def test_the_process_pool_is_released_on_request() -> None:
    from torchplace.moving import release_pinned_memory

    pool = _staging.pinned_pool()
    assert _staging.pinned_pool() is pool
    assert release_pinned_memory() >= 0 and pool.kept_bytes == 0


# --- the ring, on the CPU ------------------------------------------------------------------------


class _LateTransport:
    """Queues copies and performs them only when an event after them is waited for (or at
    ``finish``/``wait``), as an asynchronous copy engine may: a ring that refilled a slot
    before its transfer ran would send the wrong bytes, and the values would show it. Several
    threads may queue onto it at once (the reader's do), as onto one CUDA stream."""

    def __init__(self) -> None:
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done = 0  # copies performed so far
        self.log: list[str] = []
        self.lock = threading.RLock()

    def run(self, upto: int) -> None:
        with self.lock:
            while self.done < upto:
                dst, src = self.queue.pop(0)
                dst.copy_(src)
                self.done += 1

    def begin(self) -> None:
        self.log.append("begin")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self.lock:
            self.queue.append((dst, src))
            self.log.append("copy")

    def mark(self) -> _Event:
        with self.lock:
            return _Event(self, self.done + len(self.queue))

    def finish(self) -> None:
        with self.lock:
            self.log.append("finish")
            self.run(self.done + len(self.queue))

    def wait(self) -> None:
        with self.lock:
            self.log.append("wait")
            self.run(self.done + len(self.queue))


def ring(pool: PinnedPool, transport: _LateTransport) -> Stager:
    stager = Stager(torch.device("cpu"), transport=transport, pool=pool)
    return stager


def sources(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in (64 * 7 + 24, 64, 64 * 3, 8):  # bytes: partial chunks, exact ones, a tiny one
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        out.append(raw.view(dtype) if dtype != torch.bool else raw.bool())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64])
def test_ring_to_the_device_sends_every_byte_even_when_transfers_run_late(
    dtype: torch.dtype,
) -> None:
    pool, transport = host_pool(), _LateTransport()
    stager = ring(pool, transport)
    tensors = sources(dtype)
    expected = [t.clone() for t in tensors]
    out = [stager.copy(t) for t in tensors]
    for t in tensors:
        t.zero_()  # the host tensors may change as soon as copy returns
    assert transport.queue  # transfers still pending: the ring ran ahead of them
    stager.finish()
    for o, e in zip(out, expected, strict=True):
        assert o.dtype == e.dtype and o.shape == e.shape
        assert torch.equal(o.view(torch.uint8), e.view(torch.uint8))
    assert pool.allocations == 3 and pool.kept_bytes == 3 * 64  # bounded: 3 slots reused
    assert transport.log.count("begin") == len(tensors) and transport.log[-1] == "finish"


def test_ring_keeps_every_slot_in_flight_before_it_waits_for_one() -> None:
    """Overlap by construction: the host waits only when every slot of the pool is in flight,
    and then only for the oldest transfer; never for one it has just queued."""
    pool, transport = host_pool(limit=3 * 64), _LateTransport()
    stager = ring(pool, transport)
    stager.copy(torch.zeros(3 * 64, dtype=torch.uint8))  # three chunks: three slots
    assert len(transport.queue) == 3 and transport.done == 0  # nothing waited for
    stager.copy(torch.zeros(64, dtype=torch.uint8))  # a fourth: the oldest slot, once it is done
    assert transport.done == 1 and len(transport.queue) == 3
    assert [s.event.waited for s in pool._free] == [0, 0, 0]  # the waited slot went out again


def test_ring_reuses_the_pool_across_moves() -> None:
    """The first move pins its slots; the next ones allocate no pinned memory at all."""
    pool = host_pool()
    for _ in range(3):
        transport = _LateTransport()
        stager = ring(pool, transport)
        out = stager.copy(torch.arange(100.0))
        stager.synchronize()
        assert torch.equal(out, torch.arange(100.0)) and transport.log[-2:] == ["finish", "wait"]
    assert pool.allocations == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8])
def test_ring_back_to_the_host_is_complete_and_pageable(dtype: torch.dtype) -> None:
    pool, transport = host_pool(), _LateTransport()
    stager = ring(pool, transport)
    stager.depth = 2
    for t in sources(dtype):
        back = stager.copy_back(t)
        assert not transport.queue  # every transfer waited for: the result is complete
        assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))
        assert back.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert pool.kept_bytes == 2 * 64 and len(pool._free) == 2  # depth 2: two slots, given back


def test_ring_back_gives_its_slots_back_after_a_failure() -> None:
    pool = host_pool()

    class Failing(_LateTransport):
        def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
            if len(self.queue) == 2:
                raise RuntimeError("simulated")
            super().copy(dst, src)

    stager = ring(pool, Failing())
    with pytest.raises(RuntimeError, match="simulated"):
        stager.copy_back(torch.arange(100.0))
    assert len(pool._free) == pool.kept_bytes // 64  # none lost


def test_slot_starts_without_an_event() -> None:
    assert Slot(torch.empty(1), kept=True).event is None


# --- CUDA ---------------------------------------------------------------------------------


@pytest.fixture
def small_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 64 KiB in a ring of 3: a few tensors wrap around it many times."""
    monkeypatch.setattr(_staging, "STAGE_MIN_BYTES", 64 << 10)
    monkeypatch.setattr(_staging, "STAGE_CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(_staging, "STAGE_BUFFERS", 3)


@pytest.mark.requires_cuda
@pytest.mark.usefixtures("small_ring")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex64])
def test_cuda_staged_copies_are_bit_identical(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = [(300 << 10) + 5, 64 << 10, (1 << 20) + 3]  # bytes: partial last chunks
    sources = []
    for n in sizes:
        raw = torch.randint(0, 256, (n - n % 8,), dtype=torch.uint8, generator=gen)
        sources.append(raw.view(dtype) if dtype != torch.bool else raw.bool())
    stager = Stager(CUDA)
    out = [stager.copy(t) for t in sources]
    expected = [t.clone() for t in sources]
    for t in sources:
        t.zero_()  # the host tensors may change as soon as copy returns
    torch.cuda.synchronize()
    for o, e in zip(out, expected, strict=True):
        assert o.device == CUDA and o.dtype == e.dtype and o.shape == e.shape
        assert torch.equal(o.cpu().view(torch.uint8), e.view(torch.uint8))


@pytest.mark.requires_cuda
@pytest.mark.usefixtures("small_ring")
@pytest.mark.parametrize("non_blocking", [None, False])
def test_cuda_staged_model_move_keeps_identity_and_values(non_blocking: bool | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    state = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    torchplace.move(model, "cuda:0", optimizer=opt, non_blocking=non_blocking)
    if non_blocking is False:
        assert torch.cuda.current_stream().query()  # every staged copy done on return
    torchplace.verify(model, "cuda:0", optimizer=opt)
    assert list(model.parameters()) == params
    for p, b, s in zip(params, before, state, strict=True):
        assert torch.equal(p.cpu(), b)
        assert torch.equal(opt.state[p]["exp_avg_sq"].cpu(), s)


@pytest.mark.requires_cuda
def test_cuda_staged_batch_with_grad_keeps_its_graph() -> None:
    leaf = torch.randn(STAGE_MIN_BYTES // 4, requires_grad=True)
    out = torchplace.move({"x": leaf}, "cuda:0")["x"]
    assert out.grad_fn is not None  # copied by .to(), so gradients flow back to the host leaf
    out.sum().backward()
    assert leaf.grad is not None and leaf.grad.device.type == "cpu"


@pytest.mark.requires_cuda
@pytest.mark.usefixtures("small_ring")
def test_cuda_results_are_ordered_on_the_current_stream_without_a_host_wait() -> None:
    """``finish``: a kernel queued right after the move reads the complete values, although the
    transfers ran on the ring's own stream."""
    sources = [torch.randn(1 << 18) for _ in range(6)]  # 1 MiB each, 16 chunks each
    model = nn.ParameterList([nn.Parameter(t.clone()) for t in sources])
    torchplace.move(model, "cuda:0")
    sums = torch.stack([p.detach().double().sum() for p in model])  # on the current stream
    expected = torch.stack([t.double().sum() for t in sources])
    assert torch.equal(sums.cpu(), expected)


@pytest.mark.requires_cuda
@pytest.mark.usefixtures("small_ring")
def test_cuda_way_back_waits_for_work_queued_before_the_move() -> None:
    """``begin``: the ring's stream reads a tensor only after the current stream's pending
    kernels that write it, and the host result is complete when ``move`` returns."""
    model = nn.Linear(512, 512).to("cuda:0")  # a 1 MiB weight: through the ring
    with torch.no_grad():
        torch.cuda._sleep(20_000_000)  # type: ignore[attr-defined]  # the stream is busy ...
        model.weight.fill_(3.0)  # ... then writes the weight
    opt = torch.optim.Adam(model.parameters())
    torchplace.move(model, "cpu", optimizer=opt)
    assert model.weight.device.type == "cpu" and not model.weight.is_pinned()
    assert torch.equal(model.weight.detach(), torch.full((512, 512), 3.0))


@pytest.mark.requires_cuda
def test_cuda_model_round_trip_through_the_ring_is_bit_identical() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 8))  # 4 MiB weight
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    torchplace.move(model, "cuda:0", optimizer=opt)
    torchplace.move(model, "cpu", optimizer=opt)
    torchplace.verify(model, "cpu", optimizer=opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p, s in zip(model.parameters(), state, strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], s)


@pytest.mark.requires_cuda
def test_cuda_later_moves_pin_no_memory() -> None:
    """The pool: the first move pins its slots, later moves reuse them; release gives them back."""
    model = nn.Linear(2048, 2048)  # 16 MiB weight: staged
    torchplace.move(model, "cuda:0")
    torchplace.move(model, "cpu")
    pool = _staging.pinned_pool()
    made = pool.allocations
    for _ in range(3):
        torchplace.move(model, "cuda:0")
        torchplace.move(model, "cpu")
    kept = pool.kept_bytes
    assert pool.allocations == made and 0 < kept <= pool.limit
    from torchplace.moving import release_pinned_memory

    assert release_pinned_memory() == kept and pool.kept_bytes == 0


# --- reads onto a device take their slots from the same pool -----------------------------------


def _file_of(tmp_path: object, data: bytes) -> int:
    import os
    from pathlib import Path

    path = Path(str(tmp_path)) / "bytes"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


def test_reads_onto_a_device_go_through_the_pool_even_when_copies_run_late(
    tmp_path: object,
) -> None:
    """``_cuda_read.read_cuda``'s logic on the CPU: every chunk read into a slot of the pool and
    sent on by the transport, a slot taken again only once its copy ran (the values would show
    a refill before it), a converting piece converted by the copy, the pool never beyond its
    bound, and a second read pins nothing new."""
    import os
    import zlib

    from torchplace.checkpoint._cuda_read import read_cuda
    from torchplace.checkpoint._plan_items import ReadItem

    gen = torch.Generator().manual_seed(0)
    direct = torch.randn(86, generator=gen)  # 344 bytes: five full slots of 64 and a part
    converted = torch.randn(40, generator=gen)  # read from float32 into bfloat16
    data = direct.numpy().tobytes() + converted.numpy().tobytes()
    fd = _file_of(tmp_path, data)
    try:
        pool, transport = host_pool(limit=2 * 64), _LateTransport()
        for _ in range(2):
            a = torch.empty(86)
            b = torch.empty(40, dtype=torch.bfloat16)
            check = (zlib.crc32(direct.numpy().tobytes()), "direct")
            items = [ReadItem(0, a, None, check), ReadItem(direct.nbytes, b, torch.float32)]
            failed = read_cuda(fd, items, torch.device("cpu"), pool=pool, transport=transport)
            transport.wait()  # what the device's stream does before the tensors are used
            assert failed == []
            assert torch.equal(a, direct) and torch.equal(b, converted.to(torch.bfloat16))
            assert pool.allocations == 2 and pool.kept_bytes == 2 * 64  # bounded, then reused
        bad = ReadItem(0, torch.empty(86), None, (zlib.crc32(b"other"), "direct"))
        assert read_cuda(fd, [bad], torch.device("cpu"), pool=pool, transport=transport) == [
            "direct"
        ]
    finally:
        os.close(fd)


def test_a_read_that_fails_gives_its_slot_back(tmp_path: object) -> None:
    import os

    from torchplace.checkpoint._cuda_read import read_cuda
    from torchplace.checkpoint._plan_items import ReadItem

    fd = _file_of(tmp_path, bytes(100))
    try:
        pool, transport = host_pool(limit=2 * 64), _LateTransport()
        with pytest.raises(EOFError):
            read_cuda(
                fd,
                [ReadItem(0, torch.empty(64))],
                torch.device("cpu"),
                pool=pool,
                transport=transport,
            )
        transport.wait()
        assert len(pool._free) == pool.kept_bytes // 64 == pool.allocations  # none left taken
    finally:
        os.close(fd)


@pytest.mark.requires_cuda
def test_cuda_loads_and_moves_share_one_pool(tmp_path: object) -> None:
    """A load onto the GPU takes its pinned slots from the pool a move filled: it pins nothing."""
    from pathlib import Path

    model = nn.Linear(2048, 2048)  # 16 MiB weight: staged
    torchplace.move(model, "cuda:0")
    torchplace.move(model, "cpu")
    pool = _staging.pinned_pool()
    assert pool.allocations > 0  # the move pinned its slots in the shared pool
    # A load's threads take as many slots at once as the pool holds, more than this move
    # needed; fill the pool to its limit, as a larger move would, so the load must reuse.
    slots = [pool.take(pool.slot_bytes) for _ in range(pool.limit // pool.slot_bytes)]
    for slot in slots:
        pool.give(slot, None)
    assert pool.kept_bytes == pool.limit
    made = pool.allocations
    path = Path(str(tmp_path)) / "w.pt"
    torch.save(model.state_dict(), path)
    loaded = torchplace.load(path, "cuda:0")
    assert torch.equal(loaded["weight"].cpu(), model.weight.detach())
    assert pool.allocations == made and 0 < pool.kept_bytes <= pool.limit
