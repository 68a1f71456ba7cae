"""mha.GroupedQueryAttention with learned sinks against transformers' GptOssAttention.

GptOssAttention is built from a small GptOssConfig with random weights (nothing from a hub): biases
on q, k, v and o, a learned sink logit per head, head_dim other than hidden_size / heads, YaRN
(truncate False, as gpt-oss's configuration) and a sliding window on every other layer
(layer_types). Its eager attention appends the sinks as a column of the scores and drops it after
the softmax; the model hands it an additive mask, built here: 0 where query i (at position p_i)
may see key j, that is j <= p_i and, on a sliding layer, j > p_i - sliding_window; -inf elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from mha.caches import KVCache
from mha.decoding import GroupedQueryAttention
from transformers import GptOssConfig
from transformers.cache_utils import DynamicCache
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

from helpers import randn

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D, H, H_KV, D_K, WINDOW = 48, 8, 2, 16, 4
LAYERS = ["sliding_attention", "full_attention"]


def gpt_oss_config() -> GptOssConfig:
    config = GptOssConfig(
        hidden_size=D,
        num_attention_heads=H,
        num_key_value_heads=H_KV,
        head_dim=D_K,
        num_hidden_layers=2,
        layer_types=LAYERS,
        sliding_window=WINDOW,
        vocab_size=16,
        intermediate_size=32,
        num_local_experts=4,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
            "rope_theta": 150000.0,
        },
    )
    config._attn_implementation = "eager"
    return config


def pair(layer_idx: int):
    config = gpt_oss_config()
    torch.manual_seed(layer_idx)
    theirs = GptOssAttention(config, layer_idx=layer_idx).eval()
    with torch.no_grad():
        theirs.sinks.normal_(0.0, 2.0)  # torch.empty in transformers: give it values
        for name, p in theirs.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    ours = GroupedQueryAttention.from_config(config, layer_idx=layer_idx).eval()
    ours.load_state_dict(theirs.state_dict())  # strict: sinks and biases included
    return config, theirs, ours


def additive_mask(t_q: int, t_k: int, window: int | None) -> torch.Tensor:
    positions = torch.arange(t_k - t_q, t_k)[:, None]
    keys = torch.arange(t_k)[None, :]
    seen = keys <= positions
    if window is not None:
        seen &= keys > positions - window
    return torch.zeros(t_q, t_k).masked_fill(~seen, float("-inf"))[None, None]


@pytest.mark.parametrize("layer_idx", [0, 1], ids=LAYERS)
def test_state_dict_and_window_follow_the_layer(layer_idx: int) -> None:
    _, theirs, ours = pair(layer_idx)
    assert ours.window == (WINDOW if layer_idx == 0 else None) == theirs.sliding_window
    assert ours.sinks.shape == (H,) and ours.head_dim == D_K
    assert {k: v.shape for k, v in theirs.state_dict().items()} == {
        k: v.shape for k, v in ours.state_dict().items()
    }


@pytest.mark.parametrize("layer_idx", [0, 1], ids=LAYERS)
def test_prompt_equals_gpt_oss_attention(layer_idx: int) -> None:
    config, theirs, ours = pair(layer_idx)
    x = randn(2, 11, D, seed=1, dtype=torch.float32)
    positions = torch.arange(11)[None]
    with torch.no_grad():
        expected, _ = theirs(
            x,
            GptOssRotaryEmbedding(config)(x, positions),
            additive_mask(11, 11, theirs.sliding_window),
        )
        got = ours(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    with torch.no_grad():  # the sinks matter: without them the output is another
        ours.sinks.fill_(-1e4)
        assert (ours(x) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("layer_idx", [0, 1], ids=LAYERS)
def test_cached_decoding_equals_gpt_oss_attention(layer_idx: int) -> None:
    """A prompt of 6, single tokens and a chunk of 3, against transformers' steps with its
    DynamicCache: the window slides past the prompt."""
    config, theirs, ours = pair(layer_idx)
    rotary = GptOssRotaryEmbedding(config)
    x = randn(2, 12, D, seed=2, dtype=torch.float32)
    their_cache, our_cache = DynamicCache(), KVCache(2, 12, H_KV, D_K)  # keeps every key
    start = 0
    for stop in (6, 7, 8, 11, 12):
        step = x[:, start:stop]
        with torch.no_grad():
            expected, _ = theirs(
                step,
                rotary(step, torch.arange(start, stop)[None]),
                additive_mask(stop - start, stop, theirs.sliding_window),
                past_key_values=their_cache,
            )
            got = ours(step, cache=our_cache)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        start = stop


def test_gpt_oss_config_fields_are_read_or_refused() -> None:
    config = gpt_oss_config()
    with pytest.raises(ValueError, match="layer_idx must be given"):
        GroupedQueryAttention.from_config(config)
    with pytest.raises(ValueError, match="layer_idx must be < num_hidden_layers = 2"):
        GroupedQueryAttention.from_config(config, layer_idx=2)
    fields = config.to_dict()
    with pytest.raises(ValueError, match="attn_logit_softcapping = 30.0"):
        GroupedQueryAttention.from_config({**fields, "attn_logit_softcapping": 30.0}, layer_idx=0)
    from mha.configs import read_config

    with pytest.raises(ValueError, match="model_type = 'gpt_oss' \\(its mixture-of-experts"):
        read_config(config)  # the whole model is not implemented: its experts


def test_a_sliding_layer_decodes_through_a_rolling_cache() -> None:
    """The window's keys in a ring of WINDOW slots: equal to the whole sequence at once."""
    from mha.caches import RollingKVCache

    _, _, ours = pair(0)
    x = randn(2, 12, D, seed=3, dtype=torch.float32)
    cache = RollingKVCache(2, WINDOW, H_KV, D_K)
    with torch.no_grad():
        expected = ours(x)
        steps = [ours(x[:, :3], cache=cache)]
        steps += [ours(x[:, t : t + 1], cache=cache) for t in range(3, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=0, atol=1e-5)
