"""``python -m mha.parallel``: the split layer on N local processes.

``--check`` compares both split layers (by hand and DTensor) with the
single-process layer and prints one JSON line: ``max_abs_diff``,
``grad_max_abs_diff``, ``all_reduce_calls`` and ``bytes_all_reduced`` (per
forward, per process), ``seconds`` (the whole run), and more. The exit status
is 0 only if the differences are below the tolerance of the dtype and each
forward all-reduced exactly once, B * T * D numbers. ``--bench`` times the
forward on 1 process and on N and writes a JSON file for ``benchmarks/``.
``--ring`` splits the *sequence* instead (ring attention,
:mod:`mha.parallel.ring`), compares with dense attention on one process and
prints one JSON line: ``max_abs_diff``, ``grad_max_abs_diff``, the bytes
each process sent and the formula's, each process's (query, key) pairs and
their imbalance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .._validate import check_choice, check_divisible, check_int
from .launch import LaunchError, launch

__all__ = ["run_check", "run_benchmark", "run_ring", "main", "TOLERANCE"]

#: Largest difference from the single-process layer that --check accepts.
TOLERANCE = {"float32": 1e-5, "float64": 1e-10}
ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2}
#: What --ring accepts; bfloat16: within twice PyTorch's own SDPA's error.
RING_TOLERANCE = {"float32": 1e-5, "float64": 1e-12, "bfloat16": None}
#: What changes on GPUs.
ON_GPUS = (
    "--device cuda: the nccl backend instead of gloo and one GPU per process "
    "(torch.cuda.set_device(rank)); ring_attention itself does not change"
)


def run_check(
    nproc: int = 2,
    *,
    batch: int = 2,
    seq_len: int = 8,
    embed_dim: int = 32,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    causal: bool = False,
    seed: int = 0,
    timeout: float = 120.0,
    fail_rank: int | None = None,
    hang_rank: int | None = None,
) -> dict[str, Any]:
    """Launch ``nproc`` processes, compare with one process, summarise.

    ``num_kv_heads`` None: a :class:`mha.MultiHeadAttention`; a number: a
    :class:`mha.GroupedQueryAttention` with that many key/value heads. Bad
    arguments (``num_heads`` not divisible by ``nproc``, ...) raise
    ``ValueError`` / ``TypeError`` before any process starts; a failed or
    hung rank raises :class:`mha.parallel.LaunchError`.
    """
    config = _config(
        "check", nproc, batch, seq_len, embed_dim, num_heads, dtype, device
    )
    config["num_kv_heads"] = _check_kv_heads(num_kv_heads, num_heads, nproc)
    config.update(causal=bool(causal), seed=seed, timeout=timeout)
    config.update(fail_rank=fail_rank, hang_rank=hang_rank)
    start = time.perf_counter()
    ranks, pids = launch(nproc, config, timeout=timeout)
    seconds = time.perf_counter() - start
    return _summary(config, ranks, pids, seconds)


def run_benchmark(
    nproc: int = 2,
    *,
    batch: int = 4,
    seq_len: int = 256,
    embed_dim: int = 512,
    num_heads: int = 8,
    dtype: str = "float32",
    device: str = "cpu",
    repeats: int = 30,
    warmup: int = 5,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Time the split layer on 1 process and on ``nproc``.

    Three runs: 1 process with 1 thread, 1 process with ``nproc`` threads,
    ``nproc`` processes with 1 thread each.
    """
    config = _config(
        "bench", nproc, batch, seq_len, embed_dim, num_heads, dtype, device
    )
    config.update(
        num_kv_heads=None,
        repeats=check_int("repeats", repeats),
        warmup=check_int("warmup", warmup, minimum=0),
        timeout=timeout,
        seed=0,
    )
    from ..environment import environment

    env = environment(device, dtype)  # load average at the start
    runs = []
    for procs, threads in ((1, 1), (1, nproc), (nproc, 1)):
        ranks, _ = launch(
            procs, {**config, "threads": threads}, timeout=timeout
        )
        runs.append(_bench_summary(config, procs, threads, ranks))
    env["load_average_1min_end"] = os.getloadavg()[0]
    return {
        "environment": env,
        "config": {k: config[k] for k in _SHAPE_KEYS + ("repeats", "warmup")},
        "bytes_formula": _formula_bytes(config),
        "runs": runs,
    }


