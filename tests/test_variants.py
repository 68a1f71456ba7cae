"""Tests of attention variants: the NumPy twins (mha.reference) and FlexAttention (mha.variants).

The expected values come from elsewhere: masks and slopes written out by hand or from the papers
(Press et al. 2022's slopes 2^(-8h/H)), the mask functions of `transformers` (its
`masking_utils`) and BLOOM's ALiBi tensor, plain Python loops, and torch autograd through a dense
torch form of the same scores. The FlexAttention results are compared with the NumPy twins, both
unfused and compiled; a compiled call that falls back to the unfused form is an error here.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mha import bench, flash, reference, variants
from transformers import masking_utils
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

from helpers import randn

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    # a compiled call that gives up and runs unfused says so: that must fail the test
    pytest.mark.filterwarnings("error:flex_attention called without torch.compile"),
]


def _grid(mask_function, t_q: int, t_k: int) -> np.ndarray:
    """A (b, h, q_idx, kv_idx) mask function evaluated pair by pair, one index at a time."""
    zero, index = torch.tensor(0), torch.tensor
    return np.array(
        [
            [bool(mask_function(zero, zero, index(i), index(j))) for j in range(t_k)]
            for i in range(t_q)
        ],
        dtype=bool,
    )


# ---------------------------------------------------------------------------------------------
# The dense twins, against hand-written masks, transformers' mask functions and the papers


def test_sliding_window_mask_by_hand() -> None:
    expected = np.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 1, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(reference.sliding_window_mask(5, window=2), expected)


@pytest.mark.parametrize(
    "t_q, t_k, window", [(7, 7, 1), (7, 7, 3), (6, 9, 4), (9, 6, 2), (5, 5, 9)]
)
def test_sliding_window_mask_equals_transformers(t_q, t_k, window) -> None:
    theirs = masking_utils.sliding_window_causal_mask_function(window)
    mask = reference.sliding_window_mask(t_q, t_k, window=window)
    np.testing.assert_array_equal(mask, _grid(theirs, t_q, t_k))
    if window >= t_k:  # a window as long as the row is the causal mask
        np.testing.assert_array_equal(mask, reference.causal_mask(t_q, t_k))


def test_sink_window_mask_by_hand() -> None:
    # window 2, one sink: the first key stays visible to every later query
    expected = np.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 0, 1, 1, 0],
            [1, 0, 0, 1, 1],
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(reference.sink_window_mask(5, window=2, sinks=1), expected)


@pytest.mark.parametrize("t_q, t_k, window, sinks", [(9, 9, 3, 2), (6, 11, 4, 3), (8, 8, 2, 0)])
def test_sink_window_mask_equals_transformers_pieces(t_q, t_k, window, sinks) -> None:
    def first_keys(b, h, q_idx, kv_idx):
        return kv_idx < sinks

    theirs = masking_utils.or_masks(
        masking_utils.sliding_window_causal_mask_function(window),
        masking_utils.and_masks(masking_utils.causal_mask_function, first_keys),
    )
    mask = reference.sink_window_mask(t_q, t_k, window=window, sinks=sinks)
    np.testing.assert_array_equal(mask, _grid(theirs, t_q, t_k))


def test_document_mask_by_hand() -> None:
    expected = np.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(reference.document_mask([7, 7, 3, 3, 3]), expected)


def test_document_mask_equals_transformers() -> None:
    doc_ids = np.array([0, 0, 0, 1, 2, 2, 3, 3, 3, 3])
    theirs = masking_utils.and_masks(
        masking_utils.causal_mask_function,
        masking_utils.packed_sequence_mask_function(torch.tensor(doc_ids)[None]),
    )
    np.testing.assert_array_equal(reference.document_mask(doc_ids), _grid(theirs, 10, 10))


def test_prefix_lm_mask_by_hand() -> None:
    expected = np.array(
        [
            [1, 1, 1, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1],
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(reference.prefix_lm_mask(5, prefix_len=3), expected)
    np.testing.assert_array_equal(
        reference.prefix_lm_mask(4, 6, prefix_len=0), reference.causal_mask(4, 6)
    )


def test_alibi_slopes_from_the_paper() -> None:
    # Press et al. 2022, section 3: for 8 heads the slopes are 1/2, 1/4, ..., 1/256.
    np.testing.assert_array_equal(reference.alibi_slopes(8), [2.0**-i for i in range(1, 9)])
    # 12 heads (not a power of two): the 8 slopes above, then every second slope of 16 heads,
    # 2^(-0.5 k) for k = 1, 3, 5, 7.
    expected = [2.0**-i for i in range(1, 9)] + [2.0 ** (-0.5 * k) for k in (1, 3, 5, 7)]
    np.testing.assert_allclose(reference.alibi_slopes(12), expected, rtol=1e-15)


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 6, 8, 12, 16, 20, 32, 40, 64, 80])
def test_alibi_slopes_equal_bloom(num_heads) -> None:
    # BLOOM's tensor is slope * j (the key's position), one row for all queries; it computes the
    # slopes in float32.
    alibi = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), num_heads, torch.float64)
    np.testing.assert_allclose(reference.alibi_slopes(num_heads), alibi[:, 0, 1], rtol=1e-6)


def test_alibi_bias_by_hand() -> None:
    # 2 heads: slopes 2^-4 and 2^-8; bias slope * (j - i).
    expected = np.array([2.0**-4, 2.0**-8])[:, None, None] * np.array(
        [[0, 1, 2, 3], [-1, 0, 1, 2], [-2, -1, 0, 1]]
    )
    np.testing.assert_array_equal(reference.alibi_bias(2, 3, 4), expected)


def test_alibi_weights_equal_blooms_under_a_causal_mask(rng) -> None:
    # BLOOM adds slope * j instead of slope * (j - i): each row differs by the constant slope * i,
    # which softmax ignores.
    H, T, d = 4, 6, 8
    q, k, v = rng.normal(size=(3, H, T, d))
    bloom = build_alibi_tensor(torch.ones(1, T, dtype=torch.long), H, torch.float64).numpy()
    ours = reference.attention_with_score_mod(
        q, k, v, reference.causal_mask(T), score_mod=lambda s: s + reference.alibi_bias(H, T)
    )
    theirs = reference.attention_with_score_mod(
        q, k, v, reference.causal_mask(T), score_mod=lambda s: s + bloom
    )
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-12, atol=1e-15)


def test_softcap_values() -> None:
    scores = np.array([0.0, 1e-3, 10.0, -75.0, 1e6])
    expected = [50.0 * math.tanh(s / 50.0) for s in scores]
    np.testing.assert_allclose(reference.softcap(scores, 50.0), expected, rtol=1e-15)
    assert reference.softcap(scores, 50.0).max() <= 50.0


def test_attention_with_score_mod_by_loops(rng) -> None:
    T_q, T_k, d = 3, 5, 4
    q, k, v = rng.normal(size=(T_q, d)), rng.normal(size=(T_k, d)), rng.normal(size=(T_k, 2))
    mask = reference.sliding_window_mask(T_q, T_k, window=2)
    out, weights = reference.attention_with_score_mod(
        q, k, v, mask, score_mod=lambda s: reference.softcap(s, 0.3)
    )
    for i in range(T_q):
        scores = [
            0.3 * math.tanh(float(q[i] @ k[j]) / math.sqrt(d) / 0.3) if mask[i, j] else None
            for j in range(T_k)
        ]
        exps = [0.0 if s is None else math.exp(s) for s in scores]
        expected = [e / sum(exps) for e in exps]
        np.testing.assert_allclose(weights[i], expected, rtol=1e-12)
        np.testing.assert_allclose(out[i], np.array(expected) @ v, rtol=1e-12)


def test_attention_with_no_score_mod_is_scaled_dot_product_attention(rng) -> None:
    q, k, v = rng.normal(size=(3, 2, 4, 6, 8))
    mask = reference.causal_mask(6)
    for ours, theirs in zip(
        reference.attention_with_score_mod(q, k, v, mask),
        reference.scaled_dot_product_attention(q, k, v, mask),
    ):
        np.testing.assert_array_equal(ours, theirs)


# ---------------------------------------------------------------------------------------------
# FlexAttention against the twins

DOC_IDS = np.repeat([0, 1, 2, 3], [40, 17, 80, 63])  # 200 tokens, documents of uneven length


def _case(name: str, num_heads: int, t_q: int, t_k: int, offset: int = 0):
    """(mask_mod, score_mod, dense mask, NumPy score function) of one variant.

    The first query stands at position ``offset`` >= 0: the twin is rows offset ..
    offset + T_q - 1 of the twin for queries at positions 0 .. offset + T_q - 1.
    """
    rows, n = slice(offset, None), offset + t_q
    if name == "sliding_window":
        return (
            variants.sliding_window(37),
            None,
            reference.sliding_window_mask(n, t_k, window=37)[rows],
            None,
        )
    if name == "sink_window":
        twin = reference.sink_window_mask(n, t_k, window=37, sinks=5)[rows]
        return variants.sink_window(37, 5), None, twin, None
    if name == "document":
        return variants.document(DOC_IDS), None, reference.document_mask(DOC_IDS), None
    if name == "prefix_lm":
        return (
            variants.prefix_lm(45),
            None,
            reference.prefix_lm_mask(n, t_k, prefix_len=45)[rows],
            None,
        )
    if name == "alibi":
        bias = reference.alibi_bias(num_heads, n, t_k)[:, rows]
        return (
            variants.causal,
            variants.alibi(num_heads),
            reference.causal_mask(n, t_k)[rows],
            lambda s: s + bias,
        )
    if name == "softcap":
        return None, variants.softcap(2.0), None, lambda s: reference.softcap(s, 2.0)
    raise ValueError(name)


VARIANTS = ["sliding_window", "sink_window", "document", "prefix_lm", "alibi", "softcap"]


def _inputs(B, H, H_kv, t_q, t_k, d, dtype=torch.float64, scale=1.0):
    q = randn(B, H, t_q, d, seed=1) * scale
    k = randn(B, H_kv, t_k, d, seed=2) * scale
    v = randn(B, H_kv, t_k, d, seed=3)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _twin(q, k, v, mask, score_fn) -> np.ndarray:
    """The NumPy twin in float64; key/value head h // G serves query head h."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1).numpy() for t in (k, v))
    return reference.attention_with_score_mod(q.double().numpy(), k, v, mask, score_mod=score_fn)[
        0
    ]


