"""Tests of mha.kernels: the Triton attention kernels, forward and backward.

Without a GPU they run in Triton's interpreter (mha.kernels sets TRITON_INTERPRET=1), which
executes the kernels' exact code on CPU tensors; with a GPU the same tests run the compiled
kernels on it. Expected values: the NumPy reference in float64 (every score written out) and
torch autograd through the materialising attention. Shapes are small: the interpreter runs one
program after the other.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from mha import kernels, reference
from mha.functional import attention, causal_mask, split_heads
from torch.nn import functional as F

from helpers import KERNEL_DEVICE, randn

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason="triton is not installed"),
]

DEVICE = KERNEL_DEVICE
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
HEAD_SIZES = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]


def _inputs(*shape, dtype=torch.float32, seeds=(0, 1, 2)):
    return [randn(*shape, seed=s, dtype=torch.float32).to(dtype).to(DEVICE) for s in seeds]


def _qkv(batch, heads, kv_heads, t_q, t_k, d_k, dtype=torch.float32, seed=0):
    q = _inputs(batch, heads, t_q, d_k, dtype=dtype, seeds=(seed,))[0]
    k, v = _inputs(batch, kv_heads, t_k, d_k, dtype=dtype, seeds=(seed + 1, seed + 2))
    return q, k, v


def _repeat_kv(q, k, v):
    """k and v repeated per query head (transformers' repeat_kv order): copies, for the checks."""
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _mask(q, k, causal: bool):
    if not causal:
        return None
    return reference.causal_mask(q.shape[-2], k.shape[-2], align="bottom-right")


def _reference(q, k, v, causal: bool) -> np.ndarray:
    """Float64 reference output from the (rounded) inputs, every score written out."""
    k, v = _repeat_kv(q, k, v)
    arrays = [t.detach().cpu().double().numpy() for t in (q, k, v)]
    return reference.scaled_dot_product_attention(*arrays, _mask(q, k, causal))[0]


def _check(out, q, k, v, causal: bool) -> float:
    assert out.dtype == q.dtype and out.shape == q.shape[:-2] + (q.shape[-2], v.shape[-1])
    tolerance = TOLERANCE[q.dtype]
    got = out.detach().cpu().double().numpy()
    np.testing.assert_allclose(got, _reference(q, k, v, causal), rtol=tolerance, atol=tolerance)
    return float(np.abs(got - _reference(q, k, v, causal)).max())


def _torch_error(q, k, v, causal: bool) -> float:
    """The error of torch's own F.scaled_dot_product_attention in the inputs' dtype."""
    k_all, v_all = _repeat_kv(q, k, v)
    mask = _mask(q, k, causal)
    mask = None if mask is None else torch.from_numpy(mask).to(q.device)
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
    return float(np.abs(out.cpu().double().numpy() - _reference(q, k, v, causal)).max())


# ---------------------------------------------------------------------------------------------
# Forward


# (T_q, T_k, H, H_kv, causal): a decoding step with one shared key/value head (MQA), a chunk of
# a prompt after a cache (GQA), more queries than keys (the first 47 see no key when causal),
# and plain self-attention.
FAMILIES = [
    (1, 67, 4, 1, True),
    (5, 67, 4, 2, True),
    (67, 20, 2, 2, True),
    (45, 45, 4, 2, False),
]


@pytest.mark.parametrize("d_k", HEAD_SIZES)
def test_float16_head_sizes_and_shapes_within_torchs_error(d_k: int) -> None:
    # Every head size meets two of the shape families (in turn), float16, default tiles: the
    # error against float64 stays within twice that of torch's own float16 attention on the
    # same inputs (plus 1e-4 for a float16 output's last bit near 1).
    i = HEAD_SIZES.index(d_k)
    for t_q, t_k, heads, kv_heads, causal in (FAMILIES[i % 4], FAMILIES[(i + 1) % 4]):
        q, k, v = _qkv(1, heads, kv_heads, t_q, t_k, d_k, torch.float16, seed=i)
        out = kernels.triton_attention(q, k, v, causal=causal)
        error = _check(out, q, k, v, causal)
        assert error <= 2 * _torch_error(q, k, v, causal) + 1e-4, (t_q, t_k, heads, kv_heads)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_equals_reference_with_partial_tiles(causal: bool, dtype: torch.dtype) -> None:
    # T = 50 with tiles of 32 queries and 16 keys: 2 query tiles (the last one 18 rows) and 4 key
    # tiles (the last one 2 keys), so every load and store at the end is masked.
    q, k, v = _inputs(1, 2, 50, 32, dtype=dtype)
    out = kernels.triton_attention(q, k, v, causal=causal, block_q=32, block_k=16)
    _check(out, q, k, v, causal)


def test_one_query_sees_every_key_when_causal() -> None:
    # Bottom-right, by hand: a decoding step's only query is the newest token and sees all
    # keys, so causal=True equals no mask at all (top-left would return v[..., 0, :]).
    q, k, v = _qkv(1, 2, 2, 1, 40, 32)
    causal = kernels.triton_attention(q, k, v, causal=True)
    full = kernels.triton_attention(q, k, v, causal=False)
    torch.testing.assert_close(causal, full, rtol=0, atol=0)
    assert (causal - v[..., :1, :]).abs().max() > 0.1


def test_queries_that_see_no_key_give_zero() -> None:
    # T_q = 40 > T_k = 10, causal: queries 0..29 see no key; zero output and logsumexp -inf, not
    # NaN; queries 30..39 see keys 0..i - 30.
    from mha.kernels.attention import attention_forward

    q, k, v = _qkv(1, 2, 1, 40, 10, 32)
    out, lse = attention_forward(q, k, v, causal=True, block_q=16, block_k=16)
    assert (out[..., :30, :] == 0).all() and torch.isneginf(lse[..., :30]).all()
    assert torch.isfinite(lse[..., 30:]).all()
    _check(out, q, k, v, True)


def test_a_scale_and_the_default_tiles() -> None:
    # float16 at the default tiles, with a scale of 0.05 instead of 1/sqrt(d_k).
    q, k, v = _qkv(1, 2, 1, 70, 70, 48, torch.float16)
    out = kernels.triton_attention(q, k, v, causal=True, scale=0.05)
    k_all, v_all = _repeat_kv(q, k, v)
    arrays = [t.cpu().double().numpy() for t in (q, k_all, v_all)]
    expected = reference.scaled_dot_product_attention(
        *arrays, reference.causal_mask(70), scale=0.05
    )[0]
    np.testing.assert_allclose(out.cpu().double().numpy(), expected, rtol=2e-3, atol=2e-3)


def test_default_tiles_cover_every_kernel_gpu_dtype_and_head_size() -> None:
    from mha.kernels.tiles import KERNELS, default_tiles, padded_head_dim

    assert [padded_head_dim(d) for d in (1, 16, 17, 40, 64, 80, 111, 128, 160, 256)] == [
        16, 16, 32, 64, 64, 128, 128, 128, 256, 256,
    ]  # fmt: skip
    for kernel in KERNELS:
        for capability in ((8, 0), (8, 6), (9, 0)):
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                for d_k in (1, 40, 64, 96, 128, 200, 256):
                    tiles = default_tiles(kernel, d_k, dtype, capability)
                    for size in (tiles.block_q, tiles.block_k):
                        assert size >= 16 and size & (size - 1) == 0  # tl.dot's tiles
                    assert tiles.num_warps in (4, 8) and tiles.num_stages in (1, 2, 3)


def test_strided_views_need_no_copy() -> None:
    # Heads split from (B, T, D) are a transposed view: strides (T*D, d_k, D, 1).
    x = _inputs(2, 24, 64, seeds=(6,))[0]  # (B, T, D)
    q = split_heads(x, 16)  # (B, H, T, d_k) = (2, 4, 24, 16)
    assert not q.is_contiguous()
    out = kernels.triton_attention(q, q, q, causal=True, block_q=16, block_k=16)
    _check(out, q, q, q, True)


def test_causal_kernel_never_reads_the_tiles_above_the_diagonal() -> None:
    # NaN in values 32..63 poisons every row that loads them, even with weight 0 (0 * NaN).
    # With tiles of 16, query tiles 0 and 1 (rows 0..31) must never load key tiles 2 and 3.
    q, k, v = _inputs(1, 1, 64, 16)
    v[..., 32:, :] = math.nan
    out = kernels.triton_attention(q, k, v, causal=True, block_q=16, block_k=16)
    assert torch.isfinite(out[..., :32, :]).all() and torch.isnan(out[..., 32:, :]).all()
    _check(out[..., :32, :], q[..., :32, :], k[..., :32, :], v[..., :32, :], True)


def test_logsumexp_of_every_row() -> None:
    q, k, v = _qkv(1, 4, 2, 21, 37, 16)
    from mha.kernels.attention import attention_forward

    _, lse = attention_forward(q, k, v, causal=True, block_q=16, block_k=16)
    k_all, _ = _repeat_kv(q, k, v)
    scores = q.double() @ k_all.double().transpose(-1, -2) / math.sqrt(16)  # (1, 4, 21, 37)
    mask = causal_mask(21, 37, align="bottom-right", device=DEVICE)
    expected = torch.logsumexp(scores.masked_fill(~mask, -math.inf), dim=-1)
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 21)
    torch.testing.assert_close(lse.double(), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Split-KV (decoding)


@pytest.mark.parametrize(
    "t_q, t_k, heads, kv_heads, num_splits",
    [(1, 300, 4, 1, None), (1, 300, 4, 2, 3), (4, 100, 2, 2, 7), (20, 10, 2, 1, 2)],
)
def test_split_kv_equals_reference(t_q, t_k, heads, kv_heads, num_splits) -> None:
    # None: the default, as many splits as fill 132 multiprocessors (300 keys in tiles: each
    # split at least one tile). (20, 10): causal rows that see no key, and splits that hold no
    # visible key for some rows, weigh nothing in the merge.
    for causal in (False, True):
        for dtype in (torch.float32, torch.float16):
            q, k, v = _qkv(1, heads, kv_heads, t_q, t_k, 64, dtype)
            out = kernels.triton_split_kv_attention(q, k, v, causal=causal, num_splits=num_splits)
            _check(out, q, k, v, causal)


def test_split_kv_splits_and_logsumexp() -> None:
    from mha.kernels.attention import attention_forward, default_num_splits, split_kv_forward

    # 4 programs (B * H * query tiles) for 132 multiprocessors: 33 splits wanted, but 300 keys
    # in tiles of 32 make 10 tiles, so 10 splits; 200 programs: one split.
    assert default_num_splits(4, 300, 32, 132) == 10
    assert default_num_splits(4, 4096, 32, 132) == 33
    assert default_num_splits(32, 4096, 64, 132) == 4  # 128 programs: one wave of 132
    assert default_num_splits(200, 4096, 32, 132) == 1
    q, k, v = _qkv(1, 4, 1, 3, 200, 32)
    _, lse = split_kv_forward(q, k, v, causal=True, num_splits=5)
    _, expected = attention_forward(q, k, v, causal=True)
    torch.testing.assert_close(lse, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Backward


def _autograd_gradients(q, k, v, d_out, causal: bool):
    """Gradients by torch autograd through the materialising attention, in float64.

    Queries that see no key (causal, T_q > T_k) have a constant zero output: zero dq, nothing
    to dk and dv. Autograd runs on the others (a fully masked softmax row gives NaN there).
    """
    blind = max(0, q.shape[-2] - k.shape[-2]) if causal else 0
    leaves = [t.detach().double().requires_grad_() for t in (q[..., blind:, :], k, v)]
    k_all, v_all = _repeat_kv(*leaves)  # autograd sums the copies of each group
    mask = _mask(leaves[0], k, causal)
    mask = None if mask is None else torch.from_numpy(mask).to(q.device)
    out, _ = attention(leaves[0], k_all, v_all, mask)
    dq, dk, dv = torch.autograd.grad(out, leaves, d_out[..., blind:, :].double())
    dq = torch.cat([dq.new_zeros(q.shape[:-2] + (blind, q.shape[-1])), dq], dim=-2)
    return dq, dk, dv


@pytest.mark.parametrize(
    "t_q, t_k, heads, kv_heads, d_k, causal",
    [
        (50, 50, 2, 2, 32, False),
        (50, 50, 2, 2, 32, True),
        (1, 37, 4, 1, 40, True),  # decoding, MQA
        (5, 37, 4, 2, 80, True),  # chunked prefill, GQA, d_k padded to 128
        (37, 5, 4, 2, 59, True),  # more queries than keys: 32 see no key
        (20, 45, 2, 1, 32, False),
        (3, 20, 2, 1, 256, True),  # the largest head size
    ],
)
def test_backward_equals_autograd(t_q, t_k, heads, kv_heads, d_k, causal) -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(1, heads, kv_heads, t_q, t_k, d_k, seed=7))
    out = kernels.triton_attention(q, k, v, causal=causal, block_q=32, block_k=16)
    d_out = _inputs(*out.shape, seeds=(10,))[0]
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    for name, got, expected in zip("qkv", grads, _autograd_gradients(q, k, v, d_out, causal)):
        assert got.shape == expected.shape
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5, msg=f"d{name}")


