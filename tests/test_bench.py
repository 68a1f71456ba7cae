"""Tests of the benchmark harness: the command line, what it writes, its FLOP counts, and that
every implementation it times computes the same thing. No timing is asserted."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mha import bench, counting, reference
from mha.functional import reference_weights
from torch.utils.flop_counter import FlopCounterMode

from helpers import KERNEL_DEVICE

ENV_FIELDS = (
    "device",
    "device_name",
    "torch_version",
    "numpy_version",
    "dtype",
    "date_utc",
    "git_commit",
    "threads",
)
TINY = [
    "layer",
    "--batch",
    "2",
    "--heads",
    "2",
    "--head-dim",
    "8",
    "--seq-lens",
    "8",
    "16",
    "--repeats",
    "2",
    "--warmup",
    "1",
    "--min-time",
    "0",
    "--quiet",
]


# ---------------------------------------------------------------------------------------------
# The command line


@pytest.mark.parametrize(
    "command, options",
    [
        ("layer", ("--batch", "--causal", "--memory", "--numpy-max-len")),
        ("decode", ("--batch", "--kv-heads")),
    ],
)
def test_help_lists_every_option(command: str, options: tuple[str, ...]) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "mha.bench", command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    common = ("--device", "--dtype", "--heads", "--head-dim", "--seq-lens", "--impl")
    common += ("--repeats", "--warmup", "--min-time", "--max-repeats", "--threads")
    for option in (*common, "--output", "--quiet", *options):
        assert option in completed.stdout, option


def test_layer_is_the_default_command(capsys) -> None:
    assert bench.main([*TINY[1:], "--impl", "sdpa_bare"]) == 0
    assert "sdpa_bare" in capsys.readouterr().out


def test_cli_writes_json(tmp_path, capsys) -> None:
    impls = [
        "numpy_fused",
        "torch_textbook",
        "mha_module",
        "torch_mha",
        "sdpa_bare",
        "projections",
        "sdpa_math",
    ]
    json_path = tmp_path / "out.json"
    assert (
        bench.main(
            [
                *TINY,
                "--impl",
                *impls,
                "--output",
                str(json_path),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "mha_module/sdpa_bare" in printed and "torch_mha/mha_module" in printed

    report = json.loads(json_path.read_text())
    env = report["environment"]
    for field in ENV_FIELDS:
        assert field in env, field
    assert env["device"] == "cpu" and env["dtype"] == "float32"
    assert env["torch_version"] == torch.__version__ and env["numpy_version"] == np.__version__
    assert env["date_utc"].endswith("+00:00")
    assert env["command"].startswith("python -m mha.bench layer")
    assert report["config"]["seq_lens"] == [8, 16]
    rows = report["results"]
    assert [(r["impl"], r["seq_len"]) for r in rows] == [(i, t) for t in (8, 16) for i in impls]
    for row in rows:
        assert row["status"] == "ok", row
        assert row["median_s"] > 0 and row["repeats"] >= 2
        assert row["flop_per_s"] == pytest.approx(row["flop"] / row["median_s"])
        if row["scope"] == "layer":
            assert row["layer_flop_per_s"] == pytest.approx(row["layer_flop"] / row["median_s"])
            assert row["core_flop_per_s"] == pytest.approx(row["core_flop"] / row["median_s"])
        elif row["scope"] == "core":
            assert row["layer_flop_per_s"] is None
            assert row["core_flop_per_s"] == pytest.approx(row["core_flop"] / row["median_s"])
        else:
            assert row["projection_flop_per_s"] == pytest.approx(
                row["projection_flop"] / row["median_s"]
            )
    assert [r["seq_len"] for r in report["ratios"]] == [8, 16]
    for ratio in report["ratios"]:
        assert ratio["mha_module/sdpa_bare"] > 0 and ratio["torch_mha/mha_module"] > 0


@pytest.mark.parametrize("name", ["out.txt", "out.csv"])
def test_cli_writes_json_only(tmp_path, name: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main([*TINY, "--output", str(tmp_path / name)])
    assert exit_info.value.code == 2
    assert not (tmp_path / name).exists()


def test_memory_mode_measures_each_call_in_its_own_process(tmp_path) -> None:
    json_path = tmp_path / "memory.json"
    bench.main(
        [
            "layer",
            "--memory",
            "--batch",
            "1",
            "--heads",
            "2",
            "--head-dim",
            "8",
            "--seq-lens",
            "64",
            "--impl",
            "sdpa_bare",
            "torch_textbook",
            "--repeats",
            "1",
            "--min-time",
            "0",
            "--quiet",
            "--output",
            str(json_path),
        ]
    )
    report = json.loads(json_path.read_text())
    assert report["config"]["memory"] is True
    for row in report["results"]:
        assert isinstance(row["peak_memory_bytes"], int) and row["peak_memory_bytes"] >= 0
        assert row["memory_method"] in ("VmHWM after clear_refs", "ru_maxrss")
    assert "memory torch_textbook/mha_module" in report["ratios"][0]


def test_skipped_implementations_say_why() -> None:
    report = bench.run_benchmark(
        dtype="bfloat16",
        batch=1,
        heads=2,
        head_dim=8,
        seq_lens=[8],
        impls=["numpy_loop", "sdpa_bare"],
        repeats=1,
        min_time=0.0,
        quiet=True,
    )
    numpy_row, sdpa_row = report["results"]
    assert numpy_row["status"] == "skipped" and "bfloat16" in numpy_row["reason"]
    assert sdpa_row["status"] == "ok"

    report = bench.run_benchmark(
        batch=1,
        heads=2,
        head_dim=8,
        seq_lens=[8, 32],
        impls=["numpy_fused"],
        repeats=1,
        min_time=0.0,
        numpy_max_len=16,
        quiet=True,
    )
    assert [r["status"] for r in report["results"]] == ["ok", "skipped"]
    assert "--numpy-max-len" in report["results"][1]["reason"]


def test_library_not_name_decides_numpy_treatment(monkeypatch) -> None:
    # An entry of the NumPy library under any name: skipped above --numpy-max-len, and timed in
    # rounds of its own (apart from the torch entries).
    registry = dict(bench.IMPLEMENTATIONS)
    monkeypatch.setattr("mha.bench.layer.IMPLEMENTATIONS", registry)
    bench.register(registry, "reference_again", scope="layer", library="numpy")(
        bench.IMPLEMENTATIONS["numpy_fused"].build
    )
    groups = []
    real = bench.timing.time_interleaved

    def spy(runners, device, timing):
        groups.append(sorted(runners))
        return real(runners, device, timing)

    monkeypatch.setattr("mha.bench.timing.time_interleaved", spy)
    report = bench.run_benchmark(
        batch=1,
        heads=2,
        head_dim=8,
        seq_lens=[8, 32],
        impls=["reference_again", "sdpa_bare"],
        repeats=1,
        min_time=0.0,
        numpy_max_len=16,
        quiet=True,
    )
    status = {(r["impl"], r["seq_len"]): r["status"] for r in report["results"]}
    assert status == {
        ("reference_again", 8): "ok",
        ("sdpa_bare", 8): "ok",
        ("reference_again", 32): "skipped",
        ("sdpa_bare", 32): "ok",
    }
    assert groups[:2] == [["reference_again"], ["sdpa_bare"]]


@pytest.mark.parametrize("command", ["layer", "decode"])
def test_device_auto_is_cuda_where_there_is_one(command: str, monkeypatch) -> None:
    class Stop(Exception):
        pass

    seen = []

    def environment(device, dtype):
        seen.append(device.type)
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("mha.bench.timing.environment", environment)
    tiny = TINY if command == "layer" else DECODE_TINY
    with pytest.raises(Stop):
        bench.main([*tiny, "--device", "auto"])
    assert seen == ["cuda"]


def test_bad_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match="impls"):
        bench.run_benchmark(impls=["no_such_impl"], seq_lens=[8], quiet=True)
    with pytest.raises(ValueError, match="seq_lens"):
        bench.run_benchmark(seq_lens=[], quiet=True)
    with pytest.raises(ValueError, match="dtype"):
        bench.run_benchmark(dtype="int8", seq_lens=[8], quiet=True)
    with pytest.raises(ValueError, match=r"must end in \.json"):
        bench.write_results({"environment": {}, "config": {}, "results": []}, "out.txt")


def test_ratios_without_rounds_are_quotients_of_median_times() -> None:
    def row(impl: str, seconds: float, peak: int) -> dict:
        return {
            "impl": impl,
            "seq_len": 64,
            "status": "ok",
            "median_s": seconds,
            "peak_memory_bytes": peak,
        }

    report = {
        "config": {"seq_lens": [64], "memory": True},
        "results": [
            row("sdpa_bare", 2.0, 100),
            row("mha_module", 2.2, 110),
            row("torch_mha", 5.5, 1100),
            row("torch_textbook", 6.6, 2200),
        ],
    }
    (ratio,) = bench.ratios(report)
    assert ratio["mha_module/sdpa_bare"] == pytest.approx(1.1)
    assert ratio["torch_mha/mha_module"] == pytest.approx(2.5)
    assert ratio["torch_textbook/mha_module"] == pytest.approx(3.0)
    assert ratio["memory torch_textbook/mha_module"] == pytest.approx(20.0)


def test_time_ratios_pair_the_calls_of_each_round() -> None:
    # Round 2 was slow for both (the machine was busy): per-round ratios 1.1, 1.1, 1.2, median 1.1.
    report = {
        "config": {"seq_lens": [64]},
        "results": [
            {
                "impl": "mha_module",
                "seq_len": 64,
                "status": "ok",
                "median_s": 2.2,
                "times_s": [2.2, 11.0, 1.2],
            },
            {
                "impl": "sdpa_bare",
                "seq_len": 64,
                "status": "ok",
                "median_s": 2.0,
                "times_s": [2.0, 10.0, 1.0],
            },
        ],
    }
    assert bench.ratios(report)[0]["mha_module/sdpa_bare"] == pytest.approx(1.1)
    # Every round 1.2, though the medians (2.2 and 2.0) are in the ratio 1.1: the rounds decide.
    report["results"][0]["times_s"] = [2.4, 12.0, 1.2]
    assert bench.ratios(report)[0]["mha_module/sdpa_bare"] == pytest.approx(1.2)
    assert report["results"][0]["median_s"] / report["results"][1]["median_s"] == pytest.approx(
        1.1
    )


# ---------------------------------------------------------------------------------------------
# FLOP counts


def test_rows_carry_the_flop_counts_of_mha_counting() -> None:
    report = bench.run_benchmark(
        batch=2,
        heads=3,
        head_dim=4,
        seq_lens=[5],
        impls=["sdpa_bare", "sdpa_math"],
        repeats=1,
        min_time=0.0,
        causal=True,
        quiet=True,
    )
    layer_row, core_row = report["results"]
    # By hand: 2 B H T^2 d_k per product, two products, halved when causal: 4*2*3*25*4 / 2 = 1200.
    assert layer_row["core_flop"] == core_row["flop"] == 1200
    # Four projections of 2 B T D^2 = 2*2*5*144 = 2880 FLOPs each.
    assert layer_row["projection_flop"] == 4 * 2880
    assert layer_row["flop"] == 1200 + 4 * 2880


def test_flop_counts_match_torch_flop_counter() -> None:
    config = bench.BenchConfig(batch=2, seq_len=24, heads=4, head_dim=8)
    layer, x = bench.make_layer(config), bench.make_input(config)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        bench.textbook_attention(x, layer)
    assert counter.get_total_flops() == counting.layer_flops(2, 24, 32, 4)


# ---------------------------------------------------------------------------------------------
# Every implementation computes the same function


def _outputs(
    config: bench.BenchConfig,
    layer: torch.nn.MultiheadAttention,
    x: torch.Tensor,
) -> dict[str, np.ndarray]:
    outputs = {}
    for impl in bench.IMPLEMENTATIONS:
        try:
            runner = bench.build_runner(bench.IMPLEMENTATIONS, impl, layer, x, config.causal)
            with torch.no_grad():
                outputs[impl] = np.asarray(runner(), dtype=np.float64)
        except bench.Unsupported:
            continue
        except (
            RuntimeError
        ) as error:  # a backend this device does not have (efficient, cudnn on a CPU)
            assert impl in ("sdpa_efficient", "sdpa_cudnn"), error
    return outputs


def _expected(
    config: bench.BenchConfig,
    layer: torch.nn.MultiheadAttention,
    x: torch.Tensor,
):
    """Layer output, core output (B, H, T, d_k) and projections output, from the NumPy reference
    with torch's (out, in) weight layout transposed and the biases added by hand."""
    H = config.heads
    w = reference_weights(layer, dtype=np.float64)
    x_np = x.numpy().astype(np.float64)
    q, k, v = (
        x_np @ w.w_q + w.b_q,
        x_np @ w.w_k + w.b_k,
        x_np @ w.w_v + w.b_v,
    )  # (B, T, D) each
    mask = reference.causal_mask(config.seq_len) if config.causal else None
    heads, _ = reference.scaled_dot_product_attention(
        reference.split_heads(q, H),
        reference.split_heads(k, H),
        reference.split_heads(v, H),
        mask,
    )  # (B, H, T, d_k)
    layer_out = reference.merge_heads(heads) @ w.w_o + w.b_o  # (B, T, D)
    return layer_out, heads, v @ w.w_o + w.b_o


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-12), ("float32", 2e-5)])
def test_every_implementation_computes_the_same_output(
    causal: bool, dtype: str, tolerance: float
) -> None:
    config = bench.BenchConfig(
        batch=2, seq_len=12, heads=4, head_dim=8, dtype=dtype, causal=causal
    )
    layer, x = bench.make_layer(config), bench.make_input(config)
    outputs = _outputs(config, layer, x)
    assert set(bench.select(bench.IMPLEMENTATIONS, None, "cpu")) <= set(
        outputs
    )  # every entry the CPU runs by default
    layer_out, core_out, projections_out = _expected(config, layer, x)
    for impl, output in outputs.items():
        expected = {
            "layer": layer_out,
            "core": core_out,
            "projections": projections_out,
        }[bench.IMPLEMENTATIONS[impl].scope]
        np.testing.assert_allclose(output, expected, rtol=tolerance, atol=tolerance, err_msg=impl)


