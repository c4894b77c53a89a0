"""``python -m torchplace``: the same command line as ``torchplace``."""

import sys

from .cli import main

sys.exit(main())
