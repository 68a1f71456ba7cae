"""Checkers of one head: the softmax and scaled dot-product attention."""

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


def check_softmax(
    fn: Callable,
    *,
    verbose: bool = True,
    framework: str = "numpy",
    device: Any = None,
) -> None:
    """Check ``fn(x, axis=-1)``, a softmax along ``axis``.

    Catches: normalising the whole array; a maximum or sum taken without
    ``keepdims`` (broadcast along the wrong axis); ignoring ``axis``; no
    maximum subtracted (overflow to NaN); one maximum for the whole array
    (underflow to 0/0); NaN for a row of ``-inf``; changing ``x`` in place.
    """
    __tracebackhide__ = True  # tracebacks show the caller's line
    checker = Checker(
        "check_softmax",
        fn,
        framework,
        {
            words: "A maximum or a sum taken without keepdims=True has lost "
            "the axis it ran along, and does not line up with the rows: use "
            "x.max(axis=axis, keepdims=True)"
            for words in KEEPDIMS
        },
        device=device,
    )
    # a Triton kernel of rows (R, n_cols) that stores past a row's end
    checker.bounds = {
        (2, -1, n): ("n_cols", "the column bound (cols < n_cols)")
        for n in range(1, 9)  # the lengths of the rows below
    }
    rng = np.random.default_rng(0)
    square = rng.normal(size=(4, 4))  # square: a missing keepdims broadcasts

    @checker.item("returns an array of the input's shape")
    def _() -> None:
        x = rng.normal(size=(3, 5))
        expect_shape(as_array(checker.call(x, axis=-1)), x.shape, "the result")

    @checker.item("each row sums to 1 over its own entries (axis=-1)")
    def _() -> None:
        exps = np.exp(square)
        shifted = np.exp(square - square.max(axis=-1, keepdims=True))
        compare(
            checker.call(square, axis=-1),
            reference.softmax(square, axis=-1),
            "softmax(x, axis=-1)",
            {
                "the whole array sums to 1, not each row: sum with "
                "axis=axis, keepdims=True": exps / exps.sum(),
                "the maxima were taken without keepdims=True, so row i's "
                "maximum was subtracted from column i: use "
                "x.max(axis=axis, keepdims=True)": reference.softmax(
                    square - square.max(axis=-1)
                ),
                "the sums were taken without keepdims=True, so column j was "
                "divided by row j's sum: use "
                "exps.sum(axis=axis, keepdims=True)": (
                    exps / exps.sum(axis=-1),
                    shifted / shifted.sum(axis=-1),
                ),
                "the softmax ran down the columns (axis 0): with axis=-1 "
                "each row (one query's scores) must sum to 1": (
                    reference.softmax(square, axis=0)
                ),
            },
        )

    @checker.item("honours axis (x of shape (2, 3, 5), axis=1)")
    def _() -> None:
        x = rng.normal(size=(2, 3, 5))
        compare(
            checker.call(x, axis=1),
            reference.softmax(x, axis=1),
            "softmax(x, axis=1)",
            {
                "axis was ignored: the result is the softmax along the "
                "last axis": reference.softmax(x, axis=-1)
            },
        )

    @checker.item("stable for large scores (rows near 1000)")
    def _() -> None:
        x = np.array([[1000.0, 1001.0, 1002.0], [1003.0, 1001.0, 1002.0]])
        got = as_array(checker.call(x, axis=-1))
        if not np.isfinite(got).all():
            raise Failed(
                f"got {short(got)}: np.exp overflows above about 709.78, "
                "and inf / inf is NaN. Subtract each row's maximum before "
                "np.exp: softmax(x + c) = softmax(x), nothing changes but "
                "the size of the exponents"
            )
        compare(got, reference.softmax(x), "softmax of the large scores")

    @checker.item("each row is shifted by its own maximum")
    def _() -> None:
        x = np.array([[0.0, 1.0, 2.0], [1000.0, 1001.0, 1002.0]])
        got = as_array(checker.call(x, axis=-1))
        if not np.isfinite(got[0]).all() or np.allclose(got[0], 0.0):
            raise Failed(
                f"the row [0, 1, 2] came out as {short(got[0])} next to a "
                "row near 1000: one maximum for the whole array makes the "
                "exponentials of the smaller row underflow to 0, and 0 / 0 "
                "is NaN. Subtract each row's own maximum "
                "(x.max(axis=axis, keepdims=True))"
            )
        compare(got, reference.softmax(x), "softmax of the two rows")

    @checker.item("a score of -inf gets weight 0")
    def _() -> None:
        x = np.array([[0.5, -np.inf, 1.0, -np.inf]])
        compare(checker.call(x, axis=-1), reference.softmax(x), "softmax(x)")

    @checker.item("a row of only -inf gives zeros, not NaN")
    def _() -> None:
        x = np.array([[0.0, 1.0, 2.0], [-np.inf, -np.inf, -np.inf]])
        got = as_array(checker.call(x, axis=-1))
        if np.isnan(got[1]).any():
            raise Failed(
                f"the row of -inf came out as {short(got[1])}: its maximum "
                "is -inf, and -inf - (-inf) is NaN. A fully masked row "
                "(a query that may attend to nothing) should get zero "
                "weights: replace an infinite maximum by 0, and divide only "
                "where the row's total is above 0"
            )
        compare(got, reference.softmax(x), "softmax(x)")

    @checker.item("leaves its input unchanged")
    def _() -> None:
        x = rng.normal(size=(3, 4))
        kept = x.copy()
        checker.call(x, axis=-1, copy=False)
        if not np.array_equal(x, kept):
            raise Failed(
                "x itself was changed (an in-place x -= ... or np.exp(x, "
                "out=x)): the caller's scores are gone. Compute into a new "
                "array"
            )

    checker.run(verbose)


