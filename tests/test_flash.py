"""Tests of mha.flash: the tiled online-softmax attention, forward and backward, NumPy and torch.

The expected values come from elsewhere: a two-key example computed by hand, the NumPy reference
(which writes out every score, with the bottom-right causal mask of mha.reference.causal_mask and
the key/value heads repeated per query head as transformers' repeat_kv does), a logsumexp computed
directly from all scores, and torch autograd through the materialising torch attention
(mha.functional.attention) and gradcheck.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
import torch
from mha import flash, reference
from mha.functional import attention, causal_mask

from helpers import randn

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _repeat_kv(q, *tensors):
    """k and v with each key/value head repeated for its H / H_kv query heads (copies)."""
    if q.ndim < 3 or tensors[0].ndim < 3 or q.shape[-3] <= tensors[0].shape[-3]:
        return tensors  # no grouping: equal head counts, or heads that broadcast
    group = q.shape[-3] // tensors[0].shape[-3]
    if isinstance(q, torch.Tensor):
        return [t.repeat_interleave(group, dim=-3) for t in tensors]
    return [np.repeat(t, group, axis=-3) for t in tensors]


def _mask(q, k, causal: bool):
    if not causal:
        return None
    return reference.causal_mask(q.shape[-2], k.shape[-2], align="bottom-right")


def _reference(q, k, v, causal: bool):
    """Every score written out; a row that sees no key gives zeros (the reference's rule)."""
    k, v = _repeat_kv(q, k, v)
    return reference.scaled_dot_product_attention(q, k, v, _mask(q, k, causal))[0]


def _direct_logsumexp(q, k, causal: bool) -> np.ndarray:
    """log(sum_j exp(score_ij)) over every visible key, from all scores at once (float64)."""
    (k,) = _repeat_kv(q, k)
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = np.where(_mask(q, k, True), scores, -np.inf)
    return np.logaddexp.reduce(scores, axis=-1)  # -inf for a row with no visible key


# ---------------------------------------------------------------------------------------------
# Forward, NumPy


def test_two_keys_by_hand() -> None:
    # One query, two keys, blocks of one key: the second key raises the running maximum from 0
    # to 1, so the first key's contribution must be rescaled by exp(0 - 1).
    # scores = [0, 1] (scale 1); weights = [1, e] / (1 + e); out = weights @ [[2], [-1]].
    q = np.array([[1.0, 0.0]])
    k = np.array([[0.0, 0.0], [1.0, 0.0]])
    v = np.array([[2.0], [-1.0]])
    out, lse = flash.flash_attention(q, k, v, block_q=1, block_k=1, scale=1.0)
    e = math.e
    assert out[0, 0] == pytest.approx((2.0 - e) / (1.0 + e), rel=1e-15)
    assert lse[0] == pytest.approx(math.log(1.0 + e), rel=1e-15)  # 1.3132616875182228


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "t_q, t_k, block_q, block_k",
    [
        (64, 64, 16, 16),  # whole blocks
        (37, 37, 16, 8),  # partial last blocks
        (37, 37, 1, 1),  # one score per tile
        (37, 37, 64, 64),  # one tile holds everything
        (20, 45, 8, 16),  # cross-attention, T_q < T_k
        (45, 20, 16, 8),  # T_q > T_k: later queries see every key when causal
    ],
)
def test_forward_equals_reference(causal, t_q, t_k, block_q, block_k, rng) -> None:
    q = rng.normal(size=(2, 3, t_q, 8))
    k = rng.normal(size=(2, 3, t_k, 8))
    v = rng.normal(size=(2, 3, t_k, 5))
    out, lse = flash.flash_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    assert out.shape == (2, 3, t_q, 5) and lse.shape == (2, 3, t_q)
    np.testing.assert_allclose(out, _reference(q, k, v, causal), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, _direct_logsumexp(q, k, causal), rtol=1e-12, atol=1e-12)


