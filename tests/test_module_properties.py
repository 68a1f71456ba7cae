"""Properties of mha.MultiHeadAttention that follow from the definition of attention.

Permutation equivariance, causality, normalised weights, fully masked rows (zero, never NaN,
where torch gives NaN), gradients (gradcheck), dropout (train mode only, unbiased) and head_mask.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from mha.module import MultiHeadAttention

from helpers import randn

DTYPE = torch.float64


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def module_with_biases(*args, seed: int = 0, **kwargs) -> MultiHeadAttention:
    """A float64 module in eval mode whose biases are not zero (torch initialises them to zero)."""
    torch.manual_seed(seed)
    module = MultiHeadAttention(*args, dtype=DTYPE, **kwargs, batch_first=True).eval()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    return module


@pytest.mark.parametrize("need_weights", [True, False])
def test_permutation_equivariance(need_weights: bool) -> None:
    """Unmasked self-attention has no notion of order: permuting tokens permutes the outputs."""
    module = module_with_biases(8, 2)
    x = randn(3, 6, 8)
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    output, weights = module(x, x, x, need_weights=need_weights, average_attn_weights=False)
    x_perm = x[:, perm]
    output_perm, weights_perm = module(
        x_perm,
        x_perm,
        x_perm,
        need_weights=need_weights,
        average_attn_weights=False,
    )
    torch.testing.assert_close(output_perm, output[:, perm], atol=1e-12, rtol=1e-12)
    assert not torch.allclose(output_perm, output, atol=1e-3)  # the permutation did move things
    if need_weights:
        torch.testing.assert_close(
            weights_perm,
            weights[:, :, perm][:, :, :, perm],
            atol=1e-12,
            rtol=1e-12,
        )


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("how", ["is_causal", "bool_mask", "float_mask", "is_causal+padding"])
def test_causality(need_weights: bool, how: str) -> None:
    """Changing the tokens after position t leaves the outputs at positions 0..t unchanged."""
    T, t = 7, 3
    module = module_with_biases(8, 4)
    x = randn(2, T, 8)
    x_changed = x.clone()
    x_changed[:, t + 1 :] = randn(2, T - t - 1, 8, seed=1)
    blocked = torch.ones(T, T, dtype=torch.bool).triu(1)  # True above the diagonal
    kwargs = {"need_weights": need_weights}
    if how == "bool_mask":
        kwargs["attn_mask"] = blocked
    elif how == "float_mask":
        kwargs["attn_mask"] = torch.zeros(T, T, dtype=DTYPE).masked_fill(blocked, -math.inf)
    else:
        kwargs["is_causal"] = True
    if how == "is_causal+padding":
        kwargs["key_padding_mask"] = torch.tensor([[False] * T, [False] * 5 + [True] * 2])
    output, _ = module(x, x, x, **kwargs)
    output_changed, _ = module(x_changed, x_changed, x_changed, **kwargs)
    torch.testing.assert_close(
        output_changed[:, : t + 1], output[:, : t + 1], atol=1e-12, rtol=1e-12
    )
    assert not torch.allclose(output_changed[:, t + 1 :], output[:, t + 1 :], atol=1e-3)
    unmasked, _ = module(x_changed, x_changed, x_changed)
    assert not torch.allclose(
        unmasked[:, : t + 1], output[:, : t + 1], atol=1e-3
    )  # without the mask it leaks


def random_masks(
    b: int, h: int, t_q: int, t_k: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A per-head attn_mask (B*H, T_q, T_k), a key_padding_mask (B, T_k), both True = not allowed,
    and which query rows keep at least one allowed key, (B, H, T_q), computed here directly."""
    g = torch.Generator().manual_seed(seed)
    attn_mask = torch.rand(b * h, t_q, t_k, generator=g) < 0.5
    key_padding_mask = torch.rand(b, t_k, generator=g) < 0.3
    key_padding_mask[0] = True  # the first sequence is all padding: all its rows are fully masked
    allowed = ~attn_mask.view(b, h, t_q, t_k) & ~key_padding_mask[:, None, None, :]
    return attn_mask, key_padding_mask, allowed.any(dim=-1)


