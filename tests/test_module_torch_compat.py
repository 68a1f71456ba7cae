"""mha.MultiHeadAttention as a drop-in for torch.nn.MultiheadAttention.

The constructor takes torch's arguments with torch's defaults (``batch_first=False`` included),
creates the same parameters with the same initialisation, supports ``add_bias_kv`` and
``add_zero_attn``, agrees with torch on its inference fast path (eval mode, no autograd), and
traces whole with ``torch.compile(fullgraph=True)`` and ``torch.export``. Where the module
differs on purpose (zeros instead of NaN, clearer errors, ``is_causal`` without a mask), the
tests say so.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
from mha.module import MultiHeadAttention
from torch.profiler import ProfilerActivity, profile

from helpers import generator, randn

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-10  # float64 throughout


def perturb(module: torch.nn.Module, seed: int) -> None:
    """Noise on every parameter, so that zero-initialised biases are exercised too."""
    gen = generator(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def pair(seed: int = 0, **kwargs) -> tuple[MultiHeadAttention, torch.nn.MultiheadAttention]:
    """Ours and torch's with the same (perturbed) weights, float64, eval mode."""
    theirs = torch.nn.MultiheadAttention(dtype=torch.float64, **kwargs).eval()
    perturb(theirs, seed)
    ours = MultiHeadAttention(dtype=torch.float64, **kwargs).eval()
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def assert_same(got: tuple, expected: tuple, what: str = "") -> None:
    torch.testing.assert_close(
        got[0], expected[0], rtol=TOL, atol=TOL, msg=lambda m: f"{what} {m}"
    )
    if expected[1] is None:
        assert got[1] is None
    else:
        torch.testing.assert_close(got[1], expected[1], rtol=TOL, atol=TOL)


# ---------------------------------------------------------------------------------------------
# The constructor: torch's arguments, defaults, parameters and initialisation


def test_constructor_has_torchs_arguments_and_defaults() -> None:
    ours = inspect.signature(MultiHeadAttention.__init__).parameters
    theirs = inspect.signature(torch.nn.MultiheadAttention.__init__).parameters
    assert list(ours) == list(theirs)
    for name, parameter in theirs.items():
        assert ours[name].default == parameter.default, name
    forward_ours = list(inspect.signature(MultiHeadAttention.forward).parameters)
    forward_theirs = list(inspect.signature(torch.nn.MultiheadAttention.forward).parameters)
    assert forward_ours[: len(forward_theirs)] == forward_theirs  # ours adds head_mask at the end


def test_default_layout_is_sequence_first_as_in_torch() -> None:
    ours, theirs = pair(embed_dim=6, num_heads=2)
    assert ours.batch_first is False
    x = randn(5, 3, 6)  # (T, B, D), torch's default layout
    assert_same(ours(x, x, x), theirs(x, x, x))


@pytest.mark.parametrize(
    "bias, add_bias_kv, kdim",
    list(itertools.product([True, False], [True, False], [None, 3])),
)
def test_same_parameters_and_initialisation_as_torch(bias: bool, add_bias_kv: bool, kdim) -> None:
    kwargs = dict(
        embed_dim=6, num_heads=2, bias=bias, add_bias_kv=add_bias_kv, kdim=kdim, vdim=kdim
    )
    torch.manual_seed(7)
    theirs = torch.nn.MultiheadAttention(**kwargs)
    torch.manual_seed(7)
    ours = MultiHeadAttention(**kwargs)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    for (name, p_ours), p_theirs in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(p_ours, p_theirs), name


# ---------------------------------------------------------------------------------------------
# add_bias_kv and add_zero_attn


