"""``python -m mha.bench --decode``: the time of one generated token.

One decoding step of a :class:`mha.GroupedQueryAttention` layer after a
context of T tokens, against T, for every entry of
:data:`~mha.bench.registry.DECODE_IMPLEMENTATIONS`: no cache (the whole
sequence again), the concatenating cache, the preallocated cache, and
``transformers``' ``LlamaAttention`` with its own caches (same weights, same
configuration). For each batch size and context length, every implementation
and every number of key/value heads is timed in the same interleaved rounds,
so the ratios compare calls made seconds apart.

What a step reads is counted too: the keys and values it attends to
(:func:`mha.counting.kv_cache_bytes`, one layer, T + 1 positions) and the
projection weights (``(2 D + 2 H_kv d_k) D`` numbers).
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .. import counting
from .._validate import check_choice, check_int
from .config import DTYPES
from .environment import environment
from .registry import (
    DECODE_IMPLEMENTATIONS,
    Unsupported,
    build_decode_runner,
)
from .report import paired_ratio
from .timing import probe, time_interleaved

__all__ = [
    "DECODE_CONTEXTS",
    "DECODE_BATCHES",
    "make_decode_layer",
    "make_decode_inputs",
    "run_decode_benchmark",
    "decode_ratios",
    "decode_targets",
    "format_decode_table",
]

DECODE_CONTEXTS = (128, 256, 512, 1024, 2048, 4096)
DECODE_BATCHES = (1, 8)
MIB = 2**20


def make_decode_layer(
    embed_dim: int,
    heads: int,
    kv_heads: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
):
    """A seeded :class:`mha.GroupedQueryAttention`: torch's default init,
    eval mode, no gradients."""
    from ..decoding import GroupedQueryAttention

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = GroupedQueryAttention(embed_dim, heads, kv_heads)
    return layer.to(device=device, dtype=dtype).eval().requires_grad_(False)


def make_decode_inputs(
    batch: int,
    context: int,
    embed_dim: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard-normal context (B, T, D) and new token (B, 1, D)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, context + 1, embed_dim, generator=generator)
    x = x.to(device=device, dtype=dtype)
    return x[:, :context], x[:, context:]


def run_decode_benchmark(
    *,
    device: str = "cpu",
    dtype: str = "float32",
    batches: Sequence[int] = DECODE_BATCHES,
    heads: int = 8,
    head_dim: int = 64,
    kv_heads: Sequence[int] | None = None,
    contexts: Sequence[int] = DECODE_CONTEXTS,
    impls: Sequence[str] | None = None,
    repeats: int = 5,
    warmup: int = 1,
    min_time: float = 1.0,
    max_repeats: int = 50,
    threads: int | None = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Time every decode step; a JSON-ready dict with ``environment``,
    ``config``, ``results`` (one row per implementation, H_kv, B and T),
    ``ratios`` and ``targets``."""
    check_choice("dtype", dtype, tuple(DTYPES))
    for name, value in (
        ("heads", heads),
        ("head_dim", head_dim),
        ("repeats", repeats),
        ("warmup", warmup),
    ):
        check_int(name, value)
    kv_heads = list(kv_heads or _default_kv_heads(heads))
    for name, values in (
        ("batches", batches),
        ("contexts", contexts),
        ("kv_heads", kv_heads),
    ):
        if not values:
            raise ValueError(f"{name} must be a non-empty list, got []")
        for value in values:
            check_int(f"each of {name}", value)
    for h_kv in kv_heads:
        if heads % h_kv:
            raise ValueError(
                f"each of kv_heads must divide heads ({heads}), got {h_kv}"
            )
    impls = list(DECODE_IMPLEMENTATIONS if impls is None else impls)
    unknown = [name for name in impls if name not in DECODE_IMPLEMENTATIONS]
    if unknown:
        raise ValueError(
            f"impls must be among {', '.join(DECODE_IMPLEMENTATIONS)}, "
            f"got unknown {unknown}"
        )
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda': torch.cuda.is_available() is False")
    if threads is not None:
        torch.set_num_threads(threads)
    torch_device, torch_dtype = torch.device(device), DTYPES[dtype]
    D = heads * head_dim
    env = environment(torch_device, dtype)
    env["transformers_version"] = _transformers_version()
    config = {
        "mode": "decode",
        "batches": list(batches),
        "heads": heads,
        "head_dim": head_dim,
        "embed_dim": D,
        "kv_heads": kv_heads,
        "contexts": list(contexts),
        "impls": impls,
        "repeats": repeats,
        "warmup": warmup,
        "min_time_s": min_time,
        "max_repeats": max_repeats,
        "timer": "CUDA events" if device == "cuda" else "time.perf_counter",
    }
    _log(
        f"mha.bench --decode: {env['device_name']}, torch "
        f"{env['torch_version']}, transformers {env['transformers_version']}"
        f", {dtype}, {env['threads']} threads, D={D} H={heads} "
        f"H_kv={kv_heads}, B={list(batches)}, T={list(contexts)}",
        quiet,
    )
    element = torch.finfo(torch_dtype).bits // 8
    results: list[dict[str, Any]] = []
    for batch in batches:
        for context in contexts:
            results += _time_group(
                batch,
                context,
                kv_heads,
                impls,
                heads,
                head_dim,
                torch_dtype,
                torch_device,
                element,
                (repeats, warmup, min_time, max_repeats),
                quiet,
            )
    env["load_average_1min_end"] = (
        os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    )
    report = {"environment": env, "config": config, "results": results}
    report["ratios"] = decode_ratios(report)
    report["targets"] = decode_targets(report)
    return report


