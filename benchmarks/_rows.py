"""Figures against targets, shared by the GPU benchmarks and ``gpu_check.sh``.

A benchmark run with ``--rows FILE`` appends one JSON line per figure to ``FILE``;
``python benchmarks/_rows.py FILE`` prints them as one Markdown table, ready for ``RESULTS.md``.
Not a benchmark itself (no ``bench_`` prefix).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_row(
    path: str | None, what: str, figure: float, target: str, met: bool | None, unit: str = "x"
) -> None:
    """Append one figure to ``path`` (nothing when ``path`` is None). ``met`` None: no target."""
    if path is None:
        return
    row = {"what": what, "figure": figure, "unit": unit, "target": target, "met": met}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def table(path: str | Path) -> str:
    """The rows of ``path`` as a Markdown table (figure, target, verdict)."""
    lines = [
        "| what | figure | target | verdict |",
        "| --- | --- | --- | --- |",
    ]
    text = Path(path).read_text(encoding="utf-8") if Path(path).exists() else ""
    for line in text.splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        unit = row["unit"]
        figure = f"{row['figure']:.2f}{unit}" if unit == "x" else f"{row['figure']:.2f} {unit}"
        verdict = {True: "met", False: "MISSED", None: "-"}[row["met"]]
        lines.append(f"| {row['what']} | {figure} | {row['target']} | {verdict} |")
    if len(lines) == 2:
        lines.append("| (no figures: every benchmark failed or was skipped) | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1]))
