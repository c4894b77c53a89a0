"""How big a tensor is: the elements and bytes this process holds of it.

One count for every report, estimate and plan: a DTensor counts its local shard, a sparse
tensor its indices and values, a lazy module's parameter nothing.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "DTYPE_SPELLINGS",
    "PLAIN_TYPES",
    "dtype_named",
    "local_part",
    "nbytes",
    "nbytes_as",
    "numel",
]

# Tensors whose data is their own storage (no subclass between them and it).
PLAIN_TYPES = (torch.Tensor, nn.Parameter)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds: a DTensor's local shard (FSDP2, tensor parallel),
    any other tensor itself. A DTensor's ``numel()`` is the global count, over every rank."""
    if type(t) in PLAIN_TYPES:
        return t
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def numel(t: torch.Tensor) -> int:
    """Elements of ``t`` held by this process (a DTensor's local shard); none for a lazy
    module's parameter that has no shape yet."""
    if isinstance(t, (nn.UninitializedParameter, nn.UninitializedBuffer)):
        return 0
    return int(local_part(t).numel())


def nbytes(t: torch.Tensor) -> int:
    """Bytes of memory ``t`` holds in this process (a DTensor's local shard).

    A sparse tensor holds its indices and values, not its dense size. A strided tensor counts
    every element, an expanded view too: that is what it takes once moved (``.to()`` makes it
    dense), which is what ``plan`` and ``estimate`` must budget for.

    >>> import torch
    >>> from torchplace._tensor_size import nbytes
    >>> nbytes(torch.zeros(3, 4)), nbytes(torch.zeros(0))
    (48, 0)
    """
    count = numel(t)
    if count == 0:
        return 0
    t = local_part(t)
    size = int(t.element_size())
    if t.layout is not torch.strided:
        return _sparse_nbytes(t, count * size)
    if not t.is_meta and _storage_freed(t):
        return 0  # a view whose storage was given back (classic FSDP's unsharded weights)
    return count * size


def _storage_freed(t: torch.Tensor) -> bool:
    try:
        return int(t.untyped_storage().nbytes()) == 0
    except (RuntimeError, NotImplementedError, TypeError):  # fake or wrapper tensors
        return False


def _sparse_nbytes(t: torch.Tensor, dense: int) -> int:
    """Bytes of a sparse tensor's indices and values (``dense`` when they cannot be read)."""
    parts: tuple[torch.Tensor, ...]
    try:
        if t.layout is torch.sparse_coo:
            parts = (t._indices(), t._values())
        elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
            parts = (t.crow_indices(), t.col_indices(), t.values())
        elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
            parts = (t.ccol_indices(), t.row_indices(), t.values())
        else:
            return dense
        return sum(int(part.numel()) * int(part.element_size()) for part in parts)
    except (RuntimeError, NotImplementedError):
        return dense


def nbytes_as(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes a tensor takes, or would take in ``dtype`` (floating tensors only); of a sharded
    tensor (DTensor), the shard this process holds."""
    if dtype is not None and tensor.is_floating_point():
        return numel(tensor) * dtype.itemsize
    return nbytes(tensor)


# The short spellings people write for a floating dtype (the command line's --dtype, plan's
# dtype=): one table, so that every entry point takes what every other takes.
DTYPE_SPELLINGS = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
    "fp8": "float8_e4m3fn",  # the float8 that checkpoints store weights in (DeepSeek-V3's)
}


def dtype_named(name: str, /, *, floating: bool = True) -> torch.dtype | None:
    """The dtype a spelling names (``"bf16"``, ``"bfloat16"``, ``"torch.float16"``, any case),
    or None where it names none (or, ``floating``, none that is floating).

    >>> dtype_named("bf16"), dtype_named("torch.float16"), dtype_named("FP32")
    (torch.bfloat16, torch.float16, torch.float32)
    >>> dtype_named("fp8")
    torch.float8_e4m3fn
    >>> dtype_named("int8") is None, dtype_named("int8", floating=False), dtype_named("weird")
    (True, torch.int8, None)
    """
    text = name.strip().lower().removeprefix("torch.")
    found = getattr(torch, DTYPE_SPELLINGS.get(text, text), None)
    if not isinstance(found, torch.dtype) or (floating and not found.is_floating_point):
        return None
    return found
