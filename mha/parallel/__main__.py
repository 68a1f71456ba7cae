"""``python -m mha.parallel --nproc 2 --check``: :mod:`mha.parallel.cli`."""

import sys

from .cli import main

sys.exit(main())
