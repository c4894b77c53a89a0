"""Where the ranks of a sharded ``load_into`` meet after their fills: the process group's
key-value store (the one ``init_process_group`` or torchrun started), not a collective.

A collective would wait for a missing rank until the process group's timeout (30 minutes by
default), could not say which rank is missing, would leave the group unusable once timed out,
and turns a peer's death into the backend's own error. Through the store each rank posts a
short row under a key of its own, and a waiting rank sees who has posted, who is still at
work and who is gone:

- Each call is a *round*, numbered alike on every rank of the mesh (each call on a rank is its
  next round). Its keys: ``torchplace/compare/<mesh>/<round>/row/<rank>`` (and ``full/``: the
  whole outcome, read only when a row shows trouble).
- While its fill runs, a rank *beats*: a thread (one per process, kept between calls) adds 1
  to ``beat/<rank>`` every ``timeout / 5`` s (at most every second). A waiting rank gives up
  on another once it has neither posted nor beaten for ``timeout`` seconds
  (``TORCHPLACE_COMPARE_TIMEOUT``, 10 by default). A rank still reading is waited for however
  long its fill takes; one interrupted, killed, or not calling at all is not. A waiting rank
  first waits in the store (woken as the rows land) for the time between two beats, then
  looks at it, less and less often, and at the others' beats.
- Giving up on a rank is posted in that rank's own slot, atomically (``compare_set``): a rank
  that comes later finds it and fails too, never agreeing with ranks that have already raised.
  Such a late rank moves on to the latest round any rank of the mesh has begun, so the calls
  after a failure meet again.
- Each rank deletes its own keys of earlier rounds once a round shows every rank past them
  (in its next fill, by the thread that beats).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._errors import CheckpointError

__all__ = ["ABSENT", "TIMEOUT_VARIABLE", "Meeting", "compare_timeout", "meeting"]

TIMEOUT_VARIABLE = "TORCHPLACE_COMPARE_TIMEOUT"
DEFAULT_TIMEOUT = 10.0  # seconds without a sign of life before a rank is given up on
ABSENT = "absent"  # what a slot holds once the others gave up on its rank
# Once its wait in the store is over (``Meeting._waited``), a waiting rank looks at the store
# often for its first 5 ms of looking: every 0.1 ms per rank of the mesh, at least 0.2 ms apart,
# so that all the waiting ranks together ask about 10,000 times a second at most. Then less and
# less often, down to every millisecond per rank (2 ms for 2 ranks), at most every 50 ms: about
# 1,000 times a second at most, all together.
_FIRST_PAUSE = 0.0002
_EAGER_FOR = 0.005
_PAUSE_PER_RANK = 0.001
_LONGEST_PAUSE = 0.05

_rounds: dict[str, int] = {}  # this process's last round, by mesh
_posted: dict[str, list[int]] = {}  # rounds this process has posted in, by mesh
_done: dict[str, list[int]] = {}  # rounds whose keys no rank reads any more: to be deleted


def compare_timeout() -> float:
    """``TORCHPLACE_COMPARE_TIMEOUT`` in seconds (``DEFAULT_TIMEOUT`` where unset)."""
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise CheckpointError(
            f"{TIMEOUT_VARIABLE}={text!r}: expected a number of seconds above 0, such as "
            f"{DEFAULT_TIMEOUT:g}; the model is untouched"
        )
    return seconds


@dataclasses.dataclass
class Meeting:
    """One call's round on this rank: its store, the ranks that meet, the bound."""

    store: Any
    prefix: str
    ranks: tuple[int, ...]
    rank: int
    round: int
    timeout: float

    @property
    def every(self) -> float:
        """A beat's interval, and how long a waiting rank waits between looks at the beats:
        ``timeout / 5``, at most a second."""
        return min(1.0, self.timeout / 5)

    def _key(self, kind: str, rank: int, round_: int | None = None) -> str:
        return f"{self.prefix}/{self.round if round_ is None else round_}/{kind}/{rank}"

    @contextlib.contextmanager
    def beating(self) -> Iterator[None]:
        """This rank shows it is alive while the body runs. The process's beating thread
        (``_BEATER``) first says which round this rank has begun and deletes its keys of rounds
        no rank reads any more, off the fill's path, then beats until the body ends."""
        every = self.every
        key = f"{self.prefix}/beat/{self.rank}"
        done = _done.pop(self.prefix, [])

        def chores() -> None:
            _raise_latest(self.store, f"{self.prefix}/latest", self.round)
            for n in done:
                for kind in ("row", "full"):
                    self.store.delete_key(self._key(kind, self.rank, n))

        token = _BEATER.begin(_Beat(self.store, key, every, chores))
        try:
            yield
        finally:
            _BEATER.end(token)

    def post(self, row: str, full: str) -> bool:
        """Post this rank's row; False where the others gave up on this rank (then this
        process's next round is the latest any rank has begun)."""
        while True:
            self.store.set(self._key("full", self.rank), full)
            held = self.store.compare_set(self._key("row", self.rank), "", row)
            _posted.setdefault(self.prefix, []).append(self.round)
            if _text(held) != ABSENT:
                return True
            held = _text(self.store.compare_set(f"{self.prefix}/latest", "-", "-"))
            latest = int(held) if held.isdigit() else 0  # "-": none (a get would block)
            if latest <= self.round:
                return False
            self.round = _rounds[self.prefix] = latest  # join the round the others are in

    def own_row(self) -> str | None:
        """This rank's row of its round as the store holds it (``ABSENT`` where the others gave
        up on it); None where it has posted none."""
        key = self._key("row", self.rank)
        return _text(self.store.get(key)) if self.store.check([key]) else None

    def rows(self) -> dict[int, str]:
        """Every rank's row, once each has posted or been given up on (``ABSENT``)."""
        keys = {r: self._key("row", r) for r in self.ranks}
        missing = [r for r in self.ranks if r != self.rank]
        seen: dict[int, tuple[int, float]] = {}  # a rank's last beat, and since when
        every = self.every
        start = time.monotonic()
        if missing and self._waited([keys[r] for r in missing], every):
            missing = []
        look = start + every  # past, after a wait that timed out: stalls are looked for now
        longest = min(_LONGEST_PAUSE, _PAUSE_PER_RANK * len(self.ranks))
        pause = min(longest, max(_FIRST_PAUSE, _PAUSE_PER_RANK * len(self.ranks) / 10))
        while missing and not self.store.check([keys[r] for r in missing]):
            now = time.monotonic()
            if now >= look:
                missing = [r for r in missing if not self.store.check([keys[r]])]
                for r in self._stalled(missing, seen, start, now):
                    self.store.compare_set(keys[r], "", ABSENT)  # unless it posted just now
                look = now + every
            time.sleep(pause)
            if now - start >= _EAGER_FOR:
                pause = min(2 * pause, longest)
        got = _get_all(self.store, list(keys.values()))
        rows = {r: _text(value) for r, value in zip(self.ranks, got, strict=True)}
        if ABSENT not in rows.values():  # every rank has left the earlier rounds
            earlier = [n for n in _posted.get(self.prefix, []) if n != self.round]
            _done.setdefault(self.prefix, []).extend(earlier)
            _posted[self.prefix] = [self.round]
        return rows

    def _waited(self, keys: list[str], seconds: float) -> bool:
        """Whether ``keys`` were all posted within ``seconds``, waited for in the store (the
        store wakes this rank as the last one lands; False: not within them). Looking at the
        store every 0.2 ms instead took a core's worth of turns from the ranks still reading
        (2-5% of a 256 MiB fill on 2 ranks, ``bench_sharded.py``). A TCPStore whose wait
        times out logs it to stderr (c10d's own two lines): once per call at most, and only
        where a rank came more than ``seconds`` after this one. The wait holds the store's
        client for its time: a beat of another fill of this process waits behind it, at most
        ``seconds`` (a beat's interval), well within the ``timeout`` the others allow."""
        if seconds < 0.001:
            return False  # c10d keeps whole milliseconds, and 0 ms is no bound at all
        try:
            self.store.wait(keys, datetime.timedelta(seconds=seconds))
        except Exception as exc:
            if "timeout" not in str(exc).lower() or _network_error(exc):
                raise  # the store gone: the caller says so
            return False
        return True

    def _stalled(
        self, missing: list[int], seen: dict[int, tuple[int, float]], start: float, now: float
    ) -> list[int]:
        """The ranks of ``missing`` with no beat for ``timeout`` seconds (``seen``: each one's
        last beat and since when). A rank's first look counts from ``now``, not from when this
        rank began to wait (``start``), where that look came later than a beat's interval after
        it (a store whose wait keeps whole seconds, a FileStore's): a beat it could not yet have
        seen is not missed."""
        stalled = []
        for r in missing:
            beats = int(self.store.add(f"{self.prefix}/beat/{r}", 0))
            first = start if now - start <= self.every * 1.5 else now
            last, since = seen.get(r, (beats, first))
            if beats != last:
                since = now
            seen[r] = (beats, since)
            if now - since >= self.timeout:
                stalled.append(r)
        return stalled

    def fulls(self, ranks: Sequence[int]) -> dict[int, str]:
        """The whole outcomes the ``ranks`` posted."""
        got = _get_all(self.store, [self._key("full", r) for r in ranks])
        return {r: _text(value) for r, value in zip(ranks, got, strict=True)}


