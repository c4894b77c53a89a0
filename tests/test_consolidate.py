"""Consolidated copies: packing and splitting are bit-exact, and every result owns its storage."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchplace.moving._consolidate import (
    MAX_TENSOR_BYTES,
    MIN_COUNT,
    consolidated_copy,
    pack_and_copy,
    packed_host_copy,
    should_consolidate,
    small_host_tensors,
)

CPU = torch.device("cpu")

DTYPES = [
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
    torch.complex128,
    *[
        getattr(torch, name)
        for name in ("float8_e4m3fn", "uint16", "uint32")
        if hasattr(torch, name)
    ],
]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor of arbitrary bit patterns (NaN payloads, negative zeros, subnormals)."""
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for n in shape:
        numel *= n
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    t = t.resolve_conj().resolve_neg().contiguous()
    return bytes(t.reshape(-1).view(torch.uint8).tolist())


def assert_same(out: torch.Tensor, src: torch.Tensor) -> None:
    assert out.dtype == src.dtype
    assert out.shape == src.shape
    assert raw_bytes(out.cpu()) == raw_bytes(src)


def assert_owns_storage(results: list[torch.Tensor], *, exact: bool = True) -> None:
    pointers = set()
    for out in results:
        assert out._base is None
        assert out.storage_offset() == 0
        if exact:
            assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
        if out.numel():
            pointers.add(out.untyped_storage().data_ptr())
    assert len(pointers) == sum(1 for out in results if out.numel())


