"""The parallel reader's threads: a failure stops them all, and none outlives the call."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

from test_interrupts import Interrupter, tracing
from torchplace.checkpoint import _host_read, _read_threads, _reader
from torchplace.checkpoint._entries import stamp
from torchplace.checkpoint._plan_items import ReadItem


@pytest.fixture
def four_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_host_read, "READ_THREADS", 4)
    monkeypatch.setattr(_host_read, "READ_CHUNK_BYTES", 4096)


def test_a_failing_thread_stops_the_others_and_none_outlives_the_read(
    tmp_path: Path, four_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(256 * 4096))
    reads: list[int] = []
    lock = threading.Lock()
    real, real_run = _host_read.pread_exactly, _host_read.read_in_threads
    run: list[tuple[int, threading.Event]] = []  # the read's thread count and its stop event

    def caught(share: Callable[[int, int], None], threads: int, stop: threading.Event) -> None:
        run.append((threads, stop))
        real_run(share, threads, stop)

    def failing_third(fd: int, view: memoryview, offset: int) -> None:
        with lock:
            reads.append(offset)
            count = len(reads)
        if count == 3:
            raise OSError("disk gone")
        # a read after the failing one waits until the failure has stopped the read (not a
        # while, which a busy machine may outlast): then each thread ends with this chunk
        if count > 3 and not run[0][1].wait(60):
            raise AssertionError("the failing read never stopped the others")
        real(fd, view, offset)

    monkeypatch.setattr(_host_read, "read_in_threads", caught)
    monkeypatch.setattr(_host_read, "pread_exactly", failing_third)
    before = {t.ident for t in threading.enumerate()}
    into = torch.empty(256 * 4096, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="disk gone"):
            _host_read.read_host(fd, [ReadItem(0, into)])
        after = len(reads)
        time.sleep(0.05)
        assert len(reads) == after  # no thread still reading once the call returned
    finally:
        os.close(fd)
    # the others stopped at their next chunk, not at the end: one chunk in hand each at most
    assert len(reads) <= 3 + run[0][0] < 256, (len(reads), run)
    leftover = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not [t for t in leftover if t.name.startswith("torchplace-read")]


def test_all_chunks_land_in_place_with_several_threads(tmp_path: Path, four_threads: None) -> None:
    data = os.urandom(37 * 4096 + 123)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    into = torch.empty(len(data) - 100, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        _host_read.read_host(fd, [ReadItem(100, into)])
    finally:
        os.close(fd)
    assert into.numpy().tobytes() == data[100:]


def test_out_of_memory_while_allocating_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model bigger than the target's memory: the error names the file, in the tree."""
    from safetensors.torch import save_file

    import torchplace
    from torchplace.checkpoint import _load

    path = tmp_path / "w.safetensors"
    save_file({"weight": torch.ones(4, 4)}, path)
    real = _load._allocated

    def no_memory(*args: object, **kwargs: object) -> object:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(_load, "_allocated", no_memory)
    with pytest.raises(torchplace.CheckpointError, match=r"w\.safetensors") as info:
        torchplace.load(path)
    assert info.value.path == path
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    model = torchplace.skeleton(torch.nn.Linear, 4, 4, bias=False)
    with pytest.raises(torchplace.CheckpointError, match=r"w\.safetensors") as e:
        torchplace.load_into(model, path)
    assert e.value.path == path
    assert model.weight.is_meta  # untouched
    monkeypatch.setattr(_load, "_allocated", real)
    assert torch.equal(torchplace.load(path)["weight"], torch.ones(4, 4))


