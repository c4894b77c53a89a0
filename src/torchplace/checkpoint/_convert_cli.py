"""The ``convert`` command: any checkpoint ``load`` reads, written again by ``save``.

The source is resolved into its catalog (``_catalog``), which reads a pickle inertly: it never
imports or calls what the pickle names. Each tensor is then read by its byte range when the
writer reaches it, one at a time, so the conversion holds one tensor in memory (the catalog's
names: a nested ``{"model": {"w": ...}}`` gives ``model.w``). Objects a pickle would build by
running code are left out, and said; only a legacy (pre-1.6) torch file, whose tensors cannot
be read by offset, is read whole, with ``weights_only=True``, and refused if it names code.
Values that are not tensors (an ``epoch``, an optimizer's ``param_groups``) have no place in a
checkpoint file of tensors: they are left out too, and said, each by its name and type.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["convert", "register"]


def convert(source: str | Path, dest: str | Path, /, *, max_shard_size: str = "5GB",
            force: bool = False) -> tuple[int, int, list[str], list[tuple[str, str]]]:  # fmt: skip
    """Write the checkpoint ``source`` to ``dest`` with ``save``; returns the tensors and bytes
    written, the code the source's pickle names (left out, never run), and the values that are
    not tensors (left out), each with its type name.

    >>> import os, tempfile, torch
    >>> from torchplace.checkpoint._convert_cli import convert
    >>> d = tempfile.mkdtemp()
    >>> torch.save({"w": torch.ones(2)}, os.path.join(d, "a.pt"))
    >>> convert(os.path.join(d, "a.pt"), os.path.join(d, "a.safetensors"))
    (1, 8, [], [])
    """
    import torch

    from .._errors import CheckpointError
    from ._catalog import catalog, left_out_values
    from ._load import load, read_entries
    from ._save import save_items
    from ._source import as_path
    from ._writers import Item

    out = as_path(dest)
    if out.exists() and not force:
        raise CheckpointError(f"{out}: exists already; give --force to replace it", path=out)
    found = catalog(source)
    cpu = torch.device("cpu")
    if all(e.addressable for e in found.entries.values()):

        def reader(name: str) -> Any:
            return lambda: read_entries(found, [name], cpu, threads=1)[name]

        items: Any = [Item(n, e.torch_dtype(found.where), e.shape, reader(n))
                      for n, e in found.entries.items()]  # fmt: skip
        left = left_out_values(found)
    else:  # a legacy file: read whole, by torch's safe loader (refused if it names code)
        left = []
        items = _tensors(load(source, "cpu"), "", left)
    save_items(items, dest, max_shard_size=max_shard_size, others=_other_files(source, found))
    return len(items), sum(it.nbytes for it in items), list(found.code), left


def _other_files(source: str | Path, found: Any) -> list[Path]:
    """The files of a source directory beside its checkpoint (``config.json``, a tokenizer),
    which a directory written from it receives as they are."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        return []
    read = set(found.stamps) | ({found.path} if found.path is not None else set())
    return sorted(
        p for p in folder.iterdir()
        if p.is_file() and p not in read and not p.name.startswith(".")
        and not p.name.endswith((".bin", ".safetensors", ".pt", ".pth", ".index.json"))
    )  # fmt: skip


def _tensors(obj: Any, prefix: str, left: list[tuple[str, str]]) -> Any:
    """The tensors of a loaded legacy checkpoint as items, named as the catalog names them;
    each value that is not a tensor and holds none added to ``left``, with its type name."""
    import torch

    from ._writers import Item

    if isinstance(obj, torch.Tensor):
        t = obj
        return [Item(prefix, t.dtype, tuple(t.shape), lambda: t)]
    if isinstance(obj, (dict, list, tuple)) and _holds_tensor(obj):
        pairs = obj.items() if isinstance(obj, dict) else enumerate(obj)
        return [it for k, v in pairs for it in _tensors(v, f"{prefix}.{k}" if prefix else str(k),
                                                        left)]  # fmt: skip
    left.append((prefix or "<root>", type(obj).__name__))
    return []


def _holds_tensor(obj: Any) -> bool:
    import torch

    if isinstance(obj, torch.Tensor):
        return True
    values = (
        obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    )
    return any(_holds_tensor(v) for v in values)


def _run(args: argparse.Namespace) -> int:
    from .._sizes import format_bytes
    from ._run_command import run_command

    def say(written: tuple[int, int, list[str], list[tuple[str, str]]]) -> None:
        count, nbytes, code, left = written
        print(f"wrote {args.output}: {count} tensors, {format_bytes(nbytes)}")
        if code:
            print(f"left out what its pickle would build by running code ({', '.join(code)}); "
                  "none of it was run")  # fmt: skip
        if left:
            print(_left_out(left), file=sys.stderr)

    return run_command(
        "convert",
        args.output,
        lambda: convert(
            args.source, args.output, max_shard_size=args.max_shard_size, force=args.force
        ),
        say,
    )


def _left_out(left: list[tuple[str, str]], shown: int = 10) -> str:
    """What ``convert`` says of the values it left out: the first ``shown``, then a count.

    >>> print(_left_out([("epoch", "int"), ("opt.param_groups", "list")]))  # doctest: +ELLIPSIS
    left out 2 values that are not tensors (...): epoch (int), opt.param_groups (list)
    """
    names = ", ".join(f"{key} ({kind})" for key, kind in left[:shown])
    more = f", and {len(left) - shown} more" if len(left) > shown else ""
    what = (
        f"{len(left)} values that are not tensors"
        if len(left) > 1
        else "a value that is not a tensor"
    )
    return (f"left out {what} (a checkpoint file holds tensors only; save them beside it, "
            f"in a JSON file): {names}{more}")  # fmt: skip


def register(subparsers: Any) -> None:
    """Add ``convert`` to the ``torchplace`` command line.

    >>> import argparse
    >>> parser = argparse.ArgumentParser(prog="torchplace")
    >>> register(parser.add_subparsers())
    >>> parser.parse_args(["convert", "a.bin", "-o", "a.safetensors"]).output
    'a.safetensors'
    """
    cmd = subparsers.add_parser(
        "convert",
        help="write a checkpoint again as safetensors or .pt (runs no code)",
        description="Convert a checkpoint that torchplace.load reads (a torch .bin/.pt file, "
        "zip or legacy, a .safetensors file, a shard index or a save_pretrained directory) to "
        "a .safetensors file, a .pt file, or (any other DEST) a directory as save_pretrained "
        "writes it (given a directory, with its other files, config.json and tokenizer "
        "files, copied as they are), through torchplace.save: atomically, one tensor in "
        "memory at a time. "
        "Pickled code is never run: objects that would need it are left out, and said.",
    )
    cmd.add_argument("source", metavar="SOURCE", help="the checkpoint to read")
    cmd.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="DEST",
        help="a .safetensors or .pt/.pth file, or a directory to write",
    )
    cmd.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="for a directory, the most bytes of one shard (default 5GB)",
    )
    cmd.add_argument("--force", action="store_true", help="replace DEST if it exists")
    cmd.set_defaults(func=_run)
