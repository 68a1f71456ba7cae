"""``python -m mha.bench variants``: attention variants against dense masks.

The attention core, q, k, v (B, H, T, d_k), under the mask of one variant of
:mod:`mha.variants` (a sliding window of W keys by default), against T: the
compiled FlexAttention kernel with the variant's block mask, beside
``F.scaled_dot_product_attention`` with the same mask as a dense (T, T)
boolean tensor, and the causal pair (FlexAttention with the causal block
mask, SDPA with ``is_causal=True``), which compute more scores. At each T
every entry is timed in the same interleaved rounds
(:func:`mha.bench.timing.measure`).

Each row also records the first call of its entry, which for a compiled
entry includes compiling its kernel (``first_call_s``; with ``cold_compile``
in an empty compiler cache, so the compiler builds everything), and the
largest difference of its output from SDPA with the dense mask
(``max_abs_diff``). Each T adds the time to build the variant's block mask
(median of ``repeats`` builds), the tiles it computes and the bytes of the
dense mask (``"masks"``).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from .. import variants
from .._validate import check_choice
from ..environment import describe, load_average
from .registry import (
    Implementation,
    Runner,
    Unsupported,
    build_runner,
    register,
)
from .report import find_row, number, paired_ratio, ratio_table, text_table
from .timing import (
    DTYPES,
    Case,
    Timing,
    check_arguments,
    log,
    measure,
    prepare,
)

__all__ = ["VARIANT_IMPLEMENTATIONS", "VARIANT_SEQ_LENS", "MASKS"]
__all__ += ["VARIANT_RATIOS", "variant_mask", "make_variant_inputs"]
__all__ += ["run_variants_benchmark", "variant_ratios", "format_variants"]

#: The entries, in table order: ``build(q, k, v, mask_mod)``.
VARIANT_IMPLEMENTATIONS: dict[str, Implementation] = {}

VARIANT_SEQ_LENS = (512, 1024, 2048, 4096)

#: ``--mask``: the variants whose mask the benchmark can time.
MASKS = ("sliding_window", "sink_window", "causal")

#: Ratios printed per T: (numerator, denominator).
VARIANT_RATIOS = {
    "sdpa_dense/flex": ("sdpa_dense_mask", "flex"),
    "sdpa_causal/flex": ("sdpa_causal", "flex"),
    "flex_causal/flex": ("flex_causal", "flex"),
    "sdpa_causal/flex_causal": ("sdpa_causal", "flex_causal"),
}


@register(VARIANT_IMPLEMENTATIONS, "flex", scope="core")
def flex(
    q: Tensor, k: Tensor, v: Tensor, mask_mod: variants.MaskMod
) -> Runner:
    """torch.compile(flex_attention) with the variant's block mask."""
    mask = variants.block_mask(mask_mod, q.shape[2], device=q.device)
    # static shapes: one kernel per T, as a model of fixed length runs it
    run = torch.compile(flex_attention, dynamic=False)
    return lambda: run(q, k, v, block_mask=mask)


@register(VARIANT_IMPLEMENTATIONS, "sdpa_dense_mask", scope="core")
def sdpa_dense_mask(
    q: Tensor, k: Tensor, v: Tensor, mask_mod: variants.MaskMod
) -> Runner:
    """F.scaled_dot_product_attention with the variant's (T, T) bool mask."""
    keep = variants.dense_mask(mask_mod, q.shape[2]).to(q.device)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


@register(VARIANT_IMPLEMENTATIONS, "flex_causal", scope="core")
def flex_causal(
    q: Tensor, k: Tensor, v: Tensor, mask_mod: variants.MaskMod
) -> Runner:
    """torch.compile(flex_attention) with the causal block mask."""
    return flex(q, k, v, variants.causal)


@register(VARIANT_IMPLEMENTATIONS, "sdpa_causal", scope="core")
def sdpa_causal(
    q: Tensor, k: Tensor, v: Tensor, mask_mod: variants.MaskMod
) -> Runner:
    """F.scaled_dot_product_attention(is_causal=True), no window."""
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)


