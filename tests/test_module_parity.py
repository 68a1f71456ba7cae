"""mha.MultiHeadAttention against torch.nn.MultiheadAttention, the reference it stands in for.

Each hypothesis example draws one configuration (sizes, bias, kdim/vdim, batching, masks,
need_weights, ...) and checks it four ways: our module loaded from torch's state_dict and
torch's module loaded from ours, each against torch's general path (grad enabled) and, where
torch allows it, against torch's inference fast path (no_grad). Masks leave every query row at
least one allowed key: torch gives NaN otherwise (see test_module_properties.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mha.module import MultiHeadAttention

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
MAX_EXAMPLES = 400


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass(frozen=True)
class Config:
    embed_dim: int
    num_heads: int
    bias: bool
    kdim: int | None
    vdim: int | None
    batch: int | None  # None: unbatched 2-D input
    t_q: int
    t_k: int
    self_attention: bool  # query is key is value
    key_is_value: bool
    attn_mask: str | None  # None, "bool2d", "float2d", "bool3d", "float3d"
    key_padding_mask: str | None  # None, "bool", "float"
    is_causal: bool
    need_weights: bool
    average_attn_weights: bool
    dtype: torch.dtype
    seed: int


@st.composite
def configs(draw: st.DrawFn) -> Config:
    num_heads = draw(st.sampled_from([1, 2, 3, 4]))
    embed_dim = num_heads * draw(st.sampled_from([1, 2, 4]))
    self_attention = draw(st.booleans())
    if self_attention:
        kdim = vdim = None
    else:
        kdim = draw(st.sampled_from([None, 3, 5]))
        vdim = draw(st.sampled_from([None, 3, 5]))
    t_q = draw(st.integers(1, 5))
    t_k = t_q if self_attention else draw(st.integers(1, 5))
    is_causal = draw(st.sampled_from([False, False, True]))
    if is_causal:  # torch needs the causal mask itself, as a 2-D bool or float mask
        attn_mask = draw(st.sampled_from(["bool2d", "float2d"]))
    else:
        attn_mask = draw(st.sampled_from([None, "bool2d", "float2d", "bool3d", "float3d"]))
    return Config(
        embed_dim=embed_dim,
        num_heads=num_heads,
        bias=draw(st.booleans()),
        kdim=kdim,
        vdim=vdim,
        batch=draw(st.sampled_from([None, 1, 2, 3])),
        t_q=t_q,
        t_k=t_k,
        self_attention=self_attention,
        key_is_value=self_attention
        or ((kdim or embed_dim) == (vdim or embed_dim) and draw(st.booleans())),
        attn_mask=attn_mask,
        key_padding_mask=draw(st.sampled_from([None, "bool", "float"])),
        is_causal=is_causal,
        need_weights=draw(st.booleans()),
        average_attn_weights=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def make_masks(
    cfg: Config, rng: np.random.Generator
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Random masks in torch's convention (True = not allowed).

    Each query row is left an allowed key.
    """
    b = cfg.batch or 1
    h, t_q, t_k = cfg.num_heads, cfg.t_q, cfg.t_k
    anchor = 0 if cfg.is_causal else int(rng.integers(t_k))  # a key the padding mask never hides
    padding = None
    if cfg.key_padding_mask is not None:
        padding = rng.random((b, t_k)) < 0.4
        padding[:, anchor] = False
    blocked = None
    if cfg.attn_mask is not None:
        if cfg.is_causal:
            blocked = np.triu(np.ones((t_q, t_k), dtype=bool), k=1)
        elif cfg.attn_mask.endswith("2d"):
            blocked = rng.random((t_q, t_k)) < 0.4
        else:
            blocked = rng.random((b * h, t_q, t_k)) < 0.4
        per_head = blocked.reshape(
            -1, h if blocked.ndim == 3 else 1, t_q, t_k
        )  # a view of blocked
        combined = per_head if padding is None else per_head | padding[:, None, None, :]
        empty = combined.all(axis=-1)  # (B or 1, H or 1, T_q): rows with no allowed key
        if blocked.ndim == 2:
            blocked[empty.any(axis=(0, 1)), anchor] = False
        else:
            per_head[..., anchor][empty] = False
        assert (
            not (per_head if padding is None else per_head | padding[:, None, None, :])
            .all(axis=-1)
            .any()
        )

    def to_torch(block: np.ndarray | None, kind: str | None) -> torch.Tensor | None:
        if block is None:
            return None
        if kind.startswith("bool"):
            return torch.from_numpy(block)
        # torch takes a causal attn_mask as a hint and may use its own causal mask: 0 / -inf only
        finite = (
            0.0 if cfg.is_causal and block is blocked else rng.normal(scale=2.0, size=block.shape)
        )
        values = np.where(block, -np.inf, finite)
        return torch.from_numpy(values).to(cfg.dtype)

    attn_mask = to_torch(blocked, cfg.attn_mask)
    key_padding_mask = to_torch(padding, cfg.key_padding_mask)
    if cfg.batch is None and key_padding_mask is not None:
        key_padding_mask = key_padding_mask[0]  # (T_k,)
    return attn_mask, key_padding_mask


