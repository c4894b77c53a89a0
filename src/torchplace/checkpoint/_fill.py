"""``load_into``: a model filled from a checkpoint, all or nothing."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._devices import DeviceSpec
from .._devices import device as _device
from .._errors import CheckpointError, MoveError, TorchplaceError, user_stacklevel
from .._model_walk import Slot, tensor_slots, unwrapped
from ..moving._identity import parameter_like
from ..moving._move import discarded_warning
from ..moving._own_moves import AttributeSnapshot, run_own_moves
from ._catalog import Catalog, catalog, format_of
from ._conversions import (
    Plan,
    converted,
    hub_plan,
    may_convert,
)
from ._direct import Direct, direct_reads, read_direct, with_fused
from ._formats import first_sentence
from ._keys import (
    Held,
    KeyCheck,
    Missing,
    check_keys,
    does_not_fit,
    matches_nothing,
    no_data_buffers,
)
from ._load import (
    load_state,
    source_bytes,
    warn_unchecked_safetensors,
)
from ._mismatch import (
    Shapes,
    check_state_dict,
    left_on_meta,
    listing,
    target_for,
    warn_left_on_meta,
    warn_skipped,
)
from ._opened import one_open_each
from ._progress import reporting, wanted
from ._rename import Rename, as_renamer, given, guarded, not_given, renamed
from ._skeleton import ModuleT, swap
from ._source import PathLike, resolve
from ._statedict import (
    as_load_state_dict_sees,
    has_post_hooks,
    loads_itself,
    run_post_hooks,
    set_extra_states,
)


def _place(slot: Slot, value: torch.Tensor, undos: list[Callable[[], object]]) -> None:
    """Put ``value`` in the slot, keeping the Parameter object (and so ties and optimizers).

    What puts the slot back is appended to ``undos`` before anything changes, and it checks
    whether the change was made, so an interrupt at any point leaves an undo that is right.
    """
    current = slot.tensor
    if slot.is_param:
        assert isinstance(current, nn.Parameter)
        new = parameter_like(current, value, materialize=True)
        before = current._cdata  # swap_tensors exchanges the tensors' implementations

        def unswap() -> None:
            if current._cdata != before:
                swap(current, new)  # new holds what current held

        undos.append(unswap)
        try:
            swap(current, new)
            return
        except (RuntimeError, TypeError):  # weak references or autograd holds it: rebind
            undos.pop()
            replacement: torch.Tensor = new
    else:
        replacement = value

    def rebind(to: torch.Tensor) -> None:
        for module, name in slot.homes:
            if slot.is_param:
                module._parameters[name] = to  # type: ignore[assignment]
            else:
                module._buffers[name] = to
        slot.tensor = to

    undos.append(functools.partial(rebind, current))
    rebind(replacement)


_MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


def _in_layout_of(model_tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` laid out as ``model_tensor`` is (contiguous, or channels-last), when it is."""
    for memory_format in _MEMORY_FORMATS:
        if model_tensor.is_contiguous(memory_format=memory_format):
            return value.contiguous(memory_format=memory_format)
    return value


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of a file hold the same values (NaN equal to NaN); meta ones match."""
    if a.shape != b.shape:
        return False
    if a.device.type == "meta" or b.device.type == "meta":
        return True  # no data to compare: a load onto meta checks shapes only
    if (a.dtype, a.device, a.stride()) == (b.dtype, b.device, b.stride()) and (
        a.data_ptr() == b.data_ptr()
    ):
        return True  # one tensor saved under both names, as a tied model saves it: not read
    if torch.equal(a, b):
        return True
    return (
        a.dtype == b.dtype
        and (a.is_floating_point() or a.is_complex())
        and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())
    )


class _Spans:
    """The bytes already given to the model's tensors, per device, kept sorted and disjoint.

    A file may hold one storage under several names (tied weights) or overlapping views of it
    (``{"a": big, "b": big[:2]}``); assigned as they are, weights the model keeps apart would
    share memory, and a step on one would change the other. Bytes are compared by address, so
    tensors mapped from one file, each on its own storage, are told apart by their ranges.
    """

    def __init__(self) -> None:
        self.starts: dict[torch.device, list[int]] = {}
        self.ends: dict[torch.device, list[int]] = {}

    def claim(self, t: torch.Tensor) -> bool:
        """Record the bytes ``t`` shows; False (nothing recorded) when another tensor has some."""
        if t.device.type == "meta" or t.numel() == 0:
            return True
        try:
            start = t.data_ptr()
        except (RuntimeError, NotImplementedError):  # no addressable storage: nothing to share
            return True
        extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        end = start + (extent + 1) * t.element_size()
        starts = self.starts.setdefault(t.device, [])
        ends = self.ends.setdefault(t.device, [])
        i = bisect.bisect_right(starts, start)
        if (i > 0 and ends[i - 1] > start) or (i < len(starts) and starts[i] < end):
            return False
        starts.insert(i, start)
        ends.insert(i, end)
        return True


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
    it), checked, and filled in: phase 1 (``_prepare``) then phase 2 (``_apply``)."""
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
    fit = _Fit(
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
    prepared = _prepare(fit, read.target, copy=read.from_memory)
    _warn_skipped_first(fit)  # before phase 2: where warnings are errors, nothing has changed
    return _apply(fit, prepared, extra, seen.own)


def _warn_skipped_first(fit: _Fit) -> None:
    """The one warning of a ``strict=False`` load that skips keys, given before anything of the
    model changes; where the fill will leave tensors on ``meta``, its warning after the fill
    is that one instead (``_warn_after_fill``), naming the skipped keys too."""
    if fit.strict or not (fit.check.missing or fit.check.unexpected):
        return
    planned = {id(slot) for slot, _ in fit.plan}
    if fit.read_on.type != "meta" and any(
        s.tensor.is_meta and id(s) not in planned for s in (*fit.loadable, *fit.transient)
    ):
        return
    path = fit.p if isinstance(fit.p, Path) else None
    warn_skipped(fit.p, path, fit.check.missing_names, list(fit.check.unexpected))


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


def _warn_after_fill(fit: _Fit) -> None:
    """The warnings of a load that went through: values a load onto meta discarded, as ``move``
    gives them, and tensors that a load onto a real device left on meta (a key the file lacks,
    with ``strict=False``), which hold no values and make the model compute garbage.

    Given as the last step of the load, inside its all or nothing: where warnings are errors,
    the model is put back as it was before the error goes on.
    """
    if fit.discarded:
        warnings.warn(
            discarded_warning("load_into", fit.discarded), UserWarning, stacklevel=user_stacklevel()
        )
    path = fit.p if isinstance(fit.p, Path) else None
    missing = [] if fit.strict else fit.check.missing_names
    unexpected = [] if fit.strict else list(fit.check.unexpected)
    left = [s for s in (*fit.loadable, *fit.transient) if s.tensor.is_meta]
    if left and fit.read_on.type != "meta":  # the one warning: it names what was skipped too
        text = left_on_meta(
            fit.model, fit.p, left, fit.strict, fit.target, fit.check.renamed is not None
        )
        if unexpected:
            text += f" It skipped the source's {listing(unexpected)} too (the model takes none)."
        on_meta = [s.names[0] for s in left]
        every = on_meta + [n for n in missing if n not in set(on_meta)]
        warn_left_on_meta(text, path=path, missing=every, unexpected=unexpected)


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


class _Fit:
    """How a state dict fits the model: what goes where, and what is missing or refused.

    Raises ``CheckpointError`` (the model untouched) for a file that does not fit, unless the
    model's post-hooks may yet clear its missing or unexpected keys (``deferred``).
    """

    def __init__(
        self,
        p: Path | str,
        model: nn.Module,
        seen: Any,
        loadable: list[Slot],
        transient: list[Slot],
        extra: Mapping[str, nn.Module],
        read_on: torch.device,
        strict: bool,
        file_shapes: Mapping[str, tuple[int, ...]] | None = None,
        lacking: Mapping[str, tuple[str, ...]] | None = None,
        renamed: tuple[int, int] | None = None,
    ) -> None:
        self.p, self.model, self.strict, self.transient = p, model, strict, transient
        # What key hints weigh: a rename is suggested only where the shapes agree.
        self.shapes: Shapes = (
            file_shapes or {},
            {n: tuple(s.tensor.shape) for s in loadable if not is_lazy(s.tensor) for n in s.names},
        )
        self.read_on, self.loadable = read_on, loadable
        # A load onto meta discards the values of the non-persistent buffers it moves there.
        self.discarded = [
            s.names[0] for s in transient if read_on.type == "meta" and not s.tensor.is_meta
        ]
        self.target: torch.device | None = None  # set by _prepare: where tensors go
        self.loaders = seen.loaders
        own = seen.own
        # A lazy parameter takes the file's shape, as its load_state_dict pre-hook (which
        # load_into does not run: it would materialize before the checks) lets it.
        check = check_keys(
            loadable, own, _held, takes_any_shape=lambda s: is_lazy(s.tensor), lacking=lacking
        )
        check.renamed = renamed  # the keys as the caller's rename= gave them, if it gave one
        self.plan, empty, conflicts = _values(check, own, read_on)
        check.add_missing(k for k in extra if k not in own)
        check.add_missing(seen.missing)  # what pre-hooks reported
        check.unexpected = list(seen.unexpected)
        self.check = check
        # Every name of what stays as it was, for post-hooks.
        self.not_loaded = [n for m in check.missing for n in (m.name, *m.tied)]
        self.unexpected = check.unexpected
        problems = self._problems(seen.errors, empty, conflicts, transient)
        # Keys alone: post-hooks may clear them, as load_state_dict lets them (its strict check
        # comes after its post-hooks). Then the load goes ahead, and is undone if any is left.
        keys = bool(check.missing or check.unexpected)
        self.hooked = has_post_hooks(model)
        self.deferred = strict and keys and not problems and self.hooked
        self.matched = bool(self.plan) or any(k in own for k in extra)  # strict=False loads any
        if (strict and keys and not self.deferred) or problems:
            raise self._does_not_fit(problems)
        if not strict and not self.matched and loadable and not self.hooked:
            raise matches_nothing(p, type(model).__name__, check, self.shapes)

    def _does_not_fit(self, problems: list[str]) -> CheckpointError:
        """The refusal of a file whose keys or values do not fit (the model untouched)."""
        fix = "; pass strict=False to load what matches" if self.matched and not problems else ""
        p = self.p
        return does_not_fit(
            p,
            type(self.model).__name__,
            self.check,
            problems,
            strict=self.strict,
            fix=fix,
            shapes=self.shapes,
            path=p if isinstance(p, Path) else None,
        )

    def _problems(
        self,
        errors: list[str],
        empty: list[str],
        conflicts: list[tuple[str, str]],
        transient: list[Slot],
    ) -> list[str]:
        """What stops the load besides keys: mis-shaped tensors, tied weights saved with two
        values, a module's refusal, values with no data, buffers no checkpoint holds."""
        problems = self.check.shape_problems()
        if conflicts:
            drop = conflicts[0][1]
            problems.append(
                f"tied weights saved with different values: "
                f"{listing([f'{a} and {b}' for a, b in conflicts])} (the file was "
                "saved from a model that keeps them apart; keep the value you want and drop the "
                f"other, e.g. rename=lambda k: None if k == {drop!r} else k)"
            )
        if errors:
            problems.append(f"refused by the model: {listing(errors)}")
        if empty:
            problems.append(
                f"tensors on meta, which hold no values to load: {listing(empty)} (the state "
                "dict came from a model on meta or a skeleton not yet filled; load the weights "
                "from the file they were saved to, or load onto 'meta' to check shapes only)"
            )
        read_on = self.read_on
        no_data = [
            s.names[0]
            for s in transient
            if s.tensor.device.type == "meta" and read_on.type != "meta"
        ]
        if self.strict and no_data:
            problems.append(no_data_buffers(no_data, self.p, str(read_on)))
        return problems


def _held(value: Any) -> Held:
    """What the key check compares of a state dict's value."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.is_complex()
    return type(value).__name__


def _values(
    check: KeyCheck, own: Mapping[str, Any], read_on: torch.device
) -> tuple[list[tuple[Slot, torch.Tensor]], list[str], list[tuple[str, str]]]:
    """The value each matched slot takes, the names whose values hold no data (on meta, bound
    for a real device; found now, before anything is written), and the tied names saved with
    different values."""
    plan: list[tuple[Slot, torch.Tensor]] = []
    empty: list[str] = []
    conflicts: list[tuple[str, str]] = []
    for slot, present in check.matched:
        meta = [n for n in present if own[n].device.type == "meta" and read_on.type != "meta"]
        if meta:
            empty += meta
            continue
        value = own[present[0]]
        # A tied parameter is one tensor: a file that gives its names different values was
        # saved from a model that kept them apart, and either value would be a guess.
        conflicts += [(present[0], n) for n in present[1:] if not _same_values(value, own[n])]
        plan.append((slot, value))
    return plan, empty, conflicts


class _Prepared:
    """Phase 1's result: tensors to fill in place, tensors to swap in, values kept for undo."""

    __slots__ = ("backups", "fills", "places", "writing", "written")

    def __init__(self) -> None:
        self.fills: list[tuple[Slot, torch.Tensor]] = []  # memory on the target: filled
        self.places: list[tuple[Slot, torch.Tensor]] = []  # a new tensor swapped in
        self.backups: list[tuple[torch.Tensor, torch.Tensor]] = []  # filled tensors' values
        self.writing = False  # the fills may have begun: set before the write's call
        self.written = False  # the fills are done: values with no copy kept were overwritten


def _prepare(fit: _Fit, target: torch.device | None, *, copy: bool) -> _Prepared:
    """Phase 1: every transfer and conversion, which may fail for lack of memory or a bad
    device, done before the model changes, so that such a failure leaves it untouched.

    ``copy``: the values are the caller's (a mapping), so the model gets copies of its own.
    """
    out = _Prepared()
    fit.target = target
    spans = _Spans()  # the bytes given to a slot so far
    try:
        for slot, value in fit.plan:
            dev = target_for(slot, target)
            current = slot.tensor
            lazy = is_lazy(current)
            if current.device == dev and dev.type != "meta" and not lazy:
                out.fills.append((slot, value))
                if fit.deferred or not slot.is_param:
                    # Kept to put back: all that is filled when post-hooks may yet undo the
                    # load, and buffers always (a skeleton's are real, and they are small), so
                    # that only a real model's parameters can be left partly filled.
                    out.backups.append((current, current.detach().clone()))
                continue
            placed = value.to(device=dev, dtype=current.dtype, copy=copy)
            if not lazy and placed.stride() != current.stride():
                # The file keeps the layout it was saved in (a transposed view, say); the model
                # keeps its own, as load_state_dict's copy would, so .view() works as before.
                placed = _in_layout_of(current, placed)
            if not spans.claim(placed):
                # The file holds these bytes under another name too (tied in the file, or a
                # view of a bigger tensor): a model that keeps the two apart gets its own copy.
                placed = placed.clone()
                spans.claim(placed)
            out.places.append((slot, placed))
        for slot in fit.transient:
            here = slot.tensor.device
            if target is not None and here.type != "meta" and here != target:
                out.places.append((slot, slot.tensor.to(target)))
    except Exception as exc:
        raise CheckpointError(
            f"{fit.p}: could not be placed into {type(fit.model).__name__} ({type(exc).__name__}"
            f": {first_sentence(str(exc))}); the model is untouched",
            path=fit.p if isinstance(fit.p, Path) else None,
        ) from exc
    return out


def _write_fills(ready: _Prepared) -> None:
    """Every value of ``ready.fills`` copied into its tensor, in one call."""
    targets = [slot.tensor for slot, _ in ready.fills]
    values = [value for _, value in ready.fills]
    if targets:
        with torch.no_grad():
            # One C call: no line of Python runs between two copies.
            torch._foreach_copy_(targets, values)


def _lost_on_undo(fit: _Fit, ready: _Prepared) -> bool:
    """Whether the fills overwrite parameters in place with no copy kept to put back."""
    return not fit.deferred and any(slot.is_param for slot, _ in ready.fills)


def _apply(
    fit: _Fit, ready: _Prepared, extra: Mapping[str, nn.Module], own: Mapping[str, Any]
) -> nn.Module:
    """Phase 2: extra state set, tensors swapped in and filled, post-hooks run, warnings given;
    all or nothing.

    Each step records how to undo it before it is taken (and the undo checks whether it was),
    so an error or a ``KeyboardInterrupt`` at any point puts the model back as it was, except
    values filled in place into a real model's memory with no copy kept: an error in that write
    says the model is partly filled, and an interrupt once it may have begun finishes it, so
    that every weight is loaded. The steps run in a frame of their own, so that wherever an
    interrupt lands in them, it reaches the handler here through a call.
    """
    undos: list[Callable[[], object]] = []

    def put_back() -> str:
        """Undo what phase 2 did, every step tried; what could not be undone ("" if nothing)."""
        restores: list[Callable[[], object]] = [
            functools.partial(torch.Tensor.copy_, t, before) for t, before in ready.backups
        ]
        failures = []
        with torch.no_grad():
            for undo in [*restores, *reversed(undos)]:
                try:
                    undo()
                except Exception as exc:  # a post-hook made a view of a swapped parameter, ...
                    failures.append(f"{type(exc).__name__}: {first_sentence(str(exc))}")
        return failures[0] if failures else ""

    try:
        _apply_steps(fit, ready, extra, own, undos, put_back)
        _own_moves_after(fit, undos, put_back)
        _warn_after_fill(fit)
        return fit.model
    except CheckpointError:  # said what state the model is in, and put it back where it could
        raise
    except BaseException:  # Ctrl-C (or a bug): the model goes back as it was
        if ready.writing and _lost_on_undo(fit, ready):
            # Parameters are (or may be) overwritten in place with no copy kept, so putting
            # the rest back would mix old and new values: every weight stays loaded instead.
            if not ready.written:  # it came as the write began or returned: finish it
                with contextlib.suppress(Exception):  # a write that failed said so already
                    _write_fills(ready)  # a value copied twice is the same value
            raise
        put_back()
        raise


def _apply_steps(
    fit: _Fit,
    ready: _Prepared,
    extra: Mapping[str, nn.Module],
    own: Mapping[str, Any],
    undos: list[Callable[[], object]],
    put_back: Callable[[], str],
) -> None:
    p, model = fit.p, fit.model

    def state_after_put_back() -> str:
        failure = put_back()
        if failure:
            return f"the model could not be put back as it was ({failure}), so build it again"
        return "the model is put back as it was"

    # Extra state first: a module's set_extra_state may refuse what the file holds, and the
    # states already set are put back, so the refusal leaves the model untouched.
    set_extra_states(p, model, extra, own, undos)
    filled = False
    try:
        for slot, value in ready.places:
            _place(slot, value, undos)
        filled = _lost_on_undo(fit, ready)  # said if the write below fails part way
        # Every read and check is done: the in-place writes are one call (copy_ converts the
        # dtype). A real Ctrl-C that comes during the call is raised as it returns, before any
        # line after it, so ``writing`` is set before the call: an interrupt from here on
        # finds it set and the write finished (see _apply), one before it the model put back.
        ready.writing = True
        _write_fills(ready)
        ready.written = True
    except Exception as exc:
        failure = put_back()
        state = "the model is untouched"
        if failure or filled:
            state = "the model is partly filled, so build it again"
        raise CheckpointError(
            f"{p}: could not be placed into {type(model).__name__} ({type(exc).__name__}: "
            f"{first_sentence(str(exc))}); {state}",
            path=p if isinstance(p, Path) else None,
        ) from exc
    left_missing, left_unexpected = list(fit.not_loaded), list(fit.unexpected)
    _run_own_loaders(fit, undos, left_missing, left_unexpected, put_back)
    if fit.strict and not fit.deferred and left_unexpected:  # keys a self-loader did not take
        error = _keys_left(fit, left_missing, left_unexpected, matched=True)
        raise _said_more(error, f"; {state_after_put_back()}")
    if not fit.deferred:
        run_post_hooks(p, model, left_missing, left_unexpected, lambda: "the weights are loaded")
        if fit.strict and (left_missing or left_unexpected):  # a hook added keys: as torch does
            raise _said_more(
                _keys_left(fit, left_missing, left_unexpected, matched=True),
                " (reported by the model's load post-hooks once the weights were loaded, so "
                "they are loaded)",
            )
        return
    run_post_hooks(p, model, left_missing, left_unexpected, state_after_put_back)
    if left_missing or left_unexpected:
        error = _keys_left(fit, left_missing, left_unexpected, matched=fit.matched)
        raise _said_more(error, f"; {state_after_put_back()}")


def _own_moves_after(
    fit: _Fit, undos: list[Callable[[], object]], put_back: Callable[[], str]
) -> None:
    """Once every tensor is in place on one device, the overrides of modules that move state of
    their own run as ``Module.to`` would run them: metric states follow the weights, and
    Lightning's ``.device`` says where they are."""
    model = fit.model
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) != 1:
        return

    def apply(do: Callable[[], None], undo: Callable[[], None]) -> None:
        undos.append(undo)
        do()

    try:
        run_own_moves([("", model)], next(iter(devices)), apply)
    except MoveError as exc:
        failure = put_back()
        state = (
            "the model is put back as it was"
            if not failure
            else (f"the model could not be put back as it was ({failure}), so build it again")
        )
        raise CheckpointError(
            f"{fit.p}: the weights fit, but {exc}; {state}",
            path=fit.p if isinstance(fit.p, Path) else None,
        ) from exc


