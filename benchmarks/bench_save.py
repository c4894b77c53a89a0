"""Saving a 1 GB model to a directory, as ratios to the floor and to the usual ways.

Run as ``python benchmarks/bench_save.py [--layers 2] [--rounds 3] [--rows FILE]``.

A transformers Llama of about 0.9 GiB of float32 weights (hidden 2048, ``--layers`` decoder
layers, a 32,000-word vocabulary, embedding and head untied) is saved, each way in turn, round
by round, into a fresh path of a temporary directory (the page cache; every way flushes its
files to disk, as ``save`` does):

* ``floor``: the same bytes written into one file and flushed (``os.fsync``): what any save of
  them pays at least;
* ``torchplace``: ``torchplace.save(model, DIR)``: shards of 5 GB, atomic, flushed;
* ``save_pretrained``: ``model.save_pretrained(DIR)`` then each file flushed;
* ``torch.save``: ``torch.save(model.state_dict(), FILE)`` then flushed;
* ``save_file``: ``safetensors.torch.save_file(state_dict, FILE)`` then flushed.

Each is reported by its fastest round. Then the background save: the time ``save(...,
background=True)`` blocks the caller (its snapshot into one host buffer: a fresh one the first
time, then the one the last save gave back) against a copy of the state into fresh host memory
(``clone`` of each tensor). Last, in a fresh process each, the peak
host memory above the model while saving (``VmHWM`` reset before the save, through
``/proc/self/clear_refs``) for ``torchplace.save`` and ``save_file``.

``--gpu`` measures only the snapshot of a 1 GiB model resident on CUDA (16 x ``Linear(4096)``):
the time a background save blocks against one copy of the same bytes into pinned host memory
(the GPU check runs it).

Targets (docs/design.md, section 5): ``torchplace`` at most 1.2x the floor and 0.7x
``save_pretrained``; the background save blocks at most 1.2x the host copy (on a GPU: the
pinned copy); peak host memory at most 64 MiB + the largest tensor above the model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rows import add_row


def model(layers: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=2048, intermediate_size=5504, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cpu"):
        return LlamaForCausalLM(config).eval()


def _flush(path: Path) -> None:
    for file in [path] if path.is_file() else sorted(path.iterdir()):
        with open(file, "rb+") as f:
            os.fsync(f.fileno())


def ways(m: Any) -> dict[str, Callable[[Path], None]]:
    import safetensors.torch
    import torch

    import torchplace

    state = m.state_dict()
    tensors = [t.contiguous().view(-1).view(torch.uint8).numpy() for t in state.values()]

    def floor(path: Path) -> None:
        with open(path, "wb") as f:
            for t in tensors:
                f.write(memoryview(t))
            f.flush()
            os.fsync(f.fileno())

    def pretrained(path: Path) -> None:
        m.save_pretrained(path)
        _flush(path)

    def torch_save(path: Path) -> None:
        torch.save(state, path)
        _flush(path)

    def save_file(path: Path) -> None:
        safetensors.torch.save_file(state, str(path), metadata={"format": "pt"})
        _flush(path)

    return {
        "floor": floor,
        "torchplace": lambda p: torchplace.save(m, p),
        "save_pretrained": pretrained,
        "torch.save": torch_save,
        "save_file": save_file,
    }


def timed(work: Callable[[Path], None], where: Path) -> float:
    start = time.perf_counter()
    work(where)
    took = time.perf_counter() - start
    shutil.rmtree(where, ignore_errors=True) if where.is_dir() else where.unlink()
    return took


def background(m: Any, root: Path, rounds: int) -> tuple[float, float, float]:
    """The time the first background save blocks (a fresh buffer), the fastest of the later
    ones (the buffer the last one gave back), and the fastest host copy of the state."""
    import torchplace

    blocked, copied = [], []
    for r in range(rounds):
        start = time.perf_counter()
        saving = torchplace.save(m, root / f"bg{r}", background=True)
        blocked.append(time.perf_counter() - start)
        assert saving is not None
        saving.wait()
        shutil.rmtree(root / f"bg{r}")
        start = time.perf_counter()
        clone = {k: v.clone() for k, v in m.state_dict().items()}
        copied.append(time.perf_counter() - start)
        del clone
    return blocked[0], min(blocked[1:] or blocked), min(copied)


_PEAK = """
import json, os, sys, torch
sys.path.insert(0, {bench!r})
from bench_save import model
m = model({layers})
largest = max(p.numel() * p.element_size() for p in m.state_dict().values())
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
if {way!r} == "torchplace":
    import torchplace
    work = lambda: torchplace.save(m, {out!r})
else:
    import safetensors.torch
    sd = m.state_dict()
    work = lambda: safetensors.torch.save_file(sd, {out!r} + ".safetensors")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM back to VmRSS
