"""``python -m mha.bench decode``: the time of one generated token.

One decoding step of a :class:`mha.GroupedQueryAttention` layer after a
context of T tokens, against T, for every entry of
:data:`~mha.bench.registry.DECODE_IMPLEMENTATIONS`
(:mod:`mha.bench.decode_steps`) and every number of key/value heads. For each
batch size and context length, every entry and every H_kv is timed in the
same interleaved rounds (:func:`mha.bench.timing.measure`), so the ratios
compare calls made seconds apart.

What a step reads is counted too: the keys and values it attends to
(:func:`mha.counting.kv_cache_bytes`, one layer, T + 1 positions) and the
projection weights (``(2 D + 2 H_kv d_k) D`` numbers).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from itertools import product
from typing import Any

import torch

from .. import counting
from ..decoding import GroupedQueryAttention
from ..environment import describe, load_average
from . import decode_steps  # noqa: F401  (fills the registry)
from .registry import DECODE_IMPLEMENTATIONS, build_runner
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

__all__ = ["DECODE_CONTEXTS", "DECODE_BATCHES", "make_decode_layer"]
__all__ += ["make_decode_inputs", "run_decode_benchmark", "decode_ratios"]
__all__ += ["DECODE_RATIOS", "format_decode_table"]

DECODE_CONTEXTS = (128, 256, 512, 1024, 2048, 4096)
DECODE_BATCHES = (1, 8)


def make_decode_layer(
    embed_dim: int,
    heads: int,
    kv_heads: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> GroupedQueryAttention:
    """A seeded :class:`mha.GroupedQueryAttention`: torch's default init,
    eval mode, no gradients."""
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
    threads: int | None = None,
    quiet: bool = False,
    **timing: Any,
) -> dict[str, Any]:
    """Time every decode step; a report with one row per (implementation,
    H_kv, B, T). ``kv_heads`` defaults to H, H / 4 and 1 (MHA, GQA, MQA);
    ``timing`` is ``repeats``, ``warmup``, ``min_time``, ``max_repeats``."""
    timing = Timing(**timing)
    check_arguments(
        dtype,
        {"heads": heads, "head_dim": head_dim},
        {"batches": batches, "contexts": contexts},
    )
    if kv_heads is None:
        kv_heads = _default_kv_heads(heads)
    check_arguments(dtype, {}, {"kv_heads": kv_heads})
    for h_kv in kv_heads:
        if heads % h_kv:
            raise ValueError(
                f"each of kv_heads must divide heads ({heads}), got {h_kv}"
            )
    torch_device, impls, env = prepare(
        DECODE_IMPLEMENTATIONS, impls, device, dtype, threads
    )
    D = heads * head_dim
    config = {
        "mode": "decode",
        "batches": list(batches),
        "heads": heads,
        "head_dim": head_dim,
        "embed_dim": D,
        "kv_heads": list(kv_heads),
        "contexts": list(contexts),
        "impls": impls,
        **timing.record(torch_device),
    }
    log(f"mha.bench decode: {describe(env)}", quiet)
    dtype_ = DTYPES[dtype]
    element = torch.finfo(dtype_).bits // 8
    results: list[dict[str, Any]] = []
    for batch, context in product(batches, contexts):
        x = make_decode_inputs(batch, context, D, dtype_, torch_device)
        cases = {}
        for h_kv in kv_heads:
            layer = make_decode_layer(D, heads, h_kv, dtype_, torch_device)
            cached = counting.kv_cache_bytes(
                batch, context + 1, 1, h_kv, head_dim, element
            )
            for impl in impls:
                row = {
                    "impl": impl,
                    "num_kv_heads": h_kv,
                    "batch": batch,
                    "context": context,
                    # keys and values the step attends to: T + 1 positions
                    "cache_bytes": None if impl == "no_cache" else cached,
                    "weight_bytes": (2 * D + 2 * h_kv * head_dim)
                    * D
                    * element,
                }
                cases[f"{impl} H_kv={h_kv}"] = Case(
                    row,
                    lambda impl=impl, layer=layer, x=x: build_runner(
                        DECODE_IMPLEMENTATIONS, impl, layer, *x
                    ),
                )
        measure(cases, torch_device, timing, f"B={batch} T={context}", quiet)
        results += [case.row for case in cases.values()]
        del cases
        gc.collect()
    env["load_average_1min_end"] = load_average()
    report = {"environment": env, "config": config, "results": results}
    report["ratios"] = decode_ratios(report)
    return report


#: The ratios of each (B, T, H_kv): numerator and denominator entries, both
#: at the row's H_kv except for ``ours/MHA``, whose denominator has H_kv = H.
DECODE_RATIOS = {
    "ours/hf_dynamic": ("preallocated_cache", "hf_dynamic_cache"),
    "ours/hf_static": ("preallocated_cache", "hf_static_cache"),
    "no_cache/ours": ("no_cache", "preallocated_cache"),
    "concat/ours": ("concat_cache", "preallocated_cache"),
    "ours/MHA": ("preallocated_cache", "preallocated_cache"),
    "compiled/eager": ("preallocated_compiled", "preallocated_cache"),
    "hf_compiled/hf_eager": ("hf_static_compiled", "hf_static_cache"),
    "ours/hf_static, compiled": (
        "preallocated_compiled",
        "hf_static_compiled",
    ),
}


def decode_ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (B, T, H_kv), the paired time ratios of :data:`DECODE_RATIOS`."""
    config = report["config"]
    rows = []
    for batch, t, h in product(
        config["batches"], config["contexts"], config["kv_heads"]
    ):
        row = {"batch": batch, "context": t, "num_kv_heads": h}
        for key, (a, b) in DECODE_RATIOS.items():
            h_b = config["heads"] if key == "ours/MHA" else h
            pair = [
                find_row(
                    report, impl=i, num_kv_heads=k, batch=batch, context=t
                )
                for i, k in ((a, h), (b, h_b))
            ]
            row[key] = paired_ratio(*pair)
        rows.append(row)
    return rows


