"""The package's layout and import graph: each step of a tensor's journey in its own subpackage,
imports running one way, no circle, no private cross-imports.

The layout (``src/torchplace``)::

    cli/                 the torchplace command: doctor, bench, argument parsing
    spreading/           one model over several devices (filled by a map from a checkpoint)
    looking/ checkpoint/ where tensors are; checkpoints
    moving/              moves, the copy engine, parameter identity, optimizer-state rules
    (package root)       the base: devices, errors, the batch and model walks, sizes

Rules, read from the source of every module with ``ast`` (top-level and function-level
``from .x import ...`` / ``from torchplace.x import ...`` lines alike):

1. A module imports only from its own subpackage, from a subpackage on a lower layer, and from
   the base; the base imports only the base. ``torchplace.distributed`` (public, at the root)
   and the package ``__init__`` (the lazy front door) sit on top.
2. The graph "module A imports module B" has no cycle (imports under ``if TYPE_CHECKING:``
   never run and are left out of it).
3. A module imports from another torchplace module only names without a leading underscore:
   what a module shares, it shares under a public name. Dunder names (``__version__``) are
   fine. Tests may import private names; the package may not.
"""

from __future__ import annotations

import ast
import importlib
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "torchplace"

# The layer of each subpackage ("" is the base at the package root); a module may import from
# its own subpackage and from any subpackage on a lower layer.
LAYERS = {"": 0, "moving": 1, "looking": 2, "checkpoint": 2, "spreading": 3, "cli": 4}
TOP = {"__init__", "__main__", "distributed"}  # root modules above every layer


def _modules() -> list[str]:
    """Every module as a dotted name under torchplace (``moving._move``, ``_errors``)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found.append(".".join(parts))
    return found


def _package(name: str) -> str:
    """The subpackage a module belongs to ("" for the root); a subpackage's ``__init__`` is in
    its own subpackage."""
    return name.rsplit(".", 1)[0] if "." in name else ""


def _layer(name: str) -> int:
    if name in TOP:
        return len(LAYERS)
    return LAYERS[_package(name)]


def _resolve(importer: str, level: int, module: str | None) -> str:
    """The dotted torchplace name a relative import refers to."""
    base = importer.split(".")[:-1]  # the importer's own package (``__init__`` included)
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *(module.split(".") if module else [])])


def _typing_only(tree: ast.AST) -> set[int]:
    """Ids of the import nodes under ``if TYPE_CHECKING:`` (never run, so no circle)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return found


def _is_module(dotted: str) -> bool:
    path = PACKAGE.joinpath(*dotted.split(".")) if dotted else PACKAGE
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _as_module(dotted: str) -> str:
    """A dotted name as a module of _modules(): a package is its ``__init__``."""
    path = PACKAGE.joinpath(*dotted.split(".")) if dotted else PACKAGE
    if (path / "__init__.py").exists():
        return f"{dotted}.__init__" if dotted else "__init__"
    return dotted