def variant_mask(mask: str, window: int, sinks: int) -> variants.MaskMod:
    """The mask_mod that ``--mask``, ``--window`` and ``--sinks`` name."""
    if mask == "sliding_window":
        return variants.sliding_window(window)
    if mask == "sink_window":
        return variants.sink_window(window, sinks)
    return variants.causal


def make_variant_inputs(
    batch: int,
    heads: int,
    seq_len: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Standard-normal q, k, v, each (B, H, T, d_k), drawn in float32."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(3, batch, heads, seq_len, head_dim, generator=generator)
    q, k, v = qkv.to(device=device, dtype=dtype)
    return q, k, v


def run_variants_benchmark(
    *,
    device: str = "cpu",
    dtype: str = "float32",
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    seq_lens: Sequence[int] = VARIANT_SEQ_LENS,
    mask: str = "sliding_window",
    window: int = 256,
    sinks: int = 4,
    impls: Sequence[str] | None = None,
    cold_compile: bool = True,
    threads: int | None = None,
    quiet: bool = False,
    **timing: Any,
) -> dict[str, Any]:
    """Time every entry under one variant's mask; one row per (entry, T).

    ``mask`` is one of :data:`MASKS`, with ``window`` (and ``sinks``);
    ``cold_compile`` compiles in an empty, temporary compiler cache, so that
    ``first_call_s`` includes the whole build of each kernel. ``timing`` is
    ``repeats``, ``warmup``, ``min_time``, ``max_repeats``.
    """
    timing = Timing(**timing)
    check_arguments(
        dtype,
        {"batch": batch, "heads": heads, "head_dim": head_dim},
        {"seq_lens": seq_lens},
    )
    check_choice("mask", mask, MASKS)
    mask_mod = variant_mask(mask, window, sinks)  # checks window and sinks
    torch_device, impls, env = prepare(
        VARIANT_IMPLEMENTATIONS, impls, device, dtype, threads
    )
    config = {
        "batch": batch,
        "heads": heads,
        "head_dim": head_dim,
        "seq_lens": list(seq_lens),
        "mask": mask,
        "window": window if mask != "causal" else None,
        "sinks": sinks if mask == "sink_window" else None,
        "impls": list(impls),
        "cold_compile": cold_compile,
        **timing.record(torch_device),
    }
    log(f"mha.bench variants: {describe(env)}", quiet)
    results, masks = [], []
    with _compiler_cache(cold_compile):
        for seq_len in seq_lens:
            torch._dynamo.reset()  # a fresh count of compiled versions
            qkv = make_variant_inputs(
                batch, heads, seq_len, head_dim, DTYPES[dtype], torch_device
            )
            masks.append(_mask_record(mask_mod, seq_len, timing.repeats))
            cases = {}
            for impl in impls:
                row = {"impl": impl, "scope": "core", "seq_len": seq_len}
                build = _first_call_timed(impl, qkv, mask_mod, row)
                cases[impl] = Case(row, build)
            runners = measure(
                cases, torch_device, timing, f"T={seq_len}", quiet
            )
            _differences(cases, runners, qkv, mask_mod)
            results += [case.row for case in cases.values()]
            del runners, cases, qkv
            gc.collect()
    env["load_average_1min_end"] = load_average()
    report = {
        "environment": env,
        "config": config,
        "results": results,
        "masks": masks,
    }
    report["ratios"] = variant_ratios(report)
    return report


def _first_call_timed(
    impl: str,
    qkv: tuple[Tensor, Tensor, Tensor],
    mask_mod: variants.MaskMod,
    row: dict[str, Any],
) -> Callable[[], Runner]:
    """A builder that also times the runner's first call into ``row``.

    The first call of a compiled entry compiles its kernel. A compiled call
    that gives up and runs unfused (it warns) is reported as skipped, never
    timed as if it were the kernel.
    """

    def build() -> Runner:
        runner = build_runner(VARIANT_IMPLEMENTATIONS, impl, *qkv, mask_mod)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=_UNFUSED)
            start = time.perf_counter()
            try:
                with torch.no_grad():
                    runner()
            except UserWarning as fallback:
                raise Unsupported(str(fallback).splitlines()[0]) from None
            row["first_call_s"] = time.perf_counter() - start
        return runner

    return build


