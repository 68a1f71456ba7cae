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
* :func:`tile_schedule` - which tiles a pass visits (causal attention skips
  the tiles above the diagonal).

Causal attention is top-left aligned, as in
:func:`mha.reference.causal_mask` and ``F.scaled_dot_product_attention``:
query ``i`` sees keys ``0..i``. Every query therefore sees key 0, so no row is
ever empty.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray
from torch import Tensor

from ._validate import check_int, check_same, check_scale, check_tensor
from .reference import check_attention_inputs

__all__ = [
    "DEFAULT_BLOCK",
    "flash_attention",
    "flash_attention_backward",
    "tile_schedule",
    "FlashAttention",
    "flash_attention_torch",
]

Array = NDArray[np.floating]

#: Default number of queries and of keys in one tile.
DEFAULT_BLOCK = 64


def key_blocks(
    rows: slice, t_k: int, block_k: int, causal: bool
) -> Iterator[slice]:
    """The blocks of keys that the queries ``rows`` attend to.

    With ``causal``, keys after the block's last query are hidden from every
    query in it: those tiles are skipped, not computed and masked.
    """
    stop = min(t_k, rows.stop) if causal else t_k
    for start in range(0, stop, block_k):
        yield slice(start, min(start + block_k, stop))


def causal_keep(rows: slice, cols: slice) -> NDArray[np.bool_]:
    """The causal mask's (len(rows), len(cols)) tile: True = may attend."""
    query = np.arange(rows.start, rows.stop)[:, None]
    key = np.arange(cols.start, cols.stop)[None, :]
    return key <= query


def _causal_keep_torch(
    rows: slice, cols: slice, device: torch.device
) -> Tensor:
    """:func:`causal_keep` built in torch on ``device``: no host copy."""
    query = torch.arange(rows.start, rows.stop, device=device)[:, None]
    key = torch.arange(cols.start, cols.stop, device=device)[None, :]
    return key <= query  # (B_q, B_k)


