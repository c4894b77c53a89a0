"""``torchplace estimate PATH``: will it fit, before anything is downloaded or allocated.

For a Hugging Face directory (one with a ``config.json``) the model is built from its config as
a skeleton (transformers' own classes, parameters on ``meta``: no weights read, nothing
downloaded), its parameters are made fake tensors on ``--device``, and ``estimate`` runs one
step of ``--batch`` x ``--seq`` tokens on them. For a checkpoint (a file, an index, a directory
of weights without a config) only the bytes of its tensors are counted, by dtype, with the
gradients and optimizer state a training run adds; no step can run without the model's code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._devices import normalize
from .._errors import TorchplaceError, first_line, prefixed
from .._tensor_size import dtype_named
from ..looking._estimate import (
    COUNT_INSTEAD,
    IF_NOT_A_BATCH,
    PASS_A_BATCH,
    Estimate,
    count_tensors,
    estimate,
)
from ._config_checks import checked_config, model_class
from ._inputs import example_batch

__all__ = ["register"]

HELP = "will it fit: a model directory's training or inference step, or a checkpoint's bytes"
TRANSFORMERS_HINT = "pip install transformers"


def register(subparsers: Any) -> None:
    """Add ``estimate`` to the ``torchplace`` command line.

    >>> import argparse
    >>> parser = argparse.ArgumentParser(prog="torchplace")
    >>> register(parser.add_subparsers())
    >>> args = parser.parse_args(["estimate", "model/", "--seq", "128", "--dtype", "bf16"])
    >>> args.seq, args.batch, args.dtype
    (128, 1, torch.bfloat16)
    """
    cmd = subparsers.add_parser(
        "estimate",
        help=HELP,
        description="How much memory one step needs, before anything is allocated. For a "
        "Hugging Face model directory (with a config.json), the model is built from its config "
        "with no weights read and nothing downloaded, and one step on BATCH x SEQ tokens runs "
        "on fake tensors: the peak per device, split into parameters, gradients, optimizer "
        "state, activations and temporaries, and the modules at the peak. For a checkpoint "
        "(a file, a shard index or a directory of weights), the bytes of its tensors by dtype "
        "with the gradients and optimizer state that training adds.",
    )
    cmd.add_argument("path", metavar="PATH", help="a model directory or a checkpoint")
    cmd.add_argument("--batch", type=_positive, default=1, help="sequences per step (1)")
    cmd.add_argument(
        "--seq",
        type=_positive,
        default=None,
        help="tokens per sequence (2048, or less when "
        "the config's max_position_embeddings is less)",
    )
    cmd.add_argument(
        "--optimizer", default="adam", help="adam, adamw, sgd, sgd-momentum, adagrad or none (adam)"
    )
    cmd.add_argument(
        "--dtype",
        type=_dtype,
        default=None,
        help="the parameters' dtype: bf16, fp16, fp32 ... (the config's, else the checkpoint's)",
    )
    cmd.add_argument(
        "--step",
        choices=("train", "forward"),
        default="train",
        help="train: forward, backward and optimizer step; forward: inference",
    )
    cmd.add_argument("--device", default="cuda:0", help="the device to size for (cuda:0)")
    cmd.add_argument("--json", action="store_true", help="print JSON instead of tables")
    cmd.set_defaults(func=_run)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is no positive whole number")
    return value


def _dtype(text: str) -> torch.dtype:
    found = dtype_named(text)
    if found is None:
        raise argparse.ArgumentTypeError(f"{text!r} is no floating dtype; use bf16, fp16 or fp32")
    return found


def _run(args: argparse.Namespace) -> int:
    try:
        device = normalize(args.device)
        source = Path(args.path).expanduser()
        if (source / "config.json").is_file():
            found, extra = _from_config(source, args, device)
        else:
            found, left_out = _from_checkpoint(source, args, device)
            extra = {"kind": "checkpoint", "left_out": left_out}
    except TorchplaceError as exc:
        print(f"torchplace estimate: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"path": str(args.path), **extra, **found.to_dict()}, indent=2))
        return 0
    if extra["kind"] == "transformers":
        print(
            f"{args.path}: {extra['architecture']}, one {args.step} step of {extra['input']} "
            f"on {device}\n"
        )
    else:
        kept = f", leaving out its {', '.join(map(repr, extra['left_out']))}"
        kept = kept if extra["left_out"] else ""
        print(f"{args.path}: the checkpoint's weights on {device}{kept} (no step: no model code)\n")
    print(found)
    return 0


@contextlib.contextmanager
def _saying(what: str) -> Iterator[None]:
    """A spinner on stderr saying ``what`` while the block runs, where stderr is a terminal."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(what):
        yield


