"""Consolidated copies: many small tensors cross between host and device as one transfer.

Every separate host-to-device copy pays a fixed cost (a driver call, a DMA set-up and, from
pageable memory, a synchronisation) that dwarfs the bytes of a small tensor. A consolidated copy
pays it once::

    host tensors --pack--> one staging buffer --one copy--> one device buffer --split--> results
                 (pinned, offsets aligned to 16 bytes)            (a few fused kernels)

Packing copies host tensors into the pinned staging buffer grouped by dtype and, inside a dtype,
by shape: one ``torch.stack`` for each shape held by several tensors (the usual case: a model's
layers repeat their shapes), and one ``memmove`` (no tensor operation, so no dispatch) for each
of the others. Splitting cuts each dtype's region into views shaped like the inputs (one
``unbind`` for each shape's tensors, lying back to back) and makes owned results with one fused
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

This owned split is the default for batches too (``move`` and ``DeviceLoader`` with
``views=False``): a small tensor kept after its batch (labels kept for a metric) keeps only its
own bytes alive. Through these functions on the CPU, 300 labels kept from 300 batches held
293 MiB as views and 0.04 MiB owned (``benchmarks/bench_copies.py --kept``).

**Batches may land as views** (``consolidated_views``, with ``views=True``), as tensordict's
``consolidate`` does, for loops that drop their batches: the fused split above allocates every
result, which costs about as much as the copies it saves (on an H200 host, one clone per result
made 500 tensors of 4 KiB only 1.1x faster than one ``.to()`` each; views of the landed buffer,
6.4-7x). A batch's small tensors are laid out by ``plan_views`` into buffers of at most
``VIEW_BUFFER_BYTES`` each (grouped by dtype, then shape, each dtype's region aligned to 16
bytes), packed into one pinned staging buffer, sent with one copy per buffer, and handed back as
tensors over the landed buffers::

    host tensors --pack--> pinned staging [ buffer 0 | buffer 1 | ... ] --one copy each-->
        device buffer 0 (<= VIEW_BUFFER_BYTES) --unsafe_split--> results 0..k (share its storage)
        device buffer 1 ...

The results are cut with ``unsafe_split`` (one C++ call per shape or per run of lone shapes),
which makes plain tensors rather than autograd views: no two overlap, each has its own version
counter (an in-place change of one never trips autograd's check on another), and each may be
modified in place, with autograd too. Each result's ``untyped_storage()`` is its buffer, so a
small tensor kept after the batch is dropped keeps at most ``VIEW_BUFFER_BYTES`` alive, never the
batch's large tensors (those never share). Model parameters, buffers and optimizer state always
take the owned path above, as does every batch moved without ``views=True``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .._tensor_size import PLAIN_TYPES

__all__ = [
    "MAX_TENSOR_BYTES",
    "MIN_COUNT",
    "VIEW_BUFFER_BYTES",
    "Run",
    "ViewLayout",
    "consolidated_copy",
    "consolidated_views",
    "pack_and_copy",
    "packed_host_copy",
    "plan_views",
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

# The most bytes one device buffer of a batch's views holds: what a small tensor kept after its
# batch is gone can keep alive at most. Equal to the largest tensor that is packed at all, so
# keeping a view never costs more than keeping the largest small tensor would.
VIEW_BUFFER_BYTES = MAX_TENSOR_BYTES

# Every offset in a staging buffer is a multiple of this, which covers the element size of every
# dtype (complex128 is 16 bytes), so a slice can be viewed as its dtype, and vector loads apply.
_ALIGN = 16


def _eligible(t: torch.Tensor) -> bool:
    """A tensor whose bytes can travel in a staging buffer: plain, strided, no autograd history.

    Asked of every tensor of a batch, so each test is the cheapest form of the question
    (``t.is_meta``, not ``t.device.type``, which builds a device object: 0.8 us against 0.1).
    """
    return (
        type(t) in PLAIN_TYPES
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
    >>> from torchplace.moving._consolidate import small_host_tensors
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
    >>> from torchplace.moving._consolidate import should_consolidate
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
    >>> from torchplace.moving._consolidate import consolidated_copy
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
        moved = pack_and_copy(group, device, pin=pin, non_blocking=non_blocking)
        for i, out in zip(indices, moved, strict=True):
            results[i] = out
    return [t for t in results if t is not None]


def packed_host_copy(
    tensors: Sequence[torch.Tensor], device: torch.device, /, *, non_blocking: bool
) -> list[torch.Tensor]:
    """Small host ``tensors`` (as ``small_host_tensors`` picks them) on ``device`` as one packed
    copy, each result owning its storage: ``consolidated_copy`` without sorting the tensors
    again by source and size (0.6 ms of 2.7 for 500 tensors on the host), the owned
    counterpart of ``consolidated_views``. Stages through pinned memory on CUDA.

    >>> import torch
    >>> from torchplace.moving._consolidate import packed_host_copy
    >>> out = packed_host_copy([torch.ones(2), torch.tensor([True])], torch.device("cpu"),
    ...                        non_blocking=False)
    >>> [t.tolist() for t in out], out[0].untyped_storage().nbytes()
    ([[1.0, 1.0], [True]], 8)
    """
    if device.type == "cuda" and device.index is None:  # tensors always report an index
        device = torch.device("cuda", torch.cuda.current_device())
    pin = device.type == "cuda"
    return pack_and_copy(tensors, device, pin=pin, non_blocking=non_blocking)


# Integer dtypes of each element size: the split copies bytes through them, so that no value is
# converted on the way. CUDA's fused kernels compute in float for half, bfloat16 and float8,
# which turns every NaN payload into the canonical NaN, and float additions turn -0.0 into 0.0.
_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Dtypes that CUDA's fused copy moves exactly in their own type (it computes in that very type),
# so they need no reinterpreting view per tensor.
_FUSED_EXACT = frozenset(
    {torch.float32, torch.float64, torch.complex64, *_CARRIERS.values(), torch.int8}
)


# From this many host tensors of one shape, one `torch.stack` into the staging buffer packs
# them faster than a `memmove` each (a C++ loop against a Python one: on a 2-core CPU, 0.24 ms
# against 0.49 for 500 tensors in three shapes, and a tie at 2-3 tensors). Only dtypes whose CPU
# copy kernel moves bytes as they are in every PyTorch from 2.4 take it; the rest (float8,
# sub-byte integers, which have no CPU copy kernel) keep the memmove.
_STACK_FROM = 4
_STACKABLE = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
    }
)


# Whether a dtype's element size has an integer carrier, by dtype: asked of every packed tensor,
# where a dict lookup costs less than ``element_size()``.
_CARRIED: dict[torch.dtype, bool] = {}


def _packable(t: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> bool:
    """Whether ``t`` (of ``dtype`` and ``shape``) can be packed as its bytes lie and unpacked by
    its shape alone: contiguous, not empty, of a size that has a carrier, no lazy conjugation or
    negation, and plain strides. Asked of every tensor, cheapest and likeliest tests first."""
    carried = _CARRIED.get(dtype)
    if carried is None:
        carried = _CARRIED[dtype] = t.element_size() in _CARRIERS
    return (
        carried
        and t.is_contiguous()
        and 0 not in shape
        and not t.is_neg()
        and not (dtype.is_complex and t.is_conj())  # only complex tensors carry the conj bit
        and (1 not in shape or _plain_strides(t))
    )


def _plain_strides(t: torch.Tensor) -> bool:
    """Whether a contiguous ``t`` has the strides its shape alone gives. ``is_contiguous``
    overlooks the stride of a dimension of size 1, which ``Tensor.to`` keeps (a (3, 1) tensor
    with strides (1, 100)), while a view of the landed buffer would not."""
    expected = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        if stride != expected:
            return False
        expected *= size
    return True


def pack_and_copy(
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
    >>> from torchplace.moving._consolidate import pack_and_copy
    >>> x = torch.arange(6.0).reshape(2, 3)
    >>> out = pack_and_copy([x, x.t(), torch.tensor(7)], torch.device("cpu"), pin=False,
    ...                    non_blocking=False)
    >>> [torch.equal(a, b) for a, b in zip(out, [x, x.t(), torch.tensor(7)])], out[1].stride()
    ([True, True, True], (1, 3))
    """
    if not tensors:
        return []
    results: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[torch.dtype, dict[torch.Size, list[int]]] = {}
    with torch.no_grad():
        for i, t in enumerate(tensors):
            dtype, shape = t.dtype, t.shape
            if _packable(t, dtype, shape):
                shapes = groups.get(dtype)
                if shapes is None:
                    shapes = groups[dtype] = {}
                indices = shapes.get(shape)
                if indices is None:
                    shapes[shape] = [i]
                else:
                    indices.append(i)
            else:
                results[i] = t.to(
                    device, non_blocking=non_blocking and device.type != "cpu", copy=True
                )
        if groups:
            _pack_and_split(tensors, groups, results, device, pin=pin, non_blocking=non_blocking)
        if not non_blocking and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    return [t for t in results if t is not None]


