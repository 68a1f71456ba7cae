"""What ``python -m mha.bench`` times: one registry entry per implementation.

Every layer entry computes the same function with the same weights (those of
one seeded ``torch.nn.MultiheadAttention``), in eval mode and without autograd;
``tests/test_bench.py`` checks each against the NumPy reference.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import reference
from ..functional import (
    causal_mask,
    merge_heads,
    reference_weights,
    split_heads,
)
from .registry import DECODE_IMPLEMENTATIONS, Runner, Unsupported, register

__all__ = ["BACKENDS", "textbook_attention", "sdpa_attention"]

#: ``sdpa_<name>`` implementations and the backend each one forces.
BACKENDS: dict[str, SDPBackend] = {
    "math": SDPBackend.MATH,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}

NUMPY_DTYPES = (torch.float32, torch.float64)


# -----------------------------------------------------------------------------
# Two layers written out here: the textbook one and the floor of the
# module's approach


def textbook_attention(
    x: Tensor, layer: nn.MultiheadAttention, keep: Tensor | None = None
) -> Tensor:
    """Multi-head self-attention written out, (B, H, T, T) scores materialised.

    Args:
        x: inputs, (B, T, D).
        layer: the weights: ``in_proj_weight`` (3D, D), ``out_proj`` (D, D),
            and their biases.
        keep: optional boolean (T, T), True where a query may attend.

    Returns:
        (B, T, D).
    """
    d_k = x.shape[-1] // layer.num_heads
    qkv = F.linear(x, layer.in_proj_weight, layer.in_proj_bias)  # (B, T, 3D)
    # (B, H, T, d_k) each
    q, k, v = (split_heads(t, d_k) for t in qkv.chunk(3, dim=-1))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d_k))  # (B, H, T, T)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # (B, H, T, T)
    heads = weights @ v  # (B, H, T, d_k)
    return layer.out_proj(merge_heads(heads))  # (B, T, D)


def sdpa_attention(
    x: Tensor, layer: nn.MultiheadAttention, is_causal: bool = False
) -> Tensor:
    """The same layer, its core handed to ``F.scaled_dot_product_attention``.

    Nothing else is done. The floor of the module's approach: the
    projections, views and the one fused attention call.
    """
    d_k = x.shape[-1] // layer.num_heads
    qkv = F.linear(x, layer.in_proj_weight, layer.in_proj_bias)  # (B, T, 3D)
    # (B, H, T, d_k) each
    q, k, v = (split_heads(t, d_k) for t in qkv.chunk(3, dim=-1))
    # (B, H, T, d_k)
    heads = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    return layer.out_proj(merge_heads(heads))  # (B, T, D)


# -----------------------------------------------------------------------------
# The registry entries, in table order


def _numpy_inputs(layer: nn.MultiheadAttention, x: Tensor, causal: bool):
    """x, W_Q, W_K, W_V, W_O and the causal mask in the reference's layout.

    The reference has no biases.
    """
    weights = reference_weights(layer)
    for name, bias in (
        ("in_proj_bias", weights.b_q),
        ("out_proj.bias", weights.b_o),
    ):
        if bias is not None and bool(np.any(bias)):
            raise Unsupported(
                "the NumPy reference has no biases, "
                f"and the layer's {name} is not zero"
            )
    mask = reference.causal_mask(x.shape[1]) if causal else None
    return x.cpu().numpy(), weights, mask


@register("numpy_loop", scope="layer", devices=("cpu",), dtypes=NUMPY_DTYPES)
def numpy_loop(
    layer: nn.MultiheadAttention, x: Tensor, causal: bool
) -> Runner:
    """:func:`mha.reference.multi_head_attention_loop`, head by head (CPU)."""
    x_np, w, mask = _numpy_inputs(layer, x, causal)
    d_k = x.shape[-1] // layer.num_heads
    columns = [slice(i * d_k, (i + 1) * d_k) for i in range(layer.num_heads)]
    per_head = [
        [np.ascontiguousarray(m[:, c]) for c in columns]
        for m in (w.w_q, w.w_k, w.w_v)
    ]
    return lambda: reference.multi_head_attention_loop(
        x_np, *per_head, w.w_o, mask
    )[0]


@register("numpy_fused", scope="layer", devices=("cpu",), dtypes=NUMPY_DTYPES)
def numpy_fused(
    layer: nn.MultiheadAttention, x: Tensor, causal: bool
) -> Runner:
    """:func:`mha.reference.multi_head_attention`, all heads at once (CPU)."""
    x_np, w, mask = _numpy_inputs(layer, x, causal)
    return lambda: reference.multi_head_attention(
        x_np, w.w_q, w.w_k, w.w_v, w.w_o, layer.num_heads, mask
    )[0]


@register("torch_textbook", scope="layer")
def torch_textbook(
    layer: nn.MultiheadAttention, x: Tensor, causal: bool
) -> Runner:
    """:func:`textbook_attention`: writes out the (B, H, T, T) scores."""
    keep = causal_mask(x.shape[1], device=x.device) if causal else None
    return lambda: textbook_attention(x, layer, keep)


@register("mha_module", scope="layer")
def mha_module(
    layer: nn.MultiheadAttention, x: Tensor, causal: bool
) -> Runner:
    """:class:`mha.MultiHeadAttention`, ``need_weights=False``."""
    from ..module import MultiHeadAttention

    module = MultiHeadAttention(
        layer.embed_dim,
        layer.num_heads,
        batch_first=True,
        device=x.device,
        dtype=x.dtype,
    )
    module.load_state_dict(layer.state_dict())
    module.eval().requires_grad_(False)
    # The module builds the causal mask itself and hands SDPA its
    # is_causal flag.
    return lambda: module(x, x, x, need_weights=False, is_causal=causal)[0]


@register(
    "torch_mha",
    scope="layer",
    summary="``torch.nn.MultiheadAttention``, ``need_weights=False`` "
    "(its fast path).",
)
def torch_mha(layer: nn.MultiheadAttention, x: Tensor, causal: bool) -> Runner:
    """``torch.nn.MultiheadAttention``, ``need_weights=False``.

    In eval mode without autograd, as the harness calls it: its fast path.
    """
    return _torch_layer(layer, x, causal)


@register(
    "torch_mha_general",
    scope="layer",
    summary="``torch.nn.MultiheadAttention`` on its general path (train "
    "mode, dropout 0): ``F.multi_head_attention_forward``.",
)
def torch_mha_general(
    layer: nn.MultiheadAttention, x: Tensor, causal: bool
) -> Runner:
    """torch's layer where its fast path does not apply: in train mode.

    The fast path needs eval mode and no autograd; in train mode (with dropout
    0, so the result is the same) torch calls
    ``F.multi_head_attention_forward``, which hands the core to
    ``F.scaled_dot_product_attention``.
    """
    return _torch_layer(copy.deepcopy(layer).train(), x, causal)


def _torch_layer(
    layer: nn.MultiheadAttention, x: Tensor, causal: bool
) -> Runner:
    # Same tensor as query, key and value: the condition for torch's
    # self-attention fast path. torch takes is_causal only as a hint that
    # attn_mask is causal, so the mask is given too.
    blocked = ~causal_mask(x.shape[1], device=x.device) if causal else None
    return lambda: layer(
        x, x, x, need_weights=False, attn_mask=blocked, is_causal=causal
    )[0]


@register(
    "sdpa_bare",
    scope="layer",
    summary=":func:`sdpa_attention`: four ``F.linear`` around "
    "``F.scaled_dot_product_attention``.",
)
def sdpa_bare(layer: nn.MultiheadAttention, x: Tensor, causal: bool) -> Runner:
    """Four ``F.linear`` around ``F.scaled_dot_product_attention``.

    The layer as :func:`sdpa_attention` computes it.
    """
    return lambda: sdpa_attention(x, layer, is_causal=causal)


@register("projections", scope="projections")
def projections(
    layer: nn.MultiheadAttention, x: Tensor, causal: bool
) -> Runner:
    """The four projections of ``sdpa_bare`` without the attention core."""

    def run() -> Tensor:
        q, k, v = F.linear(x, layer.in_proj_weight, layer.in_proj_bias).chunk(
            3, dim=-1
        )
        # (B, T, D); the copy stands for the head merge
        return layer.out_proj(v.contiguous())

    return run


def _sdpa_core(backend: SDPBackend):
    def build(layer: nn.MultiheadAttention, x: Tensor, causal: bool) -> Runner:
        with torch.no_grad():  # the projections are made here, not timed
            # (B, T, 3D)
            qkv = F.linear(x, layer.in_proj_weight, layer.in_proj_bias)
        d_k = x.shape[-1] // layer.num_heads
        # (B, H, T, d_k) each
        q, k, v = (split_heads(t, d_k) for t in qkv.chunk(3, dim=-1))

        def core() -> Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal
                )  # (B, H, T, d_k)

        return core

    return build


# On the CPU, torch has a math and a flash kernel only: the other two run
# by default on GPUs.
for _short, _backend in BACKENDS.items():
    register(
        f"sdpa_{_short}",
        scope="core",
        default_on=("cpu", "cuda")
        if _short in ("math", "flash")
        else ("cuda",),
        summary="``F.scaled_dot_product_attention`` alone, "
        f"forced to the {_short} backend",
    )(_sdpa_core(_backend))


# ---------------------------------------------------------------------------
# Tiled attention (chapter 13): the attention core on projected heads


def _projected_heads(
    layer: nn.MultiheadAttention, x: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v of ``layer`` for ``x``, each (B, H, T, d_k), made untimed."""
    with torch.no_grad():
        qkv = F.linear(x, layer.in_proj_weight, layer.in_proj_bias)
    d_k = x.shape[-1] // layer.num_heads
    q, k, v = (split_heads(t, d_k) for t in qkv.chunk(3, dim=-1))
    return q, k, v  # (B, H, T, d_k) each