before = rss()
work()
print(json.dumps({{"growth": hwm() - before, "largest": largest}}))
"""


def peak(way: str, layers: int, out: Path) -> dict[str, int]:
    code = _PEAK.format(bench=str(Path(__file__).parent), layers=layers, way=way, out=str(out))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)  # fmt: skip
    found: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def gpu_snapshot(rounds: int, rows: str | None) -> None:
    """The time a background save of a CUDA-resident model blocks the caller (its snapshot
    over pinned memory) against one copy of the same bytes into pinned host memory."""
    import torch
    from torch import nn

    import torchplace

    if not torch.cuda.is_available():
        print("bench_save --gpu: no CUDA device here, nothing to measure (run it on a GPU)")
        return
    m = nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(16))).cuda()  # 1 GiB
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    blocked, copied = [], []
    with tempfile.TemporaryDirectory(prefix="bench_save-gpu-") as d:
        for r in range(rounds + 1):  # the first round warms the pool up: not counted
            torch.cuda.synchronize()
            start = time.perf_counter()
            saving = torchplace.save(m, Path(d) / f"gpu{r}.safetensors", background=True)
            took = time.perf_counter() - start
            assert saving is not None
            saving.wait()
            (Path(d) / f"gpu{r}.safetensors").unlink()
            start = time.perf_counter()
            at = 0
            for p in m.parameters():
                n = p.numel() * p.element_size()
                pinned[at : at + n].view(p.dtype).view(p.shape).copy_(p, non_blocking=True)
                at += n
            torch.cuda.synchronize()
            if r:
                blocked.append(took)
                copied.append(time.perf_counter() - start)
    ratio = min(blocked) / min(copied)
    print(f"GPU snapshot: background save blocks {min(blocked):.3f} s, one pinned copy "
          f"{min(copied):.3f} s ({nbytes / min(copied) / 2**30:.1f} GiB/s): {ratio:.2f}x "
          "(target <= 1.2x)")  # fmt: skip
    add_row(rows, "background save of a CUDA model, blocking / pinned copy", ratio, "<= 1.2x",
            ratio <= 1.2)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (2: about 0.9 GiB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", help="append the figures as JSON lines to this file")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="only the snapshot of a 1 GiB CUDA-resident model (a background save) against "
        "one pinned copy; exits 0 without CUDA",
    )
    args = parser.parse_args()
    if args.gpu:
        gpu_snapshot(args.rounds, args.rows)
        return
    m = model(args.layers)
    nbytes = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    print(f"model: {nbytes / 2**30:.2f} GiB, {len(m.state_dict())} tensors")
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench_save-", dir=os.environ.get("TMPDIR")) as d:
        root = Path(d)
        table = ways(m)
        for r in range(args.rounds):
            for name, work in table.items():
                where = root / (f"{name}-{r}" + ("" if name in ("torchplace", "save_pretrained")
                                                else ".bin"))  # fmt: skip
                best[name] = min(best.get(name, float("inf")), timed(work, where))
        floor = best["floor"]
        for name, took in best.items():
            print(f"{name:16} {took:7.3f} s  {took / floor:5.2f}x floor  "
                  f"{nbytes / took / 2**30:5.2f} GiB/s")  # fmt: skip
        ratio = best["torchplace"] / floor
        vs = best["torchplace"] / best["save_pretrained"]
        print(f"torchplace / floor {ratio:.2f}x (target <= 1.2x); "
              f"/ save_pretrained {vs:.2f}x (target <= 0.7x)")  # fmt: skip
        add_row(
            args.rows, "save to a directory / write+fsync floor", ratio, "<= 1.2x", ratio <= 1.2
        )
        add_row(args.rows, "save / save_pretrained + flush", vs, "<= 0.7x", vs <= 0.7)
        first, blocked, copied = background(m, root, args.rounds)
        print(f"background: the first blocks {first:.3f} s ({first / copied:.2f}x), the next "
              f"{blocked:.3f} s ({blocked / copied:.2f}x); host copy {copied:.3f} s "
              "(target <= 1.2x)")  # fmt: skip
        add_row(args.rows, "first background save blocking / host copy", first / copied,
                "<= 1.2x", first / copied <= 1.2)  # fmt: skip
        add_row(args.rows, "later background save blocking / host copy", blocked / copied,
                "<= 1.2x", blocked / copied <= 1.2)  # fmt: skip
        del m, table
        for way in ("torchplace", "save_file"):
            found = peak(way, args.layers, root / f"peak-{way}")
            limit = 64 * 2**20 + found["largest"]
            print(f"peak host memory above the model, {way}: {found['growth'] / 2**20:.0f} MiB "
                  f"(target <= 64 MiB + the largest tensor, {limit / 2**20:.0f} MiB)")  # fmt: skip
            add_row(args.rows, f"peak host memory above the model, {way}",
                    found["growth"] / 2**20, f"<= {limit / 2**20:.0f} MiB",
                    found["growth"] <= limit if way == "torchplace" else None,
                    unit="MiB")  # fmt: skip


if __name__ == "__main__":
    main()