def test_backward_with_default_tiles() -> None:
    # T = 40: partial tiles in both backward kernels, whatever their defaults.
    q, k, v = (t.requires_grad_() for t in _inputs(1, 1, 40, 16, seeds=(13, 14, 15)))
    out = kernels.triton_attention(q, k, v, causal=True)
    d_out = _inputs(*out.shape, seeds=(16,))[0]
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    for name, got, expected in zip("qkv", grads, _autograd_gradients(q, k, v, d_out, True)):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5, msg=f"d{name}")


def test_backward_in_float16_within_torchs_error() -> None:
    # GQA, d_k = 96, a chunk of 9 queries after 31 cached keys: gradients within twice the error
    # of autograd through torch's own float16 F.scaled_dot_product_attention (plus 1e-3).
    q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 2, 9, 40, 96, torch.float16, seed=20))
    out = kernels.triton_attention(q, k, v, causal=True)
    d_out = _inputs(*out.shape, dtype=torch.float16, seeds=(11,))[0]
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    k_all, v_all = _repeat_kv(q, k, v)
    mask = torch.from_numpy(_mask(q, k, True)).to(q.device)
    torch_out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
    torch_grads = torch.autograd.grad(torch_out, (q, k, v), d_out)
    expected = _autograd_gradients(q, k, v, d_out, True)
    for name, got, theirs, want in zip("qkv", grads, torch_grads, expected):
        assert got.dtype == torch.float16
        error = (got.double() - want).abs().max().item()
        torch_error = (theirs.double() - want).abs().max().item()
        assert error <= 2 * torch_error + 1e-3, (f"d{name}", error, torch_error)


