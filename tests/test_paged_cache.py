"""mha.PagedKVCache: keys and values in blocks from one pool, a block table per sequence.

Expected values come from the preallocated KVCache (the same layer, the same inputs) and from
the full causal forward; the block bookkeeping is checked by hand on small cases.
"""

from __future__ import annotations

import math

import pytest
import torch
from mha.decoding import GroupedQueryAttention, KVCache, PagedKVCache

from helpers import randn

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D, H = 32, 8
D_K = D // H


def make_layer(num_kv_heads: int, seed: int = 0) -> GroupedQueryAttention:
    torch.manual_seed(seed)
    layer = GroupedQueryAttention(D, H, num_kv_heads, dtype=torch.float64).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64) / math.sqrt(p.shape[-1]))
    return layer


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
def test_paged_equals_preallocated_at_every_step(block_size: int, num_kv_heads: int) -> None:
    layer = make_layer(num_kv_heads)
    x = randn(3, 14, D, seed=1)
    paged = PagedKVCache(3, 14, num_kv_heads, D_K, block_size=block_size, dtype=torch.float64)
    contiguous = KVCache(3, 14, num_kv_heads, D_K, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        for start, end in [(0, 5), (5, 6), (6, 9), *((t, t + 1) for t in range(9, 14))]:
            ours = layer(x[:, start:end], cache=paged)
            torch.testing.assert_close(
                ours, layer(x[:, start:end], cache=contiguous), rtol=1e-12, atol=1e-12
            )
            torch.testing.assert_close(ours, full[:, start:end], rtol=1e-12, atol=1e-12)
            k_paged, v_paged = paged.update(
                torch.zeros(3, num_kv_heads, 0, D_K).double(),
                torch.zeros(3, num_kv_heads, 0, D_K).double(),
            )
            assert torch.equal(k_paged, contiguous.keys[:, :, :end])
            assert torch.equal(v_paged, contiguous.values[:, :, :end])
    assert len(paged) == len(contiguous) == 14


def test_blocks_are_taken_only_when_needed_and_given_back() -> None:
    cache = PagedKVCache(2, 10, 1, 2, block_size=4)
    assert cache.num_blocks == 2 * 3 and cache.blocks_in_use == 0  # ceil(10 / 4) per row
    k = torch.ones(2, 1, 5, 2)
    cache.update(k, k)  # positions 0..4: blocks 0 and 1 of each row
    assert cache.blocks_in_use == 4
    assert (cache.block_table[:, 2] == cache.null_block).all()
    table = cache.block_table[:, :2].flatten().tolist()
    assert len(set(table)) == 4  # four different blocks of the pool
    cache.update(k[:, :, :3], k[:, :, :3])  # positions 5..7: still block 1
    assert cache.blocks_in_use == 4
    cache.update(k[:, :, :1], k[:, :, :1])  # position 8: a third block per row
    assert cache.blocks_in_use == 6
    cache.free(1)  # row 1 is done: its 3 blocks go back
    assert cache.blocks_in_use == 3
    assert (cache.block_table[1] == cache.null_block).all()
    cache.truncate(4)  # row 0 keeps positions 0..3: one block
    assert cache.blocks_in_use == 1 and len(cache) == 4
    cache.reset()
    assert cache.blocks_in_use == 0 and len(cache) == 0


def test_a_freed_row_leaves_the_other_rows_exact() -> None:
    layer = make_layer(2)
    x = randn(3, 9, D, seed=2)
    cache = PagedKVCache(3, 9, 2, D_K, block_size=2, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        layer(x[:, :4], cache=cache)
        cache.free(1)
        steps = [layer(x[:, t : t + 1], cache=cache) for t in range(4, 9)]
    out = torch.cat(steps, dim=1)
    torch.testing.assert_close(out[[0, 2]], full[[0, 2], 4:], rtol=1e-12, atol=1e-12)
    assert not out.isnan().any()
    assert cache.blocks_in_use == 2 * math.ceil(9 / 2)  # rows 0 and 2 only


def test_a_short_pool_refuses_the_update_and_writes_nothing() -> None:
    cache = PagedKVCache(2, 16, 1, 2, block_size=4, num_blocks=5)
    k = torch.ones(2, 1, 8, 2)
    cache.update(k, k)  # 2 blocks per row
    before = (cache.key_blocks.clone(), cache.block_table.clone(), len(cache))
    with pytest.raises(ValueError, match=r"the pool has 1 free blocks of 4 positions; 1 new"):
        cache.update(k[:, :, :1], k[:, :, :1])  # needs a third block for each row
    assert torch.equal(cache.key_blocks, before[0])
    assert torch.equal(cache.block_table, before[1]) and len(cache) == before[2]
    cache.free(0)
    cache.update(k[:, :, :1], k[:, :, :1])  # with row 0's blocks back, it fits
    assert len(cache) == 9


def test_paged_cache_errors() -> None:
    cache = PagedKVCache(2, 8, 2, 4, block_size=4)
    with pytest.raises(ValueError, match="max_len = 8 tokens and holds 0: 9 new tokens"):
        cache.update(torch.zeros(2, 2, 9, 4), torch.zeros(2, 2, 9, 4))
    with pytest.raises(ValueError, match=r"row must be < batch = 2, got 2"):
        cache.free(2)
    with pytest.raises(TypeError, match="block_size must be an int"):
        PagedKVCache(2, 8, 2, 4, block_size=4.0)
    with pytest.raises(ValueError, match=r"\(B, H_kv, d_k\) = \(2, 2, 4\)"):
        cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert len(cache) == 0 and cache.blocks_in_use == 0


def test_memory_follows_the_tokens() -> None:
    # Four sequences that stop after 5, 40, 12 and 64 tokens, room for 64 each. The
    # preallocated cache holds 4 * 64 positions from the start; the paged one, at its peak,
    # the blocks of the tokens alive (sequences that stopped gave theirs back).
    stops, block_size, max_len = [5, 40, 12, 64], 16, 64
    cache = PagedKVCache(4, max_len, 1, 2, block_size=block_size)
    k = torch.zeros(4, 1, 1, 2)
    peak = 0
    for t in range(max_len):
        cache.update(k, k)
        peak = max(peak, cache.blocks_in_use)
        for row, stop in enumerate(stops):
            if t + 1 == stop:
                cache.free(row)
    # By hand: up to t = 4 all four rows hold one block (4); row 0 stops at 5; rows 1, 2, 3
    # hold one block each until t = 11, then row 2 stops at 12; rows 1 and 3 reach 3 blocks
    # at t = 32..39 (6), then row 1 stops; row 3 alone reaches 4 blocks.
    assert peak == 6
    preallocated = KVCache(4, max_len, 1, 2)
    assert preallocated.keys.shape[2] * 4 == 256  # positions held, whatever the lengths


def test_the_cache_takes_its_blocks_from_the_serving_allocator() -> None:
    # One allocator for both paged caches: the cache's blocks are counted by a BlockAllocator
    # (reference counts by hand: one per held block), and a row's blocks go back to it.
    from mha.blocks import BlockAllocator

    allocator = BlockAllocator(6, 4, prefix_caching=False)
    cache = PagedKVCache(2, 10, 1, 2, allocator=allocator)
    assert cache.allocator is allocator and (cache.block_size, cache.num_blocks) == (4, 6)
    k = torch.ones(2, 1, 5, 2)
    cache.update(k, k)  # ceil(5 / 4) = 2 blocks per row
    assert allocator.num_free == 2 and allocator.ref_counts == [1, 1, 1, 1, 0, 0]
    cache.free(0)
    assert allocator.num_free == 4 and sorted(allocator.ref_counts) == [0, 0, 0, 0, 1, 1]
    assert isinstance(PagedKVCache(1, 8, 1, 2).allocator, BlockAllocator)  # its own


def test_a_wrong_allocator_is_refused_by_name() -> None:
    from mha.blocks import BlockAllocator

    with pytest.raises(TypeError, match="allocator must be an mha.blocks.BlockAllocator"):
        PagedKVCache(1, 8, 1, 2, allocator=object())
    with pytest.raises(ValueError, match=r"block_size must be the allocator's \(4\).*got 16"):
        PagedKVCache(1, 8, 1, 2, block_size=16, allocator=BlockAllocator(4, 4))
    with pytest.raises(ValueError, match=r"num_blocks must be the allocator's \(4\).*got 9"):
        PagedKVCache(1, 8, 1, 2, num_blocks=9, allocator=BlockAllocator(4, 4))
    busy = BlockAllocator(4, 4)
    busy.allocate()
    with pytest.raises(ValueError, match="allocator must have every block free.*1 in use"):
        PagedKVCache(1, 8, 1, 2, allocator=busy)


def test_write_stores_the_new_keys_and_pages_hands_out_the_pools_themselves() -> None:
    # pages() is what the paged kernel reads: the pool tensors (no copy), the block table and
    # each row's length; the keys of row b, position p sit at block_table[b, p // 4], p % 4.
    cache = PagedKVCache(2, 12, 2, 3, block_size=4, dtype=torch.float64)
    k, v = randn(2, 2, 6, 3, seed=5).double(), randn(2, 2, 6, 3, seed=6).double()
    cache.write(k, v)
    k_pool, v_pool, table, lens = cache.pages()
    assert k_pool is cache.key_blocks and v_pool is cache.value_blocks
    assert table.dtype == torch.int32 and lens.tolist() == [6, 6] and lens.dtype == torch.int32
    for b in range(2):
        for p in range(6):
            block = int(table[b, p // 4])
            assert torch.equal(k_pool[block, p % 4], k[b, :, p])  # (H_kv, d_k)
            assert torch.equal(v_pool[block, p % 4], v[b, :, p])


def test_a_models_layers_share_one_block_table() -> None:
    # Two layers on one table: the first to write a step takes the blocks, the second finds them
    # taken; each layer's keys live in its own pools at the positions the one table says.
    first = PagedKVCache(2, 10, 1, 4, block_size=4, dtype=torch.float64)
    second = PagedKVCache(2, 10, 1, 4, share_table_with=first, dtype=torch.float64)
    assert second.block_table is first.block_table and second.allocator is first.allocator
    k1, k2 = randn(2, 1, 5, 4, seed=1), randn(2, 1, 5, 4, seed=2)
    first.update(k1, k1)
    taken = first.blocks_in_use
    assert taken == 2 * math.ceil(5 / 4)  # 2 rows, 2 blocks of 4 each for 5 positions
    keys, _ = second.update(k2, k2)
    assert second.blocks_in_use == taken  # nothing more taken
    torch.testing.assert_close(keys, k2, rtol=0, atol=0)
    torch.testing.assert_close(first.update(k1[:, :, :1], k1[:, :, :1])[0][:, :, :5], k1)
    first.truncate(2)  # every layer of the table
    assert len(first) == len(second) == 2 and first.blocks_in_use == 2
    second.reset()
    assert len(first) == len(second) == 0 and first.blocks_in_use == 0
    with pytest.raises(
        ValueError, match=r"share_table_with must have the same \(batch, max_len\)"
    ):
        PagedKVCache(3, 10, 1, 4, share_table_with=first)
    with pytest.raises(TypeError, match="share_table_with must be an mha.PagedKVCache"):
        PagedKVCache(2, 10, 1, 4, share_table_with=KVCache(2, 10, 1, 4))


def test_the_models_paged_caches_share_one_table() -> None:
    import mha

    model = mha.CausalLM.from_config(
        {"model_type": "llama", "hidden_size": 16, "intermediate_size": 24,
         "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 3,
         "vocab_size": 32}
    )  # fmt: skip
    caches = model.new_caches(2, 8, kind="paged")
    assert len({id(cache.block_table) for cache in caches}) == 1
    assert len({id(cache.key_blocks) for cache in caches}) == 3
