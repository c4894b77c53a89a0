"""``torchplace bench``: how fast bytes cross between host and device, copy by copy.

For each direction it times one large copy from pageable and from pinned host memory, then a
few hundred small tensors copied one by one with ``.to()`` and as one consolidated copy. Each
figure is given in GB/s and as a fraction of the best single large copy in that direction,
which is what the hardware can do. Without an accelerator it says so and times what the host
can do alone: a large memory copy, and the small tensors cloned one by one or packed and split.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .._devices import device as _parse_device
from .._devices import free_memory
from .._devices import host_available as _host_available
from .._errors import TorchplaceError, first_line
from .._sizes import format_bytes
from ..moving._consolidate import consolidated_copy, pack_and_copy, packed_host_copy

__all__ = ["Measurement", "check_memory", "measure", "register"]

_SMALL_NUMELS = (256, 1024, 4096)  # float32 elements: 1, 4 and 16 KiB, in turn


@dataclass(frozen=True)
class Measurement:
    """One timed copy: which way, of what, how fast, and how close to the best large copy."""

    direction: str  # "host-to-device", "device-to-host" or "host" (no accelerator)
    copy: str  # "pageable", "pinned", "per-tensor" or "consolidated"
    bytes: int
    tensors: int
    seconds: float
    gb_per_s: float
    fraction: float  # of the best single large copy in the same direction


def register(subparsers: Any) -> None:
    """Add the ``bench`` sub-command to the ``torchplace`` command line.

    >>> import argparse
    >>> from torchplace.cli._bench import register
    >>> parser = argparse.ArgumentParser(prog="torchplace")
    >>> register(parser.add_subparsers(dest="command"))
    >>> args = parser.parse_args(["bench", "--device", "cpu", "--json"])
    >>> args.device, args.json, args.size, args.tensors
    ('cpu', True, 256, 500)
    """
    parser = subparsers.add_parser(
        "bench",
        help="copy bandwidth: pageable, pinned, per-tensor and consolidated",
        description=(
            "Time host-to-device and device-to-host copies (pageable, pinned, many small "
            "tensors one by one and consolidated) and give each as GB/s and as a fraction of "
            "the best single large copy."
        ),
    )
    parser.add_argument(
        "--device", default=None, help="device to measure (default: this machine's accelerator)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--size", type=_positive, default=256, metavar="MIB", help="MiB in the large copies"
    )
    parser.add_argument(
        "--tensors", type=_positive, default=500, metavar="N", help="number of small tensors"
    )
    parser.add_argument(
        "--repeat",
        type=_repeat,
        default=5,
        metavar="R",
        help=f"timed runs, 1 to {MAX_REPEAT} (best kept)",
    )
    parser.set_defaults(func=run)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0, got {text!r}")
    return value


# Each timed run copies every buffer once more: past this, a typo (--repeat 50000), not a plan.
MAX_REPEAT = 1000


def _repeat(text: str) -> int:
    value = _positive(text)
    if value > MAX_REPEAT:
        raise argparse.ArgumentTypeError(
            f"expected 1 to {MAX_REPEAT} timed runs, got {text!r}; the best of a few runs is "
            "the figure (the default is 5)"
        )
    return value


def run(args: argparse.Namespace) -> int:
    """Run ``torchplace bench`` with parsed arguments: 0 when measured, 1 when the copies could
    not run (out of memory), 2 for a bad device, or a ``--size`` or ``--tensors`` past the
    memory available (checked before anything is allocated)."""
    try:
        target, note = _choose(args.device)
    except TorchplaceError as exc:
        print(f"torchplace bench: {exc}", file=sys.stderr)
        return 2
    if args.size << 20 >= 1 << 63:  # torch sizes are 64-bit: past that, not even an allocation
        print(
            f"torchplace bench: --size {args.size} MiB is more bytes than a tensor can hold; "
            "try a smaller --size",
            file=sys.stderr,
        )
        return 2
    try:
        check_memory(target, args.size, args.tensors)
    except TorchplaceError as exc:
        print(f"torchplace bench: {exc}", file=sys.stderr)
        return 2
    try:
        results = measure(target, size=args.size << 20, tensors=args.tensors, repeat=args.repeat)
    except (RuntimeError, MemoryError) as exc:  # out of host or device memory, a failing device
        print(
            f"torchplace bench: the copies of --size {args.size} MiB and --tensors "
            f"{args.tensors} could not run on {target} ({first_line(exc)}); try a smaller --size",
            file=sys.stderr,
        )
        return 1
    if args.json:
        payload = {
            "device": str(target),
            "accelerator": target.type != "cpu",
            "note": note,
            "size_bytes": args.size << 20,
            "tensors": args.tensors,
            "results": [asdict(m) for m in results],
        }
        print(json.dumps(payload, indent=2))
    else:
        _render(target, note, results)
    return 0


def _choose(spec: str | None) -> tuple[torch.device, str | None]:
    """The device to measure and, when there is no accelerator, a note saying so."""
    auto = spec is None or spec.strip().lower() == "auto"
    if spec is None:
        target = _parse_device("auto")
    else:
        try:
            # "0" on a command line means accelerator 0, as the int 0 does in Python.
            target = _parse_device(int(spec) if spec.strip().isdecimal() else spec)
        except TorchplaceError as exc:
            raise type(exc)(f"--device {spec}: {exc}") from exc
    if target.type == "meta":
        raise TorchplaceError(
            "--device meta: meta tensors have no data, so no copy can be timed; "
            "use cpu or an accelerator"
        )
    if target.type != "cpu":
        return target, None
    why = "no accelerator was found" if auto else "the CPU was asked for"
    return target, (
        f"{why}: only host memory copies were measured (a large copy, small tensors cloned one "
        "by one and packed/split as in a consolidated copy); pinned memory needs an accelerator"
    )


_TENSOR_OVERHEAD = 512  # host bytes a small tensor costs beyond its data (object, storage)
_SHARE = 0.9  # of the memory available: the rest is left to everything else on the machine


def _small_bytes(tensors: int) -> int:
    """The data bytes of ``tensors`` small tensors as ``measure`` makes them."""
    whole, part = divmod(tensors, len(_SMALL_NUMELS))
    return 4 * (whole * sum(_SMALL_NUMELS) + sum(_SMALL_NUMELS[:part]))


def _pinned(nbytes: int) -> int:
    """What a pinned buffer takes: PyTorch's host allocator rounds it up to a power of two."""
    return 1 << max(nbytes - 1, 0).bit_length()


