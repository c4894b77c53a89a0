"""What ``load_state_dict`` does around the copies, done the same way by ``load_into``.

Each module's view of the file after its version upgrade and load pre-hooks, the modules that
load themselves (an ``_load_from_state_dict`` of their own, run once their tensors are in place),
extra state set all or none, and the load post-hooks run children first.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.modules.module import _IncompatibleKeys

from .._errors import CheckpointError
from ._formats import first_sentence


def set_extra_states(
    p: Path | str,
    model: nn.Module,
    extra: Mapping[str, nn.Module],
    state: Mapping[str, Any],
    undos: list[Callable[[], object]],
) -> None:
    """``set_extra_state`` for each module whose extra state the file holds; all or none.

    What sets the states back is appended to ``undos`` before any is set; a refusal puts back
    the ones set and raises ``CheckpointError``.
    """
    done: list[tuple[nn.Module, Any]] = []

    def undo() -> None:
        for module, before in reversed(done):
            with contextlib.suppress(Exception):  # it took this state a moment ago
                module.set_extra_state(before)

    undos.append(undo)
    key = ""
    try:
        for key, module in extra.items():
            if key in state:
                # Recorded first: setting back a state a module still holds changes nothing.
                done.append((module, module.get_extra_state()))
                module.set_extra_state(state[key])
    except Exception as exc:
        undo()
        raise CheckpointError(
            f"{p}: {key} was refused by {type(extra[key]).__name__}.set_extra_state "
            f"({type(exc).__name__}: {first_sentence(str(exc))}); the model is untouched",
            path=p if isinstance(p, Path) else None,
        ) from exc


# Classes whose _load_from_state_dict load_into follows: Module's own (pre-hooks, then each
# parameter and persistent buffer by name) and the norm layers' versioned upgrades, which
# _upgrade_norm repeats. Any other override does its own loading, which load_into cannot run
# without it touching the model.
_FOLLOWED_LOADERS = (nn.Module, _NormBase, _InstanceNorm)


def _loader_class(module: nn.Module) -> type:
    """The class whose ``_load_from_state_dict`` a module runs."""
    for klass in type(module).__mro__:
        if "_load_from_state_dict" in vars(klass):
            return klass
    return nn.Module


def _is_frozen_norm(module: nn.Module) -> bool:
    """torchvision's ``FrozenBatchNorm2d`` and the copies of it in Hugging Face models (DETR and
    its family): their ``_load_from_state_dict`` only drops ``num_batches_tracked``, which a
    file saved from an ordinary BatchNorm holds, and ``as_load_state_dict_sees`` does that."""
    return _loader_class(module).__name__.endswith("FrozenBatchNorm2d")


def loads_itself(module: nn.Module) -> bool:
    """Whether ``module`` overrides ``_load_from_state_dict`` in a way load_into must run (its
    own loading: torchmetrics' metric states, a value converted on load), rather than follow."""
    if "_load_from_state_dict" in vars(module):
        return True
    return _loader_class(module) not in _FOLLOWED_LOADERS and not _is_frozen_norm(module)


def _hook_name(hook: Any) -> str:
    inner = getattr(hook, "hook", hook)  # _register_load_state_dict_pre_hook wraps it
    return str(getattr(inner, "__qualname__", None) or type(inner).__name__)


def _is_lazy_hook(hook: Any) -> bool:
    """Whether a pre-hook is a lazy module's: load_into does its work itself, after the checks.

    The hook materializes uninitialized parameters at once, so running it would change the
    model before a refusal; load_into instead gives a lazy parameter the file's shape when it
    swaps the weight in, which is what the hook and the copy after it amount to.
    """
    inner = getattr(hook, "hook", hook)
    return getattr(inner, "__func__", None) is LazyModuleMixin._lazy_load_hook


class _Seen:
    """The state dict as ``load_state_dict`` would hand it to each module, after its hooks.

    ``own`` holds each module's parameters, persistent buffers and extra state by full name,
    taken from that module's view of the file once its version upgrade and pre-hooks ran;
    ``unexpected`` the keys no module takes, found as each module finds them; ``missing`` and
    ``errors`` what pre-hooks (and the norm layers' upgrade) reported.
    """

    __slots__ = ("errors", "loaders", "missing", "own", "unexpected")

    def __init__(self) -> None:
        self.own: dict[str, Any] = {}
        self.unexpected: list[str] = []
        self.missing: list[str] = []
        self.errors: list[str] = []
        # Modules that load themselves (``loads_itself``), each with its prefix, metadata and
        # its own keys, to be run once their parameters and buffers are in place.
        self.loaders: list[tuple[nn.Module, str, dict[str, Any], dict[str, Any]]] = []


def _upgrade_norm(
    module: _NormBase, local: dict[str, Any], prefix: str, version: Any, errors: list[str]
) -> None:
    """What ``_InstanceNorm`` and ``_NormBase._load_from_state_dict`` do to an older file."""
    if isinstance(module, _InstanceNorm) and version is None and not module.track_running_stats:
        # Before 0.4 instance norms kept running stats by default; loading them would be wrong.
        stats = [prefix + n for n in ("running_mean", "running_var") if prefix + n in local]
        if stats:
            errors.append(
                f"{' and '.join(stats)}: running stats for {type(module).__name__} with "
                "track_running_stats=False (a file saved before PyTorch 0.4); remove these keys, "
                "or build the layer with track_running_stats=True"
            )
            for key in stats:
                local.pop(key)
    if (version is None or version < 2) and module.track_running_stats:
        # num_batches_tracked came with version 2: an older file starts it from 0.
        key = prefix + "num_batches_tracked"
        if key not in local:
            current = module.num_batches_tracked
            ok = current is not None and current.device.type != "meta"
            local[key] = current if ok else torch.tensor(0, dtype=torch.long)


def _run_pre_hooks(
    p: Path | str,
    module: nn.Module,
    local: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    seen: _Seen,
) -> None:
    """Run ``module``'s load_state_dict pre-hooks on its view, with PyTorch's arguments."""
    for hook in module._load_state_dict_pre_hooks.values():
        if _is_lazy_hook(hook):
            continue
        try:
            hook(local, prefix, local_metadata, True, seen.missing, seen.unexpected, seen.errors)
        except Exception as exc:
            where = prefix[:-1] or "the model"
            raise CheckpointError(
                f"{p}: the load_state_dict pre-hook {_hook_name(hook)} of {where} "
                f"({type(module).__name__}) raised {type(exc).__name__}: "
                f"{first_sentence(str(exc))}; nothing was loaded",
                path=p if isinstance(p, Path) else None,
            ) from exc


def _take_own_keys(
    module: nn.Module,
    local: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    extra: Mapping[str, nn.Module],
    seen: _Seen,
) -> dict[str, dict[str, Any]]:
    """Note the keys of ``module``'s own tensors and extra state (those that belong to none as
    unexpected; all of them for a module that loads itself); returns its children's views."""
    names = {n for n, t in module._parameters.items() if t is not None}
    names.update(
        n
        for n, b in module._buffers.items()
        if b is not None and n not in module._non_persistent_buffers_set
    )
    for name in names:
        if prefix + name in local:
            seen.own[prefix + name] = local[prefix + name]
    extra_key = prefix + "_extra_state"
    if extra_key in extra:
        if extra_key in local:
            seen.own[extra_key] = local[extra_key]
    elif extra_key in local:
        seen.unexpected.append(extra_key)
    children: dict[str, dict[str, Any]] = {}
    itself = loads_itself(module)
    handed: dict[str, Any] = {}  # a self-loading module's own keys, all handed to it
    for key, value in local.items():
        if not key.startswith(prefix) or key == extra_key:
            continue
        head, dot, _ = key[len(prefix) :].partition(".")
        if dot and head in module._modules:
            children.setdefault(head, {})[key] = value
        elif itself:
            handed[key] = value  # what it leaves, it reports as unexpected itself
        elif dot or head not in names:
            seen.unexpected.append(key)
    if itself:
        seen.loaders.append((module, prefix, local_metadata, handed))
    return children


def as_load_state_dict_sees(
    p: Path | str, model: nn.Module, state: Mapping[str, Any], extra: Mapping[str, nn.Module]
) -> _Seen:
    """Walk the model as ``load_state_dict`` does, running each module's pre-hooks on its view.

    Each module gets the keys under its prefix (a fresh dict, so a hook's changes reach the
    module and its children only), its metadata (the ``version`` that norm layers upgrade by)
    and the same arguments PyTorch passes, strict included (PyTorch always passes True there).
    """
    seen = _Seen()
    metadata = getattr(state, "_metadata", None)
    top: dict[str, Any] = collections.OrderedDict(state)
    if metadata is not None:
        top._metadata = metadata  # type: ignore[attr-defined]

    def visit(module: nn.Module, local: dict[str, Any], prefix: str) -> None:
        local_metadata = {} if metadata is None else metadata.get(prefix[:-1], {})
        if isinstance(module, _NormBase):
            _upgrade_norm(module, local, prefix, local_metadata.get("version"), seen.errors)
        elif _is_frozen_norm(module):
            local.pop(prefix + "num_batches_tracked", None)
        _run_pre_hooks(p, module, local, prefix, local_metadata, seen)
        children = _take_own_keys(module, local, prefix, local_metadata, extra, seen)
        for name, child in module._modules.items():
            if child is not None:
                visit(child, children.get(name, {}), f"{prefix}{name}.")  # noqa: F821 (deleted once done)

    try:
        visit(model, top, "")
    finally:
        del visit  # it refers to itself: break the cycle so it is freed at once
    return seen


def has_post_hooks(model: nn.Module) -> bool:
    return any(m._load_state_dict_post_hooks for m in model.modules())


def run_post_hooks(
    p: Path | str,
    model: nn.Module,
    missing: list[str],
    unexpected: list[str],
    then: Callable[[], str],
) -> None:
    """Every module's load_state_dict post-hooks, children first, as load_state_dict runs them.

    They may change ``missing`` and ``unexpected`` in place. When a hook fails, ``then`` deals
    with the model (puts it back, say) and says what state it is left in.
    """
    keys = _IncompatibleKeys(missing, unexpected)

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.")  # noqa: F821 (deleted once done)
        for hook in module._load_state_dict_post_hooks.values():
            where = f"{prefix[:-1] or 'the model'} ({type(module).__name__})"
            try:
                out = hook(module, keys)
            except Exception as exc:
                raise CheckpointError(
                    f"{p}: the load_state_dict post-hook {_hook_name(hook)} of {where} raised "
                    f"{type(exc).__name__}: {first_sentence(str(exc))}; {then()}",
                    path=p if isinstance(p, Path) else None,
                ) from exc
            if out is not None:
                raise CheckpointError(
                    f"{p}: the load_state_dict post-hook {_hook_name(hook)} of {where} returned "
                    "a value; post-hooks change the incompatible keys in place and return "
                    f"None; {then()}",
                    path=p if isinstance(p, Path) else None,
                )

    try:
        visit(model, "")
    finally:
        del visit  # it refers to itself: break the cycle so it is freed at once
