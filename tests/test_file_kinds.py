"""Paths that are not readable checkpoint files, and pickles too large to read (issue 48, items
3, 6 and 7).

A named pipe, a socket or a device node (as the checkpoint, as a shard of an index, or as the
file inside a directory) is refused at once, before anything opens it: opening a pipe for
reading waits for a writer, for ever. Each call runs on a thread of its own with a time limit,
so a read that blocks fails its test instead of hanging pytest. A file this user may not read,
or a directory where a file is expected, is said to be so (not "truncated"); the real
permission check runs in a subprocess that gives up root's right to read anything. A pickle
placing more objects than the bound is refused by ``load`` as by ``inspect``, reading stopped
at the bound.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as safetensors_torch
import torch
from torch import nn

import torchplace
from torchplace._errors import CheckpointError
from torchplace.checkpoint import _pickle_reader
from torchplace.checkpoint._catalog import describe_file
from torchplace.cli import main

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX file kinds")

_LIMIT = 20.0  # seconds a call may take before it counts as blocked


def _model() -> nn.Module:
    return torchplace.skeleton(lambda: nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).state_dict()


def _outcome(call: Callable[[], object], pipes: tuple[Path, ...] = ()) -> BaseException | None:
    """What ``call`` raised (None if it returned), run on a thread of its own. A call still
    running after ``_LIMIT`` seconds (an open or a read waiting on a pipe for a writer) fails the
    test, once a writer opened and closed on each of ``pipes`` has let it go."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(_LIMIT)
    if thread.is_alive():
        for pipe in pipes:
            with contextlib.suppress(OSError):  # a writer comes and goes: the reader sees EOF
                os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(_LIMIT)
        pytest.fail(f"still running after {_LIMIT} s: it waits on a pipe for a writer")
    return outcome[0]


def _refused(call: Callable[[], object], pipes: tuple[Path, ...] = ()) -> CheckpointError:
    """The ``CheckpointError`` that ``call`` raised (anything else fails the test)."""
    err = _outcome(call, pipes)
    assert isinstance(err, CheckpointError), f"expected a CheckpointError, got {err!r}"
    return err


# ------------------------------------------------------------------- pipes, sockets and devices

KINDS = ["fifo", "socket", "dev-null", "dev-zero"]
# What each kind is called in the error
CALLED = {
    "fifo": "named pipe",
    "socket": "socket",
    "dev-null": "character device",
    "dev-zero": "character device",
}


@pytest.fixture
def special() -> Iterator[Callable[[str, Path], Path]]:
    """Makes a file of a kind (``KINDS``, or ``"dir"``) at a path: a pipe, a bound socket, a
    link to ``/dev/null`` or ``/dev/zero`` (or a directory); the sockets are closed after the
    test."""
    sockets: list[socket.socket] = []
    elsewhere: list[Path] = []  # folders of a short name for sockets, removed after

    def make(kind: str, at: Path) -> Path:
        if kind == "fifo":
            os.mkfifo(at)
        elif kind == "socket":
            if len(os.fsencode(at)) > 100:  # longer than an AF_UNIX address may be
                elsewhere.append(Path(tempfile.mkdtemp(prefix="tp-")))
                bind(elsewhere[-1] / "s")
                at.symlink_to(elsewhere[-1] / "s")
            else:
                bind(at)
        elif kind == "dir":
            at.mkdir()
        else:
            at.symlink_to("/dev/null" if kind == "dev-null" else "/dev/zero")
        return at

    def bind(at: Path) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sockets.append(s)
        s.bind(os.fspath(at))

    yield make
    for s in sockets:
        s.close()
    for folder in elsewhere:
        shutil.rmtree(folder, ignore_errors=True)


def _placed(
    make: Callable[[str, Path], Path], kind: str, place: str, root: Path
) -> tuple[Path, Path]:
    """A source whose one bad file is of ``kind``: the file itself (``file``), a shard of an
    index (``shard``) or the one file of a directory (``inside``). Returns (the source, the bad
    file)."""
    if place == "file":
        bad = make(kind, root / "model.safetensors")
        return bad, bad
    if place == "inside":
        (root / "ckpt").mkdir()
        bad = make(kind, root / "ckpt" / "model.safetensors")
        return root / "ckpt", bad
    state = _state()
    first = {k: v for k, v in state.items() if k.startswith("0.")}
    safetensors_torch.save_file(first, root / "a.safetensors")
    bad = make(kind, root / "b.safetensors")
    weight_map = {k: "a.safetensors" if k.startswith("0.") else "b.safetensors" for k in state}
    index = root / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index, bad