def flash_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    causal: bool = False,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    scale: float | None = None,
) -> tuple[Array, Array]:
    """softmax(q k^T * scale) v, one (block_q, block_k) tile at a time.

    Args:
        q: (..., T_q, d_k); k: (..., T_k, d_k); v: (..., T_k, d_v).
        causal: query i attends to keys 0..i only.
        block_q, block_k: queries and keys per tile; T need not be a multiple.
        scale: default ``1 / sqrt(d_k)``.

    Returns:
        ``(out, logsumexp)``: (..., T_q, d_v) and (..., T_q), where
        ``logsumexp[i] = log(sum_j exp(scores[i, j]))`` over the keys i sees.
    """
    q, k, v, scale = _check_numpy(q, k, v, block_q, block_k, scale)
    t_q, t_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    out = np.empty(q.shape[:-1] + (d_v,), dtype=q.dtype)  # (..., T_q, d_v)
    logsumexp = np.empty(q.shape[:-1], dtype=q.dtype)  # (..., T_q)
    for q_start in range(0, t_q, block_q):
        rows = slice(q_start, min(q_start + block_q, t_q))
        q_tile = q[..., rows, :]  # (..., B_q, d_k)
        m = np.full(q_tile.shape[:-1], -np.inf, dtype=q.dtype)  # (..., B_q)
        ell = np.zeros_like(m)  # running sum of exp(score - m)
        acc = np.zeros(q_tile.shape[:-1] + (d_v,), dtype=q.dtype)
        for cols in key_blocks(rows, t_k, block_k, causal):
            k_tile, v_tile = k[..., cols, :], v[..., cols, :]  # (..., B_k, d)
            scores = q_tile @ np.swapaxes(k_tile, -1, -2) * scale
            if causal:  # hide the keys after each query
                scores = np.where(causal_keep(rows, cols), scores, -np.inf)
            m_new = np.maximum(m, scores.max(axis=-1))  # (..., B_q)
            rescale = np.exp(m - m_new)  # brings old sums to the new max
            p = np.exp(scores - m_new[..., None])  # (..., B_q, B_k)
            ell = rescale * ell + p.sum(axis=-1)
            acc = rescale[..., None] * acc + p @ v_tile  # (..., B_q, d_v)
            m = m_new
        out[..., rows, :] = acc / ell[..., None]
        logsumexp[..., rows] = m + np.log(ell)
    return out, logsumexp


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
    ``d_scores = p * (d_out v^T - delta)``.
    """
    q, k, v, scale = _check_numpy(q, k, v, block_q, block_k, scale)
    out, logsumexp, d_out = _check_saved(q, v, out, logsumexp, d_out)
    t_q, t_k = q.shape[-2], k.shape[-2]
    delta = np.sum(d_out * out, axis=-1)  # (..., T_q)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for q_start in range(0, t_q, block_q):
        rows = slice(q_start, min(q_start + block_q, t_q))
        q_tile, do_tile = q[..., rows, :], d_out[..., rows, :]
        for cols in key_blocks(rows, t_k, block_k, causal):
            k_tile, v_tile = k[..., cols, :], v[..., cols, :]  # (..., B_k, d)
            scores = q_tile @ np.swapaxes(k_tile, -1, -2) * scale
            if causal:
                scores = np.where(causal_keep(rows, cols), scores, -np.inf)
            p = np.exp(scores - logsumexp[..., rows, None])  # recomputed
            dv[..., cols, :] += np.swapaxes(p, -1, -2) @ do_tile
            dp = do_tile @ np.swapaxes(v_tile, -1, -2)  # (..., B_q, B_k)
            ds = p * (dp - delta[..., rows, None])  # d scores
            dq[..., rows, :] += ds @ k_tile * scale
            dk[..., cols, :] += np.swapaxes(ds, -1, -2) @ q_tile * scale
    return dq, dk, dv


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
        for cols in key_blocks(rows, t_k, block_k, causal):
            whole = not causal or causal_keep(rows, cols).all()
            tiles[i, cols.start // block_k] = 1 if whole else 2
    return tiles


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
) -> tuple[Tensor, Tensor]:
    """:func:`flash_attention` in torch; running sums in float32 or wider."""
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
        acc = torch.zeros(
            q_tile.shape[:-1] + v.shape[-1:], dtype=acc_dtype, device=q.device
        )  # (..., B_q, d_v)
        for cols in key_blocks(rows, t_k, block_k, causal):
            scores = (q_tile @ k[..., cols, :].transpose(-1, -2)).to(acc_dtype)
            scores = scores * scale  # (..., B_q, B_k)
            if causal:
                keep = _causal_keep_torch(rows, cols, q.device)
                scores = scores.masked_fill(~keep, -math.inf)
            m_new = torch.maximum(m, scores.amax(dim=-1))
            rescale = torch.exp(m - m_new)
            p = torch.exp(scores - m_new[..., None])  # (..., B_q, B_k)
            ell = rescale * ell + p.sum(dim=-1)
            pv = p.to(v.dtype) @ v[..., cols, :]  # (..., B_q, d_v)
            acc = rescale[..., None] * acc + pv.to(acc_dtype)
            m = m_new
        out[..., rows, :] = (acc / ell[..., None]).to(q.dtype)
        logsumexp[..., rows] = m + torch.log(ell)
    return out, logsumexp


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
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`flash_attention_backward` in torch, and the logsumexp's gradient.

    ``d logsumexp_i / d score_ij = p_ij``, so a gradient arriving at the
    logsumexp adds ``p * d_logsumexp`` to the scores' gradient.
    """
    t_q, t_k = q.shape[-2], k.shape[-2]
    acc_dtype = logsumexp.dtype
    delta = (d_out.to(acc_dtype) * out.to(acc_dtype)).sum(dim=-1)  # (..,T_q)
    if d_logsumexp is not None:
        delta = delta - d_logsumexp.to(acc_dtype)
    dq, dk, dv = (
        torch.zeros(t.shape, dtype=acc_dtype, device=t.device)
        for t in (q, k, v)
    )
    for q_start in range(0, t_q, block_q):
        rows = slice(q_start, min(q_start + block_q, t_q))
        q_tile, do_tile = q[..., rows, :], d_out[..., rows, :]
        for cols in key_blocks(rows, t_k, block_k, causal):
            k_tile, v_tile = k[..., cols, :], v[..., cols, :]
            scores = (q_tile @ k_tile.transpose(-1, -2)).to(acc_dtype) * scale
            if causal:
                keep = _causal_keep_torch(rows, cols, q.device)
                scores = scores.masked_fill(~keep, -math.inf)
            p = torch.exp(scores - logsumexp[..., rows, None])  # recomputed
            dv[..., cols, :] += p.transpose(-1, -2) @ do_tile.to(acc_dtype)
            dp = (do_tile @ v_tile.transpose(-1, -2)).to(acc_dtype)
            ds = p * (dp - delta[..., rows, None])  # (..., B_q, B_k)
            dq[..., rows, :] += ds @ k_tile.to(acc_dtype) * scale
            dk[..., cols, :] += (
                ds.transpose(-1, -2) @ q_tile.to(acc_dtype) * scale
            )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttention(torch.autograd.Function):
    """Tiled attention for autograd, in O(T) memory.

    The forward pass saves q, k, v, the output and the logsumexp, never the
    (T_q, T_k) weights; the backward pass recomputes them tile by tile.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, block_q, block_k, scale):
        out, logsumexp = _tiled_forward(
            q, k, v, causal, block_q, block_k, scale
        )
        ctx.save_for_backward(q, k, v, out, logsumexp)
        ctx.settings = (causal, block_q, block_k, scale)
        return out, logsumexp

    @staticmethod
    def backward(ctx, d_out, d_logsumexp):
        q, k, v, out, logsumexp = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        grads = _tiled_backward(
            q, k, v, out, logsumexp, d_out, d_logsumexp, *ctx.settings
        )
        return (*grads, None, None, None, None)


def flash_attention_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`flash_attention` for torch tensors, differentiable.

    Autograd runs :class:`FlashAttention`'s backward pass.

    Args:
        q: (..., T_q, d_k); k: (..., T_k, d_k); v: (..., T_k, d_v), on one
            device, one floating dtype, the same leading axes.
        causal, block_q, block_k, scale: as in :func:`flash_attention`.

    Returns:
        ``(out, logsumexp)``: (..., T_q, d_v) in the inputs' dtype and
        (..., T_q) in float32 (float64 for float64 inputs).
    """
    scale = _check_torch(q, k, v, block_q, block_k, scale)
    return FlashAttention.apply(q, k, v, bool(causal), block_q, block_k, scale)


