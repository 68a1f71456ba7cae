"""One reader of transformers' configurations, for the layer and the model.

:func:`read_config` takes a ``LlamaConfig``, ``MistralConfig``,
``Qwen2Config`` or ``Qwen3Config``, the same ``config.json`` as a dict, or
any object with those fields, and returns a :class:`ModelConfig`: every
field either read (and implemented by :class:`mha.GroupedQueryAttention` or
:class:`mha.CausalLM`), known not to change what the model computes (token
ids, initialisation, output switches), or refused with a ``ValueError`` that
names it. A field it does not know is refused unless it is switched off
(None, False or 0): never silently ignored, since a model that ignores a
field of its configuration (Gemma 2's ``attn_logit_softcapping``, a
``partial_rotary_factor``) computes something else.

:func:`read_latent_config` reads a ``DeepseekV3Config`` for multi-head
latent attention (:class:`mha.latent.MultiHeadLatentAttention`) by the same
rules, its rotary positions by the same parser. :func:`check_context`
refuses a prompt and its new tokens longer than the configuration's
positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ._validate import check_int
from .positions import Rope

__all__ = ["MODEL_TYPES", "LAYER_ONLY_TYPES", "ModelConfig", "read_config"]
__all__ += ["check_context", "read_latent_config"]

#: The families read: their layers differ only in the fields read here.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

#: Families whose attention layers are read (``read_config(..., layer=True)``,
#: for :meth:`mha.GroupedQueryAttention.from_config`) but not the model: their
#: feed-forward is a mixture of experts. gpt-oss: learned sinks, biases, a
#: window on every other layer.
LAYER_ONLY_TYPES = ("gpt_oss",)

#: Their mixture of experts' fields: the model's, not an attention layer's.
EXPERT_FIELDS = frozenset(
    "num_local_experts num_experts_per_tok swiglu_alpha swiglu_limit "
    "router_aux_loss_coef output_router_logits".split()
)

#: Fields that do not change what the model computes: ids, initialisation,
#: bookkeeping and output switches of transformers' configurations.
INERT_FIELDS = frozenset(
    "_name_or_path architectures bos_token_id chunk_size_feed_forward dtype "
    "id2label initializer_range is_encoder_decoder label2id "
    "output_attentions output_hidden_states problem_type "
    "return_dict tokenizer_class torch_dtype transformers_version use_cache "
    "max_window_layers use_sliding_window model_type is_llama_config".split()
)

#: What each family's configuration class holds for a field that changes
#: the computation when a config.json leaves it out: transformers' own
#: defaults (the tests compare them with its classes), read where
#: transformers is not installed; where it is, its class fills them in.
#: ``head_dim`` None: hidden_size / num_attention_heads; a
#: ``num_key_value_heads`` of None: as many as query heads.
#: Defaults every family's class shares.
_SHARED_DEFAULTS = dict(
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    pad_token_id=None,
    head_dim=None,
    hidden_act="silu",
    attention_dropout=0.0,
    num_hidden_layers=32,
)
#: Qwen2's and Qwen3's, beside the shared ones.
_QWEN_DEFAULTS = dict(
    max_position_embeddings=32768,
    eos_token_id=None,
    intermediate_size=22016,
    vocab_size=151936,
    num_key_value_heads=32,
    sliding_window=4096,
    use_sliding_window=False,
    max_window_layers=28,
)
FAMILY_DEFAULTS = {
    "llama": dict(
        _SHARED_DEFAULTS,
        max_position_embeddings=2048,
        attention_bias=False,
        mlp_bias=False,
        eos_token_id=2,
        intermediate_size=11008,
        vocab_size=32000,
        num_key_value_heads=None,
    ),
    "mistral": dict(
        _SHARED_DEFAULTS,
        max_position_embeddings=131072,
        eos_token_id=2,
        intermediate_size=14336,
        vocab_size=32000,
        num_key_value_heads=8,
        sliding_window=4096,
    ),
    "qwen2": dict(_SHARED_DEFAULTS, **_QWEN_DEFAULTS),
    "qwen3": dict(
        _SHARED_DEFAULTS, **_QWEN_DEFAULTS, attention_bias=False, head_dim=128
    ),
}

#: Fields read (and implemented).
READ_FIELDS = frozenset(
    "vocab_size hidden_size intermediate_size num_hidden_layers "
    "num_attention_heads num_key_value_heads head_dim hidden_act "
    "rms_norm_eps rope_parameters rope_scaling rope_theta "
    "max_position_embeddings attention_bias attention_dropout mlp_bias "
    "tie_word_embeddings sliding_window layer_types eos_token_id pad_token_id "
    "pretraining_tp".split()
)

#: Fields read only where they hold their neutral value: field -> the test.
NEUTRAL = {
    "pretraining_tp": lambda value, fields: value in (None, 1),
    "query_pre_attn_scalar": lambda value, fields: (
        value
        in (
            None,
            fields.get("head_dim"),
        )
    ),
    "partial_rotary_factor": lambda value, fields: value in (None, 1, 1.0),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the layer and the model build from, read and checked.

    ``qkv_bias`` and ``o_bias``: biases on q/k/v and on o (Qwen2: True,
    False). ``qk_norm``: an RMSNorm over each head's queries and keys
    (Qwen3). ``windows``: per layer, the sliding window or None.
    ``sliding_window``: the window of the layers that have one.
    ``eos_token_ids``: the ids that end a row. ``sinks``: a learned sink
    logit per head (gpt-oss). ``max_position_embeddings``: the longest
    sequence (prompt and new tokens) generation accepts, or None. The
    model's own fields (``vocab_size``, ``intermediate_size``,
    ``num_hidden_layers``) are None where a configuration for one layer
    leaves them out.
    """

    model_type: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope: Rope
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    attention_dropout: float = 0.0
    vocab_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    rms_norm_eps: float = 1e-6
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    windows: tuple[int | None, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    sinks: bool = False
    max_position_embeddings: int | None = None
    dtype: str | None = None  # the weights' (config.json's torch_dtype)

    def require(self, *names: str) -> None:
        """Raise ValueError naming the first of ``names`` that is None."""
        for name in names:
            if getattr(self, name) is None:
                raise ValueError(f"config must give {name}, got none")


def read_config(config: object, *, layer: bool = False) -> ModelConfig:
    """The :class:`ModelConfig` of a transformers configuration or dict.

    ``layer=True``: for one attention layer, which also reads the families
    of :data:`LAYER_ONLY_TYPES` (their experts' fields are not its own).
    Raises ValueError naming every field that is not implemented, TypeError
    for a config that is neither a mapping nor an object with fields.
    """
    fields = _as_dict(config)
    model_type = fields.get("model_type") or "llama"
    for name in ("hidden_size", "num_attention_heads"):
        if fields.get(name) is None:
            raise ValueError(f"config must give {name}, got none")
    hidden = check_int("hidden_size", fields["hidden_size"])
    heads = check_int("num_attention_heads", fields["num_attention_heads"])
    head_dim = check_int("head_dim", fields.get("head_dim") or hidden // heads)
    _refuse_unknown({**fields, "head_dim": head_dim}, model_type, layer)
    bias = bool(fields.get("attention_bias", False))
    qkv_bias, o_bias = {"qwen2": (True, False), "mistral": (False, False)}.get(
        model_type, (bias, bias)
    )  # what transformers' attention layers of each family hold
    window = _window(fields, model_type)
    layers = _optional_int(fields, "num_hidden_layers")
    return ModelConfig(
        model_type=model_type,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=check_int(
            "num_key_value_heads", fields.get("num_key_value_heads") or heads
        ),
        head_dim=head_dim,
        rope=_rope(fields),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=model_type == "qwen3",
        attention_dropout=float(fields.get("attention_dropout") or 0.0),
        vocab_size=_optional_int(fields, "vocab_size"),
        intermediate_size=_optional_int(fields, "intermediate_size"),
        num_hidden_layers=layers,
        rms_norm_eps=float(fields.get("rms_norm_eps") or 1e-6),
        mlp_bias=bool(fields.get("mlp_bias", False)),
        tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
        sliding_window=window,
        windows=_windows(fields, model_type, layers, window),
        eos_token_ids=_eos(fields.get("eos_token_id")),
        pad_token_id=_optional_int(fields, "pad_token_id", minimum=0),
        sinks=model_type == "gpt_oss",
        max_position_embeddings=_optional_int(
            fields, "max_position_embeddings"
        ),
        dtype=_dtype_name(fields.get("dtype") or fields.get("torch_dtype")),
    )


def _dtype_name(value: object) -> str | None:
    """A config's dtype as its torch name (``"bfloat16"``), or None (none
    given, or ``"auto"``)."""
    if value is None or value == "auto":
        return None
    return str(value).removeprefix("torch.")


def _as_dict(config: object) -> dict:
    if isinstance(config, Mapping):  # a config.json: the family's defaults
        return _with_defaults(dict(config))
    if hasattr(config, "to_dict"):  # a transformers PreTrainedConfig
        return config.to_dict()
    if hasattr(config, "__dict__"):
        return dict(vars(config))
    raise TypeError(
        "config must be a transformers configuration, a dict or an object "
        f"with its fields, got {type(config).__name__}"
    )


def _with_defaults(fields: dict) -> dict:
    """A config.json's fields as transformers reads them: through its
    family's configuration class where transformers is installed (its
    defaults, and what its ``__init__`` derives, such as ``layer_types``),
    else with :data:`FAMILY_DEFAULTS` for the fields left out."""
    if any(
        fields.get(k) is None for k in ("hidden_size", "num_attention_heads")
    ):
        return fields  # the shape is never a default: refused by name below
    model_type = fields.get("model_type") or "llama"
    AutoConfig = _auto_config()
    if AutoConfig is not None and model_type in MODEL_TYPES:
        given = {k: v for k, v in fields.items() if k != "model_type"}
        try:
            return AutoConfig.for_model(model_type, **given).to_dict()
        except Exception:  # noqa: BLE001 - its class refused it: ours names why
            pass
    defaults = dict(FAMILY_DEFAULTS.get(model_type, {}))
    theta = defaults.pop("rope_theta", None)
    if theta is not None and not (
        fields.get("rope_parameters") or fields.get("rope_scaling")
    ):
        defaults["rope_theta"] = theta
    if defaults.get("num_key_value_heads") is None:
        defaults.pop("num_key_value_heads", None)  # as many as query heads
    if defaults.get("head_dim") is None:
        defaults.pop("head_dim", None)  # hidden_size / num_attention_heads
    return {**defaults, **fields}


def _auto_config():
    """transformers' ``AutoConfig``, or None where it is not installed."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    return AutoConfig


def _refuse_unknown(fields: dict, model_type: str, layer: bool) -> None:
    """One ValueError naming every field that is not implemented."""
    refused = []
    if layer and model_type in LAYER_ONLY_TYPES:
        fields = {k: v for k, v in fields.items() if k not in EXPERT_FIELDS}
    elif model_type in LAYER_ONLY_TYPES:
        refused.append(
            f"model_type = {model_type!r} (its mixture-of-experts "
            "feed-forward is not implemented; GroupedQueryAttention."
            "from_config reads its attention layers)"
        )
    elif model_type not in MODEL_TYPES:
        refused.append(f"model_type = {model_type!r} (read: {MODEL_TYPES})")
    for name, value in sorted(fields.items()):
        if name in NEUTRAL:
            if not NEUTRAL[name](value, fields):
                refused.append(f"{name} = {value!r}")
        elif name == "sliding_window" and model_type == "llama":
            if value is not None:  # Llama has no window: transformers
                refused.append(f"{name} = {value!r} (a Llama has none)")
        elif (
            name in ("mlp_bias", "attention_bias")
            and value
            and (
                model_type != "llama"
                and (name, model_type)
                not in (
                    ("attention_bias", "qwen3"),
                    ("attention_bias", "gpt_oss"),
                )
            )
        ):  # transformers' layers of this family hold no such biases
            refused.append(f"{name} = {value!r} (not in {model_type})")
        elif name == "hidden_act" and value != "silu":
            refused.append(f"{name} = {value!r} (SwiGLU: 'silu')")
        elif name not in INERT_FIELDS | READ_FIELDS and value not in (
            None,
            False,
            0,
        ):
            refused.append(f"{name} = {value!r}")
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    partial = dict(rope).get("partial_rotary_factor")
    entry = f"partial_rotary_factor = {partial!r}"
    if not NEUTRAL["partial_rotary_factor"](partial, fields) and (
        entry not in refused  # named once, top-level or in the rope's
    ):
        refused.append(entry)
    if refused:
        raise ValueError(
            "config fields not implemented: " + "; ".join(refused)
        )


def _rope(fields: dict) -> Rope:
    """RoPE from ``rope_parameters`` (transformers 5) or, as transformers 4
    and checkpoints' config.json write it, ``rope_scaling`` and a top-level
    ``rope_theta``."""
    parameters = fields.get("rope_parameters") or fields.get("rope_scaling")
    parameters = dict(parameters or {})
    if "type" in parameters and "rope_type" not in parameters:  # older key
        parameters["rope_type"] = parameters.pop("type")
    parameters.setdefault("rope_theta", fields.get("rope_theta") or 10000.0)
    return Rope.from_parameters(
        parameters,
        max_position_embeddings=fields.get("max_position_embeddings"),
    )


def _window(fields: dict, model_type: str) -> int | None:
    """The sliding window, None where transformers' family drops it."""
    window = fields.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not fields.get(
        "use_sliding_window", False
    ):
        return None
    return None if window is None else check_int("sliding_window", window)


def _windows(
    fields: dict, model_type: str, layers: int | None, window: int | None
) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as
    transformers' Mistral (every layer) and Qwen2/3 (``layer_types``, or
    the layers from ``max_window_layers`` on) place them."""
    if layers is None:
        return ()
    types = fields.get("layer_types")
    if types is None:
        first = 0
        if model_type in ("qwen2", "qwen3"):
            first = fields.get("max_window_layers") or 0
        types = [
            "sliding_attention" if window and i >= first else "full_attention"
            for i in range(layers)
        ]
    if len(types) != layers or not set(types) <= {
        "full_attention",
        "sliding_attention",
    }:
        raise ValueError(
            f"layer_types must give 'full_attention' or 'sliding_attention' "
            f"for each of the num_hidden_layers = {layers} layers, got "
            f"{types!r}"
        )
    if model_type == "mistral":  # transformers' Mistral reads no layer_types
        return tuple(window for _ in range(layers))
    return tuple(window if t == "sliding_attention" else None for t in types)


def _eos(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(check_int("eos_token_id", v, minimum=0) for v in values)


def _optional_int(fields: dict, name: str, minimum: int = 1) -> int | None:
    value = fields.get(name)
    return None if value is None else check_int(name, value, minimum=minimum)


def check_context(prompt: int, new_tokens: int, config: ModelConfig) -> None:
    """Refuse a prompt, or a prompt and its new tokens, longer than the
    config's ``max_position_embeddings`` (the positions it was trained on),
    naming the lengths."""
    most = config.max_position_embeddings
    if most is not None and prompt + new_tokens > most:
        raise ValueError(
            f"the prompt ({prompt} tokens) and max_new_tokens ({new_tokens})"
            f" must fit max_position_embeddings = {most}, got "
            f"{prompt + new_tokens} positions"
        )


# ---------------------------------------------------------------------------
# Multi-head latent attention's fields (DeepSeek-V3)

#: Fields of a DeepSeek-V3 configuration that the layer reads.
_LATENT_READ = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "attention_bias",
    "attention_dropout",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "rope_interleave",
    "max_position_embeddings",
    "head_dim",
    "qk_head_dim",
)

#: The model's other fields: not the attention layer's (experts, norms of the
#: decoder, vocabulary, training, generation), passed over.
_LATENT_MODEL_FIELDS = frozenset(
    "vocab_size intermediate_size moe_intermediate_size num_hidden_layers "
    "n_shared_experts n_routed_experts routed_scaling_factor n_group "
    "topk_group num_experts_per_tok first_k_dense_replace norm_topk_prob "
    "hidden_act initializer_range rms_norm_eps use_cache pad_token_id "
    "bos_token_id eos_token_id pretraining_tp tie_word_embeddings "
    "output_router_logits num_nextn_predict_layers num_mtp_layers "
    "aux_loss_alpha seq_aux ep_size moe_layer_freq scoring_func topk_method "
    "_name_or_path architectures chunk_size_feed_forward dtype torch_dtype "
    "id2label label2id is_encoder_decoder model_type output_attentions "
    "output_hidden_states problem_type return_dict transformers_version "
    "auto_map".split()
)


def read_latent_config(config: object) -> dict:
    """The arguments of :class:`mha.latent.MultiHeadLatentAttention` from a
    DeepSeek-V3 configuration (a ``DeepseekV3Config`` or a dict of its
    fields), checked: a field the layer does not implement is refused by
    name; the rotary positions read as every other family's
    (:func:`_rope`)."""
    if isinstance(config, Mapping):
        fields = dict(config)
    elif hasattr(config, "to_dict"):
        fields = config.to_dict()
    else:
        raise TypeError(
            "config must be a DeepseekV3Config or a dict of its fields, got "
            f"{type(config).__name__}"
        )
    model_type = fields.get("model_type", "deepseek_v3")
    if model_type != "deepseek_v3":
        raise ValueError(
            f"config must be a DeepSeek-V3 configuration (model_type "
            f"'deepseek_v3'), got model_type {model_type!r}"
        )
    unknown = sorted(set(fields) - set(_LATENT_READ) - _LATENT_MODEL_FIELDS)
    if unknown:
        raise ValueError(
            f"config has fields that MultiHeadLatentAttention does not "
            f"implement: {', '.join(unknown)}"
        )
    for name in ("hidden_size", "num_attention_heads"):
        if fields.get(name) is None:
            raise ValueError(f"config must give {name}, got none")
    heads = fields["num_attention_heads"]
    kv_heads = fields.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise ValueError(
            "num_key_value_heads must equal num_attention_heads = "
            f"{heads} (every head reads its keys and values out of the "
            f"latent), got {kv_heads}"
        )
    d_r = fields.get("qk_rope_head_dim", 64)  # DeepseekV3Config's defaults
    d_n = fields.get("qk_nope_head_dim", 128)
    for name, want in (("head_dim", d_r), ("qk_head_dim", d_n + d_r)):
        if fields.get(name) not in (None, want):
            raise ValueError(
                f"{name} must be {want} for qk_rope_head_dim = {d_r} and "
                f"qk_nope_head_dim = {d_n}, got {fields[name]}"
            )
    rope = _rope(fields)
    interleave = fields.get("rope_interleave", True)
    return {
        "hidden_size": fields["hidden_size"],
        "num_heads": heads,
        "kv_lora_rank": fields.get("kv_lora_rank", 512),
        "qk_rope_head_dim": d_r,
        "qk_nope_head_dim": d_n,
        "v_head_dim": fields.get("v_head_dim") or 128,
        "q_lora_rank": fields.get("q_lora_rank", 1536),
        "bias": bool(fields.get("attention_bias", False)),
        "rope": rope,
        "rope_interleave": True if interleave is None else bool(interleave),
        "dropout": float(fields.get("attention_dropout") or 0.0),
    }
