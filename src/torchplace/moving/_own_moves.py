"""Modules that move state of their own: torchmetrics metrics, Lightning modules and the like.

``Module.to(device)`` calls ``to`` on the module it is given and ``_apply`` on every module below
it. Libraries override those to move what they keep outside parameters and buffers (torchmetrics
moves its metric states and defaults in ``_apply``) and to keep their own bookkeeping true
(Lightning's device mixin sets ``_device`` in ``to``, ``cuda`` and ``cpu``). A move that walks
parameters and buffers itself, as torchplace's does, goes round those overrides: states stay
behind and ``.device`` lies.

So torchplace moves parameters, buffers, gradients and optimizer state itself (identity, ties,
re-bound optimizers, all or nothing), then calls each outermost override with everything already
in place. ``Module._apply`` finds every parameter and buffer where it belongs and leaves it as
it is (PyTorch's overwrite and swap flags are held off for that call, so no Parameter is
replaced); the override moves only what is its own. Every attribute of every module it can
reach is saved first, so a failure, or Ctrl-C, puts them back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._errors import MoveError, first_line

__all__ = [
    "AttributeSnapshot",
    "conversion_flags",
    "covered_modules",
    "moves_itself",
    "outermost_movers",
    "run_own_moves",
    "set_conversion_flags",
]

_OVERRIDABLE = ("to", "cuda", "cpu", "_apply")
_own: dict[type, frozenset[str]] = {}


def moves_itself(cls: type) -> frozenset[str]:
    """Which of ``to``, ``cuda``, ``cpu`` and ``_apply`` ``cls`` overrides (empty: none).

    >>> import torch
    >>> from torchplace.moving._own_moves import moves_itself
    >>> moves_itself(torch.nn.Linear)
    frozenset()
    >>> class Tracked(torch.nn.Module):
    ...     def _apply(self, fn, recurse=True):
    ...         return super()._apply(fn, recurse)
    >>> sorted(moves_itself(Tracked))
    ['_apply']
    """
    found = _own.get(cls)
    if found is None:
        found = frozenset(name for name in _OVERRIDABLE if _overridden(cls, name))
        _own[cls] = found
    return found


def _overridden(cls: type, name: str) -> bool:
    """Whether ``cls`` overrides ``nn.Module``'s ``name`` outside PyTorch itself (PyTorch's own
    overrides, RNNBase's weight cache, are handled by the move; FSDP's are not a user's)."""
    method = getattr(cls, name, None)
    if method is getattr(nn.Module, name):
        return False
    where = getattr(method, "__module__", None) or ""
    return not (where == "torch" or where.startswith("torch."))


def outermost_movers(roots: list[nn.Module]) -> list[nn.Module]:
    """The modules under ``roots`` (roots included) that move themselves, outermost first.

    A module below one that moves itself is reached by that one's own call (``Module._apply``
    recurses), so it is not listed again.
    """
    found: list[nn.Module] = []
    seen: set[int] = set()
    stack = list(reversed(roots))
    while stack:
        mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        if moves_itself(type(mod)):
            found.append(mod)
            continue
        stack.extend(c for c in reversed(mod._modules.values()) if c is not None)
    return found


def covered_modules(roots: list[nn.Module]) -> dict[int, nn.Module]:
    """Every module whose state some override moves: the movers' subtrees, by id."""
    covered: dict[int, nn.Module] = {}
    for mover in outermost_movers(roots):
        for mod in mover.modules():
            covered[id(mod)] = mod
    return covered


