"""Choosing a device: ``device()`` turns any spec into an explicit ``torch.device``.

Indexed device types always come back with their index (``cuda:0``, never bare ``cuda``), because
``torch.device("cuda") != torch.device("cuda:0")`` and tensors always report the indexed form.
Nothing here creates a CUDA context on a device it does not return.
"""

from __future__ import annotations

import os
import re
import sys

import torch

from ._errors import DeviceSpecError, DeviceUnavailableError
from ._suggest import close_matches

__all__ = ["DeviceSpec", "available", "device"]

DeviceSpec = str | int | torch.device | None

# Accelerator types in the order "auto" and "gpu" prefer them.
_ACCELERATORS = ("cuda", "mps", "xpu")
_KEYWORDS = ("auto", "best", "gpu", "cpu", "meta", "cuda", "mps", "xpu")
_NAMES = {"cuda": "CUDA", "mps": "MPS", "xpu": "XPU"}


def faking() -> bool:
    """Whether fake tensors are being made now (a ``FakeTensorMode`` is active, as in
    ``estimate``'s step or a compiler's trace): their devices are stand-ins, and real bytes
    cannot be written into them."""
    try:
        from torch._guards import detect_fake_mode
    except ImportError:  # a torch without it has no fake tensors either
        return False
    return detect_fake_mode() is not None


def count_of(kind: str) -> int:
    """How many devices of an accelerator type this process can see (0 when none)."""
    try:
        if kind == "cuda":
            return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
        if kind == "mps":
            mps = getattr(torch.backends, "mps", None)
            return 1 if mps is not None and mps.is_available() else 0
        module = getattr(torch, kind, None)
        if module is not None and module.is_available():
            return int(module.device_count())
    except (RuntimeError, AssertionError, AttributeError):  # a broken driver counts as none
        return 0
    return 0


def _accelerator() -> str | None:
    """The machine's accelerator type, the first of cuda, mps and xpu that has a device."""
    for kind in _ACCELERATORS:
        if count_of(kind):
            return kind
    return None


def _current_index(kind: str) -> int:
    """The current device index of an accelerator type, without initializing it needlessly."""
    if kind == "cuda":
        initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        return int(torch.cuda.current_device()) if initialized else 0
    if kind == "xpu":
        return int(torch.xpu.current_device())
    return 0


def _nvml_free_memory(index: int) -> int | None:
    """Free bytes on cuda:index read through NVML, which creates no CUDA context.

    NVML is the driver's own library (libnvidia-ml), reached through ctypes so that no extra
    package is needed; ``CUDA_VISIBLE_DEVICES`` is mapped to NVML's numbering as PyTorch does.
    None when NVML cannot answer (no NVIDIA driver, ROCm, an index NVML cannot map).
    """
    import ctypes

    class _Memory(ctypes.Structure):
        _fields_ = [
            ("total", ctypes.c_ulonglong),
            ("free", ctypes.c_ulonglong),
            ("used", ctypes.c_ulonglong),
        ]

    try:
        nvml_index = torch.cuda._get_nvml_device_index(index)
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except Exception:
        return None
    if lib.nvmlInit_v2() != 0:
        return None
    try:
        handle = ctypes.c_void_p()
        memory = _Memory()
        if lib.nvmlDeviceGetHandleByIndex_v2(nvml_index, ctypes.byref(handle)) != 0:
            return None
        if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:
            return None
        return int(memory.free)
    finally:
        lib.nvmlShutdown()


def free_memory(dev: torch.device) -> int | None:
    """Free bytes on an accelerator device, or None when it cannot be read.

    CUDA devices are read through NVML first. Where NVML cannot answer (ROCm, no NVIDIA
    management library) the fallback, ``torch.cuda.mem_get_info``, creates a CUDA context on
    the device it reads: the one case where ``device("best")`` touches devices it does not pick.
    """
    try:
        if dev.type == "cuda":
            index = dev.index if dev.index is not None else _current_index("cuda")
            free = _nvml_free_memory(index)
            if free is None:
                free = int(torch.cuda.mem_get_info(index)[0])
            return free
        if dev.type == "xpu":
            return int(torch.xpu.mem_get_info(dev.index)[0])
    except Exception:  # the figure is a courtesy; never fail because of it
        return None
    return None


