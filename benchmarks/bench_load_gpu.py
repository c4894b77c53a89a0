"""A checkpoint onto a GPU from the page cache, against the usual recipe and one pinned copy.

Run as ``python benchmarks/bench_load_gpu.py [--size-mb 1024] [--rounds 3] [--sweep]``, or with
``--rows FILE`` to append its figures for ``gpu_check.sh``.

A model of ``--size-mb`` of float32 weights (``Linear(4096, 4096, bias=False)`` layers, 64 MiB
each) is saved once as ``.safetensors`` in a temporary folder and read once, so it is in the page
cache. Then, round by round, in this one process (the device's allocator warm for every way):

* ``torchplace``: ``load_into(skeleton(Model), path, "cuda")``, synchronized;
* ``recipe``: ``with torch.device("meta"): m = Model()`` then
  ``m.load_state_dict(safetensors.torch.load_file(path, device="cuda"), assign=True)``;
* ``pinned copy``: one host-to-device copy of as many bytes from pinned memory, the ceiling.

Each way is reported by its fastest round, in GB/s of tensor bytes. Then the peak GPU memory of
filling a bfloat16 skeleton from the float32 file (converted on the device a chunk at a time),
beyond the model's own bytes.

Targets (issue 26): at least 25 GB/s for a checkpoint of 1 GB or more, at most 0.5x the recipe's
time, and a peak of at most the bf16 model's bytes + 256 MiB. Aim: 0.8 of the pinned copy.

``--sweep`` then times the same load with the reader's thread count
(``_cuda_read.CUDA_READ_THREADS``) and the pinned pool's shape (``_staging.STAGE_BUFFERS``
slots of ``_staging.STAGE_CHUNK_BYTES``; the pool moves use too) set to each of a few values. At
most one thread per slot reads, so counts above a shape's slots are left out. It prints the
fastest setting, to be written into ``_cuda_read.py`` (and, weighed against ``bench_move.py
--sweep``, into ``_staging.py``); no default has been set by a GPU measurement yet.

``--crc`` also saves the weights as a torch zip file (``.pt``) and times ``load_into`` of it
onto the GPU unchecked and with ``check_crc=True``, by zlib's CRC-32 and by ISA-L's (where
``isal`` is installed): what the check costs there, which decides whether ``check_crc``'s
default (``None``, on for reads into host memory where ISA-L is installed) should check reads
onto a GPU too (at most +15%).

Needs a CUDA device (and safetensors); without one it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _rows import add_row

TARGET_GBPS = 25.0
TARGET_RECIPE = 0.5
TARGET_PEAK_MIB = 256
AIM_PINNED = 0.8
WIDTH = 4096  # a layer: 64 MiB of float32
MiB = 1 << 20
# (slots, MiB per slot) of the pinned pool: the first three keep it at 64 MiB, the last doubles it
SHAPES = [(4, 16), (8, 8), (16, 4), (8, 16)]
THREADS = [1, 2, 4, 8, 16]


class Model(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers))


def best(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        del out
    return min(times)


def write_checkpoint(folder: Path, layers: int) -> Path:
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    weights = {
        f"layers.{i}.weight": torch.randn(WIDTH, WIDTH, generator=gen) for i in range(layers)
    }
    path = folder / "model.safetensors"
    save_file(weights, path)
    with open(path, "rb", buffering=0) as f:  # into the page cache
        while f.read(64 * MiB):
            pass
    return path


def pinned_copy_seconds(nbytes: int, rounds: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return best(lambda: dst.copy_(src, non_blocking=True), rounds)


def peak_beyond_model(path: Path, layers: int) -> tuple[int, int]:
    """(peak GPU bytes beyond the model's, the model's bytes) filling a bf16 skeleton from
    the fp32 file."""
    from torchplace import load_into, skeleton

    model = skeleton(Model, layers).to(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    load_into(model, path, "cuda", progress=False)
    torch.cuda.synchronize()
    model_bytes = sum(p.nbytes for p in model.parameters())
    return torch.cuda.max_memory_allocated() - before - model_bytes, model_bytes


def sweep(path: Path, layers: int, nbytes: int, rounds: int) -> tuple[float, str]:
    """GB/s of ``load_into`` per (threads, pool shape); returns the best and its setting."""
    from torchplace import load_into, skeleton
    from torchplace.checkpoint import _cuda_read
    from torchplace.moving import _staging

    saved = (_cuda_read.CUDA_READ_THREADS, _staging.STAGE_BUFFERS, _staging.STAGE_CHUNK_BYTES)
    cores = os.cpu_count() or 1
    print(f"\nsweep: GB/s of load_into by CUDA_READ_THREADS (default {saved[0]}) x pool shape")
    print("pool        " + "".join(f"{t:>8d}" for t in THREADS))
    top, top_setting = 0.0, ""
    try:
        for slots, mib in SHAPES:
            _staging.STAGE_BUFFERS = slots
            _staging.STAGE_CHUNK_BYTES = mib * MiB  # the reader's chunk is the pool's slot
            cells = []
            for threads in THREADS:
                if threads > slots or threads > cores:
                    cells.append(f"{'-':>8s}")
                    continue
                _cuda_read.CUDA_READ_THREADS = threads

                def load() -> nn.Module:
                    return load_into(skeleton(Model, layers), path, "cuda", progress=False)

                load()  # a new pool shape pins its slots once
                gbps = nbytes / best(load, rounds) / 1e9
                cells.append(f"{gbps:8.1f}")
                if gbps > top:
                    top, top_setting = (
                        gbps,
                        f"CUDA_READ_THREADS={threads}, pool {slots} x {mib} MiB",
                    )
            print(f"{slots:2d} x {mib:2d} MiB " + "".join(cells))
    finally:
        _cuda_read.CUDA_READ_THREADS, _staging.STAGE_BUFFERS, _staging.STAGE_CHUNK_BYTES = saved
    print(f"fastest: {top:.1f} GB/s with {top_setting}")
    return top, top_setting


def crc_cost(
    folder: Path, layers: int, rounds: int, rows: str | None, device: str = "cuda"
) -> None:
    """``load_into`` of a ``.pt`` onto the GPU, unchecked and checked by each CRC-32 function."""
    import zlib

    from torchplace import load_into, skeleton
    from torchplace.checkpoint import _crc

    gen = torch.Generator().manual_seed(0)
    pt = folder / "model.pt"
    weights = {
        f"layers.{i}.weight": torch.randn(WIDTH, WIDTH, generator=gen) for i in range(layers)
    }
    torch.save(weights, pt)
    del weights
    pt.read_bytes()  # into the page cache
    functions: dict[str, Callable[..., int] | None] = {"unchecked": None, "zlib": zlib.crc32}
    try:
        from isal import isal_zlib

        functions["isal"] = isal_zlib.crc32
    except ImportError:
        print("isal is not installed (pip install isal): ISA-L's CRC-32 is not timed")
    seconds = {}
    saved = _crc._pick
    try:
        for name, fn in functions.items():
            _crc._pick = lambda fn=fn: (fn or zlib.crc32, fn is not None)

            def load(fn: object = fn) -> nn.Module:
                model = skeleton(Model, layers)
                return load_into(model, pt, device, check_crc=fn is not None, progress=False)

            load()
            seconds[name] = best(load, rounds)
    finally:
        _crc._pick = saved
    for name, s in seconds.items():
        extra = s / seconds["unchecked"] - 1
        print(f".pt onto the GPU, {name:9s} {s * 1e3:6.0f} ms ({extra:+.0%})")
        if name != "unchecked":
            what = f"check_crc onto the GPU by {name}'s CRC-32, over the unchecked read"
            add_row(rows, what, extra * 100, "<= +15%", extra <= 0.15, unit="%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="thread count x pool shape")
    parser.add_argument("--crc", action="store_true", help="time check_crc onto the GPU")
    parser.add_argument("--rows", help="append the figures as JSON lines to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_load_gpu: skipped, no CUDA device (the targets apply to a GPU)")
        return 0
    from safetensors.torch import load_file

    from torchplace import load_into, skeleton

    layers = max(1, args.size_mb // 64)
    rows, rounds = args.rows, args.rounds
    with tempfile.TemporaryDirectory() as folder:
        path = write_checkpoint(Path(folder), layers)
        nbytes = layers * WIDTH * WIDTH * 4

        def ours() -> nn.Module:
            return load_into(skeleton(Model, layers), path, "cuda", progress=False)

        def recipe() -> nn.Module:
            with torch.device("meta"):
                model = Model(layers)
            model.load_state_dict(load_file(path, device="cuda"), assign=True)
            return model

        a, b = ours(), recipe()  # warm: imports, the pinned pool, the allocator; and a check
        same = all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
        del a, b
        if not same:
            print("bench_load_gpu: torchplace and the recipe loaded different values")
            return 1
        seconds = {"torchplace": best(ours, rounds), "recipe": best(recipe, rounds)}
        seconds["pinned copy"] = pinned_copy_seconds(nbytes, rounds)
        print(
            f"{nbytes / 2**30:.2f} GiB of float32 from the page cache to "
            f"{torch.cuda.get_device_name(0)}, best of {rounds}"
        )
        for name, s in seconds.items():
            print(f"{name:12s} {nbytes / s / 1e9:6.1f} GB/s ({s * 1e3:.0f} ms)")
        peak, model_bytes = peak_beyond_model(path, layers)
        print(
            f"bf16 model ({model_bytes / MiB:.0f} MiB) from the fp32 file: GPU peak beyond it "
            f"{peak / MiB:.1f} MiB"
        )
        if args.crc:
            crc_cost(Path(folder), layers, rounds, rows)
        if args.sweep:
            top, setting = sweep(path, layers, nbytes, rounds)
            add_row(rows, f"load_into to GPU, fastest of the sweep ({setting})", top, "-", None,
                    unit="GB/s")  # fmt: skip

    gbps = nbytes / seconds["torchplace"] / 1e9
    of_recipe = seconds["torchplace"] / seconds["recipe"]
    of_pinned = seconds["pinned copy"] / seconds["torchplace"]
    verdicts = [
        ("load_into to GPU from the page cache", gbps, "GB/s", gbps >= TARGET_GBPS,
         f">= {TARGET_GBPS:g} GB/s"),
        ("load_into to GPU, of the recipe's time", of_recipe, "x", of_recipe <= TARGET_RECIPE,
         f"<= {TARGET_RECIPE}x"),
        ("GPU peak beyond a bf16 model filled from fp32", peak / MiB, "MiB",
         peak <= TARGET_PEAK_MIB * MiB, f"<= {TARGET_PEAK_MIB} MiB"),
    ]  # fmt: skip
    met_all = True
    for what, figure, unit, met, target in verdicts:
        met_all &= met
        print(f"target {what} {target}: {figure:.2f} ({'met' if met else 'MISSED'})")
        add_row(rows, what, figure, target, met, unit=unit)
    print(f"aim: of one pinned copy's bandwidth >= {AIM_PINNED}: {of_pinned:.2f}")
    add_row(rows, "load_into to GPU, of one pinned copy", of_pinned, f"aim >= {AIM_PINNED}x", None)
    return 0 if met_all else 1


if __name__ == "__main__":
    sys.exit(main())
