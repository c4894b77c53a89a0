"""Moving a model with its Adam state to a GPU and back, as a fraction of one large pinned copy.

Targets (docs/design.md): ``torchplace.move(model, "cuda", optimizer=adam)`` reaches 0.85 of the
bandwidth of a single pinned host-to-device copy of the same number of bytes with a warm
allocator, and 0.6 for the first move in a process (pinned staging memory allocated then); the
way back, ``move(model, "cpu", optimizer=adam)``, is held to the same 0.85 against one pinned
device-to-host copy; GPU peak memory stays at the moved bytes + a bounded staging area (at most
``OWNED_GROUP_BYTES``, 64 MiB). Side by side: ``model.to("cuda")`` plus the by-hand
optimizer-state loop people write, and the staging ring alone in both directions.

    python benchmarks/bench_move.py [--layers 24] [--width 2048] [--sweep] [--parts]
    python benchmarks/bench_move.py --rows rows.jsonl   # also append figures for gpu_check.sh

``--sweep`` times chunk sizes and ring lengths of the staged copies
(``torchplace.moving._staging``).
``--parts`` looks for where a move's time goes: the move beside its pieces timed alone on the
same tensors (the staging ring; the host-side packing into pinned memory without any transfer;
device allocations), beside the other way to copy pageable memory at full speed (pinning the
source pages in place with ``cudaHostRegister``), then a profile of one move.

Needs a CUDA device; without one it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import torchplace
from torchplace.moving import _staging
from torchplace.moving._transfer import OWNED_GROUP_BYTES

sys.path.insert(0, str(Path(__file__).parent))
from _rows import add_row

TARGET_WARM = 0.85
TARGET_FIRST = 0.6


def build(layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    state = sum(v.nbytes for s in opt.state.values() for v in s.values() if v.dim() > 0)
    params = sum(p.nbytes for p in model.parameters())
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    return model, opt, params + grads + state


def timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def pinned_copy_seconds(nbytes: int, *, back: bool = False) -> float:
    """The best time of one pinned host-to-device (``back``: device-to-host) copy of ``nbytes``."""
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    on_device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src, dst = (on_device, pinned) if back else (pinned, on_device)
    dst.copy_(src, non_blocking=True)  # warm up
    best = min(timed(lambda: dst.copy_(src, non_blocking=True)) for _ in range(5))
    del pinned, on_device
    return best


def by_hand(model: nn.Module, opt: torch.optim.Optimizer, device: str = "cuda") -> None:
    """The hand-written move: ``model.to`` and a loop over the optimizer's state."""
    model.to(device)
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                state[key] = value.to(device)


def _with(min_bytes: int, chunk: int, buffers: int) -> None:
    _staging.STAGE_MIN_BYTES, _staging.STAGE_CHUNK_BYTES, _staging.STAGE_BUFFERS = (
        min_bytes,
        chunk,
        buffers,
    )


Mover = Callable[[nn.Module, torch.optim.Optimizer], object]


def _move(m: nn.Module, o: torch.optim.Optimizer) -> None:
    torchplace.move(m, "cuda", optimizer=o)


def _seconds(
    layers: int, width: int, fn: Mover = _move, rounds: int = 3, warm: bool = True
) -> float:
    """The best of ``rounds`` moves of a fresh model. ``warm``: the device memory the previous
    round freed is still cached by PyTorch's allocator (no cudaMalloc in the timing); cold: it is
    given back first, so each round pays cudaMalloc for every tensor, as a first move does."""
    runs = []
    for _ in range(rounds):
        m, o, _ = build(layers, width)
        if not warm:
            torch.cuda.empty_cache()
        runs.append(timed(lambda m=m, o=o: fn(m, o)))
        del m, o
    return min(runs)


def sweep(layers: int, width: int, best_copy: float) -> None:
    """Chunk size and ring length of the staged copies, as fractions of the pinned copy."""
    saved = (_staging.STAGE_MIN_BYTES, _staging.STAGE_CHUNK_BYTES, _staging.STAGE_BUFFERS)
    print("chunk MiB x buffers -> fraction of the pinned copy (warm allocator)")
    for chunk in (4 << 20, 8 << 20, 16 << 20, 32 << 20):
        cells = []
        for buffers in (2, 3, 4, 6):
            _with(saved[0], chunk, buffers)
            cells.append(f"{best_copy / _seconds(layers, width):6.2f}")
        print(f"{chunk >> 20:>9} " + " ".join(cells) + "   (buffers 2 3 4 6)")
    _with(*saved)


