"""What ``torchplace estimate DIR`` checks of a ``config.json`` before transformers builds it:
a JSON object of bounded size and depth, an ``architectures`` list naming a model class, sizes
of the type the config class has, and depths that build in bounded time. Each refusal is a
``TorchplaceError`` naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._errors import TorchplaceError

__all__ = ["MOST_LAYERS", "checked_config", "model_class"]

# The largest config.json read (real ones are kilobytes; one with ImageNet-21k's labels is under
# 2 MiB) and the deepest nesting of it: a bound on the memory and the recursion of reading it.
_MOST_BYTES = 16 << 20
_DEEPEST = 32
# The most layers (or experts, or heads) a count may ask for: the largest published models have
# a few hundred layers and experts; a million builds for hours, even on meta.
MOST_LAYERS = 4096
_COUNTS = ("layers", "experts", "n_layer", "depth", "heads", "n_head")


def _depth(value: Any) -> int:
    """How deeply ``value`` nests, iteratively (no recursion to overflow)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        deepest = max(deepest, depth)
        if depth <= _DEEPEST and isinstance(item, (dict, list)):
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def checked_config(config_file: Path) -> dict[str, Any]:
    """``config_file`` read as JSON, refused with its reason where it is no object to build."""
    try:
        size = config_file.stat().st_size
        if size > _MOST_BYTES:
            raise TorchplaceError(
                f"{config_file} is {size:,} bytes, more than any model config ({_MOST_BYTES:,} "
                "at most); give the model's own config.json"
            )
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise TorchplaceError(f"{config_file} cannot be read as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise TorchplaceError(
            f"{config_file} holds a JSON {type(raw).__name__}, where a model config is an "
            'object ({"model_type": ..., ...})'
        )
    if _depth(raw) > _DEEPEST:
        raise TorchplaceError(
            f"{config_file} nests deeper than {_DEEPEST} levels, more than any model config"
        )
    _check_counts(config_file, raw, "")
    return raw


def _check_counts(config_file: Path, raw: dict[str, Any], where: str) -> None:
    """Refuse a count of layers, experts or heads over ``MOST_LAYERS`` (or below 0), at any
    depth of the config (its text and vision parts have theirs)."""
    for key, value in raw.items():
        field = f"{where}{key}"
        if isinstance(value, dict):
            _check_counts(config_file, value, f"{field}.")
        elif _is_count(key) and isinstance(value, int) and not 0 <= value <= MOST_LAYERS:
            raise TorchplaceError(
                f"{config_file}: {field}={value} is no count a model is built with (0 to "
                f"{MOST_LAYERS}); fix {field}"
            )


def _is_count(key: str) -> bool:
    low = key.lower()
    named = low.startswith(("num_", "n_")) and any(part in low for part in _COUNTS)
    return named or low in _COUNTS


def model_class(config_file: Path, raw: dict[str, Any], transformers: Any) -> type | None:
    """The class ``architectures`` names (its first), where transformers has it and it is a
    model class; None where the field is absent (AutoModel then builds the config's model).
    Nothing named is called before it is known to be a ``PreTrainedModel``."""
    names = raw.get("architectures")
    if names is None or names == []:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise TorchplaceError(
            f"{config_file}: architectures={names!r} is no list of class names; "
            'fix architectures (["LlamaForCausalLM"]) or leave it out'
        )
    found = getattr(transformers, names[0], None)
    if found is None:
        return None  # a class of remote code, or of a later transformers: AutoModel builds it
    if not (isinstance(found, type) and issubclass(found, transformers.PreTrainedModel)):
        raise TorchplaceError(
            f"{config_file}: architectures names {names[0]!r}, which in transformers is "
            f"{'a ' + type(found).__name__ if not isinstance(found, type) else 'a class'} but "
            "no model class; fix architectures, or leave it out"
        )
    return found
