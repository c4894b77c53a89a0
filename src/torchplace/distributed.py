"""Many machines: ``setup()`` makes the device side of ``torch.distributed`` right under torchrun.

PyTorch's own ``torch.distributed`` is the engine (torchrun starts the processes, DDP and FSDP
train); torchplace does not re-implement any of it. ``setup()`` does the part that goes wrong
by hand: it reads what torchrun set, picks this process's device from ``LOCAL_RANK``, makes it
the current device, and initializes the process group with the backend that device needs
(NCCL for CUDA, Gloo for the CPU). ``verify()`` is ``torchplace.verify`` as a collective: every
rank raises the same error, naming the stragglers by rank, or every rank returns. See
``docs/distributed.md`` for whole training scripts (DDP, FSDP2 from a pretrained checkpoint,
tensor parallelism).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ._devices import count_of, visible_devices
from ._devices import device as _device
from ._errors import (
    DeviceSpecError,
    DeviceUnavailableError,
    PlacementError,
    Straggler,
    TorchplaceError,
    first_line,
)

__all__ = ["setup", "verify"]

# What torchrun sets in every process it starts.
_TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


def _env_int(name: str) -> int:
    text = os.environ[name]
    try:
        value = int(text)
    except ValueError:
        raise DeviceSpecError(
            f"{name}={text!r} is not an integer; torchrun sets it, so launch with torchrun "
            f"instead of setting {name} by hand"
        ) from None
    if value < 0:
        raise DeviceSpecError(f"{name}={value} is negative; torchrun counts ranks from 0")
    return value


def _local_device(local_rank: int) -> torch.device:
    """The accelerator this process owns (``LOCAL_RANK``), or the CPU on a machine without one."""
    auto = _device("auto")  # under torchrun: accelerator LOCAL_RANK % count, or the CPU
    if auto.type in ("cpu", "mps"):
        return auto
    count = count_of(auto.type)
    if local_rank >= count:
        raise DeviceUnavailableError(
            f"LOCAL_RANK={local_rank} needs {auto.type}:{local_rank} but "
            f"{visible_devices(auto.type)}; start at most {count} processes per machine "
            f"(torchrun --nproc-per-node={count}), since two ranks cannot share one device"
        )
    return torch.device(auto.type, local_rank)


def _check_backend(backend: object, dev: torch.device) -> str:
    import torch.distributed as dist

    if not isinstance(backend, str):
        raise DeviceSpecError(
            f"backend={backend!r} is not a backend name; pass a str such as 'nccl' or 'gloo', "
            "or None to choose by device"
        )
    name = backend.lower()
    known = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    if name not in dist.Backend.backend_list and ":" not in name:  # "cpu:gloo,cuda:nccl" maps
        raise DeviceSpecError(
            f"backend={backend!r} is not a torch.distributed backend; use one of "
            f"{', '.join(known)}, or None to choose by device"
        )
    if name == "nccl" and dev.type != "cuda":
        raise DeviceSpecError(
            f"backend={backend!r} needs CUDA devices but this process runs on {dev}; "
            "use backend='gloo' (or None to choose)"
        )
    available = getattr(dist, "is_backend_available", None)  # torch 2.5 and later
    if ":" not in name and available is not None and not available(name):
        usable = [b for b in known if available(b)]
        raise DeviceSpecError(
            f"backend={backend!r} is not available in this PyTorch build; usable here: "
            f"{', '.join(usable) or 'none'}"
        )
    return name


def _set_current(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif dev.type == "xpu":
        torch.xpu.set_device(dev)


def _torchrun_local_rank() -> int:
    """LOCAL_RANK, once torchrun's variables are checked to be what torchrun would set."""
    local_rank = _env_int("LOCAL_RANK")
    port = _env_int("MASTER_PORT")
    if not 0 < port < 65536:
        raise DeviceSpecError(
            f"MASTER_PORT={port} is not a TCP port (1 to 65535); torchrun sets it from "
            "--master-port or --rdzv-endpoint"
        )
    world_size, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    if rank >= world_size:
        raise DeviceSpecError(
            f"RANK={rank} is not below WORLD_SIZE={world_size}; launch with torchrun"
        )
    if "LOCAL_WORLD_SIZE" in os.environ:
        local_world = _env_int("LOCAL_WORLD_SIZE")
        if local_rank >= local_world or local_rank > rank:
            raise DeviceSpecError(
                f"LOCAL_RANK={local_rank} does not fit LOCAL_WORLD_SIZE={local_world} and "
                f"RANK={rank}: torchrun would never set these; launch with torchrun"
            )
    return local_rank


