"""``torchplace inspect`` and ``torchplace remap``: look at and rewrite checkpoint files.

``inspect`` reads a file's tensor table without running any of its pickled code and without a
GPU: torch files are read by an unpickler that builds inert records for every global it meets
(so a malicious file is described, never executed), safetensors files by their JSON header,
without importing torch (so ``torchplace inspect FILE.safetensors`` starts at once). Whatever
``load`` refuses, inspect refuses: a legacy file cut short in its storages, a safetensors header
whose tensors overlap, leave gaps or overflow.

``remap`` rewrites a torch file so that a plain ``torch.load`` puts its tensors on another
device, or every shard of a shard index. It reads files safely (``weights_only=True``,
memory-mapped), writes temporary files (``.NAME.torchplace-tmp-PID``) beside the outputs with
every storage tagged for the new device, and renames them into place only when all are
complete, so an interrupted run leaves no partial output; the temporary files of a run that was
killed outright are swept by the next remap into the same directory. An output that exists
already is refused unless ``--force`` (a file rewritten in place excepted), and a
``save_pretrained`` directory's other files (``config.json``, tokenizer files) are copied beside
its remapped checkpoint as they are.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import re
import shutil
import sys
import types
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from itertools import compress, repeat
from operator import attrgetter, eq
from pathlib import Path
from typing import IO, Any, NamedTuple, cast

from .._errors import CheckpointError, DeviceSpecError, TorchplaceError
from .._sizes import format_bytes
from ._catalog import catalog, code_globals, describe_file, format_of, gc_paused
from ._hub_names import hub_names_note
from ._pickle_reader import TensorRecord, pickles_a_model
from ._progress import progress_bar, wanted
from ._run_command import run_command
from ._source import as_path, resolve, shards

__all__ = [
    "TensorRecord",
    "code_globals",
    "describe_file",
    "register",
    "remap",
    "sweep_stale_temporaries",
]

# Progress is shown for files at least this large (when the output is a terminal).
PROGRESS_MIN_BYTES = 16 * 1024 * 1024


def _sizes(records: list[TensorRecord]) -> list[int]:
    """The bytes each record adds to its file: its storage's, once per storage."""
    return [0 if r.shares is not None else r.stored for r in records]


def _totals_by(
    records: list[TensorRecord], key: str, sizes: list[int] | None = None
) -> dict[str, dict[str, int]]:
    """Tensors and bytes (``sizes``, ``_sizes`` of the records where not given) per value of
    ``key``, in the order each value first comes. A checkpoint holds a few devices and dtypes:
    each is summed in one pass of C (``compress``), not one step of Python per tensor."""
    values = list(map(attrgetter(key), records))
    sizes = _sizes(records) if sizes is None else sizes
    return {
        value: {"count": count, "bytes": sum(compress(sizes, map(eq, values, repeat(value))))}
        for value, count in Counter(values).items()
    }


def _note(r: TensorRecord) -> str:
    if r.shares is not None:
        return f"shares {r.shares}'s storage"
    if r.stored > r.nbytes:
        return f"a view of {format_bytes(r.stored)}, all stored"
    return ""


def _printable(text: Any) -> str:
    """``text`` as stdout can encode it: a lone surrogate (a pickle's string, or a file name
    that is not UTF-8) is shown escaped instead of failing the print."""
    plain = str(text)
    return plain if plain.isascii() else plain.encode("utf-8", "backslashreplace").decode("utf-8")


def _run_inspect(args: argparse.Namespace) -> int:
    with gc_paused():  # its tables make two objects a cell, none in a cycle
        return _inspect(args)


def _inspect(args: argparse.Namespace) -> int:
    try:
        found = catalog(args.file)  # a file, an index or a save_pretrained directory
        kind, records, code = found.kind, found.records(), found.code
    except CheckpointError as exc:
        print(f"torchplace inspect: error: {exc}", file=sys.stderr)
        return 1
    note = hub_names_note(r.name for r in records)
    if args.json:
        print(json.dumps(_summary(str(args.file), kind, records, code, note), indent=2))
        return 0
    from rich.console import Console  # rich is imported only to render

    count = f"{len(records)} tensor{'' if len(records) == 1 else 's'}"
    console = Console(emoji=False)
    _render(console, f"{args.file} ({kind}, {count})", records, code)
    if note:
        from rich.markup import escape

        console.print(escape(note))
    return 0


