"""Moving: tensors, models, optimizer state and batches from one device to another.

``move`` (``_move``) is the entry point. ``_transfer`` is the one copy engine for ``move`` and
``DeviceLoader`` (``_loader``); ``_staging`` packs host tensors into pinned memory and
``_consolidate`` sends many small tensors as one copy (each result owning its storage;
with ``views=True`` a batch's land as views of bounded shared buffers). ``_identity`` keeps
parameters the same objects (the undo log, swaps, re-binding optimizers), ``_optim_state`` says
where each piece of optimizer state belongs, and ``_hooks`` is what ``dispatch`` leaves on a
model, which a move removes.

``release_pinned_memory()`` gives back the pinned staging memory that moves and loads keep
between calls (``_staging``'s pool).

May import: the base modules at the package root (``_devices``, ``_errors``, ``_tree``,
``_model_walk``, ``_own_moves``, ``_sizes``, ``_tensor_size``) and its own modules. Nothing
here imports ``looking``, ``checkpoint``, ``spreading`` or ``cli``.
"""

from ._staging import release_pinned_memory

__all__ = ["release_pinned_memory"]
