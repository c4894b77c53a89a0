"""The parallel reader's threads: a failure stops them all, and none outlives the call."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from torchplace.checkpoint import _reader


@pytest.fixture
def four_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_reader, "READ_THREADS", 4)
    monkeypatch.setattr(_reader, "READ_CHUNK_BYTES", 4096)


def test_a_failing_thread_stops_the_others_and_none_outlives_the_read(
    tmp_path: Path, four_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(256 * 4096))
    reads: list[int] = []
    lock = threading.Lock()
    real = _reader._pread_exactly

    def slow(fd: int, view: memoryview, offset: int) -> None:
        with lock:
            reads.append(offset)
            count = len(reads)
        if count == 3:
            raise OSError("disk gone")
        time.sleep(0.002)
        real(fd, view, offset)

    monkeypatch.setattr(_reader, "_pread_exactly", slow)
    before = {t.ident for t in threading.enumerate()}
    into = torch.empty(256 * 4096, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="disk gone"):
            _reader._read_host(fd, [(0, into)])
        after = len(reads)
        time.sleep(0.05)
        assert len(reads) == after  # no thread still reading once the call returned
    finally:
        os.close(fd)
    assert len(reads) < 256 // 2  # the others stopped at their next chunk, not at the end
    leftover = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not [t for t in leftover if t.name.startswith("torchplace-read")]


def test_all_chunks_land_in_place_with_several_threads(tmp_path: Path, four_threads: None) -> None:
    data = os.urandom(37 * 4096 + 123)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    into = torch.empty(len(data) - 100, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        _reader._read_host(fd, [(100, into)])
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
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    model = torchplace.skeleton(torch.nn.Linear, 4, 4, bias=False)
    with pytest.raises(torchplace.CheckpointError, match=r"w\.safetensors"):
        torchplace.load_into(model, path)
    assert model.weight.is_meta  # untouched
    monkeypatch.setattr(_load, "_allocated", real)
    assert torch.equal(torchplace.load(path)["weight"], torch.ones(4, 4))
