"""Checkpoint to first forward pass, each way in a fresh process, as ratios to the usual way.

Run as ``python benchmarks/bench_checkpoint.py [--size-mb 512] [--rounds 5] [--format pt]``.

A model of about ``--size-mb`` of float32 weights (a stack of ``Linear`` layers with an embedding)
is saved once. Then, in fresh Python processes, each of these goes from the file to the output
of one forward pass:

* ``plain``: ``Model(); model.load_state_dict(torch.load(f))`` (random init, then a copy);
* ``accelerate``: ``init_empty_weights()`` + ``load_checkpoint_and_dispatch(..., {"": "cpu"})``;
* ``torchplace``: ``load_into(skeleton(Model), f)``;
* ``floor``: the file read into memory the process owns (one ``readinto`` of a fresh buffer),
  what any load from the page cache pays at least;
* ``baseline`` (with ``--baseline SRC``): ``torchplace`` as another checkout's ``src`` folder
  has it, in the same rounds, to compare a change before and after on one machine.

Each child process reads ``VmRSS`` after the bare ``import torch``, times the import of its
library, then starts the clock, and reports the time to the forward's output and ``VmHWM`` (peak
resident memory) above the bare-import figure; the import's time is reported beside it and added
for the figure "imports included". Children run with bytecode caching on (in a temporary
``PYTHONPYCACHEPREFIX``), as an installed package has it, whatever ``PYTHONDONTWRITEBYTECODE``
says: compiling the sources on every start is not what a user pays. The file is read once beforehand
so every way finds it in the page cache, and the ways take turns round by round; each is
reported by its fastest round.

Targets (docs/design.md): torchplace at most 0.2x the time of ``plain`` and 0.5x that of
``accelerate``, with peak memory above the bare imports at most 1.1x the file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

WIDTH = 2048
VOCAB = 8192


class Model(nn.Module):
    """An embedding and ``blocks`` feed-forward blocks of two Linear layers."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(WIDTH)
        self.register_buffer("positions", torch.arange(64), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x)


def blocks_for(size_mb: int) -> int:
    per_block = 4 * (2 * WIDTH * 2 * WIDTH + 3 * WIDTH)
    return max(1, round((size_mb * 2**20 - 4 * VOCAB * WIDTH) / per_block))


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(way: str, path: str, blocks: int) -> None:
    """Runs in a fresh process: file to first output one way, then prints timings as JSON."""
    rss0 = _status("VmRSS")  # after the bare import torch (at the top of this file)
    began = time.perf_counter()
    if way == "accelerate":
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    elif way in ("torchplace", "baseline"):
        from torchplace.checkpoint._checkpoint import load_into, skeleton
    ids = torch.tensor([[1, 2, 3, 4]])
    start = time.perf_counter()
    imports = start - began
    if way == "floor":
        buffer = torch.empty(Path(path).stat().st_size, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(buffer.numpy()))
        seconds = time.perf_counter() - start
        peak = _status("VmHWM") - rss0
        print(json.dumps({"seconds": seconds, "imports": imports, "peak": peak, "check": None}))
        return
    with torch.no_grad():
        if way == "plain":
            model = Model(blocks)
            model.load_state_dict(torch.load(path, weights_only=True))
        elif way == "accelerate":
            with init_empty_weights():
                model = Model(blocks)
            model = load_checkpoint_and_dispatch(model, path, device_map={"": "cpu"})
        else:
            model = load_into(skeleton(Model, blocks), path)
        out = model(ids)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - rss0
    check = float(out.double().sum())
    print(json.dumps({"seconds": seconds, "imports": imports, "peak": peak, "check": check}))


def run_child(
    way: str, path: Path, blocks: int, pycache: str, baseline: str | None = None
) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", way, str(path), "--blocks", str(blocks)]
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = pycache
    if way == "baseline" and baseline:
        env["PYTHONPATH"] = os.pathsep.join([baseline, env.get("PYTHONPATH", "")])
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{way} failed:\n{done.stderr}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--format", choices=["pt", "safetensors"], default="pt")
    parser.add_argument("--baseline", metavar="SRC", help="another checkout's src folder")
    parser.add_argument("--child", nargs=2, metavar=("WAY", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.blocks)
        return

    ways = ["floor", "plain", "accelerate", "torchplace"] + (["baseline"] if args.baseline else [])
    blocks = blocks_for(args.size_mb)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"model.{'safetensors' if args.format == 'safetensors' else 'pt'}"
        torch.manual_seed(0)
        state = Model(blocks).state_dict()
        if args.format == "safetensors":
            from safetensors.torch import save_file

            save_file(state, path)
        else:
            torch.save(state, path)
        del state
        os.sync()  # no way should meet the file's pages still being written back
        size = path.stat().st_size
        with path.open("rb") as f:  # into the page cache, so no way pays the first read
            while f.read(64 * 2**20):
                pass
        pycache = str(Path(tmp) / "pycache")
        for way in ways:  # once each, unrecorded: writes the bytecode caches
            run_child(way, path, blocks, pycache, args.baseline)
        results: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way in ways:
                results[way].append(run_child(way, path, blocks, pycache, args.baseline))
        checks = {round(r["check"], 2) for rs in results.values() for r in rs if r["check"]}
        best = {way: min(rs, key=lambda r: r["seconds"]) for way, rs in results.items()}
        with_imports = {
            way: min(r["seconds"] + r["imports"] for r in rs) for way, rs in results.items()
        }
        peak = {way: max(r["peak"] for r in rs) for way, rs in results.items()}

    print(f"file: {size / 2**20:.0f} MiB ({args.format}), {blocks} blocks, {os.cpu_count()} CPUs")
    print(
        f"{'way':<12}{'seconds':>9}{'imports':>9}{'with them':>11}{'peak MiB':>10}{'peak/file':>11}"
    )
    for way in ways:
        print(
            f"{way:<12}{best[way]['seconds']:>9.3f}{best[way]['imports']:>9.3f}"
            f"{with_imports[way]:>11.3f}{peak[way] / 2**20:>10.0f}{peak[way] / size:>11.2f}"
        )
    ours = best["torchplace"]["seconds"]
    print(f"torchplace / floor:      {ours / best['floor']['seconds']:.3f}")
    floor = with_imports["floor"]
    print(f"the same, imports included: {with_imports['torchplace'] / floor:.3f}  (target <= 1.3)")
    if args.baseline:
        print(f"torchplace / baseline:   {ours / best['baseline']['seconds']:.3f}  (target <= 1)")
    plain_target = 0.5 if args.format == "safetensors" else 0.3  # plain maps a safetensors file
    print(
        f"torchplace / plain:      {ours / best['plain']['seconds']:.3f}  "
        f"(target <= {plain_target})"
    )
    print(f"torchplace / accelerate: {ours / best['accelerate']['seconds']:.3f}  (target <= 0.5)")
    print(f"torchplace peak / file:  {peak['torchplace'] / size:.3f}  (target <= 1.1)")
    if len(checks) != 1:
        print(f"WARNING: the outputs differ between ways: {sorted(checks)}")


if __name__ == "__main__":
    main()
