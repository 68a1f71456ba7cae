"""The benchmark harness: ``python -m mha.bench COMMAND``: layer, decode,

Times implementations of the same computation side by side, on the CPU or a
CUDA GPU, in interleaved rounds, and reports medians and paired time ratios
with the environment they were measured in: ``layer`` one multi-head
self-attention layer against T, ``decode`` one generated token against the
context, ``variants`` the attention core under an attention variant's mask
(compiled FlexAttention against dense masks), ``model`` a whole model's
generate per attention backend against transformers'. Rooms:
:mod:`~mha.bench.registry` (one entry = one decorated builder), the entries
(:mod:`~mha.bench.implementations`, :mod:`~mha.bench.decode_steps`), the
benchmarks (:mod:`~mha.bench.layer`, :mod:`~mha.bench.decode`,
:mod:`~mha.bench.variants`, :mod:`~mha.bench.model`, whose entries sit
beside them), the one
measurement loop (:mod:`~mha.bench.timing`), :mod:`~mha.bench.memory`,
:mod:`~mha.bench.report`, :mod:`~mha.bench.cli` (the environment of a run:
:mod:`mha.environment`).
CONTRIBUTING.md says how to add an entry or a benchmark.
"""

from __future__ import annotations

from importlib import import_module

from ..environment import *  # noqa: F403
from .cli import *  # noqa: F403
from .decode import *  # noqa: F403
from .implementations import *  # noqa: F403
from .layer import *  # noqa: F403
from .memory import *  # noqa: F403
from .model import *  # noqa: F403
from .registry import *  # noqa: F403
from .report import *  # noqa: F403
from .timing import *  # noqa: F403
from .variants import *  # noqa: F403

#: What the rooms export (their ``__all__``), at ``mha.bench.<name>``.
__all__ = [
    name
    for room in ("cli", "decode", ".environment", "implementations")
    + ("layer", "memory", "model", "registry", "report", "timing")
    + ("variants",)
    for name in import_module(f".{room}", __name__).__all__
]
