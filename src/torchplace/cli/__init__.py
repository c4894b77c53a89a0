"""The ``torchplace`` command: ``doctor`` (``_doctor``), ``bench`` (``_bench``), and the argument
parsing that imports only the module of the command being run (``_main``). ``inspect`` and
``remap`` live beside the checkpoint code, in ``checkpoint._checkpoint_cli``.

May import: every subpackage and the base. Importing this package imports no torch.
"""

from ._main import main

__all__ = ["main"]
