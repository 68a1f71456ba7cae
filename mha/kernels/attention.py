"""Tiled attention in Triton: the algorithm of :mod:`mha.flash` as GPU kernels.

Import :mod:`mha.kernels` (which decides between the compiled kernels and
Triton's CPU interpreter) rather than this module directly.

A Triton kernel is written for one *program*: a block of work that the GPU
runs on one streaming multiprocessor, thousands of them in parallel. Here
one program computes one tile of ``BLOCK_Q`` queries of one (batch, head):
the same loop over key tiles as :func:`mha.flash.flash_attention`, with the
running maximum ``m``, sum ``ell`` and weighted values ``acc`` held on chip
(in registers). Tensors are addressed with plain pointer arithmetic: a base
pointer plus offsets times strides, so views such as the transposed heads of
:func:`mha.functional.split_heads` need no copy. Loads and stores of rows past
the end of the sequence are masked, so T need not be a multiple of the tile.

* :func:`attention_forward` - the forward kernel; returns output and
  logsumexp (one float32 per query).
* :func:`attention_backward` - two kernels (one program per key tile for
  dk and dv, one per query tile for dq) that recompute the weights from the
  logsumexp, as :func:`mha.flash.flash_attention_backward` does.
* :func:`triton_attention` - both, tied together for autograd.

The kernels call Triton's built-in operations and the small ``@triton.jit``
helpers defined here, never the jitted helpers of ``triton.language``
(``tl.zeros``, ``tl.max``, ``tl.sum``): those were decorated when ``triton``
was imported, possibly before :mod:`mha.kernels` chose the interpreter, and
a compiled helper cannot be called from an interpreted kernel. Row maxima
and sums are therefore written as ``tl.reduce`` with :func:`_maximum` and
:func:`_add`, which is how ``tl.max`` and ``tl.sum`` are defined.

Offsets are 32-bit: tensors up to 2**31 elements.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._validate import check_same, check_scale, check_tensor
from . import HEAD_DIMS, INTERPRETED

__all__ = [
    "attention_forward",
    "attention_backward",
    "TritonAttention",
    "triton_attention",
    "default_blocks",
]


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _tile(head, positions, dims, stride_t, stride_d):
    """Addresses (or offsets) of the (positions, dims) tile of a matrix."""
    return head + positions[:, None] * stride_t + dims[None, :] * stride_d


@triton.jit
def _forward_kernel(
    Q, K, V, Out, LSE,  # pointers to the first element of each tensor
    stride_qb, stride_qh, stride_qt, stride_qd,  # q's strides, in elements
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    num_heads, t_q, t_k, scale,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    q_block, batch_head = tl.program_id(0), tl.program_id(1)
    b, h = batch_head // num_heads, batch_head % num_heads
    q_head = Q + b * stride_qb + h * stride_qh  # q[b, h], (T_q, d_k)
    k_head = K + b * stride_kb + h * stride_kh
    v_head = V + b * stride_vb + h * stride_vh
    rows = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)  # query positions
    dims = tl.arange(0, HEAD_DIM)
    q_tile = _tile(q_head, rows, dims, stride_qt, stride_qd)
    q = tl.load(q_tile, rows[:, None] < t_q, 0.0)  # (B_q, d_k)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)  # running maximum
    ell = tl.full([BLOCK_Q], 0.0, tl.float32)  # running sum of exp(s - m)
    acc = tl.full([BLOCK_Q, HEAD_DIM], 0.0, tl.float32)  # running p @ v
    stop = t_k
    if CAUSAL:  # key tiles after the last query of this tile: skipped
        stop = tl.minimum(t_k, (q_block + 1) * BLOCK_Q)
    for start in range(0, stop, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)  # key positions
        exists = cols[:, None] < t_k  # keys past the end read as 0
        k_tile = _tile(k_head, cols, dims, stride_kt, stride_kd)
        v_tile = _tile(v_head, cols, dims, stride_vt, stride_vd)
        k = tl.load(k_tile, exists, 0.0)  # (B_k, d_k)
        v = tl.load(v_tile, exists, 0.0)  # (B_k, d_v)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        keep = cols[None, :] < t_k  # (1, B_k), broadcast with rows below
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        scores = tl.where(keep, scores, float("-inf"))  # (B_q, B_k)
        m_new = tl.maximum(m, tl.reduce(scores, 1, _maximum))  # row max
        rescale = tl.exp(m - m_new)  # brings old sums to the new maximum
        p = tl.exp(scores - m_new[:, None])  # (B_q, B_k)
        ell = rescale * ell + tl.reduce(p, 1, _add)  # row sum
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = rescale[:, None] * acc + pv  # (B_q, d_v)
        m = m_new
    out = acc / ell[:, None]
    out_tile = _tile(Out + b * stride_ob + h * stride_oh, rows, dims,
                     stride_ot, stride_od)  # fmt: skip
    tl.store(out_tile, out.to(Out.dtype.element_ty), rows[:, None] < t_q)
    tl.store(LSE + batch_head * t_q + rows, m + tl.log(ell), rows < t_q)


@triton.jit
def _backward_dk_dv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV,
    stride_b, stride_h, stride_t, stride_d,  # of q and d_out
    stride_kb, stride_kh, stride_kt, stride_kd,  # of k, v, dk and dv
    num_heads, t_q, t_k, scale,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: dk and dv of one tile of keys, summed over query tiles."""
    k_block, batch_head = tl.program_id(0), tl.program_id(1)
    b, h = batch_head // num_heads, batch_head % num_heads
    q_offset = b * stride_b + h * stride_h  # of q[b, h] and d_out[b, h]
    kv_offset = b * stride_kb + h * stride_kh
    cols = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    dims = tl.arange(0, HEAD_DIM)
    exists = cols[:, None] < t_k
    kv_tile = _tile(kv_offset, cols, dims, stride_kt, stride_kd)
    k = tl.load(K + kv_tile, exists, 0.0)  # (B_k, d_k)
    v = tl.load(V + kv_tile, exists, 0.0)
    dk = tl.full([BLOCK_K, HEAD_DIM], 0.0, tl.float32)
    dv = tl.full([BLOCK_K, HEAD_DIM], 0.0, tl.float32)
    first = 0
    if CAUSAL:  # query tiles before this key tile never see it
        first = (k_block * BLOCK_K // BLOCK_Q) * BLOCK_Q
    for start in range(first, t_q, BLOCK_Q):
        rows = start + tl.arange(0, BLOCK_Q)
        real = rows[:, None] < t_q
        q_tile = _tile(q_offset, rows, dims, stride_t, stride_d)
        q = tl.load(Q + q_tile, real, 0.0)  # (B_q, d_k)
        do = tl.load(DO + q_tile, real, 0.0)
        lse = tl.load(LSE + batch_head * t_q + rows, rows < t_q, 0.0)
        delta = tl.load(Delta + batch_head * t_q + rows, rows < t_q, 0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        keep = real & (cols[None, :] < t_k)
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        p = tl.where(keep, tl.exp(scores - lse[:, None]), 0.0)  # recomputed
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])  # (B_q, B_k)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    dk = dk * scale
    tl.store(DK + kv_tile, dk.to(DK.dtype.element_ty), exists)
    tl.store(DV + kv_tile, dv.to(DV.dtype.element_ty), exists)