def test_forward_broadcasts_leading_axes_and_keeps_float32(rng) -> None:
    q = rng.normal(size=(2, 1, 30, 16)).astype(np.float32)
    k = rng.normal(size=(1, 4, 30, 16)).astype(np.float32)
    v = rng.normal(size=(1, 4, 30, 16)).astype(np.float32)
    out, lse = flash.flash_attention(q, k, v, causal=True, block_q=8, block_k=8)
    assert out.dtype == np.float32 and out.shape == (2, 4, 30, 16)
    expected = _reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), True)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_large_scores_do_not_overflow(rng) -> None:
    # Scores around 1000: exp(1000) overflows float64; the running maximum keeps exp <= 1.
    q = 30.0 * rng.normal(size=(12, 4))
    k = 30.0 * rng.normal(size=(12, 4))
    v = rng.normal(size=(12, 4))
    out, lse = flash.flash_attention(q, k, v, block_q=4, block_k=4, scale=1.0)
    expected = reference.scaled_dot_product_attention(q, k, v, scale=1.0)[0]
    assert np.isfinite(out).all() and np.abs(lse).max() > 710  # exp(710) overflows
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)


def test_causal_pass_never_reads_the_tiles_above_the_diagonal(rng) -> None:
    # NaN values in keys 8..15 would poison every output row that reads them, even with weight
    # 0 (0 * NaN = NaN). With blocks of 8, queries 0..7 must not touch them.
    q, k, v = rng.normal(size=(3, 16, 4))
    v[8:] = np.nan
    out, _ = flash.flash_attention(q, k, v, causal=True, block_q=8, block_k=8)
    assert np.isfinite(out[:8]).all() and np.isnan(out[8:]).all()
    np.testing.assert_allclose(out[:8], _reference(q[:8], k[:8], v[:8], True), rtol=1e-12)


def test_tile_schedule_by_hand() -> None:
    # T = 256, blocks of 64: a 4 x 4 grid of tiles. Causal: the 4 diagonal tiles are masked in
    # part, the 6 below are whole, the 6 above are skipped: 10 of 16 tiles computed.
    expected = np.array([[2, 0, 0, 0], [1, 2, 0, 0], [1, 1, 2, 0], [1, 1, 1, 2]])
    np.testing.assert_array_equal(flash.tile_schedule(256, 256, causal=True), expected)
    np.testing.assert_array_equal(flash.tile_schedule(256, 256), np.ones((4, 4)))
    # T = 100 with blocks of 64 and 32: 2 x 4 tiles. Query block 0 (rows 0..63) sees keys
    # 0..63: key blocks 0, 1 whole-or-diagonal; query block 1 (rows 64..99) sees all keys.
    expected = np.array([[2, 2, 0, 0], [1, 1, 2, 2]])
    np.testing.assert_array_equal(
        flash.tile_schedule(100, 100, causal=True, block_q=64, block_k=32), expected
    )


def test_fused_forward_bytes_by_hand() -> None:
    # B = 1, H = 2, T = 256, d_k = 64, 2 bytes: q and out are 2 * 2 * 256 * 64 = 65536
    # elements; k and v read once per head are as many again: 262144 bytes in all. With query
    # tiles of 64, each of the 4 tiles of each head reads k and v: 4 * 65536 elements.
    assert flash.fused_forward_bytes(1, 2, 256, 256, 64) == 262144
    assert flash.fused_forward_bytes(1, 2, 256, 256, 64, block_q=64) == (65536 + 262144) * 2
    # GQA, 8 query heads on 2 key/value heads, read once: k and v of 2 heads only.
    grouped = flash.fused_forward_bytes(1, 8, 100, 300, 128, kv_heads=2, bytes_per_element=4)
    assert grouped == (2 * 8 * 100 * 128 + 2 * 2 * 300 * 128) * 4
    with pytest.raises(ValueError, match="block_q must be a positive int, got 0"):
        flash.fused_forward_bytes(1, 2, 256, 256, 64, block_q=0)


