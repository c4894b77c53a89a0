"""``save`` of a DTensor-sharded model (FSDP2, tensor parallel): a collective.

Every rank calls ``save`` with its shards. The tensors are gathered one at a time, in the order
the writer writes them (``full_tensor``, which every rank must call in the same order), so no
rank holds more than one full tensor beyond its own shards; rank 0 writes them, the other ranks
only take part in each gather. A write that fails on rank 0 still completes the gathers the
other ranks wait in, and then every rank raises, so no rank hangs and none returns as if the
save had worked. Rank 0 writes every file (the files are not split among the ranks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._errors import CheckpointError
from ._writers import Item, safetensors_order

__all__ = ["collective", "gathered_in_order", "on_rank_0", "write_collectively", "write_order"]


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


def gathered_in_order(items: list[Item]) -> None:
    """Take part in the gathers of ``items``, in their order, keeping nothing."""
    for it in items:
        if it.collective:
            it.get()


def on_rank_0(check: Callable[[], str]) -> str:
    """``check()`` (what the path names, whether it can be written) run on rank 0, which
    writes, before any gather; its answer on every rank, or its error raised on every rank, so
    that no rank waits in a gather that rank 0 will never join."""
    import torch.distributed as dist

    failure: Exception | None = None
    answer = [""]
    if dist.get_rank() == 0:
        try:
            answer[0] = check()
        except Exception as exc:
            failure = exc
    _agree(failure, "was refused on rank 0, which writes the files (its error says why)")
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
    _agree(failure, "failed on rank 0, which writes the files (its error says why); the "
           "checkpoint that was there is unchanged")  # fmt: skip


def _agree(failure: BaseException | None, said: str) -> None:
    """Raise ``failure`` on rank 0 and, where rank 0 had one, on every other rank an error
    that says what happened (``said``)."""
    import torch.distributed as dist

    nccl = dist.get_backend() == "nccl"
    where = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flag = torch.tensor([failure is not None], dtype=torch.int32, device=where)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if int(flag.item()):
        raise CheckpointError(
            f"the collective save {said} on rank 0, which writes the files (its error says why)"
        )


def _counted(item: Item, done: set[str]) -> Item:
    def get() -> torch.Tensor:
        value = item.get()
        done.add(item.name)
        return value

    return Item(item.name, item.dtype, item.shape, get, item.resident, item.collective)
