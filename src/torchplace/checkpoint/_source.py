"""Sources: what a checkpoint path names, before any tensor is read.

The first step of a checkpoint's path through ``checkpoint/``: a path (or a directory as
``save_pretrained`` writes it) resolved to one file, that file told apart by its first bytes
(``detect_format``: torch zip, legacy pickle, ``.safetensors``, shard index; a foreign file is
named), and an index's shards checked (``shards``). ``_catalog`` turns what this finds into a
table of entries; nothing here reads a tensor, and nothing here needs torch.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

from .._errors import CheckpointError
from .._suggest import close_matches
from ._opened import file_kind, not_a_file, opened, unopenable

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "WRITER_HINT",
    "ZIP_MAGIC",
    "PathLike",
    "as_path",
    "detect_format",
    "is_dir",
    "model_file",
    "resolve",
    "shards",
]

PathLike = Union[str, "os.PathLike[str]"]


# The first bytes of formats people mistake for checkpoints, to say what a foreign file is.
_FOREIGN_MAGIC = (
    (b"\x93NUMPY", "a NumPy .npy array (load it with numpy.load)"),
    (b"\x89HDF", "an HDF5 file (Keras or h5py; load it with h5py)"),
    (b"GGUF", "a GGUF file (llama.cpp)"),
    (b"\x1f\x8b", "a gzip archive (decompress it first)"),
    (b"PK\x05\x06", "an empty zip archive"),
)
ZIP_MAGIC = b"PK\x03\x04"
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".index.json")
# Said of a file found empty, cut short or changing as it is read: a save in progress looks so.
WRITER_HINT = "another process may be writing it right now (load it again once the writer is done)"


def as_path(path: Any, /) -> Path:
    """``path`` as a ``Path`` (a leading ``~`` expanded, as the shell does), or a
    ``CheckpointError`` saying what a checkpoint path is (an empty one is none).

    >>> as_path(None)
    Traceback (most recent call last):
    ...
    torchplace.CheckpointError: a checkpoint is named by its path (a str or os.PathLike), ...
    """
    if isinstance(path, Path) and path.parts and not path.parts[0].startswith("~"):
        return path  # already one (a call passes its path down several times)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)):
        extra = (
            "; torchplace reads files by path (to map them), so write the bytes to a file "
            "first, or use torch.load for an open file"
            if hasattr(path, "read")
            else ""
        )
        raise CheckpointError(
            f"a checkpoint is named by its path (a str or os.PathLike), not "
            f"{type(path).__name__}{extra}"
        )
    if not os.fspath(path):  # Path("") would be the current directory, read as a checkpoint
        raise CheckpointError("an empty path names no checkpoint; give the checkpoint's path")
    return Path(os.path.expanduser(path))  # "~/x.pt" as the shell would read it


def detect_format(path: PathLike, /) -> str:
    """The format of a checkpoint file: ``"zip"``, ``"legacy"``, ``"safetensors"`` or ``"index"``.

    Raises ``CheckpointError`` for a missing file, a directory, an empty or a foreign file, and
    for anything that is not a regular file (a pipe would block the read for ever).
    """
    p = as_path(path)
    try:
        info = p.stat()
    except FileNotFoundError:
        hint = _near_misses(p)
        raise CheckpointError(f"{p}: no such file; check the path{hint}", path=p) from None
    except OSError as exc:  # a name too long, a permission on a parent directory, ...
        raise unopenable(p, exc, asked=True) from exc
    if stat.S_ISDIR(info.st_mode):
        found = sorted(
            q.name for q in p.iterdir() if q.is_file() and q.name.endswith(CHECKPOINT_SUFFIXES)
        )
        which = f": pass one of its files ({', '.join(found[:5])})" if found else ""
        raise CheckpointError(f"{p}: is a directory, not a checkpoint file{which}", path=p)
    if not stat.S_ISREG(info.st_mode):  # never opened: a pipe's open waits for a writer
        raise not_a_file(p, info.st_mode)
    size = info.st_size
    try:
        with opened(p) as f:  # a file it cannot open is refused there, saying why
            head = f.read(16)
    except OSError as exc:
        raise unopenable(p, exc) from exc
    if size == 0:
        raise CheckpointError(
            f"{p}: is empty (0 bytes); {WRITER_HINT}, or its save was interrupted (save it again)",
            path=p,
        )
    if len(head) < min(size, 16):  # fewer bytes than the size just read: it shrank
        raise CheckpointError(
            f"{p}: the file changed while it was read (its size went from {size} to "
            f"{len(head)} bytes); {WRITER_HINT}",
            path=p,
        )
    return _format_by_head(p, head, size)


def _format_by_head(p: Path, head: bytes, size: int) -> str:
    """``detect_format``'s answer from a file's first 16 bytes (``head``) and its ``size``;
    ``CheckpointError`` for a foreign file or a safetensors file cut short."""
    if p.name.endswith(".json"):
        return "index"
    if head.startswith(ZIP_MAGIC):
        return "zip"
    if len(head) >= 9:
        (header_len,) = struct.unpack("<Q", head[:8])
        if head[8:9] == b"{" and header_len <= size - 8:
            return "safetensors"
        if head[8:9] == b"{" and p.name.endswith(".safetensors"):
            raise CheckpointError(
                f"{p}: is a safetensors file cut short: its header alone should take "
                f"{header_len + 8} bytes, and the file has {size}; {WRITER_HINT}, or the save "
                "or download was interrupted (write or fetch it again)",
                path=p,
            )
    if head[:1] == b"\x80":  # a pickle: torch's legacy format (torch checks its magic number)
        return "legacy"
    if head.lstrip(b" \t\r\n\xef\xbb\xbf")[:1] == b"{":  # JSON by its bytes: a shard index
        return "index"
    for magic, what in _FOREIGN_MAGIC:
        if head.startswith(magic):
            raise CheckpointError(
                f"{p}: is {what}, not a PyTorch or safetensors checkpoint", path=p
            )
    short = (
        f"; at {size} bytes it is too short to be one: {WRITER_HINT}, or its save was "
        "interrupted (save it again)"
        if size < 9  # shorter than any checkpoint's first bytes: the start of one, maybe
        else ""
    )
    raise CheckpointError(
        f"{p}: is not a PyTorch or safetensors checkpoint (it starts with {head[:8]!r}); "
        "torchplace reads torch.save files (zip or legacy), .safetensors files and "
        f"*.index.json shard maps{short}",
        path=p,
    )


def _near_misses(p: Path) -> str:
    """A hint naming checkpoint files beside a path that does not exist: those of the same
    stem (``model.pt`` for ``model.pth``), then those the name misspells (``modle.pt``)."""
    parent = p.parent if str(p.parent) else Path(".")
    try:
        files = sorted(
            q.name for q in parent.iterdir() if q.is_file() and q.name.endswith(CHECKPOINT_SUFFIXES)
        )
    except OSError:
        return ""
    stem = p.name.split(".")[0]
    found = [name for name in files if name.startswith(stem)]
    stems: dict[str, list[str]] = {}  # compared without suffixes, which all names share
    for name in files:
        stems.setdefault(name.split(".")[0], []).append(name)
    found += [n for s in close_matches(stem, stems, n=5) for n in stems[s] if n not in found]
    return f" (found nearby: {', '.join(found[:5])})" if found else ""


def shards(p: Path, weight_map: Mapping[str, str]) -> list[tuple[str, Path, list[str]]]:
    """The shards an index names, checked: (name in the index, path, tensor names) each.

    A shard must be named inside the index's own directory (a link there may lead anywhere, as
    the Hugging Face cache's do) and not be an index itself (an index naming itself, or two
    naming each other, would never end). A shard spelt two ways
    (``s1.safetensors`` and ``./s1.safetensors``) is one file, listed (and read) once under the
    first spelling. Every shard is looked for before any is read: the error for missing ones
    names them all, however many tensors the index lists.
    """
    by_spelling: dict[str, list[str]] = {}  # one path resolved per shard, not per tensor
    for name, shard in weight_map.items():
        by_spelling.setdefault(str(shard), []).append(name)
    root = Path(os.path.normpath(p.parent))
    by_shard: dict[Path, tuple[str, list[str]]] = {}
    for shard, names in by_spelling.items():
        # The name must stay inside the index's directory as it is spelt ("../x", "/x" and
        # "a/../../x" do not); where a link there leads is the owner's choice, as the Hugging
        # Face cache links each file of a snapshot to ../../blobs/<hash>.
        if root not in Path(os.path.normpath(p.parent / shard)).parents:
            raise CheckpointError(
                f"{p}: names shard {shard!r} outside its own directory; refusing to read it", path=p
            )
        try:
            where = (p.parent / shard).resolve()
        except (OSError, ValueError) as exc:  # a NUL in the name, a loop of links
            raise CheckpointError(
                f"{p}: names shard {shard!r}, which is not a usable file name ({exc})", path=p
            ) from exc
        by_shard.setdefault(where, (shard, []))[1].extend(names)
    missing: list[str] = []
    odd: list[tuple[str, int]] = []  # shards that are there but are no regular files
    for shard_path, (shard, _) in by_shard.items():
        try:
            mode = os.stat(shard_path).st_mode  # asked, never opened: a pipe's open blocks
        except FileNotFoundError:  # (a link to nothing too)
            missing.append(shard)
            continue
        except OSError:  # a permission on its directory, ...: detect_format below says so
            continue
        if not stat.S_ISREG(mode):
            odd.append((shard, mode))
    if missing:
        raise _missing_shards(p, root, missing)
    if odd:
        raise _odd_shard(p, *odd[0])
    found = []
    for shard_path, (shard, names) in by_shard.items():
        if detect_format(shard_path) == "index":
            raise CheckpointError(
                f"{p}: names shard {shard!r}, which is itself a shard index; an index lists "
                "the files that hold the tensors",
                path=p,
            )
        found.append((shard, shard_path, names))
    return found


def _missing_shards(p: Path, root: Path, missing: list[str]) -> CheckpointError:
    """The error for the shards ``missing`` that the index ``p`` names: every one, and the
    links among them that lead to nothing (an unfinished download in the Hugging Face cache)."""
    which = (
        f"shard {missing[0]!r}, which is"
        if len(missing) == 1
        else f"{len(missing)} shards that are"
    )
    listed = "" if len(missing) == 1 else f" ({', '.join(map(repr, missing))})"
    links = [s for s in missing if (p.parent / s).is_symlink()]
    dangling = (
        f" ({'a link' if len(links) == 1 else 'links'} to nothing: "
        f"{', '.join(f'{s!r} -> {os.readlink(p.parent / s)!r}' for s in links[:3])}, as an "
        "unfinished download leaves in the Hugging Face cache)"
        if links
        else ""
    )
    return CheckpointError(
        f"{p}: names {which} missing from {root}{listed}{dangling}; download or copy every "
        "shard the index lists",
        path=p,
    )


def _odd_shard(p: Path, shard: str, mode: int) -> CheckpointError:
    """The error for the index ``p`` naming ``shard``, which is there as a ``mode`` other than a
    regular file's (a directory, a pipe, a device): it names the shard as the index spells it."""
    spelt = Path(os.path.normpath(p.parent / shard))
    what = (
        "a directory, not a file"
        if stat.S_ISDIR(mode)
        else f"not a regular file but a {file_kind(mode)}, which torchplace does not read"
    )
    link = f" (a link to {os.readlink(spelt)!r})" if spelt.is_symlink() else ""
    return CheckpointError(
        f"{p}: names shard {shard!r}{link}, which is {what}; copy the shard's file itself there",
        path=spelt,
    )


