"""mha.MultiHeadAttention against the NumPy reference (mha.reference), given the same weights.

The reference writes projections as x @ W with W of shape (d_in, d_out), the transpose of
torch's (d_out, d_in), and its boolean masks say True = may attend (torch: True = not allowed).
It has no biases, so the module is built with bias=False. The reference gives a fully masked
query row zero weights and zero output; so must the module, and these tests include such rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mha import functional
from mha.module import MultiHeadAttention
from mha.reference import (
    causal_mask,
    multi_head_attention,
    multi_head_cross_attention,
    padding_mask,
)

TOL = 1e-10  # float64 throughout


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference_weights(module: MultiHeadAttention) -> tuple[np.ndarray, ...]:
    """The module's projections as the reference's (d_in, d_out) matrices: w_q, w_k, w_v, w_o."""
    return functional.reference_weights(module)[:4]


@st.composite
def cases(draw: st.DrawFn) -> dict:
    num_heads = draw(st.sampled_from([1, 2, 4]))
    cross = draw(st.booleans())
    t_q = draw(st.integers(1, 5))
    return dict(
        num_heads=num_heads,
        embed_dim=num_heads * draw(st.sampled_from([1, 3])),
        cross=cross,
        kv_dim=draw(st.sampled_from([None, 5]))
        if cross
        else None,  # None: kdim = vdim = embed_dim
        batch=draw(st.sampled_from([None, 1, 3])),
        t_q=t_q,
        t_k=draw(st.integers(1, 5)) if cross else t_q,
        mask=draw(st.sampled_from([None, "causal", "padding", "causal+padding", "per_head"])),
        need_weights=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(derandomize=True, deadline=None, max_examples=120)
@given(case=cases())
def test_parity_with_numpy_reference(case: dict) -> None:
    rng = np.random.default_rng(case["seed"])
    torch.manual_seed(case["seed"] % 2**31)
    e, h, t_q, t_k = (
        case["embed_dim"],
        case["num_heads"],
        case["t_q"],
        case["t_k"],
    )
    kv_dim = case["kv_dim"] or e
    b = case["batch"]
    lead = () if b is None else (b,)
    module = MultiHeadAttention(
        e,
        h,
        bias=False,
        kdim=case["kv_dim"],
        vdim=case["kv_dim"],
        dtype=torch.float64,
        batch_first=True,
    ).eval()

    x_q = rng.normal(size=(*lead, t_q, e))
    x_kv = rng.normal(size=(*lead, t_k, kv_dim)) if case["cross"] else x_q

    # Masks in the reference's convention (True = may attend), broadcastable to (..., H, T_q, T_k),
    # and the same masks in torch's convention (True = not allowed).
    ref_mask, attn_mask, key_padding_mask = None, None, None
    if "causal" in (case["mask"] or ""):
        allowed = causal_mask(t_q, t_k)  # (T_q, T_k)
        ref_mask, attn_mask = allowed, torch.from_numpy(~allowed)
    if "padding" in (case["mask"] or ""):
        lengths = rng.integers(
            0, t_k + 1, size=b or 1
        )  # length 0: every key padded, fully masked rows
        keep = padding_mask(lengths, t_k)  # (B, T_k)
        padded = keep[:, None, None, :]  # (B, 1, 1, T_k)
        if b is None:
            keep, padded = keep[0], padded[0]  # (T_k,), (1, 1, T_k)
        ref_mask = padded if ref_mask is None else padded & ref_mask
        key_padding_mask = torch.from_numpy(~keep)
    if case["mask"] == "per_head":
        allowed = rng.random((b or 1, h, t_q, t_k)) < 0.6  # some rows end up fully masked
        ref_mask = allowed if b is not None else allowed[0]
        attn_mask = torch.from_numpy(~allowed).reshape((b or 1) * h, t_q, t_k)  # (B * H, T_q, T_k)

    w_q, w_k, w_v, w_o = reference_weights(module)
    if case["cross"]:
        expected, expected_weights = multi_head_cross_attention(
            x_q, x_kv, w_q, w_k, w_v, w_o, h, ref_mask
        )
    else:
        expected, expected_weights = multi_head_attention(x_q, w_q, w_k, w_v, w_o, h, ref_mask)

    query = torch.from_numpy(x_q)
    key = value = torch.from_numpy(x_kv) if case["cross"] else query
    with torch.no_grad():
        output, weights = module(
            query,
            key,
            value,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            need_weights=case["need_weights"],
            average_attn_weights=False,
        )
    np.testing.assert_allclose(output.numpy(), expected, atol=TOL, rtol=TOL)
    if case["need_weights"]:
        assert weights.shape == expected_weights.shape  # (B, H, T_q, T_k) or (H, T_q, T_k)
        np.testing.assert_allclose(weights.numpy(), expected_weights, atol=TOL, rtol=TOL)
    else:
        assert weights is None


def test_reference_parity_covers_fully_masked_rows() -> None:
    """One explicit case: the second sequence is all padding, so all its rows are fully masked."""
    rng = np.random.default_rng(7)
    module = MultiHeadAttention(6, 2, bias=False, dtype=torch.float64, batch_first=True)
    x = rng.normal(size=(2, 4, 6))
    keep = padding_mask(np.array([3, 0]), 4)  # (2, 4)
    expected, expected_weights = multi_head_attention(
        x, *reference_weights(module), 2, keep[:, None, None, :]
    )
    assert np.all(expected[1] == 0.0) and np.all(expected_weights[1] == 0.0)
    for need_weights in (True, False):
        output, weights = module(
            torch.from_numpy(x),
            torch.from_numpy(x),
            torch.from_numpy(x),
            key_padding_mask=torch.from_numpy(~keep),
            need_weights=need_weights,
            average_attn_weights=False,
        )
        np.testing.assert_allclose(output.detach().numpy(), expected, atol=TOL, rtol=TOL)
        if need_weights:
            np.testing.assert_allclose(
                weights.detach().numpy(), expected_weights, atol=TOL, rtol=TOL
            )
