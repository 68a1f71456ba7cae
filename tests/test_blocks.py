"""The block allocator: reference counts, chained hashes, the free list, the prefix cache.

Expected values are worked out by hand from the rules in mha/blocks.py's docstring: a full
block is found again only after the same prefix, blocks are shared by count, freed blocks wait in
least-recently-freed order, a sequence is freed last block first.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mha import blocks as blocks_module
from mha.blocks import BlockAllocator, OutOfBlocks, block_hashes, chain_hash

SIZE = 4  # positions per block, small enough to write prompts by hand


def _run(allocator: BlockAllocator, tokens: list[int]) -> tuple[list[int], int]:
    """Allocate a prompt and, as an engine would once its keys are written, register its full
    blocks."""
    blocks, cached = allocator.allocate_prompt(tokens)
    parent = None
    for j in range(len(tokens) // SIZE):
        parent = allocator.register(blocks[j], parent, tokens[j * SIZE : (j + 1) * SIZE])
    return blocks, cached


def test_allocate_and_free_count_references() -> None:
    allocator = BlockAllocator(3, SIZE)
    first, second = allocator.allocate(), allocator.allocate()
    assert (first, second) == (0, 1) and allocator.num_free == 1
    assert allocator.ref_counts == [1, 1, 0]
    allocator.free([first, second])
    assert allocator.num_free == 3 and allocator.ref_counts == [0, 0, 0]
    with pytest.raises(ValueError, match="block 0 is already free"):
        allocator.free([0])


def test_a_shared_system_prompt_is_computed_once() -> None:
    allocator = BlockAllocator(10, SIZE)
    system = [7, 7, 7, 7, 8, 8, 8, 8]  # two full blocks
    a_blocks, a_cached = _run(allocator, system + [1, 2, 3])  # 11 tokens: 3 blocks
    b_blocks, b_cached = _run(allocator, system + [4, 5])  # 10 tokens: 3 blocks
    assert a_cached == 0 and b_cached == 8  # the second computes 2 tokens, not 10
    assert b_blocks[:2] == a_blocks[:2] and b_blocks[2] not in a_blocks
    assert [allocator.ref_counts[b] for b in a_blocks] == [2, 2, 1]
    assert allocator.num_free == 10 - 4  # 3 + 1 blocks in use


def test_a_block_is_found_only_after_the_same_prefix() -> None:
    # Block 1 of both prompts holds the same tokens, but after a different block 0: a hash of
    # the block alone would share it, the chained hash must not.
    allocator = BlockAllocator(10, SIZE)
    _run(allocator, [1, 1, 1, 1, 5, 5, 5, 5, 9])
    blocks, cached = _run(allocator, [2, 2, 2, 2, 5, 5, 5, 5, 9])
    assert cached == 0 and len(set(blocks)) == 3
    assert block_hashes([1] * 4 + [5] * 4, SIZE)[1] != block_hashes([2] * 4 + [5] * 4, SIZE)[1]


def test_the_last_token_is_always_computed() -> None:
    # A prompt found whole (8 tokens, 2 full cached blocks) reuses only its first block: the
    # last token's logits are needed, so its block is computed again, in a fresh block.
    allocator = BlockAllocator(10, SIZE)
    first, _ = _run(allocator, list(range(8)))
    again, cached = allocator.allocate_prompt(list(range(8)))
    assert cached == 4 and again[0] == first[0] and again[1] != first[1]


def test_freed_blocks_stay_cached_until_taken_least_recently_freed_first() -> None:
    allocator = BlockAllocator(4, SIZE)
    a, _ = _run(allocator, [1, 1, 1, 1, 2])  # blocks 0, 1
    b, _ = _run(allocator, [3, 3, 3, 3, 4])  # blocks 2, 3
    allocator.free(a)  # frees block 1, then block 0
    allocator.free(b)  # frees block 3, then block 2
    assert allocator.num_free == 4
    assert allocator.allocate() == a[1]  # the least recently freed: a's tail
    # a's full block 0 is still cached though free: found again, taken back from the free list
    blocks, cached = allocator.allocate_prompt([1, 1, 1, 1, 6])
    assert cached == 4 and blocks[0] == a[0] and allocator.ref_counts[a[0]] == 1
    # the next fresh blocks: b's tail (block 3), then b's head (block 2), which forgets its hash
    assert blocks[1] == b[1]
    assert allocator.allocate() == b[0]
    allocator.free([b[0]])
    assert allocator.lookup(None, [3, 3, 3, 3]) is None  # evicted when it was taken


def test_out_of_blocks_changes_nothing() -> None:
    allocator = BlockAllocator(3, SIZE)
    _run(allocator, [1, 1, 1, 1, 2])  # 2 blocks
    before = (list(allocator.ref_counts), allocator.num_free)
    with pytest.raises(OutOfBlocks, match="needs 2 new blocks, 1 are free"):
        allocator.allocate_prompt([1, 1, 1, 1, 2, 2, 2, 2, 3])  # 1 cached + 2 new
    assert (list(allocator.ref_counts), allocator.num_free) == before
    allocator.allocate()
    with pytest.raises(OutOfBlocks, match="all 3 blocks are in use"):
        allocator.allocate()


def test_a_freed_cached_block_counts_as_used_once_found_again() -> None:
    # 2 blocks; a prompt of 5 tokens frees them; a prompt with the same first block and 5 more
    # tokens needs block 0 (cached, free) and 2 fresh: only 1 other is free, so it is refused.
    allocator = BlockAllocator(2, SIZE)
    a, _ = _run(allocator, [1, 1, 1, 1, 2])
    allocator.free(a)
    with pytest.raises(OutOfBlocks, match="needs 2 new blocks, 1 are free"):
        allocator.allocate_prompt([1, 1, 1, 1, 2, 2, 2, 2, 3])


def test_without_prefix_caching_nothing_is_shared() -> None:
    allocator = BlockAllocator(10, SIZE, prefix_caching=False)
    a, _ = _run(allocator, [1, 1, 1, 1, 2])
    b, cached = _run(allocator, [1, 1, 1, 1, 2])
    assert cached == 0 and not set(a) & set(b)
    assert allocator.lookup(None, [1, 1, 1, 1]) is None


def test_a_hash_collision_is_not_a_hit(monkeypatch) -> None:
    # Every block hashed alike: the allocator compares the tokens and the parent too.
    monkeypatch.setattr(blocks_module, "chain_hash", lambda parent, tokens: 42)
    allocator = BlockAllocator(10, SIZE)
    _run(allocator, [1, 1, 1, 1, 2])
    blocks, cached = allocator.allocate_prompt([9, 9, 9, 9, 2])
    assert cached == 0
    assert allocator.lookup(None, [1, 1, 1, 1]) is not None


def test_hashes_are_equal_in_another_process() -> None:
    # Prefix caching across engine restarts, or across processes, needs hashes without a seed
    # (hash(None) is an address in CPython 3.11: chain_hash never hashes None).
    code = "from mha.blocks import block_hashes; print(block_hashes(list(range(12)), 4))"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert other.strip() == str(block_hashes(list(range(12)), 4))
    assert chain_hash(None, [1, 2]) != chain_hash(chain_hash(None, [0, 0]), [1, 2])


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="num_blocks must be a positive int, got 0"):
        BlockAllocator(0, SIZE)
    with pytest.raises(TypeError, match="block_size must be an int, got float 4.0"):
        BlockAllocator(3, 4.0)
    allocator = BlockAllocator(3, SIZE)
    block = allocator.allocate()
    with pytest.raises(ValueError, match=r"tokens must fill a block \(4\), got 3"):
        allocator.register(block, None, [1, 2, 3])
    with pytest.raises(ValueError, match="block 2 is not allocated"):
        allocator.register(2, None, [1, 2, 3, 4])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["prompt", "free", "grow"]), st.integers(0, 3), st.integers(1, 9)
        ),
        max_size=30,
    )
)
def test_counts_free_list_and_cache_stay_consistent(operations) -> None:
    # Prompts drawn from a few shared prefixes, freed and grown in any order: every block's count
    # is the number of sequences holding it, the free blocks are those with count 0, no block is
    # held twice by one sequence, and a cache hit hands out the tokens that were registered.
    allocator = BlockAllocator(12, SIZE)
    sequences: list[tuple[list[int], list[int]]] = []  # (tokens, blocks)
    written: dict[int, tuple] = {}  # block -> tokens its keys hold, once full
    for action, pick, length in operations:
        if action == "prompt":
            tokens = [pick] * 4 + [pick + 1] * 4 + list(range(length))
            try:
                blocks, cached = allocator.allocate_prompt(tokens)
            except OutOfBlocks:
                continue
            for j, block in enumerate(blocks[: cached // SIZE]):  # hits hold these tokens
                assert written[block] == tuple(tokens[j * SIZE : (j + 1) * SIZE])
            for j in range(cached // SIZE, len(blocks)):  # fresh blocks: what they now hold
                written[blocks[j]] = tuple(tokens[j * SIZE : (j + 1) * SIZE])
            parent = None
            for j in range(len(tokens) // SIZE):
                parent = allocator.register(blocks[j], parent, tokens[j * SIZE : (j + 1) * SIZE])
            sequences.append((tokens, blocks))
        elif action == "free" and sequences:
            _, blocks = sequences.pop(pick % len(sequences))
            allocator.free(blocks)
        elif action == "grow" and sequences and allocator.num_free:
            tokens, blocks = sequences[pick % len(sequences)]
            if len(tokens) % SIZE == 0:  # the last block is full: a new one
                blocks.append(allocator.allocate())
            tokens.append(length)
            written[blocks[-1]] = tuple(tokens[(len(blocks) - 1) * SIZE :])
        held = [0] * allocator.num_blocks
        for _, blocks in sequences:
            assert len(set(blocks)) == len(blocks)
            for block in blocks:
                held[block] += 1
        assert allocator.ref_counts == held
        assert allocator.num_free == held.count(0)