# ---------------------------------------------------------------------------------------------
# bfloat16: on a GPU only (bfloat16 tl.dot is wrong in the interpreter)


COMPILED = pytest.mark.skipif(  # a GPU, but TRITON_INTERPRET=1 was set by hand
    bool(kernels.INTERPRETED) and torch.cuda.is_available(),
    reason="TRITON_INTERPRET=1: the kernels are interpreted here",
)


@pytest.mark.cuda
@COMPILED
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_on_the_gpu(causal: bool) -> None:
    q, k, v = (t.requires_grad_() for t in _inputs(2, 4, 300, 128, dtype=torch.bfloat16))
    out = kernels.triton_attention(q, k, v, causal=causal)
    _check(out, q, k, v, causal)
    d_out = _inputs(*out.shape, dtype=torch.bfloat16, seeds=(12,))[0]
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    for name, got, expected in zip("qkv", grads, _autograd_gradients(q, k, v, d_out, causal)):
        torch.testing.assert_close(got.double(), expected, rtol=5e-2, atol=5e-2, msg=f"d{name}")


@pytest.mark.cuda
@COMPILED
def test_long_sequence_on_the_gpu() -> None:
    q, k, v = _inputs(1, 8, 4099, 64, dtype=torch.float16)
    out = kernels.triton_attention(q, k, v, causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True
    )
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)


