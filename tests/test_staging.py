"""Large pageable host tensors reach a CUDA device through a ring of pinned buffers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchplace
from torchplace.moving import _staging, _transfer
from torchplace.moving._staging import STAGE_MIN_BYTES, Stager, stageable

CUDA = torch.device("cuda", 0)
META = torch.device("meta")


def big(**kwargs: object) -> torch.Tensor:
    return torch.empty(STAGE_MIN_BYTES // 4, **kwargs)  # type: ignore[call-overload]


def test_stageable_takes_only_large_plain_contiguous_host_tensors_for_cuda() -> None:
    assert stageable(big(), CUDA)
    assert not stageable(big(), torch.device("cpu"))
    assert not stageable(big(), META)
    assert not stageable(torch.empty(STAGE_MIN_BYTES // 4 - 1), CUDA)  # small: one copy
    assert not stageable(big().reshape(2, -1).t(), CUDA)  # not contiguous
    assert not stageable(big(dtype=torch.complex64).conj(), CUDA)  # a lazy conjugate
    assert not stageable(big().to_sparse(), CUDA)


def test_stageable_leaves_autograd_to_tensor_to() -> None:
    leaf = big(requires_grad=True)
    assert not stageable(leaf, CUDA)  # .to() records the copy in the graph
    with torch.no_grad():
        assert stageable(leaf, CUDA)  # module moves run without autograd
    assert stageable(nn.Parameter(big()).detach(), CUDA)


class _FakeStager:
    """Stands in for ``Stager`` on a machine without CUDA: copies to meta and records calls."""

    made: list[_FakeStager] = []  # noqa: RUF012

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copied: list[torch.Tensor] = []
        self.synced = 0
        _FakeStager.made.append(self)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        self.copied.append(t)
        return t.detach().to(self.device)

    def synchronize(self) -> None:
        self.synced += 1


@pytest.fixture
def fake_stager(monkeypatch: pytest.MonkeyPatch) -> type[_FakeStager]:
    _FakeStager.made = []
    monkeypatch.setattr(_transfer, "Stager", _FakeStager)
    monkeypatch.setattr(_transfer, "stageable", lambda t, target: t.numel() * 4 >= STAGE_MIN_BYTES)
    return _FakeStager


@pytest.mark.parametrize(("non_blocking", "syncs"), [(None, 0), (True, 0), (False, 1)])
def test_move_sends_large_tensors_through_one_stager(
    fake_stager: type[_FakeStager], non_blocking: bool | None, syncs: int
) -> None:
    """The wiring, with meta standing in for CUDA: one ring per move, waited on only if asked."""
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 4))
    weight = model[0].weight
    torchplace.move(model, "meta", non_blocking=non_blocking)
    (stager,) = fake_stager.made
    assert [t is weight for t in stager.copied] == [True]  # the only large tensor
    assert model[0].weight.device == META  # (to meta the parameter is replaced, by design)
    assert stager.synced == syncs


# --- CUDA ---------------------------------------------------------------------------------


@pytest.fixture
def small_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 64 KiB in a ring of 3: a few tensors wrap around it many times."""
    monkeypatch.setattr(_staging, "STAGE_MIN_BYTES", 64 << 10)
    monkeypatch.setattr(_staging, "STAGE_CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(_staging, "STAGE_BUFFERS", 3)


@pytest.mark.requires_cuda
@pytest.mark.usefixtures("small_ring")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex64])
def test_cuda_staged_copies_are_bit_identical(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = [(300 << 10) + 5, 64 << 10, (1 << 20) + 3]  # bytes: partial last chunks
    sources = []
    for n in sizes:
        raw = torch.randint(0, 256, (n - n % 8,), dtype=torch.uint8, generator=gen)
        sources.append(raw.view(dtype) if dtype != torch.bool else raw.bool())
    stager = Stager(CUDA)
    out = [stager.copy(t) for t in sources]
    expected = [t.clone() for t in sources]
    for t in sources:
        t.zero_()  # the host tensors may change as soon as copy returns
    torch.cuda.synchronize()
    for o, e in zip(out, expected, strict=True):
        assert o.device == CUDA and o.dtype == e.dtype and o.shape == e.shape
        assert torch.equal(o.cpu().view(torch.uint8), e.view(torch.uint8))


@pytest.mark.requires_cuda
@pytest.mark.usefixtures("small_ring")
@pytest.mark.parametrize("non_blocking", [None, False])
def test_cuda_staged_model_move_keeps_identity_and_values(non_blocking: bool | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    state = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    torchplace.move(model, "cuda:0", optimizer=opt, non_blocking=non_blocking)
    if non_blocking is False:
        assert torch.cuda.current_stream().query()  # every staged copy done on return
    torchplace.verify(model, "cuda:0", optimizer=opt)
    assert list(model.parameters()) == params
    for p, b, s in zip(params, before, state, strict=True):
        assert torch.equal(p.cpu(), b)
        assert torch.equal(opt.state[p]["exp_avg_sq"].cpu(), s)


@pytest.mark.requires_cuda
def test_cuda_staged_batch_with_grad_keeps_its_graph() -> None:
    leaf = torch.randn(STAGE_MIN_BYTES // 4, requires_grad=True)
    out = torchplace.move({"x": leaf}, "cuda:0")["x"]
    assert out.grad_fn is not None  # copied by .to(), so gradients flow back to the host leaf
    out.sum().backward()
    assert leaf.grad is not None and leaf.grad.device.type == "cpu"
