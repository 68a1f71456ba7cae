"""The one attention layer: grouped-query self-attention, RoPE, a cache.

:class:`GroupedQueryAttention`: ``H`` query heads share ``H_kv`` key/value
heads, ``H_kv`` dividing ``H``; ``H_kv = H`` is multi-head attention,
``H_kv = 1`` multi-query attention (Shazeer 2019), anything between
grouped-query attention (Ainslie et al. 2023). Projections named as in
``transformers``' ``LlamaAttention`` (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``), so its ``state_dict`` loads with no renaming; RoPE inside;
Qwen3's q/k norms, sliding windows and gpt-oss's sinks as options. The
attention itself is one call, :func:`mha.backends.attend`, with the layer's
backend and cache: chapter 12's layer is the whole model's
(:mod:`mha.model`).

With a cache the new tokens' queries attend to every cached key and to the
new keys up to their own position: the causal mask is aligned to the bottom
right (:func:`mha.functional.causal_mask` with ``align="bottom-right"``).

Shapes: ``B`` batch, ``T`` new tokens, ``T_k`` keys (cached + new), ``D``
model width, ``H`` query heads, ``H_kv`` key/value heads, ``d_k`` head size.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from ._validate import (
    check_divisible,
    check_int,
    check_positions,
    check_probability,
    dtype_or_type,
)
from .backends import Masking, attend, get_backend
from .caches import Cache, cached_so_far
from .configs import read_config
from .functional import RMSNorm, merge_heads, split_heads
from .positions import Rope, as_rope, rope_cos_sin, rotate_pairs

__all__ = ["GroupedQueryAttention"]


class GroupedQueryAttention(nn.Module):
    """Grouped-query self-attention, rotary positions, an optional cache.

    Args:
        embed_dim: D. num_heads: H query heads, ``d_k = D / H``.
        num_kv_heads: H_kv key/value heads, dividing H (H: MHA, 1: MQA).
        bias: biases on the four projections (Llama has none).
        rope_base: RoPE's base (10000 in Llama 2), a :class:`mha.Rope`
            (a base with a scaling rule, as Llama 3.1's), or None for no
            rotary positions (positions then come from the input, if at all).
        dropout: probability of dropping an attention weight in training.
        device, dtype: of the parameters.
        head_dim: d_k, when it is not D / H (the q/k/v widths are H d_k).
        window: a query at position p sees the keys at p - window + 1 .. p
            (a sliding window, Mistral's and gpt-oss's), or None: all.
        sinks: a learned sink logit per head, the parameter ``sinks`` (H,)
            (gpt-oss): one more term in each row's softmax, with no value.
        qk_norm_eps: RMSNorm over each head's queries and keys, before
            RoPE (Qwen3's ``q_norm``, ``k_norm``), with this epsilon; None:
            none.
        o_bias: a bias on ``o_proj`` (default ``bias``; Qwen2 has q, k, v
            biases and none on o).
        backend: the attention backend by name (:func:`mha.attend`,
            :func:`mha.attention_backends`), ``sdpa`` by default.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        rope_base: float | Rope | None = 10000.0,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        head_dim: int | None = None,
        window: int | None = None,
        sinks: bool = False,
        qk_norm_eps: float | None = None,
        o_bias: bool | None = None,
        backend: str = "sdpa",
    ) -> None:
        super().__init__()
        self.backend = get_backend(backend).name
        self.window = None if window is None else check_int("window", window)
        self.embed_dim = check_int("embed_dim", embed_dim)
        self.num_heads = check_int("num_heads", num_heads)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads)
        derived = head_dim is None  # d_k = D / H
        if derived:
            head_dim = check_divisible(
                "embed_dim", embed_dim, "num_heads", num_heads
            )
        self.head_dim = check_int("head_dim", head_dim)
        check_divisible("num_heads", num_heads, "num_kv_heads", num_kv_heads)
        self.rope = None if rope_base is None else as_rope(rope_base)
        if self.rope is not None and self.head_dim % 2:
            raise ValueError(
                "RoPE needs an even head width d_k = embed_dim / num_heads "
                f"(dimension i turns with i + d_k/2), got d_k = "
                f"{embed_dim} / {num_heads} = {self.head_dim}"
                if derived
                else "RoPE needs an even head_dim (dimension i turns with "
                f"i + d_k/2), got {self.head_dim}"
            )
        self.dropout = check_probability("dropout", dropout)
        q_dim = self.num_heads * self.head_dim  # H d_k (D unless head_dim)
        kv_dim = self.num_kv_heads * self.head_dim  # H_kv d_k
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, q_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        o_bias = bias if o_bias is None else o_bias
        self.o_proj = nn.Linear(q_dim, embed_dim, bias=o_bias, **factory)
        self.q_norm = self.k_norm = None  # or Qwen3's, over each head's d_k
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(self.head_dim, qk_norm_eps, **factory)
            self.k_norm = RMSNorm(self.head_dim, qk_norm_eps, **factory)
        self.sinks = None  # or (H,) logits, GptOssAttention's ``sinks``
        if sinks:
            self.sinks = nn.Parameter(
                torch.zeros(num_heads, device=device, dtype=dtype)
            )

    @property
    def rope_base(self) -> float | None:
        """RoPE's base, or None without rotary positions."""
        return None if self.rope is None else self.rope.base

    @classmethod
    def from_config(
        cls,
        config: object,
        *,
        layer_idx: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> GroupedQueryAttention:
        """The layer that ``transformers``' ``LlamaAttention`` builds from
        ``config``: a ``LlamaConfig`` (or ``Qwen2Config``, whose q/k/v have
        biases and o none), or an object or dict with its fields
        (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
        ``head_dim``, ``attention_bias``, ``attention_dropout``,
        ``max_position_embeddings`` and ``rope_parameters`` in
        ``transformers`` 5's format, rope types default, linear, llama3 and
        yarn), read by :func:`mha.configs.read_config`. Its ``state_dict``
        loads into ours with no renaming; a field the layer does not
        implement is refused by name. A ``Qwen3Config`` adds the norms of
        each head's queries and keys. A ``GptOssConfig`` gives gpt-oss's
        layer (biases, learned sinks) and ``layer_idx`` its window:
        ``layer_types[layer_idx]`` is ``"sliding_attention"``
        (``sliding_window``) or ``"full_attention"`` (none), as in
        ``GptOssAttention(config, layer_idx)``."""
        fields = read_config(config, layer=True)
        window = _layer_window(
            fields.windows, fields.sliding_window, layer_idx
        )
        return cls.from_fields(fields, window, device=device, dtype=dtype)

    @classmethod
    def from_fields(
        cls, fields, window: int | None, backend: str = "sdpa", **factory
    ) -> GroupedQueryAttention:
        """The layer of a :class:`mha.configs.ModelConfig` (the fields
        :func:`mha.configs.read_config` reads) with this ``window``."""
        return cls(
            fields.hidden_size,
            fields.num_attention_heads,
            fields.num_key_value_heads,
            bias=fields.qkv_bias,
            rope_base=fields.rope,
            dropout=fields.attention_dropout,
            head_dim=fields.head_dim,
            window=window,
            sinks=fields.sinks,
            qk_norm_eps=fields.rms_norm_eps if fields.qk_norm else None,
            o_bias=fields.o_bias,
            backend=backend,
            **factory,
        )

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor | None = None,
        cache: Cache | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = True,
        masking: Masking | None = None,
    ) -> Tensor:
        """x (B, T, D) -> (B, T, D), attending to the cache (if any) and x.

        ``positions`` (T,), (1, T) or (B, T) ints, for RoPE: by default
        ``len(cache)`` onwards (0 without a cache); (B, T) lets each row
        continue its own positions (a left-padded batch). ``attn_mask``:
        boolean, broadcastable to (B, H, T, T_k), ``True`` = may attend, with
        ``T_k`` the cached and new positions, or the cache's ``max_len``;
        combined with the causal mask when ``is_causal``. ``masking``: what
        to hide, said once for every layer by a model that has checked its
        inputs (:class:`mha.CausalLM`), in place of the last two.
        """
        if masking is None:  # a call from outside: every input checked
            self._check_forward(x, positions, cache, attn_mask)
            masking = Masking(causal=is_causal, dense=attn_mask)
        d_k, T = self.head_dim, x.shape[1]
        q = split_heads(self.q_proj(x), d_k)  # (B, H, T, d_k)
        k = split_heads(self.k_proj(x), d_k)  # (B, H_kv, T, d_k)
        v = split_heads(self.v_proj(x), d_k)  # (B, H_kv, T, d_k)
        if self.q_norm is not None:  # Qwen3: each head's q and k, normed
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:  # turn q and k by their positions
            if positions is None:  # the next T slots of the cache
                start = 0 if cache is None else cached_so_far(cache)
                positions = start + torch.arange(T, device=x.device)
            cos, sin = rope_cos_sin(positions, d_k, self.rope, q.dtype)
            q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        masking = dataclasses.replace(  # the layer's own window and sinks
            masking, window=self.window, sinks=self.sinks
        )
        drop = self.dropout if self.training else 0.0
        # the backend reads the cache, in place or gathered: (B, H, T, d_k)
        heads = attend(self.backend, q, k, v, masking, cache, dropout_p=drop)
        return self.o_proj(merge_heads(heads))  # (B, T, D)

    def _check_forward(
        self,
        x: Tensor,
        positions: Tensor | None,
        cache: Cache | None,
        attn_mask: Tensor | None,
    ) -> None:
        """Check every input before anything is computed (under
        ``torch.compile`` only what the shapes tell: no value is read)."""
        if not isinstance(x, Tensor) or not x.is_floating_point():
            got = dtype_or_type(x)
            raise TypeError(f"x must be a floating-point tensor, got {got}")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must have shape (B, T, D) with D = {self.embed_dim}, "
                f"got shape {tuple(x.shape)}"
            )
        weight = self.q_proj.weight
        if x.dtype != weight.dtype:  # else torch's "mat1 and mat2" error
            raise TypeError(
                f"x must have the layer's dtype {weight.dtype}, got {x.dtype}"
            )
        if x.device != weight.device:
            raise ValueError(
                f"x must be on the layer's device {weight.device}, got "
                f"{x.device}"
            )
        B, T, _ = x.shape
        if cache is not None:
            cache.check_update(
                B, self.num_kv_heads, T, self.head_dim, x.dtype, x.device
            )
        if positions is not None:
            _check_layer_positions(positions, B, T, self.rope is not None)
        if attn_mask is not None:
            _check_attn_mask(attn_mask, B, self.num_heads, T, cache)


