"""The estimate's tracker against a small one of our own: which base to keep (issue 51).

Run as ``python benchmarks/bench_tracker.py [TYPE ...]``. ``estimate`` measures its fake step
with PyTorch's private ``MemTracker`` (``torch.distributed._tools.mem_tracker``), subclassed
in ``looking/_fake_step.py``. The other option is a tracker of our own: a ``TorchDispatchMode``
that sees each operator's outputs, counts the bytes of each storage the first time it is seen
and takes them off when the storage dies (a weak reference's callback), and keeps each
device's peak (``StorageCounter`` below, about 40 lines; it runs the estimate's stand-ins and
side values, as its tracker does). Both run the same step: the skeleton of a tiny
transformers model (``_estimate_archs``: hidden size 64, two layers) on ``meta``, the batch
``torchplace estimate DIR`` gives it (2 x 32), a training step with Adam (a first step, then
the steady one measured) and an inference forward. Printed per architecture: each tracker's
peak in bytes, their ratio, and each one's time (the best of three). ``--llama-layers N``
times both on ``bench_estimate``'s 7B Llama-shaped skeleton cut to N layers, at 1 x 2048.

The prototype counts the total only: the estimate also splits it by kind (parameters,
gradients, optimizer state, activations, temporaries) and gives each module's peak, which
``MemTracker`` does and the prototype would have to add (module hooks, the optimizer's state,
the backward's start).
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

import _estimate_archs
from torchplace.cli._inputs import example_batch
from torchplace.looking import _fake_step as fs

DEFAULT = ["gpt2", "llama", "mixtral", "jetmoe", "bert", "t5", "vit", "whisper", "xlnet"]


class StorageCounter(TorchDispatchMode):
    """Bytes held per device: each storage counted once, from the first time it is seen (an
    operator's output, or ``track``) until it dies; the most held at once per device."""

    def __init__(
        self, stand_in: Callable[[Any, Any, Any], Any], after: Callable[..., None]
    ) -> None:
        super().__init__()
        self.after = after
        self.held: dict[torch.device, int] = {}
        self.peak: dict[torch.device, int] = {}
        self.seen: Any = WeakIdKeyDictionary()
        self.stand_in = stand_in

    def track(self, *tensors: Any) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st in self.seen:
                continue
            nbytes, dev = st.nbytes(), st.device
            self.seen[st] = True
            weakref.finalize(st, self._free, dev, nbytes)
            self.held[dev] = self.held.get(dev, 0) + nbytes
        for dev, held in self.held.items():
            self.peak[dev] = max(self.peak.get(dev, 0), held)

    def _free(self, dev: torch.device, nbytes: int) -> None:
        self.held[dev] -= nbytes

    def restart(self) -> None:
        """The peak from now on (the steady step's)."""
        self.peak = dict(self.held)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = self.stand_in(func, args, kwargs)(*args, **(kwargs or {}))
        self.track(*tree_flatten(out)[0])
        self.after(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def _fake_setting(model: torch.nn.Module, make: Any, train: bool) -> Iterator[tuple[Any, Any]]:
    """What the estimate sets up around its step (``_fake_step._measure``): the model's tensors
    swapped for fakes on the device the step runs on, the batch, the optimizer."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    disk = fs.disk_placeholders(model)
    where, run = fs._run_devices(model, disk)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with (
        fs._state_kept(model),
        fs._no_layerdrop(model),
        mode,
        fs._swapped(model, where, disk, train) as fakes,
    ):
        batch = fs._fake_batch(make, run, mode)
        opt = fs._optimizer(model, "adam", fs._foreach_default(where), fakes) if train else None
        fused = fs.FusedAttention(run) if run.type == "meta" else contextlib.nullcontext()
        with fs._eager(), fused, fs._meta_autocast():
            yield batch, opt


def own_peak(model: torch.nn.Module, make: Any, train: bool) -> int:
    """The steady step's peak by ``StorageCounter`` (a first step, then the one measured),
    summed over devices."""
    with _fake_setting(model, make, train) as (batch, opt):
        values = fs.SideValues()

        def stand_in(func: Any, args: Any, kwargs: Any) -> Any:
            return fs._stand_in(func, args, kwargs, values)

        counter = StorageCounter(stand_in, values.after)
        counter.track(*model.parameters(), *model.buffers(), *tree_flatten(batch)[0])
        with counter:
            fs._run(model, batch, opt, train)
            if opt is not None and fs._holds_state(opt):
                opt.zero_grad(set_to_none=True)
                counter.restart()
                fs._run(model, batch, opt, train)
        return sum(counter.peak.values())


def memtracker_peak(model: torch.nn.Module, make: Any, train: bool) -> int:
    """The estimate's own measure (``measure_step``, MemTracker-based): its peaks summed over
    devices, as ``Estimate.peak`` sums them."""
    found = fs.measure_step(model, make, optimizer="adam" if train else None, train=train)
    return sum(kinds["total"] for kinds in found.peaks.values())


def _timed(fn: Callable[[], int]) -> tuple[int, float]:
    best, value = float("inf"), 0
    for _ in range(3):
        started = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - started)
    return value, best


def _row(name: str, step: str, skeleton: torch.nn.Module, make: Any, train: bool) -> None:
    theirs, their_s = _timed(lambda: memtracker_peak(skeleton, make, train))
    ours, our_s = _timed(lambda: own_peak(skeleton, make, train))
    print(f"| {name} | {step} | {theirs:,} | {ours:,} | {ours / theirs:.4f} | {their_s:.2f} | "
          f"{our_s:.2f} |", flush=True)  # fmt: skip


def llama_7b(layers: int) -> None:
    """``bench_estimate``'s 7B Llama-shaped skeleton, ``layers`` of its 32, at 1 x 2048."""
    from bench_estimate import llama_7b as build

    skeleton = build(layers)

    def tokens(dev: torch.device) -> dict[str, torch.Tensor]:
        ids = torch.zeros(1, 2048, dtype=torch.long, device=dev)
        return {"input_ids": ids, "labels": ids}

    _row(f"llama 7B, {layers} layers", "train", skeleton.train(), tokens, True)


def main(types: list[str]) -> None:
    archs = {a[0]: a for a in _estimate_archs.ARCHS}
    for model_type in types:
        _, _, cls, overrides = archs[model_type]
        skeleton, config = _estimate_archs._build(model_type, cls, overrides, "meta")
        for step in ("train", "forward"):
            train = step == "train"
            make, _ = example_batch(skeleton, config, 2, 32, train)
            _row(model_type, step, skeleton.train(train), make, train)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help=f"model types (default: {' '.join(DEFAULT)})")
    parser.add_argument("--llama-layers", type=int, default=0, help="bench_estimate's 7B, N layers")
    args = parser.parse_args()
    print("| type | step | MemTracker (bytes) | own (bytes) | own / MemTracker | MemTracker s "
          "| own s |\n| --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if args.llama_layers:
            llama_7b(args.llama_layers)
        else:
            main(args.types or DEFAULT)