@register("flash_torch", scope="core")
def flash_torch(
    layer: nn.MultiheadAttention, x: Tensor, causal: bool
) -> Runner:
    """:func:`mha.flash.flash_attention_torch`: tiles of 64 x 64 scores."""
    from ..flash import flash_attention_torch

    q, k, v = _projected_heads(layer, x)
    return lambda: flash_attention_torch(q, k, v, causal=causal)[0]


@register(
    "triton_attention",
    scope="core",
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    default_on=("cuda",),
)
def triton_kernel(
    layer: nn.MultiheadAttention, x: Tensor, causal: bool
) -> Runner:
    """:func:`mha.kernels.triton_attention` (CPU: in Triton's interpreter)."""
    from .. import kernels

    d_k = x.shape[-1] // layer.num_heads
    if not kernels.TRITON_AVAILABLE:
        raise Unsupported("triton_attention needs triton, not installed here")
    if d_k not in kernels.HEAD_DIMS:
        raise Unsupported(
            f"triton_attention takes d_k in {kernels.HEAD_DIMS}, not {d_k}"
        )
    if kernels.INTERPRETED != (x.device.type == "cpu"):
        mode = "interpreted" if kernels.INTERPRETED else "compiled"
        raise Unsupported(
            "triton_attention runs compiled on CUDA tensors and in the "
            f"interpreter on CPU tensors; here it is {mode} and the device "
            f"is {x.device.type}"
        )
    if kernels.INTERPRETED and x.dtype == torch.bfloat16:
        raise Unsupported("the Triton interpreter has no correct bfloat16")
    q, k, v = _projected_heads(layer, x)
    return lambda: kernels.triton_attention(q, k, v, causal=causal)


