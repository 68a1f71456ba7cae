"""FlashAttention kernels written the way a learner writes them, right and wrong.

A forward kernel, independent of mha.kernels (exp2 with the log2(e) factor folded into the
scale, as Triton's fused-attention tutorial does; tl.max, tl.sum, tl.zeros; its own launcher);
chapter 13's backward kernels (dk/dv, then dq) and its row softmax; each mistake of the checkers'
lists switched on by the constexpr MISTAKE, so that every mutant is a real kernel run by Triton:
in its interpreter where there is no GPU, compiled on a GPU (the launchers make their tensors on
q's device). Imported after mha.kernels, which chooses the interpreter where there is no GPU.
"""

from __future__ import annotations

import mha.kernels  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU, before @triton.jit)
import torch
import triton
import triton.language as tl

MISTAKES = (
    "no_rescale",  # acc and ell not multiplied by alpha when the maximum grows
    "top_left",  # causal aligned top-left
    "tail_unmasked",  # keys past T_k loaded as 0 and kept
    "gqa_modulo",  # key/value head h % H_kv
    "no_scale",  # no 1/sqrt(d)
    "exp2_no_log2e",  # exp2 of the plain scores
    "float16_acc",  # the accumulator in float16
    "nan_empty_row",  # no guard for a row whose maximum is -inf
    "lse_base2",  # the logsumexp left in base 2
    "lse_mixed_units",  # m in log2 units plus the natural log of ell
    "normalise_in_loop",  # acc divided by ell after every key tile
    "kv_no_dims_mask",  # k and v loaded without the head-size mask
    "out_unmasked",  # out stored without a mask
    "lse_unmasked",  # the logsumexp stored without a mask
    "no_contiguous",  # the launcher skips .contiguous() and passes k's strides for v
)
#: Mistakes of the launcher, not the kernel (the kernel runs right).
LAUNCHER_MISTAKES = ("no_contiguous",)


@triton.jit
def learner_forward_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    H, GROUP, T_Q, T_K, sm_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, MISTAKE: tl.constexpr,
):  # fmt: skip
    pid_q = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    if MISTAKE == "gqa_modulo":
        kv = h % (H // GROUP)
    else:
        kv = h // GROUP
    rows = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, D_PAD)
    q_mask = (rows[:, None] < T_Q) & (dims[None, :] < HEAD_DIM)
    q_ptrs = Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + dims[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    log2e: tl.constexpr = 1.4426950408889634
    if MISTAKE == "no_scale":
        qk_scale = log2e
    elif MISTAKE == "exp2_no_log2e":
        qk_scale = sm_scale
    else:
        qk_scale = sm_scale * log2e
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    ell = tl.zeros([BLOCK_Q], tl.float32)
    if MISTAKE == "float16_acc":
        acc = tl.zeros([BLOCK_Q, D_PAD], tl.float16)
    else:
        acc = tl.zeros([BLOCK_Q, D_PAD], tl.float32)
    offset = T_K - T_Q
    if MISTAKE == "top_left":
        offset = 0
    end = T_K
    if CAUSAL:
        end = tl.minimum(T_K, tl.maximum(0, (pid_q + 1) * BLOCK_Q + offset))
    for start in range(0, end, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        kv_mask = (cols[:, None] < T_K) & (dims[None, :] < HEAD_DIM)
        if MISTAKE == "kv_no_dims_mask":
            kv_mask = cols[:, None] < T_K
        k = tl.load(
            K + b * stride_kb + kv * stride_kh + cols[:, None] * stride_kt + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            V + b * stride_vb + kv * stride_vh + cols[:, None] * stride_vt + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        if MISTAKE == "tail_unmasked":
            keep = cols[None, :] < BLOCK_K * T_K  # every loaded key
        else:
            keep = cols[None, :] < T_K
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None] + offset)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        if MISTAKE == "nan_empty_row":
            m_safe = m_new
        else:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        if MISTAKE == "no_rescale":
            ell = ell + tl.sum(p, axis=1)
        else:
            ell = ell * alpha + tl.sum(p, axis=1)
        if MISTAKE == "float16_acc":
            pv = tl.dot(p.to(tl.float16), v.to(tl.float16), out_dtype=tl.float16)
            acc = acc * alpha[:, None].to(tl.float16) + pv
        elif MISTAKE == "no_rescale":
            acc = acc + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        if MISTAKE == "normalise_in_loop":
            acc = acc / tl.where(ell > 0, ell, 1.0)[:, None]
        m = m_new
    if MISTAKE == "nan_empty_row":
        out = acc / ell[:, None]
    elif MISTAKE == "normalise_in_loop":
        out = acc
    else:
        out = acc / tl.where(ell > 0, ell, 1.0)[:, None]
    log2_ell = tl.log2(tl.where(ell > 0, ell, 1.0))  # m = -inf where ell = 0
    if MISTAKE == "lse_base2":
        lse = m + log2_ell
    elif MISTAKE == "lse_mixed_units":
        lse = m + tl.log(tl.where(ell > 0, ell, 1.0))  # m is in log2 units
    else:
        lse = (m + log2_ell) / log2e  # natural: m and log2(ell) are in base 2
    o_ptrs = Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_ot + dims[None, :]
    if MISTAKE == "out_unmasked":
        tl.store(o_ptrs, out.to(Out.dtype.element_ty))
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=q_mask)
    if MISTAKE == "lse_unmasked":
        tl.store(Lse + bh * T_Q + rows, lse)
    else:
        tl.store(Lse + bh * T_Q + rows, lse, mask=rows < T_Q)