def test_torch_implementations_agree_with_nonzero_biases() -> None:
    config = bench.BenchConfig(batch=2, seq_len=10, heads=2, head_dim=8, dtype="float64")
    layer, x = bench.make_layer(config), bench.make_input(config)
    with torch.no_grad():
        layer.in_proj_bias.copy_(torch.linspace(-1, 1, 3 * config.embed_dim, dtype=torch.float64))
        layer.out_proj.bias.copy_(torch.linspace(0.5, -0.5, config.embed_dim, dtype=torch.float64))
    with pytest.raises(bench.Unsupported, match="biases"):
        bench.build_runner(bench.IMPLEMENTATIONS, "numpy_fused", layer, x, False)
    outputs = _outputs(config, layer, x)
    assert "mha_module" in outputs and "torch_mha" in outputs
    layer_out, core_out, _ = _expected(config, layer, x)
    for impl in ("torch_textbook", "mha_module", "torch_mha", "sdpa_bare"):
        np.testing.assert_allclose(outputs[impl], layer_out, rtol=1e-12, atol=1e-12, err_msg=impl)
    np.testing.assert_allclose(outputs["sdpa_math"], core_out, rtol=1e-12, atol=1e-12)


def test_layer_weights_are_torch_initialisation() -> None:
    config = bench.BenchConfig(batch=1, seq_len=4, heads=2, head_dim=4)
    layer = bench.make_layer(config, seed=3)
    assert not layer.training and not layer.in_proj_weight.requires_grad
    assert torch.equal(layer.in_proj_bias, torch.zeros(3 * config.embed_dim))
    bound = math.sqrt(6.0 / (config.embed_dim + 3 * config.embed_dim))  # Xavier-uniform on (3D, D)
    assert float(layer.in_proj_weight.abs().max()) <= bound
    assert torch.equal(layer.in_proj_weight, bench.make_layer(config, seed=3).in_proj_weight)


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_entries_compute_the_reference_core(causal: bool) -> None:
    # head_dim 16: a size the Triton kernel takes (the test above uses 8, which it refuses).
    config = bench.BenchConfig(batch=1, seq_len=40, heads=2, head_dim=16, causal=causal)
    layer, x = bench.make_layer(config), bench.make_input(config)
    _, core_out, _ = _expected(config, layer, x)
    # the Triton kernel gets the same seeded layer and input where it runs (CUDA where compiled)
    on_kernels = dataclasses.replace(config, device=KERNEL_DEVICE)
    inputs = {
        "flash_torch": (layer, x),
        "triton_attention": (bench.make_layer(on_kernels), bench.make_input(on_kernels)),
    }
    for impl, (layer_, x_) in inputs.items():
        assert bench.IMPLEMENTATIONS[impl].scope == "core"
        with torch.no_grad():
            output = bench.build_runner(bench.IMPLEMENTATIONS, impl, layer_, x_, causal)()
        assert output.device == x_.device, impl
        np.testing.assert_allclose(
            output.cpu().numpy(), core_out, rtol=2e-5, atol=2e-5, err_msg=impl
        )
    assert "flash_torch" in bench.select(bench.IMPLEMENTATIONS, None, "cpu")
    # by name only: interpreted
    assert "triton_attention" not in bench.select(bench.IMPLEMENTATIONS, None, "cpu")
    assert "triton_attention" in bench.select(bench.IMPLEMENTATIONS, None, "cuda")


