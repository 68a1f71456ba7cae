"""Checkers of masks and positions: causal masks, RoPE, padded positions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import reference
from .._validate import check_choice
from .checker import (
    Array,
    Checker,
    Failed,
    as_array,
    compare,
    compare_mask,
    expect_shape,
    normal_arrays,
    tolerance,
)


def check_causal_mask(
    fn: Callable,
    *,
    align: str = "top-left",
    verbose: bool = True,
    framework: str = "numpy",
    device: Any = None,
) -> None:
    """Check ``fn(t_q, t_k)``: a boolean causal mask, True = may attend.

    ``align="top-left"``: query i sees keys 0..i (``F.scaled_dot_product_
    attention(is_causal=True)``). ``align="bottom-right"``: query i sees keys
    0..i + T_k - T_q, the T_q newest tokens after T_k - T_q cached ones.
    Catches: True marking the future; the diagonal left out; the upper
    triangle; the other alignment; an additive float mask.
    """
    __tracebackhide__ = True  # tracebacks show the caller's line
    check_choice("align", align, ("top-left", "bottom-right"))
    checker = Checker("check_causal_mask", fn, framework, device=device)
    other = "bottom-right" if align == "top-left" else "top-left"

    def expected(t_q, t_k, how=align):
        return reference.causal_mask(t_q, t_k, align=how)

    def call(t_q, t_k):
        got = as_array(checker.call(t_q, t_k))
        expect_shape(got, (t_q, t_k), f"the mask for ({t_q}, {t_k})")
        if got.dtype != bool:
            raise Failed(
                f"the mask has dtype {got.dtype}: masks here are boolean "
                "arrays, True = may attend (an additive mask of 0 and -inf "
                "is another convention)"
            )
        return got

    @checker.item("a boolean (T, T) mask: query i sees keys 0..i")
    def _() -> None:
        compare_mask(
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
        compare_mask(
            call(3, 6), expected(3, 6), {hints[align]: expected(3, 6, other)}
        )

    @checker.item("the same for T_q = 1, T_k = 4 and for T_q = 4 > T_k = 2")
    def _() -> None:
        compare_mask(call(1, 4), expected(1, 4), {})
        compare_mask(call(4, 2), expected(4, 2), {})

    checker.run(verbose)


def check_rope(
    fn: Callable,
    *,
    base: float = 10000.0,
    verbose: bool = True,
    framework: str = "numpy",
    device: Any = None,
) -> None:
    """Check ``fn(x, positions)``: rotary embeddings of (B, H, T, d_k) heads.

    The "rotate half" pairing of :func:`mha.apply_rope` and ``transformers``:
    dimension i turns with i + d_k/2 by ``p * base**(-2i / d_k)``.
    ``positions`` is (T,) or (B, T) integers. Catches: lengths changed;
    neighbouring dimensions paired; the rotation turned the other way;
    frequencies ``base**(-i / d_k)``; the positions of row 0 used for every
    row.
    """
    __tracebackhide__ = True  # tracebacks show the caller's line
    from ..positions import apply_rope

    checker = Checker("check_rope", fn, framework, device=device)
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
        expect_shape(as_array(checker.call(x, positions)), x.shape, "result")

    @checker.item("a rotation: every vector keeps its length")
    def _() -> None:
        got = as_array(checker.call(x, positions))
        lengths = np.linalg.norm(got, axis=-1)
        compare(lengths, np.linalg.norm(x, axis=-1), "the lengths")

    @checker.item("position 0 leaves a vector as it is")
    def _() -> None:
        got = as_array(checker.call(x, np.zeros(6, dtype=np.int64)))
        compare(got, x, "x turned by position 0")

    @checker.item("a score depends on the offset of the positions only")
    def _() -> None:
        q, k = normal_arrays(rng, (1, 1, 1, 8), (1, 1, 1, 8))

        dtypes = []

        def score(m, n):
            q_m = as_array(checker.call(q, np.array([m])))
            k_n = as_array(checker.call(k, np.array([n])))
            dtypes.extend((q_m.dtype, k_n.dtype))
            return float(np.sum(q_m * k_n))

        pairs = [(5, 2), (9, 6), (3, 0), (20, 17)]  # offset 3 each
        scores = [score(m, n) for m, n in pairs]
        rtol, atol = tolerance(np.result_type(*dtypes))
        if not np.allclose(scores, scores[0], rtol=rtol, atol=atol):
            raise Failed(
                "q at m and k at n scored "
                + ", ".join(f"{s:.6g}" for s in scores)
                + " for (m, n) = "
                + ", ".join(map(str, pairs))
                + ": the same offset must give the same score. Turn q and k "
                "by the angles of their own positions, with the same "
                "pairing and frequencies"
            )

    @checker.item("dimension i turns with i + d_k/2, by p * base^(-2i/d_k)")
    def _() -> None:
        compare(
            checker.call(x, positions),
            rope(x, positions),
            "the rotated x",
            {
                "neighbouring dimensions (2i, 2i + 1) were paired, the "
                "layout of RoFormer and Meta's code; this package, like "
                "transformers' Llama code, turns dimension i with i + d_k/2 "
                "(two halves)": rope_neighbours(x, positions, base),
                "the rotation turned the other way (angle -p * theta): "
                "[x1 cos - x2 sin, x1 sin + x2 cos] with x1, x2 the halves": (
                    rope(x, -positions)
                ),
                "the frequencies were base^(-i/d_k): pair i turns at "
                "base^(-2i/d_k)": rope_halves(x, positions, base, 1.0),
            },
        )

    @checker.item("(B, T) positions: each sequence turned by its own")
    def _() -> None:
        rows = np.stack([np.arange(6), np.arange(6) + 4])  # (B, T)
        compare(
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
    fn: Callable,
    *,
    verbose: bool = True,
    framework: str = "numpy",
    device: Any = None,
) -> None:
    """Check ``fn(keep)``: the positions of the real tokens of a padded batch.

    ``keep`` is (B, T) boolean, True at real tokens; prompts may be padded on
    the left (as for batched generation). The first real token of each row
    gets position 0, the next 1, and so on, as the prompt alone would have
    them; what a padding slot gets is not checked. Catches: counting from
    the start of the row, padding included (RoPE then turns the prompt as
    if it started later); counting from 1.
    """
    __tracebackhide__ = True  # tracebacks show the caller's line
    checker = Checker("check_padded_positions", fn, framework, device=device)
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
        got = as_array(checker.call(keep))
        expect_shape(got, keep.shape, "the positions")
        if not np.issubdtype(got.dtype, np.integer):
            raise Failed(
                f"the positions have dtype {got.dtype}: they are integers"
            )

    @checker.item("each row's real tokens are numbered from 0")
    def _() -> None:
        got = as_array(checker.call(keep))
        if np.array_equal(got[keep], expected[keep]):
            return
        counted = np.broadcast_to(np.arange(keep.shape[1]), keep.shape)
        if np.array_equal(got[keep], counted[keep]):
            raise Failed(
                "the positions count from the start of the row, padding "
                "included: row 0's first real token got position 2, where "
                "the prompt alone gives it 0, so RoPE turns the prompt as if "
                "it started later. Count the real tokens: "
                "np.cumsum(keep, axis=-1) - 1"
            )
        if np.array_equal(got[keep], expected[keep] + 1):
            raise Failed(
                "the real tokens are numbered from 1: the first is position "
                "0 (np.cumsum(keep, axis=-1) - 1)"
            )
        raise Failed(
            f"got {got.tolist()} for keep = {keep.astype(int).tolist()}; at "
            f"the real tokens expected {np.where(keep, expected, -1).tolist()}"
            " (-1 marks padding, not checked)"
        )

    checker.run(verbose)


def rope_halves(
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


def rope_neighbours(x: Array, positions: Array, base: float) -> Array:
    """RoPE that pairs dimensions 2i and 2i + 1 (RoFormer's layout)."""
    d_k = x.shape[-1]
    # reorder (x0, x1, x2, x3, ...) to (x0, x2, ..., x1, x3, ...), turn the
    # halves, and put the dimensions back in their places
    order = np.concatenate((np.arange(0, d_k, 2), np.arange(1, d_k, 2)))
    turned = rope_halves(x[..., order], positions, base)
    return turned[..., np.argsort(order)]