SHAPES = [  # H, H_kv, T_q, T_k, d_k
    (4, 4, 200, 200, 32),
    (4, 2, 200, 200, 59),  # GQA, an odd head size
    (2, 1, 200, 200, 111),  # MQA
    (3, 3, 130, 200, 64),  # T_q < T_k: the queries are the newest 130 positions
    (2, 2, 200, 150, 128),  # T_q > T_k, with q_offset=0: queries at positions 0 .. 199
    (2, 2, 200, 200, 256),
]


@pytest.mark.parametrize(
    "name, H, H_kv, t_q, t_k, d",
    # a packed row's document mask is square: T_q = T_k = len(doc_ids)
    [
        (name, *shape)
        for name in VARIANTS
        for shape in SHAPES
        if name != "document" or shape[2:4] == (200, 200)
    ],
)
def test_unfused_flex_equals_the_twin(name, H, H_kv, t_q, t_k, d) -> None:
    q_offset = 0 if t_q > t_k else None  # default: T_k - T_q
    offset = t_k - t_q if q_offset is None else q_offset
    mask_mod, score_mod, mask, score_fn = _case(name, H, t_q, t_k, offset)
    q, k, v = _inputs(2, H, H_kv, t_q, t_k, d, scale=2.0)
    out = variants.flex(
        q, k, v, mask_mod=mask_mod, score_mod=score_mod, q_offset=q_offset, compiled=False
    )
    np.testing.assert_allclose(out.numpy(), _twin(q, k, v, mask, score_fn), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", VARIANTS)
def test_compiled_flex_equals_the_twin(name) -> None:
    H, t = 4, 200
    mask_mod, score_mod, mask, score_fn = _case(name, H, t, t)
    q, k, v = _inputs(1, H, H, t, t, 32, dtype=torch.float32, scale=2.0)
    out = variants.flex(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
    np.testing.assert_allclose(out.numpy(), _twin(q, k, v, mask, score_fn), rtol=0, atol=2e-6)


@pytest.fixture(autouse=True, scope="module")
def room_for_every_compiled_case():
    """One compiled kernel per shape and mask (dynamic=False): more than torch's default of 8
    versions of flex_attention in this module. The compiler is never reset between cases."""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


def test_compiled_mask_functions_follow_one_another_in_one_process() -> None:
    # No compiler reset between the calls (nor between these tests): a document mask after a
    # sliding window once crashed Inductor's CPU code generation (dynamic shapes).
    q, k, v = _inputs(1, 2, 2, 256, 256, 16, dtype=torch.float32)
    ids = np.repeat(np.arange(4), 64)
    for mask_mod, mask in [
        (variants.sliding_window(64), reference.sliding_window_mask(256, window=64)),
        (variants.document(ids), reference.document_mask(ids)),
    ]:
        out = variants.flex(q, k, v, mask_mod=mask_mod)
        np.testing.assert_allclose(out.numpy(), _twin(q, k, v, mask, None), rtol=0, atol=2e-6)


def test_compiled_sliding_window_gqa_uneven_lengths() -> None:
    # GQA, T_q != T_k (neither a multiple of the 128-token tile), an odd head size.
    q, k, v = _inputs(2, 4, 2, 150, 290, 59, dtype=torch.float32)
    out = variants.flex(q, k, v, mask_mod=variants.sliding_window(100))
    # the 150 queries are the newest positions, 140 .. 289
    mask = reference.sliding_window_mask(290, 290, window=100)[140:]
    np.testing.assert_allclose(out.numpy(), _twin(q, k, v, mask, None), rtol=0, atol=2e-6)


def test_one_compiled_kernel_serves_every_window() -> None:
    # The window is a tensor the mask reads, not a constant in its code: no recompilation.
    # (B, H, T, d_k) as chapter 15 runs it, which then finds the kernel in the compiler's cache.
    q, k, v = _inputs(1, 8, 8, 1024, 1024, 64, dtype=torch.float32)
    for window in (256, 1, 100, 1024):
        with torch._dynamo.config.patch(error_on_recompile=window != 256):
            out = variants.flex(q, k, v, mask_mod=variants.sliding_window(window))
        mask = reference.sliding_window_mask(1024, window=window)
        np.testing.assert_allclose(out.numpy(), _twin(q, k, v, mask, None), atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_16_bit_within_sdpas_error(dtype) -> None:
    # The same inputs through SDPA with the dense mask, in the same dtype, set the tolerance.
    q, k, v = _inputs(1, 4, 4, 256, 256, 64, dtype=dtype)
    mask = reference.sliding_window_mask(256, window=64)
    exact = _twin(q, k, v, mask, None)
    out = variants.flex(q, k, v, mask_mod=variants.sliding_window(64))
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(mask))
    assert out.dtype == dtype
    ours, torchs = (np.abs(t.double().numpy() - exact).max() for t in (out, sdpa))
    assert ours <= 2 * torchs + 1e-3, (ours, torchs)


def test_dense_mask_is_the_twin() -> None:
    # 9 queries, 12 keys: by default the queries are the newest positions, 3 .. 11 (the
    # causal rows aligned bottom-right, as reference.causal_mask(align="bottom-right"));
    # with q_offset=0 they are positions 0 .. 8, where the twins put them.
    assert np.array_equal(
        reference.causal_mask(12, 12)[3:], reference.causal_mask(9, 12, align="bottom-right")
    )
    for mask_mod, twin in [
        (variants.causal, reference.causal_mask(12, 12)),
        (variants.sink_window(3, 2), reference.sink_window_mask(12, 12, window=3, sinks=2)),
        (variants.sliding_window(4), reference.sliding_window_mask(12, 12, window=4)),
        (variants.prefix_lm(5), reference.prefix_lm_mask(12, 12, prefix_len=5)),
    ]:
        np.testing.assert_array_equal(variants.dense_mask(mask_mod, 9, 12).numpy(), twin[3:])
        newest_two = variants.dense_mask(mask_mod, 2, 12, q_offset=10).numpy()
        np.testing.assert_array_equal(newest_two, twin[10:])
        first = variants.dense_mask(mask_mod, 9, 12, q_offset=0).numpy()
        np.testing.assert_array_equal(first, twin[:9])
    doc = variants.dense_mask(variants.document(DOC_IDS), 200)
    np.testing.assert_array_equal(doc.numpy(), reference.document_mask(DOC_IDS))
    # made where the mask_mod's tensors are (a GPU's, for one made for GPU queries): the meta
    # device stands in for one here, as a CPU mask cannot read its tensors
    on_meta = variants.dense_mask(variants.sink_window(3, 2, device="meta"), 9, 12)
    assert on_meta.device.type == "meta" and on_meta.shape == (9, 12)


def _tiles_of(mask: np.ndarray, block: int) -> np.ndarray:
    """0 = no score kept, 1 = every score kept, 2 = some: each tile of the dense mask."""
    n_q, n_k = -(-mask.shape[0] // block), -(-mask.shape[1] // block)
    tiles = np.zeros((n_q, n_k), dtype=np.int8)
    for r in range(n_q):
        for c in range(n_k):
            tile = mask[r * block : (r + 1) * block, c * block : (c + 1) * block]
            tiles[r, c] = 0 if not tile.any() else 1 if tile.all() else 2
    return tiles


@pytest.mark.parametrize(
    "mask_mod, twin",
    [
        (variants.sliding_window(256), reference.sliding_window_mask(1024, window=256)),
        (variants.sliding_window(100), reference.sliding_window_mask(1000, 700, window=100)),
        (variants.prefix_lm(300), reference.prefix_lm_mask(1024, prefix_len=300)),
        (variants.sink_window(200, 4), reference.sink_window_mask(1024, window=200, sinks=4)),
        (variants.document(np.repeat([0, 1, 2], [300, 500, 224])), None),
    ],
)
def test_tile_states_read_from_the_dense_mask(mask_mod, twin) -> None:
    if twin is None:
        twin = reference.document_mask(np.repeat([0, 1, 2], [300, 500, 224]))
    # the twins put the first query at position 0 (for the 1000 x 700 one too)
    states = variants.tile_states(variants.block_mask(mask_mod, *twin.shape, q_offset=0))
    np.testing.assert_array_equal(states, _tiles_of(twin, 128))


def test_causal_tiles_are_the_tiled_kernels() -> None:
    states = variants.tile_states(variants.block_mask(variants.causal, 1024, 1024, block_size=64))
    expected = flash.tile_schedule(1024, 1024, causal=True, block_q=64, block_k=64)
    np.testing.assert_array_equal(states, expected)


# ---------------------------------------------------------------------------------------------
# Gradients through a score_mod


def test_score_mods_applied_densely_equal_the_twins() -> None:
    scores = randn(2, 4, 9, 13, seed=5) * 30
    np.testing.assert_array_equal(
        variants.apply_score_mod(variants.alibi(4), torch.zeros(1, 4, 9, 13)).numpy(),
        reference.alibi_bias(4, 13, 13)[None, :, 4:].astype(np.float32),  # the newest 9
    )
    np.testing.assert_array_equal(
        variants.apply_score_mod(variants.alibi(4), torch.zeros(1, 4, 9, 13), q_offset=0),
        reference.alibi_bias(4, 9, 13)[None].astype(np.float32),
    )
    np.testing.assert_allclose(
        variants.apply_score_mod(variants.softcap(50.0), scores).numpy(),
        reference.softcap(scores.numpy(), 50.0),
        rtol=1e-15,
    )


def _dense_flex(q, k, v, score_mod, keep):
    """FlexAttention's scores written out: score_mod at every entry, then the mask, softmax."""
    scores = variants.apply_score_mod(score_mod, q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]))
    return torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1) @ v