def _summary(
    file: str, kind: str, records: list[TensorRecord], code: list[str], note: str | None
) -> dict[str, Any]:
    """What ``inspect --json`` prints. A record's fields are copied as they are (``asdict``
    copied each deeply, which took most of the time of an index of 100,000 tensors)."""
    sizes = _sizes(records)
    summary = {
        "file": file,
        "format": kind,
        "code_globals": code,
        "tensors": [{**vars(r), "shape": list(r.shape)} for r in records],
        "totals": {
            "count": len(records),
            "bytes": sum(sizes),
            "by_device": _totals_by(records, "device", sizes),
            "by_dtype": _totals_by(records, "dtype", sizes),
        },
    }
    if note:
        summary["note"] = note
    return summary


def _render(console: Any, title: str, records: list[TensorRecord], code: list[str]) -> None:
    """Print ``inspect``'s tables on a rich ``console``. No cell is ever cut: into a pipe or a
    file, a table takes the width it needs; on a terminal too narrow for it, each row is printed
    as plain lines instead (a tensor's name whole on a line of its own, the rest below)."""
    from rich.markup import escape

    headers, rows = _tensor_rows(records)
    sizes = _sizes(records)
    totals = []
    for key in ("device", "dtype"):
        for value, entry in _totals_by(records, key, sizes).items():
            totals.append([key, value, str(entry["count"]), format_bytes(entry["bytes"])])
    totals.append(["all", "", str(len(records)), format_bytes(sum(sizes))])

    if code:
        console.print(
            f"[bold red]Warning:[/bold red] loading this file would import and call "
            f"{escape(_printable(', '.join(code)))}; torchplace.load refuses it unless "
            "trusted=True"
        )
    _print_rows(console, title, headers, rows, right=("bytes",))
    _print_rows(
        console, "totals", ["by", "", "tensors", "bytes"], totals, right=("tensors", "bytes")
    )
    if any(r.device == "-" for r in records):
        console.print("safetensors files store no device: tensors load wherever they are asked to")
    if any(r.shares is None and r.stored > r.nbytes for r in records):
        console.print(
            "a tensor saved as a view stores its whole storage; save view.clone() to keep "
            "only its own bytes"
        )


def _tensor_rows(records: list[TensorRecord]) -> tuple[list[str], list[tuple[str, ...]]]:
    """The headers and rows of ``inspect``'s table of tensors, made column by column: the
    same few devices, dtypes, shapes and sizes are spelt once each."""
    files = [r.file for r in records]
    sharded = len(set(files)) > 1
    shapes = [r.shape for r in records]
    nbytes = [r.nbytes for r in records]
    shape_text = {shape: str(list(shape)) for shape in set(shapes)}
    size_text = {n: format_bytes(n) for n in set(nbytes)}
    columns = [
        [r.name for r in records],
        *([files] if sharded else []),
        [r.device for r in records],
        [r.dtype for r in records],
        list(map(shape_text.__getitem__, shapes)),
        list(map(size_text.__getitem__, nbytes)),
    ]
    headers = ["name", *(["file"] if sharded else []), "saved device", "dtype", "shape", "bytes"]
    # once: asked for each row, it made a table of n rows take n**2 steps
    if any(r.shares is not None or r.stored > r.nbytes for r in records):
        headers.append("note")
        columns.append([_note(r) for r in records])
    return headers, list(zip(*columns, strict=True))


def _print_rows(
    console: Any,
    title: str,
    headers: list[str],
    rows: Sequence[Sequence[str]],
    right: tuple[str, ...],
) -> None:
    """One table, printed whole: see ``_render``. Drawn as rich draws a table (heavy head,
    light body) but column by column: a checkpoint may list 100,000 tensors, whose table rich
    took minutes to lay out (about 1 ms a row)."""
    from rich.style import Style

    head = [_cell(c) for c in headers]
    columns = [_column(list(c)) for c in zip(*rows, strict=True)] or [_column([])] * len(head)
    widths = [max(w, c.width) for (_, w), c in zip(head, columns, strict=True)]
    needed = sum(widths) + 3 * len(widths) + 1  # a space either side of a cell, borders

    def styled(text: str, style: str) -> str:  # no codes where the console shows none
        return Style.parse(style).render(text, color_system=console.color_system)

    out = console.file
    text, width = _cell(title)
    if needed <= console.width or not console.is_terminal:  # a pipe or a file: no width to keep
        console.width = max(needed, console.width)  # what follows is not wrapped narrower
        left = max(needed - width, 0) // 2
        line = " " * left + text + " " * max(needed - left - width, 0)
        out.write(styled(line, "italic") + "\n")
        aligned = [h in right for h in headers]
        out.writelines(_box(head, columns, widths, aligned, styled))
        return
    out.write(styled(text, "italic") + "\n")
    for name, *rest in zip(*(c.texts for c in columns), strict=True):  # the first cell whole
        details = "  ".join(  # on a line of its own, the rest indented below
            f"{h}: {c}" if h else c for (h, _), c in zip(head[1:], rest, strict=True) if c
        )
        out.write(f"{styled(name, 'bold')}\n    {details}\n")


