"""torchplace doctor: a verified round trip and an honest verdict, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import check_golden
from torchplace.cli import _doctor, main


def test_doctor_is_healthy_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--no-bandwidth"]) == 0
    out = capsys.readouterr().out
    assert "round trip -> cpu" in out
    assert "skeleton move -> meta" in out
    assert "Verdict: healthy." in out


def test_doctor_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--no-bandwidth"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["healthy"] is True and report["problems"] == []
    assert report["versions"]["torch"] == torch.__version__
    assert report["devices"][-1]["device"] == "cpu"
    checks = [c["check"] for c in report["checks"]]
    assert checks[0] == "round trip -> cpu" and "values back on cpu bit for bit" in checks
    assert all(c["ok"] for c in report["checks"])


def test_a_failing_check_becomes_a_verdict_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(hops: list[torch.device]) -> list[dict[str, object]]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(_doctor, "_round_trip", broken)
    assert main(["doctor", "--no-bandwidth"]) == 1
    out = capsys.readouterr().out
    assert "Verdict: needs fixing." in out
    assert "round trip failed: CUDA error: an illegal memory access" in out


def test_a_failing_hop_names_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hops that worked stay reported, and the problem names the device that broke."""
    from torchplace import _devices
    from torchplace.moving import _move

    real_move = _move.move

    def move(obj: object, device: object, /, **kwargs: object) -> object:
        if torch.device(device).type == "meta":  # type: ignore[arg-type]
            raise RuntimeError("CUDA error: no kernel image is available for execution")
        return real_move(obj, device, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_devices, "available", lambda: [torch.device("meta"), torch.device("cpu")])
    monkeypatch.setattr(_move, "move", move)
    found = _doctor.diagnose(bandwidth=False)
    checks = {c["check"]: c for c in found.checks}
    assert checks["round trip -> cpu"]["ok"]
    assert not checks["round trip -> meta"]["ok"]
    assert any(
        p.startswith("round trip -> meta: RuntimeError: CUDA error: no kernel image")
        for p in found.problems
    )


