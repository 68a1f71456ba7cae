"""mha.GroupedQueryAttention against transformers' LlamaAttention, the layer people load.

LlamaAttention is built from a small LlamaConfig with random weights (no download, nothing from
a hub); its state_dict is loaded into ours with no renaming. transformers computes the rotary
cos/sin in LlamaRotaryEmbedding, outside the attention layer, and hands them in as
position_embeddings; its cache is a DynamicCache (grown by concatenation) or a StaticCache
(preallocated). Eager attention is given the causal mask as the model would build it: an
additive float mask, 0 where a query may attend and -inf elsewhere, aligned to the last query.
"""

from __future__ import annotations

import pytest
import torch
from mha.decoding import ConcatKVCache, GroupedQueryAttention, KVCache
from transformers import LlamaConfig
from transformers.cache_utils import DynamicCache, StaticCache
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from helpers import randn

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D, H, BASE = 64, 8, 10000.0
D_K = D // H


def llama_pair(num_kv_heads: int, impl: str, dtype=torch.float32, seed: int = 0):
    config = LlamaConfig(
        hidden_size=D,
        num_attention_heads=H,
        num_key_value_heads=num_kv_heads,
        num_hidden_layers=1,
        vocab_size=16,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": BASE},
    )
    config._attn_implementation = impl
    torch.manual_seed(seed)
    theirs = LlamaAttention(config, layer_idx=0).to(dtype).eval()
    ours = GroupedQueryAttention(D, H, num_kv_heads, rope_base=BASE, dtype=dtype).eval()
    ours.load_state_dict(theirs.state_dict())  # strict: the same names and shapes
    return config, theirs, ours


def additive_causal(t_q: int, t_k: int, dtype=torch.float32) -> torch.Tensor:
    """(1, 1, T_q, T_k): 0 where key j <= the query's position (T_k - T_q + i), -inf elsewhere."""
    query_pos = torch.arange(t_k - t_q, t_k)[:, None]
    blocked = torch.arange(t_k)[None, :] > query_pos
    return torch.zeros(t_q, t_k, dtype=dtype).masked_fill(blocked, float("-inf"))[None, None]


def cos_sin_float64(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary cos/sin of the Llama formula, in float64: (1, T, d_k) each."""
    frequencies = BASE ** (-torch.arange(0, D_K, 2, dtype=torch.float64) / D_K)
    angles = positions.to(torch.float64)[:, None] * frequencies  # (T, d_k / 2)
    angles = torch.cat((angles, angles), dim=-1)  # "rotate half": dims i and i + d_k/2
    return angles.cos()[None], angles.sin()[None]


def test_state_dicts_have_the_same_names_and_shapes() -> None:
    _, theirs, ours = llama_pair(2, "eager")
    assert {k: v.shape for k, v in theirs.state_dict().items()} == {
        k: v.shape for k, v in ours.state_dict().items()
    }
    theirs.load_state_dict(ours.state_dict())  # and back


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
def test_full_sequence_equals_llama_attention(impl: str, num_kv_heads: int) -> None:
    config, theirs, ours = llama_pair(num_kv_heads, impl)
    rotary = LlamaRotaryEmbedding(config)
    x = randn(2, 13, D, seed=1, dtype=torch.float32)
    positions = torch.arange(13)
    mask = additive_causal(13, 13) if impl == "eager" else None  # sdpa: is_causal inside
    with torch.no_grad():
        expected, _ = theirs(x, rotary(x, positions[None]), mask)
        actual = ours(x)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
def test_full_sequence_equals_llama_attention_in_float64(num_kv_heads: int) -> None:
    # LlamaRotaryEmbedding computes its angles in float32 whatever the model's dtype, and eager
    # attention its softmax; given float64 cos/sin, the sdpa path agrees to float64 rounding.
    _, theirs, ours = llama_pair(num_kv_heads, "sdpa", dtype=torch.float64)
    x = randn(2, 11, D, seed=2)
    positions = torch.arange(11)
    with torch.no_grad():
        expected, _ = theirs(x, cos_sin_float64(positions), None)  # causal inside
        actual = ours(x)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ours_cache", ["preallocated", "concat"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
def test_decoding_with_caches_equals_llama_attention_with_dynamic_cache(
    num_kv_heads: int, impl: str, ours_cache: str
) -> None:
    config, theirs, ours = llama_pair(num_kv_heads, impl)
    rotary = LlamaRotaryEmbedding(config)
    prompt, new, B = 9, 6, 2
    total = prompt + new
    x = randn(B, total, D, seed=3, dtype=torch.float32)
    positions = torch.arange(total)[None]
    their_cache = DynamicCache(config=config)
    if ours_cache == "preallocated":
        cache = KVCache(B, total, num_kv_heads, D_K)
    else:
        cache = ConcatKVCache(B, num_kv_heads, D_K)
    steps = [(0, prompt), *((t, t + 1) for t in range(prompt, total - 3)), (total - 3, total)]
    with torch.no_grad():
        for start, end in steps:  # the prompt, single tokens, then a chunk of three
            chunk = x[:, start:end]
            mask = additive_causal(end - start, end) if impl == "eager" else None
            if impl == "sdpa" and start > 0 and end - start > 1:
                mask = additive_causal(end - start, end)  # a chunk after a cache needs its mask
            expected, _ = theirs(
                chunk,
                rotary(chunk, positions[:, start:end]),
                mask,
                past_key_values=their_cache,
            )
            actual = ours(chunk, cache=cache)
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
            assert len(cache) == their_cache.get_seq_length() == end


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_decoding_equals_llama_attention_with_static_cache(num_kv_heads: int) -> None:
    # StaticCache returns all max_cache_len slots; the mask hides the ones not yet written.
    config, theirs, ours = llama_pair(num_kv_heads, "eager")
    rotary = LlamaRotaryEmbedding(config)
    B, prompt, total = 2, 5, 10
    x = randn(B, total, D, seed=4, dtype=torch.float32)
    positions = torch.arange(total)[None]
    their_cache = StaticCache(config=config, max_cache_len=total)
    cache = KVCache(B, total, num_kv_heads, D_K)
    with torch.no_grad():
        for start, end in [(0, prompt), *((t, t + 1) for t in range(prompt, total))]:
            chunk = x[:, start:end]
            mask = torch.full((1, 1, end - start, total), float("-inf"))
            mask[..., :end] = additive_causal(end - start, end)
            expected, _ = theirs(
                chunk, rotary(chunk, positions[:, start:end]), mask, past_key_values=their_cache
            )
            torch.testing.assert_close(ours(chunk, cache=cache), expected, rtol=1e-5, atol=1e-5)