@pytest.mark.parametrize(
    "score_mod", [variants.softcap(0.7), variants.alibi(2)], ids=["softcap", "alibi"]
)
def test_score_mod_gradients_by_finite_differences(score_mod) -> None:
    # FlexAttention has no backward pass on the CPU; the gradient it would take is that of the
    # score_mod's graph, checked here against finite differences (float64).
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 2, 6, 7, 3, scale=2.0))
    keep = torch.from_numpy(reference.sliding_window_mask(6, 7, window=3))
    assert torch.autograd.gradcheck(
        lambda q, k, v: _dense_flex(q, k, v, score_mod, keep), (q, k, v)
    )


@pytest.mark.cuda
def test_compiled_softcap_gradients_on_a_gpu() -> None:
    H, T, d = 4, 256, 64
    q, k, v = (t.cuda().requires_grad_() for t in _inputs(1, H, H, T, T, d, dtype=torch.float32))
    grad_out = randn(1, H, T, d, seed=4, dtype=torch.float32).cuda()
    mask_mod, score_mod = variants.sliding_window(64, device="cuda"), variants.softcap(1.0)
    out = variants.flex(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
    ours = torch.autograd.grad(out, (q, k, v), grad_out)
    keep = variants.dense_mask(mask_mod, T).cuda()
    theirs = torch.autograd.grad(_dense_flex(q, k, v, score_mod, keep), (q, k, v), grad_out)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# The rolling cache: decoding one token at a time equals full attention under the window


@pytest.mark.parametrize("window, prompt", [(5, 1), (5, 3), (5, 12), (1, 4), (8, 8)])
def test_rolling_cache_decodes_like_the_sliding_window(window, prompt) -> None:
    H, H_kv, T, d = 4, 2, 23, 16
    q, k, v = _inputs(2, H, H_kv, T, T, d)
    expected = _twin(q, k, v, reference.sliding_window_mask(T, window=window), None)

    cache = variants.RollingKVCache(2, window, H_kv, d, dtype=torch.float64)
    # the prompt at once, through the sliding-window mask; then the cache keeps its tail
    first = variants.flex(
        q[:, :, :prompt],
        k[:, :, :prompt],
        v[:, :, :prompt],
        mask_mod=variants.sliding_window(window),
        compiled=False,
    )
    np.testing.assert_allclose(first.numpy(), expected[:, :, :prompt], atol=1e-12)
    cache.update(k[:, :, :prompt], v[:, :, :prompt])
    for t in range(prompt, T):
        keys, values = cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert keys.shape[2] == len(cache) == min(t + 1, window)
        step = F.scaled_dot_product_attention(q[:, :, t : t + 1], keys, values, enable_gqa=True)
        np.testing.assert_allclose(step.numpy(), expected[:, :, t : t + 1], atol=1e-12)
    assert cache._slots.keys.shape == (2, H_kv, window, d)  # never grew


def test_rolling_cache_reset_and_views() -> None:
    cache = variants.RollingKVCache(1, 3, 1, 2)
    k = torch.arange(10.0).reshape(1, 1, 5, 2)
    keys, values = cache.update(k, -k)
    # positions 2, 3, 4 in slots 2, 0, 1
    np.testing.assert_array_equal(keys[0, 0, :, 0].numpy(), [6.0, 8.0, 4.0])
    np.testing.assert_array_equal(values[0, 0, :, 0].numpy(), [-6.0, -8.0, -4.0])
    cache.reset()
    assert len(cache) == 0
    keys, _ = cache.update(k[:, :, :1], k[:, :, :1])
    assert keys.shape == (1, 1, 1, 2)


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error that names the argument


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: variants.sliding_window(0), ValueError, "window must be a positive int, got 0"),
        (lambda: variants.sliding_window(-3), ValueError, "window must be a positive int"),
        (lambda: variants.sliding_window(2.5), TypeError, "window must be an int, got float"),
        (lambda: variants.prefix_lm(-1), ValueError, "prefix_len must be an int >= 0"),
        (lambda: variants.sink_window(0, 4), ValueError, "window must be a positive int"),
        (lambda: variants.sink_window(8, -1), ValueError, "sinks must be an int >= 0, got -1"),
        (lambda: variants.sink_window(8, 1.0), TypeError, "sinks must be an int, got float"),
        (
            lambda: variants.softcap(0.0),
            ValueError,
            "cap must be a positive finite float, got 0.0",
        ),
        (lambda: variants.softcap(-50), ValueError, "cap must be a positive finite float"),
        (lambda: variants.softcap(math.inf), ValueError, "cap must be a positive finite float"),
        (lambda: variants.softcap("50"), TypeError, "cap must be a float, got str"),
        (lambda: variants.alibi(0), ValueError, "num_heads must be a positive int"),
        (lambda: variants.document([0.0, 1.0]), TypeError, "doc_ids must be ints, got dtype"),
        (lambda: variants.document([[0, 1]]), ValueError, "doc_ids must be a non-empty 1-D"),
        (lambda: variants.document([]), ValueError, "doc_ids must be a non-empty 1-D"),
        (lambda: reference.sliding_window_mask(4, window=0), ValueError, "window must be a pos"),
        (lambda: reference.document_mask([0.5]), TypeError, "doc_ids must be an array of ints"),
        (lambda: reference.softcap([1.0], 0), ValueError, "cap must be a positive finite float"),
        (lambda: reference.prefix_lm_mask(4, prefix_len=-2), ValueError, "prefix_len must be"),
        (lambda: variants.RollingKVCache(1, 0, 1, 2), ValueError, "window must be a positive"),
    ],
)
def test_bad_arguments(call, error, words) -> None:
    with pytest.raises(error, match=words):
        call()