def test_bandwidth_is_measured_on_every_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only CUDA: an MPS (or XPU) machine gets its copy bandwidth too."""
    from torchplace import _devices

    mps = torch.device("mps:0")
    monkeypatch.setattr(_devices, "available", lambda: [mps, torch.device("cpu")])
    monkeypatch.setattr(_doctor, "_round_trip", lambda hops: [])
    monkeypatch.setattr(_doctor, "_bandwidth", lambda dev: [{"device": str(dev)}])
    found = _doctor.diagnose(bandwidth=True)
    assert found.bandwidth == [{"device": "mps:0"}]


def test_a_device_that_cannot_be_read_hides_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """One broken GPU: the others keep their memory figures and the problem names the GPU."""
    from types import SimpleNamespace

    from torchplace import _devices

    def properties(dev: torch.device) -> object:
        if dev.index == 1:
            raise RuntimeError("CUDA error: uncorrectable ECC error encountered")
        return SimpleNamespace(name="GPU", major=9, minor=0)

    cuda = [torch.device("cuda:0"), torch.device("cuda:1")]
    monkeypatch.setattr(_devices, "available", lambda: [*cuda, torch.device("cpu")])
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (1 << 30, 2 << 30))
    monkeypatch.setattr(_doctor, "_round_trip", lambda hops: [])
    found = _doctor.diagnose(bandwidth=False)
    assert [row["device"] for row in found.devices] == ["cuda:0", "cuda:1", "cpu"]
    assert found.devices[0]["memory_free"] == 1 << 30
    assert any(
        p.startswith("reading cuda:1 failed: CUDA error: uncorrectable") for p in found.problems
    )


@pytest.mark.parametrize(
    ("first_line", "version"),
    [
        # an H200 host (open kernel module); "for" is what a word count found there
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
            "(dvs-builder@U16-I3-B03-4-3)  Thu Oct 30 05:22:38 UTC 2025",
            "580.159.04",
        ),
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC "
            "2023",
            "535.104.05",
        ),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  550.54.15  Release Build  "
            "(dvs-builder@U16-T02-35-3)  Tue Mar  5 22:15:33 UTC 2024",
            "550.54.15",
        ),
        (
            "NVRM version: NVIDIA UNIX ppc64le Kernel Module  418.67  Sat Apr  6 03:07:24 CDT 2019",
            "418.67",
        ),
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  390.157  Wed Oct 12 09:19:07 UTC 2022",
            "390.157",
        ),
        (
            "NVRM version: NVIDIA UNIX Kernel Module for aarch64  34.1.1  Release Build  "
            "(buildbrain@mobile-u64-5414-d7000)  Mon May 16 21:12:24 PDT 2022",
            "34.1.1",
        ),
        ("NVRM version: a format never seen\n", "NVRM version: a format never seen"),
        ("", None),
    ],
    ids=[
        "open-module-h200",
        "x86_64",
        "open-module-aarch64",
        "ppc64le",
        "legacy",
        "tegra",
        "unknown",
        "empty",
    ],
)
def test_the_driver_version_is_read_from_any_first_line(
    first_line: str, version: str | None, tmp_path: Path
) -> None:
    assert _doctor.driver_version(first_line) == version
    proc = tmp_path / "version"
    proc.write_text(f"{first_line}\nGCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1)\n")
    assert _doctor._nvidia_driver(str(proc)) == version
    assert _doctor._nvidia_driver(str(tmp_path / "absent")) is None


def test_cpu_only_torch_beside_an_nvidia_driver_is_diagnosed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_doctor, "_nvidia_driver", lambda: "550.54")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    found = _doctor.diagnose(bandwidth=False)
    assert not found.healthy
    assert any("CPU-only build; install a CUDA build" in p for p in found.problems)
    assert any("CUDA_VISIBLE_DEVICES='' hides every GPU" in p for p in found.problems)


def test_a_gpu_torch_cannot_use_is_diagnosed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver and a CUDA build of torch, yet no GPU: not healthy, and doctor says why."""

    def too_old() -> None:
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 11040).")

    monkeypatch.setattr(_doctor, "_nvidia_driver", lambda: "470.57")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "init", too_old)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    found = _doctor.diagnose(bandwidth=False)
    assert not found.healthy
    assert any(
        "sees no GPU (RuntimeError: The NVIDIA driver on your system is too old" in p
        for p in found.problems
    )


def test_a_broken_local_rank_is_diagnosed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a script's torchplace.device() would fail on, doctor reports (with markup intact)."""
    monkeypatch.setenv("LOCAL_RANK", "[abc]")
    assert main(["doctor", "--no-bandwidth"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "torchplace.device('auto') fails here: LOCAL_RANK='[abc]' is not an integer" in out


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "doctor" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the golden file is the CPU-only output")
def test_doctor_output_golden(
    capsys: pytest.CaptureFixture[str], regen_golden: bool, monkeypatch: pytest.MonkeyPatch
) -> None:

    # What differs between machines is fixed, so the golden file holds on any CPU machine.
    fixed = {
        "torchplace": "X",
        "torch": "X",
        "python": "X",
        "platform": "X",
        "cuda (torch build)": "None",
    }
    monkeypatch.setattr(_doctor, "_versions", lambda: fixed)
    monkeypatch.setattr(_doctor, "_nvidia_driver", lambda: None)
    monkeypatch.setattr(
        _doctor, "_device_rows", lambda devices: [{"device": "cpu", "name": "x86_64", "cores": 2}]
    )
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["doctor", "--no-bandwidth"]) == 0
    text = capsys.readouterr().out
    check_golden("doctor_cpu.txt", text, regen_golden)


@pytest.mark.slow
def test_version_and_module_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess
    import sys

    import torchplace

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"torchplace {torchplace.__version__}"
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "torchplace", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == f"torchplace {torchplace.__version__}"
