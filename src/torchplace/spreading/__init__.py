"""Spreading: one model over several devices.

``_plan`` assigns submodules to devices within memory budgets (read by ``_budgets``, from a
mapping or from the machine), allocating on no device; ``_dispatch``
places each submodule and moves inputs to it as it runs (the marks it leaves are
``moving._hooks``, so that ``move`` can gather the model again). ``torchplace.distributed``, at
the package root, is the public module for many processes and machines.

``_offload`` runs the modules a map offloads (to ``"cpu"`` or ``"disk"``) with their weights
brought in just ahead of use, and ``_load_by_map`` is ``load_into(..., device_map=...)``: a fill
by the map (the checkpoint package's) that leaves ``"disk"`` modules in their file, then
``dispatch``.

May import: ``moving`` (``dispatch`` places each part with ``move``'s machinery),
``checkpoint`` (the fill and the disk tier's reader, for ``load_into`` by a map; so spreading
sits a layer above it), ``looking`` (``estimate``, in ``_budgets``: ``plan(max_memory="auto",
example_input=...)`` keeps a step's activations as headroom), the base modules at the package
root, and its own modules; never ``cli``.
"""