def _needs(target: torch.device, size_mib: int, tensors: int) -> dict[str, int]:
    """Peak bytes ``measure`` allocates, by where: ``host`` and, for an accelerator, ``device``.

    At most three sets of the small tensors live at once (the originals, a set of copies, one
    packed buffer), each costing its data and the tensors' own overhead on the host.
    """
    size = size_mib << 20
    small = _small_bytes(tensors)
    if target.type == "cpu":  # source and destination of the large copy
        return {"host": 2 * size + 3 * (small + tensors * _TENSOR_OVERHEAD)}
    pinned = 2 * _pinned(size) if target.type == "cuda" else 0  # one each way
    return {
        "host": 2 * size + pinned + 3 * (small + tensors * _TENSOR_OVERHEAD),
        "device": size + 3 * small,
    }


def _largest(fits: Callable[[int], bool], start: int) -> int:
    """The largest value from 1 to ``start`` for which ``fits`` holds (it holds for all below
    it), or 0 when it holds for none."""
    low, high = 0, start
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def check_memory(target: torch.device, size_mib: int, tensors: int) -> None:
    """Refuse, before anything is allocated, a ``--size`` or ``--tensors`` whose copies need
    more memory than the host (or the device) has available; the error names the flag, what it
    needs, what there is, and the largest value that fits.

    >>> import torch
    >>> from torchplace.cli._bench import check_memory
    >>> check_memory(torch.device("cpu"), 1, 12)  # a MiB and twelve tensors fit anywhere
    """
    available = {"host": _host_available()}
    if target.type != "cpu":
        available["device"] = free_memory(target)
    for where, have in available.items():
        if have is not None:  # not known: the copies are tried, and a failure is reported
            _check_one(target, where, have, size_mib, tensors)