@pytest.mark.cuda
def test_the_layer_runs_on_the_gpu_every_entry_there() -> None:
    # --device cuda: weights, inputs and masks on the GPU, the Triton kernel compiled; every
    # default entry of the GPU runs (status ok), and triton_attention computes the core
    report = bench.run_benchmark(
        device="cuda", batch=1, heads=2, head_dim=16, seq_lens=[40], causal=True,
        repeats=2, warmup=1, min_time=0, quiet=True,
    )  # fmt: skip
    assert report["environment"]["device"] == "cuda"
    rows = {row["impl"]: row for row in report["results"]}
    assert "triton_attention" in rows, rows
    # a forced SDPA backend may refuse float32 (flash, cudnn): skipped, with torch's reason
    forced = {f"sdpa_{name}" for name in bench.BACKENDS} - {"sdpa_math"}
    for impl, row in rows.items():
        assert row["status"] == "ok" or (impl in forced and row["reason"]), row


@pytest.mark.cuda
def test_the_decode_steps_run_on_the_gpu() -> None:
    report = bench.run_decode_benchmark(
        device="cuda", batches=[2], heads=4, head_dim=8, kv_heads=[4, 1], contexts=[9],
        repeats=2, min_time=0, quiet=True,
    )  # fmt: skip
    assert report["environment"]["device"] == "cuda"
    for row in report["results"]:
        assert row["status"] == "ok", row


