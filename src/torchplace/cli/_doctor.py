"""``torchplace doctor``: is this machine ready to put tensors where they belong?

It reports versions and devices, sends a small model (tied embedding, BatchNorm, Adam state) and a
nested batch through every available device and back with ``verify`` after each hop, checks the
values came back bit for bit, measures copy bandwidth where an accelerator exists, and closes
with a verdict listing what to fix. Every check is fenced: a failing one becomes a verdict line,
never a traceback.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Diagnosis", "diagnose", "register"]


@dataclass
class Diagnosis:
    """What ``doctor`` found: facts, checks (name, ok, detail) and problems with their fixes."""

    versions: dict[str, str] = field(default_factory=dict)
    devices: list[dict[str, Any]] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    bandwidth: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "versions": self.versions,
            "devices": self.devices,
            "checks": self.checks,
            "bandwidth": self.bandwidth,
            "problems": self.problems,
            "healthy": self.healthy,
        }


class _DoctorModel(nn.Module):
    """Small, with the traps doctor checks: a tied embedding, BatchNorm buffers, Adam state."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        x = self.norm(self.embed(batch["ids"]))
        out: torch.Tensor = self.head(x) * batch["extra"][0]["scale"]
        return out


def _versions() -> dict[str, str]:
    from .. import __version__

    versions = {
        "torchplace": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "cuda (torch build)": str(torch.version.cuda),
    }
    hip = getattr(torch.version, "hip", None)
    if hip:
        versions["rocm (torch build)"] = str(hip)
    if torch.cuda.is_available():
        versions["cudnn"] = str(torch.backends.cudnn.version())  # type: ignore[no-untyped-call]
    driver = _nvidia_driver()
    if driver:
        versions["nvidia driver"] = driver
    return versions


# A driver version: 535.104.05, 580.159.04, 390.157, or Tegra's 34.1.1. Dates on the same line
# (01:15:15, 2023) and the build host (U16-I3-B03-4-3) never match: digits and dots only.
_DRIVER_VERSION = re.compile(r"(?<![\w.])(\d+\.\d+(?:\.\d+)*)(?![\w.])")


def _nvidia_driver(path: str = "/proc/driver/nvidia/version") -> str | None:
    """The NVIDIA kernel module's version, read from ``path``; None without the driver."""
    try:
        with open(path) as f:
            first = f.readline()
    except OSError:
        return None
    return driver_version(first)


def driver_version(first_line: str) -> str | None:
    """The version in the first line of ``/proc/driver/nvidia/version``: the first word made of
    numbers and dots, wherever the module's description puts it. The whole line when it holds
    none (a format not seen yet), None when it is empty.

    >>> driver_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  "
    ...                "Release Build  (dvs-builder@U16-I3-B03-4-3)  Thu Oct 30 2025")
    '580.159.04'
    """
    found = _DRIVER_VERSION.search(first_line.partition(":")[2] or first_line)
    if found is not None:
        return found.group(1)
    return first_line.strip() or None