@pytest.mark.parametrize("as_float", [False, True])
def test_weights_sum_to_one_on_rows_with_an_allowed_key(
    as_float: bool,
) -> None:
    b, h, t_q, t_k = 4, 2, 5, 6
    module = module_with_biases(8, h, kdim=3, vdim=5)
    blocked, key_padding_mask, row_has_key = random_masks(b, h, t_q, t_k, seed=3)
    assert row_has_key.any() and not row_has_key.all()  # both kinds of rows occur
    attn_mask = blocked
    if as_float:
        attn_mask = torch.randn(blocked.shape, dtype=DTYPE).masked_fill(blocked, -math.inf)
        key_padding_mask = torch.zeros(key_padding_mask.shape, dtype=DTYPE).masked_fill(
            key_padding_mask, -math.inf
        )
    _, weights = module(
        randn(b, t_q, 8),
        randn(b, t_k, 3, seed=1),
        randn(b, t_k, 5, seed=2),
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        average_attn_weights=False,
    )
    assert weights.shape == (b, h, t_q, t_k)
    assert (weights >= 0).all()
    torch.testing.assert_close(weights.sum(dim=-1), row_has_key.to(DTYPE), atol=1e-12, rtol=0)
    assert (
        weights[blocked.view(b, h, t_q, t_k)] == 0
    ).all()  # blocked keys get exactly zero weight


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_fully_masked_rows_give_zero_never_nan(need_weights: bool, bias: bool) -> None:
    """Each head's output is zero on a row with no allowed key, so the module's output there is the
    output projection's bias (zero with bias=False); weights are zero; gradients hold no NaN."""
    b, h, t_q, t_k = 3, 2, 4, 5
    module = module_with_biases(8, h, bias=bias)
    attn_mask, key_padding_mask, row_has_key = random_masks(b, h, t_q, t_k, seed=5)
    empty = ~row_has_key.any(dim=1)  # (B, T_q): no allowed key in any head
    assert empty.any()
    query = randn(b, t_q, 8).requires_grad_()
    key = randn(b, t_k, 8, seed=1).requires_grad_()
    output, weights = module(
        query,
        key,
        key,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        need_weights=need_weights,
        average_attn_weights=False,
    )
    assert not output.isnan().any()
    expected_row = module.out_proj.bias if bias else torch.zeros(8, dtype=DTYPE)
    torch.testing.assert_close(
        output[empty], expected_row.expand(int(empty.sum()), 8), atol=0, rtol=0
    )
    if need_weights:
        assert (weights[~row_has_key] == 0).all() and not weights.isnan().any()

    # The gradients: finite everywhere, and the empty rows' outputs depend on no input at all.
    output[empty].sum().backward(retain_graph=True)
    assert torch.count_nonzero(query.grad) == 0 and torch.count_nonzero(key.grad) == 0
    query.grad, key.grad = None, None
    output.square().sum().backward()
    for tensor in (
        query.grad,
        key.grad,
        *(p.grad for p in module.parameters()),
    ):
        assert torch.isfinite(tensor).all()
    assert torch.count_nonzero(query.grad) > 0


def test_torch_gives_nan_on_fully_masked_rows() -> None:
    """The difference documented in MultiHeadAttention's docstring."""
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    ours = MultiHeadAttention(8, 2, batch_first=True).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 4, 8)
    attn_mask = torch.zeros(4, 4, dtype=torch.bool)
    attn_mask[1] = True  # query 1 may attend to nothing
    their_output, their_weights = theirs(x, x, x, attn_mask=attn_mask)
    assert their_output[:, 1].isnan().all() and their_weights[:, 1].isnan().all()
    our_output, our_weights = ours(x, x, x, attn_mask=attn_mask)
    assert (our_weights[:, 1] == 0).all() and not our_output.isnan().any()
    torch.testing.assert_close(
        our_output[:, [0, 2, 3]], their_output[:, [0, 2, 3]]
    )  # other rows agree