def learner_attention(q, k, v, causal, *, mistake="", block_q=32, block_k=32, lse_device=None):
    """The launcher: one program per (query tile, batch x head); returns (out, lse).

    ``lse_device``: a launcher's mistake, the logsumexp made on that device, not q's (None)."""
    batch, heads, t_q, d = q.shape
    kv_heads, t_k = k.shape[1], k.shape[2]
    if mistake != "no_contiguous":
        q, k, v = (t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)
    lse_device = q.device if lse_device is None else lse_device
    lse = torch.empty((batch, heads, t_q), dtype=torch.float32, device=lse_device)
    grid = (triton.cdiv(t_q, block_q), batch * heads)
    learner_forward_kernel[grid](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        *(k if mistake == "no_contiguous" else v).stride()[:3],
        out.stride(0), out.stride(1), out.stride(2),
        heads, heads // kv_heads, t_q, t_k, d**-0.5,
        CAUSAL=causal, HEAD_DIM=d, D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK_Q=block_q, BLOCK_K=block_k,
        MISTAKE="" if mistake in LAUNCHER_MISTAKES else mistake,
    )  # fmt: skip
    return out, lse


# ---------------------------------------------------------------------------------------------
# The backward pass: chapter 13's two kernels and their launcher

BACKWARD_MISTAKES = (
    "no_delta",  # dS = P * dP, delta left out
    "dq_no_scale",  # dq not multiplied by sm_scale
    "exp2_natural_lse",  # P = exp2(S * log2(e) - L) with L the natural logsumexp
    "one_head_of_group",  # dk, dv from the first query head of each group only
    "b_kv_over_h",  # b, kv = b_kv // H, b_kv % H: the forward's mapping copied
    "dk_unmasked",  # dk stored without a mask
    "dq_rows_only",  # dq stored with the row bound only
    "no_contiguous",  # the launcher skips .contiguous()
)


