"""The ``torchplace`` command: ``doctor`` (the main job), ``inspect``, ``remap``, ``convert``,
``estimate`` and ``bench``.

Each sub-command lives beside the code it drives and registers itself here through a
``register(subparsers)`` function that sets ``func`` (taking the parsed arguments, returning the
exit status). Only the module of the command being run is imported, and ``import torchplace``
imports no torch, so ``torchplace --help`` and ``torchplace inspect FILE.safetensors`` start at
once.

A usage error is said by the parser it belongs to: a command's unknown option or extra word by
that command (its usage, "torchplace bench: error: ..."), even before its missing arguments; a
misspelt command or option says what it may misspell ("did you mean '--device'?").
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from .._suggest import did_you_mean

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
    "convert": (
        "checkpoint._convert_cli",
        "write a checkpoint again as safetensors or .pt (runs no code)",
    ),
    "estimate": (
        "cli._estimate",
        "will it fit: a model directory's training or inference step, or a checkpoint's bytes",
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


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    """The parser of ``command`` (registered by its module), if ``parser`` has one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser | None = action.choices.get(command)
            return found
    return None


# What argparse takes for a negative number, not an option ("--size -1" says -1 is no size).
_NUMBER = re.compile(r"-\d+$|-\d*\.\d+$")


def _unknown_options(parser: argparse.ArgumentParser, words: Sequence[str]) -> list[str]:
    """The words that look like options of ``parser`` but are none (argparse's own ways of
    writing one kept: ``--name=value``, a unique start of a long name, ``-oVALUE``)."""
    known = parser._option_string_actions
    unknown = []
    for word in words:
        if word == "--":  # what follows is positional
            break
        if not word.startswith("-") or word == "-" or _NUMBER.match(word):
            continue
        name = word.split("=", 1)[0] if word.startswith("--") else word
        if name in known or (not word.startswith("--") and word[:2] in known):
            continue
        if word.startswith("--") and any(k.startswith(name) for k in known if k[:2] == "--"):
            continue  # an abbreviation, which argparse resolves (or calls ambiguous)
        unknown.append(word)
    return unknown


def _unrecognized(
    parser: argparse.ArgumentParser,
    words: Sequence[str],
    top: argparse.ArgumentParser | None = None,
) -> NoReturn:
    """Exit 2 with ``parser``'s usage, naming ``words`` and the options they may misspell;
    ``top``: the ``torchplace`` parser, when ``parser`` is a command's."""
    options = [k for k in parser._option_string_actions if k.startswith("--")]
    hints = []
    for word in words:
        if word == "--":  # the words after it are positional, as the user said
            break
        name = word.split("=", 1)[0]
        if top is not None and name in top._option_string_actions:
            hints.append(f"{name} is an option of torchplace itself: torchplace {name}")
        elif word.startswith("-"):
            hints.append(did_you_mean(name, options).rstrip())
    hint = "".join(f"; {h}" for h in hints if h)
    parser.error(f"unrecognized arguments: {' '.join(words)}{hint}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 healthy, 1 needs fixing, 2 bad usage,
    130 interrupted)."""
    words = list(sys.argv[1:] if argv is None else argv)
    command = _command_in(words)
    parser = _parser(command or "")
    if command is not None and command not in _COMMANDS:  # before argparse's words, to suggest
        parser.error(
            f"argument COMMAND: invalid choice: {command!r}; "
            f"{did_you_mean(command, _COMMANDS)}choose from {', '.join(_COMMANDS)}"
        )
    at = words.index(command) if command is not None else len(words)
    sub = _subparser(parser, command) if command is not None else None
    if sub is not None:
        # A command's unknown option is its own error, with its own usage, before argparse
        # would say its required arguments are missing or hand the word to the top parser.
        unknown = _unknown_options(sub, words[at + 1 :])
        if unknown:
            _unrecognized(sub, unknown, parser)
    args, extras = parser.parse_known_args(words)
    if extras:  # a word too many: the command's (after it) or the top level's (before it)
        if sub is not None and not set(words[:at]) & set(extras):
            _unrecognized(sub, extras, parser)
        _unrecognized(parser, extras)
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
