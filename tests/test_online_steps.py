"""The online-softmax step-through: its numbers are mha.flash's loop, checked against sums written
out for one query, and its HTML is one frame per step chosen without a script."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from mha import online_steps, reference


@pytest.fixture
def inputs():
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 32, 4))  # (T, d_k)
    k = k * np.linspace(0.5, 2.5, 32)[:, None]  # later keys larger: the maximum rises
    v = rng.normal(size=(32, 2))  # (T, d_v)
    return q, k, v


def test_each_step_holds_the_sums_over_the_keys_seen(inputs):
    q, k, v = inputs
    steps = online_steps.online_softmax_steps(q, k, v, query=21, block_q=4, block_k=4)
    assert [s.kind for s in steps] == ["start"] + ["tile"] * 6 + ["skipped", "finish"]
    scores = q[21] @ k.T / 2.0  # d_k = 4: scale 1/2
    scores[22:] = -np.inf  # causal, T_q = T_k: query 21 sees keys 0..21
    m_old = -np.inf
    for number, step in enumerate(steps[1:7]):
        seen = scores[: 4 * (number + 1)]
        m = seen.max()
        assert step.keys == (4 * number, 4 * number + 4)
        assert step.m == pytest.approx(m, abs=1e-12)
        assert step.ell == pytest.approx(np.exp(seen - m).sum(), rel=1e-12)
        np.testing.assert_allclose(step.acc, np.exp(seen - m) @ v[: len(seen)], rtol=1e-12)
        assert step.alpha == (0.0 if number == 0 else pytest.approx(math.exp(m_old - m)))
        m_old = m
    assert steps[6].scores[2:].tolist() == [-np.inf, -np.inf]  # keys 22, 23 masked
    assert steps[7].keys == (24, 32)  # two tiles never loaded
    expected, _ = reference.scaled_dot_product_attention(q, k, v, reference.causal_mask(32))
    np.testing.assert_allclose(steps[-1].out, expected[21], rtol=1e-12)


def test_without_causal_no_tile_is_skipped(inputs):
    steps = online_steps.online_softmax_steps(*inputs, query=3, block_q=8, block_k=8, causal=False)
    assert [s.kind for s in steps] == ["start"] + ["tile"] * 4 + ["finish"]
    expected, _ = reference.scaled_dot_product_attention(*inputs)
    np.testing.assert_allclose(steps[-1].out, expected[3], rtol=1e-12)


def test_the_view_is_one_frame_per_step_without_a_script(inputs):
    steps = online_steps.online_softmax_steps(*inputs, query=21, block_q=4, block_k=4)
    view = online_steps.step_through(steps, 32, 4, query=21)
    text = view._repr_html_()
    assert text.count('type="radio"') == len(steps) == text.count('class="mha-os-frame ')
    assert text.count(" checked") == 1 and text.count("<label") == len(steps)
    assert "<script" not in text and not re.search(r"(src|href)=", text)
    assert repr(view).startswith("online softmax step-through: 9 steps")


def test_a_query_out_of_range_is_refused(inputs):
    with pytest.raises(ValueError, match="query must be in 0..31, got 32"):
        online_steps.online_softmax_steps(*inputs, query=32, block_q=4, block_k=4)
