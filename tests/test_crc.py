"""The CRC-32 the reader's threads compute (``checkpoint/_crc.py``): ISA-L's where it imports,
zlib's where not, the same values either way; and ``check_crc``'s default, which checks as the
file is read into host memory with either."""

from __future__ import annotations

import random
import sys
import types
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers import torch_save
from torchplace import CheckpointError, load, load_into
from torchplace.checkpoint import _crc, _host_read
from torchplace.checkpoint._catalog import catalog

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


def _counting_isal(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A fake ISA-L that computes zlib's values and records each call's length."""
    calls: list[int] = []

    def crc32(data: Any, value: int = 0) -> int:
        calls.append(len(memoryview(data)))
        return zlib.crc32(data, value)

    _fake_isal(monkeypatch, crc32)
    assert _crc.fast_crc()  # picked now: its check of a known value is not counted
    calls.clear()
    return calls


def _damaged(tmp_path: Path, numel: int = 3 << 18, *, crcs: bool = True) -> tuple[Path, dict]:
    """A torch zip file whose tensor ``w`` has one bit flipped after the CRCs were recorded."""
    sd = {"w": torch.arange(numel, dtype=torch.float32), "b": torch.ones(3)}
    path = tmp_path / "w.pt"
    torch_save(sd, path, crcs=crcs)
    entry = catalog(path).entries["w"]
    data = bytearray(path.read_bytes())
    data[entry.start + entry.nbytes - 5] ^= 0x10  # one bit, in the last chunk
    path.write_bytes(bytes(data))
    return path, sd


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


def _load_into_refuses(path: Path, sd: dict[str, torch.Tensor]) -> None:
    """``load_into`` of the damaged ``path`` raises naming the record, nothing half-filled."""
    model = nn.Module()
    model.register_buffer("w", torch.zeros_like(sd["w"]))
    model.register_buffer("b", torch.zeros(3))
    with pytest.raises(CheckpointError, match=r"w/data/0 fails its CRC") as e:
        load_into(model, path)
    assert e.value.path == path
    assert not model.w.any()  # nothing half-filled


def test_the_crc32_picked_gives_zlibs_values_bit_for_bit() -> None:
    _check_values(_crc.crc32())


def test_isal_crc32_gives_zlibs_values_bit_for_bit() -> None:
    isal_zlib = pytest.importorskip("isal.isal_zlib", reason="isal is not installed")
    _check_values(isal_zlib.crc32)
    assert _crc.crc32() is isal_zlib.crc32 and _crc.fast_crc()


def test_without_isal_the_crc32_is_zlibs_and_the_default_still_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ``isal`` has no wheel, zlib's CRC-32 is the fallback, and the default check stays
    on: a flipped bit in a zip file never loads silently (it did without the ``fast`` extra)."""
    _without_isal(monkeypatch)
    assert _crc.crc32() is zlib.crc32 and not _crc.fast_crc()
    assert _crc.check_as_read(None) is True
    path, sd = _damaged(tmp_path)
    with pytest.raises(CheckpointError, match=r"w\.pt: is corrupt: w/data/0 fails its CRC") as err:
        load(path)
    assert err.value.path == path
    _load_into_refuses(path, sd)
    assert not torch.equal(load(path, check_crc=False)["w"], sd["w"])  # turned off: loads


def test_isal_is_a_runtime_dependency() -> None:
    """The installed distribution requires isal (no extra needed), and it imports here."""
    from importlib import metadata

    requires = metadata.requires("torchplace") or []
    plain = [r for r in requires if r.startswith("isal") and "extra ==" not in r]
    assert plain, requires
    assert _crc.fast_crc()  # the real one, where the dependency installed


@pytest.mark.parametrize("chunk", [1 << 20, 16 << 20], ids=["many-chunks", "one-chunk"])
def test_with_isal_a_damaged_record_is_caught_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(_host_read, "READ_CHUNK_BYTES", chunk)
    calls = _counting_isal(monkeypatch)
    assert _crc.check_as_read(None) is True
    assert _crc.check_as_read(None, "cuda") is False  # pinned reads: the check's share is larger
    path, sd = _damaged(tmp_path)
    with pytest.raises(CheckpointError, match=r"w\.pt: is corrupt: w/data/0 fails its CRC") as e:
        load(path)
    assert e.value.path == path
    assert sum(calls) == sd["w"].nbytes + sd["b"].nbytes  # every byte, by the picked function
    _load_into_refuses(path, sd)
    bf16 = nn.Module()  # converted as it is read: the file's bytes are what is checked
    bf16.w = nn.Parameter(torch.zeros(sd["w"].shape, dtype=torch.bfloat16))
    bf16.b = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match=r"w/data/0 fails its CRC") as e:
        load_into(bf16, path)
    assert e.value.path == path
    assert not torch.equal(load(path, check_crc=False)["w"], sd["w"])  # turned off: loads


def test_with_isal_a_sound_file_loads_checked_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counting_isal(monkeypatch)
    sd = {"w": torch.randn(1000), "b": torch.arange(7)}
    torch.save(sd, tmp_path / "ok.pt")
    got = load(tmp_path / "ok.pt")
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    assert sum(calls) == sd["w"].nbytes + sd["b"].nbytes


def test_a_file_without_crcs_loads_without_a_warning_unless_the_check_is_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warnings are errors in the tests: the default (on, with ISA-L) says nothing about a
    file saved with torch's CRC-32 option off; only an explicit ``check_crc=True`` warns."""
    _counting_isal(monkeypatch)
    sd = {"w": torch.arange(100.0)}
    path = tmp_path / "nocrc.pt"
    torch_save(sd, path, crcs=False)
    legacy = tmp_path / "legacy.pt"
    torch.save(sd, legacy, _use_new_zipfile_serialization=False)
    for p in (path, legacy):
        for trusted in (False, True):
            assert torch.equal(load(p, trusted=trusted)["w"], sd["w"])
        model = nn.Module()
        model.register_buffer("w", torch.zeros(100))
        assert torch.equal(load_into(model, p).w, sd["w"])
    with pytest.warns(UserWarning, match=r"nocrc\.pt: check_crc=True, but it records no CRC-32"):
        load(path, check_crc=True)


def test_the_default_makes_no_pass_of_its_own_where_torch_load_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``trusted=True`` and ``mmap=True`` are read by ``torch.load``: a check there would be a
    second read of the whole file (zlib's, in zipfile), so the default leaves it to ``True``."""
    _counting_isal(monkeypatch)
    path, sd = _damaged(tmp_path)
    for how in ({"trusted": True}, {"mmap": True}):
        assert not torch.equal(load(path, **how)["w"], sd["w"])
        with pytest.raises(CheckpointError, match=r"w\.pt: is corrupt") as e:
            load(path, check_crc=True, **how)
        assert e.value.path == path


def test_a_broken_isal_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_isal(monkeypatch, lambda data, value=0: 0)
    assert _crc.crc32() is zlib.crc32 and not _crc.fast_crc()