def test_impl_lists_the_tiled_entries() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "mha.bench", "layer", "--impl"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    names = [line.split()[0] for line in completed.stdout.splitlines()[1:]]
    assert names == list(bench.IMPLEMENTATIONS)
    assert "flash_torch" in names and "triton_attention" in names


# ---------------------------------------------------------------------------------------------
# Decode steps (python -m mha.bench decode)

DECODE_TINY = [
    "decode",
    "--batch",
    "2",
    "--heads",
    "4",
    "--head-dim",
    "8",
    "--seq-lens",
    "5",
    "9",
    "--kv-heads",
    "4",
    "2",
    "1",
    "--repeats",
    "2",
    "--min-time",
    "0",
    "--quiet",
]


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_every_decode_step_equals_the_last_row_of_the_full_forward(
    num_kv_heads: int, dtype: torch.dtype, tolerance: float
) -> None:
    from transformers import __version__  # noqa: F401  (a pinned test dependency)

    layer = bench.make_decode_layer(32, 4, num_kv_heads, dtype=dtype)
    context, x_new = bench.make_decode_inputs(2, 9, 32, dtype=dtype)
    with torch.no_grad():
        expected = layer(torch.cat((context, x_new), dim=1))[:, -1:]  # causal, positions 0..9
    assert set(bench.DECODE_IMPLEMENTATIONS).isdisjoint(bench.IMPLEMENTATIONS)
    # the default entries; the compiled ones: tests/test_compiled_decoding.py
    for impl in bench.select(bench.DECODE_IMPLEMENTATIONS, None, "cpu"):
        runner = bench.build_runner(bench.DECODE_IMPLEMENTATIONS, impl, layer, context, x_new)
        with torch.no_grad():
            first, second = runner(), runner()  # the same step every call
        # transformers computes its rotary angles in float32 whatever the dtype.
        tol = 1e-6 if impl.startswith("hf_") and dtype == torch.float64 else tolerance
        torch.testing.assert_close(first, expected, rtol=tol, atol=tol, msg=impl)
        assert torch.equal(first, second), impl


