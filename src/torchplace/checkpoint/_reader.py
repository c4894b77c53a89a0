"""A file's bytes straight into tensors that already exist, the files opened by their stamps.

``read_into(path, items)`` fills each ``ReadItem`` (``_plan_items``: from which byte, into which
tensor, from which dtype) with the bytes of the file from its ``start`` on; ``OpenFiles`` keeps
a load's files open, each checked against the stamp its catalog recorded when it is opened and
again after the reads. Host tensors are read by ``_host_read`` (threads, ``preadv``, dtype
conversion a chunk at a time), CUDA ones by ``_cuda_read`` (the pinned pool, asynchronous
copies), any other device a tensor at a time through the host.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from .._errors import CheckpointError
from ._cuda_read import read_cuda
from ._entries import Stamp, changed_error
from ._host_read import converted_from, read_host
from ._opened import open_file, raw_file
from ._plan_items import ReadItem
from ._progress import current

__all__ = ["OpenFiles", "read_into"]


class OpenFiles:
    """Files open for reading by path, each the file its catalog parsed: its stamp (size, mtime,
    inode, ctime) is checked when it is opened and again by ``verify`` after the reads, so that a
    file rewritten while it was read raises ``CheckpointError`` instead of mixing old and new
    bytes.

    ``read_into`` reads one file's items this way; a fill (``_boxes.BoxReader``, plain or
    sharded) keeps one ``OpenFiles`` for a whole load, reading every box through it.

    Each file is an ``io.FileIO``, which opens its descriptor and holds it in one C call, closes
    it at most once, and closes it when dropped: wherever a ``KeyboardInterrupt`` lands (just
    after the open, part-way through ``close``, where a ``with`` block skips ``__exit__``), no
    descriptor outlives the interrupt, and none is closed twice (a number another file may have
    taken by then).
    """

    def __init__(self, stamps: Mapping[Path, Stamp | None] | None = None) -> None:
        self.stamps = {p: s for p, s in (stamps or {}).items() if s is not None}
        self.files: dict[Path, io.FileIO] = {}  # its own, closed by close()
        self.shared: dict[Path, io.FileIO] = {}  # the call's (``_opened``), closed by the call

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fd(self, path: Path) -> int:
        """The open file of ``path`` (opened, and its stamp checked, on first use)."""
        file = self.files.get(path) or self.shared.get(path)
        if file is None:
            shared = raw_file(path)  # the call's open file, if a call holds one
            if shared is not None:
                file = self.shared[path] = shared
            else:
                file = self.files[path] = open_file(path)  # recorded at once: close() closes it
            try:
                _same_file(path, file.fileno(), self.stamps.get(path))
            except BaseException:
                if shared is None:
                    file.close()
                    del self.files[path]
                else:
                    del self.shared[path]
                raise
        return file.fileno()

    def read(
        self,
        path: Path,
        items: Sequence[ReadItem],
        fresh: bool = True,
        threads: int | None = None,
    ) -> None:
        """``read_into``'s reads from the open file of ``path``; its stamp is checked again
        only by ``verify`` (and before a CRC-32 failure is reported: a changed file says so)."""
        host: list[ReadItem] = []
        elsewhere: list[ReadItem] = []
        for i in items:  # one pass, no device objects made (a fill reads hundreds of items)
            if i.into.nbytes:
                (host if i.into.is_cpu else elsewhere).append(i)
        fd = self.fd(path)
        advance = current()  # the progress bar shown, if any (None: nothing to pay)
        failed = read_host(fd, host, advance, fresh, threads)
        by_device: dict[torch.device, list[ReadItem]] = {}
        for item in elsewhere:
            by_device.setdefault(item.into.device, []).append(item)
        for dev, group in by_device.items():
            if dev.type == "cuda":
                failed += read_cuda(fd, group, dev, advance)
                continue
            for item in group:  # another accelerator: a tensor at a time through the host
                t = item.into
                bounce = torch.empty(t.shape, dtype=converted_from(item) or t.dtype)
                failed += read_host(fd, [ReadItem(item.start, bounce, None, item.check)], advance)
                t.copy_(bounce)
        if failed:
            _same_file(path, fd, self.stamps.get(path))
            raise CheckpointError(
                f"{path}: is corrupt: {', '.join(failed[:5])} "
                f"{'fails its' if len(failed) == 1 else 'fail their'} CRC-32 check (the bytes "
                "of the tensors were damaged after the file was written); save or fetch it again",
                path=path,
            )

    def read_files(
        self,
        pending: Mapping[Path, Sequence[ReadItem]],
        fresh: bool = True,
        threads: int | None = None,
    ) -> None:
        """``read`` of each file's items in ``pending``; where every item lands whole on the
        host, unchecked (a sharded fill's on the CPU), all files' items in one go (one pool of
        threads, one set-up: a call per file cost 0.3-0.6 ms of a 30 ms fill)."""
        items = [i for group in pending.values() for i in group]
        if len(pending) < 2 or any(i.check is not None or not i.into.is_cpu for i in items):
            for path, group in pending.items():
                self.read(path, group, fresh, threads)
            return
        fds = [self.fd(path) for path, group in pending.items() for _ in group]
        read_host(fds, items, current(), fresh, threads)

    def verify(self) -> None:
        """Every file read is still the one catalogued (``CheckpointError`` if not)."""
        for p, file in [*self.files.items(), *self.shared.items()]:
            _same_file(p, file.fileno(), self.stamps.get(p))

    def close(self) -> None:
        """Every file closed, whatever interrupts arrive meanwhile (a closed one is skipped);
        the first of them is raised once the last file is closed."""
        interrupted: BaseException | None = None
        while True:
            try:
                for file in self.files.values():
                    file.close()
                break
            except BaseException as exc:  # a Ctrl-C part-way: close the rest, then raise it
                interrupted = interrupted or exc
        self.files.clear()
        self.shared.clear()
        if interrupted is not None:
            raise interrupted


def read_into(
    path: Path,
    items: Sequence[ReadItem],
    /,
    stamp: Stamp | None = None,
    fresh: bool = True,
    threads: int | None = None,
) -> None:
    """Fill each ``ReadItem`` of ``items`` with ``path``'s bytes from its ``start`` on.

    >>> import os, tempfile, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "bytes")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(bytes(range(8)))
    >>> a, b = torch.empty(2, dtype=torch.uint8), torch.empty(3, dtype=torch.uint8)
    >>> read_into(path, [ReadItem(1, a), ReadItem(5, b)])
    >>> a.tolist(), b.tolist()
    ([1, 2], [5, 6, 7])

    Each tensor must be contiguous and hold exactly the bytes to read (its ``nbytes``), on the
    CPU or an accelerator; an item with a ``stored`` dtype reads elements of that dtype from
    the file and converts them into the tensor's own dtype a chunk at a time (so the tensor's
    bytes plus a chunk per reading thread is all the memory the read takes). Raises ``OSError``
    for a read that fails and ``EOFError`` for a file that ends too soon; the tensors then hold
    what was read so far. With the ``stamp`` the file had when its catalog was made, the open
    file must still match it before the first read and after the last (its size, mtime,
    inode and ctime), or ``CheckpointError`` says that it changed while it was read. An item's
    ``check`` is the CRC-32 its bytes must have and a name for them (a zip record's), and an item
    that fails it raises ``CheckpointError`` naming it. ``fresh=False`` says the host
    tensors' pages are already resident (a model's own memory, filled in place), so they are not
    populated first (that costs about 40% of a read from the page cache into resident memory).
    ``threads``: at most this many threads read into host memory (``READ_THREADS`` if None; 1
    reads on the calling thread).
    """
    with OpenFiles({path: stamp}) as files:
        files.read(path, items, fresh, threads)
        files.verify()  # no write landed while it was read


def _same_file(path: Path, fd: int, stamp: Stamp | None) -> None:
    if stamp is not None:
        now = Stamp.of(os.fstat(fd))
        if now != stamp:
            raise changed_error(path, stamp, now)
