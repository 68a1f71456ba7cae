"""The paged-attention kernel and its torch twin against gather + softmax in float64.

Each sequence's keys and values are drawn contiguous first, (H_kv, L_b, d), then written block by
block into pool blocks picked at random (a shuffled block table); the expected output is computed
from the contiguous tensors, one (sequence, head, query) at a time in float64, never from the pool
or the table. The Triton kernel runs in Triton's interpreter on a CPU (compiled on a GPU).
"""

from __future__ import annotations

import math
import traceback

import pytest
import torch
from mha import kernels
from mha.kernels.paged_torch import paged_attention_torch

from helpers import KERNEL_DEVICE, generator, randn

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRITON = pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason="triton is not installed")
DEVICE = KERNEL_DEVICE
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 2e-3}


def _paged(lengths, heads, kv_heads, t_q, d, block_size, dtype, seed=0, spare=3):
    """q, pools, block table, lengths, and the contiguous keys and values per sequence."""
    batch = len(lengths)
    max_blocks = max(-(-n // block_size) for n in lengths) + 1  # one unused column
    num_blocks = batch * max_blocks + spare
    order = torch.randperm(num_blocks, generator=generator(seed))  # shuffled pool blocks
    k_pool = randn(num_blocks, block_size, kv_heads, d, seed=seed + 1)  # garbage in unused slots
    v_pool = randn(num_blocks, block_size, kv_heads, d, seed=seed + 2)
    table = torch.full((batch, max_blocks), num_blocks - 1, dtype=torch.int32)
    keys, values, used = [], [], 0
    for b, n in enumerate(lengths):
        k = randn(kv_heads, n, d, seed=seed + 10 + b)  # (H_kv, L_b, d)
        v = randn(kv_heads, n, d, seed=seed + 50 + b)
        for j in range(-(-n // block_size)):
            block = int(order[used])
            used += 1
            table[b, j] = block
            rows = slice(j * block_size, min(n, (j + 1) * block_size))
            count = rows.stop - rows.start
            k_pool[block, :count] = k[:, rows].transpose(0, 1)  # (slots, H_kv, d)
            v_pool[block, :count] = v[:, rows].transpose(0, 1)
        keys.append(k)
        values.append(v)
    q = randn(batch, heads, t_q, d, seed=seed + 99)
    q, k_pool, v_pool = (t.to(dtype).to(DEVICE) for t in (q, k_pool, v_pool))
    keys = [k.to(dtype).double() for k in keys]  # rounded as the pools are
    values = [v.to(dtype).double() for v in values]
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    return q, k_pool, v_pool, table.to(DEVICE), lens, keys, values


def _implementation(name: str):
    """The kernel ("triton"; skipped where Triton is missing) or its torch twin ("torch")."""
    if name == "torch":
        return paged_attention_torch
    if not kernels.TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    return kernels.triton_paged_attention


def _expected(q, keys, values, lengths, key_start=None, window=None):
    """Float64: query i of sequence b (position p = L_b - T_q + i) over keys max(key_start[b],
    p - window + 1) .. p; zeros for a query that sees no key."""
    q = q.detach().cpu().double()
    batch, heads, t_q, d = q.shape
    group = heads // keys[0].shape[0]
    out = torch.zeros(batch, heads, t_q, d, dtype=torch.float64)
    for b, n in enumerate(lengths):
        for h in range(heads):
            for i in range(t_q):
                p = n - t_q + i
                first = 0 if key_start is None else key_start[b]
                if window is not None:
                    first = max(first, p - window + 1)
                if first > p:
                    continue  # no key: zeros
                seen = torch.arange(first, p + 1)  # causal, bottom-right, masked
                k, v = keys[b][h // group, seen], values[b][h // group, seen]
                weights = torch.softmax(k @ q[b, h, i] / math.sqrt(d), dim=0)
                out[b, h, i] = weights @ v
    return out


# (lengths, H, H_kv, T_q): ragged decoding steps (T_q = 1) with GQA and MQA, a chunk of 7 after a
# cache, and sequences whose last block is full or holds one key.
CASES = [
    ([37, 5, 64, 1], 4, 2, 1),
    ([50, 16, 33], 4, 1, 1),
    ([40, 13], 2, 2, 7),
    ([32, 17], 6, 2, 3),
]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", CASES)
def test_torch_twin_equals_gather_and_softmax(case, block_size) -> None:
    lengths, heads, kv_heads, t_q = case
    q, k_pool, v_pool, table, lens, keys, values = _paged(
        lengths, heads, kv_heads, t_q, 24, block_size, torch.float64
    )
    out = paged_attention_torch(q, k_pool, v_pool, table, lens)
    expected = _expected(q, keys, values, lengths)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-12, atol=1e-12)


@TRITON
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", CASES)
def test_triton_equals_gather_and_softmax(case, block_size) -> None:
    lengths, heads, kv_heads, t_q = case
    for dtype in (torch.float32, torch.float16):
        q, k_pool, v_pool, table, lens, keys, values = _paged(
            lengths, heads, kv_heads, t_q, 40, block_size, dtype, seed=block_size
        )
        out = kernels.triton_paged_attention(q, k_pool, v_pool, table, lens)
        assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
        expected = _expected(q, keys, values, lengths)
        tolerance = TOLERANCE[dtype]
        torch.testing.assert_close(out.cpu().double(), expected, rtol=tolerance, atol=tolerance)


@TRITON
def test_decode_split_over_blocks_and_odd_block_sizes() -> None:
    # One decoding step over 200 keys in blocks of 5 (a block smaller than a key tile, so a tile
    # gathers from several blocks), split 1, 4 and 9 ways; the merge must not depend on it.
    from mha.kernels.paged import paged_forward

    lengths = [200, 77]
    q, k_pool, v_pool, table, lens, keys, values = _paged(lengths, 4, 2, 1, 32, 5, torch.float32)
    expected = _expected(q, keys, values, lengths)
    for splits in (1, 4, 9):
        out, lse = paged_forward(q, k_pool, v_pool, table, lens, num_splits=splits)
        torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-5, atol=2e-5)
        assert torch.isfinite(lse).all()


@TRITON
def test_the_kernel_reads_no_block_outside_the_table() -> None:
    # NaN in every pool block that no table entry reaches, and in the slots past each length
    # (a pool from torch.empty may hold anything there): a read of anything but the sequence's
    # own keys would turn the output NaN (0 * NaN). The twin gathers more, and zeros it.
    lengths = [21, 35]
    q, k_pool, v_pool, table, lens, keys, values = _paged(
        lengths, 2, 1, 1, 16, 16, torch.float32, spare=4
    )
    reached = set()
    for b, n in enumerate(lengths):
        for j in range(-(-n // 16)):
            block = int(table[b, j])
            reached.add(block)
            stop = n - j * 16  # slots of this block past the length
            if stop < 16:
                k_pool[block, stop:], v_pool[block, stop:] = math.nan, math.nan
    for block in set(range(k_pool.shape[0])) - reached:
        k_pool[block], v_pool[block] = math.nan, math.nan
    out = kernels.triton_paged_attention(q, k_pool, v_pool, table, lens)
    twin = paged_attention_torch(q.double(), k_pool.double(), v_pool.double(), table, lens)
    expected = _expected(q, keys, values, lengths)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(twin.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["triton", "torch"])
def test_bad_input_is_refused_by_name(implementation) -> None:
    run = _implementation(implementation)
    q = torch.zeros(2, 4, 1, 16, device=DEVICE)
    pool = torch.zeros(6, 16, 2, 16, device=DEVICE)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20, 3], dtype=torch.int32, device=DEVICE)
    run(q, pool, pool, table, lens)  # the good call
    with pytest.raises(ValueError, match=r"q must have shape \(B, H, T_q, d\)"):
        run(q[0], pool, pool, table, lens)
    with pytest.raises(ValueError, match=r"k_pool must have shape \(num_blocks, block_size"):
        run(q, pool[0], pool, table, lens)
    with pytest.raises(ValueError, match="with q's d = 16"):
        run(q, pool[..., :8], pool[..., :8], table, lens)
    with pytest.raises(ValueError, match="H_kv must divide H"):
        run(q[:, :3], pool, pool, table, lens)
    with pytest.raises(TypeError, match="one dtype"):
        run(q, pool.double(), pool, table, lens)
    with pytest.raises(TypeError, match="block_table must be an integer tensor"):
        run(q, pool, pool, table.float(), lens)
    with pytest.raises(ValueError, match=r"seq_lens must have B = 2 rows"):
        run(q, pool, pool, table, lens[:1])
    with pytest.raises(ValueError, match=r"seq_lens must lie between T_q = 1 .* and .* = 32"):
        run(q, pool, pool, table, torch.tensor([33, 3], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"seq_lens must lie between T_q = 1"):
        run(q, pool, pool, table, torch.tensor([0, 3], dtype=torch.int32, device=DEVICE))
    bad = torch.tensor([[0, 6], [2, 3]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"block_table must hold pool blocks 0 \.\. 5"):
        run(q, pool, pool, bad, lens)
    unused = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32, device=DEVICE)
    run(q, pool, pool, unused, lens)  # an entry past a sequence's length is never read
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        run([[0.0]], pool, pool, table, lens)
    if implementation == "triton":
        with pytest.raises(TypeError, match="float32, float16 or bfloat16, got torch.float64"):
            run(q.double(), pool.double(), pool.double(), table, lens)


@pytest.mark.parametrize("implementation", ["triton", "torch"])
def test_strided_lengths_and_table_entries_past_the_lengths(implementation) -> None:
    # seq_lens a strided view (every other element of a longer tensor: read as contiguous, row 1
    # would get length 1), and table entries past each length that name no block at all
    run = _implementation(implementation)
    lengths = [37, 5]
    q, k_pool, v_pool, table, lens, keys, values = _paged(lengths, 4, 2, 1, 16, 8, torch.float32)
    strided = torch.stack((lens, torch.ones_like(lens)), dim=1).flatten()[::2]  # [37, 5]
    assert strided.stride() == (2,) and strided.tolist() == lengths
    table[0, 5:], table[1, 1:] = -7, 99  # past each length: never a block
    out = run(q, k_pool, v_pool, table, strided)
    expected = _expected(q, keys, values, lengths)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("implementation", ["triton", "torch"])
def test_an_empty_batch_gives_an_empty_result(implementation) -> None:
    run = _implementation(implementation)
    q = torch.zeros(0, 4, 1, 16, device=DEVICE)
    pool = torch.zeros(6, 16, 2, 16, device=DEVICE)
    table = torch.zeros(0, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    assert run(q, pool, pool, table, lens).shape == (0, 4, 1, 16)


@TRITON
def test_max_seq_len_is_checked() -> None:
    q = torch.zeros(2, 4, 1, 16, device=DEVICE)
    pool = torch.zeros(6, 16, 2, 16, device=DEVICE)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20, 3], dtype=torch.int32, device=DEVICE)
    run = kernels.triton_paged_attention
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"max_seq_len must be a positive int, got {bad}"):
            run(q, pool, pool, table, lens, max_seq_len=bad)
    for bad in (2.5, True):
        with pytest.raises(TypeError, match="max_seq_len must be an int"):
            run(q, pool, pool, table, lens, max_seq_len=bad)


@TRITON
def test_the_pools_are_never_copied() -> None:
    # Every aten operation the call makes, watched at torch's dispatcher: none takes the pools
    # as an input (no gather, no copy, no .contiguous()): the kernel reads them through the
    # table. The bytes the call allocates are its partial results, not the cache's.
    from torch.utils._python_dispatch import TorchDispatchMode

    q, k_pool, v_pool, table, lens, _, _ = _paged([70, 33], 4, 2, 1, 32, 16, torch.float32)
    pools = {k_pool.data_ptr(), v_pool.data_ptr()}
    touched = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = [*args, *(kwargs or {}).values()]
            if any(isinstance(a, torch.Tensor) and a.data_ptr() in pools for a in flat):
                # Triton's interpreter copies every argument to emulate GPU memory: not ours
                stack = [frame.filename for frame in traceback.extract_stack()]
                if not any("triton/runtime/interpreter" in name for name in stack):
                    touched.append(str(func))
            return func(*args, **(kwargs or {}))

    with Watch():
        out = kernels.triton_paged_attention(q, k_pool, v_pool, table, lens)
    assert touched == [] and torch.isfinite(out).all()
    with Watch():
        paged_attention_torch(q, k_pool, v_pool, table, lens)
    assert touched  # the twin gathers (the watch sees it)


@TRITON
def test_a_chunk_whose_rows_fill_several_tiles() -> None:
    # 4 query heads on one key/value head (MQA) and a chunk of 6 queries: 24 packed rows, two
    # row tiles of 16, the second half empty; ragged lengths, blocks of 16.
    lengths = [40, 30]
    q, k_pool, v_pool, table, lens, keys, values = _paged(lengths, 4, 1, 6, 32, 16, torch.float32)
    out = kernels.triton_paged_attention(q, k_pool, v_pool, table, lens)
    expected = _expected(q, keys, values, lengths)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-5, atol=2e-5)


# Masks: (lengths, H, H_kv, T_q, key_start, window). Ragged key starts (a row with none, rows
# whose pads fill whole blocks of 16 and of 32, a row of pads only), windows smaller than a block
# and longer than every sequence, decoding steps and chunks, GQA and MQA, both masks at once.
MASK_CASES = {
    "key_start_decode_gqa": ([37, 5, 70, 20], 4, 2, 1, [3, 0, 40, 20], None),
    "key_start_chunk_mqa": ([40, 13, 66], 4, 1, 7, [35, 0, 33], None),
    "window_decode_mqa": ([50, 16, 33], 4, 1, 1, None, 5),
    "window_chunk_gqa": ([40, 13], 6, 2, 3, None, 4),
    "window_longer_than_every_sequence": ([40, 13], 2, 2, 7, None, 100),
    # 4 heads x 6 queries = 24 packed rows: the second row tile starts at query 4 of head 2 and
    # holds query 0 of head 3, whose window (positions 29..31 of row 0) begins a key tile earlier
    "window_chunk_mqa_two_row_tiles": ([37, 29], 4, 1, 6, None, 3),
    "both_decode_gqa": ([70, 9, 45], 4, 2, 1, [36, 0, 30], 20),
    "both_chunk_mqa": ([45, 30], 4, 1, 5, [17, 24], 9),
}


def _masked_case(name, block_size, dtype, seed=0, d=24):
    lengths, heads, kv_heads, t_q, starts, window = MASK_CASES[name]
    q, k_pool, v_pool, table, lens, keys, values = _paged(
        lengths, heads, kv_heads, t_q, d, block_size, dtype, seed=seed
    )
    key_start = None if starts is None else torch.tensor(starts, device=DEVICE)
    expected = _expected(q, keys, values, lengths, starts, window)
    # Each mask given must matter here: dropping it changes the output by far more than any
    # tolerance below, so a kernel that ignored it would fail (but a window longer than every
    # sequence, which must hide nothing).
    given = {"key_start": starts, "window": window}
    for dropped in [mask for mask, value in given.items() if value is not None]:
        other = _expected(q, keys, values, lengths, **{**given, dropped: None})
        change = (other - expected).abs().max()
        if dropped == "window" and window >= max(lengths):
            assert change == 0, name
        else:
            assert change > 0.05, (name, dropped)
    masks = {"key_start": key_start, "window": window}
    return (q, k_pool, v_pool, table, lens), masks, expected


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("name", MASK_CASES)
def test_torch_twin_masks_equal_gather_and_softmax(name, block_size) -> None:
    for dtype in (torch.float64, torch.float32):
        args, masks, expected = _masked_case(name, block_size, dtype)
        out = paged_attention_torch(*args, **masks)
        assert out.dtype == dtype and torch.isfinite(out).all()
        tolerance = TOLERANCE[dtype]
        torch.testing.assert_close(out.cpu().double(), expected, rtol=tolerance, atol=tolerance)


@TRITON
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("name", MASK_CASES)
def test_triton_masks_equal_gather_and_softmax(name, block_size) -> None:
    # float32 (the kernel takes no float64; float16 as the unmasked test does)
    for dtype in (torch.float32, torch.float16):
        args, masks, expected = _masked_case(name, block_size, dtype, seed=block_size, d=40)
        out = kernels.triton_paged_attention(*args, **masks)
        assert out.dtype == dtype and out.shape == args[0].shape and torch.isfinite(out).all()
        tolerance = TOLERANCE[dtype]
        torch.testing.assert_close(out.cpu().double(), expected, rtol=tolerance, atol=tolerance)


@TRITON
def test_masked_decode_split_over_blocks() -> None:
    # A decoding step over 200 keys in blocks of 5, split 1, 4 and 9 ways, with the masks: the
    # splits wholly before a key start or a window hold no key of the row and must weigh nothing
    # in the merge (logsumexp -inf); a split cut by the key start or the window starts mid-tile.
    from mha.kernels.paged import paged_forward

    lengths, starts = [200, 77], [130, 9]
    q, k_pool, v_pool, table, lens, keys, values = _paged(lengths, 4, 2, 1, 32, 5, torch.float32)
    key_start = torch.tensor(starts, device=DEVICE)
    for masks, ours in (
        ({"key_start": key_start}, {"key_start": starts}),
        ({"window": 45}, {"window": 45}),
        ({"key_start": key_start, "window": 45}, {"key_start": starts, "window": 45}),
    ):
        expected = _expected(q, keys, values, lengths, **ours)
        unmasked = _expected(q, keys, values, lengths)
        assert (expected - unmasked).abs().max() > 0.05  # the mask matters
        for splits in (1, 4, 9):
            out, lse = paged_forward(q, k_pool, v_pool, table, lens, num_splits=splits, **masks)
            torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-5, atol=2e-5)
            assert torch.isfinite(lse).all()


