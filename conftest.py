"""Runs the documentation: every ``python`` code block of README.md and docs/*.md is a test.

Collected by Sybil (in the ``dev`` extra), as part of the plain ``python -m pytest``. Each block
runs on its own, in a fresh namespace and a fresh temporary working directory, so it must hold
its own imports and may write files by plain names. A block that opens with ``>>>`` is a
doctest (its output checked, ``...`` matching anything). Blocks that are not meant to run are
tagged with another language (``sh``, ``text``); a rare exception carries
``<!-- skip: next "why" -->`` on the line before it.
"""

from __future__ import annotations

import atexit
import doctest
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

import pytest

try:
    from sybil import Document, Example, Region, Sybil
    from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
except ImportError:  # sybil comes with the dev extra; without it each page is one skipped test
    Sybil = None  # type: ignore[assignment,misc]


_ROOT: list[str] = []  # one temporary directory for the session, removed at exit


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
    """Why a block cannot run with the installed torch, found by what torch offers, or None.
    (tests/helpers.py asks the same of the tests.)"""
    import torch

    if "fully_shard(" in source and not hasattr(torch.cpu.Stream, "record_event"):
        return (
            "FSDP2 trains on the CPU from torch 2.7 (torch.cpu.Stream.record_event); "
            f"this is torch {torch.__version__}"
        )
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