def host_available() -> int | None:
    """Bytes of host memory available to a new allocation without swapping: MemAvailable on
    Linux (a kernel that overcommits would let an allocation past it succeed, and then kill
    the process), free pages elsewhere; None when neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def visible_devices(kind: str) -> str:
    """Says which devices of a type are visible, for error messages."""
    count = count_of(kind)
    name = _NAMES.get(kind, kind)
    env_text = ""
    if kind == "cuda":
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        env_text = (
            "CUDA_VISIBLE_DEVICES is not set"
            if env is None
            else f"CUDA_VISIBLE_DEVICES={env}"
            if env.strip()
            else "CUDA_VISIBLE_DEVICES is empty, which hides every GPU"
        )
    if count == 0:
        why = ""
        if kind == "cuda":
            if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
                why = (
                    f" (this PyTorch build ({torch.__version__}) has no CUDA support; "
                    "install a CUDA build of torch)"
                )
            else:
                why = f" (no NVIDIA driver or GPU was found; {env_text})"
        return f"no {name} device is visible{why}; available: {_names(available())}"
    devices = ", ".join(f"{kind}:{i}" for i in range(count))
    plural = "device is" if count == 1 else "devices are"
    extra = f"; {env_text}" if env_text else ""
    return f"{count} {name} {plural} visible ({devices}{extra})"


def _names(devices: list[torch.device]) -> str:
    return ", ".join(str(d) for d in devices)


def _checked(kind: str, index: int | None, spec: object, check: bool = True) -> torch.device:
    """An explicit device of a known type, or DeviceUnavailableError saying what is visible.

    With ``check=False`` only the form is checked, for code that reads devices but never
    touches them (looking at a model built on fake CUDA tensors, planning for absent GPUs).
    """
    if kind in ("cpu", "meta"):
        if index not in (None, 0):
            raise DeviceSpecError(f"{spec!r}: the {kind} device has no index {index}; use '{kind}'")
        return torch.device(kind)
    if kind in _ACCELERATORS:
        count = count_of(kind)
        if index is None:
            index = _current_index(kind) if count else 0
        if check and index >= count:
            raise DeviceUnavailableError(f"{kind}:{index} requested but {visible_devices(kind)}")
        return torch.device(kind, index)
    # Other backends (hpu, mtia, a plug-in's privateuse1...) answer through torch.<kind> once
    # their plug-in is imported; XLA through torch_xla. Without either, no such device exists.
    index = 0 if index is None else index
    module = getattr(torch, kind, None)
    if module is not None and hasattr(module, "device_count"):
        try:
            count = int(module.device_count()) if module.is_available() else 0
        except Exception:
            count = 0
        if check and index >= count:
            raise DeviceUnavailableError(
                f"{kind}:{index} requested but {count} {kind} device(s) are visible"
            )
    elif check and not (kind == "xla" and "torch_xla" in sys.modules):
        raise DeviceUnavailableError(
            f"{spec!r}: this PyTorch has no {kind} backend loaded (no torch.{kind}), so no "
            f"{kind} device exists here; import the backend's PyTorch plug-in first, or pick one "
            f"of {', '.join(map(str, available()))}"
        )
    return torch.device(kind, index)


def _local_rank() -> int | None:
    """``LOCAL_RANK`` as torchrun sets it; None when unset or -1 (the usual "not distributed")."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        return None
    try:
        rank = int(local_rank)
    except ValueError:
        raise DeviceSpecError(
            f"LOCAL_RANK={local_rank!r} is not an integer; torchrun sets it to the process's "
            "rank on this machine, so unset it or launch with torchrun"
        ) from None
    if rank < -1:  # -2 % count would silently pick an accelerator
        raise DeviceSpecError(
            f"LOCAL_RANK={local_rank!r} is negative; torchrun counts ranks from 0, so unset "
            "it or launch with torchrun"
        )
    return rank if rank >= 0 else None


