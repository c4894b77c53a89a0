"""Consolidated copies: many small tensors cross between host and device as one transfer.

Every separate host-to-device copy pays a fixed cost (a driver call, a DMA set-up and, from
pageable memory, a synchronisation) that dwarfs the bytes of a small tensor. A consolidated copy
pays it once::

    host tensors --pack--> one staging buffer --one copy--> one device buffer --split--> results
                 (pinned, offsets aligned to 16 bytes)            (a few fused kernels)

Both ends move bytes through ``uint8`` views: packing is one ``torch.cat`` into the staging
buffer, splitting one ``torch._foreach_copy_``, which CUDA runs as a handful of fused
multi-tensor kernels instead of one kernel per tensor. Each
result is allocated on its own (with the strides ``Tensor.to`` would give it), so it owns its
storage: freeing one frees its memory, and no result keeps the staging buffers alive.

Which copies are worth consolidating is decided by ``should_consolidate`` from two constants,
``MIN_COUNT`` and ``MAX_TENSOR_BYTES``; ``benchmarks/bench_copies.py --sweep`` measures the
crossover on a GPU and prints the values to put here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["MAX_TENSOR_BYTES", "MIN_COUNT", "consolidated_copy", "should_consolidate"]

# Consolidate when at least MIN_COUNT host tensors of at most MAX_TENSOR_BYTES each go to a CUDA
# device. PROVISIONAL until `python benchmarks/bench_copies.py --sweep` runs on a GPU. Measured on
# a CPU-only machine: the bookkeeping of a consolidated copy costs about 7 us per tensor there
# (about 4 us on a fast host), plus a fixed 20-30 us (three allocations, one transfer, a few fused
# kernels). Taken from CUDA's published behaviour, not measured here: a per-tensor `.to()` from
# pageable memory costs 10-20 us (a driver call and a synchronisation) plus bytes at 10-20 GB/s;
# a consolidated one adds a host memcpy into staging (10-20 GB/s) before a pinned transfer
# (25-50 GB/s). So consolidation wins from about 3 tensors (8 leaves a margin for pinned
# sources, whose per-tensor copies are cheaper) and loses above about 100 KiB per tensor, where
# the extra memcpy costs more than the saved fixed cost.
MIN_COUNT = 8
MAX_TENSOR_BYTES = 128 << 10

# Every offset in a staging buffer is a multiple of this, which covers the element size of every
# dtype (complex128 is 16 bytes), so a slice can be viewed as its dtype, and vector loads apply.
_ALIGN = 16

_PLAIN = (torch.Tensor, nn.Parameter)


def _eligible(t: torch.Tensor) -> bool:
    """A tensor whose bytes can travel in a staging buffer: plain, strided, no autograd history."""
    return (
        type(t) in _PLAIN
        and t.layout == torch.strided
        and not t.requires_grad
        and not t.is_quantized
        and not t.is_nested
        and t.device.type != "meta"
    )


def should_consolidate(tensors: Sequence[torch.Tensor], device: torch.device, /) -> bool:
    """Whether copying ``tensors`` to ``device`` goes faster as one consolidated copy.

    True only for a CUDA target and at least ``MIN_COUNT`` host tensors of at most
    ``MAX_TENSOR_BYTES`` each that can travel as bytes (plain, strided, not requiring grad).
    CPU, ``meta`` and other targets never consolidate.

    >>> import torch
    >>> from torchplace._consolidate import should_consolidate
    >>> small = [torch.zeros(4) for _ in range(100)]
    >>> should_consolidate(small, torch.device("cpu"))
    False
    >>> should_consolidate(small, torch.device("meta"))
    False
    """
    if device.type != "cuda":
        return False
    count = 0
    for t in tensors:
        if t.device.type == "cpu" and _eligible(t) and t.nbytes <= MAX_TENSOR_BYTES:
            count += 1
            if count >= MIN_COUNT:
                return True
    return False


def consolidated_copy(
    tensors: Sequence[torch.Tensor], device: torch.device, /, *, non_blocking: bool = True
) -> list[torch.Tensor]:
    """Copy ``tensors`` to ``device``, the small ones packed into one transfer.

    Returns one tensor per input, in order, with the values, dtype, shape and strides that
    ``t.to(device)`` would give (bit for bit), each owning its storage. A tensor already on
    ``device`` comes back as itself. Tensors larger than ``MAX_TENSOR_BYTES``, ones that require
    grad and tensor subclasses are copied one by one with ``Tensor.to``; the rest are grouped by
    source device and each group travels as one copy (through pinned host memory on CUDA).

    Host to CUDA with ``non_blocking=True``: the call returns once the copy is queued on the
    current stream, and the host tensors may be changed at once (their bytes are already in the
    staging buffer, which PyTorch's pinned-memory allocator keeps until the copy is done). With
    ``non_blocking=False`` it returns when the results are on the device. Device to host always
    waits for the bytes before splitting them, so the returned CPU tensors are safe to read.

    >>> import torch
    >>> from torchplace._consolidate import consolidated_copy
    >>> out = consolidated_copy([torch.ones(2), torch.tensor([True])], torch.device("meta"))
    >>> [(t.device.type, t.dtype, tuple(t.shape)) for t in out]
    [('meta', torch.float32, (2,)), ('meta', torch.bool, (1,))]
    """
    if device.type == "cuda" and device.index is None:  # tensors always report an index
        device = torch.device("cuda", torch.cuda.current_device())
    results: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[torch.device, list[int]] = {}
    one_by_one_blocking = not non_blocking or device.type == "cpu"
    for i, t in enumerate(tensors):
        if t.device == device:
            results[i] = t
        elif _eligible(t) and t.nbytes <= MAX_TENSOR_BYTES:
            groups.setdefault(t.device, []).append(i)
        else:
            results[i] = t.to(device, non_blocking=not one_by_one_blocking)
    for source, indices in groups.items():
        if len(indices) == 1:  # nothing to gain from staging a lone tensor
            i = indices[0]
            results[i] = tensors[i].to(device, non_blocking=not one_by_one_blocking)
            continue
        group = [tensors[i] for i in indices]
        pin = torch.cuda.is_available() and (
            (source.type == "cpu" and device.type == "cuda")
            or (source.type == "cuda" and device.type == "cpu")
        )
        moved = _consolidate(group, device, pin=pin, non_blocking=non_blocking)
        for i, out in zip(indices, moved, strict=True):
            results[i] = out
    return [t for t in results if t is not None]


def _out_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides ``t.to()`` gives: ``t``'s own when dense and non-overlapping, else contiguous.

    >>> import torch
    >>> from torchplace._consolidate import _out_strides
    >>> _out_strides(torch.zeros(2, 3).t()), _out_strides(torch.zeros(4, 4)[:, ::2])
    ((1, 3), (2, 1))
    """
    strides = t.stride()
    if t.is_contiguous():
        return strides
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(strides, t.shape, strict=True) if n != 1):
        if stride != expected:  # overlapping or with gaps: arrives contiguous
            return tuple(torch.empty(t.shape, device="meta").stride())
        expected *= size
    return strides


