"""mha.GroupedQueryAttention against transformers' LlamaAttention, the layer people load.

LlamaAttention is built from a small LlamaConfig with random weights (no download, nothing from
a hub); its state_dict is loaded into ours with no renaming. transformers computes the rotary
cos/sin in LlamaRotaryEmbedding, outside the attention layer, and hands them in as
position_embeddings; its cache is a DynamicCache (grown by concatenation) or a StaticCache
(preallocated). Eager attention is given the causal mask as the model would build it: an
additive float mask, 0 where a query may attend and -inf elsewhere, aligned to the last query.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from mha.decoding import ConcatKVCache, GroupedQueryAttention, KVCache
from transformers import LlamaConfig
from transformers.cache_utils import DynamicCache, StaticCache
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from helpers import ROPE_PARAMETERS, randn

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


# ---------------------------------------------------------------------------------------------
# from_config: the layer transformers builds from a configuration, scaled RoPE included


def scaled_config(rope_type: str, num_kv_heads: int = 2, bias: bool = False) -> LlamaConfig:
    config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,  # d_k = 32
        num_key_value_heads=num_kv_heads,
        num_hidden_layers=1,
        vocab_size=16,
        max_position_embeddings=16384,
        attention_bias=bias,
        rope_parameters=dict(ROPE_PARAMETERS[rope_type]),
    )
    config._attn_implementation = "sdpa"
    return config


@pytest.mark.parametrize("num_kv_heads", [4, 1])
@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3", "yarn"])
def test_from_config_equals_llama_attention(rope_type: str, num_kv_heads: int) -> None:
    config = scaled_config(rope_type, num_kv_heads, bias=rope_type == "linear")
    torch.manual_seed(5)
    theirs = LlamaAttention(config, layer_idx=0).eval()
    ours = GroupedQueryAttention.from_config(config).eval()
    ours.load_state_dict(theirs.state_dict())
    rotary = LlamaRotaryEmbedding(config)
    x = randn(2, 10, 128, seed=6, dtype=torch.float32)
    their_cache = DynamicCache(config=config)
    cache = KVCache(2, 10, num_kv_heads, 32)
    positions = torch.arange(9000, 9010)  # far past the original contexts
    with torch.no_grad():
        for start, end in [(0, 6), (6, 7), (7, 8), (8, 10)]:
            chunk, at = x[:, start:end], positions[start:end]
            mask = additive_causal(end - start, end) if end - start > 1 else None
            expected, _ = theirs(chunk, rotary(chunk, at[None]), mask, past_key_values=their_cache)
            actual = ours(chunk, cache=cache, positions=at)
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        if rope_type != "default":  # the scaling matters: the plain base would be wrong
            plain = GroupedQueryAttention(128, 4, num_kv_heads, bias=config.attention_bias)
            plain.load_state_dict(theirs.state_dict())
            assert (
                plain(x, positions=positions) - ours(x, positions=positions)
            ).abs().max() > 1e-2


def test_from_config_takes_a_dict_or_an_object_with_the_same_fields() -> None:
    fields = {
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "rope_parameters": dict(ROPE_PARAMETERS["llama3"]),
    }
    from_dict = GroupedQueryAttention.from_config(fields)
    from_object = GroupedQueryAttention.from_config(SimpleNamespace(**fields))
    from_llama = GroupedQueryAttention.from_config(LlamaConfig(**fields))
    for layer in (from_dict, from_object, from_llama):
        assert (layer.num_heads, layer.num_kv_heads, layer.head_dim) == (8, 2, 8)
        assert layer.q_proj.bias is None and layer.rope.rope_type == "llama3"
        assert layer.rope == from_llama.rope
    # Only rope_theta, no rope_parameters: the default rotation with that base.
    legacy = GroupedQueryAttention.from_config(
        {**fields, "rope_parameters": None, "rope_theta": 5e5}
    )
    assert legacy.rope.rope_type == "default" and legacy.rope_base == 5e5


def test_from_config_errors_name_the_field() -> None:
    fields = {"hidden_size": 64, "num_attention_heads": 8, "max_position_embeddings": 512}
    with pytest.raises(ValueError, match=r"rope_type 'dynamic' is not supported"):
        GroupedQueryAttention.from_config(
            {
                **fields,
                "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
            }
        )
    with pytest.raises(ValueError, match="config must give hidden_size"):
        GroupedQueryAttention.from_config({"num_attention_heads": 8})
    for field, value in [
        ("attn_logit_softcapping", 50.0),
        ("query_pre_attn_scalar", 144),
        ("pretraining_tp", 2),
        ("sliding_window", 16),
    ]:
        with pytest.raises(ValueError, match=rf"{field} = {value}"):
            GroupedQueryAttention.from_config({**fields, field: value})
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match=r"partial_rotary_factor = 0.5"):
        GroupedQueryAttention.from_config({**fields, "rope_parameters": rope})


@pytest.mark.parametrize(
    "config_class, extra",
    [
        ("LlamaConfig", {"head_dim": 16}),  # head_dim != hidden / heads (64 / 8)
        ("Qwen2Config", {}),  # biases on q, k, v, none on o
        ("LlamaConfig", {"attention_bias": True, "head_dim": 12}),
        ("Qwen3Config", {"head_dim": 16}),  # RMSNorm over each head's q and k
    ],
)
def test_from_config_equals_transformers_attention(config_class: str, extra: dict) -> None:
    import transformers

    config = getattr(transformers, config_class)(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=16,
        **extra,
    )
    config._attn_implementation = "eager"
    family = config_class.removesuffix("Config")
    module = getattr(transformers.models, family.lower())
    attention = getattr(module, f"modeling_{family.lower()}")
    torch.manual_seed(3)
    theirs = getattr(attention, f"{family}Attention")(config, layer_idx=0).eval()
    rotary = getattr(attention, f"{family}RotaryEmbedding")(config)
    ours = GroupedQueryAttention.from_config(config).eval()
    ours.load_state_dict(theirs.state_dict())  # strict
    theirs.load_state_dict(ours.state_dict())  # both ways
    x = randn(2, 7, 64, seed=4, dtype=torch.float32)
    positions = torch.arange(7)
    with torch.no_grad():
        expected, _ = theirs(x, rotary(x, positions[None]), additive_causal(7, 7))
        actual = ours(x, positions=positions)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_left_padded_batch_equals_llama_attention_with_position_ids() -> None:
    # transformers' way: position_ids per row (0 on the pads), a mask that hides the pads.
    config, theirs, ours = llama_pair(2, "eager")
    rotary = LlamaRotaryEmbedding(config)
    real = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    positions = (real.cumsum(1) - 1).clamp(min=0)  # (B, T)
    x = randn(2, 7, D, seed=9, dtype=torch.float32)
    keep = real[:, None, None, :] & torch.ones(7, 7, dtype=torch.bool).tril()  # (B, 1, T, T)
    additive = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    with torch.no_grad():
        expected, _ = theirs(x, rotary(x, positions), additive)
        actual = ours(x, positions=positions, attn_mask=real[:, None, None, :])
    # pad queries see no key: transformers' eager softmax gives NaN there, ours zeros
    torch.testing.assert_close(actual[0, 3:], expected[0, 3:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actual[1], expected[1], rtol=1e-5, atol=1e-5)
    assert not actual.isnan().any()


def test_from_config_reads_a_transformers_4_configuration() -> None:
    # config.json of a checkpoint (and transformers 4) writes rope_scaling beside a top-level
    # rope_theta; transformers 5's LlamaConfig turns them into rope_parameters.
    fields = {"hidden_size": 64, "num_attention_heads": 8, "max_position_embeddings": 8192}
    for rope_type in ("linear", "llama3", "yarn"):
        scaling = dict(ROPE_PARAMETERS[rope_type])
        theta = scaling.pop("rope_theta")
        legacy = {**fields, "rope_theta": theta, "rope_scaling": scaling}
        ours = GroupedQueryAttention.from_config(legacy)
        theirs = GroupedQueryAttention.from_config(LlamaConfig(**legacy))
        assert ours.rope.rope_type == rope_type and ours.rope == theirs.rope
    oldest = {**fields, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert GroupedQueryAttention.from_config(oldest).rope == (
        GroupedQueryAttention.from_config(LlamaConfig(**oldest)).rope
    )
    # rope_parameters without a base: the top-level rope_theta
    split = {**fields, "rope_theta": 5e5, "rope_parameters": {"rope_type": "default"}}
    assert GroupedQueryAttention.from_config(split).rope_base == 5e5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rope_type", ["llama3", "yarn"])
def test_from_config_equals_llama_attention_in_16_bits(rope_type: str, dtype) -> None:
    # A prompt, single tokens and a chunk after a cache, far past the original context, with
    # weights and activations in 16 bits. Both compute the rotary angles in float32.
    config = scaled_config(rope_type, num_kv_heads=2)
    torch.manual_seed(5)
    theirs = LlamaAttention(config, layer_idx=0).eval().to(dtype)
    ours = GroupedQueryAttention.from_config(config).eval().to(dtype)
    ours.load_state_dict(theirs.state_dict())
    rotary = LlamaRotaryEmbedding(config)
    x = randn(2, 10, 128, seed=6, dtype=torch.float32).to(dtype)
    their_cache = DynamicCache(config=config)
    cache = KVCache(2, 10, 2, 32, dtype=dtype)
    positions = torch.arange(9000, 9010)
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]  # a few roundings
    with torch.no_grad():
        for start, end in [(0, 6), (6, 7), (7, 8), (8, 10)]:
            chunk, at = x[:, start:end], positions[start:end]
            mask = additive_causal(end - start, end).to(dtype) if end - start > 1 else None
            expected, _ = theirs(chunk, rotary(chunk, at[None]), mask, past_key_values=their_cache)
            actual = ours(chunk, cache=cache, positions=at)
            assert actual.dtype == dtype
            torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
