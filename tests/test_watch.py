"""watch(): every host-device copy and wait of a block, by the user's line, run for real on the CPU.

No GPU here, so the accelerator is played by ``OnDevice``: a dispatch mode, entered before
``watch`` (so below it), under which ``meta`` is a device whose tensors (``Dev``) keep real
values in CPU tensors. ``.item()``, masks, ``nonzero`` and copies run for real and give real
values, and ``watch`` sees exactly the operations it would see on a GPU, on tensors that say
they are on the device. The test declares ``meta`` a watched device type (``_NO_BOUNDARY``);
``FakeTensorMode`` covers what needs the device type ``cuda`` itself.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

import torchplace
from torchplace.looking import _watch

DEVICE = torch.device("meta")
SOURCE = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> int:
    """The line of this file that ends with ``# marker``."""
    found = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# {marker}")]
    assert len(found) == 1, marker
    return found[0]


class Dev(torch.Tensor):
    """A tensor that says it is on the device and keeps its values in a CPU tensor."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Dev:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device=DEVICE
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise AssertionError("Dev tensors are used under OnDevice only")


class OnDevice(TorchDispatchMode):
    """``meta`` as an accelerator with real values; pinned host memory as CUDA pins it."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: list[torch.Tensor] = []

    def _is_pinned(self, t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return any(p.untyped_storage().data_ptr() == ptr for p in self.pinned)

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        self.pinned.append(t)
        return t

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        aten = torch.ops.aten
        if func is aten.is_pinned.default:
            return self._is_pinned(args[0])
        if func is aten._pin_memory.default:
            return self._pin(args[0].clone())
        to = kwargs.get("device")
        to_device = to is not None and torch.device(to).type == "meta"
        if to_device:
            kwargs["device"] = torch.device("cpu")
        on_device = any(isinstance(a, Dev) for a in tree_leaves((args, kwargs)))
        out = func(*tree_map(_inner, args), **tree_map(_inner, kwargs))
        if func is aten._to_copy.default and on_device and to is not None and not to_device:
            # to the host: the result of a non-blocking copy is pinned, as PyTorch does for CUDA
            return self._pin(out) if kwargs.get("non_blocking") else out
        if func._schema.is_mutable and isinstance(args[0], Dev):
            return args[0]
        if to_device or (on_device and to is None):
            return tree_map(lambda o: Dev(o) if type(o) is torch.Tensor else o, out)
        return out


def _inner(a: object) -> object:
    return a.inner if isinstance(a, Dev) else a


@pytest.fixture
def on_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[OnDevice]:
    monkeypatch.setattr(_watch, "_NO_BOUNDARY", frozenset({"cpu"}))
    with OnDevice() as mode:
        yield mode


def rows(seen: Any) -> dict[tuple[int, str], dict[str, Any]]:
    found = {(r["line"], r["op"]): r for r in seen.to_dict()["rows"]}
    assert len(found) == len(seen.rows)
    return found


def test_the_emulated_device_gives_real_values(on_device: OnDevice) -> None:
    x = torch.arange(6.0).to("meta")
    assert isinstance(x, Dev) and x.device == DEVICE
    assert (x * 2).sum().item() == 30.0
    assert x[x > 2].cpu().tolist() == [3.0, 4.0, 5.0]


def step(
    x: torch.Tensor, batch: torch.Tensor, pinned: torch.Tensor, host: torch.Tensor, dev: str
) -> None:
    total = x.sum().item()  # item
    if x[0] > 10:  # if
        total += 1
    x.cpu()  # cpu
    x.to("cpu", non_blocking=True)  # cpu non_blocking
    host.copy_(x)  # copy_ to host
    batch.to(dev)  # pageable
    batch.to(dev, non_blocking=True)  # pageable non_blocking
    pinned.to(dev, non_blocking=True)  # pinned non_blocking
    x[x > 2]  # mask
    # a copy of x[0]: CUDA refuses to write a view of x into x (index_put_'s overlap check)
    x[x > 2] = x[0].clone()  # mask set
    x.nonzero()  # nonzero
    torch.unique(x)  # unique
    x.masked_select(x > 1)  # masked_select
    torch.repeat_interleave(x.long())  # repeat_interleave
    torch.repeat_interleave((x >= 0).long(), output_size=6)  # with output_size
    x * torch.tensor(2.0)  # mixing
    x * 2  # python number
    torch.ops.aten.lift_fresh(x)  # lift_fresh


def test_each_pattern_is_reported_with_its_line_count_and_bytes(on_device: OnDevice) -> None:
    batch, pinned = torch.ones(4, 8), torch.ones(16).pin_memory()
    host = torch.empty(6)
    with torchplace.watch("meta") as seen:
        for _ in range(3):
            x = torch.arange(6.0).to("meta")  # setup copy
            step(x, batch, pinned, host, "meta")
    found = rows(seen)
    item = found[line_of("item"), ".item() / bool(t) / if t"]
    assert (item["count"], item["waits"], item["bytes"], item["kind"]) == (3, 3, 12, "sync")
    assert item["code"] == "total = x.sum().item()  # item"
    assert item["function"] == "step" and item["file"] == __file__
    assert found[line_of("if"), ".item() / bool(t) / if t"]["count"] == 3
    expected = {  # (marker, op): (count, waits, bytes, pinned, non_blocking, honoured)
        ("setup copy", ".to(device)"): (3, 3, 72, False, False, False),
        ("cpu", ".cpu() / .tolist()"): (3, 3, 72, False, False, False),
        ("cpu non_blocking", ".cpu() / .tolist()"): (3, 0, 72, True, True, True),
        ("copy_ to host", "copy_ to the host"): (3, 3, 72, False, False, False),
        ("pageable", ".to(device)"): (3, 3, 384, False, False, False),
        ("pageable non_blocking", ".to(device)"): (3, 0, 384, False, True, False),
        ("pinned non_blocking", ".to(device)"): (3, 0, 192, True, True, True),
        ("lift_fresh", "torch.tensor(data, device=...)"): (3, 3, 72, False, False, False),
    }
    for (marker, op), want in expected.items():
        row = found[line_of(marker), op]
        got = tuple(row[k] for k in ("count", "waits", "bytes", "pinned", "non_blocking"))
        assert (*got, row["non_blocking_honoured"]) == want, marker
        assert row["kind"] == "copy"
    for marker in ("mask", "mask set", "nonzero", "unique", "masked_select", "repeat_interleave"):
        op = {"mask": "x[mask]", "mask set": "x[mask] = v"}.get(marker, marker)
        row = found[line_of(marker), op]
        assert (row["kind"], row["count"], row["waits"], row["bytes"]) == ("sync", 3, 3, 0)
    mixing = found[line_of("mixing"), "a CPU scalar tensor with a device tensor"]
    assert (mixing["kind"], mixing["count"], mixing["waits"], mixing["bytes"]) == (
        "mixing", 3, 0, 12,
    )  # fmt: skip
    lines = {line for line, _ in found}
    assert line_of("with output_size") not in lines and line_of("python number") not in lines
    assert len(found) == 17
    json.dumps(seen.to_dict())


def test_rows_come_costliest_first_and_the_table_shows_them(on_device: OnDevice) -> None:
    x = torch.arange(6.0).to("meta")
    with torchplace.watch("meta") as seen:
        for _ in range(2):
            x.sum().item()  # twice
        torch.ones(1000).to("meta")  # big
        x.nonzero()  # once
        x * torch.tensor(3.0)  # no wait
    order = [r.line for r in seen.rows]
    assert order == [line_of(m) for m in ("twice", "big", "once", "no wait")]
    text = str(seen)
    assert text.startswith("watch (meta): 4 places, 4 host waits, 3.9 KiB across")
    positions = [text.index(f"test_watch.py:{line}") for line in order]
    assert positions == sorted(positions)
    assert "x.sum().item()  # twice" in text and "DeviceLoader" in text
    assert seen.to_dict()["totals"] == {"events": 5, "waits": 4, "bytes": 4012}


def test_a_clean_loop_reports_nothing(on_device: OnDevice) -> None:
    x = torch.arange(6.0).to("meta")
    with torchplace.watch("meta") as seen:
        for _ in range(3):
            y = torch.where(x > 2, x, 0.0) * 2 + 1
            total = y.sum()
            torch.nonzero_static(x, size=3)
            torch.ones(3).sum().item()  # the host's own tensors
    assert total.item() == 30.0
    assert seen.rows == []
    assert seen.to_dict() == {
        "device": "meta",
        "note": None,
        "rows": [],
        "totals": {"events": 0, "waits": 0, "bytes": 0},
    }
    assert str(seen) == "watch (meta): nothing crossed the boundary\n"


def test_raise_on_sync_raises_at_the_line(on_device: OnDevice) -> None:
    x = torch.arange(6.0).to("meta")
    with torchplace.watch("meta", raise_on=("sync",)):
        torch.where(x > 2, x, 0.0)
        with pytest.raises(torchplace.TorchplaceError) as err:
            above(x, 3)
    line = line_of("refused")
    assert str(err.value).startswith(f"test_watch.py:{line} (if x.sum() > limit:  # refused): ")
    assert "watch(raise_on=('sync',)) forbids" in str(err.value)
    assert "every N steps" in str(err.value)  # the fix
    assert err.value.__traceback__ is not None
    frames = [f.lineno for f in _frames(err.value.__traceback__) if f.filename == __file__]
    assert line in frames


def above(x: torch.Tensor, limit: float) -> str:
    if x.sum() > limit:  # refused
        return "above"
    return "not above"


def _frames(tb: Any) -> list[Any]:
    import traceback

    return list(traceback.extract_tb(tb))


def test_raise_on_copy_lets_waits_pass_and_stops_at_a_copy(on_device: OnDevice) -> None:
    x = torch.arange(6.0).to("meta")
    with torchplace.watch("meta", raise_on="copy") as seen:
        x.sum().item()
        with pytest.raises(torchplace.TorchplaceError, match=r"is a copy, which watch"):
            torch.ones(2).pin_memory().to("meta", non_blocking=True)  # a copy
    assert [r.op for r in seen.rows] == [".item() / bool(t) / if t", ".to(device)"]
    with torchplace.watch("meta", raise_on=("sync",)):  # a pinned non-blocking copy: no wait
        torch.ones(2).pin_memory().to("meta", non_blocking=True)


def test_raise_on_an_unknown_kind_is_refused() -> None:
    with pytest.raises(
        torchplace.TorchplaceError, match=r"unknown kind 'syncs'; use any of 'sync'"
    ):
        torchplace.watch(raise_on=("syncs",))


def test_an_event_inside_a_library_goes_to_the_library_line_unless_ignored(
    on_device: OnDevice, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "steplib.py").write_text("def metric(x):\n    return x.sum().item()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import steplib

    x = torch.arange(6.0).to("meta")
    with torchplace.watch("meta") as seen:
        steplib.metric(x)
    with torchplace.watch("meta", ignore=("steplib",)) as ignoring:
        steplib.metric(x)  # the caller
    assert [(r.where, r.function) for r in seen.rows] == [("steplib.py:2", "metric")]
    assert [r.line for r in ignoring.rows] == [line_of("the caller")]
    with pytest.raises(torchplace.TorchplaceError, match=r"'steplibb' is not an installed module"):
        torchplace.watch(ignore=("steplibb",))
    sys.modules.pop("steplib", None)


def test_as_a_decorator_every_call_adds_to_one_record(on_device: OnDevice) -> None:
    seen = torchplace.watch("meta")

    @seen
    def read(x: torch.Tensor, depth: int) -> float:
        if depth:
            read(x, depth - 1)
        return x.sum().item()  # read

    x = torch.arange(6.0).to("meta")
    assert read(x, 1) == 15.0 and read(x, 0) == 15.0
    assert [(r.line, r.count) for r in seen.rows] == [(line_of("read"), 3)]
    assert read.__name__ == "read"
    x.sum().item()  # outside: not recorded
    assert seen.rows[0].count == 3


def test_nothing_is_installed_outside_the_block(on_device: OnDevice) -> None:
    """In the block, one function-level mode; no dispatch mode stays installed, in or out."""
    depth = torch._C._len_torch_function_stack()
    dispatch = torch._C._len_torch_dispatch_stack()
    seen = torchplace.watch("meta")
    assert torch._C._len_torch_function_stack() == depth
    with seen:
        assert torch._C._len_torch_function_stack() == depth + 1
        assert torch._C._len_torch_dispatch_stack() == dispatch
        with seen:
            assert torch._C._len_torch_function_stack() == depth + 1
    assert torch._C._len_torch_function_stack() == depth
    with pytest.raises(ZeroDivisionError), seen:
        1 / 0  # noqa: B018
    assert torch._C._len_torch_function_stack() == depth
    assert torch._C._len_torch_dispatch_stack() == dispatch
    assert repr(seen) == "<Watch of meta, inactive, 0 rows>"


def test_calls_that_cannot_cross_are_not_looked_into(
    on_device: OnDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cost of an active watch: arithmetic on device tensors never reaches the dispatch-level
    mode; a call that may cross does, and is recorded."""
    looked: list[str] = []
    classify = _watch.classify

    def spy(func: Any, *rest: Any) -> Any:
        looked.append(func.__name__)
        return classify(func, *rest)

    monkeypatch.setattr(_watch, "classify", spy)
    x = torch.arange(6.0).to("meta")
    w = torch.ones(6, 6).to("meta")
    with torchplace.watch("meta") as seen:
        y = torch.nn.functional.linear(x, w).relu() * 2 + x
        y.add_(1).sum()
        y.to(torch.float64)  # a conversion: no crossing
        y[1:, None][..., 0]  # basic indexing: no crossing
        assert looked == []
        total = y.sum().item()  # looked into
    assert looked == ["_local_scalar_dense.default"]
    assert total == 6 * (15 * 2 + 1) + 15
    assert [r.line for r in seen.rows] == [line_of("looked into")]


def test_a_gradient_copied_back_in_backward_is_recorded(on_device: OnDevice) -> None:
    """Autograd copies the gradient of a copy back where its source was: a copy too."""
    w = torch.ones(4, 4, requires_grad=True)
    with torchplace.watch("meta") as seen:
        on = w.to("meta")  # forward copy
        (on * 2).sum().backward()  # backward copy
    found = {(r.line, r.direction): (r.op, r.count, r.bytes, r.waits) for r in seen.rows}
    assert found == {
        (line_of("forward copy"), "host_to_device"): (".to(device)", 1, 64, 1),
        (line_of("backward copy"), "device_to_host"): (".cpu() / .tolist()", 1, 64, 1),
    }
    assert torch.equal(w.grad, torch.full((4, 4), 2.0))


def test_a_device_tensor_read_as_a_number_is_a_wait(on_device: OnDevice) -> None:
    """Where torch wants a number, a one-element device tensor is read with ``.item()`` before
    the call: a host wait inside calls that otherwise cannot cross; tensors used as tensors are
    not."""
    x = torch.arange(6.0).to("meta")
    n, v = torch.tensor(3).to("meta"), torch.tensor(2.5).to("meta")
    with torchplace.watch("meta") as seen:
        a = x[:n]  # slice bound
        b = x[1:n, None]  # slice in a tuple
        c = torch.arange(n)  # arange
        d = x.reshape(n, -1)  # reshape
        e = x.view(n, -1)  # view
        f = torch.full((2,), v)  # full
        g = torch.topk(x, n)  # topk
        h = (v * 2 + x[:3]).reshape(3, -1) * n  # as tensors
    item = ".item() / bool(t) / if t"
    markers = ("slice bound", "slice in a tuple", "arange", "reshape", "view", "full", "topk")
    want = {line_of(m): (item, "sync", 1, 1, 8) for m in markers}
    want[line_of("full")] = (item, "sync", 1, 1, 4)
    assert {r.line: (r.op, r.kind, r.count, r.waits, r.bytes) for r in seen.rows} == want
    assert a.cpu().tolist() == [0.0, 1.0, 2.0] and b.shape == (2, 1)
    assert c.cpu().tolist() == [0, 1, 2] and d.shape == e.shape == (3, 2)
    assert f.cpu().tolist() == [2.5, 2.5] and g.values.cpu().tolist() == [5.0, 4.0, 3.0]
    assert h.cpu().flatten().tolist() == [15.0, 18.0, 21.0]


def test_type_as_a_tensor_of_another_device_is_a_copy(on_device: OnDevice) -> None:
    """``a.type_as(b)`` is ``a.to(b.options())``: it moves ``a`` to ``b``'s device."""
    x = torch.arange(4.0).to("meta")
    with torchplace.watch("meta") as seen:
        up = torch.ones(4).type_as(x)  # type_as up
        down = x.type_as(torch.ones(1))  # type_as down
        x.type_as(x)  # same device
    found = {r.line: (r.op, r.direction, r.bytes) for r in seen.rows}
    assert found == {
        line_of("type_as up"): (".to(device)", "host_to_device", 16),
        line_of("type_as down"): (".cpu() / .tolist()", "device_to_host", 16),
    }
    assert up.device == DEVICE and down.device.type == "cpu"
    assert down.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_backward_run_after_the_block_is_not_recorded(on_device: OnDevice) -> None:
    """The hook on a copy's result records the gradient copied back only while the block is
    open: a backward run after it neither adds rows nor raises."""
    w = torch.ones(4, 4, requires_grad=True)
    with torchplace.watch("meta") as seen:
        on = w.to("meta")  # copied in the block
    pinned = torch.ones(4, requires_grad=True).pin_memory()
    with torchplace.watch("meta", raise_on="sync") as strict:
        fast = pinned.to("meta", non_blocking=True)  # no wait: allowed
    (on * 2).sum().backward()
    (fast * 3).sum().backward()  # a blocking copy back, after the block: not raised
    assert [(r.line, r.direction) for r in seen.rows] == [
        (line_of("copied in the block"), "host_to_device")
    ]
    assert [r.line for r in strict.rows] == [line_of("no wait: allowed")]
    assert torch.equal(w.grad, torch.full((4, 4), 2.0))
    with seen:  # open again: recorded again
        (w.to("meta") * 2).sum().backward()  # again
    assert [r.count for r in seen.rows if r.line == line_of("again")] == [1, 1]


def test_every_call_that_may_cross_is_looked_into() -> None:
    from torchplace.looking import _watch_ops

    functional = torch.nn.functional
    for func in (
        torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.tolist,
        torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.to, torch.Tensor.cuda,
        torch.Tensor.copy_, torch.tensor, torch.as_tensor, torch.Tensor.nonzero, torch.nonzero,
        torch.where, torch.argwhere, torch.Tensor.__getitem__, torch.Tensor.__setitem__,
        torch.Tensor.index_put_, torch.unique, torch.Tensor.unique, torch.unique_consecutive,
        torch.masked_select, torch.repeat_interleave, torch.bincount, torch.equal,
        torch.allclose, functional.one_hot, torch.Tensor.__repr__, torch.Tensor.__format__,
        torch.ops.aten.lift_fresh, torch.ops.aten._local_scalar_dense.default,
    ):  # fmt: skip
        assert _watch_ops.plan(func) != _watch_ops.PLAIN, func
    for func in (torch.Tensor.add_, torch.Tensor.__mul__, functional.linear, torch.matmul):
        assert _watch_ops.plan(func) == _watch_ops.PLAIN, func


def test_an_unhashable_function_handed_to_torch_function_runs(on_device: OnDevice) -> None:
    """Libraries may route any callable through ``handle_torch_function``."""

    class Doubled:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, t: torch.Tensor) -> torch.Tensor:
            return t * 2

    x = torch.arange(3.0).to("meta")
    with torchplace.watch("meta") as seen:
        out = torch.overrides.handle_torch_function(Doubled(), (x,), x)
        out.sum().item()  # after it
    assert out.cpu().tolist() == [0.0, 2.0, 4.0]
    assert [r.line for r in seen.rows] == [line_of("after it")]


def test_compiled_code_in_the_block_computes_as_without(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo traces function-level modes into its graph: watch must not change what it
    computes (compiled code is not watched)."""
    monkeypatch.setattr(_watch, "_NO_BOUNDARY", frozenset({"cpu"}))  # meta: a watched device

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.sin() + 1
        if y.sum() > 0:
            y = y * 2
        return y.sum(), y[y > 1]

    x = torch.linspace(-2, 2, 8)
    compiled = torch.compile(step, backend="eager")
    with torchplace.watch("meta") as seen:
        assert seen.note is None  # watching
        got = compiled(x)
    want = step(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert seen.rows == []


def test_each_thread_that_enters_is_watched(on_device: OnDevice) -> None:
    """Dispatch modes belong to a thread: a second thread entering the same watch (a decorated
    function called from a pool) gets its own, and both add to one record."""
    import threading

    seen = torchplace.watch("meta")
    x = torch.arange(6.0).to("meta")

    def read() -> None:
        with OnDevice(), seen:
            x.sum().item()  # in a thread

    with seen:
        worker = threading.Thread(target=read)
        worker.start()
        worker.join(timeout=60)
        x.sum().item()  # in the main thread
    assert {(r.line, r.count) for r in seen.rows} == {
        (line_of("in a thread"), 1),
        (line_of("in the main thread"), 1),
    }


def test_an_exit_in_another_thread_is_refused_and_switches_the_block_off(
    on_device: OnDevice,
) -> None:
    """Modes belong to the thread that pushed them: an exit in another thread is refused, the
    block it closes records and refuses nothing more, and each thread can watch again after,
    with no mode of the refused block left on its stack."""
    import threading

    x = torch.arange(6.0).to("meta")
    depth = torch._C._len_torch_function_stack()
    seen = torchplace.watch("meta", raise_on="sync")
    seen.__enter__()
    assert torch._C._len_torch_function_stack() == depth + 1
    found: dict[str, Any] = {}

    def close() -> None:
        found["stack"] = [torch._C._len_torch_function_stack()]
        try:
            seen.__exit__(None, None, None)
        except Exception as exc:  # the test looks at what it is
            found["error"] = exc
        found["stack"].append(torch._C._len_torch_function_stack())
        with OnDevice(), torchplace.watch("meta") as there:
            x.sum().item()  # later in the other thread
        found["there"] = there
        found["stack"].append(torch._C._len_torch_function_stack())

    worker = threading.Thread(target=close, name="closer")
    worker.start()
    worker.join(timeout=60)
    error = found["error"]
    assert type(error) is torchplace.TorchplaceError, repr(error)
    assert repr(threading.current_thread().name) in str(error) and "'closer'" in str(error)
    assert "exit it in the thread that entered it" in str(error)  # the fix
    assert found["stack"] == [0, 0, 0]
    assert [r.line for r in found["there"].rows] == [line_of("later in the other thread")]
    x.sum().item()  # neither recorded nor refused: the block is closed
    assert seen.rows == [] and repr(seen) == "<Watch of meta, inactive, 0 rows>"
    # its mode, switched off, is still on this thread's stack, which the other thread cannot
    # reach: this thread's next watch takes it off
    assert torch._C._len_torch_function_stack() == depth + 1
    with torchplace.watch("meta") as later:
        assert torch._C._len_torch_function_stack() == depth + 1
        x.sum().item()  # later here
    assert torch._C._len_torch_function_stack() == depth
    assert [r.line for r in later.rows] == [line_of("later here")]
    with pytest.raises(torchplace.TorchplaceError, match="forbids"), seen:
        x.sum().item()  # the same watch, entered again
    assert [r.line for r in seen.rows] == [line_of("the same watch, entered again")]
    assert torch._C._len_torch_function_stack() == depth


def test_a_re_entered_watch_exited_once_in_another_thread_keeps_its_outer_block(
    on_device: OnDevice,
) -> None:
    import threading

    x = torch.arange(6.0).to("meta")
    depth = torch._C._len_torch_function_stack()
    seen = torchplace.watch("meta")
    errors: list[BaseException] = []

    def close() -> None:
        try:
            seen.__exit__(None, None, None)
        except Exception as exc:  # the test looks at what it is
            errors.append(exc)

    with seen:
        seen.__enter__()
        worker = threading.Thread(target=close)
        worker.start()
        worker.join(timeout=60)
        x.sum().item()  # the outer block still watches
        assert torch._C._len_torch_function_stack() == depth + 1
    assert [type(e) for e in errors] == [torchplace.TorchplaceError]
    assert "one level of that block is closed, 1 still open there" in str(errors[0])
    assert torch._C._len_torch_function_stack() == depth
    assert [r.line for r in seen.rows] == [line_of("the outer block still watches")]


def test_an_exit_elsewhere_while_several_threads_watch_closes_none(on_device: OnDevice) -> None:
    """Which of their blocks it was meant for is not known: each thread still exits its own."""
    import threading

    seen = torchplace.watch("meta")
    x = torch.arange(6.0).to("meta")
    inside, leave = threading.Barrier(3), threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            with OnDevice(), seen:
                inside.wait(timeout=60)
                leave.wait(timeout=60)
                x.sum().item()  # each thread, to the end of its block
        except BaseException as exc:  # the test looks at what it is
            errors.append(exc)

    workers = [threading.Thread(target=read, name=f"reader-{i}") for i in range(2)]
    for worker in workers:
        worker.start()
    inside.wait(timeout=60)
    try:
        with pytest.raises(torchplace.TorchplaceError) as info:
            seen.__exit__(None, None, None)
    finally:
        leave.set()
        for worker in workers:
            worker.join(timeout=60)
    assert "'reader-0'" in str(info.value) and "'reader-1'" in str(info.value)
    assert errors == []
    assert [(r.line, r.count) for r in seen.rows] == [
        (line_of("each thread, to the end of its block"), 2)
    ]


def test_an_exit_without_an_enter_is_refused(on_device: OnDevice) -> None:
    x = torch.arange(6.0).to("meta")
    depth = torch._C._len_torch_function_stack()
    seen = torchplace.watch("meta")
    with pytest.raises(torchplace.TorchplaceError, match=r"use it as a `with` block"):
        seen.__exit__(None, None, None)
    with seen:
        pass
    with pytest.raises(torchplace.TorchplaceError, match=r"use it as a `with` block"):
        seen.__exit__(None, None, None)  # one exit too many
    with seen:
        assert torch._C._len_torch_function_stack() == depth + 1
        x.sum().item()  # after the refusals
    assert torch._C._len_torch_function_stack() == depth
    assert [r.line for r in seen.rows] == [line_of("after the refusals")]


def test_a_mode_entered_in_the_block_and_left_open_stays_installed(on_device: OnDevice) -> None:
    """The block's end takes off its own mode, not whichever is on top."""
    from torch.overrides import TorchFunctionMode

    depth = torch._C._len_torch_function_stack()
    user = TorchFunctionMode()
    with torchplace.watch("meta"):
        user.__enter__()
    try:
        assert torch._C._len_torch_function_stack() == depth + 1
        assert torch._C._get_function_stack_at(depth) is user
    finally:
        user.__exit__(None, None, None)
    assert torch._C._len_torch_function_stack() == depth


def test_on_the_cpu_alone_nothing_is_recorded_and_it_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_watch, "available", lambda: [torch.device("cpu")])
    depth = torch._C._len_torch_dispatch_stack()
    with torchplace.watch() as seen:
        assert torch._C._len_torch_dispatch_stack() == depth
        torch.ones(3).sum().item()
    assert seen.note == "no accelerator on this machine: the CPU alone has no host-device boundary"
    assert seen.to_dict()["note"] == seen.note and seen.rows == []
    assert str(seen) == f"watch (every accelerator): {seen.note}\n"
    assert torchplace.watch("cpu").note is not None


def test_a_device_this_machine_lacks_is_refused_not_reported_clean() -> None:
    """Watching it would record nothing and print "nothing crossed the boundary"."""
    lacking: list[Any] = ["cuda:99", torch.device("cuda", 99)]
    if not torch.cuda.is_available():
        lacking += ["cuda", "cuda:3"]
    for spec in lacking:
        with pytest.raises(torchplace.DeviceUnavailableError) as info:
            torchplace.watch(spec)
        message = str(info.value)
        assert message.startswith(f"watch({spec!r}) has nothing to watch: cuda:"), message
        assert "watch() with no device" in message
    assert torchplace.watch("cpu").note is not None  # no boundary: said, not refused


def test_with_no_device_named_every_accelerator_is_watched(
    on_device: OnDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_watch, "available", lambda: [DEVICE, torch.device("cpu")])
    x = torch.arange(6.0).to("meta")
    with torchplace.watch() as seen:
        x.sum().item()  # any device
    assert seen.note is None and seen.device is None
    assert [(r.line, r.kind) for r in seen.rows] == [(line_of("any device"), "sync")]
    assert seen.to_dict()["device"] is None
    assert str(seen).startswith("watch (every accelerator): 1 place, 1 host wait, 4 B across")


@pytest.mark.fake_cuda
def test_fake_cuda_tensors_are_watched_as_cuda() -> None:
    """FakeTensorMode (below watch) makes tensors that say cuda:0 on a CPU-only build."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), torchplace.watch("cuda:0") as seen:
        torch.tensor([1.0, 2.0], device="cuda:0")  # from data
        dev = torch.empty(4, 4, device="cuda:0")
        dev.cpu()  # back
        torch.empty(8, device="cuda:1").cpu()  # another device: not watched
    found = {(r.line, r.direction): (r.count, r.bytes, r.waits) for r in seen.rows}
    assert found == {
        (line_of("from data"), "host_to_device"): (1, 8, 1),
        (line_of("back"), "device_to_host"): (1, 64, 1),
    }


def test_tolist_of_a_fake_cuda_tensor_is_one_copy_as_on_a_gpu() -> None:
    """A fake tensor's ``tolist`` reads it one element at a time with ``.item()`` (it has no
    data to copy); on a GPU, ``Tensor.tolist`` copies the whole tensor to the host once and
    converts it there: one copy, one wait, the tensor's bytes. Iterating reads each element."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # scalar outputs allowed: a fake tensor's .item() gives a symbol instead of refusing
    shapes = ShapeEnv(allow_scalar_outputs=True)
    with FakeTensorMode(shape_env=shapes), torchplace.watch("cuda:0") as seen:
        t = torch.empty(16, device="cuda:0")
        for _ in range(2):
            t.tolist()  # tolist
        torch.empty(2, 3, dtype=torch.float64, device="cuda:0").tolist()  # nested
        torch.empty((), dtype=torch.int64, device="cuda:0").tolist()  # zero-dim
        for element in torch.empty(4, device="cuda:0"):
            element.item()  # one element at a time
    found = {r.line: (r.kind, r.op, r.direction, r.count, r.waits, r.bytes) for r in seen.rows}
    copy = ("copy", ".cpu() / .tolist()", "device_to_host")
    assert found == {
        line_of("tolist"): (*copy, 2, 2, 128),
        line_of("nested"): (*copy, 1, 1, 48),
        line_of("zero-dim"): (*copy, 1, 1, 8),
        line_of("one element at a time"): (
            "sync", ".item() / bool(t) / if t", "device_to_host", 4, 4, 16,
        ),
    }  # fmt: skip


@pytest.mark.requires_cuda
def test_on_a_gpu_tolist_is_one_copy() -> None:
    t = torch.arange(16.0, device="cuda:0")
    with torchplace.watch("cuda:0") as seen:
        values = t.tolist()
    assert values == [float(i) for i in range(16)]
    assert [(r.kind, r.op, r.count, r.waits, r.bytes) for r in seen.rows] == [
        ("copy", ".cpu() / .tolist()", 1, 1, 64)
    ]


def test_a_transformers_training_step_is_watched_without_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tf = pytest.importorskip("transformers")
    config = tf.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (2, 8))
    # meta declared a watched device: the dispatch mode is installed and sees every operation
    # of the step (forward, loss, backward, AdamW), none of which crosses a boundary on the CPU
    monkeypatch.setattr(_watch, "_NO_BOUNDARY", frozenset({"cpu"}))
    with torchplace.watch("meta", raise_on=("sync", "copy"), ignore=("transformers",)) as seen:
        assert seen.note is None
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert torch.isfinite(loss).item()
    assert seen.rows == []


