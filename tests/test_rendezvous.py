"""The ranks' meeting place (``checkpoint/_rendezvous``): the beating thread, on a store of
this process's own (the torchrun tests in ``test_sharded.py`` meet across processes)."""

from __future__ import annotations

import gc
import math
import os
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


def _until(check: Any, seconds: float = 60.0) -> None:
    """Wait until ``check()`` holds; the bound only fails a test that would hang."""
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
    a, b = store.counts["a"], store.counts["b"]
    # The other call beats on. Its second beat from now is served by a later turn of the
    # thread than any beat of "a" picked before the end, which has landed by then (once).
    _until(lambda: store.counts["b"] >= b + 2)
    landed = store.counts["a"]
    assert landed - a <= 1, (a, landed)
    b = store.counts["b"]
    _until(lambda: store.counts["b"] >= b + 2)
    assert store.counts["a"] == landed  # ended: beats no more
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
                end = time.monotonic() + 60  # fails a child that would hang, no more
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
    gone = weakref.ref(store)
    del store
    # let go once the beat under way, if any, is over (however long that takes here)
    _until(lambda: gc.collect() >= 0 and gone() is None)


class _Clock:
    """``_rendezvous``'s clock (its ``time``), of the test's own: it moves only as rank 0
    sleeps or waits, so what rank 0 sees does not hang on this machine's speed. Meanwhile
    rank 1 beats every ``every`` s of it from 0 until ``beats_until``, then posts its row at
    ``posts_at`` (never, if None)."""

    def __init__(
        self, store: Any, every: float, beats_until: float, posts_at: float | None
    ) -> None:
        self.store, self.every = store, every
        self.beats_until, self.posts_at = beats_until, posts_at
        self.now, self.beats = 0.0, 0
        self.advance(0.0)  # rank 1's first beat, before rank 0 waits

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        while self.beats * self.every <= min(self.now, self.beats_until) + 1e-9:
            self.store.add("p/beat/1", 1)
            self.beats += 1
        if self.posts_at is not None and self.now >= self.posts_at:
            self.store.compare_set("p/1/row/1", "", "late")


class _WholeSecondStore:
    """A store whose wait keeps whole seconds, as a FileStore's does: a wait of 0.1 s ends
    after a second of the clock, timed out where its keys are not all there."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.inner = dist.HashStore()
        self.clock: _Clock | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def wait(self, keys: list[str], timeout: Any) -> None:
        assert self.clock is not None
        self.clock.advance(float(math.ceil(timeout.total_seconds())))
        if not self.inner.check(keys):
            raise RuntimeError("Wait timeout")


def _rows_on_a_clock(
    monkeypatch: pytest.MonkeyPatch, beats_until: float, posts_at: float | None
) -> tuple[str, _Clock]:
    """What ``Meeting.rows`` returns for rank 1 on rank 0 of 2, with a bound of 0.5 s, on a
    store whose wait keeps whole seconds; and the clock, as it was when rows returned."""
    store = _WholeSecondStore()
    meeting = _rendezvous.Meeting(store, "p", (0, 1), 0, 1, timeout=0.5)
    clock = store.clock = _Clock(store, meeting.every, beats_until, posts_at)
    monkeypatch.setattr(_rendezvous, "time", clock)
    store.set(meeting._key("row", 0), "me")
    return meeting.rows()[1], clock


def test_a_live_rank_is_waited_for_on_a_store_whose_wait_keeps_whole_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A FileStore's wait ends on whole seconds: its first look came after a bound of 0.5 s
    had passed, and the live, beating rank was given up on. Here rank 1 beats for 2.5 s, five
    times the bound, then posts; the clock is the test's own, so a busy machine, which may
    hold a real rank's beats back past the bound, changes nothing."""
    row, clock = _rows_on_a_clock(monkeypatch, beats_until=2.5, posts_at=2.5)
    assert row == "late"
    assert clock.now >= 2.5


def test_a_rank_that_stops_beating_is_given_up_on_once_the_bound_has_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other side of the same wait: rank 1 beats for 2 s, then neither beats nor posts.
    Rank 0 gives up on it once it has shown no sign of life for the bound, not before."""
    row, clock = _rows_on_a_clock(monkeypatch, beats_until=2.0, posts_at=None)
    assert row == _rendezvous.ABSENT
    assert 2.0 + 0.5 <= clock.now <= 2.0 + 0.5 + 2 * 0.1  # the bound, and a look's interval


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
