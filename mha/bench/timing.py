"""Timing and peak memory of one runner.

Times come from CUDA events on a GPU and from ``time.perf_counter`` on the CPU.
"""

from __future__ import annotations

import gc
import json
import os
import random
import resource
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import torch

from .config import BenchConfig, make_input, make_layer
from .registry import Unsupported, build_runner

__all__ = [
    "probe",
    "time_call",
    "time_interleaved",
    "cuda_peak_bytes",
    "cpu_peak_bytes",
    "cpu_peak_probe",
]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe(runner: Callable[[], object], device: torch.device) -> float:
    """Run once, untimed but for the seconds returned.

    A kernel that cannot run raises :class:`Unsupported`.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        try:
            with torch.no_grad():
                runner()
            synchronize(device)
        except (RuntimeError, NotImplementedError) as error:
            reasons = [str(w.message).splitlines()[0] for w in caught]
            first_line = (
                str(error).strip().splitlines()[0]
                if str(error).strip()
                else type(error).__name__
            )
            raise Unsupported("; ".join([first_line, *reasons])) from None
        return time.perf_counter() - start


def time_call(runner: Callable[[], object], device: torch.device) -> float:
    """Seconds for one call.

    CUDA events around it on a GPU, ``time.perf_counter`` on the CPU.
    """
    with torch.no_grad():
        if device.type == "cuda":
            start, end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            start.record()
            runner()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        begin = time.perf_counter()
        runner()
        return time.perf_counter() - begin


def time_interleaved(
    runners: dict[str, Callable[[], object]],
    device: torch.device,
    repeats: int,
    min_time: float,
    max_repeats: int,
) -> dict[str, list[float]]:
    """Time every runner in interleaved rounds, each in a fresh random order.

    The random orders are seeded. The order changes so that no implementation
    always follows the same one: a call that frees a large tensor makes the
    next call's allocations fault in fresh pages, which would otherwise always
    be charged to the same neighbour. Rounds continue until every runner has
    ``repeats`` calls and the rounds have taken ``min_time`` seconds in all
    (fast configurations get more calls), or until ``max_repeats`` rounds.
    """
    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    if not names:
        return times
    order = random.Random(0)
    start = time.perf_counter()
    rounds = 0
    while rounds < repeats or (
        rounds < max_repeats and time.perf_counter() - start < min_time
    ):
        for name in order.sample(names, len(names)):
            times[name].append(time_call(runners[name], device))
        rounds += 1
    return times


def cuda_peak_bytes(runner: Callable[[], object], device: torch.device) -> int:
    """Peak memory allocated during one call.

    It is counted above what was allocated just before the call.
    """
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    with torch.no_grad():
        output = runner()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    del output
    return int(peak)


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS.

    Returns False where that is not possible.
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return _proc_status_kib("VmHWM") is not None
    except OSError:
        return False


def cpu_peak_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Peak extra resident memory of one call of one implementation.

    Runs in a fresh process.
    """
    torch.set_num_threads(int(spec["threads"]))
    config = BenchConfig(**spec["config"])
    causal = config.causal
    # A first call at a tiny size loads the code paths and starts the thread
    # pool, so that the measured call pays only for its own tensors.
    small = replace(config, seq_len=min(config.seq_len, 16))
    warm_layer, warm_x = make_layer(small), make_input(small)
    with torch.no_grad():
        build_runner(spec["impl"], warm_layer, warm_x, causal)()
    layer, x = make_layer(config), make_input(config)
    runner = build_runner(spec["impl"], layer, x, causal)
    del warm_layer, warm_x
    gc.collect()
    if _reset_peak_rss():
        method = "VmHWM after clear_refs"
        baseline_kib = _proc_status_kib("VmRSS")
        with torch.no_grad():
            output = runner()
        peak_kib = _proc_status_kib("VmHWM")
    else:
        # peak RSS of the whole process so far; the call's own peak if it is
        # the largest
        method = "ru_maxrss"
        baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with torch.no_grad():
            output = runner()
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del output
    return {
        "peak_bytes": max(0, (peak_kib or 0) - (baseline_kib or 0)) * 1024,
        "method": method,
    }


def cpu_peak_bytes(
    impl: str, config: BenchConfig, threads: int, timeout: float = 600.0
) -> tuple[int, str]:
    """Run :func:`cpu_peak_probe` in a fresh Python process.

    Returns (peak bytes, method).
    """
    spec = {"impl": impl, "config": asdict(config), "threads": threads}
    env = dict(
        os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)
    )
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "mha.bench",
            "--memory-probe",
            json.dumps(spec),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(
            f"memory probe for {impl} at T={config.seq_len} failed:\n"
            f"{completed.stderr[-2000:]}"
        )
    answer = json.loads(completed.stdout.strip().splitlines()[-1])
    return int(answer["peak_bytes"]), str(answer["method"])
