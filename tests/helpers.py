"""Helpers several test files share: golden files, and running a script under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

GOLDEN = Path(__file__).parent / "golden"

# What torchrun sets for its workers: cleared so that a test's own run starts from scratch.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
TORCHRUN_VARIABLES += ("MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def check_golden(name: str, text: str, regen: bool) -> None:
    """``text`` equals ``tests/golden/NAME`` (rewritten first with ``--regen-golden``)."""
    path = GOLDEN / name
    if regen:
        path.write_text(text)
    assert path.exists(), f"{path} is missing; run pytest --regen-golden"
    assert text == path.read_text(), f"{name} changed; if on purpose, run pytest --regen-golden"


def fsdp2_cannot_train_on_cpu() -> str | None:
    """Why FSDP2 cannot run a forward pass on the CPU with this torch, or None where it can:
    its CPU streams record events from torch 2.7 (conftest.py at the root asks the same)."""
    import torch

    if hasattr(torch.cpu.Stream, "record_event"):
        return None
    return (
        "FSDP2 trains on the CPU from torch 2.7 (torch.cpu.Stream.record_event); "
        f"this is torch {torch.__version__}"
    )


def script(module: Any) -> Any:
    """``torch.jit.script(module)``, without the warning that it is deprecated: a
    DeprecationWarning in some releases, a FutureWarning from 2.15, none in others."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.* is deprecated")
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(module)


def torchrun_two_cpu(script: Path, *args: str, timeout: int = 120) -> str:
    """Run ``script`` (in its own directory) under torchrun on two CPU processes with Gloo;
    fails the test unless both exit cleanly. Returns their stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env |= {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if sys.platform == "linux":  # containers whose hostname does not resolve to this machine
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1"]
    command += ["--nproc-per-node=2", str(script), *args]
    try:
        done = subprocess.run(
            command,
            env=env,
            cwd=script.parent,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"torchrun did not finish in {timeout} s: {err.stdout!r} {err.stderr!r}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def torch_save(obj: Any, path: Path, *, crcs: bool = True) -> None:
    """``torch.save``, with the CRC-32 of each record recorded or not (torch's process-wide
    option, put back afterwards)."""
    import torch

    torch.serialization.set_crc32_options(crcs)
    try:
        torch.save(obj, path)
    finally:
        torch.serialization.set_crc32_options(True)