def _local_world() -> int | None:
    """``LOCAL_WORLD_SIZE`` (processes torchrun started on this machine), None when unset."""
    text = os.environ.get("LOCAL_WORLD_SIZE")
    if text is None:
        return None
    try:
        world = int(text)
    except ValueError:
        world = 0
    if world < 1:
        raise DeviceSpecError(
            f"LOCAL_WORLD_SIZE={text!r} is not a positive integer; torchrun sets it to the "
            "number of processes on this machine, so unset it or launch with torchrun"
        )
    return world


def _rank_device(kind: str, rank: int) -> torch.device:
    """The accelerator that local rank ``rank`` owns: its own, never one another rank has."""
    count = count_of(kind)
    world = _local_world()
    fix = (
        f"start at most {count} processes per machine (torchrun --nproc-per-node={count}), "
        "since two ranks cannot share one device"
    )
    if rank >= count:
        raise DeviceUnavailableError(
            f"LOCAL_RANK={rank} needs {kind}:{rank} but {visible_devices(kind)}; {fix}"
        )
    if world is not None and world > count:
        raise DeviceUnavailableError(
            f"LOCAL_WORLD_SIZE={world}: {world} processes on this machine need one "
            f"{_NAMES.get(kind, kind)} device each, but {visible_devices(kind)}; {fix}"
        )
    return torch.device(kind, rank)


def _auto() -> torch.device:
    kind = _accelerator()
    rank = _local_rank()
    if rank is not None:  # under torchrun: the local rank's own accelerator
        return torch.device("cpu") if kind is None else _rank_device(kind, rank)
    if kind is None:
        return torch.device("cpu")
    return torch.device(kind, _current_index(kind))


def _best() -> torch.device:
    kind = _accelerator()
    if kind is None:  # as "auto": the CPU is the best a machine without an accelerator has
        return _auto()
    rank = _local_rank()
    if rank is not None and _local_world() != 1:
        # Several processes on this machine: each would see the same free memory and pick the
        # same device, so each takes its own, as "auto" does.
        return _rank_device(kind, rank)
    best, best_free = 0, -1
    for index in range(count_of(kind)):
        free = free_memory(torch.device(kind, index))
        if free is not None and free > best_free:  # strict: the lowest index wins ties
            best, best_free = index, free
    return torch.device(kind, best)


def _gpu(text: str, spec: DeviceSpec) -> torch.device:
    """``"gpu"`` (the current accelerator) or ``"gpu:N"`` (accelerator N), of this machine's
    accelerator type."""
    index_text = text[4:] if text.startswith("gpu:") else None
    if index_text is not None and not index_text.isdigit():
        raise DeviceSpecError(f"unknown device spec {spec!r}; use 'gpu' or 'gpu:N'")
    if index_text is None:
        kind = _accelerator()
        if kind is None:
            raise DeviceUnavailableError(f"{spec!r} requested but {visible_devices('cuda')}")
        return torch.device(kind, _current_index(kind))
    return _accelerator_index(int(index_text), spec)


def _unknown_spec(text: str, spec: DeviceSpec) -> DeviceSpecError:
    """The error for a spec torch does not parse either, with the nearest known one."""
    name, digits = re.fullmatch(r"(.*?)(\d*)", text.split(":")[0]).groups()  # type: ignore[union-attr]
    guess = close_matches(name, _KEYWORDS, n=1, cutoff=0.5, same=True)
    if guess and digits and guess[0] not in ("auto", "best", "meta"):  # 'cuda0': 'cuda:0'
        guess = [f"{guess[0]}:{int(digits)}"]
    hint = f"did you mean {guess[0]!r}? " if guess else ""
    return DeviceSpecError(
        f"unknown device spec {spec!r}; {hint}use 'auto', 'best', 'gpu', 'cpu', 'meta', "
        "'cuda', 'cuda:N', 'mps', 'xpu:N', an int or a torch.device"
    )


