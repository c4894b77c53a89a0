"""Function sizes: how many functions of a folder run past 60 and 80 lines, and which.

Run as ``python tools/function_sizes.py [FOLDER] [--over N]`` (default: ``src/torchplace``,
listing those over 60 lines). A function's size is its lines from ``def`` to its last line,
docstring and comments included, as a reader sees it.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def sizes(folder: Path) -> list[tuple[int, str]]:
    """Every function and method under ``folder``: (lines, "file:line name"), largest first."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((lines, f"{path}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default="src/torchplace", type=Path)
    parser.add_argument("--over", type=int, default=60, help="list functions longer than this")
    args = parser.parse_args()
    found = sizes(args.folder)
    for lines, where in found:
        if lines > args.over:
            print(f"{lines:5d}  {where}")
    over_60 = sum(1 for n, _ in found if n > 60)
    over_80 = sum(1 for n, _ in found if n > 80)
    print(f"{len(found)} functions; {over_60} over 60 lines, {over_80} over 80")


if __name__ == "__main__":
    main()
