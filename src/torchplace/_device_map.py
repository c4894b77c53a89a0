"""A device map read against a model: each key a module the model has, each value a device or
``"disk"``, with the typo named and its likely fix. Read by ``dispatch`` and ``load_into``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ._devices import device as _device
from ._errors import DeviceSpecError, TorchplaceError
from ._model_walk import ModelTree, display
from ._suggest import close_matches

__all__ = ["DISK", "entry_of", "parse_device_map", "whole_model_map"]

DISK = "disk"  # the tier a device map may name besides devices: weights left in their checkpoint


def parse_device_map(
    tree: ModelTree,
    device_map: object,
    *,
    resolve: Callable[[Any], torch.device] = _device,
) -> dict[str, torch.device | str]:
    """``device_map`` checked against ``tree``: each key a module of the model, each value
    ``"disk"`` or a device spec turned into a device by ``resolve`` (``device()``, which also
    checks that the machine has it)."""
    if not isinstance(device_map, Mapping):
        raise DeviceSpecError(
            f"device_map must be a dict of module name -> device such as "
            f"{{'encoder': 'cuda:0', 'decoder': 'cuda:1'}} (plan() makes one), "
            f"not {type(device_map).__name__}"
        )
    names = list(tree.modules)
    entries: dict[str, torch.device | str] = {}
    for name, spec in device_map.items():
        where = f"device_map[{name!r}]"
        if not isinstance(name, str):
            raise DeviceSpecError(f"{where}: keys are module names (strings), '' for the model")
        if name not in tree.modules:
            owned = [key for key, qualified in tree.owners.items() if name in qualified]
            if owned:
                module = name.rpartition(".")[0]
                raise DeviceSpecError(
                    f"{where}: {display(name)} is a tensor, not a module; map the module that "
                    f"holds it, {module!r}"
                )
            guess = close_matches(name, names, n=3)
            hint = f"did you mean {' or '.join(repr(g) for g in guess)}? " if guess else ""
            raise DeviceSpecError(
                f"{where}: the model has no submodule {name!r}; {hint}keys are names from "
                "model.named_modules(), and '' is the whole model"
            )
        if spec == DISK:
            entries[name] = DISK
            continue
        if spec is None:  # device(None) is "auto"; in a map it is a lookup that missed
            raise DeviceSpecError(
                f"{where}: None is no device; give each entry a device ('cpu', 'cuda:0', ...), "
                f"{DISK!r}, or 'auto' for the best device here"
            )
        try:
            entries[name] = resolve(spec)
        except TorchplaceError as err:
            if isinstance(spec, str) and close_matches(spec.lower(), [DISK], same=True):
                raise DeviceSpecError(  # a map's own word, which device() does not know
                    f"{where}: unknown device spec {spec!r}; did you mean {DISK!r} (the module "
                    "left in its checkpoint, read as it runs)? A map takes a device spec or "
                    f"{DISK!r}"
                ) from None
            raise type(err)(f"{where}: {err}") from None
    return entries


def entry_of(path: str, entries: Mapping[str, object]) -> str | None:
    """The most specific key of ``entries`` (a device map, ``""`` the whole model) that
    contains module ``path``: itself, else its nearest parent.

    >>> entry_of("layers.1.mlp", {"": "cpu", "layers.1": "disk"})
    'layers.1'
    >>> entry_of("head", {"layers": "cpu"}) is None
    True
    """
    probe = path
    while True:
        if probe in entries:
            return probe
        if not probe:
            return None
        probe = probe.rpartition(".")[0]


def whole_model_map(model: nn.Module, tier: str, resident: str) -> dict[str, str]:
    """The map that ``{"": tier}`` stands for: the whole model on that tier (``"disk"``, or
    ``"cpu"`` beside an accelerator), each block its own entry, so that a window of one block
    bounds the memory while it runs. A module is its own block where its state dict holds
    tensors of its own, or where it is a class a transformers model keeps whole, its
    ``_no_split_modules`` (a decoder layer). Buffers a state dict leaves out (a rotary
    embedding's) are made, not read: their modules stay on ``resident``. A module with no
    tensor needs no entry.

    >>> from torch import nn
    >>> m = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2)))
    >>> whole_model_map(m, "cpu", "cuda:0")
    {'0': 'cpu', '2.0': 'cpu'}
    """
    whole = {n for m in model.modules() for n in getattr(m, "_no_split_modules", None) or ()}
    out: dict[str, str] = {}

    def visit(name: str, module: nn.Module) -> None:
        children = [(n, c) for n, c in module._modules.items() if c is not None]
        saved = any("." not in key for key in module.state_dict(keep_vars=True))
        if saved or type(module).__name__ in whole:
            out[name] = tier
            return
        if any(b is not None for b in module._buffers.values()):
            out[name] = resident  # only buffers it does not save: made, not read
        for child, inner in children:
            visit(f"{name}.{child}" if name else child, inner)

    visit("", model)
    return out