@pytest.mark.parametrize("implementation", ["triton", "torch"])
def test_a_query_that_sees_no_key_gets_zeros(implementation) -> None:
    # A chunk of 4 queries at positions 26..29 of row 0, whose pads end at 28: the first two
    # queries stand on pads and see no key; row 1 is pads only (key_start = its length).
    if implementation == "triton" and not kernels.TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    lengths, starts = [30, 20], [28, 20]
    q, k_pool, v_pool, table, lens, keys, values = _paged(lengths, 4, 2, 4, 16, 16, torch.float32)
    key_start = torch.tensor(starts, device=DEVICE)
    if implementation == "triton":
        from mha.kernels.paged import paged_forward

        out, lse = paged_forward(q, k_pool, v_pool, table, lens, key_start=key_start, window=3)
        hidden = torch.zeros_like(lse, dtype=torch.bool)
        hidden[0, :, :2], hidden[1] = True, True
        assert (lse[hidden] == -math.inf).all() and torch.isfinite(lse[~hidden]).all()
    else:
        out = paged_attention_torch(q, k_pool, v_pool, table, lens, key_start=key_start, window=3)
    assert torch.isfinite(out).all()
    assert (out[0, :, :2] == 0).all() and (out[1] == 0).all()
    assert (out[0, :, 2:] != 0).any()
    expected = _expected(q, keys, values, lengths, starts, 3)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-5, atol=2e-5)


