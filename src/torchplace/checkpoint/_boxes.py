"""A box of a catalog entry read into a destination: how a plan's parts become the reader's reads.

``queue_box(reader, entry, box, dest)`` reads the box ``box`` (offsets and lengths per dim) of
``entry`` into ``dest``. A box that is one run of the file (the whole entry, or a slice of its
leading dim) is queued as one ``ReadItem`` straight into ``dest``; a box of long runs (a
``Shard(1)`` slice of a big row-major matrix) is queued run by run; one of short runs is read as
whole rows into a reusable host buffer of at most 16 MiB and copied out of it; a box of an
entry saved as a permuted view (a transposed weight) is read whole into a temporary and laid out
by a copy. A run lands straight in ``dest`` where the reader reaches its memory (the CPU's, or
CUDA's through its pinned pool), in the file's dtype converted a chunk at a time where ``dest``'s
differs. Queued runs are read side by side at the reader's next ``flush``, through ``_reader``'s
``OpenFiles`` (its pool of threads, each file's stamp checked when it is opened and by
``verify`` after the reads): every file's runs in one call for the sharded fill, file by file
for the plain one, whose errors name the file.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch

from ._catalog import contiguous_strides
from ._entries import Entry, Stamp
from ._plan_items import Box, ReadItem
from ._reader import OpenFiles

__all__ = ["BoxReader", "entry_dtype", "fill_box", "queue_box"]

_BUFFER = 16 * 1024 * 1024  # the most a non-contiguous slice reads ahead of its copy
_DIRECT_RUN = 256 * 1024  # runs at least this long are read straight into the destination


def entry_dtype(e: Entry) -> torch.dtype:
    """The ``torch.dtype`` of an entry a fill let through (``_sharded._sharded_entries``,
    ``_load._allocated``: this torch holds it)."""
    return cast(torch.dtype, getattr(torch, e.dtype))


def _refuse_freed(t: torch.Tensor) -> None:
    """Refuse a tensor whose storage cannot hold it: one FSDP2 freed (resized to 0), where a
    read would write past the memory and crash the process."""
    n = t.numel() * t.element_size()
    held = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    if n > held:
        raise RuntimeError(f"a tensor of {n} bytes has only {held} bytes of storage")


class BoxReader:
    """One load's reads, through the one reader's ``OpenFiles`` (each file checked against its
    catalogued stamp when opened and by ``verify`` after the reads).

    Runs of the file that land straight in their destination are queued and read side by side
    at the next ``flush``; a box of short runs is read as whole rows into a reusable buffer
    (``block``) and copied out of it. ``fresh``: the destinations' memory is new (populated as
    it is read, as ``read_into`` takes it); ``threads``: at most this many threads read into
    host memory. ``together``: a flush reads every file's runs in one call (the sharded fill:
    one set-up for all files); else file by file, so that ``at`` names the file whose read
    failed (the plain fill's errors name it).
    """

    def __init__(
        self,
        stamps: Mapping[Path, Stamp] | None = None,
        *,
        fresh: bool = True,
        threads: int | None = None,
        together: bool = True,
    ) -> None:
        self.files = OpenFiles(stamps)
        self.buffer: torch.Tensor | None = None
        self.pending: dict[Path, list[ReadItem]] = {}  # queued direct reads
        self.fresh = fresh
        self.threads = threads
        self.together = together
        self.at: Path | None = None  # the file being read, while one alone is

    def queue(self, p: Path, start: int, out: torch.Tensor, stored: torch.dtype) -> None:
        """Read ``out.numel()`` elements of ``stored`` from byte ``start`` of ``p`` into ``out``
        (converted into its dtype a chunk at a time where it differs) at the next ``flush``."""
        self.pending.setdefault(p, []).append(ReadItem(start, out, stored))

    def flush(self) -> None:
        """Every queued range read, side by side by the reader's pool."""
        pending, self.pending = self.pending, {}
        if self.together:
            self.files.read_files(pending, fresh=self.fresh, threads=self.threads)
            return
        for p, items in pending.items():
            self.at = p
            self.files.read(p, items, fresh=self.fresh, threads=self.threads)
        self.at = None

    def verify(self) -> None:
        """Every file read is still the one catalogued (``CheckpointError`` if not)."""
        self.files.verify()

    def close(self) -> None:
        self.files.close()

    def block(
        self, p: Path, start: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """``shape`` elements of ``dtype`` from byte ``start``, in the reusable buffer."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = torch.empty(max(nbytes, 0), dtype=torch.uint8)
        raw = self.buffer[:nbytes]
        self.at = p
        self.files.read(p, [ReadItem(start, raw)], False, self.threads)
        self.at = None
        return raw.view(dtype).view(shape)


def _read_box(
    reader: BoxReader,
    entry: Entry,
    start: int,
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    dest: torch.Tensor,
) -> None:
    """Copy the box ``offsets``/``lengths`` of a row-major tensor at ``start`` into ``dest``."""
    assert entry.file is not None
    if 0 in lengths or 0 in shape:
        return
    dtype = entry_dtype(entry)
    itemsize = dtype.itemsize
    nd = len(shape)
    partial = [d for d in range(nd) if lengths[d] != shape[d]]
    last = partial[-1] if partial else -1
    inner = math.prod(shape[last + 1 :])
    run = (lengths[last] if last >= 0 else 1) * inner  # elements in one contiguous run
    # Read straight in (in the file's dtype, converted a chunk at a time where the destination's
    # differs): memory the reader reaches (the CPU's, or CUDA's through its pinned pool) laid out
    # as one run. Any other goes through the buffer below and a copy.
    direct = dest.is_contiguous() and (dest.is_cpu or dest.device.type == "cuda")
    if direct and last <= 0 and dest.numel() == run:  # one run: whole, or a slice of dim 0
        _refuse_freed(dest)  # before anything is read into it
        first = offsets[0] * inner if last == 0 else 0
        reader.queue(entry.file, start + first * itemsize, dest, dtype)
        return
    if direct and run * itemsize >= _DIRECT_RUN:
        strides = contiguous_strides(shape)
        _refuse_freed(dest)  # before anything is read into it
        flat = dest.detach().reshape(-1)
        outer = itertools.product(
            *(range(offsets[d], offsets[d] + lengths[d]) for d in range(last))
        )
        tail = offsets[last] * strides[last] if last >= 0 else 0
        for n, index in enumerate(outer):
            element = sum(i * s for i, s in zip(index, strides, strict=False)) + tail
            part = flat[n * run : (n + 1) * run]
            reader.queue(entry.file, start + element * itemsize, part, dtype)
        return
    if nd == 0:
        dest.copy_(reader.block(entry.file, start, dtype, ()))
        return
    slab = math.prod(shape[1:]) * itemsize  # bytes of one index of dim 0
    if slab > _BUFFER and nd > 1:
        for r in range(lengths[0]):
            where = start + (offsets[0] + r) * slab
            _read_box(reader, entry, where, shape[1:], offsets[1:], lengths[1:], dest[r])
        return
    rows = max(1, _BUFFER // max(slab, 1))
    inside = (
        slice(None),
        *(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:], strict=True)),
    )
    for r0 in range(0, lengths[0], rows):
        n = min(rows, lengths[0] - r0)
        block = reader.block(entry.file, start + (offsets[0] + r0) * slab, dtype, (n, *shape[1:]))
        dest[r0 : r0 + n].copy_(block[inside])


def fill_box(reader: BoxReader, entry: Entry, box: Box, dest: torch.Tensor) -> None:
    """``box`` of ``entry`` into ``dest``, all read when this returns (``queue_box``, flushed)."""
    queue_box(reader, entry, box, dest)
    reader.flush()


def queue_box(reader: BoxReader, entry: Entry, box: Box, dest: torch.Tensor) -> None:
    """``box`` of ``entry`` into ``dest``: runs of the file that land straight in it queued for
    the reader's next ``flush`` (``_read_plan`` flushes once, after every box: a read call per
    tensor cost 0.2 ms of its own, 10-20% of a 256 MiB model's fill on 2 ranks), others read
    now through the reader's buffer."""
    try:
        _box_into(reader, entry, box, dest)
    except BaseException:
        reader.pending.clear()  # a failure or Ctrl-C: nothing more is read, its error stands
        raise


def _box_into(reader: BoxReader, entry: Entry, box: Box, dest: torch.Tensor) -> None:
    offsets, lengths = box
    if entry.tensor is not None:
        index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
        dest.copy_(entry.tensor[index])
        return
    order = entry.order
    assert order is not None  # addressable: _sharded_entries and _load._allocated refuse others
    if order == tuple(range(len(order))):
        _read_box(reader, entry, entry.start, entry.shape, offsets, lengths, dest)
        return
    # Saved as a permuted view (a transposed weight): the file holds the permuted tensor
    # row-major, so read the permuted box and lay it out as the model's.
    shape = tuple(entry.shape[d] for d in order)
    permuted = torch.empty(tuple(lengths[d] for d in order), dtype=dest.dtype, device=dest.device)
    _read_box(
        reader,
        entry,
        entry.start,
        shape,
        tuple(offsets[d] for d in order),
        tuple(lengths[d] for d in order),
        permuted,
    )
    reader.flush()  # the permuted box is read before it is laid out
    inverse = sorted(range(len(order)), key=lambda d: order[d])
    dest.copy_(permuted.permute(inverse))