class AttributeSnapshot:
    """Every attribute of some modules, one container deep, to put back after a failed call.

    Overrides set attributes (``self._device = ...``) and fill dicts and lists kept in them
    (torchmetrics' ``_defaults``); both are saved. Restoring is safe whether or not the call ran.
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        self.saved: list[tuple[dict[str, Any], dict[str, Any], list[tuple[Any, Any]]]] = []
        for mod in modules:
            attrs = mod.__dict__
            inner = [(v, _contents(v)) for v in attrs.values() if isinstance(v, (dict, list))]
            self.saved.append((attrs, dict(attrs), inner))

    def restore(self) -> None:
        for attrs, items, inner in self.saved:
            for container, contents in inner:
                if isinstance(container, dict):
                    container.clear()
                    container.update(contents)
                else:
                    container[:] = contents
            attrs.clear()
            attrs.update(items)


def _contents(container: dict[Any, Any] | list[Any]) -> Any:
    return dict(container) if isinstance(container, dict) else list(container)


def conversion_flags() -> tuple[bool, bool]:
    """PyTorch's flags that make ``Module._apply`` replace or swap parameters (even one that is
    already in place): (overwrite, swap)."""
    future = torch.__future__
    get_swap = getattr(future, "get_swap_module_params_on_conversion", None)
    swap = bool(get_swap()) if get_swap is not None else False
    return bool(future.get_overwrite_module_params_on_conversion()), swap


def set_conversion_flags(flags: tuple[bool, bool]) -> None:
    future = torch.__future__
    future.set_overwrite_module_params_on_conversion(flags[0])
    if hasattr(future, "set_swap_module_params_on_conversion"):
        future.set_swap_module_params_on_conversion(flags[1])


class _Converter:
    """The function handed to an ``_apply`` override: each tensor to the target, as
    ``Module.to`` would, remembering the one that failed."""

    def __init__(self, target: torch.device) -> None:
        self.target = target
        self.failed: torch.Tensor | None = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.target:
            return t
        self.failed = t
        if t.is_meta:
            raise _NoData
        moved = t.to(self.target)
        self.failed = None
        return moved


class _NoData(Exception):
    pass


def _call(mod: nn.Module, target: torch.device, convert: _Converter) -> None:
    """The override ``Module.to(target)`` would run on ``mod``."""
    own = moves_itself(type(mod))
    if "to" in own:
        mod.to(target)
    elif target.type == "cuda" and "cuda" in own:
        mod.cuda(target.index)
    elif target.type == "cpu" and "cpu" in own:
        mod.cpu()
    else:
        mod._apply(convert)  # type: ignore[no-untyped-call]


def _name_of(t: torch.Tensor, mod: nn.Module, path: str) -> str:
    """Where ``mod``'s subtree keeps ``t`` (``model.metric.tp``), or the module's own path."""
    for name, sub in mod.named_modules():
        base = f"{path}.{name}" if name else path
        for key, value in vars(sub).items():
            if value is t:
                return f"{base}.{key}"
            if isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if item is t:
                        return f"{base}.{key}[{i}]"
            elif isinstance(value, dict):
                for k, item in value.items():
                    if item is t:
                        return f"{base}.{key}[{k!r}]"
    return path


def run_own_moves(
    roots: list[tuple[str, nn.Module]],
    target: torch.device,
    apply: Callable[[Callable[[], None], Callable[[], None]], None],
) -> list[nn.Module]:
    """Run the overrides of the modules under ``roots`` that move themselves, undoably.

    ``apply(do, undo)`` is the move's undo log. Returns the modules whose overrides ran (their
    subtrees' leftover attributes are then checked by the caller). Raises ``MoveError`` naming
    the module (and the tensor, when known) whose override failed.
    """
    movers: list[tuple[str, nn.Module]] = []
    for prefix, root in roots:
        for mover in outermost_movers([root]):
            movers.append((_path_in(root, mover, prefix), mover))
    if not movers:
        return []
    reachable = {id(m): m for _, mover in movers for m in mover.modules()}
    snapshot = AttributeSnapshot(list(reachable.values()))
    apply(_nothing, snapshot.restore)
    convert = _Converter(target)
    flags = conversion_flags()
    try:
        if flags != (False, False):
            set_conversion_flags((False, False))  # so that no parameter in place is replaced
        for path, mover in movers:
            try:
                _call(mover, target, convert)
            except Exception as exc:
                raise MoveError(_failure(path, mover, target, convert, exc), name=path) from exc
    finally:
        if conversion_flags() != flags:
            set_conversion_flags(flags)
    return [mover for _, mover in movers]


def _nothing() -> None:
    pass


def _path_in(root: nn.Module, mover: nn.Module, prefix: str) -> str:
    base = prefix.rstrip(".") or "model"
    if mover is root:
        return base
    for name, mod in root.named_modules():
        if mod is mover:
            return f"{prefix}{name}" if prefix else name
    return base


def _failure(
    path: str, mover: nn.Module, target: torch.device, convert: _Converter, exc: BaseException
) -> str:
    cls = type(mover).__name__
    how = ", ".join(sorted(moves_itself(type(mover))))
    failed = convert.failed
    no_data = isinstance(exc, _NoData) or "Cannot copy out of meta tensor" in str(exc)
    if no_data:
        name = path if failed is None else _name_of(failed, mover, path)
        return (
            f"{name} is on meta, which holds shapes but no data, so it cannot be copied to "
            f"{target}; {path} ({cls}) keeps it itself (its {how}), and its values were lost "
            f"when it moved to meta: build a new {cls} (or the model) on {target}, or load its "
            "state again. Nothing was moved"
        )
    if failed is not None:
        name = _name_of(failed, mover, path)
        return (
            f"could not move {name}, which {path} ({cls}) moves itself in its {how}, to "
            f"{target}: {first_line(exc)}; nothing was moved"
        )
    return (
        f"could not move {path} ({cls}) to {target}: its own {how} failed: {first_line(exc)}; "
        "nothing was moved"
    )
