"""The ``torchplace`` command: ``doctor`` (the main job), ``inspect``, ``remap`` and ``bench``.

Each sub-command lives beside the code it drives and registers itself here through a
``register(subparsers)`` function that sets ``func`` (taking the parsed arguments, returning the
exit status). Only the module of the command being run is imported, and ``import torchplace``
imports no torch, so ``torchplace --help`` and ``torchplace inspect FILE.safetensors`` start at
once.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]

# The sub-commands, in the order ``--help`` lists them: the module that registers each (and
# imports what it needs, torch included), and its line in ``--help``. Only the module of the
# command being run is imported, so ``torchplace --help`` and argument errors import no torch; a
# test checks these lines against the ones the modules register.
_COMMANDS = {
    "doctor": ("cli._doctor", "check devices, placement and copies on this machine (the main job)"),
    "inspect": (
        "checkpoint._checkpoint_cli",
        "list a checkpoint's tensors by saved device, dtype and size (runs no code)",
    ),
    "remap": (
        "checkpoint._checkpoint_cli",
        "rewrite a checkpoint (or every shard of one) to load elsewhere",
    ),
    "bench": ("cli._bench", "copy bandwidth: pageable, pinned, per-tensor and consolidated"),
}


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line, with ``command`` (or, when ``None``, every command) fully registered
    by its module; the others are listed by name and help line only."""
    parser = argparse.ArgumentParser(
        prog="torchplace",
        description="Put every tensor of a PyTorch program in its place, and prove it.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"torchplace {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    registered: set[str] = set()
    for name, (module_name, help_line) in _COMMANDS.items():
        if module_name in registered:
            continue
        if command is None or _COMMANDS.get(command, ("",))[0] == module_name:
            try:
                module = importlib.import_module(f"torchplace.{module_name}")
            except ModuleNotFoundError as exc:  # a command still being built is not offered
                if exc.name != f"torchplace.{module_name}":
                    raise
                continue
            module.register(subparsers)
            registered.add(module_name)
        else:
            subparsers.add_parser(name, help=help_line)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The sub-command ``argv`` names: its first word that is not an option."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
        if arg == "--":
            break
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 healthy, 1 needs fixing, 2 bad usage,
    130 interrupted)."""
    words = list(sys.argv[1:] if argv is None else argv)
    parser = _parser(_command_in(words) or "")
    args = parser.parse_args(words)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        status: int = func(args)
    except BrokenPipeError:  # `torchplace doctor --json | head` closed the pipe: not an error
        _silence_stdout()
        return 0
    except SystemExit as exc:
        if isinstance(exc.__context__, BrokenPipeError):  # rich's way of saying the same
            return 0
        raise
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback (remap leaves no output)
        print(f"torchplace {args.command}: interrupted", file=sys.stderr)
        return 130
    return status


def _silence_stdout() -> None:
    """Point stdout at the null device, so that the interpreter's last flush into the closed
    pipe neither fails nor prints (Python's "Note on SIGPIPE"); stderr stays open."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor behind stdout
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
