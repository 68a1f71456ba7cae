"""Serving many requests: continuous batching over a paged key/value pool.

One idea per module, floors bottom up: :mod:`.sequence` (a request),
:mod:`.allocator` (the pool's blocks: reference counts, chained hashes,
least-recently-freed reuse), :mod:`.scheduler` (waiting and running queues,
chunked prefill, preemption), :mod:`.batch` (a step's tokens as each
attention layer reads them through the block tables) and :mod:`.engine`
(:class:`Engine`: requests in, one forward per step, tokens out).
"""

from .allocator import BlockAllocator
from .engine import Engine, EngineStats
from .scheduler import Scheduler
from .sequence import Sequence, Status

__all__ = [
    "BlockAllocator",
    "Engine",
    "EngineStats",
    "Scheduler",
    "Sequence",
    "Status",
]