def _device_rows(devices: list[torch.device]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for dev in devices:
        row: dict[str, Any] = {"device": str(dev)}
        if dev.type == "cuda":
            props = torch.cuda.get_device_properties(dev)
            free, total = torch.cuda.mem_get_info(dev)
            row |= {
                "name": props.name,
                "memory_total": int(total),
                "memory_free": int(free),
                "capability": f"{props.major}.{props.minor}",
            }
        elif dev.type == "cpu":
            row |= {"name": platform.processor() or platform.machine(), "cores": os.cpu_count()}
        rows.append(row)
    return rows


def _round_trip(hops: list[torch.device]) -> list[dict[str, Any]]:
    """Send the model, its Adam state and a batch through each hop, verifying after each."""
    from ..looking._inspect import stragglers
    from ..moving._move import move

    torch.manual_seed(0)
    model = _DoctorModel()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch: dict[str, Any] = {
        "ids": torch.randint(0, 32, (8,)),
        "extra": [{"scale": torch.tensor(2.0)}],
    }
    model(batch).sum().backward()
    opt.step()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    start_state = {k: v.clone() for k, v in opt.state[model.embed.weight].items()}
    start_batch = (batch["ids"].clone(), batch["extra"][0]["scale"].clone())
    results: list[dict[str, Any]] = []
    for dev in hops:
        began = time.perf_counter()
        try:
            move(model, dev, optimizer=opt)
            batch = move(batch, dev)  # the batch travels hop to hop too, device to host included
            left = stragglers(model, dev, optimizer=opt) + stragglers(batch, dev)
            tie = model.embed.weight is model.head.weight
            ok = not left and tie
            detail = "placement verified, tie kept"
            if left:
                names = ", ".join(s.name for s in left[:3])
                detail = f"{len(left)} tensor(s) left behind: {names}"
            elif not tie:
                detail = "the tied embedding/head weight came apart"
            if ok and dev.type != "meta":
                model.eval()  # the model really runs there (eval: running stats stay as they were)
                with torch.no_grad():
                    model(batch)
                model.train()
        except Exception as exc:  # name the device that broke; the later hops cannot run
            detail = f"{type(exc).__name__}: {exc}"
            results.append({"check": f"round trip -> {dev}", "ok": False, "detail": detail})
            return results
        results.append(
            {
                "check": f"round trip -> {dev}",
                "ok": ok,
                "detail": detail,
                "seconds": round(time.perf_counter() - began, 4),
            }
        )
    if hops and hops[-1].type == "cpu":
        results.append(_values_back(model, opt, batch, start, start_state, start_batch))
    return results


def _values_back(
    model: _DoctorModel,
    opt: torch.optim.Optimizer,
    batch: dict[str, Any],
    start: dict[str, torch.Tensor],
    start_state: dict[str, torch.Tensor],
    start_batch: tuple[torch.Tensor, torch.Tensor],
) -> dict[str, Any]:
    """Back on the CPU after the round trip: parameters, Adam state and batch bit for bit."""
    now = model.state_dict()
    same = all(torch.equal(v, now[k]) for k, v in start.items())
    same_state = all(
        torch.equal(v, opt.state[model.embed.weight][k].cpu()) for k, v in start_state.items()
    )
    same_batch = torch.equal(start_batch[0], batch["ids"]) and torch.equal(
        start_batch[1], batch["extra"][0]["scale"]
    )
    ok = same and same_state and same_batch
    return {
        "check": "values back on cpu bit for bit",
        "ok": ok,
        "detail": "parameters, Adam state and batch identical"
        if ok
        else "values changed in transit",
    }


def _meta_check() -> dict[str, Any]:
    """A move to meta replaces Parameters: the optimizer must be re-bound and the tie kept."""
    from ..looking._inspect import stragglers
    from ..moving._move import move

    model = _DoctorModel()
    opt = torch.optim.Adam(model.parameters())
    move(model, "meta", optimizer=opt)
    rebound = opt.param_groups[0]["params"][0] is model.embed.weight
    ok = rebound and not stragglers(model, "meta", optimizer=opt)
    detail = "optimizer re-bound, tie kept" if ok else "optimizer not re-bound after a meta move"
    return {"check": "skeleton move -> meta", "ok": ok, "detail": detail}


def _bandwidth(dev: torch.device) -> list[dict[str, Any]]:
    """A short run of ``torchplace bench``: large and small copies both ways."""
    from ._bench import measure

    return [
        {"device": str(dev), "copy": f"{m.direction} {m.copy}", "GB/s": round(m.gb_per_s, 2)}
        for m in measure(dev, size=64 << 20, tensors=100, repeat=2)
    ]


def _environment_problems() -> list[str]:
    problems: list[str] = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    driver = _nvidia_driver() or shutil.which("nvidia-smi")
    if driver and torch.version.cuda is None and not getattr(torch.version, "hip", None):
        problems.append(
            f"an NVIDIA driver is installed but torch {torch.__version__} is a CPU-only build; "
            "install a CUDA build of torch (see pytorch.org for the right index URL)"
        )
    hidden = visible is not None and visible.strip() in ("", "-1")
    if hidden and driver:
        problems.append(
            f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU; unset it or list the GPUs to use"
        )
    elif driver and torch.version.cuda is not None and not torch.cuda.is_available():
        try:  # fails without a usable GPU, saying why (a driver too old for this build, ...)
            torch.cuda.init()  # type: ignore[no-untyped-call]
            why = "torch.cuda.is_available() is False"
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        problems.append(
            f"an NVIDIA driver is installed but torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}) sees no GPU ({why}); check nvidia-smi, and that the driver "
            "supports this CUDA version and CUDA_VISIBLE_DEVICES names existing GPUs"
        )
    from .._devices import device
    from .._errors import TorchplaceError

    try:
        device("auto")  # what a script's torchplace.device() would pick, LOCAL_RANK included
    except TorchplaceError as exc:
        problems.append(f"torchplace.device('auto') fails here: {exc}")
    if torch.cuda.is_available():
        try:
            torch.empty(1).pin_memory()
        except RuntimeError as exc:
            problems.append(
                f"pinned host memory is unavailable ({exc}); copies to the GPU cannot overlap "
                "compute: raise the locked-memory limit (ulimit -l) or the container's limit"
            )
    return problems


def _fenced(diagnosis: Diagnosis, name: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # doctor reports; it never crashes
        diagnosis.checks.append(
            {"check": name, "ok": False, "detail": f"{type(exc).__name__}: {exc}"}
        )
        diagnosis.problems.append(f"{name} failed: {exc}")
        return None


def diagnose(*, bandwidth: bool = True) -> Diagnosis:
    """Run every check of ``torchplace doctor`` and return what was found.

    >>> from torchplace.cli._doctor import diagnose
    >>> found = diagnose(bandwidth=False)
    >>> found.healthy, found.checks[0]["check"]
    (True, 'round trip -> cpu')
    """
    from .._devices import available

    diagnosis = Diagnosis()
    diagnosis.versions = _fenced(diagnosis, "reading versions", _versions) or {}
    devices = _fenced(diagnosis, "listing devices", available) or [torch.device("cpu")]
    for dev in devices:  # one device that cannot be read keeps its row and hides no other
        rows = _fenced(diagnosis, f"reading {dev}", functools.partial(_device_rows, [dev]))
        diagnosis.devices.extend(rows or [{"device": str(dev)}])
    hops: list[torch.device] = []
    for dev in devices:
        if dev.type != "cpu":
            hops.append(dev)
    hops = [torch.device("cpu")] + [h for d in hops for h in (d, torch.device("cpu"))]
    checks = _fenced(diagnosis, "round trip", lambda: _round_trip(hops))
    if checks:
        diagnosis.checks.extend(checks)
    meta = _fenced(diagnosis, "skeleton move", _meta_check)
    if meta:
        diagnosis.checks.append(meta)
    for check in diagnosis.checks:
        if not check["ok"] and not any(check["check"] in p for p in diagnosis.problems):
            diagnosis.problems.append(f"{check['check']}: {check['detail']}")
    if bandwidth:
        for dev in devices:
            if dev.type != "cpu":  # every accelerator: cuda, mps, xpu
                rows = _fenced(diagnosis, f"bandwidth on {dev}", functools.partial(_bandwidth, dev))
                diagnosis.bandwidth.extend(rows or [])
    diagnosis.problems.extend(_fenced(diagnosis, "environment", _environment_problems) or [])
    return diagnosis


def _render(diagnosis: Diagnosis) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    # Details quote the environment (CUDA_VISIBLE_DEVICES, ...): plain text, never markup.
    console = Console(emoji=False)
    console.print("[bold]torchplace doctor[/bold]")
    versions = Table(title="Versions", show_header=False)
    for key, value in diagnosis.versions.items():
        versions.add_row(key, Text(value))
    console.print(versions)
    devices = Table(title="Devices")
    columns = ["device", "name", "memory_total", "memory_free", "capability", "cores"]
    present = [c for c in columns if any(c in row for row in diagnosis.devices)]
    for column in present:
        devices.add_column(column)
    from .._sizes import format_bytes

    for row in diagnosis.devices:
        devices.add_row(
            *[
                Text(
                    format_bytes(row[c])
                    if c.startswith("memory") and c in row
                    else str(row.get(c, ""))
                )
                for c in present
            ]
        )
    console.print(devices)
    checks = Table(title="Checks")
    for column in ("check", "result", "detail"):
        checks.add_column(column)
    for check in diagnosis.checks:
        checks.add_row(check["check"], "ok" if check["ok"] else "FAIL", Text(check["detail"]))
    console.print(checks)
    if diagnosis.bandwidth:
        table = Table(title="Copy bandwidth")
        for column in ("device", "copy", "GB/s"):
            table.add_column(column)
        for row in diagnosis.bandwidth:
            table.add_row(row["device"], row["copy"], str(row["GB/s"]))
        console.print(table)
    elif not any(d["device"] != "cpu" for d in diagnosis.devices):
        console.print("No accelerator visible: copy bandwidth not measured.")
    if diagnosis.healthy:
        console.print(
            "[green]Verdict: healthy.[/green] "
            "Every tensor went where it was sent and came back intact."
        )
    else:
        console.print("[red]Verdict: needs fixing.[/red]")
        for problem in diagnosis.problems:
            console.print(f"  - {escape(problem)}")


def _run(args: argparse.Namespace) -> int:
    diagnosis = diagnose(bandwidth=not args.no_bandwidth)
    if args.json:
        print(json.dumps(diagnosis.to_dict(), indent=2))
    else:
        _render(diagnosis)
    return 0 if diagnosis.healthy else 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check devices, placement and copies on this machine (the main job)",
        description="Check versions, devices, a verified round trip through every device, "
        "copy bandwidth, and say what to fix. Exit 0 when healthy, 1 otherwise.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth copies")
    parser.set_defaults(func=_run)