def test_decode_cli_writes_json_with_ratios(tmp_path, capsys) -> None:
    json_path = tmp_path / "decode.json"
    assert bench.main([*DECODE_TINY, "--output", str(json_path)]) == 0
    printed = capsys.readouterr().out
    for text in ("ours/hf_dynamic", "no_cache/ours", "prealloc"):
        assert text in printed, text
    report = json.loads(json_path.read_text())
    env = report["environment"]
    for field in (*ENV_FIELDS, "transformers_version", "command"):
        assert field in env, field
    assert env["command"].startswith("python -m mha.bench decode")
    config = report["config"]
    assert config["mode"] == "decode" and config["kv_heads"] == [4, 2, 1]
    assert config["batches"] == [2] and config["contexts"] == [5, 9]
    rows = report["results"]
    impls = bench.select(bench.DECODE_IMPLEMENTATIONS, None, "cpu")  # the defaults
    assert len(rows) == 2 * 3 * len(impls)  # T, H_kv, implementation
    for row in rows:
        assert row["status"] == "ok", row
        assert row["median_s"] > 0 and row["repeats"] >= 2 and len(row["times_s"]) >= 2
        if row["impl"] == "no_cache":
            assert row["cache_bytes"] is None
        else:  # keys and values of T + 1 positions, float32
            expected = 2 * row["batch"] * (row["context"] + 1) * row["num_kv_heads"] * 8 * 4
            assert row["cache_bytes"] == expected
        assert row["weight_bytes"] == (2 * 32 + 2 * row["num_kv_heads"] * 8) * 32 * 4
    assert len(report["ratios"]) == 2 * 3
    for ratio in report["ratios"]:
        for key in ("ours/hf_dynamic", "ours/hf_static", "no_cache/ours", "concat/ours"):
            assert ratio[key] > 0, key
        assert (ratio["ours/MHA"] == 1.0) == (ratio["num_kv_heads"] == 4)
    assert "targets" not in report  # a chapter states its own, from the figures