def _layer_window(
    windows: tuple[int | None, ...], window: int | None, layer: int | None
) -> int | None:
    """The window of layer ``layer`` (``layer_types``), or the one window
    of every layer."""
    if layer is None:
        if len(set(windows)) > 1:
            raise ValueError(
                "layer_idx must be given: the layers' windows differ "
                f"(layer_types), got windows {sorted(set(windows), key=str)}"
            )
        return windows[0] if windows else window
    check_int("layer_idx", layer, minimum=0)
    if not windows:
        return window
    if layer >= len(windows):
        raise ValueError(
            f"layer_idx must be < num_hidden_layers = {len(windows)}, "
            f"got {layer}"
        )
    return windows[layer]


def _check_layer_positions(
    positions: object, B: int, T: int, has_rope: bool
) -> None:
    if not has_rope:
        raise ValueError(
            "positions were given, but the layer has no rotary "
            "positions (rope_base=None)"
        )
    check_positions(positions, B, T)
    if not torch.compiler.is_compiling() and positions.numel():
        if int(positions.min()) < 0:
            raise ValueError(
                "positions must be >= 0 (each row counts its own tokens "
                f"from 0), got {_value_range(positions)}"
            )


def _check_attn_mask(
    attn_mask: Tensor, B: int, H: int, t_q: int, cache: Cache | None
) -> None:
    if not isinstance(attn_mask, Tensor) or attn_mask.dtype != torch.bool:
        got = dtype_or_type(attn_mask)
        raise TypeError(
            f"attn_mask must be a bool tensor (True = may attend), got {got}"
        )
    widths = {1}  # the last axis: T_k, every slot of the cache, or 1
    if cache is None or not torch.compiler.is_compiling():
        widths.add(t_q + (0 if cache is None else len(cache)))
    if cache is not None and cache.max_len is not None:
        widths.add(cache.max_len)
    shape = tuple(attn_mask.shape)
    if len(shape) == 2 and B > 1 and shape[0] == B == t_q:
        raise ValueError(
            f"attn_mask of shape {shape} cannot be read: a 2-D mask is "
            f"(T, T_k), but with B = T = {B} it could be a (B, T_k) padding "
            "mask (transformers' attention_mask); pass (1, 1, T, T_k) or "
            "(B, 1, 1, T_k)"
        )
    fits = (
        2 <= len(shape) <= 4
        and shape[-1] in widths
        and all(
            size in (1, want) for size, want in zip(shape[-2::-1], (t_q, H, B))
        )
    )
    if not fits:
        t_k = "T_k = T" if cache is None else "T_k = len(cache) + T"
        slots = "" if cache is None else ", or the cache's max_len"
        raise ValueError(
            f"attn_mask must be broadcastable to (B, H, T, T_k) with "
            f"(B, H, T) = {(B, H, t_q)} and {t_k} = "
            f"{' or '.join(map(str, sorted(widths - {1})))}{slots}, got "
            f"shape {shape}"
        )


def _value_range(positions: Tensor) -> str:
    if positions.numel() == 0:
        return "no positions"
    return f"values {int(positions.min())} .. {int(positions.max())}"