# Decode steps (python -m mha.bench --decode): the output of one new token
# after a context of T tokens, by a GroupedQueryAttention layer or by
# transformers' LlamaAttention with the same weights. Each runner repeats the
# same step: the cache is set back to the context before every call.


def _decode_entry(name: str, summary: str):
    return register(
        name,
        scope="decode",
        registry=DECODE_IMPLEMENTATIONS,
        devices=("cpu", "cuda"),
        summary=summary,
    )


@_decode_entry("no_cache", "the whole sequence again, causal; its last row")
def decode_no_cache(
    layer: nn.Module, context: Tensor, x_new: Tensor
) -> Runner:
    sequence = torch.cat((context, x_new), dim=1)  # (B, T + 1, D)
    return lambda: layer(sequence)[:, -1:]  # (B, 1, D)


@_decode_entry("concat_cache", "mha.ConcatKVCache: torch.cat of the cache")
def decode_concat_cache(
    layer: nn.Module, context: Tensor, x_new: Tensor
) -> Runner:
    from ..decoding import ConcatKVCache

    B, T, _ = context.shape
    cache = ConcatKVCache(
        B,
        layer.num_kv_heads,
        layer.head_dim,
        dtype=context.dtype,
        device=context.device,
    )
    layer(context, cache=cache)  # the context's keys and values, untimed

    def step() -> Tensor:
        cache.truncate(T)  # forget the previous call's token (a view)
        return layer(x_new, cache=cache)  # (B, 1, D)

    return step


