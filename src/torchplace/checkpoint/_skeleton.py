"""``skeleton``: a model built with its parameters on ``meta`` and its buffers real."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.overrides import TorchFunctionMode

from .._errors import TorchplaceError
from ..moving._identity import parameter_like

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def _storage_ptr(t: torch.Tensor) -> int:
    if is_lazy(t):  # a lazy module's parameter: no storage until its first forward
        return 0
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # no storage
        return 0


# swap_tensors exchanges two tensors' contents in place, so a Parameter object (and every tie
# and optimizer that holds it) survives a change of device that .data cannot make (meta <-> cpu).
swap = cast(Callable[[torch.Tensor, torch.Tensor], None], torch.utils.swap_tensors)


def _meta_copy(p: nn.Parameter) -> nn.Parameter:
    return parameter_like(p, torch.empty_like(p, device="meta"), materialize=True)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a torch function's arguments or result (nested tuples, lists and dicts).

    Not ``torch.utils._pytree.tree_flatten``: its recursive helper is a reference cycle left for
    the garbage collector on every call, and this runs on every torch call inside ``skeleton``.
    """
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _sets_data(func: Any) -> bool:
    """Whether ``func`` is the setter of ``Tensor.data`` (``p.data = t``)."""
    owner = getattr(func, "__self__", None)
    return getattr(func, "__name__", None) == "__set__" and getattr(owner, "__name__", "") == "data"


class _SkeletonMode(TorchFunctionMode):
    """Sends parameters born inside it to ``meta`` and skips ``nn.init`` on them.

    Torch function modes are thread-local, so other threads building models are unaffected.
    Only parameters whose storage was allocated inside the mode are sent to ``meta``; a
    parameter that existed before (a pretrained module handed to the factory) is left alone.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fresh: set[int] = set()

    def is_fresh(self, t: torch.Tensor) -> bool:
        ptr = _storage_ptr(t)
        return ptr != 0 and ptr in self.fresh

    def to_meta(self, p: nn.Parameter) -> None:
        with contextlib.suppress(RuntimeError, TypeError):  # else the sweep after the factory
            swap(p, _meta_copy(p))

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        input_ptrs = set()
        for a in _tensors((args, kwargs)):
            if isinstance(a, nn.Parameter) and a.device.type != "meta" and self.is_fresh(a):
                self.to_meta(a)
            input_ptrs.add(_storage_ptr(a))
        if _sets_data(func) and len(args) == 2 and isinstance(args[1], torch.Tensor):
            target, value = args
            if isinstance(target, nn.Parameter) and target.device.type == "meta":
                # A model's init setting a parameter's values (Bamba's under transformers 4.x):
                # the parameter, on meta by now, takes their shape and dtype there.
                args = (target, torch.empty_like(value, device="meta"))
        if getattr(func, "__module__", None) == "torch.nn.init":
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.device.type == "meta":
                return target  # no init work for a parameter that has no data
        result = func(*args, **kwargs)
        for out in _tensors(result):
            if out.device.type != "meta":
                ptr = _storage_ptr(out)
                if ptr and ptr not in input_ptrs:
                    self.fresh.add(ptr)
        return result


def skeleton(factory: Callable[..., ModuleT], /, *args: Any, **kwargs: Any) -> ModuleT:
    """Build ``factory(*args, **kwargs)`` with parameters on ``meta`` and buffers real.

    >>> import torch
    >>> from torchplace import skeleton
    >>> model = skeleton(torch.nn.Linear, 4096, 4096)  # no memory, no random init
    >>> model.weight.device, model.weight.shape
    (device(type='meta'), torch.Size([4096, 4096]))

    Parameters take no memory and get no random init (``nn.init`` calls on them are skipped),
    while buffers are computed for real, so non-persistent buffers that no checkpoint holds
    (masks, rotary frequencies) survive. Fill the result with ``load_into``. It works through a
    thread-local torch function mode: ``nn.Module`` is not patched, other threads are unaffected.
    Parameters created before the call (a module passed to the factory) are left as they are.
    Lazy modules stay lazy until ``load_into`` gives them the file's shapes.
    """
    if isinstance(factory, nn.Module):  # calling it would run its forward
        cls = type(factory).__name__
        raise TorchplaceError(
            f"skeleton() builds a model, so it takes what builds one (a class or a function) "
            f"and its arguments, not a {cls} already built: skeleton({cls}, ...); a built "
            f"model takes its weights directly, torchplace.load_into(model, checkpoint)"
        )
    if not callable(factory):
        raise TorchplaceError(
            f"skeleton() takes what builds the model (a class or a function) and its arguments, "
            f"not a {type(factory).__name__}: torchplace.skeleton(YourModel, *args, **kwargs)"
        )
    mode = _SkeletonMode()
    with mode:
        model = factory(*args, **kwargs)
    if not isinstance(model, nn.Module):
        raise TorchplaceError(
            f"skeleton() needs a factory that returns an nn.Module, but {factory!r} returned "
            f"{type(model).__name__}"
        )
    # Parameters that no torch call touched inside the mode (nn.Parameter(torch.zeros(n)) set
    # and left alone) are still real: send the fresh ones to meta now, ties kept.
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.device.type == "meta" or not mode.is_fresh(p):
                continue
            if id(p) in replaced:
                module._parameters[name] = replaced[id(p)]
                continue
            try:
                swap(p, _meta_copy(p))
                replaced[id(p)] = p
            except (RuntimeError, TypeError):
                replaced[id(p)] = module._parameters[name] = _meta_copy(p)
    return model
