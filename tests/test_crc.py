"""The CRC-32 the reader's threads compute (``checkpoint/_crc.py``): ISA-L's where it imports,
zlib's where not, the same values either way."""

from __future__ import annotations

import random
import sys
import types
import zlib
from collections.abc import Callable, Iterator

import pytest
import torch

from torchplace.checkpoint import _crc

_LENGTHS = [0, 1, 7, 4095, 4096, (1 << 20) + 3]


@pytest.fixture(autouse=True)
def _fresh_pick() -> Iterator[None]:
    """The CRC-32 function picked again for each test, and again after its imports are put back."""
    _crc._pick.cache_clear()
    yield
    _crc._pick.cache_clear()


def _without_isal(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import isal.isal_zlib`` raises ImportError, as where it is not installed."""
    monkeypatch.setitem(sys.modules, "isal", None)
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)


def _fake_isal(monkeypatch: pytest.MonkeyPatch, crc32: Callable[..., int]) -> None:
    """An importable ``isal.isal_zlib`` whose ``crc32`` is ``crc32``."""
    package, module = types.ModuleType("isal"), types.ModuleType("isal.isal_zlib")
    module.crc32 = crc32  # type: ignore[attr-defined]
    package.isal_zlib = module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "isal", package)
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", module)


def _check_values(crc32: Callable[..., int]) -> None:
    rng = random.Random(32)
    for n in _LENGTHS:
        data = rng.randbytes(n)
        assert crc32(data) == zlib.crc32(data), n
        start = rng.getrandbits(32)
        assert crc32(data, start) == zlib.crc32(data, start), n
        view = (
            memoryview(torch.frombuffer(bytearray(data), dtype=torch.uint8).numpy()) if n else b""
        )
        assert crc32(view) == zlib.crc32(data), n  # a tensor's bytes, as the reader passes them


def test_the_crc32_picked_gives_zlibs_values_bit_for_bit() -> None:
    _check_values(_crc.crc32())


def test_isal_crc32_gives_zlibs_values_bit_for_bit() -> None:
    isal_zlib = pytest.importorskip("isal.isal_zlib", reason="isal is not installed")
    _check_values(isal_zlib.crc32)
    assert _crc.crc32() is isal_zlib.crc32 and _crc.fast_crc()


def test_a_broken_isal_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_isal(monkeypatch, lambda data, value=0: 0)
    assert _crc.crc32() is zlib.crc32 and not _crc.fast_crc()


def test_without_isal_the_crc32_is_zlibs(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_isal(monkeypatch)
    assert _crc.crc32() is zlib.crc32 and not _crc.fast_crc()