@_decode_entry("preallocated_cache", "mha.KVCache: written in place")
def decode_preallocated_cache(
    layer: nn.Module, context: Tensor, x_new: Tensor
) -> Runner:
    from ..decoding import KVCache

    B, T, _ = context.shape
    cache = KVCache(
        B,
        T + 1,
        layer.num_kv_heads,
        layer.head_dim,
        dtype=context.dtype,
        device=context.device,
    )
    layer(context, cache=cache)  # the context's keys and values, untimed

    def step() -> Tensor:
        cache.truncate(T)  # the new token is written at position T again
        return layer(x_new, cache=cache)  # (B, 1, D)

    return step


def _llama_attention(layer: nn.Module, dtype: torch.dtype):
    """transformers' LlamaAttention with the layer's weights, its config and
    rotary embedding; sdpa attention, transformers' default."""
    try:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import (
            LlamaAttention,
            LlamaRotaryEmbedding,
        )
    except ImportError as error:  # pragma: no cover - a pinned test dependency
        raise Unsupported(f"transformers is not installed ({error})") from None
    config = LlamaConfig(
        hidden_size=layer.embed_dim,
        num_attention_heads=layer.num_heads,
        num_key_value_heads=layer.num_kv_heads,
        num_hidden_layers=1,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": layer.rope_base,
        },
    )
    config._attn_implementation = "sdpa"
    device = layer.q_proj.weight.device
    theirs = LlamaAttention(config, layer_idx=0).to(device=device, dtype=dtype)
    theirs.load_state_dict(layer.state_dict())  # the same names
    theirs.eval().requires_grad_(False)
    return theirs, config, LlamaRotaryEmbedding(config).to(device)


@_decode_entry(
    "hf_dynamic_cache",
    "transformers' LlamaAttention + rotary embedding, DynamicCache (cat)",
)
def decode_hf_dynamic_cache(
    layer: nn.Module, context: Tensor, x_new: Tensor
) -> Runner:
    from transformers.cache_utils import DynamicCache

    theirs, config, rotary = _llama_attention(layer, context.dtype)
    T = context.shape[1]
    positions = torch.arange(T + 1, device=context.device)[None]  # (1, T+1)
    cache = DynamicCache(config=config)
    theirs(
        context, rotary(context, positions[:, :T]), None, past_key_values=cache
    )

    def step() -> Tensor:
        if cache.get_seq_length() > T:
            cache.crop(-1)  # forget the previous call's token
        cos_sin = rotary(x_new, positions[:, T:])
        return theirs(x_new, cos_sin, None, past_key_values=cache)[0]

    return step


@_decode_entry(
    "hf_static_cache",
    "transformers' LlamaAttention + rotary embedding, StaticCache (in place)",
)
def decode_hf_static_cache(
    layer: nn.Module, context: Tensor, x_new: Tensor
) -> Runner:
    from transformers.cache_utils import StaticCache

    theirs, config, rotary = _llama_attention(layer, context.dtype)
    T = context.shape[1]
    positions = torch.arange(T + 1, device=context.device)[None]  # (1, T+1)
    # Exactly T + 1 slots: after the step every slot is written, so the step
    # needs no mask (a longer StaticCache would need one over its empty slots).
    cache = StaticCache(config=config, max_cache_len=T + 1)
    theirs(
        context, rotary(context, positions[:, :T]), None, past_key_values=cache
    )
    written = cache.layers[0].cumulative_length  # a tensor, counted in place

    def step() -> Tensor:
        written.fill_(T)  # the new token is written at position T again
        cos_sin = rotary(x_new, positions[:, T:])
        return theirs(x_new, cos_sin, None, past_key_values=cache)[0]

    return step