def _decode_report(times: dict[tuple[str, int, int], list[float]]) -> dict:
    """A report with the given per-round times for (impl, H_kv, T), B = 1, H = 4."""
    results = [
        {
            "impl": impl,
            "num_kv_heads": h_kv,
            "batch": 1,
            "context": t,
            "status": "ok",
            "median_s": float(np.median(samples)),
            "times_s": samples,
            "cache_bytes": 2 * (t + 1) * h_kv * 8 * 4,
        }
        for (impl, h_kv, t), samples in times.items()
    ]
    report = {
        "config": {"batches": [1], "contexts": [128, 4096], "kv_heads": [4, 1], "heads": 4},
        "results": results,
    }
    report["ratios"] = bench.decode_ratios(report)
    return report


def test_decode_ratios_by_hand() -> None:
    times = {
        ("preallocated_cache", 4, 128): [1.0, 2.0, 1.0],
        ("preallocated_cache", 4, 4096): [3.0, 6.0, 3.0],  # 3x longer: not flat within 2x
        ("preallocated_cache", 1, 128): [1.0, 2.0, 1.0],
        ("preallocated_cache", 1, 4096): [1.5, 3.0, 1.5],
        ("hf_dynamic_cache", 4, 128): [1.25, 2.5, 1.25],  # ours / theirs = 0.8 in every round
        ("hf_dynamic_cache", 4, 4096): [2.0, 6.0, 2.0],  # 1.5, 1.0, 1.5 -> median 1.5
        ("no_cache", 4, 4096): [30.0, 60.0, 30.0],
    }
    report = _decode_report(times)
    by_key = {(r["num_kv_heads"], r["context"]): r for r in report["ratios"]}
    assert by_key[4, 128]["ours/hf_dynamic"] == pytest.approx(0.8)
    assert by_key[4, 4096]["ours/hf_dynamic"] == pytest.approx(1.5)
    assert by_key[4, 4096]["no_cache/ours"] == pytest.approx(10.0)
    assert by_key[1, 4096]["ours/MHA"] == pytest.approx(0.5)
    assert by_key[4, 128]["ours/hf_static"] is None  # not measured: no ratio


def test_decode_bad_arguments() -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main([*DECODE_TINY, "--output", "out.csv"])
    assert exit_info.value.code == 2
    with pytest.raises(ValueError, match=r"each of kv_heads must divide heads \(4\), got 3"):
        bench.run_decode_benchmark(heads=4, head_dim=8, kv_heads=[3], contexts=[4], quiet=True)
    with pytest.raises(ValueError, match="impls must be among"):
        bench.run_decode_benchmark(impls=["sdpa_bare"], contexts=[4], quiet=True)
    with pytest.raises(ValueError, match="impl must be one of"):
        bench.build_runner(
            bench.DECODE_IMPLEMENTATIONS,
            "mha_module",
            None,
            torch.zeros(1, 2, 4),
            torch.zeros(1, 1, 4),
        )
    with pytest.raises(SystemExit):
        bench.main([*TINY, "--kv-heads", "2"])  # a decode option
    with pytest.raises(SystemExit):
        bench.main([*DECODE_TINY, "--memory"])  # a layer option
    with pytest.raises(ValueError, match="registered already"):
        bench.register(bench.DECODE_IMPLEMENTATIONS, "no_cache", scope="decode")(
            lambda layer, context, x_new: None
        )


