"""mha.MultiHeadLatentAttention against transformers' DeepseekV3Attention, its cache, its twin.

DeepseekV3Attention is built from a small DeepseekV3Config with random weights (nothing from a
hub); its state_dict loads into ours strictly. transformers computes the rotary cos/sin outside
the layer (DeepseekV3RotaryEmbedding, YaRN's attention_scaling included) and gets the causal mask
from the model: here an additive float mask aligned to the last query, as in test_llama_parity.
Its cache (a DynamicCache) holds the normalized latents as "keys" and the rotated shared key as
"values", (B, 1, T, r) and (B, 1, T, d_R): the same numbers as our LatentKVCache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mha.counting import DEEPSEEK_V3_MLA, LatentAttentionShape
from mha.latent import LatentKVCache, MultiHeadLatentAttention, reference_weights
from mha.reference import multi_head_latent_attention
from torch.utils.flop_counter import FlopCounterMode
from transformers import DeepseekV3Config
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from helpers import randn

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D, H, R, D_R, D_N, D_V, Q_R = 64, 4, 32, 16, 24, 20, 40
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}


def config(q_lora_rank=None, interleave=True, rope=DEFAULT, **extra) -> DeepseekV3Config:
    cfg = DeepseekV3Config(
        hidden_size=D,
        num_attention_heads=H,
        num_key_value_heads=H,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=R,
        qk_rope_head_dim=D_R,
        qk_nope_head_dim=D_N,
        v_head_dim=D_V,
        rope_interleave=interleave,
        rope_parameters=dict(rope),
        max_position_embeddings=128,
        num_hidden_layers=1,
        vocab_size=16,
        **extra,
    )
    cfg._attn_implementation = "eager"
    return cfg


def pair(cfg: DeepseekV3Config, seed: int = 0):
    """transformers' layer with weights large enough that every part matters, and ours."""
    torch.manual_seed(seed)
    theirs = DeepseekV3Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.3)  # the norms' gains too (ones by default)
    ours = MultiHeadLatentAttention.from_config(cfg).eval()
    ours.load_state_dict(theirs.state_dict())  # strict: the same names and shapes
    return theirs, ours


def additive_causal(t_q: int, t_k: int) -> torch.Tensor:
    """(1, 1, T_q, T_k): 0 where key j <= the query's position (T_k - T_q + i), -inf elsewhere."""
    blocked = torch.arange(t_k)[None, :] > torch.arange(t_k - t_q, t_k)[:, None]
    return torch.zeros(t_q, t_k).masked_fill(blocked, float("-inf"))[None, None]


CASES = [
    pytest.param(q, inter, rope, id=f"q_lora={q}-interleave={inter}-{rope['rope_type']}")
    for q in (None, Q_R)
    for inter in (True, False)
    for rope in (DEFAULT, YARN)
]


