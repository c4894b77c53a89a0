"""``torchplace bench``: figures for what the machine has, and a clear word when it has no GPU."""

from __future__ import annotations

import json
import re

import pytest
import torch

from torchplace import TorchplaceError
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


def never_measured(*args: object, **kwargs: object) -> None:
    raise AssertionError("measure ran: the memory check let the flags through")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--size", str(100 << 20)], "--size 104857600 MiB needs more host memory than"),
        (["--tensors", "100000000"], "--tensors 100000000 needs more host memory than"),
        (
            ["--size", str(100 << 20), "--tensors", "100000000"],
            "--size 104857600 MiB with --tensors 100000000 needs",
        ),
    ],
    ids=["100TB", "1e8-tensors", "both"],
)
def test_flags_past_the_memory_available_are_refused_before_allocating(
    flags: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # On a host whose kernel overcommits, 100 TB was allocated, and the process was killed.
    monkeypatch.setattr(_bench, "measure", never_measured)
    monkeypatch.setattr(_bench, "_host_available", lambda: 16 << 30)
    assert main(["bench", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"torchplace bench: {message}"), err
    assert "bench takes at most 90% of the 16.0 GiB available, 14.4 GiB" in err
    fixes = [int(n) for n in re.findall(r"--(?:size|tensors) (\d+)(?: or less|\s+and)", err)]
    assert fixes, err
    size, tensors = 256, 500
    for flag, value in zip(re.findall(r"use (.*)", err)[0].split(" and "), fixes, strict=True):
        if flag.startswith("--size"):
            size = value
        else:
            tensors = value
    _bench.check_memory(torch.device("cpu"), size, tensors)  # the advice fits


def test_the_largest_size_that_fits_is_the_one_suggested(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_bench, "_host_available", lambda: 10 << 30)
    with pytest.raises(TorchplaceError, match=r"use --size (\d+) or less") as info:
        _bench.check_memory(torch.device("cpu"), 1 << 20, 500)
    best = int(re.findall(r"use --size (\d+)", str(info.value))[0])
    _bench.check_memory(torch.device("cpu"), best, 500)
    with pytest.raises(TorchplaceError, match=rf"--size {best + 1} MiB needs more host memory"):
        _bench.check_memory(torch.device("cpu"), best + 1, 500)


def test_the_device_memory_is_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_bench, "_host_available", lambda: 1 << 40)
    monkeypatch.setattr(_bench, "free_memory", lambda dev: 1 << 30)
    cuda = torch.device("cuda", 0)  # nothing touches it: the figures are made up
    _bench.check_memory(cuda, 256, 500)
    with pytest.raises(TorchplaceError, match=r"--size 2048 MiB needs more memory on cuda:0 "):
        _bench.check_memory(cuda, 2048, 500)
    # Pinned buffers round up to a power of two: 220 MiB pinned each way takes 2 x 256 MiB,
    # so the host needs 952 MiB, not 4 x 220 = 880 MiB, of the 921.6 MiB bench may take.
    monkeypatch.setattr(_bench, "_host_available", lambda: 1 << 30)
    with pytest.raises(TorchplaceError, match=r"--size 220 MiB needs more host memory"):
        _bench.check_memory(cuda, 220, 1)
    _bench.check_memory(cuda, 200, 1)


def test_unknown_memory_lets_the_copies_try(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_bench, "_host_available", lambda: None)
    monkeypatch.setattr(_bench, "free_memory", lambda dev: None)
    _bench.check_memory(torch.device("cuda", 0), 1 << 40, 10**9)


def test_copies_that_fail_anyway_are_explained(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory\nmore")

    monkeypatch.setattr(_bench, "measure", out_of_memory)
    assert main(["bench", "--device", "cpu", *QUICK]) == 1
    err = capsys.readouterr().err
    assert "could not run on cpu (DefaultCPUAllocator: can't allocate memory)" in err


@pytest.mark.parametrize("option", ["--size", "--tensors", "--repeat"])
def test_counts_must_be_positive(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", option, "0"])
    assert info.value.code == 2
    assert "above 0" in capsys.readouterr().err


@pytest.mark.parametrize("count", ["1001", "1000000000000"])
def test_repeat_has_an_upper_bound(count: str, capsys: pytest.CaptureFixture[str]) -> None:
    from torchplace.cli._main import _parser

    with pytest.raises(SystemExit) as info:  # parsed only: an unbounded run is never started
        _parser("bench").parse_args(["bench", "--repeat", count])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --repeat: expected 1 to 1000 timed runs, got '{count}'" in err


def test_repeat_at_its_bound_is_accepted() -> None:
    from torchplace.cli._main import _parser

    args = _parser("bench").parse_args(["bench", "--repeat", "1000"])
    assert args.repeat == 1000


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
