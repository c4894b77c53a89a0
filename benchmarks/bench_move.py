"""Moving a model with its Adam state to a GPU, as a fraction of one large pinned copy's bandwidth.

Target (docs/design.md): ``torchplace.move(model, "cuda", optimizer=adam)`` reaches 85% of the
bandwidth of a single pinned host-to-device copy of the same number of bytes. Side by side:
``model.to("cuda")`` plus the by-hand optimizer-state loop people write.

    python benchmarks/bench_move.py [--layers 24] [--width 2048] [--sweep]

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
import time
from collections.abc import Callable

import torch
from torch import nn

import torchplace
from torchplace.moving import _staging


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


def pinned_copy_seconds(nbytes: int) -> float:
    """The best time of one pinned host-to-device copy of ``nbytes``."""
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    landing = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    landing.copy_(pinned, non_blocking=True)  # warm up
    return min(timed(lambda: landing.copy_(pinned, non_blocking=True)) for _ in range(5))


def by_hand(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.to("cuda")
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                state[key] = value.to("cuda")


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
    stager = _staging.Stager(torch.device("cuda", torch.cuda.current_device()))
    for t in tensors:
        stager.copy(t) if _staging.stageable(t, stager.device) else t.to("cuda")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--sweep", action="store_true", help="chunk size x ring length")
    parser.add_argument("--parts", action="store_true", help="where a move's time goes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_move: skipped, no CUDA device (the target applies to a GPU)")
        return
    nbytes = build(args.layers, args.width)[2]
    # The first move of the process pins its ring buffers and allocates every tensor on the
    # device with cudaMalloc; later moves reuse both from PyTorch's caches.
    first = _seconds(args.layers, args.width, rounds=1, warm=False)
    _seconds(args.layers, args.width, rounds=1)  # fills the allocator's cache
    best_copy = pinned_copy_seconds(nbytes)
    if args.sweep:
        sweep(args.layers, args.width, best_copy)
        return
    if args.parts:
        parts(args.layers, args.width, best_copy)
        return
    saved = (_staging.STAGE_MIN_BYTES, _staging.STAGE_CHUNK_BYTES, _staging.STAGE_BUFFERS)
    results: dict[str, float] = {"torchplace.move": _seconds(args.layers, args.width)}
    results["torchplace.move, cold allocator"] = _seconds(args.layers, args.width, warm=False)
    _with(1 << 62, saved[1], saved[2])  # no staging: one .to() per tensor
    results["torchplace.move, no staging"] = _seconds(args.layers, args.width)
    _with(*saved)
    results["model.to + state loop"] = _seconds(args.layers, args.width, by_hand)
    results["torchplace.move, first in process"] = first
    gbps = nbytes / best_copy / 1e9
    print(f"{nbytes / 2**30:.2f} GiB (parameters, grads, Adam state); pinned copy {gbps:.1f} GB/s")
    for name, seconds in results.items():
        fraction = best_copy / seconds
        print(f"{name:36s} {nbytes / seconds / 1e9:6.1f} GB/s = {fraction:.2f} of the pinned copy")
    fraction = best_copy / results["torchplace.move"]
    verdict = "met" if fraction >= 0.85 else "MISSED"
    print(f"target >= 0.85 (warm allocator): {fraction:.2f} ({verdict})")


if __name__ == "__main__":
    main()
