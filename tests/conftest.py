"""Shared fixtures: the ``devices`` parametrization, the ``requires_cuda`` marker, fake GPUs,
and a fake world of four ranks for sharded (FSDP2) models."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# One parametrization for every test that runs "on each device": cpu and meta everywhere,
# cuda:0 where a GPU is present. Ids are the device names.
DEVICES = ["cpu", "meta"] + (["cuda:0"] if HAS_CUDA else [])


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--regen-golden",
        action="store_true",
        help="rewrite the golden files under tests/golden from the current output",
    )


@pytest.fixture
def regen_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--regen-golden"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # FakeTensorMode checks the index of a fake CUDA device against the real GPUs when there are
    # any: on a machine with one GPU, a fake cuda:1 is refused ("invalid device ordinal").
    no_fake = HAS_CUDA and torch.cuda.device_count() < 2
    skip_fake = pytest.mark.skip(reason="fakes cuda:1, which a machine with one real GPU refuses")
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device (run on a GPU machine)")
    for item in items:
        if "requires_cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if "fake_cuda" in item.keywords and no_fake:
            item.add_marker(skip_fake)


@pytest.fixture(params=DEVICES, ids=DEVICES)
def any_device(request: pytest.FixtureRequest) -> torch.device:
    """Each device this machine can test on, one test per device."""
    return torch.device(request.param)


@pytest.fixture
def fake_world() -> Iterator[object]:
    """A process group of four ranks, all played by this process (PyTorch's fake backend)."""
    dist = pytest.importorskip("torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of its own")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=4)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()
