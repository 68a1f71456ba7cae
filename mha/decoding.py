"""Decoding: grouped-query attention, key/value caches, greedy generation.

* :class:`GroupedQueryAttention`: ``H`` query heads share ``H_kv`` key/value
  heads, ``H_kv`` dividing ``H``; ``H_kv = H`` is multi-head attention,
  ``H_kv = 1`` multi-query attention (Shazeer 2019), anything between
  grouped-query attention (Ainslie et al. 2023). Projections named as in
  ``transformers``' ``LlamaAttention`` (``q_proj``, ``k_proj``, ``v_proj``,
  ``o_proj``), so its ``state_dict`` loads with no renaming; RoPE inside.
* the caches (:class:`KVCache`, :class:`ConcatKVCache`,
  :class:`PagedKVCache`) live in :mod:`mha.caches`, under the protocol
  every cache honours, and are re-exported here.
* :func:`grouped_from_multi_head`: a trained layer's key and value heads,
  mean-pooled per group (Ainslie et al. 2023).
* :class:`Decoder` and :func:`generate`: a small decoder built from these
  layers and greedy generation, with either cache or none;
  :func:`train_decoder` and :func:`evaluate_decoder` on chapter 10's
  induction task (:mod:`mha.tiny`), to train, convert and uptrain one.

With a cache the new tokens' queries attend to every cached key and to the
new keys up to their own position: the causal mask is aligned to the bottom
right (:func:`mha.functional.causal_mask` with ``align="bottom-right"``).

Shapes: ``B`` batch, ``T`` new tokens, ``T_k`` keys (cached + new), ``D``
model width, ``H`` query heads, ``H_kv`` key/value heads, ``G = H / H_kv``
query heads per key/value head, ``d_k = D / H``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ._validate import (
    check_choice,
    check_divisible,
    check_int,
    check_positions,
    check_probability,
)
from .backends import Masking, attend, get_backend, grouped_attention
from .caches import (
    Cache,
    ConcatKVCache,
    KVCache,
    PagedKVCache,
    cached_so_far,
)
from .configs import read_config
from .functional import (
    RMSNorm,
    grouped_query_state_dict,
    merge_heads,
    split_heads,
)
from .positions import Rope, as_rope, rope_cos_sin, rotate_pairs

__all__ = [
    "grouped_attention",
    "RMSNorm",
    "GroupedQueryAttention",
    "KVCache",
    "ConcatKVCache",
    "PagedKVCache",
    "grouped_from_multi_head",
    "left_pad",
    "Decoder",
    "generate",
    "generate_batch",
    "train_decoder",
    "evaluate_decoder",
]


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
            got = _dtype_or_type(x)
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
        got = _dtype_or_type(attn_mask)
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


# ---------------------------------------------------------------------------
# From multi-head to grouped-query attention


def grouped_from_multi_head(
    layer: nn.Module, num_kv_heads: int
) -> GroupedQueryAttention:
    """A layer with ``num_kv_heads`` key/value heads, each the mean of a group.

    Ainslie et al. (2023): the key and value heads of ``layer`` are averaged
    in consecutive groups of ``H_kv(layer) / num_kv_heads``; the query and
    output projections are copied. ``layer``: a
    :class:`GroupedQueryAttention`, or a :class:`mha.MultiHeadAttention` /
    ``torch.nn.MultiheadAttention`` (then without rotary positions).
    """
    state, rope_base = _projections(layer)
    new = GroupedQueryAttention(
        layer.embed_dim,
        layer.num_heads,
        _check_pooling(state, layer, num_kv_heads),
        bias="q_proj.bias" in state,
        rope_base=rope_base,
        device=state["q_proj.weight"].device,
        dtype=state["q_proj.weight"].dtype,
    )
    for name, weight in state.items():
        if name.startswith(("k_proj", "v_proj")):  # (H_kv(layer) d_k, ...)
            heads = weight.unflatten(0, (num_kv_heads, -1, new.head_dim))
            state[name] = heads.mean(dim=1).flatten(0, 1)  # (H_kv d_k, ...)
    new.load_state_dict(state)
    return new


def _projections(
    layer: nn.Module,
) -> tuple[dict[str, Tensor], Rope | None]:
    """The layer's weights (copies) under LlamaAttention's names; RoPE base."""
    if isinstance(layer, GroupedQueryAttention):
        state = {k: t.detach().clone() for k, t in layer.state_dict().items()}
        return state, layer.rope
    if hasattr(layer, "in_proj_weight") and hasattr(layer, "out_proj"):
        return grouped_query_state_dict(layer), None
    raise TypeError(
        "layer must be a GroupedQueryAttention, mha.MultiHeadAttention or "
        f"torch.nn.MultiheadAttention, got {type(layer).__name__}"
    )


def _check_pooling(
    state: dict[str, Tensor], layer: nn.Module, num_kv_heads: int
) -> int:
    check_int("num_kv_heads", num_kv_heads)
    head_dim = layer.embed_dim // layer.num_heads
    old = state["k_proj.weight"].shape[0] // head_dim  # H_kv of the layer
    if old % num_kv_heads:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must divide the layer's number "
            f"of key/value heads ({old}): heads are pooled in whole groups"
        )
    return num_kv_heads


# ---------------------------------------------------------------------------
# A small decoder and greedy generation

CACHE_KINDS = ("preallocated", "concat", "paged")


class Decoder(nn.Module):
    """Token embeddings, pre-norm blocks (attention, MLP), an output head.

    Each block is ``x = x + attn(norm(x))`` with a
    :class:`GroupedQueryAttention` (RoPE inside, no biases), then ``x = x +
    mlp(norm(x))``; ``logits = head(norm(x))``. Positions come from RoPE only.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 64,
        num_heads: int = 8,
        num_kv_heads: int | None = None,
        num_layers: int = 2,
        d_mlp: int = 128,
        rope_base: float = 10000.0,
    ) -> None:
        super().__init__()
        self.vocab_size = check_int("vocab_size", vocab_size)
        self.num_layers = check_int("num_layers", num_layers)
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.embed = nn.Embedding(vocab_size, d_model)
        self.attn_norms = nn.ModuleList(
            nn.LayerNorm(d_model) for _ in range(num_layers)
        )
        self.attns = nn.ModuleList(
            GroupedQueryAttention(
                d_model, num_heads, kv_heads, rope_base=rope_base
            )
            for _ in range(num_layers)
        )
        self.mlp_norms = nn.ModuleList(
            nn.LayerNorm(d_model) for _ in range(num_layers)
        )
        self.mlps = nn.ModuleList(
            nn.Sequential(
                nn.Linear(d_model, d_mlp),
                nn.GELU(),
                nn.Linear(d_mlp, d_model),
            )
            for _ in range(num_layers)
        )
        self.out_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    @property
    def num_kv_heads(self) -> int:
        return self.attns[0].num_kv_heads

    def forward(
        self,
        tokens: Tensor,
        *,
        caches: Sequence[Cache] | None = None,
        positions: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """Next-token logits (B, T, V) of tokens (B, T), after the caches'.

        ``positions`` and ``attn_mask`` go to every attention layer (see
        :meth:`GroupedQueryAttention.forward`): a left-padded batch.
        """
        _check_tokens(tokens, self.vocab_size)
        if caches is not None and len(caches) != self.num_layers:
            raise ValueError(
                f"caches must hold one cache per layer ({self.num_layers}), "
                f"got {len(caches)}"
            )
        if caches is not None and not torch.compiler.is_compiling():
            # every cache before the first layer writes: none half-written
            attn, weight = self.attns[0], self.head.weight
            for cache in caches:
                cache.check_update(
                    tokens.shape[0],
                    attn.num_kv_heads,
                    tokens.shape[1],
                    attn.head_dim,
                    weight.dtype,
                    weight.device,
                )
        x = self.embed(tokens)  # (B, T, D)
        for i, attn in enumerate(self.attns):
            cache = None if caches is None else caches[i]
            x = x + attn(
                self.attn_norms[i](x),
                cache=cache,
                positions=positions,
                attn_mask=attn_mask,
            )
            x = x + self.mlps[i](self.mlp_norms[i](x))
        return self.head(self.out_norm(x))  # (B, T, V)

    def new_caches(
        self, batch: int, max_len: int, *, kind: str = "preallocated"
    ) -> list[Cache]:
        """One empty cache per layer: ``"preallocated"`` (:class:`KVCache`),
        ``"concat"`` or ``"paged"`` (16-position blocks)."""
        check_choice("kind", kind, CACHE_KINDS)
        attn, dtype = self.attns[0], self.head.weight.dtype
        device = self.head.weight.device
        sizes = (attn.num_kv_heads, attn.head_dim)
        if kind == "preallocated":
            return [
                KVCache(batch, max_len, *sizes, dtype=dtype, device=device)
                for _ in self.attns
            ]
        if kind == "paged":
            return [
                PagedKVCache(
                    batch, max_len, *sizes, dtype=dtype, device=device
                )
                for _ in self.attns
            ]
        return [
            ConcatKVCache(
                batch, *sizes, max_len=max_len, dtype=dtype, device=device
            )
            for _ in self.attns
        ]

    def grouped(self, num_kv_heads: int) -> Decoder:
        """A copy whose attention layers have ``num_kv_heads`` key/value
        heads, mean-pooled from this model's (:func:`grouped_from_multi_head`).
        """
        grouped = copy.deepcopy(self)
        grouped.attns = nn.ModuleList(
            grouped_from_multi_head(a, num_kv_heads) for a in self.attns
        )
        return grouped


@torch.no_grad()
def generate(
    model: Decoder,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    cache: str | None = "preallocated",
) -> Tensor:
    """Greedy decoding: (B, T) prompt -> (B, T + max_new_tokens) tokens.

    ``cache=None`` runs the whole sequence through the model for every new
    token; ``"preallocated"`` (:class:`KVCache`), ``"concat"``
    (:class:`ConcatKVCache`) or ``"paged"`` (:class:`PagedKVCache`) runs the
    prompt once and then one token a step.
    """
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    if cache is not None:
        check_choice("cache", cache, CACHE_KINDS)
    _check_tokens(prompt, model.vocab_size)
    tokens, new = prompt, prompt  # everything so far; the newest tokens
    caches = None
    if cache is not None:
        total = prompt.shape[1] + max_new_tokens
        caches = model.new_caches(prompt.shape[0], total, kind=cache)
    for _ in range(max_new_tokens):
        seen = tokens if caches is None else new  # all so far, or the new one
        logits = model(seen, caches=caches)  # (B, T or 1, V)
        next_token = logits[:, -1].argmax(dim=-1, keepdim=True)  # (B, 1)
        tokens = torch.cat((tokens, next_token), dim=1)
        new = next_token
    return tokens


def left_pad(
    prompts: Sequence[Tensor], pad_token: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Prompts of different lengths as one batch, padded on the left.

    Returns ``tokens`` (B, T) with ``pad_token`` before the shorter prompts,
    ``real`` (B, T) bool (True at a prompt's own tokens: the key-padding
    mask) and ``positions`` (B, T): each prompt's own 0, 1, ... (0 on the
    pads). On the left, every prompt's last token sits in the last column,
    where the next token is read off, and the new tokens of all rows are
    written to the same cache positions.
    """
    _check_prompts(prompts)
    T = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), T), pad_token, dtype=torch.int64)
    real = torch.zeros(len(prompts), T, dtype=torch.bool)
    for b, prompt in enumerate(prompts):
        tokens[b, T - len(prompt) :] = prompt
        real[b, T - len(prompt) :] = True
    positions = (real.cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
    device = prompts[0].device
    return tokens.to(device), real.to(device), positions.to(device)


@torch.no_grad()
def generate_batch(
    model: Decoder,
    prompts: Sequence[Tensor],
    max_new_tokens: int,
    *,
    cache: str = "preallocated",
) -> list[Tensor]:
    """Greedy decoding of prompts of different lengths, as one batch.

    The prompts are padded on the left (:func:`left_pad`); the pads are
    masked out of every key, and each row's rotary positions are its own.
    Returns, per prompt, the prompt and its ``max_new_tokens`` new tokens:
    what :func:`generate` gives for that prompt alone.
    """
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    check_choice("cache", cache, ("preallocated", "paged"))
    tokens, real, positions = left_pad(prompts)
    B, T = tokens.shape
    _check_tokens(tokens, model.vocab_size)
    caches = model.new_caches(B, T + max_new_tokens, kind=cache)
    keys = torch.ones(B, T + max_new_tokens, dtype=torch.bool)
    keys[:, :T] = real  # (B, T_max): False at the pads, for every step
    keys = keys.to(tokens.device)[:, None, None, :]  # (B, 1, 1, T_max)
    new = []
    seen, at = tokens, positions  # the step's tokens and their positions
    for _ in range(max_new_tokens):
        logits = model(seen, caches=caches, positions=at, attn_mask=keys)
        seen = logits[:, -1].argmax(dim=-1, keepdim=True)  # (B, 1)
        at = at[:, -1:] + 1  # each row's next position
        new.append(seen)
    generated = torch.cat([tokens[:, :0], *new], dim=1)  # (B, new)
    return [
        torch.cat((prompt, generated[b])) for b, prompt in enumerate(prompts)
    ]


def _check_prompts(prompts: object) -> None:
    if isinstance(prompts, Tensor) or not isinstance(prompts, Sequence):
        raise TypeError(
            "prompts must be a list of 1-D int64 tensors (one per prompt), "
            f"got {type(prompts).__name__}"
        )
    if not prompts:
        raise ValueError("prompts must hold at least one prompt, got none")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, Tensor) or prompt.dtype != torch.int64:
            got = _dtype_or_type(prompt)
            raise TypeError(
                f"prompts[{i}] must be an int64 tensor of tokens, got {got}"
            )
        if prompt.dim() != 1 or len(prompt) == 0:
            raise ValueError(
                f"prompts[{i}] must have shape (T,) with T >= 1, got shape "
                f"{tuple(prompt.shape)}"
            )


def _dtype_or_type(value: object) -> object:
    """What an error says came: a tensor's dtype, or the type's name."""
    return value.dtype if isinstance(value, Tensor) else type(value).__name__


def _check_tokens(tokens: object, vocab_size: int) -> None:
    if not isinstance(tokens, Tensor) or tokens.dtype != torch.int64:
        got = _dtype_or_type(tokens)
        raise TypeError(f"tokens must be an int64 tensor, got {got}")
    if tokens.dim() != 2 or tokens.shape[1] == 0:
        raise ValueError(
            f"tokens must have shape (B, T) with T >= 1, got shape "
            f"{tuple(tokens.shape)}"
        )
    if torch.compiler.is_compiling():  # reading values would break a graph
        return
    if not (0 <= int(tokens.min()) and int(tokens.max()) < vocab_size):
        raise ValueError(
            f"tokens must lie in [0, vocab_size) = [0, {vocab_size}), got "
            f"values {int(tokens.min())} .. {int(tokens.max())}"
        )


# ---------------------------------------------------------------------------
# Training and evaluation on chapter 10's induction task


def train_decoder(
    model: Decoder, *, steps: int, lr: float = 3e-3, **options: object
) -> list[float]:
    """:func:`mha.tiny.train` at this model's learning rate: AdamW on fresh
    batches of the induction task, warm-up and cosine; the loss of every
    step. ``options``: ``batch_size``, ``seed``, ``seq_len``, ..."""
    from .tiny import train

    return train(model, steps=steps, lr=lr, **options)


def evaluate_decoder(model: Decoder, data) -> tuple[float, float]:
    """(loss, accuracy) of ``model`` on an :class:`mha.tiny.InductionData`,
    on its predictable positions: :func:`mha.tiny.evaluate`."""
    from .tiny import evaluate

    return evaluate(model, data)