@pytest.mark.parametrize(
    ("local_world", "cores", "threads"),
    [(None, 8, 4), ("1", 8, 4), ("2", 2, 1), ("2", 8, 4), ("4", 8, 2), ("16", 8, 1), ("x", 2, 4)],
)
def test_ranks_on_one_machine_share_its_cores(
    tmp_path: Path,
    four_threads: None,
    monkeypatch: pytest.MonkeyPatch,
    local_world: str | None,
    cores: int,
    threads: int,
) -> None:
    """Under torchrun each local rank reads with its share of the cores: two ranks of two
    threads each on two cores filled shards 25% more slowly than one thread each. A value of
    LOCAL_WORLD_SIZE that is not a number leaves the reader as it is, and every byte lands."""
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    monkeypatch.setattr(_read_threads, "CORES", cores)
    path = tmp_path / "data.bin"
    data = os.urandom(64 * 4096)
    path.write_bytes(data)
    seen: set[int] = set()
    real = _host_read.pread_exactly
    met = threading.Barrier(threads)  # each reader waits for the others at its first chunk

    def counted(fd: int, view: memoryview, offset: int) -> None:
        if threading.get_ident() not in seen:
            seen.add(threading.get_ident())
            with contextlib.suppress(threading.BrokenBarrierError):  # too few or too many
                met.wait(timeout=5)  # so a slow start on a busy machine still shows them all
        real(fd, view, offset)

    monkeypatch.setattr(_host_read, "pread_exactly", counted)
    out = torch.empty(len(data), dtype=torch.uint8)
    _reader.read_into(path, [ReadItem(0, out)])
    assert len(seen) == threads
    assert bytes(out.numpy()) == data


# --------------------------------------------------------------- descriptors under a Ctrl-C


class _Where(Interrupter):
    """``test_interrupts``' interrupter, saying where its interrupt was raised."""

    where = ""

    def local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and self.count + 1 == self.at:
            self.where = f"{frame.f_code.co_name}:{frame.f_lineno}"
        return super().local(frame, event, arg)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _leaks_at_each_line(run: Callable[[], None]) -> list[str]:
    """Run ``run`` once per line torchplace runs in it, with a ``KeyboardInterrupt`` raised at
    that line: where a descriptor was left open once the interrupt is caught and dropped."""
    counter = _Where()
    with tracing(counter):
        run()
    assert counter.count > 10  # the tracer saw the read
    leaks = []
    for at in range(1, counter.count + 1):
        before = _open_fds()
        interrupter = _Where(at)
        try:
            with tracing(interrupter):
                run()
        except KeyboardInterrupt:
            pass
        left = _open_fds() - before
        if left:
            leaks.append(f"{interrupter.where}: {len(left)} left open")
            for fd in left:  # so that one leak does not count again at the next line
                with contextlib.suppress(OSError):
                    os.close(int(fd))
    return leaks


def _two_files(tmp_path: Path) -> dict[Path, Any]:
    stamps = {}
    for name in ("a.bin", "b.bin"):
        path = tmp_path / name
        path.write_bytes(bytes(range(64)))
        stamps[path] = stamp(path)
    return stamps


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs Linux /proc")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_read_into_leaves_no_descriptor_open_wherever_a_ctrl_c_lands(tmp_path: Path) -> None:
    """Between opening the file and recording it, in ``close``, or where the ``with`` block of
    ``read_into`` calls ``__exit__`` (which such an interrupt skips)."""
    path, when = next(iter(_two_files(tmp_path).items()))
    out = torch.empty(16, dtype=torch.uint8)

    def run() -> None:
        _reader.read_into(path, [ReadItem(8, out)], when)

    assert not _leaks_at_each_line(run)
    assert out.tolist() == list(range(8, 24))


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs Linux /proc")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_open_files_of_several_shards_close_every_one_wherever_a_ctrl_c_lands(
    tmp_path: Path,
) -> None:
    """As the sharded loader uses them: several files open at once, closed in a ``finally``;
    an interrupt part-way through ``close`` still closes the rest."""
    stamps = _two_files(tmp_path)
    outs = [torch.empty(8, dtype=torch.uint8) for _ in stamps]

    def run() -> None:
        files = _reader.OpenFiles(stamps)
        try:
            for path, out in zip(stamps, outs, strict=True):
                files.read(path, [ReadItem(4, out)])
            files.verify()
        finally:
            files.close()

    assert not _leaks_at_each_line(run)
    assert all(out.tolist() == list(range(4, 12)) for out in outs)
