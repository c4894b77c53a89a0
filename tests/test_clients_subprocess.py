"""The resume loop, run as a user runs it: read ``last.pt``, train, save over ``last.pt``, read
again. In a child process, so that a crash (SIGBUS, exit -7, when a tensor still reads the file
that was just rewritten) fails the test instead of killing pytest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import torchplace

pytestmark = pytest.mark.slow  # the resume loop of each client in subprocesses

SCRIPT = r"""
import sys
import torch
from torch import nn
import torchplace

fmt, mode = sys.argv[1], sys.argv[2]
path = "last." + fmt


def save(state):
    state = {k: v.detach().contiguous() for k, v in state.items()}
    if fmt == "pt":
        torch.save(state, path)
    else:
        from safetensors.torch import save_file
        save_file(state, path)


def make():
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))


torch.manual_seed(0)
save(make().state_dict())
expected = None
for step in range(3):
    if mode == "load_into":
        model = torchplace.load_into(torchplace.skeleton(make), path)
        state = model.state_dict()
        if expected is not None:  # what the last round saved is what this one read
            assert all(torch.equal(expected[k], v) for k, v in state.items()), step
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 256)).pow(2).mean().backward()
            opt.step()
        state = model.state_dict()
    else:  # "load": read, save over the file it came from, read the tensors again
        state = torchplace.load(path)
        if expected is not None:
            assert all(torch.equal(expected[k], v) for k, v in state.items()), step
    expected = {k: v.detach().clone() for k, v in state.items()}
    save(state)
    # every tensor read again after the file under it was rewritten: a crash here is the bug
    assert all(torch.equal(expected[k], v) for k, v in state.items()), step
    if mode == "load_into":
        model(torch.randn(2, 256)).sum().backward()
print("resumed", step + 1)
"""


CASES = [(fmt, mode) for fmt in ("pt", "safetensors") for mode in ("load_into", "load")]


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[tuple[str, str], subprocess.Popen[str]]]:
    """Every case started at once (the machine has cores to spare while torch imports)."""
    src = str(Path(torchplace.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    started = {}
    for fmt, mode in CASES:
        cwd = tmp_path_factory.mktemp(f"resume-{fmt}-{mode}")
        started[fmt, mode] = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, fmt, mode],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    yield started
    for proc in started.values():  # those no test waited for (deselected, or a test failed)
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize(("fmt", "mode"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_resume_loop_survives_saving_over_the_file_it_read(
    runs: dict[tuple[str, str], subprocess.Popen[str]], fmt: str, mode: str
) -> None:
    if fmt == "safetensors":
        pytest.importorskip("safetensors")
    proc = runs[fmt, mode]
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the resume loop ({fmt}, {mode}) did not finish in 180 s")
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        pytest.fail(f"the resume loop ({fmt}, {mode}) crashed with {name}\n{stderr[-2000:]}")
    assert proc.returncode == 0, stderr[-2000:]
    assert stdout.strip() == "resumed 3"