@triton.jit
def _backward_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ,
    stride_b, stride_h, stride_t, stride_d,  # of q, d_out and dq
    stride_kb, stride_kh, stride_kt, stride_kd,  # of k and v
    num_heads, t_q, t_k, scale,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: dq of one tile of queries, summed over key tiles."""
    q_block, batch_head = tl.program_id(0), tl.program_id(1)
    b, h = batch_head // num_heads, batch_head % num_heads
    q_offset = b * stride_b + h * stride_h  # of q, d_out and dq [b, h]
    kv_offset = b * stride_kb + h * stride_kh
    rows = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, HEAD_DIM)
    real = rows[:, None] < t_q
    q_tile = _tile(q_offset, rows, dims, stride_t, stride_d)
    q = tl.load(Q + q_tile, real, 0.0)  # (B_q, d_k)
    do = tl.load(DO + q_tile, real, 0.0)
    lse = tl.load(LSE + batch_head * t_q + rows, rows < t_q, 0.0)
    delta = tl.load(Delta + batch_head * t_q + rows, rows < t_q, 0.0)
    dq = tl.full([BLOCK_Q, HEAD_DIM], 0.0, tl.float32)
    stop = t_k
    if CAUSAL:
        stop = tl.minimum(t_k, (q_block + 1) * BLOCK_Q)
    for start in range(0, stop, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        exists = cols[:, None] < t_k
        kv_tile = _tile(kv_offset, cols, dims, stride_kt, stride_kd)
        k = tl.load(K + kv_tile, exists, 0.0)  # (B_k, d_k)
        v = tl.load(V + kv_tile, exists, 0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        keep = real & (cols[None, :] < t_k)
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        p = tl.where(keep, tl.exp(scores - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq = dq * scale
    tl.store(DQ + q_tile, dq.to(DQ.dtype.element_ty), real)


# ---------------------------------------------------------------------------
# Launching the kernels


def default_blocks(
    head_dim: int, dtype: torch.dtype, *, backward: bool = False
) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_K): tiles meant to fit a GPU's shared memory, registers.

    Forward, 16-bit: 128 queries by 64 keys (the FlashAttention-2 tutorial's
    sizes); float32 takes twice the bytes per element, so half the queries,
    and half the keys again at d_k = 128. The backward kernels hold four
    tiles (q, d_out and k, v) and two accumulators: 64 by 64 in 16 bits, 32
    by 32 in float32. Any tiling gives the same result: the logsumexp is per
    query, not per tile.
    """
    wide = dtype == torch.float32
    if backward:
        return (32, 32) if wide else (64, 64)
    if not wide:
        return 128, 64
    return 64, 32 if head_dim == 128 else 64