def run_ring(
    nproc: int = 2,
    *,
    batch: int = 2,
    seq_len: int = 13,
    embed_dim: int = 32,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    dtype: str = "float64",
    device: str = "cpu",
    causal: bool = False,
    layout: str = "contiguous",
    seed: int = 0,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """Ring attention over ``nproc`` processes against dense attention.

    The sequence (T = ``seq_len`` positions, any T >= ``nproc``) is split
    by ``layout``; heads of ``embed_dim / num_heads`` features,
    ``num_kv_heads`` key/value heads (None: ``num_heads``).
    """
    nproc = check_int("nproc", nproc)
    sizes = {"batch": batch, "seq_len": seq_len, "embed_dim": embed_dim}
    sizes = {name: check_int(name, value) for name, value in sizes.items()}
    num_heads = check_int("num_heads", num_heads)
    num_kv_heads = check_int(
        "num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads
    )
    head_dim = check_divisible("embed_dim", embed_dim, "num_heads", num_heads)
    check_divisible("num_heads", num_heads, "num_kv_heads", num_kv_heads)
    if seq_len < nproc:
        raise ValueError(
            f"seq_len must be at least nproc ({nproc}), got {seq_len}"
        )
    check_choice("dtype", dtype, tuple(RING_TOLERANCE))
    check_choice("device", device, ("cpu", "cuda"))
    check_choice("layout", layout, ("contiguous", "zigzag"))
    if device == "cuda":
        _check_gpus(nproc)
    case = {
        "name": "ring",
        "batch": sizes["batch"],
        "seq_len": seq_len,
        "heads": num_heads,
        "kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype": dtype,
        "causal": bool(causal),
        "layout": layout,
        "seed": seed,
    }
    config = {"job": "ring", "device": device, "timeout": timeout}
    start = time.perf_counter()
    ranks, pids = launch(nproc, {**config, "cases": [case]}, timeout=timeout)
    seconds = time.perf_counter() - start
    ranks = [r["cases"][0] for r in ranks]
    return _ring_summary(case, nproc, ranks, seconds, pids)


def _ring_summary(case, nproc, ranks, seconds, pids) -> dict[str, Any]:
    """The worst difference over ranks; each rank's bytes and pairs."""
    from .ring import imbalance, ring_bytes

    itemsize = ITEMSIZE[case["dtype"]]
    shape = (case["batch"], case["seq_len"], case["kv_heads"])
    formula = ring_bytes(
        *shape, case["head_dim"], nproc, bytes_per_element=itemsize
    )
    out_diff = max(r["max_abs_diff"] for r in ranks)
    grad_diff = max(r["grad_max_abs_diff"] for r in ranks)
    torch_diffs = [
        max(r["torch_max_abs_diff"][i] for r in ranks) for i in (0, 1)
    ]
    tolerance = RING_TOLERANCE[case["dtype"]]
    limits = [tolerance] * 2 if tolerance else [2 * d for d in torch_diffs]
    sent = [r["forward_bytes"] for r in ranks]
    per_position = 2 * case["batch"] * case["kv_heads"] * case["head_dim"]
    exact = [  # K and V of every part but the next process's, once
        (case["seq_len"] - ranks[(i + 1) % nproc]["local_len"])
        * per_position
        * itemsize
        for i in range(nproc)
    ]
    pairs = [r["pairs_unmasked"] for r in ranks]
    return {
        "job": "ring",
        "nproc": nproc,
        **{k: case[k] for k in ("layout", "causal", "dtype", "batch")},
        **{k: case[k] for k in ("seq_len", "heads", "kv_heads", "head_dim")},
        "local_len": [r["local_len"] for r in ranks],
        "max_abs_diff": out_diff,
        "grad_max_abs_diff": grad_diff,
        "torch_sdpa_max_abs_diff": torch_diffs[0],
        "torch_sdpa_grad_max_abs_diff": torch_diffs[1],
        "tolerance": limits,
        "forward_bytes": sent,
        "backward_bytes": [r["backward_bytes"] for r in ranks],
        "bytes_formula": formula,
        "pairs_unmasked": pairs,
        "pairs_computed": [r["pairs_computed"] for r in ranks],
        "imbalance": imbalance(pairs),
        "on_gpus": ON_GPUS,
        "seconds": round(seconds, 3),
        "pids": pids,
        "ok": out_diff <= limits[0]
        and grad_diff <= limits[1]
        and sent == exact,
    }


_SHAPE_KEYS = ("batch", "seq_len", "embed_dim", "num_heads", "dtype", "device")


def _config(job, nproc, batch, seq_len, embed_dim, num_heads, dtype, device):
    """Check every argument before any process starts."""
    nproc = check_int("nproc", nproc)
    sizes = {
        "batch": batch,
        "seq_len": seq_len,
        "embed_dim": embed_dim,
        "num_heads": num_heads,
    }
    sizes = {name: check_int(name, value) for name, value in sizes.items()}
    check_divisible("embed_dim", embed_dim, "num_heads", num_heads)
    check_divisible("num_heads", num_heads, "nproc", nproc)
    check_choice("dtype", dtype, tuple(TOLERANCE))
    check_choice("device", device, ("cpu", "cuda"))
    if device == "cuda":
        _check_gpus(nproc)
    return {
        "job": job,
        "nproc": nproc,
        "dtype": dtype,
        "device": device,
        **sizes,
    }


def _check_kv_heads(num_kv_heads, num_heads: int, nproc: int) -> int | None:
    """H_kv divides H; N processes split the H_kv heads, or replicate them."""
    if num_kv_heads is None:
        return None
    num_kv_heads = check_int("num_kv_heads", num_kv_heads)
    check_divisible("num_heads", num_heads, "num_kv_heads", num_kv_heads)
    if num_kv_heads % nproc and nproc % num_kv_heads:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must be divisible by nproc "
            f"({nproc}), or divide it (each key/value head replicated)"
        )
    return num_kv_heads


