"""Serving many requests: continuous batching over a paged key/value pool.

One idea per module, floors bottom up: :mod:`.sequence` (a request),
:mod:`.scheduler` (waiting and running queues, chunked prefill,
preemption), :mod:`.batch` (a step's tokens, their slots and groups),
:mod:`.layer` (one layer's pools, read through the step's block tables)
and :mod:`.engine` (:class:`Engine`: requests in, one forward per step,
tokens out). The kernel that reads
the blocks where they are is :func:`mha.kernels.triton_paged_attention`;
``serving`` imports ``kernels``, never the other way. The block allocator
(reference counts, chained hashes of full blocks, the free list, the
prefix cache) is :mod:`mha.blocks`, a floor below: the model's
:class:`mha.PagedKVCache` takes its blocks from the same allocator.
"""

from __future__ import annotations

from .engine import Engine, EngineStats, StepOutput
from .scheduler import Scheduler
from .sequence import Sequence, Status

__all__ = [
    "Engine",
    "StepOutput",
    "EngineStats",
    "Scheduler",
    "Sequence",
    "Status",
]
