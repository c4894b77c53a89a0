"""A real Ctrl-C (SIGINT from another process) during ``estimate``: a ``KeyboardInterrupt``
once the fake step has unwound, the model as it was, and never a process aborted."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,  # real signals to a subprocess
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
]

CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch, traceback
    from torch import nn
    import torchplace

    inside = [False]

    def handler(signum, frame):  # the program's own: Ctrl-C counts only inside the estimate
        if inside[0]:
            inside[0] = False
            raise KeyboardInterrupt
        os.write(1, b"outside\\n")

    signal.signal(signal.SIGINT, handler)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(24)])
    tensors = dict(model.state_dict(keep_vars=True))
    values = {name: t.detach().clone() for name, t in tensors.items()}
    attrs = list(vars(model))
    print("ready", flush=True)
    while True:
        try:
            inside[0] = True
            torchplace.estimate(model, example_input=torch.ones(512, 256))
            inside[0] = False
        except KeyboardInterrupt as exc:
            frames = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
            unwound = frames[-2].endswith("_sigint.py")  # raised as the step ended, not in it
            now = model.state_dict(keep_vars=True)
            assert now.keys() == tensors.keys() and list(vars(model)) == attrs
            for name, t in now.items():
                assert t is tensors[name] and type(t) in (torch.Tensor, nn.Parameter), name
                assert torch.equal(t, values[name]) and t.grad is None, name
            print("interrupted" if unwound else f"interrupted inside {frames[-2:]}", flush=True)
        except Exception as exc:  # the interrupt turned into another error inside torch
            inside[0] = False
            print("raised", type(exc).__name__, repr(str(exc)[:300]), flush=True)
    """
)


def test_a_real_ctrl_c_raises_keyboard_interrupt_and_leaves_the_model(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        rng, said = random.Random(5), []
        for _ in range(20):  # each at a random point of a step, once the last one was answered
            time.sleep(rng.uniform(0.05, 0.5))
            child.send_signal(signal.SIGINT)
            ready, _, _ = select.select([child.stdout], [], [], 60)  # a child hung: fail
            assert ready, f"no answer to a Ctrl-C in 60 s after {said}"
            said.append(child.stdout.readline().strip())
            assert child.poll() is None, said  # alive: not aborted (-6), not ended
        assert said.count("interrupted") >= 10 and set(said) <= {"interrupted", "outside"}, said
    finally:
        child.kill()
        _, err = child.communicate(timeout=60)
    assert "Traceback" not in err, err[-2000:]
