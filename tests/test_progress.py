"""A progress bar for long loads: shown when asked or on a terminal for a large load, on rank 0
only, one at a time, advanced by the bytes the reader reads."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import torchplace
from torchplace import load, load_into, skeleton
from torchplace.checkpoint import _progress


@pytest.fixture
def bars(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Each bar shown: [total, bytes advanced so far], rich's bar itself not drawn."""
    shown: list[list[int]] = []

    @contextlib.contextmanager
    def recording(total: int, label: str, enabled: bool) -> Iterator[Callable[[int], None]]:
        bar = [total, 0]
        shown.append(bar)

        def advance(n: int) -> None:
            bar[1] += n

        yield advance

    monkeypatch.setattr(_progress, "progress_bar", recording)
    monkeypatch.delenv("RANK", raising=False)
    return shown


@pytest.mark.parametrize("suffix", ["pt", "safetensors"])
def test_a_bar_counts_the_bytes_read_when_asked(
    tmp_path: Path, bars: list[list[int]], suffix: str
) -> None:
    sd = {"a": torch.randn(300, 200), "b": torch.arange(7)}
    path = tmp_path / f"w.{suffix}"
    if suffix == "pt":
        torch.save(sd, path)
    else:
        save_file(sd, str(path))
    load(path)  # not a terminal, not asked: no bar
    assert bars == []
    load(path, progress=True)
    assert bars == [[path.stat().st_size, 300 * 200 * 4 + 7 * 8]]


def test_left_to_itself_a_bar_shows_on_a_terminal_for_a_large_load_only(
    tmp_path: Path, bars: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "w.pt"
    torch.save({"a": torch.ones(1000)}, path)
    monkeypatch.setattr(_progress.sys.stderr, "isatty", lambda: True)
    load(path)
    assert bars == []  # far below LOAD_PROGRESS_MIN_BYTES
    monkeypatch.setattr(_progress, "LOAD_PROGRESS_MIN_BYTES", 1000)
    load(path)
    assert len(bars) == 1 and bars[0][1] == 4000
    load(path, progress=False)
    assert len(bars) == 1


@pytest.mark.parametrize("source", ["legacy", "mmap", "index"])
def test_progress_false_shows_no_bar_on_a_terminal_for_a_large_load(
    tmp_path: Path, bars: list[list[int]], monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """``progress=False`` holds for every file a call reads: a legacy or mapped file that
    ``load_into`` leaves to the whole-file reader, and an index's torch shards."""
    import json

    sd = {"0.weight": torch.randn(4, 3), "0.bias": torch.randn(4)}
    path = tmp_path / "w.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=source != "legacy")
    if source == "index":
        torch.save({"0.bias": sd.pop("0.bias")}, tmp_path / "b.pt")
        torch.save(sd, path)
        weight_map = {"0.weight": "w.pt", "0.bias": "b.pt"}
        path = tmp_path / "m.index.json"
        path.write_text(json.dumps({"weight_map": weight_map}))
    monkeypatch.setattr(_progress.sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(_progress, "LOAD_PROGRESS_MIN_BYTES", 10)
    model = skeleton(nn.Sequential, nn.Linear(3, 4))
    load_into(model, path, progress=False, mmap=source == "mmap")
    if source == "index":
        load(path, progress=False)
    assert bars == []
    assert torch.equal(model[0].weight, torch.load(tmp_path / "w.pt")["0.weight"])


def test_only_rank_0_shows_a_bar(
    tmp_path: Path, bars: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "w.pt"
    torch.save({"a": torch.ones(10)}, path)
    monkeypatch.setenv("RANK", "1")
    load(path, progress=True)
    assert bars == []
    monkeypatch.setenv("RANK", "0")
    load(path, progress=True)
    assert len(bars) == 1


def test_load_into_shows_one_bar_for_an_index_of_shards(
    tmp_path: Path, bars: list[list[int]]
) -> None:
    import json

    first, second = {"0.weight": torch.randn(4, 3)}, {"0.bias": torch.randn(4)}
    save_file(first, str(tmp_path / "s1.safetensors"))
    save_file(second, str(tmp_path / "s2.safetensors"))
    weight_map = {"0.weight": "s1.safetensors", "0.bias": "s2.safetensors"}
    (tmp_path / "m.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_into(skeleton(nn.Sequential, nn.Linear(3, 4)), tmp_path, progress=True)
    assert torch.equal(model[0].weight, first["0.weight"])
    shards = sum((tmp_path / n).stat().st_size for n in ("s1.safetensors", "s2.safetensors"))
    assert bars == [[shards, 4 * 3 * 4 + 4 * 4]]


def test_a_forced_bar_off_a_terminal_says_what_was_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """progress=True with stderr a log file: no live bar, one closing line (not nothing)."""
    path = tmp_path / "w.pt"
    torch.save({"w": torch.ones(1024, 256)}, path)
    torchplace.load(path, progress=True)
    err = capsys.readouterr().err
    # that line alone: no blank line before it (rich's transient bar, never drawn, left one)
    assert re.fullmatch(r"load w\.pt: 1\.0 MiB in \d+\.\d s(, \d+(\.\d)? ([KMGT]i)?B/s)?\n", err), (
        err
    )


_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # cursor moves and line clears


def test_a_bar_on_a_terminal_counts_in_the_binary_units_of_the_summary(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The live bar says MiB and MiB/s, as the closing line off a terminal does (rich's own
    columns say MB, which made 300 MiB read "314.6 MB")."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich takes the captured stderr for a terminal
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "160")
    total = 300 << 20
    with _progress.progress_bar(total, "load big.pt", True) as advance:
        advance(total // 2)
        time.sleep(0.2)  # two samples apart in time: rich has a rate to show
        advance(total - total // 2)
    drawn = [_CONTROL.sub("", line).strip() for line in capsys.readouterr().err.split("\r")]
    last = [line for line in drawn if line.startswith("load big.pt")][-1]
    assert re.fullmatch(r"load big\.pt \S+ 300\.0/300\.0 MiB \d+\.\d [KMGT]iB/s \S+", last), last
    assert not re.search(r"\d ?[kMGT]B\b", "".join(drawn)), drawn


def test_a_load_by_map_counts_to_the_bytes_it_reads(tmp_path: Path, bars: list[list[int]]) -> None:
    """The disk modules' bytes are not read by the load: the bar counts to the resident ones
    and ends full (it counted to the whole file, and ended partly filled)."""

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))

    path = tmp_path / "m.safetensors"
    save_file(make().state_dict(), str(path))
    disk = {"": "cpu", "1": "disk", "2": "disk"}
    torchplace.load_into(torchplace.skeleton(make), path, device_map=disk, progress=True)
    resident = (64 * 64 + 64) * 4
    assert bars == [[resident, resident]]