class _Column(NamedTuple):
    """A table column's cells (see ``_cell``), the columns each takes (None: as many as its
    characters) and the widest's width."""

    texts: list[str]
    sizes: list[int] | None
    width: int

    def padded(self, width: int, right: bool) -> list[str]:
        """The cells, each padded to ``width``, on the left where ``right``."""
        if self.sizes is None:  # str.rjust, str.ljust: no step of Python's per cell
            return list(map(str.rjust if right else str.ljust, self.texts, repeat(width)))
        if right:
            return [" " * (width - n) + t for t, n in zip(self.texts, self.sizes, strict=True)]
        return [t + " " * (width - n) for t, n in zip(self.texts, self.sizes, strict=True)]


def _column(texts: list[str]) -> _Column:
    """A column of these cells. One of printable ASCII, the common case, is measured whole."""
    joined = "".join(texts)
    if joined.isascii() and joined.isprintable():
        return _Column(texts, None, max(map(len, texts), default=0))
    measured = {t: _cell(t) for t in dict.fromkeys(texts)}  # a column's cells repeat
    cells = [measured[t] for t in texts]
    sizes = [n for _, n in cells]
    return _Column([t for t, _ in cells], sizes, max(sizes))


def _cell(value: Any) -> tuple[str, int]:
    """A cell's text and the columns it takes. Cells come from the file, which may be anyone's:
    plain text, never markup, without the control codes rich drops from a ``Text``."""
    text = _printable(value)
    if text.isascii() and text.isprintable():  # the common case, measured without rich
        return text, len(text)
    from rich.cells import cell_len
    from rich.control import strip_control_codes

    text = strip_control_codes(text)
    return text, cell_len(text)


def _box(
    head: list[tuple[str, int]],
    columns: list[_Column],
    widths: list[int],
    right: list[bool],
    styled: Callable[..., str],
) -> Iterator[str]:
    """The lines of a table of these columns, its header's cells in bold."""

    def rule(left: str, fill: str, mid: str, end: str) -> str:
        return left + mid.join(fill * (w + 2) for w in widths) + end + "\n"

    titles = [
        _Column([t], [n], n).padded(w, r)[0]
        for (t, n), w, r in zip(head, widths, right, strict=True)
    ]
    yield rule("┏", "━", "┳", "┓")
    yield "┃ " + " ┃ ".join(styled(t, "bold") for t in titles) + " ┃\n"
    yield rule("┡", "━", "╇", "┩")
    body = [c.padded(w, r) for c, w, r in zip(columns, widths, right, strict=True)]
    yield from map("│ {} │\n".format, map(" │ ".join, zip(*body, strict=True)))
    yield rule("└", "─", "┴", "┘")


# ---------------------------------------------------------------------------------------- remap


def _parse_target(spec: str) -> Any:
    """A device to tag storages with; it need not exist on this machine (no GPU needed).

    ``gpu``, ``gpu:N`` and a bare ``N`` name the machine's accelerator type (``cuda`` on a
    machine without one), as ``cuda`` and ``cuda:N`` do, so that no GPU is needed for them
    either; ``auto`` and ``best`` are the devices ``torchplace.device`` picks here (the CPU on a
    machine without an accelerator)."""
    import torch

    from .._devices import accelerator_type
    from .._devices import device as resolve

    text = spec.strip().lower()
    if text in ("auto", "best"):
        return resolve(text)
    accelerator = re.fullmatch(r"(?:gpu(?::\s*(\d+))?|(\d+))", text)
    if accelerator:  # accelerator N, as the int N and "gpu:N" are to torchplace.device
        number = accelerator.group(1) or accelerator.group(2)
        text = accelerator_type() + (f":{int(number)}" if number else "")
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        resolve(text)  # raises DeviceSpecError with a suggestion
        raise DeviceSpecError(f"unknown device {spec!r}") from None
    single = ("cpu", "meta", "mps")  # torch.load restores these tags only without an index
    indexed = ("cuda", "xpu", "hpu", "mtia", torch._C._get_privateuse1_backend_name())
    if dev.type in single:
        if dev.index not in (None, 0):
            raise DeviceSpecError(
                f"--to {spec}: there is one {dev.type} device, and torch.load reads a file "
                f"tagged {dev} nowhere; use --to {dev.type}"
            )
        return torch.device(dev.type)
    if dev.type not in indexed:
        raise DeviceSpecError(
            f"--to {spec}: torch.load cannot restore storages tagged {dev.type}; use one of "
            f"{', '.join(single)} or {', '.join(t + ':N' for t in indexed[:3])}"
        )
    if dev.index is None:
        dev = torch.device(dev.type, 0)
    return dev


