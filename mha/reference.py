"""NumPy reference for scaled dot-product and multi-head attention.

Everything here is plain NumPy, written to be read: each public function is the
math, and the argument checks live in ``_check_*`` helpers below it.
Conventions (see the notation appendix):

* Row vectors: a token is a row, a projection is ``x @ w`` with ``w`` of shape
  ``(d_in, d_out)``. (``torch.nn.Linear`` stores the transpose,
  ``(d_out, d_in)``.)
* Shapes: ``B`` batch, ``T`` sequence length (``T_q`` queries, ``T_k`` keys),
  ``D`` = d_model, ``H`` heads, ``d_k = D / H``.
* Boolean masks: ``True`` = this query may attend to this key.
  (``torch.nn.MultiheadAttention`` uses the opposite convention; chapter 07
  puts the two side by side.)
* A query row whose keys are all masked gets zero weights and a zero output,
  never NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._validate import (
    check_choice,
    check_divisible,
    check_int,
    check_positive,
)

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
    "sliding_window_mask",
    "sink_window_mask",
    "document_mask",
    "prefix_lm_mask",
    "alibi_slopes",
    "alibi_bias",
    "softcap",
    "attention_with_score_mod",
    "attention_with_sinks",
    "multi_head_latent_attention",
]

Array = NDArray[np.floating]


def softmax(x: ArrayLike, axis: int = -1) -> Array:
    """Numerically stable softmax along ``axis``.

    Subtracting the row maximum before ``exp`` changes nothing mathematically
    (softmax is invariant to adding a constant) but keeps ``exp`` from
    overflowing. Entries equal to ``-inf`` get weight 0; a slice that is
    entirely ``-inf`` (a fully masked row) gives all zeros instead of NaN.
    """
    x = _check_scores(x)
    row_max = np.max(x, axis=axis, keepdims=True)
    # an all -inf row: avoid -inf - -inf
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
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
) -> tuple[Array, Array]:
    """softmax(q k^T / sqrt(d_k)) v, for any number of leading batch/head axes.

    Args:
        q: queries, shape ``(..., T_q, d_k)``.
        k: keys, shape ``(..., T_k, d_k)``.
        v: values, shape ``(..., T_k, d_v)``.
        mask: optional boolean array broadcastable to ``(..., T_q, T_k)``;
            ``True`` = the query may attend to the key.
        scale: factor applied to the dot products; default ``1 / sqrt(d_k)``.

    Returns:
        ``(output, weights)`` with shapes ``(..., T_q, d_v)`` and
        ``(..., T_q, T_k)``.
    """
    q, k, v, mask = check_attention_inputs(q, k, v, mask)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    scores = (q @ np.swapaxes(k, -1, -2)) * scale  # (..., T_q, T_k)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)  # a blocked key gets weight 0
    weights = softmax(scores, axis=-1)  # (..., T_q, T_k)
    return weights @ v, weights  # (..., T_q, d_v), (..., T_q, T_k)


def split_heads(x: ArrayLike, num_heads: int) -> Array:
    """(..., T, D) -> (..., H, T, D / H).

    Cut the feature axis into heads, then move heads forward.
    """
    x = _check_array("x", x, min_ndim=2, shape_text="(..., T, D)")
    *lead, t, d = x.shape
    d_k = _check_heads("the last dimension of x", d, num_heads)
    heads = x.reshape(*lead, t, num_heads, d_k)  # (..., T, H, d_k)
    return np.swapaxes(heads, -3, -2)  # (..., H, T, d_k)


def merge_heads(x: ArrayLike) -> Array:
    """(..., H, T, d_k) -> (..., T, H * d_k).

    The inverse of :func:`split_heads`.
    """
    x = _check_array("x", x, min_ndim=3, shape_text="(..., H, T, d_k)")
    *lead, h, t, d_k = x.shape
    # (..., T, H, d_k) -> (..., T, D)
    return np.swapaxes(x, -3, -2).reshape(*lead, t, h * d_k)


def multi_head_attention_loop(
    x: ArrayLike,
    w_q_heads: Sequence[ArrayLike],
    w_k_heads: Sequence[ArrayLike],
    w_v_heads: Sequence[ArrayLike],
    w_o: ArrayLike,
    mask: ArrayLike | None = None,
) -> tuple[Array, Array]:
    """Multi-head self-attention, one head at a time.

    This is the form the definition is written in.

    Args:
        x: inputs, shape ``(T, D)`` or ``(B, T, D)``.
        w_q_heads, w_k_heads, w_v_heads: one matrix per head, each ``(D, d_k)``
            (``(D, d_v)`` for values).
        w_o: output projection, shape ``(H * d_v, D_out)``.
        mask: optional boolean mask broadcastable to ``(..., H, T, T)``;
            True = may attend.

    Returns:
        ``(output, weights)`` with shapes ``(..., T, D_out)`` and
        ``(..., H, T, T)``.
    """
    x, w_q_heads, w_k_heads, w_v_heads, w_o, head_masks = _check_loop_inputs(
        x, w_q_heads, w_k_heads, w_v_heads, w_o, mask
    )
    outputs, weights = [], []
    for w_q_i, w_k_i, w_v_i, mask_i in zip(
        w_q_heads, w_k_heads, w_v_heads, head_masks
    ):
        # (..., T, d_k), (..., T, d_k), (..., T, d_v)
        q_i, k_i, v_i = x @ w_q_i, x @ w_k_i, x @ w_v_i
        out_i, weights_i = scaled_dot_product_attention(q_i, k_i, v_i, mask_i)
        outputs.append(out_i)  # (..., T, d_v)
        weights.append(weights_i)  # (..., T, T)
    concat = np.concatenate(outputs, axis=-1)  # (..., T, H * d_v)
    # (..., T, D_out), (..., H, T, T)
    return concat @ w_o, np.stack(weights, axis=-3)


def multi_head_cross_attention(
    x_q: ArrayLike,
    x_kv: ArrayLike,
    w_q: ArrayLike,
    w_k: ArrayLike,
    w_v: ArrayLike,
    w_o: ArrayLike,
    num_heads: int,
    mask: ArrayLike | None = None,
) -> tuple[Array, Array]:
    """Multi-head attention: queries from ``x_q``, keys/values from ``x_kv``.

    The fused form: one projection per role, then reshape and transpose to put
    heads on their own axis, so all heads run in one batched matrix product.

    Args:
        x_q: query inputs, shape ``(T_q, D_q)`` or ``(B, T_q, D_q)``.
        x_kv: key/value inputs, shape ``(T_k, D_kv)`` or ``(B, T_k, D_kv)``.
        w_q: ``(D_q, D)``; w_k, w_v: ``(D_kv, D)``; w_o: ``(D, D_out)``.
            D must be divisible by num_heads.
        num_heads: H.
        mask: optional boolean mask broadcastable to ``(..., H, T_q, T_k)``;
            True = may attend.

    Returns:
        ``(output, weights)`` with shapes ``(..., T_q, D_out)`` and
        ``(..., H, T_q, T_k)``.
    """
    x_q, x_kv, w_q, w_k, w_v, w_o = _check_projection_inputs(
        ("x_q", x_q), ("x_kv", x_kv), w_q, w_k, w_v, w_o, num_heads
    )
    q = split_heads(x_q @ w_q, num_heads)  # (..., H, T_q, d_k)
    k = split_heads(x_kv @ w_k, num_heads)  # (..., H, T_k, d_k)
    v = split_heads(x_kv @ w_v, num_heads)  # (..., H, T_k, d_k)
    # (..., H, T_q, d_k)
    heads, weights = scaled_dot_product_attention(q, k, v, mask)
    # (..., T_q, D_out), (..., H, T_q, T_k)
    return merge_heads(heads) @ w_o, weights


def multi_head_attention(
    x: ArrayLike,
    w_q: ArrayLike,
    w_k: ArrayLike,
    w_v: ArrayLike,
    w_o: ArrayLike,
    num_heads: int,
    mask: ArrayLike | None = None,
) -> tuple[Array, Array]:
    """Multi-head self-attention, fused.

    This is :func:`multi_head_cross_attention` with ``x_q = x_kv = x``.

    Args:
        x: inputs, shape ``(T, D)`` or ``(B, T, D)``.
        w_q, w_k, w_v: ``(D, D)`` projections (head i uses columns
            ``i*d_k:(i+1)*d_k``); w_o: ``(D, D_out)``.
        num_heads: H; D must be divisible by H.
        mask: optional boolean mask broadcastable to ``(..., H, T, T)``;
            True = may attend.

    Returns:
        ``(output, weights)`` with shapes ``(..., T, D_out)`` and
        ``(..., H, T, T)``.
    """
    # errors name x
    _check_projection_inputs(("x", x), ("x", x), w_q, w_k, w_v, w_o, num_heads)
    return multi_head_cross_attention(
        x, x, w_q, w_k, w_v, w_o, num_heads, mask
    )


def causal_mask(
    t_q: int, t_k: int | None = None, *, align: str = "top-left"
) -> NDArray[np.bool_]:
    """Boolean (T_q, T_k) causal mask, True where a query may attend to a key.

    ``align="top-left"``: query i may attend to keys 0..i, the convention of
    ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``.
    ``align="bottom-right"``: query i may attend to keys 0..i + (T_k - T_q), so
    the last query sees every key: the T_q newest tokens of a sequence whose
    first T_k - T_q tokens came before (decoding with a key/value cache). The
    two agree when T_q = T_k.
    """
    t_q = check_int("t_q", t_q)
    t_k = t_q if t_k is None else check_int("t_k", t_k)
    check_choice("align", align, ("top-left", "bottom-right"))
    offset = t_k - t_q if align == "bottom-right" else 0
    return np.tril(np.ones((t_q, t_k), dtype=bool), k=offset)


def padding_mask(lengths: ArrayLike, max_len: int) -> NDArray[np.bool_]:
    """Boolean (B, max_len) mask, True at real tokens and False at padding.

    Sequence b has ``lengths[b]`` real tokens, then padding. For attention over
    keys, expand the mask to ``mask[:, None, None, :]``, shape (B, 1, 1, T_k):
    the same keys are hidden from every head and every query.
    """
    lengths = _check_lengths(lengths, max_len)
    return np.arange(max_len)[None, :] < lengths[:, None]


# -----------------------------------------------------------------------------
# Attention variants, dense: the twins of mha.variants' mask and score
# functions. Query i and key j are indices into q and k.


def sliding_window_mask(
    t_q: int, t_k: int | None = None, *, window: int
) -> NDArray[np.bool_]:
    """Boolean (T_q, T_k) mask: query i sees keys j with i - window < j <= i.

    The causal mask cut to the last ``window`` keys (the query's own key
    included), as in Mistral 7B and Gemma 2's local layers.
    """
    t_q = check_int("t_q", t_q)
    t_k = t_q if t_k is None else check_int("t_k", t_k)
    window = check_int("window", window)
    distance = np.arange(t_q)[:, None] - np.arange(t_k)[None, :]  # i - j
    return (distance >= 0) & (distance < window)


def sink_window_mask(
    t_q: int, t_k: int | None = None, *, window: int, sinks: int
) -> NDArray[np.bool_]:
    """A sliding window that also keeps the first ``sinks`` keys.

    Query i sees keys j <= i with i - window < j or j < sinks: StreamingLLM's
    attention sinks (Xiao et al. 2024), which keep the first tokens that
    trained models give much weight to, and a window of the newest.
    """
    window_keys = sliding_window_mask(t_q, t_k, window=window)
    t_k = window_keys.shape[1]
    sinks = check_int("sinks", sinks, minimum=0)
    first = np.arange(t_k)[None, :] < sinks  # (1, T_k)
    return window_keys | (first & causal_mask(t_q, t_k))


def document_mask(doc_ids: ArrayLike) -> NDArray[np.bool_]:
    """Boolean (T, T) mask for documents packed into one row of T tokens.

    ``doc_ids[t]`` names the document of token t; query i sees key j when
    both belong to the same document and j <= i.
    """
    doc_ids = _check_doc_ids(doc_ids)
    same = doc_ids[:, None] == doc_ids[None, :]
    return same & causal_mask(len(doc_ids))


def prefix_lm_mask(
    t_q: int, t_k: int | None = None, *, prefix_len: int
) -> NDArray[np.bool_]:
    """Boolean (T_q, T_k) mask: every query sees the prefix, causal after it.

    Key j is visible to query i when j < prefix_len or j <= i (a prefix
    language model: the prompt is read both ways, the rest left to right).
    """
    t_q = check_int("t_q", t_q)
    t_k = t_q if t_k is None else check_int("t_k", t_k)
    prefix_len = check_int("prefix_len", prefix_len, minimum=0)
    in_prefix = np.arange(t_k)[None, :] < prefix_len  # (1, T_k)
    return in_prefix | causal_mask(t_q, t_k)


def alibi_slopes(num_heads: int) -> Array:
    """ALiBi's slope of each head, shape (H,) (Press et al. 2022).

    For H a power of two: 2^(-8h/H) for h = 1 .. H. Otherwise the slopes of
    the largest power of two n < H, then every second slope of 2n: the rule
    of the authors' code (and of BLOOM and transformers), not in order; the
    paper's formula would keep 2^(-8h/H) for every H.
    """
    num_heads = check_int("num_heads", num_heads)
    n = 2 ** int(np.floor(np.log2(num_heads)))  # largest power of 2 <= H
    slopes = 2.0 ** (-8.0 * np.arange(1, n + 1) / n)
    if n == num_heads:
        return slopes
    extra = 2.0 ** (-8.0 * np.arange(1, 2 * n + 1) / (2 * n))[::2]
    return np.concatenate([slopes, extra[: num_heads - n]])


def alibi_bias(num_heads: int, t_q: int, t_k: int | None = None) -> Array:
    """ALiBi's bias added to the scores, (H, T_q, T_k): slope_h * (j - i).

    Zero on the diagonal, more negative the further key j lies behind
    query i; no position is added to the inputs.
    """
    t_q = check_int("t_q", t_q)
    t_k = t_q if t_k is None else check_int("t_k", t_k)
    offset = np.arange(t_k)[None, :] - np.arange(t_q)[:, None]  # j - i
    return alibi_slopes(num_heads)[:, None, None] * offset  # (H, T_q, T_k)


def softcap(scores: ArrayLike, cap: float) -> Array:
    """cap * tanh(scores / cap): scores squashed smoothly into (-cap, cap).

    Near zero it changes nothing (tanh(x) ~ x); Gemma 2 caps its attention
    scores at 50.
    """
    cap = check_positive("cap", cap)
    return cap * np.tanh(_as_float_array("scores", scores) / cap)


def attention_with_score_mod(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    score_mod: Callable[[Array], Array] | None = None,
    scale: float | None = None,
) -> tuple[Array, Array]:
    """:func:`scaled_dot_product_attention` with the scores changed first.

    ``score_mod`` takes the scaled scores, (..., T_q, T_k), and returns new
    ones of the same shape (``lambda s: s + alibi_bias(H, T_q, T_k)``,
    ``lambda s: softcap(s, 50.0)``); the mask is applied after it, as
    FlexAttention applies its ``mask_mod`` after its ``score_mod``.
    Returns ``(output, weights)``, (..., T_q, d_v) and (..., T_q, T_k).
    """
    q, k, v, mask = check_attention_inputs(q, k, v, mask)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    scores = (q @ np.swapaxes(k, -1, -2)) * scale  # (..., T_q, T_k)
    if score_mod is not None:
        scores = _check_modified(score_mod(scores), scores.shape)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)  # a blocked key gets weight 0
    weights = softmax(scores, axis=-1)  # (..., T_q, T_k)
    return weights @ v, weights  # (..., T_q, d_v), (..., T_q, T_k)


def attention_with_sinks(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    sinks: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
) -> tuple[Array, Array]:
    """Attention with a learned sink per head (gpt-oss): one more logit in
    every row's softmax, which takes weight and gives no value.

    q (..., H, T_q, d_k), k (..., H, T_k, d_k), v (..., H, T_k, d_v);
    ``sinks`` (H,): head h's sink logit ``s_h``. The weights are
    ``exp(score_ij) / (exp(s_h) + sum_j exp(score_ij))``: they sum to less
    than 1, and what is missing went to the sink. A row whose keys are all
    masked gives zeros. Returns ``(output, weights)``, (..., H, T_q, d_v)
    and (..., H, T_q, T_k) (the sink's column dropped).
    """
    q, k, v, mask = check_attention_inputs(q, k, v, mask)
    sinks = _check_sinks(sinks, q.shape)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    scores = (q @ np.swapaxes(k, -1, -2)) * scale  # (..., H, T_q, T_k)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    sink_column = np.broadcast_to(
        sinks[:, None, None], scores.shape[:-1] + (1,)
    )  # (..., H, T_q, 1)
    weights = softmax(np.concatenate((scores, sink_column), -1), axis=-1)
    weights = weights[..., :-1]  # the sink's share is dropped: no value
    return weights @ v, weights  # (..., H, T_q, d_v), (..., H, T_q, T_k)


# -----------------------------------------------------------------------------
# Multi-head latent attention (DeepSeek-V2/V3): the twin of mha.latent.


def multi_head_latent_attention(
    x: ArrayLike,
    weights: Mapping[str, ArrayLike],
    *,
    num_heads: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    frequencies: ArrayLike | None = None,
    rope_scaling: float = 1.0,
    interleave: bool = True,
    scale: float | None = None,
    eps: float = 1e-6,
) -> tuple[Array, Array]:
    """Causal multi-head latent attention over x (T, D) or (B, T, D).

    ``weights`` maps ``transformers``' parameter names to arrays, matrices
    in this module's layout ``(d_in, d_out)``: ``q_proj.weight``, or
    ``q_a_proj.weight`` (+ ``.bias``), ``q_a_layernorm.weight`` and
    ``q_b_proj.weight``; ``kv_a_proj_with_mqa.weight`` (+ ``.bias``),
    ``kv_a_layernorm.weight``, ``kv_b_proj.weight``, ``o_proj.weight``
    (+ ``.bias``). The latent ``c`` (r wide) is the first r outputs of
    ``kv_a_proj_with_mqa``, RMS-normalized; the rest is the shared key
    ``k_R`` (d_R wide), rotated like every head's ``q_R`` by position ``t``
    and pair ``i`` through the angle ``t * frequencies[i]`` (default
    ``10000^(-2i/d_R)``), cos and sin times ``rope_scaling``; pairs are
    neighbours ``(2i, 2i+1)`` when ``interleave``, else ``(i, i + d_R/2)``.
    Head h's key is ``[c W_UK_h | k_R]``, its value ``c W_UV_h``. ``scale``
    defaults to ``1 / sqrt(d_N + d_R)``. Returns ``(output, weights)``,
    (..., T, D) and (..., H, T, T).
    """
    x = _check_inputs("x", x)
    w = {name: _as_float_array(name, value) for name, value in weights.items()}
    d_n, d_r = qk_nope_head_dim, qk_rope_head_dim
    rank = _check_latent_weights(w, num_heads, d_n, d_r, v_head_dim)
    t = x.shape[-2]

    def linear(name: str, inputs: Array) -> Array:
        return inputs @ w[f"{name}.weight"] + w.get(f"{name}.bias", 0.0)

    def rms_norm(name: str, inputs: Array) -> Array:
        mean_square = np.mean(inputs**2, axis=-1, keepdims=True)
        return inputs / np.sqrt(mean_square + eps) * w[f"{name}.weight"]

    if "q_proj.weight" in w:
        q = linear("q_proj", x)
    else:
        q = linear(
            "q_b_proj", rms_norm("q_a_layernorm", linear("q_a_proj", x))
        )
    q = split_heads(q, num_heads)  # (..., H, T, d_N + d_R)
    compressed = linear("kv_a_proj_with_mqa", x)  # (..., T, r + d_R)
    c = rms_norm("kv_a_layernorm", compressed[..., :rank])  # (..., T, r)
    k_rope = compressed[..., None, :, rank:]  # (..., 1, T, d_R): every head

    if frequencies is None:
        frequencies = 10000.0 ** (-np.arange(0, d_r, 2) / d_r)
    angles = np.arange(t)[:, None] * np.asarray(frequencies)  # (T, d_R/2)
    cos, sin = np.cos(angles) * rope_scaling, np.sin(angles) * rope_scaling

    def rotate(z: Array) -> Array:
        if interleave:  # pairs (2i, 2i+1), returned first halves first
            z1, z2 = z[..., 0::2], z[..., 1::2]
        else:  # pairs (i, i + d_R/2)
            z1, z2 = z[..., : d_r // 2], z[..., d_r // 2 :]
        return np.concatenate((z1 * cos - z2 * sin, z2 * cos + z1 * sin), -1)

    kv = split_heads(c @ w["kv_b_proj.weight"], num_heads)  # (.., H, T, .)
    k_nope, v = kv[..., :d_n], kv[..., d_n:]
    k_rope = np.broadcast_to(rotate(k_rope), k_nope.shape[:-1] + (d_r,))
    k = np.concatenate((k_nope, k_rope), axis=-1)  # (..., H, T, d_N + d_R)
    q = np.concatenate((q[..., :d_n], rotate(q[..., d_n:])), axis=-1)
    if scale is None:
        scale = 1.0 / np.sqrt(d_n + d_r)
    heads, attention = scaled_dot_product_attention(
        q, k, v, causal_mask(t), scale=scale
    )  # (..., H, T, d_v), (..., H, T, T)
    return linear("o_proj", merge_heads(heads)), attention


def _check_latent_weights(
    w: dict[str, Array], num_heads: int, d_n: int, d_r: int, d_v: int
) -> int:
    """The latent width r, after checking that the weights fit together."""
    for name, value in (("num_heads", num_heads), ("v_head_dim", d_v)):
        check_int(name, value)
    check_int("qk_nope_head_dim", d_n, minimum=0)
    if check_int("qk_rope_head_dim", d_r) % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {d_r}")
    query = ["q_proj"] if "q_proj.weight" in w else ["q_a_proj", "q_b_proj"]
    query += [] if "q_proj.weight" in w else ["q_a_layernorm"]
    needed = [*query, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"]
    missing = [f"{n}.weight" for n in [*needed, "o_proj"]]
    missing = [name for name in missing if name not in w]
    if missing:
        raise ValueError(
            f"weights must hold {', '.join(missing)}, got "
            f"{', '.join(sorted(w))}"
        )
    rank = w["kv_a_layernorm.weight"].shape[-1]
    shapes = {
        "kv_a_proj_with_mqa.weight": (None, rank + d_r),
        "kv_b_proj.weight": (rank, num_heads * (d_n + d_v)),
        "o_proj.weight": (num_heads * d_v, None),
        "q_proj.weight" if "q_proj.weight" in w else "q_b_proj.weight": (
            None,
            num_heads * (d_n + d_r),
        ),
    }
    for name, (rows, cols) in shapes.items():
        _check_matrix(name, w[name], rows, cols, f"({rows}, {cols})")
    return rank


# -----------------------------------------------------------------------------
# Argument checks: each raises TypeError / ValueError naming the argument (see
# mha._validate).


def _as_float_array(name: str, value: ArrayLike) -> Array:
    """``value`` as a floating-point array (integers become float64)."""
    array = np.asarray(value)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.number):
        raise TypeError(
            f"{name} must be a numeric array, got dtype {array.dtype}"
        )
    if np.issubdtype(array.dtype, np.complexfloating):
        raise TypeError(f"{name} must be real, got dtype {array.dtype}")
    if not np.issubdtype(array.dtype, np.floating):
        array = array.astype(np.float64)
    return array


def _check_array(
    name: str, value: ArrayLike, *, min_ndim: int, shape_text: str
) -> Array:
    array = _as_float_array(name, value)
    if array.ndim < min_ndim:
        raise ValueError(
            f"{name} must have shape {shape_text} "
            f"(at least {min_ndim} dimensions), got shape {array.shape}"
        )
    return array


def _check_inputs(name: str, value: ArrayLike) -> Array:
    """Layer inputs: ``(T, d)`` or ``(B, T, d)``."""
    x = _as_float_array(name, value)
    if x.ndim not in (2, 3):
        raise ValueError(
            f"{name} must have shape (T, d) or (B, T, d) (2 or 3 dimensions), "
            f"got shape {x.shape} ({x.ndim} dimensions)"
        )
    return x


def _check_heads(what: str, d_model: int, num_heads: int) -> int:
    """d_k = D / H, after checking H and that it divides D."""
    check_int("num_heads", num_heads)
    return check_divisible(f"{what}", d_model, "num_heads", num_heads)


def _check_matrix(
    name: str, w: Array, rows: int | None, cols: int | None, text: str
) -> Array:
    wrong_rows = rows is not None and w.shape[0] != rows
    wrong_cols = cols is not None and w.shape[1] != cols
    if w.ndim != 2 or wrong_rows or wrong_cols:
        raise ValueError(f"{name} must have shape {text}, got shape {w.shape}")
    return w


def _check_scores(x: ArrayLike) -> Array:
    x = _as_float_array("x", x)
    if np.isnan(x).any():
        raise ValueError("x must not contain NaN")
    if np.isposinf(x).any():
        raise ValueError(
            "x must not contain +inf (use -inf to exclude an entry)"
        )
    return x


def _check_sinks(sinks: ArrayLike, q_shape: tuple[int, ...]) -> Array:
    """One finite sink logit per query head: shape (H,)."""
    sinks = _as_float_array("sinks", sinks)
    if q_shape[:-2] == () or sinks.shape != (q_shape[-3],):
        heads = q_shape[-3] if len(q_shape) > 2 else "H"
        raise ValueError(
            f"sinks must have shape (H,) = ({heads},), one logit per query "
            f"head of q (..., H, T_q, d_k) {q_shape}, got shape {sinks.shape}"
        )
    if not np.isfinite(sinks).all():
        raise ValueError("sinks must be finite logits, got inf or NaN")
    return sinks


def check_attention_inputs(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None
) -> tuple[Array, Array, Array, NDArray[np.bool_] | None]:
    """q (..., T_q, d_k), k (..., T_k, d_k), v (..., T_k, d_v) and a mask.

    The mask must be a boolean array that broadcasts to the scores' shape.
    """
    q = _check_array("q", q, min_ndim=2, shape_text="(..., T_q, d_k)")
    k = _check_array("k", k, min_ndim=2, shape_text="(..., T_k, d_k)")
    v = _check_array("v", v, min_ndim=2, shape_text="(..., T_k, d_v)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            "q and k must have the same last dimension d_k, "
            f"got q {q.shape} and k {k.shape}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            "k and v must have the same number of positions T_k, "
            f"got k {k.shape} and v {v.shape}"
        )
    try:
        batch_shape = np.broadcast_shapes(
            q.shape[:-2], k.shape[:-2], v.shape[:-2]
        )
    except ValueError:
        raise ValueError(
            f"the leading (batch/head) axes of q {q.shape}, k {k.shape} "
            f"and v {v.shape} do not broadcast"
        ) from None
    if mask is None:
        return q, k, v, None
    mask = np.asarray(mask)
    if mask.dtype != bool:
        raise TypeError(
            "mask must be a boolean array (True = may attend), "
            f"got dtype {mask.dtype}"
        )
    scores_shape = batch_shape + (q.shape[-2], k.shape[-2])
    try:
        fits = np.broadcast_shapes(mask.shape, scores_shape) == scores_shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"mask must broadcast to the scores' shape {scores_shape} "
            f"(..., T_q, T_k), got shape {mask.shape}"
        )
    return q, k, v, mask


def _check_loop_inputs(
    x: ArrayLike,
    w_q_heads: Sequence[ArrayLike],
    w_k_heads: Sequence[ArrayLike],
    w_v_heads: Sequence[ArrayLike],
    w_o: ArrayLike,
    mask: ArrayLike | None,
) -> tuple[
    Array,
    list[Array],
    list[Array],
    list[Array],
    Array,
    list[NDArray[np.bool_] | None],
]:
    """The inputs of :func:`multi_head_attention_loop`.

    The mask comes back cut into one mask per head.
    """
    x = _check_inputs("x", x)
    w_o = _as_float_array("w_o", w_o)
    num_heads = check_head_lists(w_q_heads, w_k_heads, w_v_heads)
    d_in = x.shape[-1]
    w_q, w_k, w_v = [], [], []
    for i in range(num_heads):
        w_q_i = _check_matrix(
            f"w_q_heads[{i}]",
            _as_float_array(f"w_q_heads[{i}]", w_q_heads[i]),
            d_in,
            None,
            f"({d_in}, d_k)",
        )
        d_k = w_q_i.shape[1]
        w_q.append(w_q_i)
        w_k.append(
            _check_matrix(
                f"w_k_heads[{i}]",
                _as_float_array(f"w_k_heads[{i}]", w_k_heads[i]),
                d_in,
                d_k,
                f"({d_in}, {d_k})",
            )
        )
        w_v.append(
            _check_matrix(
                f"w_v_heads[{i}]",
                _as_float_array(f"w_v_heads[{i}]", w_v_heads[i]),
                d_in,
                None,
                f"({d_in}, d_v)",
            )
        )
    d_concat = sum(w.shape[1] for w in w_v)  # H * d_v
    _check_matrix("w_o", w_o, d_concat, None, f"({d_concat}, D_out)")
    if mask is None:
        return x, w_q, w_k, w_v, w_o, [None] * num_heads
    mask = np.asarray(mask)
    if mask.ndim < 3:  # no head axis: every head gets the same mask
        return x, w_q, w_k, w_v, w_o, [mask] * num_heads
    if mask.shape[-3] not in (1, num_heads):
        raise ValueError(
            "mask's head axis (axis -3) must have size 1 or "
            f"num_heads={num_heads}, got shape {mask.shape}"
        )
    head_masks = [
        np.take(mask, i if mask.shape[-3] > 1 else 0, axis=-3)
        for i in range(num_heads)
    ]
    return x, w_q, w_k, w_v, w_o, head_masks


def check_head_lists(
    w_q_heads: Sequence[ArrayLike],
    w_k_heads: Sequence[ArrayLike],
    w_v_heads: Sequence[ArrayLike],
) -> int:
    """H, after checking that the three lists of per-head matrices match."""
    num_heads = len(w_q_heads)
    if (
        num_heads == 0
        or len(w_k_heads) != num_heads
        or len(w_v_heads) != num_heads
    ):
        raise ValueError(
            "w_q_heads, w_k_heads and w_v_heads must be non-empty lists "
            "of the same length, got lengths "
            f"{len(w_q_heads)}, {len(w_k_heads)} and {len(w_v_heads)}"
        )
    return num_heads


def _check_projection_inputs(
    named_q: tuple[str, ArrayLike],
    named_kv: tuple[str, ArrayLike],
    w_q: ArrayLike,
    w_k: ArrayLike,
    w_v: ArrayLike,
    w_o: ArrayLike,
    num_heads: int,
) -> tuple[Array, Array, Array, Array, Array, Array]:
    """The inputs of the fused forms.

    ``named_q``/``named_kv`` are (name, value) pairs; errors use the names.
    """
    (q_name, x_q), (kv_name, x_kv) = named_q, named_kv
    x_q, x_kv = _check_inputs(q_name, x_q), _check_inputs(kv_name, x_kv)
    if x_q.ndim != x_kv.ndim or (
        x_q.ndim == 3 and x_q.shape[0] != x_kv.shape[0]
    ):
        raise ValueError(
            f"{q_name} and {kv_name} must both be batched with the same "
            "batch size or both unbatched, "
            f"got shapes {x_q.shape} and {x_kv.shape}"
        )
    w_q, w_k, w_v, w_o = (
        _as_float_array(name, w)
        for name, w in (("w_q", w_q), ("w_k", w_k), ("w_v", w_v), ("w_o", w_o))
    )
    _check_matrix(
        "w_q", w_q, x_q.shape[-1], None, f"({x_q.shape[-1]}, d_model)"
    )
    d_model = w_q.shape[1]
    _check_heads("d_model (the second dimension of w_q)", d_model, num_heads)
    d_kv = x_kv.shape[-1]
    _check_matrix("w_k", w_k, d_kv, d_model, f"({d_kv}, {d_model})")
    _check_matrix("w_v", w_v, d_kv, d_model, f"({d_kv}, {d_model})")
    _check_matrix("w_o", w_o, d_model, None, f"({d_model}, D_out)")
    return x_q, x_kv, w_q, w_k, w_v, w_o


def _check_lengths(lengths: ArrayLike, max_len: int) -> NDArray[np.integer]:
    max_len = check_int("max_len", max_len, minimum=0)
    lengths = np.asarray(lengths)
    if not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(
            f"lengths must be an array of ints, got dtype {lengths.dtype}"
        )
    if lengths.ndim != 1:
        raise ValueError(
            f"lengths must be a 1-D array of ints, got shape {lengths.shape}"
        )
    if lengths.size and (lengths.min() < 0 or lengths.max() > max_len):
        raise ValueError(
            f"lengths must lie in [0, max_len={max_len}], "
            f"got {lengths.tolist()}"
        )
    return lengths


def _check_doc_ids(doc_ids: ArrayLike) -> NDArray[np.integer]:
    doc_ids = np.asarray(doc_ids)
    if doc_ids.ndim != 1 or doc_ids.size == 0:
        raise ValueError(
            "doc_ids must be a non-empty 1-D array (T,) of ints, got shape "
            f"{doc_ids.shape}"
        )
    if not np.issubdtype(doc_ids.dtype, np.integer):
        raise TypeError(
            f"doc_ids must be an array of ints, got dtype {doc_ids.dtype}"
        )
    return doc_ids


def _check_modified(scores: ArrayLike, shape: tuple[int, ...]) -> Array:
    """The scores score_mod returned: the shape it was given, no NaN."""
    scores = _as_float_array("score_mod(scores)", scores)
    if scores.shape != shape:
        raise ValueError(
            f"score_mod must return the shape it was given, {shape}, "
            f"got {scores.shape}"
        )
    if np.isnan(scores).any():
        raise ValueError("score_mod(scores) must not contain NaN")
    return scores
