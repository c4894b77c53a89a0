"""Consolidated copies: many small tensors cross between host and device as one transfer.

Every separate host-to-device copy pays a fixed cost (a driver call, a DMA set-up and, from
pageable memory, a synchronisation) that dwarfs the bytes of a small tensor. A consolidated copy
pays it once::

    host tensors --pack--> one staging buffer --one copy--> one device buffer --split--> results
                 (pinned, offsets aligned to 16 bytes)            (a few fused kernels)

Packing copies each host tensor's bytes into the pinned staging buffer with one ``memmove``
(no tensor operation, so no per-tensor dispatch), grouped by dtype. Splitting cuts each dtype's
region into views shaped like the inputs and makes owned results with one fused
``torch._foreach_add(views, 0)``, which CUDA runs as a handful of multi-tensor kernels that also
allocate every result. Floating dtypes that CUDA's fused kernels compute in their own type
(float32, float64, complex64) get a fused ``_foreach_copy_`` on top, since ``x + 0`` turns -0.0
into 0.0; half, bfloat16, bool and float8, which those kernels compute in float (rewriting NaN
payloads), travel as integers of their size and are reinterpreted per tensor. Each result is
allocated on its own, so it owns its storage: freeing one frees its memory, and no result keeps
the staging buffers alive.

Which copies are worth consolidating is decided by ``should_consolidate`` from two constants,
``MIN_COUNT`` and ``MAX_TENSOR_BYTES``; ``benchmarks/bench_copies.py --sweep`` measures the
crossover on a GPU and prints the values to put here.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = [
    "MAX_TENSOR_BYTES",
    "MIN_COUNT",
    "consolidated_copy",
    "should_consolidate",
    "small_host_tensors",
]

# Consolidate when at least MIN_COUNT host tensors of at most MAX_TENSOR_BYTES each go to a CUDA
# device. Measured with `python benchmarks/bench_copies.py --sweep` on an H100 host (2026-11-22,
# benchmarks/RESULTS.md): against one pageable `.to()` each, a consolidated copy breaks even at
# about 16 tensors and wins by more than 10% from 32, at every size from 256 bytes to 1 MiB
# (1.3x to 1.8x at 32 to 256 tensors). Larger tensors go through the pinned ring of
# `_staging.Stager` in `move`, or one by one.
MIN_COUNT = 32
MAX_TENSOR_BYTES = 1 << 20

# Every offset in a staging buffer is a multiple of this, which covers the element size of every
# dtype (complex128 is 16 bytes), so a slice can be viewed as its dtype, and vector loads apply.
_ALIGN = 16

_PLAIN = (torch.Tensor, nn.Parameter)


def _eligible(t: torch.Tensor) -> bool:
    """A tensor whose bytes can travel in a staging buffer: plain, strided, no autograd history.

    Asked of every tensor of a batch, so each test is the cheapest form of the question
    (``t.is_meta``, not ``t.device.type``, which builds a device object: 0.8 us against 0.1).
    """
    return (
        type(t) in _PLAIN
        and not t.requires_grad
        and t.layout is torch.strided
        and not t.is_meta
        and not t.is_quantized
        and not t.is_nested
    )


def _small(t: torch.Tensor) -> bool:
    """A tensor a consolidated copy packs: eligible and at most ``MAX_TENSOR_BYTES``."""
    return _eligible(t) and t.nbytes <= MAX_TENSOR_BYTES


def small_host_tensors(tensors: Iterable[torch.Tensor], /) -> list[torch.Tensor]:
    """The tensors of ``tensors`` that a consolidated copy from the host would pack.

    >>> import torch
    >>> from torchplace._consolidate import small_host_tensors
    >>> big, on_meta = torch.zeros(1 << 20), torch.zeros(4, device="meta")
    >>> len(small_host_tensors([torch.zeros(4), big, on_meta, torch.ones(2, requires_grad=True)]))
    1
    """
    return [t for t in tensors if t.is_cpu and _small(t)]


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
        if t.is_cpu and _small(t):
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
    host = torch.device("cpu")
    for i, t in enumerate(tensors):
        source = host if t.is_cpu else t.device  # t.device builds a new object each time
        if source == device:
            results[i] = t
        elif _small(t):
            groups.setdefault(source, []).append(i)
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


# Integer dtypes of each element size: the split copies bytes through them, so that no value is
# converted on the way. CUDA's fused kernels compute in float for half, bfloat16 and float8,
# which turns every NaN payload into the canonical NaN, and float additions turn -0.0 into 0.0.
_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Dtypes that CUDA's fused copy moves exactly in their own type (it computes in that very type),
# so they need no reinterpreting view per tensor.
_FUSED_EXACT = frozenset(
    {torch.float32, torch.float64, torch.complex64, *_CARRIERS.values(), torch.int8}
)


def _packable(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be packed as they lie and unpacked by its shape alone."""
    return (
        t.is_contiguous()
        and t.numel() > 0
        and t.element_size() in _CARRIERS
        and not t.is_conj()
        and not t.is_neg()
    )


