"""What ``python -m mha.bench decode`` times: one decoding step each.

The output of one new token after a context of T tokens, by a
:class:`mha.GroupedQueryAttention` layer or ``transformers``'
``LlamaAttention`` with the same weights. Each runner repeats the same step:
the cache is filled with the context once, untimed, and set back to T tokens
before every call. One builder per family: our caches, ``transformers``'.
The ``*_compiled`` entries run the same step through ``torch.compile``
(inductor, ``fullgraph=True``), compiled before the timing; they take minutes
to compile on a CPU and run only when asked for (``--impl``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..decoding import ConcatKVCache, KVCache
from .registry import DECODE_IMPLEMENTATIONS, Runner, Unsupported, register

__all__ = ["llama_attention"]


def _step(name: str, summary: str, **options) -> Callable:
    return register(
        DECODE_IMPLEMENTATIONS,
        name,
        scope="decode",
        summary=summary,
        **options,
    )


def _compile(call: Runner, reset: Runner) -> Runner:
    """``call`` compiled once (static shapes, one graph), and run twice after
    ``reset`` so that the compiling is done before anything is timed."""
    # Every build compiles the same lambda's code again, for another cache
    # and context: let the compiler keep one graph for each (its default
    # limit is 8 per code object, then it would fall back to eager).
    torch._dynamo.config.recompile_limit = max(
        torch._dynamo.config.recompile_limit, 256
    )
    compiled = torch.compile(call, fullgraph=True, dynamic=False)
    for _ in range(2):  # the first call compiles
        reset()
        compiled()
    return compiled


@_step("no_cache", "the whole sequence again, causal; its last row")
def no_cache(layer: nn.Module, context: Tensor, x_new: Tensor) -> Runner:
    sequence = torch.cat((context, x_new), dim=1)  # (B, T + 1, D)
    return lambda: layer(sequence)[:, -1:]  # (B, 1, D)


def _ours(preallocated: bool, compiled: bool = False) -> Callable:
    """A step of ``layer`` with our preallocated or concatenating cache."""

    def build(layer: nn.Module, context: Tensor, x_new: Tensor) -> Runner:
        B, T, _ = context.shape
        shape = (layer.num_kv_heads, layer.head_dim)
        options = {"dtype": context.dtype, "device": context.device}
        if preallocated:
            cache = KVCache(B, T + 1, *shape, **options)
        else:
            cache = ConcatKVCache(B, *shape, **options)
        layer(context, cache=cache)  # the context's keys and values, untimed

        def reset() -> None:
            cache.truncate(T)  # forget the previous call's token

        def call() -> Tensor:
            return layer(x_new, cache=cache)  # (B, 1, D)

        if compiled:
            call = _compile(call, reset)

        def step() -> Tensor:
            reset()
            return call()

        return step

    return build


_step("concat_cache", "mha.ConcatKVCache: torch.cat of the cache")(
    _ours(preallocated=False)
)
_step("preallocated_cache", "mha.KVCache: written in place")(
    _ours(preallocated=True)
)
_step(
    "preallocated_compiled",
    "mha.KVCache, the step compiled by torch.compile",
    default_on=(),
)(_ours(preallocated=True, compiled=True))


def llama_attention(layer: nn.Module, dtype: torch.dtype):
    """``transformers``' ``LlamaAttention`` with ``layer``'s weights.

    Returns the attention (sdpa, transformers' default), its config and its
    rotary embedding. ``layer`` is a :class:`mha.GroupedQueryAttention`.
    """
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


def _theirs(static: bool, compiled: bool = False) -> Callable:
    """A step of ``LlamaAttention`` (and its rotary embedding) with its
    ``StaticCache`` or its ``DynamicCache``."""

    def build(layer: nn.Module, context: Tensor, x_new: Tensor) -> Runner:
        theirs, config, rotary = llama_attention(layer, context.dtype)
        from transformers.cache_utils import DynamicCache, StaticCache

        T = context.shape[1]
        positions = torch.arange(T + 1, device=context.device)[None]
        # Exactly T + 1 static slots: after the step every slot is written,
        # so the step needs no mask (more would need one over empty slots).
        cache = (
            StaticCache(config=config, max_cache_len=T + 1)
            if static
            else DynamicCache(config=config)
        )
        cos_sin = rotary(context, positions[:, :T])
        theirs(context, cos_sin, None, past_key_values=cache)  # untimed

        def reset() -> None:
            if static:  # the tokens written, counted in place: T again
                cache.layers[0].cumulative_length.fill_(T)
            else:  # forget the previous call's token
                cache.crop(T - cache.get_seq_length())

        def call() -> Tensor:
            cos_sin = rotary(x_new, positions[:, T:])
            return theirs(x_new, cos_sin, None, past_key_values=cache)[0]

        if compiled:
            call = _compile(call, reset)

        def step() -> Tensor:
            reset()
            return call()

        return step

    return build


_step(
    "hf_dynamic_cache",
    "transformers' LlamaAttention + rotary embedding, DynamicCache (cat)",
)(_theirs(static=False))
_step(
    "hf_static_cache",
    "transformers' LlamaAttention + rotary embedding, StaticCache (in place)",
)(_theirs(static=True))
_step(
    "hf_static_compiled",
    "transformers' LlamaAttention, StaticCache, compiled by torch.compile",
    default_on=(),
)(_theirs(static=True, compiled=True))
