"""Batches land as views of bounded shared buffers: the packing and cutting, on the CPU.

``consolidated_views`` runs from the host to any device, ``cpu`` included, so every property of
the layout is checked here without a GPU: values bit for bit, the strides ``.to()`` gives, no two
results overlapping, each result's storage one bounded buffer, large and odd tensors owning their
own, and results that behave as independent tensors (in place, with autograd too). The wiring in
``move`` and ``DeviceLoader`` is checked with ``meta`` standing in for a GPU.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import torchplace
from test_consolidate import DTYPES, assert_same, mixed, random_bits
from torchplace.moving import _move, _transfer
from torchplace.moving._consolidate import (
    VIEW_BUFFER_BYTES,
    consolidated_views,
    pack_and_copy,
    plan_views,
)
from torchplace.moving._loader import DeviceLoader

CPU = torch.device("cpu")
META = torch.device("meta")


def views(
    tensors: list[torch.Tensor], bound: int = VIEW_BUFFER_BYTES
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return consolidated_views(tensors, CPU, pin=False, non_blocking=False, bound=bound)


def span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` covers, as addresses: a contiguous tensor's [start, stop)."""
    start = t.data_ptr()
    return start, start + t.nbytes


def assert_views_of(out: list[torch.Tensor], storages: list[torch.Tensor], bound: int) -> None:
    """Every result lies inside one of ``storages``, no two results overlap, buffers are bounded,
    and every result's offset is aligned to its element size."""
    owners = {s.untyped_storage().data_ptr(): s for s in storages}
    for t in out:
        if t.numel() == 0:
            continue
        owner = owners[t.untyped_storage().data_ptr()]  # its storage is one of them
        assert t.untyped_storage().nbytes() == owner.untyped_storage().nbytes()
        assert (t.data_ptr() - owner.data_ptr()) % t.element_size() == 0
    for s in storages:
        if s.dtype == torch.uint8 and s.dim() == 1 and s._base is None:  # a shared buffer
            assert s.nbytes <= bound and s.nbytes % 16 == 0
    spans = sorted(span(t) for t in out if t.numel())
    for (_, stop), (start, _) in itertools.pairwise(spans):
        assert stop <= start, "two results overlap"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_dtype_lands_bit_identical_in_one_buffer(dtype: torch.dtype) -> None:
    tensors = [random_bits((n,), dtype, seed=n) for n in (1, 3, 17, 64)]
    out, storages = views(tensors)
    for a, b in zip(out, tensors, strict=True):
        assert_same(a, b)
        assert a._base is None  # a plain tensor, not an autograd view of the buffer
    assert len(storages) == 1
    assert all(a.untyped_storage().data_ptr() == storages[0].data_ptr() for a in out)
    assert_views_of(out, storages, VIEW_BUFFER_BYTES)


def test_mixed_dtypes_and_shapes_keep_the_strides_of_to_and_never_overlap() -> None:
    tensors = mixed()
    out, storages = views(tensors)
    assert len(out) == len(tensors)
    for a, b in zip(out, tensors, strict=True):
        assert_same(a, b)
        assert a.stride() == b.clone().stride()  # clone keeps strides as .to() does
    assert_views_of(out, storages, VIEW_BUFFER_BYTES)
    # The odd ones travel on their own and own their storage, with .to()'s strides.
    shared = storages[0].data_ptr()
    for i in range(-8, 0):  # transposed, gaps, window, overlap, odd stride, channels-last, ...
        if out[i].numel():
            assert out[i].untyped_storage().data_ptr() != shared, i
    assert out[-3].is_contiguous(memory_format=torch.channels_last)


def test_regions_of_each_dtype_start_aligned_after_odd_sizes() -> None:
    tensors = [
        random_bits((7,), torch.int8, seed=1),  # 7 bytes: the next region needs padding
        random_bits((3,), torch.float64, seed=2),
        random_bits((1,), torch.bool, seed=3),
        random_bits((2,), torch.complex128, seed=4),  # 16-byte elements
    ]
    layout = plan_views(tensors)
    offsets = {run.dtype: run.offset for run in layout.runs[0]}
    assert offsets == {torch.int8: 0, torch.float64: 16, torch.bool: 48, torch.complex128: 64}
    out, storages = views(tensors)
    for a, b in zip(out, tensors, strict=True):
        assert_same(a, b)
    assert [(a.data_ptr() - storages[0].data_ptr()) for a in out] == [0, 16, 48, 64]


