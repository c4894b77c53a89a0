"""Checkpoints: ``load`` a file onto a device, build a ``skeleton``, fill it with ``load_into``.

A checkpoint's journey here has three steps, each a public function:

``load(path, device)``
    Reads a torch file (zip or legacy pickle), a ``.safetensors`` file or a sharded checkpoint
    (a Hugging Face ``*.index.json`` weight map) and puts its tensors on ``device``, whatever
    device they were saved from. Untrusted files are read with ``weights_only=True``, so loading
    never runs code. Every failure (missing, truncated, corrupt, foreign or unsafe file) is a
    ``CheckpointError`` that names the file.
``skeleton(factory, *args, **kwargs)``
    Builds a model whose parameters live on ``meta`` (no memory, no random init) while buffers
    stay real, so non-persistent buffers such as masks and rotary frequencies survive. It works
    through a thread-local ``TorchFunctionMode``: nothing global is patched.
``load_into(model, path, device)``
    Fills a skeleton (or a real model) from a file. Weights are memory-mapped and assigned rather
    than copied, tied parameters stay one object, modules' load hooks run as in
    ``load_state_dict``, and a strict load lists every missing, unexpected and mis-shaped key.
"""

from __future__ import annotations

from ._fill import load_into
from ._formats import (
    SAFETENSORS_DTYPES,
    SAFETENSORS_HINT,
    PathLike,
    as_path,
    detect_format,
    safetensors_header,
    shards,
)
from ._read import load
from ._skeleton import skeleton

__all__ = [
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_HINT",
    "PathLike",
    "as_path",
    "detect_format",
    "load",
    "load_into",
    "safetensors_header",
    "shards",
    "skeleton",
]
