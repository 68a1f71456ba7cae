"""Tests for mha.tiny: the induction data, the tiny model, head masks, head scores and training."""

from __future__ import annotations

import copy

import pytest
import torch
from mha.module import MultiHeadAttention
from mha.tiny import (
    TinyTransformer,
    evaluate,
    head_importance,
    head_mask_without,
    head_scores,
    head_value_norms,
    make_induction_data,
    masked_loss_and_accuracy,
    train,
)

V, T, S = 16, 16, 6


def _data(n: int = 32, seed: int = 0, **kwargs):
    return make_induction_data(n, generator=torch.Generator().manual_seed(seed), **kwargs)


def _model(
    num_heads: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32
) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(V, T, d_model=16, num_heads=num_heads, d_mlp=32).to(dtype).eval()


# ---------------------------------------------------------------- data


def test_data_shapes_and_ranges() -> None:
    data = _data(50)
    assert data.tokens.shape == data.targets.shape == data.predictable.shape == (50, T)
    assert data.tokens.dtype == torch.int64 and data.predictable.dtype == torch.bool
    assert int(data.tokens.min()) >= 0 and int(data.tokens.max()) < V
    assert len(data) == 50 and len(data[:7]) == 7


def test_segment_repeats_and_everything_else_is_distinct() -> None:
    data = _data(200, seed=1)
    for n in range(len(data)):
        seq = data.tokens[n].tolist()
        a, b = int(data.source_start[n]), int(data.copy_start[n])
        assert 0 <= a and a + S <= b and b + S <= T  # source before copy, both inside the sequence
        assert seq[b : b + S] == seq[a : a + S]  # the segment really repeats
        # Remove the copy: what is left are distinct tokens.
        rest = seq[:b] + seq[b + S :]
        assert len(rest) == T - S and len(set(rest)) == T - S


def test_targets_and_predictable_positions_follow_the_induction_rule() -> None:
    data = _data(200, seed=2)
    for n in range(len(data)):
        seq = data.tokens[n].tolist()
        b = int(data.copy_start[n])
        assert data.targets[n, :-1].tolist() == seq[1:]  # next token
        expected = [b <= t <= b + S - 2 for t in range(T)]
        assert data.predictable[n].tolist() == expected
        for t in range(T):
            if expected[t]:
                # The current token occurred exactly once before; the answer is the token after it.
                earlier = [j for j in range(t) if seq[j] == seq[t]]
                assert len(earlier) == 1
                assert data.targets[n, t].item() == seq[earlier[0] + 1]


def test_positions_are_spread_so_no_fixed_offset_solves_the_task() -> None:
    data = _data(2000, seed=3)
    offsets = (data.copy_start - data.source_start).unique()
    assert (
        offsets.min().item() == S and offsets.max().item() == T - S
    )  # every offset from S to T - S occurs
    assert len(offsets) == T - 2 * S + 1


