"""The benchmark: build every runner per T, time them, collect the rows.

The runners of one T are timed in interleaved rounds.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import counting
from .._validate import check_choice, check_int
from .config import DTYPES, BenchConfig, make_input, make_layer
from .environment import environment
from .registry import IMPLEMENTATIONS, Unsupported, build_runner, default_impls
from .report import MIB, ratios
from .timing import cpu_peak_bytes, cuda_peak_bytes, probe, time_interleaved

__all__ = ["DEFAULT_SEQ_LENS", "MEMORY_SEQ_LENS", "run_benchmark"]

DEFAULT_SEQ_LENS = (128, 256, 512, 1024, 2048)
MEMORY_SEQ_LENS = (256, 512, 1024, 2048, 4096)


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda' was asked for, "
            "but torch.cuda.is_available() is False"
        )
    if device not in ("cpu", "cuda"):
        raise ValueError(
            f"device must be 'cpu', 'cuda' or 'auto', got {device!r}"
        )
    return torch.device(device)


def _check_arguments(
    dtype: str,
    batch: int,
    heads: int,
    head_dim: int,
    seq_lens: Sequence[int],
    repeats: int,
    warmup: int,
) -> None:
    check_choice("dtype", dtype, tuple(DTYPES))
    for name, value in (
        ("batch", batch),
        ("heads", heads),
        ("head_dim", head_dim),
        ("repeats", repeats),
    ):
        check_int(name, value)
    # The first warm-up call also checks that an implementation can run here.
    check_int("warmup", warmup)
    if not seq_lens:
        raise ValueError(
            "seq_lens must be a non-empty list of positive ints, got []"
        )
    for t in seq_lens:
        check_int("each of seq_lens", t)


def _log(message: str, quiet: bool) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def run_benchmark(
    *,
    device: str = "cpu",
    dtype: str = "float32",
    batch: int = 8,
    heads: int = 8,
    head_dim: int = 64,
    seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
    impls: Sequence[str] | None = None,
    repeats: int = 5,
    warmup: int = 1,
    min_time: float = 1.0,
    max_repeats: int = 50,
    causal: bool = False,
    memory: bool = False,
    threads: int | None = None,
    numpy_max_len: int = 512,
    quiet: bool = False,
) -> dict[str, Any]:
    """Run the benchmark and return a JSON-ready dict.

    The dict holds ``environment``, ``config``, ``results`` and ``ratios``.
    ``results`` holds one row per (implementation, T) with ``status`` ``"ok"``
    or ``"skipped"`` (and the ``reason``). See the module docstring for how
    times and memory are measured.
    """
    _check_arguments(dtype, batch, heads, head_dim, seq_lens, repeats, warmup)
    torch_device = _resolve_device(device)
    impls = list(default_impls(torch_device) if impls is None else impls)
    unknown = [name for name in impls if name not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(
            f"impls must be among {', '.join(IMPLEMENTATIONS)}, "
            f"got unknown {unknown}"
        )
    if threads is not None:
        torch.set_num_threads(threads)
    env = environment(torch_device, dtype)
    config_record = {
        "batch": batch,
        "heads": heads,
        "head_dim": head_dim,
        "embed_dim": heads * head_dim,
        "seq_lens": list(seq_lens),
        "impls": impls,
        "causal": causal,
        "repeats": repeats,
        "warmup": warmup,
        "min_time_s": min_time,
        "max_repeats": max_repeats,
        "memory": memory,
        "numpy_max_len": numpy_max_len,
        "timer": "CUDA events"
        if torch_device.type == "cuda"
        else "time.perf_counter",
        "memory_method": None
        if not memory
        else (
            "torch.cuda.max_memory_allocated"
            if torch_device.type == "cuda"
            else "peak RSS in a fresh process"
        ),
    }
    _log(
        f"mha.bench: {env['device_name']} ({torch_device.type}), "
        f"torch {env['torch_version']}, {dtype}, {env['threads']} threads, "
        f"B={batch} H={heads} d_k={head_dim}, T in {list(seq_lens)}",
        quiet,
    )

    results: list[dict[str, Any]] = []
    for index, seq_len in enumerate(seq_lens, start=1):
        config = BenchConfig(
            batch, seq_len, heads, head_dim, dtype, torch_device.type, causal
        )
        layer, x = make_layer(config), make_input(config)
        core = counting.attention_core_flops(
            batch, seq_len, heads * head_dim, heads, causal=causal
        )
        proj = counting.projection_flops(batch, seq_len, heads * head_dim)
        flops_of_scope = {
            "layer": core + proj,
            "core": core,
            "projections": proj,
        }
        rows: dict[str, dict[str, Any]] = {}
        runners: dict[str, Callable[[], object]] = {}
        for impl in impls:
            row = {
                "impl": impl,
                "scope": IMPLEMENTATIONS[impl].scope,
                "seq_len": seq_len,
                "status": "ok",
                "reason": None,
                "core_flop": core,
                "projection_flop": proj,
                "layer_flop": core + proj,
                "flop": flops_of_scope[IMPLEMENTATIONS[impl].scope],
            }
            rows[impl] = row
            try:
                if impl.startswith("numpy_") and seq_len > numpy_max_len:
                    raise Unsupported(
                        "NumPy implementations run up to "
                        f"T = {numpy_max_len} (--numpy-max-len)"
                    )
                runner = build_runner(impl, layer, x, causal)
                for _ in range(warmup):
                    probe(runner, torch_device)
                runners[impl] = runner
            except Unsupported as why:
                row.update(status="skipped", reason=str(why))
        _log(
            f"[{index}/{len(seq_lens)}] T={seq_len}: "
            f"timing {len(runners)} implementations",
            quiet,
        )
        # NumPy (OpenBLAS threads) and torch (OpenMP threads) are timed apart:
        # interleaved, each library's idle threads would still be spinning
        # when the other's call starts.
        times: dict[str, list[float]] = {}
        for family in (
            lambda name: name.startswith("numpy_"),
            lambda name: not name.startswith("numpy_"),
        ):
            group = {
                name: runner
                for name, runner in runners.items()
                if family(name)
            }
            times.update(
                time_interleaved(
                    group, torch_device, repeats, min_time, max_repeats
                )
            )
        for impl in impls:
            row = rows[impl]
            if row["status"] == "ok":
                samples = sorted(times[impl])
                median = statistics.median(samples)
                quartiles = (
                    statistics.quantiles(samples, n=4)
                    if len(samples) >= 2
                    else [median] * 3
                )
                row.update(
                    median_s=median,
                    min_s=samples[0],
                    q1_s=quartiles[0],
                    q3_s=quartiles[2],
                    repeats=len(samples),
                    **_rates(row, median),
                    # in round order, for the paired ratios
                    times_s=times[impl],
                )
                if memory:
                    if torch_device.type == "cuda":
                        row.update(
                            peak_memory_bytes=cuda_peak_bytes(
                                runners[impl], torch_device
                            ),
                            memory_method="torch.cuda.max_memory_allocated",
                        )
                    else:
                        peak, method = cpu_peak_bytes(
                            impl, config, torch.get_num_threads()
                        )
                        row.update(
                            peak_memory_bytes=peak, memory_method=method
                        )
                memory_text = (
                    f", peak +{row['peak_memory_bytes'] / MIB:.1f} MiB"
                    if memory
                    else ""
                )
                _log(
                    f"    {impl:<16} {median * 1e3:10.3f} ms  "
                    f"{row['flop_per_s'] / 1e9:8.1f} GFLOP/s "
                    f"({row['scope']}){memory_text}",
                    quiet,
                )
            else:
                _log(f"    {impl:<16} skipped: {row['reason']}", quiet)
            results.append(row)
        del runners, layer, x
        gc.collect()
    env["load_average_1min_end"] = (
        os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    )
    report = {"environment": env, "config": config_record, "results": results}
    report["ratios"] = ratios(report)
    return report


def _rates(row: dict[str, Any], seconds: float) -> dict[str, float | None]:
    """FLOP/s of a row: of its scope, and of the layer, core and projections.

    The last three only where defined. A layer row's ``core_flop_per_s``
    divides the core's FLOPs by the whole layer's time (a lower bound on the
    rate of its core); a core row has no layer rate, a projections row only its
    own.
    """
    scope = row["scope"]
    return {
        "flop_per_s": row["flop"] / seconds,
        "layer_flop_per_s": row["layer_flop"] / seconds
        if scope == "layer"
        else None,
        "core_flop_per_s": row["core_flop"] / seconds
        if scope in ("layer", "core")
        else None,
        "projection_flop_per_s": row["projection_flop"] / seconds
        if scope == "projections"
        else None,
    }