@pytest.mark.parametrize(
    "add_bias_kv, add_zero_attn", [(True, False), (False, True), (True, True)]
)
@pytest.mark.parametrize("masks", [None, "bool", "float", "padding", "bool+padding"])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_extra_keys_match_torch(
    add_bias_kv: bool,
    add_zero_attn: bool,
    masks: str | None,
    need_weights: bool,
    batch_first: bool,
) -> None:
    ours, theirs = pair(
        embed_dim=8,
        num_heads=2,
        add_bias_kv=add_bias_kv,
        add_zero_attn=add_zero_attn,
        batch_first=batch_first,
        kdim=5,
        vdim=3,
    )
    B, T_q, T_k = 3, 4, 6
    query, key, value = (
        randn(B, T_q, 8, seed=1),
        randn(B, T_k, 5, seed=2),
        randn(B, T_k, 3, seed=3),
    )
    if not batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    kwargs: dict = {"need_weights": need_weights, "average_attn_weights": False}
    gen = generator(4)
    if masks in ("bool", "bool+padding"):
        kwargs["attn_mask"] = torch.rand(T_q, T_k, generator=gen) < 0.5
    if masks == "float":
        kwargs["attn_mask"] = torch.randn(T_q, T_k, generator=gen, dtype=torch.float64)
    if masks in ("padding", "bool+padding"):
        kwargs["key_padding_mask"] = torch.rand(B, T_k, generator=gen) < 0.4
    # The extra keys are always allowed, so no row is empty and torch gives no NaN.
    assert_same(ours(query, key, value, **kwargs), theirs(query, key, value, **kwargs), str(masks))


def test_extra_keys_both_directions_of_state_dict() -> None:
    torch.manual_seed(0)
    ours = MultiHeadAttention(8, 2, add_bias_kv=True, add_zero_attn=True, dtype=torch.float64)
    perturb(ours, 3)
    theirs = torch.nn.MultiheadAttention(
        8, 2, add_bias_kv=True, add_zero_attn=True, dtype=torch.float64
    )
    theirs.load_state_dict(ours.state_dict())
    assert set(ours.state_dict()) == {
        "in_proj_weight",
        "in_proj_bias",
        "bias_k",
        "bias_v",
        "out_proj.weight",
        "out_proj.bias",
    }
    x = randn(5, 2, 8)  # (T, B, D)
    assert_same(
        ours(x, x, x, average_attn_weights=False), theirs(x, x, x, average_attn_weights=False)
    )


def test_zero_attention_key_is_a_zero_vector() -> None:
    # With add_zero_attn, each head also scores a zero key: its score is 0 and its value is 0,
    # so the weights of the real keys sum to 1 - softmax weight of a score of 0.
    ours, _ = pair(embed_dim=4, num_heads=1, bias=False, add_zero_attn=True, batch_first=True)
    x = randn(1, 3, 4)
    _, weights = ours(x, x, x)  # (B, T_q, T_k + 1)
    assert weights.shape == (1, 3, 4)
    q = x @ ours.in_proj_weight[:4].T  # (B, T, D) with one head of d_k = 4
    k = x @ ours.in_proj_weight[4:8].T
    scores = torch.cat([q @ k.transpose(1, 2) / 2.0, torch.zeros(1, 3, 1, dtype=x.dtype)], dim=-1)
    torch.testing.assert_close(weights, torch.softmax(scores, dim=-1), rtol=TOL, atol=TOL)


# ---------------------------------------------------------------------------------------------
# torch's inference fast path: eval mode and no autograd


