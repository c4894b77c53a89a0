"""The ranks' meeting place (``checkpoint/_rendezvous``): the beating thread, on a store of
this process's own (the torchrun tests in ``test_sharded.py`` meet across processes)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import pytest

from torchplace.checkpoint import _rendezvous


class _Store:
    """The calls a beat makes of a store, counted."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, key: str, n: int) -> int:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n
            return self.counts[key]


def _beaters() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "torchplace-beat"]


def _until(check: Any, seconds: float = 5.0) -> None:
    end = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < end, "not within the time"
        time.sleep(0.005)


def test_one_thread_beats_for_every_call_and_stops_when_each_ends() -> None:
    beater = _rendezvous._Beater()
    store = _Store()
    chores: list[str] = []
    before = len(_beaters())
    first = beater.begin(_rendezvous._Beat(store, "a", 0.01, lambda: chores.append("a")))
    second = beater.begin(_rendezvous._Beat(store, "b", 0.02, lambda: chores.append("b")))
    assert len(_beaters()) == before + 1  # one thread for both, kept
    _until(lambda: store.counts.get("a", 0) >= 4 and store.counts.get("b", 0) >= 2)
    assert chores == ["a", "b"]  # each call's chores once, first
    beater.end(first)
    time.sleep(0.1)  # a beat picked before the end may still land, once
    a, b = store.counts["a"], store.counts["b"]
    _until(lambda: store.counts["b"] >= b + 2)  # the other call beats on
    assert store.counts["a"] == a  # ended: beats no more
    beater.end(second)
    third = beater.begin(_rendezvous._Beat(store, "c", 0.01, lambda: chores.append("c")))
    _until(lambda: store.counts.get("c", 0) >= 2)
    beater.end(third)
    assert chores == ["a", "b", "c"] and len(_beaters()) == before + 1


def test_a_store_that_fails_stops_no_beating() -> None:
    """A store call that raises (the store's process gone) is the waiting ranks' to report;
    the thread beats on for the calls still under way."""
    beater = _rendezvous._Beater()
    store = _Store()

    def gone(key: str, n: int) -> int:
        raise RuntimeError("connection reset")

    broken = _Store()
    broken.add = gone  # type: ignore[method-assign]
    bad = beater.begin(_rendezvous._Beat(broken, "x", 0.01, lambda: 1 / 0))  # chores fail too
    good = beater.begin(_rendezvous._Beat(store, "y", 0.01, lambda: None))
    _until(lambda: store.counts.get("y", 0) >= 3)
    beater.end(bad)
    beater.end(good)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_beats_with_a_thread_of_its_own() -> None:
    """The parent's thread does not exist in a forked child (and a lock it held stays held
    there): the child's first call starts its own."""
    store = _Store()
    token = _rendezvous._BEATER.begin(_rendezvous._Beat(store, "parent", 0.01, lambda: None))
    try:
        _until(lambda: store.counts.get("parent", 0) >= 1)
        pid = os.fork()
        if pid == 0:  # the child: exits with 0 only if it beat
            code = 1
            try:
                child = _Store()
                mine = _rendezvous._BEATER.begin(
                    _rendezvous._Beat(child, "child", 0.01, lambda: None)
                )
                end = time.monotonic() + 5
                while child.counts.get("child", 0) < 2 and time.monotonic() < end:
                    time.sleep(0.005)
                _rendezvous._BEATER.end(mine)
                code = 0 if child.counts.get("child", 0) >= 2 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        _rendezvous._BEATER.end(token)


def test_an_ended_call_leaves_nothing_of_its_store_to_the_thread() -> None:
    """The thread waits for the next call holding nothing of the last one: a store kept alive
    there would keep rank 0's TCPStore server and its port after destroy_process_group."""
    beater = _rendezvous._Beater()
    store = _Store()
    counts = store.counts
    token = beater.begin(_rendezvous._Beat(store, "a", 0.01, lambda: None))
    _until(lambda: counts.get("a", 0) >= 2)
    beater.end(token)
    time.sleep(0.05)  # past the beat under way, if any
    gone = weakref.ref(store)
    del store
    gc.collect()
    assert gone() is None


def _rows_in_a_child(store_code: str, timeout: float, beats_for: float) -> str:
    """What ``Meeting.rows`` returns on rank 0 of 2 while rank 1, in a child process of its own
    on the same store, beats every ``timeout / 5`` s for ``beats_for`` s and then posts; run in
    a subprocess with a bound, so that a wait that never ends fails the test."""
    code = f"""
import subprocess, sys, time
import torch.distributed as dist
from torchplace.checkpoint._rendezvous import Meeting
child = '''
import time, torch.distributed as dist
s = {store_code}
s.add("p/beat/1", 1); print("up", flush=True)
end = time.monotonic() + {beats_for}
while time.monotonic() < end:
    s.add("p/beat/1", 1); time.sleep({timeout} / 5)
s.compare_set("p/1/row/1", "", "late")
'''
s = {store_code}
p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE)
p.stdout.readline()
m = Meeting(s, "p", (0, 1), 0, 1, timeout={timeout})
s.set(m._key("row", 0), "me")
print(m.rows()[1])
p.kill()
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_live_rank_is_waited_for_on_a_store_whose_wait_keeps_whole_seconds(
    tmp_path: Any,
) -> None:
    """A FileStore's wait ends on whole seconds: its first look came after a bound of 0.5 s
    had passed, and the live, beating rank was given up on."""
    store = f"dist.PrefixStore('pg', dist.FileStore({str(tmp_path / 'store')!r}, 2))"
    assert _rows_in_a_child(store, timeout=0.5, beats_for=2.5) == "late"


def test_a_bound_under_a_millisecond_gives_up_instead_of_waiting_for_ever() -> None:
    """c10d keeps a wait's bound in whole milliseconds, and 0 ms is no bound: a store's wait
    for a rank that never comes never ended."""
    import torch.distributed as dist

    store = dist.PrefixStore("x", dist.HashStore())
    meeting = _rendezvous.Meeting(store, "p", (0, 1), 0, 1, timeout=0.004)
    store.set(meeting._key("row", 0), "me")
    result: list[dict[int, str]] = []
    waiter = threading.Thread(target=lambda: result.append(meeting.rows()), daemon=True)
    waiter.start()
    waiter.join(10)
    assert result == [{0: "me", 1: _rendezvous.ABSENT}]