def test_bfloat16_is_refused_by_the_interpreter() -> None:
    if not kernels.INTERPRETED:
        pytest.skip("the compiled kernels take bfloat16 (tested above)")
    q = torch.zeros(1, 1, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 runs on a GPU only"):
        kernels.triton_attention(q, q, q)


# ---------------------------------------------------------------------------------------------
# Bad input, and a machine without Triton or without a GPU


def test_bad_arguments_raise_clear_errors() -> None:
    q = torch.zeros(1, 1, 16, 16, device=DEVICE)
    big = torch.zeros(1, 1, 16, 257, device=DEVICE)
    with pytest.raises(ValueError, match=r"d_k \(the last dimension of q\) must be from 1 to 256"):
        kernels.triton_attention(big, big, big)
    with pytest.raises(ValueError, match=r"must be from 1 to 256, got 0"):
        kernels.triton_attention(q[..., :0], q[..., :0], q[..., :0])
    with pytest.raises(ValueError, match="H_kv that divides q's H, got H = 3 and H_kv = 2"):
        kernels.triton_attention(
            q.expand(1, 3, 16, 16), q.expand(1, 2, 16, 16), q.expand(1, 2, 16, 16)
        )
    with pytest.raises(TypeError, match="float32, float16 or bfloat16, got torch.float64"):
        kernels.triton_attention(q.double(), q.double(), q.double())
    with pytest.raises(TypeError, match="one dtype"):
        kernels.triton_attention(q, q.half(), q)
    with pytest.raises(ValueError, match=r"q must have shape \(B, H, T, d_k\)"):
        kernels.triton_attention(q[0], q, q)
    with pytest.raises(ValueError, match="k, v"):
        kernels.triton_attention(q, q, torch.zeros(1, 1, 15, 16, device=DEVICE))
    with pytest.raises(
        ValueError,
        match=r"block_q must be a power of two from 16 \(tl.dot's smallest tile\) to 256, got 24",
    ):
        kernels.triton_attention(q, q, q, block_q=24)
    with pytest.raises(ValueError, match="block_k must be a power of two from 16 .* got 512"):
        kernels.triton_attention(q, q, q, block_k=512)  # a tile larger than any GPU holds
    one = q[:, :, :1]
    for run, query in ((kernels.triton_attention, q), (kernels.triton_split_kv_attention, one)):
        for causal in ("no", None, 1):
            with pytest.raises(
                TypeError, match=f"causal must be True or False, got .* {causal!r}"
            ):
                run(query, q, q, causal=causal)
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got ndarray"):
        kernels.triton_attention(q, np.zeros((1, 1, 16, 16)), q)


def _float64_attention(q, k, v, keep):
    """Float64 SDPA on the CPU with a boolean ``keep`` (T_q, T_k) or (B, 1, T_q, T_k)."""
    q, k, v = (t.cpu().double() for t in (q, k, v))  # leaves stay leaves: their gradients
    k, v = _repeat_kv(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def test_the_backward_sees_the_key_starts_of_its_forward() -> None:
    # the caller's key_start changed between the forward and the backward: the gradients are
    # still those of the forward that ran (keys 0..3 hidden), not of the changed key starts
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, 5, 9, 16))
    d_out = _inputs(1, 2, 5, 16, seeds=(7,))[0]
    key_start = torch.tensor([4], device=DEVICE)
    out = kernels.triton_attention(q, k, v, key_start=key_start)
    key_start[0] = 0
    out.backward(d_out)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    keep = torch.arange(9) >= 4  # (T_k,)
    expected = _float64_attention(*leaves, keep.expand(5, 9))
    expected.backward(d_out.cpu().double())
    for got, leaf in zip((q, k, v), leaves):
        torch.testing.assert_close(got.grad.cpu().double(), leaf.grad, rtol=1e-5, atol=1e-5)


