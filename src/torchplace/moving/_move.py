"""Moving: tensors, batches, modules and optimizer state, all or nothing.

A move happens in two phases. First every tensor that must travel is copied to the target while
nothing the caller can see changes; a failed copy (out of memory, a bad device, a meta tensor with
no data) raises ``MoveError`` with the model exactly as it was. Then the copies are committed
(parameter data swapped, buffers and attributes replaced, optimizers re-bound) through an undo
log, so even a failure there is rolled back before ``MoveError`` is raised.

Parameters keep their identity where PyTorch allows it (``param.data = new``, as ``Module.to``
does). Where PyTorch replaces them (cpu<->meta, or ``set_overwrite_module_params_on_conversion``)
every tied slot gets the one new parameter, every optimizer passed is re-bound with its state, and
the replacement is remembered so that ``stragglers`` can still name an optimizer left behind.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, TypeVar

import torch
from torch import nn

from .._devices import DeviceSpec
from .._devices import device as _device
from .._errors import MoveError, TorchplaceError, user_stacklevel
from .._model_walk import tensor_slots, user_attributes
from .._suggest import did_you_mean
from .._tree import (
    Located,
    cached_properties,
    iter_leaves,
    map_tensors,
    opaque_tensors,
    refuse_unwalkable,
)
from ._hooks import is_dispatched, undispatch
from ._identity import (
    UndoLog,
    current,
    del_item,
    keep_requires_grad,
    needs_swap,
    parameter_like,
    record_replacement,
    replaced_outside,
    replaces,
    restore,
    set_attr,
    set_data,
    set_item,
    swap_step,
    swappable,
    swaps,
)
from ._offloaded import drop_homes, gather_homes
from ._optim_state import optimizer_list, rule_for
from ._own_moves import (
    conversion_flags,
    covered_modules,
    run_own_moves,
    set_conversion_flags,
)
from ._transfer import Copier, CopyFailed, is_accelerator, own_to, tensor_mover

__all__ = ["NON_PERSISTENT_LOST", "REBUILD", "discarded_warning", "move"]

# Said wherever a non-persistent buffer on meta is met on the way back to a real device.
REBUILD = (
    "build the model again with torchplace.skeleton(YourModel, ...), which keeps such buffers "
    "real, then torchplace.load_into(model, checkpoint, {dev})"
)
NON_PERSISTENT_LOST = (
    "a non-persistent buffer (not in the state dict) on meta: its values were lost when it "
    "moved there and no checkpoint holds them, so neither load_into nor to_empty brings them "
    "back; " + REBUILD
)


def discarded_warning(verb: str, names: list[str]) -> str:
    """The warning for non-persistent buffers whose values a trip to meta (``torchplace.move``
    or ``torchplace.load_into``, ``verb``) discarded: the same words wherever it happens."""
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return (
        f"torchplace.{verb} to meta discarded the values of {len(names)} non-persistent "
        f"buffer(s) ({shown}): they are not in the state dict, so no checkpoint can bring them "
        "back. To use the model again, build it anew with torchplace.skeleton(YourModel, ...), "
        "which keeps such buffers real, and fill it with torchplace.load_into(model, "
        "checkpoint, device)"
    )


T = TypeVar("T")
Attributes = Literal["warn", "move", "ignore"]


def _reraise(located: Located, root: str, target: torch.device) -> NoReturn:
    """Turn an exception found at some path of a walk into the error a user should see."""
    cause = located.cause
    where = located.path(root)
    if isinstance(cause, CopyFailed):
        raise MoveError(cause.message(where), name=where) from cause.cause
    if isinstance(cause, TorchplaceError):
        raise cause from cause.__cause__
    raise MoveError(f"could not move {where} to {target}: {cause}", name=where) from cause


def _map(
    value: Any,
    fn: Callable[[torch.Tensor], torch.Tensor],
    root: str,
    target: torch.device,
    to: Callable[[Any], Any] | None = None,
) -> Any:
    try:
        return map_tensors(value, fn, to=to, root=root)
    except Located as located:
        _reraise(located, root, target)


@dataclass
class _Plan:
    """What one module move will touch, gathered before anything is copied."""

    params: dict[int, tuple[str, nn.Parameter]] = field(default_factory=dict)
    param_slots: dict[int, list[tuple[nn.Module, str]]] = field(default_factory=dict)
    buffers: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)
    buffer_slots: dict[int, list[tuple[nn.Module, str]]] = field(default_factory=dict)
    # Buffers left out of the state dict (rotary frequencies, masks), by id, named.
    non_persistent: dict[int, str] = field(default_factory=dict)
    attributes: list[tuple[nn.Module, str, str, Any]] = field(default_factory=list)
    # Modules kept in plain lists or dicts: Module.to() never reaches them.
    unregistered: list[tuple[str, nn.Module]] = field(default_factory=list)


def _plan(roots: list[tuple[str, nn.Module]], follow_unregistered: bool) -> _Plan:
    plan = _Plan()
    registered = {id(m) for _, root in roots for m in root.modules()}
    queue = list(roots)
    while queue:
        prefix, root = queue.pop(0)
        slots = tensor_slots(root, every_name=False)  # each module once: a move's need
        for slot in (*slots.loadable, *slots.transient):
            t, name = slot.tensor, prefix + slot.names[0]
            if slot.is_param:
                plan.params.setdefault(id(t), (name, t))  # type: ignore[arg-type]
                plan.param_slots.setdefault(id(t), []).extend(slot.homes)
            else:
                plan.buffers.setdefault(id(t), (name, t))
                plan.buffer_slots.setdefault(id(t), []).extend(slot.homes)
                if not slot.persistent:
                    plan.non_persistent.setdefault(id(t), name)
        for mod_name, mod in slots.modules:
            path = f"{prefix}{mod_name}" if mod_name else prefix.rstrip(".")
            dot = f"{path}." if path else ""
            for key, value in user_attributes(mod):
                has_tensor = False
                for leaf_path, leaf in iter_leaves(value, dot + key, skip_cycles=True):
                    if isinstance(leaf, torch.Tensor):
                        has_tensor = True
                    elif isinstance(leaf, nn.Module) and id(leaf) not in registered:
                        registered.update(id(m) for m in leaf.modules())
                        plan.unregistered.append((leaf_path + ".", leaf))
                        if follow_unregistered:
                            queue.append((leaf_path + ".", leaf))
                if has_tensor:
                    plan.attributes.append((mod, key, dot + key, value))
    return plan


def _check_non_persistent(plan: _Plan, target: torch.device, copier: Copier) -> None:
    """Non-persistent buffers cannot come back from meta: no checkpoint holds them.

    Towards meta, their values are about to be lost: they are noted for a warning. From meta
    towards a real device, the move cannot work and the error says how to rebuild them.
    """
    buffers = plan.non_persistent
    if not buffers:
        return
    if target.type == "meta":
        copier.discarded += [n for bid, n in buffers.items() if not plan.buffers[bid][1].is_meta]
        return
    lost = [n for bid, n in buffers.items() if plan.buffers[bid][1].is_meta]
    if lost:
        names = ", ".join(lost[:5]) + (", ..." if len(lost) > 5 else "")
        raise MoveError(
            f"{names}: {NON_PERSISTENT_LOST.format(dev=repr(str(target)))}. Nothing was moved",
            name=lost[0],
        )


def _moved_state(
    state: dict[Any, Any],
    label: str,
    name: str,
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    target: torch.device,
    copier: Copier,
) -> dict[Any, Any] | None:
    """A parameter's state with its tensors copied per PyTorch's policy; None if none moved.

    Each key goes where ``_optim_state.rule_for`` says (the rules ``verify`` checks): ``step``
    stays on the CPU unless the group is fused or capturable (ASGD's goes with its parameter),
    NAdam's ``mu_product`` stays on the CPU, everything else goes with its parameter. No dtype
    changes.
    """
    new_state: dict[Any, Any] = {}
    changed = False
    for key, value in state.items():
        dest = rule_for(optimizer, group, key).destination(target)
        root = f"{label}.state[{name}].{key}"

        def fn(t: torch.Tensor, _dest: torch.device = dest) -> torch.Tensor:
            return copier.copy(t, _dest)

        with torch.no_grad():
            moved = _map(value, fn, root, target)
        changed = changed or moved is not value
        new_state[key] = moved
    return new_state if changed else None


def _note_meta_optimizer_state(
    optimizers: list[torch.optim.Optimizer], target: torch.device, copier: Copier
) -> None:
    """Optimizer state on meta has no values either: a failure to copy the weights says so."""
    if target.type != "meta" and any(
        isinstance(v, torch.Tensor) and v.is_meta
        for opt in optimizers
        for entries in opt.state.values()
        for v in entries.values()
    ):
        copier.meta_note = (
            f". The optimizer's state on meta has no values either: once load_into has put "
            f"the weights back, clear it with opt.state.clear() and re-bind the optimizer with "
            f"torchplace.move(model, '{target}', optimizer=opt) (after to_empty, which makes new "
            "parameters, build a new optimizer instead)"
        )


@dataclass
class _Copies:
    """Phase 1's copies by id of the original (the original itself where nothing moved)."""

    params: dict[int, torch.Tensor]
    grads: dict[int, torch.Tensor]
    buffers: dict[int, torch.Tensor]


def _copy_tensors(
    plan: _Plan,
    target: torch.device,
    optimizers: list[torch.optim.Optimizer],
    copier: Copier,
    destinations: dict[int, torch.device] | None,
) -> _Copies:
    """Phase 1: copy every parameter, grad and buffer. Nothing the caller can see changes here."""

    def dest(t: torch.Tensor) -> torch.device:
        return target if destinations is None else destinations.get(id(t), t.device)

    if destinations is None:
        grads = [p.grad for _, p in plan.params.values() if p.grad is not None]
        state = [  # 0-dim entries (Adam's step) stay on the host
            v
            for opt in optimizers
            for p, entries in opt.state.items()
            if id(p) in plan.params
            for v in entries.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        copier.prefill(
            [p for _, p in plan.params.values()]
            + grads
            + [b for _, b in plan.buffers.values()]
            + state,
            detach=True,
        )
    with torch.no_grad():
        new_params = {pid: copier(p, name, dest(p)) for pid, (name, p) in plan.params.items()}
        new_grads = {
            pid: copier(p.grad, f"{name}.grad", dest(p))
            for pid, (name, p) in plan.params.items()
            if p.grad is not None
        }
        new_buffers = {bid: copier(b, name, dest(b)) for bid, (name, b) in plan.buffers.items()}
    for bid, (_, b) in plan.buffers.items():  # copied without autograd: a leaf, as it was
        keep_requires_grad(b, new_buffers[bid])
    return _Copies(new_params, new_grads, new_buffers)


@dataclass
class _Bindings:
    """How each copy is bound: swapped into its parameter, replacing it, or (neither) set as its
    data in place."""

    replaced: dict[int, torch.Tensor]  # id(old tensor) -> the object that replaces it
    final: dict[int, torch.Tensor]  # id(parameter) -> the parameter after the move
    swapped: dict[int, nn.Parameter]  # id(parameter) -> a shell to swap its contents with


def _bind_copies(plan: _Plan, copies: _Copies, copier: Copier) -> _Bindings:
    """Decide, for each copied parameter and buffer, how the commit will put it in place."""
    replaced: dict[int, torch.Tensor] = {}
    final: dict[int, torch.Tensor] = {}
    swapped: dict[int, nn.Parameter] = {}
    new_params = copies.params
    swap = swaps()
    for pid, (_, p) in plan.params.items():
        final[pid] = p
        new = new_params[pid]
        if new is p:
            continue
        subclass = needs_swap(p, new)
        if swap or subclass:
            shell = parameter_like(p, new)
            if swap or swappable(p, shell):
                swapped[pid] = shell
                continue
        if subclass or replaces(p, new):
            fresh = parameter_like(p, new)
            if pid in copies.grads:
                fresh.grad = copies.grads[pid]
            replaced[pid] = final[pid] = fresh
    for bid, (_, b) in plan.buffers.items():
        if copies.buffers[bid] is not b:
            replaced[bid] = copies.buffers[bid]
    for pid, (_, p) in plan.params.items():
        if new_params[pid] is not p:
            copier.finals[id(new_params[pid])] = final[pid]
    return _Bindings(replaced, final, swapped)


def _unregistered_left_behind(plan: _Plan, target: torch.device) -> list[str]:
    """Modules kept in plain lists or dicts whose parameters are off ``target``, named."""
    left_behind = []
    for prefix, mod in plan.unregistered:
        for _, p in mod.named_parameters(prefix=prefix.rstrip(".")):
            if p.device != target:
                left_behind.append(prefix.rstrip("."))
                break
    return left_behind


def _moved_attributes(
    plan: _Plan,
    target: torch.device,
    copier: Copier,
    attributes: Attributes,
    covered: dict[int, nn.Module],
    replaced: dict[int, torch.Tensor],
) -> tuple[list[tuple[nn.Module, str, Any]], list[str]]:
    """The new values of plain module attributes holding tensors, and those left where they
    were (named): aliases of parameters and buffers follow them, the rest per ``attributes``."""
    left_behind = _unregistered_left_behind(plan, target) if attributes != "move" else []
    new_attributes: list[tuple[nn.Module, str, Any]] = []
    for mod, key, name, value in plan.attributes:
        # A value a functools.cached_property computed is derived state: it goes with the
        # module whatever `attributes` says, so that it never stays behind.
        cached = key in cached_properties(type(mod))
        if attributes != "move" and id(mod) in covered and not cached:
            continue

        def fix(t: torch.Tensor, _name: str = name, _move: bool = cached) -> torch.Tensor:
            alias = replaced.get(id(t))
            if alias is not None:  # an alias of a parameter or buffer (RNN._flat_weights)
                return alias
            if id(t) in plan.params or id(t) in plan.buffers or t.device == target:
                return t
            if attributes == "move" or _move:
                return keep_requires_grad(t, copier.copy(t, target))
            if _name not in left_behind:
                left_behind.append(_name)
            return t

        def fix_own(node: Any, _name: str = name, _move: bool = cached) -> Any:
            """An object with its own .to() (a BatchEncoding kept on a module) moves by it."""
            if attributes == "move" or _move:
                return own_to(node, target, asynchronous=False)
            if _name not in left_behind:
                left_behind.append(_name)
            return node

        try:
            with torch.no_grad():
                new_value = _map(value, fix, name, target, fix_own)
        except TorchplaceError:
            if attributes == "move":
                raise
            continue  # a cyclic attribute holding tensors: left as it is, like Module.to does
        if new_value is not value:
            new_attributes.append((mod, key, new_value))
    return new_attributes, left_behind


def _move_modules(
    roots: list[tuple[str, nn.Module]],
    target: torch.device,
    optimizers: list[torch.optim.Optimizer],
    copier: Copier,
    attributes: Attributes,
    log: UndoLog,
    destinations: dict[int, torch.device] | None = None,
) -> list[str]:
    """Copy then commit every tensor of ``roots``; returns the attributes left where they were.

    ``destinations`` (id of a parameter or buffer -> device) sends each tensor to its own device,
    as ``dispatch`` needs; tensors it does not name stay where they are.
    """
    plan = _plan(roots, follow_unregistered=attributes == "move")
    if destinations is None:
        _check_non_persistent(plan, target, copier)
        _note_meta_optimizer_state(optimizers, target, copier)
    # Modules whose own overrides (torchmetrics' _apply, Lightning's to) move their extra state:
    # their plain attributes are theirs to move, and are judged after those overrides ran.
    covered = covered_modules([m for _, m in roots]) if destinations is None else {}

    # Phase 1: copy. Nothing the caller can see changes here.
    copies = _copy_tensors(plan, target, optimizers, copier, destinations)
    bindings = _bind_copies(plan, copies, copier)
    new_attributes, left_behind = _moved_attributes(
        plan, target, copier, attributes, covered, bindings.replaced
    )
    devices = {pid: new.device for pid, new in copies.params.items()}
    states = _plan_optimizer_states(optimizers, plan, bindings.final, devices, copier)

    # Phase 2: commit, every step undoable.
    _commit(roots, plan, copies, bindings, new_attributes, states, log)
    if covered:
        run_own_moves(roots, target, log.apply)
        left_behind += _still_behind(plan, covered, target)
    return left_behind


def _commit(
    roots: list[tuple[str, nn.Module]],
    plan: _Plan,
    copies: _Copies,
    bindings: _Bindings,
    new_attributes: list[tuple[nn.Module, str, Any]],
    states: list[_StatePlan],
    log: UndoLog,
) -> None:
    """Phase 2: put every copy in place through ``log``, so that a failure rolls it all back."""
    rnns = [m for _, root in roots for m in root.modules() if isinstance(m, nn.RNNBase)]
    for rnn in rnns:  # an RNN's weak references to its weights would block swap_tensors
        refs = rnn.__dict__.get("_flat_weight_refs")
        if isinstance(refs, list):  # cleared in place: another holder of the list keeps none
            log.apply(refs.clear, rnn._init_flat_weights)
    _commit_parameters(plan, copies, bindings, log)
    replaced = bindings.replaced
    for bid, (_, b) in plan.buffers.items():
        if bid in replaced:
            for mod, key in plan.buffer_slots[bid]:
                buffers = mod._buffers
                log.apply(set_item(buffers, key, replaced[bid]), set_item(buffers, key, b))
    for mod, key, new_value in new_attributes:
        attrs = mod.__dict__
        log.apply(set_item(attrs, key, new_value), set_item(attrs, key, attrs[key]))
    _commit_optimizer_states(states, log)
    for rnn in rnns:  # rebuild the RNN's cached list of its weights, as RNNBase._apply does
        saved = {k: rnn.__dict__.get(k) for k in ("_flat_weights", "_flat_weight_refs")}
        log.apply(rnn._init_flat_weights, restore(rnn.__dict__, saved))
    for pid, (_, p) in plan.params.items():
        if pid in replaced:
            log.apply(*record_replacement(p, replaced[pid]))


def _commit_parameters(plan: _Plan, copies: _Copies, bindings: _Bindings, log: UndoLog) -> None:
    """Each parameter (and its grad) swapped, replaced in every slot, or given its new data."""
    new_params, new_grads = copies.params, copies.grads
    swapped, replaced = bindings.swapped, bindings.replaced
    for pid, (_, p) in plan.params.items():
        if pid in swapped:  # swap_tensors keeps the Python objects of parameter and grad
            grad = p.grad
            if grad is not None:
                log.apply(set_attr(p, "grad", None), set_attr(p, "grad", grad))
            log.apply(*swap_step(p, swapped[pid]))
            if grad is not None:
                log.apply(*swap_step(grad, new_grads[pid]))
                log.apply(set_attr(p, "grad", grad), set_attr(p, "grad", None))
        elif pid in replaced:
            for mod, key in plan.param_slots[pid]:
                params = mod._parameters
                log.apply(set_item(params, key, replaced[pid]), set_item(params, key, p))
        else:  # in place; the parameter may already be there (`p.data = ...` left .grad behind)
            if new_params[pid] is not p:
                log.apply(set_data(p, new_params[pid]), set_data(p, p.data))
            grad = p.grad
            if grad is not None and new_grads[pid] is not grad:
                log.apply(set_data(grad, new_grads[pid]), set_data(grad, grad.data))


def _commit_optimizer_states(states: list[_StatePlan], log: UndoLog) -> None:
    """Re-bind each optimizer to its parameters after the move, and give it their moved state."""
    for opt, group_params, index, old, bound, new_state in states:
        if bound is not old:
            log.apply(set_item(group_params, index, bound), set_item(group_params, index, old))
        if new_state is not None:
            old_state = opt.state.get(old)
            if bound is not old:
                log.apply(del_item(opt.state, old), set_item(opt.state, old, old_state))
                log.apply(set_item(opt.state, bound, new_state), del_item(opt.state, bound))
            else:
                log.apply(set_item(opt.state, old, new_state), set_item(opt.state, old, old_state))


def _still_behind(plan: _Plan, covered: dict[int, nn.Module], target: torch.device) -> list[str]:
    """Attributes of self-moving modules that their own overrides left off ``target``."""
    registered = plan.params.keys() | plan.buffers.keys()
    behind = []
    for mod, key, name, _ in plan.attributes:
        if id(mod) not in covered:
            continue
        for _, leaf in iter_leaves(mod.__dict__.get(key), name, skip_cycles=True):
            if (
                isinstance(leaf, torch.Tensor)
                and id(leaf) not in registered
                and leaf.device != target
            ):
                behind.append(name)
                break
    return behind


_StatePlan = tuple[
    torch.optim.Optimizer, list[Any], int, torch.Tensor, torch.Tensor, "dict[Any, Any] | None"
]


def _plan_optimizer_states(
    optimizers: list[torch.optim.Optimizer],
    plan: _Plan,
    final: dict[int, torch.Tensor],
    devices: dict[int, torch.device],
    copier: Copier,
) -> list[_StatePlan]:
    """For each optimizer parameter of the moved model: its final parameter and moved state.

    A parameter that an earlier move replaced (the optimizer was not passed to it) is re-bound to
    its replacement here, with its state.
    """
    result: list[_StatePlan] = []
    model_params = [p for _, p in plan.params.values()]
    for opt_index, opt in enumerate(optimizers):
        label = "optimizer" if len(optimizers) == 1 else f"optimizer[{opt_index}]"
        held = 0  # parameters of the moved model(s) that this optimizer holds
        adopted = replaced_outside(opt, model_params)  # a plain model.to() replaced them
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                pid = id(p)
                if pid not in final:
                    pid = id(current(p))
                    if pid not in final and id(p) in adopted:
                        pid = id(adopted[id(p)])
                    if pid not in final:
                        continue  # not a parameter of the model being moved
                held += 1
                fresh = final[pid]
                state = opt.state.get(p)
                new_state = None
                if state:
                    name = plan.params[pid][0]
                    new_state = _moved_state(state, label, name, opt, group, devices[pid], copier)
                if new_state is None and fresh is not p and state is not None:
                    new_state = dict(state)  # re-keyed even when empty: state_dict() needs it
                if fresh is not p or new_state is not None:
                    result.append((opt, group["params"], i, p, fresh, new_state))
        count = sum(len(group["params"]) for group in opt.param_groups)
        if not held and count:
            raise MoveError(
                f"{label} ({type(opt).__name__}) holds none of the parameters being moved (its "
                f"{count} belong to another model), so its state would stay where it is; pass "
                "the optimizer built on this model's parameters, or move that optimizer with "
                "its own model. Nothing was moved",
                name=label,
            )
    return result


def _move_optimizer_state(
    opt: torch.optim.Optimizer, label: str, target: torch.device, copier: Copier, log: UndoLog
) -> None:
    """Move one optimizer's state on its own (its parameters stay where they are)."""
    updates: list[tuple[torch.Tensor, dict[Any, Any]]] = []
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            state = opt.state.get(p)
            if state:
                name = f"param_groups[{g}]['params'][{i}]"
                new_state = _moved_state(state, label, name, opt, group, target, copier)
                if new_state is not None:
                    updates.append((p, new_state))
    for p, new_state in updates:
        old_state = opt.state[p]
        log.apply(set_item(opt.state, p, new_state), set_item(opt.state, p, old_state))


def _move_optimizers_alone(
    optimizers: list[torch.optim.Optimizer], target: torch.device, copier: Copier, log: UndoLog
) -> None:
    """Move the state of optimizers on their own, each labelled as an error would name it."""
    for index, opt in enumerate(optimizers):
        label = "optimizer" if len(optimizers) == 1 else f"optimizer[{index}]"
        _move_optimizer_state(opt, label, target, copier, log)


_ATTRIBUTE_MODES = ("warn", "move", "ignore")


def _check_options(attributes: Any, non_blocking: Any, views: Any) -> None:
    """Refuse ``move``'s keyword arguments when they are not what it takes."""
    if attributes not in _ATTRIBUTE_MODES:
        hint = did_you_mean(attributes, _ATTRIBUTE_MODES) if isinstance(attributes, str) else ""
        raise TorchplaceError(
            f"attributes={attributes!r} is not one of 'warn', 'move', 'ignore'; {hint}'move' "
            "also moves plain tensor attributes of modules, 'ignore' leaves them silently"
        )
    if non_blocking is not None and not isinstance(non_blocking, bool):
        raise TorchplaceError(f"non_blocking={non_blocking!r} must be True, False or None")
    if not isinstance(views, bool):
        raise TorchplaceError(
            f"views={views!r} must be True (a batch's small tensors share bounded device "
            "buffers) or False (each tensor owns its storage)"
        )


def move(
    obj: T,
    device: DeviceSpec,
    /,
    *,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    non_blocking: bool | None = None,
    attributes: Attributes = "warn",
    views: bool = False,
) -> T:
    """Move a tensor, batch, module (in place) or optimizer's state to ``device``, all or nothing.

    >>> import torch, torchplace
    >>> model = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> torchplace.move(model, "meta", optimizer=opt) is model
    True
    >>> model.weight.device, opt.param_groups[0]["params"][0] is model.weight
    (device(type='meta'), True)
    >>> batch = {"x": torch.ones(2), "ids": [torch.arange(3)], "name": "a"}
    >>> moved = torchplace.move(batch, "meta")
    >>> moved["x"].device, moved["name"]
    (device(type='meta'), 'a')
    >>> torchplace.move(batch, "cpu") is batch  # nothing to do: the very same object
    True

    Many small tensors of a batch bound for a GPU travel as one copy (packed into pinned
    staging, one transfer) and are split into tensors that each own their storage, as
    parameters, buffers and optimizer state always do: keeping one keeps nothing else alive.
    ``views=True`` lets them land as views of a few shared device buffers of at most 1 MiB each
    instead (faster; for loops that drop their batches): a small tensor kept after its batch
    then keeps its whole buffer alive (``.clone()`` it to keep it on its own), and an in-place
    operation that grows a tensor's storage (``resize_`` to more elements, ``set_``) would
    write into its neighbours' bytes. Values are independent either way.
    """
    _check_options(attributes, non_blocking, views)
    refuse_unwalkable(obj, "move")
    optimizers = optimizer_list(optimizer)
    if torch.compiler.is_compiling():  # inside torch.compile: what Dynamo can trace
        # Imported here, never before torch.compile runs: it needs torch._dynamo (2 s to import).
        from ._compiled import traced_move

        return traced_move(obj, device, non_blocking, optimizers)  # type: ignore[no-any-return]
    target = _device(device)
    copier = Copier(target, non_blocking)
    log = UndoLog()
    left_behind: list[str] = []
    # Process-wide modes a step may set for a moment; an interrupt at any line must not leave
    # them changed (a `with` can be interrupted after its body, before its __exit__).
    grad_mode, flags = torch.is_grad_enabled(), conversion_flags()
    try:
        if isinstance(obj, nn.Module):
            gather_homes(obj, target, log)  # disk-offloaded weights read back first
            left_behind = _owners_mover()([("", obj)], optimizers, target, copier, attributes, log)
            result: Any = obj
        elif isinstance(obj, torch.optim.Optimizer):
            others = [o for o in optimizers if o is not obj]
            _move_optimizers_alone([obj, *others], target, copier, log)
            result = obj
        else:
            result, left_behind = _move_collection(
                obj, target, optimizers, copier, attributes, log, views=views
            )
        copier.synchronize()
    except BaseException as exc:
        _roll_back(copier, log, grad_mode, flags)
        if isinstance(exc, TorchplaceError) or not isinstance(exc, Exception):
            raise
        raise MoveError(f"could not move {type(obj).__name__} to {target}: {exc}") from exc
    _warn_after(obj, result, target, copier, left_behind, attributes)
    return result  # type: ignore[no-any-return]


def _roll_back(copier: Copier, log: UndoLog, grad_mode: bool, flags: tuple[bool, bool]) -> None:
    """Undo a failed move: pending copies dropped, process-wide modes and the model restored."""
    copier.abandon()
    torch.set_grad_enabled(grad_mode)
    if conversion_flags() != flags:
        set_conversion_flags(flags)
    log.rollback()


def _warn_after(
    obj: Any,
    result: Any,
    target: torch.device,
    copier: Copier,
    left_behind: list[str],
    attributes: Attributes,
) -> None:
    """After a move: the warnings for what it left where it was, or discarded."""
    opaque = [] if result is not obj else [path for path, _ in opaque_tensors(obj)]
    if opaque:
        cls = type(obj).__name__
        names = ", ".join(opaque[:5]) + (", ..." if len(opaque) > 5 else "")
        warnings.warn(
            f"torchplace.move left the {cls} as it is: it is not a container torchplace moves "
            f"(no .to(device) method, not a dict, list, tuple or dataclass), so its tensors "
            f"({names}) stay where they are; give {cls} a .to(device) method that returns the "
            "moved object, or make it a dataclass",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    if copier.discarded:
        warnings.warn(
            discarded_warning("move", copier.discarded), UserWarning, stacklevel=user_stacklevel()
        )
    if left_behind and attributes == "warn":
        names = ", ".join(left_behind[:5]) + (", ..." if len(left_behind) > 5 else "")
        warnings.warn(
            f"torchplace.move left {len(left_behind)} plain attribute(s) holding tensors off "
            f"{target} ({names}): Module.to() does not move unregistered tensors either. "
            "Register tensors with self.register_buffer(name, tensor), keep modules in "
            "nn.ModuleList / nn.ModuleDict, or pass attributes='move' (or 'ignore').",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def place(model: nn.Module, destinations: dict[int, torch.device], /) -> None:
    """Send each parameter and buffer of ``model`` (by id) to its own device, all or nothing.

    The machinery of ``move`` for a model spread over devices: ties, identity, gradients and
    RNN weight caches are kept as in any move, and a failure leaves every tensor where it was.
    """
    copier = Copier(torch.device("cpu"), None)
    log = UndoLog()
    try:
        _move_modules([("", model)], copier.target, [], copier, "ignore", log, destinations)
        copier.synchronize()
    except BaseException:
        copier.abandon()
        log.rollback()
        raise


def _owned_ids(holders: list[Any]) -> set[int]:
    """Ids of every tensor the modules and optimizers of a batch hold (parameters, buffers,
    grads, optimizer state): a batch that lists one beside its owner must not make it a view."""
    ids: set[int] = set()
    for holder in holders:
        if isinstance(holder, nn.Module):
            for p in holder.parameters():
                ids.add(id(p))
                if p.grad is not None:
                    ids.add(id(p.grad))
            ids.update(id(b) for b in holder.buffers())
        elif isinstance(holder, torch.optim.Optimizer):
            for entries in holder.state.values():
                ids.update(id(v) for v in entries.values() if isinstance(v, torch.Tensor))
    return ids


def _owners_mover() -> Callable[..., list[str]]:
    """``_move_owners``, never traced: where torch.compile without fullgraph=True runs a move it
    cannot trace (a module in a batch) eagerly, Dynamo would still trace into its steps, and
    fail there. Wrapped in torch.compiler.disable only once torch._dynamo is imported (by
    torch.compile), so that importing torchplace never imports it."""
    if "torch._dynamo" not in sys.modules:
        return _move_owners
    untraced = _UNTRACED.get("owners")
    if untraced is None:  # a dict, not functools.cache: Dynamo warns on traced lru_caches
        untraced = _UNTRACED["owners"] = torch.compiler.disable(_move_owners)  # type: ignore[no-untyped-call]
    return untraced


_UNTRACED: dict[str, Callable[..., list[str]]] = {}


def _move_owners(
    modules: list[tuple[str, nn.Module]],
    optimizers: list[torch.optim.Optimizer],
    target: torch.device,
    copier: Copier,
    attributes: Attributes,
    log: UndoLog,
) -> list[str]:
    """Move modules with the optimizers that hold their parameters; gather dispatched ones."""
    left_behind = _move_modules(modules, target, optimizers, copier, attributes, log)
    for _, module in modules:
        _undispatch(module)
    return left_behind


def _undispatch(module: nn.Module) -> None:
    """Remove the hooks of ``torchplace.dispatch`` once a model is gathered onto one device."""
    if is_dispatched(module):
        undispatch(module)
        drop_homes(module)


def _prefill_batch(obj: Any, root: str, copier: Copier, views: bool) -> None:
    """Gather a batch's tensors bound for an accelerator, so that the copier sends many small
    ones in one copy before the walk that rebuilds the batch asks for each."""
    found: list[torch.Tensor] = []
    holders: list[Any] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    def hold(node: Any) -> Any:
        holders.append(node)
        return node

    with contextlib.suppress(Exception):  # the walk that rebuilds the batch reports any problem
        map_tensors(obj, collect, owner=hold, root=root)
    # Parameters, and tensors a module or optimizer in the batch holds, own their storage:
    # they travel with their owner's move, never as views of a batch's shared buffer.
    if views:  # (Parameter subclasses are not plain tensors: they never travel packed)
        parameter = nn.Parameter
        if holders:
            owned = _owned_ids(holders)
            found = [t for t in found if type(t) is not parameter and id(t) not in owned]
        else:
            found = [t for t in found if type(t) is not parameter]
    copier.prefill(found, views=views)


def _move_collection(
    obj: Any,
    target: torch.device,
    optimizers: list[torch.optim.Optimizer],
    copier: Copier,
    attributes: Attributes,
    log: UndoLog,
    *,
    views: bool = False,
) -> tuple[Any, list[str]]:
    """Move a batch: tensors copied into a rebuilt structure, modules and optimizers in place.

    Tensors are copied first, without touching anything the caller holds; then the modules and
    optimizers found in the batch move together, undoably; objects with their own ``.to`` come
    last, since some (a tokenizer's BatchEncoding) move themselves in place and cannot be put
    back: by then everything else has succeeded, and a failure there still undoes the modules.
    """
    modules: list[tuple[str, nn.Module]] = []
    found_optimizers: list[torch.optim.Optimizer] = []
    seen: set[int] = set()
    has_own_to: list[bool] = []

    def owner(node: Any) -> Any:
        if id(node) not in seen:
            seen.add(id(node))
            if isinstance(node, nn.Module):
                modules.append(("", node))
            else:
                found_optimizers.append(node)
        return node

    def later(node: Any) -> Any:
        has_own_to.append(True)
        return node

    # Batch tensors move with autograd, as Tensor.to does: activations keep their graph.
    tensor = tensor_mover(target, copier)

    root = "tensor" if isinstance(obj, torch.Tensor) else "batch"
    if is_accelerator(target):  # gather first, so many small tensors travel in one copy
        _prefill_batch(obj, root, copier, views)
    try:
        result = map_tensors(obj, tensor, to=later, owner=owner, root=root)
    except Located as located:
        _reraise(located, root, target)
    all_optimizers = optimizers + [o for o in found_optimizers if o not in optimizers]
    left_behind: list[str] = []
    if modules:
        # Name each module by its place in the batch: batch['model'].encoder.weight.
        paths = {id(leaf): path for path, leaf in iter_leaves(obj, root)}
        modules = [(paths.get(id(m), root) + ".", m) for _, m in modules]
        left_behind = _owners_mover()(modules, all_optimizers, target, copier, attributes, log)
        if copier.finals:  # a parameter listed beside its model comes back as that parameter
            finals = copier.finals
            result = map_tensors(result, lambda t: finals.get(id(t), t), root=root)
    else:
        _move_optimizers_alone(all_optimizers, target, copier, log)
    if has_own_to:
        result = _move_own_to(result, root, target, copier)
    return result, left_behind


def _move_own_to(batch: Any, root: str, target: torch.device, copier: Copier) -> Any:
    """The last step of a batch's move: objects in it with their own ``.to`` move by it."""

    def to(node: Any) -> Any:
        return own_to(node, target, asynchronous=bool(copier.non_blocking))

    try:
        return map_tensors(batch, lambda t: t, to=to, root=root)
    except Located as located:
        _reraise(located, root, target)
