"""The worked example of chapter 04: two heads, three tokens.

The sizes are d_model = 4 and d_k = d_v = 2. Every matrix of the example lives
here, once, so the chapter, the tests and the reader all use the same numbers.
The arrays are read-only; copy one (``W_O.copy()``) to change it.

Conventions (row vectors, as in :mod:`mha.reference`): token ``t`` is row
``X[t]``, ``Q_i = X @ W_Q_HEADS[i]``, ``scores_i = Q_i @ K_i.T``,
``weights_i = softmax(scores_i / sqrt(d_k))`` row by row,
``head_i = weights_i @ V_i``, ``concat = [head_1 | head_2]``,
``output = concat @ W_O``. Python counts heads from 0: ``W_Q_HEADS[0]`` is the
book's W_Q1.

What each matrix picks out of a token ``x = (x0, x1, x2, x3)``:

* head 1: query ``(x0, x1)``, key ``(x1, x0)`` (the same two features,
  swapped), value ``(x0 + x2, 0)``;
* head 2: query ``(x2, x3)``, key ``(x3, x2)``, value ``(0, x0 + x1)``;
* ``W_O`` sends head 1's value feature to output feature 0, head 2's to output
  feature 1, and writes their sum and difference into output features 2 and 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from mha.reference import (
    check_head_lists,
    multi_head_attention,
    multi_head_attention_loop,
    scaled_dot_product_attention,
)

__all__ = [
    "SEQ_LEN",
    "D_MODEL",
    "NUM_HEADS",
    "D_K",
    "X",
    "W_Q_HEADS",
    "W_K_HEADS",
    "W_V_HEADS",
    "W_O",
    "W_Q",
    "W_K",
    "W_V",
    "HeadSteps",
    "WorkedExample",
    "compute",
]


def _frozen(rows: Sequence[Sequence[float]]) -> NDArray[np.float64]:
    """A read-only float64 array.

    Read-only so that no chapter can change the example by accident.
    """
    array = np.array(rows, dtype=np.float64)
    array.flags.writeable = False
    return array


SEQ_LEN = 3  # T: tokens
D_MODEL = 4  # D
NUM_HEADS = 2  # H
D_K = D_MODEL // NUM_HEADS  # 2, also d_v

# The input: three tokens, one per row. (T, D) = (3, 4)
X = _frozen(
    [
        [1, 0, 1, 0],
        [0, 1, 0, 1],
        [1, 1, 0, 0],
    ]
)

# Per-head projections, each (D, d_k) = (4, 2).
W_Q_HEADS = (
    _frozen([[1, 0], [0, 1], [0, 0], [0, 0]]),  # head 1: q = (x0, x1)
    _frozen([[0, 0], [0, 0], [1, 0], [0, 1]]),  # head 2: q = (x2, x3)
)
W_K_HEADS = (
    _frozen([[0, 1], [1, 0], [0, 0], [0, 0]]),  # head 1: k = (x1, x0)
    _frozen([[0, 0], [0, 0], [0, 1], [1, 0]]),  # head 2: k = (x3, x2)
)
W_V_HEADS = (
    _frozen([[1, 0], [0, 0], [1, 0], [0, 0]]),  # head 1: v = (x0 + x2, 0)
    _frozen([[0, 1], [0, 1], [0, 0], [0, 0]]),  # head 2: v = (0, x0 + x1)
)

# Output projection, (H * d_v, D) = (4, 4). Row i says where concat feature i
# goes. Concat features 1 and 2 are zero for every input (W_V1's second column
# and W_V2's first column are zero), so their rows are zero too.
W_O = _frozen(
    [
        # head 1, value feature 0 -> output 0, and + into outputs 2 and 3
        [1, 0, 1, 1],
        [0, 0, 0, 0],  # head 1, value feature 1 (always 0)
        [0, 0, 0, 0],  # head 2, value feature 0 (always 0)
        # head 2, value feature 1 -> output 1, + into output 2, - into output 3
        [0, 1, 1, -1],
    ]
)

# The fused form: head i owns columns i*d_k:(i+1)*d_k. Each is
# (D, H * d_k) = (4, 4).
# W_Q is the identity: Q = X, cut into two halves.
W_Q = _frozen(np.concatenate(W_Q_HEADS, axis=1))
W_K = _frozen(np.concatenate(W_K_HEADS, axis=1))
W_V = _frozen(np.concatenate(W_V_HEADS, axis=1))


@dataclass(frozen=True)
class HeadSteps:
    """Every intermediate of one head, for T tokens.

    Attributes:
        q, k: ``(T, d_k)`` queries and keys, ``X @ W_Q_i`` and ``X @ W_K_i``.
        v: ``(T, d_v)`` values, ``X @ W_V_i``.
        scores: ``(T, T)`` raw dot products ``q @ k.T``; row t = query t,
            column s = key s.
        scaled_scores: ``(T, T)`` ``scores * scale`` (scale = 1 / sqrt(d_k)
            unless chosen).
        weights: ``(T, T)`` row-wise softmax of ``scaled_scores``; each row
            sums to 1.
        output: ``(T, d_v)`` ``weights @ v``.
    """

    q: NDArray[np.float64]
    k: NDArray[np.float64]
    v: NDArray[np.float64]
    scores: NDArray[np.float64]
    scaled_scores: NDArray[np.float64]
    weights: NDArray[np.float64]
    output: NDArray[np.float64]


@dataclass(frozen=True)
class WorkedExample:
    """Every intermediate of the two-head example.

    It also holds the same result from the reference functions.

    Attributes:
        heads: one :class:`HeadSteps` per head (``heads[0]`` is head 1).
        concat: ``(T, H * d_v)`` ``[head_1 | head_2]``.
        output: ``(T, D_out)`` ``concat @ w_o``.
        loop_output, loop_weights: ``(T, D_out)`` and ``(H, T, T)`` from
            :func:`mha.reference.multi_head_attention_loop` with the per-head
            matrices.
        fused_output, fused_weights: ``(T, D_out)`` and ``(H, T, T)`` from
            :func:`mha.reference.multi_head_attention` with the fused
            ``[W_Q1 | W_Q2]`` etc. (``None`` when a non-default scale is
            chosen: the fused form always uses 1 / sqrt(d_k)).
    """

    heads: tuple[HeadSteps, ...]
    concat: NDArray[np.float64]
    output: NDArray[np.float64]
    loop_output: NDArray[np.float64] | None
    loop_weights: NDArray[np.float64] | None
    fused_output: NDArray[np.float64] | None
    fused_weights: NDArray[np.float64] | None

    @property
    def weights(self) -> NDArray[np.float64]:
        """``(H, T, T)``: every head's attention weights, stacked."""
        return np.stack([head.weights for head in self.heads])


