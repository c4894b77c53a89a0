"""Estimating a 7B-parameter Llama-shaped skeleton's training step (docs/design.md, "Estimate").

Run as ``python benchmarks/bench_estimate.py [--layers N] [--seq N] [--profile]``. The model is
transformers' ``LlamaForCausalLM`` with Llama 2 7B's dimensions, built on ``meta`` (nothing
allocated); one training step at batch 1 x 2048 tokens with labels and Adam runs on fake tensors
as the estimate does it. Target: under 30 s on the 2-core machine. The time to build the
skeleton is shown apart (it is transformers', not the estimate's). ``--profile`` prints where
the estimate's time goes (cProfile, top functions by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from torchplace.looking._estimate import estimate

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
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
