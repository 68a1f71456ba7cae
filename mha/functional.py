"""PyTorch building blocks that every torch layer of the package shares.

* :func:`split_heads` / :func:`merge_heads`: ``(B, T, D) <-> (B, H, T, d_k)``,
  the one place the head split is written in torch (the NumPy reference has its
  own, :func:`mha.reference.split_heads`).
* :func:`causal_mask`: top-left or bottom-right aligned, the reference's
  mask built in torch.
* :func:`attention`: scaled dot-product attention that returns its weights.
* :func:`reference_weights`: a torch layer's projections in the NumPy
  reference's layout.
* :func:`grouped_query_state_dict`: a torch layer's projections under the
  names of :class:`mha.GroupedQueryAttention` and ``transformers``'
  ``LlamaAttention``.
* :class:`RMSNorm`: the one RMSNorm of the package (a model's layers, Qwen3's
  q/k norms, multi-head latent attention's).

Mask convention for new code: a boolean mask is ``True`` where a query **may
attend** (the reference's and ``F.scaled_dot_product_attention``'s convention);
a float mask is added to the scores. Only :class:`mha.MultiHeadAttention`
speaks ``torch.nn.MultiheadAttention``'s opposite convention
(``True`` = blocked), at its boundary.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._validate import check_choice, check_int, check_tensor

__all__ = [
    "split_heads",
    "merge_heads",
    "causal_mask",
    "attention",
    "input_projections",
    "ReferenceWeights",
    "reference_weights",
    "grouped_query_state_dict",
    "key_start_from_attention_mask",
    "RMSNorm",
]


def split_heads(x: Tensor, head_dim: int) -> Tensor:
    """(..., T, H * d_k) -> (..., H, T, d_k), a view.

    Head i holds features i*d_k ... (i+1)*d_k - 1. The number of heads is
    read from the width (``-1`` in the view), so the same call splits queries
    with H heads and keys with H_kv heads, and a shard holding only some of
    the heads.
    """
    heads = x.view(*x.shape[:-1], -1, head_dim)  # (..., T, H, d_k)
    return heads.transpose(-3, -2)  # (..., H, T, d_k)


def merge_heads(x: Tensor) -> Tensor:
    """(..., H, T, d_k) -> (..., T, H * d_k).

    The inverse of :func:`split_heads`.
    """
    # (..., T, H, d_k) -> (..., T, H * d_k)
    return x.transpose(-3, -2).flatten(-2)


def causal_mask(
    t_q: int,
    t_k: int | None = None,
    *,
    align: str = "top-left",
    device: torch.device | str | None = None,
) -> Tensor:
    """Causal mask (T_q, T_k), ``True`` where a query may attend to a key.

    A boolean tensor on ``device``. ``align="top-left"`` (query i sees keys
    0..i) is ``F.scaled_dot_product_attention``'s ``is_causal``;
    ``align="bottom-right"`` (query i sees keys 0..i + T_k - T_q) is what the
    newest T_q tokens need when T_k - T_q earlier tokens sit in a key/value
    cache. It is :func:`mha.reference.causal_mask` written in torch, built
    on ``device`` (no copy from the host), so that it traces under
    ``torch.compile(fullgraph=True)`` and ``torch.export``.
    """
    t_q = check_int("t_q", t_q)
    t_k = t_q if t_k is None else check_int("t_k", t_k)
    check_choice("align", align, ("top-left", "bottom-right"))
    offset = t_k - t_q if align == "bottom-right" else 0
    ones = torch.ones((t_q, t_k), dtype=torch.bool, device=device)
    return ones.tril(offset)  # (T_q, T_k)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(q k^T * scale + mask) v, returning the output and the weights.

    Args:
        q: (..., T_q, d_k); k: (..., T_k, d_k); v: (..., T_k, d_v).
        mask: optional, broadcastable to (..., T_q, T_k): boolean
            (``True`` = may attend) or float (added to the scores; ``-inf``
            blocks a key).
        dropout_p: probability of dropping a weight (pass 0.0 in evaluation).
        scale: default ``1 / sqrt(d_k)``.

    Returns:
        ``(output, weights)``: (..., T_q, d_v) and (..., T_q, T_k), the weights
        after dropout.
    """
    divisor = math.sqrt(q.shape[-1]) if scale is None else 1.0 / scale
    scores = q @ k.transpose(-2, -1) / divisor  # (..., T_q, T_k)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    # (..., T_q, T_k)
    weights = F.dropout(torch.softmax(scores, dim=-1), p=dropout_p)
    return weights @ v, weights  # (..., T_q, d_v), (..., T_q, T_k)


def input_projections(
    layer: nn.Module,
) -> tuple[
    Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None
]:
    """W_Q, W_K, W_V and b_Q, b_K, b_V of a torch-style attention layer.

    For ``torch.nn.MultiheadAttention`` and :class:`mha.MultiHeadAttention`:
    weights in ``nn.Linear``'s (d_out, d_in) layout, cut from the stacked
    ``in_proj_weight`` (3D, D) or taken from ``q/k/v_proj_weight``; biases cut
    from ``in_proj_bias`` (3D,), or None. Views, not copies.
    """
    D = layer.embed_dim
    if layer.in_proj_weight is not None:
        w_q, w_k, w_v = layer.in_proj_weight.split(D)  # (D, D) each
    else:
        w_q = layer.q_proj_weight  # (D, D)
        w_k = layer.k_proj_weight  # (D, kdim)
        w_v = layer.v_proj_weight  # (D, vdim)
    b_q = b_k = b_v = None
    if layer.in_proj_bias is not None:
        b_q, b_k, b_v = layer.in_proj_bias.split(D)  # (D,) each
    return w_q, w_k, w_v, b_q, b_k, b_v


