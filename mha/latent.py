"""Multi-head latent attention (MLA, DeepSeek-V2 and V3) and its cache.

Keys and values are not projected from the token one head at a time: the
token is first compressed to one latent vector ``c`` of ``r = kv_lora_rank``
numbers (with an RMSNorm), and every head's key and value are read out of
``c`` by an up-projection ``kv_b_proj`` (``W_UK``, ``W_UV`` in the paper).
Only ``c`` is cached, with one more small key that carries the position: RoPE
cannot pass through ``W_UK`` (a rotation between ``q`` and ``W_UK c`` would
change with the position), so a separate ``d_R = qk_rope_head_dim`` wide key,
shared by every head, is rotated and cached beside ``c`` (the *decoupled*
RoPE). A head's query is ``[q_nope | q_rope]`` and its key ``[k_nope |
k_rope]``; its value has its own width ``v_head_dim``. Queries may be
compressed too (``q_lora_rank``), to save activations in training.

* :class:`MultiHeadLatentAttention`: ``transformers``' ``DeepseekV3Attention``
  with its parameter names (``from_config`` reads a ``DeepseekV3Config``);
  ``forward(x, positions, cache, absorb)``. The naive path expands the
  cached latents into every head's keys and values (as ``transformers``
  does); ``absorb=True`` multiplies ``W_UK`` into the query and applies
  ``W_UV`` after the weights, so that attention reads the latents directly
  and nothing of size ``T_k H`` is built (DeepSeek-V2, section 2.1.2).
* :class:`LatentKVCache`: ``r + d_R`` numbers per token and layer, however
  many heads; the same contract as :class:`mha.KVCache`.
* :func:`reference_weights`: the layer's matrices for
  :func:`mha.reference.multi_head_latent_attention`, the NumPy twin.

Shapes: ``B`` batch, ``T`` new tokens, ``T_k`` cached and new, ``D`` model
width, ``H`` heads, ``r`` kv_lora_rank, ``d_N`` qk_nope_head_dim, ``d_R``
qk_rope_head_dim, ``d_v`` v_head_dim.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._validate import (
    check_int,
    check_positions,
    check_probability,
    check_tensor,
)
from .configs import read_latent_config
from .functional import RMSNorm, merge_heads, split_heads
from .positions import Rope, as_rope, rope_cos_sin, rotate_pairs

__all__ = [
    "RMSNorm",
    "MultiHeadLatentAttention",
    "LatentKVCache",
    "rotate_interleaved",
    "latent_softmax_scale",
    "reference_weights",
]


def rotate_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on neighbouring pairs ``(2i, 2i + 1)`` (DeepSeek's layout).

    x (..., d_R); cos, sin (..., d_R / 2). The turned pairs come back
    de-interleaved, first elements then second ones, as ``transformers``'
    ``apply_rotary_pos_emb_interleave`` returns them: queries and keys are
    reordered alike, so their dot products are those of the pairs.
    """
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (..., d_R/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def latent_softmax_scale(qk_head_dim: int, rope: Rope) -> float:
    """``1 / sqrt(d_N + d_R)``, times YaRN's ``mscale**2`` when the RoPE is
    scaled and ``mscale_all_dim`` is set, as ``transformers``' DeepSeek-V3
    applies it (``mscale = 0.1 mscale_all_dim ln(factor) + 1``)."""
    scale = qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        if rope.factor > 1:
            mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
            scale *= mscale * mscale
    return scale


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention with decoupled RoPE and a latent cache.

    Args:
        hidden_size: D. num_heads: H.
        kv_lora_rank: r, the width of the cached latent.
        qk_rope_head_dim: d_R, the rotated part of a query and the shared
            rotated key. qk_nope_head_dim: d_N, the part without positions.
        v_head_dim: d_v.
        q_lora_rank: the width of the compressed query (with its RMSNorm),
            or None for one ``q_proj``.
        bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``
            (``transformers``' ``attention_bias``; the up-projections have
            none).
        rope: RoPE's base or a :class:`mha.Rope` (scaling rule, YaRN).
        rope_interleave: pairs ``(2i, 2i + 1)`` (DeepSeek's checkpoints) or
            ``(i, i + d_R / 2)`` ("rotate half").
        dropout: on the attention weights, in training.
        device, dtype: of the parameters.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        qk_nope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        bias: bool = False,
        rope: float | Rope = 10000.0,
        rope_interleave: bool = True,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        D = self.hidden_size = check_int("hidden_size", hidden_size)
        H = self.num_heads = check_int("num_heads", num_heads)
        r = self.kv_lora_rank = check_int("kv_lora_rank", kv_lora_rank)
        d_r = self.qk_rope_head_dim = check_int(
            "qk_rope_head_dim", qk_rope_head_dim
        )
        if d_r % 2:
            raise ValueError(
                f"qk_rope_head_dim must be even (RoPE turns pairs), got {d_r}"
            )
        d_n = self.qk_nope_head_dim = check_int(
            "qk_nope_head_dim", qk_nope_head_dim, minimum=0
        )
        d_v = self.v_head_dim = check_int("v_head_dim", v_head_dim)
        self.q_lora_rank = (
            None
            if q_lora_rank is None
            else check_int("q_lora_rank", q_lora_rank)
        )
        self.qk_head_dim = d_n + d_r
        self.rope = as_rope(rope)
        self.rope_interleave = bool(rope_interleave)
        self.dropout = check_probability("dropout", dropout)
        self.scaling = latent_softmax_scale(self.qk_head_dim, self.rope)
        factory = {"device": device, "dtype": dtype}
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * self.qk_head_dim, False, **factory)
        else:
            q_r = self.q_lora_rank
            self.q_a_proj = nn.Linear(D, q_r, bias, **factory)
            self.q_a_layernorm = RMSNorm(q_r, 1e-6, **factory)
            self.q_b_proj = nn.Linear(
                q_r, H * self.qk_head_dim, False, **factory
            )
        self.kv_a_proj_with_mqa = nn.Linear(D, r + d_r, bias, **factory)
        self.kv_a_layernorm = RMSNorm(r, 1e-6, **factory)
        self.kv_b_proj = nn.Linear(r, H * (d_n + d_v), False, **factory)
        self.o_proj = nn.Linear(H * d_v, D, bias, **factory)

    @classmethod
    def from_config(
        cls,
        config: object,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> MultiHeadLatentAttention:
        """The layer ``transformers``' ``DeepseekV3Attention`` builds from
        ``config``: a ``DeepseekV3Config`` or a dict of its fields (a
        checkpoint's ``config.json``). The model's other fields (experts,
        vocabulary, ...) are not the layer's and are passed over; a field
        that would change the attention and is not implemented here
        (``quantization_config``, ``num_key_value_heads != H``, an unknown
        key) raises ``ValueError`` naming it."""
        fields = read_latent_config(config)
        return cls(**fields, device=device, dtype=dtype)

    def forward(
        self,
        x: Tensor,
        positions: Tensor | None = None,
        cache: LatentKVCache | None = None,
        absorb: bool = False,
    ) -> Tensor:
        """x (B, T, D) -> (B, T, D), causal, attending to the cache and x.

        ``positions`` (T,), (1, T) or (B, T) ints for RoPE, by default
        ``len(cache)`` onwards (0 without a cache). With a ``cache`` the new
        latents and rotated keys are written to it first; query ``i`` sees
        the cached tokens and the new ones up to itself. ``absorb``: attend
        to the latents directly (same result, another order of products).
        """
        self._check_forward(x, positions, cache)
        B, T, _ = x.shape
        start = 0 if cache is None else len(cache)
        if positions is None:
            positions = start + torch.arange(T, device=x.device)
        q_nope, q_rope = self._queries(x)  # (B, H, T, d_N), (B, H, T, d_R)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )  # (B, T, r), (B, T, d_R)
        latent = self.kv_a_layernorm(latent)
        cos, sin = rope_cos_sin(
            positions, self.qk_rope_head_dim, self.rope, x.dtype
        )  # (T, d_R/2) or (B, 1, T, d_R/2)
        q_rope = self._rotate(q_rope, cos, sin)
        k_rope = self._rotate(k_rope[:, None], cos, sin)[:, 0]  # (B, T, d_R)
        if cache is not None:
            latent, k_rope = cache.update(latent, k_rope)  # (B, T_k, .)
        keep = _causal(start, T, latent.shape[1], x.device)  # (T, T_k)
        if absorb:
            heads = self._absorbed(q_nope, q_rope, latent, k_rope, keep)
        else:
            heads = self._expanded(q_nope, q_rope, latent, k_rope, keep)
        return self.o_proj(merge_heads(heads))  # (B, T, D)

    def _queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Every head's query, split into its part without positions and
        its rotary part: (B, H, T, d_N), (B, H, T, d_R) (not yet turned)."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)  # (B, T, H (d_N + d_R))
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = split_heads(q, self.qk_head_dim)  # (B, H, T, d_N + d_R)
        return q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.rope_interleave:
            return rotate_interleaved(x, cos, sin)
        return rotate_pairs(x, cos, sin)

    def _up_projections(self) -> tuple[Tensor, Tensor]:
        """``W_UK`` (H, d_N, r) and ``W_UV`` (H, d_v, r), out of
        ``kv_b_proj.weight`` (H (d_N + d_v), r)."""
        w = self.kv_b_proj.weight.unflatten(0, (self.num_heads, -1))
        return w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)

    def _expanded(
        self,
        q_nope: Tensor,
        q_rope: Tensor,
        latent: Tensor,
        k_rope: Tensor,
        keep: Tensor,
    ) -> Tensor:
        """The naive path: every head's keys and values built from the
        latents of all T_k tokens, then ordinary attention."""
        kv = split_heads(
            self.kv_b_proj(latent), self.qk_nope_head_dim + self.v_head_dim
        )  # (B, H, T_k, d_N + d_v)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], -1)
        k_rope = k_rope[:, None].expand(-1, self.num_heads, -1, -1)
        k = torch.cat((k_nope, k_rope), dim=-1)  # (B, H, T_k, d_N + d_R)
        q = torch.cat((q_nope, q_rope), dim=-1)  # (B, H, T, d_N + d_R)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=keep,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.scaling,
        )  # (B, H, T, d_v)

    def _absorbed(
        self,
        q_nope: Tensor,
        q_rope: Tensor,
        latent: Tensor,
        k_rope: Tensor,
        keep: Tensor,
    ) -> Tensor:
        """The absorbed path: ``q_nope . (W_UK c) = (W_UK^T q_nope) . c``,
        so scores are taken against the latents ``c`` themselves, and the
        weighted sum of latents is turned into values by ``W_UV`` once per
        query, not once per cached token."""
        w_uk, w_uv = self._up_projections()  # (H, d_N, r), (H, d_v, r)
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)  # (B,H,T,r)
        scores = torch.einsum("bhtr,bsr->bhts", q_latent, latent)
        scores = scores + torch.einsum("bhtd,bsd->bhts", q_rope, k_rope)
        scores = (scores * self.scaling).masked_fill(~keep, -math.inf)
        weights = torch.softmax(scores, dim=-1)  # (B, H, T, T_k)
        weights = F.dropout(weights, self.dropout, self.training)
        mixed = torch.einsum("bhts,bsr->bhtr", weights, latent)  # (B,H,T,r)
        return torch.einsum("bhtr,hvr->bhtv", mixed, w_uv)  # (B, H, T, d_v)

    def _check_forward(
        self, x: object, positions: object, cache: object
    ) -> None:
        check_tensor("x", x, ndim=3, shape="(B, T, D)")
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"x must have shape (B, T, D) with D = {self.hidden_size}, "
                f"got shape {tuple(x.shape)}"
            )
        B, T, _ = x.shape
        if positions is not None:
            check_positions(positions, B, T)
            if positions.numel() and int(positions.min()) < 0:
                raise ValueError(
                    f"positions must be >= 0, got {int(positions.min())}"
                )
        if cache is not None:
            if not isinstance(cache, LatentKVCache):
                raise TypeError(
                    "cache must be a LatentKVCache, got "
                    f"{type(cache).__name__}"
                )
            want = (self.kv_lora_rank, self.qk_rope_head_dim)
            got = (cache.kv_lora_rank, cache.qk_rope_head_dim)
            if got != want:
                raise ValueError(
                    "cache must hold (kv_lora_rank, qk_rope_head_dim) = "
                    f"{want}, the layer's, got {got}"
                )
            cache.check_update(B, T, x.dtype, x.device)


