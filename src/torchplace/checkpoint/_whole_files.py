"""Whole files, read by others or as they are: what torchplace does not read itself is read here
by its own library, the file's stamp checked after: ``torch.load`` (a trusted file, a mapped
one, a legacy or unusual zip file), the safetensors package (a mapped file, a big-endian
machine) and ``zipfile`` (every record's CRC-32 checked). The caller turns their failures into
a sentence about the file. A file is also copied byte for byte (``remap``'s unchanged files)
or mapped copy-on-write (the disk tier with ``mmap=True``) here, and the pages under a view of
such a map handed back (``MappedViews.page_out``).
"""

from __future__ import annotations

import mmap
import os
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError, user_stacklevel
from ._entries import Stamp, changed_error
from ._formats import first_sentence
from ._host_read import READ_CHUNK_BYTES
from ._opened import open_file, opened, unopenable
from ._zip_read import SPARSE_CHECK_NOTE

__all__ = [
    "NO_CRC",
    "MappedViews",
    "check_records",
    "copy_file",
    "map_file",
    "safetensors_load",
    "torch_load",
    "unchecked_warning",
]


def torch_load(path: Path, target: torch.device, *, mmap: bool, trusted: bool, stamp: Stamp) -> Any:
    """``torch.load`` of a whole torch file onto ``target`` (``weights_only`` unless
    ``trusted``), refused with ``CheckpointError`` if the file no longer has ``stamp`` after."""
    with warnings.catch_warnings():  # torch's note on pickle protocols is not the user's
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        warnings.filterwarnings("ignore", message=SPARSE_CHECK_NOTE)
        if mmap:  # torch maps the file by its path
            loaded = torch.load(path, map_location=target, mmap=True, weights_only=not trusted)
        else:
            with opened(path) as f:
                loaded = torch.load(f, map_location=target, weights_only=not trusted)
    now = Stamp.of(os.stat(path))
    if now != stamp:  # torch read it by its path: a rewrite shows in the stamp
        raise changed_error(path, stamp, now)
    return loaded


def safetensors_load(
    path: Path, target: torch.device, *, mmap: bool, stamp: Stamp | None = None
) -> dict[str, torch.Tensor]:
    """A ``.safetensors`` file's tensors on ``target`` by the safetensors package: mapped
    (``mmap=True``), or read whole and converted to the machine's byte order; refused with
    ``CheckpointError`` if the file no longer has ``stamp`` (its catalog's) after."""
    import safetensors
    import safetensors.torch

    if not mmap:
        with opened(path) as f:
            data = safetensors.torch.load(f.read())
        out = {k: v.to(target) for k, v in data.items()}
    else:
        device = _safetensors_device(target)
        with safetensors.safe_open(str(path), framework="pt", device=device) as f:
            out = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    if stamp is not None:
        now = Stamp.of(os.stat(path))
        if now != stamp:
            raise changed_error(path, stamp, now)
    return out


def _safetensors_device(target: torch.device) -> str:
    # safetensors takes a device *string*; "mps:0" is spelt "mps".
    return "mps" if target.type == "mps" else str(target)


def check_records(p: Path) -> None:
    """Every record of a zip file that records a CRC-32 read through ``zipfile``, which checks
    it (a CRC of 0 is "not recorded": torch writes none with its CRC-32 option off); a warning
    where no record has one, since nothing could be checked."""
    checked = 0
    try:
        with opened(p) as f, zipfile.ZipFile(f) as archive:
            for info in archive.infolist():
                if not info.CRC:
                    continue
                checked += 1
                with archive.open(info) as record:
                    while record.read(16 << 20):
                        pass
    except (PermissionError, IsADirectoryError) as exc:  # not damage: said as it is
        raise unopenable(p, exc) from exc
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, NotImplementedError) as exc:
        raise CheckpointError(
            f"{p}: is corrupt ({type(exc).__name__}: {first_sentence(str(exc))}); the bytes were "
            "damaged after the file was written, so save or fetch it again",
            path=p,
        ) from exc
    if not checked:
        unchecked_warning(p, NO_CRC)


NO_CRC = "it records no CRC-32 (saved with torch.serialization.set_crc32_options(False))"


def unchecked_warning(p: Path, why: str) -> None:
    """Say that ``check_crc=True`` could check nothing in ``p``, and why."""
    warnings.warn(
        f"{p}: check_crc=True, but {why}, so nothing was checked: its bytes are read as they are",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def copy_file(path: Path, out: Any) -> None:
    """Every byte of ``path`` written to the file object ``out`` as it is, ``CheckpointError``
    if the file changed while it was copied (its stamp before and after)."""
    with open_file(path) as f:  # a pipe put there is refused, not read
        before = Stamp.of(os.fstat(f.fileno()))
        shutil.copyfileobj(f, out, READ_CHUNK_BYTES)
        now = Stamp.of(os.fstat(f.fileno()))
    if now != before:
        raise changed_error(path, before, now)


def map_file(path: Path) -> mmap.mmap:
    """``path`` mapped copy-on-write: the page cache's pages, each copied only where written
    (nothing here writes), for tensors that view a file's bytes (the disk tier with
    ``mmap=True``). Opened as every checkpoint is (``open_file``: a pipe is never opened)."""
    with open_file(path) as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


class MappedViews(dict[str, torch.Tensor]):
    """A disk tier read's weights as views of mapped files, and ``page_out``: the pages under a
    view leave the process's resident set (``MADV_DONTNEED``; the map is copy-on-write and never
    written, so a later touch faults the same bytes in again from the page cache)."""

    PAGE = mmap.PAGESIZE

    def __init__(self, views: dict[str, torch.Tensor], maps: list[mmap.mmap]) -> None:
        super().__init__(views)
        self._maps = [(_address(m), len(m), m) for m in maps if len(m)]

    def page_out(self, t: torch.Tensor) -> None:
        """Hand back the whole pages under ``t`` where it views one of this read's maps."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None or t.device.type != "cpu" or t.layout != torch.strided:
            return
        start, size = t.data_ptr(), t.numel() * t.element_size()
        for base, length, m in self._maps:
            if base <= start < base + length:
                lo = -(-(start - base) // self.PAGE) * self.PAGE
                hi = min(start - base + size, length) // self.PAGE * self.PAGE
                if hi > lo:
                    m.madvise(advice, lo, hi - lo)
                return


def _address(m: mmap.mmap) -> int:
    """Where ``m`` starts in memory."""
    return torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()
