"""The one key check of every fill (``checkpoint._keys``): the plain and the sharded fill
refuse the same source with the same words."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import torchplace
from torchplace._errors import CheckpointError


class _Masked(nn.Module):
    """A linear layer and a non-persistent buffer, which no checkpoint holds."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.register_buffer("mask", torch.ones(4), persistent=False)


def _on_meta() -> _Masked:
    with torch.device("meta"):
        return _Masked()  # the buffer is on meta too: its values are gone


def _advice(text: str) -> str:
    """What the error says about the buffers, the device of its suggested call left out."""
    found = re.search(r"non-persistent buffers on meta that no checkpoint holds: .*?\)\)", text)
    assert found is not None, text
    return found.group(0).replace(", 'cpu'))", "))")


def test_plain_and_sharded_fills_give_one_advice_for_lost_buffers(
    fake_world: object, tmp_path: Path
) -> None:
    from torch.distributed.fsdp import fully_shard

    path = tmp_path / "m.safetensors"
    save_file({k: v.clone() for k, v in _Masked().state_dict().items()}, str(path))
    plain = _on_meta()
    with pytest.raises(CheckpointError) as by_plain:
        torchplace.load_into(plain, path, "cpu")
    sharded = _on_meta()
    fully_shard(sharded, mesh=fake_world)
    with pytest.raises(CheckpointError) as by_sharded:
        torchplace.load_into(sharded, path)
    assert by_plain.value.path == path
    said = _advice(str(by_plain.value))
    assert said == _advice(str(by_sharded.value))
    assert "torchplace.skeleton(YourModel, ...), which keeps such buffers real" in said
    assert f"then torchplace.load_into(model, {str(path)!r}))" in said
    assert all(p.is_meta for p in plain.parameters())  # both untouched
    assert all(p.is_meta for p in sharded.parameters())


def test_a_sharded_misfit_suggests_a_call_that_names_the_file(
    fake_world: object, tmp_path: Path
) -> None:
    """The rename hint of a sharded fill names the file read, as the plain fill's does."""
    from torch.distributed.fsdp import fully_shard

    path = tmp_path / "m.safetensors"
    save_file(
        {f"module.{k}": v.clone() for k, v in nn.Linear(3, 4).state_dict().items()}, str(path)
    )
    for sharded in (False, True):
        with torch.device("meta"):
            model = nn.Linear(3, 4)
        if sharded:
            fully_shard(model, mesh=fake_world)
        with pytest.raises(CheckpointError) as info:
            torchplace.load_into(model, path)
        assert (info.value.missing, info.value.unexpected) == (
            ("weight", "bias"),
            ("module.bias", "module.weight"),
        )
        fix = f'torchplace.load_into(model, {str(path)!r}, rename={{r"^module\\.": ""}})'
        assert fix in str(info.value), (sharded, str(info.value))