def _consolidate(
    tensors: Sequence[torch.Tensor], device: torch.device, *, pin: bool, non_blocking: bool
) -> list[torch.Tensor]:
    """Pack ``tensors`` (all on one device) into one buffer, copy it, split it on ``device``.

    ``pin`` places the host-side buffer (the staging buffer, or the landing buffer of a
    device-to-host copy) in pinned memory. Runs on any pair of devices, ``cpu`` to ``cpu``
    included, which is how the packing and splitting are tested without a GPU.

    Each tensor's bytes sit at an offset aligned to 16 bytes, so the buffer can be viewed once
    per dtype and each tensor addressed in it with the strides it arrives with; packing and
    splitting are then one ``_foreach_copy_`` per dtype between same-shaped views, which CUDA
    runs as a few fused kernels (no per-tensor kernel, no byte reinterpretation per tensor).

    >>> import torch
    >>> from torchplace._consolidate import _consolidate
    >>> x = torch.arange(6.0).reshape(2, 3)
    >>> out = _consolidate([x, x.t(), torch.tensor(7)], torch.device("cpu"), pin=False,
    ...                    non_blocking=False)
    >>> [torch.equal(a, b) for a, b in zip(out, [x, x.t(), torch.tensor(7)])], out[1].stride()
    ([True, True, True], (1, 3))
    """
    if not tensors:
        return []
    source = tensors[0].device
    with torch.no_grad():
        layout: list[tuple[torch.Tensor, tuple[int, ...], int]] = []  # tensor, strides, offset
        total = 0
        for t in tensors:
            if t.is_conj() or t.is_neg():  # a lazy view: its memory is not its values
                t = t.resolve_conj().resolve_neg()
            layout.append((t, _out_strides(t), total))
            nbytes = t.numel() * t.element_size()
            total += nbytes + (-nbytes % _ALIGN)

        host_pinned = pin and source.type == "cpu"
        packed = torch.empty(total, dtype=torch.uint8, device=source, pin_memory=host_pinned)
        _copy_by_dtype(packed, layout, into_buffer=True)

        if source.type == "cpu" or device.type != "cpu":
            landed = torch.empty(total, dtype=torch.uint8, device=device)
            landed.copy_(packed, non_blocking=non_blocking and pin)
        else:  # device to host: land in (pinned) host memory and wait for the bytes
            landed = torch.empty(total, dtype=torch.uint8, device=device, pin_memory=pin)
            if source.type == "cuda":
                landed.copy_(packed, non_blocking=True)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(torch.cuda.current_stream(source))
                done.synchronize()
            else:
                landed.copy_(packed)

        results = [
            torch.empty_strided(t.shape, strides, dtype=t.dtype, device=device)
            for t, strides, _ in layout
        ]
        arrived = [
            (out, strides, offset)
            for out, (_, strides, offset) in zip(results, layout, strict=True)
        ]
        _copy_by_dtype(landed, arrived, into_buffer=False)
        if not non_blocking and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    return results


def _copy_by_dtype(
    buffer: torch.Tensor,
    layout: Sequence[tuple[torch.Tensor, tuple[int, ...], int]],
    *,
    into_buffer: bool,
) -> None:
    """Copies each tensor into (or out of) its place in ``buffer``, one fused copy per dtype."""
    typed: dict[torch.dtype, tuple[torch.Tensor, int, list[torch.Tensor], list[torch.Tensor]]] = {}
    for t, strides, offset in layout:
        if not t.numel():
            continue
        entry = typed.get(t.dtype)
        if entry is None:
            entry = typed[t.dtype] = (buffer.view(t.dtype), t.element_size(), [], [])
        view, itemsize, in_buffer, outside = entry
        in_buffer.append(view.as_strided(t.shape, strides, offset // itemsize))
        outside.append(t)
    for _, _, in_buffer, outside in typed.values():
        if into_buffer:
            _copy_all(in_buffer, outside)
        else:
            _copy_all(outside, in_buffer)


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for all i; fused kernels where the backend has them."""
    try:
        torch._foreach_copy_(targets, sources)
    except (AttributeError, NotImplementedError):  # a backend without the fused copy
        for target, src in zip(targets, sources, strict=True):
            target.copy_(src)