@dataclasses.dataclass
class _Beat:
    """One call's beating: its store, its key, how often, and the chores done first."""

    store: Any
    key: str
    every: float
    chores: Callable[[], None]
    due: float = 0.0  # when it beats next (``time.monotonic``)


class _Beater:
    """The process's one beating thread, started by the first sharded fill and kept: starting
    a thread per call cost 0.3-0.5 ms of a fill that takes 30 ms (it waits for the new thread
    to run). A call hands it its ``_Beat`` and takes it back when the fill ends; several calls
    at once (threads of one process filling two models) each beat on their own key. A forked
    child, which has no such thread, starts its own."""

    def __init__(self) -> None:
        self.forked()

    def forked(self) -> None:
        """As new: in a forked child, where no thread runs (a lock held across the fork
        stays held)."""
        self.cond = threading.Condition()
        self.beats: dict[int, _Beat] = {}
        self.fresh: list[_Beat] = []  # begun, chores not yet done
        self.next = 0
        self.running = False

    def begin(self, beat: _Beat) -> int:
        """Beat ``beat`` from now until ``end`` is given the token this returns."""
        with self.cond:
            if not self.running:
                thread = threading.Thread(target=self._run, name="torchplace-beat", daemon=True)
                thread.start()
                self.running = True
            self.next += 1
            beat.due = time.monotonic() + beat.every
            self.beats[self.next] = beat
            self.fresh.append(beat)
            self.cond.notify()
            return self.next

    def end(self, token: int) -> None:
        """The beating of ``token`` stops (not waited for: a beat under way may still land)."""
        with self.cond:
            self.beats.pop(token, None)

    def _run(self) -> None:
        try:
            self._beat_on(self.cond)
        finally:  # should it ever end, the next call starts another
            self.running = False

    def _beat_on(self, cond: threading.Condition) -> None:
        while True:
            fresh, due = self._next(cond)
            _serve(fresh, due)
            fresh.clear()  # nothing of an ended call (its store) kept while this waits
            due.clear()

    def _next(self, cond: threading.Condition) -> tuple[list[_Beat], list[_Beat]]:
        """The calls just begun, and the calls due to beat, once there are any."""
        with cond:
            while not self.fresh and not self.beats:
                cond.wait()
            fresh, self.fresh = self.fresh, []
            if not fresh:
                cond.wait(max(0.0, min(b.due for b in self.beats.values()) - time.monotonic()))
            now = time.monotonic()
            due = [b for b in self.beats.values() if b.due <= now]
            for b in due:
                b.due = now + b.every
            return fresh, due


