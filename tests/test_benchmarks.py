"""No benchmark can rot: each ``benchmarks/bench_*.py`` imports and runs, in a fresh process.

Every script answers ``--help`` (it imports and builds its parser), and the GPU ones run their
whole ``main`` with CUDA hidden, which must end in the "skipped, no CUDA" message and exit 0;
``bench_copies --host`` runs its host-side timings for real on a few tensors. A script added
later is picked up by the glob. ``gpu_check.sh`` is checked by a dry run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = sorted((ROOT / "benchmarks").glob("bench_*.py"))

# Scripts whose targets need a GPU: with CUDA hidden, main() says so and exits 0.
GPU_ONLY = {"bench_copies.py", "bench_load_gpu.py", "bench_loader.py", "bench_move.py"}
# Quick CPU-only runs of the real thing, beside --help.
CPU_RUNS = {
    "bench_copies.py": ["--host", "--count", "40", "--repeat", "2"],
    "bench_offload.py": ["--layers", "3", "--width", "64", "--rounds", "2"],
    "bench_watch.py": ["--rounds", "3"],
}


def run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT / "src"))
    return subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_every_benchmark_is_found() -> None:
    names = {path.name for path in BENCHMARKS}
    assert names >= GPU_ONLY | set(CPU_RUNS)
    assert len(names) >= 9


@pytest.mark.slow
@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_imports_and_answers_help(path: Path) -> None:
    done = run([sys.executable, str(path), "--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GPU_ONLY))
def test_gpu_benchmark_runs_its_main_and_skips_without_cuda(name: str) -> None:
    done = run([sys.executable, str(ROOT / "benchmarks" / name)])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "skipped, no CUDA device" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CPU_RUNS))
def test_cpu_mode_runs(name: str) -> None:
    done = run([sys.executable, str(ROOT / "benchmarks" / name), *CPU_RUNS[name]])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ms" in done.stdout


@pytest.mark.slow
def test_rows_make_one_table(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    lines = [
        {"what": "a", "figure": 4.5, "unit": "x", "target": ">= 4x", "met": True},
        {"what": "b", "figure": 30.25, "unit": "GB/s", "target": "-", "met": None},
        {"what": "c", "figure": 0.4, "unit": "x", "target": ">= 0.85x", "met": False},
    ]
    rows.write_text("".join(json.dumps(r) + "\n" for r in lines))
    done = run([sys.executable, str(ROOT / "benchmarks" / "_rows.py"), str(rows)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "| what | figure | target | verdict |",
        "| --- | --- | --- | --- |",
        "| a | 4.50x | >= 4x | met |",
        "| b | 30.25 GB/s | - | - |",
        "| c | 0.40x | >= 0.85x | MISSED |",
    ]


BASH = shutil.which("bash")


@pytest.mark.slow
@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_gpu_check_parses_and_dry_runs() -> None:
    script = str(ROOT / "benchmarks" / "gpu_check.sh")
    assert run([str(BASH), "-n", script]).returncode == 0  # it parses
    done = run([str(BASH), script, "--dry-run"])
    assert done.returncode == 0, done.stderr
    assert "-m requires_cuda" in done.stdout
    for name in sorted(GPU_ONLY):
        assert name in done.stdout  # every GPU benchmark is run


@pytest.mark.slow
@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_gpu_check_fails_soft_without_cuda() -> None:
    done = run([str(BASH), str(ROOT / "benchmarks" / "gpu_check.sh")])
    assert done.returncode == 0, done.stderr
    assert "no CUDA" in done.stdout
