"""What this torch's Dynamo (the tracer of ``torch.compile``) can trace faithfully.

Imported only while torch.compile traces a move (never by ``import torchplace``): making the
functions below imports ``torch._dynamo``, which takes seconds.

torchplace supports torch 2.6, whose Dynamo lacks features the traced ``move`` uses on newer
torch. Each is told by looking for what Dynamo offers, never by the version number; an answer
that cannot be found is "no", which takes the conservative way.

- ``"copy"``: ``copy.copy`` of an object of a user's class (a dataclass), by Dynamo's ``copy``
  polyfill.
- ``"defaultdict"``: a ``defaultdict`` made in the trace comes back a ``defaultdict`` (torch
  2.6's Dynamo hands back a plain ``dict``).
- ``"exceptions"``: raising and catching exceptions of a user's class (torch 2.6's Dynamo can
  do neither, so no torchplace error can leave a trace with its message).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ._model_walk import cached_property_names

__all__ = [
    "TRACED_FEATURES",
    "dynamo_supports",
    "raise_in_trace",
    "traced_cached_property_names",
    "traced_supports",
]

TRACED_FEATURES = ("copy", "defaultdict", "exceptions")


@functools.cache
def dynamo_supports(feature: str) -> bool:
    """Whether this torch's Dynamo traces ``feature`` (one of ``TRACED_FEATURES``)."""
    if feature not in TRACED_FEATURES:
        raise ValueError(f"unknown Dynamo feature {feature!r}; one of {TRACED_FEATURES}")
    try:
        from torch._dynamo import variables
        from torch._dynamo.polyfills import loader
    except ImportError:
        return False
    if feature == "copy":
        return "copy" in getattr(loader, "POLYFILLED_MODULE_NAMES", ())
    if feature == "defaultdict":
        legacy = getattr(variables, "DefaultDictVariable", None)
        plain = getattr(variables, "ConstDictVariable", None)  # rebuilds a dict or OrderedDict
        return legacy is None or getattr(legacy, "reconstruct", None) is not getattr(
            plain, "reconstruct", None
        )
    return hasattr(variables, "UserDefinedExceptionClassVariable")


def _traced(feature: str) -> bool:
    return dynamo_supports(feature)


# ``dynamo_supports`` as torch.compile traces it: run as it is, its answer taken as a constant.
traced_supports: Callable[[str], bool] = torch.compiler.assume_constant_result(_traced)  # type: ignore[no-untyped-call]


def _raise(error: type[Exception], message: str) -> None:
    raise error(message)


# Raises ``error(message)`` while torch.compile traces, from outside the trace, for a Dynamo
# that cannot raise a user's exception in it (torch 2.6): torch.compile then stops and reports
# it with its message (an InternalTorchDynamoError reading "MoveError: ..."), with fullgraph or
# without. Only strings, classes and other constants may be passed.
raise_in_trace: Callable[[type[Exception], str], None] = torch.compiler.assume_constant_result(
    _raise
)  # type: ignore[no-untyped-call]


# While torch.compile traces: run as it is and its result taken as a constant, as a class's
# attributes do not change once it is in use (the Dynamo of torch 2.6 cannot trace ``vars`` of
# a class).
traced_cached_property_names: Callable[[type], tuple[str, ...]] = (
    torch.compiler.assume_constant_result(cached_property_names)  # type: ignore[no-untyped-call]
)
