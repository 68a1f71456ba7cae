"""Serving many requests: continuous batching over a paged key/value pool.

One idea per module, floors bottom up: :mod:`.sequence` (a request),
:mod:`.blocks` (the block allocator: reference counts, chained hashes of
full blocks, the free list, the prefix cache), :mod:`.scheduler` (waiting
and running queues, chunked prefill, preemption), :mod:`.batch` (a step's
tokens as each attention layer reads them through the block tables) and
:mod:`.engine` (:class:`Engine`: requests in, one forward per step, tokens
out). The kernel that reads the blocks where they are is
:func:`mha.kernels.triton_paged_attention`; ``serving`` imports
``kernels``, never the other way.
"""

from __future__ import annotations

from .blocks import BlockAllocator, OutOfBlocks, block_hashes, chain_hash
from .engine import Engine, EngineStats
from .scheduler import Scheduler
from .sequence import Sequence, Status

__all__ = [
    "BlockAllocator",
    "OutOfBlocks",
    "block_hashes",
    "chain_hash",
    "Engine",
    "EngineStats",
    "Scheduler",
    "Sequence",
    "Status",
]
