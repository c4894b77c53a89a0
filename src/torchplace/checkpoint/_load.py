"""``load``: a checkpoint file's tensors read into the process's own memory, or mapped."""

from __future__ import annotations

import dataclasses
import functools
import pickle
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .._devices import DeviceSpec
from .._devices import device as _device
from .._errors import CheckpointError, check_flags, user_stacklevel
from ._boxes import BoxReader, queue_box
from ._catalog import catalog, code_globals, format_of
from ._crc import check_as_read
from ._entries import Catalog, Entry, stamp
from ._formats import (
    SAFETENSORS_HINT,
    device_failure,
    diagnose,
    first_sentence,
    out_of_memory,
    refusal_reason,
)
from ._opened import made_in_call, one_open_each, unopenable
from ._pickle_reader import WHOLE_MODEL, pickles_a_model, within_bound
from ._plan_items import Assembled, Part
from ._progress import reporting, wanted
from ._source import WRITER_HINT, PathLike, resolve
from ._whole_files import NO_CRC, check_records, safetensors_load, torch_load, unchecked_warning
from ._zip_layout import has_data_pkl, has_legacy_magic, zip_layout
from ._zip_read import UNUSUAL, DTypeWish, read_zip

# ------------------------------------------------------------------------------------------ load


def load(
    path: PathLike,
    device: DeviceSpec = "cpu",
    /,
    *,
    mmap: bool = False,
    trusted: bool = False,
    check_crc: bool | None = None,
    progress: bool | None = None,
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

    ``check_crc`` checks every tensor record of a zip file against the CRC-32 it was saved with
    (torch writes one per record), so a flipped bit in a tensor's bytes raises
    ``CheckpointError`` naming the record; the pickle record is always checked. Left to
    ``None`` (the default), the records are checked as they are read into host memory: with
    ISA-L's CRC-32 (``isal``, a dependency) it adds about 7-13% to a read from the page cache in
    the reader's threads; with zlib's, the fallback where ``isal`` has no wheel, 35-60%
    (``benchmarks/RESULTS.md``). Onto a GPU (where the reads are faster and the check's share
    larger), or where the file is mapped (``mmap=True``) or read by ``torch.load``
    (``trusted=True``, a legacy or unusual file), nothing more is checked by default. ``True``
    always checks (in a pass of its own where ``torch.load`` reads) and warns where the file
    records no CRC-32; ``False`` never checks. Safetensors files carry no checksum: asked of
    one (or of an index with safetensors shards), ``check_crc=True`` warns once that nothing
    was checked there.

    ``progress``: a bar on stderr (bytes, rate, time left) while the file is read. ``None``
    shows it when stderr is a terminal and the checkpoint holds at least 2 GiB; ``True`` and
    ``False`` force it on or off. On many ranks only rank 0 shows it.
    """
    check_flags("load()", mmap=mmap, trusted=trusted, check_crc=check_crc, progress=progress,
                optional=("check_crc", "progress"))  # fmt: skip
    if isinstance(path, Mapping):
        raise CheckpointError(
            f"load() reads a checkpoint from its path, not a {type(path).__name__} already in "
            "memory; to fill a model from a state dict, use torchplace.load_into(model, "
            "state_dict)"
        )
    with one_open_each():  # each file opened once in this call
        target = _device(device)
        p = resolve(path)  # a directory's model file
        kind = format_of(p)
        if check_crc:
            warn_unchecked_safetensors(p, kind, None)
        if wanted(progress):  # a bar only where one may show: no size asked for otherwise
            with reporting(source_bytes(p, kind), f"load {p.name}", progress):
                return _load(p, kind, target, mmap=mmap, trusted=trusted, check_crc=check_crc)
        return _load(p, kind, target, mmap=mmap, trusted=trusted, check_crc=check_crc)


def warn_unchecked_safetensors(p: Path, kind: str, kinds: Mapping[Path, str] | None) -> None:
    """Warn, once for a whole call, that ``check_crc=True`` checks nothing of a safetensors
    file, nor of an index's safetensors shards: the format records no checksum. ``kinds``: the
    index's shard formats, when its catalog is at hand. The warning names the user's line."""
    if kind == "index":
        found = set((catalog(p).kinds if kinds is None else kinds).values())
        if "safetensors" not in found:
            return
        what = (
            "its shards are safetensors files, which record no checksum, so nothing was "
            "checked: their bytes are read as they are"
            if found == {"safetensors"}
            else "its safetensors shards record no checksum, so only its torch shards were "
            "checked: theirs are read as they are"
        )
    elif kind == "safetensors":
        what = (
            "a safetensors file records no checksum, so nothing was checked: its bytes are read "
            "as they are"
        )
    else:
        return
    warnings.warn(
        f"{p}: check_crc=True, but {what}",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def source_bytes(p: Path, kind: str) -> int:
    """The bytes of the files a source reads (an index: its shards')."""
    if kind != "index":
        return p.stat().st_size
    return sum(s.size for f, s in catalog(p).stamps.items() if f != p)


def _load(
    p: Path,
    kind: str,
    target: torch.device,
    *,
    mmap: bool,
    trusted: bool,
    check_crc: bool | None,
) -> Any:
    return reader_for(kind, target)(p, target, ReadOptions(mmap, trusted, check_crc))


def _load_torch(
    p: Path, target: torch.device, o: ReadOptions, *, zip_format: bool, by_layout: bool
) -> Any:
    """A torch file (``zip_format``: a zip, else legacy) read onto ``target``: by its zip layout
    into storages on the target where ``by_layout`` (the CPU, CUDA) and the file is neither
    mapped nor trusted, else by ``torch.load``, its failures said as sentences about the file."""
    mmap, trusted, check_crc = o.mmap, o.trusted, o.check_crc
    use_mmap = mmap and zip_format and target.type != "meta"
    if not zip_format and not has_legacy_magic(p):
        raise CheckpointError(
            f"{p}: is a plain pickle, not a torch.save file (it does not open with torch's "
            "magic number); a pickle is not a checkpoint, and torchplace does not unpickle it",
            path=p,
        )
    when = stamp(p)  # the file read must stay the one whose layout was found
    # torch's reader has no bound on a pickle's objects: they are counted first, the count
    # stopping at the bound, unless the file is trusted or this call's catalog counted them
    count = not trusted and not made_in_call(("catalog", p))
    if count and not zip_format:
        within_bound(p, zip_format=False)
    # Only an explicit True warns of nothing to check, or checks in a pass of its own; left to
    # None, records are checked only as the reader reads them into host memory (ISA-L's CRC-32,
    # else zlib's).
    if check_crc and not zip_format:
        unchecked_warning(p, "a legacy (non-zip) torch file records no CRC-32")
    if zip_format:
        layout = zip_layout(p)  # the pickle record's CRC-32 is checked, however it is read
        if count:
            within_bound(p, layout.pickle if layout is not None else None)
        if check_crc and layout is not None and not any(i.CRC for i in layout.records.values()):
            unchecked_warning(p, NO_CRC)
            check_crc = False
        if layout is not None and not mmap and not trusted and by_layout:
            crc = check_as_read(check_crc, target.type)
            read = read_zip(layout, target, when, crc, o.dtype_of, o.wanted)
            if read is not UNUSUAL:
                return read
        if check_crc:  # read by torch.load below: every record checked in a pass of its own
            check_records(p)
    try:
        return torch_load(p, target, mmap=use_mmap, trusted=trusted, stamp=when)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        text = str(exc)
        reason = refusal_reason(text)
        if "Weights only load failed" in text and "operand" in reason:
            raise CheckpointError(
                f"{p}: was pickled with an instruction torch's safe loader does not read "
                f"({reason}; a newer pickle protocol). Nothing was run. Re-save it with "
                "torch.save's default protocol, or pass trusted=True if you trust its source",
                path=p,
            ) from exc
        if "Weights only load failed" in text and _whole_model(p):
            raise CheckpointError(
                f"{p}: {WHOLE_MODEL.format(path=repr(str(p)))} (a state dict load_into takes "
                "as it is); better, save model.state_dict() instead of the model",
                path=p,
            ) from exc
        if "Weights only load failed" in text:
            raise CheckpointError(
                f"{p}: refused to unpickle it, because loading it would run code or build "
                f"objects other than tensors and containers ({reason}). "
                "Nothing was run. If you trust where the file came from, pass trusted=True to "
                "torchplace.load, or allow that class with torch.serialization.add_safe_globals",
                path=p,
            ) from exc
        raise CheckpointError(f"{p}: is corrupt ({first_sentence(text)})", path=p) from exc
    except Exception as exc:
        if isinstance(exc, (PermissionError, IsADirectoryError)):  # torch.load's own open
            raise unopenable(p, exc) from exc
        if zip_format and not has_data_pkl(p):
            raise CheckpointError(
                f"{p}: is a zip archive but not a torch.save file (no data.pkl); torchplace "
                "reads torch.save files, .safetensors files and *.index.json shard maps",
                path=p,
            ) from exc
        raise CheckpointError(f"{p}: {diagnose(exc, zip_format, target)}", path=p) from exc


def _safetensors_on_meta(p: Path, target: torch.device, o: ReadOptions) -> dict[str, Any]:
    """A safetensors file's tensors on ``meta``, from its header alone (the safetensors package
    rejects ``meta``; the header says all there is to know)."""
    return {
        name: torch.empty(e.shape, dtype=e.torch_dtype(str(p)), device="meta")
        for name, e in catalog(p).entries.items()
    }


def _load_safetensors(p: Path, target: torch.device, o: ReadOptions) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors on ``target``: read from its catalog's entries (in the
    dtypes ``o.dtype_of`` asks for), or by the safetensors package where mapped (``mmap``) or on
    a big-endian machine."""
    found = catalog(p)
    mmap = o.mmap
    if not mmap and sys.byteorder == "little":
        names = [n for n in found.entries if o.wanted is None or o.wanted(n)]
        return read_entries(found, names, target, o.dtype_of)
    for e in found.entries.values():
        e.torch_dtype(str(p))  # refused as the reader refuses it
    try:
        import safetensors.torch  # noqa: F401  (read by the reader's safetensors_load)
    except ImportError as exc:
        how = (
            "mapping it (mmap=True) needs the safetensors package; read it without mmap=True, or"
            if mmap
            else "reading it on a big-endian machine needs the safetensors package;"
        )
        raise CheckpointError(
            f"{p}: is a safetensors file, and {how} install it with {SAFETENSORS_HINT}", path=p
        ) from exc
    try:
        return safetensors_load(p, target, mmap=mmap, stamp=found.stamps.get(p))
    except CheckpointError:  # the file changed while it was read
        raise
    except Exception as exc:
        reason = "it is truncated or corrupt"
        raise _unreadable(p, exc, target, first_sentence(str(exc)), reason) from exc


def _whole_model(p: Path) -> bool:
    try:
        return pickles_a_model(code_globals(p))
    except CheckpointError:
        return False


Alloc = Callable[[tuple[int, ...], torch.dtype], "torch.Tensor | None"]
"""Host memory for a tensor of a read (its shape and dtype), or None to allocate it afresh:
the disk tier hands its reused buffer (``spreading._offload``)."""


def read_entries(
    found: Catalog,
    names: list[str],
    target: torch.device,
    dtype_of: DTypeWish | None = None,
    *,
    fresh: bool = True,
    threads: int | None = None,
    alloc: Alloc | None = None,
) -> dict[str, torch.Tensor]:
    """The catalog's addressable entries ``names``, each allocated on ``target`` (the CPU for an
    accelerator other than CUDA) and read straight into, every file's stamp checked.

    ``dtype_of(name)``: the floating dtype a floating tensor is wanted in (the model's), so that
    it is converted chunk by chunk as it is read, never held in the file's dtype whole.
    ``fresh=False``: the host memory allocated is likely resident already; ``threads``: at most
    this many threads read into host memory (both as ``read_into`` takes them).
    """
    plan = whole_plan(found, names, dtype_of)
    return read_assembled(found, plan, target, fresh=fresh, threads=threads, alloc=alloc)


def whole_plan(
    found: Catalog, names: list[str], dtype_of: DTypeWish | None = None
) -> dict[str, Assembled]:
    """Each entry of ``names`` as one tensor read as saved, in the floating dtype ``dtype_of``
    wants for it where both are floating (converted a chunk at a time as it is read)."""
    plan = {}
    for name in names:
        e = found.entries[name]
        stored = e.torch_dtype(found.where)
        want = dtype_of(name) if dtype_of is not None else None
        if want is None or not (want.is_floating_point and stored.is_floating_point):
            want = stored
        plan[name] = Assembled(e.shape, want, [Part(e, (0,) * len(e.shape))])
    return plan


def _allocated(
    found: Catalog, plan: Mapping[str, Assembled], home: torch.device, alloc: Alloc | None = None
) -> tuple[dict[str, torch.Tensor], list[tuple[Entry, torch.Tensor]]]:
    """``read_assembled``'s tensors allocated on ``home``, and each piece's entry with the slice
    of its tensor it fills (every piece checked to fit before a byte is read)."""
    out: dict[str, torch.Tensor] = {}
    parts: list[tuple[Entry, torch.Tensor]] = []
    for name, made in plan.items():
        made_here = None if alloc is None else alloc(made.shape, made.dtype)
        t = out[name] = (
            made_here
            if made_here is not None
            else torch.empty(made.shape, dtype=made.dtype, device=home)
        )
        for piece in made.pieces:
            e = piece.entry
            if not e.addressable or e.file is None or e.order is None:
                raise CheckpointError(
                    f"{e.file}: tensor {e.name!r} cannot be read here: {e.why}", path=e.file
                )
            e.torch_dtype(found.where)  # one this torch holds
            lead = len(piece.at) - len(e.shape)  # leading offsets index (stacked experts)
            dest: torch.Tensor | None = None
            if lead >= 0 and len(piece.at) == t.dim():
                index: list[int | slice] = list(piece.at[:lead])
                index += [slice(a, a + n) for a, n in zip(piece.at[lead:], e.shape, strict=True)]
                dest = t[tuple(index)] if index else t
            if dest is None or tuple(dest.shape) != e.shape:
                raise CheckpointError(
                    f"{found.where}: {e.name!r} of shape {e.shape} does not fit {name!r} "
                    f"(shape {made.shape}) at {piece.at}",
                    path=found.path,
                )
            parts.append((e, dest))
    return out, parts


def read_assembled(
    found: Catalog,
    plan: Mapping[str, Assembled],
    target: torch.device,
    *,
    fresh: bool = True,
    threads: int | None = None,
    alloc: Alloc | None = None,
) -> dict[str, torch.Tensor]:
    """Each tensor of ``plan`` allocated on ``target`` (the CPU for an accelerator other than
    CUDA) and filled from its pieces' byte ranges, every file's stamp checked.

    Each piece is its entry's box read whole into its slice of the tensor, as the sharded fill
    reads a rank's box (``_boxes.queue_box``): a slice that is one run of memory (a box over the
    leading dim, or the whole) is read straight into it, converted to the tensor's dtype a chunk
    at a time; a box across a later dim goes a few rows at a time through a reusable host buffer
    of at most 16 MiB and a copy; a piece saved as a transposed view is read whole into a
    temporary of its own (one at a time) and laid out by a copy. ``fresh`` and ``threads``: as
    ``read_into`` takes them.
    """
    home = target if target.type in ("cpu", "cuda") else torch.device("cpu")
    try:  # every tensor is allocated before a byte is read
        out, parts = _allocated(found, plan, home, alloc if home.type == "cpu" else None)
    except CheckpointError:
        raise
    except Exception as exc:  # out of memory on the target, a failing device
        if out_of_memory(exc) or device_failure(exc):
            raise CheckpointError(
                f"{found.where}: {diagnose(exc, True, target)}", path=found.path
            ) from exc
        raise CheckpointError(
            f"{found.where}: its tensors could not be allocated on {target} "
            f"({type(exc).__name__}: {first_sentence(str(exc))})",
            path=found.path,
        ) from exc
    reader = BoxReader(found.stamps, fresh=fresh, threads=threads, together=False)
    try:
        for e, dest in parts:  # a plain fill: one box covering each entry
            queue_box(reader, e, ((0,) * len(e.shape), e.shape), dest)
        reader.flush()
        reader.verify()  # no write landed while they were read
    except CheckpointError:
        raise
    except Exception as exc:
        p = reader.at or found.path or Path(found.where)
        detail = f"{type(exc).__name__}: {first_sentence(str(exc))}"
        reason = f"it is truncated: {WRITER_HINT}, or its save was interrupted (save it again)"
        kind = "a torch file" if found.kinds.get(p, found.kind) == "zip" else "safetensors"
        raise _unreadable(p, exc, target, detail, reason, kind) from exc
    finally:
        reader.close()
    if home != target:
        try:
            out = {name: t.to(target) for name, t in out.items()}
        except Exception as exc:
            raise _unreadable(found.path or Path(found.where), exc, target, str(exc), "") from exc
    return out


def _unreadable(
    p: Path,
    exc: Exception,
    target: torch.device,
    detail: str,
    likely: str,
    kind: str = "safetensors",
) -> CheckpointError:
    """The error for a file of ``kind`` that failed to read: the device's own trouble (out of
    memory, a failing GPU) said as such, a file gone since it was found (a checkpoint a
    ``"disk"`` module reads, moved or deleted under the model) or one this user may not read
    (or a directory now) as such, anything else as a damaged file."""
    if out_of_memory(exc) or device_failure(exc):
        return CheckpointError(f"{p}: {diagnose(exc, True, target)}", path=p)
    if isinstance(exc, FileNotFoundError):
        return CheckpointError(
            f"{p}: no longer exists: it was moved or deleted after it was found; put it back "
            "where it was, or load the model again from where it is now",
            path=p,
        )
    if isinstance(exc, (PermissionError, IsADirectoryError)):  # not damage: said as it is
        return unopenable(p, exc)
    return CheckpointError(f"{p}: cannot be read as {kind} ({detail}); {likely}", path=p)


def load_state(
    path: PathLike,
    target: torch.device,
    *,
    mmap: bool,
    dtype_of: DTypeWish | None,
    check_crc: bool | None = None,
    kind: str | None = None,
    wanted: Callable[[str], bool] | None = None,
) -> Any:
    """``load(path, target, mmap=mmap)`` for ``load_into``: tensors of safetensors files (alone
    or in an index) are read in the dtype ``dtype_of`` asks for, converted as they are read,
    and only the keys ``wanted`` keeps (all where None; see ``ReadOptions.wanted``).
    ``kind``: the format of ``path``, where the caller resolved it already (then ``path`` is
    the file it resolved to, and neither is worked out again)."""
    p = resolve(path) if kind is None else Path(path)
    kind = format_of(p) if kind is None else kind
    # (a safetensors file has no checksum: load_into has said so already)
    crc = check_crc and kind != "safetensors"
    return reader_for(kind, target)(p, target, ReadOptions(mmap, False, crc, dtype_of, wanted))


def _load_index(p: Path, target: torch.device, o: ReadOptions) -> dict[str, Any]:
    """Every tensor an index lists: safetensors shards read from the catalog's entries (or
    mapped, with ``mmap=True``), other shards by their own reader and the listed names taken."""
    found = catalog(p)
    by_file: dict[Path, list[str]] = {}
    for name, e in found.entries.items():
        assert e.file is not None
        if o.wanted is None or o.wanted(name):  # a shard of none of them is not opened
            by_file.setdefault(e.file, []).append(name)
    result: dict[str, Any] = {}
    for shard, names in by_file.items():
        kind = found.kinds.get(shard) or format_of(shard)
        by_entries = not o.mmap and sys.byteorder == "little" and target.type != "meta"
        if kind == "safetensors" and by_entries:  # the index's entries of this shard only
            part: Mapping[str, Any] = read_entries(found, names, target, o.dtype_of)
        else:
            # a safetensors shard has no checksum to check: said once for the whole index
            crc = o.check_crc and kind != "safetensors"
            loaded = reader_for(kind, target)(shard, target, dataclasses.replace(o, check_crc=crc))
            if not isinstance(loaded, Mapping):
                raise CheckpointError(
                    f"{shard}: holds a {type(loaded).__name__}, not tensors", path=shard
                )
            part = loaded
        for name in names:
            if name in part:
                result[name] = part[name]
            else:  # a quantized or sparse tensor, catalogued by its parts: loaded whole
                head = name.split(".")
                for k in range(len(head) - 1, 0, -1):
                    owner = ".".join(head[:k])
                    if owner in part:
                        result[owner] = part[owner]
                        break
    return result


# ------------------------------------------------------------- the reader, by format and device


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How a reader reads a file: mapped (``mmap``), by ``torch.load`` without
    ``weights_only`` (``trusted``), its CRC-32s checked (``check_crc``, as ``load`` takes it),
    and its floating tensors in the dtype ``dtype_of`` wishes for (``load_into``'s)."""

    mmap: bool
    trusted: bool = False
    check_crc: bool | None = None
    dtype_of: DTypeWish | None = None
    # Which keys to read, where not all: the others are not read at all (load_into's rename
    # drops them, or they stay on disk, as a load by map's disk modules do). Kept by a
    # safetensors file (or index) entry by entry, by a torch zip file storage by storage (one
    # that a wanted tensor shares is read) where it is read in wished dtypes; a legacy or
    # unusual torch file is read whole.
    wanted: Callable[[str], bool] | None = None


