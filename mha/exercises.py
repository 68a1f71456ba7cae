"""Checkers for code a learner writes, with messages that say what is wrong.

Each ``check_*`` takes your function, runs it on small inputs with a fixed
seed and goes through a checklist, comparing with the package's own code.
When every item passes it returns ``None`` (and prints the checklist unless
``verbose=False``). Otherwise it raises ``AssertionError`` naming the item
that failed and what came; where your result equals the result of a known
mistake (a split without a transpose, a scale by sqrt(D), a softmax over the
wrong axis, ...), the message names that mistake and how to put it right.

* :func:`check_softmax` - ``fn(x, axis=-1)``
* :func:`check_scaled_dot_product_attention` - ``fn(q, k, v, mask=None)``
* :func:`check_split_heads` - ``fn(x, num_heads)``;
  :func:`check_merge_heads` - ``fn(heads)``
* :func:`check_multi_head_attention` -
  ``fn(x, w_q, w_k, w_v, w_o, num_heads, mask=None)``
* :func:`check_causal_mask` - ``fn(t_q, t_k)``
* :func:`check_rope` - ``fn(x, positions)``
* :func:`check_padded_positions` - ``fn(keep)``
* :func:`check_kv_cache_update` - ``fn(keys, values, k, v, length)``
* :func:`check_online_softmax_step` - ``fn(m, ell, acc, scores, v)``

Your function gets NumPy arrays, or float64 torch tensors with
``framework="torch"``; it may return either. Masks are boolean, ``True`` =
may attend, as everywhere in the package. :func:`failure` returns a
checker's message instead of raising it.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from . import reference
from ._validate import check_choice

__all__ = [
    "check_softmax",
    "check_scaled_dot_product_attention",
    "check_split_heads",
    "check_merge_heads",
    "check_multi_head_attention",
    "check_causal_mask",
    "check_rope",
    "check_padded_positions",
    "check_kv_cache_update",
    "check_online_softmax_step",
    "failure",
]

Array = NDArray[Any]
# Two results agree when they differ by rounding only.
RTOL, ATOL = 1e-6, 1e-9


class _Failed(Exception):
    """One checklist item failed; the message says how."""


class _Checker:
    """Runs a learner's function through a checklist; one per ``check_*``."""

    def __init__(
        self,
        name: str,
        fn: Callable,
        framework: str,
        error_hints: dict[str, str] | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(
                f"fn must be a function, got {type(fn).__name__} {fn!r}"
            )
        check_choice("framework", framework, ("numpy", "torch"))
        self.name, self.fn, self.framework = name, fn, framework
        # words of an error message -> what usually causes it
        self.error_hints = error_hints or {}
        self.items: list[tuple[str, Callable[[], None]]] = []

    def item(self, title: str) -> Callable:
        """Decorator: add the decorated function as the next item."""

        def add(run: Callable[[], None]) -> Callable[[], None]:
            self.items.append((title, run))
            return run

        return add

    def call(self, *args: Any, copy: bool = True, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with arrays in the chosen framework.

        The arrays are copies unless ``copy=False``, so that a function that
        changes its inputs cannot change what it is compared with.
        """
        args = tuple(_to_framework(a, self.framework, copy) for a in args)
        kwargs = {
            k: _to_framework(a, self.framework, copy)
            for k, a in kwargs.items()
        }
        try:
            # the checklist reports overflow and NaN; NumPy's warnings would
            # only repeat it
            with np.errstate(all="ignore"):
                return self.fn(*args, **kwargs)
        except Exception as error:  # the learner's error, reported as such
            shapes = ", ".join(_describe(a) for a in args)
            hints = [
                hint
                for words, hint in self.error_hints.items()
                if words in str(error)
            ]
            raise _Failed(
                f"calling it with ({shapes}) raised "
                f"{type(error).__name__}: {error}"
                + "".join(f"\n{hint}" for hint in hints)
            ) from None

    def run(self, verbose: bool) -> None:
        total = len(self.items)
        for number, (title, run) in enumerate(self.items, 1):
            try:
                run()
            except _Failed as failed:
                raise AssertionError(
                    _wrap(
                        f"{self.name}: item {number} of {total} failed: "
                        f"{title}.",
                        str(failed),
                    )
                ) from None
        if verbose:
            print(f"{self.name}: all {total} items pass")
            for number, (title, _) in enumerate(self.items, 1):
                print(f"  {number}. {title}")


def failure(check: Callable, fn: Callable, **kwargs: Any) -> str | None:
    """The message ``check(fn, **kwargs)`` fails with, or None if it passes."""
    try:
        check(fn, verbose=False, **kwargs)
    except AssertionError as error:
        return str(error)
    return None


# ---------------------------------------------------------------------------
# One head


def check_softmax(
    fn: Callable, *, verbose: bool = True, framework: str = "numpy"
) -> None:
    """Check ``fn(x, axis=-1)``, a softmax along ``axis``.

    Catches: normalising the whole array; a maximum or sum taken without
    ``keepdims`` (broadcast along the wrong axis); ignoring ``axis``; no
    maximum subtracted (overflow to NaN); one maximum for the whole array
    (underflow to 0/0); NaN for a row of ``-inf``; changing ``x`` in place.
    """
    checker = _Checker(
        "check_softmax",
        fn,
        framework,
        {
            "broadcast": "A maximum or a sum taken without keepdims=True "
            "has lost the axis it ran along, and does not line up with the "
            "rows: use x.max(axis=axis, keepdims=True)"
        },
    )
    rng = np.random.default_rng(0)
    square = rng.normal(size=(4, 4))  # square: a missing keepdims broadcasts

    @checker.item("returns an array of the input's shape")
    def _() -> None:
        x = rng.normal(size=(3, 5))
        _expect_shape(_array(checker.call(x, axis=-1)), x.shape, "the result")

    @checker.item("each row sums to 1 over its own entries (axis=-1)")
    def _() -> None:
        exps = np.exp(square)
        shifted = np.exp(square - square.max(axis=-1, keepdims=True))
        _compare(
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
        _compare(
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
        got = _array(checker.call(x, axis=-1))
        if not np.isfinite(got).all():
            raise _Failed(
                f"got {_short(got)}: np.exp overflows above about 709.78, "
                "and inf / inf is NaN. Subtract each row's maximum before "
                "np.exp: softmax(x + c) = softmax(x), nothing changes but "
                "the size of the exponents"
            )
        _compare(got, reference.softmax(x), "softmax of the large scores")

    @checker.item("each row is shifted by its own maximum")
    def _() -> None:
        x = np.array([[0.0, 1.0, 2.0], [1000.0, 1001.0, 1002.0]])
        got = _array(checker.call(x, axis=-1))
        if not np.isfinite(got[0]).all() or np.allclose(got[0], 0.0):
            raise _Failed(
                f"the row [0, 1, 2] came out as {_short(got[0])} next to a "
                "row near 1000: one maximum for the whole array makes the "
                "exponentials of the smaller row underflow to 0, and 0 / 0 "
                "is NaN. Subtract each row's own maximum "
                "(x.max(axis=axis, keepdims=True))"
            )
        _compare(got, reference.softmax(x), "softmax of the two rows")

    @checker.item("a score of -inf gets weight 0")
    def _() -> None:
        x = np.array([[0.5, -np.inf, 1.0, -np.inf]])
        _compare(checker.call(x, axis=-1), reference.softmax(x), "softmax(x)")

    @checker.item("a row of only -inf gives zeros, not NaN")
    def _() -> None:
        x = np.array([[0.0, 1.0, 2.0], [-np.inf, -np.inf, -np.inf]])
        got = _array(checker.call(x, axis=-1))
        if np.isnan(got[1]).any():
            raise _Failed(
                f"the row of -inf came out as {_short(got[1])}: its maximum "
                "is -inf, and -inf - (-inf) is NaN. A fully masked row "
                "(a query that may attend to nothing) should get zero "
                "weights: replace an infinite maximum by 0, and divide only "
                "where the row's total is above 0"
            )
        _compare(got, reference.softmax(x), "softmax(x)")

    @checker.item("leaves its input unchanged")
    def _() -> None:
        x = rng.normal(size=(3, 4))
        kept = x.copy()
        checker.call(x, axis=-1, copy=False)
        if not np.array_equal(x, kept):
            raise _Failed(
                "x itself was changed (an in-place x -= ... or np.exp(x, "
                "out=x)): the caller's scores are gone. Compute into a new "
                "array"
            )

    checker.run(verbose)


def check_scaled_dot_product_attention(
    fn: Callable, *, verbose: bool = True, framework: str = "numpy"
) -> None:
    """Check ``fn(q, k, v, mask=None)``: softmax(q k^T / sqrt(d_k)) v.

    ``fn`` returns the output, or ``(output, weights)``. Catches: no scale,
    a scale of 1/d_k or 1/sqrt(d_v); the softmax over the queries; ``True``
    read as "blocked"; a mask applied after the softmax; NaN or the mean of
    the values for a query that may attend to nothing; leading axes ignored.
    """
    checker = _Checker(
        "check_scaled_dot_product_attention",
        fn,
        framework,
        {
            "matmul": "If it was the scores, q @ k: transpose k's last two "
            "axes (np.swapaxes(k, -1, -2)), so (T_q, d_k) @ (d_k, T_k) gives "
            "(T_q, T_k)."
        },
    )
    rng = np.random.default_rng(1)
    # T_q = 3, T_k = 4, d_k = 5, d_v = 6: every mix-up changes a shape
    q, k, v = _normal(rng, (3, 5), (4, 5), (4, 6))
    # every row keeps a key and blocks one, the other way round as well
    mask = np.array(
        [[True, False, True, True], [False, True, True, False]]
        + [[True, True, False, True]]
    )

    def attend(q, k, v, mask=None, **kwargs):
        return _attend(q, k, v, mask, **kwargs)

    @checker.item("returns the output, shape (T_q, d_v) = (3, 6)")
    def _() -> None:
        output, _ = _output_and_weights(checker.call(q, k, v))
        _expect_shape(output, (3, 6), "the output")

    @checker.item("output = softmax(q k^T / sqrt(d_k)) v")
    def _() -> None:
        output, _ = _output_and_weights(checker.call(q, k, v))
        _compare(
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
        _, weights = _output_and_weights(checker.call(q, k, v))
        if weights is not None:
            _compare(weights, _weights(q, k), "the weights")

    @checker.item("leading axes: q (2, 3, 3, 5), k and v (2, 3, 4, ...)")
    def _() -> None:
        q4, k4, v4 = _normal(rng, (2, 3, 3, 5), (2, 3, 4, 5), (2, 3, 4, 6))
        output, _ = _output_and_weights(checker.call(q4, k4, v4))
        _compare(output, attend(q4, k4, v4), "the output")

    @checker.item("mask: True = may attend, False = blocked")
    def _() -> None:
        output, _ = _output_and_weights(checker.call(q, k, v, mask=mask))
        masked = attend(q, k, v, mask)
        weights = _weights(q, k) * mask
        _compare(
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
        output, _ = _output_and_weights(checker.call(q, k, v, mask=empty))
        output = _array(output)
        _expect_shape(output, (3, 6), "the output")
        if np.isnan(output[1]).any():
            raise _Failed(
                f"query 1, whose keys are all blocked, got {_short(output[1])}"
                ": every score of its row is -inf and the softmax gave "
                "0 / 0. Give such a row zero weights (the package's softmax "
                "does), so its output is zero"
            )
        if np.allclose(output[1], v.mean(axis=0)):
            raise _Failed(
                "query 1, whose keys are all blocked, got the mean of the "
                "values: blocking with a large negative number (-1e9) leaves "
                "every key of the row tied, so the softmax spreads the "
                "weight evenly. Block with -inf and give an empty row zero "
                "weights"
            )
        _compare(output, attend(q, k, v, empty), "the masked output")

    @checker.item("a (2, 1, 1, T_k) mask broadcasts over heads and queries")
    def _() -> None:
        q4, k4, v4 = _normal(rng, (2, 3, 3, 5), (2, 3, 4, 5), (2, 3, 4, 6))
        keys = np.array([[True, True, False, False], [True] * 4])
        padding = keys[:, None, None, :]  # (B, 1, 1, T_k)
        output, _ = _output_and_weights(checker.call(q4, k4, v4, padding))
        _compare(output, attend(q4, k4, v4, padding), "the output")

    checker.run(verbose)


# ---------------------------------------------------------------------------
# Many heads


def check_split_heads(
    fn: Callable, *, verbose: bool = True, framework: str = "numpy"
) -> None:
    """Check ``fn(x, num_heads)``: (..., T, D) -> (..., H, T, D / H).

    Head h holds columns ``h * d_k`` to ``(h + 1) * d_k - 1`` of every token.
    Catches: a reshape to (B, H, T, d_k) without a transpose; heads taking
    every H-th column; the axes in the wrong order.
    """
    checker = _Checker("check_split_heads", fn, framework)
    rng = np.random.default_rng(2)
    # B = 2, T = 3, H = 4, d_k = 5: every axis has its own length
    x = rng.normal(size=(2, 3, 20))
    expected = reference.split_heads(x, 4)

    @checker.item("(B, T, D) = (2, 3, 20) with H = 4 gives (B, H, T, d_k)")
    def _() -> None:
        _expect_shape(
            _array(checker.call(x, 4)), (2, 4, 3, 5), "the heads", _AXES
        )

    @checker.item("head h holds the h-th block of d_k columns of each token")
    def _() -> None:
        _compare(
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
                "a reshape to (B, T, H, d_k)": _interleaved(x, 4),
            },
        )

    @checker.item("works without a batch axis: (T, D) gives (H, T, d_k)")
    def _() -> None:
        _compare(checker.call(x[0], 4), expected[0], "the heads")

    @checker.item("any head width: (1, 5, 21) with H = 3 (d_k = 7)")
    def _() -> None:
        odd = rng.normal(size=(1, 5, 21))
        _compare(checker.call(odd, 3), reference.split_heads(odd, 3), "heads")

    checker.run(verbose)


def check_merge_heads(
    fn: Callable, *, verbose: bool = True, framework: str = "numpy"
) -> None:
    """Check ``fn(heads)``: (..., H, T, d_k) -> (..., T, H * d_k).

    The inverse of the split. Catches: a reshape without moving the heads
    back behind T; interleaving the heads' columns.
    """
    checker = _Checker("check_merge_heads", fn, framework)
    rng = np.random.default_rng(3)
    heads = rng.normal(size=(2, 4, 3, 5))  # (B, H, T, d_k)
    expected = reference.merge_heads(heads)

    @checker.item("(B, H, T, d_k) = (2, 4, 3, 5) gives (B, T, D) = (2, 3, 20)")
    def _() -> None:
        _expect_shape(_array(checker.call(heads)), (2, 3, 20), "the result")

    @checker.item("row t is [head_0[t] | head_1[t] | ... ], undoing the split")
    def _() -> None:
        _compare(
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
        _compare(checker.call(heads[0]), expected[0], "the merged heads")

    checker.run(verbose)


def check_multi_head_attention(
    fn: Callable, *, verbose: bool = True, framework: str = "numpy"
) -> None:
    """Check ``fn(x, w_q, w_k, w_v, w_o, num_heads, mask=None)``.

    Multi-head self-attention without biases: head h uses columns
    ``h * d_k`` to ``(h + 1) * d_k - 1`` of ``x @ w_q`` (and of ``x @ w_k``,
    ``x @ w_v``); the heads' outputs side by side are multiplied by ``w_o``.
    ``x`` is (T, D) or (B, T, D), the masks it gets are (T, T); ``fn``
    returns the output, or ``(output, weights)`` with weights
    (..., H, T, T). Catches: a split or merge without
    a transpose; a scale of 1/sqrt(D); the softmax over the queries; heads
    taking every H-th column; ``w_o`` left out; ``True`` read as "blocked";
    NaN for a query that may attend to nothing.
    """
    checker = _Checker("check_multi_head_attention", fn, framework)
    rng = np.random.default_rng(4)
    # B = 2, T = 5, D = 12, H = 3, d_k = 4
    x = rng.normal(size=(2, 5, 12))
    w = _normal(rng, *[(12, 12)] * 4)
    causal = reference.causal_mask(5)

    def mha(x, w, h, mask=None, **mistake):
        return _multi_head(x, *w, h, mask, **mistake)

    @checker.item("(B, T, D) = (2, 5, 12), H = 3: output (B, T, D)")
    def _() -> None:
        output, _ = _output_and_weights(checker.call(x, *w, 3))
        _expect_shape(output, (2, 5, 12), "the output")

    @checker.item("the output equals the reference (H = 3, d_k = 4)")
    def _() -> None:
        output, _ = _output_and_weights(checker.call(x, *w, 3))
        _compare(output, mha(x, w, 3), "the output", _mha_mistakes(x, w, 3))

    @checker.item("weights, if returned: (B, H, T, T), rows sum to 1")
    def _() -> None:
        _, weights = _output_and_weights(checker.call(x, *w, 3))
        if weights is not None:
            _compare(weights, reference.multi_head_attention(x, *w, 3)[1], "w")

    @checker.item("one sequence: x of shape (T, D)")
    def _() -> None:
        output, _ = _output_and_weights(checker.call(x[0], *w, 3))
        _compare(output, mha(x[0], w, 3), "the output")

    @checker.item("H = 1 is chapter 1's single head, with W_O")
    def _() -> None:
        output, _ = _output_and_weights(checker.call(x, *w, 1))
        _compare(output, mha(x, w, 1), "the output")

    @checker.item("odd head widths: D = 14, H = 2 (d_k = 7)")
    def _() -> None:
        x14 = rng.normal(size=(2, 4, 14))
        w14 = _normal(rng, *[(14, 14)] * 4)
        output, _ = _output_and_weights(checker.call(x14, *w14, 2))
        _compare(
            output, mha(x14, w14, 2), "the output", _mha_mistakes(x14, w14, 2)
        )

    @checker.item("a causal mask, True = may attend")
    def _() -> None:
        output, _ = _output_and_weights(checker.call(x, *w, 3, mask=causal))
        _compare(
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
        output, _ = _output_and_weights(checker.call(x, *w, 3, mask=empty))
        output = _array(output)
        _expect_shape(output, (2, 5, 12), "the output")
        if np.isnan(output).any():
            raise _Failed(
                "query 0, whose keys are all blocked, gave NaN "
                f"({_short(output[1, 0, :4])}...): its scores are all -inf "
                "and the softmax computed 0 / 0. Give such a row zero "
                "weights (the package's softmax does), so it outputs zeros"
            )
        _compare(output, mha(x, w, 3, empty), "the masked output")

    checker.run(verbose)


def _mha_mistakes(x: Array, w: tuple, h: int) -> dict[str, Array]:
    """The typical wrong multi-head layers, by the hint that names them."""
    d = x.shape[-1]
    return {
        "the projections were reshaped straight to (B, H, T, d_k) without a "
        "transpose, so a 'head' mixes the rows of several tokens: reshape to "
        "(B, T, H, d_k), then swap T and H": _multi_head(
            x, *w, h, split="no-transpose"
        ),
        "the heads were merged by a reshape without moving them back behind "
        "T: swap H and T, then reshape to (B, T, D)": _multi_head(
            x, *w, h, merge="no-transpose"
        ),
        "the scores were divided by sqrt(D), the model width: each head "
        "divides by sqrt(d_k) = sqrt(D / H), the width of its own queries "
        "and keys": _multi_head(x, *w, h, scale=1 / np.sqrt(d)),
        "the scores were not scaled: divide by sqrt(d_k)": _multi_head(
            x, *w, h, scale=1.0
        ),
        "the softmax ran over the queries (axis -2): each query's weights "
        "must sum to 1 over the keys, axis=-1": _multi_head(x, *w, h, axis=-2),
        "head h took every H-th column: head h's columns are the block "
        "h*d_k to (h+1)*d_k - 1": _multi_head(x, *w, h, split="interleaved"),
        "W_O was left out: the heads' outputs side by side are multiplied "
        "by w_o": _multi_head(x, *w, h, use_w_o=False),
    }


# ---------------------------------------------------------------------------
# Masks and positions


def check_causal_mask(
    fn: Callable,
    *,
    align: str = "top-left",
    verbose: bool = True,
    framework: str = "numpy",
) -> None:
    """Check ``fn(t_q, t_k)``: a boolean causal mask, True = may attend.

    ``align="top-left"``: query i sees keys 0..i (``F.scaled_dot_product_
    attention(is_causal=True)``). ``align="bottom-right"``: query i sees keys
    0..i + T_k - T_q, the T_q newest tokens after T_k - T_q cached ones.
    Catches: True marking the future; the diagonal left out; the upper
    triangle; the other alignment; an additive float mask.
    """
    check_choice("align", align, ("top-left", "bottom-right"))
    checker = _Checker("check_causal_mask", fn, framework)
    other = "bottom-right" if align == "top-left" else "top-left"

    def expected(t_q, t_k, how=align):
        return reference.causal_mask(t_q, t_k, align=how)

    def call(t_q, t_k):
        got = _array(checker.call(t_q, t_k))
        _expect_shape(got, (t_q, t_k), f"the mask for ({t_q}, {t_k})")
        if got.dtype != bool:
            raise _Failed(
                f"the mask has dtype {got.dtype}: masks here are boolean "
                "arrays, True = may attend (an additive mask of 0 and -inf "
                "is another convention)"
            )
        return got

    @checker.item("a boolean (T, T) mask: query i sees keys 0..i")
    def _() -> None:
        _compare_mask(
            call(5, 5),
            expected(5, 5),
            {
                "True marks the future here: True = may attend, so query i "
                "is True at keys 0..i": ~expected(5, 5),
                "query i may not attend to itself: the diagonal belongs to "
                "the past (np.tril(..., k=0))": np.tri(5, k=-1, dtype=bool),
                "the mask is the upper triangle, query i sees keys i..T-1 "
                "(the future): take np.tril, not np.triu": expected(5, 5).T,
            },
        )

    lines = {
        "top-left": "query i sees keys 0..i",
        "bottom-right": "query i sees keys 0..i + T_k - T_q",
    }

    @checker.item(f"T_q = 3 < T_k = 6: {lines[align]}")
    def _() -> None:
        hints = {
            "top-left": "the mask is aligned bottom-right (the T_q queries "
            "as the last of T_k positions); this checker asked for top-left, "
            "query i sees keys 0..i, as F.scaled_dot_product_attention's "
            "is_causal does",
            "bottom-right": "the mask is aligned top-left (query i sees keys "
            "0..i): with T_k - T_q tokens cached, the T_q new queries are "
            "the last T_q positions, and query i sees keys 0..i + T_k - T_q "
            "(np.tril(..., k=T_k - T_q))",
        }
        _compare_mask(
            call(3, 6), expected(3, 6), {hints[align]: expected(3, 6, other)}
        )

    @checker.item("the same for T_q = 1, T_k = 4 and for T_q = 4 > T_k = 2")
    def _() -> None:
        _compare_mask(call(1, 4), expected(1, 4), {})
        _compare_mask(call(4, 2), expected(4, 2), {})

    checker.run(verbose)


def check_rope(
    fn: Callable,
    *,
    base: float = 10000.0,
    verbose: bool = True,
    framework: str = "numpy",
) -> None:
    """Check ``fn(x, positions)``: rotary embeddings of (B, H, T, d_k) heads.

    The "rotate half" pairing of :func:`mha.apply_rope` and ``transformers``:
    dimension i turns with i + d_k/2 by ``p * base**(-2i / d_k)``.
    ``positions`` is (T,) or (B, T) integers. Catches: lengths changed;
    neighbouring dimensions paired; the rotation turned the other way;
    frequencies ``base**(-i / d_k)``; the positions of row 0 used for every
    row.
    """
    from .positions import apply_rope

    checker = _Checker("check_rope", fn, framework)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 3, 6, 8))  # (B, H, T, d_k)
    positions = np.arange(6)

    def rope(x, positions):
        import torch

        rotated = apply_rope(
            torch.from_numpy(x), torch.from_numpy(positions), base
        )
        return rotated.numpy()

    @checker.item("returns the shape it got, (B, H, T, d_k) = (2, 3, 6, 8)")
    def _() -> None:
        _expect_shape(_array(checker.call(x, positions)), x.shape, "result")

    @checker.item("a rotation: every vector keeps its length")
    def _() -> None:
        got = _array(checker.call(x, positions))
        lengths = np.linalg.norm(got, axis=-1)
        _compare(lengths, np.linalg.norm(x, axis=-1), "the lengths")

    @checker.item("position 0 leaves a vector as it is")
    def _() -> None:
        got = _array(checker.call(x, np.zeros(6, dtype=np.int64)))
        _compare(got, x, "x turned by position 0")

    @checker.item("a score depends on the offset of the positions only")
    def _() -> None:
        q, k = _normal(rng, (1, 1, 1, 8), (1, 1, 1, 8))

        def score(m, n):
            q_m = _array(checker.call(q, np.array([m])))
            k_n = _array(checker.call(k, np.array([n])))
            return float(np.sum(q_m * k_n))

        pairs = [(5, 2), (9, 6), (3, 0), (20, 17)]  # offset 3 each
        scores = [score(m, n) for m, n in pairs]
        if not np.allclose(scores, scores[0], rtol=RTOL, atol=ATOL):
            raise _Failed(
                "q at m and k at n scored "
                + ", ".join(f"{s:.4f}" for s in scores)
                + " for (m, n) = "
                + ", ".join(map(str, pairs))
                + ": the same offset must give the same score. Turn q and k "
                "by the angles of their own positions, with the same "
                "pairing and frequencies"
            )

    @checker.item("dimension i turns with i + d_k/2, by p * base^(-2i/d_k)")
    def _() -> None:
        _compare(
            checker.call(x, positions),
            rope(x, positions),
            "the rotated x",
            {
                "neighbouring dimensions (2i, 2i + 1) were paired, the "
                "layout of RoFormer and Meta's code; this package, like "
                "transformers' Llama code, turns dimension i with i + d_k/2 "
                "(two halves)": _rope_neighbours(x, positions, base),
                "the rotation turned the other way (angle -p * theta): "
                "[x1 cos - x2 sin, x1 sin + x2 cos] with x1, x2 the halves": (
                    rope(x, -positions)
                ),
                "the frequencies were base^(-i/d_k): pair i turns at "
                "base^(-2i/d_k)": _rope_halves(x, positions, base, 1.0),
            },
        )

    @checker.item("(B, T) positions: each sequence turned by its own")
    def _() -> None:
        rows = np.stack([np.arange(6), np.arange(6) + 4])  # (B, T)
        _compare(
            checker.call(x, rows),
            rope(x, rows),
            "the rotated x",
            {
                "every sequence was turned by the positions of sequence 0: "
                "with (B, T) positions, the angles are (B, 1, T, d_k/2), one "
                "row per sequence": rope(x, rows[0])
            },
        )

    checker.run(verbose)


def check_padded_positions(
    fn: Callable, *, verbose: bool = True, framework: str = "numpy"
) -> None:
    """Check ``fn(keep)``: the positions of the real tokens of a padded batch.

    ``keep`` is (B, T) boolean, True at real tokens; prompts may be padded on
    the left (as for batched generation). The first real token of each row
    gets position 0, the next 1, and so on, as the prompt alone would have
    them; what a padding slot gets is not checked. Catches: counting from
    the start of the row, padding included (RoPE then turns the prompt as
    if it started later); counting from 1.
    """
    checker = _Checker("check_padded_positions", fn, framework)
    keep = np.array(
        [
            [False, False, True, True, True],  # padded on the left
            [True, True, True, True, True],
            [False, False, False, False, True],
            [True, True, True, False, False],  # padded on the right
        ]
    )
    expected = np.cumsum(keep, axis=-1) - 1

    @checker.item("(B, T) integers, one position per slot")
    def _() -> None:
        got = _array(checker.call(keep))
        _expect_shape(got, keep.shape, "the positions")
        if not np.issubdtype(got.dtype, np.integer):
            raise _Failed(
                f"the positions have dtype {got.dtype}: they are integers"
            )

    @checker.item("each row's real tokens are numbered from 0")
    def _() -> None:
        got = _array(checker.call(keep))
        if np.array_equal(got[keep], expected[keep]):
            return
        counted = np.broadcast_to(np.arange(keep.shape[1]), keep.shape)
        if np.array_equal(got[keep], counted[keep]):
            raise _Failed(
                "the positions count from the start of the row, padding "
                "included: row 0's first real token got position 2, where "
                "the prompt alone gives it 0, so RoPE turns the prompt as if "
                "it started later. Count the real tokens: "
                "np.cumsum(keep, axis=-1) - 1"
            )
        if np.array_equal(got[keep], expected[keep] + 1):
            raise _Failed(
                "the real tokens are numbered from 1: the first is position "
                "0 (np.cumsum(keep, axis=-1) - 1)"
            )
        raise _Failed(
            f"got {got.tolist()} for keep = {keep.astype(int).tolist()}; at "
            f"the real tokens expected {np.where(keep, expected, -1).tolist()}"
            " (-1 marks padding, not checked)"
        )

    checker.run(verbose)


# ---------------------------------------------------------------------------
# Decoding and tiled attention


def check_kv_cache_update(
    fn: Callable, *, verbose: bool = True, framework: str = "numpy"
) -> None:
    """Check ``fn(keys, values, k, v, length) -> (k_all, v_all)``.

    ``keys`` and ``values`` are preallocated (B, H_kv, max_len, d_k) buffers
    holding ``length`` cached tokens; ``k`` and ``v`` are (B, H_kv, T, d_k),
    the new tokens. ``fn`` writes them at positions ``length`` to
    ``length + T - 1`` in place and returns views of the ``length + T``
    positions written (as :meth:`mha.KVCache.update` does). Catches: writing
    every step at position 0; returning the whole buffer (zeros included);
    building new arrays and leaving the buffers unwritten; returning copies;
    writing past ``max_len`` without an error.
    """
    checker = _Checker("check_kv_cache_update", fn, framework)
    rng = np.random.default_rng(6)
    shape = (2, 3, 8, 4)  # (B, H_kv, max_len, d_k)
    # three steps of 3, 1 and 2 new tokens: (B, H_kv, T, d_k) keys, values
    steps = [_normal(rng, (2, 3, t, 4), (2, 3, t, 4)) for t in (3, 1, 2)]

    def fresh():
        buffers = (np.zeros(shape), np.zeros(shape))
        if framework == "torch":
            import torch

            return tuple(torch.from_numpy(b) for b in buffers)
        return buffers

    def run_steps():
        keys, values = fresh()
        length, results = 0, []
        for k, v in steps:
            results.append(
                checker.call(keys, values, k, v, length, copy=False)
            )
            length += k.shape[2]
        return keys, values, results

    everything_k = np.concatenate([k for k, _ in steps], axis=2)
    everything_v = np.concatenate([v for _, v in steps], axis=2)

    @checker.item("returns (k_all, v_all), (B, H_kv, length + T, d_k) each")
    def _() -> None:
        _, _, results = run_steps()
        length = 0
        for (k, _), result in zip(steps, results):
            length += k.shape[2]
            if not isinstance(result, tuple | list) or len(result) != 2:
                raise _Failed(
                    f"it returned {type(result).__name__}: return the pair "
                    "(k_all, v_all)"
                )
            for name, part in zip(("k_all", "v_all"), result):
                got = _array(part)
                if got.shape == shape and length < shape[2]:
                    raise _Failed(
                        f"{name} has all max_len = {shape[2]} positions after "
                        f"{length} tokens: the unwritten ones are zeros, and "
                        "the queries would attend to them (a key of zeros "
                        "scores 0, not -inf). Return keys[:, :, :length + T]"
                    )
                _expect_shape(got, (2, 3, length, 4), name)

    @checker.item("the buffers hold every token, each after the ones before")
    def _() -> None:
        keys, values, _ = run_steps()
        n, newest = everything_k.shape[2], steps[-1][0]
        keys, values = _array(keys), _array(values)
        if not keys[:, :, :n].any():
            raise _Failed(
                "the keys buffer is still zeros: the new keys went into a new "
                "array (np.concatenate?), and the next step will not find "
                "them. Write into keys[:, :, length:length + T]"
            )
        if np.allclose(keys[:, :, : newest.shape[2]], newest):
            raise _Failed(
                "the newest keys sit at position 0: each step writes after "
                "the tokens cached before it, at keys[:, :, length:length + "
                "T]"
            )
        _compare(keys[:, :, :n], everything_k, "the keys buffer")
        _compare(values[:, :, :n], everything_v, "the values buffer")

    @checker.item("k_all and v_all are the tokens so far, in order")
    def _() -> None:
        _, _, results = run_steps()
        k_all, v_all = (_array(part) for part in results[-1])
        _compare(k_all, everything_k, "k_all after three steps")
        _compare(v_all, everything_v, "v_all after three steps")

    @checker.item("returns views of the buffers, not copies")
    def _() -> None:
        keys, values, results = run_steps()
        for name, buffer, part in zip(
            ("k_all", "v_all"), (keys, values), results[-1]
        ):
            if not _shares_memory(part, buffer):
                raise _Failed(
                    f"{name} is a copy: copying every cached token at every "
                    "step is the cost a cache is there to save. Return the "
                    "slice keys[:, :, :length + T] itself"
                )

    @checker.item("writing past max_len raises an error")
    def _() -> None:
        keys, values = fresh()
        k, v = _normal(rng, (2, 3, 3, 4), (2, 3, 3, 4))
        try:
            checker.call(keys, values, k, v, 6, copy=False)  # 6 + 3 > 8
        except _Failed:
            return
        raise _Failed(
            "3 new tokens after 6 cached ones, with max_len = 8, went "
            "through without an error: a token was dropped, or the result "
            "is longer than the buffer. Raise an error when length + T > "
            "max_len"
        )

    checker.run(verbose)


def check_online_softmax_step(
    fn: Callable, *, verbose: bool = True, framework: str = "numpy"
) -> None:
    """Check ``fn(m, ell, acc, scores, v) -> (m, ell, acc)``: one step of the
    online softmax (the inner loop of :func:`mha.flash_attention`).

    ``m`` (B_q,) is the running maximum of the scores seen so far, ``ell``
    (B_q,) the running sum of ``exp(score - m)``, ``acc`` (B_q, d_v) the
    running sum of ``exp(score - m) * value``; ``scores`` (B_q, B_k) and
    ``v`` (B_k, d_v) are the next block. After the last block, ``acc /
    ell`` is the attention output. Start from ``m = -inf``, ``ell = 0``,
    ``acc = 0``. Catches: ``acc`` or ``ell`` not rescaled when the maximum
    grows; the rescale inverted; the block's maximum in place of the running
    one; the exponentials of the raw scores (overflow).
    """
    checker = _Checker("check_online_softmax_step", fn, framework)
    rng = np.random.default_rng(7)
    # four blocks of 3 keys for 2 queries; the maxima go up, down, far up
    blocks = [
        (rng.normal(size=(2, 3)) + shift, rng.normal(size=(3, 4)))
        for shift in (0.0, 3.0, -2.0, 800.0, 1.0)
    ]

    def fold(step, blocks):
        m, ell, acc = np.full(2, -np.inf), np.zeros(2), np.zeros((2, 4))
        for scores, v in blocks:
            m, ell, acc = step(m, ell, acc, scores, v)
        return m, ell, acc

    def learner(m, ell, acc, scores, v):
        result = checker.call(m, ell, acc, scores, v)
        if not isinstance(result, tuple | list) or len(result) != 3:
            raise _Failed(
                f"it returned {type(result).__name__}: return the triple "
                "(m, ell, acc)"
            )
        return tuple(_array(part) for part in result)

    def expected(blocks):
        scores = np.concatenate([s for s, _ in blocks], axis=-1)
        values = np.concatenate([v for _, v in blocks], axis=0)
        return reference.softmax(scores) @ values, scores

    @checker.item("one block: acc / ell = softmax(scores) @ v")
    def _() -> None:
        m, ell, acc = learner(
            np.full(2, -np.inf), np.zeros(2), np.zeros((2, 4)), *blocks[0]
        )
        if not (np.isfinite(ell).all() and np.isfinite(acc).all()):
            raise _Failed(
                "the first block, from m = -inf, ell = 0, acc = 0, gave "
                f"ell = {_short(ell)}: the old sums' factor exp(m - m_new) "
                "is exp(-inf) = 0 there; an inverted factor, "
                "exp(m_new - m), is exp(+inf)"
            )
        _compare(acc / ell[:, None], expected(blocks[:1])[0], "acc / ell")

    @checker.item("three blocks: acc / ell = the softmax over all of them")
    def _() -> None:
        m, ell, acc = fold(learner, blocks[:3])
        _compare(
            acc / ell[:, None],
            expected(blocks[:3])[0],
            "acc / ell",
            {
                hint: twin[2] / twin[1][:, None]
                for hint, twin in _online_mistakes(fold, blocks[:3]).items()
            },
        )

    @checker.item("m is the running maximum, ell the sum of exp(score - m)")
    def _() -> None:
        m, ell, _ = fold(learner, blocks[:3])
        scores = expected(blocks[:3])[1]
        if np.allclose(m, blocks[2][0].max(axis=-1)):
            raise _Failed(
                "m is the last block's own maximum: it is the running "
                "maximum, np.maximum(m, scores.max(axis=-1)); with the "
                "block's maximum, a block far below the ones before "
                "overflows exp(m - m_new)"
            )
        _compare(m, scores.max(axis=-1), "m")
        _compare(
            ell, np.exp(scores - scores.max(-1, keepdims=True)).sum(-1), "ell"
        )

    @checker.item("stable: a block of scores near 800 gives no inf or NaN")
    def _() -> None:
        m, ell, acc = fold(learner, blocks)
        if not (np.isfinite(ell).all() and np.isfinite(acc).all()):
            raise _Failed(
                "ell or acc became inf or NaN after a block of scores near "
                "800: np.exp of a raw score overflows above about 709.78. "
                "Take exp(scores - m_new), with m_new the new running "
                "maximum, and rescale the old sums by exp(m - m_new)"
            )
        _compare(acc / ell[:, None], expected(blocks)[0], "acc / ell")

    checker.run(verbose)


def _online_mistakes(fold: Callable, blocks: list) -> dict[str, tuple]:
    """The typical wrong online-softmax steps, folded over ``blocks``."""

    def step(
        m,
        ell,
        acc,
        scores,
        v,
        acc_scale=True,
        ell_scale=True,
        sign=1,
        raw=False,
    ):
        m_new = np.maximum(m, scores.max(-1))
        # 0 for the first block (m = -inf), in the inverted form too
        rescale = np.where(np.isfinite(m), np.exp(sign * (m - m_new)), 0.0)
        p = np.exp(scores if raw else scores - m_new[:, None])
        ell = (rescale if ell_scale else 1.0) * ell + p.sum(-1)
        acc = (rescale[:, None] if acc_scale else 1.0) * acc + p @ v
        return m_new, ell, acc

    def variant(**how):
        with np.errstate(all="ignore"):
            return fold(lambda *a: step(*a, **how), blocks)

    return {
        "acc was not rescaled when the maximum grew: the values summed "
        "before were weighted by exp(score - m_old); multiply acc by "
        "exp(m_old - m_new) before adding the new block": variant(
            acc_scale=False
        ),
        "ell was not rescaled when the maximum grew: multiply the old sum "
        "by exp(m_old - m_new) before adding the new block": variant(
            ell_scale=False
        ),
        "the rescale is inverted: the old sums are multiplied by "
        "exp(m_old - m_new), at most 1, not exp(m_new - m_old)": variant(
            sign=-1.0
        ),
        "the new block's exponentials were taken of the raw scores: they "
        "are exp(scores - m_new), on the same footing as the rescaled old "
        "sums (and safe from overflow)": variant(raw=True),
    }


# ---------------------------------------------------------------------------
# The computations the checks compare with, and the known mistakes


def _weights(q: Array, k: Array) -> Array:
    return reference.scaled_dot_product_attention(q, k, k[..., :1])[1]


def _attend(
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None = None,
    *,
    scale: float | None = None,
    axis: int = -1,
) -> Array:
    """Scaled dot-product attention with a chosen scale and softmax axis."""
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    scores = q @ np.swapaxes(k, -1, -2) * scale  # (..., T_q, T_k)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    return reference.softmax(scores, axis=axis) @ v


def _interleaved(x: Array, num_heads: int) -> Array:
    """Heads taking every H-th column: (..., T, D) -> (..., H, T, d_k)."""
    *lead, t, d = x.shape
    heads = x.reshape(*lead, t, d // num_heads, num_heads)
    return np.moveaxis(heads, -1, -3)


def _multi_head(
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
) -> Array:
    """Multi-head attention, right or with one of the known mistakes."""
    *lead, t, d = x.shape
    d_k = d // num_heads

    def heads(y: Array) -> Array:  # (..., T, D) -> (..., H, T, d_k)
        if split == "no-transpose":
            return y.reshape(*lead, num_heads, t, d_k)
        if split == "interleaved":
            return _interleaved(y, num_heads)
        return reference.split_heads(y, num_heads)

    q, k, v = heads(x @ w_q), heads(x @ w_k), heads(x @ w_v)
    out = _attend(q, k, v, mask, scale=scale, axis=axis)  # (..., H, T, d_k)
    if merge == "no-transpose":
        merged = out.reshape(*lead, t, d)
    else:
        merged = reference.merge_heads(out)  # (..., T, D)
    return merged @ w_o if use_w_o else merged


def _rope_halves(
    x: Array, positions: Array, base: float, exponent: float = 2.0
) -> Array:
    """Rotate-half RoPE with frequencies ``base**(-exponent * i / d_k)``."""
    d_k = x.shape[-1]
    i = np.arange(d_k // 2)
    angles = positions[..., None] * base ** (-exponent * i / d_k)
    if angles.ndim == 3:  # (B, T, d_k/2) -> (B, 1, T, d_k/2)
        angles = angles[:, None]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., : d_k // 2], x[..., d_k // 2 :]
    return np.concatenate((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)


def _rope_neighbours(x: Array, positions: Array, base: float) -> Array:
    """RoPE that pairs dimensions 2i and 2i + 1 (RoFormer's layout)."""
    d_k = x.shape[-1]
    # reorder (x0, x1, x2, x3, ...) to (x0, x2, ..., x1, x3, ...), turn the
    # halves, and put the dimensions back in their places
    order = np.concatenate((np.arange(0, d_k, 2), np.arange(1, d_k, 2)))
    turned = _rope_halves(x[..., order], positions, base)
    return turned[..., np.argsort(order)]


# ---------------------------------------------------------------------------
# Helpers: arrays in and out, comparisons, messages

_AXES = {
    (2, 3, 4, 5): "(B, T, H, d_k): the heads' axis is after T; swap the axes "
    "T and H (np.swapaxes(heads, -3, -2))",
    (2, 4, 5, 3): "(B, H, d_k, T): the last two axes are swapped; the heads "
    "are (B, H, T, d_k)",
    (2, 3, 20): "(B, T, D): the heads were not split",
}


def _to_framework(value: Any, framework: str, copy: bool) -> Any:
    if not isinstance(value, np.ndarray):
        return value
    if copy:
        value = value.copy()
    if framework == "torch":
        import torch

        return torch.from_numpy(value)  # shares memory, float64 stays
    return value


def _array(value: Any) -> Array:
    """A learner's result as a NumPy array (torch tensors are converted)."""
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except Exception as error:
        raise _Failed(
            f"the result is {type(value).__name__}, not an array ({error})"
        ) from None


def _shares_memory(part: Any, buffer: Any) -> bool:
    if hasattr(part, "untyped_storage"):  # torch
        return part.untyped_storage().data_ptr() == (
            buffer.untyped_storage().data_ptr()
        )
    return isinstance(part, np.ndarray) and np.shares_memory(part, buffer)


def _output_and_weights(result: Any) -> tuple[Array, Array | None]:
    """``output`` or ``(output, weights)``, as arrays."""
    if isinstance(result, tuple | list):
        if len(result) != 2:
            raise _Failed(
                f"it returned {len(result)} values: return the output, or "
                "(output, weights)"
            )
        return _array(result[0]), _array(result[1])
    return _array(result), None


def _normal(rng: np.random.Generator, *shapes: tuple) -> tuple[Array, ...]:
    return tuple(rng.normal(size=shape) for shape in shapes)


def _expect_shape(
    got: Array,
    shape: tuple,
    what: str,
    known: dict[tuple, str] | None = None,
) -> None:
    if got.shape == tuple(shape):
        return
    hint = (known or {}).get(got.shape, "")
    raise _Failed(
        f"{what} has shape {got.shape}, expected {tuple(shape)}"
        + (f": {hint}" if hint else "")
    )


def _compare(
    got: Any,
    expected: Array,
    what: str,
    mistakes: dict[str, Array | tuple[Array, ...]] | None = None,
) -> None:
    """Pass if ``got`` equals ``expected`` up to rounding; otherwise fail,
    naming the mistake whose result (one of them) ``got`` equals, if any."""
    got = _array(got)
    _expect_shape(got, expected.shape, what)
    if not np.issubdtype(got.dtype, np.number) and got.dtype != bool:
        raise _Failed(f"{what} has dtype {got.dtype}, expected numbers")
    if np.allclose(got, expected, rtol=RTOL, atol=ATOL, equal_nan=True):
        return
    # NaN where a mistake gives 0 is a second mistake (an empty row): name
    # the first
    for hint, twins in (mistakes or {}).items():
        for twin in twins if isinstance(twins, tuple) else (twins,):
            if twin.shape == got.shape and np.allclose(
                np.nan_to_num(got), np.nan_to_num(twin), rtol=RTOL, atol=ATOL
            ):
                raise _Failed(hint)
    if np.isnan(got).any() and not np.isnan(expected).any():
        where = tuple(int(i) for i in np.argwhere(np.isnan(got))[0])
        raise _Failed(f"{what} holds NaN (first at index {where})")
    with np.errstate(invalid="ignore"):
        error = np.abs(got.astype(float) - expected)
    where = np.unravel_index(np.nanargmax(error), error.shape)
    raise _Failed(
        f"{what} differs from the package's result by up to "
        f"{error[where]:.3g}: at index {tuple(int(i) for i in where)} it is "
        f"{got[where]:.4g}, expected {expected[where]:.4g}"
    )


def _compare_mask(got: Array, expected: Array, mistakes: dict) -> None:
    if np.array_equal(got, expected):
        return
    for hint, twin in mistakes.items():
        if np.array_equal(got, twin):
            raise _Failed(hint)
    raise _Failed(
        f"got\n{got.astype(int)}\nexpected\n{expected.astype(int)} "
        "(1 = may attend)"
    )


def _short(values: Array) -> str:
    return np.array2string(np.asarray(values), precision=4, separator=", ")


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"array {tuple(shape)}"
    return repr(value)


# A message fits a code cell's output box even inside a solution's dropdown.
WIDTH = 74


def _wrap(title: str, detail: str) -> str:
    """The message, in lines of at most ``WIDTH`` characters."""
    lines = textwrap.wrap(title, WIDTH)
    for paragraph in detail.split("\n"):
        lines += textwrap.wrap(
            paragraph, WIDTH, initial_indent="  ", subsequent_indent="  "
        ) or [""]
    return "\n".join(lines)
