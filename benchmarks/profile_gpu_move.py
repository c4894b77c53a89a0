"""Where the time of a model's move (and of a batch's small tensors) goes on a GPU, in one run.

    PYTHONPATH=src python3 benchmarks/profile_gpu_move.py --out DIR [--layers 24] [--width 2048]
    PYTHONPATH=src python3 benchmarks/profile_gpu_move.py --variants   # the A/B table alone

Prints, and writes under ``DIR`` (four small text files):

- ``phases.txt``: wall time of each step of one warm ``torchplace.move`` of bench_move's model
  (Linear layers with grads and Adam state) to ``cuda:0`` and back, with the ring's per-tensor
  calls and the pool's waits counted; the cost of dropping the old host tensors on its own.
- ``profiles.txt``: ``torch.profiler`` (CPU + CUDA) of the same moves, by self CPU time and by
  device time, and ``cProfile`` of their host side, by own time.
- ``variants.txt``: each variant timed in the same process, best of 3, as a fraction of one
  pinned copy: the pool's shape (4 x 16 MiB, 8 x 8 MiB, 8 x 16 MiB); to the GPU the move with
  the old host tensors dropped as it returns and kept alive while timed (what freeing them
  costs), the ring and the host packing alone; to the host the move, the ring alone and the
  host landing alone (fresh pageable results filled from pinned slots).
- ``copies.txt``: bench_copies' 500 x 4 KiB and 500 shapes, owned and views, against one
  ``.to()`` each and the floor, with the steps of each path timed and profiled.

Every part catches its own failure, prints it and goes on. Needs CUDA; without it, says so.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import pstats
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import torchplace
from torchplace.moving import _consolidate, _move, _staging, _transfer

sys.path.insert(0, str(Path(__file__).parent))
from bench_copies import _floors_and_splits, _interleaved, small_tensors
from bench_move import _host_packing, _ring, _tensors, build, pinned_copy_seconds, timed

CUDA = torch.device("cuda", 0)
DEVICE = "cuda"  # "cpu" for --smoke: the script's own plumbing checked on a machine without one
SHAPES = {"4 x 16 MiB": (4, 16 << 20), "8 x 8 MiB": (8, 8 << 20), "8 x 16 MiB": (8, 16 << 20)}


class Out:
    """Printed lines, kept per file under ``--out``."""

    def __init__(self, folder: str | None) -> None:
        self.folder = Path(folder) if folder else None
        self.files: dict[str, list[str]] = {}

    def say(self, name: str, text: str) -> None:
        print(text, flush=True)
        self.files.setdefault(name, []).append(text)

    def save(self) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        for name, lines in self.files.items():
            (self.folder / name).write_text("\n".join(lines) + "\n")


def part(out: Out, name: str, fn: Callable[[], None]) -> None:
    """Run one part; a failure is printed and the next part runs."""
    start = time.perf_counter()
    try:
        fn()
    except Exception:
        out.say(name, f"!! part failed:\n{traceback.format_exc()}")
    out.say(name, f"[{name}: {time.perf_counter() - start:.1f} s]")


# --- phases -------------------------------------------------------------------------------------


class Timers:
    """Wall time and calls of wrapped functions (nested ones counted in their callers too)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed

    def table(self, total: float) -> str:
        rows = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        lines = [f"  {'step':44s} {'ms':>8s} {'calls':>6s} {'of the move':>11s}"]
        for name, s in rows:
            share = s / total
            lines.append(f"  {name:44s} {s * 1e3:8.2f} {self.calls[name]:6d} {share:10.0%}")
        return "\n".join(lines)


_PATCHED = [
    (_move, "gather_homes"),
    (_move, "_plan"),
    (_move, "_check_non_persistent"),
    (_move, "covered_modules"),
    (_move, "_copy_tensors"),
    (_move, "_bind_copies"),
    (_move, "_moved_attributes"),
    (_move, "_plan_optimizer_states"),
    (_move, "_commit"),
    (_move, "_warn_after"),
    (_move, "_prefill_batch"),
    (_transfer, "copy_tensor"),
    (_transfer, "packed_host_copy"),
    (_transfer, "consolidated_views"),
    (_transfer, "small_host_tensors"),
    (_transfer, "stageable"),
    (_transfer, "stageable_back"),
    (_transfer.Copier, "prefill"),
    (_transfer.Copier, "copy"),
    (_transfer.Copier, "synchronize"),
    (_staging.Stager, "copy"),
    (_staging.Stager, "copy_back"),
    (_staging.Stager, "_land"),
    (_staging.Stager, "finish"),
    (_staging.PinnedPool, "take"),
    (_staging.PinnedPool, "give"),
    (_consolidate, "plan_views"),
    (_consolidate, "_pack_runs"),
    (_consolidate, "_cut"),
    (_consolidate, "_pack_on_host"),
    (_consolidate, "_land"),
    (_consolidate, "_split"),
]