def mixed() -> list[torch.Tensor]:
    base = random_bits((6, 10), torch.float32, seed=1)
    return [
        *(random_bits((3, 5), dtype, seed=i) for i, dtype in enumerate(DTYPES)),
        random_bits((), torch.float64, seed=2),  # 0-dim
        torch.empty(0, 4),  # no bytes at all
        random_bits((7,), torch.int8, seed=3),  # 7 bytes: the next piece needs padding
        base.t(),  # dense but transposed: strides kept
        base[:, ::3],  # with gaps: arrives contiguous
        base[1:4, 2:7],  # a window with a storage offset
        torch.ones(3, 1).expand(3, 4),  # overlapping (stride 0)
        torch.arange(3.0).as_strided((3, 1), (1, 100)),  # contiguous, odd stride of a size 1
        random_bits((2, 3, 4, 5), torch.float16, seed=4).to(memory_format=torch.channels_last),
        random_bits((4,), torch.complex64, seed=5).conj(),  # lazy conjugate
        random_bits((4,), torch.float32, seed=6)._neg_view(),  # lazy negation
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_dtype_bit_identical(dtype: torch.dtype) -> None:
    tensors = [random_bits((n,), dtype, seed=n) for n in (1, 3, 17, 64)]
    out = pack_and_copy(tensors, CPU, pin=False, non_blocking=False)
    for a, b in zip(out, tensors, strict=True):
        assert_same(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_dtype_bit_identical_when_shapes_repeat(dtype: torch.dtype) -> None:
    # Six tensors of one shape are packed by one stack (or a memmove each where the dtype has
    # no CPU copy kernel in every PyTorch), two of another shape one by one.
    shapes = [(2, 3)] * 6 + [(5,)] * 2
    tensors = [random_bits(shape, dtype, seed=i) for i, shape in enumerate(shapes)]
    out = pack_and_copy(tensors, CPU, pin=False, non_blocking=False)
    for a, b in zip(out, tensors, strict=True):
        assert_same(a, b)
    assert_owns_storage(out)


def test_mixed_bit_identical_with_the_strides_of_to() -> None:
    tensors = mixed()
    out = pack_and_copy(tensors, CPU, pin=False, non_blocking=False)
    assert len(out) == len(tensors)
    for a, b in zip(out, tensors, strict=True):
        assert_same(a, b)
        assert a.stride() == b.clone().stride()  # clone keeps strides as .to() does
    assert out[-3].is_contiguous(memory_format=torch.channels_last)


def test_results_own_their_storage() -> None:
    tensors = mixed()
    out = pack_and_copy(tensors, CPU, pin=False, non_blocking=False)
    assert_owns_storage(out)
    first = out[0].clone()
    out[1].zero_()  # writing one result leaves the others alone
    assert torch.equal(out[0], first)


def test_the_owned_copy_of_small_host_tensors_is_bit_identical_and_owned() -> None:
    """``packed_host_copy``, what a batch takes by default: the small host tensors only."""
    tensors = small_host_tensors([t for t in mixed() if t.dtype != torch.complex128] * 3)
    out = packed_host_copy(tensors, CPU, non_blocking=False)
    for a, b in zip(out, tensors, strict=True):
        assert_same(a, b)
        assert a.stride() == b.clone().stride()
    assert_owns_storage(out)


def test_sources_are_untouched() -> None:
    tensors = mixed()
    before = [raw_bytes(t) for t in tensors]
    pack_and_copy(tensors, CPU, pin=False, non_blocking=False)
    assert [raw_bytes(t) for t in tensors] == before


def test_to_meta_keeps_dtype_shape_and_strides() -> None:
    tensors = mixed()
    out = pack_and_copy(tensors, torch.device("meta"), pin=False, non_blocking=True)
    for a, b in zip(out, tensors, strict=True):
        assert a.device.type == "meta"
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.clone().stride())


def test_empty_input() -> None:
    assert pack_and_copy([], CPU, pin=False, non_blocking=False) == []
    assert consolidated_copy([], torch.device("meta")) == []


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(DTYPES),
            st.lists(st.integers(0, 5), min_size=0, max_size=3),
            st.booleans(),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_any_list_survives(specs: list[tuple[torch.dtype, list[int], bool]]) -> None:
    tensors = []
    for i, (dtype, shape, transpose) in enumerate(specs):
        t = random_bits(tuple(shape), dtype, seed=i)
        tensors.append(t.t() if transpose and t.dim() == 2 else t)
    out = pack_and_copy(tensors, CPU, pin=False, non_blocking=False)
    for a, b in zip(out, tensors, strict=True):
        assert_same(a, b)
    assert_owns_storage(out)


def test_groups_of_every_rank_keep_their_shapes() -> None:
    ranks = [(), (3,), (2, 3), (2, 1, 3), (1, 1, 1, 2)]
    tensors = [random_bits(shape, torch.int16, seed=i) for i, shape in enumerate(ranks * 3)]
    out = pack_and_copy(tensors, CPU, pin=False, non_blocking=False)
    for a, b in zip(out, tensors, strict=True):
        assert_same(a, b)
    assert_owns_storage(out)


def test_shared_and_lone_shapes_interleaved_come_back_in_order() -> None:
    # Tensors of one shape are packed back to back and cut by one unbind, lone shapes in runs
    # between them: every result must still land at its own index.
    shapes = [(2,), (3,), (2,), (), (5,), (3, 3), (2,), (), (7, 1), (3,), (4,)]
    tensors = [random_bits(shape, torch.float32, seed=i) for i, shape in enumerate(shapes)]
    out = pack_and_copy(tensors, CPU, pin=False, non_blocking=False)
    for a, b in zip(out, tensors, strict=True):
        assert_same(a, b)
    assert_owns_storage(out)


# --- the public entry points ----------------------------------------------------------------


def test_copy_to_the_same_device_returns_the_inputs() -> None:
    tensors = [torch.ones(2), torch.zeros(3)]
    out = consolidated_copy(tensors, CPU)
    assert all(a is b for a, b in zip(out, tensors, strict=True))


def test_copy_keeps_order_across_paths() -> None:
    big = torch.empty(MAX_TENSOR_BYTES // 4 + 1)  # one by one
    grad = torch.ones(2, requires_grad=True)  # one by one, with autograd as .to() gives it
    small = [torch.full((i + 1,), float(i)) for i in range(10)]
    tensors = [small[0], big, *small[1:5], grad, *small[5:]]
    out = consolidated_copy(tensors, torch.device("meta"))
    assert [tuple(t.shape) for t in out] == [tuple(t.shape) for t in tensors]
    assert all(t.device.type == "meta" for t in out)
    assert out[6].requires_grad and out[6].grad_fn is not None


def test_should_consolidate_only_for_cuda_targets() -> None:
    small = [torch.zeros(16) for _ in range(MIN_COUNT)]
    assert should_consolidate(small, torch.device("cuda:0"))  # a decision, no CUDA needed
    assert not should_consolidate(small, torch.device("cpu"))
    assert not should_consolidate(small, torch.device("meta"))
    assert not should_consolidate(small[:-1], torch.device("cuda:0"))


def test_should_consolidate_counts_only_small_plain_host_tensors() -> None:
    cuda = torch.device("cuda:0")
    big = [torch.empty(MAX_TENSOR_BYTES + 1, dtype=torch.uint8) for _ in range(MIN_COUNT)]
    grad = [torch.zeros(2, requires_grad=True) for _ in range(MIN_COUNT)]
    meta = [torch.zeros(2, device="meta") for _ in range(MIN_COUNT)]
    sparse = [torch.zeros(2).to_sparse() for _ in range(MIN_COUNT)]
    for tensors in (big, grad, meta, sparse):
        assert not should_consolidate(tensors, cuda)
    mixed = big + [torch.zeros(2) for _ in range(MIN_COUNT)]
    assert should_consolidate(mixed, cuda)


# --- CUDA ---------------------------------------------------------------------------------


@pytest.mark.requires_cuda
@pytest.mark.parametrize("non_blocking", [True, False])
def test_cuda_host_to_device_bit_identical_and_owned(non_blocking: bool) -> None:
    tensors = [t for t in mixed() if t.dtype != torch.float8_e4m3fn] * 20
    cuda = torch.device("cuda:0")
    assert should_consolidate(tensors, cuda)
    out = consolidated_copy(tensors, cuda, non_blocking=non_blocking)
    for a, b in zip(out, tensors, strict=True):
        assert a.device == cuda
        assert_same(a, b)
        assert a.stride() == b.to(cuda).stride()
    assert_owns_storage(out, exact=False)  # the caching allocator rounds storages up


@pytest.mark.requires_cuda
@pytest.mark.parametrize("non_blocking", [True, False])
def test_cuda_owned_copy_of_small_host_tensors(non_blocking: bool) -> None:
    dtypes = [d for d in DTYPES if d not in (torch.float8_e4m3fn, torch.complex128)]
    expected = [random_bits((i % 37 + 1,), dtypes[i % len(dtypes)], seed=i) for i in range(300)]
    tensors = [t.clone() for t in expected]
    out = packed_host_copy(tensors, torch.device("cuda"), non_blocking=non_blocking)
    for t in tensors:
        t.zero_()  # the bytes are already in the staging buffer
    torch.cuda.synchronize()
    for a, b in zip(out, expected, strict=True):
        assert a.device == torch.device("cuda", torch.cuda.current_device())
        assert_same(a, b)
    assert_owns_storage(out, exact=False)  # the caching allocator rounds storages up


@pytest.mark.requires_cuda
def test_cuda_sources_may_change_right_after() -> None:
    tensors = [torch.full((100,), float(i)) for i in range(50)]
    out = consolidated_copy(tensors, torch.device("cuda:0"), non_blocking=True)
    for t in tensors:
        t.fill_(-1.0)  # the bytes are already in the staging buffer
    assert all((o == float(i)).all().item() for i, o in enumerate(out))


@pytest.mark.requires_cuda
def test_cuda_device_to_host_bit_identical_and_owned() -> None:
    host = [t for t in mixed() if t.dtype != torch.float8_e4m3fn]
    on_gpu = [t.to("cuda:0") for t in host]
    out = consolidated_copy(on_gpu, CPU)
    for a, b in zip(out, host, strict=True):
        assert a.device == CPU
        assert_same(a, b)
    assert_owns_storage(out)


@pytest.mark.requires_cuda
def test_cuda_many_small_tensors() -> None:
    tensors = [random_bits((i % 37 + 1,), DTYPES[i % len(DTYPES)], seed=i) for i in range(500)]
    tensors = [t for t in tensors if t.dtype != torch.float8_e4m3fn]
    out = consolidated_copy(tensors, torch.device("cuda:0"))
    torch.cuda.synchronize()
    for a, b in zip(out, tensors, strict=True):
        assert_same(a, b)
