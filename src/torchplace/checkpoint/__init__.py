"""Checkpoints: reading, writing and filling models from files, indexes, directories and mappings.

``_checkpoint`` holds the public ``load``, ``load_into`` and ``skeleton``. The modules follow the
path a checkpoint takes: ``_source`` says what a path names (a directory's model file, a file's
format, an index's shards); ``_catalog`` resolves the source once into a table of entries (name,
file, byte range, dtype, shape, layout) that every reader starts from; ``_safetensors``,
``_index`` and ``_pickle_reader`` parse and check each format for it, and ``_formats`` says what
torch's errors mean about a file;
``_reader`` reads byte ranges into tensors, the file's stamp checked (``_host_read``: threads
and dtype conversion a chunk at a time, CRC-32s checked; ``_cuda_read``: the pinned pool onto
CUDA; ``_read_threads``: the threads), ``_zip_read`` a torch zip file by its layout,
``_whole_files`` what other libraries read whole (``torch.load``, safetensors), ``_load`` is
``load``; ``_fill`` fills a model (``_statedict`` does what ``load_state_dict`` does around it,
``_rename`` fits the names, ``_conversions`` converts a transformers model's hub names as
``from_pretrained`` does, ``_skeleton`` builds one on ``meta``), ``_sharded`` fills DTensor
shards; ``_progress`` is the bar a long load shows, ``_crc`` joins CRC-32s, and
``_checkpoint_cli`` is the ``inspect`` and ``remap`` commands (``_hub_names``: its note on
per-expert hub names). Writing goes the other way: ``_save`` is ``save`` (``_save_items``: what
a model's tensors are saved as, ``_writers``: a tensor at a time into a safetensors or torch
file, ``_atomic``: in place of the old checkpoint only once complete, ``_save_collective``: a
DTensor model's gathers on every rank), and ``_convert_cli`` is the ``convert`` command
(``_run_command``: how ``convert`` and ``remap`` end, their exit status).

May import: ``moving`` (pinned staging, parameter identity), the base modules at the package
root, and its own modules; never ``looking``, ``spreading`` or ``cli``. Importing this package
imports no torch (``torchplace inspect FILE.safetensors`` starts without it).
"""
