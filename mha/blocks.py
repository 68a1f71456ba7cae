"""The block allocator of a paged key/value cache, with prefix caching.

A sequence holds a list of blocks of ``block_size`` positions (its row of
the block table). A full block is identified by :func:`chain_hash` of its
parent's hash and its tokens, so equal hashes mean equal prefixes. Blocks
are shared by reference count: two prompts that begin with one system prompt
hold the same blocks for it, and the second computes only what follows. A
block whose count drops to zero joins the end of the free list but keeps its
hash: a later prompt may still find it until :meth:`BlockAllocator.allocate`
takes it (the least recently freed first). A sequence is freed last block
first, so a shared prefix outlives its tails.

One allocator serves both paged caches: :class:`mha.PagedKVCache` (a
model's ``generate``, without the prefix cache) and the serving engine
(:mod:`mha.serving`, with it). It sits a floor below both and imports
nothing of the package but its checks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ._validate import check_int

__all__ = ["BlockAllocator", "OutOfBlocks", "block_hashes", "chain_hash"]


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The identity of a full block: its parent's hash (None for a first
    block) and its tokens. Python hashes integers and tuples of them without
    a seed (and never to -1, which stands for None): equal in every process."""
    root = -1 if parent is None else parent
    return hash((root, tuple(int(t) for t in tokens)))


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the full blocks of ``tokens``, in order."""
    hashes: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(chain_hash(parent, tokens[start : start + block_size]))
    return hashes


class BlockAllocator:
    """Reference-counted blocks, a free list and a prefix cache.

    Args:
        num_blocks: blocks in the pool.
        block_size: positions per block.
        prefix_caching: whether full blocks are found again by their hash.
    """

    def __init__(
        self, num_blocks: int, block_size: int, *, prefix_caching: bool = True
    ) -> None:
        self.num_blocks = check_int("num_blocks", num_blocks)
        self.block_size = check_int("block_size", block_size)
        self.prefix_caching = bool(prefix_caching)
        self.ref_counts = [0] * num_blocks
        self._key: list[tuple | None] = [None] * num_blocks  # (parent, tokens)
        self._hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # hash -> block
        # free blocks, least recently freed first (never used: first of all)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(num_blocks)
        )

    @property
    def num_free(self) -> int:
        """Blocks that no sequence holds (cached or not)."""
        return len(self._free)

    def allocate(self) -> int:
        """A block for new tokens, its count 1: the least recently freed
        free block, whose cached tokens are forgotten."""
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        block, _ = self._free.popitem(last=False)
        if self._hash[block] is not None:  # evicted from the prefix cache
            del self._cached[self._hash[block]]
            self._key[block] = self._hash[block] = None
        self.ref_counts[block] = 1
        return block

    def lookup(self, parent: int | None, tokens: Sequence[int]) -> int | None:
        """The cached block holding ``tokens`` after ``parent``, now shared
        (its count + 1), or None."""
        block = self._find(parent, tokens)
        if block is not None:
            self._share(block)
        return block

    def register(
        self, block: int, parent: int | None, tokens: Sequence[int]
    ) -> int:
        """Record that ``block`` is full of ``tokens`` after ``parent`` (call
        it once their keys and values are written); returns its hash."""
        if len(tokens) != self.block_size:
            raise ValueError(
                f"tokens must fill a block ({self.block_size}), got "
                f"{len(tokens)}"
            )
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is not allocated")
        key = (parent, tuple(int(t) for t in tokens))
        digest = chain_hash(*key)
        if self.prefix_caching and digest not in self._cached:
            self._cached[digest] = block
            self._key[block], self._hash[block] = key, digest
        return digest

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of a sequence's ``blocks``, the last
        first; a block no one holds joins the free list's end."""
        for block in reversed(blocks):
            if self.ref_counts[block] < 1:
                raise ValueError(f"block {block} is already free")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def allocate_prompt(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        """Blocks for a prompt: the cached blocks of its longest cached
        prefix, shared, then fresh ones. Returns ``(blocks, cached)``, the
        number of leading tokens whose keys and values are already there.

        The last token is never cached (its logits are needed), so a
        prompt found whole still computes its last block. Raises
        :class:`OutOfBlocks`, and changes nothing, if the pool is short.
        """
        size = self.block_size
        needed = -(-len(tokens) // size)
        hits: list[int] = []
        parent = None
        for digest in block_hashes(tokens[: len(tokens) - 1], size):
            block = self._find(parent, tokens[len(hits) * size :][:size])
            if block is None:
                break
            hits.append(block)
            parent = digest
        free = self.num_free - sum(self.ref_counts[b] == 0 for b in hits)
        if needed - len(hits) > free:
            raise OutOfBlocks(
                f"a prompt of {len(tokens)} tokens needs "
                f"{needed - len(hits)} new blocks, {free} are free"
            )
        for block in hits:
            self._share(block)
        fresh = [self.allocate() for _ in range(needed - len(hits))]
        return hits + fresh, len(hits) * size

    def _find(self, parent: int | None, tokens: Sequence[int]) -> int | None:
        if not self.prefix_caching:
            return None
        key = (parent, tuple(int(t) for t in tokens))
        block = self._cached.get(chain_hash(*key))
        return block if block is not None and self._key[block] == key else None

    def _share(self, block: int) -> None:
        if self.ref_counts[block] == 0:  # back from the free list
            del self._free[block]
        self.ref_counts[block] += 1
