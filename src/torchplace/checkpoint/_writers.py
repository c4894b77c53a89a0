"""Writing tensors to a file, one at a time: a safetensors file and a torch zip file.

What ``save`` writes is a list of ``Item``: a name, a dtype, a shape, and a callable that gives
the values when the writer reaches it (a parameter already in memory, a copy taken for a
background save, or a disk module's weights read from their checkpoint). The writers never
build the file in memory: a safetensors file is its header (every item's dtype, shape and byte
range, known before any value is read) and then each tensor's bytes; a torch file is its pickle
(small: the names and one storage record each) and then each tensor's record, written through
torch's own zip writer. Each tensor is brought to host memory whole, made contiguous and
written in chunks of ``CHUNK`` bytes, so host memory stays within the largest tensor plus a
chunk, and a Ctrl-C is seen between chunks. Every tensor is written as a CPU tensor of its own
(device-neutral; a view is written as its own values, not its base's storage).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import pickle
import struct
import sys
from collections.abc import Callable, Iterable
from typing import IO, Any

import torch

from .._errors import CheckpointError
from ._safetensors import DTYPES

__all__ = ["CHUNK", "Item", "host_tensor", "safetensors_order", "write_pt", "write_safetensors"]

CHUNK = 16 * 2**20  # bytes handed to one write() call

_SAFETENSORS_NAMES = {
    getattr(torch, name): code for code, (name, _) in DTYPES.items() if hasattr(torch, name)
}


@dataclasses.dataclass
class Item:
    """One tensor to write: its name in the file, dtype, shape, and ``get``, which gives its
    values (on any device, in any layout) when the writer reaches it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    get: Callable[[], torch.Tensor]
    resident: bool = True  # in memory (False: read from a checkpoint when written)
    collective: bool = False  # a DTensor's gather, which every rank must take part in
    # the name of an earlier item holding the very same values (one tensor under two keys of a
    # mapping): a torch file gives both one storage, as torch.save does; safetensors has none
    same_as: str | None = None

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def host_tensor(item: Item) -> torch.Tensor:
    """``item``'s values as a flat, contiguous CPU tensor (copied to the CPU and made
    contiguous where they are not already)."""
    t = item.get().detach()
    if t.dtype != item.dtype or tuple(t.shape) != item.shape:
        raise CheckpointError(
            f"{item.name}: changed while it was being saved (now {t.dtype} {tuple(t.shape)}, "
            f"was {item.dtype} {item.shape}); save again once it has stopped changing"
        )
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous().reshape(-1)


def _as_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    array: Any = t.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def _write_chunks(f: IO[bytes], data: memoryview, advance: Callable[[int], None]) -> None:
    for at in range(0, len(data), CHUNK):
        piece = data[at : at + CHUNK]
        f.write(piece)
        advance(len(piece))


def safetensors_order(items: list[Item]) -> list[Item]:
    """Wider dtypes first (stable), so that every tensor's bytes start aligned to its dtype, as
    the safetensors library lays them out."""
    return sorted(items, key=lambda it: -it.dtype.itemsize)


def write_safetensors(
    f: IO[bytes],
    items: Iterable[Item],
    metadata: dict[str, str] | None = None,
    advance: Callable[[int], None] = lambda n: None,
) -> None:
    """Write ``items`` to the open binary file ``f`` as one safetensors file."""
    ordered = safetensors_order(list(items))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for it in ordered:
        code = _SAFETENSORS_NAMES.get(it.dtype)
        if code is None:
            raise CheckpointError(
                f"{it.name} is {it.dtype}, which safetensors cannot hold; save to a .pt path "
                "instead, or cast it first"
            )
        header[it.name] = {"dtype": code, "shape": list(it.shape),
                           "data_offsets": [offset, offset + it.nbytes]}  # fmt: skip
        offset += it.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # the data starts 8-aligned
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for it in ordered:
        _write_chunks(f, _as_bytes(host_tensor(it)), advance)


def _legacy_storage(dtype: torch.dtype) -> Any:
    """The typed storage class torch pickles a tensor of ``dtype`` with (``FloatStorage``), or
    None for a dtype that has none (``uint16``, pickled over an ``UntypedStorage``)."""
    name = torch.storage._dtype_to_storage_type_map().get(dtype)
    return getattr(torch, name) if name is not None else None


class _Storage:
    """A storage record of the torch file being written: its key, dtype and element count."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _Slot:
    """Pickled as torch pickles a contiguous CPU tensor over the storage ``storage``."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: Any) -> Any:
        stride, step = [], 1
        for d in reversed(self.shape):
            stride.append(step)
            step *= max(d, 1)
        args: tuple[Any, ...] = (self.storage, 0, self.shape, tuple(reversed(stride)), False,
                                 collections.OrderedDict())  # fmt: skip
        if _legacy_storage(self.storage.dtype) is None:  # as torch.save pickles such a dtype
            return (torch._utils._rebuild_tensor_v3, (*args, self.storage.dtype))
        return (torch._utils._rebuild_tensor_v2, args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            kind = _legacy_storage(obj.dtype)
            if kind is None:
                nbytes = obj.numel * obj.dtype.itemsize
                return ("storage", torch.storage.UntypedStorage, obj.key, "cpu", nbytes)
            return ("storage", kind, obj.key, "cpu", obj.numel)
        return None


def write_pt(
    f: IO[bytes], items: Iterable[Item], advance: Callable[[int], None] = lambda n: None
) -> None:
    """Write ``items`` to the open binary file ``f`` as a torch zip file holding a dict of CPU
    tensors, which ``torch.load(weights_only=True)`` reads."""
    listed = list(items)
    storages: dict[str, _Storage] = {}
    for i, it in enumerate(listed):
        shared = storages.get(it.same_as) if it.same_as is not None else None
        storages[it.name] = shared or _Storage(str(i), it.dtype, _numel(it.shape))
    slots = {it.name: _Slot(storages[it.name], it.shape) for it in listed}
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(slots)
    writer = torch._C.PyTorchFileWriter(f)
    pickled = buffer.getvalue()
    writer.write_record("data.pkl", pickled, len(pickled))
    records = [(".format_version", b"1"), ("byteorder", sys.byteorder.encode())]
    aligned = getattr(torch.serialization, "_get_storage_alignment", None)  # where torch has it
    if aligned is not None:  # the records' alignment, as torch.save records it
        records.insert(1, (".storage_alignment", str(aligned()).encode()))
    for record, value in records:
        writer.write_record(record, value, len(value))
    for i, it in enumerate(listed):
        if storages[it.name].key != str(i):  # the storage of an earlier item: written once
            advance(it.nbytes)
            continue
        t = host_tensor(it)  # torch's writer takes one record whole: one tensor's host copy
        n = t.numel() * t.element_size()
        if t.storage_offset() or t.untyped_storage().nbytes() != n:
            t = t.clone()  # a view into a larger storage: its own values only
        storage: Any = t.untyped_storage()
        writer.write_record(f"data/{i}", storage, n)
        advance(n)
    writer.write_end_of_file()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
