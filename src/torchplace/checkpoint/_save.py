"""``save``: a model in any placement, or a mapping of tensors, written atomically.

The path says the layout: a ``.safetensors`` file, a ``.pt``/``.pth`` torch file, or any other
path a directory as ``save_pretrained`` writes it (``model.safetensors``, or shards of at most
``max_shard_size`` named ``model-00001-of-0000N.safetensors`` with
``model.safetensors.index.json``, and a transformers model's ``config.json`` and generation
config). ``_save_items`` says what is written and under which names, ``_writers`` writes it a
tensor at a time, and ``_atomic`` puts the result in place of the old checkpoint only once it is
complete and on disk.

``background=True`` copies every tensor in memory into one host buffer (the snapshot: the
caller may change the parameters as soon as ``save`` returns), then writes from a thread.
Saves to one path are written in the order they were asked for: each waits for the one before.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError, check_flags
from .._model_walk import user_model
from .._sizes import parse_size
from ._atomic import created, flushed, replacing, synced
from ._progress import progress_bar, wanted
from ._save_collective import (
    collective,
    gathered_in_order,
    on_rank_0,
    write_collectively,
    write_order,
    write_split,
)
from ._save_items import check_not_read_from, items_of, transformers_model
from ._source import PathLike, as_path
from ._writers import Item, write_pt, write_safetensors

__all__ = ["Saving", "save", "save_items"]

_SHOW_FROM = 2 * 2**30  # bytes from which progress=None shows a bar (as load does)
_INDEX = "model.safetensors.index.json"


class Saving:
    """A background ``save``: ``wait()`` returns once the checkpoint is in place, or raises
    what the write raised; ``done()`` says whether it has finished.

    >>> import os, tempfile, torch, torchplace
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> saving = torchplace.save({"w": torch.ones(2)}, path, background=True)
    >>> saving.wait(); saving.done()
    True
    """

    def __init__(self, path: Path, work: Callable[[], None], before: Saving | None) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._before = before
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=False,
                                        name=f"torchplace.save {path.name}")  # fmt: skip
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        if self._before is not None:
            self._before._thread.join()  # saves to one path land in call order
            self._before = None
        try:
            work()
        except BaseException as exc:  # handed to wait()
            self._error = exc
        finally:
            with _PENDING_LOCK:  # the last save to its path, done: nothing to wait for
                if _PENDING.get(self.path) is self:
                    del _PENDING[self.path]

    def done(self) -> bool:
        """Whether the save has finished (written, or failed)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save has finished; raise what it raised, if anything."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        return f"<Saving {str(self.path)!r} {'done' if self.done() else 'writing'}>"


_PENDING: dict[Path, Saving] = {}  # the last background save asked for each path
_PENDING_LOCK = threading.Lock()