@contextlib.contextmanager
def instrumented() -> Iterator[Timers]:
    timers = Timers()
    saved = []
    for owner, attr in _PATCHED:
        fn = getattr(owner, attr, None)
        if fn is None:
            continue
        saved.append((owner, attr, fn))
        label = f"{getattr(owner, '__name__', owner)}.{attr}".replace("torchplace.moving.", "")
        setattr(owner, attr, timers.wrap(label, fn))
    try:
        yield timers
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def _to(device: str) -> Callable[[Any, Any], object]:
    where = DEVICE if device == "cuda" else device
    return lambda m, o: torchplace.move(m, where, optimizer=o)


def phases(out: Out, layers: int, width: int) -> None:
    model, opt, nbytes = build(layers, width)
    for _ in range(2):  # warm: pool pinned, allocator cached
        _to("cuda")(model, opt)
        _to("cpu")(model, opt)
    out.say("phases.txt", f"{nbytes / 2**30:.2f} GiB moved; {torch.get_num_threads()} threads")
    for device in ("cuda", "cpu"):
        with instrumented() as timers:
            seconds = timed(lambda d=device: _to(d)(model, opt))
        head = f"move to {device}: {seconds * 1e3:.1f} ms"
        out.say("phases.txt", f"{head}\n{timers.table(seconds)}")
    keep = _tensors(model, opt)  # the host tensors a move to the GPU drops
    _to("cuda")(model, opt)
    torch.cuda.synchronize()
    start = time.perf_counter()
    del keep
    dropped = time.perf_counter() - start
    out.say("phases.txt", f"dropping the old host tensors after a move: {dropped * 1e3:.1f} ms")


# --- profiles -----------------------------------------------------------------------------------


def _profiler_tables(prof: Any, rows: int = 25) -> str:
    averages = prof.key_averages()
    text = [averages.table(sort_by="self_cpu_time_total", row_limit=rows)]
    for key in ("self_device_time_total", "self_cuda_time_total", "cuda_time_total"):
        try:
            text.append(averages.table(sort_by=key, row_limit=rows))
            break
        except Exception:
            continue
    return "\n".join(text)


def _cprofile(fn: Callable[[], object], rows: int = 30) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    torch.cuda.synchronize()
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(rows)
    return stream.getvalue()


def profiles(out: Out, layers: int, width: int) -> None:
    model, opt, _ = build(layers, width)
    _to("cuda")(model, opt)
    _to("cpu")(model, opt)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for device in ("cuda", "cpu"):
        with torch.profiler.profile(activities=activities) as prof:
            _to(device)(model, opt)
            torch.cuda.synchronize()
        out.say("profiles.txt", f"== torch.profiler, move to {device}\n{_profiler_tables(prof)}")
    for device in ("cuda", "cpu"):
        text = _cprofile(lambda d=device: _to(d)(model, opt))
        out.say("profiles.txt", f"== cProfile, move to {device}, by own time\n{text}")


# --- variants -----------------------------------------------------------------------------------


def _ring_back(model: Any, opt: Any) -> None:
    """The ring alone, device to host, landed."""
    stager = _staging.Stager(CUDA)
    cpu = torch.device("cpu")
    for t in _tensors(model, opt):
        stager.copy_back(t) if _staging.stageable_back(t, cpu) else t.cpu()
    stager.finish()


def _host_landing(tensors: list[torch.Tensor]) -> None:
    """The way back's host side alone: fresh pageable results filled from pinned slots."""
    chunk = _staging.STAGE_CHUNK_BYTES
    slots = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    i = 0
    for t in tensors:
        out = torch.empty(t.nbytes, dtype=torch.uint8)
        for start in range(0, t.nbytes, chunk):
            stop = min(start + chunk, t.nbytes)
            out[start:stop].copy_(slots[i % 2][: stop - start])
            i += 1


def _kept_move(model: Any, opt: Any) -> Callable[[], object]:
    """The move to the GPU with the old host tensors held until after the timing."""
    keep = _tensors(model, opt)

    def run() -> object:
        _to("cuda")(model, opt)
        return keep

    return run


def _sample(model: Any, opt: Any, way: str) -> float:
    """One timed run of ``way``; leaves the model where the next sample expects it."""
    on_gpu = not next(model.parameters()).is_cpu
    if way.startswith("to gpu") and on_gpu:
        _to("cpu")(model, opt)
    if way.startswith("to cpu") and not on_gpu:
        _to("cuda")(model, opt)
    if way == "to gpu: move, old host tensors kept":
        return timed(_kept_move(model, opt))
    fns: dict[str, Callable[[], object]] = {
        "to gpu: move, old host tensors dropped as it returns": lambda: _to("cuda")(model, opt),
        "to gpu: ring alone": lambda: _ring(_tensors(model, opt)),
        "to gpu: host packing alone": lambda: _host_packing(_tensors(model, opt)),
        "to cpu: host landing alone": lambda: _host_landing(_tensors(model, opt)),
        "to cpu: move": lambda: _to("cpu")(model, opt),
        "to cpu: ring alone": lambda: _ring_back(model, opt),
    }
    return timed(fns[way])