@TRITON
def test_the_kernel_reads_no_pad_and_no_key_before_every_window() -> None:
    # NaN in the pads (positions before key_start) and, for the window, in the keys before the
    # window of the row's only query (a decoding step): a key that is hidden from every row is
    # never loaded (0 * NaN would turn the output NaN).
    lengths, starts, window = [70, 40], [40, 3], 10
    q, k_pool, v_pool, table, lens, keys, values = _paged(lengths, 4, 2, 1, 16, 16, torch.float32)
    for b, n in enumerate(lengths):
        hidden = max(starts[b], n - window)  # positions 0 .. hidden - 1 are seen by no query
        for j in range(hidden):
            block = int(table[b, j // 16])
            k_pool[block, j % 16], v_pool[block, j % 16] = math.nan, math.nan
    key_start = torch.tensor(starts, device=DEVICE)
    out = kernels.triton_paged_attention(
        q, k_pool, v_pool, table, lens, key_start=key_start, window=window
    )
    expected = _expected(q, keys, values, lengths, starts, window)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("implementation", ["triton", "torch"])
def test_bad_masks_are_refused_by_name(implementation) -> None:
    run = _implementation(implementation)
    q = torch.zeros(2, 4, 1, 16, device=DEVICE)
    pool = torch.zeros(6, 16, 2, 16, device=DEVICE)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20, 3], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([20, 0], device=DEVICE)
    run(q, pool, pool, table, lens, key_start=starts, window=1)  # the good call
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        run(q, pool, pool, table, lens, window=0)
    with pytest.raises(ValueError, match="window must be a positive int, got -3"):
        run(q, pool, pool, table, lens, window=-3)
    with pytest.raises(TypeError, match="window must be an int, got bool True"):
        run(q, pool, pool, table, lens, window=True)
    with pytest.raises(TypeError, match="window must be an int, got float 2.5"):
        run(q, pool, pool, table, lens, window=2.5)
    with pytest.raises(TypeError, match="key_start must be an integer tensor, got dtype"):
        run(q, pool, pool, table, lens, key_start=starts.float())
    with pytest.raises(TypeError, match="key_start must be a torch.Tensor, got list"):
        run(q, pool, pool, table, lens, key_start=[20, 0])
    with pytest.raises(ValueError, match=r"key_start must have shape \(B,\) = \(2,\), got"):
        run(q, pool, pool, table, lens, key_start=starts[:, None])
    with pytest.raises(ValueError, match="key_start must have B = 2 rows"):
        run(q, pool, pool, table, lens, key_start=starts[:1])
    with pytest.raises(ValueError, match="key_start must be on q's device"):
        run(q, pool, pool, table, lens, key_start=starts.to("meta"))
    between = "key_start must lie between 0 and seq_lens"
    with pytest.raises(ValueError, match=between + r" .* got \[21, 0\] with seq_lens \[20, 3\]"):
        run(q, pool, pool, table, lens, key_start=torch.tensor([21, 0], device=DEVICE))
    with pytest.raises(ValueError, match=between + r" .* got \[0, -1\]"):
        run(q, pool, pool, table, lens, key_start=torch.tensor([0, -1], device=DEVICE))
