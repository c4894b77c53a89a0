"""How a command that writes a checkpoint ends (``torchplace convert``, ``torchplace remap``): one
runner, so that both say the same thing with the same exit status. Bad usage (a size or a
device it cannot read) exits 2, any other ``TorchplaceError`` 1, each with its message after
``torchplace COMMAND: error:``; Ctrl-C exits 130 saying that the output was not written (each
command writes beside its output and renames only once done). No torch at import.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

from .._errors import DeviceSpecError, TorchplaceError

__all__ = ["run_command"]

T = TypeVar("T")


def run_command(
    command: str, output: object, work: Callable[[], T], report: Callable[[T], None]
) -> int:
    """``work()``, then ``report`` of what it returned; the command's exit status.

    >>> run_command("convert", "out.safetensors", lambda: 3, lambda n: print(f"wrote {n}"))
    wrote 3
    0
    """
    try:
        result = work()
    except DeviceSpecError as exc:  # bad usage, not a bad file
        print(f"torchplace {command}: error: {exc}", file=sys.stderr)
        return 2
    except TorchplaceError as exc:
        print(f"torchplace {command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"torchplace {command}: interrupted; {output} was not written", file=sys.stderr)
        return 130
    report(result)
    return 0
