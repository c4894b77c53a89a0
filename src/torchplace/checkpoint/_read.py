"""``load``: a checkpoint file's tensors read into the process's own memory, or mapped."""

from __future__ import annotations

import inspect
import io
import pickle
import struct
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .._devices import DeviceSpec
from .._devices import device as _device
from .._errors import CheckpointError
from ._formats import (
    SAFETENSORS_DTYPES,
    SAFETENSORS_HINT,
    PathLike,
    ZipLayout,
    as_path,
    detect_format,
    device_failure,
    diagnose,
    first_sentence,
    gather_index,
    has_data_pkl,
    has_legacy_magic,
    is_dir,
    model_file,
    out_of_memory,
    record_start,
    refusal_reason,
    safetensors_header,
    zip_layout,
)
from ._pickle_reader import WHOLE_MODEL, code_globals, pickles_a_model
from ._readinto import read_into

# ------------------------------------------------------------------------------------------ load


def load(
    path: PathLike, device: DeviceSpec = "cpu", /, *, mmap: bool = False, trusted: bool = False
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

    Reads torch files (``.pt``, ``.pth``, ``.bin``; zip or legacy), ``.safetensors`` files,
    sharded checkpoints through a Hugging Face ``*.index.json`` weight map, and a directory
    holding one of these as ``save_pretrained`` writes it (its index, or its one model file).
    Files are read with ``weights_only=True`` unless ``trusted=True``, so an untrusted file never
    runs code. A missing, truncated, corrupt, foreign or unsafe file raises ``CheckpointError``
    naming the file.

    The bytes are read into the process's own memory, straight into each tensor (onto a GPU,
    through pinned buffers straight to the device), so the file may be rewritten or deleted at
    once: ``torch.save(sd, path)`` back to the same path is safe. ``mmap=True`` maps zip and
    safetensors files instead (zero-copy; legacy files cannot be mapped, and are read): the
    tensors are then pages of the file, and **rewriting or truncating the file while they live
    crashes the process** (SIGBUS, exit -7, even for values already changed in memory). Use it to
    serve weights read-only from a file nothing writes to; ``mmap=True`` safetensors need
    ``pip install safetensors``.
    """
    target = _device(device)
    p = as_path(path)
    if is_dir(p):
        p = model_file(p)
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
    if not zip_format and not has_legacy_magic(p):
        raise CheckpointError(
            f"{p}: is a plain pickle, not a torch.save file (it does not open with torch's "
            "magic number); a pickle is not a checkpoint, and torchplace does not unpickle it"
        )
    if zip_format:
        layout = zip_layout(p)  # the pickle record's CRC-32 is checked, however it is read
        if layout is not None and not mmap and not trusted and target.type in ("cpu", "cuda"):
            read = _read_zip(layout, target)
            if read is not _UNUSUAL:
                return read
    try:
        with warnings.catch_warnings():  # torch's note on pickle protocols is not the user's
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            warnings.filterwarnings("ignore", message=_SPARSE_CHECK_NOTE)
            return torch.load(p, map_location=target, mmap=use_mmap, weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        reason = refusal_reason(text)
        if "Weights only load failed" in text and "operand" in reason:
            raise CheckpointError(
                f"{p}: was pickled with an instruction torch's safe loader does not read "
                f"({reason}; a newer pickle protocol). Nothing was run. Re-save it with "
                "torch.save's default protocol, or pass trusted=True if you trust its source"
            ) from exc
        if "Weights only load failed" in text and _whole_model(p):
            raise CheckpointError(
                f"{p}: {WHOLE_MODEL} (a state dict load_into takes as it is); better, save "
                "model.state_dict() instead of the model"
            ) from exc
        if "Weights only load failed" in text:
            raise CheckpointError(
                f"{p}: refused to unpickle it, because loading it would run code or build "
                f"objects other than tensors and containers ({reason}). "
                "Nothing was run. If you trust where the file came from, pass trusted=True to "
                "torchplace.load, or allow that class with torch.serialization.add_safe_globals"
            ) from exc
        raise CheckpointError(f"{p}: is corrupt ({first_sentence(text)})") from exc
    except Exception as exc:
        if zip_format and not has_data_pkl(p):
            raise CheckpointError(
                f"{p}: is a zip archive but not a torch.save file (no data.pkl); torchplace "
                "reads torch.save files, .safetensors files and *.index.json shard maps"
            ) from exc
        raise CheckpointError(f"{p}: {diagnose(exc, zip_format, target)}") from exc


_UNUSUAL = object()  # what _read_zip returns for a file it leaves to torch.load


class _Unusual(Exception):
    """A zip file laid out in a way _read_zip does not read (torch.load reads it instead)."""


def _read_zip(layout: ZipLayout, target: torch.device) -> Any:
    """A torch zip file's objects, each record read into a storage on ``target``.

    Returns ``_UNUSUAL`` for anything it does not read itself, or that fails: a refused
    global, a compressed or mis-sized record, a file written big-endian. ``torch.load`` then
    reads it, or raises the error the caller turns into a sentence about the file. Only a lack
    of memory or a failing device is reported here, since it would fail there again.
    """
    p = layout.path
    order = layout.records.get(layout.prefix + "byteorder")
    try:
        with p.open("rb") as f:
            if order is not None:
                f.seek(record_start(f, order))
                if f.read(order.file_size) != sys.byteorder.encode():
                    return _UNUSUAL
            elif sys.byteorder != "little":
                return _UNUSUAL
            storages: dict[str, Any] = {}
            pieces: list[tuple[int, torch.Tensor]] = []

            def persistent_load(saved_id: Any) -> Any:
                if not isinstance(saved_id, tuple) or len(saved_id) != 5:
                    raise _Unusual(f"persistent id {saved_id!r}")
                typename, storage_type, key, _location, numel = saved_id
                if typename not in ("storage", b"storage") or not isinstance(key, str):
                    raise _Unusual(f"persistent id {saved_id!r}")
                if key in storages:
                    return storages[key]
                if storage_type is torch.UntypedStorage:
                    dtype = torch.uint8
                else:
                    dtype = storage_type.dtype
                nbytes = numel * dtype.itemsize
                info = layout.records.get(f"{layout.prefix}data/{key}")
                if info is None or info.compress_type != 0 or info.file_size != nbytes:
                    raise _Unusual(f"record data/{key}")
                data = torch.empty(nbytes, dtype=torch.uint8, device=target)
                pieces.append((record_start(f, info), data))
                storage = torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
                    wrap_storage=data.untyped_storage(), dtype=dtype, _internal=True
                )
                storages[key] = storage
                return storage

            from torch import _weights_only_unpickler

            unpickler = _weights_only_unpickler.Unpickler(
                io.BytesIO(layout.pickle), encoding="utf-8"
            )
            unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
            result = unpickler.load()  # type: ignore[no-untyped-call]
        read_into(p, pieces)
        _check_sparse()  # once their bytes are in: before, they hold what the allocator left
    except Exception as exc:
        _forget_sparse_checks()  # queued by this read: torch.load would check them next
        if out_of_memory(exc) or device_failure(exc):
            raise CheckpointError(f"{p}: {diagnose(exc, True, target)}") from exc
        return _UNUSUAL
    return result


# torch 2.15's note that checking sparse tensors takes time: torchplace's to take, not the user's
_SPARSE_CHECK_NOTE = "Validating sparse tensor invariants"


def _check_sparse() -> None:
    """torch's check of the sparse tensors just read, as its safe loader makes it: always from
    torch 2.15 (bad indices would be read out of bounds later), before only when
    ``torch.sparse.check_sparse_tensor_invariants`` is on (torch 2.6: always too)."""
    validate: Any = torch._utils._validate_loaded_sparse_tensors  # its signature varies
    if "weights_only" not in inspect.signature(validate).parameters:
        validate()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SPARSE_CHECK_NOTE)
        validate(weights_only=True)


def _forget_sparse_checks() -> None:
    """Drop the sparse tensors an abandoned read queued for torch's check on their indices.

    torch keeps them in a list that the next load empties; left there, a read that failed
    half-way would have ``torch.load`` check tensors never filled, and refuse a sound file as
    corrupt."""
    getter = getattr(torch._utils, "_get_sparse_tensors_to_validate", None)  # torch 2.15
    queued = (
        getter() if callable(getter) else getattr(torch._utils, "_sparse_tensors_to_validate", None)
    )
    if isinstance(queued, list):
        queued.clear()


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
    if not mmap and sys.byteorder == "little":
        return _read_safetensors(p, header, target)
    try:
        import safetensors
        import safetensors.torch
    except ImportError as exc:
        how = (
            "mapping it (mmap=True) needs the safetensors package; read it without mmap=True, or"
            if mmap
            else "reading it on a big-endian machine needs the safetensors package;"
        )
        raise CheckpointError(
            f"{p}: is a safetensors file, and {how} install it with {SAFETENSORS_HINT}"
        ) from exc
    try:
        if not mmap:
            data = safetensors.torch.load(p.read_bytes())
            return {k: v.to(target) for k, v in data.items()}
        with safetensors.safe_open(str(p), framework="pt", device=_safetensors_device(target)) as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as exc:
        reason = "it is truncated or corrupt"
        raise _unreadable(p, exc, target, first_sentence(str(exc)), reason) from exc


def _whole_model(p: Path) -> bool:
    try:
        return pickles_a_model(code_globals(p))
    except CheckpointError:
        return False


def _read_safetensors(
    p: Path, header: dict[str, Any], target: torch.device
) -> dict[str, torch.Tensor]:
    """Each tensor allocated on ``target`` (the CPU for another accelerator) and read into."""
    home = target if target.type in ("cpu", "cuda") else torch.device("cpu")
    try:
        with p.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
        start = 8 + header_len
        out: dict[str, torch.Tensor] = {}
        pieces = []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            out[name] = torch.empty(entry["shape"], dtype=dtype, device=home)
            pieces.append((start + entry["data_offsets"][0], out[name]))
        read_into(p, pieces)
        if home != target:
            out = {name: t.to(target) for name, t in out.items()}
    except Exception as exc:
        detail = f"{type(exc).__name__}: {first_sentence(str(exc))}"
        reason = "it is truncated, or it changed while being read"
        raise _unreadable(p, exc, target, detail, reason) from exc
    return out


def _unreadable(
    p: Path, exc: Exception, target: torch.device, detail: str, likely: str
) -> CheckpointError:
    """The error for a safetensors file that failed to read: the device's own trouble (out of
    memory, a failing GPU) said as such, anything else as a damaged file."""
    if out_of_memory(exc) or device_failure(exc):
        return CheckpointError(f"{p}: {diagnose(exc, True, target)}")
    return CheckpointError(f"{p}: cannot be read as safetensors ({detail}); {likely}")


def _load_index(p: Path, target: torch.device, *, mmap: bool, trusted: bool) -> dict[str, Any]:
    def read(shard_path: Path) -> Mapping[str, Any]:
        part = load(shard_path, target, mmap=mmap, trusted=trusted)
        if not isinstance(part, Mapping):
            raise CheckpointError(f"{shard_path}: holds a {type(part).__name__}, not tensors")
        return part

    return gather_index(p, read)
