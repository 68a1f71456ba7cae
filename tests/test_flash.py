"""Tests of mha.flash: the tiled online-softmax attention, forward and backward, NumPy and torch.

The expected values come from elsewhere: a two-key example computed by hand, the NumPy reference
(which writes out every score), a logsumexp computed directly from all scores, and torch autograd
through the materialising torch attention (mha.functional.attention) and gradcheck.
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


def _reference(q, k, v, causal: bool):
    mask = reference.causal_mask(q.shape[-2], k.shape[-2]) if causal else None
    return reference.scaled_dot_product_attention(q, k, v, mask)[0]


def _direct_logsumexp(q, k, causal: bool) -> np.ndarray:
    """log(sum_j exp(score_ij)) over every visible key, from all scores at once (float64)."""
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = np.where(reference.causal_mask(q.shape[-2], k.shape[-2]), scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(scores - top).sum(axis=-1, keepdims=True)))[..., 0]


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
# Backward, NumPy and torch


def _autograd_gradients(q, k, v, d_out, causal: bool):
    """Gradients by torch autograd through the materialising attention, float64."""
    leaves = [torch.tensor(t, requires_grad=True) for t in (q, k, v)]
    mask = causal_mask(q.shape[-2], k.shape[-2]) if causal else None
    out, _ = attention(*leaves, mask)
    out.backward(torch.tensor(d_out))
    return [leaf.grad.numpy() for leaf in leaves]


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
    with pytest.raises(ValueError, match="same leading"):
        flash.flash_attention_torch(t, torch.zeros(2, 5, 4), torch.zeros(2, 5, 4))
    with pytest.raises(TypeError, match="floating-point"):
        flash.flash_attention_torch(t.long(), t, t)