def test_narrow_key_starts_and_windows_wider_than_an_int64() -> None:
    q, k, v = _qkv(2, 2, 1, 6, 11, 16)
    rows = torch.tensor([3, 0])
    keep = (torch.arange(11)[None, :] >= rows[:, None])[:, None, None, :]  # (B, 1, 1, T_k)
    for dtype in (torch.int8, torch.int16, torch.uint8):
        out = kernels.triton_attention(q, k, v, key_start=rows.to(dtype).to(DEVICE))
        expected = _float64_attention(q, k, v, keep)
        torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)
    causal = torch.tril(torch.ones(6, 11, dtype=torch.bool), diagonal=5)  # bottom-right
    for window in (11, 2**40, 2**64):  # as wide as the keys, or wider: no key hidden
        out = kernels.triton_attention(q, k, v, causal=True, window=window)
        expected = _float64_attention(q, k, v, causal)
        torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)


def test_sinks_must_be_finite_or_minus_infinity() -> None:
    from mha.kernels.attention import attention_forward

    q, k, v = _qkv(1, 2, 2, 3, 5, 16)
    for bad, head in ((math.nan, 0), (math.inf, 1)):
        sinks = torch.zeros(2, device=DEVICE)
        sinks[head] = bad
        with pytest.raises(ValueError, match=f"sinks must be finite .* got {bad} at head {head}"):
            attention_forward(q, k, v, sinks=sinks)
    sinks = torch.tensor([-math.inf, 0.0], device=DEVICE)  # -inf: that head has no sink
    out, _ = attention_forward(q, k, v, sinks=sinks)
    torch.testing.assert_close(
        out[:, 0].cpu().double(), _float64_attention(q, k, v, None)[:, 0], rtol=1e-5, atol=1e-5
    )


