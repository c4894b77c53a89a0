"""``load``: a checkpoint file's tensors read into the process's own memory, or mapped."""

from __future__ import annotations

import json
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ._devices import DeviceSpec
from ._devices import device as _device
from ._errors import CheckpointError
from ._formats import (
    SAFETENSORS_DTYPES,
    SAFETENSORS_HINT,
    PathLike,
    _device_failure,
    _diagnose,
    _first_sentence,
    _has_data_pkl,
    _has_legacy_magic,
    _out_of_memory,
    _refusal_reason,
    as_path,
    detect_format,
    safetensors_header,
    shards,
)

# ------------------------------------------------------------------------------------------ load


def load(
    path: PathLike, device: DeviceSpec = "cpu", /, *, mmap: bool = True, trusted: bool = False
) -> Any:
    """Load a checkpoint with its tensors on ``device``, whatever device they were saved from.

    >>> import os, tempfile, torch
    >>> from torchplace import load
    >>> path = os.path.join(tempfile.mkdtemp(), "weights.pt")
    >>> torch.save({"w": torch.ones(2)}, path)
    >>> load(path)
    {'w': tensor([1., 1.])}
    >>> load(path, "meta")["w"].device
    device(type='meta')

    Reads torch files (``.pt``, ``.pth``, ``.bin``; zip or legacy), ``.safetensors`` files
    (needs ``pip install safetensors``) and sharded checkpoints through a Hugging
    Face ``*.index.json`` weight map. Zip and safetensors files are memory-mapped when ``mmap``
    (legacy files cannot be, and are read). Files are read with ``weights_only=True`` unless
    ``trusted=True``, so an untrusted file never runs code. A missing, truncated, corrupt,
    foreign or unsafe file raises ``CheckpointError`` naming the file.
    """
    target = _device(device)
    p = as_path(path)
    kind = detect_format(p)
    if kind == "index":
        return _load_index(p, target, mmap=mmap, trusted=trusted)
    if kind == "safetensors":
        return _load_safetensors(p, target, mmap=mmap)
    return _load_torch(p, target, zip_format=kind == "zip", mmap=mmap, trusted=trusted)


def _load_torch(
    p: Path, target: torch.device, *, zip_format: bool, mmap: bool, trusted: bool
) -> Any:
    use_mmap = mmap and zip_format and target.type != "meta"
    if not zip_format and not _has_legacy_magic(p):
        raise CheckpointError(
            f"{p}: is a plain pickle, not a torch.save file (it does not open with torch's "
            "magic number); a pickle is not a checkpoint, and torchplace does not unpickle it"
        )
    try:
        with warnings.catch_warnings():  # torch's note on pickle protocols is not the user's
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(p, map_location=target, mmap=use_mmap, weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        reason = _refusal_reason(text)
        if "Weights only load failed" in text and "operand" in reason:
            raise CheckpointError(
                f"{p}: was pickled with an instruction torch's safe loader does not read "
                f"({reason}; a newer pickle protocol). Nothing was run. Re-save it with "
                "torch.save's default protocol, or pass trusted=True if you trust its source"
            ) from exc
        if "Weights only load failed" in text:
            raise CheckpointError(
                f"{p}: refused to unpickle it, because loading it would run code or build "
                f"objects other than tensors and containers ({reason}). "
                "Nothing was run. If you trust where the file came from, pass trusted=True to "
                "torchplace.load, or allow that class with torch.serialization.add_safe_globals"
            ) from exc
        raise CheckpointError(f"{p}: is corrupt ({_first_sentence(text)})") from exc
    except Exception as exc:
        if zip_format and not _has_data_pkl(p):
            raise CheckpointError(
                f"{p}: is a zip archive but not a torch.save file (no data.pkl); torchplace "
                "reads torch.save files, .safetensors files and *.index.json shard maps"
            ) from exc
        raise CheckpointError(f"{p}: {_diagnose(exc, zip_format, target)}") from exc


def _safetensors_device(target: torch.device) -> str:
    # safetensors takes a device *string*; "mps:0" is spelt "mps".
    return "mps" if target.type == "mps" else str(target)


def _load_safetensors(p: Path, target: torch.device, *, mmap: bool) -> dict[str, torch.Tensor]:
    header = safetensors_header(p)
    if target.type == "meta":  # safetensors rejects meta; the header says all there is to know
        return {
            name: torch.empty(
                entry["shape"], dtype=SAFETENSORS_DTYPES[entry["dtype"]], device="meta"
            )
            for name, entry in header.items()
            if name != "__metadata__"
        }
    try:
        import safetensors
        import safetensors.torch
    except ImportError as exc:
        raise CheckpointError(
            f"{p}: is a safetensors file, and reading it needs the safetensors package; "
            f"install it with {SAFETENSORS_HINT}"
        ) from exc
    try:
        if not mmap:
            data = safetensors.torch.load(p.read_bytes())
            return {k: v.to(target) for k, v in data.items()}
        with safetensors.safe_open(str(p), framework="pt", device=_safetensors_device(target)) as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as exc:
        if _out_of_memory(exc) or _device_failure(exc):
            raise CheckpointError(f"{p}: {_diagnose(exc, True, target)}") from exc
        raise CheckpointError(
            f"{p}: cannot be read as safetensors ({_first_sentence(str(exc))}); it is truncated "
            "or corrupt"
        ) from exc


def _load_index(p: Path, target: torch.device, *, mmap: bool, trusted: bool) -> dict[str, Any]:
    try:
        index = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{p}: is not a readable JSON shard index ({exc})") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{p}: is JSON but not a shard index; a sharded checkpoint's index maps every tensor "
            'name to its file under "weight_map"'
        )
    result: dict[str, Any] = {}
    for shard, shard_path, names in shards(p, weight_map):
        part = load(shard_path, target, mmap=mmap, trusted=trusted)
        if not isinstance(part, Mapping):
            raise CheckpointError(f"{shard_path}: holds a {type(part).__name__}, not tensors")
        for name in names:
            if name not in part:
                raise CheckpointError(
                    f"{p}: says {name!r} is in {shard!r}, but that shard does not hold it; the "
                    "index and its shards do not match"
                )
            result[name] = part[name]
    return result