GRADCHECK_CASES = {
    "plain self-attention": dict(),
    "bool attn_mask 2-D, need_weights=False": dict(attn_mask="bool2d", need_weights=False),
    "float attn_mask 3-D + bool padding": dict(attn_mask="float3d", key_padding_mask="bool"),
    "fully masked rows": dict(attn_mask="bool3d", key_padding_mask="bool", empty_rows=True),
    "fully masked rows, need_weights=False": dict(
        attn_mask="bool3d", empty_rows=True, need_weights=False
    ),
    "cross-attention kdim/vdim, is_causal": dict(cross=True, is_causal=True),
    "head_mask, per-head weights": dict(head_mask=True, average_attn_weights=False),
    "unbatched, float padding": dict(batch=None, key_padding_mask="float"),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES), ids=list(GRADCHECK_CASES))
def test_gradcheck(case: str) -> None:
    """Analytic gradients (autograd) match finite differences, for inputs and all parameters."""
    options = GRADCHECK_CASES[case]
    b, h, t_q = options.get("batch", 2), 2, 3
    t_k = 4 if options.get("cross") else t_q
    kdim, vdim = (3, 5) if options.get("cross") else (4, 4)
    module = module_with_biases(4, h, kdim=kdim, vdim=vdim)
    lead = () if b is None else (b,)
    g = torch.Generator().manual_seed(11)
    query = torch.randn(*lead, t_q, 4, generator=g, dtype=DTYPE, requires_grad=True)
    key = torch.randn(*lead, t_k, kdim, generator=g, dtype=DTYPE, requires_grad=True)
    value = torch.randn(*lead, t_k, vdim, generator=g, dtype=DTYPE, requires_grad=True)
    bb = b or 1
    blocked = torch.rand(bb * h, t_q, t_k, generator=g) < 0.4
    if options.get("empty_rows"):
        blocked[0, 1] = True  # batch 0, head 0, query 1: no allowed key
    kwargs = dict(
        need_weights=options.get("need_weights", True),
        is_causal=options.get("is_causal", False),
        average_attn_weights=options.get("average_attn_weights", True),
    )
    kind = options.get("attn_mask")
    if kind is not None:
        mask = blocked if kind.endswith("3d") else blocked[0]
        if kind.startswith("float"):
            mask = torch.randn(mask.shape, generator=g, dtype=DTYPE).masked_fill(mask, -math.inf)
        kwargs["attn_mask"] = mask
    kind = options.get("key_padding_mask")
    if kind is not None:
        padding = torch.zeros(bb, t_k, dtype=torch.bool)
        padding[-1, -1] = True
        if kind == "float":
            padding = torch.randn(bb, t_k, generator=g, dtype=DTYPE).masked_fill(
                padding, -math.inf
            )
        kwargs["key_padding_mask"] = padding if b is not None else padding[0]
    if options.get("head_mask"):
        kwargs["head_mask"] = torch.tensor([[1.0, 0.0], [0.5, 1.0]], dtype=DTYPE)
    names = [name for name, _ in module.named_parameters()]

    def f(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *parameters: torch.Tensor,
    ):
        state = dict(zip(names, parameters))
        output, weights = torch.func.functional_call(module, state, (query, key, value), kwargs)
        return output if weights is None else (output, weights)

    parameters = [p.detach().clone().requires_grad_() for p in module.parameters()]
    assert torch.autograd.gradcheck(f, (query, key, value, *parameters))


