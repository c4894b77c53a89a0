"""The ``torchplace`` command: ``doctor`` (the main job), ``inspect``, ``remap`` and ``bench``.

Each sub-command lives beside the code it drives and registers itself here through a
``register(subparsers)`` function that sets ``func`` (taking the parsed arguments, returning the
exit status). Heavy imports happen inside those functions, so ``torchplace --help`` stays quick.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]

# Modules that contribute sub-commands, in the order ``--help`` lists them.
_COMMAND_MODULES = ("_doctor", "_checkpoint_cli", "_bench")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchplace",
        description="Put every tensor of a PyTorch program in its place, and prove it.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"torchplace {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"torchplace.{name}")
        except ModuleNotFoundError as exc:  # a command still being built is simply not offered
            if exc.name != f"torchplace.{name}":
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 healthy, 1 needs fixing, 2 bad usage,
    130 interrupted)."""
    parser = _parser()
    args = parser.parse_args(argv)
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
