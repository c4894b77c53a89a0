"""``load_into`` by a device map: one flow from a skeleton to a model that runs.

With ``device_map=``, the modules that live in memory (on accelerators or the host) are filled
by the checkpoint package's fill while the modules mapped to ``"disk"`` are held out of the
model (each of the file's bytes is read once, and theirs not at all); each ``"disk"`` module
then gets a ``CheckpointWeights`` reader of its byte ranges, its parameters stay on ``meta``,
and the model is dispatched by the map (``dispatch`` runs the disk modules from that reader).
Without a map, ``load_into`` is the checkpoint package's, unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from .._device_map import DISK, entry_of, whole_model_map
from .._devices import DeviceSpec
from .._errors import CheckpointError, DeviceSpecError, TorchplaceError, check_flags, prefixed
from .._model_walk import display, tensor_slots, walk_model
from ..checkpoint._catalog import catalog
from ..checkpoint._checkpoint import load_into as fill
from ..checkpoint._conversions import Plan
from ..checkpoint._entries import Catalog
from ..checkpoint._keys import KeyCheck, Mismatch, Missing, does_not_fit
from ..checkpoint._mismatch import REFUSE_LEFT_ON_META, LeftOnMeta, listing, warn_skipped
from ..checkpoint._opened import one_open_each
from ..checkpoint._rename import Rename, as_renamer, given, not_given
from ..checkpoint._source import PathLike
from ..checkpoint._statedict import has_post_hooks, loads_itself
from ..moving._hooks import MARK
from ..moving._identity import record_replacement
from ..moving._offloaded import DEFAULT_WINDOW, HOME, homes, mark_disk_placeholder

if TYPE_CHECKING:  # the map's modules load only when a map is given: a plain load pays none
    from ._dispatch import DeviceMapSpec

__all__ = ["load_into"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def load_into(
    model: ModuleT,
    source: PathLike | Mapping[str, Any],
    device: DeviceSpec = None,
    /,
    *,
    strict: bool = True,
    mmap: bool = False,
    rename: Rename | None = None,
    check_crc: bool | None = None,
    progress: bool | None = None,
    device_map: DeviceMapSpec | None = None,
    execution_device: DeviceSpec = None,
    offload_window: int = DEFAULT_WINDOW,
) -> ModuleT:
    """Fill ``model`` from a checkpoint; with ``device_map``, fill it by the map and dispatch it.

    >>> import os, tempfile, torch, torchplace
    >>> path = os.path.join(tempfile.mkdtemp(), "mlp.pt")
    >>> make = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> torch.save(make().state_dict(), path)
    >>> device_map = {"": "cpu", "1": "disk"}
    >>> model = torchplace.load_into(torchplace.skeleton(make), path, device_map=device_map)
    >>> model[1].weight.device  # left in the file, read just in time
    device(type='meta')
    >>> with torch.no_grad():
    ...     model(torch.ones(1, 4)).shape
    torch.Size([1, 2])

    Without ``device_map`` this is the checkpoint package's ``load_into`` (see its docstring
    for ``device``, ``strict``, ``mmap``, ``rename``, ``check_crc`` and ``progress``).

    With ``device_map`` (as ``plan`` returns it, or written by hand; ``device`` must then be
    None), the modules mapped to devices are filled (each of their bytes read once: straight
    onto the device when the map keeps them all on one, else into host memory and then placed), the
    modules mapped to ``"disk"`` are left in the checkpoint (their parameters on ``meta``;
    nothing is written to an offload folder) and read from it each time they run, and the
    model comes back dispatched by the map with ``execution_device`` and ``offload_window``
    as for ``dispatch``. A mapping source cannot be left on disk.

    Raises:
        CheckpointError: as the fill raises; a mapping source with ``"disk"`` in the map.
        DeviceSpecError: a bad map; ``device`` given with ``device_map``.
    """
    check_flags("load_into()", strict=strict, mmap=mmap, check_crc=check_crc, progress=progress,
                optional=("check_crc", "progress"))  # fmt: skip
    _refuse_offloaded(model)
    if device_map is None:
        if execution_device is not None:
            raise TorchplaceError("load_into(): execution_device is for a device_map; give one")
        return fill(
            model,
            source,
            device,
            strict=strict,
            mmap=mmap,
            rename=rename,
            check_crc=check_crc,
            progress=progress,
        )
    options = {"strict": strict, "mmap": mmap, "check_crc": check_crc, "progress": progress}
    try:
        return _by_map(model, source, device, device_map, rename, options, execution_device,
                       offload_window)  # fmt: skip
    except TorchplaceError as err:
        raise prefixed(err, "load_into()") from err.__cause__


def _refuse_offloaded(model: object) -> None:
    """``CheckpointError`` for a model with offloaded modules (``dispatch``, or an earlier
    ``load_into`` by a map): filled in place, they would go on bringing their old weights to
    each call (from the checkpoint they were left in, or from host memory)."""
    if not isinstance(model, nn.Module) or not any(
        HOME in m.__dict__ or MARK in m.__dict__ for m in model.modules()
    ):
        return  # (a walk without names: every load_into pays it)
    inside = getattr(model.__dict__.get(MARK), "inside", "")
    if inside:
        raise CheckpointError(
            f"load_into(): {type(model).__name__} lies inside {display(inside)}, which is "
            "offloaded to 'disk' and reads its weights from the checkpoint it was loaded from "
            "each time it runs, so what is filled here would be read over at its next call; "
            "gather the model first, torchplace.move(model, 'cpu'), then load_into, or load the "
            "checkpoint into a new skeleton with device_map= to run it offloaded"
        )
    found = next(homes(model), None)
    if found is None:
        return  # dispatched, nothing offloaded
    path, module, home = found
    name = display(path) if path else type(model).__name__
    kept = "the checkpoint it was loaded from" if home.tier == "disk" else "host memory"
    raise CheckpointError(
        f"load_into(): {name} ({type(module).__name__}) is offloaded to {home.tier} and brings "
        f"its weights from {kept} to {home.execution} for each call, so filling the model in "
        "place would leave it running with its old weights; gather it first, "
        f"torchplace.move(model, {str(home.execution)!r}), then load_into, or load the "
        "checkpoint into a new skeleton with device_map= to run it offloaded"
    )


def _by_map(
    model: ModuleT,
    source: PathLike | Mapping[str, Any],
    device: DeviceSpec,
    device_map: DeviceMapSpec,
    rename: Rename | None,
    options: dict[str, Any],
    execution_device: DeviceSpec,
    offload_window: int,
) -> ModuleT:
    if device is not None:
        raise DeviceSpecError(
            f"device={device!r} and a device_map were both given; the map says where each "
            "module goes, so leave device out"
        )
    if not isinstance(model, nn.Module):
        raise TorchplaceError(f"load_into() fills an nn.Module, not {type(model).__name__}")
    from .._device_map import parse_device_map
    from ..checkpoint._disk_weights import model_names
    from ._dispatch import check_offloading, dispatch

    tree = walk_model(model)
    if isinstance(device_map, Mapping) and dict(device_map) == {"": "disk"}:
        device_map = blocks_on_disk(model, execution_device)  # the whole model, block by block
    entries = parse_device_map(tree, device_map)
    disk = [name for name, where in entries.items() if where == DISK]
    _check_disk(model, source, disk)
    check_offloading(tree, entries, execution_device, offload_window)  # before reading a byte
    renamer = None if rename is None else as_renamer(rename)
    strict = options["strict"]
    with one_open_each():  # each file opened once in this call (the disk tier's reads: later)
        # resolved once, for the checks and the tier
        found = catalog(source) if disk or not strict else None
        # each file key's model names, after rename and the hub-name conversion
        names, plan = model_names(found, model, renamer) if found is not None else ({}, None)
        skipped = []  # keys under the disk modules that fill nothing (strict=False)
        tied = _tied_keys(model, disk, names) if disk else {}
        if found is not None and disk:
            skipped = _check_in_file(model, found, disk, (names, plan, renamer), strict=strict)
        if found is not None and not strict:
            _refuse_left_on_meta(model, found, disk, names, renamer)
        dtypes = {name: _dtypes(model.get_submodule(name)) for name in disk}
        # a disk module's persistent buffers (BatchNorm's statistics, a router's bias) are read
        # now, before anything changes, and live in memory as any module's buffers do
        buffers = _disk_buffers(model, found, disk, names, strict, skipped) if found else {}
        filled = source if found is None or found.path is None else found.path
        with _held_out(model, disk):
            _left_on_meta_refused(  # what a hook left
                lambda: fill(
                    model,
                    filled,
                    _one_device(entries),
                    rename=_dropping(renamer, disk, names),
                    **options,
                )
            )
    _put_buffers(model, buffers)
    if found is not None:
        _leave_on_disk(
            model, found, disk, dtypes, (names, renamer), tied, mapped=bool(options["mmap"])
        )
    dispatch(model, device_map, execution_device=execution_device, offload_window=offload_window)
    return model


def _leave_on_disk(
    model: nn.Module,
    found: Catalog,
    disk: list[str],
    dtypes: Mapping[str, Any],
    keys: tuple[dict[str, tuple[str, ...]], Callable[[str], str | None] | None],
    tied: Mapping[str, Mapping[str, str]],
    *,
    mapped: bool = False,
) -> None:
    """The ``"disk"`` modules' parameters made ``meta`` placeholders, each module marked with
    its home: the reader of its weights from ``found`` (``keys``: each file key's model names,
    and the renamer; ``tied``: per entry, the file keys its tied weights are read from;
    ``mapped``: ``mmap=True``, its weights read as views of the file)."""
    from ..checkpoint._disk_weights import CheckpointWeights
    from ..moving._offloaded import HOME, Home

    names, renamer = keys
    for name in disk:
        module = model.get_submodule(name)
        rename = _renaming(renamer, tied.get(name, {}))
        reader = CheckpointWeights(found, model, name, dtypes[name], rename, names)
        reader.mapped = mapped
        _params_to_meta(module, name)
        module.__dict__[HOME] = Home(DISK, torch.device("cpu"), reader)


def blocks_on_disk(model: nn.Module, execution_device: object = None) -> dict[str, str]:
    """The map that ``{"": "disk"}`` stands for (``whole_model_map``): the whole model on disk,
    each block its own entry; buffers a state dict leaves out on the execution device
    (``execution_device``, else the CPU).

    >>> m = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2)))
    >>> blocks_on_disk(m)
    {'0': 'disk', '2.0': 'disk'}
    """
    resident = "cpu" if execution_device is None else str(execution_device)
    return whole_model_map(model, DISK, resident)


def _refuse_left_on_meta(
    model: nn.Module,
    found: Catalog,
    disk: list[str],
    names: Mapping[str, tuple[str, ...]],
    renamer: Callable[[str], str | None] | None,
) -> None:
    """Refuse, before anything is filled, a ``strict=False`` load that would leave a tensor the
    map keeps in memory on ``meta`` (no key of the file fills it, after ``rename`` and the
    hub-name conversion: ``names``): dispatch cannot place a tensor with no values, and it
    raised after the fill, the model half filled. A model whose load hooks or own loaders may
    yet fill such a tensor is left to the fill (``_left_on_meta_refused``)."""
    if has_post_hooks(model) or any(loads_itself(m) for m in model.modules()):
        return
    filled = {n for targets in names.values() for n in targets}
    heads = tuple(f"{name}." for name in disk)
    slots = tensor_slots(model)
    left = [
        s.names[0]
        for s in (*slots.loadable, *slots.transient)
        if s.tensor.is_meta
        and not any(n in filled for n in s.names)
        and not all(n.startswith(heads) for n in s.names)
    ]
    if not left:
        return
    once = " once the rename= given is applied" if given(renamer) else ""
    raise CheckpointError(
        f"strict=False would leave {len(left)} tensor(s) of {type(model).__name__} on meta, "
        f"where they hold no values: {listing(left)}; {found.where} has no key for them{once}, "
        "and the device_map places them in memory, where they must hold values before the "
        "model is dispatched. Nothing was filled: give them values first (the load fills only "
        "what the file holds, so what you initialise stays), load a file that holds them, or "
        "map their modules to 'disk' from a checkpoint that does",
        path=found.path,
        missing=left,
    )


def _left_on_meta_refused(load: Callable[[], object]) -> None:
    """``load()`` with the fill's warning that ``strict=False`` left tensors on ``meta`` made
    its error, then refused: the map places those tensors in memory, and dispatch could not
    place a tensor with no values. ``_refuse_left_on_meta`` refuses such a load before anything
    is filled; this is for what the model's load hooks or own loaders left (the fill puts back
    what it kept copies of; what it wrote in place stays).

    The fill is told so by a context variable (a warnings filter would be the whole process's: a
    plain load in another thread meanwhile had its warning raised), set in a copy of this
    thread's context that ``load`` runs in: nothing is left to reset, so an interrupt at any
    point leaves no later load of this thread refusing what it should warn of."""

    def refusing() -> None:
        REFUSE_LEFT_ON_META.set(True)
        load()

    try:
        contextvars.copy_context().run(refusing)
    except LeftOnMeta as left:
        raise CheckpointError(
            f"{left}; with a device_map the load stops here: the map places them in memory, "
            "where they must hold values before the model is dispatched (the load fills only "
            "what the file holds, so what you initialise first stays). What the fill wrote in "
            "place may stay written: build the model again",
            path=left.path,
            missing=left.missing,
        ) from None


def _check_disk(model: nn.Module, source: object, disk: list[str]) -> None:
    if not disk:
        return
    if isinstance(source, Mapping):
        raise CheckpointError(
            f"the device_map puts {', '.join(map(display, disk[:3]))} on 'disk', but the source "
            "is a mapping of tensors already in memory, not a file its weights could stay in; "
            "save it first (torch.save or safetensors) and pass the path, or map them to 'cpu'"
        )
    if "" in disk:
        raise DeviceSpecError(
            "device_map[''] is 'disk' beside other entries; give {'': 'disk'} alone for the "
            "whole model on disk (each block read as it runs), or map the model's parts (its "
            "layers) to 'disk' one by one"
        )
    _check_ties(model, disk)
    for name in disk:
        module = model.get_submodule(name)
        lazy = [n for n, p in module.named_parameters() if isinstance(p, nn.UninitializedParameter)]
        if lazy:
            raise DeviceSpecError(
                f"{display(f'{name}.{lazy[0]}')} is a lazy parameter, with no shape until its "
                f"module's first forward, so the disk tier cannot read it by its byte range; "
                f"run one batch through the model first, or map {name!r} to 'cpu' or to a device"
            )


def _check_in_file(
    model: nn.Module,
    found: Catalog,
    disk: list[str],
    keys: tuple[Mapping[str, tuple[str, ...]], Plan | None, Callable[[str], str | None] | None],
    *,
    strict: bool,
) -> list[str]:
    """Refuse, before anything is filled, a ``"disk"`` module whose weights the checkpoint does
    not all hold in their shapes, and with ``strict``, keys under one that fill nothing: it
    would load without a word and fail on its first call, blaming the file for changing or with
    torch's own shape error. The weights are found as its reader finds them: ``keys`` gives the
    model names each file key fills (after ``rename`` and the hub-name conversion), that
    conversion's plan, and the renamer. A weight the file lacks is refused with
    ``strict=False`` too: its module reads every weight from the file. Returns, with
    ``strict=False``, the keys under the disk modules that fill nothing, skipped."""
    filled = keys[0]
    names = {n for targets in filled.values() for n in targets}
    renamed = given(keys[2])
    wanted = _wanted(model, found, disk, names, renamed)
    _check_readable(found, disk, filled, wanted)
    check = _disk_keys(found, disk, keys, names, wanted, _persistent_buffers(model, disk))
    if renamed:
        check.renamed = (len(found.entries), len(filled))
    skipped: list[str] = []
    if not strict:
        skipped, check.unexpected = check.unexpected, []
    if not check.missing and not check.unexpected and not check.mismatched:
        return skipped
    entries = [name for name in disk if any(m.name.startswith(f"{name}.") for m in check.missing)]
    fix = (
        "; a module on 'disk' reads each of its weights from the file when it runs, so it "
        f"cannot do without one: map {' and '.join(map(repr, entries))} to 'cpu' or to a "
        "device, where strict=False leaves what the file lacks as it was (give it values "
        "first where it is still on meta, as in a skeleton)"
        if entries
        else "; pass strict=False to load what matches"
        if not check.mismatched
        else ""
    )
    raise does_not_fit(
        found.where,
        type(model).__name__,
        check,
        check.shape_problems(),
        strict=True,
        fix=fix,
        shapes=None,
        path=found.path,
        tail="; the model is untouched",
    )


def _wanted(
    model: nn.Module, found: Catalog, disk: list[str], names: set[str], renamed: bool
) -> dict[str, tuple[int, ...]]:
    """The ``"disk"`` modules' weights, each with its shape; refused where the file holds no
    tensor under a module (``names``: the model names the file's keys fill, after the rename
    the caller gave, if ``renamed``)."""
    wanted: dict[str, tuple[int, ...]] = {}
    for name in disk:
        head = f"{name}."
        params = {
            f"{name}.{n}": tuple(p.shape) for n, p in model.get_submodule(name).named_parameters()
        }
        wanted.update(params)
        if params and not any(n.startswith(head) for n in names):
            if renamed:
                gives = sorted(names)[:3]
                kept = (
                    f"the names it gives are {', '.join(gives)}{' ...' * (len(names) > 3)}"
                    if names
                    else "it dropped every one"
                )
                raise CheckpointError(
                    f"the device_map puts {display(name)} on 'disk', but after the rename= given "
                    f"none of the keys of {found.where} is under {head!r} ({kept}), so its "
                    "weights could not be read when it runs; fix the rename, or map "
                    f"{name!r} to a device and fill it another way",
                    path=found.path,
                    missing=list(params),
                )
            raise CheckpointError(
                f"the device_map puts {display(name)} on 'disk', but {found.where} holds no tensor "
                f"under {head!r}, so its weights could not be read when it runs; check that "
                "this is the model's checkpoint (rename= maps other names), or map "
                f"{name!r} to a device and fill it another way",
                path=found.path,
                missing=list(params),
            )
    return wanted


def _check_readable(
    found: Catalog,
    disk: list[str],
    filled: Mapping[str, tuple[str, ...]],
    wanted: Mapping[str, tuple[int, ...]],
) -> None:
    """Refuse a ``"disk"`` module whose weights the file cannot give one at a time, from their
    byte ranges (a legacy torch file's, a view with gaps): its reads would fail on each
    call."""
    for key, targets in filled.items():
        entry = found.entries.get(key)
        mine = [t for t in targets if t in wanted]
        if entry is None or entry.addressable or not mine:
            continue
        module = next(name for name in disk if mine[0].startswith(f"{name}."))
        again = (
            "save the checkpoint again with torch.save (its zip format, the default since torch "
            "1.6) or as safetensors, or "
            if "legacy" in entry.why
            else ""
        )
        raise CheckpointError(
            f"the device_map puts {display(module)} on 'disk', but {found.where} cannot give "
            f"its weight {key!r} on its own: {entry.why}; {again}map {module!r} to 'cpu' or "
            "to a device",
            path=found.path,
        )


def _disk_keys(
    found: Catalog,
    disk: list[str],
    keys: tuple[Mapping[str, tuple[str, ...]], Plan | None, Callable[[str], str | None] | None],
    names: set[str],
    wanted: Mapping[str, tuple[int, ...]],
    buffers: frozenset[str] = frozenset(),
) -> KeyCheck:
    """The ``"disk"`` modules' weights (``wanted``: each one's shape) against the file: those it
    lacks (a fused tensor with the keys it lacks), keys under them that fill none, and weights
    held in another shape (a whole key's, or the one a conversion would build). ``names``:
    every model name the file's keys fill."""
    filled, plan, renamer = keys
    lacking = plan.lacking if plan is not None else {}
    built = plan.mismatched if plan is not None else {}
    # the file keys read as pieces of tensors a conversion builds (the plan names them renamed)
    converted = plan.consumed() - set(plan.renames.values()) if plan is not None else set()
    pieces = {k for k in filled if (renamer(k) if renamer is not None else k) in converted}
    missing = [Missing(n, (), lacking.get(n, ())) for n in wanted if n not in names or n in lacking]
    heads = tuple(f"{name}." for name in disk)
    unexpected = []
    mismatched = [Mismatch(n, f"file {built[n]}, model {wanted[n]}") for n in wanted if n in built]
    for key, targets in filled.items():
        if not any(t.startswith(heads) for t in targets):
            continue
        if any(t in buffers for t in targets):  # read into memory (``_disk_buffers``)
            continue
        if not any(t in wanted for t in targets):
            unexpected.append(key)
        elif key not in pieces and (shape := found.entries[key].shape) != wanted[targets[0]]:
            mismatched.append(Mismatch(targets[0], f"file {shape}, model {wanted[targets[0]]}"))
    return KeyCheck([], missing, unexpected, mismatched)


def _tie_groups(model: nn.Module) -> list[list[str]]:
    """The names of each parameter the model holds under several names (a tied embedding and
    head)."""
    names: dict[int, list[str]] = {}
    for full, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(full)
    return [group for group in names.values() if len(group) > 1]


def _check_ties(model: nn.Module, disk: list[str]) -> None:
    """``DeviceSpecError`` for a tied parameter held both by a ``"disk"`` module and by one kept
    in memory (a tie is one tensor, so its holders share one tier: ``plan`` keeps them
    together), or twice inside one ``"disk"`` module (which reads each weight from one key).
    Holders on disk under entries of their own each read the tensor from the file's one key
    (``_tied_keys``)."""
    on_disk = dict.fromkeys(disk)
    for group in _tie_groups(model):
        entries = [entry_of(full, on_disk) for full in group]
        placed = [e for e in entries if e is not None]
        if not placed:
            continue
        on, entry = next((full, e) for full, e in zip(group, entries, strict=True) if e)
        if len(placed) < len(group):
            off = next(full for full, e in zip(group, entries, strict=True) if e is None)
            holder = off.rpartition(".")[0]
            raise DeviceSpecError(
                f"{display(on)} is tied to {display(off)}, and the device_map puts "
                f"{display(entry)} on 'disk' but {display(holder)} in memory: a tied weight is "
                f"one tensor, so its holders share one tier; map {entry!r} to 'cpu' or to a "
                f"device, or {holder!r} to 'disk' too (plan keeps them together)"
            )
        if len(set(placed)) < len(placed):
            other = next(full for full, e in zip(group, entries, strict=True) if e and full != on)
            raise DeviceSpecError(
                f"{display(on)} is tied to {display(other)}, both inside {display(entry)}, "
                "which the device_map puts on 'disk': a module on disk reads each weight of its "
                f"own from a key of its own; map the holders' modules inside {entry!r} to "
                f"'disk' one by one, or map {entry!r} to 'cpu' or to a device"
            )


def _tied_keys(
    model: nn.Module, disk: list[str], names: dict[str, tuple[str, ...]]
) -> dict[str, dict[str, str]]:
    """For each ``"disk"`` entry, the tied weights it holds that the file keeps under another
    holder's key (transformers saves a tied head once, as the embedding): that key -> the
    weight's name. ``names`` (each file key's model names) gains those names, so that the
    entry's reader reads that key for them and the checks find them filled."""
    key_of = {n: key for key, targets in names.items() for n in targets}
    out: dict[str, dict[str, str]] = {}
    on_disk = dict.fromkeys(disk)
    for group in _tie_groups(model):
        held = next((key_of[n] for n in group if n in key_of), None)
        if held is None:
            continue  # the file lacks it under every name: the key check says so
        for full in group:
            entry = entry_of(full, on_disk)
            if full in key_of or entry is None:
                continue
            out.setdefault(entry, {})[held] = full  # one holder per entry: _check_ties
            names[held] = (*names[held], full)
    return out


def _renaming(
    renamer: Callable[[str], str | None] | None, tied: Mapping[str, str]
) -> Callable[[str], str | None] | None:
    """A disk entry's renamer: ``renamer``, but the file keys of ``tied`` (``_tied_keys``) named
    as this entry's tied weights."""
    if not tied:
        return renamer

    def rename(key: str) -> str | None:
        if key in tied:
            return tied[key]
        return renamer(key) if renamer is not None else key

    return rename


def _one_device(entries: Mapping[str, torch.device | str]) -> torch.device | None:
    """The one device every module kept in memory is mapped to, read straight onto (onto CUDA
    through pinned buffers); None when there are several (read into host memory, then placed
    by ``dispatch``)."""
    devices = {where for where in entries.values() if isinstance(where, torch.device)}
    return devices.pop() if len(devices) == 1 else None


def _dtypes(module: nn.Module) -> dict[str, torch.dtype]:
    return {name: p.dtype for name, p in module.named_parameters()}


def _persistent_buffers(model: nn.Module, disk: list[str]) -> frozenset[str]:
    """The names in the model of the ``"disk"`` modules' persistent buffers: registered
    buffers that a state dict keeps (an ``_extra_state`` a module makes is not one)."""
    found: set[str] = set()
    for name in disk:
        for local, _ in model.get_submodule(name).named_buffers(remove_duplicate=False):
            full = f"{name}.{local}" if name else local
            owner_name, _, leaf = full.rpartition(".")
            if leaf not in model.get_submodule(owner_name)._non_persistent_buffers_set:
                found.add(full)
    return frozenset(found)


def _disk_buffers(
    model: nn.Module,
    found: Catalog,
    disk: list[str],
    names: Mapping[str, tuple[str, ...]],
    strict: bool,
    unexpected: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The persistent buffers of the ``"disk"`` modules (by their names in the model) read from
    the file (each on the CPU, in the buffer's dtype), before anything of the model changes.
    Buffers are small and read every call (a running statistic, a router's bias), so they
    live in memory, on the execution device, as every buffer of a dispatched model does; only
    parameters stay in the file. ``names``: each file key's model names (after ``rename`` and
    the hub-name conversion). A buffer the file lacks is missing with ``strict``; without, it
    keeps its value, and one on ``meta`` (a skeleton's) is refused, as it holds none. The
    disk modules' skipped keys (those and ``unexpected``, keys under them that fill nothing)
    are named in one warning, before anything changes."""
    from ..checkpoint._load import read_entries

    key_of = {n: key for key, targets in names.items() for n in targets}
    wanted: dict[str, tuple[str, torch.Tensor]] = {}  # model name -> (file key, buffer)
    lacking: list[str] = []
    skipped: list[str] = []
    shared: dict[int, list[str]] = {}  # one buffer under several names: saved under any one
    for full in sorted(_persistent_buffers(model, disk)):
        shared.setdefault(id(model.get_buffer(full)), []).append(full)
    mismatched: list[str] = []
    for fulls in shared.values():
        buffer = model.get_buffer(fulls[0])
        key = next((key_of[n] for n in fulls if key_of.get(n) in found.entries), None)
        if key is None:
            (lacking if strict or buffer.is_meta else skipped).append(fulls[0])
            continue
        if tuple(found.entries[key].shape) != tuple(buffer.shape):
            mismatched.append(f"{fulls[0]} (file {tuple(found.entries[key].shape)}, model "
                              f"{tuple(buffer.shape)})")  # fmt: skip
            continue
        wanted.update((full, (key, buffer)) for full in fulls)
    if mismatched or lacking:
        raise _buffers_do_not_fit(found, type(model).__name__, mismatched, lacking)
    if skipped or unexpected:  # said before anything changes: where warnings are errors
        warn_skipped(found.where, found.path, skipped, list(unexpected or []))
    if not wanted:
        return {}
    read = read_entries(found, sorted({key for key, _ in wanted.values()}), torch.device("cpu"))
    values: dict[int, torch.Tensor] = {}  # a shared buffer stays one tensor
    return {
        full: values.setdefault(id(buffer), read[key].to(buffer.dtype))
        for full, (key, buffer) in wanted.items()
    }


def _buffers_do_not_fit(
    found: Catalog, model_name: str, mismatched: list[str], lacking: list[str]
) -> CheckpointError:
    """The error for disk modules' buffers the file holds in another shape (``mismatched``,
    each said with its shapes) or lacks (``lacking``)."""
    if mismatched:
        return CheckpointError(
            f"{found.where}: does not fit {model_name}: shape mismatches: {listing(mismatched)} "
            "(buffers of modules mapped to 'disk'); the model is untouched",
            path=found.path,
            mismatched=[m.split(" ")[0] for m in mismatched],
        )
    return CheckpointError(
        f"{found.where}: does not fit {model_name}: missing keys: {listing(lacking)} (buffers "
        "of modules mapped to 'disk', which live in memory and take their values from the "
        "file); load a checkpoint that holds them, or give them values first and pass "
        "strict=False",
        path=found.path,
        missing=lacking,
    )


def _put_buffers(model: nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
    """The disk modules' buffers read by ``_disk_buffers`` given to the model: a buffer on
    ``meta`` (a skeleton's) replaced, a real one written in place (its object kept)."""
    for full, value in buffers.items():
        owner_name, _, local = full.rpartition(".")
        owner = model.get_submodule(owner_name)
        current = owner._buffers[local]
        if current is None or current.is_meta:
            owner._buffers[local] = value
        else:
            with torch.no_grad():
                current.copy_(value)


@contextlib.contextmanager
def _held_out(model: nn.Module, names: list[str]) -> Iterator[None]:
    """``names`` taken out of the model while it is filled, then put back as they were."""
    taken: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for name in names:
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            module = parent._modules[leaf]
            assert module is not None
            parent._modules[leaf] = None
            taken.append((parent, leaf, module))
        yield
    finally:
        for parent, leaf, module in reversed(taken):
            parent._modules[leaf] = module


def _dropping(
    renamer: Callable[[str], str | None] | None,
    disk: list[str],
    filled: Mapping[str, tuple[str, ...]],
) -> Callable[[str], str | None] | None:
    """The fill's renamer: the user's, then the file keys of ``"disk"`` modules dropped: those
    that fill a disk module's weights (``filled``: each key's model names, after the hub-name
    conversion), or are named under one."""
    if not disk:
        return renamer
    heads = tuple(f"{name}." for name in disk)
    theirs = {key for key, names in filled.items() if any(n.startswith(heads) for n in names)}

    def rename(key: str) -> str | None:
        new = renamer(key) if renamer is not None else key
        return None if new is None or key in theirs or new.startswith(heads) else new

    return rename if renamer is not None else not_given(rename)


def _params_to_meta(module: nn.Module, path: str) -> None:
    """A disk module's parameters as ``meta`` (their values stay in the file), objects kept
    where they already were; each marked as the placeholder of the module at ``path``. A real
    parameter's placeholder is recorded as its replacement, as a move records one: an optimizer
    built before the load is re-bound by ``move(model, ..., optimizer=opt)`` once the model is
    gathered, and ``verify``/``stragglers`` name it until then."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and not p.is_meta:
                meta = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                sub._parameters[name] = meta
                record_replacement(p, meta)[0]()
                p = meta
            if p is not None:
                mark_disk_placeholder(p, path)
