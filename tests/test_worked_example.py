"""The worked example of chapter 04, checked against values derived by hand.

Every expected value below comes from the derivation written in the comments (exact integer
dot products, then exp and normalisation with ``math``), not from the package's output.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from mha import worked_example as we

TOL = 1e-12
ROOT2 = math.sqrt(2.0)
E = math.exp(
    1.0 / ROOT2
)  # e^{1/sqrt(2)}: the weight of a key whose raw score is 1 more than the smallest


# --- the matrices, exactly as given in the example ---------------------------------------------


def test_matrices_are_exactly_the_example() -> None:
    assert np.array_equal(we.X, [[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0]])
    assert np.array_equal(we.W_Q_HEADS[0], [[1, 0], [0, 1], [0, 0], [0, 0]])
    assert np.array_equal(we.W_K_HEADS[0], [[0, 1], [1, 0], [0, 0], [0, 0]])
    assert np.array_equal(we.W_V_HEADS[0], [[1, 0], [0, 0], [1, 0], [0, 0]])
    assert np.array_equal(we.W_Q_HEADS[1], [[0, 0], [0, 0], [1, 0], [0, 1]])
    assert np.array_equal(we.W_K_HEADS[1], [[0, 0], [0, 0], [0, 1], [1, 0]])
    assert np.array_equal(we.W_V_HEADS[1], [[0, 1], [0, 1], [0, 0], [0, 0]])
    assert np.array_equal(we.W_O, [[1, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, -1]])
    assert len(we.W_Q_HEADS) == len(we.W_K_HEADS) == len(we.W_V_HEADS) == we.NUM_HEADS == 2
    assert (we.SEQ_LEN, we.D_MODEL, we.D_K) == (3, 4, 2)


def test_fused_matrices_are_the_heads_side_by_side() -> None:
    # [W_Q1 | W_Q2] written out: head 1 owns columns 0-1, head 2 columns 2-3.
    assert np.array_equal(we.W_Q, np.eye(4))
    assert np.array_equal(we.W_K, [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]])
    assert np.array_equal(we.W_V, [[1, 0, 0, 1], [0, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]])


def test_matrices_are_read_only() -> None:
    for array in (
        we.X,
        we.W_O,
        we.W_Q,
        we.W_K,
        we.W_V,
        *we.W_Q_HEADS,
        *we.W_K_HEADS,
        *we.W_V_HEADS,
    ):
        with pytest.raises(ValueError):
            array[0, 0] = 5.0


# --- hand derivation ---------------------------------------------------------------------------
# Tokens: x_0 = (1, 0, 1, 0), x_1 = (0, 1, 0, 1), x_2 = (1, 1, 0, 0).
#
# Head 1: q = (x0, x1), k = (x1, x0), v = (x0 + x2, 0).
#   q_0 = (1, 0), q_1 = (0, 1), q_2 = (1, 1)
#   k_0 = (0, 1), k_1 = (1, 0), k_2 = (1, 1)
#   v_0 = (2, 0), v_1 = (0, 0), v_2 = (1, 0)
#   raw scores, row t = q_t . (k_0, k_1, k_2):
#   row 0: (1*0 + 0*1, 1*1 + 0*0, 1*1 + 0*1) = (0, 1, 1)
#   row 1: (0*0 + 1*1, 0*1 + 1*0, 0*1 + 1*1) = (1, 0, 1)
#   row 2: (1*0 + 1*1, 1*1 + 1*0, 1*1 + 1*1) = (1, 1, 2)
HEAD1_Q = [[1, 0], [0, 1], [1, 1]]
HEAD1_K = [[0, 1], [1, 0], [1, 1]]
HEAD1_V = [[2, 0], [0, 0], [1, 0]]
HEAD1_RAW = [
    [Fraction(0), Fraction(1), Fraction(1)],
    [Fraction(1), Fraction(0), Fraction(1)],
    [Fraction(1), Fraction(1), Fraction(2)],
]
#
# Head 2: q = (x2, x3), k = (x3, x2), v = (0, x0 + x1).
#   q_0 = (1, 0), q_1 = (0, 1), q_2 = (0, 0)
#   k_0 = (0, 1), k_1 = (1, 0), k_2 = (0, 0)
#   v_0 = (0, 1), v_1 = (0, 1), v_2 = (0, 2)
#   row 0: (1*0 + 0*1, 1*1 + 0*0, 1*0 + 0*0) = (0, 1, 0)
#   row 1: (0*0 + 1*1, 0*1 + 1*0, 0*0 + 1*0) = (1, 0, 0)
#   row 2: q_2 = 0, so every dot product is 0:  (0, 0, 0)
HEAD2_Q = [[1, 0], [0, 1], [0, 0]]
HEAD2_K = [[0, 1], [1, 0], [0, 0]]
HEAD2_V = [[0, 1], [0, 1], [0, 2]]
HEAD2_RAW = [
    [Fraction(0), Fraction(1), Fraction(0)],
    [Fraction(1), Fraction(0), Fraction(0)],
    [Fraction(0), Fraction(0), Fraction(0)],
]


def _softmax_by_hand(raw_row: list[Fraction]) -> list[float]:
    """exp(raw / sqrt(2)) for each entry, divided by the row's total."""
    exps = [math.exp(float(s) / ROOT2) for s in raw_row]
    total = math.fsum(exps)
    return [e / total for e in exps]