def test_tiled_forward_holds_no_t_by_t_array(rng) -> None:
    # Peak of NumPy's own allocations (traced by tracemalloc) during one call, T = 1024: the
    # reference holds float64 (T, T) scores (8 MiB); the tiled pass only (64, 64) tiles.
    t, d = 1024, 16
    q, k, v = rng.normal(size=(3, t, d))
    peaks = {}
    for name, run in (
        ("reference", lambda: reference.scaled_dot_product_attention(q, k, v)),
        ("tiled", lambda: flash.flash_attention(q, k, v)),
    ):
        tracemalloc.start()
        run()
        peaks[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks["reference"] >= 8 * t * t
    assert peaks["tiled"] < 8 * t * t / 10


# ---------------------------------------------------------------------------------------------
# The shapes of decoding: bottom-right causal, grouped key/value heads, split keys


def test_one_query_sees_every_key_when_causal(rng) -> None:
    # Bottom-right alignment, derived by hand: the only query of a decoding step is the newest
    # token, so with causal=True it attends to all 37 keys, exactly as without a mask. (Top-left
    # alignment would let it see key 0 alone and return v[0].)
    q, k, v = rng.normal(size=(1, 8)), rng.normal(size=(37, 8)), rng.normal(size=(37, 5))
    causal, _ = flash.flash_attention(q, k, v, causal=True, block_q=16, block_k=8)
    full = reference.scaled_dot_product_attention(q, k, v)[0]  # no mask at all
    np.testing.assert_allclose(causal, full, rtol=1e-12, atol=1e-12)
    assert np.abs(causal - v[0]).max() > 0.1


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("t_q, t_k", [(1, 37), (5, 37), (37, 5), (20, 20)])
def test_numpy_decode_shapes_forward_and_backward(heads, kv_heads, t_q, t_k, rng) -> None:
    # T_q = 1: a decoding step; T_q < T_k: a chunk of a prompt after a cache; T_q > T_k: the
    # first T_q - T_k queries see no key when causal (zero output, logsumexp -inf, no NaN).
    q = rng.normal(size=(2, heads, t_q, 8))
    k = rng.normal(size=(2, kv_heads, t_k, 8))
    v = rng.normal(size=(2, kv_heads, t_k, 6))
    d_out = rng.normal(size=(2, heads, t_q, 6))
    for causal in (False, True):
        tiles = dict(causal=causal, block_q=4, block_k=8)
        out, lse = flash.flash_attention(q, k, v, **tiles)
        np.testing.assert_allclose(out, _reference(q, k, v, causal), rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(
            np.isneginf(lse), np.isneginf(_direct_logsumexp(q, k, causal))
        )
        finite = np.isfinite(lse)
        np.testing.assert_allclose(lse[finite], _direct_logsumexp(q, k, causal)[finite], 1e-12)
        assert finite.all() == (not causal or t_q <= t_k)
        grads = flash.flash_attention_backward(q, k, v, out, lse, d_out, **tiles)
        expected = _autograd_gradients(q, k, v, d_out, causal)
        for name, got, want in zip("qkv", grads, expected):
            assert got.shape == want.shape and np.isfinite(got).all(), f"d{name}"
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"d{name}")


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 1)])
@pytest.mark.parametrize("t_q, t_k", [(1, 37), (5, 37), (37, 5)])
def test_torch_decode_shapes_forward_and_backward(heads, kv_heads, t_q, t_k, rng) -> None:
    q = rng.normal(size=(2, heads, t_q, 8))
    k = rng.normal(size=(2, kv_heads, t_k, 8))
    v = rng.normal(size=(2, kv_heads, t_k, 6))
    d_out = rng.normal(size=(2, heads, t_q, 6))
    leaves = [torch.tensor(t, requires_grad=True) for t in (q, k, v)]
    out, lse = flash.flash_attention_torch(*leaves, causal=True, block_q=4, block_k=16)
    np.testing.assert_allclose(out.detach().numpy(), _reference(q, k, v, True), rtol=1e-12)
    np.testing.assert_allclose(lse.detach().numpy(), _direct_logsumexp(q, k, True), rtol=1e-12)
    out.backward(torch.tensor(d_out))
    for name, leaf, expected in zip("qkv", leaves, _autograd_gradients(q, k, v, d_out, True)):
        assert leaf.grad.shape == leaf.shape
        np.testing.assert_allclose(
            leaf.grad.numpy(), expected, rtol=1e-10, atol=1e-12, err_msg=f"d{name}"
        )