_Region = tuple[torch.dtype, dict[torch.Size, list[int]], int, int]  # dtype, shapes, offset, bytes


def _pack_on_host(
    packed: torch.Tensor, regions: list[_Region], tensors: Sequence[torch.Tensor]
) -> None:
    """Copy host tensors into their places in ``packed``, each dtype's region shape by shape."""
    base, memmove = packed.data_ptr(), ctypes.memmove
    for dtype, shapes, offset, _ in regions:
        for shape, indices in shapes.items():
            nbytes = shape.numel() * dtype.itemsize
            if len(indices) >= _STACK_FROM and dtype in _STACKABLE:
                block = packed.narrow(0, offset, nbytes * len(indices)).view(dtype)
                torch.stack([tensors[i] for i in indices], out=block.view(-1, *shape))
                offset += nbytes * len(indices)
                continue
            for i in indices:  # one memmove each: no tensor op, so no dispatch cost
                memmove(base + offset, tensors[i].data_ptr(), nbytes)
                offset += nbytes


def _land(
    packed: torch.Tensor, device: torch.device, *, pin: bool, non_blocking: bool
) -> torch.Tensor:
    """The packed bytes copied to ``device`` in one transfer."""
    source, total = packed.device, packed.numel()
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
    return landed


def _pack_and_split(
    tensors: Sequence[torch.Tensor],
    groups: dict[torch.dtype, dict[torch.Size, list[int]]],
    results: list[torch.Tensor | None],
    device: torch.device,
    *,
    pin: bool,
    non_blocking: bool,
) -> None:
    """The consolidated part of ``pack_and_copy``: fills ``results`` at the indices of ``groups``.

    Each dtype's region holds its tensors shape by shape, in the order of ``groups[dtype]``.
    """
    source = tensors[0].device  # one device for all, as _consolidate is given them
    regions: list[_Region] = []
    total = 0
    for dtype, shapes in groups.items():
        nbytes = dtype.itemsize * sum(shape.numel() * len(ix) for shape, ix in shapes.items())
        regions.append((dtype, shapes, total, nbytes))
        total += nbytes + (-nbytes % _ALIGN)

    packed = torch.empty(
        total, dtype=torch.uint8, device=source, pin_memory=pin and source.type == "cpu"
    )
    if source.type == "cpu":
        _pack_on_host(packed, regions, tensors)
    else:
        for dtype, shapes, offset, nbytes in regions:
            group = [tensors[i] for indices in shapes.values() for i in indices]
            flat = _flatten_dense_tensors(group)  # type: ignore[no-untyped-call]
            packed[offset : offset + nbytes].view(dtype).copy_(flat)

    landed = _land(packed, device, pin=pin, non_blocking=non_blocking)

    for dtype, shapes, offset, nbytes in regions:
        split = _split(landed[offset : offset + nbytes], dtype, shapes, tensors)
        order = (i for indices in shapes.values() for i in indices)
        for i, out in zip(order, split, strict=True):
            results[i] = out