Reader = Callable[[Path, torch.device, ReadOptions], Any]  # a whole file's objects on the device

# The device types a reader is chosen by: "other" is any accelerator but CUDA (read into host
# memory and moved, or by torch.load).
DEVICE_TYPES = ("cpu", "cuda", "meta", "other")
_ZIP_BY_LAYOUT = functools.partial(_load_torch, zip_format=True, by_layout=True)
_ZIP_BY_TORCH = functools.partial(_load_torch, zip_format=True, by_layout=False)
_LEGACY = functools.partial(_load_torch, zip_format=False, by_layout=False)

# The reader of each (format, device type): the zip layout reader fills storages on the CPU and
# CUDA only; the safetensors package rejects meta, where the header says all there is to know.
READERS: dict[tuple[str, str], Reader] = {
    **{("index", device): _load_index for device in DEVICE_TYPES},
    **{("legacy", device): _LEGACY for device in DEVICE_TYPES},
    ("zip", "cpu"): _ZIP_BY_LAYOUT,
    ("zip", "cuda"): _ZIP_BY_LAYOUT,
    ("zip", "meta"): _ZIP_BY_TORCH,
    ("zip", "other"): _ZIP_BY_TORCH,
    ("safetensors", "cpu"): _load_safetensors,
    ("safetensors", "cuda"): _load_safetensors,
    ("safetensors", "meta"): _safetensors_on_meta,
    ("safetensors", "other"): _load_safetensors,
}


def reader_for(kind: str, target: torch.device) -> Reader:
    """The reader of a file of format ``kind`` (``detect_format``'s) onto ``target``;
    ``CheckpointError`` for a pair no reader reads."""
    device = target.type if target.type in DEVICE_TYPES else "other"
    reader = READERS.get((kind, device))
    if reader is None:
        formats = ", ".join(sorted({k for k, _ in READERS}))
        raise CheckpointError(
            f"no reader reads a {kind!r} checkpoint onto {target}; torchplace reads the formats "
            f"{formats} onto the CPU, meta or an accelerator"
        )
    return reader
