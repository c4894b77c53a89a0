"""Estimating a 7B-parameter Llama-shaped skeleton's training step (docs/design.md, "Estimate").

Run as ``python benchmarks/bench_estimate.py [--layers N] [--seq N] [--profile]``. The model is
transformers' ``LlamaForCausalLM`` with Llama 2 7B's dimensions, built on ``meta`` (nothing
allocated); one training step at batch 1 x 2048 tokens with labels and Adam runs on fake tensors
as the estimate does it. Target: under 30 s on the 2-core machine. The time to build the
skeleton is shown apart (it is transformers', not the estimate's). ``--profile`` prints where
the estimate's time goes (cProfile, top functions by cumulative time).

``--archs [TYPE ...]`` checks accuracy across some 30 transformers architectures against real
steps on the CPU (``_estimate_archs``): predicted / measured per architecture, then the summary.

``--gpu`` (on a CUDA machine) checks accuracy instead: three small transformers models (GPT-2,
Llama, BERT; a few layers, batch 8 x 256) each run one real training step (forward, backward,
Adam) and one inference forward on ``cuda:0``, and the predicted peak of ``estimate`` for the
same step is compared with ``torch.cuda.max_memory_allocated`` over the step (the model's
weights included, as both count them). Each step starts as in a fresh process: no gradients
left by the step before, no cuBLAS workspaces (each thread that runs a matmul allocates its own,
32 MiB on a Hopper GPU, and keeps it), and the training step keeps its output until the step is
over, as a training loop does and as ``estimate`` assumes. Target: within 10%. Each row is
printed with the estimate's split by kind and what was allocated before the step. ``--rows
FILE`` appends the figures for ``gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import time

import torch

from _rows import add_row
from torchplace.looking._estimate import Estimate, estimate

TARGET_S = 30.0


def llama_7b(layers: int) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def small_models() -> dict[str, torch.nn.Module]:
    """Three transformers families, a few layers each, on the CPU (moved to the GPU per step)."""
    import transformers

    return {
        "gpt2": transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_layer=4, n_embd=512, n_head=8, vocab_size=8000, bos_token_id=0, eos_token_id=0
            )
        ),
        "llama": transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                num_hidden_layers=4,
                hidden_size=512,
                intermediate_size=1376,
                num_attention_heads=8,
                num_key_value_heads=8,
                vocab_size=8000,
            )
        ),
        "bert": transformers.BertForMaskedLM(
            transformers.BertConfig(
                num_hidden_layers=4,
                hidden_size=512,
                intermediate_size=2048,
                num_attention_heads=8,
                vocab_size=8000,
            )
        ),
    }


def _fresh(model: torch.nn.Module) -> int:
    """Drop what an earlier step left on cuda:0 (gradients, cuBLAS workspaces, cached blocks)
    so the next step starts as in a fresh process; what is still allocated (the weights)."""
    model.zero_grad(set_to_none=True)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _real_peak(model: torch.nn.Module, batch: dict[str, torch.Tensor], train: bool) -> int:
    """``max_memory_allocated`` over one real step on cuda:0 (weights already there); a
    training step keeps its output until the optimizer's step is done, and is a steady one:
    a first step (which makes Adam's state) runs before the one measured, as ``estimate``
    predicts the steady step."""
    opt = torch.optim.Adam(model.parameters()) if train else None
    for _ in range(2 if train else 1):  # the peak kept is the last step's
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if not train:
            with torch.no_grad():
                model(**batch)
            continue
        assert opt is not None
        output = model(**batch)
        output.loss.backward()
        opt.step()
        opt.zero_grad()
        del output
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _split(est: Estimate) -> str:
    """The estimate's kinds at its peak, in MiB, for the line printed beside the real peak."""
    row = next((r for r in est.peaks if r.device.type == "cuda"), None)
    if row is None:
        return f"not measured: {est.fallback}"
    kinds = [f.name for f in dataclasses.fields(row) if f.name not in ("device", "total")]
    return ", ".join(f"{k} {getattr(row, k) >> 20}" for k in kinds if getattr(row, k))


def gpu_accuracy(rows: str | None) -> None:
    """Predicted peak against the real one, per model and step, on cuda:0."""
    cuda = torch.device("cuda", 0)

    def tokens(dev: torch.device) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 8000, (8, 256), device=dev)
        return {"input_ids": ids, "labels": ids}

    for name, model in small_models().items():
        for step in ("train", "forward"):
            model.to(cuda).train(step == "train")
            est = estimate(model, example_input=tokens, step=step)
            before = _fresh(model)
            real = _real_peak(model, tokens(cuda), step == "train")
            ratio = est.peak / real
            print(f"{name} {step}: predicted {est.peak >> 20} MiB, real {real >> 20} MiB, "
                  f"ratio {ratio:.3f}  [predicted, MiB: {_split(est)}; "
                  f"allocated before the step {before >> 20}]")  # fmt: skip
            add_row(rows, f"estimate {name} {step}: predicted / max_memory_allocated", ratio,
                    "0.9-1.1x", 0.9 <= ratio <= 1.1)  # fmt: skip
            model.zero_grad(set_to_none=True)
            model.to("cpu")
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="accuracy against a real CUDA step")
    parser.add_argument("--rows", default=None, help="append figures as JSON lines here")
    parser.add_argument(
        "--archs",
        nargs="*",
        default=None,
        help="accuracy across architectures against real CPU steps (all, or those named)",
    )
    args = parser.parse_args()
    if args.archs is not None:
        import _estimate_archs

        print(_estimate_archs.HEADER)
        print(_estimate_archs.summary(_estimate_archs.run(args.archs)))
        return
    if args.gpu:
        if not torch.cuda.is_available():
            print("bench_estimate --gpu: no CUDA device here, nothing to measure")
            return
        gpu_accuracy(args.rows)
        return
    start = time.perf_counter()
    model = llama_7b(args.layers)
    built = time.perf_counter() - start

    def tokens(dev: torch.device) -> dict[str, torch.Tensor]:
        ids = torch.zeros(1, args.seq, dtype=torch.long, device=dev)
        return {"input_ids": ids, "labels": ids}

    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    est = estimate(model, example_input=tokens)
    if profiler is not None:
        profiler.disable()
    took = time.perf_counter() - start
    gib = 1 << 30
    print(f"skeleton: {est.parameter_count / 1e9:.2f}B parameters, built in {built:.1f} s")
    print(
        f"estimate of a train step, 1 x {args.seq}: {took:.1f} s (target < {TARGET_S:.0f} s, "
        f"{'met' if took < TARGET_S else 'MISSED'}); peak {est.peak / gib:.1f} GiB, "
        f"activations at most {est.activations / gib:.1f} GiB, fallback {est.fallback}"
    )
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