class _CountingWriter(io.RawIOBase):
    """A binary file wrapper that reports how many bytes went through it."""

    def __init__(self, raw: IO[bytes], advance: Callable[[int], None]) -> None:
        super().__init__()
        self.raw, self.advance = raw, advance

    def writable(self) -> bool:
        return True

    failure: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            n = self.raw.write(data)
            self.advance(len(memoryview(data)))
        except BaseException as exc:  # torch's C++ writer turns it into a RuntimeError: keep it
            self.failure = exc
            raise
        return n if n is not None else 0

    def flush(self) -> None:
        self.raw.flush()


def _relocating_pickle(location: str) -> types.ModuleType:
    """A pickle module whose Pickler tags every saved storage with ``location``."""
    module = types.ModuleType("torchplace_relocating_pickle")

    class Pickler(pickle._Pickler):  # pure Python: it looks persistent_id up on each object
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            inner = self.persistent_id

            def persistent_id(obj: Any) -> Any:
                pid = inner(obj)
                if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
                    return (*pid[:3], location, *pid[4:])
                return pid

            self.persistent_id = persistent_id  # type: ignore[method-assign]

    module.Pickler = Pickler  # type: ignore[attr-defined]
    return module


_progress = progress_bar  # remap's bar, the one loads show


# Temporary files are named for their output and the process writing them
# (``.model.pt.torchplace-tmp-4242``), so that a remap can tell its own leftovers from a run
# that was killed (its process is gone) and sweep them.
_TMP_MARK = ".torchplace-tmp-"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # it exists, and belongs to someone else
        return True
    return True


def sweep_stale_temporaries(directory: str | os.PathLike[str], /) -> list[Path]:
    """Remove the temporary files that killed ``remap`` runs left in ``directory``; returns
    those it removed. A file is remap's by its name (``.OUT.torchplace-tmp-PID``) and stale
    when no process ``PID`` runs; a live run's files are left alone.

    >>> import tempfile
    >>> from torchplace.checkpoint._checkpoint_cli import sweep_stale_temporaries
    >>> sweep_stale_temporaries(tempfile.mkdtemp())
    []
    """
    if os.name != "posix":  # os.kill(pid, 0) would end the process on Windows: say, don't sweep
        return []
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        pid = entry.name.rpartition(_TMP_MARK)[2].partition("-")[0]
        if not entry.name.startswith(".") or _TMP_MARK not in entry.name or not pid.isdecimal():
            continue
        if int(pid) == os.getpid() or _process_alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


class _PendingOutputs:
    """Files written under temporary names beside their outputs, and renamed into place only
    once every one of them is complete (in the order added: an index after its shards). On any
    failure, every temporary file is removed and no output is touched."""

    def __init__(self) -> None:
        self.files: list[tuple[Path, Path]] = []  # (temporary, output)
        self.made_dirs: list[Path] = []

    def open(self, out: Path) -> tuple[Path, int]:
        """A new temporary file for ``out``: its path and an open descriptor."""
        missing = [d for d in (out.parent, *out.parent.parents) if not d.exists()]
        for d in reversed(missing):  # a shard in a sub-directory of the index's
            d.mkdir()
            self.made_dirs.append(d)
        for n in range(100):
            tmp = out.with_name(f".{out.name}{_TMP_MARK}{os.getpid()}" + (f"-{n}" if n else ""))
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            self.files.append((tmp, out))
            return tmp, fd
        raise FileExistsError(f"{out.parent}: too many temporary files named for {out.name}")

    def commit(self, modes_from: list[Path | None]) -> None:
        """Rename every file into place, in order, each with the mode of the output it replaces
        or else of its source in ``modes_from`` (``None``: the file's mode is set already). Only
        a failing rename (the files are on one file system, so hardly ever) can leave some
        renamed: shards, never the index after."""
        for (tmp, out), source in zip(self.files, modes_from, strict=True):
            if source is not None:  # not O_CREAT's private 0600
                shutil.copymode(out if out.exists() else source, tmp)
        for tmp, out in self.files:
            os.replace(tmp, out)
        self.files = []

    def discard(self) -> None:
        for tmp, _ in self.files:
            tmp.unlink(missing_ok=True)
        for d in reversed(self.made_dirs):
            with contextlib.suppress(OSError):
                d.rmdir()
        self.files, self.made_dirs = [], []