def test_buffers_are_bounded_and_split_at_the_bound() -> None:
    bound = 256
    floats = bound // 4
    exact = [torch.arange(float(floats))]  # exactly the bound: one buffer of its own
    out, storages = views(exact, bound)
    assert len(storages) == 1 and storages[0].nbytes == bound
    assert out[0].untyped_storage().data_ptr() == storages[0].data_ptr()

    halves = [torch.full((floats // 2,), float(i)) for i in range(2)]  # fill one buffer
    assert plan_views(halves, bound).sizes == [bound]
    over = [torch.full((floats // 2 + 1,), float(i)) for i in range(2)]  # do not fit together
    assert plan_views(over, bound).sizes == [bound // 2 + 16, bound // 2 + 16]
    too_big = [torch.zeros(floats + 1)]  # larger than the bound: never shared
    assert plan_views(too_big, bound).loose == [0]

    many = [random_bits((10,), torch.float32, seed=i) for i in range(50)]  # 2,000 bytes
    out, storages = views(many, bound)
    assert len(storages) == 9  # 6 tensors of 40 bytes per 256-byte buffer: 8 full, 1 not
    for a, b in zip(out, many, strict=True):
        assert_same(a, b)
    assert_views_of(out, storages, bound)


def test_a_kept_small_tensor_keeps_only_its_bounded_buffer() -> None:
    labels = torch.arange(16)
    batch = [labels, torch.zeros(1 << 20), *(torch.ones(8) for _ in range(40))]  # 4 MiB large
    out, storages = views(batch)
    kept = out[0]
    assert kept.untyped_storage().nbytes() <= VIEW_BUFFER_BYTES
    assert kept.untyped_storage().data_ptr() == storages[0].data_ptr()
    large = out[1]  # larger than the bound: owns its storage, shares with no one
    assert large.untyped_storage().nbytes() == large.nbytes
    assert large.untyped_storage().data_ptr() not in {s.data_ptr() for s in storages[:1]}
    assert torch.equal(kept, labels)


def test_results_are_independent_tensors() -> None:
    tensors = [torch.arange(4.0) + i for i in range(6)] + [torch.ones(2, 2), torch.tensor(3.0)]
    out, _ = views(tensors)
    before = [t.clone() for t in out]
    out[1].zero_()  # writing one result leaves the others alone
    for i in (0, *range(2, len(out))):
        assert torch.equal(out[i], before[i])
    assert [t._version for t in out[2:4]] == [0, 0]  # own version counters
    # Changed in place by an operation autograd records, as any tensor may be ...
    weight = torch.full((4,), 2.0, requires_grad=True)
    out[0].mul_(weight)
    out[-2].mul_(torch.ones(2, 2, requires_grad=True))
    out[-1].mul_(torch.ones((), requires_grad=True))
    # ... and a sibling changed in place does not invalidate one saved for backward.
    w2 = torch.ones(4, requires_grad=True)
    loss = (w2 * out[3]).sum()
    out[2].add_(1)
    loss.backward()
    assert torch.equal(w2.grad, tensors[3])


def test_views_made_under_no_grad_may_later_change_under_autograd() -> None:
    with torch.no_grad():
        out, _ = views([torch.ones(2, 3) for _ in range(3)] + [torch.ones(())])
    out[0].mul_(torch.ones(2, 3, requires_grad=True))
    out[3].mul_(torch.ones((), requires_grad=True))
    assert out[0].requires_grad and out[3].requires_grad


def test_sources_are_untouched_and_a_tensor_twice_lands_twice() -> None:
    x = torch.arange(5.0)
    out, storages = views([x, x, torch.ones(3)])
    assert torch.equal(out[0], x) and torch.equal(out[1], x)
    assert torch.equal(x, torch.arange(5.0))
    assert_views_of(out, storages, VIEW_BUFFER_BYTES)


def test_repeated_and_lone_shapes_of_every_rank_come_back_in_order() -> None:
    shapes = [(2,), (3,), (2,), (), (5,), (3, 3), (2,), (), (7, 1), (3,), (4,), (2, 1, 3)] * 2
    tensors = [random_bits(shape, torch.int16, seed=i) for i, shape in enumerate(shapes)]
    out, storages = views(tensors)
    for a, b in zip(out, tensors, strict=True):
        assert_same(a, b)
        assert a.stride() == b.stride()
    assert_views_of(out, storages, VIEW_BUFFER_BYTES)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(DTYPES),
            st.lists(st.integers(0, 6), min_size=0, max_size=3),
            st.booleans(),
        ),
        min_size=1,
        max_size=16,
    ),
    st.sampled_from([64, 256, 4096]),
)
def test_any_list_survives_any_bound(
    specs: list[tuple[torch.dtype, list[int], bool]], bound: int
) -> None:
    tensors = []
    for i, (dtype, shape, transpose) in enumerate(specs):
        t = random_bits(tuple(shape), dtype, seed=i)
        tensors.append(t.t() if transpose and t.dim() == 2 else t)
    out, storages = views(tensors, bound)
    for a, b in zip(out, tensors, strict=True):
        assert_same(a, b)
    assert_views_of(out, storages, bound)


def test_to_meta_keeps_dtype_shape_and_strides() -> None:
    tensors = [torch.ones(2, 3), torch.zeros((), dtype=torch.int8), torch.ones(3, 2).t()]
    out, storages = consolidated_views(tensors, META, pin=False, non_blocking=False)
    assert [(t.device, t.dtype, t.shape, t.stride()) for t in out] == [
        (META, t.dtype, t.shape, t.stride()) for t in tensors
    ]
    assert len(storages) == 2  # one shared buffer, and the transposed tensor's own


# --- the wiring: meta stands in for a GPU ------------------------------------------------------


@pytest.fixture
def meta_consolidates(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (_move, _transfer):
        monkeypatch.setattr(module, "is_accelerator", lambda dev: dev.type != "cpu")
    monkeypatch.setattr(_transfer, "should_consolidate", lambda tensors, dev: len(tensors) >= 8)


def shares(t: torch.Tensor) -> bool:
    """On meta a storage has no address, but its size says whether it is the tensor's own."""
    return t.untyped_storage().nbytes() > t.nbytes


@pytest.mark.usefixtures("meta_consolidates")
def test_move_of_a_batch_lands_small_tensors_as_views_and_large_ones_owned() -> None:
    batch: dict[str, Any] = {
        "ids": [torch.arange(4) + i for i in range(10)],
        "image": torch.zeros(1 << 19),  # 2 MiB: owns its storage
        "mask": torch.ones(3, 4, dtype=torch.bool),
    }
    batch["again"] = batch["ids"][0]
    moved = torchplace.move(batch, "meta", views=True)
    assert all(shares(t) for t in moved["ids"]) and shares(moved["mask"])
    assert not shares(moved["image"])
    assert moved["again"] is moved["ids"][0]
    owned = torchplace.move(batch, "meta")  # the default: each tensor owns its storage
    assert not any(shares(t) for t in [*owned["ids"], owned["mask"], owned["image"]])
    assert owned["again"] is owned["ids"][0]


@pytest.mark.usefixtures("meta_consolidates")
def test_parameters_buffers_and_state_in_a_batch_own_their_storage() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model.requires_grad_(False)  # frozen parameters could travel as plain data
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = {
        "model": model,
        "opt": opt,
        "mean": model[1].running_mean,  # a module's buffer listed beside its module
        "weight": model[0].weight,  # and a parameter
        "xs": [torch.ones(2) for _ in range(10)],
    }
    moved = torchplace.move(batch, "meta", views=True)
    assert all(shares(t) for t in moved["xs"])
    for t in [*model.parameters(), *model.buffers()]:
        assert not shares(t), t.shape
    assert moved["mean"] is model[1].running_mean and moved["weight"] is model[0].weight
    loose = torchplace.move(
        {
            "w": nn.Parameter(torch.ones(2), requires_grad=False),
            "xs": [torch.ones(2) for _ in range(10)],
        },
        "meta",
        views=True,
    )
    assert not shares(loose["w"])


@pytest.mark.usefixtures("meta_consolidates")
def test_module_moves_consolidate_into_owned_results() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(6)])
    torchplace.move(model, "meta")
    assert not any(shares(t) for t in model.parameters())


@pytest.mark.usefixtures("meta_consolidates")
def test_small_tensors_travel_in_groups_of_bounded_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device memory a model move needs beyond the moved bytes is one group at most."""
    sizes: list[int] = []
    real = _transfer.packed_host_copy

    def counted(tensors: list[torch.Tensor], device: torch.device, **kw: Any) -> Any:
        sizes.append(sum(t.nbytes for t in tensors))
        return real(tensors, device, **kw)

    monkeypatch.setattr(_transfer, "packed_host_copy", counted)
    monkeypatch.setattr(_transfer, "OWNED_GROUP_BYTES", 100)
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(6)])  # 12 tensors of 16 or 8 bytes
    torchplace.move(model, "meta")
    assert len(sizes) > 1 and max(sizes) <= 100 and sum(sizes) == 6 * (16 + 8)
    assert not any(shares(t) for t in model.parameters())


# --- the default: a batch's tensors own their storage --------------------------------------------


def labelled_batches(count: int) -> list[dict[str, Any]]:
    """Batches of 8 labels (64 bytes) beside 40 small masks (1 KiB each)."""
    return [
        {"labels": torch.arange(8) + i, "masks": [torch.ones(256) for _ in range(40)]}
        for i in range(count)
    ]


@pytest.mark.usefixtures("meta_consolidates")
def test_a_label_kept_from_each_moved_batch_holds_only_its_own_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loop that keeps one small tensor per batch (labels for a metric; torchmetrics' mAP keeps
    every target) keeps those bytes alone, not each batch's shared buffer (issue 31: 300 kept
    labels held 295.5 MiB as views, 0.1 MiB owned)."""
    packed: list[int] = []
    real = _transfer.packed_host_copy

    def counted(tensors: list[torch.Tensor], device: torch.device, **kw: Any) -> Any:
        packed.append(len(tensors))
        return real(tensors, device, **kw)

    monkeypatch.setattr(_transfer, "packed_host_copy", counted)
    batches = labelled_batches(5)
    kept = [torchplace.move(batch, "meta")["labels"] for batch in batches]
    assert packed == [41] * 5  # each batch still travels as one consolidated copy
    assert [t.untyped_storage().nbytes() for t in kept] == [64] * 5
    assert [(t.shape, t.dtype) for t in kept] == [(b["labels"].shape, torch.int64) for b in batches]
    shared = [torchplace.move(batch, "meta", views=True)["labels"] for batch in batches]
    assert all(t.untyped_storage().nbytes() >= 40 * 1024 for t in shared)  # the opt-in's cost


@pytest.mark.usefixtures("meta_consolidates")
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_label_kept_from_each_loaded_batch_holds_only_its_own_bytes(prefetch: int) -> None:
    batches = labelled_batches(5)
    kept = [batch["labels"] for batch in DeviceLoader(batches, "meta", prefetch=prefetch)]
    assert [t.untyped_storage().nbytes() for t in kept] == [64] * 5
    loader = DeviceLoader(batches, "meta", prefetch=prefetch, views=True)
    assert all(b["labels"].untyped_storage().nbytes() >= 40 * 1024 for b in loader)


def test_the_owned_split_leaves_a_kept_tensor_alone_with_its_bits() -> None:
    """The measurement of issue 31, scaled down, with real bytes on the CPU: each batch packed
    into one buffer, copied once and split (the path of ``views=False``, the default), one
    tensor kept per batch. Each kept tensor holds its own bytes in a storage of its own; the
    same loop with views holds every batch's buffer."""
    owned_kept, view_kept, sources = [], [], []
    for i in range(20):
        labels = random_bits((16,), torch.int64, seed=i)
        masks = [random_bits((1024,), torch.float32, seed=100 + 40 * i + j) for j in range(40)]
        batch = [labels, *masks]
        owned = pack_and_copy(batch, CPU, pin=False, non_blocking=False)
        for a, b in zip(owned, batch, strict=True):
            assert_same(a, b)
        owned_kept.append(owned[0])
        view_kept.append(views(batch)[0][0])
        sources.append(labels)
    for kept, labels in zip(owned_kept, sources, strict=True):
        assert_same(kept, labels)
        assert kept.untyped_storage().nbytes() == labels.nbytes == 128
    assert len({t.untyped_storage().data_ptr() for t in owned_kept}) == 20
    assert sum(t.untyped_storage().nbytes() for t in view_kept) >= 20 * 40 * 4096


def test_views_must_be_a_bool() -> None:
    with pytest.raises(torchplace.TorchplaceError, match=r"views=1 must be True"):
        torchplace.move(torch.ones(2), "meta", views=1)  # type: ignore[arg-type]
    with pytest.raises(torchplace.TorchplaceError, match=r"DeviceLoader\(views='no'\)"):
        DeviceLoader([], "meta", views="no")  # type: ignore[arg-type]


def test_loader_passes_views_on(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []

    def consolidate(
        tensors: Any, target: torch.device, *, non_blocking: bool, views: bool
    ) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
        seen.append(views)
        return {}, []

    from torchplace.moving import _loader

    monkeypatch.setattr(_loader, "consolidate_small", consolidate)
    batches = [[torch.ones(2) for _ in range(3)]]
    assert next(iter(DeviceLoader(batches, "meta", prefetch=0)))[0].device == META
    list(DeviceLoader(batches, "meta", prefetch=0, views=True))
    assert seen == [False, True]  # owned storage unless views=True asks
    assert "views=True" in repr(DeviceLoader(batches, "meta", views=True))


# --- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.requires_cuda
def test_cuda_batch_lands_as_views_bit_identical() -> None:
    cuda = torch.device("cuda", 0)
    tensors = [random_bits((257 + i % 7,), torch.float32, seed=i) for i in range(500)]
    tensors += [random_bits((3, 5), torch.bfloat16, seed=1), torch.zeros(1 << 19)]
    moved = torchplace.move(tensors, "cuda:0", views=True)
    for a, b in zip(moved, tensors, strict=True):
        assert a.device == cuda
        assert_same(a, b)
    sizes = {t.untyped_storage().nbytes() for t in moved[:-1]}
    assert max(sizes) <= VIEW_BUFFER_BYTES and len(moved[0].untyped_storage()) > moved[0].nbytes
    assert moved[-1].untyped_storage().nbytes() == moved[-1].nbytes  # large: its own
    owned = torchplace.move(tensors, "cuda:0")  # the default
    for a, b in zip(owned, tensors, strict=True):
        assert_same(a, b)
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in owned)
    assert len({t.untyped_storage().data_ptr() for t in owned}) == len(owned)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("shared", [True, False], ids=["views", "owned"])
def test_cuda_loader_views_survive_the_next_batches(shared: bool) -> None:
    """A kept tensor must not be overwritten by later batches (record_stream on its storage)."""
    batches = [[torch.full((64,), float(i)) for _ in range(40)] for i in range(6)]
    kept = []
    for batch in DeviceLoader(batches, "cuda:0", prefetch=2, views=shared):
        kept.append(batch[0])
        torch.cuda._sleep(1000)  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    assert [float(t[0]) for t in kept] == [float(i) for i in range(6)]


def test_lone_shapes_and_scalars_are_cut_with_the_strides_of_to() -> None:
    """Shapes held by one tensor each (2-D, 3-D with a dimension of 1, 4-D) and scalars that
    repeat: cut without ``view``, still with ``.to()``'s strides, values and offsets, and each
    usable in place with autograd afterwards."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(2, 5), (2, 1, 3), (1, 2, 2, 3), (), (), (), (), (7,)]
    tensors = [torch.randn(s, generator=gen) for s in shapes]
    out, storages = views(tensors)
    for a, b in zip(out, tensors, strict=True):
        assert a.shape == b.shape and a.stride() == b.clone().stride()
        assert torch.equal(a, b)
    assert_views_of(out, storages, VIEW_BUFFER_BYTES)
    leaf = out[1].requires_grad_()
    (leaf * 2).sum().backward()
    assert torch.equal(leaf.grad, torch.full((2, 1, 3), 2.0))
    with torch.no_grad():
        out[2].mul_(0)
    assert torch.equal(out[0], tensors[0]) and not out[2].any()
