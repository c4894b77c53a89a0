"""Walking a model: every module under every name, and who owns each parameter and buffer.

``plan`` and ``dispatch`` read a model through ``walk_model``; ties show as one tensor with
several owners. ``load_into`` (plain and sharded) reads it through ``tensor_slots``: each
parameter and buffer once, with every name it is saved under and every (module, attribute)
that holds it, so that a loaded tensor goes to all of them and ties stay tied. Names are
dotted paths (``encoder.0.weight``); ``display`` is how messages show them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from ._errors import TorchplaceError

__all__ = [
    "ModelTree",
    "Slot",
    "Slots",
    "cached_property_names",
    "display",
    "join",
    "tensor_slots",
    "unwrapped",
    "user_attributes",
    "user_model",
    "walk_model",
]


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def display(path: str) -> str:
    """How messages name a module or tensor: ``model.encoder.0`` (``model`` for the root)."""
    return f"model.{path}" if path else "model"


@dataclasses.dataclass
class ModelTree:
    """A model's modules under every name they have, and the tensors each holds directly."""

    modules: dict[str, nn.Module]  # path -> module, in registration order
    children: dict[str, list[str]]  # path -> child paths
    direct: dict[str, list[int]]  # path -> ids of the tensors the module itself holds
    tensors: dict[int, torch.Tensor]  # id -> tensor
    owners: dict[int, list[str]]  # id -> qualified names (``lm_head.weight``), first first
    owner_modules: dict[int, list[str]]  # id -> paths of the modules that hold it directly

    subtrees: dict[str, frozenset[int]] = dataclasses.field(default_factory=dict)

    def subtree(self, path: str) -> frozenset[int]:
        """Ids of every tensor held by the module at ``path`` or any module under it."""
        found = self.subtrees.get(path)
        if found is None:
            ids = set(self.direct[path])
            for child in self.children[path]:
                ids |= self.subtree(child)
            found = self.subtrees[path] = frozenset(ids)
        return found


def walk_model(model: nn.Module) -> ModelTree:
    """Every module of ``model`` under every name, and each parameter and buffer with its owners.

    >>> import torch
    >>> tree = walk_model(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> list(tree.modules), [len(names) for names in tree.owners.values()]
    (['', '0'], [1, 1])
    """
    tree = ModelTree({}, {}, {}, {}, {}, {})
    active: set[int] = set()

    def visit(path: str, module: nn.Module) -> None:
        if id(module) in active:  # a module that contains itself; Module.to() would loop too
            raise TorchplaceError(f"{display(path)} contains itself; a model must be a tree")
        active.add(id(module))
        tree.modules[path] = module
        tree.children[path] = []
        tree.direct[path] = []
        for kind in ("_parameters", "_buffers"):
            slots: dict[str, torch.Tensor | None] = getattr(module, kind)
            for name, tensor in slots.items():
                if tensor is None:
                    continue
                key = id(tensor)
                tree.tensors[key] = tensor
                tree.owners.setdefault(key, []).append(join(path, name))
                owners = tree.owner_modules.setdefault(key, [])
                if path not in owners:
                    owners.append(path)
                if key not in tree.direct[path]:
                    tree.direct[path].append(key)
        for name, child in module._modules.items():
            if child is None:
                continue
            child_path = join(path, name)
            tree.children[path].append(child_path)
            visit(child_path, child)  # noqa: F821 (deleted once done)
        active.discard(id(module))

    try:
        visit("", model)
    finally:
        del visit  # it refers to itself: a cycle holding the tree until the collector runs
    return tree


@dataclasses.dataclass(eq=False, slots=True)
class Slot:
    """One parameter or buffer of a model, under every name it has (tied ones have several).

    ``names`` are the keys a state dict holds it under (for a non-persistent buffer, which no
    state dict holds, every name it has); ``homes`` every (module, attribute) holding it, so a
    new tensor put in one place goes in all of them. ``tensor`` is whatever is there now: a
    loader that replaces it updates it.
    """

    tensor: torch.Tensor
    is_param: bool
    persistent: bool
    names: list[str]
    homes: list[tuple[nn.Module, str]]


@dataclasses.dataclass
class Slots:
    """A model's tensors as a loader sees them, its modules, and those that save extra state."""

    modules: list[tuple[str, nn.Module]]  # each module once, under its first name
    loadable: list[Slot]  # parameters and persistent buffers, in state-dict order
    transient: list[Slot]  # non-persistent buffers: in no state dict
    extra_state: dict[str, nn.Module]  # ``encoder._extra_state`` -> the module saving it