@pytest.mark.parametrize("d_k", [40, 80, 96, 256])
def test_torch_head_sizes_people_run(d_k, rng) -> None:
    # GQA, a chunk of 3 queries after 9 cached keys, causal, float64: forward and gradients.
    q = rng.normal(size=(1, 4, 3, d_k))
    k, v = rng.normal(size=(2, 1, 2, 12, d_k))
    d_out = rng.normal(size=(1, 4, 3, d_k))
    leaves = [torch.tensor(t, requires_grad=True) for t in (q, k, v)]
    out, _ = flash.flash_attention_torch(*leaves, causal=True, block_q=2, block_k=5)
    expected = _reference(q, k, v, True)
    np.testing.assert_allclose(out.detach().numpy(), expected, rtol=1e-12, atol=1e-12)
    out.backward(torch.tensor(d_out))
    for name, leaf, expected in zip("qkv", leaves, _autograd_gradients(q, k, v, d_out, True)):
        np.testing.assert_allclose(
            leaf.grad.numpy(), expected, rtol=1e-10, atol=1e-12, err_msg=f"d{name}"
        )


def test_grouped_heads_are_views_not_copies(rng) -> None:
    # Query head h reads key/value head h // (H / H_kv): heads 0, 1 read kv head 0; 2, 3 read 1.
    q = rng.normal(size=(4, 3, 8))
    k, v = rng.normal(size=(2, 2, 5, 8))
    grouped_q, grouped_k, grouped_v, grouped = flash.group_heads(q, k, v)
    assert grouped and grouped_q.shape == (2, 2, 3, 8) and grouped_k.shape == (2, 1, 5, 8)
    assert all(np.shares_memory(a, b) for a, b in ((grouped_q, q), (grouped_k, k)))
    np.testing.assert_array_equal(grouped_q[1, 0], q[2])  # head 2 is group 1, member 0
    out, _ = flash.flash_attention(q, k, v)
    np.testing.assert_allclose(out[3], _reference(q[3], k[1], v[1], False), rtol=1e-12)


@pytest.mark.parametrize("num_splits", [1, 3, 7, 50])
@pytest.mark.parametrize("t_q, t_k", [(1, 45), (4, 45), (45, 20)])
def test_split_kv_equals_reference(num_splits, t_q, t_k, rng) -> None:
    # 50 splits of 45 keys: one key per split. T_q > T_k, causal: some rows see no key at all,
    # and some splits hold no visible key for a row: both weigh nothing in the merge.
    q = rng.normal(size=(2, 4, t_q, 8))
    k, v = rng.normal(size=(2, 2, 2, t_k, 8))
    for causal in (False, True):
        out, lse = flash.split_kv_attention(
            q, k, v, num_splits=num_splits, causal=causal, block_k=4
        )
        np.testing.assert_allclose(out, _reference(q, k, v, causal), rtol=1e-12, atol=1e-12)
        expected = _direct_logsumexp(q, k, causal)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(lse[finite], expected[finite], rtol=1e-12)


def test_merge_partials_by_hand() -> None:
    # Part 0 saw one key with score 0 and value 2; part 1 one key with score log 3 and value
    # -2: weights 1/4 and 3/4, so out = 2/4 - 6/4 = -1, logsumexp = log(1 + 3) = log 4. A third
    # part saw nothing (logsumexp -inf) and must not count.
    outs = np.array([[[2.0]], [[-2.0]], [[0.0]]])  # (S, T_q, d_v)
    logsumexps = np.array([[0.0], [math.log(3.0)], [-np.inf]])  # (S, T_q)
    out, lse = flash.merge_partials(outs, logsumexps)
    assert out[0, 0] == pytest.approx(-1.0, rel=1e-15)
    assert lse[0] == pytest.approx(math.log(4.0), rel=1e-15)


