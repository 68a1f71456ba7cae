"""``python -m mha.bench layer``: one self-attention layer, against T.

B sequences of T tokens, width D = H d_k: every entry of
:data:`~mha.bench.registry.IMPLEMENTATIONS` with the same weights, timed at
each T by :func:`mha.bench.timing.measure`. FLOPs count the matrix products
(:mod:`mha.counting`): the core ``4 B H T^2 d_k`` (halved when causal), the
projections ``8 B T D^2``. ``flop_per_s`` divides the FLOPs of what a row
times (its scope) by its median time; ``layer_``, ``core_`` and
``projection_flop_per_s`` the FLOPs of each part its time covers. With
``memory``, each row gets the peak extra memory of one call
(:mod:`mha.bench.memory`).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from .. import counting
from ..environment import describe, load_average
from . import implementations  # noqa: F401  (fills the registry)
from .memory import cuda_peak_bytes, in_fresh_process, peak_rss_of_call
from .registry import IMPLEMENTATIONS, Runner, Unsupported, build_runner
from .report import (
    MIB,
    find_row,
    number,
    paired_ratio,
    ratio_table,
    text_table,
)
from .timing import (
    DTYPES,
    Case,
    Timing,
    check_arguments,
    log,
    measure,
    prepare,
)

__all__ = ["DEFAULT_SEQ_LENS", "MEMORY_SEQ_LENS", "RATIO_PAIRS"]
__all__ += ["BenchConfig", "make_layer", "make_input", "run_benchmark"]
__all__ += ["memory_probe", "ratios", "format_table"]

DEFAULT_SEQ_LENS = (128, 256, 512, 1024, 2048)
MEMORY_SEQ_LENS = (256, 512, 1024, 2048, 4096)

#: Time ratios printed side by side: (numerator, denominator).
RATIO_PAIRS: tuple[tuple[str, str], ...] = (
    ("mha_module", "sdpa_bare"),
    ("torch_mha", "mha_module"),
    ("torch_mha_general", "mha_module"),
    ("torch_textbook", "mha_module"),
)


@dataclass(frozen=True)
class BenchConfig:
    """One configuration: B sequences of T tokens, H heads of width d_k."""

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


def make_layer(config: BenchConfig, seed: int = 0) -> nn.MultiheadAttention:
    """The weights every entry uses: a seeded ``nn.MultiheadAttention``.

    torch initialises the projection weights Xavier-uniform and the biases
    to zero. Eval mode, no gradients.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = nn.MultiheadAttention(
            config.embed_dim, config.heads, batch_first=True
        )
    layer = layer.to(device=config.device, dtype=DTYPES[config.dtype])
    return layer.eval().requires_grad_(False)