def _launch_settings(
    q: Tensor, block_q: int | None, block_k: int | None, backward: bool = False
) -> dict:
    d_k = q.shape[-1]
    default_q, default_k = default_blocks(d_k, q.dtype, backward=backward)
    return {
        "BLOCK_Q": default_q if block_q is None else block_q,
        "BLOCK_K": default_k if block_k is None else block_k,
        "HEAD_DIM": d_k,
        # float32 products in full float32, not in the tensor cores' TF32
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "num_warps": 8 if d_k == 128 and q.element_size() == 2 else 4,
    }


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The forward kernel: ``(out, logsumexp)``, (B, H, T_q, d_k), (B, H, T_q).

    The logsumexp is float32 whatever the inputs' dtype.
    """
    scale = _check_inputs(q, k, v, scale, block_q, block_k)
    settings = _launch_settings(q, block_q, block_k)
    (batch, heads, t_q, _), t_k = q.shape, k.shape[2]
    out = torch.empty_like(q)
    logsumexp = torch.empty(
        (batch, heads, t_q), dtype=torch.float32, device=q.device
    )
    grid = (triton.cdiv(t_q, settings["BLOCK_Q"]), batch * heads)
    _forward_kernel[grid](
        q, k, v, out, logsumexp,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        heads, t_q, t_k, scale, CAUSAL=bool(causal), **settings,
    )  # fmt: skip
    return out, logsumexp


def attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    d_out: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run the backward kernels: ``(dq, dk, dv)`` of ``sum(d_out * out)``."""
    scale = _check_inputs(q, k, v, scale, block_q, block_k)
    settings = _launch_settings(q, block_q, block_k, backward=True)
    (batch, heads, t_q, _), t_k = q.shape, k.shape[2]
    # One layout for q, d_out and dq, and one for k, v, dk and dv.
    q, d_out = q.contiguous(), d_out.contiguous()
    k, v = k.contiguous(), v.contiguous()
    delta = (d_out.float() * out.float()).sum(dim=-1)  # (B, H, T_q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(CAUSAL=bool(causal), **settings)
    by_keys = (triton.cdiv(t_k, settings["BLOCK_K"]), batch * heads)
    _backward_dk_dv_kernel[by_keys](
        q, k, v, d_out, logsumexp, delta, dk, dv,
        *q.stride(), *k.stride(), heads, t_q, t_k, scale, **common,
    )  # fmt: skip
    by_queries = (triton.cdiv(t_q, settings["BLOCK_Q"]), batch * heads)
    _backward_dq_kernel[by_queries](
        q, k, v, d_out, logsumexp, delta, dq,
        *q.stride(), *k.stride(), heads, t_q, t_k, scale, **common,
    )  # fmt: skip
    return dq, dk, dv