def _check_one(target: torch.device, where: str, have: int, size_mib: int, tensors: int) -> None:
    """``check_memory`` for one kind of memory (``host`` or ``device``), ``have`` available."""
    limit = int(have * _SHARE)

    def need(size: int, count: int) -> int:
        return _needs(target, size, count)[where]

    total = need(size_mib, tensors)
    if total <= limit:
        return
    what = "host memory" if where == "host" else f"memory on {target}"
    large = need(size_mib, 0)
    small = f"{format_bytes(total - large)} for the small tensors"
    best_size = _largest(lambda v: need(v, tensors) <= limit, size_mib)  # --tensors as given
    best_count = _largest(lambda v: need(size_mib, v) <= limit, tensors)  # --size as given
    if best_size and (large >= total - large or not best_count):  # --size asks the most
        flag, fix = f"--size {size_mib} MiB", f"use --size {best_size} or less"
        part = f"with --tensors {tensors}, the copies need about {format_bytes(total)} "
        part += f"({format_bytes(large)} for the large copies)"
    elif best_count:
        flag, fix = f"--tensors {tensors}", f"use --tensors {best_count} or less"
        part = f"with --size {size_mib} MiB, the copies need about {format_bytes(total)} ({small})"
    else:  # neither alone can shrink enough: each gets half
        half, base = limit // 2, need(0, 0)  # base: counted once, with the sizes
        sizes = _largest(lambda v: need(v, 0) <= half, size_mib)
        counts = _largest(lambda v: need(0, v) - base <= half, tensors)
        flag = f"--size {size_mib} MiB with --tensors {tensors}"
        fix = f"use --size {max(sizes, 1)} and --tensors {max(counts, 1)} or less"
        part = f"the copies need about {format_bytes(total)} ({format_bytes(large)} for the "
        part += f"large copies, {small})"
    raise TorchplaceError(
        f"{flag} needs more {what} than is available: {part}, and bench takes at most "
        f"{_SHARE:.0%} of the {format_bytes(have)} available, {format_bytes(limit)}; {fix}"
    )