def _consolidate(
    tensors: Sequence[torch.Tensor], device: torch.device, *, pin: bool, non_blocking: bool
) -> list[torch.Tensor]:
    """Pack ``tensors`` (all on one device) into one buffer, copy it, split it on ``device``.

    ``pin`` places the host-side buffer (the staging buffer, or the landing buffer of a
    device-to-host copy) in pinned memory. Runs on any pair of devices, ``cpu`` to ``cpu``
    included, which is how the packing and splitting are tested without a GPU.

    Tensors of one dtype are packed back to back (each dtype's region starts at an offset
    aligned to 16 bytes) and split as the module docstring describes, bit for bit; a host
    target clones each view instead, having no fused kernels. Tensors that cannot travel as
    plain bytes (non-contiguous, lazily conjugated or negated, empty, complex128) are copied one
    by one with the strides ``Tensor.to`` gives them.

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
    results: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[torch.dtype, list[int]] = {}
    with torch.no_grad():
        for i, t in enumerate(tensors):
            if _packable(t):
                groups.setdefault(t.dtype, []).append(i)
            else:
                results[i] = t.to(
                    device, non_blocking=non_blocking and device.type != "cpu", copy=True
                )
        if groups:
            _pack_and_split(tensors, groups, results, device, pin=pin, non_blocking=non_blocking)
        if not non_blocking and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    return [t for t in results if t is not None]


@dataclass
class _Region:
    """One group's place in a staging buffer and how to cut it back into tensors.

    ``layout`` is the nested-tensor layout of the group (each tensor's sizes, strides and offset,
    in elements), or None when the group was packed one tensor after another by shape.
    """

    dtype: torch.dtype
    indices: list[int]
    offset: int
    nbytes: int
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


_quiet = threading.Lock()
_quieted = False


def _quiet_nested_warning() -> None:
    """Swallow PyTorch's one-time "nested tensors are a prototype" warning, which would
    otherwise reach a user who never asked for a nested tensor: PyTorch warns once per process,
    so triggering it once here, with the warning ignored, silences it for good."""
    global _quieted
    if _quieted:
        return
    with _quiet:
        if not _quieted:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with contextlib.suppress(Exception):
                    torch._nested_tensor_from_tensor_list([torch.zeros(1)])
            _quieted = True


def _pack_nested(
    tensors: Sequence[torch.Tensor], groups: dict[torch.dtype, list[int]], *, pin: bool
) -> tuple[torch.Tensor, list[_Region]] | None:
    """Host tensors packed by one nested-tensor construction per dtype and rank.

    PyTorch builds a nested tensor from a list by copying every member's bytes into one buffer
    in a single C++ loop, and records each member's layout, which later cuts the landed buffer
    into shaped views in another single C++ call (``unbind``). None where this PyTorch cannot
    (the caller then packs one tensor at a time).
    """
    _quiet_nested_warning()
    parts: list[tuple[torch.Tensor, _Region]] = []
    total = 0
    try:
        for dtype, indices in groups.items():
            by_rank: dict[int, list[int]] = {}
            for i in indices:
                by_rank.setdefault(tensors[i].dim(), []).append(i)
            for members in by_rank.values():
                nested = torch._nested_tensor_from_tensor_list([tensors[i] for i in members])
                values = nested.values()
                layout = (
                    nested._nested_tensor_size(),
                    nested._nested_tensor_strides(),
                    nested._nested_tensor_storage_offsets(),
                )
                nbytes = values.numel() * values.element_size()
                parts.append((values, _Region(dtype, members, total, nbytes, layout)))
                total += nbytes + (-nbytes % _ALIGN)
    except (AttributeError, NotImplementedError, RuntimeError, TypeError):
        return None
    packed = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    for values, region in parts:
        packed[region.offset : region.offset + region.nbytes].view(region.dtype).copy_(values)
    return packed, [region for _, region in parts]


def _pack_flat(
    tensors: Sequence[torch.Tensor],
    groups: dict[torch.dtype, list[int]],
    source: torch.device,
    *,
    pin: bool,
) -> tuple[torch.Tensor, list[_Region]]:
    """Tensors packed one after another by dtype: one ``memmove`` each from the host, one
    flattening per dtype on a device."""
    regions: list[_Region] = []
    total = 0
    for dtype, indices in groups.items():
        nbytes = sum(tensors[i].numel() for i in indices) * tensors[indices[0]].element_size()
        regions.append(_Region(dtype, indices, total, nbytes))
        total += nbytes + (-nbytes % _ALIGN)
    packed = torch.empty(
        total, dtype=torch.uint8, device=source, pin_memory=pin and source.type == "cpu"
    )
    for region in regions:
        group = [tensors[i] for i in region.indices]
        if source.type == "cpu":
            base, offset = packed.data_ptr(), region.offset
            for t in group:
                nbytes = t.numel() * t.element_size()
                ctypes.memmove(base + offset, t.data_ptr(), nbytes)
                offset += nbytes
        else:
            flat = _flatten_dense_tensors(group)  # type: ignore[no-untyped-call]
            end = region.offset + region.nbytes
            packed[region.offset : end].view(region.dtype).copy_(flat)
    return packed, regions


def _pack_and_split(
    tensors: Sequence[torch.Tensor],
    groups: dict[torch.dtype, list[int]],
    results: list[torch.Tensor | None],
    device: torch.device,
    *,
    pin: bool,
    non_blocking: bool,
) -> None:
    """The consolidated part of ``_consolidate``: fills ``results`` at the indices of ``groups``."""
    source = tensors[0].device  # one device for all, as _consolidate is given them
    packing = _pack_nested(tensors, groups, pin=pin) if source.type == "cpu" else None
    packed, regions = packing or _pack_flat(tensors, groups, source, pin=pin)
    total = packed.numel()

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

    for region in regions:
        group = [tensors[i] for i in region.indices]
        for i, out in zip(region.indices, _split(landed, region, group), strict=True):
            results[i] = out


def _split(landed: torch.Tensor, region: _Region, group: list[torch.Tensor]) -> list[torch.Tensor]:
    """Owned tensors of the region's dtype with the shapes of ``group``, from its bytes."""
    dtype = region.dtype
    cuda = landed.device.type == "cuda"
    # CUDA's fused kernels rewrite what they compute in float: those dtypes travel as integers.
    carrier = dtype if not cuda or dtype in _FUSED_EXACT else _CARRIERS[group[0].element_size()]
    if region.layout is not None and landed.device.type in ("cpu", "cuda"):
        # The whole buffer, not a slice: the nested view counts offsets from the storage's
        # start and ignores a slice's own offset. Every region starts 16-byte aligned.
        sizes, strides, offsets = region.layout
        start = region.offset // group[0].element_size()
        nested = torch._nested_view_from_buffer(
            landed.view(carrier), sizes, strides, offsets + start
        )
        views = nested.unbind()
    else:
        flat = landed[region.offset : region.offset + region.nbytes].view(carrier)
        views = _unflatten_dense_tensors(flat, group)  # type: ignore[no-untyped-call]
    if not cuda:  # no fused kernels here: one clone each is the cheaper way
        return [view.clone() for view in views]
    owned = torch._foreach_add(views, 0)  # allocates every result
    if carrier is not dtype:
        return [out.view(dtype).detach() for out in owned]
    if dtype.is_floating_point or dtype.is_complex:  # x + 0 turns -0.0 into 0.0
        torch._foreach_copy_(owned, views)
    return list(owned)