def check_scaled_dot_product_attention(
    fn: Callable,
    *,
    verbose: bool = True,
    framework: str = "numpy",
    device: Any = None,
) -> None:
    """Check ``fn(q, k, v, mask=None)``: softmax(q k^T / sqrt(d_k)) v.

    ``fn`` returns the output, or ``(output, weights)``. Catches: no scale,
    a scale of 1/d_k or 1/sqrt(d_v); the softmax over the queries; ``True``
    read as "blocked"; a mask applied after the softmax; NaN or the mean of
    the values for a query that may attend to nothing; leading axes ignored.
    """
    __tracebackhide__ = True  # tracebacks show the caller's line
    checker = Checker(
        "check_scaled_dot_product_attention",
        fn,
        framework,
        {
            "matmul": "If it was the scores, q @ k: transpose k's last two "
            "axes (np.swapaxes(k, -1, -2)), so (T_q, d_k) @ (d_k, T_k) gives "
            "(T_q, T_k).",
            **KEEPDIMS,
        },
        device=device,
    )
    rng = np.random.default_rng(1)
    # T_q = 3, T_k = 4, d_k = 5, d_v = 6: every mix-up changes a shape
    q, k, v = normal_arrays(rng, (3, 5), (4, 5), (4, 6))
    # every row keeps a key and blocks one, the other way round as well
    mask = np.array(
        [[True, False, True, True], [False, True, True, False]]
        + [[True, True, False, True]]
    )

    @checker.item("returns the output, shape (T_q, d_v) = (3, 6)")
    def _() -> None:
        output, _ = output_and_weights(checker.call(q, k, v))
        expect_shape(output, (3, 6), "the output")

    @checker.item("output = softmax(q k^T / sqrt(d_k)) v")
    def _() -> None:
        output, _ = output_and_weights(checker.call(q, k, v))
        compare(
            output,
            attend(q, k, v),
            "the output",
            {
                "the scores were not scaled: divide q k^T by sqrt(d_k), the "
                "width of queries and keys": attend(q, k, v, scale=1.0),
                "the scores were divided by d_k: divide by its square root, "
                "sqrt(d_k)": attend(q, k, v, scale=1 / 5),
                "the scores were divided by sqrt(d_v), the width of the "
                "values: the scale is 1 / sqrt(d_k)": attend(
                    q, k, v, scale=1 / np.sqrt(6)
                ),
                "the softmax ran over the queries (axis -2): each query's "
                "weights must sum to 1 over the keys, axis=-1": attend(
                    q, k, v, axis=-2
                ),
            },
        )

    @checker.item("weights, if returned: (T_q, T_k), rows sum to 1")
    def _() -> None:
        _, weights = output_and_weights(checker.call(q, k, v))
        if weights is not None:
            compare(weights, attention_weights(q, k), "the weights")

    @checker.item("leading axes: q (2, 3, 3, 5), k and v (2, 3, 4, ...)")
    def _() -> None:
        q4, k4, v4 = normal_arrays(
            rng, (2, 3, 3, 5), (2, 3, 4, 5), (2, 3, 4, 6)
        )
        output, _ = output_and_weights(checker.call(q4, k4, v4))
        compare(output, attend(q4, k4, v4), "the output")

    @checker.item("mask: True = may attend, False = blocked")
    def _() -> None:
        output, _ = output_and_weights(checker.call(q, k, v, mask=mask))
        masked = attend(q, k, v, mask)
        weights = attention_weights(q, k) * mask
        compare(
            output,
            masked,
            "the masked output",
            {
                "True was read as blocked: in this package's convention (and "
                "F.scaled_dot_product_attention's) True = may attend; only "
                "torch.nn.MultiheadAttention's masks mean the opposite": (
                    attend(q, k, v, ~mask)
                ),
                "the weights were masked after the softmax, so a row no "
                "longer sums to 1: set the blocked scores to -inf before the "
                "softmax": weights @ v,
            },
        )

    @checker.item("a query that may attend to no key gets a zero output")
    def _() -> None:
        empty = mask.copy()
        empty[1] = False  # query 1 sees nothing
        output, _ = output_and_weights(checker.call(q, k, v, mask=empty))
        output = as_array(output)
        expect_shape(output, (3, 6), "the output")
        if np.isnan(output[1]).any():
            raise Failed(
                f"query 1, whose keys are all blocked, got {short(output[1])}"
                ": every score of its row is -inf and the softmax gave "
                "0 / 0. Give such a row zero weights (the package's softmax "
                "does), so its output is zero"
            )
        if np.allclose(output[1], v.mean(axis=0)):
            raise Failed(
                "query 1, whose keys are all blocked, got the mean of the "
                "values: blocking with a large negative number (-1e9) leaves "
                "every key of the row tied, so the softmax spreads the "
                "weight evenly. Block with -inf and give an empty row zero "
                "weights"
            )
        compare(output, attend(q, k, v, empty), "the masked output")

    @checker.item("a (2, 1, 1, T_k) mask broadcasts over heads and queries")
    def _() -> None:
        q4, k4, v4 = normal_arrays(
            rng, (2, 3, 3, 5), (2, 3, 4, 5), (2, 3, 4, 6)
        )
        keys = np.array([[True, True, False, False], [True] * 4])
        padding = keys[:, None, None, :]  # (B, 1, 1, T_k)
        output, _ = output_and_weights(checker.call(q4, k4, v4, padding))
        compare(output, attend(q4, k4, v4, padding), "the output")

    checker.run(verbose)


# The words of NumPy's and torch's broadcasting errors, and what, inside a
# softmax, usually causes them.
KEEPDIMS_HINT = (
    "If it was the softmax: a maximum or a sum taken without "
    "keepdims=True has lost the axis it ran along, and does not line up "
    "with the rows. Use scores.max(axis=-1, keepdims=True) (torch: "
    "keepdim=True)."
)
KEEPDIMS = {
    "could not be broadcast": KEEPDIMS_HINT,
    "must match the size of tensor": KEEPDIMS_HINT,
}


def attention_weights(q: Array, k: Array) -> Array:
    return reference.scaled_dot_product_attention(q, k, k[..., :1])[1]


def attend(
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None = None,
    *,
    scale: float | None = None,
    axis: int = -1,
    fill: float = -np.inf,
    softmax: Callable[..., Array] = reference.softmax,
) -> Array:
    """Scaled dot-product attention with a chosen scale, softmax axis, value
    for blocked scores, and softmax."""
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    scores = q @ np.swapaxes(k, -1, -2) * scale  # (..., T_q, T_k)
    if mask is not None:
        scores = np.where(mask, scores, fill)
    return softmax(scores, axis=axis) @ v
