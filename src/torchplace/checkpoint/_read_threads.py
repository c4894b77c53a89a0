"""Threads that read a checkpoint's chunks side by side: how many (a share of the cores when
torchrun started several processes on this machine), and running them so that a failure or a
Ctrl-C in one stops the others and none outlives the call. The host and CUDA reads
(``_host_read``, ``_cuda_read``) hand their chunks out to these threads in turn.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["CORES", "read_in_threads", "thread_count"]

CORES = os.cpu_count() or 1  # asked once: each call cost 20-75 us of a fill's hot path


def thread_count(cap: int, tasks: int) -> int:
    """How many threads read ``tasks`` chunks: ``cap``, but a share of the cores when torchrun
    started several processes on this machine (``LOCAL_WORLD_SIZE``), since its ranks read at
    once. Two ranks of two threads each on two cores filled shards 1.27-1.34x as slowly as each
    rank reading its own rows in one thread; one thread each, 1.05-1.09x (``bench_sharded.py``)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:  # the device picker says what is wrong with it; reading needs no more
        local = 1
    if local > 1:
        cap = min(cap, max(1, CORES // local))
    return max(1, min(cap, tasks))


def read_in_threads(share: Callable[[int, int], None], threads: int, stop: threading.Event) -> None:
    """``share(0, 1)`` in this thread where one thread reads, else ``_run_shares``."""
    if threads <= 1:
        share(0, 1)
    else:
        _run_shares(share, threads, stop)


def _run_shares(share: Callable[[int, int], None], threads: int, stop: threading.Event) -> None:
    """Run ``share(k, threads)`` on ``threads`` threads and re-raise the first failure.

    A failure or Ctrl-C stops the others at their next chunk, and this returns only once every
    thread has finished, whatever interrupts arrive meanwhile: the caller closes the file the
    threads read from, and a number closed under a live read could be reused by another file.
    """
    pool = ThreadPoolExecutor(threads, thread_name_prefix="torchplace-read")
    interrupted: BaseException | None = None
    try:
        futures = [pool.submit(share, k, threads) for k in range(threads)]
        for future in futures:
            future.result()
    except BaseException:
        stop.set()
        raise
    finally:
        while True:
            try:
                pool.shutdown(wait=True, cancel_futures=True)
                break
            except BaseException as exc:  # a second Ctrl-C: stop is set, keep waiting
                stop.set()
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted
