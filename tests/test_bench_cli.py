"""``torchplace bench``: figures for what the machine has, and a clear word when it has no GPU."""

from __future__ import annotations

import json

import pytest
import torch

from torchplace.cli import _bench, main
from torchplace.cli._bench import measure

QUICK = ["--size", "1", "--tensors", "12", "--repeat", "1"]


@pytest.fixture
def no_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    mps = getattr(torch.backends, "mps", None)
    if mps is not None:
        monkeypatch.setattr(mps, "is_available", lambda: False)
    xpu = getattr(torch, "xpu", None)
    if xpu is not None:
        monkeypatch.setattr(xpu, "is_available", lambda: False)


@pytest.mark.usefixtures("no_accelerator")
def test_json_without_an_accelerator_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--json", *QUICK]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu"
    assert report["accelerator"] is False
    assert "no accelerator was found" in report["note"]
    assert report["tensors"] == 12
    rows = report["results"]
    assert [(r["direction"], r["copy"]) for r in rows] == [
        ("host", "pageable"),
        ("host", "per-tensor"),
        ("host", "consolidated"),
    ]
    assert rows[0]["fraction"] == 1.0
    for row in rows:
        assert row["gb_per_s"] > 0
        assert row["seconds"] > 0
        assert row["fraction"] > 0
    assert rows[1]["bytes"] == rows[2]["bytes"]
    assert rows[1]["tensors"] == 12


@pytest.mark.usefixtures("no_accelerator")
def test_table_without_an_accelerator(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *QUICK]) == 0
    out = capsys.readouterr().out
    assert "torchplace bench" in out
    assert "GB/s" in out
    assert "consolidated" in out
    assert "no accelerator" in out


def test_explicit_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--device", "cpu", "--json", *QUICK]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu"
    assert "the CPU was asked for" in report["note"]


@pytest.mark.usefixtures("no_accelerator")
def test_auto_and_a_number_without_an_accelerator(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--device", "auto", "--json", *QUICK]) == 0
    assert "no accelerator was found" in json.loads(capsys.readouterr().out)["note"]
    assert main(["bench", "--device", "0", *QUICK]) == 2  # accelerator 0, which is absent
    assert "--device 0: accelerator 0 requested" in capsys.readouterr().err


def test_only_the_large_copies_set_the_best() -> None:
    from torchplace.cli._bench import _rates

    rows = _rates(
        [
            ("host", "pageable", 1 << 20, 1, 1e-3),
            ("host", "per-tensor", 1024, 1, 1e-7),  # one small tensor (--tensors 1), fast
            ("host", "consolidated", 1024, 1, 1e-6),
        ]
    )
    assert rows[0].fraction == 1.0
    assert rows[1].fraction > 1.0  # faster than the large copy, and shown as such


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("meta", "--device meta: meta tensors have no data"),
        ("cdua", "--device cdua: unknown"),
        ("hpu", "--device hpu: 'hpu': this PyTorch has no hpu backend"),
        ("²", "--device ²: unknown"),  # a digit to str.isdigit, but no number to int()
    ],
)
def test_devices_that_cannot_be_measured(
    spec: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--device", spec]) == 2
    assert message in capsys.readouterr().err


def test_a_size_too_large_to_allocate_is_explained(capsys: pytest.CaptureFixture[str]) -> None:
    # 100 TB: more than any host has, so the first allocation fails at once
    assert main(["bench", "--device", "cpu", "--size", str(100 << 20)]) == 1
    assert "could not run on cpu" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--size", "--tensors", "--repeat"])
def test_counts_must_be_positive(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", option, "0"])
    assert info.value.code == 2
    assert "above 0" in capsys.readouterr().err


@pytest.mark.requires_cuda
def test_cuda_measures_both_directions() -> None:
    rows = measure(torch.device("cuda:0"), size=8 << 20, tensors=50, repeat=2)
    kinds = [(m.direction, m.copy) for m in rows]
    for direction in ("host-to-device", "device-to-host"):
        for copy in ("pageable", "pinned", "per-tensor", "consolidated"):
            assert (direction, copy) in kinds
    assert max(m.fraction for m in rows if m.tensors == 1) == 1.0


def test_a_size_past_any_tensor_is_bad_usage(capsys: pytest.CaptureFixture[str]) -> None:
    # 2**60 MiB: more bytes than a tensor's size can count (it was a raw TypeError)
    assert main(["bench", "--device", "cpu", "--size", str(1 << 60)]) == 2
    assert "--size 1152921504606846976 MiB" in capsys.readouterr().err


def test_interrupted_bench_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_bench, "measure", interrupted)
    assert main(["bench", "--device", "cpu", *QUICK]) == 130
    assert capsys.readouterr().err == "torchplace bench: interrupted\n"