def _time_group(
    batch: int,
    context: int,
    kv_heads: list[int],
    impls: list[str],
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    element: int,
    timing: tuple[int, int, float, int],
    quiet: bool,
) -> list[dict[str, Any]]:
    """Every (implementation, H_kv) at one (B, T), timed in the same rounds."""
    repeats, warmup, min_time, max_repeats = timing
    D = heads * head_dim
    context_x, x_new = make_decode_inputs(batch, context, D, dtype, device)
    rows: dict[str, dict[str, Any]] = {}
    runners = {}
    for h_kv in kv_heads:
        layer = make_decode_layer(D, heads, h_kv, dtype, device)
        for impl in impls:
            key = f"{impl} H_kv={h_kv}"
            cached = impl != "no_cache"
            rows[key] = {
                "impl": impl,
                "num_kv_heads": h_kv,
                "batch": batch,
                "context": context,
                "status": "ok",
                "reason": None,
                # keys and values the step attends to: T + 1 positions
                "cache_bytes": counting.kv_cache_bytes(
                    batch, context + 1, 1, h_kv, head_dim, element
                )
                if cached
                else None,
                "weight_bytes": (2 * D + 2 * h_kv * head_dim) * D * element,
            }
            try:
                runner = build_decode_runner(impl, layer, context_x, x_new)
                for _ in range(warmup):
                    probe(runner, device)
                runners[key] = runner
            except Unsupported as why:
                rows[key].update(status="skipped", reason=str(why))
    _log(f"B={batch} T={context}: timing {len(runners)} runners", quiet)
    times = time_interleaved(runners, device, repeats, min_time, max_repeats)
    for key, row in rows.items():
        if row["status"] != "ok":
            _log(f"    {key:<30} skipped: {row['reason']}", quiet)
            continue
        samples = sorted(times[key])
        quartiles = (
            statistics.quantiles(samples, n=4)
            if len(samples) >= 2
            else [samples[0]] * 3
        )
        row.update(
            median_s=statistics.median(samples),
            min_s=samples[0],
            q1_s=quartiles[0],
            q3_s=quartiles[2],
            repeats=len(samples),
            times_s=times[key],  # in round order, for paired ratios
        )
        _log(f"    {key:<30} {row['median_s'] * 1e3:10.3f} ms", quiet)
    del runners
    gc.collect()
    return list(rows.values())


# ---------------------------------------------------------------------------
# Ratios and targets


def _row(report: dict[str, Any], impl: str, h_kv: int, batch: int, t: int):
    for row in report["results"]:
        if (
            row["impl"] == impl
            and row["num_kv_heads"] == h_kv
            and row["batch"] == batch
            and row["context"] == t
            and row["status"] == "ok"
        ):
            return row
    return None