def _tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a move of ``model`` and ``opt`` copies: parameters, grads and Adam state."""
    out = [p.detach() for p in model.parameters()]
    out += [p.grad for p in model.parameters() if p.grad is not None]
    out += [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    return out


def _ring(tensors: list[torch.Tensor]) -> None:
    """The ring alone (on its own stream); the small tensors by ``.to()``, which no longer drain
    the ring: their blocking copies wait for the current stream only."""
    stager = _staging.Stager(torch.device("cuda", torch.cuda.current_device()))
    for t in tensors:
        stager.copy(t) if _staging.stageable(t, stager.device) else t.to("cuda")
    stager.finish()


def _ring_back(tensors: list[torch.Tensor]) -> None:
    """The ring alone, device to host: pageable results at pinned speed."""
    stager = _staging.Stager(torch.device("cuda", torch.cuda.current_device()))
    for t in tensors:
        stager.copy_back(t) if _staging.stageable_back(t, torch.device("cpu")) else t.cpu()


def _host_packing(tensors: list[torch.Tensor]) -> None:
    """The ring's host side alone: every byte copied into pinned buffers, nothing sent."""
    buffers = [
        torch.empty(_staging.STAGE_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
        for _ in range(_staging.STAGE_BUFFERS)
    ]
    i = 0
    for t in tensors:
        flat = t.reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), _staging.STAGE_CHUNK_BYTES):
            chunk = flat[start : start + _staging.STAGE_CHUNK_BYTES]
            buffers[i % len(buffers)][: chunk.numel()].copy_(chunk)
            i += 1


def _allocations(tensors: list[torch.Tensor]) -> None:
    kept = [torch.empty_like(t, device="cuda") for t in tensors]
    del kept


