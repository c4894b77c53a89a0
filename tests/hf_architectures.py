"""Tiny transformers models for the differential test of ``load_into`` against ``save_pretrained``.

Every architecture ``AutoModelForCausalLM`` knows is built from a tiny config (hidden size 64,
two layers, four experts, a small vocabulary), without downloads: each size the config class
has is passed to its constructor, so sizes derived in ``__init__`` (``layer_types``) follow.
``python tests/hf_architectures.py [TYPE ...]`` checks each in a process of its own and prints
one line per architecture (used to time the whole list and to find the sample's kinds).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

TINY: dict[str, Any] = {
    # widths
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "embed_dim": 64, "dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "ffn_hidden_size": 128,
    "head_dim": 16, "kv_channels": 16, "max_position_embeddings": 128, "n_positions": 128,
    # depth and heads
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2,
    # experts
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "moe_k": 2, "n_group": 1,
    "topk_group": 1, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_hidden_size": 32, "n_shared_experts": 1,
    # encoder-decoder families (their decoder is the causal LM)
    "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "is_decoder": True,
    # vocabulary
    "vocab_size": 512,
}  # fmt: skip


class Composite(ValueError):
    """A config whose sizes live in sub-configs (a multimodal model's text and vision parts)."""


_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def causal_lm_types() -> list[str]:
    """Every model type ``AutoModelForCausalLM`` builds, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _tiny_kwargs(default: Any) -> dict[str, Any]:
    """The sizes of ``TINY`` that ``default``'s class takes (a property, such as Falcon's
    ``head_dim``, is derived from the others, not passed)."""
    return {
        k: v
        for k, v in TINY.items()
        if hasattr(default, k) and not isinstance(getattr(type(default), k, None), property)
    }


def tiny_config(model_type: str) -> Any:
    """The tiny config of ``model_type``; ``Composite`` for a multimodal one (its text part under
    ``text_config``, beside vision or audio parts), whose parts would each need a tiny config of
    their own. A text model whose config is split in parts (DBRX's ``attn_config`` and
    ``ffn_config``, BLT's encoder, decoder and patcher) gets each part shrunk."""
    import transformers

    default = transformers.AutoConfig.for_model(model_type)
    parts = dict(getattr(default, "sub_configs", None) or {})
    if "text_config" in parts:
        raise Composite(
            f"{model_type} is a multimodal composite config ({', '.join(parts)}): its sizes "
            "live in sub-configs of their own"
        )
    kwargs = _tiny_kwargs(default)
    for name in parts:
        part = getattr(default, name, None)
        if part is not None and hasattr(part, "to_dict"):
            kwargs[name] = _tiny_kwargs(part)
    vocab = kwargs.get("vocab_size", 512)
    for key in _TOKEN_IDS:  # special tokens of the full vocabulary would fall outside
        value = getattr(default, key, None)
        if isinstance(value, int) and value >= vocab:
            kwargs[key] = 1
        elif isinstance(value, list):
            kwargs[key] = [v if v < vocab else 1 for v in value]
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def build(model_type: str) -> tuple[Any, Any]:
    """The tiny config and a model built from it, random weights, seeded."""
    import transformers

    config = tiny_config(model_type)
    torch.manual_seed(0)
    return config, transformers.AutoModelForCausalLM.from_config(config)


def differences(saved: torch.nn.Module, loaded: torch.nn.Module) -> list[str]:
    """What differs between two models: keys, values bit for bit, dtypes, and ties."""
    a, b = saved.state_dict(keep_vars=True), loaded.state_dict(keep_vars=True)
    out = [f"{k}: missing after load" for k in a if k not in b]
    out += [f"{k}: appeared after load" for k in b if k not in a]
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        if x.device.type == "meta" or y.device.type == "meta":
            out.append(f"{k}: on meta ({x.device} saved, {y.device} loaded)")
        elif x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"{k}: {x.dtype}{tuple(x.shape)} saved, {y.dtype}{tuple(y.shape)} loaded")
        elif not torch.equal(
            x.detach().view(-1).view(torch.uint8), y.detach().view(-1).view(torch.uint8)
        ):
            out.append(f"{k}: values differ")
    ties_a = _ties(saved)
    ties_b = _ties(loaded)
    if ties_a != ties_b:
        out.append(f"ties differ: saved {sorted(ties_a)}, loaded {sorted(ties_b)}")
    return sorted(out)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits, so that NaNs and signed zeros compare as they are stored."""
    return t.detach().reshape(-1).view(torch.uint8)


def _ties(model: torch.nn.Module) -> set[tuple[str, ...]]:
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {tuple(sorted(g)) for g in groups.values() if len(g) > 1}


def check(model_type: str, directory: str) -> str:
    """Save ``model_type``'s tiny model to ``directory`` and load it back with ``load_into``
    from the directory, its index or single file; "" when bit for bit equal, else what
    differs (or what failed)."""
    import os

    import transformers

    import torchplace

    config, model = build(model_type)
    model.save_pretrained(directory, max_shard_size="200KB")
    names = os.listdir(directory)
    index = [n for n in names if n.endswith(".index.json")]
    source = os.path.join(directory, index[0]) if index else directory
    skeleton = torchplace.skeleton(transformers.AutoModelForCausalLM.from_config, config)
    loaded = torchplace.load_into(skeleton, source)
    return "; ".join(differences(model, loaded)[:5])


def verdict(model_type: str) -> tuple[str, str]:
    """``("ok", "")``, ``("fail", what differs)``, or why it was not tried: ``("composite",
    ...)``, ``("nobuild", ...)`` (no tiny model), ``("nosave", ...)`` (transformers' own
    ``save_pretrained`` fails)."""
    import tempfile

    try:
        tiny_config(model_type)
        build(model_type)
    except Composite as exc:
        return "composite", str(exc)
    except Exception as exc:
        return "nobuild", f"{type(exc).__name__}: {str(exc)[:200]}"
    with tempfile.TemporaryDirectory() as directory:
        try:
            _, model = build(model_type)
            model.save_pretrained(directory, max_shard_size="200KB")
        except Exception as exc:
            return "nosave", f"save_pretrained: {type(exc).__name__}: {str(exc)[:200]}"
        try:
            found = check(model_type, directory)
        except Exception as exc:
            found = f"{type(exc).__name__}: {str(exc)[:400]}"
    return ("fail", found) if found else ("ok", "")


def verdicts(types: list[str], *, jobs: int = 2, batch: int = 12) -> dict[str, tuple[str, str]]:
    """``verdict`` of each type, each batch in a process of its own (``jobs`` at a time), so a
    crash loses no more than its batch; the types a crashed batch left are tried one per
    process, and the one that crashes alone is ``("crash", its last words)``."""
    import json
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def run(group: list[str]) -> dict[str, tuple[str, str]]:
        done = subprocess.run(
            [sys.executable, __file__, "--worker", *group],
            capture_output=True,
            text=True,
            check=False,
        )
        found = {}
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                found.update({k: tuple(v) for k, v in json.loads(line).items()})
        left = [t for t in group if t not in found]
        if left and len(group) == 1:
            return {left[0]: ("crash", f"exit {done.returncode}: {done.stderr[-300:]}")}
        for t in left:
            found.update(run([t]))
        return found  # type: ignore[return-value]

    groups = [types[i : i + batch] for i in range(0, len(types), batch)]
    out: dict[str, tuple[str, str]] = {}
    with ThreadPoolExecutor(jobs) as pool:
        for found in pool.map(run, groups):
            out.update(found)
    return out


def _worker(types: list[str]) -> None:
    import json
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")
    for model_type in types:
        print(json.dumps({model_type: verdict(model_type)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2:])
    else:
        import time

        start = time.perf_counter()
        results = verdicts(sys.argv[1:] or causal_lm_types())
        for name, (kind, detail) in sorted(results.items()):
            print(f"{name}\t{kind}\t{detail}")
        print(f"{len(results)} types in {time.perf_counter() - start:.0f}s")