def make_input(config: BenchConfig, seed: int = 1) -> Tensor:
    """Standard-normal inputs, (B, T, D), drawn in float32 and then cast."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(
        config.batch, config.seq_len, config.embed_dim, generator=generator
    )
    return x.to(device=config.device, dtype=DTYPES[config.dtype])


def run_benchmark(
    *,
    device: str = "cpu",
    dtype: str = "float32",
    batch: int | None = None,
    heads: int = 8,
    head_dim: int = 64,
    seq_lens: Sequence[int] | None = None,
    impls: Sequence[str] | None = None,
    causal: bool = False,
    memory: bool = False,
    threads: int | None = None,
    numpy_max_len: int = 512,
    quiet: bool = False,
    **timing: Any,
) -> dict[str, Any]:
    """Time the layer; a report with one row per (implementation, T).

    ``batch`` defaults to 8 (1 with ``memory``), ``seq_lens`` to
    :data:`DEFAULT_SEQ_LENS` (:data:`MEMORY_SEQ_LENS` with ``memory``),
    ``impls`` to those the device runs by default; ``timing`` is
    ``repeats``, ``warmup``, ``min_time``, ``max_repeats`` (:class:`Timing`).
    NumPy entries are skipped above ``numpy_max_len``.
    """
    batch = batch if batch is not None else (1 if memory else 8)
    if seq_lens is None:
        seq_lens = MEMORY_SEQ_LENS if memory else DEFAULT_SEQ_LENS
    timing = Timing(**timing)
    check_arguments(
        dtype,
        {"batch": batch, "heads": heads, "head_dim": head_dim},
        {"seq_lens": seq_lens},
    )
    torch_device, impls, env = prepare(
        IMPLEMENTATIONS, impls, device, dtype, threads
    )
    config_record = {
        "batch": batch,
        "heads": heads,
        "head_dim": head_dim,
        "embed_dim": heads * head_dim,
        "seq_lens": list(seq_lens),
        "impls": list(impls),
        "causal": causal,
        **timing.record(torch_device),
        "memory": memory,
        "numpy_max_len": numpy_max_len,
        "memory_method": None
        if not memory
        else "torch.cuda.max_memory_allocated"
        if torch_device.type == "cuda"
        else "peak RSS in a fresh process",
    }
    log(f"mha.bench layer: {describe(env)}", quiet)
    results: list[dict[str, Any]] = []
    for seq_len in seq_lens:
        config = BenchConfig(
            batch, seq_len, heads, head_dim, dtype, torch_device.type, causal
        )
        layer, x = make_layer(config), make_input(config)
        cases = {
            impl: _case(impl, config, layer, x, numpy_max_len)
            for impl in impls
        }
        runners = measure(cases, torch_device, timing, f"T={seq_len}", quiet)
        for impl, case in cases.items():
            if case.row["status"] == "ok":
                case.row.update(_rates(case.row, case.row["median_s"]))
                if memory:
                    case.row.update(_peak(impl, config, runners[impl]))
            results.append(case.row)
        del runners, cases, layer, x
        gc.collect()
    env["load_average_1min_end"] = load_average()
    report = {"environment": env, "config": config_record, "results": results}
    report["ratios"] = ratios(report)
    return report


def _case(
    impl: str,
    config: BenchConfig,
    layer: nn.MultiheadAttention,
    x: Tensor,
    numpy_max_len: int,
) -> Case:
    """The row of (impl, T), with its FLOPs, and how to build its runner."""
    entry = IMPLEMENTATIONS[impl]
    B, T, D = config.batch, config.seq_len, config.embed_dim
    core = counting.attention_core_flops(
        B, T, D, config.heads, causal=config.causal
    )
    flops = {"core": core, "projection": counting.projection_flops(B, T, D)}
    flops["layer"] = flops["core"] + flops["projection"]
    row = {"impl": impl, "scope": entry.scope, "seq_len": T}
    row |= {f"{part}_flop": flop for part, flop in flops.items()}
    row["flop"] = flops[entry.scope.removesuffix("s")]

    def build():
        if entry.library == "numpy" and config.seq_len > numpy_max_len:
            raise Unsupported(
                "NumPy implementations run up to "
                f"T = {numpy_max_len} (--numpy-max-len)"
            )
        return build_runner(IMPLEMENTATIONS, impl, layer, x, config.causal)

    return Case(row, build, entry.library)


#: The parts whose FLOP rate a row's time gives, by scope (a layer row's
#: core rate is a lower bound: the core's FLOPs over the whole layer's time).
_COVERS = {"layer": ("layer", "core"), "core": ("core",)}
_COVERS["projections"] = ("projection",)


def _rates(row: dict[str, Any], seconds: float) -> dict[str, float | None]:
    """FLOP/s of a row's scope, and of each part (None where not covered)."""
    rates = {"flop_per_s": row["flop"] / seconds}
    for part in ("layer", "core", "projection"):
        covered = part in _COVERS[row["scope"]]
        rate = row[f"{part}_flop"] / seconds if covered else None
        rates[f"{part}_flop_per_s"] = rate
    return rates


