"""Decoding: key/value caches, greedy generation, a small decoder.

* :class:`GroupedQueryAttention`, the attention layer (:mod:`mha.layer`),
  and the caches (:class:`KVCache`, :class:`ConcatKVCache`,
  :class:`PagedKVCache`, :mod:`mha.caches`, under the protocol every cache
  honours) are re-exported here.
* :func:`grouped_from_multi_head`: a trained layer's key and value heads,
  mean-pooled per group (Ainslie et al. 2023).
* :class:`Decoder` and :func:`generate`: a small decoder built from these
  layers and greedy generation, with either cache or none;
  :func:`left_pad` and :func:`generate_batch` for prompts of different
  lengths; :func:`train_decoder` and :func:`evaluate_decoder` on chapter
  10's induction task (:mod:`mha.tiny`), to train, convert and uptrain one.

Shapes: ``B`` batch, ``T`` new tokens, ``T_k`` keys (cached + new), ``D``
model width, ``H`` query heads, ``H_kv`` key/value heads, ``G = H / H_kv``
query heads per key/value head, ``d_k = D / H``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ._validate import (
    check_choice,
    check_int,
    dtype_or_type,
)
from .backends import grouped_attention
from .caches import (
    Cache,
    ConcatKVCache,
    KVCache,
    PagedKVCache,
)
from .functional import (
    RMSNorm,
    grouped_query_state_dict,
)
from .layer import GroupedQueryAttention
from .positions import Rope

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
            got = dtype_or_type(prompt)
            raise TypeError(
                f"prompts[{i}] must be an int64 tensor of tokens, got {got}"
            )
        if prompt.dim() != 1 or len(prompt) == 0:
            raise ValueError(
                f"prompts[{i}] must have shape (T,) with T >= 1, got shape "
                f"{tuple(prompt.shape)}"
            )


def _check_tokens(tokens: object, vocab_size: int) -> None:
    if not isinstance(tokens, Tensor) or tokens.dtype != torch.int64:
        got = dtype_or_type(tokens)
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
