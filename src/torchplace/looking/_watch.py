"""``watch()``: where a step made the host wait for the device, and what crossed between them.

A model on the right device can still be slow because of what travels between host and device
unseen: an ``.item()`` that waits for the device's queue, a mask that must learn its size, a
batch copied from pageable memory. ``watch`` counts each of these in its block and names the
line of the user's code that caused it, with the bytes, the operation and the fix.

How: while the block runs, a ``TorchFunctionMode`` sees each call of torch's Python API
(``x.item()``, ``x[mask]``, ``F.linear``), before PyTorch decomposes it, and ``_watch_ops.plan``
says, once per function, whether it can cross the boundary. Most calls cannot (an operation
with kernels of its own and none of the boundary's, a decomposition known to hold none, a
tensor's attribute): they cost one cached look-up and one look at the arguments (``scan``), for
a CPU scalar tensor, the one event that needs no look inside, and for a watched device's
one-element tensor where PyTorch may want a number (``x[:n]``, ``torch.arange(n)``), which it
reads with ``.item()`` before the call: such a call is looked into. A call that may cross, when
a watched device's tensor is among its arguments (or always, for ``.to(device)`` and
``.cuda()``), runs under a ``TorchDispatchMode`` pushed for that call alone, which hands its
aten operations to ``_watch_ops.classify``: that module's docstring lists what reaches the
dispatcher for each Python-level pattern. Only for an event does ``watch`` walk the Python
stack, to the first frame outside torch, torchplace and the libraries named in ``ignore``. An
empty dispatch mode over every operation costs the small step of ``benchmarks/bench_watch.py``
2.2x; this, 1.7x.
Nothing is installed outside the block: the mode is pushed on entry and taken off on exit, and
importing torchplace installs nothing. Modes belong to a thread (PyTorch keeps its stacks in
thread-local state): each thread that enters has its own, and must exit in that thread. An exit
elsewhere is refused, and closes the block it was meant for, switching its mode off; as no
thread can reach another's stack, the entering thread takes that mode off the next time it
enters or exits a watch.

What it cannot see: copies made by other threads (a DataLoader's pinning thread), work inside
``torch.compile``d code, where operations run fused (the mode steps aside while Dynamo traces),
and what autograd runs in the backward pass: its formulas are not looked into (a CPU scalar
mixed in the forward is recorded there, not again in the backward), except the gradient of a
copy, copied back where the copy's source was, which a hook on the copy's result records while
a block is open (without a line of the user's when PyTorch runs the backward on a device thread
of its own);
Python code that autograd runs (a custom ``Function``'s ``backward``, recomputed checkpoints)
is not watched. On the CPU alone there is no host-device boundary: nothing is installed, and
the result says so.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import linecache
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .._devices import available, faking, normalize
from .._devices import device as _existing
from .._errors import DeviceUnavailableError, TorchplaceError
from .._sizes import format_bytes
from ._watch_ops import (
    ALWAYS,
    ITEM,
    LOOK,
    PLAIN,
    TORCH_DIR,
    TORCHPLACE_DIR,
    Event,
    classify,
    gradient_copy,
    listed,
    plan,
    scan,
    simple,
    touches,
)

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text

__all__ = ["Watch", "WatchRow", "watch"]

# Device types without a host-device boundary: watching them records nothing.
_NO_BOUNDARY = frozenset({"cpu", "meta"})
_KINDS = ("sync", "copy", "mixing")
_F = TypeVar("_F", bound=Callable[..., Any])
_compiling = torch.compiler.is_compiling


def watch(
    device: Any = None,
    /,
    *,
    raise_on: Iterable[str] | str | None = None,
    ignore: Iterable[str] = (),
) -> Watch:
    """Record every host-device copy and every wait for the device in a block, by line.

    >>> import torch, torchplace
    >>> with torchplace.watch() as seen:
    ...     loss = torch.ones(3).sum()
    ...     total = loss.item()
    >>> seen.to_dict()["rows"]
    []

    On a GPU, ``seen`` lists ``total = loss.item()`` as one wait for the device, with its fix;
    ``print(seen)`` shows a table, costliest row first.

    Args:
        device: the accelerator whose boundary with the host is watched; ``None``, every one.
            On a machine with no accelerator (or for ``"cpu"``), nothing is installed and the
            result's ``note`` says so.
        raise_on: ``"sync"`` (the host waited for the device: ``.item()``, ``bool(t)``, a
            blocking copy, a size that depends on values), ``"copy"`` (any host-device copy),
            ``"mixing"`` (a CPU scalar tensor with a device tensor), or several: the first
            such event raises there, at the user's line.
        ignore: names of libraries (``"transformers"``) whose frames are skipped like torch's,
            so that an event inside them is charged to the user's line that called them.

    Returns:
        A ``Watch``: a context manager and a decorator (every call adds to the same record),
        with ``str()`` (a table), ``to_dict()`` (JSON-able), ``rows`` and ``note``.

    Raises:
        TorchplaceError: ``raise_on`` names an unknown kind, ``ignore`` a module that is not
        installed; in the block, the first event that ``raise_on`` names; on exit, a thread
        that did not enter it (or more exits than entries).
        DeviceSpecError: ``device`` is not a device spec.
        DeviceUnavailableError: ``device`` names an accelerator this machine does not have
        (``"cuda"`` without CUDA), unless a ``FakeTensorMode`` is active, whose fake tensors
        may say they are on it.
    """
    return Watch(device, raise_on=raise_on, ignore=ignore)


@dataclass(frozen=True)
class WatchRow:
    """One line of the user's code and one kind of event there, with totals."""

    file: str | None  # None: no frame of the user's (an autograd device thread)
    line: int | None
    function: str | None
    code: str
    kind: str  # "sync", "copy" or "mixing"
    op: str
    direction: str | None  # "host_to_device", "device_to_host" or None
    pinned: bool | None
    non_blocking: bool | None
    non_blocking_honoured: bool | None
    count: int
    waits: int  # events among ``count`` that made the host wait
    bytes: int
    fix: str

    @property
    def where(self) -> str:
        if self.file is None:
            return "(no Python caller: autograd's device thread)"
        return f"{os.path.basename(self.file)}:{self.line}"


