"""The one vocabulary of a read plan, shared by ``load``, the plain fill and the sharded fill.

A fill plans from the catalog which part of which entry lands where (``Part`` and ``Assembled``: a
model tensor built from whole entries at offsets; ``Box``: a part of a tensor as offsets and
lengths per dim, what a rank of a sharded model holds), then hands the reader ``ReadItem``s,
grouped by file: which bytes of the file (from ``start``, as many elements as the destination
holds), which destination (a tensor, a slice of one, or a buffer a later copy lays out), which
conversion (the file's dtype where it differs from the destination's) and, where asked, the CRC-32
those bytes must have and the name a failed check reports. One routine turns a part of an entry
into ``ReadItem``s for both fills (``_boxes.queue_box``): a plain fill is the case of one shard
covering every tensor, each entry one box read whole into its tensor (or its slice of a fused
one). No module but the reader (``_host_read`` and ``_cuda_read``, whose threads cut items into
chunks) describes a read otherwise. No torch at import: the types name torch only in annotations.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from ._entries import Entry

__all__ = ["Assembled", "Box", "Part", "ReadItem"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths), one per dim


@dataclasses.dataclass(frozen=True)
class Part:
    """Part of a model tensor taken from one entry: the entry, and the offsets (per dim, in the
    destination's coordinates) of the box of the destination it fills.

    A tensor read whole is one part at offsets ``(0, ...)``. A conversion that builds one fused
    parameter from several entries lists one part per entry, each at its own offsets, one per
    dim of the destination: an entry with fewer dims than the destination takes the leading
    offsets as indices (expert ``i`` of a stack is at ``(i, 0, 0)``), a concatenation puts each
    part at its offset along the joined dim (``(0, 3 * i)``). ``_load.read_assembled`` reads
    each as its entry's whole box into its slice (``_boxes.queue_box``: straight into it, or
    through a reusable buffer where the slice is not one run of memory).
    """

    entry: Entry
    at: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Assembled:
    """A tensor to build from catalog entries: its shape and dtype, and the parts that fill it.
    One part at the origin is a tensor read as saved; several build one fused tensor (experts
    stacked, projections concatenated), each read straight into its slice."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Part]


class ReadItem(NamedTuple):
    """One read: ``into`` (contiguous, on the CPU or an accelerator) filled from its file's
    bytes from ``start`` on, as ``into.numel()`` elements of ``stored`` converted into its own
    dtype a chunk at a time, or, where ``stored`` is None (or ``into``'s dtype), its own
    ``nbytes`` as they are. ``check``: (the CRC-32 the bytes must have, the name a failure
    reports), as a zip record records it; None checks nothing."""

    start: int
    into: torch.Tensor
    stored: torch.dtype | None = None
    check: tuple[int, str] | None = None
