"""Checkpoints: reading, writing and filling models from files, indexes, directories and mappings.

``_checkpoint`` holds the public ``load``, ``load_into`` and ``skeleton``. A source is told apart
and parsed by ``_formats``, ``_safetensors``, ``_index``, ``_pickle_reader`` and ``_statedict``;
``_read`` and ``_readinto`` read tensors' bytes; ``_fill`` fills a model (``_rename`` fits the
names, ``_conversions`` converts a transformers model's hub names as ``from_pretrained`` does,
``_skeleton`` builds one on ``meta``), and ``_sharded`` fills DTensor shards.
``_checkpoint_cli`` is the ``inspect`` and ``remap`` commands (``_hub_names``: its note on
per-expert hub names).

May import: ``moving`` (pinned staging, parameter identity), the base modules at the package
root, and its own modules; never ``looking``, ``spreading`` or ``cli``. Importing this package
imports no torch (``torchplace inspect FILE.safetensors`` starts without it).
"""
