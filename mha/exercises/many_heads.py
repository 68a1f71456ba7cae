"""Checkers of many heads: split, merge, multi-head attention."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import reference
from .checker import (
    Array,
    Checker,
    Failed,
    as_array,
    compare,
    expect_shape,
    normal_arrays,
    output_and_weights,
    short,
)
from .one_head import KEEPDIMS, attend

_AXES = {
    (2, 3, 4, 5): "(B, T, H, d_k): the heads' axis is after T; swap the axes "
    "T and H (np.swapaxes(heads, -3, -2))",
    (2, 4, 5, 3): "(B, H, d_k, T): the last two axes are swapped; the heads "
    "are (B, H, T, d_k)",
    (2, 3, 20): "(B, T, D): the heads were not split",
}


def check_split_heads(
    fn: Callable,
    *,
    verbose: bool = True,
    framework: str = "numpy",
    device: Any = None,
) -> None:
    """Check ``fn(x, num_heads)``: (..., T, D) -> (..., H, T, D / H).

    Head h holds columns ``h * d_k`` to ``(h + 1) * d_k - 1`` of every token.
    Catches: a reshape to (B, H, T, d_k) without a transpose; heads taking
    every H-th column; the axes in the wrong order.
    """
    __tracebackhide__ = True  # tracebacks show the caller's line
    checker = Checker("check_split_heads", fn, framework, device=device)
    rng = np.random.default_rng(2)
    # B = 2, T = 3, H = 4, d_k = 5: every axis has its own length
    x = rng.normal(size=(2, 3, 20))
    expected = reference.split_heads(x, 4)

    @checker.item("(B, T, D) = (2, 3, 20) with H = 4 gives (B, H, T, d_k)")
    def _() -> None:
        expect_shape(
            as_array(checker.call(x, 4)), (2, 4, 3, 5), "the heads", _AXES
        )

    @checker.item("head h holds the h-th block of d_k columns of each token")
    def _() -> None:
        compare(
            checker.call(x, 4),
            expected,
            "the heads",
            {
                "x was reshaped straight to (B, H, T, d_k) without a "
                "transpose: a 'head' then holds pieces of several tokens. "
                "Reshape to (B, T, H, d_k), then swap the axes T and H "
                "(np.swapaxes(heads, -3, -2))": x.reshape(2, 4, 3, 5),
                "head h got every H-th column (a reshape to (B, T, d_k, H)): "
                "it must get the block of columns h*d_k to (h+1)*d_k - 1, "
                "a reshape to (B, T, H, d_k)": interleaved(x, 4),
            },
        )

    @checker.item("works without a batch axis: (T, D) gives (H, T, d_k)")
    def _() -> None:
        compare(checker.call(x[0], 4), expected[0], "the heads")

    @checker.item("any head width: (1, 5, 21) with H = 3 (d_k = 7)")
    def _() -> None:
        odd = rng.normal(size=(1, 5, 21))
        compare(checker.call(odd, 3), reference.split_heads(odd, 3), "heads")

    checker.run(verbose)


def check_merge_heads(
    fn: Callable,
    *,
    verbose: bool = True,
    framework: str = "numpy",
    device: Any = None,
) -> None:
    """Check ``fn(heads)``: (..., H, T, d_k) -> (..., T, H * d_k).

    The inverse of the split. Catches: a reshape without moving the heads
    back behind T; interleaving the heads' columns.
    """
    __tracebackhide__ = True  # tracebacks show the caller's line
    checker = Checker("check_merge_heads", fn, framework, device=device)
    rng = np.random.default_rng(3)
    heads = rng.normal(size=(2, 4, 3, 5))  # (B, H, T, d_k)
    expected = reference.merge_heads(heads)

    @checker.item("(B, H, T, d_k) = (2, 4, 3, 5) gives (B, T, D) = (2, 3, 20)")
    def _() -> None:
        expect_shape(as_array(checker.call(heads)), (2, 3, 20), "the result")

    @checker.item("row t is [head_0[t] | head_1[t] | ... ], undoing the split")
    def _() -> None:
        compare(
            checker.call(heads),
            expected,
            "the merged heads",
            {
                "the heads were reshaped straight to (B, T, D) without "
                "moving them back behind T: swap the axes H and T first "
                "(np.swapaxes(heads, -3, -2)), then reshape": heads.reshape(
                    2, 3, 20
                ),
                "the heads' columns were interleaved (column c*H + h from "
                "head h): put each head's d_k columns side by side, a "
                "reshape of (B, T, H, d_k)": np.swapaxes(heads, 1, 2)
                .swapaxes(2, 3)
                .reshape(2, 3, 20),
            },
        )

    @checker.item("works without a batch axis: (H, T, d_k) gives (T, D)")
    def _() -> None:
        compare(checker.call(heads[0]), expected[0], "the merged heads")

    checker.run(verbose)


def check_multi_head_attention(
    fn: Callable,
    *,
    verbose: bool = True,
    framework: str = "numpy",
    device: Any = None,
) -> None:
    """Check ``fn(x, w_q, w_k, w_v, w_o, num_heads, mask=None)``.

    Multi-head self-attention without biases: head h uses columns
    ``h * d_k`` to ``(h + 1) * d_k - 1`` of ``x @ w_q`` (and of ``x @ w_k``,
    ``x @ w_v``); the heads' outputs side by side are multiplied by ``w_o``.
    ``x`` is (T, D) or (B, T, D), the masks it gets are (T, T); ``fn``
    returns the output, or ``(output, weights)`` with weights
    (..., H, T, T). Catches: a split or merge without a transpose; a scale
    of 1/sqrt(D); the softmax over the queries or over the heads; a softmax
    without keepdims (from the error it raises); heads taking every H-th
    column; H and d_k swapped; torch's (out, in) weight layout
    (``x @ w.T``); ``w_o`` left out, or only its diagonal blocks used; heads
    that read only their own slice of ``x``; ``True`` read as "blocked";
    NaN, or the mean of the values (blocking with -1e9), for a query that
    may attend to nothing.
    """
    __tracebackhide__ = True  # tracebacks show the caller's line
    checker = Checker(
        "check_multi_head_attention", fn, framework, KEEPDIMS, device=device
    )
    rng = np.random.default_rng(4)
    # B = 2, T = 5, D = 12, H = 3, d_k = 4
    x = rng.normal(size=(2, 5, 12))
    w = normal_arrays(rng, *[(12, 12)] * 4)
    causal = reference.causal_mask(5)

    def mha(x, w, h, mask=None, **mistake):
        return multi_head(x, *w, h, mask, **mistake)

    @checker.item("(B, T, D) = (2, 5, 12), H = 3: output (B, T, D)")
    def _() -> None:
        output, _ = output_and_weights(checker.call(x, *w, 3))
        expect_shape(output, (2, 5, 12), "the output")

    @checker.item("the output equals the reference (H = 3, d_k = 4)")
    def _() -> None:
        output, _ = output_and_weights(checker.call(x, *w, 3))
        compare(output, mha(x, w, 3), "the output", _mha_mistakes(x, w, 3))

    @checker.item("weights, if returned: (B, H, T, T), rows sum to 1")
    def _() -> None:
        _, weights = output_and_weights(checker.call(x, *w, 3))
        if weights is not None:
            compare(weights, reference.multi_head_attention(x, *w, 3)[1], "w")

    @checker.item("one sequence: x of shape (T, D)")
    def _() -> None:
        output, _ = output_and_weights(checker.call(x[0], *w, 3))
        compare(output, mha(x[0], w, 3), "the output")

    @checker.item("H = 1 is chapter 1's single head, with W_O")
    def _() -> None:
        output, _ = output_and_weights(checker.call(x, *w, 1))
        compare(output, mha(x, w, 1), "the output", _mha_mistakes(x, w, 1))

    @checker.item("odd head widths: D = 14, H = 2 (d_k = 7)")
    def _() -> None:
        x14 = rng.normal(size=(2, 4, 14))
        w14 = normal_arrays(rng, *[(14, 14)] * 4)
        output, _ = output_and_weights(checker.call(x14, *w14, 2))
        compare(
            output, mha(x14, w14, 2), "the output", _mha_mistakes(x14, w14, 2)
        )

    @checker.item("a causal mask, True = may attend")
    def _() -> None:
        output, _ = output_and_weights(checker.call(x, *w, 3, mask=causal))
        compare(
            output,
            mha(x, w, 3, causal),
            "the masked output",
            {
                "True was read as blocked: here (and in "
                "F.scaled_dot_product_attention) True = may attend": mha(
                    x, w, 3, ~causal
                ),
                "the mask was ignored": mha(x, w, 3),
            },
        )

    @checker.item("a query that may attend to nothing gets a zero output")
    def _() -> None:
        empty = causal.copy()
        empty[0] = False  # query 0 sees nothing, in every sequence
        output, _ = output_and_weights(checker.call(x, *w, 3, mask=empty))
        output = as_array(output)
        expect_shape(output, (2, 5, 12), "the output")
        if np.isnan(output).any():
            raise Failed(
                "query 0, whose keys are all blocked, gave NaN "
                f"({short(output[1, 0, :4])}...): its scores are all -inf "
                "and the softmax computed 0 / 0. Give such a row zero "
                "weights (the package's softmax does), so it outputs zeros"
            )
        compare(
            output,
            mha(x, w, 3, empty),
            "the masked output",
            {
                "query 0, whose keys are all blocked, got the mean of the "
                "values: blocking with a large negative number (-1e9) "
                "leaves every key of the row tied, so the softmax spreads "
                "the weight evenly. Block with -inf and give an empty row "
                "zero weights": (
                    mha(x, w, 3, empty, fill=-1e9),
                    mha(x, w, 3, empty, additive=-1e9),
                )
            },
        )

    checker.run(verbose)


def _mha_mistakes(
    x: Array, w: tuple, h: int
) -> dict[str, Array | tuple[Array, ...]]:
    """The typical wrong multi-head layers, by the hint that names them."""
    d = x.shape[-1]
    w_q, w_k, w_v, w_o = w
    names = ("w_q", "w_k", "w_v", "w_o")
    # torch's nn.Linear stores (out, in) and computes x @ weight.T; here the
    # matrices are (in, out): any of them used transposed
    transposed = {
        ", ".join(names[i] for i in which): multi_head(
            x, *(m.T if i in which else m for i, m in enumerate(w)), h
        )
        for which in _subsets(4)
    }
    blocks = [_block_diagonal(m, h) for m in w]
    return {
        **{
            f"{used} used as torch's nn.Linear stores them, (out, in) "
            "(x @ w.T): here the matrices are (in, out), x @ w": twin
            for used, twin in transposed.items()
        },
        "the projections were reshaped straight to (B, H, T, d_k) without a "
        "transpose, so a 'head' mixes the rows of several tokens: reshape to "
        "(B, T, H, d_k), then swap T and H": multi_head(
            x, *w, h, split="no-transpose"
        ),
        "the heads were merged by a reshape without moving them back behind "
        "T: swap H and T, then reshape to (B, T, D)": multi_head(
            x, *w, h, merge="no-transpose"
        ),
        "the scores were divided by sqrt(D), the model width: each head "
        "divides by sqrt(d_k) = sqrt(D / H), the width of its own queries "
        "and keys": multi_head(x, *w, h, scale=1 / np.sqrt(d)),
        "the scores were not scaled: divide by sqrt(d_k)": multi_head(
            x, *w, h, scale=1.0
        ),
        "the softmax ran over the queries (axis -2): each query's weights "
        "must sum to 1 over the keys, axis=-1": multi_head(x, *w, h, axis=-2),
        "head h took every H-th column: head h's columns are the block "
        "h*d_k to (h+1)*d_k - 1": multi_head(x, *w, h, split="interleaved"),
        "W_O was left out: the heads' outputs side by side are multiplied "
        "by w_o": multi_head(x, *w, h, use_w_o=False),
        "the softmax ran over the heads (axis -3, axis=1 of (B, H, T, T)): "
        "each query's weights must sum to 1 over the keys, axis=-1": (
            multi_head(x, *w, h, axis=-3)
        ),
        "H and d_k were swapped: the split made D / H heads of width H. "
        "Reshape to (B, T, H, d_k), with H = num_heads and d_k = D / H": (
            multi_head(x, *w, d // h),
            multi_head(x, *w, d // h, scale=1 / np.sqrt(d // h)),
        ),
        "only W_O's diagonal blocks were used (each head's output times "
        "its own d_k x d_k block): W_O mixes the heads, so the heads side "
        "by side, (T, D), are multiplied by all of w_o": multi_head(
            x, w_q, w_k, w_v, blocks[3], h
        ),
        "each head read only its own slice of x (x[..., h*d_k:(h+1)*d_k] "
        "times a d_k x d_k block of w_q): every head reads all D columns "
        "of x, and its d_k columns of x @ w_q are its queries": (
            multi_head(x, *blocks[:3], w_o, h),
            multi_head(x, *blocks, h),
        ),
    }


def _subsets(n: int) -> list[tuple[int, ...]]:
    """The non-empty subsets of range(n), as sorted tuples."""
    return [
        tuple(i for i in range(n) if mask >> i & 1) for mask in range(1, 2**n)
    ]


def _block_diagonal(matrix: Array, num_heads: int) -> Array:
    """``matrix`` with only its H diagonal blocks of d_k x d_k kept."""
    d_k = matrix.shape[0] // num_heads
    head = np.arange(matrix.shape[0]) // d_k
    return np.where(head[:, None] == head[None, :], matrix, 0.0)


def interleaved(x: Array, num_heads: int) -> Array:
    """Heads taking every H-th column: (..., T, D) -> (..., H, T, d_k)."""
    *lead, t, d = x.shape
    heads = x.reshape(*lead, t, d // num_heads, num_heads)
    return np.moveaxis(heads, -1, -3)


def multi_head(
    x: Array,
    w_q: Array,
    w_k: Array,
    w_v: Array,
    w_o: Array,
    num_heads: int,
    mask: Array | None = None,
    *,
    split: str = "right",
    merge: str = "right",
    scale: float | None = None,
    axis: int = -1,
    use_w_o: bool = True,
    fill: float = -np.inf,
    additive: float | None = None,
    softmax: Callable[..., Array] = reference.softmax,
) -> Array:
    """Multi-head attention, right or with one of the known mistakes.

    ``fill`` replaces blocked scores; ``additive`` is added to them instead
    (a mask of 0 and -1e9).
    """
    *lead, t, d = x.shape
    d_k = d // num_heads

    def heads(y: Array) -> Array:  # (..., T, D) -> (..., H, T, d_k)
        if split == "no-transpose":
            return y.reshape(*lead, num_heads, t, d_k)
        if split == "interleaved":
            return interleaved(y, num_heads)
        return reference.split_heads(y, num_heads)

    q, k, v = heads(x @ w_q), heads(x @ w_k), heads(x @ w_v)
    if mask is not None and additive is not None:
        # the mask as numbers added to the scores; what the softmax gets
        extra, mask, plain = np.where(mask, 0.0, additive), None, softmax
        softmax = lambda s, axis=-1: plain(s + extra, axis=axis)  # noqa: E731

    out = attend(
        q, k, v, mask, scale=scale, axis=axis, fill=fill, softmax=softmax
    )  # (..., H, T, d_k)
    if merge == "no-transpose":
        merged = out.reshape(*lead, t, d)
    else:
        merged = reference.merge_heads(out)  # (..., T, D)
    return merged @ w_o if use_w_o else merged