@pytest.fixture(scope="module")
def steps() -> we.WorkedExample:
    return we.compute()


@pytest.mark.parametrize(
    ("head", "q", "k", "v"),
    [(0, HEAD1_Q, HEAD1_K, HEAD1_V), (1, HEAD2_Q, HEAD2_K, HEAD2_V)],
)
def test_projections(steps: we.WorkedExample, head: int, q, k, v) -> None:
    assert np.array_equal(steps.heads[head].q, q)
    assert np.array_equal(steps.heads[head].k, k)
    assert np.array_equal(steps.heads[head].v, v)


@pytest.mark.parametrize(("head", "raw"), [(0, HEAD1_RAW), (1, HEAD2_RAW)])
def test_raw_and_scaled_scores(
    steps: we.WorkedExample, head: int, raw: list[list[Fraction]]
) -> None:
    # Integer dot products of integer vectors: exact in floating point.
    assert np.array_equal(steps.heads[head].scores, np.array(raw, dtype=float))
    scaled = [[float(s) / ROOT2 for s in row] for row in raw]
    np.testing.assert_allclose(steps.heads[head].scaled_scores, scaled, rtol=0, atol=TOL)


@pytest.mark.parametrize(("head", "raw"), [(0, HEAD1_RAW), (1, HEAD2_RAW)])
def test_weights_by_exp_and_normalise(
    steps: we.WorkedExample, head: int, raw: list[list[Fraction]]
) -> None:
    expected = [_softmax_by_hand(row) for row in raw]
    np.testing.assert_allclose(steps.heads[head].weights, expected, rtol=0, atol=TOL)


def test_head1_weights_closed_form(steps: we.WorkedExample) -> None:
    # Row 0 raw (0, 1, 1): exp of scaled = (1, E, E), total 1 + 2E.
    # Row 1 raw (1, 0, 1): (E, 1, E) / (1 + 2E).
    # Row 2 raw (1, 1, 2): (E, E, E^2) / (2E + E^2) = (1, 1, E) / (2 + E).
    expected = [
        [1 / (1 + 2 * E), E / (1 + 2 * E), E / (1 + 2 * E)],
        [E / (1 + 2 * E), 1 / (1 + 2 * E), E / (1 + 2 * E)],
        [1 / (2 + E), 1 / (2 + E), E / (2 + E)],
    ]
    np.testing.assert_allclose(steps.heads[0].weights, expected, rtol=0, atol=TOL)
    # To four decimals, the numbers the chapter prints.
    np.testing.assert_allclose(steps.heads[0].weights[0], [0.1978, 0.4011, 0.4011], atol=5e-5)


def test_head2_weights_closed_form(steps: we.WorkedExample) -> None:
    # Row 0 raw (0, 1, 0): (1, E, 1) / (2 + E).  Row 1 raw (1, 0, 0): (E, 1, 1) / (2 + E).
    # Row 2 raw (0, 0, 0): a zero query scores every key alike, so the weights are uniform,
    # 1/3 each.
    expected = [
        [1 / (2 + E), E / (2 + E), 1 / (2 + E)],
        [E / (2 + E), 1 / (2 + E), 1 / (2 + E)],
        [1 / 3, 1 / 3, 1 / 3],
    ]
    np.testing.assert_allclose(steps.heads[1].weights, expected, rtol=0, atol=TOL)


