"""Looking: where every tensor lives, what is out of place, and what a model will need.

``_inspect`` is the one walk (``where``, ``devices_of``, ``stragglers``, ``verify``); ``_report``
renders it as a table, ``_guard`` checks a module's inputs as it runs, and ``_estimate`` sizes
parameters, gradients and optimizer state before anything is allocated, with the peak of one
step that ``_fake_step`` runs on fake tensors.

May import: ``moving`` (parameter identity and the optimizer-state rules it shares with
``move``), the base modules at the package root, and its own modules; never ``checkpoint``,
``spreading`` or ``cli``.
"""