@pytest.mark.parametrize("q_lora_rank", [None, Q_R])
def test_state_dicts_have_the_same_names_and_shapes(q_lora_rank) -> None:
    theirs, ours = pair(config(q_lora_rank))
    assert {k: v.shape for k, v in theirs.state_dict().items()} == {
        k: v.shape for k, v in ours.state_dict().items()
    }
    theirs.load_state_dict(ours.state_dict())  # and back, strictly


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize(("q_lora_rank", "interleave", "rope"), CASES)
def test_prompt_equals_deepseek_v3_attention(q_lora_rank, interleave, rope, absorb) -> None:
    cfg = config(q_lora_rank, interleave, rope)
    theirs, ours = pair(cfg)
    x = randn(2, 11, D, seed=1, dtype=torch.float32)
    positions = torch.arange(11)[None]
    with torch.no_grad():
        expected, _ = theirs(
            x, DeepseekV3RotaryEmbedding(cfg)(x, positions), additive_causal(11, 11)
        )
        got = ours(x, absorb=absorb)
    assert expected.abs().max() > 0.5  # not a vanishing output
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize(("q_lora_rank", "interleave", "rope"), CASES[::3])
def test_cached_decoding_equals_deepseek_v3_attention(q_lora_rank, interleave, rope, absorb):
    """A prompt of 5, one token, a chunk of 3, one token: each step against transformers' step
    with its DynamicCache, and the caches' contents against each other."""
    cfg = config(q_lora_rank, interleave, rope)
    theirs, ours = pair(cfg)
    rotary = DeepseekV3RotaryEmbedding(cfg)
    x = randn(2, 10, D, seed=2, dtype=torch.float32)
    their_cache, our_cache = DynamicCache(config=cfg), LatentKVCache(2, 12, R, D_R)
    start = 0
    for stop in (5, 6, 9, 10):
        step = x[:, start:stop]
        positions = torch.arange(start, stop)[None]
        with torch.no_grad():
            expected, _ = theirs(
                step,
                rotary(step, positions),
                additive_causal(stop - start, stop),
                past_key_values=their_cache,
            )
            got = ours(step, cache=our_cache, absorb=absorb)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        start = stop
    assert len(our_cache) == 10
    latents, keys = their_cache.layers[0].keys, their_cache.layers[0].values  # (B, 1, T, .)
    torch.testing.assert_close(our_cache.latents[:, :10], latents[:, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(our_cache.keys[:, :10], keys[:, 0], rtol=0, atol=1e-6)


def test_per_row_positions_equal_transformers() -> None:
    """(B, T) positions: each row its own offset (a left-padded batch continues this way)."""
    cfg = config(Q_R, True, YARN)
    theirs, ours = pair(cfg)
    x = randn(2, 6, D, seed=3, dtype=torch.float32)
    positions = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        expected, _ = theirs(
            x, DeepseekV3RotaryEmbedding(cfg)(x, positions), additive_causal(6, 6)
        )
        for absorb in (False, True):
            got = ours(x, positions=positions, absorb=absorb)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_absorbed_equals_naive_in_float64_with_a_cache() -> None:
    torch.manual_seed(4)
    layer = MultiHeadLatentAttention(
        96, 6, kv_lora_rank=48, qk_rope_head_dim=32, qk_nope_head_dim=40, v_head_dim=33,
        q_lora_rank=56, bias=True, dtype=torch.float64,
    )  # fmt: skip
    x = randn(3, 21, 96, seed=5)
    caches = [LatentKVCache(3, 21, 48, 32, dtype=torch.float64) for _ in range(2)]
    with torch.no_grad():
        for start, stop in ((0, 13), (13, 14), (14, 21)):
            naive = layer(x[:, start:stop], cache=caches[0])
            absorbed = layer(x[:, start:stop], cache=caches[1], absorb=True)
            torch.testing.assert_close(absorbed, naive, rtol=0, atol=1e-12)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("q_lora_rank", [None, Q_R])
def test_numpy_twin_equals_the_layer(interleave: bool, q_lora_rank) -> None:
    cfg = config(q_lora_rank, interleave, YARN, attention_bias=True)
    _, ours = pair(cfg)
    ours = ours.double()
    x = randn(2, 9, D, seed=6)
    with torch.no_grad():
        expected = ours(x).numpy()
    rope = ours.rope
    got, weights = multi_head_latent_attention(
        x.numpy(),
        reference_weights(ours),
        num_heads=H,
        qk_nope_head_dim=D_N,
        qk_rope_head_dim=D_R,
        v_head_dim=D_V,
        frequencies=rope.frequencies(D_R, torch.float64).numpy(),
        rope_scaling=rope.attention_scaling,
        interleave=interleave,
        scale=ours.scaling,
    )
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    assert weights.shape == (2, H, 9, 9)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=0, atol=1e-12)
    assert np.all(np.triu(weights, k=1) == 0)  # causal


def test_yarn_scale_is_the_mscale_of_transformers() -> None:
    """1/sqrt(d_N + d_R) times (0.1 ln(factor) mscale_all_dim + 1)^2, worked by hand."""
    _, ours = pair(config(None, True, YARN))
    by_hand = (D_N + D_R) ** -0.5 * (0.1 * np.log(4.0) * 1.0 + 1.0) ** 2
    assert ours.scaling == pytest.approx(by_hand, rel=1e-15)
    assert pair(config())[1].scaling == pytest.approx((D_N + D_R) ** -0.5, rel=1e-15)


def test_a_dict_config_builds_the_same_layer() -> None:
    cfg = config(Q_R, False, YARN)
    from_dict = MultiHeadLatentAttention.from_config(cfg.to_dict())
    from_object = MultiHeadLatentAttention.from_config(cfg)
    for name in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "scaling"):
        assert getattr(from_dict, name) == getattr(from_object, name)
    assert from_dict.rope == from_object.rope and from_dict.rope_interleave is False
    # DeepSeek-V3's own config.json: rope_scaling with "type", beside rope_theta
    old_style = {
        k: v for k, v in cfg.to_dict().items() if k not in ("rope_parameters", "head_dim")
    }
    old_style["rope_scaling"] = {k: v for k, v in YARN.items() if k not in ("rope_theta",)}
    old_style["rope_scaling"]["type"] = old_style["rope_scaling"].pop("rope_type")
    old_style["rope_theta"] = 10000.0
    assert MultiHeadLatentAttention.from_config(old_style).rope == from_object.rope


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"sliding_window": 128}, "sliding_window"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"model_type": "llama"}, "model_type"),
        ({"head_dim": 8}, "head_dim"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ],
)
def test_config_fields_it_does_not_implement_are_refused_by_name(change, named) -> None:
    fields = {**config().to_dict(), **change}
    with pytest.raises(ValueError, match=named):
        MultiHeadLatentAttention.from_config(fields)