def _imports(name: str, *, typing: bool = True) -> list[tuple[str, str]]:
    """(imported torchplace module, imported name) for every import in module ``name``; with
    ``typing=False``, leaving out those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(PACKAGE.joinpath(*name.split(".")).with_suffix(".py").read_text("utf-8"))
    skip = set() if typing else _typing_only(tree)
    found: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                target = _resolve(name, node.level, node.module)
            elif node.module and (node.module + ".").startswith("torchplace."):
                target = node.module.removeprefix("torchplace").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                if _is_module(sub):  # from . import x: x is a module
                    found.append((_as_module(sub), "*"))
                else:
                    found.append((_as_module(target), alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torchplace."):
                    found.append((_as_module(alias.name.removeprefix("torchplace.")), "*"))
    return found


def test_the_walk_sees_function_level_imports() -> None:
    # imported inside a function
    assert ("looking._inspect", "stragglers") in _imports("cli._doctor")


def test_every_subpackage_says_what_it_does_and_may_import() -> None:
    for sub in LAYERS:
        if sub:
            doc = importlib.import_module(f"torchplace.{sub}").__doc__ or ""
            assert "May import" in doc, f"torchplace/{sub}/__init__.py: say what it may import"


@pytest.mark.parametrize("name", [m for m in _modules() if m != "__main__"])
def test_every_module_imports(name: str) -> None:
    dotted = name.removesuffix("__init__").rstrip(".")
    assert importlib.import_module(f"torchplace.{dotted}" if dotted else "torchplace")


# Imports between siblings of one layer that the layout allows, each with its reason (none now:
# spreading, which plans with estimate, sits a layer above looking and checkpoint).
SIBLING_IMPORTS: dict[tuple[str, str], str] = {}


def test_imports_run_down_the_layers() -> None:
    bad = []
    for name in _modules():
        if name in TOP:
            continue
        for module, _ in _imports(name, typing=False):
            if module in TOP:
                if module == "__init__" and _ != "*":  # __version__ only
                    continue
                bad.append(f"{name} imports {module}")
            elif (name, module) in SIBLING_IMPORTS:
                continue
            elif _package(module) != _package(name) and _layer(module) >= _layer(name):
                bad.append(f"{name} imports {module}")
    assert bad == []


def test_no_import_cycle_among_torchplace_modules() -> None:
    graph = {
        name: sorted(
            {module for module, _ in _imports(name, typing=False) if module != "__init__"} - {name}
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


@pytest.mark.slow
def test_no_private_names_imported_across_modules() -> None:
    bad = [
        f"{name} imports {imported} from {module}"
        for name in _modules()
        for module, imported in _imports(name)
        if imported.startswith("_") and not (imported.startswith("__") and imported.endswith("__"))
    ]
    assert bad == []


def test_the_layering_test_can_fail() -> None:
    """A base module importing from moving would be caught (the rule is not vacuous)."""
    assert _layer("moving._move") > _layer("_tree")
    assert _package("looking._inspect") != _package("checkpoint._fill")
    assert _layer("looking._inspect") == _layer("checkpoint._fill")  # siblings may not mix
    for name, module in SIBLING_IMPORTS:  # each exemption names an import that is there
        assert module in {found for found, _ in _imports(name, typing=False)}, (name, module)


# Issue 26, item 3: a checkpoint source is opened and parsed in one place. The catalog (with the
# parsers it calls for each format, and ``_source``, which tells a format by its first bytes)
# says what a source holds and where; the reader reads the byte ranges it found, unpickles a zip
# file's pickle by that layout, or hands a whole file to torch's or safetensors' own reader.
# Every other module asks them.
OPENS_SOURCES = {
    "checkpoint._source",
    "checkpoint._catalog",
    "checkpoint._zip_layout",  # the catalog's quick look at a file (split out of it)
    "checkpoint._safetensors",
    "checkpoint._pickle_reader",
    "checkpoint._index",
    "checkpoint._reader",
    "checkpoint._host_read",  # the reader's preadv into host memory (split out of _reader)
    "checkpoint._zip_read",  # the reader's zip file, unpickled by torch (split out of _reader)
    "checkpoint._whole_files",  # what torch.load or safetensors reads whole (out of _reader)
    "checkpoint._opened",  # a call's open files, which the modules above read through
}
# What opens or reads a file elsewhere, by module, function and call, and why it is no source.
NOT_A_SOURCE = {
    ("checkpoint._checkpoint_cli", "_PendingOutputs.open", "os.open"): "remap's output, created",
    ("checkpoint._checkpoint_cli", "_write_remapped", "os.fdopen"): "remap's output, written",
    ("checkpoint._checkpoint_cli", "_write_jobs", "pending.open"): "remap's output, created",
    ("checkpoint._checkpoint_cli", "", "import pickle"): "remap writes with a pickler of its own",
    ("checkpoint._load", "", "import pickle"): "pickle.UnpicklingError: torch.load's refusals",
    ("checkpoint._atomic", "created", "open"): "save's output, written",
    ("checkpoint._atomic", "flushed", "open"): "save's output, flushed to disk",
    ("checkpoint._atomic", "_fsync_dir", "os.open"): "a directory, flushed after a rename",
    ("checkpoint._atomic", "_temporary", "os.open"): "save's temporary, created",
    ("checkpoint._writers", "", "import pickle"): "save writes with a pickler of its own",
    ("checkpoint._load", "", "import safetensors.torch"): "whether the package is installed",
    ("_devices", "host_available", "open"): "/proc/meminfo",
    ("cli._doctor", "_nvidia_driver", "open"): "the driver's version in /proc",
    ("cli._main", "_silence_stdout", "os.open"): "/dev/null",
    ("cli._config_checks", "checked_config", "config_file.read_text"): "a config.json",
}
# Calls that open or read a file, or parse one, whatever the receiver (``Path.read_bytes``,
# ``torch.load``, ``pickle.load``, ``safetensors.torch.load_file``, ``numpy.fromfile``); the
# builtin ``open``; imports of what parses a file.
_READING_ATTRIBUTES = {
    "open", "fdopen", "read_bytes", "read_text", "ZipFile", "safe_open", "mmap", "load",
    "load_file", "from_file", "fromfile", "pread", "preadv", "Unpickler",
}  # fmt: skip
_READING_MODULES = {"zipfile", "pickle", "mmap", "safetensors", "numpy"}


def _file_readers(source: str) -> list[tuple[str, str]]:
    """(function, call) for each call in ``source`` that opens, reads or parses a file, and
    (``""``, ``import x``) for each import of a module that parses one, or of torch's loader."""
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{where}.{child.name}" if where else child.name
            if isinstance(child, ast.Call):
                func = child.func
                if isinstance(func, ast.Name) and func.id == "open":
                    found.append((where, "open"))
                elif isinstance(func, ast.Attribute) and func.attr in _READING_ATTRIBUTES:
                    found.append((where, ast.unparse(func)))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] in _READING_MODULES:
                        found.append(("", f"import {alias.name}"))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                head = child.module.split(".")[0]
                torch_loader = child.module in ("torch", "torch.serialization") and any(
                    a.name in ("load", "_load") for a in child.names
                )
                if head in _READING_MODULES or torch_loader:
                    found.append(("", f"from {child.module} import ..."))
            visit(child, inner)

    visit(ast.parse(source), "")
    return found


