"""Print the longest functions of torchplace, and check them against limits.

Every function and method under the root (src/torchplace by default) is measured from its
``def`` line to its last line: docstring, comments and blank lines included, decorators not.
A nested function counts inside the one around it and again on its own.

    python tools/function_sizes.py                  # those over 60 lines, longest first
    python tools/function_sizes.py --over 40        # those over 40
    python tools/function_sizes.py --max-len 80 --max-over-60 15 --allow _tree.map_tensors

With ``--max-len`` or ``--max-over-60`` the exit status is 1 when a limit is exceeded (each
offender is named), so a test can call it. ``--allow`` takes a function (its dotted name or a
dotted part of it, ``_tree.map_tensors``, ``DeviceLoader.__init__``, which allows the functions
nested in it too) or a file or folder (``src/torchplace/spreading/``); allowed functions are
still listed, marked, but count against no limit. Paths are relative to the repository root.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LONG = 60  # the length --max-over-60 counts functions over


@dataclass(frozen=True)
class Function:
    lines: int
    path: str  # relative to the repository root where it is inside it
    line: int
    name: str  # dotted: torchplace._tree.map_tensors, or Class.method within its module

    def allowed_by(self, pattern: str) -> bool:
        if "/" in pattern or pattern.endswith(".py"):
            folder = pattern.rstrip("/")
            return self.path == folder or self.path.startswith(folder + "/")
        # the function itself, or one it is nested in (or its module, or its class)
        return f".{pattern}." in f".{self.name}."


def _shown(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return path.as_posix()


def _module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _functions(
    tree: ast.AST, prefix: str
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}.{node.name}", node
            yield from _functions(node, f"{prefix}.{node.name}")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}.{node.name}")
        else:
            yield from _functions(node, prefix)


def measure(root: Path) -> list[Function]:
    """Every function under root, longest first."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for name, node in _functions(tree, _module_name(path, root)):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            found.append(Function(lines, _shown(path), node.lineno, name))
    found.sort(key=lambda f: (-f.lines, f.path, f.line))
    return found


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root", type=Path, default=REPO / "src" / "torchplace", help="src/torchplace"
    )
    parser.add_argument("--over", type=int, default=LONG, help="list those longer (60)")
    parser.add_argument("--max-len", type=int, help="fail if a function is longer than this")
    parser.add_argument(
        "--max-over-60", type=int, help=f"fail if more than this many are over {LONG} lines"
    )
    exempt = "a function, file or folder exempt from the limits (repeatable)"
    parser.add_argument("--allow", action="append", default=[], metavar="NAME", help=exempt)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    functions = measure(args.root)
    allowed = {f for f in functions if any(f.allowed_by(p) for p in args.allow)}
    width = max((len(str(f.lines)) for f in functions), default=1)
    for f in functions:
        if f.lines > args.over:
            mark = "  (allowed)" if f in allowed else ""
            print(f"{f.lines:>{width}}  {f.path}:{f.line}  {f.name}{mark}")
    over_60 = [f for f in functions if f.lines > LONG]
    over_80 = [f for f in functions if f.lines > 80]
    print(
        f"{len(functions)} functions; {len(over_60)} over {LONG} lines, {len(over_80)} over 80, "
        f"longest {functions[0].lines if functions else 0}"
    )
    checked = [f for f in functions if f not in allowed]
    failures = []
    if args.max_len is not None:
        failures += [
            f"{f.name} ({f.path}:{f.line}) is {f.lines} lines, over the limit of {args.max_len}"
            for f in checked
            if f.lines > args.max_len
        ]
    counted = [f for f in checked if f.lines > LONG]
    if args.max_over_60 is not None and len(counted) > args.max_over_60:
        failures.append(
            f"{len(counted)} functions not allowed are over {LONG} lines, "
            f"more than the limit of {args.max_over_60}"
        )
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