def save(
    obj: Any,
    path: PathLike,
    /,
    *,
    max_shard_size: int | str = "5GB",
    background: bool = False,
    progress: bool | None = None,
) -> Saving | None:
    """Save a model (in any placement) or a mapping of tensors, atomically and device-neutral.

    >>> import os, tempfile, torch, torchplace
    >>> d = tempfile.mkdtemp()
    >>> model = torch.nn.Linear(2, 3)
    >>> torchplace.save(model, os.path.join(d, "model.safetensors"))
    >>> sorted(torchplace.load(os.path.join(d, "model.safetensors")))
    ['bias', 'weight']
    >>> torchplace.save(model, os.path.join(d, "checkpoint"))
    >>> sorted(os.listdir(os.path.join(d, "checkpoint")))
    ['model.safetensors']

    Args:
        obj: a model (on one device, split over several, dispatched with ``"cpu"`` and
            ``"disk"`` tiers, or sharded as DTensors: then call it on every rank; a directory's
            shard files are split among the ranks, a single file is written by rank 0) or a
            mapping of names to tensors. A model's tied parameters are written once (under
            the name ``save_pretrained`` keeps); a mapping has every key written, tied or not
            (a ``.pt`` file gives the keys of one tensor one storage). A model wrapped by
            ``torch.compile``, DDP or DataParallel is saved as the model inside (its names,
            its transformers config).
        path: ``*.safetensors``, ``*.pt``/``*.pth`` (read by ``torch.load(weights_only=True)``),
            or any other path (or one ending in a slash, ``"ckpt.pt/"``): a directory as
            ``save_pretrained`` writes it.
        max_shard_size: for a directory, the most bytes of one shard (``"5GB"``, ``"500MiB"``,
            an int), as ``save_pretrained`` takes it.
        background: copy the tensors into host memory now and write them in a thread; returns
            a ``Saving`` handle.
        progress: a bar on stderr; ``None`` shows it on a terminal for 2 GiB or more.

    Returns:
        ``None``, or with ``background=True`` a ``Saving`` to ``wait()`` on.

    Raises:
        PlacementError: a tensor on ``meta`` that holds no values (nothing is written).
        CheckpointError: a sparse tensor (save it ``.to_dense()``), a value that is not a
            tensor, or a path that is the checkpoint a ``"disk"`` module of ``obj`` still reads
            from (nothing is written); the path cannot be written (a full disk, a file in the
            way): the old checkpoint is left as it was.
    """
    check_flags("save()", background=background, progress=progress, optional=("progress",))
    target = Path(os.path.abspath(as_path(path)))  # where it is now, whatever cwd is later
    slash = _slash(path)
    shard_bytes = parse_size(max_shard_size, "save(max_shard_size=...)")
    if isinstance(obj, torch.nn.Module):  # torch.compile, DDP, DataParallel: the model inside
        obj = user_model(obj)
    items = items_of(obj)
    if collective(items):  # the path checked where it is written: on rank 0
        layout = on_rank_0(lambda: _layout(target, slash))
    else:
        layout = _layout(target, slash)
    check_not_read_from(obj, target, directory=layout == "directory")
    config = _configs(obj) if layout == "directory" else []
    if collective(items):
        return _save_collective(target, layout, items, config, shard_bytes, background, progress)
    if not background:
        _wait_pending(target)
        _write(target, layout, items, config, shard_bytes, progress)
        return None
    return _in_background(target, layout, items, config, shard_bytes, progress)


def _in_background(target: Path, layout: str, items: list[Item], config: list[Any],
                   shard_bytes: int, progress: bool | None) -> Saving:  # fmt: skip
    """``items`` snapshotted, and a thread that writes them after the saves to ``target``
    asked for before; the snapshot's buffer is given back once written."""
    copied, buffer = _snapshot(items)

    def work() -> None:
        try:
            _write(target, layout, copied, config, shard_bytes, progress)
        finally:
            _give_buffer(buffer)

    with _PENDING_LOCK:
        saving = Saving(target, work, _PENDING.get(target))
        _PENDING[target] = saving
    return saving


def _save_collective(target: Path, layout: str, items: list[Item], config: list[Any],
                     shard_bytes: int, background: bool, progress: bool | None
                     ) -> Saving | None:  # fmt: skip
    """``save`` of a DTensor-sharded model, on every rank (``_save_collective``): a directory
    of several shards written by every rank, anything else by rank 0 while the others take part
    in each gather."""
    import torch.distributed as dist

    if background:  # the snapshot gathers, in the items' order on every rank
        if dist.get_rank() != 0:
            gathered_in_order(items)
            return Saving(target, lambda: None, None)
        return _in_background(target, layout, items, config, shard_bytes, progress)
    _wait_pending(target)
    shards = _shards(items, shard_bytes) if layout == "directory" else []
    if len(shards) > 1:
        _write_split(target, _shard_files(shards), config, progress)
        return None
    ordered = write_order(layout, items, lambda listed: _shards(listed, shard_bytes))
    write_collectively(
        lambda listed: _write(target, layout, listed, config, shard_bytes, progress), ordered
    )
    return None


