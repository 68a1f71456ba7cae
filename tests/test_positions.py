"""Tests of mha.positions: sinusoidal and learned positions, RoPE.

Expected values are worked out by hand for small cases (a rotation of one pair by a known
angle), from the formula of Vaswani et al. (2017) section 3.5, and from transformers' Llama
rotary embedding (LlamaRotaryEmbedding, apply_rotary_pos_emb), for each rope type it knows
(default, linear, llama3, yarn); the scaling rules are also checked by hand, band by band.
"""

from __future__ import annotations

import math

import pytest
import torch
from mha.decoding import GroupedQueryAttention
from mha.positions import (
    LearnedPositions,
    Rope,
    apply_rope,
    rope_angles,
    sinusoidal_positions,
)
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from helpers import ROPE_PARAMETERS, randn

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------
# Sinusoidal and learned positions


def test_sinusoidal_positions_by_hand() -> None:
    # D = 4: frequencies 1 and 1 / 10000^(2/4) = 1/100; columns sin, cos, sin, cos.
    table = sinusoidal_positions(3, 4, dtype=torch.float64)
    expected = [[math.sin(p), math.cos(p), math.sin(p / 100), math.cos(p / 100)] for p in range(3)]
    torch.testing.assert_close(table, torch.tensor(expected, dtype=torch.float64))
    assert table[0].tolist() == [0.0, 1.0, 0.0, 1.0]


def test_sinusoidal_positions_follow_vaswani_section_3_5() -> None:
    T, D = 50, 16
    table = sinusoidal_positions(T, D, dtype=torch.float64)
    assert table.shape == (T, D) and table.dtype == torch.float64
    for pos in (0, 7, 49):
        for i in range(D // 2):
            angle = pos / 10000 ** (2 * i / D)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-14)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-14)
    assert sinusoidal_positions(T, D).dtype == torch.get_default_dtype()


def test_sinusoidal_offsets_are_linear_maps() -> None:
    # Vaswani et al.: PE[pos + k] is a linear function of PE[pos] (a rotation of each pair).
    table = sinusoidal_positions(20, 8, dtype=torch.float64)
    k = 3
    for i in range(4):
        w = 1 / 10000 ** (2 * i / 8)
        rotation = torch.tensor(
            [[math.cos(k * w), -math.sin(k * w)], [math.sin(k * w), math.cos(k * w)]],
            dtype=torch.float64,
        )
        pairs = table[:, 2 * i : 2 * i + 2]  # (T, 2): (sin, cos)
        torch.testing.assert_close(pairs[:-k] @ rotation, pairs[k:])


def test_learned_positions() -> None:
    torch.manual_seed(0)
    learned = LearnedPositions(10, 6)
    out = learned(torch.arange(4))
    assert out.shape == (4, 6)
    assert torch.equal(out, learned.table.weight[:4])
    assert learned(torch.arange(4).expand(2, 4)).shape == (2, 4, 6)
    assert sum(p.numel() for p in learned.parameters()) == 60  # one vector per position
    with pytest.raises(ValueError, match=r"positions must lie in \[0, max_len\) = \[0, 10\)"):
        learned(torch.arange(11))
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        learned(torch.zeros(3))


def test_sinusoidal_errors() -> None:
    with pytest.raises(ValueError, match="d_model must be even"):
        sinusoidal_positions(4, 5)
    with pytest.raises(TypeError, match="seq_len must be an int"):
        sinusoidal_positions(4.0, 4)
    with pytest.raises(ValueError, match="base must be a float > 1"):
        sinusoidal_positions(4, 4, base=1.0)


# ---------------------------------------------------------------------------------------------
# RoPE


def test_rope_rotates_one_pair_by_the_position() -> None:
    # d_k = 2: one pair, frequency 1: position p turns (x0, x1) by p radians.
    x = torch.tensor([1.0, 2.0], dtype=torch.float64).expand(1, 1, 3, 2)  # (B, H, T, d_k)
    out = apply_rope(x, torch.tensor([0, 1, 2]))
    for p in range(3):
        c, s = math.cos(p), math.sin(p)
        assert out[0, 0, p].tolist() == pytest.approx([1 * c - 2 * s, 1 * s + 2 * c], abs=1e-15)


def test_rope_pairs_dimension_i_with_i_plus_half() -> None:
    # d_k = 4: pairs (0, 2) at frequency 1 and (1, 3) at frequency 1/100 ("rotate half").
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64).reshape(1, 1, 1, 4)
    p = 5
    out = apply_rope(x, torch.tensor([p]))[0, 0, 0]
    a, b = p, p / 100
    expected = [
        1 * math.cos(a) - 3 * math.sin(a),
        2 * math.cos(b) - 4 * math.sin(b),
        1 * math.sin(a) + 3 * math.cos(a),
        2 * math.sin(b) + 4 * math.cos(b),
    ]
    assert out.tolist() == pytest.approx(expected, abs=1e-14)


