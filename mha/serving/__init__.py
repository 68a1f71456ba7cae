"""Serving many requests over one paged key/value cache.

One idea per file: :mod:`mha.serving.blocks`, the block allocator (reference
counts, chained hashes of full blocks, the free list, the prefix cache).
The kernel that reads the blocks where they are is
:func:`mha.kernels.triton_paged_attention`; ``serving`` imports ``kernels``,
never the other way.
"""

from __future__ import annotations

from .blocks import BlockAllocator, OutOfBlocks, block_hashes, chain_hash

__all__ = ["BlockAllocator", "OutOfBlocks", "block_hashes", "chain_hash"]