@triton.jit
def learner_dk_dv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV,
    stride_qb, stride_qh, stride_qt,  # of q and d_out
    stride_kb, stride_kh, stride_kt,  # of k, v, dk and dv
    H, GROUP, T_Q, T_K, sm_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, MISTAKE: tl.constexpr,
):  # fmt: skip
    pid_k, b_kv = tl.program_id(0), tl.program_id(1)
    if MISTAKE == "b_kv_over_h":
        b, kv = b_kv // H, b_kv % H
    else:
        b, kv = b_kv // (H // GROUP), b_kv % (H // GROUP)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    dims = tl.arange(0, D_PAD)
    kv_mask = (cols[:, None] < T_K) & (dims[None, :] < HEAD_DIM)
    kv_base = b * stride_kb + kv * stride_kh
    kv_offsets = kv_base + cols[:, None] * stride_kt + dims[None, :]
    k = tl.load(K + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_offsets, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_K, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_K, D_PAD], tl.float32)
    offset = T_K - T_Q
    first = 0
    if CAUSAL:  # the query tile of the first query that sees these keys
        first = tl.maximum(0, pid_k * BLOCK_K - offset)
        first = first // BLOCK_Q * BLOCK_Q
    heads = GROUP
    if MISTAKE == "one_head_of_group":
        heads = 1
    for g in range(0, heads):  # every query head that reads head kv
        h = kv * GROUP + g
        q_base = b * stride_qb + h * stride_qh
        for start in range(first, T_Q, BLOCK_Q):
            rows = start + tl.arange(0, BLOCK_Q)
            q_mask = (rows[:, None] < T_Q) & (dims[None, :] < HEAD_DIM)
            q_offsets = q_base + rows[:, None] * stride_qt + dims[None, :]
            qt_mask = (dims[:, None] < HEAD_DIM) & (rows[None, :] < T_Q)
            qt_offsets = q_base + dims[:, None] + rows[None, :] * stride_qt
            q_t = tl.load(Q + qt_offsets, mask=qt_mask, other=0.0)
            do = tl.load(DO + q_offsets, mask=q_mask, other=0.0)
            at = (b * H + h) * T_Q + rows
            lse = tl.load(Lse + at, mask=rows < T_Q, other=0.0)
            delta = tl.load(Delta + at, mask=rows < T_Q, other=0.0)
            s_t = tl.dot(k, q_t, input_precision="ieee") * sm_scale
            keep = (cols[:, None] < T_K) & (rows[None, :] < T_Q)
            if CAUSAL:
                keep = keep & (cols[:, None] <= rows[None, :] + offset)
            if MISTAKE == "exp2_natural_lse":
                p_t = tl.where(keep, tl.exp2(s_t * 1.4426950408889634 - lse[None, :]), 0.0)
            else:
                p_t = tl.where(keep, tl.exp(s_t - lse[None, :]), 0.0)  # P^T
            dv += tl.dot(p_t.to(do.dtype), do, input_precision="ieee")
            dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
            if MISTAKE == "no_delta":
                ds_t = p_t * dp_t
            else:
                ds_t = p_t * (dp_t - delta[None, :])  # the softmax's gradient
            dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision="ieee")
    dk = dk * sm_scale
    if MISTAKE == "dk_unmasked":
        tl.store(DK + kv_offsets, dk.to(DK.dtype.element_ty))
    else:
        tl.store(DK + kv_offsets, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_offsets, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def learner_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    H, GROUP, T_Q, T_K, sm_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, MISTAKE: tl.constexpr,
):  # fmt: skip
    pid_q, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kv = h // GROUP
    rows = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, D_PAD)
    q_mask = (rows[:, None] < T_Q) & (dims[None, :] < HEAD_DIM)
    q_base = b * stride_qb + h * stride_qh
    q_offsets = q_base + rows[:, None] * stride_qt + dims[None, :]
    q = tl.load(Q + q_offsets, mask=q_mask, other=0.0)
    do = tl.load(DO + q_offsets, mask=q_mask, other=0.0)
    lse = tl.load(Lse + bh * T_Q + rows, mask=rows < T_Q, other=0.0)
    delta = tl.load(Delta + bh * T_Q + rows, mask=rows < T_Q, other=0.0)
    dq = tl.zeros([BLOCK_Q, D_PAD], tl.float32)
    offset = T_K - T_Q
    end = T_K
    if CAUSAL:  # key tiles after the tile's last query: skipped
        last = (pid_q + 1) * BLOCK_Q + offset  # its last key, plus 1
        end = tl.minimum(T_K, tl.maximum(0, last))
    kv_base = b * stride_kb + kv * stride_kh
    for start in range(0, end, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        kv_mask = (cols[:, None] < T_K) & (dims[None, :] < HEAD_DIM)
        kv_offsets = kv_base + cols[:, None] * stride_kt + dims[None, :]
        k = tl.load(K + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_offsets, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        keep = (rows[:, None] < T_Q) & (cols[None, :] < T_K)
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None] + offset)
        if MISTAKE == "exp2_natural_lse":
            p = tl.where(keep, tl.exp2(s * 1.4426950408889634 - lse[:, None]), 0.0)
        else:
            p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        if MISTAKE == "no_delta":
            ds = p * dp
        else:
            ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
    if MISTAKE != "dq_no_scale":
        dq = dq * sm_scale
    if MISTAKE == "dq_rows_only":
        tl.store(DQ + q_offsets, dq.to(DQ.dtype.element_ty), mask=rows[:, None] < T_Q)
    else:
        tl.store(DQ + q_offsets, dq.to(DQ.dtype.element_ty), mask=q_mask)