def _check_gpus(nproc: int) -> None:
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < nproc:
        raise ValueError(
            f"nproc must be at most the number of CUDA GPUs ({found}) with "
            f"device='cuda', got {nproc}"
        )


def _formula_bytes(config: dict[str, Any]) -> int:
    """B * T * D * bytes per number: the (B, T, D) output, summed once."""
    B, T, D = config["batch"], config["seq_len"], config["embed_dim"]
    return B * T * D * ITEMSIZE[config["dtype"]]


def _summary(config, ranks, pids, seconds) -> dict[str, Any]:
    """The worst difference over ranks and both versions; rank 0's counts."""
    versions = {
        name: _over_ranks([r[name] for r in ranks])
        for name in ("hand", "dtensor", "dtensor_per_projection")
        if ranks[0][name] is not None
    }
    hand = versions["hand"]
    formula = _formula_bytes(config)
    tolerance = TOLERANCE[config["dtype"]]
    summary = {
        **{k: config[k] for k in ("nproc",) + _SHAPE_KEYS},
        "num_kv_heads": config["num_kv_heads"],
        "causal": config["causal"],
        "max_abs_diff": max(v["max_abs_diff"] for v in versions.values()),
        "grad_max_abs_diff": max(
            v["grad_max_abs_diff"] for v in versions.values()
        ),
        "all_reduce_calls": hand["all_reduce_calls"],
        "bytes_all_reduced": hand["bytes_all_reduced"],
        "bytes_formula": formula,
        "backward_all_reduce_calls": hand["backward_all_reduce_calls"],
        "hand": hand,
        "dtensor": versions.get("dtensor"),
        "dtensor_per_projection": versions.get("dtensor_per_projection"),
        "tolerance": tolerance,
        "seconds": round(seconds, 3),
        "pids": pids,
    }
    summary["ok"] = summary["max_abs_diff"] < tolerance and all(
        v["ranks_agree"]
        and v["grad_max_abs_diff"] < tolerance
        and v["forward_collectives"] == ["all_reduce"]
        and v["bytes_all_reduced"] == formula
        for v in versions.values()
    )
    return summary


def _over_ranks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest difference of any rank; rank 0's counts (all must agree)."""
    merged = {
        key: max(r[key] for r in results) if "diff" in key else value
        for key, value in results[0].items()
    }
    merged["ranks_agree"] = all(
        r[key] == value
        for r in results
        for key, value in results[0].items()
        if "diff" not in key
    )
    return merged


