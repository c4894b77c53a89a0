"""Runs the documentation: every ``python`` code block of README.md and docs/*.md is a test.

Collected by Sybil (in the ``dev`` extra), as part of the plain ``python -m pytest``. Each block
runs on its own, in a fresh namespace and a fresh temporary working directory, so it must hold
its own imports and may write files by plain names. A block that opens with ``>>>`` is a
doctest (its output checked, ``...`` matching anything). Blocks that are not meant to run are
tagged with another language (``sh``, ``text``); a rare exception carries
``<!-- skip: next "why" -->`` on the line before it.

It also keeps, on a torch older than 2.8, every Gloo process group that the tests, doctests and
documentation destroy in this process (``keep_destroyed_gloo_groups`` says why).
"""

from __future__ import annotations

import atexit
import ctypes
import doctest
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest

try:
    from sybil import Document, Example, Region, Sybil
    from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
except ImportError:  # sybil comes with the dev extra; without it each page is one skipped test
    Sybil = None  # type: ignore[assignment,misc]


_ROOT: list[str] = []  # one temporary directory for the session, removed at exit


def keep_destroyed_gloo_groups() -> None:
    """On torch < 2.8, ``destroy_process_group`` in this process leaves Gloo groups undestroyed.

    Before torch 2.8 (pytorch/pytorch#154976) a ``ProcessGroup`` is freed with the GIL held:
    when its last Python reference goes, ``~ProcessGroupGloo`` joins Gloo's worker threads
    under the GIL. A worker that has just finished a collective drops the tensors it held, and
    one whose Python object was already dropped (the temporary tensors of
    ``all_gather_object``, which ``torchplace.distributed.verify`` uses, or of
    ``all_reduce(torch.ones(3))``) must take the GIL to free it: the two wait for each other
    forever. On torch 2.6 a group of one destroyed right after ``verify`` hangs so within a
    hundred tries, and the whole suite (its doctests and documentation blocks do just that)
    hung about one run in three.

    Here ``destroy_process_group`` still unregisters the group (``is_initialized()`` is False
    after it, and a new group can start), but the group objects it drops are kept in a list
    that is never freed, not even when the interpreter exits, so no Gloo group's destructor
    ever runs in the test process. The few groups made here (groups of one, with two idle
    threads each) live until the process ends; at exit, their workers are given a moment to
    finish freeing tensors first. Scripts run by torchrun are other processes.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or torch.torch_version.TorchVersion(torch.__version__) >= (2, 8):
        return  # torch 2.8 and later release the GIL before a process group's destructor
    from torch.distributed import distributed_c10d

    destroy = distributed_c10d.destroy_process_group
    if hasattr(destroy, "kept"):
        return  # already in place
    kept: list[object] = []
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))  # a reference nobody ever drops

    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is distributed_c10d.GroupMember.WORLD:
            groups = list(distributed_c10d._world.pg_map)  # the default group drops them all
        else:
            groups = [group] if group in distributed_c10d._world.pg_map else []
        kept.extend(g for g in groups if "gloo" in str(dist.get_backend(g)))
        destroy(group)

    def let_gloo_workers_finish() -> None:
        # A Gloo worker may still be freeing the tensors of the last collective, and so want the
        # GIL; one that asks for it while the interpreter shuts down aborts the process
        # ("terminate called without an active exception"). The GIL is free while this sleeps.
        if kept:
            time.sleep(0.2)

    atexit.register(let_gloo_workers_finish)
    destroy_process_group.kept = kept  # type: ignore[attr-defined]
    distributed_c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def pytest_configure(config: pytest.Config) -> None:
    keep_destroyed_gloo_groups()


def pytest_ignore_collect(collection_path: Any, config: pytest.Config) -> bool | None:
    """A module of the package (under this repository's ``src/``) with no doctest in it is not
    collected: ``--doctest-modules`` would import it only to find nothing, and some import what
    takes seconds (``_dynamo_compat`` imports ``torch._dynamo``: 1.9 s of every collection).
    The tests import what they test (``test_module_graph`` imports every module). A package's
    ``__init__.py`` is always collected: ``torchplace/__init__.py`` is where the public names'
    examples are found (their ``__module__`` is ``torchplace``)."""
    src = config.rootpath / "src"
    if collection_path.suffix != ".py" or collection_path.name == "__init__.py":
        return None
    if not collection_path.is_relative_to(src):
        return None
    try:
        source = collection_path.read_text(encoding="utf-8")
    except OSError:
        return None
    return True if ">>>" not in source else None


def _fresh_directory() -> str:
    if not _ROOT:
        _ROOT.append(tempfile.mkdtemp(prefix="torchplace-docs-"))
        atexit.register(shutil.rmtree, _ROOT[0], ignore_errors=True)
    return tempfile.mkdtemp(dir=_ROOT[0])


def _alone(evaluate: Callable[[Any], Any], block: dict[str, str], first: bool) -> Any:
    """``evaluate`` run in the block's own working directory; the example that opens a block
    clears what earlier blocks left in the namespace (the ``>>>`` lines of one block share it)."""

    def run(example: Example) -> Any:
        if first:
            example.namespace.clear()
            example.namespace["__name__"] = "__main__"
            block["cwd"] = _fresh_directory()
        here = os.getcwd()
        os.chdir(block["cwd"])
        try:
            return evaluate(example)
        finally:
            os.chdir(here)

    return run


if Sybil is not None:

    class _BlockParser(PythonCodeBlockParser):
        """Python blocks, each in a namespace of its own."""

        def __call__(self, document: Document) -> Iterable[Region]:
            for block in self.codeblock_parser(document):
                source = block.parsed
                shared: dict[str, str] = {}
                if not source.startswith(">>>"):
                    block.evaluator = _alone(block.evaluator, shared, first=True)
                    yield block
                    continue
                for index, region in enumerate(self.doctest_parser(source, document.path)):
                    region.adjust(block, source)
                    region.evaluator = _alone(region.evaluator, shared, first=index == 0)
                    yield region

    pytest_collect_file = Sybil(
        parsers=[
            _BlockParser(doctest_optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE),
            SkipParser(),
        ],
        patterns=["README.md", "docs/*.md"],
        name="docs",
    ).pytest()


# Pages whose blocks do not run yet, while they are rewritten; each is an expected failure, and
# strict: once a block of such a page passes, the run fails until the page is removed from here.
_NOT_YET_RUNNABLE: dict[str, str] = {}


def _needs_newer_torch(source: str) -> str | None:
    """Why a block cannot run with the installed torch or transformers, found by what they
    offer, or None. (tests/helpers.py asks the same of the tests.)"""
    import torch

    if "fully_shard(" in source and not hasattr(torch.cpu.Stream, "record_event"):
        return (
            "FSDP2 trains on the CPU from torch 2.7 (torch.cpu.Stream.record_event); "
            f"this is torch {torch.__version__}"
        )
    if "# transformers 5" in source:  # a block about what transformers 5 writes (hub names)
        import importlib.util

        if importlib.util.find_spec("transformers.conversion_mapping") is None:
            return "transformers 4.x writes no hub names: this block shows transformers 5's"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for item in items:
        page = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        if page in _NOT_YET_RUNNABLE:
            item.add_marker(pytest.mark.xfail(reason=_NOT_YET_RUNNABLE[page], strict=True))
        source = getattr(getattr(item, "example", None), "parsed", None)
        why = _needs_newer_torch(source) if isinstance(source, str) else None
        if why:
            item.add_marker(pytest.mark.skip(reason=why))


if Sybil is None:

    class _Unrunnable(pytest.Item):
        def runtest(self) -> None:
            pytest.skip("running the documentation needs sybil: pip install -e '.[dev]'")

    class _Page(pytest.File):
        def collect(self) -> Iterable[pytest.Item]:
            yield _Unrunnable.from_parent(self, name="code blocks")

    def pytest_collect_file(file_path: Any, parent: pytest.Collector) -> pytest.File | None:
        if not file_path.is_relative_to(parent.config.rootpath):
            return None
        relative = file_path.relative_to(parent.config.rootpath).as_posix()
        if relative == "README.md" or (relative.startswith("docs/") and relative.endswith(".md")):
            return _Page.from_parent(parent, path=file_path)
        return None