class LearnerAttention(torch.autograd.Function):
    """learner_forward_kernel forward; chapter 13's two kernels backward, as its launcher."""

    @staticmethod
    def forward(ctx, q, k, v, causal, mistake):
        out, lse = learner_attention(q, k, v, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.mistake = causal, mistake
        return out

    @staticmethod
    def backward(ctx, d_out, block_q=32, block_k=32):
        q, k, v, out, lse = ctx.saved_tensors
        mistake = ctx.mistake
        if mistake != "no_contiguous":
            q, k, v, d_out = (t.contiguous() for t in (q, k, v, d_out))
        (batch, heads, t_q, d), (kv_heads, t_k) = q.shape, k.shape[1:3]
        delta = (d_out * out).sum(-1)  # (B, H, T_q)
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        common = dict(
            CAUSAL=ctx.causal, HEAD_DIM=d, D_PAD=max(16, triton.next_power_of_2(d)),
            BLOCK_Q=block_q, BLOCK_K=block_k,
            MISTAKE="" if mistake == "no_contiguous" else mistake,
        )  # fmt: skip
        sizes = (heads, heads // kv_heads, t_q, t_k, d**-0.5)
        strides = (*q.stride()[:3], *k.stride()[:3])
        grid = (triton.cdiv(t_k, block_k), batch * kv_heads)
        learner_dk_dv_kernel[grid](q, k, v, d_out, lse, delta, dk, dv, *strides, *sizes, **common)
        grid = (triton.cdiv(t_q, block_q), batch * heads)
        learner_dq_kernel[grid](q, k, v, d_out, lse, delta, dq, *strides, *sizes, **common)
        return dq, dk, dv, None, None


def learner_autograd(q, k, v, causal, *, mistake=""):
    """Attention with gradients: out (B, H, T_q, d)."""
    return LearnerAttention.apply(q, k, v, causal, mistake)


# ---------------------------------------------------------------------------------------------
# Chapter 13's row softmax (check_softmax(row_softmax, framework="torch"))

SOFTMAX_MISTAKES = ("store_unmasked", "store_far")


@triton.jit
def learner_softmax_kernel(X, Y, stride, n_cols, BLOCK: tl.constexpr, MISTAKE: tl.constexpr):
    row = tl.program_id(0)  # one program per row
    cols = tl.arange(0, BLOCK)  # BLOCK >= n_cols, a power of two
    inside = cols < n_cols
    x = tl.load(X + row * stride + cols, mask=inside, other=float("-inf"))
    m = tl.max(x, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a row of -inf: no NaN
    e = tl.exp(x - m)
    total = tl.sum(e, axis=0)
    y = e / tl.where(total > 0, total, 1.0)
    if MISTAKE == "store_unmasked":
        tl.store(Y + row * stride + cols, y)
    elif MISTAKE == "store_far":  # rows 2**37 elements apart: unmapped memory, for row >= 1
        tl.store(Y + row.to(tl.int64) * 137438953472 + cols, y, mask=inside)
    else:
        tl.store(Y + row * stride + cols, y, mask=inside)


def learner_row_softmax(x, axis=-1, *, mistake=""):
    rows = x.movedim(axis, -1).contiguous()  # the softmax's axis last
    flat = rows.reshape(-1, rows.shape[-1])  # (R, N): one row per program
    out = torch.empty_like(flat)
    block = triton.next_power_of_2(flat.shape[1])
    learner_softmax_kernel[(flat.shape[0],)](
        flat, out, flat.stride(0), flat.shape[1], BLOCK=block, MISTAKE=mistake
    )
    return out.reshape(rows.shape).movedim(-1, axis)
