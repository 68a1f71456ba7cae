"""The benchmark harness: ``python -m mha.bench``.

Times one multi-head self-attention layer (B sequences of T tokens, width D = H * d_k) in
several implementations, on the CPU or a CUDA GPU, over a list of sequence lengths T:

========================  =====  ==============================================================
name                      scope  what is timed
========================  =====  ==============================================================
``numpy_loop``            layer  :func:`mha.reference.multi_head_attention_loop`, head by head (CPU)
``numpy_fused``           layer  :func:`mha.reference.multi_head_attention`, all heads at once (CPU)
``torch_textbook``        layer  :func:`textbook_attention`: writes out the (B, H, T, T) scores
``mha_module``            layer  :class:`mha.MultiHeadAttention`, ``need_weights=False``
``torch_mha``             layer  ``torch.nn.MultiheadAttention``, ``need_weights=False`` (its fast path)
``sdpa_bare``             layer  :func:`sdpa_attention`: four ``F.linear`` around ``F.scaled_dot_product_attention``
``projections``           proj   the four projections of ``sdpa_bare`` without the attention core
``sdpa_<backend>``        core   ``F.scaled_dot_product_attention`` alone, forced to one backend
                                 (math, efficient, flash, cudnn) with ``sdpa_kernel``
========================  =====  ==============================================================

Every layer implementation computes the same function with the same weights (those of one
``torch.nn.MultiheadAttention``, seeded), in eval mode and without autograd.

Timing: each implementation runs ``--warmup`` calls first (the first call also tells whether it
can run at all: a backend that does not exist for this device, dtype or shape is reported as
skipped, with the reason). Then the implementations are timed in interleaved rounds (one call
of each per round, in a new random order each round), so that a change in the machine's load touches all of
them alike; the NumPy ones are timed in rounds of their own, apart from the torch ones, so that
neither library's idle worker threads slow the other's calls. Each call is timed with
``time.perf_counter`` on the CPU and with CUDA events on a GPU. The figure reported is the
median over at least ``--repeats`` calls (more for fast calls, until the rounds of a sequence
length have taken ``--min-time`` seconds). Ratios between implementations are medians of the
ratios within each round (see :func:`ratios`).

FLOPs count the matrix products only (one multiply-add = 2 FLOPs): the attention core
``4 B H T^2 d_k`` (halved when causal) and the four projections ``8 B T D^2``. A row's
``flop_per_s`` divides the FLOPs of what the row times (its *scope*) by its median time;
``layer_flop_per_s``, ``core_flop_per_s`` and ``projection_flop_per_s`` give the rates of the
whole layer (core + projections), of the core alone and of the projections alone, where the row
defines them (a layer row's core rate is the core's FLOPs over the whole layer's time).

Peak memory (``--memory``): on a GPU, ``torch.cuda.max_memory_allocated`` minus the memory
allocated just before the call. On the CPU, each (implementation, T) runs once in a fresh
Python process, which resets the kernel's peak-RSS counter (``/proc/self/clear_refs``) just
before the call and reads ``VmHWM`` after it: the peak extra resident memory of that call.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import gc
import json
import math
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import reference

__all__ = [
    "BACKENDS",
    "IMPLEMENTATIONS",
    "BenchConfig",
    "Unsupported",
    "attention_core_flop_count",
    "projection_flop_count",
    "layer_flop_count",
    "textbook_attention",
    "sdpa_attention",
    "make_layer",
    "make_input",
    "build_runner",
    "environment",
    "device_name",
    "run_benchmark",
    "ratios",
    "lookup",
    "format_table",
    "write_results",
    "load_results",
    "series",
    "default_impls",
    "main",
]

#: ``sdpa_<name>`` implementations and the backend each one forces.
BACKENDS: dict[str, SDPBackend] = {
    "math": SDPBackend.MATH,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}

#: Every implementation, in table order, with the part of the layer it times.
IMPLEMENTATIONS: dict[str, str] = {
    "numpy_loop": "layer",
    "numpy_fused": "layer",
    "torch_textbook": "layer",
    "mha_module": "layer",
    "torch_mha": "layer",
    "sdpa_bare": "layer",
    "projections": "projections",
    **{f"sdpa_{name}": "core" for name in BACKENDS},
}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}

#: Ratios of median times printed side by side: (numerator, denominator).
RATIO_PAIRS: tuple[tuple[str, str], ...] = (
    ("mha_module", "sdpa_bare"),
    ("torch_mha", "mha_module"),
    ("torch_textbook", "mha_module"),
)

DEFAULT_SEQ_LENS = (128, 256, 512, 1024, 2048)
MEMORY_SEQ_LENS = (256, 512, 1024, 2048, 4096)
MIB = 2**20


class Unsupported(Exception):
    """An implementation cannot run for this device, dtype or configuration; the message says why."""


# ---------------------------------------------------------------------------------------------
# FLOP counts


def attention_core_flop_count(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool = False) -> int:
    """FLOPs of ``Q K^T`` and ``weights V`` over all heads: ``4 B H T^2 d_k`` (halved when causal).

    Each head multiplies (T, d_k) by (d_k, T) and (T, T) by (T, d_k): ``2 T^2 d_k`` FLOPs each.
    A causal mask leaves about half of the (T, T) products to compute (the convention of the
    FlashAttention papers).
    """
    flops = 4 * batch * heads * seq_len * seq_len * head_dim
    return flops // 2 if causal else flops


def projection_flop_count(batch: int, seq_len: int, embed_dim: int) -> int:
    """FLOPs of the query, key, value and output projections: ``4 x 2 B T D^2 = 8 B T D^2``."""
    return 8 * batch * seq_len * embed_dim * embed_dim


def layer_flop_count(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool = False) -> int:
    """FLOPs of the whole layer: attention core plus the four projections (D = H d_k)."""
    return attention_core_flop_count(batch, heads, seq_len, head_dim, causal) + projection_flop_count(
        batch, seq_len, heads * head_dim
    )


# ---------------------------------------------------------------------------------------------
# The implementations that are not already in the package


def textbook_attention(
    x: Tensor,
    in_proj_weight: Tensor,
    in_proj_bias: Tensor | None,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    num_heads: int,
    blocked: Tensor | None = None,
) -> Tensor:
    """Multi-head self-attention written out, the (B, H, T, T) scores materialised.

    Args:
        x: inputs, (B, T, D).
        in_proj_weight: (3D, D), the rows of W_Q, W_K, W_V stacked (``torch.nn.Linear`` layout);
            in_proj_bias: (3D,) or None.
        out_proj_weight: (D, D); out_proj_bias: (D,) or None.
        num_heads: H, dividing D.
        blocked: optional boolean (T, T), True where a query may NOT attend (torch's convention).

    Returns:
        (B, T, D).
    """
    B, T, D = x.shape
    d_k = D // num_heads
    q, k, v = F.linear(x, in_proj_weight, in_proj_bias).chunk(3, dim=-1)  # (B, T, D) each
    q = q.view(B, T, num_heads, d_k).transpose(1, 2)  # (B, H, T, d_k)
    k = k.view(B, T, num_heads, d_k).transpose(1, 2)  # (B, H, T, d_k)
    v = v.view(B, T, num_heads, d_k).transpose(1, 2)  # (B, H, T, d_k)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d_k))  # (B, H, T, T)
    if blocked is not None:
        scores = scores.masked_fill(blocked, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # (B, H, T, T)
    heads = weights @ v  # (B, H, T, d_k)
    merged = heads.transpose(1, 2).reshape(B, T, D)  # (B, T, H, d_k) -> (B, T, D)
    return F.linear(merged, out_proj_weight, out_proj_bias)  # (B, T, D)


def sdpa_attention(
    x: Tensor,
    in_proj_weight: Tensor,
    in_proj_bias: Tensor | None,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    num_heads: int,
    is_causal: bool = False,
) -> Tensor:
    """The same layer with the core handed to ``F.scaled_dot_product_attention``: nothing else.

    The floor of the module's approach: the projections, views and the one fused attention call.
    Shapes as in :func:`textbook_attention`.
    """
    B, T, D = x.shape
    d_k = D // num_heads
    q, k, v = F.linear(x, in_proj_weight, in_proj_bias).chunk(3, dim=-1)  # (B, T, D) each
    q = q.view(B, T, num_heads, d_k).transpose(1, 2)  # (B, H, T, d_k)
    k = k.view(B, T, num_heads, d_k).transpose(1, 2)  # (B, H, T, d_k)
    v = v.view(B, T, num_heads, d_k).transpose(1, 2)  # (B, H, T, d_k)
    heads = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)  # (B, H, T, d_k)
    merged = heads.transpose(1, 2).reshape(B, T, D)  # (B, T, D)
    return F.linear(merged, out_proj_weight, out_proj_bias)  # (B, T, D)


# ---------------------------------------------------------------------------------------------
# Configurations, layers, inputs, runners


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark configuration: B sequences of T tokens, H heads of width d_k."""

    batch: int
    seq_len: int
    heads: int
    head_dim: int
    dtype: str = "float32"
    device: str = "cpu"
    causal: bool = False

    @property
    def embed_dim(self) -> int:
        """D = H d_k."""
        return self.heads * self.head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def make_layer(config: BenchConfig, seed: int = 0) -> nn.MultiheadAttention:
    """The weights every implementation uses: a seeded ``torch.nn.MultiheadAttention``, eval mode.

    torch initialises the projection weights Xavier-uniform and the biases to zero.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = nn.MultiheadAttention(config.embed_dim, config.heads, batch_first=True)
    return layer.to(device=config.device, dtype=config.torch_dtype).eval().requires_grad_(False)


def make_input(config: BenchConfig, seed: int = 1) -> Tensor:
    """Standard-normal inputs, (B, T, D), drawn in float32 and then cast."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(config.batch, config.seq_len, config.embed_dim, generator=generator)  # (B, T, D)
    return x.to(device=config.device, dtype=config.torch_dtype)


def _blocked_causal(seq_len: int, device: torch.device) -> Tensor:
    """(T, T) boolean, True above the diagonal: the keys a query may not see."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(diagonal=1)


def _layer_weights(layer: nn.MultiheadAttention) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    return layer.in_proj_weight, layer.in_proj_bias, layer.out_proj.weight, layer.out_proj.bias


def _numpy_weights(layer: nn.MultiheadAttention) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """W_Q, W_K, W_V, W_O in the reference's row-vector layout, (D, D) each (transposes of torch's)."""
    for name in ("in_proj_bias", "out_proj.bias"):
        bias = layer.get_parameter(name)
        if bias is not None and bool(bias.any()):
            raise Unsupported(f"the NumPy reference has no biases, and the layer's {name} is not zero")
    D = layer.embed_dim
    w_in = layer.in_proj_weight.detach().cpu().numpy()  # (3D, D)
    w_q, w_k, w_v = (np.ascontiguousarray(w_in[i * D : (i + 1) * D].T) for i in range(3))  # (D, D) each
    w_o = np.ascontiguousarray(layer.out_proj.weight.detach().cpu().numpy().T)  # (D, D)
    return w_q, w_k, w_v, w_o


def _check_supported(impl: str, device: torch.device, dtype: torch.dtype) -> None:
    if impl.startswith("numpy_"):
        if device.type != "cpu":
            raise Unsupported("NumPy runs on the CPU only")
        if dtype not in (torch.float32, torch.float64):
            raise Unsupported(f"NumPy has no {str(dtype).removeprefix('torch.')} matrix products")


def build_runner(
    impl: str, layer: nn.MultiheadAttention, x: Tensor, causal: bool = False
) -> Callable[[], Tensor | np.ndarray]:
    """A function of no arguments that runs ``impl`` once on ``x`` (B, T, D) and returns its output.

    Layer and projection scopes return (B, T, D); ``sdpa_<backend>`` returns the attention core's
    output (B, H, T, d_k), computed from the layer's projections of ``x`` (made here, not timed).
    Everything the call needs (weights, masks, head views) is prepared here, outside the timing.

    Raises:
        Unsupported: ``impl`` cannot run on this device or dtype (the message says why).
        ValueError: unknown ``impl``.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {', '.join(IMPLEMENTATIONS)}, got {impl!r}")
    _check_supported(impl, x.device, x.dtype)
    B, T, D = x.shape
    H = layer.num_heads
    d_k = D // H
    w_in, b_in, w_out, b_out = _layer_weights(layer)
    blocked = _blocked_causal(T, x.device) if causal else None

    if impl == "numpy_loop":
        w_q, w_k, w_v, w_o = _numpy_weights(layer)
        columns = [slice(i * d_k, (i + 1) * d_k) for i in range(H)]
        w_q_heads = [np.ascontiguousarray(w_q[:, c]) for c in columns]  # H x (D, d_k)
        w_k_heads = [np.ascontiguousarray(w_k[:, c]) for c in columns]
        w_v_heads = [np.ascontiguousarray(w_v[:, c]) for c in columns]
        x_np = x.cpu().numpy()  # (B, T, D)
        mask = reference.causal_mask(T) if causal else None  # True = may attend
        return lambda: reference.multi_head_attention_loop(x_np, w_q_heads, w_k_heads, w_v_heads, w_o, mask)[0]
    if impl == "numpy_fused":
        w_q, w_k, w_v, w_o = _numpy_weights(layer)
        x_np = x.cpu().numpy()  # (B, T, D)
        mask = reference.causal_mask(T) if causal else None
        return lambda: reference.multi_head_attention(x_np, w_q, w_k, w_v, w_o, H, mask)[0]
    if impl == "torch_textbook":
        return lambda: textbook_attention(x, w_in, b_in, w_out, b_out, H, blocked)
    if impl == "mha_module":
        try:
            from .module import MultiHeadAttention
        except ImportError as error:  # pragma: no cover - the module ships with the package
            raise Unsupported(f"mha.module is not available ({error})") from None
        module = MultiHeadAttention(D, H, device=x.device, dtype=x.dtype)
        module.load_state_dict(layer.state_dict())
        module.eval().requires_grad_(False)
        # The module builds the causal mask itself and hands SDPA its is_causal flag.
        return lambda: module(x, x, x, need_weights=False, is_causal=causal)[0]
    if impl == "torch_mha":
        # Same tensor as query, key and value: the condition for torch's self-attention fast path.
        # torch takes is_causal only as a hint that attn_mask is causal, so the mask is given too.
        return lambda: layer(x, x, x, need_weights=False, attn_mask=blocked, is_causal=causal)[0]
    if impl == "sdpa_bare":
        return lambda: sdpa_attention(x, w_in, b_in, w_out, b_out, H, is_causal=causal)
    if impl == "projections":

        def projections() -> Tensor:
            q, k, v = F.linear(x, w_in, b_in).chunk(3, dim=-1)  # (B, T, D) each
            return F.linear(v.contiguous(), w_out, b_out)  # (B, T, D); the copy stands for the head merge

        return projections
    # sdpa_<backend>: the core alone, on the layer's own projections of x
    backend = BACKENDS[impl.removeprefix("sdpa_")]
    with torch.no_grad():
        q, k, v = F.linear(x, w_in, b_in).chunk(3, dim=-1)  # (B, T, D) each
    q, k, v = (t.view(B, T, H, d_k).transpose(1, 2) for t in (q, k, v))  # (B, H, T, d_k) each

    def core() -> Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, H, T, d_k)

    return core