def _module_source(name: str) -> str:
    return PACKAGE.joinpath(*name.split(".")).with_suffix(".py").read_text(encoding="utf-8")


def test_only_the_catalog_and_the_reader_open_a_checkpoint() -> None:
    outside = [
        f"{name}: {where or '<module>'} calls {call}"
        for name in _modules()
        if name not in OPENS_SOURCES
        for where, call in _file_readers(_module_source(name))
        if (name, where, call) not in NOT_A_SOURCE
    ]
    assert outside == []


def test_the_source_rule_can_fail() -> None:
    """Each way of reading a file is caught where it does not belong, and every exemption
    still names a call that is there (the rule is not vacuous, nor out of date)."""
    hidden = textwrap.dedent(
        """
        import pickle, zipfile
        import numpy as np
        import safetensors.torch
        from torch import load as tload
        from torch.serialization import load

        def sneaky(p):
            open(p).read()
            p.read_bytes()
            torch.load(p)
            tload(p)
            torch.serialization.load(p)
            pickle.load(p)
            safetensors.torch.load_file(p)
            safetensors.safe_open(p, "pt")
            np.fromfile(p)
            torch.UntypedStorage.from_file(p)
            zipfile.ZipFile(p)
            os.pread(3, 1, 0)
        """
    )
    calls = {call for _, call in _file_readers(hidden)}
    assert {
        "import pickle", "import zipfile", "import numpy", "import safetensors.torch",
        "from torch import ...", "from torch.serialization import ...", "open", "p.read_bytes",
        "torch.load", "torch.serialization.load", "pickle.load", "safetensors.torch.load_file",
        "safetensors.safe_open", "np.fromfile", "torch.UntypedStorage.from_file",
        "zipfile.ZipFile", "os.pread",
    } <= calls  # fmt: skip
    for name, where, call in NOT_A_SOURCE:
        assert (where, call) in _file_readers(_module_source(name)), (name, where, call)


def _design_table() -> dict[str, set[str]]:
    """The module map of ``docs/design.md``: the files each folder's rows name ("" the root)."""
    text = (PACKAGE.parents[1] / "docs" / "design.md").read_text()
    table = text[text.index("## Module map") :]
    table = table[: table.index("\n\n", table.index("| --- |"))]
    named: dict[str, set[str]] = {}
    folder = ""
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("layer", "---"):
            continue
        if cells[0]:
            folder = cells[0].strip("`").rstrip("/") if cells[0].startswith("`") else ""
        files = [f.strip().strip("`") for f in cells[1].split(",")]
        named.setdefault(folder, set()).update(files)
    return named


def test_the_design_docs_module_map_names_every_module_and_no_other() -> None:
    """``docs/design.md`` had fallen behind the code: 12 modules were missing from its table.
    Every module is in its folder's rows (a subpackage's ``__init__.py`` aside), and every
    file the table names exists."""
    named = _design_table()
    present: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        folder = path.parent.relative_to(PACKAGE).as_posix()
        folder = "" if folder == "." else folder
        if folder and path.name == "__init__.py":
            continue
        present.setdefault(folder, set()).add(path.name)
    missing = {f"{k}/{n}" for k, names in present.items() for n in names - named.get(k, set())}
    gone = {f"{k}/{n}" for k, names in named.items() for n in names - present.get(k, set())}
    assert not missing, f"modules missing from docs/design.md's module map: {sorted(missing)}"
    assert not gone, f"docs/design.md names modules that do not exist: {sorted(gone)}"


def test_at_most_twelve_modules_at_the_package_root() -> None:
    """The root held 14 modules; what belongs to one step lives in its subpackage."""
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 12, root