def _ops(module: torch.nn.Module, *args, **kwargs) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        module(*args, **kwargs)
    return {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("padding", [False, True])
def test_parity_on_torchs_inference_fast_path(need_weights: bool, padding: bool) -> None:
    ours, theirs = pair(embed_dim=8, num_heads=2, batch_first=True)
    x = randn(3, 5, 8)
    kwargs: dict = {"need_weights": need_weights}
    if padding:
        kwargs["key_padding_mask"] = torch.tensor(
            [[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4]
        )
    with torch.no_grad():
        assert "aten::_native_multi_head_attention" in _ops(theirs, x, x, x, **kwargs)
        expected = theirs(x, x, x, **kwargs)
        got = ours(x, x, x, **kwargs)
    if padding and not need_weights:
        # The fast path returns zeros for padded *query* positions when it uses nested tensors;
        # otherwise it computes them like every other query. Compare the real positions.
        real = ~kwargs["key_padding_mask"]
        torch.testing.assert_close(got[0][real], expected[0][real], rtol=TOL, atol=TOL)
    else:
        assert_same(got, expected, "fast path")
    with torch.enable_grad():  # and the general path, for the record
        assert "aten::_native_multi_head_attention" not in _ops(theirs, x, x, x, **kwargs)


# ---------------------------------------------------------------------------------------------
# torch.compile and torch.export


def test_compiles_as_one_graph() -> None:
    torch._dynamo.reset()
    ours, _ = pair(embed_dim=8, num_heads=2, batch_first=True)
    x = randn(2, 5, 8)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    compiled = torch.compile(ours, fullgraph=True, backend="eager")
    for kwargs in (
        {},
        {"need_weights": False, "is_causal": True},
        {"is_causal": True},  # a causal mask built in torch
        {"key_padding_mask": padding},
    ):
        assert_same(compiled(x, x, x, **kwargs), ours(x, x, x, **kwargs), str(kwargs))


def test_exports() -> None:
    ours, _ = pair(embed_dim=8, num_heads=2, batch_first=True)
    x = randn(2, 5, 8)
    program = torch.export.export(ours, (x, x, x), kwargs={"need_weights": False})
    got = program.module()(x, x, x, need_weights=False)
    assert_same(got, ours(x, x, x, need_weights=False))


def test_is_not_scriptable_as_the_readme_says() -> None:
    # README: TorchScript (deprecated in PyTorch 2) is not supported; compile and export are.
    ours, _ = pair(embed_dim=8, num_heads=2, batch_first=True)
    with pytest.warns(DeprecationWarning), pytest.raises(RuntimeError, match="Torchscript"):
        torch.jit.script(ours)


# ---------------------------------------------------------------------------------------------
# Edges decided on purpose


def test_parameters_of_mixed_dtypes_are_refused_clearly() -> None:
    # torch computes on batch-first input and fails deep inside on sequence-first input;
    # we refuse both, naming the parameter.
    module = MultiHeadAttention(8, 2, batch_first=True, dtype=torch.float64)
    module.in_proj_bias = torch.nn.Parameter(module.in_proj_bias.detach().half())
    x = randn(2, 3, 8)
    with pytest.raises(TypeError, match="in_proj_bias has dtype torch.float16"):
        module(x, x, x)


def test_input_of_another_dtype_is_refused_clearly() -> None:
    module = MultiHeadAttention(8, 2, batch_first=True)  # float32
    x = randn(2, 3, 8)  # float64
    with pytest.raises(TypeError, match="query has dtype torch.float64, .* torch.float32"):
        module(x, x, x)


def test_a_wrong_causal_hint_is_refused_not_ignored() -> None:
    # torch takes attn_mask with is_causal=True as a hint and may ignore it; a mask of the
    # wrong shape is a mistake we report.
    module = MultiHeadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        module(
            x,
            x,
            x,
            attn_mask=torch.ones(4, 4, dtype=torch.bool),
            is_causal=True,
            need_weights=False,
        )


def test_extra_keys_stay_visible_under_is_causal() -> None:
    # torch hides the extra key on its is_causal route without weights (SDPA's top-left causal
    # mask over T_k + 1 keys) but shows it when it returns the weights; ours always shows it,
    # so both of our paths agree with torch's weights path.
    ours, theirs = pair(embed_dim=8, num_heads=2, add_bias_kv=True, batch_first=True)
    x = randn(2, 4, 8)
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
    expected, _ = theirs(x, x, x, attn_mask=causal, is_causal=True, need_weights=True)
    for need_weights in (True, False):
        got, _ = ours(x, x, x, is_causal=True, need_weights=need_weights)
        torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)
    hidden, _ = theirs(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
    assert not torch.allclose(hidden, expected)  # torch's two routes disagree


def test_nested_tensors_are_refused_clearly() -> None:
    module = MultiHeadAttention(8, 2, batch_first=True)
    nested = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)])
    with pytest.raises(TypeError, match="query must be a regular tensor, got a nested tensor"):
        module(nested, nested, nested)