def _peak(impl: str, config: BenchConfig, runner: Runner) -> dict[str, Any]:
    """``peak_memory_bytes`` of one call, and the ``memory_method``."""
    if config.device == "cuda":
        peak = cuda_peak_bytes(runner, torch.device("cuda"))
        method = "torch.cuda.max_memory_allocated"
    else:
        spec = {"impl": impl, "config": asdict(config)}
        threads = torch.get_num_threads()
        probe = in_fresh_process("mha.bench.layer:memory_probe", spec, threads)
        peak, method = probe["peak_bytes"], probe["method"]
    return {"peak_memory_bytes": peak, "memory_method": method}


def memory_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Peak extra memory of one call of ``spec["impl"]``; in a fresh process.

    A first call at T <= 16 loads the code paths and starts the thread pool,
    so that the measured call pays only for its own tensors.
    """
    config = BenchConfig(**spec["config"])
    small = replace(config, seq_len=min(config.seq_len, 16))
    for size in (small, config):
        layer, x = make_layer(size), make_input(size)
        runner = build_runner(
            IMPLEMENTATIONS, spec["impl"], layer, x, config.causal
        )
        if size is small:
            runner()
    return peak_rss_of_call(runner)


def ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per T, the paired time ratios of :data:`RATIO_PAIRS`.

    With memory measured, the same ratios of peak memory too.
    ``"mha_module/sdpa_bare": 1.05`` means the module took 5 % longer than
    the bare floor (see :func:`mha.bench.report.paired_ratio`).
    """
    rows = []
    for seq_len in report["config"]["seq_lens"]:
        row: dict[str, Any] = {"seq_len": seq_len}
        for a, b in RATIO_PAIRS:
            pair = [find_row(report, impl=i, seq_len=seq_len) for i in (a, b)]
            row[f"{a}/{b}"] = paired_ratio(*pair)
            if report["config"].get("memory"):
                peaks = [p and p.get("peak_memory_bytes") for p in pair]
                row[f"memory {a}/{b}"] = (
                    peaks[0] / peaks[1]
                    if peaks[0] is not None and peaks[1]
                    else None
                )
        rows.append(row)
    return rows


def format_table(report: dict[str, Any]) -> str:
    """The results as a text table, then the skipped entries and ratios."""
    env, config = report["environment"], report["config"]
    unit, scale = (
        ("TFLOP/s", 1e12) if env["device"] == "cuda" else ("GFLOP/s", 1e9)
    )
    memory = bool(config.get("memory"))
    header = ["T", "impl", "scope", "median ms"]
    header += [f"{part} {unit}" for part in ("layer", "core", "proj")]
    rows, skipped = [], {}
    for row in report["results"]:
        if row["status"] != "ok":
            key = f"  {row['impl']}: {row['reason']}; at T ="
            skipped[key] = f"{skipped.get(key, key)} {row['seq_len']}"
            continue
        rates = ("layer", "core", "projection")
        rows.append(
            [row["seq_len"], row["impl"], row["scope"]]
            + [number(row["median_s"], ".3f", 1e-3)]
            + [number(row[f"{r}_flop_per_s"], ".2f", scale) for r in rates]
            + (
                [number(row["peak_memory_bytes"], ".1f", MIB)]
                if memory
                else []
            )
        )
    lines = [
        describe(env),
        f"B={config['batch']} H={config['heads']} "
        f"d_k={config['head_dim']} D={config['embed_dim']}"
        f"{' causal' if config['causal'] else ''}; "
        f"median of >= {config['repeats']} calls ({config['timer']}); "
        "a layer row's core rate = core FLOPs / layer time",
        "",
        *text_table(header + ["peak MiB"] * memory, rows),
    ]
    if skipped:
        lines += ["", "skipped:", *skipped.values()]
    lines += [
        "",
        "time ratios (median of per-round ratios; peak memory where "
        "marked), from this run:",
        *ratio_table(report["ratios"], {"seq_len": "T"}),
    ]
    return "\n".join(lines)
