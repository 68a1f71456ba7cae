"""Paged attention in plain torch: the paged kernel's twin, and its checks.

A serving engine keeps the keys and values of every sequence in fixed-size
blocks of one pool, ``k_pool`` and ``v_pool`` (num_blocks, block_size, H_kv,
d), and a block table per sequence: ``block_table[b, j]`` is the pool block
that holds positions ``j * block_size`` .. ``(j + 1) * block_size - 1`` of
sequence b. ``seq_lens[b]`` positions of sequence b are valid; its queries
``q[b]`` (H, T_q, d) are its last T_q positions, so query i sits at position
``seq_lens[b] - T_q + i`` and sees keys 0 .. that position (causal, aligned
bottom-right to each sequence's own length).

Two optional masks narrow what a query sees. ``key_start`` (B,) hides the
first ``key_start[b]`` positions of sequence b (a left-padded batch: they
are pads), so query i sees keys ``key_start[b]`` .. its position.
``window`` (a positive int) keeps a query's ``window`` newest keys, itself
included: the query at position p sees keys j with ``p - j < window``
(Mistral's sliding window, as in :class:`mha.backends.Masking`). With both,
a query sees keys ``max(key_start[b], p - window + 1)`` .. p. A query that
sees no key (one that stands on a pad) gets zeros.

:func:`paged_attention_torch` gathers each sequence's keys and values out
of the pool (zeros past its length, whatever the pool holds there) and
takes a masked softmax: plain torch, importable without
Triton, the reference that :func:`mha.kernels.triton_paged_attention`
(which reads the blocks where they are) is tested against.
:func:`check_paged_inputs` is the one check of the arguments for both.
:func:`page_index` says where each row's positions lie in a pool: the one
gather out of a pool, for this function, :class:`mha.PagedKVCache` and the
serving engine.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._validate import check_int, check_same, check_scale, check_tensor

__all__ = ["paged_attention_torch", "check_paged_inputs", "page_index"]


def paged_attention_torch(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
    key_start: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    """Attention of each sequence's last T_q queries over its paged keys.

    Args:
        q: (B, H, T_q, d), the last T_q positions of each sequence.
        k_pool, v_pool: (num_blocks, block_size, H_kv, d), H_kv dividing H
            (query head h reads key/value head ``h // (H / H_kv)``).
        block_table: (B, max_blocks) integers, pool blocks in order.
        seq_lens: (B,) integers, T_q <= seq_lens[b] <= max_blocks *
            block_size: the valid positions of each sequence, the T_q
            queries included.
        scale: default ``1 / sqrt(d)``.
        key_start: (B,) integers on q's device, 0 <= key_start[b] <=
            seq_lens[b], or None: sequence b's positions 0 ..
            key_start[b] - 1 are padding, hidden from its queries.
        window: a positive int, or None: the query at position p sees only
            keys j with ``p - j < window`` (its ``window`` newest keys).

    Returns:
        (B, H, T_q, d) in q's dtype; zeros for a query that sees no key.
    """
    scale = check_paged_inputs(
        q,
        k_pool,
        v_pool,
        block_table,
        seq_lens,
        scale,
        key_start=key_start,
        window=window,
    )
    (batch, heads, t_q, _), (block_size, kv_heads) = q.shape, k_pool.shape[1:3]
    if batch == 0:  # no sequence: nothing to read
        return q.clone()
    length = int(seq_lens.max())
    positions = torch.arange(length, device=q.device)  # (L,)
    blocks, slots, real = page_index(block_table, block_size, length, seq_lens)
    real = real[:, None, :, None]  # (B, 1, L, 1)
    # slots past a length may hold anything (NaN): zeros
    k = k_pool[blocks, slots].permute(0, 2, 1, 3).where(real, 0.0)
    v = v_pool[blocks, slots].permute(0, 2, 1, 3).where(real, 0.0)
    # (B, H_kv, L, d)
    group = heads // kv_heads
    k = k.repeat_interleave(group, dim=1)  # (B, H, L, d)
    v = v.repeat_interleave(group, dim=1)
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = (
        q.to(acc) @ k.to(acc).transpose(-1, -2)
    ) * scale  # (B, H, T_q, L)
    lens = seq_lens.long()[:, None, None, None]  # (B, 1, 1, 1)
    own = (
        lens - t_q + torch.arange(t_q, device=q.device)[:, None]
    )  # (B,1,T_q,1)
    keep = (positions <= own) & (positions < lens)  # (B, 1, T_q, L)
    if key_start is not None:  # left padding: pads hidden
        keep = keep & (positions >= key_start.long()[:, None, None, None])
    if window is not None:  # the window newest keys, the query's own included
        keep = keep & (own - positions < window)
    scores = scores.masked_fill(~keep, -math.inf)
    top = scores.amax(dim=-1, keepdim=True)
    top = top.masked_fill(top == -math.inf, 0.0)  # a query that sees no key
    weights = torch.exp(scores - top)  # (B, H, T_q, L)
    total = weights.sum(dim=-1, keepdim=True)
    out = (weights / total.masked_fill(total == 0, 1.0)) @ v.to(acc)
    return out.to(q.dtype)


def page_index(
    block_table: Tensor,
    block_size: int,
    longest: int,
    lengths: Tensor | None = None,
    *,
    right_aligned: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Where ``longest`` positions of each row lie in a pool: ``blocks``
    and ``slots`` (B, L), so that ``pool[blocks, slots]`` is (B, L, H_kv,
    d), and ``real`` (B, L), True at a position the row holds.

    Positions 0 .. L - 1 of every row; ``lengths`` (B,): row b holds
    ``lengths[b]`` of them (None: all L). ``right_aligned``: each row's
    last ``lengths[b]`` positions end at index L - 1, shorter rows padded
    on the left (their newest key last, as a backend takes a left-padded
    batch). The index is made once and serves every layer's pools.
    """
    at = torch.arange(longest, device=block_table.device)[None, :]  # (1, L)
    at = at.expand(block_table.shape[0], longest)  # (B, L)
    if lengths is None:
        real = torch.ones_like(at, dtype=torch.bool)
    elif right_aligned:  # the first longest - lengths[b] slots: pads
        at = at - (longest - lengths.long()[:, None])
        real = at >= 0
    else:
        real = at < lengths.long()[:, None]
    at = at.clamp(0, block_table.shape[1] * block_size - 1)
    blocks = block_table.gather(1, at // block_size).long()  # (B, L)
    # entries past a row's length may name any block, or none: block 0
    return blocks.where(real, 0), at % block_size, real


def check_paged_inputs(
    q,
    k_pool,
    v_pool,
    block_table,
    seq_lens,
    scale,
    *,
    key_start=None,
    window=None,
    read_values=True,
):
    """The paged kernels' requirements, each with a clear error; the scale.

    Reads ``seq_lens``, ``key_start`` and the used entries of
    ``block_table`` on the host, to refuse a length or a block the pool
    does not hold (on a GPU, a wrong index would read memory that is not
    the cache's) and a key start past its sequence's length. ``window``
    must be a positive int (``bool`` is not one) or None.
    ``read_values=False``: shapes, dtypes and devices only, for a caller
    that built the table and the lengths itself (:class:`mha.PagedKVCache`
    through :func:`mha.backends.attend`), which a read would only slow.
    """
    check_tensor("q", q, ndim=4, shape="(B, H, T_q, d)")
    pools = "(num_blocks, block_size, H_kv, d)"
    check_tensor("k_pool", k_pool, ndim=4, shape=pools)
    check_tensor("v_pool", v_pool, ndim=4, shape=pools)
    check_same("q, k_pool and v_pool", (q, k_pool, v_pool))
    (batch, heads, t_q, d), kv_heads = q.shape, k_pool.shape[2]
    num_blocks, block_size = k_pool.shape[:2]
    if v_pool.shape != k_pool.shape or k_pool.shape[3] != d:
        raise ValueError(
            f"k_pool and v_pool must both have shape {pools} with q's "
            f"d = {d}, got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}"
        )
    if min(k_pool.shape) == 0 or t_q == 0 or heads % kv_heads:
        raise ValueError(
            "the pools must hold a block of a slot, q a query, and H_kv "
            f"must divide H, got q {tuple(q.shape)}, pools "
            f"{tuple(k_pool.shape)}"
        )
    table_shape = "(B, max_blocks)"
    check_tensor(
        "block_table", block_table, kind="integer", ndim=2, shape=table_shape
    )
    check_tensor("seq_lens", seq_lens, kind="integer", ndim=1, shape="(B,)")
    given = [("block_table", block_table), ("seq_lens", seq_lens)]
    if key_start is not None:
        check_tensor(
            "key_start",
            key_start,
            kind="integer",
            ndim=1,
            shape=f"(B,) = ({batch},)",
        )
        given.append(("key_start", key_start))
    if window is not None:
        check_int("window", window)
    for name, t in given:
        if t.shape[0] != batch:
            raise ValueError(
                f"{name} must have B = {batch} rows (q's), got shape "
                f"{tuple(t.shape)}"
            )
        if t.device != q.device:
            raise ValueError(
                f"{name} must be on q's device ({q.device}), got {t.device}"
            )
    if not read_values:
        return check_scale(scale, d)
    lens = seq_lens.cpu()
    capacity = block_table.shape[1] * block_size
    if (lens < t_q).any() or (lens > capacity).any():
        raise ValueError(
            f"seq_lens must lie between T_q = {t_q} (they count the "
            f"queries) and max_blocks * block_size = {capacity}, got "
            f"{lens.tolist()}"
        )
    if key_start is not None:
        starts = key_start.cpu()
        if (starts < 0).any() or (starts > lens).any():
            raise ValueError(
                "key_start must lie between 0 and seq_lens (a sequence's "
                f"pads precede its keys), got {starts.tolist()} with "
                f"seq_lens {lens.tolist()}"
            )
    reached = -(-lens[:, None] // block_size)  # (B, 1): blocks in use
    used = torch.arange(block_table.shape[1])[None, :] < reached
    blocks = block_table.cpu()[used]  # the entries the lengths reach
    if len(blocks) and (blocks.min() < 0 or blocks.max() >= num_blocks):
        raise ValueError(
            f"block_table must hold pool blocks 0 .. {num_blocks - 1} where "
            f"seq_lens reach, got {blocks.min().item()} .. "
            f"{blocks.max().item()}"
        )
    return check_scale(scale, d)