def test_document_of_the_wrong_length() -> None:
    q = torch.zeros(1, 2, 120, 8)
    with pytest.raises(ValueError, match=r"doc_ids has 200 tokens.*got T_q = 120, T_k = 120"):
        variants.flex(q, q, q, mask_mod=variants.document(DOC_IDS), compiled=False)
    with pytest.raises(ValueError, match="doc_ids has 200 tokens"):
        variants.block_mask(variants.document(DOC_IDS), 256)


def test_flex_input_errors() -> None:
    q = torch.zeros(1, 4, 16, 8)
    with pytest.raises(
        ValueError, match=r"q must have shape \(B, H, T, d_k\), got shape \(4, 16, 8\)"
    ):
        variants.flex(q[0], q, q)
    with pytest.raises(TypeError, match="k must be a floating-point tensor, got torch.int64"):
        variants.flex(q, q.long(), q)
    with pytest.raises(ValueError, match=r"k must be \(B, H_kv, T_k, d_k\) and v \(B, H_kv"):
        variants.flex(q, q, q[:, :, :8])
    with pytest.raises(
        ValueError, match=r"num_heads of q \(4\) must be divisible by num_heads of k \(3\)"
    ):
        variants.flex(q, torch.zeros(1, 3, 16, 8), torch.zeros(1, 3, 16, 8))
    with pytest.raises(ValueError, match="alibi score_mod has slopes for 8 heads, q has 4"):
        variants.flex(q, q, q, score_mod=variants.alibi(8), compiled=False)
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        variants.block_mask(np.ones((4, 4), bool), 4)