class TritonAttention(torch.autograd.Function):
    """The kernels for autograd; saves q, k, v, output and logsumexp."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_q, block_k):
        settings = dict(
            causal=causal, scale=scale, block_q=block_q, block_k=block_k
        )
        out, logsumexp = attention_forward(q, k, v, **settings)
        ctx.save_for_backward(q, k, v, out, logsumexp)
        ctx.settings = settings
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, logsumexp = ctx.saved_tensors
        grads = attention_backward(
            q, k, v, out, logsumexp, d_out, **ctx.settings
        )
        return (*grads, None, None, None, None)


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Tensor:
    """softmax(q k^T * scale) v by the Triton kernels, differentiable.

    Args:
        q: (B, H, T_q, d_k); k, v: (B, H, T_k, d_k); float32 or float16, or
            bfloat16 on a GPU; d_k in :data:`mha.kernels.HEAD_DIMS`. CUDA
            tensors for the compiled kernels, CPU tensors in the interpreter.
        causal: query i attends to keys 0..i (top-left aligned).
        scale: default ``1 / sqrt(d_k)``.
        block_q, block_k: tile sizes, powers of two >= 16; default
            :func:`default_blocks`.

    Returns:
        (B, H, T_q, d_k), in the inputs' dtype.
    """
    return TritonAttention.apply(
        q, k, v, bool(causal), scale, block_q, block_k
    )


# ---------------------------------------------------------------------------
# Argument checks (see mha._validate).


def _check_inputs(q, k, v, scale, block_q, block_k) -> float:
    """The kernels' requirements, each with a clear error; returns scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, kind=None, ndim=4, shape="(B, H, T, d_k)")
    check_same("q, k and v", (q, k, v))
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    if q.dtype not in dtypes:
        raise TypeError(
            f"q, k and v must be float32, float16 or bfloat16, got {q.dtype}"
        )
    if k.shape != v.shape or q.shape[:2] + q.shape[3:] != k.shape[:2] + (
        k.shape[3],
    ):
        raise ValueError(
            "q must have shape (B, H, T_q, d_k) and k, v (B, H, T_k, d_k), "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(
            f"d_k (the last dimension of q) must be one of {HEAD_DIMS}, got "
            f"{q.shape[-1]}"
        )
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError(
            "q and k must hold at least one position each, got shapes "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    if INTERPRETED and q.dtype == torch.bfloat16:
        raise ValueError(
            "bfloat16 runs on a GPU only: tl.dot in bfloat16 is wrong in "
            "Triton's interpreter (TRITON_INTERPRET=1)"
        )
    if not INTERPRETED and q.device.type != "cuda":
        raise ValueError(
            f"the compiled kernels need CUDA tensors, got {q.device}; set "
            "TRITON_INTERPRET=1 before importing mha.kernels to run them "
            "on the CPU"
        )
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if block is None:
            continue
        if isinstance(block, bool) or not isinstance(block, numbers.Integral):
            raise TypeError(
                f"{name} must be an int or None, got "
                f"{type(block).__name__} {block!r}"
            )
        if block < 16 or block & (block - 1):
            raise ValueError(
                f"{name} must be a power of two >= 16 (tl.dot's smallest "
                f"tile), got {block}"
            )
    return check_scale(scale, q.shape[-1])