#: What FlexAttention warns when it runs without a compiled kernel.
_UNFUSED = "flex_attention called without torch.compile"


def _differences(
    cases: dict[str, Case],
    runners: dict[str, Runner],
    qkv: tuple[Tensor, Tensor, Tensor],
    mask_mod: variants.MaskMod,
) -> None:
    """The largest difference of each entry under the variant's mask from
    SDPA with the dense mask, into its row."""
    q, k, v = qkv
    keep = variants.dense_mask(mask_mod, q.shape[2]).to(q.device)
    with torch.no_grad():
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        for impl, case in cases.items():
            if impl in runners and impl not in ("flex_causal", "sdpa_causal"):
                diff = (runners[impl]() - reference).abs().max()
                case.row["max_abs_diff"] = float(diff)


def _mask_record(
    mask_mod: variants.MaskMod, seq_len: int, repeats: int
) -> dict[str, Any]:
    """Build time of the block mask (median), its tiles, the dense bytes."""
    seconds = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        block = variants.block_mask(mask_mod, seq_len)
        seconds.append(time.perf_counter() - start)
    tiles = variants.tile_states(block)
    return {
        "seq_len": seq_len,
        "block_mask_s": statistics.median(seconds),
        "tiles_computed": int((tiles > 0).sum()),
        "tiles_total": int(tiles.size),
        "dense_mask_bytes": seq_len * seq_len,  # one bool per score
    }


@contextlib.contextmanager
def _compiler_cache(cold: bool):
    """An empty, temporary compiler cache while the benchmark runs."""
    if not cold:
        yield
        return
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        yield


def variant_ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per T, the paired time ratios of :data:`VARIANT_RATIOS`."""
    rows = []
    for t in report["config"]["seq_lens"]:
        row: dict[str, Any] = {"seq_len": t}
        for key, (a, b) in VARIANT_RATIOS.items():
            row[key] = paired_ratio(
                find_row(report, impl=a, seq_len=t),
                find_row(report, impl=b, seq_len=t),
            )
        rows.append(row)
    return rows


def format_variants(report: dict[str, Any]) -> str:
    """Times (ms), first calls (s), the block masks and the ratios, as text."""
    env, config = report["environment"], report["config"]
    impls = config["impls"]
    mask = config["mask"]
    if config["window"] is not None:
        mask += f" W={config['window']}"
    if config["sinks"] is not None:
        mask += f" sinks={config['sinks']}"
    lines = [
        describe(env),
        f"attention core under {mask}: B={config['batch']} "
        f"H={config['heads']} d_k={config['head_dim']}; median ms of >= "
        f"{config['repeats']} calls ({config['timer']})",
    ]
    rows = []
    for t in config["seq_lens"]:
        found = [find_row(report, impl=i, seq_len=t) for i in impls]
        rows.append(
            [t] + [r and number(r["median_s"], ".2f", 1e-3) for r in found]
        )
    lines += text_table(["T", *impls], rows)
    lines += ["", "first call (s), compiling where compiled:"]
    rows = []
    for t in config["seq_lens"]:
        found = [find_row(report, impl=i, seq_len=t) for i in impls]
        rows.append(
            [t] + [r and number(r["first_call_s"], ".2f") for r in found]
        )
    lines += text_table(["T", *impls], rows)
    lines += ["", "block mask of the variant:"]
    lines += text_table(
        ["T", "build ms", "tiles", "of", "dense MiB"],
        [
            [
                m["seq_len"],
                number(m["block_mask_s"], ".2f", 1e-3),
                m["tiles_computed"],
                m["tiles_total"],
                number(m["dense_mask_bytes"], ".1f", 2**20),
            ]
            for m in report["masks"]
        ],
    )
    lines += ["", "time ratios, median of per-round ratios:"]
    lines += ratio_table(report["ratios"], {"seq_len": "T"})
    return "\n".join(lines)