WAYS = (
    "to gpu: move, old host tensors dropped as it returns",
    "to gpu: move, old host tensors kept",
    "to gpu: ring alone",
    "to gpu: host packing alone",
    "to cpu: move",
    "to cpu: ring alone",
    "to cpu: host landing alone",
)


def variants(out: Out, layers: int, width: int, rounds: int = 3) -> None:
    model, opt, nbytes = build(layers, width)
    there, back = pinned_copy_seconds(nbytes), pinned_copy_seconds(nbytes, back=True)
    saved = (_staging.STAGE_BUFFERS, _staging.STAGE_CHUNK_BYTES)
    best: dict[tuple[str, str], float] = {}
    try:
        for _ in range(rounds):  # the shapes and ways take turns: each sees the same drift
            for shape, (buffers, chunk) in SHAPES.items():
                _staging.STAGE_BUFFERS, _staging.STAGE_CHUNK_BYTES = buffers, chunk
                for way in WAYS:
                    try:
                        seconds = _sample(model, opt, way)
                    except Exception as exc:  # one way failing leaves the others' figures
                        if (shape, way) not in best:
                            out.say("variants.txt", f"!! {shape}, {way}: {exc!r}"[:300])
                        seconds = float("inf")
                    best[shape, way] = min(best.get((shape, way), seconds), seconds)
    finally:
        _staging.STAGE_BUFFERS, _staging.STAGE_CHUNK_BYTES = saved
    gbps = (nbytes / there / 1e9, nbytes / back / 1e9)
    lines = [f"{nbytes / 2**30:.2f} GiB; pinned copy {gbps[0]:.1f} GB/s there, {gbps[1]:.1f} back"]
    lines.append(f"best of {rounds}, fraction of one pinned copy (ms)")
    lines.append(f"{'way':52s}" + "".join(f"{s:>20s}" for s in SHAPES))
    for way in WAYS:
        ref = there if way.startswith("to gpu") else back
        cells = "".join(f"{ref / best[s, way]:10.2f} ({best[s, way] * 1e3:6.1f})" for s in SHAPES)
        lines.append(f"{way:52s}{cells}")
    out.say("variants.txt", "\n".join(lines))


# --- small tensors ------------------------------------------------------------------------------


def copies(out: Out, count: int = 500, repeat: int = 20) -> None:
    for label, distinct in ((f"{count} x 4 KiB", False), (f"{count} shapes", True)):
        tensors = small_tensors(count, distinct=distinct)
        ways: dict[str, Callable[[], object]] = {
            "per_tensor": lambda ts=tensors: [t.to(CUDA) for t in ts],
            "owned": lambda ts=tensors: torchplace.move(ts, CUDA),
            "views": lambda ts=tensors: torchplace.move(ts, CUDA, views=True),
            "floor_copy": _floors_and_splits(tensors, CUDA, pin=DEVICE == "cuda")["floor_copy"],
        }
        best = _interleaved(ways, torch.cuda.synchronize, repeat)
        figures = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in best.items())
        out.say("copies.txt", f"== {label}: {figures}")
        for way in ("owned", "views"):
            with instrumented() as timers:
                seconds = timed(ways[way])
            out.say(
                "copies.txt", f"-- {label}, {way}: {seconds * 1e3:.3f} ms\n" + timers.table(seconds)
            )
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                ways[way]()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
            out.say("copies.txt", table)
            out.say("copies.txt", _cprofile(ways[way], rows=20))


def _smoke() -> None:
    """Every move to the CPU (nothing to do), no device waits: the plumbing runs on any machine
    (the ring needs CUDA and reports its failure)."""
    global DEVICE, CUDA
    DEVICE, CUDA = "cpu", torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    globals()["pinned_copy_seconds"] = lambda nbytes, back=False: 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for the four text files")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3, help="samples per variant")
    parser.add_argument(
        "--parts", default="variants,phases,copies,profiles", help="which parts, in order"
    )
    parser.add_argument("--variants", action="store_true", help="only the variants table")
    parser.add_argument("--smoke", action="store_true", help="to meta, without a GPU")
    args = parser.parse_args(argv)
    if args.smoke:
        _smoke()
    elif not torch.cuda.is_available():
        print("profile_gpu_move: skipped, no CUDA device")
        return 0
    out = Out(args.out)
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE
    print(f"torch {torch.__version__}, {name}")
    layers, width = args.layers, args.width
    parts: dict[str, Callable[[], None]] = {
        "variants": lambda: variants(out, layers, width, args.rounds),
        "phases": lambda: phases(out, layers, width),
        "copies": lambda: copies(out),
        "profiles": lambda: profiles(out, layers, width),
    }
    chosen = ["variants"] if args.variants else args.parts.split(",")
    for name in chosen:
        part(out, f"{name}.txt", parts[name])
        out.save()  # after each part: a run stopped by its time limit keeps what it had
    if "variants.txt" in out.files and len(chosen) > 1:  # the table again, last on the screen
        print("\n== summary (variants.txt)\n" + "\n".join(out.files["variants.txt"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