def _read_for_remap(src: Path, kind: str) -> Any:
    """What remap writes for ``src``: its loaded contents, or ``None`` for a safetensors file
    (copied as it is, once its header is checked as ``load`` checks it)."""
    from ._checkpoint import load

    if kind == "safetensors":
        for entry in catalog(src).entries.values():  # checked as load checks it
            entry.torch_dtype(str(src))
        return None
    try:
        # every record's CRC-32 checked, where the file records them: the rewrite records new
        # ones over what it read (a file with none is rewritten as it is, without a word)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*check_crc=True, but")
            return load(src, "cpu", check_crc=True)
    except CheckpointError as exc:
        # Refused for the code it would run, or for pickle opcodes the safe loader does not
        # read (a newer protocol), which load's own message already explains.
        found = []
        if "trusted=True" in str(exc):
            with contextlib.suppress(CheckpointError):  # the catalog refuses it: load's word
                found = code_globals(src)
        if not found:
            raise
        # Saved again, the objects would be pickled again: only the tensors can be remapped. A
        # whole model's are its state dict; a mapping's, the entries that are tensors.
        resaved = str(src.with_name(f"{src.stem}-weights.pt"))
        loaded = f"torchplace.load({str(src)!r}, 'cpu', trusted=True)"
        if pickles_a_model(found):
            kept, note = f"{loaded}.state_dict()", ""
        else:
            kept = f"{{k: v for k, v in {loaded}.items() if isinstance(v, torch.Tensor)}}"
            note = " (for a file holding a dict: its tensors kept, the other objects left out)"
        raise CheckpointError(
            f"{src}: would run code when loaded ({', '.join(found)}), "
            "and remap never runs a file's code. If you trust its source, rewrite it yourself"
            f"{note}: torch.save({kept}, {resaved!r}), then remap {resaved!r}",
            path=src,
        ) from exc


def _write_remapped(
    src: Path, obj: Any, fd: int, target: Any, advance: Callable[[int], None]
) -> None:
    """Write ``obj`` (or, when ``None``, ``src`` as it is) to the open file ``fd``, its storages
    tagged for ``target``, and flush it to disk."""
    with os.fdopen(fd, "wb") as raw:
        writer = _CountingWriter(raw, advance)
        try:
            if obj is None:
                from ._whole_files import copy_file  # torch: imported only once a file is copied

                copy_file(src, writer)
            else:
                import torch

                torch.save(
                    obj, cast(IO[bytes], writer), pickle_module=_relocating_pickle(str(target))
                )
        except BaseException as exc:
            # torch's C++ writer turns what the file raised (Ctrl-C, a full disk) into a
            # RuntimeError: raise the original.
            if writer.failure is not None and writer.failure is not exc:
                raise writer.failure from None
            raise
        raw.flush()
        os.fsync(raw.fileno())


def _output_file(dst: Path) -> None:
    """Refuse an output that cannot be a file: a directory, or one in a missing directory."""
    try:
        if dst.is_dir():
            raise CheckpointError(
                f"{dst}: is a directory; give the output file's name with -o", path=dst
            )
        if not dst.parent.is_dir():
            raise CheckpointError(f"{dst}: its directory {dst.parent} does not exist", path=dst)
    except OSError as exc:
        raise CheckpointError(
            f"{dst}: cannot be written ({exc.strerror or exc})", path=dst
        ) from exc


def _index_outputs(src: Path, dst: Path) -> tuple[Path, list[tuple[Path, Path, str]]]:
    """Where remapping the shard index ``src`` to ``dst`` writes: the new index, and each shard
    (source, output, format), laid out beside the new index as the old ones lie beside theirs.
    ``dst`` names the new index, or a directory to write it into under its old name."""
    try:
        if dst.is_dir() or str(dst).endswith(("/", os.sep)):
            dst = dst / src.name
        if not dst.parent.is_dir():
            raise CheckpointError(f"{dst}: its directory {dst.parent} does not exist", path=dst)
    except OSError as exc:
        raise CheckpointError(
            f"{dst}: cannot be written ({exc.strerror or exc})", path=dst
        ) from exc
    from ._index import weight_map

    # each shard under the name the index spells (the file may be a link elsewhere, as every
    # file of a Hugging Face cache snapshot is, into ../../blobs)
    spelt = {path: name for name, path, _ in shards(src, weight_map(src))}
    outputs = []
    for shard_path, kind in catalog(src).kinds.items():  # every shard, its format found
        if shard_path in spelt:
            outputs.append((shard_path, dst.parent / os.path.normpath(spelt[shard_path]), kind))
    reading = {src.resolve(), *(shard for shard, _, _ in outputs)}
    for out in [dst, *(out for _, out, _ in outputs)]:
        if out.resolve() in reading:
            raise CheckpointError(
                f"{src}: remapping it to {dst} would write over {out}, which it reads; give "
                "-o a new directory (or an index file in one) for the remapped shards",
                path=src,
            )
    return dst, outputs