# ---------------------------------------------------------------------------
# Argument checks (see mha._validate).


def _check_blocks(block_q: object, block_k: object) -> None:
    check_int("block_q", block_q)
    check_int("block_k", block_k)


def _check_lengths(q_shape: tuple, k_shape: tuple) -> None:
    if q_shape[-2] == 0 or k_shape[-2] == 0:
        raise ValueError(
            "q and k must hold at least one position each, got shapes "
            f"{tuple(q_shape)} and {tuple(k_shape)}"
        )


def _check_numpy(q, k, v, block_q, block_k, scale):
    """Arrays of one floating dtype, broadcast to common leading axes."""
    q, k, v, _ = check_attention_inputs(q, k, v, None)
    _check_blocks(block_q, block_k)
    _check_lengths(q.shape, k.shape)
    scale = check_scale(scale, q.shape[-1])
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    dtype = np.result_type(q, k, v)
    q, k, v = (
        np.broadcast_to(t, lead + t.shape[-2:]).astype(dtype, copy=False)
        for t in (q, k, v)
    )
    return q, k, v, scale


def _check_saved(q, v, out, logsumexp, d_out):
    """``out``, ``d_out`` shaped as the output, ``logsumexp`` as its rows."""
    expected = {
        "out": q.shape[:-1] + v.shape[-1:],
        "d_out": q.shape[:-1] + v.shape[-1:],
        "logsumexp": q.shape[:-1],
    }
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
        arrays[name] = array.astype(q.dtype, copy=False)
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
    if not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        raise ValueError(
            "q, k and v must have the same leading (batch, head) axes, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    _check_blocks(block_q, block_k)
    _check_lengths(q.shape, k.shape)
    return check_scale(scale, q.shape[-1])