# The files save_pretrained writes, in the order a directory is searched for its one model file.
_MODEL_FILE_KINDS = (".safetensors.index.json", ".index.json", ".safetensors")


def is_dir(p: Path, /) -> bool:
    """Whether ``p`` is a directory; for a path that cannot be asked, ``detect_format`` says why."""
    try:
        return stat.S_ISDIR(p.stat().st_mode)
    except (OSError, ValueError):
        return False


def model_file(p: Path, /) -> Path:
    """The checkpoint a directory holds, as ``save_pretrained`` writes one: its index or its file.

    An index (``*.index.json``) names the shards beside it, so a directory with one index means
    that index; without one, a directory with one checkpoint file means that file. Where several
    could be meant, one safetensors index (or, without any index, one ``.safetensors`` file) is
    what ``save_pretrained`` would have written; anything else is a ``CheckpointError`` that lists
    the files to choose from.
    """
    try:
        named = sorted(q for q in p.iterdir() if q.name.endswith(CHECKPOINT_SUFFIXES))
        found = [q for q in named if q.is_file()]
    except OSError as exc:
        raise unopenable(p, exc) from exc
    indexes = [q for q in found if q.name.endswith(".index.json")]
    candidates = indexes or found
    if len(candidates) == 1:
        return candidates[0]
    for suffix in _MODEL_FILE_KINDS:
        preferred = [q for q in candidates if q.name.endswith(suffix)]
        if len(preferred) == 1:
            return preferred[0]
    if not candidates:
        odd = _not_files(named)
        if odd is not None:
            return odd
        raise CheckpointError(
            f"{p}: is a directory holding no checkpoint (no *.safetensors, *.bin, *.pt, *.pth, "
            "*.ckpt or *.index.json file); pass the checkpoint's own path",
            path=p,
        )
    names = ", ".join(q.name for q in candidates[:6])
    raise CheckpointError(
        f"{p}: is a directory holding several checkpoints ({names}), and which one is meant "
        f"cannot be told; pass its path, e.g. {str(p / candidates[0].name)!r}",
        path=p,
    )


def _not_files(named: list[Path]) -> Path | None:
    """Of a directory's entries ``named`` as checkpoints, none a regular file: the first that is
    there (a pipe, a socket, a device), which ``detect_format`` then refuses by name, or a
    ``CheckpointError`` for one that is a directory; None where none is there at all."""
    for q in named:
        try:
            mode = q.stat().st_mode  # asked, never opened
        except OSError:  # a link to nothing
            continue
        if stat.S_ISDIR(mode):
            raise CheckpointError(
                f"{q.parent}: holds no checkpoint file: {q.name} is a directory, not a file; "
                "pass the checkpoint file's own path",
                path=q,
            )
        return q
    return None


def resolve(source: Any, /) -> Path:
    """The one file a path names: the path itself, or a directory's model file (its index, or
    its one checkpoint file, as ``save_pretrained`` writes them)."""
    p = as_path(source)
    return model_file(p) if is_dir(p) else p