# ---------------------------------------------------------------------------------------------
# Timing and memory


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _probe(runner: Callable[[], object], device: torch.device) -> float:
    """Run once, untimed but for the seconds returned. A kernel that cannot run raises :class:`Unsupported`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        try:
            with torch.no_grad():
                runner()
            _synchronize(device)
        except (RuntimeError, NotImplementedError) as error:
            reasons = [str(w.message).splitlines()[0] for w in caught]
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise Unsupported("; ".join([first_line, *reasons])) from None
        return time.perf_counter() - start


def _time_call(runner: Callable[[], object], device: torch.device) -> float:
    """Seconds for one call: CUDA events around it on a GPU, ``time.perf_counter`` on the CPU."""
    with torch.no_grad():
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        begin = time.perf_counter()
        runner()
        return time.perf_counter() - begin


def _time_interleaved(
    runners: dict[str, Callable[[], object]],
    device: torch.device,
    repeats: int,
    min_time: float,
    max_repeats: int,
) -> dict[str, list[float]]:
    """Time every runner in interleaved rounds, each round in a fresh (seeded) random order.

    The order changes so that no implementation always follows the same one: a call that frees a
    large tensor makes the next call's allocations fault in fresh pages, which would otherwise
    always be charged to the same neighbour. Rounds continue until every runner has ``repeats`` calls and the rounds have taken ``min_time``
    seconds in all (fast configurations get more calls), or until ``max_repeats`` rounds.
    """
    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    if not names:
        return times
    order = random.Random(0)
    start = time.perf_counter()
    rounds = 0
    while rounds < repeats or (rounds < max_repeats and time.perf_counter() - start < min_time):
        for name in order.sample(names, len(names)):
            times[name].append(_time_call(runners[name], device))
        rounds += 1
    return times


def _cuda_peak_bytes(runner: Callable[[], object], device: torch.device) -> int:
    """Peak memory allocated during one call, above what was allocated just before it."""
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
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS; False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return _proc_status_kib("VmHWM") is not None
    except OSError:
        return False


def _cpu_peak_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: peak extra resident memory of one call of one implementation."""
    torch.set_num_threads(int(spec["threads"]))
    config = BenchConfig(**spec["config"])
    causal = config.causal
    # A first call at a tiny size loads the code paths and starts the thread pool, so that the
    # measured call pays only for its own tensors.
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
    else:  # peak RSS of the whole process so far; the call's own peak if it is the largest
        method = "ru_maxrss"
        baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with torch.no_grad():
            output = runner()
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del output
    return {"peak_bytes": max(0, (peak_kib or 0) - (baseline_kib or 0)) * 1024, "method": method}


