"""Offload beside transformers: a load by map with layers on disk, then greedy decoding.

Run as ``python benchmarks/bench_offload_hf.py [--layers N] [--hidden D] [--tokens T]``. One
Llama-shaped checkpoint (``save_pretrained``, float32, about 1 GB by default) and two maps:
half of the decoder layers on ``"disk"``, and all of them. For each map, three loaders, each in
a fresh process (``python bench_offload_hf.py --worker KIND MAP DIR``):

- ``transformers``: ``from_pretrained(dir, device_map=map, offload_folder=tmp)``, which maps the
  file and writes the disk layers' weights it must convert to the offload folder;
- ``torchplace``: ``skeleton`` + ``load_into(dir, device_map=map)`` (resident weights copied
  into memory the process owns, disk layers left in the checkpoint);
- ``torchplace-mmap``: the same with ``mmap=True`` (resident weights map the file, as
  transformers' do).

Each worker reports the host peak over the load (``VmHWM`` above the process after
``import torch, transformers`` and the import of each loader's code), over load and generate,
the bytes the process read (``/proc/self/io`` ``rchar``) and wrote (the offload folder's size),
the load time, and the seconds per token of ``generate`` (greedy, ``--tokens`` new tokens
after a warm-up of 2).
Targets (DESIGN.md section 5): peak within the resident bytes + the prefetch window + 64 MiB;
with ``mmap=True`` at most transformers' peak over load and generate; decoding at most 1.1x
transformers' seconds per token; nothing written. ``--rows FILE`` appends JSON lines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak() -> int:
    """The process's resident bytes now, its peak (``VmHWM``) reset to them (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def rss_peak() -> int:
    return status("VmHWM")


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def config(layers: int, hidden: int) -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def device_map(layers: int, share: str) -> dict[str, str]:
    """Each module named (transformers refuses ``""`` beside other entries with disk ones)."""
    first = layers // 2 if share == "half" else 0
    top = dict.fromkeys(["model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"], "cpu")
    return {**top, **{f"model.layers.{i}": "cpu" if i < first else "disk" for i in range(layers)}}


def worker(kind: str, share: str, directory: Path, tokens: int) -> dict[str, Any]:
    import torch
    import transformers

    import torchplace

    cfg = transformers.AutoConfig.from_pretrained(directory)
    dmap = device_map(cfg.num_hidden_layers, share)
    torch.manual_seed(0)
    # Each loader's code is imported before the peak is reset (transformers' Llama module;
    # torchplace's load, which its package imports on first use): the peaks are the load's.
    _ = transformers.LlamaForCausalLM, torchplace.load_into, torchplace.skeleton
    base, read0 = reset_peak(), rchar()
    offload = Path(tempfile.mkdtemp(dir=directory.parent))
    t0 = time.perf_counter()
    if kind == "transformers":
        model = transformers.LlamaForCausalLM.from_pretrained(
            directory, device_map=dmap, offload_folder=str(offload), dtype=torch.float32
        )
    else:
        skel = torchplace.skeleton(transformers.LlamaForCausalLM, cfg)
        model = torchplace.load_into(skel, directory, device_map=dmap, mmap=kind.endswith("mmap"))
    load_s = time.perf_counter() - t0
    load_peak, load_read = rss_peak() - base, rchar() - read0
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    greedy = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **greedy)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **greedy)
        per_token = (time.perf_counter() - t0) / tokens
    written = sum(f.stat().st_size for f in offload.rglob("*") if f.is_file())
    return {
        "kind": kind,
        "share": share,
        "load_s": load_s,
        "load_peak": load_peak,
        "peak": rss_peak() - base,
        "read": load_read,
        "written": written,
        "s_per_token": per_token,
        "tokens": out[0, -tokens:].tolist(),
    }


def run_worker(kind: str, share: str, directory: Path, tokens: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", kind, share, str(directory), str(tokens)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"kind": kind, "share": share, "error": done.stderr.strip().splitlines()[-1:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def resident_bytes(layers: int, hidden: int, share: str) -> int:
    """The bytes a map keeps in memory: embeddings, head, norm, and the layers not on disk."""
    inter = hidden * 11 // 4
    layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * 4
    kept = layers // 2 if share == "half" else 0
    return (2 * 32000 * hidden + hidden) * 4 + kept * layer, layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--rows", default=None, help="append figures as JSON lines here")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, share, directory, tokens = args.worker
        print(json.dumps(worker(kind, share, Path(directory), int(tokens))))
        return
    import torch
    import transformers

    mib = 2**20
    with tempfile.TemporaryDirectory() as where:
        directory = Path(where) / "llama"
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config(args.layers, args.hidden)).save_pretrained(directory)
        size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        print(f"checkpoint {size / mib:.0f} MiB, {args.layers} layers, {args.tokens} tokens")
        for share in ("half", "all"):
            resident, layer = resident_bytes(args.layers, args.hidden, share)
            bound = resident + 2 * layer + 64 * mib
            rows = [run_worker(k, share, directory, args.tokens) for k in KINDS]
            report(share, rows, bound, args.rows)


KINDS = ("transformers", "torchplace", "torchplace-mmap")


def report(share: str, rows: list[dict[str, Any]], bound: int, out: str | None) -> None:
    mib = 2**20
    print(f"\n{share} of the layers on disk (resident + window + 64 MiB = {bound / mib:.0f} MiB)")
    print(
        f"{'loader':16} {'load s':>7} {'peak load':>10} {'peak all':>9} {'read MiB':>9} "
        f"{'written':>8} {'s/token':>8}"
    )
    base = next((r for r in rows if r["kind"] == "transformers" and "error" not in r), None)
    for r in rows:
        if "error" in r:
            print(f"{r['kind']:16} failed: {r['error']}")
            continue
        print(
            f"{r['kind']:16} {r['load_s']:7.2f} {r['load_peak'] / mib:10.0f} "
            f"{r['peak'] / mib:9.0f} {r['read'] / mib:9.0f} {r['written'] / mib:8.0f} "
            f"{r['s_per_token']:8.3f}"
        )
        if base is not None and r is not base:
            same = r["tokens"] == base["tokens"]
            print(
                f"{'':16} vs transformers: decode "
                f"{r['s_per_token'] / base['s_per_token']:.2f}x, peak all "
                f"{r['peak'] / base['peak']:.2f}x, load {r['load_s'] / base['load_s']:.2f}x; "
                f"load peak / bound {r['load_peak'] / bound:.2f}; same tokens: {same}"
            )
        if out:
            with open(out, "a") as f:
                f.write(json.dumps({"bench": "offload_hf", "share": share, **r}) + "\n")


if __name__ == "__main__":
    main()