def _run_own_loaders(
    fit: _Fit,
    undos: list[Callable[[], object]],
    missing: list[str],
    unexpected: list[str],
    put_back: Callable[[], str],
) -> None:
    """Run the ``_load_from_state_dict`` of each module that loads itself, as ``load_state_dict``
    would, now that its parameters and buffers hold memory: it is handed its own keys (a
    metric's states, a weight it converts on load) and does what it does with them. Its
    attributes and its own tensors' values are saved first, so that a failure puts them back."""
    with torch.no_grad():
        for module, prefix, metadata, handed in fit.loaders:
            saved = AttributeSnapshot([module])
            tensors = [
                (t, t.detach().clone())
                for t in [*module._parameters.values(), *module._buffers.values()]
                if t is not None and t.device.type != "meta"
            ]
            undos.append(saved.restore)
            undos.extend(functools.partial(torch.Tensor.copy_, t, before) for t, before in tensors)
            reported: list[str] = []
            errors: list[str] = []
            try:
                module._load_from_state_dict(
                    dict(handed), prefix, metadata, True, reported, unexpected, errors
                )
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {first_sentence(str(exc))}")
            where = prefix[:-1] or type(fit.model).__name__
            if errors:
                failure = put_back()
                state = (
                    "the model is put back as it was"
                    if not failure
                    else (
                        f"the model could not be put back as it was ({failure}), so build it again"
                    )
                )
                raise CheckpointError(
                    f"{fit.p}: {where} ({type(module).__name__}) loads itself "
                    f"(_load_from_state_dict) and refused the file: {listing(errors)}; {state}",
                    path=fit.p if isinstance(fit.p, Path) else None,
                )
            missing += [k for k in reported if k not in missing and k not in fit.not_loaded]


def _keys_left(
    fit: _Fit, missing: list[str], unexpected: list[str], *, matched: bool
) -> CheckpointError:
    """The error for the keys left once the weights are in place (a module that loads itself
    took some, a post-hook added some); ``matched``: ``strict=False`` would load something."""
    return does_not_fit(
        fit.p,
        type(fit.model).__name__,
        fit.check,
        [],
        strict=fit.strict,
        fix="; pass strict=False to load what matches" if matched else "",
        shapes=fit.shapes,
        missing=[Missing(name) for name in missing],
        unexpected=unexpected,
        path=fit.p if isinstance(fit.p, Path) else None,
    )


def _said_more(error: CheckpointError, more: str) -> CheckpointError:
    """``error`` with ``more`` said after its message, its data kept."""
    return CheckpointError(
        f"{error}{more}",
        path=error.path,
        missing=error.missing,
        unexpected=error.unexpected,
        mismatched=error.mismatched,
    )
