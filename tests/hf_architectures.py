"""Tiny transformers models for the differential test of ``load_into`` against ``save_pretrained``,
with an estimate leg (``estimate_check``: each one estimated for training and a forward).

Every architecture ``AutoModelForCausalLM`` knows is built from a tiny config (hidden size 64,
two layers, four experts, a small vocabulary), without downloads: each size the config class
has is passed to its constructor, so sizes derived in ``__init__`` (``layer_types``) follow.
Each that loads is loaded again by ``plan``'s map with about half of it on disk and run on token
ids against the resident model (``offload_check``: the whole list's offload leg).
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
    # rotary and latent attention widths within the heads' (GPT-J's rotary_dim, MLA's ranks)
    "rotary_dim": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "kv_lora_rank": 32, "q_lora_rank": 32,
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


# Sizes of a multimodal model's vision part beside those of TINY (a vision tower's depth, its
# global layers): only its sub-configs get them.
TINY_PARTS: dict[str, Any] = {
    "depth": 2, "num_global_layers": 1, "num_layers": 2, "cross_attention_layers": [1],
}  # fmt: skip
# What a multimodal config needs beyond sizes, by type, then by part ("" for the config
# itself): Emu3 looks its image tokens up by name and has a VQ-VAE of its own to shrink,
# Mllama's text part needs its kind of rotary embedding named.
EXTRA: dict[str, dict[str, dict[str, Any]]] = {
    "emu3": {
        "": {"vocabulary_map": {"<|extra_200|>": 2, "<|visual token 000000|>": 3}},
        "vq_config": {
            "codebook_size": 64, "base_channels": 32, "channel_multiplier": [1, 1],
            "num_res_blocks": 1, "attn_resolutions": [],
        },
    },
    "mllama": {"text_config": {"rope_scaling": {"rope_type": "default"}}},
}  # fmt: skip

# Multimodal models whose transformers 4.x ``save_pretrained`` writes legacy names
# (``language_model.model.*``, ``vision_tower.*``: the reverse of the class's
# ``_checkpoint_conversion_mapping``), which ``from_pretrained`` maps back. Each is built with
# tiny sub-configs (text, vision) and checked as the causal LMs are; the type -> the class.
LEGACY_NAMES: dict[str, str] = {
    "aria": "AriaForConditionalGeneration",
    "aya_vision": "AyaVisionForConditionalGeneration",
    "emu3": "Emu3ForConditionalGeneration",
    "fuyu": "FuyuForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "got_ocr2": "GotOcr2ForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava_next_video": "LlavaNextVideoForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "mllama": "MllamaForConditionalGeneration",
    "paligemma": "PaliGemmaForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "video_llava": "VideoLlavaForConditionalGeneration",
    "vipllava": "VipLlavaForConditionalGeneration",
}


class Composite(ValueError):
    """A config whose sizes live in sub-configs (a multimodal model's text and vision parts)."""


# Generation settings that every transformers 4.x config has (``top_k``): a size only for a
# config whose own ``__init__`` takes it (an MoE's experts per token).
_GENERATION = frozenset({"top_k"})

_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def causal_lm_types() -> list[str]:
    """Every model type ``AutoModelForCausalLM`` builds, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def legacy_name_types() -> list[str]:
    """The types of ``LEGACY_NAMES`` that the installed transformers has, sorted."""
    import transformers

    return sorted(t for t, name in LEGACY_NAMES.items() if hasattr(transformers, name))


def architecture_types() -> list[str]:
    """What the whole-list test checks: every causal LM and every multimodal model of
    ``LEGACY_NAMES``."""
    return sorted(set(causal_lm_types()) | set(legacy_name_types()))


def maker(model_type: str) -> Any:
    """What builds ``model_type``'s model from a config: its class of ``LEGACY_NAMES``, else
    ``AutoModelForCausalLM``."""
    import transformers

    if model_type in LEGACY_NAMES:
        return getattr(transformers, LEGACY_NAMES[model_type])._from_config
    return transformers.AutoModelForCausalLM.from_config


def _tiny_kwargs(default: Any, sizes: dict[str, Any] = TINY) -> dict[str, Any]:
    """The ``sizes`` that ``default``'s class takes (a property, such as Falcon's ``head_dim``,
    is derived from the others, not passed), special tokens kept inside the vocabulary."""
    import inspect

    own = inspect.signature(type(default).__init__).parameters
    out = {
        k: v
        for k, v in sizes.items()
        if hasattr(default, k)
        and not isinstance(getattr(type(default), k, None), property)
        and (k not in _GENERATION or k in own)
    }
    if "qk_rope_head_dim" in out and "head_dim" in out:  # latent attention: its rotary width
        out["head_dim"] = out["qk_rope_head_dim"]
    vocab = out.get("vocab_size", 512)
    for key in _TOKEN_IDS:  # special tokens of the full vocabulary would fall outside
        value = getattr(default, key, None)
        if isinstance(value, int) and value >= vocab:
            out[key] = 1
        elif isinstance(value, list):
            out[key] = [v if v < vocab else 1 for v in value]
    return out


def _tiny_composite(model_type: str, default: Any) -> Any:
    """A multimodal config of ``LEGACY_NAMES`` with each part (text, vision, ...) tiny."""
    import transformers

    kwargs = _tiny_kwargs(default, {k: v for k, v in TINY.items() if k != "vocab_size"})
    extra = EXTRA.get(model_type, {})
    kwargs.update(extra.get("", {}))
    for name in default.sub_configs:
        part = getattr(default, name, None)
        if part is not None and hasattr(part, "to_dict"):
            tiny = _tiny_kwargs(part, {**TINY, **TINY_PARTS})
            kwargs[name] = {"model_type": part.model_type, **tiny, **extra.get(name, {})}
            rope = getattr(part, "rope_scaling", None)  # the part's own kind of rotary embedding
            if rope:
                kwargs[name].setdefault("rope_scaling", rope)
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def tiny_config(model_type: str) -> Any:
    """The tiny config of ``model_type``; ``Composite`` for a multimodal one (its text part under
    ``text_config``, beside vision or audio parts), whose parts would each need a tiny config of
    their own. A text model whose config is split in parts (DBRX's ``attn_config`` and
    ``ffn_config``, BLT's encoder, decoder and patcher) gets each part shrunk."""
    import transformers

    default = transformers.AutoConfig.for_model(model_type)
    parts = dict(getattr(default, "sub_configs", None) or {})
    if model_type in LEGACY_NAMES:
        return _tiny_composite(model_type, default)
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
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def build(model_type: str) -> tuple[Any, Any]:
    """The tiny config and a model built from it, random weights, seeded."""
    config = tiny_config(model_type)
    torch.manual_seed(0)
    return config, maker(model_type)(config)


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

    import torchplace

    config, model = build(model_type)
    model.save_pretrained(directory, max_shard_size="200KB")
    names = os.listdir(directory)
    index = [n for n in names if n.endswith(".index.json")]
    source = os.path.join(directory, index[0]) if index else directory
    skeleton = torchplace.skeleton(maker(model_type), config)
    loaded = torchplace.load_into(skeleton, source)
    return "; ".join(differences(model, loaded)[:5])


def offload_map(model: torch.nn.Module, skeleton: torch.nn.Module) -> dict[str, Any]:
    """``plan``'s map of ``skeleton`` with about half of the model on disk: the cpu's budget is
    half the bytes of the model's state, the disk's open; the model's ``_no_split_modules``
    kept whole where it has them."""
    import torchplace

    total = sum(t.nbytes for t in model.state_dict().values())
    whole = any(getattr(m, "_no_split_modules", None) for m in model.modules())
    return torchplace.plan(skeleton, {"cpu": total // 2, "disk": "1TB"},
                           no_split="auto" if whole else ())  # fmt: skip


def example_ids(config: Any) -> torch.Tensor:
    """Token ids a tiny model takes: 8 of them, seeded, inside its text vocabulary."""
    text = getattr(config, "text_config", None) or config
    vocab = int(getattr(text, "vocab_size", None) or 512)
    return torch.randint(3, min(vocab, 512), (1, 8), generator=torch.Generator().manual_seed(0))


def _outputs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # no cache: a hybrid's two tiny layers may both be linear attention
        out = model(input_ids=ids, use_cache=False)
    found = getattr(out, "logits", None)
    return out[0] if found is None else found  # type: ignore[no-any-return]


def offload_check(model_type: str, directory: str) -> tuple[str, str]:
    """``model_type``'s tiny model, saved in ``directory``, loaded by ``load_into`` by
    ``plan``'s map with about half of it on disk (``offload_map``) and run on ``example_ids``:
    ``("ok", the map's disk share)`` when bit for bit the resident model's outputs, else
    ``("fail", ...)``; ``("noforward", ...)`` where the resident model itself does not run on
    token ids alone, ``("nodisk", ...)`` where the map puts nothing on disk."""
    import torchplace

    config, model = build(model_type)
    model.eval()
    ids = example_ids(config)
    try:
        expected = _outputs(model, ids)
    except Exception as exc:
        return "noforward", f"{type(exc).__name__}: {str(exc)[:200]}"
    skeleton = torchplace.skeleton(maker(model_type), config)
    device_map = offload_map(model, skeleton)
    disk = [k for k, v in device_map.items() if v == "disk"]
    if not disk:
        return "nodisk", f"plan put nothing on disk: {dict(device_map)}"
    shown = f"{len(disk)} of {len(device_map)} entries on disk"
    try:
        loaded = torchplace.load_into(skeleton, directory, device_map=device_map).eval()
        got = _outputs(loaded, ids)
    except Exception as exc:
        return "fail", f"{type(exc).__name__}: {str(exc)[:400]} ({shown})"
    if got.shape != expected.shape or not torch.equal(_bytes(got), _bytes(expected)):
        return "fail", f"outputs differ ({shown}: {disk[:4]})"
    return "ok", shown


def estimate_check(model_type: str) -> str:
    """The estimate leg: ``torchplace.estimate`` of ``model_type``'s skeleton for a training
    step and an inference forward, on the batch ``torchplace estimate DIR`` gives it; "" when
    both are measured (no error, no fallback), or where the real tiny model itself cannot run
    that batch (its config is at fault, not the estimate), else what failed."""
    import warnings

    import torchplace
    from torchplace.cli._inputs import example_batch

    config, model = build(model_type)
    skeleton = torchplace.skeleton(maker(model_type), config)
    for step in ("train", "forward"):
        make, _ = example_batch(model, config, 2, 16, step == "train")
        try:
            with torch.no_grad():
                model.train(step == "train")(**make(torch.device("cpu")))
        except Exception:  # the real model refuses it too: nothing to hold the estimate to
            return ""
        skeleton.train(step == "train")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                found = torchplace.estimate(skeleton, example_input=make, step=step)
            except Exception as exc:
                return f"estimate {step}: {type(exc).__name__}: {str(exc)[:300]}"
        if found.fallback is not None:
            return f"estimate {step} fell back: {found.fallback[:300]}"
    return ""


def _estimate_leg(model_type: str) -> str:
    """``estimate_check`` on transformers 5, where its results were checked; the 4.x sample of
    the sweep keeps to the load."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return estimate_check(model_type) if major >= 5 else ""


def verdict(model_type: str) -> tuple[str, str, str, str]:
    """The load's verdict, then the offload leg's (``offload_check``; ``("", "")`` where the
    load was not ok). The load's: ``("ok", "")``, ``("fail", what differs)``, or why it was not
    tried: ``("composite", ...)``, ``("nobuild", ...)`` (no tiny model), ``("nosave", ...)``
    (transformers' own ``save_pretrained`` fails)."""
    import tempfile

    try:
        tiny_config(model_type)
        build(model_type)
    except Composite as exc:
        return "composite", str(exc), "", ""
    except Exception as exc:
        return "nobuild", f"{type(exc).__name__}: {str(exc)[:200]}", "", ""
    with tempfile.TemporaryDirectory() as directory:
        try:
            _, model = build(model_type)
            model.save_pretrained(directory, max_shard_size="200KB")
        except Exception as exc:
            return "nosave", f"save_pretrained: {type(exc).__name__}: {str(exc)[:200]}", "", ""
        try:
            found = check(model_type, directory) or _estimate_leg(model_type)
        except Exception as exc:
            found = f"{type(exc).__name__}: {str(exc)[:400]}"
        if found:
            return "fail", found, "", ""
        try:
            offloaded = offload_check(model_type, directory)
        except Exception as exc:
            offloaded = ("fail", f"{type(exc).__name__}: {str(exc)[:400]}")
    return ("ok", "", *offloaded)


def verdicts(
    types: list[str], *, jobs: int = 2, batch: int = 12
) -> dict[str, tuple[str, str, str, str]]:
    """``verdict`` of each type, each batch in a process of its own (``jobs`` at a time), so a
    crash loses no more than its batch; the types a crashed batch left are tried one per
    process, and the one that crashes alone is ``("crash", its last words)``."""
    import json
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def run(group: list[str]) -> dict[str, tuple[str, str, str, str]]:
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
            return {left[0]: ("crash", f"exit {done.returncode}: {done.stderr[-300:]}", "", "")}
        for t in left:
            found.update(run([t]))
        return found  # type: ignore[return-value]

    groups = [types[i : i + batch] for i in range(0, len(types), batch)]
    out: dict[str, tuple[str, str, str, str]] = {}
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
        results = verdicts(sys.argv[1:] or architecture_types())
        for name, (kind, detail, offload, said) in sorted(results.items()):
            print(f"{name}\t{kind}\t{detail}\t{offload}\t{said}")
        print(f"{len(results)} types in {time.perf_counter() - start:.0f}s")