class _Ops(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Hands each aten operation of a call to ``classify``; ``_record`` the boundary ones."""

    def __init__(self, owner: Watch) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.owner = owner
        self.copied: Event | None = None  # the last copy seen, for ``_Calls``' gradient hook

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **kwargs) if kwargs else func(*args)
        found = classify(func, args, kwargs or {}, out, self.owner._watched)
        if found is not None:
            if found[0].kind == "copy":
                self.copied = found[0]
            self.owner._record(*found)
        return out


class _Calls(TorchFunctionMode):
    """Sees each call of torch's Python API in the block, before any decomposition, and sends
    the few that may cross the boundary (``plan``) through ``_Ops``; every other call costs
    one cached look-up and one look at its arguments (``scan``)."""

    def __init__(self, owner: Watch) -> None:
        super().__init__()
        self.owner = owner
        self.ops = _Ops(owner)

    # Switched off when its block was closed by an exit in another thread: it stays on this
    # thread's stack, which no other thread can reach, until this thread enters or exits a
    # watch again (``_take_off_left``), and calls through until then.
    off = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Dynamo traces a mode's calls into its graph: keep watch out of it
        if self.off or _compiling():
            return func(*args, **kwargs) if kwargs else func(*args)
        how = plan(func)
        if (
            how != PLAIN
            and not simple(func, args, kwargs)
            and (how == ALWAYS or touches(args, kwargs, self.owner._watched))
        ):
            return self._looked_into(func, args, kwargs or {})
        found = scan(func, args, kwargs, self.owner._watched)
        if found is LOOK:  # a one-element device tensor PyTorch may read as a number
            return self._looked_into(func, args, kwargs or {})
        if found is not None:
            self.owner._record(*found)  # type: ignore[misc]
        return func(*args, **kwargs) if kwargs else func(*args)

    def _looked_into(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """``func`` run with its aten operations seen; a copy's gradient copied back in the
        backward pass is recorded by a hook on the copy's result."""
        below = self.ops
        below.copied = None
        with below:
            out = func(*args, **kwargs)
        copied = below.copied
        if copied is not None and isinstance(out, torch.Tensor) and out.grad_fn is not None:
            out.register_hook(functools.partial(self.owner._gradient_copied, copied))
        return out


_Key = tuple[str | None, int | None, str | None, Event]


class _Block:
    """One thread's open blocks of a ``Watch``: how deeply nested, and the mode it pushed."""

    __slots__ = ("depth", "mode", "thread")

    def __init__(self) -> None:
        self.depth = 0
        self.mode: _Calls | None = None
        self.thread = threading.current_thread()


# Modes of blocks closed by an exit in another thread, by the thread whose stack holds them.
_LEFT: weakref.WeakKeyDictionary[threading.Thread, list[_Calls]] = weakref.WeakKeyDictionary()
_LEFT_LOCK = threading.Lock()


def _take_off_left() -> None:
    """Takes this thread's switched-off modes (``_LEFT``) off its stack."""
    if not _LEFT:
        return
    with _LEFT_LOCK:
        modes = _LEFT.pop(threading.current_thread(), [])
    for mode in modes:
        _take_off(mode)


def _take_off(mode: _Calls) -> None:
    """``mode`` off this thread's stack of function-level modes wherever it is (the modes above
    it stay, in their order: a mode entered in the block and not exited); nothing when it is
    not there."""
    depth = torch._C._len_torch_function_stack()
    if not any(torch._C._get_function_stack_at(i) is mode for i in range(depth)):
        return
    above = []
    while (top := torch._C._pop_torch_function_stack()) is not mode:
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


class Watch:
    """The record of a ``watch`` block (see ``watch``); a context manager and a decorator.

    >>> import torchplace
    >>> seen = torchplace.watch("cpu")
    >>> seen.note
    'cpu has no host-device boundary: nothing to watch (pass an accelerator, or None for all)'
    """

    def __init__(
        self, device: Any = None, /, *, raise_on: Iterable[str] | str | None, ignore: Iterable[str]
    ) -> None:
        self.device: torch.device | None = None if device is None else _watched(device)
        self._raise_on = _kinds(raise_on)
        self._skip = _skipped_dirs(ignore)
        self._seen: dict[str, bool] = {}
        self._totals: dict[_Key, list[int]] = {}
        # Modes are per thread: each thread that enters has its own ``_Block`` (``.block``), and
        # the fake tensor's ``tolist`` being recorded (``.listing``, see ``_record``).
        self._here = threading.local()
        # Every thread's open blocks: a gradient hook records only while one is open, and an
        # exit in a thread with none open closes the one it was meant for (``_exit_elsewhere``).
        self._open: list[_Block] = []
        self._open_lock = threading.Lock()
        self.note: str | None = _note(self.device)

    def _watched(self, device: torch.device) -> bool:
        if self.device is None:
            return device.type not in _NO_BOUNDARY
        return device == self.device

    def __enter__(self) -> Watch:
        _take_off_left()
        block = getattr(self._here, "block", None)
        if block is None:
            block = self._here.block = _Block()
        with self._open_lock:
            if block.depth == 0:
                if self.note is None:
                    block.mode = _Calls(self)
                    block.mode.__enter__()  # type: ignore[no-untyped-call]
                self._open.append(block)
            block.depth += 1
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        _take_off_left()
        block = getattr(self._here, "block", None)
        with self._open_lock:  # another thread's exit may close this thread's block
            if block is not None and not block.depth:
                block = None
            mode = None if block is None else self._close(block)
        if block is None:
            self._exit_elsewhere()
        if mode is not None:
            _take_off(mode)
            self._here.listing = None

    def _close(self, block: _Block) -> _Calls | None:
        """One level of ``block`` closed (under ``_open_lock``): its mode once none is left."""
        block.depth -= 1
        if block.depth:
            return None
        self._open.remove(block)
        mode, block.mode = block.mode, None
        return mode

    def _exit_elsewhere(self) -> NoReturn:
        """An exit in a thread with no block open: refused, and the block it was meant for, if
        one other thread has one open, closed there, its mode switched off (no thread can take
        a mode off another's stack). With several open, which one is not known: none closed."""
        here = threading.current_thread()
        this = "watch()" if self.device is None else f"watch({str(self.device)!r})"
        with self._open_lock:
            others = list(self._open)
            mode = self._close(others[0]) if len(others) == 1 else None
            if mode is not None:
                mode.off = True
                if others[0].thread.is_alive():
                    with _LEFT_LOCK:
                        _LEFT.setdefault(others[0].thread, []).append(mode)
        if not others:
            raise TorchplaceError(
                f"{this} was exited in thread {here.name!r} without being entered; exit it "
                "once for each time it was entered: use it as a `with` block (or a decorator)"
            )
        if len(others) == 1:
            left = others[0].depth  # levels still open there, this exit's taken off
            closed = (
                "that block is now closed"
                if not left
                else f"one level of that block is closed, {left} still open there"
            )
            entered = f"thread {others[0].thread.name!r}"
        else:
            entered = "threads " + " and ".join(repr(b.thread.name) for b in others)
            closed = "each of those must exit its own (none is closed)"
        raise TorchplaceError(
            f"{this} was entered in {entered} and exited in thread {here.name!r}, but PyTorch's "
            f"modes belong to the thread that pushed them: {closed}; fix: exit it in the thread "
            "that entered it, e.g. use it as a `with` block in one thread (or as a decorator)"
        )

    def __call__(self, fn: _F) -> _F:
        @functools.wraps(fn)
        def watched(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return watched  # type: ignore[return-value]

    def _record(self, event: Event, nbytes: int) -> None:
        caller = sys._getframe(1)
        if event is ITEM:
            found = listed(caller)
            if found is not None:  # an element read by a fake tensor's tolist: one copy in all
                call, (event, nbytes) = found
                if call is getattr(self._here, "listing", None):
                    return
                self._here.listing = call
        frame = self._user_frame(caller)
        if frame is None:
            key: _Key = (None, None, None, event)
        else:
            key = (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, event)
        totals = self._totals.setdefault(key, [0, 0, 0])
        totals[0] += 1
        totals[1] += event.waits
        totals[2] += nbytes
        if event.kind in self._raise_on or (event.waits and "sync" in self._raise_on):
            raise TorchplaceError(_refusal(self._row(key, totals), self._raise_on))

    def _gradient_copied(self, forward: Event, grad: torch.Tensor) -> None:
        """Autograd copies the gradient of a copy's result back where its source was: recorded
        while a block is open (a backward run after the block is not the block's)."""
        if not self._open:
            return
        self._record(*gradient_copy(forward, grad))

    def _user_frame(self, frame: FrameType | None) -> FrameType | None:
        """The first frame outside torch, torchplace and the ignored libraries."""
        while frame is not None:
            name = frame.f_code.co_filename
            skip = self._seen.get(name)
            if skip is None:
                skip = self._seen[name] = name.startswith(self._skip)
            if not skip:
                return frame
            frame = frame.f_back
        return None

    def _row(self, key: _Key, totals: list[int]) -> WatchRow:
        file, line, function, event = key
        code = linecache.getline(file, line).strip() if file and line else ""
        honoured = None if event.non_blocking is None else bool(event.non_blocking and event.pinned)
        return WatchRow(
            file, line, function, code, event.kind, event.op, event.direction, event.pinned,
            event.non_blocking, honoured, totals[0], totals[1], totals[2], event.fix,
        )  # fmt: skip

    @property
    def rows(self) -> list[WatchRow]:
        """Every line and event kind seen, costliest first: most host waits, then most bytes,
        then most events."""
        rows = [self._row(key, totals) for key, totals in self._totals.items()]
        rows.sort(key=lambda r: (-r.waits, -r.bytes, -r.count, r.file or "", r.line or 0))
        return rows

    def to_dict(self) -> dict[str, Any]:
        """The record as plain data (JSON-able)."""
        rows = self.rows
        return {
            "device": None if self.device is None else str(self.device),
            "note": self.note,
            "rows": [asdict(row) for row in rows],
            "totals": {
                "events": sum(r.count for r in rows),
                "waits": sum(r.waits for r in rows),
                "bytes": sum(r.bytes for r in rows),
            },
        }

    def _title(self) -> str:
        rows = self.rows
        where = "every accelerator" if self.device is None else str(self.device)
        if self.note is not None or not rows:
            return f"watch ({where})"
        waits, moved = sum(r.waits for r in rows), sum(r.bytes for r in rows)
        return (
            f"watch ({where}): {len(rows)} place{'s' * (len(rows) != 1)}, "
            f"{waits} host wait{'s' * (waits != 1)}, {format_bytes(moved)} across"
        )

    def __rich__(self) -> Table | Text:
        from rich.table import Table
        from rich.text import Text

        if self.note is not None or not self._totals:
            return Text(f"{self._title()}: {self.note or 'nothing crossed the boundary'}")
        table = Table(title=Text(self._title()), title_justify="left")
        for column, justify in _COLUMNS:
            table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
        for row in self.rows:
            where = Text(row.where)
            if row.code:
                where.append("\n" + row.code, style="dim")
            table.add_row(
                where,
                Text(_what(row)),
                f"{row.count:,}",
                f"{row.waits:,}",
                format_bytes(row.bytes),
                Text(row.fix),
            )
        return table

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=120, color_system=None, force_terminal=False, emoji=False).print(
            self
        )
        return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"

    def __repr__(self) -> str:
        where = "every accelerator" if self.device is None else str(self.device)
        block = getattr(self._here, "block", None)
        state = "active" if block is not None and block.mode is not None else "inactive"
        return f"<Watch of {where}, {state}, {len(self._totals)} rows>"


_COLUMNS = (
    ("line", "left"),
    ("what", "left"),
    ("count", "right"),
    ("waits", "right"),
    ("bytes", "right"),
    ("fix", "left"),
)


def _what(row: WatchRow) -> str:
    """The operation and, for a copy, its direction and how it was asked."""
    if row.kind != "copy":
        return row.op if row.kind == "mixing" else f"{row.op} (host waits)"
    arrow = "host -> device" if row.direction == "host_to_device" else "device -> host"
    memory = "pinned" if row.pinned else "pageable"
    if not row.non_blocking:
        how = "blocking"
    else:
        how = "non_blocking" + ("" if row.non_blocking_honoured else " (not honoured)")
    return f"{row.op}: {arrow}, {memory}, {how}"


def _refusal(row: WatchRow, kinds: tuple[str, ...]) -> str:
    happened = "made the host wait for the device" if row.waits else f"is a {row.kind}"
    code = f" ({row.code})" if row.code else ""
    return (
        f"{row.where}{code}: {row.op} {happened}, which watch(raise_on={kinds!r}) forbids; "
        f"fix: {row.fix}"
    )


def _kinds(raise_on: Iterable[str] | str | None) -> tuple[str, ...]:
    if raise_on is None:
        return ()
    kinds = (raise_on,) if isinstance(raise_on, str) else tuple(raise_on)
    wrong = [k for k in kinds if k not in _KINDS]
    if wrong:
        raise TorchplaceError(
            f"watch(raise_on={raise_on!r}): unknown kind {wrong[0]!r}; "
            f"use any of {', '.join(map(repr, _KINDS))}"
        )
    return kinds


def _skipped_dirs(ignore: Iterable[str]) -> tuple[str, ...]:
    """Path prefixes of frames that are not the user's: torch, torchplace, ``ignore``."""
    if isinstance(ignore, str):
        ignore = (ignore,)
    dirs = [TORCH_DIR, TORCHPLACE_DIR]
    for name in ignore:
        try:
            spec = importlib.util.find_spec(name) if isinstance(name, str) and name else None
        except (ImportError, ValueError):  # a dotted name whose parent is missing
            spec = None
        if spec is None:
            raise TorchplaceError(
                f"watch(ignore=...): {name!r} is not an installed module; name the library "
                "whose frames to skip as it is imported, e.g. ignore=('transformers',)"
            )
        if spec.submodule_search_locations:
            dirs += [os.path.abspath(d) + os.sep for d in spec.submodule_search_locations]
        elif spec.origin:
            dirs.append(os.path.abspath(spec.origin))
    return tuple(dirs)


def _watched(spec: Any) -> torch.device:
    """The device ``spec`` names, refused when this machine lacks it: watching it would report
    a clean step that was never watched. Under ``FakeTensorMode`` it need not exist (fake
    tensors say they are on it)."""
    dev = normalize(spec)
    if dev.type in _NO_BOUNDARY or faking():
        return dev
    try:
        _existing(dev)
    except DeviceUnavailableError as exc:
        raise DeviceUnavailableError(
            f"watch({spec!r}) has nothing to watch: {exc}; watch a device this machine has, "
            "or call watch() with no device to watch every accelerator it has (on a machine "
            "with none, it says so)"
        ) from exc
    return dev


def _note(device: torch.device | None) -> str | None:
    """Why nothing will be recorded, or ``None`` when there is a boundary to watch."""
    if device is not None and device.type in _NO_BOUNDARY:
        return (
            f"{device} has no host-device boundary: nothing to watch "
            "(pass an accelerator, or None for all)"
        )
    if device is None and all(d.type in _NO_BOUNDARY for d in available()):
        return "no accelerator on this machine: the CPU alone has no host-device boundary"
    return None
