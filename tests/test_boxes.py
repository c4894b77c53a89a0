"""``_boxes``: a box of a catalog entry read into its destination, for the plain fill (each
entry one box, read whole) and the sharded fill (the box a rank holds) alike."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torchplace._errors import CheckpointError
from torchplace.checkpoint import _boxes, _sharded
from torchplace.checkpoint._catalog import catalog
from torchplace.checkpoint._load import read_assembled
from torchplace.checkpoint._plan_items import Assembled, Part


def _every_box(shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every box that halves or keeps each dim, plus a one-element one: all run patterns."""
    choices = [[(0, n), (0, n // 2), (n // 2, n - n // 2), (1, max(n - 2, 0))] for n in shape]
    found = []
    for picks in itertools.product(*choices):
        found.append((tuple(o for o, _ in picks), tuple(n for _, n in picks)))
    return found


@pytest.mark.parametrize("direct_run", [0, 1 << 40], ids=["runs-read-directly", "buffered"])
@pytest.mark.parametrize("buffer", [1 << 20, 64], ids=["big-buffer", "64-byte-buffer"])
def test_every_box_of_a_safetensors_tensor_reads_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_run: int, buffer: int
) -> None:
    monkeypatch.setattr(_boxes, "_DIRECT_RUN", direct_run)
    monkeypatch.setattr(_boxes, "_BUFFER", buffer)
    tensors = {
        "three": torch.randn(4, 5, 6),
        "matrix": torch.randn(7, 9).to(torch.bfloat16),
        "vector": torch.arange(11, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    entries = _sharded._file_entries(path)
    reader = _boxes.BoxReader()
    try:
        for name, full in tensors.items():
            for offsets, lengths in _every_box(tuple(full.shape)):
                dest = torch.full(lengths, -1, dtype=full.dtype)
                _boxes.fill_box(reader, entries[name], (offsets, lengths), dest)
                index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
                assert torch.equal(dest, full[index]), (name, offsets, lengths)
                # Into another dtype (the model's): converted as read, or through the buffer.
                wide = torch.zeros(lengths, dtype=torch.float64)
                _boxes.fill_box(reader, entries[name], (offsets, lengths), wide)
                assert torch.equal(wide, full[index].double()), (name, offsets, lengths)
    finally:
        reader.close()


def test_torch_zip_files_are_located_without_running_code(tmp_path: Path) -> None:
    """Offsets into shared storages and transposed views come back bit for bit."""
    base = torch.randn(10, 6)
    state = {
        "whole": base,
        "rows": base[3:7],  # a view at an offset into the same storage
        "transposed": torch.randn(6, 4).t(),  # saved with strides (1, 4)
        "half": torch.randn(5, 3).half(),
    }
    path = tmp_path / "m.pt"
    torch.save(state, path)
    entries = _sharded._file_entries(path)
    assert entries["rows"].start == entries["whole"].start + 3 * 6 * 4
    reader = _boxes.BoxReader()
    try:
        for name, full in state.items():
            for offsets, lengths in _every_box(tuple(full.shape)):
                dest = torch.empty(lengths, dtype=full.dtype)
                _boxes.fill_box(reader, entries[name], (offsets, lengths), dest)
                index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
                assert torch.equal(dest, full[index]), (name, offsets, lengths)
    finally:
        reader.close()


def test_a_run_into_another_dtype_is_converted_as_it_is_read(tmp_path: Path) -> None:
    """The model's dtype differs from the file's: the run is still read straight into the
    shard, converted a chunk at a time, without the reusable buffer and its copy."""
    full = torch.randn(8, 6).to(torch.bfloat16)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    found = catalog(tmp_path / "w.safetensors")
    reader = _boxes.BoxReader(found.stamps)
    try:
        dest = torch.empty(3, 6, dtype=torch.float32)
        _boxes.fill_box(reader, found.entries["w"], ((2, 0), (3, 6)), dest)
        assert torch.equal(dest, full[2:5].float())
        assert reader.buffer is None  # read directly, no bounce through the buffer
    finally:
        reader.close()


def test_a_plain_piece_across_a_later_dim_is_read_through_the_bounded_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces side by side along dim 1 (a fused projection): each is read a few rows at a time
    into the reusable buffer and copied into its columns, never as a whole buffer of its own."""
    parts = {f"e{i}": torch.randn(16, 3) for i in range(3)}
    save_file(parts, str(tmp_path / "e.safetensors"))
    found = catalog(tmp_path / "e.safetensors")
    monkeypatch.setattr(_boxes, "_BUFFER", 4 * 3 * 4)  # four rows of one piece
    blocks: list[int] = []
    real = _boxes.BoxReader.block

    def spy(
        reader: _boxes.BoxReader, p: Path, start: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        blocks.append(shape[0])
        return real(reader, p, start, dtype, shape)

    monkeypatch.setattr(_boxes.BoxReader, "block", spy)
    wide = Assembled(
        (16, 9), torch.float64, [Part(found.entries[f"e{i}"], (0, 3 * i)) for i in range(3)]
    )
    out = read_assembled(found, {"wide": wide}, torch.device("cpu"))
    expected = torch.cat([parts[f"e{i}"] for i in range(3)], dim=1).double()
    assert torch.equal(out["wide"], expected)
    assert blocks == [4] * 12  # three pieces of 16 rows, four rows at a time


@pytest.mark.parametrize("across", [False, True], ids=["read-directly", "through-the-buffer"])
def test_a_failed_read_names_the_file_it_failed_in(tmp_path: Path, across: bool) -> None:
    """Pieces from two files of an index; the second is cut short after its catalog was made:
    the error names that shard, not the index, whether its piece is read straight into its
    slice or (side by side along dim 1) through the buffer."""
    save_file({"a": torch.ones(16, 4)}, str(tmp_path / "a.safetensors"))
    save_file({"b": torch.ones(16, 4)}, str(tmp_path / "b.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "a.safetensors", "b": "b.safetensors"}}))
    found = catalog(index)
    b = (tmp_path / "b.safetensors").resolve()
    data = b.read_bytes()
    b.write_bytes(data[: len(data) - 128])  # its stamp left out below: nothing says it changed
    unstamped = dataclasses.replace(found, stamps={p: s for p, s in found.stamps.items() if p != b})
    if across:
        parts = [Part(unstamped.entries["a"], (0, 0)), Part(unstamped.entries["b"], (0, 4))]
        plan = {"ab": Assembled((16, 8), torch.float32, parts)}
    else:
        plan = {
            name: Assembled((16, 4), torch.float32, [Part(unstamped.entries[name], (0, 0))])
            for name in ("a", "b")
        }
    with pytest.raises(CheckpointError, match=r"b\.safetensors: cannot be read .*EOFError"):
        read_assembled(unstamped, plan, torch.device("cpu"))


@pytest.mark.requires_cuda
@pytest.mark.parametrize("direct_run", [0, 1 << 40], ids=["runs-read-directly", "buffered"])
def test_every_box_lands_on_cuda_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_run: int
) -> None:
    """A sharded fill onto CUDA: runs through the reader's pinned slots (converted on the
    device where the dtype differs), short runs through the host buffer and a copy."""
    monkeypatch.setattr(_boxes, "_DIRECT_RUN", direct_run)
    tensors = {"three": torch.randn(4, 5, 6), "matrix": torch.randn(7, 9).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    entries = _sharded._file_entries(tmp_path / "m.safetensors")
    reader = _boxes.BoxReader()
    try:
        for name, full in tensors.items():
            for offsets, lengths in _every_box(tuple(full.shape)):
                index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
                for dtype in (full.dtype, torch.float64):
                    dest = torch.full(lengths, -1, dtype=dtype, device="cuda")
                    _boxes.fill_box(reader, entries[name], (offsets, lengths), dest)
                    torch.cuda.synchronize()
                    assert torch.equal(dest.cpu(), full[index].to(dtype)), (name, offsets)
    finally:
        reader.close()


@pytest.mark.requires_cuda
def test_a_fused_tensor_is_assembled_on_cuda_bit_for_bit(tmp_path: Path) -> None:
    """Stacked pieces read straight onto the GPU, pieces side by side along dim 1 through the
    host buffer, a transposed piece through a temporary: all equal to the CPU's result."""
    parts = {f"e{i}": torch.randn(16, 3) for i in range(3)}
    save_file(parts, str(tmp_path / "e.safetensors"))
    found = catalog(tmp_path / "e.safetensors")
    plan = {
        "stacked": Assembled(
            (3, 16, 3), torch.bfloat16, [Part(found.entries[f"e{i}"], (i, 0, 0)) for i in range(3)]
        ),
        "wide": Assembled(
            (16, 9), torch.float32, [Part(found.entries[f"e{i}"], (0, 3 * i)) for i in range(3)]
        ),
    }
    on_gpu = read_assembled(found, plan, torch.device("cuda"))
    on_cpu = read_assembled(found, plan, torch.device("cpu"))
    torch.cuda.synchronize()
    for name, t in on_gpu.items():
        assert t.is_cuda and torch.equal(t.cpu(), on_cpu[name]), name
    torch.save({"t": torch.randn(3, 4).t()}, tmp_path / "t.pt")
    zipped = catalog(tmp_path / "t.pt")
    (entry,) = zipped.entries.values()
    plan = {"t": Assembled((4, 3), torch.float32, [Part(entry, (0, 0))])}
    got = read_assembled(zipped, plan, torch.device("cuda"))
    assert torch.equal(got["t"].cpu(), read_assembled(zipped, plan, torch.device("cpu"))["t"])