def _views(
    flat: torch.Tensor, shapes: dict[torch.Size, list[int]], tensors: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as ``shapes`` lays them out: each shape's tensors back to back.

    A shape held by several tensors is cut with one ``unbind``; runs of shapes held by one
    tensor each with one ``unflatten_dense_tensors``. Both loop in C++, where a slice and a
    view per tensor from Python would cost about two microseconds each.
    """
    if len(shapes) == len(tensors) or all(len(indices) == 1 for indices in shapes.values()):
        lone = [tensors[indices[0]] for indices in shapes.values()]  # no shape repeats
        return list(_unflatten_dense_tensors(flat, lone))  # type: ignore[no-untyped-call]
    views: list[torch.Tensor] = []
    lone = []  # tensors of shapes held once, not yet cut
    start = offset = 0
    for shape, indices in shapes.items():
        numel = shape.numel()
        if len(indices) == 1:
            lone.append(tensors[indices[0]])
            offset += numel
            continue
        if lone:
            run = flat.narrow(0, start, offset - start)
            views.extend(_unflatten_dense_tensors(run, lone))  # type: ignore[no-untyped-call]
            lone = []
        block = flat.narrow(0, offset, len(indices) * numel)
        views.extend(block.view(len(indices), *shape).unbind(0))
        offset += len(indices) * numel
        start = offset
    if lone:
        run = flat.narrow(0, start, offset - start)
        views.extend(_unflatten_dense_tensors(run, lone))  # type: ignore[no-untyped-call]
    return views


def _split(
    flat: torch.Tensor,
    dtype: torch.dtype,
    shapes: dict[torch.Size, list[int]],
    tensors: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """Owned tensors of ``dtype`` shaped as ``shapes`` lays them out, from the bytes of ``flat``."""
    if flat.device.type != "cuda":  # no fused kernels here: one clone each is the cheaper way
        return [view.clone() for view in _views(flat.view(dtype), shapes, tensors)]
    if dtype in _FUSED_EXACT:  # two fused calls, no per-tensor work in Python
        views = _views(flat.view(dtype), shapes, tensors)
        owned = torch._foreach_add(views, 0)  # allocates every result
        if dtype.is_floating_point or dtype.is_complex:  # x + 0 turns -0.0 into 0.0
            torch._foreach_copy_(owned, views)
        return list(owned)
    carrier = _CARRIERS[dtype.itemsize]
    views = _views(flat.view(carrier), shapes, tensors)
    return [out.view(dtype).detach() for out in torch._foreach_add(views, 0)]


# --- batches: views of bounded device buffers ---------------------------------------------------


class Run:
    """Tensors of one dtype and shape lying back to back in one buffer, from byte ``offset``
    (``numel`` elements each). A plain class: one is made per shape of a batch."""

    __slots__ = ("dtype", "indices", "numel", "offset", "shape")

    def __init__(self, dtype: torch.dtype, shape: torch.Size, offset: int, numel: int) -> None:
        self.dtype = dtype
        self.shape = shape
        self.offset = offset
        self.numel = numel
        self.indices: list[int] = []

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize * len(self.indices)


@dataclass
class ViewLayout:
    """Where each tensor lies: ``runs[b]`` fill buffer ``b`` of ``sizes[b]`` bytes (a multiple
    of 16, at most the bound); ``loose`` are the indices that travel on their own."""

    sizes: list[int] = field(default_factory=list)
    runs: list[list[Run]] = field(default_factory=list)
    loose: list[int] = field(default_factory=list)


# By dtype: whether a byte offset aligned to 16 suits its element size, and whether it is
# complex (only complex tensors carry the conj bit). Asked of every tensor of a batch, where a
# dict lookup costs less than ``element_size()`` and ``dtype.is_complex``.
_VIEWABLE_SIZE: dict[torch.dtype, tuple[bool, bool]] = {}


def _viewable(
    t: torch.Tensor, bound: int, dtype: torch.dtype, shape: torch.Size, eligible: bool
) -> bool:
    """Whether ``t`` (of ``dtype`` and ``shape``) can travel as its bytes and come back as a
    view shaped like it, with the strides ``Tensor.to`` gives: plain, contiguous with plain
    strides, not empty, not lazily conjugated or negated, of an element size a byte offset can
    be aligned to. ``eligible``: ``small_host_tensors`` picked it (plain, strided, no grad, not
    meta, nested or quantized), which is not asked again. Asked of every tensor of a batch:
    cheapest and likeliest tests first."""
    known = _VIEWABLE_SIZE.get(dtype)
    if known is None:
        known = _VIEWABLE_SIZE[dtype] = (t.element_size() in (1, 2, 4, 8, 16), dtype.is_complex)
    sized, complex_ = known
    return (
        sized
        and (
            eligible
            or (
                type(t) in PLAIN_TYPES
                and not t.requires_grad
                and t.layout is torch.strided
                and not t.is_nested
                and not t.is_meta
                and not t.is_quantized
            )
        )
        and 0 < t.nbytes <= bound
        and t.is_contiguous()
        and not t.is_neg()
        and not (complex_ and t.is_conj())
        and (1 not in shape or _plain_strides(t))
    )


def plan_views(
    tensors: Sequence[torch.Tensor],
    /,
    bound: int = VIEW_BUFFER_BYTES,
    *,
    eligible: bool = False,
) -> ViewLayout:
    """Lay ``tensors`` out in buffers of at most ``bound`` bytes, for ``consolidated_views``.

    Tensors are grouped by dtype, then by shape (each group in order of first appearance), and
    fill the buffers in that order, a new buffer starting where the next tensor would not fit.
    Each dtype's region starts at an offset aligned to 16 bytes. Tensors that cannot travel as
    plain bytes, or are larger than ``bound``, are ``loose``: they travel on their own.
    ``eligible``: every tensor is one ``small_host_tensors`` picked (its tests are not repeated).

    >>> import torch
    >>> from torchplace.moving._consolidate import plan_views
    >>> layout = plan_views([torch.zeros(3), torch.zeros(2, dtype=torch.int8), torch.zeros(5)],
    ...                     bound=32)
    >>> layout.sizes, [[(r.dtype, r.offset, r.indices) for r in runs] for runs in layout.runs]
    ([32, 16], [[(torch.float32, 0, [0]), (torch.float32, 12, [2])], [(torch.int8, 0, [1])]])
    """
    groups: dict[torch.dtype, dict[torch.Size, list[int]]] = {}
    layout = ViewLayout()
    for i, t in enumerate(tensors):
        dtype, shape = t.dtype, t.shape
        if _viewable(t, bound, dtype, shape, eligible):
            groups.setdefault(dtype, {}).setdefault(shape, []).append(i)
        else:
            layout.loose.append(i)
    runs: list[Run] = []
    used = 0
    for dtype, shapes in groups.items():
        used += -used % _ALIGN  # each dtype's region starts aligned
        itemsize = dtype.itemsize
        for shape, indices in shapes.items():
            numel = shape.numel()
            nbytes = numel * itemsize
            if used + nbytes * len(indices) <= bound:  # the usual case: the whole run fits
                run = Run(dtype, shape, used, numel)
                run.indices = indices
                runs.append(run)
                used += nbytes * len(indices)
                continue
            current: Run | None = None
            for i in indices:
                if used + nbytes > bound and runs:  # full: the next buffer
                    layout.sizes.append(used + -used % _ALIGN)
                    layout.runs.append(runs)
                    runs, used, current = [], 0, None
                if current is None:
                    current = Run(dtype, shape, used, numel)
                    runs.append(current)
                current.indices.append(i)
                used += nbytes
    if runs:
        layout.sizes.append(used + -used % _ALIGN)
        layout.runs.append(runs)
    return layout


def _pack_runs(
    tensors: Sequence[torch.Tensor], runs: Sequence[Run], staging: torch.Tensor, start: int
) -> None:
    """Copy the tensors of ``runs`` into the host ``staging`` buffer, the buffer at ``start``."""
    base, memmove = staging.data_ptr() + start, ctypes.memmove
    for run in runs:
        dtype, shape, indices = run.dtype, run.shape, run.indices
        if len(indices) >= _STACK_FROM and dtype in _STACKABLE:
            block = staging.narrow(0, start + run.offset, run.nbytes).view(dtype)
            torch.stack([tensors[i] for i in indices], out=block.view(-1, *shape))
            continue
        nbytes = run.numel * dtype.itemsize
        offset = run.offset
        for i in indices:  # one memmove each: no tensor op, so no dispatch cost
            memmove(base + offset, tensors[i].data_ptr(), nbytes)
            offset += nbytes


def _strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (those ``_plain_strides`` checks for)."""
    if len(shape) == 2:  # the usual case, without the loop
        return (shape[1], 1)
    strides = [1] * len(shape)
    for dim in range(len(shape) - 1, 0, -1):
        strides[dim - 1] = strides[dim] * shape[dim]
    return tuple(strides)


def _cut(buffer: torch.Tensor, runs: Sequence[Run], results: list[torch.Tensor | None]) -> None:
    """Fill ``results`` with tensors over ``buffer`` (uint8) as ``runs`` lay them out.

    Each dtype's region is split once (``unsafe_split_with_sizes``: one piece per run), each run
    of several tensors once more along its first dimension; only shapes held by one tensor that
    are not 1-D, and 0-dim tensors, take a ``view`` each.
    """
    k = 0
    while k < len(runs):
        dtype = runs[k].dtype
        end = k
        while end < len(runs) and runs[end].dtype is dtype:
            end += 1
        region = runs[k:end]
        first, last = region[0], region[-1]
        flat = buffer.narrow(0, first.offset, last.offset + last.nbytes - first.offset)
        flat = flat.view(dtype)
        # Split even a lone run: the pieces are plain tensors, not autograd views of the buffer.
        pieces = flat.unsafe_split_with_sizes([r.numel * len(r.indices) for r in region])
        for run, piece in zip(region, pieces, strict=True):
            shape, indices = run.shape, run.indices
            if len(indices) == 1:  # as_strided: a third of what view costs from Python
                one = piece if len(shape) == 1 else piece.as_strided(shape, _strides(shape))
                results[indices[0]] = one
            elif len(shape) == 0:
                for i, one in zip(indices, piece.unsafe_split(1), strict=True):
                    results[i] = one.as_strided(shape, ())
            else:
                rows = piece.view(len(indices) * shape[0], *shape[1:])
                for i, one in zip(indices, rows.unsafe_split(shape[0]), strict=True):
                    results[i] = one
        k = end


def consolidated_views(
    tensors: Sequence[torch.Tensor],
    device: torch.device,
    /,
    *,
    pin: bool,
    non_blocking: bool,
    bound: int = VIEW_BUFFER_BYTES,
    eligible: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Host ``tensors`` on ``device`` as tensors sharing a few bounded buffers, and the tensors
    that own every result's memory (the shared buffers first, then each loose result).

    The values, dtype, shape and strides are those ``t.to(device)`` gives, bit for bit; no two
    results overlap, and each is a plain tensor (not an autograd view) whose storage is one of
    the shared buffers, of at most ``bound`` bytes. Tensors that cannot share (``plan_views``'
    ``loose`` ones: non-contiguous, empty, lazily conjugated, larger than ``bound``) are copied
    with ``Tensor.to`` and own their storage. ``pin`` stages through pinned memory; with
    ``non_blocking`` the copies are only queued on the current stream. Runs on any device pair
    from the host, ``cpu`` to ``cpu`` included, which is how it is tested without a GPU.
    ``eligible``: the tensors are ones ``small_host_tensors`` picked (see ``plan_views``).

    >>> import torch
    >>> from torchplace.moving._consolidate import consolidated_views
    >>> xs = [torch.arange(3.0), torch.tensor([1, 2], dtype=torch.int8), torch.ones(2, 2)]
    >>> out, buffers = consolidated_views(xs, torch.device("cpu"), pin=False, non_blocking=False)
    >>> [torch.equal(a, b) for a, b in zip(out, xs)], len(buffers)
    ([True, True, True], 1)
    >>> all(o.untyped_storage().data_ptr() == buffers[0].data_ptr() for o in out)
    True
    """
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    results: list[torch.Tensor | None] = [None] * len(tensors)
    layout = plan_views(tensors, bound, eligible=eligible)
    buffers: list[torch.Tensor] = []
    with torch.no_grad():
        for i in layout.loose:
            results[i] = tensors[i].to(
                device, non_blocking=non_blocking and device.type != "cpu", copy=True
            )
        if layout.sizes:
            staging = torch.empty(sum(layout.sizes), dtype=torch.uint8, pin_memory=pin)
            start = 0
            for size, runs in zip(layout.sizes, layout.runs, strict=True):
                _pack_runs(tensors, runs, staging, start)
                landed = torch.empty(size, dtype=torch.uint8, device=device)
                landed.copy_(staging.narrow(0, start, size), non_blocking=non_blocking and pin)
                buffers.append(landed)
                start += size
    # Cut with grad mode on, whatever the caller's: a view made under no_grad may not later be
    # changed in place by an operation that autograd records. No result has history either way.
    with torch.enable_grad():
        for buffer, runs in zip(buffers, layout.runs, strict=True):
            _cut(buffer, runs, results)
    if not non_blocking and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    out = [t for t in results if t is not None]
    return out, buffers + [out[i] for i in layout.loose]
