"""Checkpoints: ``load`` a file onto a device, build a ``skeleton``, fill it with ``load_into``.

A checkpoint's journey here has three steps, each a public function:

``load(path, device)``
    Reads a torch file (zip or legacy pickle), a ``.safetensors`` file, a sharded checkpoint
    (a Hugging Face ``*.index.json`` weight map) or a ``save_pretrained`` directory and puts its
    tensors on ``device``, whatever device they were saved from, read into the process's own
    memory (``mmap=True`` maps the file instead). Untrusted files are read with
    ``weights_only=True``, so loading never runs code. Every failure (missing, truncated,
    corrupt, foreign or unsafe file) is a ``CheckpointError`` that names the file.
    (``_source``: what a path names; ``_catalog``: its tensors and where they lie; ``_load``:
    ``load``; ``_reader``: bytes into tensors.)
``skeleton(factory, *args, **kwargs)``
    Builds a model whose parameters live on ``meta`` (no memory, no random init) while buffers
    stay real, so non-persistent buffers such as masks and rotary frequencies survive. It works
    through a thread-local ``TorchFunctionMode``: nothing global is patched (``_skeleton``).
``load_into(model, source, device)``
    Fills a skeleton (or a real model) from a file, a directory or a mapping, names fitted by
    ``rename=``. Weights read are assigned rather than copied again, tied parameters stay one
    object, modules' load hooks run as in ``load_state_dict`` (``_statedict``), a strict load
    lists every missing, unexpected and mis-shaped key, and a failure or Ctrl-C puts the model
    back (``_fill``, ``_rename``).
"""

from __future__ import annotations

from ._catalog import safetensors_header
from ._fill import load_into
from ._formats import SAFETENSORS_DTYPES, SAFETENSORS_HINT
from ._load import load
from ._skeleton import skeleton
from ._source import PathLike, as_path, detect_format, shards

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