_NO_EXTRA_STATE = nn.Module.get_extra_state


def tensor_slots(model: nn.Module, *, every_name: bool = True) -> Slots:
    """Every parameter and buffer of ``model`` once, with its names and homes.

    ``every_name``: each tensor under every name a state dict gives it (a module registered
    twice, under both), as loading needs; without it, each module is visited once, under its
    first name, which is all a move needs, and a module reachable many ways (shared
    submodules, a child holding a link back to its parent) costs nothing more. A buffer is
    persistent when any module holding it registered it so: it is then in the state dict
    under those names. Tensors come in state-dict order.

    >>> import torch
    >>> m = torch.nn.Module()
    >>> m.a = m.b = torch.nn.Linear(2, 2)
    >>> [slot.names for slot in tensor_slots(m).loadable]
    [['a.weight', 'b.weight'], ['a.bias', 'b.bias']]
    """
    by_id: dict[int, Slot] = {}
    saved_as: dict[int, list[str]] = {}  # the persistent names of each buffer
    order: dict[int, int] = {}  # when each loadable tensor first shows in the state dict
    extra: dict[str, nn.Module] = {}
    modules: dict[int, tuple[str, nn.Module]] = {}
    saves_extra: dict[type, bool] = {}  # asked once per class, not once per module
    for prefix, module in _named_modules(model, every_name):
        dot = f"{prefix}." if prefix else ""
        seen = id(module) in modules  # a module under a second name: a name, not a home
        if not seen:
            modules[id(module)] = (prefix, module)
        for is_param, held in ((True, module._parameters), (False, module._buffers)):
            for name, t in held.items():
                if t is None:
                    continue
                slot = by_id.get(id(t))
                if slot is None:
                    slot = by_id[id(t)] = Slot(t, is_param, is_param, [], [])
                slot.names.append(dot + name)
                if not seen:
                    slot.homes.append((module, name))
                if is_param or name not in module._non_persistent_buffers_set:
                    order.setdefault(id(t), len(order))
                    if not is_param:
                        saved_as.setdefault(id(t), []).append(dot + name)
        cls = type(module)
        extra_state = saves_extra.get(cls)
        if extra_state is None:
            extra_state = saves_extra[cls] = cls.get_extra_state is not _NO_EXTRA_STATE
        if extra_state:
            extra[dot + "_extra_state"] = module
    loadable, transient = _loadable_and_transient(by_id, saved_as, order)
    return Slots(list(modules.values()), loadable, transient, extra)