def compute(
    x: ArrayLike = X,
    w_q_heads: Sequence[ArrayLike] = W_Q_HEADS,
    w_k_heads: Sequence[ArrayLike] = W_K_HEADS,
    w_v_heads: Sequence[ArrayLike] = W_V_HEADS,
    w_o: ArrayLike = W_O,
    *,
    scale: float | None = None,
) -> WorkedExample:
    """Run the example step by step and keep every intermediate.

    Defaults are the book's matrices; pass others to ask "what if" (an identity
    ``w_o``, a different ``x``, ``scale=1.0`` for no scaling).

    Args:
        x: ``(T, D)`` tokens as rows.
        w_q_heads, w_k_heads: per head ``(D, d_k)``.
        w_v_heads: per head ``(D, d_v)``.
        w_o: ``(H * d_v, D_out)``.
        scale: factor on the dot products; default ``1 / sqrt(d_k)``.

    Returns:
        A :class:`WorkedExample`. Loop and fused results are ``None`` when
        ``scale`` is given (the reference functions always scale by
        ``1 / sqrt(d_k)``).
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"x must have shape (T, D), got shape {x.shape}")
    num_heads = check_head_lists(w_q_heads, w_k_heads, w_v_heads)
    heads = []
    for w_q_i, w_k_i, w_v_i in zip(w_q_heads, w_k_heads, w_v_heads):
        q = x @ np.asarray(w_q_i, dtype=np.float64)  # (T, d_k)
        k = x @ np.asarray(w_k_i, dtype=np.float64)  # (T, d_k)
        v = x @ np.asarray(w_v_i, dtype=np.float64)  # (T, d_v)
        # (T, d_v), (T, T)
        output, weights = scaled_dot_product_attention(q, k, v, scale=scale)
        head_scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
        scores = q @ k.T  # (T, T)
        heads.append(
            HeadSteps(q, k, v, scores, scores * head_scale, weights, output)
        )
    # (T, H * d_v)
    concat = np.concatenate([head.output for head in heads], axis=-1)
    w_o = np.asarray(w_o, dtype=np.float64)
    if w_o.ndim != 2 or w_o.shape[0] != concat.shape[-1]:
        raise ValueError(
            f"w_o must have shape ({concat.shape[-1]}, D_out), "
            f"got shape {w_o.shape}"
        )
    loop = fused = (None, None)
    if scale is None:
        # (T, D_out), (H, T, T)
        loop = multi_head_attention_loop(
            x, w_q_heads, w_k_heads, w_v_heads, w_o
        )
        fused_w = [
            np.concatenate([np.asarray(w) for w in ws], axis=1)
            for ws in (w_q_heads, w_k_heads, w_v_heads)
        ]
        # the fused form needs d_v = d_k
        if len({w.shape[1] for w in fused_w}) == 1:
            # (T, D_out), (H, T, T)
            fused = multi_head_attention(x, *fused_w, w_o, num_heads)
    return WorkedExample(tuple(heads), concat, concat @ w_o, *loop, *fused)
