"""``make gpu-check`` (mha.bench.gpu): refused without a GPU, and every part runs.

The parts are run here on the CPU at toy sizes (the kernels in Triton's interpreter, float32,
a two-layer model), so that the command a GPU machine runs once is known to work before it
does: each part's rows, its errors against float32 and SDPA's, the engine's tokens against
generate's alone.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from mha import kernels
from mha.bench import gpu

pytestmark = pytest.mark.skipif(not kernels.TRITON_AVAILABLE, reason="triton is not installed")


def test_attention_flops_as_flashattention_counts_them() -> None:
    # FlashAttention's benchmark: 4 B H T^2 d forward, half of it causal, 3.5x with the backward.
    assert gpu.attention_flops(1, 16, 16384, 64, False) == 4 * 16 * 16384**2 * 64
    assert gpu.attention_flops(2, 8, 100, 64, True) == 2 * 2 * 8 * 100**2 * 64
    assert gpu.attention_flops(1, 1, 10, 10, False, backward=True) == 3.5 * 4000


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_fails(capsys) -> None:
    assert gpu.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.fixture
def toy(monkeypatch) -> argparse.Namespace:
    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    monkeypatch.setattr(gpu, "DTYPE", torch.float32)
    monkeypatch.setattr(gpu, "_median_ms", lambda fn: (fn(), 1.0)[1])  # one call, "1 ms"
    monkeypatch.setattr(gpu, "COPY_ELEMENTS", 1024)
    monkeypatch.setattr(gpu, "DECODE_SHAPES", [(2, 4, 2, 40)])
    monkeypatch.setattr(gpu, "DECODE_HEAD_DIM", 16)
    monkeypatch.setattr(gpu, "MODEL_PROMPT", 9)
    monkeypatch.setattr(gpu, "MODEL_NEW_TOKENS", 3)
    fields = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=97)  # fmt: skip
    monkeypatch.setattr(gpu, "ONE_B", {**gpu.ONE_B, **fields})
    monkeypatch.setattr(gpu, "ENGINE_WORK", dict(requests=2, seed=0, prompts=(3, 9), new=(2, 3)))
    monkeypatch.setattr(gpu, "EXACT_WORK", dict(requests=3, seed=1, prompts=(3, 9), new=(2, 4)))
    return argparse.Namespace(attention_lengths=[32], head_dims=[16], tokens=64, width=32,
                              workers=1)  # fmt: skip


def test_the_attention_part(toy) -> None:
    toy.attention_lengths = [32]
    report = gpu.part_attention(600.0, toy)
    rows = {(r["impl"], r["causal"]): r for r in report["rows"]}
    for causal in (False, True):
        ours = rows["triton", causal]
        assert ours["status"] == "ok" and ours["error"] < 1e-5, ours
        assert ours["forward_tflops"] == gpu.attention_flops(2, 2, 32, 16, causal) / 1e9
        assert "forward_backward_ms" in ours
        # every entry has a row: a result, or why this machine refused it (cuDNN needs a GPU)
        assert {impl for impl, c in rows if c == causal} >= {"sdpa_flash", "sdpa_cudnn"}
        assert rows["sdpa_cudnn", causal]["status"] != "ok"
    assert [r["T"] for r in report["ratios"]] == [32, 32]


def test_the_decode_part(toy) -> None:
    (row,) = gpu.part_decode(600.0, toy)["rows"]
    assert row["kv_bytes"] == 2 * 2 * 2 * 40 * 16 * 4
    for name in ("sdpa", "split_kv", "paged_16", "paged_64"):
        assert row[f"{name}_error"] < 1e-5, (name, row)
        assert row[f"{name}_gbs"] == row["kv_bytes"] / 1e6


def test_the_model_part(toy) -> None:
    rows = gpu.part_model(600.0, toy)["rows"]
    assert set(rows) == {"transformers", "sdpa_static", "eager_static", "triton_static",
                         "flex_static", "sdpa_paged", "triton_paged"}  # fmt: skip
    for name, row in rows.items():
        assert "seconds" in row, (name, row)
        if name != "transformers":  # float32, greedy: the same tokens as transformers
            assert row["first_token_differing"] is None, (name, row)
            # synchronisations of a decoding step: counted by torch on a GPU, None elsewhere
            assert (row["syncs_per_step"] is None) == (not torch.cuda.is_available()), row


def test_the_engine_part(toy) -> None:
    report = gpu.part_engine(600.0, toy)
    assert report["timing"]["requests"] == 2
    for name in ("triton_float32", "sdpa_float32"):
        assert report[name]["requests_equal"] == report["requests"] == 3, report[name]