_CALLS: dict[str, Callable[[Path], object]] = {
    "load": torchplace.load,
    "inspect": describe_file,
    "load_into": lambda source: torchplace.load_into(_model(), source),
    "device_map": lambda source: torchplace.load_into(
        _model(), source, device_map={"": "cpu", "1": "disk"}
    ),
}


@pytest.mark.parametrize("call", list(_CALLS))
@pytest.mark.parametrize("place", ["file", "shard", "inside"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_pipe_socket_or_device_is_refused_at_once(
    tmp_path: Path, special: Callable[[str, Path], Path], kind: str, place: str, call: str
) -> None:
    source, bad = _placed(special, kind, place, tmp_path)
    err = _refused(lambda: _CALLS[call](source), (bad,))
    assert err.path == bad
    assert f"not a regular file but a {CALLED[kind]}" in str(err)
    fix = "copy the shard's file itself there" if place == "shard" else "save the checkpoint"
    assert fix in str(err)


@pytest.mark.parametrize("place", ["file", "shard", "inside"])
@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_inspect_on_the_command_line_refuses_a_pipe_or_socket(
    tmp_path: Path,
    special: Callable[[str, Path], Path],
    capsys: pytest.CaptureFixture[str],
    kind: str,
    place: str,
) -> None:
    source, bad = _placed(special, kind, place, tmp_path)
    codes: list[int] = []
    assert _outcome(lambda: codes.append(main(["inspect", str(source)])), (bad,)) is None
    err = capsys.readouterr().err
    assert codes == [1]
    assert err.startswith("torchplace inspect: error: ") and f"a {CALLED[kind]}" in err


@pytest.mark.parametrize("device", ["/dev/null", "/dev/zero"])
@pytest.mark.parametrize("call", list(_CALLS))
def test_a_device_node_named_itself_is_refused(device: str, call: str) -> None:
    err = _refused(lambda: _CALLS[call](Path(device)))
    assert err.path == Path(device)
    assert "not a regular file but a character device" in str(err)


def _on_disk(path: Path) -> nn.Module:
    """A model whose module "1" is left on disk by ``load_into``, read from ``path`` (a torch
    zip file) when it runs."""
    torch.save(_state(), path)
    return torchplace.load_into(_model(), path, device_map={"": "cpu", "1": "disk"})


@pytest.mark.parametrize("kind", KINDS)
def test_a_disk_module_whose_checkpoint_became_a_pipe_is_refused_not_blocked(
    tmp_path: Path, special: Callable[[str, Path], Path], kind: str
) -> None:
    """The disk tier opens its checkpoint on each read: a pipe left in its place would block
    that open for ever."""
    path = tmp_path / "model.pt"
    model = _on_disk(path)
    path.unlink()
    special(kind, path)

    def run() -> None:
        with torch.no_grad():
            model(torch.ones(1, 2))

    err = _refused(run, (path,))
    assert err.path == path
    assert f"not a regular file but a {CALLED[kind]}" in str(err)


# ------------------------------------------------------------------- directories where files are


def test_a_shard_that_is_a_directory_is_named_as_one(
    tmp_path: Path, special: Callable[[str, Path], Path]
) -> None:
    index, bad = _placed(special, "dir", "shard", tmp_path)
    for call in _CALLS.values():
        err = _refused(functools.partial(call, index))
        assert err.path == bad
        assert "is a directory" in str(err) and "missing" not in str(err)
        assert "copy the shard's file itself there" in str(err)


def test_a_checkpoint_name_inside_a_directory_that_is_a_directory_is_named_as_one(
    tmp_path: Path,
) -> None:
    (tmp_path / "model.safetensors").mkdir()
    for call in _CALLS.values():
        err = _refused(functools.partial(call, tmp_path))
        assert err.path == tmp_path / "model.safetensors"
        assert "is a directory" in str(err) and "pass the checkpoint file's own path" in str(err)


def test_a_disk_module_whose_checkpoint_became_a_directory_says_so(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    model = _on_disk(path)
    path.unlink()
    path.mkdir()

    def run() -> None:
        with torch.no_grad():
            model(torch.ones(1, 2))

    err = _refused(run)
    assert err.path == path
    assert "is a directory" in str(err) and "truncated" not in str(err)
    assert "name the checkpoint file itself" in str(err)


# ------------------------------------------------------------------ files this user cannot read

# Run in a subprocess: as root (who reads any file) it gives the right up (os.setuid) once
# everything it needs is imported, then makes each call on a file of mode 000 and prints what
# each raised.
_UNREADABLE = textwrap.dedent(
    """
    import contextlib, io, json, os, sys
    from pathlib import Path

    import rich.console, rich.markup, rich.table, rich.text  # imported while they can be
    import safetensors.torch
    import torch
    from torch import nn

    import torchplace
    import torchplace.checkpoint._disk_weights
    from torchplace.checkpoint._catalog import describe_file
    from torchplace.cli import main

    root = Path(sys.argv[1])
    state = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).state_dict()

    def model():
        return torchplace.skeleton(lambda: nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))

    def cli(source):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["inspect", str(source)])
        raise torchplace.CheckpointError(f"exit {code}: {err.getvalue()}")

    torch.save(state, root / "zip.pt")
    torch.save(state, root / "legacy.pt", _use_new_zipfile_serialization=False)
    safetensors.torch.save_file(state, root / "model.safetensors")
    index = root / "index"
    index.mkdir()
    for name in ("a", "b"):
        part = {k: v for k, v in state.items() if k.startswith("0." if name == "a" else "1.")}
        safetensors.torch.save_file(part, index / f"{name}.safetensors")
    weight_map = {k: "a.safetensors" if k.startswith("0.") else "b.safetensors" for k in state}
    (index / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    on_disk = torchplace.load_into(model(), root / "zip.pt", device_map={"": "cpu", "1": "disk"})
    for p in root.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    sources = {  # the source given, and the file of it this user cannot read
        "zip": (root / "zip.pt", root / "zip.pt"),
        "legacy": (root / "legacy.pt", root / "legacy.pt"),
        "safetensors": (root / "model.safetensors", root / "model.safetensors"),
        "shard": (index / "model.safetensors.index.json", index / "b.safetensors"),
    }
    for _, bad in sources.values():
        os.chmod(bad, 0)
    if os.geteuid() == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
        except OSError as exc:
            print(json.dumps({"skip": f"cannot give up root here ({exc})"}))
            sys.exit(0)
    calls = {
        "load": torchplace.load,
        "load-mmap": lambda source: torchplace.load(source, mmap=True),
        "inspect": describe_file,
        "cli": cli,
        "load_into": lambda source: torchplace.load_into(model(), source),
        "device_map": lambda source: torchplace.load_into(
            model(), source, device_map={"": "cpu", "1": "disk"}
        ),
    }
    results = {}

    def record(name, bad, call):
        try:
            call()
            results[name] = {"bad": str(bad), "raised": None}
        except Exception as exc:
            path = getattr(exc, "path", None)
            results[name] = {
                "bad": str(bad),
                "raised": type(exc).__name__,
                "path": None if path is None else str(path),
                "message": str(exc),
            }

    for source_name, (source, bad) in sources.items():
        for call_name, call in calls.items():
            record(f"{source_name}-{call_name}", bad, lambda: call(source))

    def run_on_disk():  # its file, readable when the model was loaded, is not now
        with torch.no_grad():
            on_disk(torch.ones(1, 2))

    record("disk-module", root / "zip.pt", run_on_disk)
    print(json.dumps(results))
    """
)

_UNREADABLE_CASES = [
    f"{source}-{call}"
    for source in ("zip", "legacy", "safetensors", "shard")
    for call in ("load", "load-mmap", "inspect", "cli", "load_into", "device_map")
] + ["disk-module"]


@pytest.fixture(scope="module")
def unreadable() -> Iterator[dict[str, dict[str, Any]]]:
    """What each call raised on a file of mode 000, by case (``_UNREADABLE_CASES``), made as a
    user who may not read it: one subprocess for all of them."""
    root = Path(tempfile.mkdtemp(prefix="torchplace-perm-"))
    os.chmod(root, 0o777)  # the user it becomes must reach the files
    try:
        done = subprocess.run(
            [sys.executable, "-c", _UNREADABLE, str(root)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=root,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        results = json.loads(done.stdout.strip().splitlines()[-1])
        if "skip" in results:
            pytest.skip(results["skip"])
        yield results
    finally:
        for p in root.rglob("*"):
            with contextlib.suppress(OSError):
                os.chmod(p, stat.S_IRWXU)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", _UNREADABLE_CASES)
def test_a_file_this_user_cannot_read_is_said_to_be_so(
    unreadable: dict[str, dict[str, Any]], case: str
) -> None:
    found = unreadable[case]
    assert found["raised"] == "CheckpointError", found
    message = found["message"]
    assert "permission denied" in message and "truncated" not in message, message
    assert "chmod a+r" in message, message  # the fix
    if not case.endswith("-cli"):
        assert found["path"] == found["bad"]


# ------------------------------------------------------------------------- pickles past the bound


@pytest.fixture
def small_bound(monkeypatch: pytest.MonkeyPatch) -> int:
    """A bound of 10,000 objects, so that a pickle past it is quick to make and to refuse."""
    monkeypatch.delenv("TORCHPLACE_MAX_PICKLE_OBJECTS", raising=False)
    monkeypatch.setattr(_pickle_reader, "MAX_PICKLE_OBJECTS", 10_000)
    return 10_000


@pytest.fixture
def torch_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The readers of torch that built a file's objects during the test: its weights-only
    unpickler and ``torch.load``, recorded, then run as they are."""
    from torch import _weights_only_unpickler

    called: list[str] = []
    unpickle = _weights_only_unpickler.Unpickler.load
    torch_load = torch.load

    def recorded_unpickle(self: Any) -> Any:
        called.append("unpickler")
        return unpickle(self)

    def recorded_load(*args: Any, **kwargs: Any) -> Any:
        called.append("torch.load")
        return torch_load(*args, **kwargs)

    monkeypatch.setattr(_weights_only_unpickler.Unpickler, "load", recorded_unpickle)
    monkeypatch.setattr(torch, "load", recorded_load)
    return called


_IDS = 200_000  # integers in the files below: 20 times the bound


class _W(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))


_READS: dict[str, Callable[[Path], object]] = {
    "read": torchplace.load,
    "mmap": lambda path: torchplace.load(path, mmap=True),
    "meta": lambda path: torchplace.load(path, "meta"),
    "load_into": lambda path: torchplace.load_into(torchplace.skeleton(_W), path, strict=False),
}


@pytest.mark.parametrize("read", list(_READS))
@pytest.mark.parametrize("kind", ["zip", "legacy"])
def test_load_refuses_a_pickle_past_the_bound_before_building_it(
    tmp_path: Path, small_bound: int, torch_reads: list[str], kind: str, read: str
) -> None:
    """``torch.save({"w": ..., "ids": list(range(20_000_000))})`` took ``load`` minutes and
    gigabytes; now reading stops at the bound, and torch's own reader never starts."""
    path = tmp_path / "ids.pt"
    torch.save(
        {"w": torch.zeros(2), "ids": list(range(_IDS))},
        path,
        _use_new_zipfile_serialization=kind == "zip",
    )
    err = _refused(functools.partial(_READS[read], path))
    assert err.path == path
    message = str(err)
    assert "more than 10,000 objects" in message  # the bound
    stopped = re.search(r"reading stopped at ([\d,]+)", message)
    assert stopped is not None, message
    assert int(stopped.group(1).replace(",", "")) <= small_bound + 1_000  # a batch past it
    assert "trusted=True" in message and "TORCHPLACE_MAX_PICKLE_OBJECTS" in message  # the fixes
    assert torch_reads == []


@pytest.mark.parametrize("kind", ["zip", "legacy"])
def test_a_pickle_past_the_bound_loads_when_trusted_or_bound_raised(
    tmp_path: Path, small_bound: int, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    path = tmp_path / "ids.pt"
    torch.save({"ids": list(range(20_000))}, path, _use_new_zipfile_serialization=kind == "zip")
    assert len(torchplace.load(path, trusted=True)["ids"]) == 20_000
    monkeypatch.setenv("TORCHPLACE_MAX_PICKLE_OBJECTS", "30000")
    assert len(torchplace.load(path)["ids"]) == 20_000


def test_a_state_dict_below_the_bound_is_read_once(
    tmp_path: Path, small_bound: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pickle of no more bytes than the bound cannot place more objects than it (each takes
    a byte at least): it is not read a second time to count them."""
    counted: list[int] = []
    init = _pickle_reader.InertUnpickler.__init__

    def recorded(self: Any, f: Any) -> None:
        counted.append(1)
        init(self, f)

    path = tmp_path / "small.pt"
    torch.save({"w": torch.ones(2)}, path)
    monkeypatch.setattr(_pickle_reader.InertUnpickler, "__init__", recorded)
    assert torch.equal(torchplace.load(path)["w"], torch.ones(2))
    assert counted == []


def test_a_plain_pickle_is_refused_without_being_unpickled(tmp_path: Path) -> None:
    """A plain pickle (not torch.save's) is refused from its first bytes: unpickling its first
    object whole to compare it with torch's magic number built all of it first."""
    path = tmp_path / "ids.pkl"
    with path.open("wb") as f:
        pickle.dump({"w": [0.0, 0.0], "ids": list(range(2_000_000))}, f, protocol=2)
    tracemalloc.start()
    try:
        err = _refused(lambda: torchplace.load(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.path == path
    assert "plain pickle" in str(err)
    assert peak < 16 << 20  # its 2 million integers alone take 70 MB