def _on_fake(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` with fake parameters and buffers on ``device`` (each tied one), nothing real."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    made: dict[int, torch.Tensor] = {}
    with FakeTensorMode():
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in list(table.items()):
                    if t is not None and id(t) not in made:
                        fake = torch.empty(t.shape, dtype=t.dtype, device=device)
                        grad = isinstance(t, nn.Parameter) and t.requires_grad
                        made[id(t)] = (
                            nn.Parameter(fake, grad) if isinstance(t, nn.Parameter) else fake
                        )
                    if t is not None:
                        table[name] = made[id(t)]  # type: ignore[assignment]
    return model


def _skeleton_from_config(folder: Path, dtype: torch.dtype | None) -> tuple[nn.Module, Any]:
    """The model ``folder/config.json`` describes, built by transformers on ``meta``."""
    config_file = folder / "config.json"
    try:
        import transformers
    except ImportError:
        raise TorchplaceError(
            f"{config_file} is a transformers config, and building its model needs "
            f"transformers, which is not installed: {TRANSFORMERS_HINT}"
        ) from None
    raw = checked_config(config_file)
    cls = model_class(config_file, raw, transformers)
    names = raw.get("architectures") or [None]
    architecture = names[0]
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        with torch.device("meta"):
            model = cls(config) if cls is not None else transformers.AutoModel.from_config(config)  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise TorchplaceError(
            f"{config_file}: transformers {transformers.__version__} cannot build architecture "
            f"{architecture or '(none named)'} (model_type {raw.get('model_type')!r}): "
            f"{type(exc).__name__}: {first_line(exc)}{_fields_named(raw, exc)}; upgrade "
            "transformers, or estimate the model in Python: torchplace.estimate(model, "
            "example_input=...)"
        ) from exc
    saved = raw.get("dtype") or raw.get("torch_dtype")
    wanted = dtype or getattr(torch, str(saved), None)
    return (model.to(wanted) if isinstance(wanted, torch.dtype) else model), config


def _fields_named(raw: dict[str, Any], exc: BaseException) -> str:
    """The config's fields that ``exc``'s message names, as a clause ('' where none is)."""
    said = str(exc)
    named = [key for key in raw if len(key) > 2 and key in said]
    return f" (check {', '.join(named)} in config.json)" if named else ""


def _from_config(
    folder: Path, args: argparse.Namespace, device: torch.device
) -> tuple[Estimate, dict[str, Any]]:
    with _saying(f"building {folder / 'config.json'} on meta"):
        model, config = _skeleton_from_config(folder, args.dtype)
    longest = getattr(config, "max_position_embeddings", None)
    seq = args.seq or (min(2048, longest) if isinstance(longest, int) and longest > 0 else 2048)
    model.train(args.step == "train")  # inference in eval mode, as from_pretrained gives it
    try:
        batch, said = example_batch(model, config, args.batch, seq, args.step == "train")
    except (TypeError, ValueError, OverflowError) as exc:  # a size of the config's that is none
        raise TorchplaceError(
            f"{folder / 'config.json'}: the {getattr(model, 'main_input_name', 'input')} of "
            f"{type(model).__name__} cannot be shaped from it: {type(exc).__name__}: {exc}; "
            "fix image_size, num_channels or conv_stride, whichever is no whole number"
        ) from exc
    extra = {"kind": "transformers", "architecture": type(model).__name__, "batch": args.batch}
    extra.update(seq=seq, input=said)
    name = None if args.optimizer.strip().lower() == "none" else args.optimizer
    with _saying(f"one {args.step} step of {type(model).__name__}, {said}"):
        try:
            found = estimate(
                _on_fake(model, device), optimizer=name, example_input=batch, step=args.step
            )
        except TorchplaceError as exc:
            fault = _config_at_fault(model, config, seq)
            raise _for_the_command_line(exc, said, longest, fault) from exc.__cause__
    return found, extra


def _config_at_fault(model: nn.Module, config: Any, seq: int) -> str:
    """Where the model's step failed on the command's batch: whether a forward of the
    smallest batch fails too (then the config's sizes disagree with each other, not with the
    batch: a sentence saying so), else ''."""
    small, said = example_batch(model, config, 1, min(seq, 8), False)
    try:
        estimate(model, optimizer=None, example_input=small, step="forward")
    except TorchplaceError:
        return (
            f"a forward of the smallest batch ({said}) fails too, so the config's sizes "
            "disagree with each other, not with the batch: check the fields of config.json "
            "that the failing module reads (head counts and sizes, num_key_value_heads)"
        )
    return ""


def _for_the_command_line(
    exc: TorchplaceError, said: str, longest: object, fault: str = ""
) -> TorchplaceError:
    """``estimate``'s error about its ``example_input``, with the fix a command line can
    follow: the tokens are the command's (``--batch`` x ``--seq``), not a batch in Python; or
    ``fault``, where the config, not the batch, is at fault."""
    text = str(exc)
    if "example_input: " not in text:
        return exc
    if fault:
        head = text.partition(f"; {PASS_A_BATCH}")[0].partition(f". {IF_NOT_A_BATCH}")[0]
        return TorchplaceError(f"{head.replace('example_input: ', f'{said}: ', 1)}; {fault}")
    limit = (
        f" (this config's max_position_embeddings is {longest})"
        if isinstance(longest, int) and longest > 0
        else ""
    )
    head, found, _ = text.partition(f"; {PASS_A_BATCH}")
    if found:  # the model's own refusal of the tokens
        text = f"{head}; pass a --seq and --batch this model takes{limit}"
    elif IF_NOT_A_BATCH in text:  # a fake kernel's failure
        text = text.replace(
            IF_NOT_A_BATCH,
            f"If the tokens are not what this model takes, pass a --seq and --batch it "
            f"takes{limit}",
        ).replace(COUNT_INSTEAD, "torchplace estimate of its weights file counts")
    else:
        return exc
    return TorchplaceError(text.replace("example_input: ", f"{said}: ", 1))


# The top-level keys of a training checkpoint that hold no weights of the model: its
# optimizer's state (counted again from the weights, as gradients and the optimizer's copies)
# and the training loop's own state. Left out only where one of them holds an optimizer's
# ``state`` (a model may have a submodule called ``scaler``).
_NOT_WEIGHTS = frozenset(
    {"optimizer", "optimizers", "optimizer_state", "optimizer_state_dict", "optimizer_states",
     "optim", "opt", "scheduler", "lr_scheduler", "lr_schedulers", "scaler", "grad_scaler"}
)  # fmt: skip


# A checkpoint alone does not say which of its tensors are buffers; these names are the norm
# layers' statistics (BatchNorm, InstanceNorm with running stats), counted as buffers: no
# gradient, no optimizer state. Any other tensor counts as a parameter.
_BUFFER_NAMES = frozenset({"running_mean", "running_var", "num_batches_tracked"})


def _from_checkpoint(
    source: Path, args: argparse.Namespace, device: torch.device
) -> tuple[Estimate, list[str]]:
    """The checkpoint's weights counted as parameters on ``device`` from their shapes (no
    tensor made; norm statistics as buffers, ``_BUFFER_NAMES``), and what of a training
    checkpoint was left out (its ``optimizer`` state: counted from the weights)."""
    from ..checkpoint._catalog import catalog

    every = [r for r in catalog(source).records() if r.shares is None]  # each storage once
    heads = {r.name.split(".", 1)[0] for r in every if ".state." in r.name}
    training = bool(heads & _NOT_WEIGHTS)  # an optimizer's state beside the weights
    records = [r for r in every if not training or r.name.split(".", 1)[0] not in _NOT_WEIGHTS]
    left_out = sorted(
        {r.name.split(".", 1)[0] for r in every} - {r.name.split(".", 1)[0] for r in records}
    )
    train = args.step == "train"
    name = None if args.optimizer.strip().lower() == "none" or not train else args.optimizer
    shapes = []
    for r in records:
        dtype = getattr(torch, r.dtype)
        if args.dtype is not None and dtype.is_floating_point:
            dtype = args.dtype
        shapes.append((tuple(r.shape), dtype, r.name.rsplit(".", 1)[-1] in _BUFFER_NAMES))
    try:
        return count_tensors(shapes, device, name, train), left_out
    except TorchplaceError as err:
        raise prefixed(err, "estimate()") from err.__cause__