def measure(
    target: torch.device, /, *, size: int = 256 << 20, tensors: int = 500, repeat: int = 5
) -> list[Measurement]:
    """Time the copies for ``target`` (an accelerator, or the CPU alone).

    >>> import torch
    >>> from torchplace.cli._bench import measure
    >>> rows = measure(torch.device("cpu"), size=1 << 20, tensors=10, repeat=1)
    >>> [(m.direction, m.copy) for m in rows]  # doctest: +NORMALIZE_WHITESPACE
    [('host', 'pageable'), ('host', 'per-tensor'), ('host', 'consolidated')]
    """
    numel = max(size // 4, 1)
    small = [torch.rand(_SMALL_NUMELS[i % len(_SMALL_NUMELS)]) for i in range(tensors)]
    if target.type == "cpu":
        return _rates(_host_rows(target, numel, small, repeat))

    small_bytes = sum(t.nbytes for t in small)
    rows: list[tuple[str, str, int, int, float]] = []
    sync = _sync_for(target)
    pinned_ok = target.type == "cuda"
    host = torch.rand(numel)
    on_device = torch.empty(numel, device=target)
    h2d = "host-to-device"
    rows.append(
        (h2d, "pageable", host.nbytes, 1, _time(lambda: on_device.copy_(host), sync, repeat))
    )
    if pinned_ok:
        pinned = host.pin_memory()
        copy_pinned = lambda: on_device.copy_(pinned, non_blocking=True)  # noqa: E731
        rows.append((h2d, "pinned", host.nbytes, 1, _time(copy_pinned, sync, repeat)))
    per_tensor = lambda: [t.to(target) for t in small]  # noqa: E731
    rows.append((h2d, "per-tensor", small_bytes, tensors, _time(per_tensor, sync, repeat)))
    # As a batch travels by default: one packed copy, each result owning its storage.
    together = lambda: packed_host_copy(small, target, non_blocking=True)  # noqa: E731
    rows.append((h2d, "consolidated", small_bytes, tensors, _time(together, sync, repeat)))

    rows += _device_to_host_rows(on_device, small, target, sync, repeat)
    return _rates(rows)


def _host_rows(
    target: torch.device, numel: int, small: list[torch.Tensor], repeat: int
) -> list[tuple[str, str, int, int, float]]:
    """The CPU alone: a large copy, the small tensors one by one, and packed together."""
    tensors = len(small)
    small_bytes = sum(t.nbytes for t in small)
    rows: list[tuple[str, str, int, int, float]] = []
    sync: Callable[[], None] = _no_sync
    src = torch.rand(numel)
    dst = torch.empty_like(src)
    rows.append(("host", "pageable", src.nbytes, 1, _time(lambda: dst.copy_(src), sync, repeat)))
    rows.append(
        (
            "host",
            "per-tensor",
            small_bytes,
            tensors,
            _time(lambda: [t.clone() for t in small], sync, repeat),
        )
    )
    pack = lambda: pack_and_copy(small, target, pin=False, non_blocking=False)  # noqa: E731
    rows.append(("host", "consolidated", small_bytes, tensors, _time(pack, sync, repeat)))
    return rows


def _device_to_host_rows(
    on_device: torch.Tensor,
    small: list[torch.Tensor],
    target: torch.device,
    sync: Callable[[], None],
    repeat: int,
) -> list[tuple[str, str, int, int, float]]:
    """Back from ``target``: a large copy (pageable, then pinned on CUDA), the small tensors one
    by one, and packed together."""
    numel, tensors = on_device.numel(), len(small)
    small_bytes = sum(t.nbytes for t in small)
    pinned_ok = target.type == "cuda"
    d2h = "device-to-host"
    rows: list[tuple[str, str, int, int, float]] = []
    cpu = torch.device("cpu")
    back = torch.empty(numel)
    rows.append(
        (d2h, "pageable", back.nbytes, 1, _time(lambda: back.copy_(on_device), sync, repeat))
    )
    if pinned_ok:
        landing = torch.empty(numel, pin_memory=True)
        copy_back = lambda: landing.copy_(on_device, non_blocking=True)  # noqa: E731
        rows.append((d2h, "pinned", back.nbytes, 1, _time(copy_back, sync, repeat)))
    small_on_device = [t.to(target) for t in small]
    each_back = lambda: [t.to(cpu) for t in small_on_device]  # noqa: E731
    rows.append((d2h, "per-tensor", small_bytes, tensors, _time(each_back, sync, repeat)))
    all_back = lambda: consolidated_copy(small_on_device, cpu)  # noqa: E731
    rows.append((d2h, "consolidated", small_bytes, tensors, _time(all_back, sync, repeat)))
    return rows


def _no_sync() -> None:
    return None


def _sync_for(target: torch.device) -> Callable[[], None]:
    if target.type == "cuda":
        return lambda: torch.cuda.synchronize(target)
    module = getattr(torch, target.type, None)
    synchronize = getattr(module, "synchronize", None)
    if callable(synchronize):
        return lambda: synchronize()
    return _no_sync


def _time(fn: Callable[[], object], sync: Callable[[], None], repeat: int) -> float:
    """Best wall-clock seconds of ``fn`` over ``repeat`` runs, after one warm-up run.

    The best run, not the median: what is measured is what the hardware can do, and slower runs
    measure whatever else the machine was doing.
    """
    fn()
    sync()
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return max(min(times), 1e-9)


def _rates(rows: list[tuple[str, str, int, int, float]]) -> list[Measurement]:
    best: dict[str, float] = {}
    for direction, copy, nbytes, _, seconds in rows:
        if copy in ("pageable", "pinned"):  # the large copies (--tensors 1 makes others single)
            best[direction] = max(best.get(direction, 0.0), nbytes / seconds / 1e9)
    out = []
    for direction, copy, nbytes, count, seconds in rows:
        rate = nbytes / seconds / 1e9
        out.append(
            Measurement(direction, copy, nbytes, count, seconds, rate, rate / best[direction])
        )
    return out


def _render(target: torch.device, note: str | None, results: list[Measurement]) -> None:
    from rich.console import Console  # rich loads only when rendering
    from rich.table import Table

    table = Table(title=f"torchplace bench: copies with {target}", caption=note)
    for name, justify in (
        ("direction", "left"),
        ("copy", "left"),
        ("size", "right"),
        ("tensors", "right"),
        ("GB/s", "right"),
        ("of best", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for m in results:
        table.add_row(
            m.direction,
            m.copy,
            f"{m.bytes / 2**20:.1f} MiB",
            str(m.tensors),
            f"{m.gb_per_s:.2f}",
            f"{m.fraction:.0%}",
        )
    Console().print(table)