def _bench_summary(config, procs, threads, ranks) -> dict[str, Any]:
    """Medians (the slowest rank's); memory measured and by formula."""
    from .. import counting

    def median(key):
        per_rank = [statistics.median(r[key]) for r in ranks if key in r]
        return max(per_rank) if per_rank else None

    itemsize = ITEMSIZE[config["dtype"]]
    B, T = config["batch"], config["seq_len"]
    D, H = config["embed_dim"], config["num_heads"]
    return {
        "processes": procs,
        "threads_per_process": threads,
        "forward_median_s": median("forward_s"),
        "all_reduce_median_s": median("all_reduce_s"),
        "whole_layer_forward_median_s": median("whole_layer_forward_s"),
        "all_reduce_calls": [r["all_reduce_calls"] for r in ranks],
        "bytes_all_reduced": [r["bytes_all_reduced"] for r in ranks],
        "weight_bytes": [r["weight_bytes"] for r in ranks],
        "weight_bytes_formula": itemsize
        * counting.tensor_parallel_parameters(D, H, procs, bias=True),
        "activation_bytes": [r["activation_bytes"] for r in ranks],
        "activation_bytes_formula": itemsize
        * counting.tensor_parallel_saved_elements(B, T, D, H, procs),
        "forward_s": [r["forward_s"] for r in ranks],
        "all_reduce_s": [r["all_reduce_s"] for r in ranks],
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mha.parallel",
        description="Multi-head attention split by heads (or, with --ring, "
        "by positions) over N local processes (torch.distributed: gloo on "
        "CPUs, tested; NCCL on GPUs, untested).",
    )
    job = p.add_mutually_exclusive_group(required=True)
    job.add_argument(
        "--check",
        action="store_true",
        help="compare with one process, print one JSON line",
    )
    job.add_argument(
        "--bench",
        action="store_true",
        help="time 1 and N processes, write --output",
    )
    job.add_argument(
        "--ring",
        action="store_true",
        help="split the sequence (ring attention), compare with one process",
    )
    job.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    p.add_argument(
        "--nproc", type=int, default=2, help="number of processes (default 2)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--dtype",
        choices=tuple(RING_TOLERANCE),
        help="float32 (default) or float64; --ring: also bfloat16 (default "
        "float64)",
    )
    p.add_argument("--batch", type=int, help="B")
    p.add_argument("--seq-len", type=int, help="T")
    p.add_argument("--embed-dim", type=int, help="D")
    p.add_argument("--heads", type=int, help="H")
    p.add_argument(
        "--kv-heads",
        type=int,
        help="H_kv: a GroupedQueryAttention (default: MultiHeadAttention); "
        "--ring: key/value heads (default H)",
    )
    p.add_argument(
        "--causal",
        action="store_true",
        help="causal self-attention (--check, --ring)",
    )
    p.add_argument(
        "--layout",
        choices=("contiguous", "zigzag"),
        default="contiguous",
        help="--ring: which positions each process holds",
    )
    p.add_argument(
        "--timeout", type=float, help="seconds before every process is stopped"
    )
    p.add_argument(
        "--repeats", type=int, help="timed calls per configuration (--bench)"
    )
    p.add_argument("--output", type=Path, help="JSON file to write (--bench)")
    p.add_argument(
        "--fail-rank",
        type=int,
        help="this rank raises an error (to see a failure)",
    )
    p.add_argument(
        "--hang-rank",
        type=int,
        help="this rank stops responding (to see the timeout)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker is not None:
        from .jobs import worker_main

        worker_main(json.loads(args.worker))
        return 0
    options = {
        key: value
        for key, value in (
            ("batch", args.batch),
            ("seq_len", args.seq_len),
            ("embed_dim", args.embed_dim),
            ("num_heads", args.heads),
            ("timeout", args.timeout),
        )
        if value is not None
    }
    options["device"] = args.device
    if args.dtype is not None or not args.ring:
        options["dtype"] = args.dtype or "float32"
    try:
        if args.ring:
            summary = run_ring(
                args.nproc,
                num_kv_heads=args.kv_heads,
                causal=args.causal,
                layout=args.layout,
                **options,
            )
            print(json.dumps(summary), flush=True)
            return 0 if summary["ok"] else 1
        if args.check:
            summary = run_check(
                args.nproc,
                num_kv_heads=args.kv_heads,
                causal=args.causal,
                fail_rank=args.fail_rank,
                hang_rank=args.hang_rank,
                **options,
            )
            print(json.dumps(summary), flush=True)
            return 0 if summary["ok"] else 1
        if args.repeats is not None:
            options["repeats"] = args.repeats
        results = run_benchmark(args.nproc, **options)
        command = " ".join(sys.argv[1:] if argv is None else argv)
        results["command"] = f"python -m mha.parallel {command}"
        _write(results, args.output)
        return 0
    except (ValueError, TypeError) as error:
        print(
            f"python -m mha.parallel: {type(error).__name__}: {error}",
            file=sys.stderr,
        )
        return 2
    except LaunchError as error:
        print(
            f"python -m mha.parallel: the run failed:\n{error}",
            file=sys.stderr,
        )
        return 1


def _write(results: dict[str, Any], output: Path | None) -> None:
    """Print the runs; write the JSON whole (a temporary file, renamed)."""
    for run in results["runs"]:
        times = ("forward_s", "all_reduce_s")
        print(json.dumps({k: v for k, v in run.items() if k not in times}))
    if output is None:
        return
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, output)