def _registered(tensors: list[torch.Tensor]) -> None:
    """Pin each source tensor's pages in place, copy from them directly, unpin: no staging."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    done = []
    try:
        for t in tensors:
            err = cudart.cudaHostRegister(t.data_ptr(), t.nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")
            done.append(t)
        out = [t.to("cuda", non_blocking=True) for t in tensors]
        torch.cuda.synchronize()
        del out
    finally:
        for t in done:
            cudart.cudaHostUnregister(t.data_ptr())


def parts(layers: int, width: int, best_copy: float, rounds: int = 5) -> None:
    """Each way on the tensors of a fresh model, the ways taking turns round after round."""
    ways: dict[str, Callable[[nn.Module, torch.optim.Optimizer], object]] = {
        "torchplace.move": _move,
        "the staging ring alone": lambda m, o: _ring(_tensors(m, o)),
        "host packing alone (nothing sent)": lambda m, o: _host_packing(_tensors(m, o)),
        "device allocations alone": lambda m, o: _allocations(_tensors(m, o)),
        "cudaHostRegister + direct copies": lambda m, o: _registered(_tensors(m, o)),
    }
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in ways.items():
            m, o, _ = build(layers, width)
            try:
                seconds = timed(lambda fn=fn, m=m, o=o: fn(m, o))
            except Exception as exc:  # an experiment, not the library: say and go on
                print(f"{name}: failed, {type(exc).__name__}: {exc}")
                continue
            best[name] = min(best.get(name, seconds), seconds)
            del m, o
    for name, seconds in best.items():
        print(f"{name:36s} {seconds * 1e3:8.1f} ms = {best_copy / seconds:.2f} of the pinned copy")
    m, o, _ = build(layers, width)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        _move(m, o)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def _on_device(layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    m, o, _ = build(layers, width)
    torchplace.move(m, "cuda", optimizer=o)
    torch.cuda.synchronize()
    return m, o


def _back_seconds(layers: int, width: int, fn: Mover, rounds: int = 3) -> float:
    """The best of ``rounds`` moves of a model (with Adam state) from the GPU to the host."""
    runs = []
    for _ in range(rounds):
        m, o = _on_device(layers, width)
        runs.append(timed(lambda m=m, o=o: fn(m, o)))
        del m, o
    return min(runs)


def _move_back(m: nn.Module, o: torch.optim.Optimizer) -> None:
    torchplace.move(m, "cpu", optimizer=o)


def _by_hand_back(m: nn.Module, o: torch.optim.Optimizer) -> None:
    by_hand(m, o, "cpu")


def _extra_peak_bytes(layers: int, width: int, nbytes: int) -> int:
    """Device memory a move needs beyond the bytes it moves (staging, consolidated groups)."""
    m, o, _ = build(layers, width)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torchplace.move(m, "cuda", optimizer=o)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before - nbytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--sweep", action="store_true", help="chunk size x ring length")
    parser.add_argument("--parts", action="store_true", help="where a move's time goes")
    parser.add_argument("--rows", help="append the figures as JSON lines to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_move: skipped, no CUDA device (the target applies to a GPU)")
        return 0
    layers, width, rows = args.layers, args.width, args.rows
    nbytes = build(layers, width)[2]
    # The first move of the process pins its staging slots (the pool) and allocates every
    # tensor on the device with cudaMalloc; later moves reuse both.
    first = _seconds(layers, width, rounds=1, warm=False)
    _seconds(layers, width, rounds=1)  # fills the allocator's cache
    best_copy = pinned_copy_seconds(nbytes)
    if args.sweep:
        sweep(layers, width, best_copy)
        return 0
    if args.parts:
        parts(layers, width, best_copy)
        return 0
    saved = (_staging.STAGE_MIN_BYTES, _staging.STAGE_CHUNK_BYTES, _staging.STAGE_BUFFERS)
    results: dict[str, float] = {"torchplace.move": _seconds(layers, width)}
    results["torchplace.move, cold allocator"] = _seconds(layers, width, warm=False)
    _with(1 << 62, saved[1], saved[2])  # no staging: one .to() per tensor
    results["torchplace.move, no staging"] = _seconds(layers, width)
    _with(*saved)
    results["model.to + state loop"] = _seconds(layers, width, by_hand)
    results["the ring alone"] = _seconds(layers, width, lambda m, o: _ring(_tensors(m, o)))
    results["torchplace.move, first in process"] = first
    gbps = nbytes / best_copy / 1e9
    print(f"{nbytes / 2**30:.2f} GiB (parameters, grads, Adam state); pinned copy {gbps:.1f} GB/s")
    for name, seconds in results.items():
        fraction = best_copy / seconds
        print(f"{name:36s} {nbytes / seconds / 1e9:6.1f} GB/s = {fraction:.2f} of the pinned copy")

    best_back = pinned_copy_seconds(nbytes, back=True)
    back: dict[str, float] = {
        "torchplace.move to cpu": _back_seconds(layers, width, _move_back),
        "model.to(cpu) + state loop": _back_seconds(layers, width, _by_hand_back),
        "the ring alone, to cpu": _back_seconds(
            layers, width, lambda m, o: _ring_back(_tensors(m, o))
        ),
    }
    print(f"device to host: pinned copy {nbytes / best_back / 1e9:.1f} GB/s")
    for name, seconds in back.items():
        fraction = best_back / seconds
        print(f"{name:36s} {nbytes / seconds / 1e9:6.1f} GB/s = {fraction:.2f} of the pinned copy")

    extra = _extra_peak_bytes(layers, width, nbytes)
    print(f"GPU peak beyond the moved bytes: {extra / 2**20:.1f} MiB")

    warm = best_copy / results["torchplace.move"]
    cold = best_copy / first
    down = best_back / back["torchplace.move to cpu"]
    verdicts = [
        ("move to GPU, warm, of one pinned copy", warm, TARGET_WARM),
        ("move to GPU, first in process, of one pinned copy", cold, TARGET_FIRST),
        ("move to CPU, of one pinned copy", down, TARGET_WARM),
    ]
    met_all = True
    for what, figure, target in verdicts:
        met = figure >= target
        met_all &= met
        print(f"target {what} >= {target}: {figure:.2f} ({'met' if met else 'MISSED'})")
        add_row(rows, what, figure, f">= {target}x", met)
    add_row(
        rows,
        "the ring alone, to GPU, of one pinned copy",
        best_copy / results["the ring alone"],
        "-",
        None,
    )
    add_row(
        rows,
        "the ring alone, to CPU, of one pinned copy",
        best_back / back["the ring alone, to cpu"],
        "-",
        None,
    )
    add_row(
        rows,
        "model.to + state loop, to GPU, of one pinned copy",
        best_copy / results["model.to + state loop"],
        "-",
        None,
    )
    limit = OWNED_GROUP_BYTES / 2**20
    met = extra <= OWNED_GROUP_BYTES
    met_all &= met
    print(
        f"target GPU peak beyond the moved bytes <= {limit:.0f} MiB: {extra / 2**20:.1f} MiB "
        f"({'met' if met else 'MISSED'})"
    )
    add_row(
        rows,
        "GPU peak beyond the moved bytes",
        extra / 2**20,
        f"<= {limit:.0f} MiB",
        met,
        unit="MiB",
    )
    return 0 if met_all else 1


if __name__ == "__main__":
    sys.exit(main())
