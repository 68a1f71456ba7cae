"""Tests for mha.fitting: the two-relationship task, the torch attention layer, and the fits."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from mha import fitting
from mha.fitting import (
    INPUT_DIM,
    NUM_KINDS,
    PAYLOAD_DIM,
    SEQ_LEN,
    attention,
    best_readout_loss,
    evaluate,
    fit,
    init_weights,
    make_batch,
    one_hot_pattern,
    sample_kinds,
    target_dim,
    token_labels,
    weight_on,
)
from mha.reference import multi_head_attention

from helpers import generator

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_kinds_two_of_each_and_no_equal_neighbours():
    kinds = sample_kinds(300, generator(1)).tolist()
    assert len(kinds) == 300
    for row in kinds:
        assert sorted(row) == [0, 0, 1, 1, 2, 2, 3, 3]
        for i in range(SEQ_LEN):
            assert row[i] != row[i - 1]  # i - 1 = -1 wraps to the last token


def test_batch_by_hand():
    batch = make_batch(20, generator(2))
    assert batch.x.shape == (20, SEQ_LEN, INPUT_DIM)
    assert batch.x.dtype == torch.float64
    assert batch.target.shape == (20, SEQ_LEN, 2 * PAYLOAD_DIM)
    for b in range(20):
        kinds = batch.kinds[b].tolist()
        for i in range(SEQ_LEN):
            # Input features, written out.
            expected_x = [1.0 if k == kinds[i] else 0.0 for k in range(NUM_KINDS)]
            expected_x += [1.0 if j == i else 0.0 for j in range(SEQ_LEN)]
            expected_x += batch.payload[b, i].tolist()
            assert batch.x[b, i].tolist() == expected_x
            # The two relationships, found by search.
            previous = i - 1 if i > 0 else SEQ_LEN - 1
            (partner,) = [j for j in range(SEQ_LEN) if j != i and kinds[j] == kinds[i]]
            assert batch.previous[b, i] == previous
            assert batch.partner[b, i] == partner
            assert previous != partner
            expected_target = (
                batch.payload[b, previous].tolist() + batch.payload[b, partner].tolist()
            )
            assert batch.target[b, i].tolist() == expected_target


def test_other_targets():
    separate = make_batch(10, generator(3), "separate")
    summed = make_batch(10, generator(3), "sum")
    twice = make_batch(10, generator(3), "previous_twice")
    p = PAYLOAD_DIM
    torch.testing.assert_close(
        summed.target,
        (separate.target[..., :p] + separate.target[..., p:]) / math.sqrt(2),
    )
    torch.testing.assert_close(twice.target[..., :p], separate.target[..., :p])
    torch.testing.assert_close(twice.target[..., p:], separate.target[..., :p])
    assert [target_dim(t) for t in ("separate", "sum", "previous_twice")] == [
        8,
        4,
        8,
    ]


def test_target_variance_is_one():
    for target in ("separate", "sum", "previous_twice"):
        y = make_batch(4000, generator(4), target).target
        assert abs(float(y.mean())) < 0.02
        assert abs(float(y.var()) - 1.0) < 0.03


def test_token_labels():
    assert token_labels(torch.tensor([2, 0, 1, 3, 0, 2, 3, 1])) == [
        "C0",
        "A1",
        "B2",
        "D3",
        "A4",
        "C5",
        "D6",
        "B7",
    ]


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_attention_matches_numpy_reference(num_heads):
    batch = make_batch(3, generator(5))
    weights = init_weights(16, 8, generator(6))
    output, attn = attention(batch.x, weights, num_heads)
    ref_output, ref_attn = multi_head_attention(
        batch.x.numpy(),
        *(weights[n].numpy() for n in ("w_q", "w_k", "w_v", "w_o")),
        num_heads,
    )
    assert output.shape == (3, SEQ_LEN, 8)
    assert attn.shape == (3, num_heads, SEQ_LEN, SEQ_LEN)
    np.testing.assert_allclose(output.numpy(), ref_output, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(attn.numpy(), ref_attn, rtol=1e-12, atol=1e-12)


def test_init_does_not_depend_on_heads_and_has_fan_in_scale():
    a = init_weights(16, 8, generator(7))
    b = init_weights(16, 8, generator(7))
    for name in a:
        assert torch.equal(a[name], b[name])
    assert a["w_q"].shape == (INPUT_DIM, 16) and a["w_o"].shape == (16, 8)
    big = init_weights(400, 300, generator(8), d_in=500)
    assert abs(float(big["w_q"].std()) - 1 / math.sqrt(500)) < 0.002
    assert abs(float(big["w_o"].std()) - 1 / math.sqrt(400)) < 0.002


def test_weight_on():
    batch = make_batch(5, generator(9))
    exact = torch.stack(
        [one_hot_pattern(batch.previous), one_hot_pattern(batch.partner)],
        dim=1,
    )  # (B, 2, T, T)
    torch.testing.assert_close(
        weight_on(exact, batch.previous),
        torch.tensor([1.0, 0.0], dtype=torch.float64),
    )
    torch.testing.assert_close(
        weight_on(exact, batch.partner),
        torch.tensor([0.0, 1.0], dtype=torch.float64),
    )
    uniform = torch.full((5, 1, SEQ_LEN, SEQ_LEN), 1 / SEQ_LEN, dtype=torch.float64)
    torch.testing.assert_close(
        weight_on(uniform, batch.partner),
        torch.tensor([0.125], dtype=torch.float64),
    )
    with pytest.raises(ValueError, match="index"):
        weight_on(uniform, batch.partner[:, :3])


def test_best_readout_two_exact_maps_is_zero():
    batch = make_batch(200, generator(10))
    maps = torch.stack(
        [one_hot_pattern(batch.previous), one_hot_pattern(batch.partner)],
        dim=1,
    )
    assert best_readout_loss(maps, batch) < 1e-20


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_best_readout_one_map_loses_half(alpha):
    # One map alpha * previous + (1 - alpha) * partner. Per payload coordinate the best
    # linear guess of u from z = alpha u + (1 - alpha) w (u, w independent, variance 1)
    # leaves (1 - alpha)^2 / n of u's variance and alpha^2 / n of w's,
    # n = alpha^2 + (1 - alpha)^2: together 1 out of 2, for every alpha.
    batch = make_batch(4000, generator(11))
    mixed = alpha * one_hot_pattern(batch.previous) + (1 - alpha) * one_hot_pattern(batch.partner)
    assert abs(best_readout_loss(mixed[:, None], batch) - 0.5) < 0.02


def test_best_readout_blur_is_enough_for_the_sum():
    batch = make_batch(200, generator(12), "sum")
    blur = 0.5 * one_hot_pattern(batch.previous) + 0.5 * one_hot_pattern(batch.partner)
    assert best_readout_loss(blur[:, None], batch) < 1e-20


def test_fit_is_reproducible_and_shares_the_start():
    a = fit(2, steps=5, seed=3)
    b = fit(2, steps=5, seed=3)
    np.testing.assert_array_equal(a.losses, b.losses)
    for name in a.weights:
        assert torch.equal(a.weights[name], b.weights[name])
    # One head and two heads start from the same matrices and see the same first batch:
    # the fit draws the start, then the batches, from one generator.
    g = generator(3)
    start = init_weights(16, 8, g)
    batch = make_batch(64, g)
    for heads in (1, 2):
        output, _ = attention(batch.x, start, heads)
        expected = float(torch.mean((output - batch.target) ** 2))
        assert fit(heads, steps=1, seed=3).losses[0] == pytest.approx(expected, rel=1e-12)


def test_two_heads_learn_both_relationships():
    result = fit(2, steps=200, seed=0)
    batch = make_batch(256, generator(99))
    loss, attn = evaluate(result, batch)
    assert loss < 0.02
    on_previous, on_partner = (
        weight_on(attn, batch.previous),
        weight_on(attn, batch.partner),
    )
    assert max(on_previous) > 0.8 and max(on_partner) > 0.8
    assert torch.argmax(on_previous) != torch.argmax(on_partner)


def test_one_head_cannot_beat_half():
    result = fit(1, steps=200, seed=0)
    loss, _ = evaluate(result, make_batch(256, generator(99)))
    assert loss > 0.45


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="target"):
        make_batch(2, generator(), "both")
    with pytest.raises(ValueError, match="divisible"):
        fit(3, 16, steps=1)
    with pytest.raises(ValueError, match="batch_size"):
        sample_kinds(0, generator())
    with pytest.raises(TypeError, match="num_heads"):
        attention(make_batch(1, generator()).x, init_weights(16, 8, generator()), 2.0)
    with pytest.raises(ValueError, match="maps"):
        best_readout_loss(
            torch.zeros(1, 1, 3, 3, dtype=torch.float64),
            make_batch(1, generator()),
        )
    result = fit(1, steps=1, target="sum")
    with pytest.raises(ValueError, match="D_out"):
        evaluate(result, make_batch(1, generator(), "separate"))
    assert dataclasses.is_dataclass(fitting.TwoRelationBatch)