def test_git_dirty_counts_code_changes_not_benchmark_results(tmp_path):
    """Replacing committed results (as the reproduction recipe does) is
    not a change of the code that measured them; editing code is."""
    from mha.environment import git_commit

    def git(*args):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
        )

    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "cpu_2000-01-01.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    commit, dirty = git_commit(tmp_path)
    assert len(commit) == 40 and dirty is False

    git("rm", "-q", "benchmarks/cpu_2000-01-01.json")
    assert git_commit(tmp_path) == (commit, False)

    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == (commit, True)


def test_serve_names_its_sizes_once() -> None:
    # serve's sizes are numbers of requests: --requests, and no --seq-lens beside it.
    import contextlib
    import io

    from mha.bench.cli import main

    text = io.StringIO()
    with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--requests" in text.getvalue() and "--seq-lens" not in text.getvalue()


# ---------------------------------------------------------------------------------------------
# A learner's own kernel beside the book's (python -m mha.bench layer --load FILE.py)

LEARNER_ENTRY = '''
import mha.kernels  # first: it chooses Triton's interpreter where there is no GPU
import sys
sys.path.insert(0, {tests!r})
import torch
from learner_kernels import learner_attention
from mha.bench import core


@core("my_flash", dtypes=(torch.float32, torch.float16, torch.bfloat16), default_on=())
def my_flash(q, k, v, causal):
    """My FlashAttention kernel (chapter 13's exercise)."""
    return lambda: learner_attention(q, k, v, causal)[0]
'''


def _bench(*args: str, cwd) -> subprocess.CompletedProcess:
    # mha from this tree, where it is not installed too (a plain checkout on a GPU machine)
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "mha.bench", *args], capture_output=True,
                          text=True, timeout=600, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": path})  # fmt: skip


def test_a_learners_kernel_is_timed_beside_the_books(tmp_path) -> None:
    (tmp_path / "my_kernel.py").write_text(LEARNER_ENTRY.format(tests=str(Path(__file__).parent)))
    listed = _bench("layer", "--load", "my_kernel.py", "--impl", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "my_flash" in listed.stdout and "My FlashAttention kernel" in listed.stdout
    completed = _bench(
        "layer", "--load=my_kernel.py", "--impl", "my_flash", "triton_attention", "sdpa_math",
        "--seq-lens", "48", "--batch", "1", "--heads", "2", "--head-dim", "32", "--causal",
        "--repeats", "1", "--warmup", "1", "--min-time", "0", "--max-repeats", "1", "--quiet",
        "--device", KERNEL_DEVICE, "--output", "out.json", cwd=tmp_path,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    rows = {row["impl"]: row for row in report["results"]}
    assert set(rows) == {"my_flash", "triton_attention", "sdpa_math"}
    assert all(row["status"] == "ok" for row in rows.values()), rows
    assert "--load=my_kernel.py" in report["environment"]["command"]
    assert "my_flash" in completed.stdout


def test_a_file_that_cannot_be_loaded_is_named(tmp_path) -> None:
    missing = _bench("layer", "--load", "nowhere.py", "--impl", cwd=tmp_path)
    assert missing.returncode == 2
    assert "--load takes a Python file (.py), got 'nowhere.py': no such file" in missing.stderr
    (tmp_path / "broken.py").write_text("raise RuntimeError('half written')\n")
    broken = _bench("layer", "--load", "broken.py", "--impl", cwd=tmp_path)
    assert broken.returncode == 2
    assert "--load broken.py: running it raised RuntimeError: half written" in broken.stderr
    (tmp_path / "again.py").write_text(
        "from mha.bench import core\n\n@core('sdpa_math')\ndef again(q, k, v, causal):\n"
        "    return lambda: q\n"
    )
    again = _bench("layer", "--load", "again.py", "--impl", cwd=tmp_path)
    assert again.returncode == 2 and "named 'sdpa_math' is registered already" in again.stderr