def _make_current(dev: torch.device, local_rank: int) -> None:
    """Make ``dev`` this process's current device, or say why it could not be."""
    try:
        _set_current(dev)
    except Exception as exc:  # a busy GPU (exclusive compute mode), a broken driver
        raise DeviceUnavailableError(
            f"setup() could not make {dev} the current device for LOCAL_RANK={local_rank}: "
            f"{type(exc).__name__}: {first_line(exc)}; check with nvidia-smi that no other "
            "process holds it and that CUDA_VISIBLE_DEVICES lists this machine's GPUs"
        ) from exc


def _start_group(name: str, dev: torch.device, under_torchrun: bool) -> None:
    """Start the default process group on backend ``name``: from torchrun's variables, or as a
    group of one; a failure leaves no group behind and says where to look."""
    import torch.distributed as dist

    options: dict[str, object] = {}
    if dev.type == "cuda":
        options["device_id"] = dev  # binds NCCL to this device from the start
    try:
        if under_torchrun:
            dist.init_process_group(backend=name, **options)  # type: ignore[arg-type]
        else:
            dist.init_process_group(
                backend=name,
                store=dist.HashStore(),  # type: ignore[attr-defined]
                rank=0,
                world_size=1,
                **options,  # type: ignore[arg-type]
            )
    except Exception as exc:  # a rendezvous that failed or timed out, a backend that broke
        if dist.is_initialized():  # it failed after the group was made (TORCH_DIST_INIT_BARRIER)
            dist.destroy_process_group()
        if under_torchrun:
            where = (
                f"MASTER_ADDR={os.environ.get('MASTER_ADDR')!r}, "
                f"MASTER_PORT={os.environ.get('MASTER_PORT')!r}"
            )
            fix = (
                "Check that every rank can reach MASTER_ADDR on MASTER_PORT and that all were "
                "started with the same torchrun arguments"
            )
        else:  # no rendezvous, no MASTER_ADDR: the backend itself failed
            where = "a group of one process"
            fix = (
                "A group of one needs no other process, so the backend itself failed: for gloo, "
                "set GLOO_SOCKET_IFNAME to an interface this machine has (lo), for nccl, run "
                "with NCCL_DEBUG=INFO to see why"
            )
        raise TorchplaceError(
            f"torch.distributed could not start the {name} process group for {dev} ({where}): "
            f"{type(exc).__name__}: {first_line(exc)}. {fix}"
        ) from exc


def setup(backend: str | None = None, *, single_process: bool = False) -> torch.device:
    """Under torchrun: pick this process's device, make it current, start ``torch.distributed``.

    >>> import torch.distributed as dist
    >>> import torchplace.distributed
    >>> dev = torchplace.distributed.setup(single_process=True)  # one process, no torchrun
    >>> dev.type in ("cpu", "cuda"), dist.get_rank(), dist.get_world_size()
    (True, 0, 1)
    >>> dist.destroy_process_group()

    Returns ``cuda:LOCAL_RANK`` (or the CPU on a machine without an accelerator), after making
    it the current device and initializing the default process group from torchrun's
    variables: NCCL for CUDA and Gloo for the CPU unless ``backend`` names another. Call it
    once at the top of the script; a second call returns the device without starting a new
    group. Outside torchrun it raises, naming the missing variables, unless
    ``single_process=True``, which starts a group of one (for a quick run without torchrun).
    Wrap the model with ``DistributedDataParallel`` or ``FullyShardedDataParallel`` after
    moving it to the returned device.
    """
    import torch.distributed as dist  # loaded only when asked for

    if not dist.is_available():
        raise TorchplaceError(
            f"this PyTorch build ({torch.__version__}) has no torch.distributed support; "
            "install a build from pytorch.org"
        )
    missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
    under_torchrun = not missing
    if not under_torchrun and dist.is_initialized() and dist.get_world_size() == 1:
        return _local_device(0)  # a second call after setup(single_process=True)
    if not under_torchrun and not single_process:
        raise TorchplaceError(
            f"setup() runs under torchrun, which sets {', '.join(_TORCHRUN_VARIABLES)}, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set; launch with "
            "'torchrun --nproc-per-node=N train.py' (for several machines, run on each "
            "'torchrun --nnodes=M --nproc-per-node=N --rdzv-backend=c10d "
            "--rdzv-endpoint=HOST:29400 --rdzv-id=JOB train.py' with the same HOST and JOB), or "
            "call setup(single_process=True) to run one process"
        )
    local_rank = _torchrun_local_rank() if under_torchrun else 0
    dev = _local_device(local_rank)
    name = _check_backend(backend, dev) if backend is not None else _BACKENDS.get(dev.type)
    if name is None:
        name = dist.Backend.default_device_backend_map.get(dev.type, "gloo")
    _make_current(dev, local_rank)
    if dist.is_initialized():
        return dev
    _start_group(name, dev, under_torchrun)
    return dev