def _cpu_peak_bytes(impl: str, config: BenchConfig, threads: int, timeout: float = 600.0) -> tuple[int, str]:
    """Run :func:`_cpu_peak_probe` in a fresh Python process and return (peak bytes, method)."""
    spec = {"impl": impl, "config": asdict(config), "threads": threads}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    completed = subprocess.run(
        [sys.executable, "-m", "mha.bench", "--memory-probe", json.dumps(spec)],
        capture_output=True, text=True, env=env, timeout=timeout, check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"memory probe for {impl} at T={config.seq_len} failed:\n{completed.stderr[-2000:]}")
    answer = json.loads(completed.stdout.strip().splitlines()[-1])
    return int(answer["peak_bytes"]), str(answer["method"])


# ---------------------------------------------------------------------------------------------
# The environment


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _git_commit() -> tuple[str | None, bool | None]:
    """(commit, True if tracked files differ from it) of the repository holding this file, if any."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        return commit or None, bool(status)
    except (OSError, subprocess.SubprocessError):
        return None, None


def device_name(device: torch.device | str) -> str:
    """The GPU's name (``torch.cuda.get_device_name``) or the CPU's model (from ``/proc/cpuinfo``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device.index if device.index is not None else torch.cuda.current_device())
    return _cpu_model()