def _named_modules(model: nn.Module, every_name: bool) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()``: every module under each of its names, or each module once."""
    try:
        return list(model.named_modules(remove_duplicate=not every_name))
    except RecursionError:  # only with every_name: named_modules(remove_duplicate=False) loops
        raise TorchplaceError(
            f"the {type(model).__name__} model contains itself (a module registered as an "
            "attribute of one of its own submodules), so it has no state dict to load: keep "
            "such a link out of the module tree, e.g. in a plain attribute through "
            "object.__setattr__ or a weakref"
        ) from None


def _loadable_and_transient(
    by_id: dict[int, Slot], saved_as: dict[int, list[str]], order: dict[int, int]
) -> tuple[list[Slot], list[Slot]]:
    """The slots in the state dict (in its order, buffers under their persistent names only),
    and the non-persistent buffers."""
    loadable: list[Slot] = []
    transient: list[Slot] = []
    for key, slot in by_id.items():
        if slot.is_param:
            loadable.append(slot)
        elif key in saved_as:
            slot.persistent = True
            slot.names = saved_as[key]
            loadable.append(slot)
        else:
            transient.append(slot)
    loadable.sort(key=lambda slot: order[id(slot.tensor)])
    return loadable, transient


# Attributes every nn.Module has; anything else in a module's __dict__ is the user's own.
MODULE_INTERNALS = frozenset(vars(nn.Module()))


def derived_attributes(module: nn.Module) -> frozenset[str]:
    """Tensor attributes that the module's own forward pre-hooks recompute on every call.

    ``torch.nn.utils.weight_norm`` and ``spectral_norm`` (the old, hook-based ones) keep
    ``weight`` as a plain attribute rebuilt from registered parameters before each forward, so
    it is neither a straggler nor something to register.
    """
    names = [
        getattr(hook, "name", None)
        for hook in module._forward_pre_hooks.values()
        if type(hook).__name__ in ("WeightNorm", "SpectralNorm")
    ]
    return frozenset(name for name in names if isinstance(name, str))


_PLAIN = (int, float, str, bool, type(None), torch.device, torch.dtype)


def user_attributes(module: nn.Module) -> list[tuple[str, Any]]:
    """A module's own plain attributes that may hold tensors, in the order they were set.

    Everything ``nn.Module.__init__`` sets, plain values (numbers, strings, devices, dtypes)
    and attributes the module's hooks recompute (``derived_attributes``) are left out. Most of a
    module's ``__dict__`` is PyTorch's own machinery, so that is taken away in one set
    difference before anything is looked at one by one (``move`` asks this of every module).
    """
    attrs = vars(module)
    keys = attrs.keys() - MODULE_INTERNALS
    if not keys:
        return []
    derived = derived_attributes(module) if module._forward_pre_hooks else frozenset()
    found = [
        (key, attrs[key])
        for key in keys
        if key not in derived and not isinstance(attrs[key], _PLAIN)
    ]
    if len(found) > 1:  # a set has no order: put them back in the module's
        order = {key: index for index, key in enumerate(attrs)}
        found.sort(key=lambda item: order[item[0]])
    return found


# Wrappers that hold the user's model and nothing of their own, by (module, class) name so that
# torch._dynamo and Lightning are never imported to recognise them: the attribute holding it.
_COMPILED = ("torch._dynamo.eval_frame", "OptimizedModule")  # torch.compile(model)
_WRAPPERS = {
    _COMPILED: "_orig_mod",
    ("lightning_fabric.wrappers", "_FabricModule"): "_forward_module",  # fabric.setup(model)
    ("lightning.fabric.wrappers", "_FabricModule"): "_forward_module",
    ("torch.nn.parallel.distributed", "DistributedDataParallel"): "module",
    ("torch.nn.parallel.data_parallel", "DataParallel"): "module",
}


def compiled_inner(module: object) -> nn.Module | None:
    """The module a ``torch.compile``'d one wraps (its ``_orig_mod``), or None for any other
    (recognised by name, as ``_WRAPPERS`` are: Dynamo is not imported for it)."""
    cls = type(module)
    if (cls.__module__, cls.__qualname__) != _COMPILED:
        return None
    inner = getattr(module, _WRAPPERS[_COMPILED], None)
    return inner if isinstance(inner, nn.Module) else None


def user_model(module: nn.Module) -> nn.Module:
    """The model inside wrappers (``torch.compile``, Fabric's ``setup``, DDP), so that reports
    name its tensors as the user's own model does (``encoder.weight``, not
    ``_orig_mod.encoder.weight``). A wrapper holding any tensor of its own, or a module beside
    the one it wraps, is kept: its names are then the only true ones.

    >>> import torch
    >>> from torchplace._model_walk import user_model
    >>> model = torch.nn.Linear(2, 2)
    >>> user_model(torch.nn.DataParallel(model)) is model
    True
    """
    return unwrapped(module)[0]


def unwrapped(module: nn.Module) -> tuple[nn.Module, str]:
    """``user_model(module)`` and the prefix its wrappers put before its names in their own
    state dict (``"_orig_mod."``, ``"module."``; ``""`` for a model that is not wrapped)."""
    prefix = ""
    while True:
        cls = type(module)
        attr = _WRAPPERS.get((cls.__module__, cls.__qualname__))
        inner = module._modules.get(attr) if attr is not None else None
        if inner is None or module._parameters or module._buffers:
            return module, prefix
        if any(isinstance(value, torch.Tensor) for _, value in user_attributes(module)):
            return module, prefix
        inside = {id(m) for m in inner.modules()}
        if any(id(child) not in inside for child in module._modules.values() if child is not None):
            return module, prefix
        module, prefix = inner, f"{prefix}{attr}."


def cached_property_names(cls: type) -> tuple[str, ...]:
    """The names of ``cls``'s ``functools.cached_property`` attributes, base classes' included.

    >>> import functools
    >>> class Sample:
    ...     @functools.cached_property
    ...     def area(self) -> int:
    ...         return 4
    >>> cached_property_names(Sample)
    ('area',)
    """
    return tuple(
        name
        for name in dict.fromkeys(n for klass in cls.__mro__ for n in vars(klass))
        if isinstance(getattr(cls, name, None), functools.cached_property)
    )