def device(spec: DeviceSpec = "auto", /) -> torch.device:
    """Turn a device spec into an explicit ``torch.device`` that exists on this machine.

    >>> import torchplace
    >>> torchplace.device("cpu")
    device(type='cpu')
    >>> torchplace.device("meta")
    device(type='meta')
    >>> torchplace.device("cdua")
    Traceback (most recent call last):
    ...
    torchplace.DeviceSpecError: unknown device spec 'cdua'; did you mean 'cuda'? ...

    ``"auto"`` (or ``None``) picks ``cuda:LOCAL_RANK`` under torchrun, else the current CUDA
    device, then MPS, then XPU, then the CPU. ``"gpu"`` is the machine's accelerator type, an
    ``int`` N is accelerator N, and ``"best"`` is the accelerator with most free memory (lowest
    index on ties), or the CPU on a machine without one, as for ``"auto"``. A negative index,
    ``-1`` or ``"cuda:-1"`` alike, is a ``DeviceSpecError``.

    Under torchrun no two local ranks share an accelerator: with several processes on the
    machine (``LOCAL_WORLD_SIZE`` above 1, or unset beside ``LOCAL_RANK``), ``"best"`` is the
    local rank's own device, as ``"auto"`` is (ranks that each chose by free memory would all
    choose the same one), and both raise ``DeviceUnavailableError`` when the machine has fewer
    accelerators than processes; with one process per machine, ``"best"`` still chooses by
    free memory.
    """
    if spec is None:
        return _auto()
    if isinstance(spec, torch.device):
        return _checked(spec.type, spec.index, spec)
    if isinstance(spec, bool) or not isinstance(spec, (str, int)):
        raise DeviceSpecError(
            f"a device spec is a str, int, torch.device or None, not {type(spec).__name__} "
            f"({spec!r}); for example torchplace.device('cuda:0')"
        )
    if isinstance(spec, int):
        return _accelerator_index(spec, spec)
    text = spec.strip().lower()
    negative = re.fullmatch(r"(?:[a-z_0-9]+:)?\s*(-\d+)", text)
    if negative:  # torch would call it no device at all: said as for the int
        raise _negative_index(int(negative.group(1)))
    if text == "auto":
        return _auto()
    if text == "best":
        return _best()
    if text == "gpu" or text.startswith("gpu:"):
        return _gpu(text, spec)
    try:
        parsed = torch.device(text)
    except (RuntimeError, ValueError):
        raise _unknown_spec(text, spec) from None
    return _checked(parsed.type, parsed.index, spec)


def normalize(spec: DeviceSpec) -> torch.device:
    """Like ``device``, but an explicit device need not exist here (for reading, not moving)."""
    if isinstance(spec, torch.device):
        return _checked(spec.type, spec.index, spec, check=False)
    if (
        isinstance(spec, str)
        and spec.strip().lower() not in ("auto", "best")
        and not (spec.strip().lower().startswith("gpu"))
    ):
        try:
            parsed = torch.device(spec.strip().lower())
        except (RuntimeError, ValueError):
            return device(spec)  # raises DeviceSpecError with its suggestion
        return _checked(parsed.type, parsed.index, spec, check=False)
    return device(spec)


def _negative_index(index: int) -> DeviceSpecError:
    """The error for a negative device index, one for every spelling (``-1``, ``"cuda:-1"``)."""
    return DeviceSpecError(f"device index {index} is negative; accelerators count from 0")


def _accelerator_index(index: int, spec: object) -> torch.device:
    if index < 0:
        raise _negative_index(index)
    kind = _accelerator()
    if kind is None:
        raise DeviceUnavailableError(f"accelerator {index} requested but {visible_devices('cuda')}")
    return _checked(kind, index, spec)


def accelerator_type() -> str:
    """The type ``"gpu"`` names here: the machine's accelerator's, or ``cuda`` on a machine
    without one (for naming a device that need not exist here, such as a checkpoint's tag)."""
    return _accelerator() or "cuda"


def available() -> list[torch.device]:
    """Every usable device, accelerators first and ``cpu`` last.

    >>> import torchplace
    >>> torchplace.available()[-1]
    device(type='cpu')
    """
    devices = [torch.device(kind, i) for kind in _ACCELERATORS for i in range(count_of(kind))]
    devices.append(torch.device("cpu"))
    return devices
