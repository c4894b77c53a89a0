"""``save`` of a DTensor-sharded model (FSDP2, tensor parallel): a collective.

Every rank calls ``save`` with its shards. The tensors are gathered one at a time, in the order
the writers write them (``full_tensor``, which every rank must call in the same order), so no
rank holds more than one full tensor beyond its own shards: a rank keeps a gathered tensor only
while it writes it into a file of its own, and lets go of the others at once.

A directory of several shards is written by every rank: the ``i``-th shard file by rank
``i % world_size`` (``write_split``). Rank 0 makes the temporary directory beside the path
(``_atomic.staging``) and tells the others its name; every rank writes its files into it and
flushes them to disk (the ranks' flushes run at once); once every rank has said that its files
are on disk, rank 0 writes the index and puts the directory in place (``_atomic.put_in_place``),
so a crash at any moment leaves the old checkpoint whole or the new one. The path must be on a
file system every rank sees (a rank that cannot see the temporary directory says so before any
gather). A single file, or a directory of one shard, is written by rank 0 alone
(``write_collectively``); so is a background save (its snapshot is gathered on rank 0, and its
thread writes there).

A write that fails on any rank still completes the gathers the other ranks wait in, and then
every rank raises (the failing rank its own error, the others one that names that rank), so no
rank hangs and none returns as if the save had worked; rank 0 removes the temporary directory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch

from .._errors import CheckpointError
from ._atomic import flushed, put_in_place, staging
from ._writers import Item, safetensors_order

__all__ = [
    "collective",
    "gathered_in_order",
    "on_rank_0",
    "write_collectively",
    "write_order",
    "write_split",
]

_UNCHANGED = "the checkpoint that was there is unchanged"
_WHY = " (its error there says why)"


def collective(items: list[Item]) -> bool:
    """Whether any of ``items`` is a gather every rank takes part in (a DTensor's)."""
    return any(it.collective for it in items)


def write_order(layout: str, items: list[Item], shards: Callable[[list[Item]], list[list[Item]]]
                ) -> list[Item]:  # fmt: skip
    """``items`` in the order the writer of ``layout`` asks for their values."""
    if layout == "pt":
        return items
    if layout == "safetensors":
        return safetensors_order(items)
    return [it for shard in shards(items) for it in safetensors_order(shard)]


def gathered_in_order(items: list[Item], advance: Callable[[int], None] = lambda n: None) -> None:
    """Take part in the gathers of ``items``, in their order, keeping nothing (``advance``
    told each item's bytes, as though written)."""
    for it in items:
        if it.collective:
            it.get()
        advance(it.nbytes)


def on_rank_0(
    check: Callable[[], str], said: str = "was refused on rank {rank}, which checks the path" + _WHY
) -> str:
    """``check()`` (what the path names, whether it can be written) run on rank 0 before any
    gather; its answer on every rank, or its error raised on every rank (``said`` on the
    others), so that no rank waits in a gather that rank 0 will never join."""
    import torch.distributed as dist

    failure: Exception | None = None
    answer = [""]
    if dist.get_rank() == 0:
        try:
            answer[0] = check()
        except Exception as exc:
            failure = exc
    _agree(failure, said)
    dist.broadcast_object_list(answer, src=0)
    return answer[0]


def write_collectively(write: Callable[[list[Item]], None], ordered: list[Item]) -> None:
    """``write(items)`` on rank 0 while the others gather with it in the writer's order
    (``ordered``); then every rank raises if the write failed."""
    import torch.distributed as dist

    failure: BaseException | None = None
    if dist.get_rank() == 0:
        done: set[str] = set()
        try:
            write([_counted(it, done) if it.collective else it for it in ordered])
        except Exception as exc:  # the others still wait in the gathers that are left
            failure = exc
        gathered_in_order([it for it in ordered if it.name not in done])
    else:
        gathered_in_order(ordered)
    _agree(failure, f"failed on rank {{rank}}, which writes the files{_WHY}; {_UNCHANGED}")


def write_split(
    target: Path,
    files: list[tuple[str, list[Item]]],
    *,
    before: Callable[[Path], None],
    write: Callable[[Path, list[Item]], None],
    after: Callable[[Path], None],
    advance: Callable[[int], None],
) -> None:
    """The directory ``target`` written by every rank: ``before(folder)`` on rank 0 (the
    configs), then the ``i``-th of ``files`` (a name, its items) written by ``write(path,
    items)`` on rank ``i % world_size`` and flushed, while every rank takes part in each
    gather, in the files' order; once every rank's files are on disk, ``after(folder)`` on
    rank 0 (the index), and the folder put in place of ``target``. Every rank raises if any
    step failed on any rank; ``target`` is then as it was."""
    with contextlib.ExitStack() as stack:  # on rank 0, the temporary directory

        def start() -> str:
            folder = stack.enter_context(staging(target, directory=True))
            before(folder)
            return str(folder)

        folder = Path(on_rank_0(start, "could not start on rank {rank}" + _WHY))
        _agree(_unseen(folder), "could not start: rank {rank} does not see its directory" + _WHY)
        _agree(
            _write_own(folder, files, write, advance),
            f"failed on rank {{rank}}{_WHY}; {_UNCHANGED}",
        )

        def finish() -> str:
            after(folder)
            put_in_place(folder, target, directory=True)
            return ""

        on_rank_0(finish, f"failed on rank {{rank}}, which puts it in place{_WHY}; {_UNCHANGED}")


def _unseen(folder: Path) -> CheckpointError | None:
    """An error if this rank does not see the directory rank 0 made (another machine's disk)."""
    if folder.is_dir():
        return None
    import torch.distributed as dist

    return CheckpointError(
        f"{folder}: rank {dist.get_rank()} does not see the directory rank 0 made to save into; "
        "every rank writes some of a directory's files, so save to a path on a file system "
        "that every rank sees (a shared one), or to a single .safetensors file",
        path=folder,
    )


def _write_own(
    folder: Path,
    files: list[tuple[str, list[Item]]],
    write: Callable[[Path, list[Item]], None],
    advance: Callable[[int], None],
) -> Exception | None:
    """This rank's share of ``files`` written into ``folder`` and flushed, while it takes part
    in the gathers of the others' files; the error that stopped it, if any (it still took
    part in every gather)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    failure: Exception | None = None
    mine: list[Path] = []
    for i, (name, items) in enumerate(files):
        ordered = safetensors_order(items)  # the order write_safetensors asks for them
        if i % world != rank or failure is not None:
            gathered_in_order(ordered, advance)
            continue
        done: set[str] = set()
        try:
            write(folder / name, [_counted(it, done) if it.collective else it for it in items])
            mine.append(folder / name)
        except Exception as exc:  # the others still wait in the gathers that are left
            failure = exc
            gathered_in_order([it for it in ordered if it.name not in done])
    if failure is None:
        try:
            flushed(mine)  # after the gathers: every rank flushes its files at once
        except OSError as exc:
            failure = exc
    return failure


def _agree(failure: BaseException | None, said: str) -> None:
    """Raise ``failure`` on its rank and, where any rank had one, on every other rank an error
    that says what happened (``said``, its ``{rank}`` the highest rank that failed)."""
    import torch.distributed as dist

    nccl = dist.get_backend() == "nccl"
    where = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    failed = dist.get_rank() + 1 if failure is not None else 0
    flag = torch.tensor([failed], dtype=torch.int32, device=where)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if int(flag.item()):
        said = said.format(rank=int(flag.item()) - 1)
        raise CheckpointError(f"the collective save {said}")


def _counted(item: Item, done: set[str]) -> Item:
    def get() -> torch.Tensor:
        value = item.get()
        done.add(item.name)
        return value

    return Item(item.name, item.dtype, item.shape, get, item.resident, item.collective)