def _other_files(folder: Path, rewritten: set[Path], into: Path) -> list[tuple[Path, Path, str]]:
    """The files of the ``save_pretrained`` directory ``folder`` that remap does not rewrite
    (``config.json``, ``generation_config.json``, tokenizer files; in sub-directories too), each
    as a job that copies it as it is to the same place under ``into``."""
    skip = into.resolve()  # an output directory inside the source is not copied into itself
    jobs = []
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        dirs[:] = sorted(d for d in dirs if (here / d).resolve() != skip)
        for name in sorted(files):
            file = here / name
            if _TMP_MARK in name or file.resolve() in rewritten or not file.is_file():
                continue  # a model file remap rewrites, a remap's temporary, a socket
            jobs.append((file, into / file.relative_to(folder), "copy"))
    return jobs


def _refuse_existing(jobs: list[tuple[Path, Path, str]]) -> None:
    """Refuse outputs that exist already, but for a file rewritten in place (source = output,
    replaced atomically as any output is)."""
    taken = [
        str(out)
        for source, out, _ in jobs
        if os.path.lexists(out) and out.resolve() != source.resolve()
    ]
    if taken:
        more = f" and {len(taken) - 3} more" if len(taken) > 3 else ""
        them = "it" if len(taken) == 1 else "them"
        raise CheckpointError(
            f"{', '.join(taken[:3])}{more}: exist{'s' if len(taken) == 1 else ''} already, and "
            f"remap does not write over a file it does not read unless told to: pass --force "
            f"(force=True) to replace {them}, or choose another -o. Nothing was written",
            path=taken[0],
        )


def remap(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    /,
    *,
    to: Any,
    progress: bool | None = None,
    force: bool = False,
) -> Path:
    """Rewrite a checkpoint so that ``torch.load`` puts its tensors on ``to``; returns the file
    written (for a shard index, the new index).

    >>> import os, tempfile, torch
    >>> from torchplace.checkpoint._checkpoint_cli import describe_file, remap
    >>> d = tempfile.mkdtemp()
    >>> torch.save({"w": torch.ones(2)}, os.path.join(d, "a.pt"))
    >>> out = remap(os.path.join(d, "a.pt"), os.path.join(d, "b.pt"), to="cuda:1")
    >>> describe_file(out)[0].device
    'cuda:1'

    The file is read without running code. The result is written to a temporary file beside
    ``out`` (``.OUT.torchplace-tmp-PID``) and renamed only when complete: an interrupted or
    failed remap leaves ``out`` as it was, and the next remap into that directory removes what
    a killed one left. A safetensors file stores no device, so it is copied unchanged once its
    header is checked as ``load`` checks it.

    A shard index (``*.index.json``) is remapped whole: every shard it lists is rewritten (or,
    for safetensors, copied) beside the new index, laid out as beside the old one, and the
    index is copied last. ``out`` names the new index (a name ending in ``.json``), or a
    directory to write it into under its own name, made if its parent exists; it may not be
    where the shards are read from. Nothing is renamed into place until every shard is written.

    ``out`` ending in a slash, or an existing directory, names a directory to write into under
    the source's own name (made if its parent exists), for any source.

    A ``save_pretrained`` directory is remapped through its checkpoint (its index, or its one
    model file): ``out`` then names a directory, made if its parent exists, that receives the
    checkpoint under its own names, and every other file of the directory (``config.json``,
    ``generation_config.json``, tokenizer files, sub-directories too) copied as it is, so that
    ``from_pretrained`` loads the new directory as it loaded the old one.

    An output that exists already is refused (``CheckpointError``, nothing written) unless
    ``force=True`` (``--force``): remap never replaces a file it was not asked to. A file
    remapped in place (``out`` the file ``path`` names) is replaced atomically, as asked.
    """
    given, dst = as_path(path), as_path(out)
    src = resolve(given)  # a save_pretrained directory: its index, or its one checkpoint file
    target = _parse_target(to) if isinstance(to, str) else to
    kind = format_of(src)
    slash = str(out).endswith(("/", os.sep))
    dst, made = _remap_destination(given, src, dst, slash, kind == "index")
    try:  # what remap checks before writing: a failure removes the directory it made
        dst, jobs = _remap_jobs(given, src, dst, kind, force)
        total = sum(job[0].stat().st_size for job in jobs)
        show = (wanted(None) and total >= PROGRESS_MIN_BYTES) if progress is None else progress
        for d in {job[1].parent for job in jobs}:
            sweep_stale_temporaries(d)
    except BaseException:
        _remove_if_made(made)
        raise
    try:
        _write_jobs(jobs, target, f"remap {src.name}", total, show)
    except BaseException as exc:
        _remove_if_made(made)
        if isinstance(exc, (TorchplaceError, KeyboardInterrupt, SystemExit)):
            raise
        if isinstance(exc, Exception):
            raise CheckpointError(
                f"{src}: could not be rewritten to {dst} ({type(exc).__name__}: {exc}); "
                f"{dst} was not touched",
                path=src,
            ) from exc
        raise
    return dst