# ---------------------------------------------------------------------------------------------
# The cache


def test_the_cache_is_written_in_place_and_counts_in_a_tensor() -> None:
    cache = LatentKVCache(2, 8, R, D_R)
    pointers = (cache.latents.data_ptr(), cache.keys.data_ptr())
    latent, key = randn(2, 3, R, dtype=torch.float32), randn(2, 3, D_R, dtype=torch.float32)
    all_latents, all_keys = cache.update(latent, key)
    assert torch.equal(all_latents, latent) and torch.equal(all_keys, key)
    more = (
        randn(2, 2, R, seed=1, dtype=torch.float32),
        randn(2, 2, D_R, seed=1, dtype=torch.float32),
    )
    all_latents, all_keys = cache.update(*more)
    assert (cache.latents.data_ptr(), cache.keys.data_ptr()) == pointers
    assert all_latents.data_ptr() == pointers[0]  # a view of the preallocated tensor
    assert torch.equal(all_latents, torch.cat((latent, more[0]), dim=1))
    assert isinstance(cache.length, torch.Tensor) and len(cache) == cache.seen == 5
    cache.truncate(3)
    assert len(cache) == 3
    cache.reset()
    assert len(cache) == 0 and cache.latents.data_ptr() == pointers[0]


def test_the_cache_holds_r_plus_d_r_numbers_per_token() -> None:
    cache = LatentKVCache(1, 100, 512, 64, dtype=torch.bfloat16)
    assert cache.nbytes == 100 * (512 + 64) * 2  # per token: 1152 bytes, any H


@pytest.mark.parametrize(
    ("latent", "key", "error", "named"),
    [
        ((3, 2, R), (3, 2, D_R), ValueError, "B = 2"),
        ((2, 2, R + 1), (2, 2, D_R), ValueError, "latent"),
        ((2, 2, R), (2, 2, D_R + 2), ValueError, "key"),
        ((2, 2, R), (2, 3, D_R), ValueError, "same tokens"),
        ((2, 9, R), (2, 9, D_R), ValueError, "max_len = 8"),
        ((2, 2, R), (2, 2), ValueError, "key"),
    ],
)
def test_bad_updates_are_refused_with_nothing_written(latent, key, error, named) -> None:
    cache = LatentKVCache(2, 8, R, D_R)
    cache.update(torch.ones(2, 1, R), torch.ones(2, 1, D_R))
    before = cache.latents.clone(), cache.keys.clone()
    with pytest.raises(error, match=named):
        cache.update(torch.full(latent, 7.0), torch.full(key, 7.0))
    assert len(cache) == 1
    assert torch.equal(cache.latents, before[0]) and torch.equal(cache.keys, before[1])


