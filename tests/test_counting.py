"""Tests for mha.counting.

Parameter counts against torch, FLOP counts against an independent count.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from mha import counting
from mha.counting import (
    MODEL_CONFIGS,
    VASWANI2017_HEAD_ABLATION,
    attention_core_flops,
    attention_flops,
    attention_parameters,
    attention_weights_bytes,
    kv_cache_bytes,
    layer_flops,
    parameter_bytes,
    projection_flops,
    softmax_rows,
)
from torch.utils.flop_counter import FlopCounterMode


def torch_parameter_count(d_model: int, num_heads: int, **kwargs: object) -> int:
    layer = torch.nn.MultiheadAttention(d_model, num_heads, **kwargs)
    return sum(p.numel() for p in layer.parameters())


def test_d512_by_hand():
    # W_Q, W_K, W_V, W_O are each 512 x 512 = 262,144 weights: 4 * 262,144 = 1,048,576.
    # Four bias vectors of length 512 add 4 * 512 = 2,048: 1,050,624.
    assert attention_parameters(512, 8, bias=False) == 1_048_576
    assert attention_parameters(512, 8, bias=True) == 1_050_624


def test_d512_against_torch():
    assert torch_parameter_count(512, 8, bias=False) == 1_048_576
    assert torch_parameter_count(512, 8, bias=True) == 1_050_624


@pytest.mark.parametrize(
    ("d_model", "num_heads", "bias", "kdim", "vdim", "add_bias_kv"),
    [
        (8, 1, True, None, None, False),
        (8, 2, False, None, None, False),
        (12, 3, True, None, None, False),
        (64, 4, True, None, None, False),
        (64, 16, False, None, None, False),
        (96, 6, True, 40, 24, False),
        (96, 6, False, 40, 24, False),
        (32, 4, True, 7, None, False),
        (32, 4, False, None, 9, False),
        (16, 2, True, None, None, True),
        (16, 2, False, 5, 3, True),
    ],
)
def test_parameters_against_torch(d_model, num_heads, bias, kdim, vdim, add_bias_kv):
    expected = torch_parameter_count(
        d_model,
        num_heads,
        bias=bias,
        kdim=kdim,
        vdim=vdim,
        add_bias_kv=add_bias_kv,
    )
    got = attention_parameters(
        d_model,
        num_heads,
        bias=bias,
        kdim=kdim,
        vdim=vdim,
        add_bias_kv=add_bias_kv,
    )
    assert got == expected


def test_kdim_vdim_by_hand():
    # D = 6, kdim = 4, vdim = 2: W_Q 6*6 = 36, W_K 4*6 = 24, W_V 2*6 = 12, W_O 6*6 = 36
    # -> 108; biases 4*6 = 24.
    assert attention_parameters(6, 3, bias=False, kdim=4, vdim=2) == 108
    assert attention_parameters(6, 3, bias=True, kdim=4, vdim=2) == 132


def test_parameters_do_not_depend_on_heads():
    counts = {attention_parameters(48, h, bias=True) for h in (1, 2, 3, 4, 6, 8, 12, 16, 24, 48)}
    assert counts == {4 * 48 * 48 + 4 * 48}
    assert {torch_parameter_count(48, h) for h in (1, 3, 16)} == counts


def count_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize(
    ("batch", "t_q", "t_k", "d_model", "num_heads", "kdim", "vdim"),
    [
        (1, 3, 3, 4, 2, None, None),
        (2, 5, 5, 12, 3, None, None),
        (3, 4, 7, 8, 4, None, None),
        (2, 6, 2, 16, 2, 5, 3),
    ],
)
def test_flops_against_torch_flop_counter(batch, t_q, t_k, d_model, num_heads, kdim, vdim):
    """FlopCounterMode counts 2 FLOPs per multiply-add of each matmul it sees."""
    kdim_, vdim_ = kdim or d_model, vdim or d_model
    d_k = d_model // num_heads
    x_q = torch.randn(batch, t_q, d_model)
    x_k = torch.randn(batch, t_k, kdim_)
    x_v = torch.randn(batch, t_k, vdim_)
    w_q, w_k, w_v, w_o = (torch.randn(n, d_model) for n in (d_model, kdim_, vdim_, d_model))
    q = (x_q @ w_q).view(batch, t_q, num_heads, d_k).transpose(1, 2)  # (B, H, T_q, d_k)
    k = (x_k @ w_k).view(batch, t_k, num_heads, d_k).transpose(1, 2)  # (B, H, T_k, d_k)
    v = (x_v @ w_v).view(batch, t_k, num_heads, d_k).transpose(1, 2)  # (B, H, T_k, d_k)
    weights = torch.softmax(q @ k.transpose(-1, -2), dim=-1)  # (B, H, T_q, T_k)
    heads = weights @ v  # (B, H, T_q, d_k)
    merged = heads.transpose(1, 2).reshape(batch, t_q, d_model)  # (B, T_q, D)

    expected = {
        "q_proj": count_flops(lambda: x_q @ w_q),
        "k_proj": count_flops(lambda: x_k @ w_k),
        "v_proj": count_flops(lambda: x_v @ w_v),
        "scores": count_flops(lambda: q @ k.transpose(-1, -2)),
        "weighted_values": count_flops(lambda: weights @ v),
        "out_proj": count_flops(lambda: merged @ w_o),
    }
    got = attention_flops(batch, t_q, d_model, num_heads, t_k=t_k, kdim=kdim, vdim=vdim)
    assert got == expected
    assert projection_flops(batch, t_q, d_model, t_k=t_k, kdim=kdim, vdim=vdim) == (
        expected["q_proj"] + expected["k_proj"] + expected["v_proj"] + expected["out_proj"]
    )
    assert attention_core_flops(batch, t_q, d_model, num_heads, t_k=t_k) == (
        expected["scores"] + expected["weighted_values"]
    )


def count_multiply_adds_of_loops(
    batch: int, t: int, d_model: int, num_heads: int
) -> tuple[int, int]:
    """Run explicit Python loops for a tiny self-attention and count every multiply-add they do."""
    rng = np.random.default_rng(0)
    d_k = d_model // num_heads
    x = rng.normal(size=(batch, t, d_model))
    w = rng.normal(size=(d_model, d_model))
    macs = {"projections": 0, "core": 0}

    def matmul(a, b, kind):
        rows, inner = a.shape
        cols = b.shape[1]
        out = np.zeros((rows, cols))
        for i in range(rows):
            for j in range(cols):
                for m in range(inner):
                    out[i, j] += a[i, m] * b[m, j]
                    macs[kind] += 1
        return out

    for b in range(batch):
        q, k, v = (matmul(x[b], w, "projections") for _ in range(3))
        heads = []
        for h in range(num_heads):
            cols = slice(h * d_k, (h + 1) * d_k)
            scores = matmul(q[:, cols], k[:, cols].T, "core")
            heads.append(matmul(scores, v[:, cols], "core"))
        matmul(np.concatenate(heads, axis=1), w, "projections")
    return macs["projections"], macs["core"]


@pytest.mark.parametrize(
    ("batch", "t", "d_model", "num_heads"),
    [(1, 3, 4, 2), (2, 2, 6, 3), (1, 5, 4, 1)],
)
def test_flops_against_counted_loops(batch, t, d_model, num_heads):
    projection_macs, core_macs = count_multiply_adds_of_loops(batch, t, d_model, num_heads)
    assert projection_flops(batch, t, d_model) == 2 * projection_macs
    assert attention_core_flops(batch, t, d_model, num_heads) == 2 * core_macs


def test_flops_by_hand():
    # B = 1, T = 2, D = 4, H = 2: each projection is (2, 4) @ (4, 4): 2 * 4 * 4 = 32 MACs,
    # 64 FLOPs; four: 256.
    # Q K^T per head is (2, 2) @ (2, 2): 8 MACs; weights V the same; two heads: 32 MACs = 64 FLOPs.
    assert projection_flops(1, 2, 4) == 256
    assert attention_core_flops(1, 2, 4, 2) == 64
    # B=2, H=3, T=5, d_k=4 (D=12): per head, Q K^T has 5 x 5 outputs of 4 multiply-adds = 100 MACs,
    # weights V another 100; 200 MACs = 400 FLOPs per head, times B H = 6 -> 2400; causal: half.
    assert attention_core_flops(2, 5, 12, 3) == 2400
    assert attention_core_flops(2, 5, 12, 3, causal=True) == 1200
    # One projection: B T = 10 rows x 12 outputs x 12 MACs = 1440 MACs = 2880 FLOPs; four of them.
    assert layer_flops(2, 5, 12, 3) == 2400 + 4 * 2880
    assert layer_flops(2, 5, 12, 3, causal=True) == 1200 + 4 * 2880
    # The benchmark's defaults, B=8, H=8, d_k=64, T=1024: core 4*8*8*1024^2*64 = 2^34 FLOPs,
    # projections 8*8*1024*512^2 = 2^34 as well (T = 2 D is where the two are equal).
    assert attention_core_flops(8, 1024, 512, 8) == 2**34
    assert projection_flops(8, 1024, 512) == 2**34


def test_kv_cache_bytes_by_hand():
    # Keys and values (2) x B=1 x T=4096 x L=32 x H_kv=32 x d_k=128 x 2 bytes = 2 GiB
    # (Llama-2-7B, bf16).
    assert kv_cache_bytes(1, 4096, 32, 32, 128) == 2 * 4096 * 32 * 32 * 128 * 2 == 2 * 2**30
    # Per token and layer with one key/value head of 64 float32 numbers: 2 x 64 x 4 bytes.
    assert kv_cache_bytes(1, 1, 1, 1, 64, bytes_per_element=4) == 512


def test_core_and_projection_flops_are_equal_at_twice_d_model():
    # 4 B T^2 D = 8 B T D^2  <=>  T = 2 D.
    for d_model in (64, 512, 4096):
        t = 2 * d_model
        assert attention_core_flops(2, t, d_model, 8) == projection_flops(2, t, d_model)
        assert attention_core_flops(2, t - 1, d_model, 8) < projection_flops(2, t - 1, d_model)
        assert attention_core_flops(2, t + 1, d_model, 8) > projection_flops(2, t + 1, d_model)


def test_flops_do_not_depend_on_heads():
    totals = {sum(attention_flops(2, 10, 64, h).values()) for h in (1, 2, 4, 8, 16, 32, 64)}
    assert len(totals) == 1


def test_softmax_rows_and_weights_memory_grow_with_heads():
    assert softmax_rows(2, 10, 1) == 20
    assert softmax_rows(2, 10, 8) == 160
    # (B, H, T_q, T_k) = (2, 8, 10, 12) float32 values: 2 * 8 * 10 * 12 * 4 = 7,680 bytes.
    assert attention_weights_bytes(2, 8, 10, 12) == 7_680
    assert attention_weights_bytes(2, 8, 10, 12, bytes_per_element=2) == 3_840


def test_parameter_bytes():
    assert parameter_bytes(1_048_576) == 4 * 1_048_576
    assert parameter_bytes(1_048_576, bytes_per_param=2) == 2_097_152
    tensor = torch.nn.MultiheadAttention(64, 4, bias=False)
    assert parameter_bytes(attention_parameters(64, 4, bias=False)) == sum(
        p.numel() * p.element_size() for p in tensor.parameters()
    )


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (
            lambda: attention_parameters(10, 3),
            ValueError,
            "d_model (10) must be divisible by num_heads (3)",
        ),
        (
            lambda: attention_parameters(10, 0),
            ValueError,
            "num_heads must be a positive int, got 0",
        ),
        (
            lambda: attention_parameters(10.0, 2),
            TypeError,
            "d_model must be an int, got float",
        ),
        (
            lambda: attention_parameters(8, 2, kdim=0),
            ValueError,
            "kdim must be a positive int, got 0",
        ),
        (
            lambda: attention_flops(0, 4, 8, 2),
            ValueError,
            "batch must be a positive int, got 0",
        ),
        (
            lambda: attention_flops(1, 4, 8, True),
            TypeError,
            "num_heads must be an int, got bool",
        ),
        (
            lambda: attention_core_flops(1, 4, 8, 2, t_k=-1),
            ValueError,
            "t_k must be a positive int, got -1",
        ),
    ],
)
def test_bad_input(call, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        call()


# Values quoted in the papers (see the citation of each entry), written here again by hand.
PUBLISHED = {
    "Transformer base": (512, 8, 6),  # vaswani2017attention, Table 3
    "Transformer big": (1024, 16, 6),  # vaswani2017attention, Table 3
    "BERT-base": (768, 12, 12),  # devlin2019bert: L=12, H=768, A=12
    "BERT-large": (1024, 16, 24),  # devlin2019bert: L=24, H=1024, A=16
    "GPT-2 small": (
        768,
        12,
        12,
    ),  # radford2019language Table 2; openai2019gpt2code hparams
    "GPT-2 medium": (1024, 16, 24),
    "GPT-2 large": (1280, 20, 36),
    "GPT-2 XL": (1600, 25, 48),
    "GPT-3 175B": (
        12288,
        96,
        96,
    ),  # brown2020language, Table 2.1 (d_head = 128)
    "LLaMA-7B": (4096, 32, 32),  # touvron2023llama, Table 2
}


def test_model_configs_match_the_papers():
    assert {c.name: (c.d_model, c.num_heads, c.num_layers) for c in MODEL_CONFIGS} == PUBLISHED


def test_model_configs_have_whole_head_sizes():
    for config in MODEL_CONFIGS:
        assert config.d_model % config.num_heads == 0, config.name
        assert config.d_k * config.num_heads == config.d_model
    by_name = {c.name: c for c in MODEL_CONFIGS}
    assert by_name["GPT-3 175B"].d_k == 128  # brown2020language, Table 2.1: d_head = 128
    assert by_name["GPT-2 XL"].d_k == 64
    assert by_name["Transformer base"].d_k == 64  # vaswani2017attention, Table 3: d_k = 64


def test_model_configs_cite_known_keys():
    text = (Path(__file__).parents[1] / "references.bib").read_text()
    for config in MODEL_CONFIGS:
        for key in config.citation.split(","):
            assert "{" + key + "," in text, (config.name, key)


def test_model_config_parameter_totals():
    by_name = {c.name: c for c in MODEL_CONFIGS}
    # GPT-3: 96 layers * (4 * 12288^2 + 4 * 12288) = 96 * 603,979,776 + 96 * 49,152.
    gpt3 = by_name["GPT-3 175B"]
    assert gpt3.attention_parameters_total() == 96 * (603_979_776 + 49_152)
    assert gpt3.attention_parameters_total(bias=False) == 96 * 603_979_776
    # LLaMA-7B has no attention biases: 32 * 4 * 4096^2.
    assert by_name["LLaMA-7B"].attention_parameters_total() == 32 * 4 * 4096 * 4096
    # Transformer base: 3 * 6 attention modules of 4 * 512^2.
    assert by_name["Transformer base"].attention_parameters_total() == 18 * 1_048_576


def test_head_ablation_data():
    rows = [
        (r.row, r.num_heads, r.d_k, r.d_v, r.perplexity_dev, r.bleu_dev)
        for r in VASWANI2017_HEAD_ABLATION
    ]
    # vaswani2017attention, Table 3, rows (A), base and the first line of (B), newstest2013.
    assert rows == [
        ("(A)", 1, 512, 512, 5.29, 24.9),
        ("(A)", 4, 128, 128, 5.00, 25.5),
        ("base", 8, 64, 64, 4.92, 25.8),
        ("(A)", 16, 32, 32, 4.91, 25.8),
        ("(A)", 32, 16, 16, 5.01, 25.4),
        ("(B)", 8, 16, 64, 5.16, 25.1),
    ]
    for row in VASWANI2017_HEAD_ABLATION:
        if row.row in (
            "(A)",
            "base",
        ):  # constant computation: h * d_k = d_model = 512
            assert row.num_heads * row.d_k == 512 and row.d_k == row.d_v


def test_all_names_exported():
    for name in counting.__all__:
        assert hasattr(counting, name)


# ---------------------------------------------------------------------------------------------
# Bytes moved and the roofline of the attention core (chapter 13), derived by hand


def test_attention_core_bytes_by_hand() -> None:
    # B = 1, H = 1, T = 1024, d_k = 64, bf16: q, k, v in and the output out = 4 * 1024 * 64
    # elements of 2 bytes = 524,288 bytes.
    assert counting.attention_core_bytes(1, 1024, 1, 64) == 524_288
    # Materialising adds S written, S read, P written, P read: 4 * 1024^2 * 2 = 8,388,608 bytes.
    assert counting.attention_core_bytes(1, 1024, 1, 64, materialise=True) == 8_912_896
    # Cross-attention, B = 2, H = 3, T_q = 10, T_k = 20, d_k = 4, float32:
    # (2*10 + 2*20) * 2 * 3 * 4 = 1440 elements = 5760 bytes; + 4 * 2*3*10*20 = 4800 elements.
    assert counting.attention_core_bytes(2, 10, 3, 4, t_k=20, bytes_per_element=4) == 5760
    assert (
        counting.attention_core_bytes(2, 10, 3, 4, t_k=20, bytes_per_element=4, materialise=True)
        == 5760 + 4800 * 4
    )


def test_exponentials_by_hand() -> None:
    # One exp per score: B H T_q T_k = 2 * 3 * 10 * 20 = 1200; halved when causal.
    assert counting.attention_core_exponentials(2, 10, 3, t_k=20) == 1200
    assert counting.attention_core_exponentials(2, 10, 3, t_k=20, causal=True) == 600
    # Against the core's 4 B H T^2 d_k FLOPs: one exp per 4 d_k = 512 FLOPs at d_k = 128, the
    # ratio shah2024flashattention3 quotes (Section 3.1: "512x more matmul FLOPS").
    flops = counting.attention_core_flops(1, 256, 128 * 4, 4)
    assert flops // counting.attention_core_exponentials(1, 256, 4) == 512


def test_h100_figures_are_the_datasheet_ones() -> None:
    # 1,979 TFLOPS with sparsity -> 989.5 dense; 3.35 TB/s; ridge 989.5 / 3.35 = 295.37 FLOP/B.
    h100 = counting.H100_SXM
    assert h100.peak_flop_per_s == 989.5e12 and h100.memory_bytes_per_s == 3.35e12
    assert h100.ridge_intensity == pytest.approx(295.373, abs=1e-3)
    assert h100.dtype == "bfloat16" and h100.citation == "nvidia2023h100"


def test_roofline_of_the_fused_and_the_materialising_core_by_hand() -> None:
    # B = H = 1, T = 1024, d_k = 64, bf16 on the H100 SXM.
    # FLOPs: 4 * 1024^2 * 64 = 268,435,456. Fused: 524,288 bytes, intensity 512 FLOP/B > 295.4:
    # compute-bound, 268,435,456 / 989.5e12 s = 0.27128 us, at the peak.
    fused = counting.attention_core_roofline(1, 1024, 1, 64)
    assert fused.flop == 268_435_456 and fused.intensity == 512.0
    assert fused.bound == "compute"
    assert fused.seconds == pytest.approx(2.7128394e-7, rel=1e-7)
    assert fused.flop_per_s == pytest.approx(989.5e12)
    # Materialising: 8,912,896 bytes, intensity T d / (2 (T + d)) = 65536 / 2176 = 30.12 FLOP/B:
    # memory-bound, 8,912,896 / 3.35e12 s = 2.6606 us, 30.12 * 3.35 = 100.9 TFLOP/s.
    textbook = counting.attention_core_roofline(1, 1024, 1, 64, materialise=True)
    assert textbook.intensity == pytest.approx(65536 / 2176)
    assert textbook.bound == "memory"
    assert textbook.seconds == pytest.approx(2.6605660e-6, rel=1e-7)
    assert textbook.flop_per_s == pytest.approx(100.894e12, rel=1e-5)
    # Causal halves the FLOPs, not the fused kernel's bytes: intensity T / 4 = 256 < 295.4.
    causal = counting.attention_core_roofline(1, 1024, 1, 64, causal=True)
    assert causal.intensity == 256.0 and causal.bound == "memory"
    assert causal.flop_per_s == pytest.approx(256 * 3.35e12)


def test_roofline_rejects_bad_counts() -> None:
    with pytest.raises(TypeError, match="flop must be an int"):
        counting.roofline(1.5, 10)
    with pytest.raises(ValueError, match="bytes_moved must be a positive int, got 0"):
        counting.roofline(10, 0)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        counting.attention_core_bytes(1, 8, 1, 0)


# Key/value caches of published decoders (chapter 12)


def test_decoder_kv_cache_bytes_per_token_by_hand() -> None:
    from mha.counting import DECODER_KV_CONFIGS

    by_name = {c.name: c for c in DECODER_KV_CONFIGS}
    # 2 (keys and values) x layers x key/value heads x d_k x 2 bytes (16-bit floats).
    expected = {
        "Llama-2-7B": 2 * 32 * 32 * 128 * 2,  # 524,288 bytes = 512 KiB
        "Llama-2-70B": 2 * 80 * 8 * 128 * 2,  # 327,680 bytes = 320 KiB
        "Llama-3-8B": 2 * 32 * 8 * 128 * 2,  # 131,072 bytes = 128 KiB
        "Mistral-7B": 2 * 32 * 8 * 128 * 2,
    }
    assert {name: c.kv_cache_bytes_per_token() for name, c in by_name.items()} == expected
    assert by_name["Llama-2-7B"].kv_cache_bytes_per_token() == 512 * 1024
    for config in DECODER_KV_CONFIGS:
        assert config.d_model // config.num_heads == config.head_dim
        assert config.num_heads % config.num_kv_heads == 0
        ratio = config.mha_kv_cache_bytes_per_token() / config.kv_cache_bytes_per_token()
        assert ratio == config.num_heads / config.num_kv_heads  # what sharing saves
        assert config.citation and config.source


def test_deepseek_v2_figures_agree_with_each_other() -> None:
    from mha.counting import DEEPSEEK_V2_MLA as mla

    assert mla.elements_per_token() == (512 + 64) * 60 == 34_560
    # Table 1: d_c = 4 d_h, d_h^R = d_h / 2: (d_c + d_h^R) l = 9/2 d_h l = GQA with 2.25 groups.
    assert mla.kv_compression_dim == 4 * mla.head_dim and mla.rope_head_dim == mla.head_dim // 2
    assert (mla.kv_compression_dim + mla.rope_head_dim) / (2 * mla.head_dim) == (
        mla.equivalent_gqa_groups
    )
    assert mla.mha_elements_per_token() == 2 * 128 * 128 * 60