def test_rope_angles_by_formula() -> None:
    angles = rope_angles(torch.arange(4), 8, dtype=torch.float64)  # (T, d_k/2)
    expected = [[p * 10000 ** (-2 * i / 8) for i in range(4)] for p in range(4)]
    torch.testing.assert_close(angles, torch.tensor(expected, dtype=torch.float64))


def test_rope_keeps_lengths_and_position_zero_is_identity() -> None:
    x = randn(2, 3, 7, 8, seed=1)
    rotated = apply_rope(x, torch.arange(7))
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotated[:, :, 0], x[:, :, 0], rtol=0, atol=0)


def test_rope_scores_depend_only_on_the_offset() -> None:
    q, k = randn(1, 1, 1, 16, seed=2), randn(1, 1, 1, 16, seed=3)

    def score(m: int, n: int) -> float:
        return (apply_rope(q, torch.tensor([m])) * apply_rope(k, torch.tensor([n]))).sum().item()

    for m, n in ((5, 2), (2, 5), (9, 9)):
        for shift in (1, 17, 300):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-12)
    assert abs(score(5, 2) - score(5, 3)) > 1e-3  # the offset itself matters


def test_rope_per_sequence_positions() -> None:
    x = randn(2, 2, 4, 8, seed=4)
    rows = torch.tensor([[0, 1, 2, 3], [10, 11, 12, 13]])
    out = apply_rope(x, rows)
    torch.testing.assert_close(out[0], apply_rope(x[:1], torch.arange(4))[0])
    torch.testing.assert_close(out[1], apply_rope(x[1:], torch.arange(10, 14))[0])


@pytest.mark.parametrize("head_dim, base", [(8, 10000.0), (64, 10000.0), (16, 500000.0)])
def test_rope_equals_transformers_llama_rotary_embedding(head_dim: int, base: float) -> None:
    config = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": base},
    )
    rotary = LlamaRotaryEmbedding(config)
    q, k = (
        randn(2, 4, 40, head_dim, seed=5, dtype=torch.float32),
        randn(2, 2, 40, head_dim, seed=6, dtype=torch.float32),
    )
    positions = torch.arange(100, 140)
    cos, sin = rotary(q, positions[None])  # (1, T, d_k) each
    q_theirs, k_theirs = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(apply_rope(q, positions, base), q_theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rope(k, positions, base), k_theirs, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Scaled RoPE: position interpolation, Llama 3.1's rule, YaRN


def llama_rotary(rope_type: str, head_dim: int) -> tuple[LlamaConfig, LlamaRotaryEmbedding]:
    config = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        rope_parameters=dict(ROPE_PARAMETERS[rope_type]),
    )
    return config, LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3", "yarn"])
def test_scaled_rope_equals_transformers(rope_type: str, head_dim: int) -> None:
    config, rotary = llama_rotary(rope_type, head_dim)
    rope = Rope.from_parameters(
        config.rope_parameters, max_position_embeddings=config.max_position_embeddings
    )
    assert rope.rope_type == rope_type
    torch.testing.assert_close(rope.frequencies(head_dim), rotary.inv_freq, rtol=1e-7, atol=0)
    assert rope.attention_scaling == pytest.approx(rotary.attention_scaling, rel=1e-12)
    q = randn(2, 4, 24, head_dim, seed=11, dtype=torch.float32)
    k = randn(2, 2, 24, head_dim, seed=12, dtype=torch.float32)
    positions = torch.arange(12000, 12024)  # past every original context
    cos, sin = rotary(q, positions[None])
    q_theirs, k_theirs = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(apply_rope(q, positions, rope), q_theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rope(k, positions, rope), k_theirs, rtol=1e-5, atol=1e-5)


def test_linear_scaling_is_position_interpolation() -> None:
    # Chen et al. (2023): position p is read as p / factor.
    rope = Rope(rope_type="linear", factor=4.0)
    angles = rope_angles(torch.arange(0, 64, 4), 16, rope, dtype=torch.float64)
    torch.testing.assert_close(angles, rope_angles(torch.arange(16), 16, dtype=torch.float64))


