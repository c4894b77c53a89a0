"""Looking: where every tensor of a model, optimizer or batch lives, and which are out of place.

Everything here reads; nothing moves. The one walk, ``entries``, names each tensor the way a user
would look it up (``encoder.weight`` as in ``named_parameters()``, ``encoder.weight.grad``,
``optimizer.state[encoder.weight].exp_avg``, ``batch['images'][2]``) and says what kind it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .._device_map import DISK, entry_of, parse_device_map, whole_model_map
from .._devices import DeviceSpec, normalize
from .._devices import device as _device
from .._errors import (
    DeviceUnavailableError,
    MixedDevicesError,
    NoTensorsError,
    PlacementError,
    Straggler,
    TorchplaceError,
    prefixed,
)
from .._model_walk import display, user_attributes, user_model, walk_model
from .._sizes import format_bytes  # its home; imported from here by several modules
from .._tensor_size import nbytes
from .._tree import cached_properties, iter_leaves, opaque_tensors, refuse_unwalkable
from ..moving._identity import current, replaced_outside
from ..moving._move import NON_PERSISTENT_LOST, REBUILD
from ..moving._offloaded import DISK_UNIT, Home, homes
from ..moving._optim_state import optimizer_list, rule_for
from ..moving._own_moves import moves_itself

__all__ = [
    "Entry",
    "devices_of",
    "entries",
    "format_bytes",
    "stragglers",
    "verify",
    "where",
]

Kind = Literal["parameter", "buffer", "grad", "attribute", "optimizer_state", "tensor"]


@dataclass(frozen=True)
class Entry:
    """One tensor found by a walk, with its name, kind, and the device policy that governs it.

    ``host`` marks optimizer state kept on the CPU by PyTorch's own policy (``step`` of a group
    that is neither fused nor capturable): it belongs on the CPU, whatever the model's device.
    ``module`` and ``slot`` say where a module's tensor is stored, for reports.
    """

    name: str
    kind: Kind
    tensor: torch.Tensor
    host: bool = False
    flexible: bool = False  # may live on the CPU or with its parameter (NAdam's mu_product)
    module: str | None = None
    # Held by an optimizer for a parameter that an earlier move replaced: the optimizer would
    # update a tensor the model no longer uses, wherever it lies.
    stale: bool = False
    # A buffer left out of the state dict: no checkpoint holds its values.
    non_persistent: bool = False
    # An attribute of a module that moves it itself ("MulticlassAccuracy's _apply").
    own: str | None = None
    # A module's value cached by a functools.cached_property of its class.
    cached: bool = False
    # An optimizer's parameter (or its state) that is not part of the model looked at.
    foreign: bool = False
    # Kept in the attributes of an object of this class, which move does not walk.
    opaque: str | None = None
    # A parameter of an offloaded module: its home tier ("cpu" or "disk") and the device it
    # runs on (its weights are brought there for each call).
    home: Home | None = None

    @property
    def place(self) -> str:
        """The device as reports show it: ``disk, runs on cuda:0`` for an offloaded weight."""
        if self.home is None:
            return str(self.tensor.device)
        return f"{self.home.tier}, runs on {self.home.execution}"


def module_entries(module: nn.Module, prefix: str = "") -> Iterator[Entry]:
    """Parameters, gradients, buffers and plain tensor attributes of a module and its children."""
    registered: set[int] = set()
    offloaded = {id(p): home for _, m, home in homes(module) for p in m.parameters()}
    for name, p in module.named_parameters():
        registered.add(id(p))
        owner = (prefix + name).rpartition(".")[0]
        yield Entry(prefix + name, "parameter", p, module=owner, home=offloaded.get(id(p)))
        if p.grad is not None:
            registered.add(id(p.grad))
            yield Entry(f"{prefix}{name}.grad", "grad", p.grad, module=owner)
    non_persistent = {
        id(b)
        for m in module.modules()
        for key, b in m._buffers.items()
        if key in m._non_persistent_buffers_set
    }
    for name, b in module.named_buffers():
        registered.add(id(b))
        owner = (prefix + name).rpartition(".")[0]
        lost = id(b) in non_persistent
        yield Entry(prefix + name, "buffer", b, module=owner, non_persistent=lost)
    modules = {id(m) for m in module.modules()}
    for mod_name, mod in module.named_modules():
        # Only a module whose own class moves it keeps its attributes in step; a plain module
        # below one is walked by Module._apply, which leaves plain attributes behind.
        own = _own_move(mod) if moves_itself(type(mod)) else None
        for key, value in user_attributes(mod):
            base = f"{prefix}{mod_name}.{key}" if mod_name else f"{prefix}{key}"
            for path, leaf in iter_leaves(value, root=base, skip_cycles=True):
                if isinstance(leaf, torch.Tensor):
                    if id(leaf) not in registered:
                        registered.add(id(leaf))
                        yield Entry(
                            path,
                            "attribute",
                            leaf,
                            module=(prefix + mod_name).rstrip("."),
                            own=own,
                            cached=key in cached_properties(type(mod)),
                        )
                elif isinstance(leaf, nn.Module) and id(leaf) not in modules:
                    # A module kept in a plain list or dict is not registered: Module.to()
                    # never reaches its tensors, so they count as attributes of the owner.
                    modules.update(id(m) for m in leaf.modules())
                    for entry in module_entries(leaf, prefix=path + "."):
                        if id(entry.tensor) not in registered:
                            registered.add(id(entry.tensor))
                            yield Entry(entry.name, "attribute", entry.tensor, module=path)


def _own_move(mover: nn.Module) -> str:
    """The override that moves a module's state, named: ``MulticlassAccuracy's _apply``."""
    return f"{type(mover).__name__}'s {'/'.join(sorted(moves_itself(type(mover))))}"


def optimizer_entries(
    optimizer: torch.optim.Optimizer,
    label: str,
    names: dict[int, str],
    params: Sequence[torch.Tensor] = (),
) -> Iterator[Entry]:
    """State tensors of an optimizer, named by the parameter they belong to.

    ``names`` maps id(parameter) to its name in the model being looked at. Parameters that a
    move replaced are named after their replacement, and their entries are ``stale``: the state
    tensors, or the parameter itself when it has no state yet (plain SGD, Adam before its first
    step). Parameters the optimizer holds that are not in ``names`` are yielded as parameters
    of the optimizer. ``params`` (the model's parameters in order) lets parameters that a plain
    ``model.to()`` replaced be recognised (``replaced_outside``).
    """
    adopted = replaced_outside(optimizer, params)
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            slot = f"param_groups[{g}]['params'][{i}]"
            name = names.get(id(p))
            stale = False
            if name is None:
                name = names.get(id(current(p)))
                if name is None and id(p) in adopted:
                    name = names.get(id(adopted[id(p)]))
                stale = name is not None
            foreign = name is None and bool(names)  # held beside a model it is not part of
            if name is None:
                name = slot
                yield Entry(f"{label}.{name}", "parameter", p, foreign=foreign)
            state = optimizer.state.get(p)
            reported = False
            for key, value in (state or {}).items():
                base = f"{label}.state[{name}].{key}"
                rule = rule_for(optimizer, group, key)
                for path, leaf in iter_leaves(value, root=base, skip_cycles=True):
                    if isinstance(leaf, torch.Tensor):
                        reported = True
                        yield Entry(
                            path,
                            "optimizer_state",
                            leaf,
                            rule.host,
                            rule.flexible,
                            module=f"{label}.state",
                            stale=stale,
                            foreign=foreign,
                        )
            if stale and not reported:
                yield Entry(f"{label}.{slot}", "optimizer_state", p, stale=True)


def entries(obj: Any, /, *, optimizer: Any = None, root: str = "batch") -> list[Entry]:
    """Every tensor reachable from ``obj`` (and the optimizers), each once, in a stable order."""
    optimizers = optimizer_list(optimizer)
    found: list[Entry] = []
    names: dict[int, str] = {}
    params: list[torch.Tensor] = []
    seen: set[int] = set()

    def add(entry: Entry) -> None:
        if id(entry.tensor) not in seen:
            seen.add(id(entry.tensor))
            found.append(entry)
            if entry.kind == "parameter" and id(entry.tensor) not in names:
                names[id(entry.tensor)] = entry.name
                params.append(entry.tensor)

    def visit(node: Any, label: str) -> None:
        if isinstance(node, nn.Module):
            for entry in module_entries(node, prefix="" if label == "" else label + "."):
                add(entry)
        elif isinstance(node, torch.optim.Optimizer):
            if node not in optimizers:
                optimizers.append(node)
        elif isinstance(node, torch.Tensor):
            kind: Kind = "parameter" if isinstance(node, nn.Parameter) else "tensor"
            add(Entry(label or "tensor", kind, node))
        else:
            for path, leaf in iter_leaves(node, root=label or root, refuse=True):
                visit(leaf, path)  # noqa: F821 (deleted once done)

    try:
        if isinstance(obj, torch.optim.Optimizer):
            if obj not in optimizers:
                optimizers.insert(0, obj)
        else:  # a model wrapped by torch.compile, Fabric or DDP is named as the user names it
            visit(user_model(obj) if isinstance(obj, nn.Module) else obj, "")
    finally:
        del visit  # it refers to itself: a cycle holding every entry's tensor otherwise
    if not isinstance(obj, torch.optim.Optimizer):
        for path, t in opaque_tensors(obj, root):  # an object move does not walk: said so
            add(Entry(path, "tensor", t, opaque=type(obj).__name__))
    model_params = list(params)  # the optimizers' own parameters are not the model's
    for index, opt in enumerate(optimizers):
        label = "optimizer" if len(optimizers) == 1 else f"optimizer[{index}]"
        for entry in optimizer_entries(opt, label, names, model_params):
            add(entry)
    return found


def _expected(entry: Entry, target: torch.device) -> bool:
    """Whether an entry is where it belongs, given the device everything should be on."""
    if entry.stale:
        return False
    dev = entry.tensor.device
    if entry.host:
        return dev.type == "cpu"
    if entry.flexible and dev.type == "cpu":
        return True
    return dev == target


def misplaced(obj: Any, target: torch.device, optimizer: Any) -> list[Entry]:
    """The entries of ``obj`` that are not where they belong when all should be on ``target``."""
    return [e for e in entries(obj, optimizer=optimizer) if not _expected(e, target)]


def devices_of(obj: Any, /, *, optimizer: Any = None) -> frozenset[torch.device]:
    """Every device holding a tensor of ``obj``.

    Optimizer state that PyTorch keeps on the CPU on purpose (``step``) is left out.

    >>> import torch, torchplace
    >>> found = torchplace.devices_of({"a": torch.zeros(1), "b": torch.zeros(1, device="meta")})
    >>> sorted(str(d) for d in found)
    ['cpu', 'meta']
    """
    refuse_unwalkable(obj, "devices_of")
    return frozenset(e.tensor.device for e in entries(obj, optimizer=optimizer) if not e.host)


def _runs_on(entry: Entry) -> torch.device:
    """The device an entry counts on for ``where``: an offloaded weight's is where it runs."""
    return entry.tensor.device if entry.home is None else entry.home.execution


def _summary(found: Iterable[Entry]) -> dict[torch.device, list[Entry]]:
    by_device: dict[torch.device, list[Entry]] = {}
    for e in found:
        by_device.setdefault(_runs_on(e), []).append(e)
    return dict(sorted(by_device.items(), key=lambda kv: -sum(nbytes(e.tensor) for e in kv[1])))


def describe(obj: Any) -> str:
    if isinstance(obj, nn.Module):
        return f"the {type(user_model(obj)).__name__} model"
    if isinstance(obj, torch.optim.Optimizer):
        return f"the {type(obj).__name__} optimizer"
    if isinstance(obj, torch.Tensor):
        return "the tensor"
    return f"the {type(obj).__name__}"


def where(obj: Any, /) -> torch.device:
    """The one device that holds every tensor of ``obj``.

    >>> import torch, torchplace
    >>> torchplace.where(torch.nn.Linear(2, 2))
    device(type='cpu')
    >>> torchplace.where(torch.nn.ReLU())
    Traceback (most recent call last):
    ...
    torchplace.NoTensorsError: the ReLU model holds no tensors, so it has no device ...
    """
    refuse_unwalkable(obj, "where")
    found = [e for e in entries(obj) if not e.host]
    if not found:
        raise NoTensorsError(
            f"{describe(obj)} holds no tensors, so it has no device "
            "(next(model.parameters()) would raise a bare StopIteration); "
            "take the device from its inputs or from your own torchplace.device()"
        )
    by_device = _summary(found)
    if len(by_device) == 1:
        return next(iter(by_device))
    parts = []
    for dev, group in by_device.items():
        total = sum(nbytes(e.tensor) for e in group)
        examples = ", ".join(e.name for e in group[:3]) + (", ..." if len(group) > 3 else "")
        count = f"{len(group)} tensor{'s' if len(group) != 1 else ''}"
        parts.append(f"{dev} ({count}, {format_bytes(total)}: {examples})")
    raise MixedDevicesError(
        f"{describe(obj)} is spread over {len(by_device)} devices: {'; '.join(parts)}. "
        "It has no single device (next(model.parameters()).device would name just one); "
        "gather it with torchplace.move(obj, device) or list them with torchplace.devices_of"
    )


def stragglers(obj: Any, device: DeviceSpec, /, *, optimizer: Any = None) -> list[Straggler]:
    """Every tensor reachable from ``obj`` (and ``optimizer``) that is not on ``device``.

    >>> import torch, torchplace
    >>> model = torch.nn.Linear(2, 2)
    >>> model.scale = torch.ones(1)  # a plain attribute: Module.to() would not move it
    >>> [s.name for s in torchplace.stragglers(model, "meta")]
    ['weight', 'bias', 'scale']
    >>> torchplace.stragglers(model, "cpu")
    []
    """
    refuse_unwalkable(obj, "stragglers")
    return [
        Straggler(e.name, e.kind, e.tensor.device, nbytes(e.tensor))
        for e in misplaced(obj, normalize(device), optimizer)
    ]


def fix_for(entry: Entry, target: torch.device, *, rebuild: bool = False) -> str:
    """What to do about one misplaced tensor, in words that work when followed to the letter.

    ``rebuild``: the model also has non-persistent buffers on meta, which only rebuilding it
    brings back, so that is the fix for its parameters and buffers on meta too.
    """
    dev = f"'{target}'"
    if entry.opaque is not None:
        return (
            f"held by {entry.opaque}, which is not a container torchplace moves (no "
            ".to(device) method, not a dict, list, tuple or dataclass), so torchplace.move "
            f"leaves it as it is; give {entry.opaque} a .to(device) method that returns the "
            "moved object, or make it a dataclass"
        )
    if entry.foreign:
        return (
            "the optimizer also holds parameters that are not part of this model (another "
            "model's): move that model with its optimizer too, torchplace.move(other_model, "
            f"{dev}, optimizer=opt), or verify this model alone, without optimizer="
        )
    if entry.stale and entry.kind == "optimizer_state" and entry.name.endswith("]"):
        # the stale parameter itself (its state, if any, is listed on its own lines)
        return (
            "the optimizer still holds a parameter that the model no longer uses (a move "
            "without it, to_empty, or a load_into by device_map replaced it), so its steps would "
            "change the wrong tensor; "
            f"re-bind it: torchplace.move(model, {dev}, optimizer=opt)"
        )
    if entry.stale and entry.tensor.is_meta and target.type != "meta":
        return (
            "state held for a parameter the model no longer uses, and on meta it has no values: "
            "clear it with opt.state.clear(), then re-bind the optimizer with "
            f"torchplace.move(model, {dev}, optimizer=opt)"
        )
    if entry.home is not None:  # left on meta by an offloading map: its values are kept
        return (
            f"offloaded to {entry.home.tier} by a device map, its weights brought to "
            f"{entry.home.execution} for each call; check such a model against its map, "
            "torchplace.verify(model, device_map), or gather it onto one device first, "
            f"torchplace.move(model, {dev})"
        )
    inside = _inside_disk_module(entry, dev)
    if inside:
        return inside
    if entry.tensor.is_meta and target.type != "meta":
        if rebuild and entry.kind in ("parameter", "buffer") and not entry.non_persistent:
            return (
                "on meta it has no values, and the model's non-persistent buffers on meta "
                f"cannot be loaded back; {REBUILD.format(dev=dev)}"
            )
        return _lost_on_meta(entry, dev)
    if entry.stale:
        return (
            "the optimizer still holds a parameter that the model no longer uses (a move it "
            "was not passed to, or a load_into by device_map, replaced it), so its steps would "
            "change the wrong tensor; "
            f"re-bind it: torchplace.move(model, {dev}, optimizer=opt)"
        )
    return _fix_by_kind(entry, dev)


def _inside_disk_module(entry: Entry, dev: str) -> str:
    """The fix for a placeholder of a disk module that a module inside it, looked at alone,
    holds (its values are kept in the checkpoint), else ''."""
    unit = entry.tensor.__dict__.get(DISK_UNIT) if entry.tensor.is_meta else None
    if not isinstance(unit, str):
        return ""
    return (
        f"its values stay on disk with the module offloaded at {display(unit)}, which reads "
        "them when it runs; check the whole model against its map, torchplace.verify(model, "
        f"device_map), or gather it onto one device first, torchplace.move(model, {dev})"
    )


def _fix_by_kind(entry: Entry, dev: str) -> str:
    """The fix for a misplaced tensor with values and a live owner: by what kind of tensor it is."""
    kind = entry.kind
    if kind == "attribute":
        return _fix_for_attribute(entry, dev)
    if kind == "optimizer_state":
        if entry.host:
            return (
                "'step' must stay on the CPU unless the optimizer is fused or capturable; "
                f"torchplace.move(model, {dev}, optimizer=opt) puts it back"
            )
        return f"move the optimizer with its model: torchplace.move(model, {dev}, optimizer=opt)"
    if kind == "grad":
        return (
            "a gradient left behind (param.data = ... moves data, not .grad); "
            f"torchplace.move(model, {dev}) moves both"
        )
    if kind == "tensor":
        # move returns the moved batch (the one passed in is left as it was): keep the result
        root = re.split(r"[\[.]", entry.name, maxsplit=1)[0]
        return f"{root} = torchplace.move({root}, {dev})"
    return f"torchplace.move(model, {dev})"


def _fix_for_attribute(entry: Entry, dev: str) -> str:
    """The fix for a tensor kept in a plain attribute of a module."""
    if entry.own is not None:
        return (
            f"kept by a module that moves it itself ({entry.own}), as Module.to() would; "
            f"torchplace.move(model, {dev}) runs that"
        )
    attr = entry.name.rpartition(".")[2]
    if "[" in entry.name:  # in a plain list, tuple or dict attribute (a module's, or a tensor)
        return (
            "held in a plain list or dict attribute, which Module.to() does not walk; keep "
            "modules in nn.ModuleList / nn.ModuleDict and tensors as registered buffers "
            "(one register_buffer each), or pass attributes='move' to torchplace.move"
        )
    if entry.cached:
        return (
            f"a value cached by a functools.cached_property, which torchplace.move "
            f"moves with its module: torchplace.move(model, {dev}); or drop it with "
            f"del model.{entry.name} and it is computed again where the model is"
        )
    return (
        f"a plain tensor attribute, which Module.to() does not move; register it, "
        f"self.register_buffer('{attr}', ...) in its module's __init__ in place of "
        f"self.{attr} = ..., or pass attributes='move' to torchplace.move"
    )


def _lost_on_meta(entry: Entry, dev: str) -> str:
    """The fix for a tensor on meta (no values) that belongs on a real device: what was lost,
    and the way to get it back that works."""
    kind = entry.kind
    if kind == "optimizer_state":
        return (
            "its values were lost when the optimizer's state moved to meta (meta holds shapes, "
            "no data); clear it with opt.state.clear() (the optimizer starts afresh at its next "
            "step) or load a saved one with opt.load_state_dict(saved)"
        )
    if kind == "grad":
        return "a gradient on meta has no values; drop it with model.zero_grad(), compute it again"
    if kind == "buffer" and entry.non_persistent:
        return NON_PERSISTENT_LOST.format(dev=dev)
    if kind in ("parameter", "buffer"):
        return (
            "on meta it has no values; load them with "
            f"torchplace.load_into(model, checkpoint, {dev})"
        )
    if kind == "attribute" and entry.own is not None:
        return (
            f"kept by a module that moves it itself ({entry.own}); its values were lost on meta: "
            f"build that module again on {dev}"
        )
    if kind == "attribute":
        return f"a plain attribute on meta has no values; assign it again on {dev}"
    return f"a tensor on meta has no values; build it again on {dev}"


def _refuse_other_models_optimizer(found: list[Entry], optimizers: list[Any]) -> None:
    """An optimizer none of whose parameters belongs to the model checked is another model's
    (``move`` refuses to move it): wherever its tensors are, it is not this model's."""
    for index, opt in enumerate(optimizers):
        label = "optimizer" if len(optimizers) == 1 else f"optimizer[{index}]"
        count = sum(len(group["params"]) for group in opt.param_groups)
        prefix = f"{label}.param_groups["
        foreign = [e for e in found if e.foreign and e.name.startswith(prefix)]
        if count and len(foreign) == count:
            raise TorchplaceError(
                f"{label} ({type(opt).__name__}) holds none of the model's parameters (its "
                f"{count} belong to another model), so it cannot be checked with this model; "
                "pass the optimizer built on this model's parameters"
            )


def verify(
    obj: Any, device: DeviceSpec | Mapping[str, DeviceSpec], /, *, optimizer: Any = None
) -> None:
    """Raise ``PlacementError`` unless every tensor of ``obj`` (and ``optimizer``) is on ``device``.

    >>> import torch, torchplace
    >>> model = torch.nn.Linear(2, 2)
    >>> torchplace.verify(model, "cpu")
    >>> torchplace.verify(model, "meta")
    Traceback (most recent call last):
    ...
    torchplace.PlacementError: 2 tensors of the Linear model are not on meta: ...

    ``device`` may be a device map (as ``dispatch`` and ``load_into`` take it) when ``obj`` is
    a model: each parameter and buffer is then checked against the device of the most specific
    entry that holds it, and an offloaded module's weights against their home tier (``"cpu"`` or
    ``"disk"``; its buffers live on the device it runs on). The map is read as ``dispatch``
    reads it: a key naming no module of the model (a typo, a layer it lacks) raises
    ``DeviceSpecError`` with the likely name; the devices it names need not be on this machine.
    ``{"": "disk"}`` (and ``{"": "cpu"}`` beside an accelerator) stands for each block on that
    tier, as ``load_into`` and ``dispatch`` read it; buffers a state dict leaves out stay on the
    device the model runs on.
    """
    refuse_unwalkable(obj, "verify")
    if isinstance(device, Mapping):
        _verify_by_map(obj, device)
        return
    target = normalize(device)
    found = entries(obj, optimizer=optimizer)
    _refuse_other_models_optimizer(found, optimizer_list(optimizer))
    bad = [e for e in found if not _expected(e, target)]
    if not bad:
        return
    lines = []
    rebuild = target.type != "meta" and any(e.non_persistent and e.tensor.is_meta for e in bad)
    for e in bad[:10]:
        where_text = f"is on {e.tensor.device}" + (", expected cpu" if e.host else "")
        if e.stale:
            where_text = f"is on {e.tensor.device}, held for a replaced parameter"
        lines.append(
            f"  - {e.name} ({e.kind}, {format_bytes(nbytes(e.tensor))}) {where_text}; "
            f"fix: {fix_for(e, target, rebuild=rebuild)}"
        )
    if len(bad) > 10:
        lines.append(f"  ... and {len(bad) - 10} more (torchplace.stragglers lists them all)")
    if target.type not in ("cpu", "meta"):  # the fixes move there: say when they cannot
        try:
            _device(target)
        except DeviceUnavailableError as exc:
            lines.append(
                f"  note: the fixes above cannot run here ({exc}); check against a device "
                "this machine has, e.g. torchplace.device('auto')"
            )
    count = f"{len(bad)} tensor{'s' if len(bad) != 1 else ''} of {describe(obj)}"
    if isinstance(obj, torch.Tensor):
        count = "the tensor"
    raise PlacementError(
        f"{count} {'are' if len(bad) != 1 else 'is'} not on {target}:\n" + "\n".join(lines),
        stragglers=[Straggler(e.name, e.kind, e.tensor.device, nbytes(e.tensor)) for e in bad],
    )


def _verify_by_map(model: Any, device_map: Mapping[str, Any]) -> None:
    """``verify`` against a device map: ``PlacementError`` naming each tensor out of its place,
    each with the fix that puts it there."""
    if not isinstance(model, nn.Module):
        raise TorchplaceError(f"a device map describes a model, not {type(model).__name__}")
    try:  # the map read as dispatch and load_into read it; its devices need not be here
        wants = parse_device_map(
            walk_model(model), _as_loaded(model, device_map), resolve=normalize
        )
    except TorchplaceError as err:
        raise prefixed(err, "verify()") from err.__cause__
    runs = {path: home.execution for path, _, home in homes(model)}
    bad: list[tuple[Entry, str]] = []
    for e in entries(model):
        if e.kind not in ("parameter", "buffer") or e.module is None:
            continue
        want = _mapped(e.module, wants)
        if want is None:
            bad.append((e, "no entry of the map covers it"))
        elif e.home is not None:
            if e.home.tier != str(want):
                bad.append((e, f"it is offloaded to {e.home.tier}, the map says {want}"))
        elif e.kind == "buffer" and e.tensor.device == _mapped(e.module, runs):
            continue  # an offloaded module's buffers live where it runs
        elif e.tensor.device != want:
            bad.append((e, f"it is on {e.tensor.device}, the map says {want}"))
    if bad:
        gather = _taken_off_disk(model, wants)
        lines = []
        for e, why in bad[:10]:
            fix = _map_fix(e, _mapped(e.module or "", wants), gather)
            lines.append(f"  - {e.name} ({e.kind}): {why}; fix: {fix}")
        if len(bad) > 10:
            lines.append(f"  ... and {len(bad) - 10} more")
        raise PlacementError(
            f"{len(bad)} tensor(s) of {describe(model)} are not where the device map puts "
            "them:\n" + "\n".join(lines),
            stragglers=[
                Straggler(e.name, e.kind, e.tensor.device, nbytes(e.tensor)) for e, _ in bad
            ],
        )


def _as_loaded(model: nn.Module, device_map: Mapping[str, Any]) -> Mapping[str, Any]:
    """The map that ``{"": "disk"}`` or ``{"": "cpu"}`` stands for, as ``load_into`` and
    ``dispatch`` read it (``whole_model_map``): each block its own entry on that tier, and the
    modules holding only buffers a state dict leaves out (a rotary embedding's) on the device
    the model runs on. ``{"": "cpu"}`` stands for blocks only where the model runs its host
    tier on another device; otherwise it is the whole model on the CPU, as it says."""
    tier = str(device_map.get("", "")) if len(device_map) == 1 else ""
    if tier not in (DISK, "cpu"):
        return device_map
    offloaded = [home for _, _, home in homes(model) if home.tier == tier]
    if tier == "cpu" and not any(home.execution.type != "cpu" for home in offloaded):
        return device_map
    resident = str(offloaded[0].execution) if offloaded else "cpu"
    return whole_model_map(model, tier, resident)


def _taken_off_disk(model: nn.Module, wants: Mapping[str, Any]) -> bool:
    """Whether the map puts a module whose weights are left on disk anywhere but on disk:
    ``dispatch`` refuses that until ``move`` has read them back."""
    return any(
        home.tier == DISK and str(_mapped(path, wants)) != DISK for path, _, home in homes(model)
    )


def _map_fix(e: Entry, want: Any, gather: bool) -> str:
    """The fix for one tensor out of its place under a map, that works when followed: a map
    that leaves it out needs an entry; only ``load_into`` leaves weights on disk (``dispatch``
    writes none there); ``dispatch`` takes weights off disk only once ``move`` has read them."""
    if want is None:
        owner = e.module or ""
        return f"add an entry for {owner!r} or one of its parents ('' covers the whole model)"
    if str(want) == DISK:
        return (
            "dispatch writes no weights to disk; load the model by this map, "
            "torchplace.load_into(skeleton, checkpoint, device_map=device_map), which leaves "
            "them in the file"
        )
    if gather:
        return (
            "the map takes weights off disk, which only move reads back: "
            "torchplace.move(model, 'cpu'), then torchplace.dispatch(model, device_map)"
        )
    return "torchplace.dispatch(model, device_map)"


def _mapped(path: str, table: Mapping[str, Any]) -> Any:
    """The value of the most specific key of ``table`` that contains module ``path``."""
    entry = entry_of(path, table)
    return None if entry is None else table[entry]