def save_items(
    items: list[Item], path: PathLike, /, *, max_shard_size: int | str, others: list[Path]
) -> None:
    """``save`` of ``items`` made elsewhere (``convert``'s, read from a checkpoint); a
    directory also receives a copy of each file of ``others``."""
    target = Path(os.path.abspath(as_path(path)))
    shard_bytes = parse_size(max_shard_size, "max_shard_size")
    layout = _layout(target, _slash(path))
    _wait_pending(target)
    _write(target, layout, items, list(others) if layout == "directory" else [], shard_bytes,
           None)  # fmt: skip


def _wait_pending(target: Path) -> None:
    with _PENDING_LOCK:
        pending = _PENDING.get(target)
    if pending is not None:
        pending._thread.join()


def _slash(path: PathLike) -> bool:
    """Whether ``path`` ends in a slash, which names a directory whatever its suffix (as
    ``remap`` takes it); a ``Path`` drops it, so only a str (or bytes) can say it."""
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    return isinstance(path, str) and path.endswith(("/", os.sep))


def _layout(target: Path, slash: bool = False) -> str:
    suffix = target.suffix.lower()
    layout = {".safetensors": "safetensors", ".pt": "pt", ".pth": "pt"}.get(suffix, "directory")
    if slash:
        layout = "directory"
    if layout == "directory" and target.exists() and not target.is_dir():
        why = "ends in a slash" if slash else "has no .safetensors or .pt suffix"
        raise CheckpointError(
            f"{target}: is a file, and a path that {why} is saved as a directory; remove the "
            "file or give a file name ending in .safetensors or .pt",
            path=target,
        )
    if layout != "directory" and target.is_dir():
        raise CheckpointError(f"{target}: is a directory, not a {suffix} file", path=target)
    if not target.parent.is_dir():
        raise CheckpointError(f"{target}: its directory {target.parent} does not exist",
                              path=target)  # fmt: skip
    return layout


def _configs(obj: Any) -> list[Any]:
    """A transformers model's config and generation config, as ``save_pretrained`` writes
    them (its dtype and class recorded in the config)."""
    if not transformers_model(obj):
        return []
    config = copy.deepcopy(obj.config)
    config.dtype = str(obj.dtype).split(".")[1]
    config.architectures = [type(obj).__name__]
    found = [config]
    generation = getattr(obj, "generation_config", None)
    if generation is not None and obj.can_generate():
        found.append(copy.deepcopy(generation))
    return found


def _snapshot(items: list[Item]) -> tuple[list[Item], torch.Tensor]:
    """``items`` with every tensor in memory copied into one host buffer (pinned where CUDA is
    in use; the buffer a finished background save gave back, where it is large enough); a disk
    module's weights stay where they are, read when written. Second: the buffer."""
    total = sum(_aligned(it.nbytes) for it in items if it.resident)
    # each item's values are asked for once: a DTensor's are a gather every rank takes part in
    pinned = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    pool = _take_buffer(total, pinned)
    at, out = 0, []
    for it in items:
        if not it.resident:
            out.append(it)
            continue
        view = pool[at : at + it.nbytes].view(it.dtype).view(it.shape)
        view.copy_(it.get(), non_blocking=pinned)
        out.append(_copied(it, view))
        at += _aligned(it.nbytes)  # each tensor's bytes start aligned for any dtype
    if pinned:
        torch.cuda.synchronize()
    return out, pool


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


# The buffer of the last background save, once written, kept for the next one: a fresh buffer
# of a model's size costs its page faults again on every save (as much as the copy itself).
_IDLE_BUFFER: list[torch.Tensor] = []


def _take_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    with _PENDING_LOCK:
        idle = _IDLE_BUFFER[0] if _IDLE_BUFFER else None
        if idle is not None and idle.numel() >= nbytes and idle.is_pinned() == pinned:
            return _IDLE_BUFFER.pop()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def _give_buffer(buffer: torch.Tensor) -> None:
    with _PENDING_LOCK:
        _IDLE_BUFFER[:] = [buffer]


def _copied(item: Item, view: torch.Tensor) -> Item:
    return dataclasses.replace(item, get=lambda: view)