def test_tile_schedule_bottom_right() -> None:
    # T_q = 64 queries after 192 cached keys (T_k = 256), tiles of 64: query i sees keys up to
    # i + 192, so key tiles 0..2 are whole and tile 3 is crossed by the diagonal.
    np.testing.assert_array_equal(
        flash.tile_schedule(64, 256, causal=True), np.array([[1, 1, 1, 2]])
    )
    # T_q = 128 > T_k = 64: queries 0..63 see no key (their tile is skipped), the second query
    # tile (64..127) sees keys 0..i - 64, crossed by the diagonal.
    np.testing.assert_array_equal(flash.tile_schedule(128, 64, causal=True), np.array([[0], [2]]))


# ---------------------------------------------------------------------------------------------
# Backward, NumPy and torch


def _autograd_gradients(q, k, v, d_out, causal: bool):
    """Gradients by torch autograd through the materialising attention, float64.

    With causal and T_q > T_k, the first T_q - T_k queries see no key: their output is a
    constant zero, so their dq is zero and they add nothing to dk, dv. Autograd runs on the
    other queries only (through a fully masked row the materialising softmax gives NaN).
    """
    blind = max(0, q.shape[-2] - k.shape[-2]) if causal else 0
    leaves = [torch.tensor(t, requires_grad=True) for t in (q[..., blind:, :], k, v)]
    k_all, v_all = _repeat_kv(leaves[0], *leaves[1:])  # autograd sums each group's copies
    t_q = q.shape[-2] - blind
    mask = causal_mask(t_q, k.shape[-2], align="bottom-right") if causal else None
    out, _ = attention(leaves[0], k_all, v_all, mask)
    out.backward(torch.tensor(d_out[..., blind:, :]))
    dq, dk, dv = (leaf.grad.numpy() for leaf in leaves)
    dq = np.concatenate([np.zeros(q.shape[:-2] + (blind, q.shape[-1])), dq], axis=-2)
    return dq, dk, dv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t_q, t_k", [(37, 37), (21, 30)])
def test_numpy_backward_equals_autograd(causal, t_q, t_k, rng) -> None:
    q = rng.normal(size=(2, t_q, 8))
    k = rng.normal(size=(2, t_k, 8))
    v = rng.normal(size=(2, t_k, 6))
    d_out = rng.normal(size=(2, t_q, 6))
    out, lse = flash.flash_attention(q, k, v, causal=causal, block_q=16, block_k=8)
    grads = flash.flash_attention_backward(
        q, k, v, out, lse, d_out, causal=causal, block_q=16, block_k=8
    )
    for name, got, expected in zip("qkv", grads, _autograd_gradients(q, k, v, d_out, causal)):
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12, err_msg=f"d{name}")


@pytest.mark.parametrize("causal", [False, True])
def test_torch_version_equals_reference_and_autograd(causal, rng) -> None:
    q, k, v = (rng.normal(size=(2, 3, 29, 8)) for _ in range(3))
    d_out = rng.normal(size=(2, 3, 29, 8))
    leaves = [torch.tensor(t, requires_grad=True) for t in (q, k, v)]
    out, lse = flash.flash_attention_torch(*leaves, causal=causal, block_q=8, block_k=16)
    np.testing.assert_allclose(out.detach().numpy(), _reference(q, k, v, causal), rtol=1e-12)
    np.testing.assert_allclose(lse.detach().numpy(), _direct_logsumexp(q, k, causal), rtol=1e-12)
    out.backward(torch.tensor(d_out))
    for name, leaf, expected in zip("qkv", leaves, _autograd_gradients(q, k, v, d_out, causal)):
        np.testing.assert_allclose(
            leaf.grad.numpy(), expected, rtol=1e-10, atol=1e-12, err_msg=f"d{name}"
        )


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_of_output_and_logsumexp(causal) -> None:
    # Finite differences of both outputs; the logsumexp's gradient adds p * d_lse to the scores'.
    q, k, v = (randn(1, 2, 7, 4, seed=s).requires_grad_() for s in range(3))

    def both(q, k, v):
        return flash.flash_attention_torch(q, k, v, causal=causal, block_q=3, block_k=2)

    assert torch.autograd.gradcheck(both, (q, k, v))