def _remove_if_made(made: Path | None) -> None:
    """Remove the output directory a failed remap made, only if empty: nothing of the user's
    is removed."""
    if made is not None:
        with contextlib.suppress(OSError):
            made.rmdir()


def _remap_destination(
    given: Path, src: Path, dst: Path, slash: bool, index: bool
) -> tuple[Path, Path | None]:
    """Where remap writes ``src`` (the file ``dst`` names, or one under the source's own name in
    the directory it names), and the output directory this call made (None if none).

    -o names a directory the copy goes into, under the source's own names: from a directory
    always; from an index, unless it ends in the .json an index is found by; and from any
    source, when it ends in a slash or is a directory already (as cp takes it).
    """
    made: Path | None = None
    try:
        is_dir, exists = dst.is_dir(), dst.exists()
    except OSError as exc:  # a name too long, say
        raise CheckpointError(
            f"{dst}: cannot be written ({exc.strerror or exc})", path=dst
        ) from exc
    into_folder = src != given or slash or is_dir or (index and not dst.name.endswith(".json"))
    if into_folder and src == given and exists and not is_dir:
        name = "an index name ending in .json such as " if index else "the file's name, such as "
        raise CheckpointError(
            f"{dst}: is a file, not a directory; give -o a directory for the remapped "
            f"{'shards' if index else 'file'}, or {name}{src.name}. Nothing was written",
            path=dst,
        )
    if into_folder:
        try:
            if not dst.exists() and dst.parent.is_dir():
                dst.mkdir()
                made = dst
        except OSError as exc:
            raise CheckpointError(
                f"{dst}: cannot be made ({exc.strerror or exc})", path=dst
            ) from exc
        if dst.is_dir():
            dst = dst / src.name
        if not index and dst.resolve() == src.resolve():
            raise CheckpointError(
                f"{src}: remapping it into {dst.parent} would write over it, the file it reads; "
                "give -o another directory, or rewrite it in place by naming the file as both "
                f"the source and the output (torchplace remap {src} --to DEVICE -o {src}). "
                "Nothing was written",
                path=src,
            )
    return dst, made


def _remap_jobs(
    given: Path, src: Path, dst: Path, kind: str, force: bool
) -> tuple[Path, list[tuple[Path, Path, str]]]:
    """What remap will write, checked before anything is: (source, output, format) for each
    file, the index or the one file last; with the output that names the result."""
    if kind == "index":
        dst, shard_jobs = _index_outputs(src, dst)
    else:
        _output_file(dst)
        shard_jobs = []
    if src != given:  # a directory's other files, copied as they are, before its index
        rewritten = {job[0].resolve() for job in [*shard_jobs, (src, dst, kind)]}
        shard_jobs += _other_files(given, rewritten, dst.parent)
    jobs = [*shard_jobs, (src, dst, kind)]  # the index, or the one file, last
    if not force:
        _refuse_existing(jobs)
    return dst, jobs


def _write_jobs(
    jobs: list[tuple[Path, Path, str]], target: Any, title: str, total: int, show: bool
) -> None:
    """Write every output to a temporary file beside it, then rename them all into place; a
    failure removes the temporaries and leaves every output as it was."""
    pending = _PendingOutputs()
    try:
        with _progress(total, title, show) as advance:
            for source, output, fmt in jobs:
                # the index itself is copied as it is (its shards keep their names), and so are
                # a directory's other files
                obj = None if fmt in ("index", "copy") else _read_for_remap(source, fmt)
                try:
                    tmp, fd = pending.open(output)
                except OSError as exc:
                    raise CheckpointError(
                        f"{output}: cannot be written ({exc.strerror or exc}: no file could be "
                        f"created in {output.parent}); choose another output with -o. Nothing "
                        "was written",
                        path=output,
                    ) from exc
                _write_remapped(source, obj, fd, target, advance)
                if fmt == "copy":  # as shutil.copy2 copies: its mode and times too
                    shutil.copystat(source, tmp)
        pending.commit([None if job[2] == "copy" else job[0] for job in jobs])
    except BaseException:
        pending.discard()
        raise