def test_data_is_reproducible_with_a_seed() -> None:
    first, second = _data(20, seed=5), _data(20, seed=5)
    assert torch.equal(first.tokens, second.tokens)
    assert not torch.equal(first.tokens, _data(20, seed=6).tokens)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"segment_len": 1}, "segment_len"),
        ({"seq_len": 10}, "seq_len"),
        ({"vocab_size": 5}, "vocab_size"),
    ],
)
def test_bad_data_arguments_raise(kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        make_induction_data(4, **kwargs)


# ---------------------------------------------------------------- model


def test_model_uses_the_book_module_and_has_the_right_shapes() -> None:
    model = _model(num_heads=4)
    assert all(isinstance(attn, MultiHeadAttention) for attn in model.attns)
    data = _data(5)
    logits, weights = model(data.tokens, return_weights=True)
    assert logits.shape == (5, T, V)
    assert len(weights) == 2 and all(w.shape == (5, 4, T, T) for w in weights)
    torch.testing.assert_close(weights[0].sum(-1), torch.ones(5, 4, T))  # rows are distributions
    assert model(data.tokens)[1] is None


def test_attention_is_causal_in_the_weights() -> None:
    model = _model()
    _, weights = model(_data(4).tokens, return_weights=True)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # key after query
    for w in weights:
        assert torch.all(w[..., future] == 0)


def test_changing_future_tokens_does_not_change_earlier_logits() -> None:
    model = _model()
    tokens = _data(8).tokens
    changed = tokens.clone()
    k = 9
    changed[:, k + 1 :] = (changed[:, k + 1 :] + 5) % V  # new tokens after position k
    with torch.no_grad():
        before, _ = model(tokens)
        after, _ = model(changed)
    torch.testing.assert_close(after[:, : k + 1], before[:, : k + 1], rtol=1e-5, atol=1e-6)
    assert (after[:, k + 1 :] - before[:, k + 1 :]).abs().max() > 1e-3  # the later ones do change


def test_head_mask_of_ones_is_no_mask() -> None:
    model = _model()
    tokens = _data(6).tokens
    with torch.no_grad():
        plain, _ = model(tokens)
        ones, _ = model(tokens, head_mask=torch.ones(2, 4))
        ones_b, _ = model(tokens, head_mask=torch.ones(6, 2, 4))
    torch.testing.assert_close(ones, plain, rtol=0, atol=0)
    torch.testing.assert_close(ones_b, plain, rtol=0, atol=0)


@pytest.mark.parametrize("layer", [0, 1])
def test_switching_off_a_whole_layer_equals_zeroing_its_output_projection(
    layer: int,
) -> None:
    model = _model()
    tokens = _data(6).tokens
    silenced = copy.deepcopy(model)
    with torch.no_grad():
        silenced.attns[
            layer
        ].out_proj.weight.zero_()  # the layer now adds exactly 0 to the residual
        expected, _ = silenced(tokens)
        got, _ = model(
            tokens,
            head_mask=head_mask_without(model, [(layer, h) for h in range(4)]),
        )
        plain, _ = model(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert (got - plain).abs().max() > 1e-3


def test_one_head_off_equals_zeroing_its_columns_of_the_output_projection() -> None:
    model = _model()
    tokens = _data(6).tokens
    layer, head, d_k = 1, 2, 16 // 4
    silenced = copy.deepcopy(model)
    with torch.no_grad():
        silenced.attns[layer].out_proj.weight[:, head * d_k : (head + 1) * d_k] = (
            0.0  # head's slice of W_O
        )
        expected, _ = silenced(tokens)
        got, _ = model(tokens, head_mask=head_mask_without(model, [(layer, head)]))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_per_example_head_mask_matches_running_examples_one_by_one() -> None:
    model = _model()
    tokens = _data(3).tokens
    masks = torch.stack(
        [
            head_mask_without(model, []),
            head_mask_without(model, [(0, 1)]),
            head_mask_without(model, [(1, 0), (1, 3)]),
        ]
    )  # (B, L, H)
    with torch.no_grad():
        together, _ = model(tokens, head_mask=masks)
        for b in range(3):
            alone, _ = model(tokens[b : b + 1], head_mask=masks[b])
            torch.testing.assert_close(together[b], alone[0], rtol=1e-5, atol=1e-6)


def test_bad_model_arguments_raise() -> None:
    model = _model()
    with pytest.raises(ValueError, match="head_mask"):
        model(_data(2).tokens, head_mask=torch.ones(4, 2))
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, T + 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="removed"):
        head_mask_without(model, [(2, 0)])
    with pytest.raises(ValueError, match="divisible"):
        TinyTransformer(V, T, d_model=10, num_heads=4)


# ---------------------------------------------------------------- measurements


def test_head_scores_on_hand_made_attention_patterns() -> None:
    data = _data(10, seed=4)
    n = len(data)
    eye = torch.eye(T)
    previous = torch.zeros(T, T)
    previous[torch.arange(1, T), torch.arange(T - 1)] = 1.0
    previous[0, 0] = 1.0
    first = torch.zeros(T, T)
    first[:, 0] = 1.0
    # An ideal induction head: at each predictable query, all weight on the answer's earlier
    # position.
    induction = eye.repeat(n, 1, 1)  # (N, T, T)
    for i in range(n):
        a, b = int(data.source_start[i]), int(data.copy_start[i])
        for t in range(b, b + S - 1):
            induction[i, t] = 0.0
            induction[i, t, a + (t - b) + 1] = 1.0
    heads = torch.stack(
        [
            eye.expand(n, T, T),
            previous.expand(n, T, T),
            first.expand(n, T, T),
            induction,
        ],
        dim=1,
    )
    scores = head_scores([heads], data)  # one layer, 4 heads
    torch.testing.assert_close(
        scores["self"], torch.tensor([[1.0, 0.0, 0.0, 1 - (S - 1) / (T - 1)]])
    )
    # Query 1's previous key is key 0: the previous-token and first-token heads overlap there only.
    torch.testing.assert_close(scores["previous"], torch.tensor([[0.0, 1.0, 1 / (T - 1), 0.0]]))
    torch.testing.assert_close(scores["first"], torch.tensor([[0.0, 1 / (T - 1), 1.0, 0.0]]))
    # Over the first copy's positions a + 1 .. a + S - 1 (a >= 0, so key 0 is the previous key
    # only when a = 0).
    from_first = float((data.source_start == 0).sum()) / n / (S - 1)
    torch.testing.assert_close(
        scores["previous_source"], torch.tensor([[0.0, 1.0, from_first, 0.0]])
    )
    torch.testing.assert_close(scores["induction"], torch.tensor([[0.0, 0.0, 0.0, 1.0]]))


def test_match_score_finds_the_earlier_occurrence() -> None:
    data = _data(10, seed=7)
    n = len(data)
    match = torch.eye(T).repeat(n, 1, 1)  # (N, T, T)
    for i in range(n):
        seq = data.tokens[i].tolist()
        for t in range(T):
            earlier = [j for j in range(t) if seq[j] == seq[t]]
            if earlier:  # only inside the copy
                match[i, t] = 0.0
                match[i, t, earlier[0]] = 1.0
    scores = head_scores(match[None, :, None], data)  # weights (L=1, N, H=1, T, T)
    torch.testing.assert_close(scores["match"], torch.ones(1, 1))


@pytest.mark.parametrize("removed", [[], [(0, 1), (1, 3)]])
def test_head_importance_is_the_mean_absolute_derivative_of_the_loss(
    removed: list,
) -> None:
    model = _model(dtype=torch.float64)
    data = _data(3, seed=8)
    base = head_mask_without(model, removed).double()  # (L, H), the point where we differentiate
    importance = head_importance(model, data, head_mask=None if not removed else base)
    assert importance.shape == (2, 4)
    # Finite differences, example by example: d loss_b / d xi[l, h].
    eps = 1e-6
    expected = torch.zeros(2, 4, dtype=torch.float64)
    for b in range(3):
        one = data[b : b + 1]
        for layer in range(2):
            for head in range(4):
                values = []
                for sign in (1.0, -1.0):
                    xi = base.clone()
                    xi[layer, head] += sign * eps
                    with torch.no_grad():
                        logits, _ = model(one.tokens, head_mask=xi)
                    values.append(masked_loss_and_accuracy(logits, one)[0].item())
                expected[layer, head] += abs(values[0] - values[1]) / (2 * eps) / 3
    torch.testing.assert_close(importance, expected, rtol=1e-5, atol=1e-8)


def test_head_value_norms_equal_each_heads_output_where_one_key_is_visible() -> None:
    # With T = 1 the only visible key is the query's own position, with weight 1, so what head
    # h adds there is f_h(x_0) itself: run each layer through the module with a one-hot head
    # mask (no biases, so that is the head's output alone) and take its norm.
    model = _model(dtype=torch.float64)
    tokens = _data(20, seed=10).tokens[:, :1]  # (B, 1)
    norms = head_value_norms(model, tokens)
    assert norms.shape == (2, 4)
    x = model.tok_emb(tokens) + model.pos_emb(torch.arange(1))  # (B, 1, D)
    with torch.no_grad():
        for layer, (norm, attn) in enumerate(zip(model.attn_norms, model.attns)):
            h = norm(x)
            for head in range(4):
                one_hot = torch.zeros(4, dtype=torch.float64)
                one_hot[head] = 1.0
                out, _ = attn(h, h, h, need_weights=False, is_causal=True, head_mask=one_hot)
                expected = out.norm(dim=-1).mean()
                torch.testing.assert_close(norms[layer, head], expected)
            x = x + attn(h, h, h, need_weights=False, is_causal=True)[0]
    assert not any(attn._forward_pre_hooks for attn in model.attns)  # the hooks are gone


def test_head_value_norms_scale_with_that_heads_output_columns_only() -> None:
    model = _model(dtype=torch.float64)
    tokens = _data(8, seed=11).tokens
    before = head_value_norms(model, tokens)
    d_k = model.d_model // 4
    # Head 2 of layer 1 writes three times as much; the input of every layer stays the same.
    with torch.no_grad():
        model.attns[1].out_proj.weight[:, 2 * d_k : 3 * d_k] *= 3.0
    after = head_value_norms(model, tokens)
    expected = before.clone()
    expected[1, 2] *= 3.0
    torch.testing.assert_close(after, expected)


# ---------------------------------------------------------------- training


def test_a_short_training_run_reduces_the_loss(one_torch_thread: None) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(V, T, d_model=32, num_heads=2)
    test = _data(256, seed=9)
    loss_before, _ = evaluate(model, test)
    losses = train(model, steps=60, batch_size=32, seed=0)
    loss_after, _ = evaluate(model, test)
    assert len(losses) == 60
    # Measured drop: about 0.5 nats for seeds 0, 1, 2; half of that is the bar.
    assert loss_after < loss_before - 0.25, (loss_before, loss_after)


def test_training_is_reproducible(one_torch_thread: None) -> None:
    results = []
    for _ in range(2):
        torch.manual_seed(3)
        model = TinyTransformer(V, T, d_model=16, num_heads=2, d_mlp=32)
        results.append(train(model, steps=5, batch_size=16, seed=3))
    assert results[0] == results[1]


def test_one_loop_trains_the_decoder_of_chapter_12_too(one_torch_thread: None) -> None:
    # train and evaluate take any model that maps tokens to logits; the decoder's own entry
    # points are the same loop at its learning rate, so both routes give the same numbers.
    from mha.decoding import Decoder, evaluate_decoder, train_decoder

    test = _data(64, seed=9)
    runs = []
    for route in ("tiny", "decoding"):
        torch.manual_seed(3)
        model = Decoder(vocab_size=V, d_model=16, num_heads=2, num_layers=1, d_mlp=32)
        if route == "tiny":
            losses = train(model, steps=5, batch_size=16, lr=3e-3, seed=3)
            runs.append((losses, evaluate(model, test)))
        else:
            losses = train_decoder(model, steps=5, batch_size=16, seed=3)
            runs.append((losses, evaluate_decoder(model, test)))
    assert runs[0] == runs[1]
    assert len(runs[0][0]) == 5 and not model.training
    with pytest.raises(TypeError, match="steps must be an int, got float 2.5"):
        train(model, steps=2.5)
