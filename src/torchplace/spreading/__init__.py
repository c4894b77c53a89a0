"""Spreading: one model over several devices.

``_plan`` assigns submodules to devices within memory budgets (read by ``_budgets``, from a
mapping or from the machine), allocating on no device; ``_dispatch``
places each submodule and moves inputs to it as it runs (the marks it leaves are
``moving._hooks``, so that ``move`` can gather the model again). ``torchplace.distributed``, at
the package root, is the public module for many processes and machines.

May import: ``moving`` (``dispatch`` places each part with ``move``'s machinery), the base
modules at the package root, and its own modules; from ``looking`` only ``estimate``, in
``_budgets`` (``plan(max_memory="auto", example_input=...)`` keeps a step's activations as
headroom); never ``checkpoint`` or ``cli``.
"""
