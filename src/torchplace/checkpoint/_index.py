"""Checkpoint file facts that need no torch: a shard index's weight map, and the number torch's
legacy (non-zip) files open with.

``load``, the sharded reader and ``inspect`` read shard indexes through ``weight_map``, so they
accept and refuse the same files with the same words.
"""

from __future__ import annotations

import json
from pathlib import Path

from .._errors import CheckpointError
from ._opened import opened

__all__ = ["LEGACY_MAGIC", "index_bytes", "weight_map"]

# torch's legacy (non-zip) files open with this number, pickled on its own.
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def index_bytes(p: Path, /) -> bytes:
    """The bytes of a shard index, as they are (``CheckpointError`` where it cannot be read)."""
    try:
        with opened(p) as f:
            return f.read()
    except OSError as exc:
        raise CheckpointError(f"{p}: is not a readable JSON shard index ({exc})", path=p) from exc


def weight_map(p: Path, /, raw: bytes | None = None) -> dict[str, str]:
    """The ``weight_map`` of a shard index (tensor name -> shard file), checked: a JSON object
    mapping strings to strings, under ``"weight_map"`` (Hugging Face's form) or as the whole
    object (the flat form Accelerate takes), or ``CheckpointError`` naming the file. ``raw``:
    the index's bytes, where they were read already."""
    try:
        index = json.loads((index_bytes(p) if raw is None else raw).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{p}: is not a readable JSON shard index ({exc})", path=p) from exc
    found = index.get("weight_map") if isinstance(index, dict) else None
    if found is None and _flat(index):  # {name: file}, as Accelerate reads and writes one
        found = index
    # JSON's keys are strings: its values are what may not be
    if not isinstance(found, dict) or not all(type(v) is str for v in found.values()):
        raise CheckpointError(
            f"{p}: is JSON but not a shard index; a sharded checkpoint's index maps every tensor "
            'name to its file, under "weight_map" (as save_pretrained writes it) or as the '
            "whole object ({name: file}, as Accelerate takes it)",
            path=p,
        )
    return found


# The files a flat index may name: a checkpoint's shards.
_SHARD_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def _flat(index: object) -> bool:
    """Whether ``index`` is a flat shard index: a JSON object mapping every tensor name straight
    to a shard file (a checkpoint file's name), with no ``weight_map``. Told by its values, so
    that other JSON (a ``config.json``, whose values name no such file) is not taken for one.

    >>> _flat({"w": "a.safetensors", "b": "b.bin"}), _flat({"model_type": "llama"}), _flat({})
    (True, False, False)
    """
    return (
        isinstance(index, dict)
        and bool(index)
        and all(type(v) is str and v.endswith(_SHARD_SUFFIXES) for v in index.values())
    )