def environment(device: torch.device | str, dtype: str) -> dict[str, Any]:
    """What the figures depend on: device and its name, versions, dtype, threads, date, commit."""
    device = torch.device(device)
    commit, dirty = _git_commit()
    capability = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        capability = ".".join(map(str, torch.cuda.get_device_capability(index)))
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count()
    return {
        "device": device.type,
        "device_name": device_name(device),
        "cuda_capability": capability,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_available": affinity,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "dtype": dtype,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": dirty,
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


# ---------------------------------------------------------------------------------------------
# The benchmark


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch.cuda.is_available() is False")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    return torch.device(device)


def default_impls(device: torch.device | str) -> list[str]:
    """Every implementation, with the SDPA backends this build of torch could offer on ``device``.

    On the CPU, torch has a math and a flash kernel only; the others are left out here (asked
    for by name, they are probed and reported as skipped).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return [name for name in IMPLEMENTATIONS if name not in ("sdpa_efficient", "sdpa_cudnn")]
    return [name for name in IMPLEMENTATIONS if not name.startswith("numpy_")]


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
    """Run the benchmark and return a JSON-ready dict: ``environment``, ``config``, ``results``, ``ratios``.

    ``results`` holds one row per (implementation, T) with ``status`` ``"ok"`` or ``"skipped"``
    (and the ``reason``). See the module docstring for how times and memory are measured.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    for name, value in (("batch", batch), ("heads", heads), ("head_dim", head_dim), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not seq_lens or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in seq_lens):
        raise ValueError(f"seq_lens must be a non-empty list of positive ints, got {list(seq_lens)!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be an int >= 1 (the first call also checks that an implementation runs), "
                         f"got {warmup!r}")
    torch_device = _resolve_device(device)
    impls = list(default_impls(torch_device) if impls is None else impls)
    unknown = [name for name in impls if name not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(f"impls must be among {', '.join(IMPLEMENTATIONS)}, got unknown {unknown}")
    if threads is not None:
        torch.set_num_threads(threads)
    env = environment(torch_device, dtype)
    config_record = {
        "batch": batch, "heads": heads, "head_dim": head_dim, "embed_dim": heads * head_dim,
        "seq_lens": list(seq_lens), "impls": impls, "causal": causal, "repeats": repeats,
        "warmup": warmup, "min_time_s": min_time, "max_repeats": max_repeats, "memory": memory,
        "numpy_max_len": numpy_max_len,
        "timer": "CUDA events" if torch_device.type == "cuda" else "time.perf_counter",
        "memory_method": None if not memory else (
            "torch.cuda.max_memory_allocated" if torch_device.type == "cuda" else "peak RSS in a fresh process"
        ),
    }
    _log(f"mha.bench: {env['device_name']} ({torch_device.type}), torch {env['torch_version']}, "
         f"{dtype}, {env['threads']} threads, B={batch} H={heads} d_k={head_dim}, T in {list(seq_lens)}", quiet)

    results: list[dict[str, Any]] = []
    for index, seq_len in enumerate(seq_lens, start=1):
        config = BenchConfig(batch, seq_len, heads, head_dim, dtype, torch_device.type, causal)
        layer, x = make_layer(config), make_input(config)
        core = attention_core_flop_count(batch, heads, seq_len, head_dim, causal)
        proj = projection_flop_count(batch, seq_len, heads * head_dim)
        flops_of_scope = {"layer": core + proj, "core": core, "projections": proj}
        rows: dict[str, dict[str, Any]] = {}
        runners: dict[str, Callable[[], object]] = {}
        for impl in impls:
            row = {
                "impl": impl, "scope": IMPLEMENTATIONS[impl], "seq_len": seq_len, "status": "ok", "reason": None,
                "core_flop": core, "projection_flop": proj, "layer_flop": core + proj,
                "flop": flops_of_scope[IMPLEMENTATIONS[impl]],
            }
            rows[impl] = row
            try:
                if impl.startswith("numpy_") and seq_len > numpy_max_len:
                    raise Unsupported(f"NumPy implementations run up to T = {numpy_max_len} (--numpy-max-len)")
                runner = build_runner(impl, layer, x, causal)
                for _ in range(warmup):
                    _probe(runner, torch_device)
                runners[impl] = runner
            except Unsupported as why:
                row.update(status="skipped", reason=str(why))
        _log(f"[{index}/{len(seq_lens)}] T={seq_len}: timing {len(runners)} implementations", quiet)
        # NumPy (OpenBLAS threads) and torch (OpenMP threads) are timed apart: interleaved, each
        # library's idle threads would still be spinning when the other's call starts.
        times: dict[str, list[float]] = {}
        for family in (lambda name: name.startswith("numpy_"), lambda name: not name.startswith("numpy_")):
            group = {name: runner for name, runner in runners.items() if family(name)}
            times.update(_time_interleaved(group, torch_device, repeats, min_time, max_repeats))
        for impl in impls:
            row = rows[impl]
            if row["status"] == "ok":
                samples = sorted(times[impl])
                median = statistics.median(samples)
                quartiles = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [median] * 3
                row.update(
                    median_s=median, min_s=samples[0], q1_s=quartiles[0], q3_s=quartiles[2],
                    repeats=len(samples), **_rates(row, median),
                    times_s=times[impl],  # in round order, for the paired ratios
                )
                if memory:
                    if torch_device.type == "cuda":
                        row.update(peak_memory_bytes=_cuda_peak_bytes(runners[impl], torch_device),
                                   memory_method="torch.cuda.max_memory_allocated")
                    else:
                        peak, method = _cpu_peak_bytes(impl, config, torch.get_num_threads())
                        row.update(peak_memory_bytes=peak, memory_method=method)
                memory_text = f", peak +{row['peak_memory_bytes'] / MIB:.1f} MiB" if memory else ""
                _log(f"    {impl:<16} {median * 1e3:10.3f} ms  {row['flop_per_s'] / 1e9:8.1f} GFLOP/s "
                     f"({row['scope']}){memory_text}", quiet)
            else:
                _log(f"    {impl:<16} skipped: {row['reason']}", quiet)
            results.append(row)
        del runners, layer, x
        gc.collect()
    env["load_average_1min_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    report = {"environment": env, "config": config_record, "results": results}
    report["ratios"] = ratios(report)
    return report


def _rates(row: dict[str, Any], seconds: float) -> dict[str, float | None]:
    """FLOP/s of a row: of its scope, and of the layer, the core and the projections where defined.

    A layer row's ``core_flop_per_s`` divides the core's FLOPs by the whole layer's time (a lower
    bound on the rate of its core); a core row has no layer rate, a projections row only its own.
    """
    scope = row["scope"]
    return {
        "flop_per_s": row["flop"] / seconds,
        "layer_flop_per_s": row["layer_flop"] / seconds if scope == "layer" else None,
        "core_flop_per_s": row["core_flop"] / seconds if scope in ("layer", "core") else None,
        "projection_flop_per_s": row["projection_flop"] / seconds if scope == "projections" else None,
    }


def lookup(report: dict[str, Any], impl: str, seq_len: int, field: str = "median_s") -> float | None:
    """One figure of a report: ``field`` of the measured row (impl, T), or None if there is none."""
    for row in report["results"]:
        if row["impl"] == impl and row["seq_len"] == seq_len and row["status"] == "ok":
            value = row.get(field)
            return None if value is None else float(value)
    return None


def _row(report: dict[str, Any], impl: str, seq_len: int) -> dict[str, Any] | None:
    for row in report["results"]:
        if row["impl"] == impl and row["seq_len"] == seq_len and row["status"] == "ok":
            return row
    return None


def _time_ratio(report: dict[str, Any], numerator: str, denominator: str, seq_len: int) -> float | None:
    """Median of the per-round ratios of two implementations' times (see :func:`ratios`)."""
    a, b = _row(report, numerator, seq_len), _row(report, denominator, seq_len)
    if a is None or b is None:
        return None
    times_a, times_b = a.get("times_s"), b.get("times_s")
    if times_a and times_b and len(times_a) == len(times_b):
        return statistics.median(x / y for x, y in zip(times_a, times_b))
    return a["median_s"] / b["median_s"]


def ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per T, the time ratios of :data:`RATIO_PAIRS` (and the ratios of peak memory, if measured).

    A time ratio is the median, over the timing rounds, of the ratio of the two calls made in the
    same round (``times_s`` of both rows, in round order): calls made seconds apart share the
    machine's state, so a shared machine's changing load cancels out better than in a ratio of
    medians. Rows without paired ``times_s`` fall back to the ratio of their medians.
    ``"mha_module/sdpa_bare": 1.05`` means the module took 5 % longer than the bare floor;
    ``"torch_mha/mha_module": 2.0`` means torch's layer took twice as long as the module.
    """
    rows = []
    for seq_len in report["config"]["seq_lens"]:
        row: dict[str, Any] = {"seq_len": seq_len}
        for numerator, denominator in RATIO_PAIRS:
            row[f"{numerator}/{denominator}"] = _time_ratio(report, numerator, denominator, seq_len)
        if report["config"].get("memory"):
            for numerator, denominator in RATIO_PAIRS:
                a = lookup(report, numerator, seq_len, "peak_memory_bytes")
                b = lookup(report, denominator, seq_len, "peak_memory_bytes")
                row[f"memory {numerator}/{denominator}"] = None if a is None or b is None or b == 0 else a / b
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Output


def format_table(report: dict[str, Any]) -> str:
    """The results as a text table (one block per T) followed by the ratio table."""
    env, config = report["environment"], report["config"]
    on_gpu = env["device"] == "cuda"
    unit, scale = ("TFLOP/s", 1e12) if on_gpu else ("GFLOP/s", 1e9)
    memory = bool(config.get("memory"))
    lines = [
        f"{env['device_name']} ({env['device']}), torch {env['torch_version']}, numpy {env['numpy_version']}, "
        f"{env['dtype']}, {env['threads']} threads, {env['date_utc']}",
        f"B={config['batch']} H={config['heads']} d_k={config['head_dim']} D={config['embed_dim']}"
        f"{' causal' if config['causal'] else ''}; median of >= {config['repeats']} calls "
        f"({config['timer']}); a layer row's core rate = core FLOPs / layer time",
        "",
    ]
    header = (f"{'T':>6}  {'impl':<16} {'scope':<11} {'median ms':>11} "
              f"{'layer ' + unit:>15} {'core ' + unit:>14} {'proj ' + unit:>14}")
    if memory:
        header += f" {'peak MiB':>10}"
    lines += [header, "-" * len(header)]
    for row in report["results"]:
        if row["status"] != "ok":
            continue
        rates = [row.get(f"{part}_flop_per_s") for part in ("layer", "core", "projection")]
        cells = [f"{rate / scale:>{w}.2f}" if rate is not None else f"{'':>{w}}" for rate, w in zip(rates, (15, 14, 14))]
        line = f"{row['seq_len']:>6}  {row['impl']:<16} {row['scope']:<11} {row['median_s'] * 1e3:>11.3f} " + " ".join(cells)
        if memory:
            peak = row.get("peak_memory_bytes")
            line += f" {peak / MIB:>10.1f}" if peak is not None else f" {'':>10}"
        lines.append(line)
    skipped_rows: dict[tuple[str, str], list[int]] = {}
    for row in report["results"]:
        if row["status"] != "ok":
            skipped_rows.setdefault((row["impl"], row["reason"]), []).append(row["seq_len"])
    if skipped_rows:
        lines += ["", "skipped:"]
        for (impl, reason), lens in skipped_rows.items():
            lines.append(f"  {impl} at T = {', '.join(map(str, lens))}: {reason}")
    ratio_rows = report.get("ratios") or []
    if ratio_rows:
        keys = [key for key in ratio_rows[0] if key != "seq_len"]
        keys = [key for key in keys if any(r.get(key) is not None for r in ratio_rows)]
        if keys:
            lines += ["", "time ratios (median of per-round ratios; peak memory where marked), from this run:"]
            widths = [max(len(key), 8) for key in keys]
            lines.append(f"{'T':>6}  " + "  ".join(f"{key:>{w}}" for key, w in zip(keys, widths)))
            for r in ratio_rows:
                cells = [f"{r[key]:>{w}.2f}" if r.get(key) is not None else f"{'-':>{w}}" for key, w in zip(keys, widths)]
                lines.append(f"{r['seq_len']:>6}  " + "  ".join(cells))
    return "\n".join(lines)


CSV_FIELDS = (
    "impl", "scope", "seq_len", "status", "reason", "median_s", "min_s", "q1_s", "q3_s", "repeats",
    "flop", "flop_per_s", "layer_flop_per_s", "core_flop_per_s", "projection_flop_per_s",
    "core_flop", "projection_flop", "layer_flop", "peak_memory_bytes", "memory_method",
)


def write_results(report: dict[str, Any], path: str | Path) -> Path:
    """Write ``report`` as JSON (``.json``) or CSV (``.csv``, the environment repeated on each row)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".csv"):
        raise ValueError(f"output must end in .json or .csv, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".json":
        path.write_text(json.dumps(report, indent=1) + "\n")
        return path
    env_fields = [f"env_{key}" for key in report["environment"]]
    config_fields = [f"config_{key}" for key in ("batch", "heads", "head_dim", "embed_dim", "causal")]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*CSV_FIELDS, *config_fields, *env_fields])
        writer.writeheader()
        for row in report["results"]:
            record = {field: row.get(field) for field in CSV_FIELDS}
            record.update({f"env_{k}": v for k, v in report["environment"].items()})
            record.update({f"config_{k}": report["config"][k] for k in ("batch", "heads", "head_dim", "embed_dim", "causal")})
            writer.writerow(record)
    return path


def load_results(path: str | Path) -> dict[str, Any]:
    """Read a report written by :func:`write_results` as JSON."""
    return json.loads(Path(path).read_text())


def series(report: dict[str, Any], impl: str, field: str = "median_s") -> tuple[np.ndarray, np.ndarray]:
    """``(seq_lens, values)`` of one implementation's measured rows, for plotting: two 1-D arrays."""
    pairs = [(row["seq_len"], row[field]) for row in report["results"]
             if row["impl"] == impl and row["status"] == "ok" and row.get(field) is not None]
    seq_lens = np.array([t for t, _ in pairs], dtype=np.int64)
    values = np.array([v for _, v in pairs], dtype=np.float64)
    return seq_lens, values


# ---------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mha.bench",
        description=(
            "Time one multi-head self-attention layer (B x T x D, D = heads x head-dim) in several "
            "implementations, print a table and the ratios mha_module/sdpa_bare and torch_mha/mha_module, "
            "and optionally write every figure with the environment to JSON or CSV."
        ),
        epilog=(
            "Implementations: " + ", ".join(IMPLEMENTATIONS) + ". Scope 'layer' times the whole layer, "
            "'core' only F.scaled_dot_product_attention on projected (B, H, T, d_k) inputs, 'projections' "
            "the four linear maps. Examples: python -m mha.bench --device cpu;  "
            "python -m mha.bench --memory --output benchmarks/cpu_memory.json;  "
            "python -m mha.bench --device cuda --dtype bfloat16 --output gpu.json"
        ),
    )
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                        help="where to run; auto = cuda if available, else cpu (default: cpu)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="(default: float32)")
    parser.add_argument("--batch", type=int, default=None,
                        help="B, sequences per call (default: 8; 1 with --memory)")
    parser.add_argument("--heads", type=int, default=8, help="H (default: 8)")
    parser.add_argument("--head-dim", type=int, default=64, help="d_k; D = heads x head-dim (default: 64)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None, metavar="T",
                        help=f"sequence lengths (default: {' '.join(map(str, DEFAULT_SEQ_LENS))}; "
                             f"{' '.join(map(str, MEMORY_SEQ_LENS))} with --memory)")
    parser.add_argument("--impl", nargs="+", choices=tuple(IMPLEMENTATIONS), default=None, metavar="NAME",
                        help="implementations to run (default: all that the device offers; on the CPU "
                             "every one but sdpa_efficient and sdpa_cudnn)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed calls per implementation and T, at least (default: 5)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed calls before timing, at least 1: the first one also checks that the "
                             "implementation can run here (default: 1)")
    parser.add_argument("--min-time", type=float, default=1.0,
                        help="more rounds of calls for fast configurations, until the timed rounds of a T "
                             "take this many seconds (default: 1.0)")
    parser.add_argument("--max-repeats", type=int, default=50, help="cap on timed calls (default: 50)")
    parser.add_argument("--causal", action="store_true", help="causal self-attention (core FLOPs halved)")
    parser.add_argument("--memory", action="store_true",
                        help="also measure peak extra memory per (impl, T): CUDA allocator peak on a GPU, "
                             "peak RSS in a fresh process on the CPU; defaults become B=1 and T up to 4096")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's, from OMP_NUM_THREADS); NumPy's BLAS "
                             "threads follow OMP_NUM_THREADS / OPENBLAS_NUM_THREADS set before start")
    parser.add_argument("--numpy-max-len", type=int, default=512,
                        help="skip the NumPy implementations above this T; at T = 2048, B = 8 one call "
                             "takes tens of seconds on 2 cores (default: 512)")
    parser.add_argument("--output", nargs="+", default=(), metavar="FILE",
                        help="write the results to FILE(s): .json or .csv by extension")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; see ``python -m mha.bench --help``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.memory_probe:
        print(json.dumps(_cpu_peak_probe(json.loads(args.memory_probe))))
        return 0
    for output in args.output:
        if Path(output).suffix.lower() not in (".json", ".csv"):
            parser.error(f"--output must end in .json or .csv, got {output!r}")
    batch = args.batch if args.batch is not None else (1 if args.memory else 8)
    seq_lens = args.seq_lens if args.seq_lens is not None else list(MEMORY_SEQ_LENS if args.memory else DEFAULT_SEQ_LENS)
    try:
        report = run_benchmark(
            device=args.device, dtype=args.dtype, batch=batch, heads=args.heads, head_dim=args.head_dim,
            seq_lens=seq_lens, impls=args.impl, repeats=args.repeats, warmup=args.warmup,
            min_time=args.min_time, max_repeats=args.max_repeats, causal=args.causal, memory=args.memory,
            threads=args.threads, numpy_max_len=args.numpy_max_len, quiet=args.quiet,
        )
    except ValueError as error:
        parser.error(str(error))
    report["environment"]["command"] = "python -m mha.bench " + " ".join(
        sys.argv[1:] if argv is None else list(argv)
    )
    print(format_table(report))
    for output in args.output:
        written = write_results(report, output)
        _log(f"wrote {written}", args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