_PORTABLE_FLEX = """
import torch
from torch.nn.attention.flex_attention import flex_attention
from mha import variants
q = torch.zeros(1, 2, 16, 8)
assert not variants.flex_compiles("cpu")
try:
    variants.flex(q, q, q)
except RuntimeError as error:
    print("ours:", error)
try:  # what the check spares the reader: torch's own failure, deep in Inductor
    torch.compile(flex_attention)(q, q, q)
except Exception as error:
    print("torch:", type(error).__name__, "not supported for CPU" in str(error))
print("unfused:", variants.flex(q, q, q, compiled=False).shape)
"""


def test_flex_under_the_portable_default_says_why_it_cannot_compile(tmp_path) -> None:
    """ATEN_CPU_CAPABILITY=default: torch cannot compile FlexAttention on a CPU; flex says so."""
    env = {
        **os.environ,
        "ATEN_CPU_CAPABILITY": "default",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    run = subprocess.run(
        [sys.executable, "-c", _PORTABLE_FLEX],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ours: flex(compiled=True): torch cannot compile FlexAttention" in run.stdout
    assert "pass compiled=False" in run.stdout
    assert "torch: " in run.stdout and "True" in run.stdout.split("torch: ")[1].split("\n")[0]
    assert "unfused: torch.Size([1, 2, 16, 8])" in run.stdout
    # on this machine's own instruction set the compiled kernel is available
    assert variants.flex_compiles("cpu") == torch.cpu._is_avx2_supported()


def test_rolling_cache_update_errors() -> None:
    cache = variants.RollingKVCache(2, 4, 2, 8)
    with pytest.raises(ValueError, match=r"\(B, H_kv, d_k\) = \(2, 2, 8\)"):
        cache.update(torch.zeros(2, 1, 1, 8), torch.zeros(2, 1, 1, 8))
    with pytest.raises(TypeError, match="dtype torch.float32"):
        cache.update(torch.zeros(2, 2, 1, 8, dtype=torch.float64), torch.zeros(2, 2, 1, 8))
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        cache.update(torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 2, 8))
    assert len(cache) == 0  # nothing was written


# ---------------------------------------------------------------------------------------------
# The benchmark: python -m mha.bench variants


def test_variants_benchmark_rows_and_ratios() -> None:
    from mha.bench import variants as bench_variants
    from mha.bench.report import paired_ratio

    report = bench_variants.run_variants_benchmark(
        seq_lens=(200,),
        window=37,
        heads=4,
        head_dim=32,
        repeats=2,
        warmup=1,
        min_time=0.0,
        max_repeats=2,
        cold_compile=False,
        quiet=True,
    )
    rows = {row["impl"]: row for row in report["results"]}
    assert list(rows) == list(bench_variants.VARIANT_IMPLEMENTATIONS)
    assert all(row["status"] == "ok" and row["seq_len"] == 200 for row in rows.values())
    assert all(row["first_call_s"] > 0 and len(row["times_s"]) == 2 for row in rows.values())
    # the window's entries against SDPA with the dense mask (the causal pair has no window)
    assert rows["flex"]["max_abs_diff"] < 1e-5
    assert rows["sdpa_dense_mask"]["max_abs_diff"] == 0.0
    assert "max_abs_diff" not in rows["sdpa_causal"]
    (mask,) = report["masks"]
    twin_tiles = _tiles_of(reference.sliding_window_mask(200, window=37), 128)
    assert (mask["tiles_computed"], mask["tiles_total"]) == (np.count_nonzero(twin_tiles), 4)
    assert mask["dense_mask_bytes"] == 200 * 200 and mask["block_mask_s"] > 0
    (ratios,) = report["ratios"]
    for key, (a, b) in bench_variants.VARIANT_RATIOS.items():
        assert ratios[key] == paired_ratio(rows[a], rows[b])
    assert ratios["sdpa_dense/flex"] == np.median(
        np.divide(rows["sdpa_dense_mask"]["times_s"], rows["flex"]["times_s"])
    )
    text = bench_variants.format_variants(report)
    assert "sliding_window W=37" in text and "sdpa_dense/flex" in text


def test_flex_causal_entry_equals_causal_sdpa() -> None:
    from mha.bench import variants as bench_variants

    q, k, v = bench_variants.make_variant_inputs(1, 4, 200, 32)
    run = bench.build_runner(
        bench_variants.VARIANT_IMPLEMENTATIONS, "flex_causal", q, k, v, variants.causal
    )
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(run(), expected, rtol=0, atol=2e-6)


def test_variants_command_line(tmp_path, capsys) -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "mha.bench", "variants", "--impl"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert [line.split()[0] for line in listing.splitlines()[1:]] == [
        "flex",
        "sdpa_dense_mask",
        "flex_causal",
        "sdpa_causal",
    ]
    output = tmp_path / "variants.json"
    argv = ["variants", "--seq-lens", "64", "--heads", "2", "--head-dim", "16", "--quiet"]
    argv += ["--mask", "sink_window", "--window", "8", "--sinks", "2", "--repeats", "1"]
    argv += ["--min-time", "0", "--impl", "sdpa_dense_mask", "sdpa_causal"]
    assert bench.main([*argv, "--output", str(output)]) == 0
    report = bench.load_results(output)
    assert report["config"]["mask"] == "sink_window" and report["config"]["sinks"] == 2
    assert report["environment"]["command"].startswith("python -m mha.bench variants")
    assert [row["impl"] for row in report["results"]] == ["sdpa_dense_mask", "sdpa_causal"]
    assert "sink_window W=8 sinks=2" in capsys.readouterr().out


def test_variants_benchmark_bad_arguments() -> None:
    from mha.bench import variants as bench_variants

    with pytest.raises(ValueError, match="mask must be one of 'sliding_window'"):
        bench_variants.run_variants_benchmark(mask="diagonal", quiet=True)
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        bench_variants.run_variants_benchmark(window=0, quiet=True)
    with pytest.raises(ValueError, match="each of seq_lens must be a positive int"):
        bench_variants.run_variants_benchmark(seq_lens=(0,), quiet=True)


# ---------------------------------------------------------------------------------------------
# Fewer queries than keys, a block mask built once, the scale, d_v, the device of a variant


@pytest.mark.parametrize(
    "mask_mod",
    [
        variants.causal,
        variants.sliding_window(5),
        variants.sink_window(5, 2),
        variants.prefix_lm(7),
    ],
    ids=["causal", "sliding_window", "sink_window", "prefix_lm"],
)
@pytest.mark.parametrize("with_alibi", [False, True], ids=["", "alibi"])
@pytest.mark.parametrize("t_q", [1, 6])
def test_fewer_queries_are_the_newest_positions(mask_mod, with_alibi, t_q) -> None:
    # A decoding step (T_q = 1) or a chunk of a prompt (T_q = 6) after 20 - T_q earlier tokens:
    # its outputs are the last T_q rows of attention over the whole sequence.
    q, k, v = _inputs(2, 2, 1, 20, 20, 8)
    score_mod = variants.alibi(2) if with_alibi else None
    whole = variants.flex(q, k, v, mask_mod=mask_mod, score_mod=score_mod, compiled=False)
    step = variants.flex(
        q[:, :, -t_q:], k, v, mask_mod=mask_mod, score_mod=score_mod, compiled=False
    )
    torch.testing.assert_close(step, whole[:, :, -t_q:], rtol=0, atol=1e-12)


def test_compiled_decoding_step_under_a_sliding_window() -> None:
    q, k, v = _inputs(1, 4, 2, 1, 300, 64, dtype=torch.float32)
    out = variants.flex(q, k, v, mask_mod=variants.sliding_window(100))
    # the query is position 299: it sees keys 200 .. 299
    mask = reference.sliding_window_mask(300, 300, window=100)[-1:]
    np.testing.assert_allclose(out.numpy(), _twin(q, k, v, mask, None), rtol=0, atol=2e-6)


def test_flex_with_a_block_mask_built_once() -> None:
    q, k, v = _inputs(1, 2, 2, 20, 20, 8)
    window = variants.sliding_window(5)
    built = variants.block_mask(window, 20, 20, block_size=8)
    once = variants.flex(q, k, v, block_mask=built, compiled=False)
    each = variants.flex(q, k, v, mask_mod=window, block_size=8, compiled=False)
    torch.testing.assert_close(once, each, rtol=0, atol=0)
    twin = _twin(q, k, v, reference.sliding_window_mask(20, window=5), None)
    np.testing.assert_allclose(once.numpy(), twin, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="mask_mod or block_mask, not both"):
        variants.flex(q, k, v, mask_mod=window, block_mask=built, compiled=False)
    with pytest.raises(ValueError, match=r"built for T_q, T_k = \(20, 20\), q and k have 6, 20"):
        variants.flex(q[:, :, :6], k, v, block_mask=built, compiled=False)
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        variants.flex(q, k, v, block_mask=np.ones((20, 20), bool), compiled=False)


def test_flex_scale_and_a_value_width_of_its_own() -> None:
    # Gemma 2 scales its scores by query_pre_attn_scalar^-1/2, not d_k^-1/2; d_v may differ.
    q, k, _ = _inputs(2, 4, 2, 12, 12, 16)
    v = randn(2, 2, 12, 5, seed=9)
    out = variants.flex(
        q, k, v, mask_mod=variants.causal, score_mod=variants.softcap(2.0), scale=0.3,
        compiled=False,
    )  # fmt: skip
    k_rep, v_rep = (t.repeat_interleave(2, dim=1).numpy() for t in (k, v))
    expected = reference.attention_with_score_mod(
        q.numpy(), k_rep, v_rep, reference.causal_mask(12),
        score_mod=lambda s: reference.softcap(s, 2.0), scale=0.3,
    )[0]  # fmt: skip
    assert out.shape == (2, 4, 12, 5)
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="scale must be a positive finite float"):
        variants.flex(q, k, v, scale=0.0, compiled=False)


