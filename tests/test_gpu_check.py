"""``make gpu-check`` (mha.bench.gpu): refused without a GPU, and every part runs.

The parts are run here on the CPU at toy sizes (the kernels in Triton's interpreter, float32,
a two-layer model), so that the command a GPU machine runs once is known to work before it
does: each part's rows, its errors against float32 and SDPA's, the engine's tokens against
generate's alone. On a machine with a GPU the kernels are compiled for it and refuse CPU
tensors, so there the toy parts run in a child process that sees no GPU (the interpreter's
machine), and the GPU itself is left to ``make gpu-check``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

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


def test_a_partial_race_grid_or_a_cut_test_run_has_not_passed() -> None:
    parts = ["race", "tests"]
    whole = {"race": {"failed": {}, "not_run": []}, "tests": {"returncode": 0}}
    assert gpu.checks_passed(whole, parts)
    assert not gpu.checks_passed({**whole, "race": {"failed": {}, "not_run": ["d64"]}}, parts)
    assert not gpu.checks_passed(
        {**whole, "race": {"failed": {"d64": ["dk"]}, "not_run": []}}, parts
    )
    assert not gpu.checks_passed(
        {**whole, "race": {"status": "failed"}}, parts
    )  # the part crashed
    assert not gpu.checks_passed({**whole, "tests": {"returncode": None}}, parts)  # timed out
    assert gpu.checks_passed({"tests": {"returncode": 0}}, ["tests"])  # the race grid not asked


def test_the_report_is_strict_json() -> None:
    import json

    report = {"error": float("nan"), "rows": [1.5, {"ratio": float("inf")}, (float("-inf"),)]}
    text = json.dumps(gpu._finite(report), allow_nan=False)
    assert json.loads(text) == {"error": None, "rows": [1.5, {"ratio": None}, [None]]}


def test_the_cuda_tests_are_collected_from_their_files_alone() -> None:
    # pytest's own selection of cuda-marked tests over every test file, against the same over the
    # files cuda_test_files names: the same tests, so collecting only those files loses none
    root = Path(__file__).resolve().parents[1]

    def collected(*paths: str) -> set[str]:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda",
             "-p", "no:cacheprovider", *paths],
            cwd=root, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        return {line for line in done.stdout.splitlines() if "::" in line}

    files = gpu.cuda_test_files(root)
    assert "tests/test_kernels.py" in files and "tests/test_gpu_check.py" not in files
    everything = collected("tests", "--ignore=tests/book")
    assert everything and collected(*files) == everything


def test_the_compiler_compiles_every_shape_and_never_falls_back() -> None:
    # torch.compile keeps 8 versions of a function's code by default, then runs it uncompiled
    # without a word; gpu-check's settings compile each of 12 shapes, and past its own limit
    # a call raises
    import torch._dynamo

    config = torch._dynamo.config
    traced = []

    def backend(graph, inputs):
        traced.append(inputs[0].shape)
        return graph.forward

    def double(x):
        return x * 2

    now = {name: getattr(config, name) for name in gpu.COMPILER_SETTINGS}
    with config.patch(**now):  # this process's settings, restored on leaving
        assert gpu.configure_compiler() == gpu.COMPILER_SETTINGS
        torch._dynamo.reset()
        compiled = torch.compile(double, backend=backend, dynamic=False)
        for n in range(1, 13):
            compiled(torch.ones(n))
        assert len(traced) == 12
        with config.patch(recompile_limit=12), pytest.raises(Exception, match="recompile_limit"):
            compiled(torch.ones(13))
    torch._dynamo.reset()
    assert {name: getattr(config, name) for name in now} == now


#: The toy parts: on the CPU, in this process where no GPU is seen, else in a child that sees none.
TOY_PARTS = ["attention", "decode", "model", "engine", "ladder"]


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU here: the toy parts run in this process"
)
def test_the_toy_parts_in_a_process_that_sees_no_gpu() -> None:
    if (problem := kernels.interpreter_problem()) is not None:  # this machine's own Triton
        pytest.skip(f"the toy parts need Triton's interpreter: {problem}")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    here = Path(__file__)  # run from the repository's root, where ``mha`` is imported from
    ids = [f"{here.parent.name}/{here.name}::test_the_{part}_part" for part in TOY_PARTS]
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids],
        cwd=here.parents[1], env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-6000:] + completed.stderr[-2000:]
    assert f"{len(TOY_PARTS)} passed" in completed.stdout, completed.stdout[-2000:]


@pytest.fixture
def toy(monkeypatch) -> argparse.Namespace:
    if torch.cuda.is_available():  # the kernels are compiled: they take CUDA tensors only
        pytest.skip("this machine has a GPU: the toy parts run in a child that sees none")
    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    monkeypatch.setattr(gpu, "DTYPE", torch.float32)
    monkeypatch.setattr(gpu, "_median_ms", lambda fn, grad_to_none=None: (fn(), 1.0)[1])  # "1 ms"
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
    names = ["sdpa", "split_kv", "split_kv_packed", "paged_16", "paged_64"]
    names += [f"{kernel}_w{waves}" for kernel in ("split_kv_packed", "paged_16", "paged_64")
              for waves in gpu.DECODE_WAVES]  # fmt: skip
    for name in names:
        assert row[f"{name}_error"] < 1e-5, (name, row)
        assert row[f"{name}_gbs"] == row["kv_bytes"] / 1e6


def test_the_model_part(toy) -> None:
    rows = gpu.part_model(600.0, toy)["rows"]
    assert set(rows) == {"transformers", "sdpa_static", "eager_static", "triton_static",
                         "flex_static", "sdpa_paged", "triton_paged",
                         "sdpa_static_compiled"}  # fmt: skip
    compiled = rows.pop("sdpa_static_compiled")
    assert compiled["first_token_differing"] is None, compiled  # every step one graph
    # every weight once (the tied embeddings once), the whole static cache: 2 layers x 12
    # slots x 2 kv heads x 16 dims x 4 bytes, twice (keys and values)
    weights = sum(p.numel() for p in set(gpu._ours(*gpu._one_b(torch.float32), "sdpa")
                                         .parameters())) * 4  # fmt: skip
    assert compiled["bytes_per_token"] == weights + 2 * 2 * 12 * 2 * 16 * 4
    assert compiled["achieved_gbs"] == compiled["bytes_per_token"] * 3 / compiled["seconds"] / 1e9
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


def test_the_ladder_part(toy, monkeypatch) -> None:
    from mha.bench import ladder
    from mha.kernels.tiles import LADDER, Tiles

    # toy tiles at d 16: the default first, then one more
    candidates = {16: [Tiles(16, 16, 4, 1), Tiles(32, 16, 4, 1)]}
    monkeypatch.setattr(ladder, "TILE_CANDIDATES", candidates)
    monkeypatch.setattr(ladder, "CS336", dict(batch=1, heads=2, t=24, d=16, causal=True))
    monkeypatch.setattr(ladder, "GQA_BACKWARD", ((1, 4, 2, 24, 16),))
    toy.ladder_lengths = [32, 48]
    report = gpu.part_ladder(600.0, toy)
    rows = [r for r in report["rows"] if r["impl"] == "triton"]
    # 2 lengths x 2 masks x (3 rungs + 1 more tile), each against float32 SDPA
    assert len(rows) == 2 * 2 * (len(LADDER) + 1) and not report["skipped"]
    for row in rows:
        assert row["status"] == "ok" and row["error"] < 1e-5, row
    # cuDNN needs a GPU: its rows say why, and no ratio is made up without it
    cudnn = [r for r in report["rows"] if r["impl"] == "sdpa_cudnn"]
    assert len(cudnn) == 4 and all(r["status"] != "ok" for r in cudnn)
    assert len(report["ratios"]) == 2 * 2 * len(LADDER)
    for ratio in report["ratios"]:
        assert "vs_sdpa_cudnn" not in ratio and ratio["vs_sdpa_flash"] == 1.0
    # every candidate took "1 ms" at both lengths: the first (the default) is kept, speed-up 1
    assert report["best_tiles"] == [
        {"d": 16, "causal": False, "tiles": [16, 16, 4, 1], "speedup_over_default": 1.0},
        {"d": 16, "causal": True, "tiles": [16, 16, 4, 1], "speedup_over_default": 1.0},
    ]
    cs336 = {"shape", "triton_forward_backward_ms", "sdpa_flash_forward_backward_ms"}
    assert set(report["cs336"]) == cs336
    # the backward's GQA switch beside the default and SDPA, gradients within float32's
    # rounding of the first row's
    gqa = report["gqa_backward"]
    assert [row["impl"] for row in gqa] == ["triton", "triton_split_group", "sdpa_flash"]
    for row in gqa[:2]:
        assert row["status"] == "ok" and row["grad_difference"] < 1e-5, row
    assert gqa[0]["grad_difference"] == 0.0 and gqa[1]["forward_backward_ms"] == 1.0


def test_best_tiles_are_the_least_total_time_over_the_lengths_all_were_timed_at() -> None:
    from mha.bench import ladder

    top = ladder.LADDER[-1][0]
    default, other = (list(vars(t).values()) for t in ladder.TILE_CANDIDATES[64][:2])

    def row(t, tiles, ms):
        return dict(impl="triton", rung=top, status="ok", d=64, causal=True, T=t, tiles=tiles,
                    forward_ms=ms)  # fmt: skip

    # other is faster at 1k and slower at 4k: 1 + 5 = 6 against 2 + 3 = 5; the 16k row, timed
    # for the default only, is left out of both totals
    rows = [row(1024, default, 2.0), row(4096, default, 3.0), row(16384, default, 50.0),
            row(1024, other, 1.0), row(4096, other, 5.0)]  # fmt: skip
    assert ladder.best_tiles(rows) == [
        {"d": 64, "causal": True, "tiles": default, "speedup_over_default": 1.0}
    ]
    rows[-1] = row(4096, other, 2.0)  # now 1 + 2 = 3 against 5
    assert ladder.best_tiles(rows) == [
        {"d": 64, "causal": True, "tiles": other, "speedup_over_default": round(5 / 3, 3)}
    ]
