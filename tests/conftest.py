"""Shared fixtures: the ``devices`` parametrization, the ``requires_cuda`` marker, fake GPUs."""

from __future__ import annotations

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
