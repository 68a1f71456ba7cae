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


def _frames(text: str) -> list[str]:
    return re.findall(r'<div class="mha-os-frame .*?</p></div>', text)


def _key_kinds(frame: str) -> list[str]:
    keys = frame.split('<div class="mha-os-legend">')[0]
    return re.findall(r'<span class="k (\w+)(?: edge)?" title="key \d+">', keys)


def test_masked_keys_are_never_shown_as_seen(inputs):
    steps = online_steps.online_softmax_steps(*inputs, query=21, block_q=4, block_k=4)
    frames = _frames(online_steps.step_through(steps, 32, 4, query=21)._repr_html_())
    kinds = [_key_kinds(frame) for frame in frames]
    assert [len(row) for row in kinds] == [32] * len(steps)
    # keys 22 and 23 are masked (after the query's position) in the tile that holds them
    # (frame 6), and stay masked in every frame after it: the skipped tiles' and the result's
    for number, row in enumerate(kinds):
        assert [row[22], row[23]] == (["masked"] * 2 if number >= 6 else ["ahead"] * 2), number
    # no frame shows a masked key as seen, nor a key it has not read
    for step, row in zip(steps, kinds):
        read = max([s.keys[1] for s in steps[: steps.index(step) + 1] if s.kind == "tile"] or [0])
        seen = [j for j, kind in enumerate(row) if kind == "seen"]
        assert all(j < read and j not in (22, 23) for j in seen)
    assert kinds[-1] == ["seen"] * 22 + ["masked"] * 2 + ["skipped"] * 8
    assert kinds[0] == ["ahead"] * 32  # the start: nothing read yet


def test_the_legend_names_every_colour(inputs):
    steps = online_steps.online_softmax_steps(*inputs, query=21, block_q=4, block_k=4)
    frame = _frames(online_steps.step_through(steps, 32, 4, query=21)._repr_html_())[6]
    legend = frame.split('<div class="mha-os-legend">')[1].split("</div>")[0]
    named = dict(re.findall(r'<span class="k (\w+)"></span>([^<]+)', legend))
    assert {kind: name.strip() for kind, name in named.items()} == {
        "ahead": "not read yet",
        "now": "this tile",
        "seen": "seen",
        "masked": "masked",
        "skipped": "skipped",
    }
    assert set(_key_kinds(frame)) <= set(named)


def _says(view) -> list[str]:
    return re.findall(r'<p class="mha-os-say">(.*?)</p>', view._repr_html_())


def test_alpha_on_the_first_tile_is_explained(inputs):
    steps = online_steps.online_softmax_steps(*inputs, query=21, block_q=4, block_k=4)
    assert steps[1].alpha == 0.0
    said = _says(online_steps.step_through(steps, 32, 4, query=21))[1]
    m = f"{steps[1].m:.3f}".replace("-", "−")
    assert f"α = exp(−∞ − {m}) = 0: before it m was −∞ and nothing had been summed" in said
    assert "(ℓ = 0, acc = 0), so α has only zeros to rescale" in said


def test_base_two_shows_what_an_exp2_kernel_holds(inputs):
    steps = online_steps.online_softmax_steps(*inputs, query=21, block_q=4, block_k=4)
    natural = online_steps.step_through(steps, 32, 4, query=21)
    base2 = online_steps.step_through(steps, 32, 4, query=21, units="exp2")
    text = base2._repr_html_()
    assert "Base 2, as chapter 13's Triton exercise computes" in text
    assert 'units="exp2") shows it' in natural._repr_html_()  # the natural view says so
    assert repr(base2).endswith("in base 2 (exp2) (interactive in HTML)")
    log2e = 1 / math.log(2)
    frames = _frames(text)
    for step, frame in zip(steps, frames):
        if step.kind == "tile":
            shown = re.search(r"<th>m₂</th><td>[^<]*</td><td>([^<]+)</td>", frame).group(1)
            assert float(shown.replace("−", "-")) == pytest.approx(step.m * log2e, abs=1e-3)
            assert f"<th>α</th><td></td><td>{step.alpha:.3f}</td>" in frame  # the same α
    said = _says(base2)
    assert "α = 2^(−∞ − " in said[1]
    m2 = [f"{s.m * log2e:.3f}".replace("-", "−") for s in steps[1:3]]
    assert f"α = 2^({m2[0]} − {m2[1]}) = {steps[2].alpha:.3f}" in said[2]
    lse = steps[-1].m + math.log(steps[-1].ell)
    assert f"m₂ + log₂ ℓ = {lse * log2e:.3f}" in said[-1]
    assert f"divided by log₂e is the natural one, {lse:.3f}" in said[-1]
    # the ids differ: both views can stand on one page
    assert natural._repr_html_().split('"')[3] != text.split('"')[3]
    with pytest.raises(ValueError, match="units must be 'natural' or 'exp2', got 'log2'"):
        online_steps.step_through(steps, 32, 4, query=21, units="log2")
