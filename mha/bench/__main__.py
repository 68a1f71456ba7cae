"""``python -m mha.bench``: see :mod:`mha.bench.cli`."""

import sys

from .cli import main

sys.exit(main())