_SHOWN = 20  # straggler lines an error shows, over all ranks


def _local_report(obj: Any, device: Any, optimizer: Any) -> tuple[str, list[str], list[Straggler]]:
    """("", [], []) when this rank's objects are in place; else (error class, lines, the
    stragglers found)."""
    from ._devices import normalize
    from ._tensor_size import nbytes
    from .looking._inspect import fix_for, misplaced

    try:
        target = normalize(device)
        lines = []
        bad = misplaced(obj, target, optimizer)
        rebuild = target.type != "meta" and any(e.non_persistent and e.tensor.is_meta for e in bad)
        for e in bad:
            where = f"is on {e.tensor.device}" + (
                ", expected cpu" if e.host else f", expected {target}"
            )
            if e.stale:
                where = f"is on {e.tensor.device}, held for a replaced parameter"
            fix = fix_for(e, target, rebuild=rebuild)
            lines.append(f"{e.name} ({e.kind}) {where}; fix: {fix}")
    except Exception as exc:  # the check itself failed here: every rank must still hear of it
        kind = type(exc).__name__ if isinstance(exc, TorchplaceError) else "TorchplaceError"
        return kind, [f"the check itself failed: {type(exc).__name__}: {first_line(exc)}"], []
    stragglers = [Straggler(e.name, e.kind, e.tensor.device, nbytes(e.tensor)) for e in bad]
    return ("PlacementError", lines, stragglers) if lines else ("", [], [])


def verify(obj: Any, device: Any, /, *, optimizer: Any = None, group: Any = None) -> None:
    """Collective ``torchplace.verify``: every rank raises the same error, or every rank returns.

    >>> import torch, torch.distributed as dist, torchplace.distributed
    >>> dev = torchplace.distributed.setup(single_process=True)
    >>> torchplace.distributed.verify(torch.nn.Linear(2, 2), "cpu")
    >>> torchplace.distributed.verify(torch.nn.Linear(2, 2), "meta")
    Traceback (most recent call last):
    ...
    torchplace.PlacementError: 2 tensors on 1 of 1 ranks are not where they should be: ...
    >>> dist.destroy_process_group()

    Each rank checks its own ``obj`` (and ``optimizer``) against its own ``device`` (each rank
    passes the device ``setup()`` gave it), then the ranks of ``group`` (default: all) share
    what they found with ``all_gather_object``. If any rank has a tensor out of place, every
    rank raises the same ``PlacementError``, naming the stragglers by rank
    (``rank 3: encoder.weight (parameter) is on cpu, expected cuda:3; fix: ...``), so no rank
    goes on to a collective that the others never reach; ``stragglers`` holds every rank's in
    rank order. A rank whose check fails (a bad device spec) is reported alike, the error
    taking its class. Call it on every rank of ``group``, as any collective.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise TorchplaceError(
            "torchplace.distributed.verify() is a collective, but torch.distributed is not "
            "initialized; call torchplace.distributed.setup() first, or use torchplace.verify "
            "in a single process"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TorchplaceError(
            f"torchplace.distributed.verify(): group={group!r} is not a process group; pass "
            "one made by torch.distributed.new_group (or a device mesh's get_group()), or leave "
            "it out to check every rank"
        )
    mine = _local_report(obj, device, optimizer)
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, mine, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(found))
    failing = [(rank, report) for rank, report in zip(ranks, found, strict=True) if report[0]]
    if not failing:
        return
    lines = [f"  - rank {rank}: {line}" for rank, (_, texts, _) in failing for line in texts]
    total = len(lines)
    if total > _SHOWN:
        lines = [*lines[:_SHOWN], f"  ... and {total - _SHOWN} more"]
    kinds = [kind for _, (kind, _, _) in failing if kind != "PlacementError"]
    if kinds:  # a check failed: the error of the first such rank, on every rank
        from . import _errors

        error = getattr(_errors, kinds[0], TorchplaceError)
        raise error(
            f"the placement check failed on {len(failing)} of {len(found)} ranks:\n"
            + "\n".join(lines)
        )
    raise PlacementError(
        f"{total} tensor{'s' if total != 1 else ''} on {len(failing)} of {len(found)} ranks "
        f"{'are' if total != 1 else 'is'} not where they should be:\n" + "\n".join(lines),
        stragglers=[s for _, (_, _, found_here) in failing for s in found_here],
    )
