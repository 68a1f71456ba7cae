"""Tests of the NumPy reference (mha.reference).

Expected values come from an independent float64 computation written here with explicit
Python loops over batch, head, query and key (no shared code with the package), or by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mha.reference import (
    causal_mask,
    merge_heads,
    multi_head_attention,
    multi_head_attention_loop,
    multi_head_cross_attention,
    padding_mask,
    scaled_dot_product_attention,
    softmax,
    split_heads,
)

# ---------------------------------------------------------------- independent float64 model


def naive_attention_row(q_row, keys, values, allowed):
    """One query against all keys with plain Python floats: scores, softmax, weighted sum."""
    d_k = len(q_row)
    scores = []
    for j, key in enumerate(keys):
        if allowed[j]:
            scores.append(sum(float(a) * float(b) for a, b in zip(q_row, key)) / math.sqrt(d_k))
        else:
            scores.append(None)
    finite = [s for s in scores if s is not None]
    if not finite:  # fully masked row: zeros by contract
        return [0.0] * len(values[0]), [0.0] * len(keys)
    top = max(finite)
    exps = [0.0 if s is None else math.exp(s - top) for s in scores]
    total = sum(exps)
    weights = [e / total for e in exps]
    out = [
        sum(w * float(values[j][c]) for j, w in enumerate(weights)) for c in range(len(values[0]))
    ]
    return out, weights


def naive_mha(x_q, x_kv, w_q, w_k, w_v, w_o, num_heads, keep=None):
    """Multi-head attention with loops.

    x_*: (B, T, D) float64 arrays; keep: (B, H, T_q, T_k) bool or None.
    """
    batch, t_q, _ = x_q.shape
    t_k = x_kv.shape[1]
    d_model = w_q.shape[1]
    d_k = d_model // num_heads
    q_all = x_q.astype(np.float64) @ w_q
    k_all = x_kv.astype(np.float64) @ w_k
    v_all = x_kv.astype(np.float64) @ w_v
    out = np.zeros((batch, t_q, w_o.shape[1]))
    weights = np.zeros((batch, num_heads, t_q, t_k))
    for b in range(batch):
        concat = np.zeros((t_q, d_model))
        for h in range(num_heads):
            cols = slice(h * d_k, (h + 1) * d_k)
            for i in range(t_q):
                allowed = [True] * t_k if keep is None else list(keep[b, h, i])
                o, w = naive_attention_row(
                    q_all[b, i, cols],
                    k_all[b, :, cols],
                    v_all[b, :, cols],
                    allowed,
                )
                concat[i, cols] = o
                weights[b, h, i] = w
        out[b] = concat @ w_o
    return out, weights


def random_weights(rng, d_in, d_model, d_kv=None):
    d_kv = d_in if d_kv is None else d_kv
    scale = 1.0 / math.sqrt(d_model)
    return (
        rng.normal(0, scale, (d_in, d_model)),
        rng.normal(0, scale, (d_kv, d_model)),
        rng.normal(0, scale, (d_kv, d_model)),
        rng.normal(0, scale, (d_model, d_model)),
    )


def head_slices(w, num_heads):
    d_k = w.shape[1] // num_heads
    return [w[:, h * d_k : (h + 1) * d_k] for h in range(num_heads)]


# ---------------------------------------------------------------- softmax


def test_softmax_rows_sum_to_one_and_are_positive():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 3, (4, 5, 7))
    for axis in (0, 1, 2, -1):
        s = softmax(x, axis=axis)
        np.testing.assert_allclose(s.sum(axis=axis), 1.0, rtol=0, atol=1e-12)
        assert (s > 0).all()


def test_softmax_matches_definition_by_hand():
    # softmax([0, ln 2, ln 3]) = [1, 2, 3] / 6
    s = softmax(np.array([0.0, math.log(2), math.log(3)]))
    np.testing.assert_allclose(s, [1 / 6, 2 / 6, 3 / 6], rtol=1e-14)


@pytest.mark.parametrize("constant", [-1e3, -5.0, 0.0, 7.5, 1e4])
def test_softmax_invariant_to_adding_a_constant(constant):
    x = np.random.default_rng(1).normal(size=(3, 6))
    np.testing.assert_allclose(softmax(x + constant), softmax(x), rtol=1e-9, atol=1e-15)


def test_softmax_stays_finite_for_large_inputs():
    x = np.array([[1e4, -1e4, 0.0], [1e4, 1e4, 1e4], [-1e4, -1e4, -1e4]])
    s = softmax(x)
    assert np.isfinite(s).all()
    np.testing.assert_allclose(s[0], [1.0, 0.0, 0.0], atol=1e-15)
    np.testing.assert_allclose(s[1], [1 / 3] * 3, rtol=1e-14)
    np.testing.assert_allclose(s[2], [1 / 3] * 3, rtol=1e-14)
    # a naive exp overflows here; ours does not
    with np.errstate(over="ignore", invalid="ignore"):
        naive = np.exp(x[0]) / np.exp(x[0]).sum()
    assert not np.isfinite(naive).all()


def test_softmax_all_minus_inf_row_gives_zeros():
    x = np.array([[-np.inf, -np.inf], [0.0, -np.inf]])
    np.testing.assert_array_equal(softmax(x), [[0.0, 0.0], [1.0, 0.0]])


def test_softmax_rejects_nan_and_plus_inf():
    with pytest.raises(ValueError, match="NaN"):
        softmax([0.0, np.nan])
    with pytest.raises(ValueError, match=r"\+inf"):
        softmax([0.0, np.inf])
    with pytest.raises(TypeError, match="x must be a numeric array"):
        softmax(np.array(["a", "b"]))


# ---------------------------------------------------------------- scaled dot-product attention


def test_sdpa_by_hand():
    # One query q = [1, 0]; keys [1, 0] and [0, 1]; d_k = 2 so the scores are [1/sqrt2, 0].
    q = np.array([[1.0, 0.0]])
    k = np.array([[1.0, 0.0], [0.0, 1.0]])
    v = np.array([[10.0], [20.0]])
    out, weights = scaled_dot_product_attention(q, k, v)
    e = math.exp(1 / math.sqrt(2))
    np.testing.assert_allclose(weights, [[e / (e + 1), 1 / (e + 1)]], rtol=1e-14)
    np.testing.assert_allclose(out, [[(10 * e + 20) / (e + 1)]], rtol=1e-14)


def test_sdpa_matches_naive_with_batch_broadcast_and_mask():
    rng = np.random.default_rng(2)
    q = rng.normal(size=(2, 3, 4, 5))  # (B, H, T_q, d_k)
    k = rng.normal(size=(1, 3, 6, 5))  # broadcast over B
    v = rng.normal(size=(2, 1, 6, 7))  # broadcast over H
    keep = rng.random((2, 1, 4, 6)) > 0.4
    keep[..., 0] = True
    out, weights = scaled_dot_product_attention(q, k, v, keep)
    assert out.shape == (2, 3, 4, 7) and weights.shape == (2, 3, 4, 6)
    for b in range(2):
        for h in range(3):
            for i in range(4):
                o, w = naive_attention_row(q[b, h, i], k[0, h], v[b, 0], keep[b, 0, i])
                np.testing.assert_allclose(out[b, h, i], o, rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(weights[b, h, i], w, rtol=1e-12, atol=1e-15)


def test_sdpa_fully_masked_row_gives_zeros_not_nan():
    rng = np.random.default_rng(3)
    q, k, v = (
        rng.normal(size=(3, 4)),
        rng.normal(size=(5, 4)),
        rng.normal(size=(5, 2)),
    )
    keep = np.ones((3, 5), dtype=bool)
    keep[1] = False
    out, weights = scaled_dot_product_attention(q, k, v, keep)
    assert np.isfinite(out).all() and np.isfinite(weights).all()
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(weights[1], 0.0)
    np.testing.assert_allclose(weights[[0, 2]].sum(-1), 1.0, atol=1e-12)


def test_sdpa_masked_keys_get_exactly_zero_weight():
    rng = np.random.default_rng(4)
    q, k, v = (
        rng.normal(size=(4, 3)),
        rng.normal(size=(4, 3)),
        rng.normal(size=(4, 3)),
    )
    keep = causal_mask(4)
    _, weights = scaled_dot_product_attention(q, k, v, keep)
    np.testing.assert_array_equal(weights[~keep], 0.0)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-12)


def test_sdpa_errors_name_the_argument():
    q, k, v = np.ones((3, 4)), np.ones((5, 4)), np.ones((5, 2))
    with pytest.raises(ValueError, match=r"q and k must have the same last dimension d_k"):
        scaled_dot_product_attention(q, np.ones((5, 3)), v)
    with pytest.raises(ValueError, match=r"k and v must have the same number of positions"):
        scaled_dot_product_attention(q, k, np.ones((6, 2)))
    with pytest.raises(
        ValueError,
        match=r"mask must broadcast to the scores' shape \(3, 5\).*got shape \(3, 4\)",
    ):
        scaled_dot_product_attention(q, k, v, np.ones((3, 4), dtype=bool))
    with pytest.raises(TypeError, match="mask must be a boolean array"):
        scaled_dot_product_attention(q, k, v, np.ones((3, 5)))
    with pytest.raises(ValueError, match=r"q must have shape \(\.\.\., T_q, d_k\)"):
        scaled_dot_product_attention(np.ones(4), k, v)
    with pytest.raises(ValueError, match="do not broadcast"):
        scaled_dot_product_attention(np.ones((2, 3, 4)), np.ones((3, 5, 4)), np.ones((3, 5, 2)))


# ---------------------------------------------------------------- heads


def test_split_and_merge_heads_by_hand_and_round_trip():
    x = np.arange(2 * 3 * 4).reshape(2, 3, 4)  # (B=2, T=3, D=4)
    heads = split_heads(x, 2)  # (B, H=2, T, d_k=2)
    assert heads.shape == (2, 2, 3, 2)
    # head 0 of token t holds features 0, 1 of token t; head 1 holds features 2, 3
    np.testing.assert_array_equal(heads[0, 0], [[0, 1], [4, 5], [8, 9]])
    np.testing.assert_array_equal(heads[0, 1], [[2, 3], [6, 7], [10, 11]])
    np.testing.assert_array_equal(merge_heads(heads), x)


def test_split_heads_errors():
    with pytest.raises(ValueError, match=r"must be divisible by num_heads \(3\)"):
        split_heads(np.ones((2, 4)), 3)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        split_heads(np.ones(4), 2)
    with pytest.raises(ValueError, match="at least 3 dimensions"):
        merge_heads(np.ones((3, 4)))
    with pytest.raises(TypeError, match="num_heads must be an int"):
        split_heads(np.ones((2, 4)), 2.0)


# ---------------------------------------------------------------- multi-head attention


CONFIGS = [
    (batch, t, d_model, heads)
    for batch in (1, 3)
    for t in (1, 5, 17)
    for d_model, heads in ((4, 1), (4, 2), (12, 3), (16, 4), (24, 8))
]


@pytest.mark.parametrize("batch,t,d_model,heads", CONFIGS)
def test_loop_equals_fused_equals_naive(batch, t, d_model, heads):
    rng = np.random.default_rng(batch * 1000 + t * 10 + heads)
    x = rng.normal(size=(batch, t, d_model))
    w_q, w_k, w_v, w_o = random_weights(rng, d_model, d_model)
    fused_out, fused_w = multi_head_attention(x, w_q, w_k, w_v, w_o, heads)
    loop_out, loop_w = multi_head_attention_loop(
        x,
        head_slices(w_q, heads),
        head_slices(w_k, heads),
        head_slices(w_v, heads),
        w_o,
    )
    naive_out, naive_w = naive_mha(x, x, w_q, w_k, w_v, w_o, heads)
    assert fused_out.shape == (batch, t, d_model) and fused_w.shape == (
        batch,
        heads,
        t,
        t,
    )
    np.testing.assert_allclose(fused_out, loop_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(fused_w, loop_w, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(fused_out, naive_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(fused_w, naive_w, rtol=1e-10, atol=1e-14)


def test_unbatched_input_equals_batch_of_one():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(6, 8))
    w = random_weights(rng, 8, 8)
    out2, w2 = multi_head_attention(x, *w, num_heads=2)
    out3, w3 = multi_head_attention(x[None], *w, num_heads=2)
    assert out2.shape == (6, 8) and w2.shape == (2, 6, 6)
    np.testing.assert_allclose(out2, out3[0], rtol=1e-13)
    np.testing.assert_allclose(w2, w3[0], rtol=1e-13)


def test_cross_attention_matches_naive_with_padding_mask():
    rng = np.random.default_rng(6)
    x_q, x_kv = (
        rng.normal(size=(2, 3, 8)),
        rng.normal(size=(2, 5, 6)),
    )  # T_q=3, T_k=5, D_kv=6
    w_q, w_k, w_v, w_o = random_weights(rng, 8, 8, d_kv=6)
    valid = padding_mask(np.array([5, 2]), 5)  # (B, T_k)
    mask = valid[:, None, None, :]  # (B, 1, 1, T_k): same keys hidden from every head and query
    out, weights = multi_head_cross_attention(x_q, x_kv, w_q, w_k, w_v, w_o, 4, mask)
    keep = np.broadcast_to(mask, (2, 4, 3, 5))
    naive_out, naive_w = naive_mha(x_q, x_kv, w_q, w_k, w_v, w_o, 4, keep)
    assert weights.shape == (2, 4, 3, 5)
    np.testing.assert_allclose(out, naive_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(weights, naive_w, rtol=1e-10, atol=1e-14)
    np.testing.assert_array_equal(weights[1, :, :, 2:], 0.0)  # padded keys of sequence 1


def test_causal_mask_in_mha_makes_outputs_ignore_the_future():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(1, 6, 8))
    w = random_weights(rng, 8, 8)
    out, _ = multi_head_attention(x, *w, num_heads=2, mask=causal_mask(6))
    x_changed = x.copy()
    x_changed[0, 4:] = rng.normal(size=(2, 8))
    out_changed, _ = multi_head_attention(x_changed, *w, num_heads=2, mask=causal_mask(6))
    np.testing.assert_allclose(out[0, :4], out_changed[0, :4], rtol=1e-13)
    assert not np.allclose(out[0, 4:], out_changed[0, 4:])


def test_per_head_mask_in_loop_and_fused_agree():
    rng = np.random.default_rng(8)
    x = rng.normal(size=(2, 4, 8))
    w_q, w_k, w_v, w_o = random_weights(rng, 8, 8)
    keep = rng.random((2, 2, 4, 4)) > 0.3  # (B, H, T, T), a different mask per head
    keep[:, :, 1, :] = False  # query 1 sees nothing, in every head
    fused = multi_head_attention(x, w_q, w_k, w_v, w_o, 2, keep)
    loop = multi_head_attention_loop(
        x,
        head_slices(w_q, 2),
        head_slices(w_k, 2),
        head_slices(w_v, 2),
        w_o,
        keep,
    )
    naive = naive_mha(x, x, w_q, w_k, w_v, w_o, 2, keep)
    for got in (fused, loop):
        np.testing.assert_allclose(got[0], naive[0], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got[1], naive[1], rtol=1e-10, atol=1e-14)
    np.testing.assert_array_equal(fused[1][:, :, 1, :], 0.0)
    assert np.isfinite(fused[0]).all()


def test_mha_errors_name_the_argument():
    x = np.ones((2, 5, 6))
    w = [np.ones((6, 6))] * 4
    with pytest.raises(
        ValueError,
        match=r"d_model .*\(6\) must be divisible by num_heads \(4\)",
    ):
        multi_head_attention(x, *w, num_heads=4)
    with pytest.raises(
        ValueError,
        match=r"x must have shape \(T, d\) or \(B, T, d\).*got shape \(1, 2, 5, 6\)",
    ):
        multi_head_attention(x[None], *w, num_heads=2)
    with pytest.raises(
        ValueError,
        match=r"w_q must have shape \(5, d_model\), got shape \(6, 6\)",
    ):
        multi_head_attention(np.ones((2, 5, 5)), *w, num_heads=2)
    with pytest.raises(
        ValueError,
        match=r"w_o must have shape \(6, D_out\), got shape \(4, 6\)",
    ):
        multi_head_attention(x, w[0], w[1], w[2], np.ones((4, 6)), num_heads=2)
    with pytest.raises(ValueError, match="mask must broadcast"):
        multi_head_attention(x, *w, num_heads=2, mask=np.ones((3, 3), dtype=bool))
    with pytest.raises(
        ValueError,
        match="x_q and x_kv must both be batched with the same batch size",
    ):
        multi_head_cross_attention(np.ones((2, 3, 6)), np.ones((3, 3, 6)), *w, num_heads=2)
    with pytest.raises(ValueError, match="num_heads must be a positive int, got 0"):
        multi_head_attention(x, *w, num_heads=0)
    with pytest.raises(ValueError, match="same length"):
        multi_head_attention_loop(
            x,
            [np.ones((6, 3))] * 2,
            [np.ones((6, 3))],
            [np.ones((6, 3))] * 2,
            w[3],
        )
    with pytest.raises(ValueError, match=r"mask's head axis"):
        multi_head_attention_loop(
            x,
            [np.ones((6, 3))] * 2,
            [np.ones((6, 3))] * 2,
            [np.ones((6, 3))] * 2,
            w[3],
            mask=np.ones((2, 3, 5, 5), dtype=bool),
        )


# ---------------------------------------------------------------- masks


def test_causal_mask_by_hand():
    np.testing.assert_array_equal(
        causal_mask(3),
        [[True, False, False], [True, True, False], [True, True, True]],
    )
    np.testing.assert_array_equal(causal_mask(2, 3), [[True, False, False], [True, True, False]])
    with pytest.raises(ValueError, match="t_q must be a positive int"):
        causal_mask(0)


def test_padding_mask_by_hand():
    np.testing.assert_array_equal(
        padding_mask(np.array([3, 1, 0]), 3),
        [[True, True, True], [True, False, False], [False, False, False]],
    )
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, max_len=3\]"):
        padding_mask(np.array([4]), 3)
    with pytest.raises(TypeError, match="lengths must be an array of ints, got dtype float64"):
        padding_mask(np.array([1.5]), 3)
    with pytest.raises(ValueError, match="lengths must be a 1-D array of ints"):
        padding_mask(np.array([[1]]), 3)
