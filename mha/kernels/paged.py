"""Paged attention in Triton: keys and values read through the block table.

Import :mod:`mha.kernels` (which decides between the compiled kernels and
Triton's CPU interpreter) rather than this module directly. The layout and
the semantics are those of :mod:`mha.kernels.paged_torch`: pools
(num_blocks, block_size, H_kv, d), a block table (B, max_blocks), lengths
(B,), queries (B, H, T_q, d) that are each sequence's last T_q positions,
causal aligned bottom-right to each sequence's own length, and the two
optional masks: ``key_start`` (B,), the pads of a left-padded batch hidden,
and ``window``, a sliding window of the newest keys.

One program takes one tile of rows of one (sequence, key/value head) and
one range ("split") of that sequence's keys. The rows pack the query heads
that share the key/value head: row r is query ``r % T_q`` of head ``kv * G
+ r // T_q`` (G = H / H_kv), so a decoding step (T_q = 1) fills a tile with
the G heads of a group instead of one query and fifteen rows of padding,
and each key tile is loaded once for the whole group. The key tile's
addresses are gathered: key position j lives in pool block
``block_table[b, j // block_size]``, slot ``j % block_size``; nothing is
copied out of the pool. Each split writes its softmax output and
logsumexp, and the splits are merged as in the split-KV kernel
(:func:`mha.kernels.attention.merge_partials`): a decoding step is split
over the blocks, a chunk after a cache is one split or several.

The masks follow the dense kernels of :mod:`mha.kernels.attention`: without
them the kernel is compiled without their code (``HAS_KEY_START`` and
``HAS_WINDOW`` are constexprs; the key starts are a pointer and the window a
runtime int, passed only with them). The key tiles that lie wholly before
``key_start[b]``, or wholly before the window of every row of the program's
tile, are skipped: the loop over a split's keys starts at the later of the
split's first key and that bound (rounded down to a key tile), and the keys
before it are never loaded. Within the loop each row keeps the keys j with
``key_start[b] <= j`` and ``p - j < window``, p its position. A row that
sees no key gets zeros and a logsumexp of -inf, never NaN; so does a split
that holds none of a row's keys, and the merge gives such a split no weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._validate import check_int
from . import MAX_HEAD_DIM
from .attention import (
    Launch,
    check_runs_here,
    finish_rows,
    merge_partials,
    multiprocessors,
    online_step,
)
from .paged_torch import check_paged_inputs
from .tiles import (
    Tiles,
    capability_of,
    default_num_splits,
    default_tiles,
    padded_head_dim,
    split_sizes,
)

__all__ = ["paged_forward", "paged_launch", "triton_paged_attention"]


@triton.jit
def _paged_kernel(
    Q, KPool, VPool, BlockTable, SeqLens, Partial, PartialLSE,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kn, stride_ks, stride_kh, stride_kd,  # pool: block, slot, head, d
    stride_vn, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tj,  # block table: sequence, block
    num_kv_heads, group, t_q, keys_per_split, scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, PADDED_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    KeyStart=None, HAS_KEY_START: tl.constexpr = False,  # (B,) int32
    window=None, HAS_WINDOW: tl.constexpr = False,  # a positive int
):  # fmt: skip
    """One program: rows (heads of a group x queries) against one split."""
    split, r_block, batch_kv = (
        tl.program_id(0),
        tl.program_id(1),
        tl.program_id(2),
    )
    num_splits = tl.num_programs(0)
    b, kv = batch_kv // num_kv_heads, batch_kv % num_kv_heads
    seq_len = tl.load(SeqLens + b)
    num_rows = group * t_q
    r = r_block * BLOCK_Q + tl.arange(0, BLOCK_Q)  # packed rows
    head, query = kv * group + r // t_q, r % t_q
    dims = tl.arange(0, PADDED_DIM)
    real = (r[:, None] < num_rows) & (dims[None, :] < HEAD_DIM)
    q_tile = (Q + b * stride_qb + head[:, None] * stride_qh
              + query[:, None] * stride_qt
              + dims[None, :] * stride_qd)  # fmt: skip
    q = tl.load(q_tile, real, 0.0)  # (B_q, d)
    position = seq_len - t_q + query  # each row's own position
    start = split * keys_per_split
    stop = tl.minimum(seq_len, start + keys_per_split)
    floor = 0  # no row of the tile sees a key before it
    if HAS_KEY_START:  # left padding: pads hidden
        key_start = tl.load(KeyStart + b)
        floor = key_start
    if HAS_WINDOW:  # the window of the tile's earliest row
        first_query = (r_block * BLOCK_Q) % t_q
        # the tile's rows run on to the next head's query 0, or stay in one
        lowest = tl.where(first_query + BLOCK_Q > t_q, 0, first_query)
        floor = tl.maximum(floor, seq_len - t_q + lowest - window + 1)
    if HAS_KEY_START or HAS_WINDOW:  # key tiles before the floor: skipped
        start = tl.maximum(start, tl.maximum(floor, 0) // BLOCK_K * BLOCK_K)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    ell = tl.full([BLOCK_Q], 0.0, tl.float32)
    acc = tl.full([BLOCK_Q, PADDED_DIM], 0.0, tl.float32)
    table = BlockTable + b * stride_tb
    for first in range(start, stop, BLOCK_K):
        cols = first + tl.arange(0, BLOCK_K)  # key positions
        visible = cols < stop
        # the table is read up to the length (its entries there are checked
        # pool blocks): masking this load by the floor too made ptxas spill
        block = tl.load(table + (cols // BLOCK_SIZE) * stride_tj, visible, 0)
        if HAS_KEY_START or HAS_WINDOW:  # hidden from every row: not loaded
            visible = visible & (cols >= floor)
        slot = cols % BLOCK_SIZE
        exists = visible[:, None] & (dims[None, :] < HEAD_DIM)
        k_tile = (KPool + block[:, None] * stride_kn
                  + slot[:, None] * stride_ks + kv * stride_kh
                  + dims[None, :] * stride_kd)  # fmt: skip
        v_tile = (VPool + block[:, None] * stride_vn
                  + slot[:, None] * stride_vs + kv * stride_vh
                  + dims[None, :] * stride_vd)  # fmt: skip
        k = tl.load(k_tile, exists, 0.0)  # (B_k, d), gathered from the pool
        v = tl.load(v_tile, exists, 0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        keep = visible[None, :] & (cols[None, :] <= position[:, None])
        if HAS_WINDOW:  # each row's own window: p - j < window
            keep = keep & (position[:, None] - cols[None, :] < window)
        scores = tl.where(keep, scores, float("-inf"))  # (B_q, B_k)
        m, ell, acc = online_step(
            m, ell, acc, scores, v, scale, PRECISION, False
        )
    out, logsumexp = finish_rows(m, ell, acc, False)
    part = batch_kv * num_splits + split  # partial[b, kv, split]
    out_tile = (Partial + part * num_rows * HEAD_DIM + r[:, None] * HEAD_DIM
                + dims[None, :])  # fmt: skip
    tl.store(out_tile, out, real)
    tl.store(PartialLSE + part * num_rows + r, logsumexp, r < num_rows)


def paged_launch(
    q, k_pool, v_pool, block_table, seq_lens, partial, partial_lse, *,
    scale, tiles, keys_per_split, key_start=None, window=None,
):  # fmt: skip
    """The paged kernel's launch: one program per (split, row tile, b,
    kv); ``partial`` is (B, H_kv, splits, G * T_q, d) float32;
    ``key_start`` (B,) int32 or None (no padding); ``window`` a positive
    int or None (no sliding window)."""
    (batch, heads, t_q, d), (block_size, kv_heads) = q.shape, k_pool.shape[1:3]
    group, splits = heads // kv_heads, partial.shape[2]
    grid = (splits, triton.cdiv(group * t_q, tiles.block_q), batch * kv_heads)
    args = (
        q, k_pool, v_pool, block_table, seq_lens, partial, partial_lse,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *block_table.stride(),
        kv_heads, group, t_q, keys_per_split, scale,
    )  # fmt: skip
    constants = {
        "BLOCK_SIZE": block_size,
        "BLOCK_Q": tiles.block_q,
        "BLOCK_K": tiles.block_k,
        "HEAD_DIM": d,
        "PADDED_DIM": padded_head_dim(d),
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
        "enable_fp_fusion": True,  # as the dense kernels (attention.py)
    }
    if key_start is not None:
        constants.update(KeyStart=key_start, HAS_KEY_START=True)
    if window is not None:
        constants.update(window=window, HAS_WINDOW=True)
    return Launch(_paged_kernel, grid, args, constants)


def paged_forward(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    key_start: Tensor | None = None,
    window: int | None = None,
    max_seq_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The paged kernel and the merge of its splits: ``(out, logsumexp)``,
    (B, H, T_q, d) in q's dtype and (B, H, T_q) float32; a query that sees
    no key gets zeros and a logsumexp of -inf. ``key_start``, ``window``
    and ``max_seq_len``: as in :func:`triton_paged_attention`."""
    scale = check_paged_inputs(
        q, k_pool, v_pool, block_table, seq_lens, scale,
        key_start=key_start, window=window,
        read_values=max_seq_len is None,
    )  # fmt: skip
    _check_backend(q)
    (batch, heads, t_q, d), kv_heads = q.shape, k_pool.shape[2]
    if max_seq_len is not None:
        max_seq_len = check_int("max_seq_len", max_seq_len)
    if batch == 0:  # no sequence: nothing to read
        return q.clone(), q.new_empty(q.shape[:3], dtype=torch.float32)
    group = heads // kv_heads
    tiles: Tiles = default_tiles("paged", d, q.dtype, capability_of(q.device))
    longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    if num_splits is None:
        programs = batch * kv_heads * triton.cdiv(group * t_q, tiles.block_q)
        num_splits = default_num_splits(
            programs, longest, tiles.block_k, multiprocessors(q.device)
        )
    keys_per_split, splits = split_sizes(longest, num_splits, tiles.block_k)
    partial = torch.empty(
        (batch, kv_heads, splits, group * t_q, d),
        dtype=torch.float32,
        device=q.device,
    )
    partial_lse = torch.empty(
        partial.shape[:-1], dtype=torch.float32, device=q.device
    )
    # the kernel reads the lengths at SeqLens + b: contiguous
    table = block_table.to(torch.int32)
    lens = seq_lens.to(torch.int32).contiguous()
    if key_start is not None:
        key_start = key_start.to(torch.int32).contiguous()
    with torch.no_grad():
        paged_launch(
            q, k_pool, v_pool, table, lens, partial, partial_lse,
            scale=scale, tiles=tiles, keys_per_split=keys_per_split,
            key_start=key_start, window=window,
        )()  # fmt: skip
        out, logsumexp = merge_partials(partial, partial_lse)
    # (B, H_kv, G * T_q, d) -> (B, H, T_q, d): head kv * G + g
    out = out.reshape(batch, heads, t_q, d)
    return out.to(q.dtype), logsumexp.reshape(batch, heads, t_q)


def triton_paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
    key_start: Tensor | None = None,
    window: int | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """Attention of each sequence's last T_q queries over its paged keys.

    The arguments and the result of
    :func:`mha.kernels.paged_torch.paged_attention_torch`, ``key_start``
    (left padding) and ``window`` (a sliding window) included; the blocks
    are read where they are in the pools. Forward only (no gradient).
    ``max_seq_len``: the longest of ``seq_lens``, where the caller knows
    it (as flash-attention's ``max_seqlen_k``): then nothing is read from
    the device, and the lengths, key starts and table are trusted, not
    checked.
    """
    out, _ = paged_forward(
        q, k_pool, v_pool, block_table, seq_lens, scale=scale,
        key_start=key_start, window=window, max_seq_len=max_seq_len,
    )  # fmt: skip
    return out


def _check_backend(q: Tensor) -> None:
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(
            f"q, k_pool and v_pool must be float32, float16 or bfloat16, got "
            f"{q.dtype}"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(
            f"d (the last dimension of q) must be at most {MAX_HEAD_DIM}, "
            f"got {q.shape[-1]}"
        )
    check_runs_here(q)