def _causal(start: int, t_q: int, t_k: int, device: torch.device) -> Tensor:
    """(T_q, T_k) bool: query ``i`` at slot ``start + i`` sees keys up to
    its own slot (bottom-right aligned when ``T_k = start + T_q``)."""
    slots = torch.arange(t_k, device=device)  # (T_k,)
    query_slots = start + torch.arange(t_q, device=device)  # (T_q,)
    return slots[None, :] <= query_slots[:, None]


class LatentKVCache:
    """The latents and rotated shared keys of the tokens so far.

    ``latents`` (B, max_len, r) and ``keys`` (B, max_len, d_R), allocated
    once and written in place: ``r + d_R`` numbers per token, whatever the
    number of heads (the protocol of :mod:`mha.caches`, ``update``, ``len``,
    ``seen``, ``reset``, ``truncate``, ``check_update``, ``max_len``, with
    the latent and the shared key in place of k and v; the count of written
    positions is a tensor, ``length``).
    """

    def __init__(
        self,
        batch: int,
        max_len: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        self.batch = check_int("batch", batch)
        self.max_len = check_int("max_len", max_len)
        self.kv_lora_rank = check_int("kv_lora_rank", kv_lora_rank)
        self.qk_rope_head_dim = check_int("qk_rope_head_dim", qk_rope_head_dim)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(
                f"dtype must be a floating torch.dtype, got {dtype!r}"
            )
        self.latents = torch.zeros(
            batch, max_len, kv_lora_rank, dtype=dtype, device=device
        )
        self.keys = torch.zeros(
            batch, max_len, qk_rope_head_dim, dtype=dtype, device=device
        )
        self.dtype, self.device = dtype, self.latents.device
        self.length = torch.zeros((), dtype=torch.int64, device=self.device)

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (both tensors, every slot)."""
        return self.latents.nbytes + self.keys.nbytes

    def update(self, latent: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        """Write latent (B, T, r) and key (B, T, d_R) after the cached ones;
        return everything written so far, (B, T_k, r) and (B, T_k, d_R)."""
        for name, t, width in (
            ("latent", latent, self.kv_lora_rank),
            ("key", key, self.qk_rope_head_dim),
        ):
            check_tensor(name, t, ndim=3, shape=f"(B, T, {width})")
            if t.shape[0] != self.batch or t.shape[2] != width:
                raise ValueError(
                    f"{name} must have shape (B, T, {width}) with B = "
                    f"{self.batch}, the cache's, got shape {tuple(t.shape)}"
                )
        if latent.shape[1] != key.shape[1]:
            raise ValueError(
                "latent and key must hold the same tokens T, got "
                f"{latent.shape[1]} and {key.shape[1]}"
            )
        if key.dtype != latent.dtype or key.device != latent.device:
            raise TypeError(
                "latent and key must have one dtype and device, got "
                f"{latent.dtype} on {latent.device} and {key.dtype} on "
                f"{key.device}"
            )
        T = latent.shape[1]
        self.check_update(self.batch, T, latent.dtype, latent.device)
        slots = self.length + torch.arange(T, device=self.device)  # (T,)
        self.latents.index_copy_(1, slots, latent)
        self.keys.index_copy_(1, slots, key)
        self.length += T
        end = len(self)
        return self.latents[:, :end], self.keys[:, :end]

    def __len__(self) -> int:
        return int(self.length)

    @property
    def seen(self) -> int:
        """Positions written so far: ``len(cache)`` (this cache forgets
        nothing), the position of the next token."""
        return len(self)

    def reset(self) -> None:
        """Forget every cached token (the memory stays allocated)."""
        self.length.zero_()

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens and forget the rest."""
        length = check_int("length", length, minimum=0)
        if length > len(self):
            raise ValueError(
                f"length must be at most len(cache) = {len(self)}, "
                f"got {length}"
            )
        self.length.fill_(length)

    def check_update(
        self,
        batch: int,
        new_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Raise ValueError/TypeError if such an update cannot be written."""
        if dtype != self.dtype:
            raise TypeError(
                f"the new latents must have the cache's dtype {self.dtype}, "
                f"got {dtype}"
            )
        if torch.device(device) != self.device:
            raise ValueError(
                f"the new latents must be on the cache's device "
                f"{self.device}, got {device}"
            )
        if batch != self.batch:
            raise ValueError(
                f"the new latents must have B = {self.batch}, the cache's, "
                f"got {batch}"
            )
        if len(self) + new_tokens > self.max_len:
            raise ValueError(
                f"the cache has room for max_len = {self.max_len} tokens "
                f"and holds {len(self)}: {new_tokens} new tokens do not fit"
            )


def reference_weights(
    layer: MultiHeadLatentAttention,
) -> dict[str, np.ndarray]:
    """The layer's parameters for the NumPy twin: ``transformers``' names,
    each matrix in the reference's layout ``(d_in, d_out)`` (``x @ w``, the
    transpose of ``nn.Linear``'s), norms' weights and biases as vectors."""
    weights = {}
    for name, value in layer.state_dict().items():
        array = value.detach().cpu().numpy()
        if name.endswith(".weight") and array.ndim == 2:
            array = array.T
        weights[name] = array
    return weights