def decode_ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (B, T, H_kv): ours against transformers, caches against none,
    and, per (B, T), GQA and MQA against MHA (preallocated caches)."""
    config = report["config"]
    heads, kv_heads = config["heads"], config["kv_heads"]
    rows = []
    for batch in config["batches"]:
        for t in config["contexts"]:
            ours = {
                h: _row(report, "preallocated_cache", h, batch, t)
                for h in kv_heads
            }
            for h in kv_heads:

                def get(impl: str, h: int = h):
                    return _row(report, impl, h, batch, t)

                rows.append(
                    {
                        "batch": batch,
                        "context": t,
                        "num_kv_heads": h,
                        "ours/hf_dynamic": paired_ratio(
                            ours[h], get("hf_dynamic_cache")
                        ),
                        "ours/hf_static": paired_ratio(
                            ours[h], get("hf_static_cache")
                        ),
                        "concat/hf_dynamic": paired_ratio(
                            get("concat_cache"), get("hf_dynamic_cache")
                        ),
                        "no_cache/ours": paired_ratio(
                            get("no_cache"), ours[h]
                        ),
                        "concat/ours": paired_ratio(
                            get("concat_cache"), ours[h]
                        ),
                        "ours/MHA": paired_ratio(ours[h], ours.get(heads)),
                    }
                )
    return rows


def decode_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's three targets, each with what was measured and whether
    it was met: flat cached steps, ours vs transformers, GQA vs MHA."""
    config = report["config"]
    heads, kv_heads = config["heads"], config["kv_heads"]
    first, last = config["contexts"][0], config["contexts"][-1]
    targets = []
    growth = []
    for batch in config["batches"]:
        for h in kv_heads:
            for impl in ("preallocated_cache", "no_cache"):
                a = _row(report, impl, h, batch, last)
                b = _row(report, impl, h, batch, first)
                if a and b:
                    growth.append(
                        {
                            "impl": impl,
                            "batch": batch,
                            "num_kv_heads": h,
                            "ratio": a["median_s"] / b["median_s"],
                        }
                    )
    cached = [g for g in growth if g["impl"] == "preallocated_cache"]
    if cached:
        targets.append(
            {
                "name": f"preallocated step flat within 2x, T={first}..{last}",
                "met": all(g["ratio"] <= 2.0 for g in cached),
                "measured": growth,
            }
        )
    for theirs in ("hf_dynamic", "hf_static"):
        values = [
            r for r in report["ratios"] if r.get(f"ours/{theirs}") is not None
        ]
        if values:
            worst = max(values, key=lambda r: r[f"ours/{theirs}"])
            targets.append(
                {
                    "name": f"ours (preallocated) at least as fast as "
                    f"transformers ({theirs}) at every T",
                    "met": worst[f"ours/{theirs}"] <= 1.0,
                    "measured": {
                        "worst_ratio": worst[f"ours/{theirs}"],
                        "at": {
                            k: worst[k]
                            for k in ("batch", "context", "num_kv_heads")
                        },
                        "median_ratio": statistics.median(
                            r[f"ours/{theirs}"] for r in values
                        ),
                    },
                }
            )
    gqa = [h for h in kv_heads if h not in (heads, 1)]
    compared = []
    for batch in config["batches"]:
        for h in gqa:
            ratio = next(
                (
                    r["ours/MHA"]
                    for r in report["ratios"]
                    if (r["batch"], r["context"], r["num_kv_heads"])
                    == (batch, last, h)
                ),
                None,
            )
            mha, grouped = (
                _row(report, "preallocated_cache", k, batch, last)
                for k in (heads, h)
            )
            if ratio is not None and mha and grouped:
                compared.append(
                    {
                        "batch": batch,
                        "num_kv_heads": h,
                        "time_ratio": ratio,
                        "cache_bytes_mha": mha["cache_bytes"],
                        "cache_bytes_gqa": grouped["cache_bytes"],
                    }
                )
    if compared:
        targets.append(
            {
                "name": f"GQA step faster than MHA at T={last}",
                "met": all(c["time_ratio"] < 1.0 for c in compared),
                "measured": compared,
            }
        )
    return targets