# Head outputs, weights times values (only one value column is non-zero in each head):
#   head 1, column 0 = 2 * w[t, 0] + 0 * w[t, 1] + 1 * w[t, 2]
#     row 0: (2 + E) / (1 + 2E);  row 1: (2E + E) / (1 + 2E) = 3E / (1 + 2E);
#     row 2: (2 + E) / (2 + E) = 1
#   head 2, column 1 = 1 * w[t, 0] + 1 * w[t, 1] + 2 * w[t, 2]
#     row 0: (1 + E + 2) / (2 + E);  row 1: (E + 1 + 2) / (2 + E);  row 2: (1 + 1 + 2) / 3 = 4/3
HEAD1_OUT = [
    [(2 + E) / (1 + 2 * E), 0.0],
    [3 * E / (1 + 2 * E), 0.0],
    [1.0, 0.0],
]
HEAD2_OUT = [[0.0, (3 + E) / (2 + E)], [0.0, (3 + E) / (2 + E)], [0.0, 4 / 3]]


def test_head_outputs_concat_and_output(steps: we.WorkedExample) -> None:
    np.testing.assert_allclose(steps.heads[0].output, HEAD1_OUT, rtol=0, atol=TOL)
    np.testing.assert_allclose(steps.heads[1].output, HEAD2_OUT, rtol=0, atol=TOL)
    concat = [h1 + h2 for h1, h2 in zip(HEAD1_OUT, HEAD2_OUT)]
    np.testing.assert_allclose(steps.concat, concat, rtol=0, atol=TOL)
    # W_O: output = (a, b, a + b, a - b) with a = concat column 0 (head 1),
    # b = concat column 3 (head 2).
    output = [[row[0], row[3], row[0] + row[3], row[0] - row[3]] for row in concat]
    np.testing.assert_allclose(steps.output, output, rtol=0, atol=TOL)


def test_loop_and_fused_reference_agree(steps: we.WorkedExample) -> None:
    np.testing.assert_allclose(steps.loop_output, steps.output, rtol=0, atol=TOL)
    np.testing.assert_allclose(steps.fused_output, steps.output, rtol=0, atol=TOL)
    np.testing.assert_allclose(steps.loop_weights, steps.weights, rtol=0, atol=TOL)
    np.testing.assert_allclose(steps.fused_weights, steps.weights, rtol=0, atol=TOL)
    assert steps.weights.shape == (2, 3, 3)


def test_torch_multihead_attention_agrees(steps: we.WorkedExample) -> None:
    layer = torch.nn.MultiheadAttention(4, 2, bias=False, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        layer.in_proj_weight.copy_(
            torch.from_numpy(np.concatenate([we.W_Q.T, we.W_K.T, we.W_V.T]))
        )
        layer.out_proj.weight.copy_(torch.from_numpy(we.W_O.T.copy()))
    x = torch.from_numpy(we.X.copy())[None]  # (1, T, D)
    output, weights = layer(x, x, x, need_weights=True, average_attn_weights=False)
    np.testing.assert_allclose(output[0].detach().numpy(), steps.output, rtol=0, atol=TOL)
    np.testing.assert_allclose(weights[0].detach().numpy(), steps.weights, rtol=0, atol=TOL)


def test_what_if_identity_w_o_and_no_scaling() -> None:
    identity = we.compute(w_o=np.eye(4))
    np.testing.assert_allclose(identity.output, identity.concat, rtol=0, atol=0)
    # scale = 1: head 1 row 2 raw (1, 1, 2) -> (e, e, e^2) / (2e + e^2) = (1, 1, e) / (2 + e).
    unscaled = we.compute(scale=1.0)
    e = math.e
    np.testing.assert_allclose(
        unscaled.heads[0].weights[2],
        [1 / (2 + e), 1 / (2 + e), e / (2 + e)],
        atol=TOL,
    )
    assert unscaled.loop_output is None and unscaled.fused_output is None


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="x must have shape"):
        we.compute(x=np.ones(4))
    with pytest.raises(ValueError, match="same length"):
        we.compute(w_q_heads=we.W_Q_HEADS[:1])
    with pytest.raises(ValueError, match="w_o must have shape"):
        we.compute(w_o=np.eye(3))