def test_a_variant_reading_a_tensor_names_its_device() -> None:
    q = torch.zeros(1, 4, 16, 8)
    assert variants.alibi(4, device="meta").device.type == "meta"
    with pytest.raises(ValueError, match=r"score_mod reads a tensor on meta, the queries are on"):
        variants.flex(q, q, q, score_mod=variants.alibi(4, device="meta"), compiled=False)
    ids = torch.tensor(np.repeat([0, 1], [6, 10]))
    assert variants.document(ids).device == ids.device  # a tensor stays where it is
    with pytest.raises(ValueError, match=r"mask_mod reads a tensor on meta.*device='cpu'"):
        variants.flex(q, q, q, mask_mod=variants.document(ids, device="meta"), compiled=False)


def test_a_mask_on_another_device_than_the_queries_is_refused_by_name() -> None:
    # The window is a tensor the compiled kernel reads: it must live where the queries do.
    q = torch.zeros(1, 1, 16, 16, device="meta")
    for mask_mod in (
        variants.sliding_window(4),
        variants.prefix_lm(2),
        variants.sink_window(4, 1),
    ):
        with pytest.raises(ValueError, match="build it with device='meta'"):
            variants.flex(q, q, q, mask_mod=mask_mod, compiled=False)
    assert variants.sliding_window(4, device="meta").device == torch.device("meta")
