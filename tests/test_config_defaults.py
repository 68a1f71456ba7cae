"""A config.json dict is read as transformers reads the same dict: the fields it leaves out take
its family's defaults. Where transformers is installed its configuration class fills them in; the
table used where it is not (mha.configs.FAMILY_DEFAULTS) is compared here with those classes."""

from __future__ import annotations

import pytest
from mha import configs
from mha.configs import FAMILY_DEFAULTS, read_config
from transformers import AutoConfig

SHAPE = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3}


@pytest.mark.parametrize("family", sorted(FAMILY_DEFAULTS))
def test_the_table_holds_transformers_defaults(family: str) -> None:
    theirs = AutoConfig.for_model(family, hidden_size=64, num_attention_heads=4).to_dict()
    for name, value in FAMILY_DEFAULTS[family].items():
        if name == "rope_theta":
            assert theirs["rope_parameters"]["rope_theta"] == value
        elif name == "head_dim" and value is None:  # hidden_size / heads
            assert theirs.get("head_dim") in (None, 64 // 4), family
        elif name == "num_key_value_heads" and value is None:  # as many as query heads
            assert theirs["num_key_value_heads"] == 4
        elif name == "sliding_window" and not theirs.get("use_sliding_window", True):
            assert theirs["sliding_window"] is None  # dropped while use_sliding_window is off
        else:
            assert theirs.get(name) == value, (family, name)


def _dicts(family: str):
    """The family's config with each computation field left out in turn."""
    full = {"model_type": family, **SHAPE, **{k: v for k, v in FAMILY_DEFAULTS[family].items()}}
    full = {k: v for k, v in full.items() if v is not None}
    for name in FAMILY_DEFAULTS[family]:
        yield name, {k: v for k, v in full.items() if k != name}


@pytest.mark.parametrize("family", sorted(FAMILY_DEFAULTS))
@pytest.mark.parametrize("with_transformers", [True, False])
def test_a_dict_reads_as_transformers_reads_it(family, with_transformers, monkeypatch) -> None:
    if not with_transformers:
        monkeypatch.setattr(configs, "_auto_config", lambda: None)
    for name, fields in _dicts(family):
        given = {k: v for k, v in fields.items() if k != "model_type"}
        expected = read_config(AutoConfig.for_model(family, **given))
        assert read_config(fields) == expected, (family, name)


@pytest.mark.parametrize("with_transformers", [True, False])
def test_the_defaults_that_changed_results(with_transformers, monkeypatch) -> None:
    # The three a practitioner met: a Qwen2 dict without max_window_layers slides none of its
    # 3 layers (transformers: layers from the 28th on); a Mistral dict without sliding_window
    # keeps a window of 4096; a Llama dict without eos_token_id stops at 2.
    if not with_transformers:
        monkeypatch.setattr(configs, "_auto_config", lambda: None)
    qwen2 = {"model_type": "qwen2", **SHAPE, "use_sliding_window": True, "sliding_window": 8}
    assert read_config(qwen2).windows == (None, None, None)
    assert read_config({"model_type": "mistral", **SHAPE}).sliding_window == 4096
    assert read_config({"model_type": "llama", **SHAPE}).eos_token_ids == (2,)
    assert read_config({**SHAPE}).eos_token_ids == (2,)  # a dict without model_type: Llama


def test_smollm2s_inert_marker_is_accepted() -> None:
    # SmolLM2's config.json says is_llama_config: true (a marker) and rope_interleaved: false.
    fields = {"model_type": "llama", **SHAPE, "is_llama_config": True, "rope_interleaved": False}
    assert read_config(fields) == read_config({"model_type": "llama", **SHAPE})
    with pytest.raises(ValueError, match="rope_interleaved = True"):
        read_config({**fields, "rope_interleaved": True})
