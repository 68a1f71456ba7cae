"""The block pool's bookkeeping: reference counts, chained hashes, LRU reuse.

The pool has ``num_blocks`` blocks of ``block_size`` positions; a sequence's
block table lists the blocks that hold its keys and values, in order. A
block carries a reference count (how many sequences' tables list it) and,
once full and computed, a hash chained from its parent block's hash and its
own tokens: two sequences whose tokens agree up to the end of a block have
the same hash there, so the second reuses the first's block instead of
computing it again (prefix caching). A block whose count falls to zero goes
to the end of the free list with its hash kept: it can still be found and
reused until a new block is needed and it is the least recently freed one
(vLLM's and nano-vllm's block managers work so).
"""

from __future__ import annotations

from collections import OrderedDict

from .._validate import check_int
from .sequence import Sequence

__all__ = ["BlockAllocator"]


class BlockAllocator:
    """Blocks of one pool handed to sequences (see the module)."""

    def __init__(
        self, num_blocks: int, block_size: int, *, prefix_caching: bool = True
    ) -> None:
        self.num_blocks = check_int("num_blocks", num_blocks)
        self.block_size = check_int("block_size", block_size)
        self.prefix_caching = bool(prefix_caching)
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...]] = [()] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(num_blocks)
        )  # least recently freed first
        self.peak_in_use = 0

    @property
    def in_use(self) -> int:
        """Blocks listed by at least one sequence."""
        return self.num_blocks - len(self.free)

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold ``positions`` positions."""
        return -(-positions // self.block_size)

    def _hits(self, seq: Sequence) -> list[int]:
        """Blocks of the cache that hold ``seq``'s leading full blocks (the
        block of its newest token is always computed: its logits are
        needed)."""
        hits, parent = [], None
        if not self.prefix_caching:
            return hits
        for i in range((len(seq) - 1) // self.block_size):
            tokens = seq.block_tokens(i, self.block_size)
            parent = hash((parent, tokens))
            block = self.cached.get(parent)
            if block is None or self.block_tokens[block] != tokens:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether every token of ``seq`` can have its block now."""
        hits = self._hits(seq)
        revived = sum(block in self.free for block in hits)
        new = self.blocks_for(len(seq)) - len(hits)
        return new + revived <= len(self.free)

    def allocate(self, seq: Sequence) -> int:
        """Give ``seq`` blocks for all its tokens, reusing cached ones;
        returns the positions reused (``seq.num_computed``)."""
        hits = self._hits(seq)
        for block in hits:
            self.free.pop(block, None)
            self.ref_count[block] += 1
        seq.block_table = hits
        seq.num_computed = len(hits) * self.block_size
        self._grow(seq, len(seq))
        return seq.num_computed

    def can_append(self, seq: Sequence, positions: int) -> bool:
        """Whether ``seq`` can hold ``positions`` positions after taking
        the free blocks it needs."""
        needed = self.blocks_for(positions) - len(seq.block_table)
        return needed <= len(self.free)

    def _grow(self, seq: Sequence, positions: int) -> None:
        """New blocks at the end of ``seq``'s table until it holds
        ``positions`` positions."""
        while len(seq.block_table) < self.blocks_for(positions):
            block, _ = self.free.popitem(last=False)  # least recently freed
            if self.cached.get(self.block_hash[block]) == block:
                del self.cached[self.block_hash[block]]  # evicted
            self.block_hash[block], self.block_tokens[block] = None, ()
            self.ref_count[block] = 1
            seq.block_table.append(block)
        self.peak_in_use = max(self.peak_in_use, self.in_use)

    append = _grow

    def register(self, seq: Sequence) -> None:
        """Hash the full blocks of ``seq`` that are computed now."""
        parent = None
        for i in range(seq.num_computed // self.block_size):
            block = seq.block_table[i]
            if self.block_hash[block] is None:
                tokens = seq.block_tokens(i, self.block_size)
                self.block_hash[block] = hash((parent, tokens))
                self.block_tokens[block] = tokens
                if self.prefix_caching:
                    self.cached.setdefault(self.block_hash[block], block)
            parent = self.block_hash[block]

    def release(self, seq: Sequence) -> None:
        """Take back ``seq``'s blocks (its last block first, so that shared
        prefixes are evicted last); cached ones stay findable."""
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
        seq.block_table, seq.num_computed = [], 0
