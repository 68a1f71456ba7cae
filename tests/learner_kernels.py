"""FlashAttention forward kernels written the way a learner writes them, right and wrong.

One Triton kernel, independent of mha.kernels (exp2 with the log2(e) factor folded into the
scale, as Triton's fused-attention tutorial does; tl.max, tl.sum, tl.zeros; its own launcher),
and each mistake of check_flash_attention's list switched on by the constexpr MISTAKE, so that
every mutant is a real kernel run by Triton: in its interpreter where there is no GPU, compiled
on a GPU (the launcher makes its tensors on q's device). Imported after mha.kernels, which
chooses the interpreter where there is no GPU.
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
)


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
        m = m_new
    if MISTAKE == "nan_empty_row":
        out = acc / ell[:, None]
    else:
        out = acc / tl.where(ell > 0, ell, 1.0)[:, None]
    log2_ell = tl.log2(tl.where(ell > 0, ell, 1.0))  # m = -inf where ell = 0
    if MISTAKE == "lse_base2":
        lse = m + log2_ell
    else:
        lse = (m + log2_ell) / log2e  # natural: m and log2(ell) are in base 2
    o_ptrs = Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_ot + dims[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=q_mask)
    tl.store(Lse + bh * T_Q + rows, lse, mask=rows < T_Q)


def learner_attention(q, k, v, causal, *, mistake="", block_q=32, block_k=32, lse_device=None):
    """The launcher: one program per (query tile, batch x head); returns (out, lse).

    ``lse_device``: a launcher's mistake, the logsumexp made on that device, not q's (None)."""
    batch, heads, t_q, d = q.shape
    kv_heads, t_k = k.shape[1], k.shape[2]
    q, k, v = (t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)
    lse_device = q.device if lse_device is None else lse_device
    lse = torch.empty((batch, heads, t_q), dtype=torch.float32, device=lse_device)
    grid = (triton.cdiv(t_q, block_q), batch * heads)
    learner_forward_kernel[grid](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        heads, heads // kv_heads, t_q, t_k, d**-0.5,
        CAUSAL=causal, HEAD_DIM=d, D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK_Q=block_q, BLOCK_K=block_k, MISTAKE=mistake,
    )  # fmt: skip
    return out, lse
