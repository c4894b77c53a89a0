"""``inspect`` of the largest checkpoints: a bound on what a pickle may hold, and tables of any
length drawn as rich draws them.

Timing targets (a 100,000-tensor index catalogued in under 1 s and inspected in under 3 s) live
in ``benchmarks/bench_catalog.py``; here, what the faster paths print and refuse.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
import torch

from torchplace._errors import CheckpointError
from torchplace.checkpoint import _checkpoint_cli, _pickle_reader
from torchplace.checkpoint._catalog import catalog, describe_file
from torchplace.cli import main

safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture
def small_bound(monkeypatch: pytest.MonkeyPatch) -> int:
    """A bound of 10,000 objects, so that a pickle past it is quick to make and to refuse."""
    monkeypatch.delenv("TORCHPLACE_MAX_PICKLE_OBJECTS", raising=False)
    monkeypatch.setattr(_pickle_reader, "MAX_PICKLE_OBJECTS", 10_000, raising=False)
    return 10_000


@pytest.mark.parametrize("kind", ["zip", "legacy"])
def test_a_pickle_of_more_objects_than_the_bound_is_refused(
    tmp_path: Path, small_bound: int, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file of 2 million integers beside a tensor (20 million took 42 s and 3.8 GB to inspect)
    stops at the bound with torchplace's error naming the file, the bound and the way past it,
    from the catalog, describe_file and the command line alike."""
    path = tmp_path / "ints.pt"
    state = {"w": torch.ones(2), "ids": list(range(2_000_000))}
    torch.save(state, path, _use_new_zipfile_serialization=kind == "zip")
    for read in (catalog, describe_file):
        with pytest.raises(CheckpointError) as caught:
            read(path)
        message = str(caught.value)
        assert message.startswith(f"{path}: its pickle holds more than 10,000 objects")
        assert "TORCHPLACE_MAX_PICKLE_OBJECTS" in message and "nothing was run" in message
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert "torchplace inspect: error:" in err and "10,000 objects" in err


def test_the_bound_is_raised_by_its_variable_and_a_bad_value_is_named(
    tmp_path: Path, small_bound: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ints.pt"
    torch.save({"ids": list(range(20_000)), "w": torch.arange(3.0)}, path)
    with pytest.raises(CheckpointError, match="more than 10,000 objects"):
        catalog(path)
    monkeypatch.setenv("TORCHPLACE_MAX_PICKLE_OBJECTS", "30000")
    (record,) = describe_file(path)
    assert (record.name, record.dtype, record.shape, record.nbytes) == ("w", "float32", (3,), 12)
    monkeypatch.setenv("TORCHPLACE_MAX_PICKLE_OBJECTS", "lots")
    with pytest.raises(CheckpointError, match=r"TORCHPLACE_MAX_PICKLE_OBJECTS='lots' is not a"):
        catalog(path)


def test_a_state_dict_costs_two_objects_a_tensor(tmp_path: Path, small_bound: int) -> None:
    """What the bound counts: a state dict of 4,000 tensors (2 a tensor: name and tensor) reads
    under a bound of 10,000, so the default of 1,000,000 reads 500,000 tensors."""
    path = tmp_path / "many.pt"
    state = {f"layers.{i}.weight": torch.full((2,), float(i)) for i in range(4_000)}
    torch.save(state, path)
    entries = catalog(path).entries
    assert list(entries) == list(state)
    assert all(e.shape == (2,) and e.dtype == "float32" for e in entries.values())


def test_a_tensor_among_many_plain_values_is_found_under_its_path(tmp_path: Path) -> None:
    """The walk looks only into what may hold a tensor: one nested in a long list of numbers
    is still found, under its index."""
    path = tmp_path / "mixed.pt"
    values: list[object] = [*range(5_000), {"w": torch.ones(3)}, *range(5_000)]
    torch.save({"values": values, "t": (1, 2.0, "x", torch.zeros(2))}, path)
    assert list(catalog(path).entries) == ["values.5000.w", "t.3"]


def _rich_table(title: str, headers: list[str], rows: list[list[str]]) -> str:
    """The table as rich's own Table draws it into a pipe (what inspect printed before)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(title))
    for col in headers:
        justify = "right" if col in ("tensors", "bytes") else "left"
        table.add_column(col, justify=justify, no_wrap=True)
    for row in rows:
        table.add_row(*(Text(c) for c in row))
    out = io.StringIO()
    console = Console(file=out, width=1000, color_system=None, emoji=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


@pytest.mark.parametrize("seed", range(4))
def test_tables_are_drawn_as_rich_draws_them(seed: int) -> None:
    """The table inspect draws line by line (rich's took minutes for 100,000 rows) is, cell for
    cell, rich's: wide characters, right-aligned sizes, a title centred over it."""
    from rich.console import Console

    rng = random.Random(seed)
    alphabet = "abcxyz._0123456789重み权"
    headers = ["name", "", "tensors", "bytes"]
    rows = [
        ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))), "", str(n), f"{n} B"]
        for n in (rng.randint(0, 10**9) for _ in range(rng.randint(1, 40)))
    ]
    out = io.StringIO()
    console = Console(file=out, width=40, color_system=None, emoji=False)
    _checkpoint_cli._print_rows(console, "title", headers, rows, right=("tensors", "bytes"))
    drawn = "\n".join(line.rstrip() for line in out.getvalue().splitlines())
    assert drawn == _rich_table("title", headers, rows)


def test_inspect_lists_every_tensor_of_a_large_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every tensor of a 3,000-tensor index in 4 shards, as a table and as JSON."""
    from safetensors.torch import save_file

    names = [f"model.layers.{i // 30}.experts.{i % 30}.w" for i in range(3_000)]
    listed = {}
    for s in range(4):
        shard = f"model-{s + 1:05d}-of-00004.safetensors"
        part = names[s * 750 : (s + 1) * 750]
        save_file({n: torch.ones(2) for n in part}, tmp_path / shard)
        listed.update(dict.fromkeys(part, shard))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": listed}))
    assert main(["inspect", str(index), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert sorted(t["name"] for t in summary["tensors"]) == sorted(names)  # each shard's in
    # the order of its header (which safetensors sorts)
    assert summary["totals"]["count"] == 3_000
    assert main(["inspect", str(index)]) == 0
    table = capsys.readouterr().out
    lines = [line for line in table.splitlines() if line.startswith("│ model.layers.")]
    listed_names = [line.split(" │ ")[0].removeprefix("│ ").rstrip() for line in lines]
    assert listed_names == [t["name"] for t in summary["tensors"]]