class ReferenceWeights(NamedTuple):
    """A layer's projections as the NumPy reference writes them.

    Each weight is used as ``x @ w``, with ``w`` of shape (d_in, d_out).
    ``b_q``, ``b_k``, ``b_v``, ``b_o`` are the biases, or None for a layer
    without them.
    """

    w_q: np.ndarray
    w_k: np.ndarray
    w_v: np.ndarray
    w_o: np.ndarray
    b_q: np.ndarray | None
    b_k: np.ndarray | None
    b_v: np.ndarray | None
    b_o: np.ndarray | None


def reference_weights(
    layer: nn.Module, dtype: np.dtype | type | None = None
) -> ReferenceWeights:
    """The projections of a torch attention layer, in the reference's layout.

    ``layer`` is a ``torch.nn.MultiheadAttention`` or
    :class:`mha.MultiHeadAttention`. torch stores ``nn.Linear`` weights as
    (d_out, d_in), the transpose of the reference's (d_in, d_out): each matrix
    is transposed; ``in_proj_weight`` (3D, D) is cut into W_Q, W_K, W_V. The
    arrays are C-ordered copies on the CPU, in ``dtype`` (default: the
    layer's).
    """

    def numpy(t: Tensor | None) -> np.ndarray | None:
        return (
            None
            if t is None
            else np.array(t.detach().cpu().numpy(), dtype=dtype, order="C")
        )

    w_q, w_k, w_v, b_q, b_k, b_v = input_projections(layer)
    out = layer.out_proj
    return ReferenceWeights(
        numpy(w_q.T),
        numpy(w_k.T),
        numpy(w_v.T),
        numpy(out.weight.T),  # (d_in, D), (D, D)
        numpy(b_q),
        numpy(b_k),
        numpy(b_v),
        numpy(out.bias),
    )


def grouped_query_state_dict(layer: nn.Module) -> dict[str, Tensor]:
    """A torch MHA layer's projections under ``LlamaAttention``'s names.

    ``layer``: a ``torch.nn.MultiheadAttention`` or
    :class:`mha.MultiHeadAttention`. Returns a state_dict for
    :class:`mha.GroupedQueryAttention` with
    ``num_kv_heads = num_heads`` (and for ``transformers``' ``LlamaAttention``,
    whose names it shares): ``in_proj_weight`` (3D, D) is cut into
    ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight`` (D, D) each,
    ``out_proj`` becomes ``o_proj``; biases likewise. Both layouts store
    ``nn.Linear`` weights as (d_out, d_in), so nothing is transposed. The
    tensors are copies.
    """
    D = layer.embed_dim
    if getattr(layer, "kdim", D) != D or getattr(layer, "vdim", D) != D:
        raise ValueError(
            "layer must have kdim = vdim = embed_dim (self-attention), got "
            f"kdim={layer.kdim}, vdim={layer.vdim}, embed_dim={D}"
        )
    w_q, w_k, w_v = layer.in_proj_weight.split(D)  # (D, D) each
    state = {
        "q_proj.weight": w_q,
        "k_proj.weight": w_k,
        "v_proj.weight": w_v,
        "o_proj.weight": layer.out_proj.weight,
    }
    if layer.in_proj_bias is not None:
        b_q, b_k, b_v = layer.in_proj_bias.split(D)  # (D,) each
        state.update(
            {
                "q_proj.bias": b_q,
                "k_proj.bias": b_k,
                "v_proj.bias": b_v,
                "o_proj.bias": layer.out_proj.bias,
            }
        )
    return {name: t.detach().clone() for name, t in state.items()}


def key_start_from_attention_mask(attention_mask: Tensor) -> Tensor:
    """A left-padded batch's ``attention_mask`` as one key start per row.

    ``attention_mask`` (B, T_k) holds 1 (or True) for a real token and 0 for
    padding, as transformers takes it; left-padded, each row is zeros then
    ones. Returns (B,) int32: the number of zeros of each row, the first key
    the row's queries may see (``key_start`` of
    :func:`mha.flash.flash_attention_torch` and of the Triton kernels).
    Reads the mask on the host (once per prompt).

    Raises:
        ValueError: a value other than 0 and 1, or a row that is not
            left-padded (a 0 after a 1: right padding, or a hole).
    """
    check_tensor(
        "attention_mask", attention_mask, kind=None, ndim=2, shape="(B, T_k)"
    )
    mask = attention_mask
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)
        if bad.any():
            raise ValueError(
                "attention_mask must hold only 0 and 1, got "
                f"{mask[bad][0].item()}"
            )
        mask = mask != 0
    ones = mask.to(torch.int32)  # (B, T_k)
    drops = ones[:, 1:] < ones[:, :-1]  # (B, T_k - 1): a 1, then a 0
    if drops.any():
        row, position = (int(i) for i in drops.nonzero()[0])
        raise ValueError(
            "attention_mask must be left-padded (zeros, then ones, in every "
            f"row), got a 0 after a 1 in row {row} at position {position + 1}"
        )
    return (mask.shape[1] - ones.sum(dim=1)).to(torch.int32)  # (B,)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last axis, normed in at least float32
    and cast back to x's dtype before the weight (``transformers``'
    ``LlamaRMSNorm`` and ``DeepseekV3RMSNorm``; float64 stays float64)."""

    def __init__(self, size: int, eps: float, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
