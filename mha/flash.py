"""Tiled attention with the online softmax: FlashAttention's algorithm.

The textbook computes all ``T_q x T_k`` scores, their softmax, then the
weighted values: memory that grows as ``T^2``. The tiled form walks over
blocks of keys for one block of queries at a time and keeps, per query, only
a running maximum ``m``, a running sum of exponentials ``ell`` and a running
weighted sum of values ``acc`` (the *online softmax* of Milakov and
Gimelshein, 2018). When a new block raises the maximum, what was summed so far
is rescaled by ``exp(m_old - m_new)``. No more than one ``(block_q, block_k)``
tile of scores exists at any time (Dao et al., 2022; 2023).

* :func:`flash_attention` - the forward pass in NumPy; returns the output and
  the row logsumexp ``m + log(ell)``, the one number per query that the
  backward pass needs.
* :func:`flash_attention_backward` - the gradients in NumPy, recomputing each
  tile of weights from the logsumexp instead of storing them.
* :func:`flash_attention_torch` - the same two passes in PyTorch, tied
  together by :class:`FlashAttention`, a ``torch.autograd.Function``.
* :func:`split_kv_attention` - the keys split among several passes whose
  partial outputs merge by their logsumexps ("Flash-Decoding"): how a GPU
  keeps busy when a few queries meet a long cache.
* :func:`tile_schedule` - which tiles a pass visits (causal attention skips
  the tiles above the diagonal).

Causal attention is aligned *bottom-right*, as the flash-attn library does:
query ``i`` of ``T_q`` sees keys ``0 .. i + T_k - T_q``, so the last query
sees every key. That is what the ``T_q`` newest tokens need when the first
``T_k - T_q`` keys come from a cache (one decoding step, a chunk of a long
prompt); it equals the top-left mask of ``F.scaled_dot_product_attention``'s
``is_causal`` when ``T_q = T_k``. With ``T_q > T_k`` the first ``T_q - T_k``
queries see no key at all: their output is zero and their logsumexp
``-inf``.

Learned attention sinks (gpt-oss): ``sinks``, one logit per head, is one
more term in every row's softmax that brings no value; the online softmax
starts from it (``m = sink``, ``ell = 1``, ``acc = 0``).

Keys and values may have fewer heads than the queries (grouped-query and
multi-query attention): with ``H`` query heads and ``H_kv`` key/value heads,
``H_kv`` dividing ``H``, query head ``h`` reads key/value head
``h // (H / H_kv)``. The code never copies k and v per query head: it views
q as ``(..., H_kv, G, T_q, d_k)`` with ``G = H / H_kv`` and lets each
key/value head broadcast over its group of ``G`` query heads.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray
from torch import Tensor

from ._validate import (
    check_int,
    check_key_start,
    check_same,
    check_scale,
    check_tensor,
    check_window,
)
from .reference import check_attention_inputs

__all__ = [
    "DEFAULT_BLOCK",
    "flash_attention",
    "flash_attention_backward",
    "split_kv_attention",
    "merge_partials",
    "tile_schedule",
    "group_heads",
    "fused_forward_bytes",
    "FlashAttention",
    "flash_attention_torch",
]

Array = NDArray[np.floating]

#: Default number of queries and of keys in one tile.
DEFAULT_BLOCK = 64


def group_heads(q, k, v):
    """Views in which each key/value head serves its group of query heads.

    q (..., H, T_q, d_k) becomes (..., H_kv, G, T_q, d_k) with ``G = H /
    H_kv``; k and v (..., H_kv, T_k, d) become (..., H_kv, 1, T_k, d), so
    that ``q @ k^T`` broadcasts each key/value head over its ``G`` query
    heads, ``einsum('...kgqd,...kxsd->...kgqs')``. Query head ``h = kv * G +
    g`` reads key/value head ``kv = h // G``: the order of ``transformers``'
    ``repeat_kv``. Equal head counts give ``G = 1``. Works on NumPy arrays
    and torch tensors alike, and copies nothing.

    Returns:
        ``(q, k, v, grouped)``; ``grouped`` is False when k and v were not
        grouped (equal head counts, or leading axes that merely broadcast).
    """
    h_q = q.shape[-3] if q.ndim >= 3 else 1
    h_kv = k.shape[-3] if k.ndim >= 3 else 1
    grouped = q.ndim >= 3 and k.ndim >= 3 and h_q != h_kv
    grouped = grouped and h_kv > 0 and h_q % h_kv == 0
    q = group_queries(q, h_kv if grouped else None)
    return q, k[..., None, :, :], v[..., None, :, :], grouped


def group_queries(x, num_kv_heads: int | None):
    """(..., H, T, d) -> (..., H_kv, H / H_kv, T, d), a view.

    ``num_kv_heads=None``: (..., H, 1, T, d), a group of one.
    """
    if num_kv_heads is None:
        return x[..., None, :, :]
    groups = (num_kv_heads, x.shape[-3] // num_kv_heads)
    return x.reshape(tuple(x.shape[:-3]) + groups + tuple(x.shape[-2:]))


def ungroup_heads(x, grouped: bool):
    """The inverse of :func:`group_queries`: (..., H_kv, G, T, d) -> (..., H,
    T, d), or (..., 1, T, d) -> (..., T, d) when not ``grouped``."""
    if not grouped:
        return x[..., 0, :, :]
    return x.reshape(tuple(x.shape[:-4]) + (-1,) + tuple(x.shape[-2:]))


def sink_rows(sinks, q, grouped: bool):
    """(H,) sink logits shaped as the grouped queries' rows: (H_kv, G, 1),
    or (H, 1, 1), to broadcast over (..., H_kv, G, T_q)."""
    kv_heads = q.shape[-4] if grouped else None
    return group_queries(sinks.reshape(-1, 1, 1), kv_heads)[..., 0]


def key_blocks(
    rows: slice, t_q: int, t_k: int, block_k: int, causal: bool
) -> Iterator[slice]:
    """The blocks of keys that the queries ``rows`` attend to.

    With ``causal``, the keys after the last query's own position
    (``rows.stop - 1 + T_k - T_q``, bottom-right aligned) are hidden from
    every query in the block: those tiles are skipped, not computed and
    masked.
    """
    stop = min(t_k, max(0, rows.stop + t_k - t_q)) if causal else t_k
    for start in range(0, stop, block_k):
        yield slice(start, min(start + block_k, stop))


def causal_keep(rows: slice, cols: slice, offset: int) -> NDArray[np.bool_]:
    """A (len(rows), len(cols)) tile of the causal mask: True = may attend.

    Query i sees key j when ``j <= i + offset``, ``offset = T_k - T_q``.
    """
    query = np.arange(rows.start, rows.stop)[:, None]
    key = np.arange(cols.start, cols.stop)[None, :]
    return key <= query + offset


def online_softmax(
    q_tile, k, v, rows, key_tiles, offset, causal, scale, sink=None
):
    """Stream key tiles past one query tile; their summaries ``(m, ell, acc)``.

    ``m`` is each query's running maximum, ``ell`` its sum of ``exp(score -
    m)`` and ``acc`` its sum of those exponentials times the values: after
    the last tile, ``acc / ell`` is the output and ``m + log(ell)`` the
    logsumexp. A query whose scores are all masked keeps ``m = -inf`` and
    ``ell = 0``. A learned ``sink`` logit (broadcastable to the rows) is one
    more term in ``ell`` with no value: the sums start at ``m = sink``,
    ``ell = exp(sink - m) = 1``, ``acc = 0``.
    """
    m = np.full(q_tile.shape[:-1], -np.inf, dtype=q_tile.dtype)  # (..., B_q)
    ell = np.zeros_like(m)  # running sum of exp(score - m)
    if sink is not None:  # the sink's column, before any key
        m = np.broadcast_to(sink, m.shape).astype(m.dtype)  # (..., B_q)
        ell = np.ones_like(m)  # exp(sink - m), and no value in acc
    acc = np.zeros(q_tile.shape[:-1] + v.shape[-1:], dtype=q_tile.dtype)
    for cols in key_tiles:
        k_tile, v_tile = k[..., cols, :], v[..., cols, :]  # (..., B_k, d)
        scores = q_tile @ np.swapaxes(k_tile, -1, -2) * scale
        if causal:  # hide the keys after each query
            keep = causal_keep(rows, cols, offset)
            scores = np.where(keep, scores, -np.inf)
        m_new = np.maximum(m, scores.max(axis=-1))  # (..., B_q)
        # a row with no visible key yet keeps m = -inf: exponentiate
        # against 0 there, so that exp(-inf - -inf) never makes a NaN
        m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
        rescale = np.exp(m - m_safe)  # brings old sums to the new max
        p = np.exp(scores - m_safe[..., None])  # (..., B_q, B_k)
        ell = rescale * ell + p.sum(axis=-1)
        acc = rescale[..., None] * acc + p @ v_tile  # (..., B_q, d_v)
        m = m_new
    return m, ell, acc


def finish(m, ell, acc):
    """Output ``acc / ell`` (0 where no key was visible) and logsumexp."""
    seen = ell > 0
    out = acc / np.where(seen, ell, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        logsumexp = np.where(
            seen, m + np.log(np.where(seen, ell, 1.0)), -np.inf
        )
    return out, logsumexp


def flash_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    causal: bool = False,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    scale: float | None = None,
    sinks: ArrayLike | None = None,
) -> tuple[Array, Array]:
    """softmax(q k^T * scale) v, one (block_q, block_k) tile at a time.

    Args:
        q: (..., H, T_q, d_k); k: (..., H_kv, T_k, d_k); v: (..., H_kv, T_k,
            d_v), with H_kv dividing H (query head h reads key/value head
            ``h // (H / H_kv)``); other leading axes broadcast.
        causal: bottom-right aligned: query i sees keys 0..i + T_k - T_q.
        block_q, block_k: queries and keys per tile; T need not be a multiple.
        scale: default ``1 / sqrt(d_k)``.
        sinks: (H,) learned sink logits (gpt-oss), one more term in each
            row's softmax that carries no value; None for none.

    Returns:
        ``(out, logsumexp)``: (..., H, T_q, d_v) and (..., H, T_q), where
        ``logsumexp[i] = log(sum_j exp(scores[i, j]))`` over the keys i sees
        (``-inf``, with a zero output row, where it sees none), the sink's
        ``exp(s_h)`` included in the sum.
    """
    q_shape = np.shape(q)
    q, k, v, scale, grouped = _check_numpy(q, k, v, scale)
    sink = None
    if sinks is not None:
        sinks = _check_sinks(sinks, q_shape, q.dtype)
        sink = sink_rows(sinks, q, grouped)  # (H_kv, G, 1) or (H, 1, 1)
    _check_blocks(block_q=block_q, block_k=block_k)
    t_q, t_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    out = np.empty(q.shape[:-1] + (d_v,), dtype=q.dtype)  # (..., T_q, d_v)
    logsumexp = np.empty(q.shape[:-1], dtype=q.dtype)  # (..., T_q)
    for q_start in range(0, t_q, block_q):
        rows = slice(q_start, min(q_start + block_q, t_q))
        key_tiles = key_blocks(rows, t_q, t_k, block_k, causal)
        summaries = online_softmax(
            q[..., rows, :],
            k,
            v,
            rows,
            key_tiles,
            t_k - t_q,
            causal,
            scale,
            sink,
        )
        out[..., rows, :], logsumexp[..., rows] = finish(*summaries)
    return ungroup_heads(out, grouped), ungroup_heads(
        logsumexp[..., None], grouped
    )[..., 0]


def flash_attention_backward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    out: ArrayLike,
    logsumexp: ArrayLike,
    d_out: ArrayLike,
    *,
    causal: bool = False,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    scale: float | None = None,
) -> tuple[Array, Array, Array]:
    """Gradients ``(dq, dk, dv)`` of ``sum(d_out * out)``, tile by tile.

    The weights of a tile are recomputed from the saved logsumexp,
    ``p = exp(scores - logsumexp)``, instead of being stored by the forward
    pass. With ``delta = rowsum(d_out * out)``, the softmax's gradient is
    ``d_scores = p * (d_out v^T - delta)``. With grouped heads, dk and dv
    sum over the query heads of each group.
    """
    q, k, v, scale, grouped = _check_numpy(q, k, v, scale)
    _check_blocks(block_q=block_q, block_k=block_k)
    out, logsumexp, d_out = _check_saved(q, v, grouped, out, logsumexp, d_out)
    t_q, t_k, offset = q.shape[-2], k.shape[-2], k.shape[-2] - q.shape[-2]
    delta = np.sum(d_out * out, axis=-1)  # (..., T_q)
    dq = np.zeros_like(q)  # (..., H_kv, G, T_q, d_k)
    dk, dv = np.zeros_like(k), np.zeros_like(v)  # (..., H_kv, 1, T_k, d)
    for q_start in range(0, t_q, block_q):
        rows = slice(q_start, min(q_start + block_q, t_q))
        q_tile, do_tile = q[..., rows, :], d_out[..., rows, :]
        for cols in key_blocks(rows, t_q, t_k, block_k, causal):
            k_tile, v_tile = k[..., cols, :], v[..., cols, :]  # (..., B_k, d)
            scores = q_tile @ np.swapaxes(k_tile, -1, -2) * scale
            if causal:
                keep = causal_keep(rows, cols, offset)
                scores = np.where(keep, scores, -np.inf)
            with np.errstate(invalid="ignore"):  # -inf - -inf: rows, no key
                p = np.exp(scores - logsumexp[..., rows, None])  # recomputed
            p = np.where(np.isneginf(scores), 0.0, p)
            dv_tile = np.swapaxes(p, -1, -2) @ do_tile  # (..., G, B_k, d_v)
            dv[..., cols, :] += dv_tile.sum(axis=-3, keepdims=True)
            dp = do_tile @ np.swapaxes(v_tile, -1, -2)  # (..., B_q, B_k)
            ds = p * (dp - delta[..., rows, None])  # d scores
            dq[..., rows, :] += ds @ k_tile * scale
            dk_tile = np.swapaxes(ds, -1, -2) @ q_tile * scale
            dk[..., cols, :] += dk_tile.sum(axis=-3, keepdims=True)
    return (
        ungroup_heads(dq, grouped),
        ungroup_heads(dk, False),
        ungroup_heads(dv, False),
    )


def split_kv_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    num_splits: int,
    causal: bool = False,
    block_k: int = DEFAULT_BLOCK,
    scale: float | None = None,
) -> tuple[Array, Array]:
    """:func:`flash_attention` with the keys cut into ``num_splits`` parts.

    Each part is an independent pass (on a GPU, its own programs) over its
    keys that returns a partial output and a partial logsumexp per query;
    :func:`merge_partials` merges them. All queries form one tile: meant for
    few queries and many keys, one decoding step. ``ceil(T_k / num_splits)``
    keys per split, so at most ``num_splits`` splits.

    Returns:
        ``(out, logsumexp)`` as :func:`flash_attention`.
    """
    q, k, v, scale, grouped = _check_numpy(q, k, v, scale)
    _check_blocks(block_k=block_k)
    check_int("num_splits", num_splits)
    t_q, t_k = q.shape[-2], k.shape[-2]
    chunk = math.ceil(t_k / num_splits)  # keys per split
    outs, logsumexps = [], []
    for start in range(0, t_k, chunk):  # on a GPU: side by side
        stop = min(start + chunk, t_k)
        key_tiles = [
            slice(j, min(j + block_k, stop))
            for j in range(start, stop, block_k)
        ]
        summaries = online_softmax(
            q, k, v, slice(0, t_q), key_tiles, t_k - t_q, causal, scale
        )
        out, logsumexp = finish(*summaries)  # the softmax over this split
        outs.append(out)  # (..., T_q, d_v)
        logsumexps.append(logsumexp)  # (..., T_q)
    out, logsumexp = merge_partials(np.stack(outs), np.stack(logsumexps))
    return ungroup_heads(out, grouped), ungroup_heads(
        logsumexp[..., None], grouped
    )[..., 0]


def merge_partials(outs: Array, logsumexps: Array) -> tuple[Array, Array]:
    """Merge the softmaxes of parts of the keys: (S, ..., T_q, d_v), (S, ...).

    Part s saw keys with logsumexp ``L_s`` and gave output ``o_s``; the
    softmax over all keys weighs each part by its share of the total,
    ``exp(L_s - L)``, with ``L = log(sum_s exp(L_s))``: the merge of two
    summaries in the online softmax, for any number of parts. A part that
    saw no key (``L_s = -inf``) weighs nothing.
    """
    top = logsumexps.max(axis=0)  # (..., T_q)
    top = np.where(np.isneginf(top), 0.0, top)  # every part empty: no NaN
    weights = np.exp(logsumexps - top)  # (S, ..., T_q)
    total = weights.sum(axis=0)
    out = (weights[..., None] * outs).sum(axis=0)
    out = out / np.where(total > 0, total, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        logsumexp = top + np.log(total)  # -inf where every part was empty
    return out, logsumexp


def tile_schedule(
    t_q: int,
    t_k: int,
    *,
    causal: bool = False,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
) -> NDArray[np.int8]:
    """Which tiles a pass computes: (query blocks, key blocks) of 0, 1 or 2.

    0 = skipped (every score of the tile is masked), 1 = computed whole, 2 =
    computed and masked in part (a tile that the causal diagonal crosses).
    """
    for name, value in (
        ("t_q", t_q),
        ("t_k", t_k),
        ("block_q", block_q),
        ("block_k", block_k),
    ):
        check_int(name, value)
    n_q, n_k = math.ceil(t_q / block_q), math.ceil(t_k / block_k)
    tiles = np.zeros((n_q, n_k), dtype=np.int8)
    for i, q_start in enumerate(range(0, t_q, block_q)):
        rows = slice(q_start, min(q_start + block_q, t_q))
        for cols in key_blocks(rows, t_q, t_k, block_k, causal):
            keep = causal_keep(rows, cols, t_k - t_q)
            whole = not causal or keep.all()
            tiles[i, cols.start // block_k] = 1 if whole else 2
    return tiles


def fused_forward_bytes(
    batch: int,
    heads: int,
    t_q: int,
    t_k: int,
    head_dim: int,
    *,
    kv_heads: int | None = None,
    block_q: int | None = None,
    bytes_per_element: int = 2,
) -> int:
    """Bytes a fused forward pass moves between main memory and the chip.

    Every query head reads its q rows and writes its output rows once. Each
    program (one query tile of one query head) streams all of its key/value
    head's k and v: with ``block_q`` given, nothing is shared between
    programs, so k and v are read ``ceil(T_q / block_q)`` times per query
    head; with ``block_q=None`` each key/value head is read once, the best a
    cache shared by the programs (the GPU's L2) can do. Non-causal.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    for name, value in (
        ("batch", batch),
        ("heads", heads),
        ("t_q", t_q),
        ("t_k", t_k),
        ("head_dim", head_dim),
        ("kv_heads", kv_heads),
        ("bytes_per_element", bytes_per_element),
    ):
        check_int(name, value)
    queries = 2 * heads * t_q * head_dim  # q read, output written
    if block_q is None:
        keys = 2 * kv_heads * t_k * head_dim  # k and v, once per head
    else:
        reads = math.ceil(t_q / check_int("block_q", block_q))
        keys = reads * 2 * heads * t_k * head_dim
    return batch * (queries + keys) * bytes_per_element


# ---------------------------------------------------------------------------
# The same algorithm in PyTorch, with a backward pass that autograd calls.


def _tiled_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    block_q: int,
    block_k: int,
    scale: float,
    key_start: Tensor | None = None,
    sink: Tensor | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`flash_attention` in torch; running sums in float32 or wider.

    q (..., G, T_q, d_k), k and v (..., 1, T_k, d): grouped heads;
    ``key_start`` (B,) int32 or None, B the first axis; ``sink`` the sink
    logits shaped by :func:`sink_rows`, or None; ``window`` a sliding
    window (each query's newest keys), or None.
    """
    t_q, t_k = q.shape[-2], k.shape[-2]
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty(
        q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device
    )
    logsumexp = torch.empty(q.shape[:-1], dtype=acc_dtype, device=q.device)
    for q_start in range(0, t_q, block_q):
        rows = slice(q_start, min(q_start + block_q, t_q))
        q_tile = q[..., rows, :]  # (..., B_q, d_k)
        m = torch.full(
            q_tile.shape[:-1], -math.inf, dtype=acc_dtype, device=q.device
        )  # (..., B_q)
        ell = torch.zeros_like(m)
        if sink is not None:  # the sink's column, before any key
            m = torch.maximum(m, sink.to(acc_dtype))  # (..., B_q): the sink
            ell = torch.ones_like(m)  # exp(sink - m), and no value in acc
        acc = torch.zeros(
            q_tile.shape[:-1] + v.shape[-1:], dtype=acc_dtype, device=q.device
        )  # (..., B_q, d_v)
        for cols in _in_window(
            key_blocks(rows, t_q, t_k, block_k, causal),
            rows,
            t_k - t_q,
            window,
        ):
            k_tile, v_tile = k[..., cols, :], v[..., cols, :]
            if key_start is not None:  # padding: hidden, and zeros
                visible = _visible_keys(key_start, cols, q.ndim)
                k_tile = k_tile.where(visible, 0.0)
                v_tile = v_tile.where(visible, 0.0)
            scores = (q_tile @ k_tile.transpose(-1, -2)).to(acc_dtype)
            scores = scores * scale  # (..., B_q, B_k)
            if causal or window is not None:
                keep = _keep_torch(
                    rows, cols, t_k - t_q, causal, window, q.device
                )
                scores = scores.masked_fill(~keep, -math.inf)
            if key_start is not None:  # (B, 1, .., 1, B_k) over the scores
                scores = scores.masked_fill(~visible.mT, -math.inf)
            m_new = torch.maximum(m, scores.amax(dim=-1))
            m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
            rescale = torch.exp(m - m_safe)
            p = torch.exp(scores - m_safe[..., None])  # (..., B_q, B_k)
            ell = rescale * ell + p.sum(dim=-1)
            pv = p.to(v.dtype) @ v_tile  # (..., B_q, d_v)
            acc = rescale[..., None] * acc + pv.to(acc_dtype)
            m = m_new
        seen = ell > 0  # False: the query saw no key (causal, or padding)
        out[..., rows, :] = (acc / ell.where(seen, 1.0)[..., None]).to(q.dtype)
        logsumexp[..., rows] = (m + torch.log(ell)).where(seen, -math.inf)
    return out, logsumexp


def _visible_keys(key_start: Tensor, cols: slice, ndim: int) -> Tensor:
    """(B, 1, ..., 1, B_k, 1) booleans: the keys ``cols`` that each row's
    queries may see (at or after its ``key_start``); ``ndim`` axes, as a
    key tile (B, H_kv, 1, B_k, d) has."""
    key = torch.arange(cols.start, cols.stop, device=key_start.device)
    visible = key[None, :] >= key_start[:, None]  # (B, B_k)
    shape = (visible.shape[0],) + (1,) * (ndim - 3) + (visible.shape[1], 1)
    return visible.reshape(shape)


def _keep_torch(
    rows: slice, cols: slice, offset: int, causal: bool, window, device
) -> Tensor:
    """:func:`causal_keep` built in torch on ``device`` (no host copy), and
    the window: query i sees keys j > i + offset - window."""
    query = torch.arange(rows.start, rows.stop, device=device)[:, None]
    key = torch.arange(cols.start, cols.stop, device=device)[None, :]
    keep = key <= query + offset if causal else key >= 0  # (B_q, B_k)
    if window is not None:
        keep = keep & (key > query + offset - window)
    return keep


def _in_window(blocks, rows: slice, offset: int, window) -> Iterator[slice]:
    """The key tiles of ``blocks`` that reach the window of the first query
    of ``rows``: the tiles wholly before it are skipped."""
    first = -1 if window is None else rows.start + offset - window + 1
    return (cols for cols in blocks if cols.stop > first)


def _tiled_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    d_out: Tensor,
    d_logsumexp: Tensor | None,
    causal: bool,
    block_q: int,
    block_k: int,
    scale: float,
    key_start: Tensor | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`flash_attention_backward` in torch, and the logsumexp's gradient.

    ``d logsumexp_i / d score_ij = p_ij``, so a gradient arriving at the
    logsumexp adds ``p * d_logsumexp`` to the scores' gradient. Grouped
    heads as in :func:`_tiled_forward`; dk and dv sum over each group.
    """
    t_q, t_k = q.shape[-2], k.shape[-2]
    acc_dtype = logsumexp.dtype
    delta = (d_out.to(acc_dtype) * out.to(acc_dtype)).sum(dim=-1)  # (..,T_q)
    if d_logsumexp is not None:  # zero where a query saw no key
        delta = delta - d_logsumexp.to(acc_dtype).nan_to_num(0.0)
    dq, dk, dv = (
        torch.zeros(t.shape, dtype=acc_dtype, device=t.device)
        for t in (q, k, v)
    )
    for q_start in range(0, t_q, block_q):
        rows = slice(q_start, min(q_start + block_q, t_q))
        q_tile, do_tile = q[..., rows, :], d_out[..., rows, :]
        for cols in _in_window(
            key_blocks(rows, t_q, t_k, block_k, causal),
            rows,
            t_k - t_q,
            window,
        ):
            k_tile, v_tile = k[..., cols, :], v[..., cols, :]
            if key_start is not None:  # padding: zeros, and no weight
                visible = _visible_keys(key_start, cols, q.ndim)
                k_tile = k_tile.where(visible, 0.0)
                v_tile = v_tile.where(visible, 0.0)
            scores = (q_tile @ k_tile.transpose(-1, -2)).to(acc_dtype) * scale
            p = torch.exp(scores - logsumexp[..., rows, None])  # recomputed
            if causal or window is not None:
                keep = _keep_torch(
                    rows, cols, t_k - t_q, causal, window, q.device
                )
                p = p.masked_fill(~keep, 0.0)
            if key_start is not None:
                p = p.masked_fill(~visible.mT, 0.0)
            dv_tile = p.transpose(-1, -2) @ do_tile.to(acc_dtype)
            dv[..., cols, :] += dv_tile.sum(dim=-3, keepdim=True)
            dp = (do_tile @ v_tile.transpose(-1, -2)).to(acc_dtype)
            ds = p * (dp - delta[..., rows, None])  # (..., B_q, B_k)
            dq[..., rows, :] += ds @ k_tile.to(acc_dtype) * scale
            dk_tile = ds.transpose(-1, -2) @ q_tile.to(acc_dtype) * scale
            dk[..., cols, :] += dk_tile.sum(dim=-3, keepdim=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttention(torch.autograd.Function):
    """Tiled attention for autograd, in O(T) memory.

    The forward pass saves q, k, v, the output and the logsumexp, never the
    (T_q, T_k) weights; the backward pass recomputes them tile by tile.
    """

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        causal,
        block_q,
        block_k,
        scale,
        key_start,
        sinks=None,
        window=None,
    ):
        *grouped_qkv, grouped = group_heads(q, k, v)
        sink = None
        if sinks is not None:
            sink = sink_rows(sinks, grouped_qkv[0], grouped)
        out, logsumexp = _tiled_forward(
            *grouped_qkv,
            causal,
            block_q,
            block_k,
            scale,
            key_start,
            sink,
            window,
        )
        out = ungroup_heads(out, grouped)  # (..., H, T_q, d_v)
        logsumexp = ungroup_heads(logsumexp[..., None], grouped)[..., 0]
        ctx.save_for_backward(q, k, v, out, logsumexp, sinks)
        ctx.settings = (causal, block_q, block_k, scale, key_start, window)
        return out, logsumexp

    @staticmethod
    def backward(ctx, d_out, d_logsumexp):
        q, k, v, out, logsumexp, sinks = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[8]:
            d_sinks = _sink_gradient(sinks, out, logsumexp, d_out, d_logsumexp)
        q, k, v, grouped = group_heads(q, k, v)
        h_kv = k.shape[-4] if grouped else None
        out, d_out = group_queries(out, h_kv), group_queries(d_out, h_kv)
        logsumexp = group_queries(logsumexp[..., None], h_kv)[..., 0]
        if d_logsumexp is not None:
            d_logsumexp = group_queries(d_logsumexp[..., None], h_kv)[..., 0]
        dq, dk, dv = _tiled_backward(
            q, k, v, out, logsumexp, d_out, d_logsumexp, *ctx.settings
        )
        grads = ungroup_heads(dq, grouped), dk[..., 0, :, :], dv[..., 0, :, :]
        return (*grads, None, None, None, None, None, d_sinks, None)


def _sink_gradient(
    sinks: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    d_out: Tensor,
    d_logsumexp: Tensor | None,
) -> Tensor:
    """d loss / d s_h: the sink's column has weight ``p = exp(s_h -
    logsumexp)`` and no value, so its score gradient is ``p (0 - delta)``
    with ``delta = sum(d_out * out)`` per row (minus the logsumexp's own
    gradient), summed over every row of head h. out (..., H, T_q, d_v)."""
    acc_dtype = logsumexp.dtype
    delta = (d_out.to(acc_dtype) * out.to(acc_dtype)).sum(
        dim=-1
    )  # (.., H, T_q)
    if d_logsumexp is not None:
        delta = delta - d_logsumexp.to(acc_dtype).nan_to_num(0.0)
    p_sink = torch.exp(sinks.to(acc_dtype)[:, None] - logsumexp)
    d_sink = -(p_sink * delta)  # (..., H, T_q)
    return d_sink.flatten(0, -3).sum(dim=(0, 2)).to(sinks.dtype)  # (H,)


def flash_attention_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    scale: float | None = None,
    key_start: Tensor | None = None,
    sinks: Tensor | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`flash_attention` for torch tensors, differentiable.

    Autograd runs :class:`FlashAttention`'s backward pass.

    Args:
        q: (..., H, T_q, d_k); k: (..., H_kv, T_k, d_k); v: (..., H_kv, T_k,
            d_v), H_kv dividing H; one device, one floating dtype, the same
            other leading axes.
        causal, block_q, block_k, scale: as in :func:`flash_attention`
            (``causal`` bottom-right aligned).
        key_start: None, or (B,) integers on q's device for q of shape (B,
            H, T_q, d_k): row b's keys 0..key_start[b] - 1 are padding (a
            left-padded batch, see
            :func:`mha.functional.key_start_from_attention_mask`), hidden
            from its queries and read as zeros; as the Triton kernels'
            ``key_start``. A query that sees no key gets zeros and a
            logsumexp of -inf.
        sinks: (H,) learned sink logits, differentiable, or None: as in
            :func:`flash_attention` (a query that sees no key then gets
            zeros and the logsumexp ``s_h``).
        window: a positive int, or None: query i sees only its ``window``
            newest keys (a sliding window, as the Triton kernels'
            ``window``); the key tiles before a query tile's window are
            skipped.

    Returns:
        ``(out, logsumexp)``: (..., H, T_q, d_v) in the inputs' dtype and
        (..., H, T_q) in float32 (float64 for float64 inputs).
    """
    scale = _check_torch(q, k, v, block_q, block_k, scale)
    key_start = check_key_start(key_start, q)
    window = check_window(window)
    if sinks is not None:
        check_tensor("sinks", sinks)
        _check_sinks(sinks, tuple(q.shape), None)
        check_same("q and sinks", (q, sinks))
    return FlashAttention.apply(
        q,
        k,
        v,
        bool(causal),
        block_q,
        block_k,
        scale,
        key_start,
        sinks,
        window,
    )


# ---------------------------------------------------------------------------
# Argument checks (see mha._validate).


def _check_blocks(**blocks: object) -> None:
    for name, value in blocks.items():
        check_int(name, value)


def _check_lengths(q_shape: tuple, k_shape: tuple) -> None:
    if q_shape[-2] == 0 or k_shape[-2] == 0:
        raise ValueError(
            "q and k must hold at least one position each, got shapes "
            f"{tuple(q_shape)} and {tuple(k_shape)}"
        )


def _check_head_counts(q_shape: tuple, k_shape: tuple, v_shape: tuple):
    """Key/value heads H_kv (axis -3) that divide the query heads H."""
    if min(len(q_shape), len(k_shape), len(v_shape)) < 3:
        return
    heads, kv_heads = q_shape[-3], k_shape[-3]
    if v_shape[-3] != kv_heads:
        raise ValueError(
            "k and v must have the same number of heads H_kv (axis -3), got "
            f"k {tuple(k_shape)} and v {tuple(v_shape)}"
        )
    if 1 in (heads, kv_heads) or heads % kv_heads == 0:
        return
    raise ValueError(
        "k and v must have a number of heads H_kv (axis -3) that divides "
        f"q's H, got H = {heads} (q {tuple(q_shape)}) and H_kv = {kv_heads} "
        f"(k {tuple(k_shape)})"
    )


def _check_numpy(q, k, v, scale):
    """Floating arrays of one dtype, grouped (:func:`group_heads`) and
    broadcast to common leading axes; the scale; whether heads are grouped.
    """
    q, k, v = (np.asarray(t) for t in (q, k, v))
    _check_head_counts(q.shape, k.shape, v.shape)
    grouped = False
    if min(q.ndim, k.ndim, v.ndim) >= 2:  # otherwise the check below says so
        q, k, v, grouped = group_heads(q, k, v)
    q, k, v, _ = check_attention_inputs(q, k, v, None)
    _check_lengths(q.shape, k.shape)
    scale = check_scale(scale, q.shape[-1])
    lead = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    dtype = np.result_type(q, k, v)
    q, k, v = (
        np.broadcast_to(t, lead + t.shape[-3:]).astype(dtype, copy=False)
        for t in (q, k, v)
    )
    return q, k, v, scale, grouped


def _check_sinks(sinks, q_shape: tuple, dtype):
    """(H,) finite logits, H the heads of q (..., H, T_q, d_k); as an array
    of ``dtype``, or the tensor itself."""
    if len(q_shape) < 3:
        raise ValueError(
            "sinks need a head axis: q must have shape (..., H, T_q, d_k), "
            f"got shape {tuple(q_shape)}"
        )
    is_tensor = isinstance(sinks, Tensor)
    array = sinks if is_tensor else np.asarray(sinks)
    if tuple(array.shape) != (q_shape[-3],):
        raise ValueError(
            f"sinks must have shape (H,) = ({q_shape[-3]},), one logit per "
            f"query head, got shape {tuple(array.shape)}"
        )
    if is_tensor:
        finite = bool(torch.isfinite(array).all())
    else:
        array = array.astype(dtype)
        finite = bool(np.isfinite(array).all())
    if not finite:
        raise ValueError("sinks must be finite logits, got inf or NaN")
    return array


def _check_saved(q, v, grouped, out, logsumexp, d_out):
    """``out``, ``d_out`` shaped as the output, ``logsumexp`` as its rows;
    returned grouped as ``q`` is."""
    rows = ungroup_heads(q[..., :1], grouped).shape[:-1]  # (..., H, T_q)
    expected = {
        "out": rows + v.shape[-1:],
        "d_out": rows + v.shape[-1:],
        "logsumexp": rows,
    }
    kv_heads = q.shape[-4] if grouped else None
    arrays = {"out": out, "logsumexp": logsumexp, "d_out": d_out}
    for name, value in arrays.items():
        array = np.asarray(value)
        if not np.issubdtype(array.dtype, np.floating):
            raise TypeError(
                f"{name} must be a floating-point array, got dtype "
                f"{array.dtype}"
            )
        if array.shape != expected[name]:
            raise ValueError(
                f"{name} must have shape {expected[name]}, got {array.shape}"
            )
        array = array.astype(q.dtype, copy=False)
        if name == "logsumexp":
            arrays[name] = group_queries(array[..., None], kv_heads)[..., 0]
        else:
            arrays[name] = group_queries(array, kv_heads)
    return arrays["out"], arrays["logsumexp"], arrays["d_out"]


def _check_torch(q, k, v, block_q, block_k, scale) -> float:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, min_ndim=2, shape="(..., T, d)")
    check_same("q, k and v", (q, k, v))
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(
            "q, k, v must have shapes (..., T_q, d_k), (..., T_k, d_k), "
            f"(..., T_k, d_v), got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if not q.shape[:-3] == k.shape[:-3] == v.shape[:-3] or q.ndim != k.ndim:
        raise ValueError(
            "q, k and v must have the same leading (batch) axes, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    _check_head_counts(q.shape, k.shape, v.shape)
    if q.ndim >= 3 and q.shape[-3] < k.shape[-3]:
        raise ValueError(
            f"k and v must not have more heads than q, got q {tuple(q.shape)} "
            f"and k {tuple(k.shape)}"
        )
    _check_blocks(block_q=block_q, block_k=block_k)
    _check_lengths(q.shape, k.shape)
    return check_scale(scale, q.shape[-1])
