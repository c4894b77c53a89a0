"""``load_into``: a model filled from a checkpoint, all or nothing."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._devices import DeviceSpec
from .._devices import device as _device
from .._errors import CheckpointError, TorchplaceError
from .._model_walk import Slot, tensor_slots, unwrapped
from ._apply import Fit, apply_fit, prepare_fit, warn_skipped_first
from ._catalog import catalog, format_of
from ._conversions import (
    Plan,
    converted,
    hub_plan,
    may_convert,
)
from ._direct import Direct, direct_reads, read_direct, with_fused
from ._entries import Catalog
from ._load import (
    load_state,
    source_bytes,
    warn_unchecked_safetensors,
)
from ._mismatch import (
    check_state_dict,
    target_for,
)
from ._opened import one_open_each
from ._progress import reporting, wanted
from ._rename import Rename, as_renamer, given, guarded, not_given, renamed
from ._skeleton import ModuleT
from ._source import PathLike, resolve
from ._statedict import (
    as_load_state_dict_sees,
    loads_itself,
)


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
) -> ModuleT:
    """Fill ``model`` (a skeleton or a real model) from a checkpoint, weights on ``device``.

    >>> import os, tempfile, torch
    >>> from torchplace import load_into, skeleton
    >>> path = os.path.join(tempfile.mkdtemp(), "linear.pt")
    >>> torch.save(torch.nn.Linear(3, 2).state_dict(), path)
    >>> model = load_into(skeleton(torch.nn.Linear, 3, 2), path)
    >>> model.weight.device, model.weight.requires_grad
    (device(type='cpu'), True)

    ``source`` is a path (a file, a shard index, or a directory as ``save_pretrained`` writes
    it, as for ``load``) or a mapping of names to tensors (a state dict, a Lightning
    checkpoint's ``["state_dict"]``), whose tensors the model gets its own copy of. ``rename``
    fits another program's names to the model's before anything is checked: a callable
    ``str -> str | None`` (None drops the key) or a dict of regular expressions to replacements
    applied in order (``{r"^module\\.": ""}`` for a file saved from DDP, ``{r"^model\\.": ""}``
    for a Lightning module's; a replacement of None drops the keys its pattern matches). A model
    wrapped by ``torch.compile``, Fabric's ``setup``, DDP or DataParallel is filled through the
    model inside it, from a file saved from either, and the wrapper is returned.

    ``device`` defaults to where each tensor already is, or the CPU for a skeleton's ``meta``
    parameters. A file's bytes are read straight into the memory the model keeps (onto a GPU,
    through pinned buffers), so the file may be rewritten at once. ``check_crc`` and
    ``progress`` are as for ``load`` (CRC-32 checks go into host memory only, not onto a GPU or
    into DTensors). ``mmap=True`` assigns pages of the memory-mapped file instead (zero-copy,
    copy-on-write): **rewriting or truncating the file while the model lives crashes the
    process** (SIGBUS), so use it only for files nothing writes to. A parameter that already
    holds memory on the target is filled in place. Parameter objects are kept, with their class
    and attributes, so tied weights stay tied and optimizers stay valid; a tied parameter saved
    under any one of its names counts as present (under two names with different values, it
    raises). Weights the model keeps apart never share memory, even where the file holds them
    in one storage. The model's dtypes and memory layouts are kept (the file's are converted).

    As ``load_state_dict`` does, each module's load pre-hooks run on its part of the file, older
    BatchNorm files without ``num_batches_tracked`` load, lazy modules take the file's shapes,
    and load post-hooks run once the weights are in place and may clear missing or unexpected
    keys before the strict check (the load then goes ahead, keeping a copy of the weights it
    fills in place, and is undone if a key is left). A module that overrides
    ``_load_from_state_dict`` (beyond PyTorch's norm layers and the ``FrozenBatchNorm2d`` of
    torchvision and Hugging Face) is refused before anything changes, and so is extra state
    that ``set_extra_state`` refuses. With ``strict``, missing and unexpected keys and shape
    mismatches raise ``CheckpointError`` naming them, the model untouched; without it, keys that
    do not match are skipped (a shape mismatch still raises, and so does a file of which no key
    matches, unless the model has load post-hooks).

    All or nothing: a failure or a ``KeyboardInterrupt`` while a model's tensors are swapped in
    puts every parameter and buffer back as it was. Values filled in place into a real model's
    memory are put back only where a post-hook's check kept a copy; otherwise the error says the
    model is partly filled.
    """
    if not isinstance(model, nn.Module):
        raise TorchplaceError(
            f"load_into() fills an nn.Module, not {type(model).__name__}; build the model "
            "first, e.g. torchplace.load_into(torchplace.skeleton(MyModel, ...), checkpoint)"
        )
    _check_source(source)
    with one_open_each():  # each file opened once in this call, until it is read
        handed = _handed_on(model, source, device, rename, mmap, strict, check_crc, progress)
        if handed is not None:
            return handed  # type: ignore[return-value]
        read = _read_source(model, source, device, rename, mmap, check_crc, progress)
    # The files are read and closed: what follows changes the model, with no line of the
    # read's scope left to run after it.
    return _fit_and_fill(model, read, strict=strict)  # type: ignore[return-value]


def _handed_on(
    model: nn.Module,
    source: PathLike | Mapping[str, Any],
    device: DeviceSpec,
    rename: Rename | None,
    mmap: bool,
    strict: bool,
    check_crc: bool | None,
    progress: bool | None,
) -> nn.Module | None:
    """The model filled elsewhere, or None where ``load_into`` fills it itself: a wrapped model
    (``torch.compile``, Fabric, DDP: the file holds the names of the model inside) through the
    model inside, a model with DTensors (FSDP2, tensor parallelism) by ``load_sharded``, each
    rank reading its own slices."""
    inner, prefix = unwrapped(model)
    if inner is not model:
        load_into(
            inner,
            source,
            device,
            strict=strict,
            mmap=mmap,
            rename=_without_prefix(prefix, rename),
            check_crc=check_crc,
            progress=progress,
        )
        return model
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor can exist: skip the import
        return None
    from ._sharded import has_dtensors, load_sharded

    if not has_dtensors(model):
        return None
    return load_sharded(
        model, source, device, strict=strict, rename=rename, check_crc=check_crc, progress=progress
    )


@dataclasses.dataclass
class _Read:
    """A source read for ``load_into``, nothing of the model changed yet: what messages call it
    (a directory's model file, not its directory), the state (by the file's names), the fused
    tensors read straight into their memory (by the model's), the rest of the conversion plan
    (None where none was read straight), the model's slots, the target and the device read
    onto, the renamer, and whether the source was a mapping in memory."""

    p: Path | str
    state: Any
    assembled: dict[str, torch.Tensor]
    rest: Plan | None
    slots: Any
    target: torch.device | None
    read_on: torch.device
    renamer: Callable[[str], str | None] | None
    from_memory: bool
    given_rename: bool  # the caller gave rename= (not only a wrapper's prefix taken off)
    dropped: int = 0  # the file's keys not read, as the renamer drops them (not in state)


def _read_source(
    model: nn.Module,
    source: PathLike | Mapping[str, Any],
    device: DeviceSpec,
    rename: Rename | None,
    mmap: bool,
    check_crc: bool | None,
    progress: bool | None,
) -> _Read:
    """``load_into``'s source read (a file) or taken as it is (a mapping) for ``model``."""
    target = None if device is None else _device(device)
    renamer = None if rename is None else as_renamer(rename)
    given_rename = given(rename)
    from_memory = isinstance(source, Mapping)
    # A directory's model file: messages name the file read, not its directory.
    p: Path | str = "the state dict given to load_into" if from_memory else resolve(source)
    if renamer is not None:  # its own failure on a key is an error naming the source and key
        renamer = guarded(p, renamer)
    slots = tensor_slots(model)
    read_on = _read_on(slots.loadable, target)
    assembled: dict[str, torch.Tensor] = {}  # fused tensors read straight into their memory
    rest: Plan | None = None  # the conversions left to apply once the file is read
    if isinstance(source, Mapping):
        state: Any = source
        dropped = 0
    else:
        assert isinstance(p, Path)
        state, assembled, rest, dropped = _read_file(
            p,
            model,
            slots.loadable,
            read_on,
            renamer,
            mmap=mmap,
            check_crc=check_crc,
            progress=progress,
        )
    return _Read(
        p,
        state,
        assembled,
        rest,
        slots,
        target,
        read_on,
        renamer,
        from_memory,
        given_rename,
        dropped,
    )


def _read_file(
    p: Path,
    model: nn.Module,
    loadable: list[Slot],
    read_on: torch.device,
    renamer: Callable[[str], str | None] | None,
    *,
    mmap: bool,
    check_crc: bool | None,
    progress: bool | None,
) -> tuple[Any, dict[str, torch.Tensor], Plan | None, int]:
    """The file's tensors read onto ``read_on``: the state (by the file's names), the fused
    tensors read straight into their memory (by the model's), the rest of the conversion plan
    to apply to the state (None where there is no plan read straight), and how many of the
    file's keys were not read, as ``renamer`` drops them."""
    # Tensors of another floating dtype than the model's are converted as they are read.
    wish = _dtype_wish(model, loadable, renamer)
    kind = format_of(p)
    if check_crc:
        warn_unchecked_safetensors(p, kind, None)
    direct = _direct_plan(p, model, renamer, read_on, mmap=mmap, kind=kind)
    total = _bytes_to_read(p, kind, renamer) if wanted(progress) else 0
    with reporting(total, f"load_into {p.name}", progress):
        if direct is None:
            # a key the rename drops (a load by map's disk modules' among them) is not read
            refused: set[str] = set()

            def kept(key: str) -> bool:
                assert renamer is not None
                if renamer(key) is not None:
                    return True
                refused.add(key)
                return False

            state = load_state(
                p,
                read_on,
                mmap=mmap,
                dtype_of=wish,
                check_crc=check_crc,
                kind=kind,
                wanted=None if renamer is None else kept,
            )
            held = state.keys() if isinstance(state, Mapping) else ()
            return state, {}, None, len(refused.difference(held))
        state, assembled = read_direct(direct, read_on, wish)
        dropped = 0 if renamer is None else sum(renamer(k) is None for k in catalog(p).entries)
        return state, assembled, direct.rest, dropped


def _fit_and_fill(model: nn.Module, read: _Read, *, strict: bool) -> nn.Module:
    """The state read fitted to the model (renamed, converted, as ``load_state_dict`` would see
    it), checked, and filled in: phase 1 (``prepare_fit``) then phase 2 (``apply_fit``)."""
    p, state, renamer, slots = read.p, read.state, read.renamer, read.slots
    loadable, transient, extra = slots.loadable, slots.transient, slots.extra_state
    check_state_dict(p, model, state, loadable)
    held = len(state) + read.dropped  # the keys the file holds, those not read among them
    if renamer is not None:
        state = renamed(p, state, renamer)
    # what messages say of a rename the caller gave: the keys it had, and those it kept
    counts = (held, len(state)) if read.given_rename else None
    plan = read.rest
    if plan is not None:
        # The fused tensors were read straight into their slices; what is left of the plan
        # (renames, computed tensors, fused ones that are not boxes of whole entries) applies
        # to the tensors read whole, as below.
        state = with_fused(str(p), type(model).__name__, plan, state, read.assembled)
    else:
        # A transformers model's hub names (per-expert tensors, renamed keys) become its own,
        # as from_pretrained converts them; the read state is changed in place, each tensor let
        # go as soon as its fused tensor holds it.
        owned = not read.from_memory or renamer is not None
        plan = hub_plan(p, model, state)
        if plan is not None:
            state = converted(p, type(model).__name__, plan, state, owned=owned)
    # What each module would be given by load_state_dict: older norm layers upgraded, every
    # pre-hook run (a layout converted, a key renamed), so values and shapes match its result.
    seen = as_load_state_dict_sees(p, model, state, extra)
    file_shapes = {
        k: tuple(v.shape)
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and not is_lazy(v)
    }
    lacking = plan.lacking if plan is not None else None
    fit = Fit(
        p,
        model,
        seen,
        loadable,
        transient,
        extra,
        read.read_on,
        strict,
        file_shapes,
        lacking,
        renamed=counts,
    )
    prepared = prepare_fit(fit, read.target, copy=read.from_memory)
    warn_skipped_first(fit)  # before phase 2: where warnings are errors, nothing has changed
    return apply_fit(fit, prepared, extra, seen.own)


def _without_prefix(prefix: str, rename: Rename | None) -> Rename:
    """``rename``, then a wrapper's ``prefix`` taken off the names that carry it: a file saved
    from the wrapper (``compiled.state_dict()``: ``_orig_mod.*``) and one saved from the model
    inside it both fill that model."""
    first = None if rename is None else as_renamer(rename)

    def renamer(key: str) -> str | None:
        name = key if first is None else first(key)
        return None if name is None else name.removeprefix(prefix)

    return renamer if first is not None else not_given(renamer)


def _check_source(source: object) -> None:
    """A ``CheckpointError`` for a source ``load_into`` cannot read, saying what it reads."""
    if isinstance(source, nn.Module):
        raise CheckpointError(
            f"load_into fills a model from a checkpoint (a path, a directory or a state dict), "
            f"not from a {type(source).__name__} model; pass its weights: "
            "torchplace.load_into(model, other.state_dict())"
        )
    if isinstance(source, (str, bytes, os.PathLike, Mapping)):
        return
    if hasattr(source, "read"):  # an open file, io.BytesIO
        what = f"an open file ({type(source).__name__})"
        fix = (
            "torchplace reads files by path, so pass the file's path, or read it first and "
            "pass the state dict, torchplace.load_into(model, torch.load(f, weights_only=True))"
        )
    else:
        shown = repr(source)
        what = f"{type(source).__name__} ({shown if len(shown) <= 40 else shown[:37] + '...'})"
        fix = (
            "e.g. torchplace.load_into(model, 'model.safetensors') or "
            "torchplace.load_into(model, other.state_dict())"
        )
    raise CheckpointError(
        f"load_into reads weights from a path or a mapping, not {what}: a path (a str or "
        "os.PathLike) to a checkpoint file (.safetensors, .pt, .pth, .bin, .ckpt), to a shard "
        "index (*.index.json) or to a directory as save_pretrained writes it, or a mapping of "
        f"names to tensors (a state dict); {fix}"
    )


def _direct_plan(
    p: Path,
    model: nn.Module,
    renamer: Callable[[str], str | None] | None,
    read_on: torch.device,
    *,
    mmap: bool,
    kind: str,
) -> Direct | None:
    """How to read ``p`` so that each fused model tensor is allocated once, in the model's dtype,
    and its file tensors read straight into their slices of it; None where the plain read and
    the conversion after it do (no conversion plan, nothing fused that is a box of whole entries, a
    file that is not safetensors, a read mapped or onto ``meta``).

    The plan is made from the catalog's names (renamed first), shapes and dtypes, before
    anything is read. A fused tensor goes straight when every piece is a whole entry at one box
    of it (stacked, concatenated; not a chunk of an entry, not transposed) and its entries feed
    nothing else; the others stay in the rest of the plan.
    """
    if mmap or read_on.type not in ("cpu", "cuda") or sys.byteorder != "little":
        return None
    if kind not in ("safetensors", "index") or not may_convert(model):
        return None  # nothing to read straight into fused tensors: no catalog built for it
    found = catalog(p)
    files = {e.file for e in found.entries.values()}
    if not all(found.kinds.get(f, found.kind) == "safetensors" for f in files if f is not None):
        return None  # torch files keep non-tensor values and shared storages: read as saved
    names = _plan_names(found, renamer)
    if names is None:
        return None  # two keys renamed to one name: renamed() raises, naming both
    # the keys a rename drops (a load by map's disk modules') are not read, as by load_state:
    # those it keeps are the file keys ``names`` holds
    try:
        return direct_reads(found, model, names, list(names.values()))
    except CheckpointError as exc:
        raise CheckpointError(f"{p}: {exc}", path=p) from exc


def _bytes_to_read(p: Path, kind: str, renamer: Callable[[str], str | None] | None) -> int:
    """What a progress bar counts to: the source's bytes, less a safetensors source's entries
    that the renamer drops (they are not read: a load by map's disk modules)."""
    if renamer is None or kind not in ("safetensors", "index"):
        return source_bytes(p, kind)
    found = catalog(p)
    if any(k != "safetensors" for f, k in found.kinds.items() if f != p):
        return source_bytes(p, kind)  # a torch shard is read whole
    return sum(e.nbytes for key, e in found.entries.items() if renamer(key) is not None)


def _plan_names(
    found: Catalog, renamer: Callable[[str], str | None] | None
) -> dict[str, str] | None:
    """The name the plan knows (renamed) -> the file's name, for each entry the renamer keeps;
    None where two keys are renamed to one name."""
    names: dict[str, str] = {}
    for key in found.entries:
        new = key if renamer is None else renamer(key)
        if not isinstance(new, str):
            continue  # dropped (renamed() raises for what is neither str nor None)
        if new in names:
            return None
        names[new] = key
    return names


def _dtype_wish(
    model: nn.Module, loadable: list[Slot], renamer: Callable[[str], str | None] | None
) -> Callable[[str], torch.dtype | None] | None:
    """The model's floating dtype for a file's tensor, by the file's name, where converting it
    while it is read changes nothing ``load_state_dict`` would show: None (read as saved) when a
    module has load pre-hooks or loads itself (they see the file's values as saved), and no
    dtype for a tied parameter (its names' values are compared) or a lazy one."""
    for module in model.modules():
        if module._load_state_dict_pre_hooks or loads_itself(module):
            return None
    dtypes = {
        slot.names[0]: slot.tensor.dtype
        for slot in loadable
        if len(slot.names) == 1 and slot.tensor.dtype.is_floating_point and not is_lazy(slot.tensor)
    }
    if not dtypes:
        return None

    def dtype_of(name: str) -> torch.dtype | None:
        fitted = renamer(name) if renamer is not None else name
        return None if fitted is None else dtypes.get(fitted)

    return dtype_of


def _read_on(loadable: list[Slot], target: torch.device | None) -> torch.device:
    """Where a file is read to: the one device every tensor goes to, unless that means a copy.

    Onto ``meta`` nothing is read. Onto a CUDA device that no tensor of the model is on yet (a
    skeleton), the bytes go through pinned buffers straight there. Otherwise the file is read
    into host memory, and tensors are filled or moved from it.
    """
    devices = {target} if target is not None else {target_for(s, None) for s in loadable}
    if len(devices) != 1:
        return torch.device("cpu")
    (dev,) = devices
    if dev.type == "meta":
        return dev
    if dev.type == "cuda" and not any(s.tensor.device == dev for s in loadable):
        return dev
    return torch.device("cpu")
