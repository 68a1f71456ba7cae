"""PyTorch multi-head attention: a drop-in for ``torch.nn.MultiheadAttention``.

:class:`MultiHeadAttention` takes the same arguments with the same defaults,
holds parameters with the same names, shapes and initialisation (so
``load_state_dict`` works in both directions) and returns the same results.
It differs only where torch gives NaN or an unclear error, each on purpose:

* A query row whose keys are all masked gets zero weights and a zero attention
  output, never NaN, in the forward pass and in gradients
  (``torch.nn.MultiheadAttention`` gives NaN there with ``need_weights=True``
  and on its inference fast path).
  The output projection then returns its bias for that row.
* ``is_causal=True`` works without ``attn_mask`` (a causal mask is built);
  torch raises an error there, or ignores the flag on its inference fast
  path. With ``attn_mask`` given, the mask is used as
  given; torch may ignore it, and ours checks its shape.
* Extra keys (``add_bias_kv``, ``add_zero_attn``) stay visible to every query
  under every mask; torch hides them on its ``is_causal`` route through
  ``F.scaled_dot_product_attention`` (``need_weights=False``).
* ``head_mask`` multiplies each head's output, to switch heads off without
  retraining.
* Bad input raises ``ValueError`` / ``TypeError`` naming the argument, where
  torch raises ``AssertionError`` or ``RuntimeError`` from deep inside.

Two paths compute the attention core. ``need_weights=False`` calls
``torch.nn.functional.scaled_dot_product_attention`` (fused kernels, no
``(B, H, T_q, T_k)`` weights kept); ``need_weights=True`` writes out scores,
softmax and weights.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._validate import (
    check_divisible,
    check_int,
    check_probability,
    shape_text,
)
from .functional import (
    attention,
    causal_mask,
    input_projections,
    merge_heads,
    split_heads,
)

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head attention, a drop-in for ``torch.nn.MultiheadAttention``.

    Args:
        embed_dim: D, the model width; the output has D features. Must be
            divisible by ``num_heads``.
        num_heads: H; each head works in ``d_k = D / H`` dimensions.
        dropout: probability of dropping an attention weight (train mode
            only).
        bias: add biases to the input and output projections.
        add_bias_kv: append a learned key ``bias_k`` and value ``bias_v``,
            (1, 1, D) each, to the keys and values of every sequence.
        add_zero_attn: append a key and a value of zeros.
        kdim, vdim: feature sizes of ``key`` and ``value`` (default D). When
            either differs from D, the projections are held separately as
            ``q_proj_weight`` (D, D), ``k_proj_weight`` (D, kdim) and
            ``v_proj_weight`` (D, vdim); otherwise fused in
            ``in_proj_weight`` (3D, D).
        batch_first: inputs and outputs are ``(B, T, D)`` when True,
            ``(T, B, D)`` when False (the default, as in torch). Ignored for
            unbatched ``(T, D)`` inputs. The book passes ``batch_first=True``.
        device, dtype: where and in which floating type to create the
            parameters.

    Forward: ``module(query, key, value, key_padding_mask=None,
    need_weights=True, attn_mask=None, average_attn_weights=True,
    is_causal=False, head_mask=None)`` returns ``(output, weights)``:

    * query ``(B, T_q, D)``, key ``(B, T_k, kdim)``, value ``(B, T_k, vdim)``
      (sequence first if not batch_first; unbatched ``(T, features)`` too);
    * ``key_padding_mask`` ``(B, T_k)``: keys hidden from every query;
      ``attn_mask`` ``(T_q, T_k)`` or ``(B * H, T_q, T_k)``; boolean masks
      say ``True`` = not allowed, float masks are added to the scores;
    * ``is_causal``: query i may attend to keys 0..i only;
    * ``head_mask`` ``(H,)`` or ``(B, H)``: multiplies each head's output
      before the output projection (0 switches a head off);
    * ``output`` ``(B, T_q, D)``; ``weights`` ``(B, T_q, T_k)`` averaged over
      heads or ``(B, H, T_q, T_k)`` per head, after dropout in train mode,
      None when ``need_weights=False``.

    The differences from torch are listed in the module's docstring.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = check_int("embed_dim", embed_dim)
        self.num_heads = check_int("num_heads", num_heads)
        self.head_dim = check_divisible(
            "embed_dim", embed_dim, "num_heads", num_heads
        )
        self.kdim = embed_dim if kdim is None else check_int("kdim", kdim)
        self.vdim = embed_dim if vdim is None else check_int("vdim", vdim)
        self.dropout = check_probability("dropout", dropout)
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        factory = {"device": device, "dtype": dtype}
        self._qkv_same_embed_dim = (
            self.kdim == embed_dim and self.vdim == embed_dim
        )

        # Same parameters, created in the same order, as
        # torch.nn.MultiheadAttention.
        if self._qkv_same_embed_dim:
            # [W_Q; W_K; W_V], stacked: (3D, D)
            self.in_proj_weight = nn.Parameter(
                torch.empty(3 * embed_dim, embed_dim, **factory)
            )
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.q_proj_weight = nn.Parameter(
                torch.empty(embed_dim, embed_dim, **factory)
            )
            self.k_proj_weight = nn.Parameter(
                torch.empty(embed_dim, self.kdim, **factory)
            )
            self.v_proj_weight = nn.Parameter(
                torch.empty(embed_dim, self.vdim, **factory)
            )
            self.register_parameter("in_proj_weight", None)
        if bias:
            # [b_Q; b_K; b_V]
            self.in_proj_bias = nn.Parameter(
                torch.empty(3 * embed_dim, **factory)
            )
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's initialisation: Xavier-uniform weights, zero biases.

        Xavier-uniform applies to the input projection weights; ``out_proj``
        keeps the weight ``nn.Linear`` gave it. Biases start at zero; the extra
        key and value of ``add_bias_kv`` are Xavier-normal.
        """
        for weight in (
            self.in_proj_weight,
            self.q_proj_weight,
            self.k_proj_weight,
            self.v_proj_weight,
        ):
            if weight is not None:
                nn.init.xavier_uniform_(weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        head_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` over ``key`` / ``value``.

        Returns ``(output, weights or None)``; the arguments are described in
        the class docstring.
        """
        batched = self._check_inputs(
            query, key, value, attn_mask, key_padding_mask, head_mask
        )
        self_attention = query is key and key is value  # one projection
        query, key, value = self._batch_first(batched, query, key, value)
        mask = self._prepare_mask(
            query, key, attn_mask, key_padding_mask, is_causal, need_weights
        )

        # 1. Project: queries, keys and values, (B, T, D) each.
        q, k, v = self._in_projection(query, key, value, self_attention)
        k, v = self._extra_keys(k, v)  # add_bias_kv, add_zero_attn
        # 2. Split into heads: (B, H, T, d_k) each.
        q, k, v = (split_heads(x, self.head_dim) for x in (q, k, v))
        # 3. Attend, every head at once: (B, H, T_q, d_k), and the weights.
        heads, weights = self._attend(q, k, v, mask, need_weights, head_mask)
        # 4. Merge the heads: (B, T_q, D).
        merged = merge_heads(heads)
        # 5. Project out: (B, T_q, D).
        output = self.out_proj(merged)
        return self._outputs(output, weights, batched, average_attn_weights)

    def _in_projection(
        self, query: Tensor, key: Tensor, value: Tensor, self_attention: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, features) -> queries, keys and values, (B, T, D) each."""
        D = self.embed_dim
        if self_attention and self._qkv_same_embed_dim:
            # one matrix product for all three: (B, T, 3D)
            qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias)
            return qkv.split(D, dim=-1)  # (B, T, D) each, views
        w_q, w_k, w_v, b_q, b_k, b_v = input_projections(self)
        return (
            F.linear(query, w_q, b_q),
            F.linear(key, w_k, b_k),
            F.linear(value, w_v, b_v),
        )

    def _extra_keys(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append the extra keys and values: (B, T_k, D) -> (B, T_k + n, D).

        ``add_bias_kv`` appends the learned ``bias_k`` / ``bias_v``,
        ``add_zero_attn`` a key and a value of zeros (zero in every head).
        Every query may attend to them: :meth:`_prepare_mask` pads the masks.
        """
        B = k.shape[0]
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(B, 1, -1)], dim=1)
            v = torch.cat([v, self.bias_v.expand(B, 1, -1)], dim=1)
        if self.add_zero_attn:
            k = F.pad(k, (0, 0, 0, 1))  # one more position, all zeros
            v = F.pad(v, (0, 0, 0, 1))
        return k, v

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: _Mask,
        need_weights: bool,
        head_mask: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention on (B, H, T, d_k) heads, by one of two paths.

        ``need_weights=True`` writes out the (B, H, T_q, T_k) weights
        (:func:`attention`); ``need_weights=False`` hands the work to
        ``F.scaled_dot_product_attention``, whose fused kernels never keep the
        weights. Empty rows (no allowed key) give zeros; ``head_mask`` scales
        whole heads (the returned weights are not scaled).
        """
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            heads, weights = attention(
                q, k, v, mask.additive, dropout_p=dropout_p
            )
        else:
            heads = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask.additive,
                dropout_p=dropout_p,
                is_causal=mask.is_causal,
            )
            weights = None
        if mask.row_has_key is not None:
            # rows with no allowed key: zero, not NaN
            heads = heads * mask.row_has_key
            weights = None if weights is None else weights * mask.row_has_key
        if head_mask is not None:  # (1 or B, H, 1, 1): switch heads off
            scale = head_mask.to(heads.dtype).reshape(-1, self.num_heads, 1, 1)
            heads = heads * scale
        return heads, weights

    def _prepare_mask(
        self,
        query: Tensor,
        key: Tensor,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        is_causal: bool,
        need_weights: bool,
    ) -> _Mask:
        """Turn the masks into one additive mask for the scores.

        ``attn_mask`` and ``key_padding_mask`` become one float mask
        (0 = allowed, -inf = blocked), ``(1 or B, 1 or H, T_q, T_k)``. Rows in
        which every key is blocked are unblocked *before* the softmax and
        remembered in ``row_has_key``, so no NaN is ever made; :meth:`_attend`
        zeroes them afterwards. With ``is_causal`` and no other mask, SDPA's
        own causal flag is used instead of a mask, where it can be. The
        extra keys of ``add_bias_kv`` / ``add_zero_attn`` are never masked.
        """
        (B, T_q, _), T_k = query.shape, key.shape[1]
        extra = int(self.bias_k is not None) + int(self.add_zero_attn)
        if is_causal and attn_mask is None:
            if key_padding_mask is None and not need_weights and not extra:
                return _Mask(None, None, is_causal=True)
            # True = blocked
            attn_mask = ~causal_mask(T_q, T_k, device=query.device)
        additive = None
        if attn_mask is not None:
            # a 2-D mask: every head
            per_head = 1 if attn_mask.dim() == 2 else self.num_heads
            additive = _additive(attn_mask, query.dtype).reshape(
                -1, per_head, T_q, T_k
            )
        if key_padding_mask is not None:
            # the same keys are hidden from every head and query
            padding = _additive(key_padding_mask, query.dtype).reshape(
                B, 1, 1, T_k
            )
            additive = padding if additive is None else additive + padding
        if additive is None:
            return _Mask(None, None, is_causal=False)
        additive = F.pad(additive, (0, extra))  # extra keys: always allowed
        # (..., T_q, 1)
        row_has_key = (additive > float("-inf")).any(dim=-1, keepdim=True)
        # softmax never sees a row of -inf
        unblocked = additive.masked_fill(~row_has_key, 0.0)
        return _Mask(unblocked, row_has_key.to(query.dtype), is_causal=False)

    def _batch_first(
        self, batched: bool, *inputs: Tensor
    ) -> tuple[Tensor, ...]:
        """Any accepted input layout -> (B, T, features)."""
        if not batched:
            return tuple(x.unsqueeze(0) for x in inputs)  # (1, T, features)
        if self.batch_first:
            return inputs
        return tuple(x.transpose(0, 1) for x in inputs)  # (B, T, features)

    def _outputs(
        self,
        output: Tensor,
        weights: Tensor | None,
        batched: bool,
        average_attn_weights: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """(B, T_q, D) output, (B, H, T_q, T_k) weights -> caller's layout."""
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (B, T_q, T_k)
        if not batched:
            return output.squeeze(0), (
                None if weights is None else weights.squeeze(0)
            )
        if not self.batch_first:
            output = output.transpose(0, 1)  # (T_q, B, D)
        return output, weights

    def _check_inputs(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        head_mask: Tensor | None,
    ) -> bool:
        """Check the inputs and masks; return whether the input is batched.

        True for batched (3-D) input, False for unbatched (2-D).
        """
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise TypeError(
                    f"{name} must be a torch.Tensor, got {type(x).__name__}"
                )
            if x.is_nested:
                raise TypeError(
                    f"{name} must be a regular tensor, got a nested tensor: "
                    "pad the sequences and pass key_padding_mask"
                )
            if not x.is_floating_point():
                raise TypeError(
                    f"{name} must be a floating-point tensor, "
                    f"got dtype {x.dtype}"
                )
        self._check_dtypes(query, key, value)
        if query.dim() not in (2, 3):
            raise ValueError(
                "query must have 3 dimensions (batched) or 2 (unbatched), "
                f"got shape {tuple(query.shape)}"
            )
        layout = (
            ("(B, T, {})" if self.batch_first else "(T, B, {})")
            if query.dim() == 3
            else "(T, {})"
        )
        for name, x, features, symbol in (
            ("query", query, self.embed_dim, "embed_dim"),
            ("key", key, self.kdim, "kdim"),
            ("value", value, self.vdim, "vdim"),
        ):
            if x.dim() != query.dim() or x.shape[-1] != features:
                expected = layout.format(f"{symbol}={features}")
                like = (
                    ""
                    if name == "query"
                    else f" (like query, {tuple(query.shape)})"
                )
                raise ValueError(
                    f"{name} must have shape {expected}{like}, "
                    f"got shape {tuple(x.shape)}"
                )
        t_axis, b_axis = (1, 0) if self.batch_first else (0, 1)
        if query.dim() == 2:
            t_axis = 0
        elif (
            not query.shape[b_axis] == key.shape[b_axis] == value.shape[b_axis]
        ):
            raise ValueError(
                "query, key and value must have the same batch size, "
                f"got shapes {tuple(query.shape)}, {tuple(key.shape)} "
                f"and {tuple(value.shape)}"
            )
        if key.shape[t_axis] != value.shape[t_axis]:
            raise ValueError(
                "key and value must have the same length T_k, got shapes "
                f"{tuple(key.shape)} and {tuple(value.shape)}"
            )
        batched = query.dim() == 3
        B = query.shape[b_axis] if batched else 1
        T_q, T_k = query.shape[t_axis], key.shape[t_axis]
        self._check_masks(
            attn_mask, key_padding_mask, head_mask, B, T_q, T_k, batched
        )
        return batched

    def _check_dtypes(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        """One floating type for parameters, and inputs outside autocast."""
        parameters = iter(self.named_parameters())
        first_name, first = next(parameters)
        for name, parameter in parameters:
            if parameter.dtype != first.dtype:
                raise TypeError(
                    f"{name} has dtype {parameter.dtype}, but {first_name} "
                    f"has {first.dtype}: give the module one dtype, "
                    "module.to(dtype)"
                )
        if torch.is_autocast_enabled(query.device.type):
            return  # autocast chooses the dtype of each product
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x.dtype != first.dtype:
                raise TypeError(
                    f"{name} has dtype {x.dtype}, but the module's parameters "
                    f"have {first.dtype}"
                )

    def _check_masks(
        self,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        head_mask: Tensor | None,
        B: int,
        T_q: int,
        T_k: int,
        batched: bool,
    ) -> None:
        """Check the masks' types, shapes and values.

        Shapes are checked against B, T_q, T_k and H.
        """
        H = self.num_heads
        if attn_mask is not None:
            stack = "B * num_heads" if batched else "num_heads"
            expected = {
                "(T_q, T_k)": (T_q, T_k),
                f"({stack}, T_q, T_k)": (B * H, T_q, T_k),
            }
            _check_mask("attn_mask", attn_mask, expected)
        if key_padding_mask is not None:
            expected = (
                {"(B, T_k)": (B, T_k)} if batched else {"(T_k,)": (T_k,)}
            )
            _check_mask("key_padding_mask", key_padding_mask, expected)
        if head_mask is not None:
            if (
                not isinstance(head_mask, Tensor)
                or not head_mask.is_floating_point()
            ):
                got = (
                    f"dtype {head_mask.dtype}"
                    if isinstance(head_mask, Tensor)
                    else type(head_mask).__name__
                )
                raise TypeError(
                    "head_mask must be a float tensor of multipliers "
                    f"(1 keeps a head, 0 removes it), got {got}"
                )
            expected = {"(num_heads,)": (H,), "(B, num_heads)": (B, H)}
            if tuple(head_mask.shape) not in expected.values():
                raise ValueError(
                    f"head_mask must have shape {shape_text(expected)}, "
                    f"got shape {tuple(head_mask.shape)}"
                )


class _Mask(NamedTuple):
    """What :meth:`MultiHeadAttention._prepare_mask` hands to the attention.

    ``additive``: float mask added to the scores, (1 or B, 1 or H, T_q, T_k),
    or None. ``row_has_key``: 1 where a query row has an allowed key, 0 where
    it has none, (..., T_q, 1), or None. ``is_causal``: let SDPA apply its own
    causal mask.
    """

    additive: Tensor | None
    row_has_key: Tensor | None
    is_causal: bool


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean mask (True = not allowed) -> 0 / -inf.

    A float mask is already additive.
    """
    if mask.dtype == torch.bool:
        blocked = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return blocked.masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def _check_mask(
    name: str, mask: Tensor, expected: dict[str, tuple[int, ...]]
) -> None:
    """Check one mask.

    A mask must be bool or float, have one of the expected shapes, and hold no
    NaN or +inf.
    """
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"{name} must be a bool tensor (True = not allowed) "
            "or a float tensor (added to the scores), "
            f"got dtype {mask.dtype}"
        )
    if tuple(mask.shape) not in expected.values():
        raise ValueError(
            f"{name} must have shape {shape_text(expected)}, "
            f"got shape {tuple(mask.shape)}"
        )
    # one pass: False for NaN and +inf
    if mask.is_floating_point() and not bool((mask < math.inf).all()):
        raise ValueError(
            f"{name} must not contain NaN or +inf (use -inf to block a key)"
        )
