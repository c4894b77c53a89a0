"""The disk tier: a module's weights left in the checkpoint they came from, read when needed.

``load_into(model, path, device_map=...)`` fills what lives in memory and gives each module
mapped to ``"disk"`` a ``CheckpointWeights``: the file's keys under the module's name (found
once in the catalog the load resolved its source into, after ``rename``), read straight from
their byte ranges onto the device asked (onto CUDA through the reader's bounded pinned ring),
converted from hub names as ``load_into`` converts them (a fused tensor's file tensors read
straight into its slices, as the plain fill reads them; the conversion worked out on the first
read and kept while the weights keep their dtypes) and cast to the model's dtypes.
Nothing is written anywhere: the file's stamp (the one it had when the model was loaded) is
checked on each read, so a checkpoint rewritten under a running model raises. Each read is a
call of its own: it opens the file.

A model loaded with ``mmap=True`` maps its disk modules' weights too, read on the CPU: where a
weight is one file tensor in the model's dtype, laid out row-major, the read gives a view of
the mapped file (copy-on-write, so nothing writes to it): no copy per call, the page cache
serving the bytes, as transformers' own disk offload maps its files. Any weight that needs a
copy (another dtype, a fused or converted tensor) has the module read by copy instead.
Such a read's weights can hand their pages back early (``page_out``): the offload hooks do
this as each module inside the offloaded one returns, so that a layer's weights are not all
in the resident set at once (transformers' hooks hold one module's at a time).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, SupportsIndex

import torch
from torch import nn

from .._errors import CheckpointError, TorchplaceError
from .._model_walk import display
from ._conversions import Plan, conversion_plan, converted, hub_plan
from ._direct import Direct, direct_reads, read_direct, with_fused
from ._entries import Catalog, Entry, FileChanged
from ._load import Alloc, read_entries
from ._rename import not_a_name
from ._whole_files import MappedViews, map_file

__all__ = ["CheckpointWeights", "model_names"]


def model_names(
    found: Catalog, model: nn.Module, renamer: Callable[[str], str | None] | None
) -> tuple[dict[str, tuple[str, ...]], Plan | None]:
    """Each file key of ``found`` with the names of ``model`` it fills: after ``rename``, and
    converted from hub names as ``load_into`` converts them (a transformers 5 Mixtral's
    ``block_sparse_moe.experts.3.w1.weight`` fills ``mlp.experts.gate_up_proj``); a key that
    ``rename`` drops is left out. What a ``"disk"`` module reads is the keys that fill it.
    Second: the hub-name conversion plan (None: nothing converted); a model tensor it cannot
    build (``lacking``, ``mismatched``) is given as filled by the pieces the file holds of it."""
    renamed: dict[str, str] = {}  # name after rename -> file key
    for key in found.entries:
        name = renamer(key) if renamer is not None else key
        if name is not None and not isinstance(name, str):
            raise not_a_name(found.where, key, name)
        if name is not None:
            renamed[name] = key
    names: dict[str, tuple[str, ...]] = {key: (name,) for name, key in renamed.items()}
    shapes = {
        n: (found.entries[k].shape, found.entries[k].torch_dtype(found.where))
        for n, k in renamed.items()
    }
    try:
        plan = conversion_plan(model, shapes)
    except CheckpointError as exc:
        raise CheckpointError(f"{found.where}: {exc}", path=found.path) from exc
    if plan is None:
        return names, None
    for new, old in plan.renames.items():
        names[renamed[old]] = (new,)
    filled: dict[str, list[str]] = {}
    for fused in plan.fused:
        for piece in fused.pieces:
            filled.setdefault(piece.source, []).append(fused.name)
    for computed in plan.computed:
        for source in computed.sources:
            filled.setdefault(source, []).extend(computed.names)
    for source, target in (*plan.lacking_sources.items(), *plan.mismatched_sources.items()):
        filled.setdefault(source, []).append(target)
    for source, targets in filled.items():
        names[renamed[source]] = tuple(dict.fromkeys(targets))
    return names, plan


class CheckpointWeights:
    """The weights of the module at ``entry`` (their names inside it, with their dtypes), read
    on each ``read`` from the files of ``found``, the catalog ``load_into`` resolved its source
    into; ``names``: the model names each file key fills (``model_names``); ``prefix`` narrows
    them to a submodule's."""

    mapped = False  # read by copy; ``load_into(..., mmap=True)`` maps (see the module docstring)
    takes_buffers = True  # ``read`` reads into the host buffers it is handed (``alloc``)

    def __init__(
        self,
        found: Catalog,
        model: nn.Module,
        entry: str,
        dtypes: dict[str, torch.dtype],
        renamer: Callable[[str], str | None] | None,
        names: dict[str, tuple[str, ...]],
        prefix: str = "",
    ) -> None:
        self.found = found
        self.names = names
        self.where = found.where
        self._model = weakref.ref(model)  # the model holds this reader: no cycle through it
        self.entry = entry
        self.dtypes = {n: d for n, d in dtypes.items() if not prefix or n.startswith(prefix + ".")}
        self.renamer = renamer
        self.prefix = prefix
        self._keys: list[str] | None = None
        self._plan: tuple[Any, Plan | None] | None = None  # (what it was made for, the plan)
        self._direct: tuple[Any, Direct | None] | None = None  # (the dtypes, the reads)
        # The module holding each weight (name, module, leaf), for the model they were found in;
        # held weakly, as the model: the model holds this reader.
        self._holders: _Holders | None = None
        self.nbytes = sum(_numel(model, entry, n) * d.itemsize for n, d in self.dtypes.items())
        # found now, by the module objects of the model as loaded: a module wrapped later (an
        # adapter's layer put in its place, holding it) still holds its weights
        self._current_dtypes(model)

    def __deepcopy__(self, memo: dict[int, Any]) -> CheckpointWeights:
        """A copy for a deep copy of the model: it reads for the copy of the model (found in
        ``memo``, where ``copy.deepcopy`` keeps the model it is copying), else for the model
        this one reads for (a submodule copied alone)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        model = self._model()
        copied = memo.get(id(model)) if model is not None else None
        if isinstance(copied, nn.Module):
            new._model = weakref.ref(copied)
        new.dtypes = dict(self.dtypes)
        return new

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise TorchplaceError(
            f"a model with {display(self.entry)} left on 'disk' (read from {self.where} "
            "when it runs) cannot be pickled or saved whole: gather it first, "
            "torchplace.move(model, 'cpu'), or save the skeleton's class and load_into again "
            "from the same checkpoint"
        )

    def only(self, prefix: str) -> CheckpointWeights:
        model = self._model()
        assert model is not None
        narrowed = CheckpointWeights(
            self.found, model, self.entry, self.dtypes, self.renamer, self.names, prefix
        )
        narrowed.mapped = self.mapped
        return narrowed

    def _file_keys(self) -> list[str]:
        """The file's keys that fill this module's weights (after ``rename`` and the model's
        hub-name conversion), found once."""
        if self._keys is None:
            head = f"{self.entry}.{self.prefix}" if self.prefix else self.entry
            head = head + "." if head else ""
            self._keys = [
                key
                for key, names in self.names.items()
                if any(name.startswith(head) for name in names)
            ]
        return self._keys

    def _current_dtypes(self, model: nn.Module) -> dict[str, torch.dtype]:
        """Each weight's dtype as the model has it now: a model cast after ``load_into`` (its
        ``meta`` parameters cast too) reads its disk weights in the new dtype. The module
        holding each weight is found once per model (``get_parameter`` walked the tree on every
        read: 2.1 ms of a small Mixtral's 8-layer read, 0.2 ms now); the weight is looked up in
        it each time, so a cast that makes new parameters is seen too."""
        holders = self._holders() if self._holders is not None else None
        if holders is None or holders[0] is not model:  # a deep copy reads for its own model
            head = f"{self.entry}." if self.entry else ""
            found = []
            for name in self.dtypes:
                owner, _, leaf = (head + name).rpartition(".")
                found.append((name, model.get_submodule(owner), leaf))
            holders = (model, found)
            self._holders = _Holders(holders)
        return {name: getattr(module, leaf).dtype for name, module, leaf in holders[1]}

    def _conversion(
        self, model: nn.Module, state: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]
    ) -> Plan | None:
        """The hub-name conversion of the weights read (``state``), worked out once and kept
        while they and the module's weights keep their shapes and dtypes (a cast makes it
        again): making it took about 4.5 ms of a small Mixtral layer's 7-8.5 ms read. A plan
        that runs transformers' own code (``Plan.computed``) holds the model, so it is not kept
        (the model holds this reader)."""
        made_for = (
            tuple((k, tuple(v.shape), v.dtype) for k, v in state.items()),
            tuple(dtypes.items()),
        )
        if self._plan is not None and self._plan[0] == made_for:
            return self._plan[1]
        plan = hub_plan(self.where, model, state)
        self._plan = None if plan is not None and plan.computed else (made_for, plan)
        return plan

    def _direct_reads(self, model: nn.Module, dtypes: dict[str, torch.dtype]) -> Direct | None:
        """How this module's fused tensors (a Mixtral layer's experts) are read straight into
        their memory, each file tensor into its slice, rather than read whole and copied in
        (a small Mixtral's 8 disk layers: 49-55 ms that way, 17-22 ms this way). Worked out
        once and kept while the module's weights keep their dtypes; None where nothing fused is
        a box of whole file tensors (then ``_conversion`` converts what is read), and not kept
        where the plan runs transformers' own code (it holds the model)."""
        made_for = tuple(dtypes.items())
        if self._direct is not None and self._direct[0] == made_for:
            return self._direct[1]
        names: dict[str, str] = {}  # the name the plan knows -> the file's key
        for key in self._file_keys():
            new = key if self.renamer is None else self.renamer(key)
            names[new if isinstance(new, str) else key] = key
        try:
            direct = direct_reads(self.found, model, names, self._file_keys())
        except CheckpointError as exc:
            raise CheckpointError(f"{self.where}: {exc}", path=self.found.path) from exc
        computed = direct is not None and direct.rest.computed
        self._direct = None if computed else (made_for, direct)
        return direct

    def read(self, device: torch.device, alloc: Alloc | None = None) -> dict[str, torch.Tensor]:
        """The module's weights by their names in it, read onto ``device`` (on the CPU, into
        what ``alloc`` hands out where it does: the disk tier's reused buffer)."""
        try:
            return self._read(device, alloc)
        except FileChanged as exc:
            file = f" (its file {exc.path})" if exc.path and str(exc.path) != self.where else ""
            raise FileChanged(
                f"{self.where}: the checkpoint that {display(self.entry)} (offloaded to 'disk') "
                f"reads its weights from when it runs has changed since the model was "
                f"loaded{file} ({'; '.join(exc.changes)}); nothing read from it is kept. A "
                "disk-offloaded model needs its checkpoint as it was loaded: load the model "
                "again from it once the writer is done, or gather the model first, "
                "torchplace.move(model, 'cpu'), before rewriting the file",
                path=exc.path,
                changes=exc.changes,
            ) from exc

    def _read(self, device: torch.device, alloc: Alloc | None) -> dict[str, torch.Tensor]:
        model = self._model()
        assert model is not None, "the model this reader belongs to is gone"
        found, keys = self.found, self._file_keys()
        dtypes = self._current_dtypes(model)
        if self.mapped and device.type == "cpu":
            views = self._views(model, dtypes)
            if views is not None:
                return views
        direct = self._direct_reads(model, dtypes)
        # Into memory the previous unit's weights have just given back (its pages resident):
        # faulting them in first took 7.9 ms against 3.0 ms for a 16 MiB layer (bench_offload).
        # On the calling thread: starting the reader's threads for each unit's read cost more
        # than they saved, 16 layers' reads taking 150-200 ms against 53-110 ms read on one
        # thread on the 2-core machine of bench_offload (most of it waiting for them to start).
        if direct is not None:
            state, fused = read_direct(direct, device, None, fresh=False, threads=1, alloc=alloc)
            if self.renamer is not None:
                state = {self.renamer(k) or k: v for k, v in state.items()}
            state = with_fused(self.where, type(model).__name__, direct.rest, state, fused)
        else:
            state = read_entries(found, keys, device, fresh=False, threads=1, alloc=alloc)
            if self.renamer is not None:
                state = {self.renamer(k) or k: v for k, v in state.items()}
            plan = self._conversion(model, state, dtypes)
            if plan is not None:
                state = converted(self.where, type(model).__name__, plan, state, owned=True)
        cut = len(self.entry) + 1 if self.entry else 0
        out = {}
        for name, value in state.items():
            local = name[cut:]
            dtype = dtypes.get(local)
            if dtype is not None:
                out[local] = value if value.dtype == dtype else value.to(dtype)
        missing = sorted(set(self.dtypes) - set(out))
        if missing:
            shown = ", ".join(f"{self.entry}.{n}" for n in missing[:5])
            raise CheckpointError(
                f"{self.where} no longer holds {shown} ({len(missing)} tensor(s) of the "
                "offloaded module); the checkpoint a disk-offloaded model reads must stay as "
                "it was loaded",
                path=self.found.path,
                missing=[f"{self.entry}.{n}" for n in missing],
            )
        return out

    def _views(
        self, model: nn.Module, dtypes: dict[str, torch.dtype]
    ) -> dict[str, torch.Tensor] | None:
        """The weights as views of the mapped file (see the module docstring), or None where
        one needs a copy. The file's stamp is checked first, as every read checks it."""
        if self._direct_reads(model, dtypes) is not None:
            return None
        found = self.found
        state: dict[str, torch.Tensor] = {}
        maps: dict[Path, Any] = {}  # this read's maps, one per file, held by its views alone
        for key in self._file_keys():
            e = found.entries[key]
            if not e.addressable or e.order != tuple(range(len(e.shape))):
                return None
            assert e.file is not None
            found.check_unchanged(e.file)
            name = key if self.renamer is None else (self.renamer(key) or key)
            mapped = maps.get(e.file)
            if mapped is None:  # the views hold it: it goes with them after the call, its
                mapped = maps[e.file] = map_file(e.file)  # pages out of the resident set
            state[name] = _view(mapped, e, found.where)
        if self._conversion(model, state, dtypes) is not None:
            return None
        cut = len(self.entry) + 1 if self.entry else 0
        out = {}
        for name, value in state.items():
            local = name[cut:]
            dtype = dtypes.get(local)
            if dtype is not None and value.dtype != dtype:
                return None
            if dtype is not None and local is not None:
                out[local] = value
        return MappedViews(out, list(maps.values())) if set(out) == set(self.dtypes) else None


def _view(mapped: Any, e: Entry, where: str) -> torch.Tensor:
    """Entry ``e`` as a tensor over ``mapped``, its file's map."""
    dtype = e.torch_dtype(where)
    count = e.nbytes // dtype.itemsize
    if count == 0:
        return torch.empty(e.shape, dtype=dtype)
    flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=e.start)
    return flat.view(e.shape)


class _Holders:
    """A weak hold on ``(model, [(name, module, leaf), ...])``: what the model holds, it keeps
    alive; once the model or one of the modules is gone, called, it returns None."""

    def __init__(self, held: tuple[nn.Module, list[tuple[str, nn.Module, str]]]) -> None:
        self._model = weakref.ref(held[0])
        self._found = [(name, weakref.ref(module), leaf) for name, module, leaf in held[1]]

    def __call__(self) -> tuple[nn.Module, list[tuple[str, nn.Module, str]]] | None:
        model = self._model()
        found = []
        for name, ref, leaf in self._found:
            module = ref()
            if module is None:
                return None
            found.append((name, module, leaf))
        return None if model is None else (model, found)


def _numel(model: nn.Module, entry: str, name: str) -> int:
    full = f"{entry}.{name}" if entry else name
    return model.get_parameter(full).numel()
