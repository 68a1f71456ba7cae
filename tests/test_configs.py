"""mha.configs.read_config: one reader for the layer and the model; every field read, known to
change nothing, or refused by name. (That what is read equals transformers' model is checked in
test_model.py, field by field.)"""

from __future__ import annotations

import pytest
from mha.configs import read_config
from transformers import (
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    PhiConfig,
    Qwen2Config,
    Qwen3Config,
)

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)


def test_a_config_and_its_dict_read_alike() -> None:
    for config_class in (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config):
        config = config_class(**SMALL, vocab_size=128)
        assert read_config(config) == read_config(config.to_dict())


def test_where_each_family_puts_its_window_and_biases() -> None:
    mistral = read_config(MistralConfig(**SMALL, sliding_window=8))
    assert mistral.windows == (8, 8, 8) and not mistral.qkv_bias
    qwen2 = read_config(
        Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    )
    assert qwen2.windows == (None, 8, 8)  # from max_window_layers on, as transformers
    assert (qwen2.qkv_bias, qwen2.o_bias) == (True, False)
    qwen2_off = read_config(Qwen2Config(**SMALL, sliding_window=8))  # use_sliding_window False
    assert qwen2_off.windows == (None, None, None)
    qwen3 = read_config(Qwen3Config(**SMALL, head_dim=32))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.qkv_bias
    assert read_config(LlamaConfig(**SMALL, eos_token_id=[5, 7])).eos_token_ids == (5, 7)


@pytest.mark.parametrize(
    "config, fields",
    [
        (Gemma2Config(), ["model_type = 'gemma2'", "attn_logit_softcapping = 50.0"]),
        (PhiConfig(), ["model_type = 'phi'", "partial_rotary_factor = 0.5", "layer_norm_eps"]),
        ({**SMALL, "sliding_window": 16}, ["sliding_window = 16 (a Llama has none)"]),
        ({**SMALL, "hidden_act": "gelu"}, ["hidden_act = 'gelu'"]),
        ({**SMALL, "final_logit_softcapping": 30.0}, ["final_logit_softcapping = 30.0"]),
        ({**SMALL, "pretraining_tp": 2}, ["pretraining_tp = 2"]),
        ({**SMALL, "layer_types": ["full_attention"] * 2}, ["layer_types must give"]),
    ],
)
def test_fields_not_implemented_are_refused_by_name(config, fields) -> None:
    with pytest.raises(ValueError) as error:
        read_config(config)
    for field in fields:
        assert field in str(error.value)


def test_switched_off_fields_are_accepted() -> None:
    config = {**SMALL, "attn_logit_softcapping": None, "qk_layernorm": False, "embd_pdrop": 0.0}
    assert read_config(config).hidden_size == 64


def test_a_field_is_named_once() -> None:
    # Phi-3 gives partial_rotary_factor at the top; it was named twice (there and in the rope's).
    from transformers import Phi3Config

    with pytest.raises(ValueError) as refused:
        read_config(Phi3Config(partial_rotary_factor=0.5))
    assert str(refused.value).count("partial_rotary_factor") == 1
