"""The ground truth ``estimate`` is checked against: real steps on real tensors, measured by
PyTorch's own ``MemTracker`` (``torch.distributed._tools.mem_tracker``), which counts each
storage's bytes as the fake step's tracker does. Used by ``test_estimate_steady`` and by
``benchmarks/bench_estimate.py``."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(*batch) if isinstance(batch, tuple) else model(batch)


def _loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = output[0] if isinstance(output, tuple) else getattr(output, "logits", output)
    return first.float().sum()


def _inputs(batch: Any) -> list[torch.Tensor]:
    values = batch.values() if isinstance(batch, Mapping) else batch
    values = values if isinstance(values, (tuple, list, type({}.values()))) else [values]
    return [t for t in values if isinstance(t, torch.Tensor)]


class _NoHook:
    def remove(self) -> None:
        pass


@contextlib.contextmanager
def _tracking(model: nn.Module, *extra: Any) -> Iterator[Any]:
    """PyTorch's tracker on ``model`` and ``extra``: frozen parameters (which it would hook for
    their gradients, and torch refuses) marked as hooked, and its note about its own module
    hierarchy (a layer entered again, as the kernels package's are) not shown."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    for param in model.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
    tracker.track_external(model, *extra)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The module hierarchy tracking")
        warnings.filterwarnings("ignore", message="Module is None")  # a loss made in forward
        with tracker:
            yield tracker


def train_peaks(
    model: nn.Module,
    batch: Any,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = torch.optim.Adam,
    steps: int = 3,
) -> list[int]:
    """The peak of each of ``steps`` real training steps (forward, backward from the loss,
    optimizer step, ``zero_grad``, the output kept to the step's end), all devices summed."""
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    peaks = []
    with _tracking(model, opt, *_inputs(batch)) as tracker:
        for _ in range(steps):
            tracker._peak_mem_snap = tracker.get_tracker_snapshot()  # this step's peak only
            tracker._peak_mem = {d: s["Total"] for d, s in tracker._peak_mem_snap.items()}
            output = _call(model, batch)
            _loss(output).backward()
            opt.step()
            opt.zero_grad()
            del output
            peaks.append(sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values()))
            tracker.reset_mod_stats()
    return peaks


def forward_peak(model: nn.Module, batch: Any) -> int:
    """The peak of one real forward under ``torch.no_grad``, all devices summed."""
    with _tracking(model, *_inputs(batch)) as tracker, torch.no_grad():
        _call(model, batch)
    return sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
