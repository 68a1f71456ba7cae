"""Learned attention sinks (gpt-oss): one logit per head that joins every row's softmax and
brings no value, in the reference, the tiled forms (NumPy, torch, Triton) and FlexAttention.

The expected values come from elsewhere: a row worked by hand, the softmax over the scores with
the sink's column appended (what transformers' GptOss eager_attention_forward does), torch
autograd through that dense form, and gradcheck.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mha import flash, reference

from helpers import KERNEL_DEVICE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def dense_with_sinks(q, k, v, sinks, causal: bool):
    """torch: the sink as one more column of the scores (GptOss's eager attention), H_kv heads
    repeated; returns the output and the logsumexp over the keys and the sink."""
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        t_q, t_k = q.shape[-2], k.shape[-2]
        seen = torch.arange(t_k)[None, :] <= torch.arange(t_q)[:, None] + t_k - t_q
        scores = scores.masked_fill(~seen, -math.inf)
    column = sinks[:, None, None].expand(*scores.shape[:-1], 1).to(scores.dtype)
    logits = torch.cat((scores, column), dim=-1)
    return torch.softmax(logits, -1)[..., :-1] @ v, logits.logsumexp(-1)


def test_one_row_by_hand() -> None:
    # scores [0, 1] (scale 1), sink s = ln 2: weights [1, e] / (1 + e + 2), values [2, -1]
    q = np.array([[[1.0, 0.0]]])  # (H, T_q, d) = (1, 1, 2)
    k = np.array([[[0.0, 0.0], [1.0, 0.0]]])
    v = np.array([[[2.0], [-1.0]]])
    out, weights = reference.attention_with_sinks(q, k, v, [math.log(2.0)], scale=1.0)
    e = math.e
    assert weights[0, 0] == pytest.approx([1 / (3 + e), e / (3 + e)], rel=1e-15)
    assert out[0, 0, 0] == pytest.approx((2 - e) / (3 + e), rel=1e-15)
    tiled, lse = flash.flash_attention(q, k, v, sinks=[math.log(2.0)], scale=1.0, block_k=1)
    assert tiled[0, 0, 0] == pytest.approx((2 - e) / (3 + e), rel=1e-15)
    assert lse[0, 0] == pytest.approx(math.log(3 + e), rel=1e-15)


def test_a_sink_takes_weight_and_gives_no_value(rng) -> None:
    """The weights sum to 1 - p_sink; a very low sink is no sink; a masked row gives zeros."""
    q, k, v = rng.normal(size=(3, 4, 8)), rng.normal(size=(3, 6, 8)), rng.normal(size=(3, 6, 5))
    sinks = np.array([-1.0, 0.5, 2.0])
    _, weights = reference.attention_with_sinks(q, k, v, sinks)
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(8)
    p_sink = np.exp(sinks[:, None]) / (np.exp(sinks[:, None]) + np.exp(scores).sum(-1))
    np.testing.assert_allclose(weights.sum(-1), 1 - p_sink, rtol=0, atol=1e-14)
    none, _ = reference.attention_with_sinks(q, k, v, [-80.0] * 3)
    plain, _ = reference.scaled_dot_product_attention(q, k, v)
    np.testing.assert_allclose(none, plain, rtol=0, atol=1e-14)
    mask = np.ones((4, 6), dtype=bool)
    mask[2] = False
    out, weights = reference.attention_with_sinks(q, k, v, sinks, mask)
    assert np.all(out[:, 2] == 0) and np.all(weights[:, 2] == 0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "heads, kv_heads, t_q, t_k",
    [(4, 4, 37, 37), (6, 2, 5, 37), (4, 1, 1, 37), (4, 2, 37, 5)],  # MHA, GQA, MQA, T_q > T_k
)
def test_tiled_numpy_and_torch_equal_the_dense_form(causal, heads, kv_heads, t_q, t_k, rng):
    q = torch.tensor(rng.normal(size=(2, heads, t_q, 40)), requires_grad=True)
    k = torch.tensor(rng.normal(size=(2, kv_heads, t_k, 40)), requires_grad=True)
    v = torch.tensor(rng.normal(size=(2, kv_heads, t_k, 24)), requires_grad=True)
    sinks = torch.tensor(rng.normal(size=heads) * 2, requires_grad=True)
    expected, expected_lse = dense_with_sinks(q, k, v, sinks, causal)
    numpy_out, numpy_lse = flash.flash_attention(
        *(t.detach().numpy() for t in (q, k, v)),
        causal=causal,
        block_q=16,
        block_k=8,
        sinks=sinks.detach().numpy(),
    )
    np.testing.assert_allclose(numpy_out, expected.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(numpy_lse, expected_lse.detach().numpy(), rtol=0, atol=1e-12)
    out, lse = flash.flash_attention_torch(
        q, k, v, causal=causal, block_q=16, block_k=8, sinks=sinks
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=1e-12)
    d_out, d_lse = torch.randn_like(out), torch.randn_like(lse)
    tiled = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), (q, k, v, sinks))
    dense = torch.autograd.grad(
        (expected * d_out).sum() + (expected_lse * d_lse).sum(), (q, k, v, sinks)
    )
    for name, got, want in zip("q k v sinks".split(), tiled, dense):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11, msg=f"d {name}")


def test_gradcheck_with_sinks() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 5, 6, generator=gen, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (q, k, v, sinks)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: flash.flash_attention_torch(
            q, k, v, causal=True, block_q=2, block_k=3, sinks=s
        ),
        inputs,
    )


def test_bad_sinks_are_refused_by_name(rng) -> None:
    q, k, v = (
        rng.normal(size=(2, 4, 3, 8)),
        rng.normal(size=(2, 2, 3, 8)),
        rng.normal(size=(2, 2, 3, 8)),
    )
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(4,\)"):
        flash.flash_attention(q, k, v, sinks=np.zeros(2))
    with pytest.raises(ValueError, match="finite"):
        flash.flash_attention(q, k, v, sinks=[0.0, np.inf, 0.0, 0.0])
    with pytest.raises(ValueError, match="sinks must have shape"):
        reference.attention_with_sinks(q, q, v[:, :1].repeat(4, 1), np.zeros(3))
    tq, tk = torch.tensor(q), torch.tensor(k)
    with pytest.raises(TypeError, match="one dtype"):
        flash.flash_attention_torch(tq, tk, tk, sinks=torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"\(H,\) = \(4,\)"):
        flash.flash_attention_torch(tq, tk, tk, sinks=torch.zeros(4, 1, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# FlexAttention: the sinks as one more key column, with a zero value and a score of s_h


@pytest.mark.parametrize(
    "variant, t_q", [("causal", 37), ("causal", 5), ("window", 37), ("none", 9), ("document", 37)]
)
def test_flex_with_sinks_equals_the_dense_form(variant: str, t_q: int) -> None:
    from mha import variants

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, t_q, 32, generator=gen)
    k, v = torch.randn(2, 2, 37, 32, generator=gen), torch.randn(2, 2, 37, 24, generator=gen)
    sinks = 2 * torch.randn(4, generator=gen)
    group = 2
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(32)
    i = torch.arange(37 - t_q, 37)[:, None]  # the queries' positions: the last T_q
    j = torch.arange(37)[None, :]
    doc = torch.tensor([0] * 10 + [1] * 20 + [2] * 7)
    mask_mod, keep = {
        "causal": (variants.causal, j <= i),
        "window": (variants.sliding_window(8), (j <= i) & (j > i - 8)),
        "none": (None, torch.ones(t_q, 37, dtype=torch.bool)),
        "document": (variants.document(doc), (doc[j] == doc[i]) & (j <= i)),
    }[variant]
    logits = torch.cat(
        (scores.masked_fill(~keep, -math.inf), sinks[:, None, None].expand(2, 4, t_q, 1)), -1
    )
    expected = torch.softmax(logits, -1)[..., :-1] @ v.repeat_interleave(group, 1)
    got = variants.flex(q, k, v, mask_mod=mask_mod, sinks=sinks, compiled=False)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_compiled_flex_with_sinks_equals_the_dense_form() -> None:
    from mha import variants

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen) for _ in range(3))
    sinks = torch.tensor([-1.0, 3.0])
    expected, _ = dense_with_sinks(q, k, v, sinks, causal=True)
    compiled = variants.flex_compiles(q.device)  # else FlexAttention's unfused form
    got = variants.flex(q, k, v, mask_mod=variants.causal, sinks=sinks, compiled=compiled)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_flex_refuses_bad_sinks() -> None:
    from mha import variants

    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(4,\)"):
        variants.flex(q, q, q, sinks=torch.zeros(2), compiled=False)
    with pytest.raises(TypeError, match="sinks must be a floating-point tensor"):
        variants.flex(q, q, q, sinks=[0.0] * 4, compiled=False)
    with pytest.raises(ValueError, match="needs T_q = T_k = 5"):
        document = variants.document(torch.zeros(5, dtype=torch.int64))
        variants.flex(q, q, q, mask_mod=document, sinks=torch.zeros(4), compiled=False)
    mask = variants.block_mask(variants.causal, 3, 3)
    with pytest.raises(ValueError, match="pass mask_mod, not a block_mask"):
        variants.flex(q, q, q, block_mask=mask, sinks=torch.zeros(4), compiled=False)


# ---------------------------------------------------------------------------------------------
# The Triton forward (Triton's interpreter on the CPU): the sink as one more term in ell


@pytest.mark.parametrize(
    "heads, kv_heads, t_q, t_k, d_k", [(4, 2, 20, 33, 40), (2, 1, 1, 33, 64), (2, 2, 33, 5, 32)]
)
def test_triton_forward_and_backward_with_sinks(heads, kv_heads, t_q, t_k, d_k) -> None:
    from mha.kernels import triton_attention

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, heads, t_q, d_k, generator=gen).requires_grad_()
    k = torch.randn(1, kv_heads, t_k, d_k, generator=gen).requires_grad_()
    v = torch.randn(1, kv_heads, t_k, d_k, generator=gen).requires_grad_()
    sinks = (2 * torch.randn(heads, generator=gen)).requires_grad_()
    # The kernel's inputs on its device; .to() is differentiable, so the gradients reach the CPU
    # leaves, where the dense form is computed and the results compared.
    q_d, k_d, v_d, s_d = (t.to(KERNEL_DEVICE) for t in (q, k, v, sinks))
    out = triton_attention(q_d, k_d, v_d, causal=True, sinks=s_d, block_q=16, block_k=16).cpu()
    expected, _ = dense_with_sinks(q, k, v, sinks, causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-6)
    d_out = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad((out * d_out).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((expected * d_out).sum(), (q, k, v, sinks))
    for name, a, b in zip("q k v sinks".split(), got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-6, msg=f"d {name}")


def test_triton_refuses_bad_sinks() -> None:
    from mha.kernels import triton_attention

    q = torch.zeros(1, 4, 3, 16, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(4,\)"):
        triton_attention(q, q, q, sinks=torch.zeros(2, device=KERNEL_DEVICE))
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        triton_attention(q, q, q, sinks=[0.0] * 4)