@pytest.mark.requires_cuda
def test_on_a_gpu_every_wait_reported_is_one_pytorch_warns_about() -> None:
    """The same loop on a real GPU, beside torch.cuda.set_sync_debug_mode("warn"), which warns
    at each synchronisation PyTorch makes: the lines of this file on the stack at each warning
    are the lines watch reports as waits."""
    import traceback
    import warnings

    dev = torch.device("cuda:0")
    batch, pinned = torch.ones(4, 8), torch.ones(16).pin_memory()
    warned: set[int] = set()

    def record(message: Any, *args: Any, **kwargs: Any) -> None:
        if "called a synchronizing cuda operation" in str(message).lower():
            ours = [f.lineno for f in traceback.extract_stack() if f.filename == __file__]
            warned.add(ours[-2])  # the innermost line of ours that is not this function's

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        x = torch.arange(6.0, device=dev)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torchplace.watch(dev) as seen:
                for _ in range(2):
                    step(x.clone(), batch, pinned, torch.empty(6), "cuda:0")
                    torch.tensor([1.0, 2.0], device=dev)  # from data on a GPU
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waited = {row.line for row in seen.rows if row.waits} - {line_of("lift_fresh")}
    assert line_of("from data on a GPU") in waited
    assert waited == warned, (sorted(waited - warned), sorted(warned - waited), str(seen))
