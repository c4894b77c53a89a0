"""The code one load by map runs through, beside Accelerate's ``load_checkpoint_and_dispatch``.

Run as ``python benchmarks/trace_load.py [--layers N]``. One small Llama-shaped checkpoint
(``save_pretrained``) and one map: the embeddings, norm and head in memory, the first half of
the layers in memory, the second half on ``"disk"``. Each loader runs once in a fresh process
under ``sys.setprofile``, which sees every Python function called:

- ``torchplace``: ``load_into(skeleton, dir, device_map=map)``;
- ``accelerate``: ``load_checkpoint_and_dispatch(empty model, dir, device_map=map,
  offload_folder=tmp)`` (it writes the disk layers' weights to that folder first);
- ``transformers``: ``from_pretrained(dir, device_map=map, offload_folder=tmp)``, the call
  users make, counted over transformers, Accelerate and safetensors' Python files.

Each loads once before the traced load, so that what a first call imports is not counted.

For the calls made inside the loader's own package, each reports the files and functions it
ran (comprehensions and lambdas aside), and how often the call came back to a file it had
already left: a call into a file entered before and no longer on the stack (a helper called
from the file that calls it is not a return; a stage that calls back into an earlier one is).
Issue 49 counted 31 files and 297 functions for torchplace before its rebuild, and 6 files and
37 functions for Accelerate, which leaves the reading to ``safetensors`` (not counted here)
where torchplace reads the files itself. ``--json`` prints the figures as one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def trace(packages: str, run: Any) -> dict[str, Any]:
    """Run ``run()`` under a profile hook; the calls made into the files of ``packages``
    (names joined by ``+``), each named from its package's parent folder."""
    roots = [str(Path(__import__(p).__file__).parent) for p in packages.split("+")]
    calls: list[tuple[str, str]] = []
    stack: list[str | None] = []  # the file of each frame under way (None: not the package's)
    entered: set[str] = set()
    returns: list[str] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        root = next((r for r in roots if name.startswith(r)), None)
        file = None if root is None else name[len(str(Path(root).parent)) + 1 :]
        if event == "call":
            if file is not None:
                calls.append((file, frame.f_code.co_qualname))
                if file in entered and file not in stack:  # left once, entered again
                    returns.append(file)
                entered.add(file)
            stack.append(file)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    plain = {c for c in calls if "<" not in c[1]}  # comprehensions and lambdas aside
    return {
        "files": len({f for f, _ in calls}),
        "functions": len(plain),
        "calls": len(calls),
        "returns": len(returns),
        "most_returned": collections.Counter(returns).most_common(5),
        "file_list": sorted({f for f, _ in calls}),
    }


def device_map(layers: int) -> dict[str, str]:
    top = dict.fromkeys(["model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"], "cpu")
    half = layers // 2
    return {**top, **{f"model.layers.{i}": "cpu" if i < half else "disk" for i in range(layers)}}


def worker(kind: str, directory: Path) -> dict[str, Any]:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(directory)
    dmap = device_map(cfg.num_hidden_layers)
    if kind == "torchplace":
        import torchplace

        def load() -> Any:
            skel = torchplace.skeleton(transformers.LlamaForCausalLM, cfg)
            return lambda: torchplace.load_into(skel, directory, device_map=dmap)

        load()()  # a first load outside the trace: what it imports lazily is not counted
        return trace("torchplace", load())
    if kind == "transformers":

        def from_pretrained() -> Any:
            folder = tempfile.mkdtemp()
            return lambda: transformers.LlamaForCausalLM.from_pretrained(
                directory, device_map=dmap, offload_folder=folder
            )

        from_pretrained()()
        return trace("transformers+accelerate+safetensors", from_pretrained())
    import accelerate

    def dispatch() -> Any:
        with accelerate.init_empty_weights():
            empty = transformers.LlamaForCausalLM(cfg)
        folder = tempfile.mkdtemp()
        return lambda: accelerate.load_checkpoint_and_dispatch(
            empty, str(directory), device_map=dmap, offload_folder=folder
        )

    dispatch()()
    return trace("accelerate", dispatch())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], Path(args.worker[1]))))
        return
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as where:
        directory = Path(where) / "llama"
        config = transformers.LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=128,
            num_hidden_layers=args.layers, num_attention_heads=4, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(directory)
        rows = {}
        for kind in ("torchplace", "accelerate", "transformers"):
            cmd = [sys.executable, __file__, "--worker", kind, str(directory)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(rows))
        return
    print("| loader | files | functions | calls | returns to a file left |")
    print("| --- | --- | --- | --- | --- |")
    for kind, r in rows.items():
        print(f"| {kind} | {r['files']} | {r['functions']} | {r['calls']} | {r['returns']} |")
    for kind, r in rows.items():
        print(f"\n{kind}: {', '.join(r['file_list'])}")
        print(f"  returned to most: {r['most_returned']}")


if __name__ == "__main__":
    main()