def _run_remap(args: argparse.Namespace) -> int:
    return run_command(
        "remap",
        args.output,
        lambda: remap(args.file, args.output, to=args.to, force=args.force),
        lambda out: _say_remapped(args, out),
    )


def _say_remapped(args: argparse.Namespace, out: Path) -> None:
    """What ``remap`` wrote, and what it left as it was."""
    src = resolve(args.file)
    kind = format_of(src)
    loads_on = f"tensors load on {_parse_target(args.to)}"
    unchanged = "copied unchanged: a safetensors file stores no device"
    if kind == "safetensors":
        print(f"wrote {_printable(out)} ({unchanged})")
    elif kind == "index":
        kinds = set(catalog(src).kinds.values())  # each shard's format
        if kinds == {"safetensors"}:
            said = f"shards {unchanged}"
        elif "safetensors" in kinds:
            said = f"{loads_on}; safetensors shards are copied unchanged"
        else:
            said = loads_on
        print(f"wrote {_printable(out)} and its shards beside it ({said})")
    else:
        print(f"wrote {_printable(out)} ({loads_on})")
    if src != as_path(args.file):  # a save_pretrained directory
        print(f"copied the other files of {_printable(args.file)} beside it, as they are")


def register(subparsers: Any) -> None:
    """Add ``inspect`` and ``remap`` to the ``torchplace`` command line.

    >>> import argparse
    >>> from torchplace.checkpoint._checkpoint_cli import register
    >>> parser = argparse.ArgumentParser(prog="torchplace")
    >>> register(parser.add_subparsers())
    >>> parser.parse_args(["remap", "a.pt", "--to", "cpu", "-o", "b.pt"]).output
    'b.pt'
    """
    inspect = subparsers.add_parser(
        "inspect",
        help="list a checkpoint's tensors by saved device, dtype and size (runs no code)",
        description="List every tensor of a checkpoint with its saved device, dtype, shape and "
        "bytes, and totals per device and dtype. FILE is a torch.save file, a .safetensors "
        "file, a shard index (*.index.json: every shard it lists) or a directory as "
        "save_pretrained writes it (its index or its one model file). Pickled code is never "
        "run and no GPU is needed.",
    )
    inspect.add_argument(
        "file",
        metavar="FILE",
        help="a torch.save file, a .safetensors file, a shard index (*.index.json) or a "
        "save_pretrained directory",
    )
    inspect.add_argument("--json", action="store_true", help="print JSON instead of tables")
    inspect.set_defaults(func=_run_inspect)

    _register_remap(subparsers)


def _register_remap(subparsers: Any) -> None:
    """Add ``remap`` to the ``torchplace`` command line."""
    remap_cmd = subparsers.add_parser(
        "remap",
        help="rewrite a checkpoint (or every shard of one) to load elsewhere",
        description="Rewrite a checkpoint so that torch.load puts its tensors on DEVICE. For a "
        "shard index (*.index.json), every shard it lists is rewritten beside the new index, "
        "laid out as beside the old one (safetensors shards are copied: they store no device), "
        "and the index is copied last. Output is written to temporary files named "
        ".NAME.torchplace-tmp-PID and renamed only when all are complete, so a failure leaves "
        "no partial output; those a killed run left are removed by the next remap into the "
        "same directory.",
    )
    remap_cmd.add_argument(
        "file",
        metavar="FILE",
        help="the checkpoint to read: a torch.save or .safetensors file, a shard index "
        "(*.index.json) or a save_pretrained directory",
    )
    remap_cmd.add_argument(
        "--to",
        required=True,
        metavar="DEVICE",
        help="e.g. cpu or cuda:0; need not exist here: gpu, gpu:N and a bare N mean this "
        "machine's accelerator type (cuda on a machine without one), as cuda and cuda:N do; "
        "auto and best are the device torchplace.device picks here (cpu without an accelerator)",
    )
    remap_cmd.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT",
        help="file to write, or a directory (ending in / or existing; made if missing) to write "
        "it into under its own name; for an index, the new index file (ending in .json) or a "
        "directory for it and its shards (not the directory its shards are read from); for a "
        "save_pretrained directory, a directory that also receives its other files "
        "(config.json, tokenizer files, ...) copied as they are. An existing output is refused "
        "unless --force is given; naming FILE itself rewrites it in place",
    )
    remap_cmd.add_argument(
        "--force",
        action="store_true",
        help="replace outputs that exist already (by default remap refuses to write over them)",
    )
    remap_cmd.set_defaults(func=_run_remap)