def format_decode_table(report: dict[str, Any]) -> str:
    """Times per token (ms), ratios and targets, as text."""
    env, config = report["environment"], report["config"]
    kv_heads, impls = config["kv_heads"], config["impls"]
    short = {
        "no_cache": "none",
        "concat_cache": "concat",
        "preallocated_cache": "prealloc",
        "hf_dynamic_cache": "hf_dyn",
        "hf_static_cache": "hf_stat",
    }
    lines = [
        f"{env['device_name']} ({env['device']}), torch "
        f"{env['torch_version']}, transformers "
        f"{env.get('transformers_version')}, {env['dtype']}, "
        f"{env['threads']} threads, {env['date_utc']}",
        f"decode step of one layer: D={config['embed_dim']} "
        f"H={config['heads']} d_k={config['head_dim']}; median ms per "
        f"token of >= {config['repeats']} calls ({config['timer']})",
    ]
    for batch in config["batches"]:
        for h in kv_heads:
            lines += ["", f"B={batch} H_kv={h}   ms per generated token"]
            header = f"{'T':>6} " + "".join(
                f"{short.get(i, i):>10}" for i in impls
            )
            lines += [header + f"{'cache MiB':>11}", "-" * (len(header) + 11)]
            for t in config["contexts"]:
                cells, cache = [], None
                for impl in impls:
                    row = _row(report, impl, h, batch, t)
                    cells.append(
                        f"{row['median_s'] * 1e3:>10.3f}"
                        if row
                        else f"{'-':>10}"
                    )
                    if row and row["cache_bytes"] is not None:
                        cache = row["cache_bytes"]
                mib = f"{cache / MIB:>11.2f}" if cache is not None else ""
                lines.append(f"{t:>6} " + "".join(cells) + mib)
    keys = (
        "ours/hf_dynamic",
        "ours/hf_static",
        "no_cache/ours",
        "concat/ours",
        "ours/MHA",
    )
    lines += [
        "",
        "time ratios, median of per-round ratios (ours = preallocated cache):",
        f"{'B':>3} {'H_kv':>4} {'T':>6} " + "".join(f"{k:>16}" for k in keys),
    ]
    for r in report["ratios"]:
        cells = "".join(
            f"{r[k]:>16.2f}" if r.get(k) is not None else f"{'-':>16}"
            for k in keys
        )
        lines.append(
            f"{r['batch']:>3} {r['num_kv_heads']:>4} {r['context']:>6} "
            + cells
        )
    lines += ["", "targets, from this run:"]
    for target in report["targets"]:
        mark = "met" if target["met"] else "NOT met"
        lines.append(f"  [{mark}] {target['name']}")
        measured = target["measured"]
        if isinstance(measured, dict):
            lines.append(
                f"      worst ratio {measured['worst_ratio']:.2f} at "
                f"{measured['at']}, median {measured['median_ratio']:.2f}"
            )
            continue
        for m in measured:
            if "ratio" in m:
                lines.append(
                    f"      {m['impl']:<18} B={m['batch']} "
                    f"H_kv={m['num_kv_heads']}: T={config['contexts'][-1]}"
                    f" takes {m['ratio']:.1f}x T={config['contexts'][0]}"
                )
            else:
                lines.append(
                    f"      B={m['batch']} H_kv={m['num_kv_heads']}: "
                    f"{m['time_ratio']:.2f}x MHA's time; keys and values "
                    f"read {m['cache_bytes_gqa'] / MIB:.2f} MiB against "
                    f"{m['cache_bytes_mha'] / MIB:.2f} MiB"
                )
    return "\n".join(lines)


def _default_kv_heads(heads: int) -> list[int]:
    """MHA, GQA with H / H_kv = 4 (where 4 divides H), MQA."""
    kv = [heads, heads // 4 if heads % 4 == 0 and heads > 4 else None, 1]
    return list(dict.fromkeys(k for k in kv if k))


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:  # pragma: no cover
        return None
    return transformers.__version__


def _log(message: str, quiet: bool) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)
