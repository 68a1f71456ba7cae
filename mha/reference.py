"""NumPy reference implementation of scaled dot-product and multi-head attention.

Everything here is plain NumPy, written to be read. Conventions (see the notation appendix):

* Row vectors: a token is a row, a projection is ``x @ w`` with ``w`` of shape ``(d_in, d_out)``.
  (``torch.nn.Linear`` stores the transpose, ``(d_out, d_in)``.)
* Shapes: ``B`` batch, ``T`` sequence length (``T_q`` queries, ``T_k`` keys), ``D`` = d_model,
  ``H`` heads, ``d_k = D / H``.
* Boolean masks: ``True`` = this query may attend to this key. (``torch.nn.MultiheadAttention``
  uses the opposite convention; chapter 07 puts the two side by side.)
* A query row whose keys are all masked gets zero weights and a zero output, never NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "softmax",
    "scaled_dot_product_attention",
    "split_heads",
    "merge_heads",
    "multi_head_attention_loop",
    "multi_head_attention",
    "multi_head_cross_attention",
    "causal_mask",
    "padding_mask",
]


def _as_float_array(name: str, value: ArrayLike) -> NDArray[np.floating]:
    """Return ``value`` as a floating-point array (integers become float64)."""
    array = np.asarray(value)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.number):
        raise TypeError(f"{name} must be a numeric array, got dtype {array.dtype}")
    if np.issubdtype(array.dtype, np.complexfloating):
        raise TypeError(f"{name} must be real, got dtype {array.dtype}")
    if not np.issubdtype(array.dtype, np.floating):
        array = array.astype(np.float64)
    return array


def _check_ndim(name: str, array: np.ndarray, allowed: Sequence[int], shape_text: str) -> None:
    if array.ndim not in allowed:
        raise ValueError(
            f"{name} must have shape {shape_text} ({' or '.join(map(str, allowed))} dimensions), "
            f"got shape {array.shape} ({array.ndim} dimensions)"
        )


def softmax(x: ArrayLike, axis: int = -1) -> NDArray[np.floating]:
    """Numerically stable softmax along ``axis``.

    Subtracting the row maximum before ``exp`` changes nothing mathematically
    (softmax is invariant to adding a constant) but keeps ``exp`` from overflowing.
    Entries equal to ``-inf`` get weight 0; a slice that is entirely ``-inf``
    (a fully masked row) gives all zeros instead of NaN.
    """
    x = _as_float_array("x", x)
    if np.isnan(x).any():
        raise ValueError("x must not contain NaN")
    if np.isposinf(x).any():
        raise ValueError("x must not contain +inf (use -inf to exclude an entry)")
    row_max = np.max(x, axis=axis, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)  # all -inf row: avoid -inf - -inf
    exps = np.exp(x - row_max)
    totals = np.sum(exps, axis=axis, keepdims=True)
    return np.divide(exps, totals, out=np.zeros_like(exps), where=totals > 0)


def scaled_dot_product_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
) -> tuple[NDArray[np.floating], NDArray[np.floating]]:
    """softmax(q k^T / sqrt(d_k)) v, for any number of leading batch/head axes.

    Args:
        q: queries, shape ``(..., T_q, d_k)``.
        k: keys, shape ``(..., T_k, d_k)``.
        v: values, shape ``(..., T_k, d_v)``.
        mask: optional boolean array broadcastable to ``(..., T_q, T_k)``;
            ``True`` = the query may attend to the key.
        scale: factor applied to the dot products; default ``1 / sqrt(d_k)``.

    Returns:
        ``(output, weights)`` with shapes ``(..., T_q, d_v)`` and ``(..., T_q, T_k)``.
    """
    q = _as_float_array("q", q)
    k = _as_float_array("k", k)
    v = _as_float_array("v", v)
    for name, array, text in (
        ("q", q, "(..., T_q, d_k)"),
        ("k", k, "(..., T_k, d_k)"),
        ("v", v, "(..., T_k, d_v)"),
    ):
        if array.ndim < 2:
            raise ValueError(f"{name} must have shape {text} (at least 2 dimensions), got shape {array.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same last dimension d_k, got q {q.shape} and k {k.shape}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same number of positions T_k, got k {k.shape} and v {v.shape}"
        )
    try:
        batch_shape = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(
            f"the leading (batch/head) axes of q {q.shape}, k {k.shape} and v {v.shape} do not broadcast"
        ) from None

    d_k = q.shape[-1]
    if scale is None:
        scale = 1.0 / np.sqrt(d_k)
    scores = (q @ np.swapaxes(k, -1, -2)) * scale  # (..., T_q, T_k)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != bool:
            raise TypeError(f"mask must be a boolean array (True = may attend), got dtype {mask.dtype}")
        scores_shape = batch_shape + scores.shape[-2:]
        try:
            fits = np.broadcast_shapes(mask.shape, scores_shape) == scores_shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(
                f"mask must broadcast to the scores' shape {scores_shape} (..., T_q, T_k), got shape {mask.shape}"
            )
        scores = np.where(mask, scores, -np.inf)
    weights = softmax(scores, axis=-1)  # (..., T_q, T_k)
    output = weights @ v  # (..., T_q, d_v)
    return output, weights


def split_heads(x: ArrayLike, num_heads: int) -> NDArray[np.floating]:
    """(..., T, D) -> (..., H, T, D / H): cut the feature axis into heads, then move heads forward."""
    x = _as_float_array("x", x)
    if x.ndim < 2:
        raise ValueError(f"x must have shape (..., T, D) (at least 2 dimensions), got shape {x.shape}")
    _check_num_heads(x.shape[-1], num_heads, "the last dimension of x")
    *lead, t, d = x.shape
    heads = x.reshape(*lead, t, num_heads, d // num_heads)  # (..., T, H, d_k)
    return np.swapaxes(heads, -3, -2)  # (..., H, T, d_k)


def merge_heads(x: ArrayLike) -> NDArray[np.floating]:
    """(..., H, T, d_k) -> (..., T, H * d_k): the inverse of :func:`split_heads`."""
    x = _as_float_array("x", x)
    if x.ndim < 3:
        raise ValueError(f"x must have shape (..., H, T, d_k) (at least 3 dimensions), got shape {x.shape}")
    *lead, h, t, d_k = x.shape
    return np.swapaxes(x, -3, -2).reshape(*lead, t, h * d_k)  # (..., T, H, d_k) -> (..., T, D)


def _check_num_heads(d_model: int, num_heads: int, what: str) -> None:
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)):
        raise TypeError(f"num_heads must be an int, got {type(num_heads).__name__}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be at least 1, got {num_heads}")
    if d_model % num_heads != 0:
        raise ValueError(f"{what} ({d_model}) must be divisible by num_heads ({num_heads})")


def _check_matrix(name: str, w: np.ndarray, rows: int | None, cols: int | None, text: str) -> None:
    if w.ndim != 2 or (rows is not None and w.shape[0] != rows) or (cols is not None and w.shape[1] != cols):
        raise ValueError(f"{name} must have shape {text}, got shape {w.shape}")


def _check_inputs(name: str, x: np.ndarray) -> None:
    _check_ndim(name, x, (2, 3), "(T, d) or (B, T, d)")


def multi_head_attention_loop(
    x: ArrayLike,
    w_q_heads: Sequence[ArrayLike],
    w_k_heads: Sequence[ArrayLike],
    w_v_heads: Sequence[ArrayLike],
    w_o: ArrayLike,
    mask: ArrayLike | None = None,
) -> tuple[NDArray[np.floating], NDArray[np.floating]]:
    """Multi-head self-attention, one head at a time: the form the definition is written in.

    Args:
        x: inputs, shape ``(T, D)`` or ``(B, T, D)``.
        w_q_heads, w_k_heads, w_v_heads: one matrix per head, each ``(D, d_k)`` (``(D, d_v)`` for values).
        w_o: output projection, shape ``(H * d_v, D_out)``.
        mask: optional boolean mask broadcastable to ``(..., H, T, T)``; True = may attend.

    Returns:
        ``(output, weights)`` with shapes ``(..., T, D_out)`` and ``(..., H, T, T)``.
    """
    x = _as_float_array("x", x)
    _check_inputs("x", x)
    w_o = _as_float_array("w_o", w_o)
    num_heads = len(w_q_heads)
    if num_heads == 0 or len(w_k_heads) != num_heads or len(w_v_heads) != num_heads:
        raise ValueError(
            "w_q_heads, w_k_heads and w_v_heads must be non-empty lists of the same length, got lengths "
            f"{len(w_q_heads)}, {len(w_k_heads)} and {len(w_v_heads)}"
        )
    d_in = x.shape[-1]
    if mask is not None:
        mask = np.asarray(mask)
        if mask.ndim >= 3:  # a mask with a head axis: give each head its slice
            if mask.shape[-3] not in (1, num_heads):
                raise ValueError(
                    f"mask's head axis (axis -3) must have size 1 or num_heads={num_heads}, got shape {mask.shape}"
                )
            head_masks = [np.take(mask, i if mask.shape[-3] > 1 else 0, axis=-3) for i in range(num_heads)]
        else:
            head_masks = [mask] * num_heads
    outputs, weights = [], []
    for i in range(num_heads):
        w_q_i = _as_float_array(f"w_q_heads[{i}]", w_q_heads[i])
        w_k_i = _as_float_array(f"w_k_heads[{i}]", w_k_heads[i])
        w_v_i = _as_float_array(f"w_v_heads[{i}]", w_v_heads[i])
        _check_matrix(f"w_q_heads[{i}]", w_q_i, d_in, None, f"({d_in}, d_k)")
        _check_matrix(f"w_k_heads[{i}]", w_k_i, d_in, w_q_i.shape[1], f"({d_in}, {w_q_i.shape[1]})")
        _check_matrix(f"w_v_heads[{i}]", w_v_i, d_in, None, f"({d_in}, d_v)")
        q_i, k_i, v_i = x @ w_q_i, x @ w_k_i, x @ w_v_i  # (..., T, d_k), (..., T, d_k), (..., T, d_v)
        out_i, weights_i = scaled_dot_product_attention(
            q_i, k_i, v_i, None if mask is None else head_masks[i]
        )
        outputs.append(out_i)  # (..., T, d_v)
        weights.append(weights_i)  # (..., T, T)
    concat = np.concatenate(outputs, axis=-1)  # (..., T, H * d_v)
    _check_matrix("w_o", w_o, concat.shape[-1], None, f"({concat.shape[-1]}, D_out)")
    return concat @ w_o, np.stack(weights, axis=-3)  # (..., T, D_out), (..., H, T, T)


def multi_head_cross_attention(
    x_q: ArrayLike,
    x_kv: ArrayLike,
    w_q: ArrayLike,
    w_k: ArrayLike,
    w_v: ArrayLike,
    w_o: ArrayLike,
    num_heads: int,
    mask: ArrayLike | None = None,
) -> tuple[NDArray[np.floating], NDArray[np.floating]]:
    """Multi-head attention of queries from ``x_q`` over keys and values from ``x_kv``.

    The fused form: one projection per role, then reshape and transpose to put heads on
    their own axis, so all heads run in one batched matrix product.

    Args:
        x_q: query inputs, shape ``(T_q, D_q)`` or ``(B, T_q, D_q)``.
        x_kv: key/value inputs, shape ``(T_k, D_kv)`` or ``(B, T_k, D_kv)``.
        w_q: ``(D_q, D)``; w_k, w_v: ``(D_kv, D)``; w_o: ``(D, D_out)``. D must be divisible by num_heads.
        num_heads: H.
        mask: optional boolean mask broadcastable to ``(..., H, T_q, T_k)``; True = may attend.

    Returns:
        ``(output, weights)`` with shapes ``(..., T_q, D_out)`` and ``(..., H, T_q, T_k)``.
    """
    x_q = _as_float_array("x_q", x_q)
    x_kv = _as_float_array("x_kv", x_kv)
    _check_inputs("x_q", x_q)
    _check_inputs("x_kv", x_kv)
    if x_q.ndim != x_kv.ndim or (x_q.ndim == 3 and x_q.shape[0] != x_kv.shape[0]):
        raise ValueError(
            f"x_q and x_kv must both be batched with the same batch size or both unbatched, "
            f"got shapes {x_q.shape} and {x_kv.shape}"
        )
    w_q, w_k, w_v, w_o = (_as_float_array(n, w) for n, w in (("w_q", w_q), ("w_k", w_k), ("w_v", w_v), ("w_o", w_o)))
    _check_matrix("w_q", w_q, x_q.shape[-1], None, f"({x_q.shape[-1]}, d_model)")
    d_model = w_q.shape[1]
    _check_num_heads(d_model, num_heads, "d_model (the second dimension of w_q)")
    _check_matrix("w_k", w_k, x_kv.shape[-1], d_model, f"({x_kv.shape[-1]}, {d_model})")
    _check_matrix("w_v", w_v, x_kv.shape[-1], d_model, f"({x_kv.shape[-1]}, {d_model})")
    _check_matrix("w_o", w_o, d_model, None, f"({d_model}, D_out)")

    q = split_heads(x_q @ w_q, num_heads)  # (..., H, T_q, d_k)
    k = split_heads(x_kv @ w_k, num_heads)  # (..., H, T_k, d_k)
    v = split_heads(x_kv @ w_v, num_heads)  # (..., H, T_k, d_k)
    heads, weights = scaled_dot_product_attention(q, k, v, mask)  # (..., H, T_q, d_k), (..., H, T_q, T_k)
    return merge_heads(heads) @ w_o, weights  # (..., T_q, D_out)


def multi_head_attention(
    x: ArrayLike,
    w_q: ArrayLike,
    w_k: ArrayLike,
    w_v: ArrayLike,
    w_o: ArrayLike,
    num_heads: int,
    mask: ArrayLike | None = None,
) -> tuple[NDArray[np.floating], NDArray[np.floating]]:
    """Multi-head self-attention, fused: :func:`multi_head_cross_attention` with ``x_q = x_kv = x``.

    Args:
        x: inputs, shape ``(T, D)`` or ``(B, T, D)``.
        w_q, w_k, w_v: ``(D, D)`` projections (head i uses columns ``i*d_k:(i+1)*d_k``); w_o: ``(D, D_out)``.
        num_heads: H; D must be divisible by H.
        mask: optional boolean mask broadcastable to ``(..., H, T, T)``; True = may attend.

    Returns:
        ``(output, weights)`` with shapes ``(..., T, D_out)`` and ``(..., H, T, T)``.
    """
    try:
        return multi_head_cross_attention(x, x, w_q, w_k, w_v, w_o, num_heads, mask)
    except (ValueError, TypeError) as error:  # speak of x, not x_q / x_kv
        message = str(error).replace("x_q and x_kv", "x").replace("x_q", "x").replace("x_kv", "x")
        raise type(error)(message) from None


def causal_mask(t_q: int, t_k: int | None = None) -> NDArray[np.bool_]:
    """Boolean (T_q, T_k) mask, True on and below the diagonal: query i may attend to keys 0..i.

    Aligned at the top-left corner, as ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``.
    """
    t_k = t_q if t_k is None else t_k
    for name, value in (("t_q", t_q), ("t_k", t_k)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return np.tril(np.ones((t_q, t_k), dtype=bool))


def padding_mask(lengths: ArrayLike, max_len: int) -> NDArray[np.bool_]:
    """Boolean (B, max_len) mask, True at the real tokens of each sequence and False at its padding.

    For attention over keys, expand it to ``mask[:, None, None, :]``, shape (B, 1, 1, T_k):
    the same keys are hidden from every head and every query.
    """
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be a 1-D array of ints, got shape {lengths.shape} and dtype {lengths.dtype}")
    if lengths.size and (lengths.min() < 0 or lengths.max() > max_len):
        raise ValueError(f"lengths must lie in [0, max_len={max_len}], got {lengths.tolist()}")
    return np.arange(max_len)[None, :] < lengths[:, None]