def test_llama3_rule_by_hand() -> None:
    # d_k = 8, base 10000: theta = 1, 0.1, 0.01, 0.001; wavelengths 2 pi / theta =
    # 6.3, 62.8, 628.3, 6283.2. Context 2048, low 1, high 4: wavelengths under 2048 / 4 = 512
    # keep theta (pairs 0, 1), over 2048 / 1 are divided by 8 (pair 3), and pair 2 blends:
    # s = (2048 / 628.3 - 1) / (4 - 1), theta' = (1 - s) theta / 8 + s theta.
    rope = Rope(rope_type="llama3", factor=8.0, original_max_len=2048)
    s = (2048 / (2 * math.pi / 0.01) - 1) / 3
    expected = [1.0, 0.1, (1 - s) * 0.01 / 8 + s * 0.01, 0.001 / 8]
    torch.testing.assert_close(
        rope.frequencies(8, torch.float64), torch.tensor(expected, dtype=torch.float64)
    )


def test_yarn_bands_and_attention_factor_by_the_paper() -> None:
    # Peng et al. (2023): pairs that turn more than beta_fast = 32 times over the original
    # context keep their frequency, those that turn less than beta_slow = 1 time are
    # interpolated (divided by the factor); the attention temperature is 0.1 ln(s) + 1,
    # applied to queries and keys alike (so sqrt of 1/t on the scores).
    rope = Rope(rope_type="yarn", factor=16.0, original_max_len=4096)
    theta = Rope().frequencies(128, torch.float64)
    turns = 4096 * theta / (2 * math.pi)  # (64,)
    scaled = rope.frequencies(128, torch.float64)
    fast, slow = turns > 32 * 1.2, turns < 1 / 1.2  # clear of the ramp's rounded ends
    assert fast.sum() > 10 and slow.sum() > 10
    torch.testing.assert_close(scaled[fast], theta[fast])
    torch.testing.assert_close(scaled[slow], theta[slow] / 16)
    between = ~fast & ~slow
    assert bool(
        ((scaled[between] <= theta[between]) & (scaled[between] >= theta[between] / 16)).all()
    )
    assert rope.attention_scaling == pytest.approx(0.1 * math.log(16) + 1)
    x = randn(1, 1, 3, 128, seed=13)
    ratio = apply_rope(x, torch.arange(3), rope).norm(dim=-1) / x.norm(dim=-1)
    torch.testing.assert_close(ratio, torch.full_like(ratio, 0.1 * math.log(16) + 1))


def test_rope_from_parameters_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ValueError, match=r"rope_type 'dynamic' is not supported"):
        Rope.from_parameters({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match=r"rope_type 'longrope' is not supported"):
        Rope.from_parameters({"rope_type": "longrope", "rope_theta": 1e4})
    with pytest.raises(ValueError, match=r"partial_rotary_factor must be 1.0.*got 0.5"):
        Rope.from_parameters({"rope_theta": 1e4, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match=r"keys that Rope does not know: \['scale'\]"):
        Rope.from_parameters({"rope_theta": 1e4, "scale": 2.0})
    with pytest.raises(TypeError, match="original_max_len must be an int"):
        Rope.from_parameters({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0})
    with pytest.raises(ValueError, match=r"factor must be a float >= 1 for rope_type 'linear'"):
        Rope(rope_type="linear", factor=0.5)
    with pytest.raises(TypeError, match="rope_parameters must be a dict"):
        Rope.from_parameters([("rope_theta", 1e4)])


def test_rope_errors() -> None:
    x = randn(1, 2, 3, 6)
    with pytest.raises(ValueError, match=r"d_k must be even.*got d_k = 5|even for RoPE.*d_k = 5"):
        apply_rope(randn(1, 2, 3, 5), torch.arange(3))
    with pytest.raises(ValueError, match=r"positions must have shape \(T,\) = \(3,\)"):
        apply_rope(x, torch.arange(4))
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        apply_rope(x, torch.arange(3.0))
    with pytest.raises(ValueError, match=r"x must have shape \(B, H, T, d_k\)"):
        apply_rope(x[0], torch.arange(3))
    with pytest.raises(ValueError, match="base must be a float > 1"):
        apply_rope(x, torch.arange(3), base=-1.0)


# ---------------------------------------------------------------------------------------------
# Attention without positions is permutation-equivariant; with RoPE it is not


def test_attention_without_positions_is_permutation_equivariant() -> None:
    torch.manual_seed(0)
    layer = GroupedQueryAttention(16, 4, 2, rope_base=None, dtype=torch.float64)
    x = randn(2, 6, 16, seed=7)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    out = layer(x, is_causal=False)
    torch.testing.assert_close(layer(x[:, perm], is_causal=False), out[:, perm])
    roped = GroupedQueryAttention(16, 4, 2, dtype=torch.float64)
    roped.load_state_dict(layer.state_dict())
    moved = roped(x[:, perm], is_causal=False) - roped(x, is_causal=False)[:, perm]
    assert moved.abs().max() > 1e-3  # with positions, order changes the outputs