def test_split_kv_of_an_empty_batch_is_empty() -> None:
    q, k, v = _qkv(0, 2, 2, 1, 9, 16)
    assert kernels.triton_split_kv_attention(q, k, v).shape == (0, 2, 1, 16)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environment, **env},
        check=False,
    )


def test_import_works_without_triton() -> None:
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # as if it were not installed\n"
        "import mha, mha.kernels, mha.kernels.tiles, torch\n"
        "assert not mha.kernels.TRITON_AVAILABLE and mha.kernels.INTERPRETED is None\n"
        "assert mha.kernels.tiles.default_tiles('forward', 80, torch.float16).block_q\n"
        "q = torch.zeros(1, 1, 16, 16)\n"
        "try:\n"
        "    mha.kernels.triton_attention(q, q, q)\n"
        "except ModuleNotFoundError as error:\n"
        "    print(error)\n"
    )
    completed = _python(code)
    assert completed.returncode == 0, completed.stderr
    assert "needs the triton package" in completed.stdout
    assert "pip install triton==3.9.0" in completed.stdout


def test_interpreter_is_chosen_without_a_gpu() -> None:
    code = (
        "import os, torch, mha.kernels as k\n"
        "print(k.INTERPRETED, torch.cuda.is_available(), os.environ.get('TRITON_INTERPRET'))\n"
    )
    completed = _python(code)
    assert completed.returncode == 0, completed.stderr
    interpreted, cuda, variable = completed.stdout.split()
    assert interpreted == str(cuda == "False")
    assert variable == ("1" if cuda == "False" else "None")
    # An explicit choice is respected.
    completed = _python(code, TRITON_INTERPRET="1")
    assert completed.stdout.split()[0] == "True"


# A learner's kernel that calls a jitted helper of triton.language (tl.max); Triton reads a
# kernel's source from its file, so it is written to one.
ROW_MAX_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def row_max_kernel(X, Y, N: tl.constexpr):
    cols = tl.arange(0, N)
    x = tl.load(X + cols)
    tl.store(Y + cols, x - tl.max(x, axis=0))