def format_decode_table(report: dict[str, Any]) -> str:
    """Times per token (ms) and the ratios, as text."""
    env, config = report["environment"], report["config"]
    names = [i.removesuffix("_cache") for i in config["impls"]]
    header = ["T", *names, "cache MiB"]
    lines = [
        describe(env),
        f"decode step of one layer: D={config['embed_dim']} "
        f"H={config['heads']} d_k={config['head_dim']}; median ms per "
        f"token of >= {config['repeats']} calls ({config['timer']})",
    ]
    for batch, h in product(config["batches"], config["kv_heads"]):
        rows = []
        for t in config["contexts"]:
            found = [
                find_row(
                    report, impl=i, num_kv_heads=h, batch=batch, context=t
                )
                for i in config["impls"]
            ]
            cache = max((r["cache_bytes"] or 0) for r in found if r) or None
            rows.append(
                [t]
                + [r and number(r["median_s"], ".3f", 1e-3) for r in found]
                + [number(cache, ".2f", MIB)]
            )
        lines += ["", f"B={batch} H_kv={h}, ms per generated token"]
        lines += text_table(header, rows)
    ids = {"batch": "B", "num_kv_heads": "H_kv", "context": "T"}
    lines += [
        "",
        "time ratios, median of per-round ratios (ours = preallocated cache):",
        *ratio_table(report["ratios"], ids),
    ]
    return "\n".join(lines)


def _default_kv_heads(heads: int) -> list[int]:
    """MHA, GQA with H / H_kv = 4 (where 4 divides H), MQA."""
    kv = [heads, heads // 4 if heads % 4 == 0 and heads > 4 else None, 1]
    return list(dict.fromkeys(k for k in kv if k))
