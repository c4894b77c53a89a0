"""Walking a model: every module under every name, and who owns each parameter and buffer.

``plan`` and ``dispatch`` read a model through ``walk_model``; ties show as one tensor with
several owners. Names are dotted paths (``encoder.0.weight``); ``display`` is how messages
show them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ._errors import TorchplaceError

__all__ = ["ModelTree", "display", "join", "walk_model"]


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