def make_inputs(
    cfg: Config, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lead = () if cfg.batch is None else (cfg.batch,)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*lead, *shape, generator=generator, dtype=cfg.dtype)

    query = randn(cfg.t_q, cfg.embed_dim)
    if cfg.self_attention:
        return query, query, query
    key = randn(cfg.t_k, cfg.kdim or cfg.embed_dim)
    value = key if cfg.key_is_value else randn(cfg.t_k, cfg.vdim or cfg.embed_dim)
    return query, key, value


def perturb(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Add noise to every parameter, so that biases (zero at initialisation) are tested too."""
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(
                0.3 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            )


def torch_fast_path_applies(cfg: Config, *masks: torch.Tensor | None) -> bool:
    """The conditions under which torch.nn.MultiheadAttention.forward uses its fused fast path."""
    float_mask = any(m is not None and m.is_floating_point() for m in masks)
    return (
        cfg.self_attention
        and cfg.batch is not None
        and cfg.bias
        and cfg.num_heads % 2 == 0
        and not float_mask
    )


def assert_same(ours: tuple, theirs: tuple, dtype: torch.dtype, what: str) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        ours[0],
        theirs[0],
        atol=tol,
        rtol=tol,
        msg=lambda m: f"{what} output: {m}",
    )
    if theirs[1] is None:
        assert ours[1] is None, what
    else:
        torch.testing.assert_close(
            ours[1],
            theirs[1],
            atol=tol,
            rtol=tol,
            msg=lambda m: f"{what} weights: {m}",
        )


def check_config(cfg: Config) -> None:
    generator = torch.Generator().manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    attn_mask, key_padding_mask = make_masks(cfg, rng)
    query, key, value = make_inputs(cfg, generator)
    kwargs = dict(
        key_padding_mask=key_padding_mask,
        need_weights=cfg.need_weights,
        attn_mask=attn_mask,
        average_attn_weights=cfg.average_attn_weights,
        is_causal=cfg.is_causal,
    )
    build = dict(
        embed_dim=cfg.embed_dim,
        num_heads=cfg.num_heads,
        bias=cfg.bias,
        kdim=cfg.kdim,
        vdim=cfg.vdim,
        dtype=cfg.dtype,
    )

    def torch_module() -> torch.nn.MultiheadAttention:
        module = torch.nn.MultiheadAttention(**build, batch_first=True).eval()
        perturb(module, generator)
        return module

    def our_module() -> MultiHeadAttention:
        module = MultiHeadAttention(**build, batch_first=True).eval()
        perturb(module, generator)
        return module

    # Direction 1: ours <- torch's state_dict.  Direction 2: torch <- ours.
    theirs_1, ours_1 = torch_module(), MultiHeadAttention(**build, batch_first=True).eval()
    ours_1.load_state_dict(theirs_1.state_dict())
    ours_2, theirs_2 = (
        our_module(),
        torch.nn.MultiheadAttention(**build, batch_first=True).eval(),
    )
    theirs_2.load_state_dict(ours_2.state_dict())

    fast = torch_fast_path_applies(cfg, attn_mask, key_padding_mask)
    for direction, ours, theirs in (
        ("ours<-torch", ours_1, theirs_1),
        ("torch<-ours", ours_2, theirs_2),
    ):
        with warnings.catch_warnings():
            # torch warns when the two masks' types differ (bool and float); we accept both.
            warnings.filterwarnings(
                "ignore",
                message="Support for mismatched key_padding_mask and attn_mask",
            )
            expected = theirs(query, key, value, **kwargs)
            got = ours(query, key, value, **kwargs)
            assert_same(got, expected, cfg.dtype, f"{direction} {cfg}")
            if fast:
                with torch.no_grad():
                    expected = theirs(query, key, value, **kwargs)
                    got = ours(query, key, value, **kwargs)
                assert_same(got, expected, cfg.dtype, f"{direction} fast path {cfg}")


@settings(
    derandomize=True,
    deadline=None,
    max_examples=MAX_EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(cfg=configs())
def test_parity_with_torch(cfg: Config) -> None:
    check_config(cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_parity_batch_first_false(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    theirs = torch.nn.MultiheadAttention(
        8, 2, kdim=3, vdim=5, dtype=dtype
    ).eval()  # batch_first=False
    perturb(theirs, generator)
    ours = MultiHeadAttention(8, 2, kdim=3, vdim=5, batch_first=False, dtype=dtype).eval()
    ours.load_state_dict(theirs.state_dict())
    query = torch.randn(4, 3, 8, generator=generator, dtype=dtype)  # (T_q, B, D)
    key = torch.randn(6, 3, 3, generator=generator, dtype=dtype)  # (T_k, B, kdim)
    value = torch.randn(6, 3, 5, generator=generator, dtype=dtype)  # (T_k, B, vdim)
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [True] + [False] * 5])
    for need_weights in (True, False):
        got = ours(
            query,
            key,
            value,
            key_padding_mask=padding,
            need_weights=need_weights,
            average_attn_weights=False,
        )
        expected = theirs(
            query,
            key,
            value,
            key_padding_mask=padding,
            need_weights=need_weights,
            average_attn_weights=False,
        )
        assert got[0].shape == (4, 3, 8)
        assert_same(
            got,
            expected,
            dtype,
            f"batch_first=False need_weights={need_weights}",
        )

    # Self-attention, where one fused projection serves query, key and value.
    theirs = torch.nn.MultiheadAttention(8, 2, dtype=dtype).eval()
    perturb(theirs, generator)
    ours = MultiHeadAttention(8, 2, batch_first=False, dtype=dtype).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(6, 3, 8, generator=generator, dtype=dtype)  # (T, B, D)
    padding = torch.tensor(
        [[False] * 6, [False] * 4 + [True] * 2, [False] * 5 + [True]]
    )  # key 0 always seen
    for need_weights in (True, False):
        got = ours(
            x,
            x,
            x,
            key_padding_mask=padding,
            need_weights=need_weights,
            is_causal=True,
        )
        expected = theirs(
            x,
            x,
            x,
            key_padding_mask=padding,
            need_weights=need_weights,
            is_causal=True,
            attn_mask=torch.ones(6, 6, dtype=torch.bool).triu(diagonal=1),
        )
        assert_same(
            got,
            expected,
            dtype,
            f"batch_first=False self-attention need_weights={need_weights}",
        )


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("with_padding", [True, False])
def test_is_causal_without_mask_equals_torch_with_causal_mask(
    need_weights: bool, with_padding: bool
) -> None:
    generator = torch.Generator().manual_seed(1)
    theirs = torch.nn.MultiheadAttention(8, 4, batch_first=True, dtype=torch.float64).eval()
    perturb(theirs, generator)
    ours = MultiHeadAttention(8, 4, dtype=torch.float64, batch_first=True).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 8, generator=generator, dtype=torch.float64)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(
        diagonal=1
    )  # True above the diagonal: not allowed
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2]) if with_padding else None
    got = ours(
        x,
        x,
        x,
        key_padding_mask=padding,
        need_weights=need_weights,
        is_causal=True,
    )
    expected = theirs(
        x,
        x,
        x,
        key_padding_mask=padding,
        need_weights=need_weights,
        attn_mask=causal,
        is_causal=True,
    )
    assert_same(got, expected, torch.float64, "is_causal without attn_mask")


def test_same_initialisation_as_torch() -> None:
    """Same seed, same arguments: torch's module and ours start from identical parameters."""
    for kwargs in (
        {},
        {"bias": False},
        {"kdim": 3, "vdim": 5},
        {"kdim": 3, "bias": False},
    ):
        torch.manual_seed(123)
        theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True, **kwargs)
        torch.manual_seed(123)
        ours = MultiHeadAttention(8, 2, **kwargs, batch_first=True)
        expected, got = theirs.state_dict(), ours.state_dict()
        assert list(got) == list(expected), kwargs
        for name in expected:
            assert got[name].shape == expected[name].shape, name
            assert torch.equal(got[name], expected[name]), (kwargs, name)
        assert (ours.in_proj_weight is None) == (theirs.in_proj_weight is None)
        assert (ours.in_proj_bias is None) == (theirs.in_proj_bias is None)
        assert (ours.out_proj.bias is None) == (theirs.out_proj.bias is None)


def test_state_dict_names_and_shapes() -> None:
    fused = MultiHeadAttention(12, 3, batch_first=True)
    assert {name: tuple(p.shape) for name, p in fused.state_dict().items()} == {
        "in_proj_weight": (36, 12),
        "in_proj_bias": (36,),
        "out_proj.weight": (12, 12),
        "out_proj.bias": (12,),
    }
    separate = MultiHeadAttention(12, 3, bias=False, kdim=4, vdim=7, batch_first=True)
    assert separate.in_proj_weight is None and separate.in_proj_bias is None
    assert {name: tuple(p.shape) for name, p in separate.state_dict().items()} == {
        "q_proj_weight": (12, 12),
        "k_proj_weight": (12, 4),
        "v_proj_weight": (12, 7),
        "out_proj.weight": (12, 12),
    }
    assert isinstance(fused.out_proj, torch.nn.Linear)
