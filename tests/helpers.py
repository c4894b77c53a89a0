"""Helpers several test files share: golden files, running a script under torchrun, and the model
and files the checkpoint tests save and load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

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


# -------------------------------------------------------------------------------------- checkpoints


def safetensors_torch() -> Any:
    """safetensors' writer, for the tests that make such files: only they skip without it."""
    return pytest.importorskip("safetensors.torch")


class Net(nn.Module):
    """Tied embedding and head, a persistent and a non-persistent buffer."""

    def __init__(self, d: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((d,), 0.5))
        self.register_buffer("mask", torch.ones(4, 4).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)) * self.scale)


X = torch.tensor([[1, 2, 3, 4]])


def reference() -> Net:
    torch.manual_seed(0)
    return Net()


def save(obj: object, path: Path, *, legacy: bool = False) -> Path:
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    return path


def write_shards(root: Path, sd: dict[str, torch.Tensor], *, torch_shards: bool = False) -> Path:
    names = sorted(sd)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-0000{i + 1}-of-00002." + ("bin" if torch_shards else "safetensors")
        chunk = {k: sd[k].contiguous() for k in part}
        if torch_shards:
            torch.save(chunk, root / shard)
        else:
            safetensors_torch().save_file(chunk, root / shard)
        weight_map.update(dict.fromkeys(part, shard))
    index = root / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


DISCARDED_MASK = r"load_into to meta discarded the values of 1 non-persistent buffer\(s\) \(mask\)"


def transformers_major() -> int:
    """The installed transformers' major version (0 where it is not installed), read without
    importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 0


def needs_transformers_5(why: str) -> pytest.MarkDecorator:
    """Skip, saying ``why``, on transformers 4.x (the suite runs on 5 and on 4.57.6, the test
    extra's floor): for what a 4.x model does otherwise."""
    return pytest.mark.skipif(0 < transformers_major() < 5, reason=f"transformers 4.x: {why}")
