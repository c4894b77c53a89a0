"""Checkpoint formats: the dtypes this torch holds, and what torch's errors mean.

``SAFETENSORS_DTYPES`` is the safetensors dtypes this torch can hold, and the ``diagnose``
family turns what torch raised into a sentence about the file. Telling a path's format and
resolving a directory or an index is ``_source``'s; reading and checking a safetensors header is
``_safetensors``'s; what a file holds, the layout of its records included, is the catalog's
(``_catalog``).
"""

from __future__ import annotations

import re

import torch

from . import _safetensors
from ._source import WRITER_HINT

__all__ = [
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_HINT",
    "device_failure",
    "diagnose",
    "first_sentence",
    "out_of_memory",
    "refusal_reason",
]

SAFETENSORS_HINT = "pip install safetensors (torchplace's [safetensors] extra)"

# safetensors dtype names, as written in a file's JSON header, that this torch can hold.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, torch_name)
    for name, (torch_name, _) in _safetensors.DTYPES.items()
    if hasattr(torch, torch_name)
}


def refusal_reason(text: str) -> str:
    """The line of torch's weights-only refusal that names what was blocked."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line or "unsupported" in line:
            return line
    for i, line in enumerate(lines):
        if "error:" in line:
            rest = line.split("error:", 1)[1].strip()
            return rest or (lines[i + 1] if i + 1 < len(lines) else "an object it cannot build")
    return "it holds objects beyond tensors and containers"


def out_of_memory(exc: BaseException) -> bool:
    text = str(exc)
    return (
        isinstance(exc, (MemoryError, torch.OutOfMemoryError))
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    )


def device_failure(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("CUDA error", "CUDA driver", "HIP error", "XPU error")
    )


def diagnose(exc: BaseException, zip_format: bool, target: torch.device) -> str:
    text = first_sentence(str(exc) or type(exc).__name__)
    if out_of_memory(exc):
        return (
            f"ran out of memory while being read onto {target} ({type(exc).__name__}: {text}); "
            "free memory, read it with mmap=True (the file is then mapped, not copied), or load "
            "it onto another device. If the file is far smaller than the free memory, a length "
            "in it is damaged"
        )
    if device_failure(exc):
        return (
            f"could not be placed onto {target} ({text}); the file may be sound and the device "
            "failing: run torchplace doctor, or load it onto the CPU"
        )
    if isinstance(exc, EOFError) or "failed finding central directory" in text:
        if "central directory" in text:  # torch's words for it carry a miniz internal note
            text = "its zip central directory is missing"
        return f"is truncated ({text}); {WRITER_HINT}, or its save was interrupted (save it again)"
    if "TorchScript" in text:
        return (
            "is a TorchScript archive (torch.jit.save), not a checkpoint of weights; load it "
            "with torch.jit.load, which runs its code, so only if you trust it"
        )
    if "magic number" in text.lower():
        return (
            f"is not a torch.save file ({text}); a plain pickle or a foreign file is not a "
            "checkpoint"
        )
    missing_class = re.match(r"Can't get attribute '([\w.]+)' on <module '([\w.]+)'", text)
    if isinstance(exc, AttributeError) and missing_class:
        cls, module = missing_class.groups()
        return (
            f"pickles an object of class {cls} from module {module}, which this program does not "
            f"define; the file may be sound: import or define {cls} (as the program that saved "
            "it did) before loading it"
        )
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return (
            f"pickles objects from module {exc.name}, which this program cannot import; the file "
            f"may be sound: load it where {exc.name} is installed and importable"
        )
    if not zip_format and "UntypedStorage' has no attribute 'dtype'" in text:
        return (
            "is a legacy-format file (torch.save with _use_new_zipfile_serialization=False) "
            "holding a dtype that PyTorch cannot read back from that format (uint16, uint32, "
            "uint64 or a float8); the file may be sound: save it again in the default zip "
            "format where it was written"
        )
    fmt = "zip" if zip_format else "legacy"
    return f"is truncated or corrupt ({type(exc).__name__}: {text}); this {fmt} file cannot be read"


def first_sentence(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:300]