def test_a_cache_of_another_dtype_or_width_is_refused_by_the_layer() -> None:
    _, ours = pair(config())
    x = torch.zeros(2, 3, D)
    with pytest.raises(TypeError, match="dtype torch.float64, got torch.float32"):
        ours(x, cache=LatentKVCache(2, 8, R, D_R, dtype=torch.float64))
    narrow = LatentKVCache(2, 8, R // 2, D_R)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        ours(x, cache=narrow)
    assert len(narrow) == 0
    with pytest.raises(ValueError, match="positions"):
        ours(x, positions=torch.arange(4))
    with pytest.raises(ValueError, match=r"\(B, T, D\) with D = 64"):
        ours(torch.zeros(2, 3, D + 1))


# ---------------------------------------------------------------------------------------------
# Counts: the FLOPs torch's own counter sees, and the cache's bytes


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("q_lora_rank", [None, Q_R])
def test_decode_flops_are_what_torch_counts(absorb: bool, q_lora_rank) -> None:
    _, ours = pair(config(q_lora_rank))
    shape = LatentAttentionShape(D, H, R, D_R, D_N, D_V, q_lora_rank)
    cache = LatentKVCache(1, 20, R, D_R)
    with torch.no_grad():
        ours(randn(1, 12, D, dtype=torch.float32), cache=cache)
        with FlopCounterMode(display=False) as counter:
            ours(randn(1, 1, D, seed=1, dtype=torch.float32), cache=cache, absorb=absorb)
        assert counter.get_total_flops() == shape.decode_flops(13, absorb=absorb)
        with FlopCounterMode(display=False) as counter:  # a chunk of 4 after the 13
            ours(randn(1, 4, D, seed=2, dtype=torch.float32), cache=cache, absorb=absorb)
    expected = 4 * shape.projection_flops() + shape.attention_flops(17, absorb=absorb, queries=4)
    assert counter.get_total_flops() == expected


def test_deepseek_v3_counts() -> None:
    """The shape is transformers' DeepseekV3Config's defaults; MLA's cache per token is
    (512 + 64) 61 numbers, DeepSeek-V2's Table 1 row (d_c + d_h^R) l."""
    defaults = DeepseekV3Config()
    v3 = DEEPSEEK_V3_MLA
    assert (v3.d_model, v3.num_heads, v3.num_layers) == (
        defaults.hidden_size,
        defaults.num_attention_heads,
        defaults.num_hidden_layers,
    )
    assert (v3.kv_lora_rank, v3.qk_rope_head_dim, v3.qk_nope_head_dim) == (
        defaults.kv_lora_rank,
        defaults.qk_rope_head_dim,
        defaults.qk_nope_head_dim,
    )
    assert (v3.v_head_dim, v3.q_lora_rank) == (defaults.v_head_dim, defaults.q_lora_rank)
    assert v3.cache_elements_per_token() == 576 * 61 == 35136
    # absorbed attention per cached key: H (2 r + d_R) multiply-adds = 128 * 1088
    assert v3.attention_flops(2, absorb=True) - v3.attention_flops(1, absorb=True) == (
        2 * 128 * 1088
    )
    assert v3.decode_bytes(1000, absorb=True) == 1000 * 576 * 2


@pytest.mark.parametrize("absorb", [False, True])
def test_bfloat16_is_as_close_to_float64_as_transformers_own(absorb: bool) -> None:
    """In bfloat16 both layers round; ours must not be further from the float64 result than
    DeepseekV3Attention in bfloat16 is (by more than a quarter)."""
    cfg = config(Q_R, True, YARN)
    theirs, ours = pair(cfg)
    x = randn(2, 11, D, seed=1)
    positions, mask = torch.arange(11)[None], additive_causal(11, 11)
    with torch.no_grad():
        exact, _ = theirs.double()(x, DeepseekV3RotaryEmbedding(cfg)(x, positions), mask.double())
        xb = x.to(torch.bfloat16)
        theirs_b, _ = theirs.to(torch.bfloat16)(
            xb, DeepseekV3RotaryEmbedding(cfg)(xb, positions), mask.to(torch.bfloat16)
        )
        ours_b = ours.to(torch.bfloat16)(xb, absorb=absorb)
    their_error = (theirs_b.double() - exact).abs().max()
    our_error = (ours_b.double() - exact).abs().max()
    assert our_error <= 1.25 * their_error, (our_error, their_error)


@pytest.mark.parametrize("absorb", [False, True])
def test_causal_counts_charge_each_query_for_the_keys_it_sees(absorb: bool) -> None:
    # A chunk of 4 queries after 13 cached keys (17 in all), causal: the queries see 14, 15, 16
    # and 17 keys, 62 scores in all instead of 4 * 17 = 68. The count is what one query at each
    # of those context lengths costs, the naive expansion of the cache paid once.
    v3 = DEEPSEEK_V3_MLA
    H, r, d_r = v3.num_heads, v3.kv_lora_rank, v3.qk_rope_head_dim
    d_n, d_v = v3.qk_nope_head_dim, v3.v_head_dim
    per_score = 2 * H * ((2 * r + d_r) if absorb else (d_n + d_r + d_v))
    dense = v3.attention_flops(17, absorb=absorb, queries=4)
    causal = v3.attention_flops(17, absorb=absorb, queries=4, causal=True)
    assert dense - causal == (68 - 62) * per_score
    if absorb:  # each query alone at its own context
        assert causal == sum(v3.attention_flops(t, absorb=True) for t in (14, 15, 16, 17))
    assert v3.attention_flops(17, absorb=absorb, queries=1, causal=True) == (
        v3.attention_flops(17, absorb=absorb)
    )