def _serve(fresh: list[_Beat], due: list[_Beat]) -> None:
    """The chores of the calls just begun, then a beat of each call whose beat is due."""
    for b in fresh:
        with contextlib.suppress(Exception):  # keys left behind are a few bytes
            b.chores()
    for b in due:
        with contextlib.suppress(Exception):  # a store gone: the waiting ranks will say
            b.store.add(b.key, 1)


_BEATER = _Beater()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_BEATER.forked)


def meeting(store: Any, ranks: Sequence[int], rank: int) -> Meeting:
    """This call's round among ``ranks`` (global ranks, this one among them); every rank of
    them starts one per call."""
    timeout = compare_timeout()
    name = hashlib.blake2b(",".join(map(str, ranks)).encode(), digest_size=8).hexdigest()
    prefix = f"torchplace/compare/{name}"
    round_ = _rounds[prefix] = _rounds.get(prefix, 0) + 1
    return Meeting(store, prefix, tuple(ranks), rank, round_, timeout)


def _raise_latest(store: Any, key: str, round_: int) -> None:
    """The store's ``key`` holds the latest round any rank has begun (a few tries at most:
    it only helps a late rank find the others)."""
    expected = str(round_ - 1) if round_ > 1 else ""
    for _ in range(8):
        held = _text(store.compare_set(key, expected, str(round_)))
        if held.isdigit() and int(held) >= round_:
            return
        expected = "" if held == expected else held  # unchanged: the key was missing


def _network_error(exc: BaseException) -> bool:
    """Whether ``exc`` is c10d's for a store that cannot be reached (its process gone)."""
    kind = getattr(sys.modules.get("torch.distributed"), "DistNetworkError", None)
    return kind is not None and isinstance(exc, kind)


def _get_all(store: Any, keys: list[str]) -> list[Any]:
    if store.has_extended_api():
        return list(store.multi_get(keys))
    return [store.get(k) for k in keys]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