@pytest.mark.parametrize("need_weights", [True, False])
def test_dropout_only_in_train_mode(need_weights: bool) -> None:
    torch.manual_seed(0)
    module = MultiHeadAttention(8, 2, dropout=0.5, dtype=DTYPE, batch_first=True)
    no_dropout = MultiHeadAttention(8, 2, dropout=0.0, dtype=DTYPE, batch_first=True)
    no_dropout.load_state_dict(module.state_dict())
    x = randn(2, 5, 8)
    module.train()
    first, _ = module(x, x, x, need_weights=need_weights)
    second, _ = module(x, x, x, need_weights=need_weights)
    assert not torch.allclose(first, second)  # a fresh dropout mask on each call
    module.eval()
    torch.testing.assert_close(
        module(x, x, x, need_weights=need_weights)[0],
        no_dropout(x, x, x)[0],
        atol=1e-12,
        rtol=0,
    )
    torch.testing.assert_close(
        module(x, x, x, need_weights=need_weights)[0],
        module(x, x, x)[0],
        atol=1e-12,
        rtol=0,
    )


def test_dropout_weights_are_returned_after_dropout() -> None:
    """As torch: in train mode the returned per-head weights are the dropped and rescaled ones."""
    torch.manual_seed(1)
    p = 0.5
    module = MultiHeadAttention(8, 2, dropout=p, dtype=DTYPE, batch_first=True)
    x = randn(2, 5, 8)
    expected = module.eval()(x, x, x, average_attn_weights=False)[1]
    dropped = module.train()(x, x, x, average_attn_weights=False)[1]
    kept = dropped != 0
    assert 0 < kept.sum() < kept.numel()
    torch.testing.assert_close(dropped[kept], expected[kept] / (1 - p), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("need_weights", [True, False])
def test_dropout_keeps_the_expectation(need_weights: bool) -> None:
    """The mean of n train-mode outputs estimates the eval-mode output: every element lies within
    6 standard errors (the sample standard deviation / sqrt(n)) of it."""
    n, p = 4000, 0.3
    torch.manual_seed(2)
    module = module_with_biases(4, 2, seed=2)
    module.dropout = p
    x = randn(1, 3, 4).expand(n, 3, 4)  # n copies of one sequence: n independent dropout draws
    expected = module.eval()(x[:1], x[:1], x[:1], need_weights=need_weights)[0][0]
    samples = module.train()(x, x, x, need_weights=need_weights)[0]  # (n, 3, 4)
    mean, std = samples.mean(dim=0), samples.std(dim=0)
    assert (std > 0).all()
    assert ((mean - expected).abs() <= 6 * std / math.sqrt(n)).all()
    assert (
        (samples - expected).abs().amax(dim=0) > 10 * std / math.sqrt(n)
    ).all()  # single draws are far off


def per_head_outputs(module: MultiHeadAttention, x: torch.Tensor) -> list[torch.Tensor]:
    """Each head's attention output, (B, T, d_k), computed one head at a time from the weights."""
    d_k = module.head_dim
    w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    b_q, b_k, b_v = module.in_proj_bias.chunk(3)
    heads = []
    for i in range(module.num_heads):
        rows = slice(i * d_k, (i + 1) * d_k)
        q = x @ w_q[rows].T + b_q[rows]
        k = x @ w_k[rows].T + b_k[rows]
        v = x @ w_v[rows].T + b_v[rows]
        heads.append(torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d_k), dim=-1) @ v)
    return heads