def _write(target: Path, layout: str, items: list[Item], configs: list[Any], shard_bytes: int,
           progress: bool | None) -> None:  # fmt: skip
    total = sum(it.nbytes for it in items)
    show = wanted(progress) and (progress is True or total >= _SHOW_FROM)
    try:
        with (
            progress_bar(total, f"save {target.name}", show) as advance,
            replacing(target, directory=layout == "directory") as tmp,
        ):
            if layout == "directory":
                _write_directory(tmp, items, configs, shard_bytes, advance)
                return
            with synced(tmp) as f:
                if layout == "pt":
                    write_pt(f, items, advance)
                else:
                    write_safetensors(f, items, {"format": "pt"}, advance)
    except OSError as exc:
        raise _unsaved(target, exc) from exc


def _write_split(target: Path, files: list[tuple[str, list[Item]]], configs: list[Any],
                 progress: bool | None) -> None:  # fmt: skip
    """The directory ``target`` of several shard ``files``, its files split among the ranks
    (``write_split``); a bar on rank 0, which takes part in every file's gathers."""
    import torch.distributed as dist

    total = sum(it.nbytes for _, shard in files for it in shard)
    show = dist.get_rank() == 0 and wanted(progress) and (progress is True or total >= _SHOW_FROM)
    try:
        with progress_bar(total, f"save {target.name}", show) as advance:
            write_split(
                target,
                files,
                before=lambda folder: _write_configs(folder, configs),
                write=lambda path, items: _write_shard(path, items, advance),
                after=lambda folder: _write_index(folder, files),
                advance=advance,
            )
    except OSError as exc:
        raise _unsaved(target, exc) from exc


def _unsaved(target: Path, exc: OSError) -> CheckpointError:
    return CheckpointError(
        f"{target}: could not be saved ({exc.strerror or exc}); the checkpoint that was "
        "there is unchanged and nothing partial was left",
        path=target,
    )


def _write_shard(path: Path, items: list[Item], advance: Callable[[int], None]) -> None:
    """One shard file of a collective save, written (flushed to disk with the rank's others)."""
    with created(path) as f:
        write_safetensors(f, items, {"format": "pt"}, advance)


def _shards(items: list[Item], limit: int) -> list[list[Item]]:
    """``items`` split in order into shards of at most ``limit`` bytes (a tensor larger than
    that alone in its shard), as ``save_pretrained`` splits them."""
    shards: list[list[Item]] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    return shards


def _write_directory(
    folder: Path,
    items: list[Item],
    configs: list[Any],
    limit: int,
    advance: Callable[[int], None],
) -> None:
    _write_configs(folder, configs)
    shards = _shards(items, limit)
    if len(shards) == 1:
        with synced(folder / "model.safetensors") as f:
            write_safetensors(f, shards[0], {"format": "pt"}, advance)
        return
    files = _shard_files(shards)
    for name, shard in files:
        with synced(folder / name) as f:
            write_safetensors(f, shard, {"format": "pt"}, advance)
    _write_index(folder, files)


def _write_configs(folder: Path, configs: list[Any]) -> None:
    """A transformers config, or a file copied as it is, each, flushed to disk as the tensors
    are."""
    for config in configs:
        if isinstance(config, Path):
            shutil.copy2(config, folder / config.name)
        else:
            config.save_pretrained(folder)
    flushed(list(folder.iterdir()))


def _shard_files(shards: list[list[Item]]) -> list[tuple[str, list[Item]]]:
    """Each shard with its file's name, as ``save_pretrained`` names them."""
    n = len(shards)
    return [(f"model-{i:05d}-of-{n:05d}.safetensors", shard) for i, shard in enumerate(shards, 1)]


def _write_index(folder: Path, files: list[tuple[str, list[Item]]]) -> None:
    """``model.safetensors.index.json``: which file holds each tensor, and their total size."""
    items = [it for _, shard in files for it in shard]
    index = {
        "metadata": {"total_size": sum(it.nbytes for it in items),
                     "total_parameters": sum(it.nbytes // it.dtype.itemsize for it in items)},
        "weight_map": {it.name: name for name, shard in files for it in shard},
    }  # fmt: skip
    with synced(folder / _INDEX) as f:
        f.write((json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
