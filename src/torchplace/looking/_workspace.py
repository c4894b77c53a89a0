"""cuBLAS workspaces: device memory a CUDA step holds that no tensor of the step owns.

PyTorch gives each cuBLAS handle, one per thread and device, a workspace per stream, taken from
the caching allocator at the thread's first matrix product and kept for the life of the
process, so ``torch.cuda.max_memory_allocated`` counts it. A step's forward runs on the
caller's thread and its backward on autograd's thread for the device: a training step holds
two, an inference forward one (32 MiB each on an H200, as measured there). The size is PyTorch's
rule: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` pairs, SIZE in KiB) when set, else 32 MiB
on compute capability 9 and later, 8 MiB and 128 KiB before; a device this machine cannot
query (a fake ``cuda:0`` on a laptop) is taken to be of capability 9 or later. ROCm builds
size their hipBLAS workspaces otherwise and are not counted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["add_workspaces", "note_matmul", "workspace_bytes"]

# The aten operators that run on cuBLAS for CUDA tensors (``linear`` and ``matmul`` come here
# as ``addmm``, ``mm``, ``bmm``).
_MATMULS = frozenset(
    {
        "mm",
        "addmm",
        "_addmm_activation",
        "bmm",
        "baddbmm",
        "addbmm",
        "mv",
        "addmv",
        "dot",
        "vdot",
        "_int_mm",
        "_scaled_mm",
    }
)
_KIB = 1024
_HOPPER = 4096 * 8 * _KIB  # ":4096:8"
_BEFORE_HOPPER = 4096 * 2 * _KIB + 16 * 8 * _KIB  # ":4096:2:16:8"


def note_matmul(func: Any, args: Any, seen: set[tuple[torch.device, bool]]) -> None:
    """Add (device, in a backward) to ``seen`` when ``func`` is a matrix product."""
    packet = getattr(func, "overloadpacket", None)
    if getattr(packet, "__name__", None) not in _MATMULS:
        return
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None:
        return
    graph_task = getattr(torch._C, "_current_graph_task_id", None)
    seen.add((first.device, graph_task is not None and graph_task() != -1))


def workspace_bytes(dev: torch.device) -> int:
    """The bytes of one cuBLAS workspace on ``dev`` (0 when it is not a CUDA device)."""
    if dev.type != "cuda" or torch.version.hip is not None:
        return 0
    default = _HOPPER
    if torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count():
        major, _ = torch.cuda.get_device_capability(dev)
        default = _HOPPER if major >= 9 else _BEFORE_HOPPER
    pairs = re.findall(r":([0-9]+):([0-9]+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if not pairs:
        return default
    return sum(int(size) * int(count) for size, count in pairs) * _KIB


def add_workspaces(
    peaks: dict[torch.device, dict[str, int]],
    seen: set[tuple[torch.device, bool]],
    label: Callable[[torch.device], torch.device],
) -> None:
    """Add to each CUDA device's peak (kind ``"workspace"`` and the total) one workspace per
    thread that ran a matrix product on it: the forward's, the backward's."""
    for dev, _ in seen:
        shown = label(dev)
        if shown in peaks:
            nbytes = workspace_bytes(shown)
            peaks[shown]["workspace"] += nbytes
            peaks[shown]["total"] += nbytes