@pytest.mark.parametrize("need_weights", [True, False])
def test_head_mask_removes_a_head(need_weights: bool) -> None:
    """Zeroing head h equals dropping its slice from the concatenation.

    W_O's matching columns are dropped too.
    """
    h, d_k = 4, 3
    module = module_with_biases(h * d_k, h)
    x = randn(2, 5, h * d_k)
    heads = per_head_outputs(module, x)
    w_o, b_o = module.out_proj.weight, module.out_proj.bias
    with torch.no_grad():
        for removed in range(h):
            keep = [i for i in range(h) if i != removed]
            columns = torch.cat([torch.arange(i * d_k, (i + 1) * d_k) for i in keep])
            expected = torch.cat([heads[i] for i in keep], dim=-1) @ w_o[:, columns].T + b_o
            head_mask = torch.ones(h, dtype=DTYPE)
            head_mask[removed] = 0.0
            output, _ = module(x, x, x, need_weights=need_weights, head_mask=head_mask)
            torch.testing.assert_close(output, expected, atol=1e-12, rtol=1e-12)

        all_heads = torch.cat(heads, dim=-1) @ w_o.T + b_o
        output, _ = module(
            x,
            x,
            x,
            need_weights=need_weights,
            head_mask=torch.ones(h, dtype=DTYPE),
        )
        torch.testing.assert_close(output, all_heads, atol=1e-12, rtol=1e-12)
        assert torch.equal(
            output, module(x, x, x, need_weights=need_weights)[0]
        )  # all ones: nothing changes

        # (B, H): a different head removed in each sequence of the batch.
        per_sequence = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]], dtype=DTYPE)
        output, _ = module(x, x, x, need_weights=need_weights, head_mask=per_sequence)
        for s, removed in ((0, 1), (1, 3)):
            single = torch.ones(h, dtype=DTYPE)
            single[removed] = 0.0
            torch.testing.assert_close(
                output[s],
                module(x[s], x[s], x[s], head_mask=single)[0],
                atol=1e-12,
                rtol=1e-12,
            )


def test_head_mask_leaves_weights_alone() -> None:
    module = module_with_biases(8, 2)
    x = randn(2, 5, 8)
    _, weights = module(x, x, x, average_attn_weights=False)
    _, masked_weights = module(
        x,
        x,
        x,
        average_attn_weights=False,
        head_mask=torch.tensor([0.0, 1.0], dtype=DTYPE),
    )
    assert torch.equal(weights, masked_weights)


def test_need_weights_false_runs_through_sdpa(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fast path calls F.scaled_dot_product_attention; the explicit path does not."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        calls.append(kwargs.get("is_causal"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    module = MultiHeadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    module(x, x, x, need_weights=True)
    assert calls == []
    assert module(x, x, x, need_weights=False)[1] is None
    module(x, x, x, need_weights=False, is_causal=True)
    assert calls == [False, True]  # no mask given: SDPA's own causal flag


def test_is_causal_takes_the_given_mask() -> None:
    """With attn_mask given, is_causal is torch's hint: the given mask is used as it is."""
    module = module_with_biases(8, 2)
    x = randn(1, 4, 8)
    mask = torch.tensor([[False, True, True, True]] * 4)  # every query sees key 0 only
    for need_weights in (True, False):
        output, _ = module(x, x, x, attn_mask=mask, is_causal=True, need_weights=need_weights)
        torch.testing.assert_close(output, module(x, x, x, attn_mask=mask)[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(output[0, 1:], output[0, :1].expand(3, 8), atol=1e-12, rtol=0)


@pytest.mark.parametrize("need_weights", [True, False])
def test_unbatched_equals_batch_of_one(need_weights: bool) -> None:
    module = module_with_biases(8, 2, kdim=3, vdim=5)
    q, k, v = randn(4, 8), randn(6, 3, seed=1), randn(6, 5, seed=2)
    padding = torch.tensor([False, True, False, False, True, False])
    output, weights = module(q, k, v, key_padding_mask=padding, need_weights=need_weights)
    batched, batched_weights = module(
        q[None],
        k[None],
        v[None],
        key_padding_mask=padding[None],
        need_weights=need_weights,
    )
    assert output.shape == (4, 8)
    torch.testing.assert_close(output, batched[0], atol=1e-12, rtol=0)
    if need_weights:
        assert weights.shape == (4, 6)
        torch.testing.assert_close(weights, batched_weights[0], atol=1e-12, rtol=0)
