"""The package's import graph: no circle among torchplace modules, no private cross-imports.

Rules, read from the source of every module under ``src/torchplace`` (top-level and
function-level ``from .x import ...`` / ``from torchplace.x import ...`` lines alike, parsed
with ``ast``):

1. The graph "module A imports module B" has no cycle (imports under ``if TYPE_CHECKING:``
   never run and are left out of it). The package ``__init__`` is left out:
   it is the lazy front door that names every public function, and no module imports from it
   but ``__version__`` (which ``from . import __version__`` reads without a circle at run time).
2. A module imports from another torchplace module only names without a leading underscore:
   what a module shares, it shares under a public name, in the module named for that idea.
   ``import x as _x`` style aliases are fine (the name imported is public); dunder names
   (``__version__``) are fine. Tests may import private names; the package may not.

Modules being reworked on other branches when this was written are listed in ``_PENDING`` (and
one import edge in ``_PENDING_EDGES``) with what is left to do; any other module breaking a
rule fails here, and an entry no longer needed fails too.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "torchplace"

# Modules reworked on other branches while this test was written (the checkpoint split, the
# sharded reader, distributed): their private imports are theirs to turn into public names.
# Each stays listed only while it still imports a private name (the last test checks).
_PENDING: dict[str, str] = {}
# Import edges left out of the cycle check, for the same reason: (importer, imported).
_PENDING_EDGES: dict[tuple[str, str], str] = {}


def _modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py"))


def _typing_only(tree: ast.AST) -> set[int]:
    """Ids of the import nodes under ``if TYPE_CHECKING:`` (never run, so no circle)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return found


def _imports(name: str, *, typing: bool = True) -> list[tuple[str, str]]:
    """(imported torchplace module, imported name) for every from-import in module ``name``;
    with ``typing=False``, leaving out those under ``if TYPE_CHECKING:``."""
    tree = ast.parse((PACKAGE / f"{name}.py").read_text(encoding="utf-8"))
    skip = set() if typing else _typing_only(tree)
    found: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or id(node) in skip:
            continue
        if node.level == 1:
            module = node.module
        elif node.level == 0 and node.module and node.module.startswith("torchplace"):
            module = node.module.removeprefix("torchplace").lstrip(".") or None
        else:
            continue
        for alias in node.names:
            if module is None:  # from . import x: x is a module or a name of __init__
                if (PACKAGE / f"{alias.name}.py").exists():
                    found.append((alias.name, "*"))
                else:
                    found.append(("__init__", alias.name))
            else:
                found.append((module.split(".")[0], alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torchplace."):
                    found.append((alias.name.split(".")[1], "*"))
    return found


def test_the_walk_sees_function_level_imports() -> None:
    assert ("_inspect", "stragglers") in _imports("_doctor")  # imported inside a function


@pytest.mark.parametrize("name", [m for m in _modules() if m != "__main__"])
def test_every_module_imports(name: str) -> None:
    assert importlib.import_module(f"torchplace.{name}" if name != "__init__" else "torchplace")


def test_no_import_cycle_among_torchplace_modules() -> None:
    graph = {
        name: sorted(
            {
                module
                for module, _ in _imports(name, typing=False)
                if module != "__init__" and (name, module) not in _PENDING_EDGES
            }
            - {name}
        )
        for name in _modules()
        if name != "__init__"
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node)


def test_no_private_names_imported_across_modules() -> None:
    bad = [
        f"{name} imports {imported} from {module}"
        for name in _modules()
        for module, imported in _imports(name)
        if imported.startswith("_")
        and not (imported.startswith("__") and imported.endswith("__"))
        and name not in _PENDING
    ]
    assert bad == []


def test_the_pending_exceptions_are_still_needed() -> None:
    for name in _PENDING:
        assert any(i.startswith("_") and not i.startswith("__") for _, i in _imports(name)), (
            f"{name} imports no private name any more: take it off _PENDING"
        )
    for name, module in _PENDING_EDGES:
        assert module in {m for m, _ in _imports(name)}, f"take {name}->{module} off"