def test_gradcheck_grouped_heads_fewer_queries_than_keys() -> None:
    # Two query heads share one key/value head; 3 queries after 4 cached keys, causal.
    q = randn(1, 2, 3, 4, seed=0).requires_grad_()
    k, v = (randn(1, 1, 7, 4, seed=s).requires_grad_() for s in (1, 2))

    def both(q, k, v):
        return flash.flash_attention_torch(q, k, v, causal=True, block_q=2, block_k=3)

    assert torch.autograd.gradcheck(both, (q, k, v))


def test_backward_stores_no_weights() -> None:
    # What autograd keeps for the backward pass: q, k, v, out and logsumexp, nothing (T, T).
    t = 48
    q, k, v = (randn(1, 2, t, 8, seed=s).requires_grad_() for s in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda x: saved.append(x.shape) or x, lambda x: x
    ):
        out, _ = flash.flash_attention_torch(q, k, v, block_q=16, block_k=16)
    assert sorted(saved) == sorted([(1, 2, t, 8)] * 4 + [(1, 2, t)])


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_torch_version_in_16_bits_keeps_float32_statistics(dtype, tolerance) -> None:
    q, k, v = (randn(2, 2, 50, 16, seed=s).to(dtype) for s in range(3))
    out, lse = flash.flash_attention_torch(q, k, v, causal=True, block_q=16, block_k=16)
    assert out.dtype == dtype and lse.dtype == torch.float32
    expected = _reference(*(t.double().numpy() for t in (q, k, v)), True)
    np.testing.assert_allclose(out.double().numpy(), expected, rtol=tolerance, atol=tolerance)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_arguments_raise_clear_errors(rng) -> None:
    q = rng.normal(size=(5, 4))
    with pytest.raises(TypeError, match="block_q must be an int, got float"):
        flash.flash_attention(q, q, q, block_q=2.0)
    with pytest.raises(ValueError, match="block_k must be a positive int, got 0"):
        flash.flash_attention(q, q, q, block_k=0)
    with pytest.raises(ValueError, match="scale must be a positive finite float, got -1"):
        flash.flash_attention(q, q, q, scale=-1.0)
    with pytest.raises(ValueError, match="same last dimension d_k"):
        flash.flash_attention(q, rng.normal(size=(5, 3)), q)
    with pytest.raises(ValueError, match="at least one position"):
        flash.flash_attention(q[:0], q, q)
    out, lse = flash.flash_attention(q, q, q)
    with pytest.raises(ValueError, match=r"logsumexp must have shape \(5,\), got \(4,\)"):
        flash.flash_attention_backward(q, q, q, out, lse[:4], out)
    t = torch.zeros(1, 5, 4)
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got ndarray"):
        flash.flash_attention_torch(t, q, t)
    with pytest.raises(TypeError, match="one dtype"):
        flash.flash_attention_torch(t, t.double(), t)
    t4 = torch.zeros(1, 2, 5, 4)
    with pytest.raises(ValueError, match="same leading"):
        flash.flash_attention_torch(t4, torch.zeros(2, 2, 5, 4), torch.zeros(2, 2, 5, 4))
    with pytest.raises(ValueError, match=r"H_kv \(axis -3\) that divides q's H, got H = 6"):
        flash.flash_attention_torch(torch.zeros(1, 6, 5, 4), *[torch.zeros(1, 4, 5, 4)] * 2)
    with pytest.raises(ValueError, match=r"H_kv \(axis -3\) that divides q's H, got H = 6"):
        flash.flash_attention(np.zeros((6, 5, 4)), np.zeros((4, 5, 4)), np.zeros((4, 5, 4)))
    with pytest.raises(ValueError, match="k and v must have the same number of heads"):
        flash.flash_attention(np.zeros((6, 5, 4)), np.zeros((2, 5, 4)), np.zeros((3, 5, 4)))
    with pytest.raises(ValueError, match="num_splits must be a positive int, got 0"):
        flash.split_kv_attention(q, q, q, num_splits=0)
    with pytest.raises(TypeError, match="floating-point"):
        flash.flash_attention_torch(t.long(), t, t)
