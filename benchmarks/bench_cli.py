"""How fast the command line starts, as a ratio to ``python -c "import torch"``, same run.

Run as ``python benchmarks/bench_cli.py [--rounds N]``. Target (docs/design.md):
``torchplace --help``
and ``torchplace inspect FILE.safetensors`` import no torch and take at most 0.25x the time of
``python -c "import torch"``.

Every command runs in a fresh interpreter (``python -m torchplace ...``, so it measures the
package as found on ``sys.path``), and the commands take turns in each round so that drift in
the machine's speed hits all alike. Interference only ever adds time, so each series is summed
up by its 10th percentile. For scale, a bare interpreter (``python -c pass``) and the import of
rich's table and console (what drawing inspect's table costs on top) are timed too. The
safetensors file has the header of a 32-layer transformer (291 tensors with long names) over
tiny tensors, so the header, not the disk, is what is read.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = 0.25


def transformer_file(path: Path, layers: int = 32) -> None:
    """A safetensors file with a transformer's tensor names and 4-element float32 tensors."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(layers):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(f"model.layers.{i}.self_attn.{part}.weight")
        for part in ("gate_proj", "up_proj", "down_proj"):
            names.append(f"model.layers.{i}.mlp.{part}.weight")
        names += [f"model.layers.{i}.input_layernorm.weight"]
        names += [f"model.layers.{i}.post_attention_layernorm.weight"]
    header = {
        name: {"dtype": "F32", "shape": [2, 2], "data_offsets": [16 * k, 16 * (k + 1)]}
        for k, name in enumerate(names)
    }
    raw = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16 * len(names)))


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def low(times: list[float]) -> float:
    """The 10th percentile: interference only adds time, so the fast end is the signal."""
    return sorted(times)[len(times) // 10]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="fresh processes per command")
    rounds = parser.parse_args().rounds
    src = Path(__file__).resolve().parent.parent / "src"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
    }
    env["COLUMNS"] = "200"
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        st = Path(tmp) / "model.safetensors"
        transformer_file(st)
        commands = {
            'python -c "import torch"': [py, "-c", "import torch"],
            "torchplace --help": [py, "-m", "torchplace", "--help"],
            "torchplace inspect FILE.safetensors": [py, "-m", "torchplace", "inspect", str(st)],
            "torchplace inspect FILE.safetensors --json": [
                py,
                "-m",
                "torchplace",
                "inspect",
                str(st),
                "--json",
            ],
            'python -c "import rich.table, rich.console"': [
                py,
                "-c",
                "import rich.table, rich.console",
            ],
            'python -c "pass"': [py, "-c", "pass"],
        }
        for argv in commands.values():  # warm the page cache and .pyc files
            timed(argv, env)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(rounds):
            for name, argv in commands.items():
                times[name].append(timed(argv, env))
    base = low(times['python -c "import torch"'])
    print(f"CLI start-up, {rounds} fresh processes each (10th percentile); target <= {TARGET}x")
    print(f"{'command':<46} {'seconds':>8} {'x import torch':>15}")
    worst = 0.0
    for name, series in times.items():
        ratio = low(series) / base
        if name.startswith("torchplace"):
            worst = max(worst, ratio)
        print(f"{name:<46} {low(series):>8.3f} {ratio:>14.2f}x")
    print(
        f"worst torchplace command: {worst:.2f}x ({'meets' if worst <= TARGET else 'misses'} "
        f"the {TARGET}x target)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