"""

IMPORT_ORDER = """
import sys
sys.path.insert(0, sys.argv[1])
{first}
import torch
import mha.kernels as kernels
from row_max import row_max_kernel
print(kernels.INTERPRETED, kernels.TRITON_IMPORTED_FIRST)
q = torch.randn(1, 2, 20, 16)  # the book's kernels call no helper of triton.language
torch.testing.assert_close(kernels.triton_attention(q, q, q), torch.softmax(
    q @ q.transpose(-1, -2) / 4, dim=-1) @ q)
x, y = torch.randn(8), torch.empty(8)
try:
    row_max_kernel[(1,)](x, y, N=8)
except kernels.TritonImportOrderError as error:
    print(error)
else:
    assert torch.equal(y, x - x.max())
    print("ran")
"""


def test_an_interpreter_that_cannot_run_the_kernels_is_named(monkeypatch) -> None:
    # Each pair run here on the forward kernel: the interpreters of Triton 3.4, 3.5 and 3.6
    # fail under NumPy 2.4.6 ("only 0-dimensional arrays can be converted to Python scalars")
    # and run under NumPy 2.3.5; those of Triton 3.7, 3.8 and 3.9 run under NumPy 2.4.6.
    for triton_version in ("3.4.0", "3.5.0", "3.6.0"):
        problem = kernels.interpreter_problem(triton_version, "2.4.6")
        assert problem == (
            f"Triton {triton_version}'s interpreter cannot run these kernels with NumPy 2.4.6: "
            "it turns one-element arrays into Python integers, which NumPy 2.4 refuses; install "
            "triton 3.7 or later (this project pins 3.9.0) or numpy older than 2.4"
        )
        assert kernels.interpreter_problem(triton_version, "2.3.5") is None
        assert kernels.interpreter_problem(triton_version, "2.5.0rc1") is not None
    for triton_version in ("3.7.0", "3.8.0", "3.9.0", "3.10.0"):
        assert kernels.interpreter_problem(triton_version, "2.4.6") is None
    if kernels.INTERPRETED:  # the kernels refuse to start, by name, before Triton fails
        monkeypatch.setattr(kernels.triton, "__version__", "3.6.0")
        monkeypatch.setattr(np, "__version__", "2.4.6")
        q = torch.randn(1, 1, 4, 8)
        with pytest.raises(RuntimeError, match="Triton 3.6.0's interpreter cannot run"):
            kernels.triton_attention(q, q, q)


CHOSEN = "before mha.kernels chose Triton's interpreter (it sets TRITON_INTERPRET=1 where"
SET = "before TRITON_INTERPRET=1 was set, by `import triton`"


@pytest.mark.parametrize(
    "first, variable, explained",
    [
        ("import triton", None, CHOSEN),
        ("import torch._inductor.runtime.triton_helpers", None, CHOSEN),  # imports triton
        ("import os, triton; os.environ['TRITON_INTERPRET'] = '1'", None, SET),  # by hand, late
        ("", None, None),  # the normal order: mha.kernels first
        ("import triton", "1", None),  # the variable set before anything imported triton
    ],
)
def test_triton_imported_before_mha_kernels_is_explained(
    tmp_path, first, variable, explained
) -> None:
    # as on a machine without a GPU (none is visible to the child): import triton (or what
    # imports it), then mha.kernels, which chooses the interpreter too late for the helpers of
    # triton.language; the first launch of a kernel that calls one says so, in our words
    (tmp_path / "row_max.py").write_text(ROW_MAX_KERNEL)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    if variable is not None:
        env["TRITON_INTERPRET"] = variable
    completed = subprocess.run(
        [sys.executable, "-c", IMPORT_ORDER.format(first=first), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    flags, said = completed.stdout.split("\n", 1)
    assert flags == f"True {explained is not None}"
    if explained is None:
        assert said == "ran\n"
        return
    assert said.startswith(
        "the kernel row_max_kernel runs in Triton's CPU interpreter, but triton was imported "
        + explained
    )
    assert "tl.max" in said and "Cannot call" not in said  # our words, not Triton's
    assert "restart the kernel" in said and "import mha.kernels first" in said
    assert "set TRITON_INTERPRET=1 before anything imports triton" in said
