"""``make gpu-check``: the kernels and models checked and timed on a GPU.

``python -m mha.bench.gpu`` runs, on a machine with a CUDA GPU and only what
its Python already has (torch >= 2.11, triton >= 3.6, transformers >= 5.17;
nothing installed, no virtual environment), in this order, each part within
what is left of one time budget:

1. ``race``: the race grid of :mod:`mha.bench.race` (every rerun bitwise
   equal, errors within twice SDPA's), over worker processes;
2. ``tests``: the unit tests marked ``cuda`` (``pytest -m cuda``);
3. ``attention``: forward and forward+backward TFLOP/s of
   :func:`mha.kernels.triton_attention` beside SDPA's flash, cuDNN and
   efficient kernels and compiled FlexAttention (FlashAttention's grid:
   d 64 and 128, T 1k-16k, B T = 16k, H d = 2048, causal and not), each
   output's error against float32 beside SDPA flash's;
4. ``ladder``: the forward kernel's techniques one rung at a time, and its
   tiles chosen by timing, beside SDPA's cuDNN kernel
   (:mod:`mha.bench.ladder`); CS336's leaderboard shape forward and backward;
5. ``decode``: one decoding step's bandwidth (bytes of keys and values read
   per second) of the split-KV and paged kernels beside SDPA with
   ``enable_gqa``, and the device's copy ceiling;
6. ``model``: ``CausalLM.generate`` per backend beside transformers'
   ``generate`` on a Llama-3.2-1B-shaped model (random weights, bfloat16);
7. ``engine``: :class:`mha.Engine` beside ``generate`` one request at a
   time (time, and whether the tokens are equal: float32 and bfloat16, each
   against its own float32 run).

It writes ``benchmarks/gpu_<device>_<date>.json`` (the environment
included) after every part, and prints one table. Without a GPU it says so
and exits with status 2. TFLOP/s count as FlashAttention counts them:
forward 4 B H T^2 d, halved when causal; forward and backward 3.5 times
that. Times are medians of ``triton.testing.do_bench`` (CUDA events).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

__all__ = ["main", "PARTS", "attention_flops", "run_parts"]

ROOT = Path(__file__).resolve().parents[2]
#: Where everything runs (the tests run the parts on the CPU at toy sizes).
DEVICE = "cuda"
#: The parts, in the order they run.
PARTS = ("race", "tests", "attention", "ladder", "decode", "model", "engine")
#: Decode shapes: (batch, query heads, key/value heads, keys), d = 128.
DECODE_SHAPES = [
    (1, 32, 8, 32768),
    (8, 32, 8, 8192),
    (32, 32, 8, 4096),
    (64, 32, 8, 16384),
    (32, 64, 8, 8192),
    (16, 32, 32, 8192),
]
#: The dtype of every timing (float32 too for the engine's exactness).
DTYPE = torch.bfloat16
DECODE_HEAD_DIM = 128
#: Programs per multiprocessor tried beside the kernels' default of one
#: wave (more splits keep more loads in flight).
DECODE_WAVES = (2, 4, 8)
#: Elements (int16) of the copy that measures the bandwidth ceiling: 2 GiB.
COPY_ELEMENTS = 2**30
MODEL_PROMPT, MODEL_NEW_TOKENS = 512, 64
#: The engine's timed requests, and the smaller ones whose tokens are compared.
ENGINE_WORK = dict(requests=8, seed=0, prompts=(64, 256), new=(16, 32))
EXACT_WORK = dict(requests=8, seed=1, prompts=(8, 96), new=(8, 24))
#: Llama-3.2-1B's shape (its published config.json), random weights.
ONE_B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=16,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=True,
    eos_token_id=None,
    bos_token_id=None,
)


def attention_flops(batch, heads, t, d, causal, backward=False) -> float:
    """FlashAttention's count: 4 B H T^2 d forward (half when causal);
    forward and backward 3.5 times the forward."""
    flops = 4 * batch * heads * t * t * d / (2 if causal else 1)
    return flops * (3.5 if backward else 1.0)


def _median_ms(fn: Callable[[], object], grad_to_none=None) -> float:
    """Median milliseconds of ``fn``: triton.testing.do_bench, CUDA events;
    ``grad_to_none``: tensors whose ``.grad`` is reset before each call
    (a backward then writes its gradients, never adds to old ones)."""
    from triton.testing import do_bench

    return float(
        do_bench(
            fn,
            warmup=10,
            rep=50,
            grad_to_none=grad_to_none,
            return_mode="median",
        )
    )


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


#: torch.compile's limits for a run that compiles FlexAttention and a model
#: for many shapes, grad modes and masks: each compiled function's code
#: (``flex_attention``'s, shared by every wrapper) may compile 64 versions,
#: not torch's 8, and a call past the limit raises, where torch would run
#: it uncompiled (FlexAttention then writes every score out) unannounced.
COMPILER_SETTINGS = {
    "recompile_limit": 64,
    "accumulated_recompile_limit": 4096,
    "fail_on_recompile_limit_hit": True,
}


def configure_compiler() -> dict[str, Any]:
    """Set :data:`COMPILER_SETTINGS` where this torch has them; returns
    those set (the report's environment names them)."""
    import torch._dynamo

    config = torch._dynamo.config
    applied = {}
    for name, value in COMPILER_SETTINGS.items():
        if hasattr(config, name):
            setattr(config, name, value)
            applied[name] = value
    return applied


def _environment(args) -> dict[str, Any]:
    from importlib import metadata

    import triton

    props = torch.cuda.get_device_properties(0)
    try:
        transformers = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers = None
    try:
        driver = (
            subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=driver_version",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        driver = None
    return {
        "device_name": torch.cuda.get_device_name(0),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers,
        "python": sys.version.split()[0],
        "date": dt.date.today().isoformat(),
        "commit": args.commit or os.environ.get("MHA_COMMIT") or _git_commit(),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------------------
# 1. The race grid, over worker processes (each compiles its own cases)


def _race_worker(job: tuple[dict, str]) -> dict:
    import mha.kernels  # noqa: F401  (before anything imports triton)
    from mha.bench import race

    case, device = job
    try:
        return race.race_case(race.RaceCase(**case), device, reruns=3)
    except Exception as error:  # noqa: BLE001 - recorded, with its name
        return {"case": race.RaceCase(**case).name, "error": repr(error)[:500]}


def part_race(budget: float, args) -> dict:
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures import TimeoutError as Timeout
    from multiprocessing import get_context

    from . import race

    grid = race.GPU_GRID if DEVICE == "cuda" else race.CPU_GRID
    workers = max(1, min(args.workers, len(grid)))
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"))
    futures = {pool.submit(_race_worker, (asdict(c), DEVICE)): c for c in grid}
    results = []
    try:
        for future in as_completed(futures, timeout=budget):
            try:
                results.append(future.result())
            except Exception as error:  # noqa: BLE001 - a worker that died
                name = futures[future].name
                results.append({"case": name, "error": repr(error)[:500]})
    except Timeout:  # the cases not run are named, not counted as passed
        pass
    _stop(pool)
    done = {r["case"] for r in results}
    not_run = [c.name for c in grid if c.name not in done]
    failed = {}
    for r in results:
        problems = [r["error"]] if "error" in r else race.failures(r)
        if problems:
            failed[r["case"]] = problems
    worst = _worst_ratios(results)
    differ = sum(
        r[name]["differ"]
        for r in results
        for name in race.TENSORS
        if name in r
    )
    return {
        "cases": len(results),
        "not_run": not_run,
        "failed": failed,
        "elements_differ": differ,
        "worst_error_ratio": worst,
        "results": results,
    }


def _stop(pool) -> None:
    """Cancel what has not started and end the workers still running (a
    case past the budget must not run on beside the next part's timing)."""
    pool.shutdown(wait=False, cancel_futures=True)
    for process in list(getattr(pool, "_processes", {}).values()):
        if process.is_alive():
            process.terminate()
    for process in list(getattr(pool, "_processes", {}).values()):
        process.join(timeout=10)


def _worst_ratios(results) -> dict:
    from .race import TENSORS

    worst = {}
    for name in TENSORS:
        ratios = [
            r[name]["error"] / r[name]["sdpa_error"]
            for r in results
            if name in r and r[name]["sdpa_error"] > 0
        ]
        if ratios:
            worst[name] = round(max(ratios), 3)
    return worst


# ---------------------------------------------------------------------------
# 2. The cuda-marked unit tests


RACE_TEST = "tests/test_kernels_race.py::test_reruns_bitwise_equal_on_the_gpu"


def cuda_test_files(root: Path = ROOT) -> list[str]:
    """The test files with cuda-marked tests, relative to ``root``: only
    they are collected, so that a module another file imports (hypothesis,
    matplotlib) and the GPU's Python lacks stops no cuda test."""
    return sorted(
        path.relative_to(root).as_posix()
        for path in (root / "tests").glob("test_*.py")
        if "pytest.mark.cuda" in path.read_text(encoding="utf-8")
    )


def part_tests(budget: float, args) -> dict:
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        return {"returncode": None, "status": "not run: no pytest here"}
    junit = Path(tempfile.mkdtemp()) / "cuda.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "cuda",
        *cuda_test_files(),
        "-p",
        "no:cacheprovider",
        "--junitxml",
        str(junit),
        "--continue-on-collection-errors",
        # the race grid is part 1
        "--deselect",
        RACE_TEST,
    ]
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(args.workers)]
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}" + os.environ.get("PYTHONPATH", ""),
    }
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=budget,
        )
        tail, code = done.stdout[-3000:], done.returncode
    except subprocess.TimeoutExpired as stopped:
        out = stopped.stdout or b""  # bytes, even with text=True
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        tail, code = f"timed out after {budget:.0f} s\n{out}"[-3000:], None
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", tail, re.M)
    failures = _junit_failures(junit)
    return {
        "returncode": code,
        "summary": summary[-1] if summary else None,
        "failures": failures,
        "tail": tail if code else tail[-600:],
    }


def _junit_failures(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    if not path.exists():
        return {}
    found = {}
    for case in ET.parse(path).iter("testcase"):
        for bad in list(case.iter("failure")) + list(case.iter("error")):
            name = f"{case.get('classname')}::{case.get('name')}"
            found[name] = (bad.get("message") or "")[:400]
    return found


# ---------------------------------------------------------------------------
# 3. Attention: TFLOP/s of every kernel, FlashAttention's grid


def _attention_impls() -> dict[str, Callable]:
    from torch.nn import functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .. import kernels

    def sdpa(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal
                )

        return run

    impls = {
        "triton": lambda q, k, v, causal: kernels.triton_attention(
            q, k, v, causal=causal
        ),
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }
    # one compiled function per mask: one reused across masks can trip
    # Inductor
    try:
        from torch.nn.attention.flex_attention import (
            create_block_mask,
            flex_attention,
        )

        compiled = {
            True: torch.compile(flex_attention),
            False: torch.compile(flex_attention),
        }
        masks = {}

        def flex(q, k, v, causal):
            if not causal:
                return compiled[False](q, k, v)
            t = q.shape[2]
            if t not in masks:
                masks[t] = create_block_mask(
                    lambda b, h, i, j: j <= i,
                    None,
                    None,
                    t,
                    t,
                    device=q.device,
                )
            return compiled[True](q, k, v, block_mask=masks[t])

        impls["flex_compiled"] = flex
    except ImportError:
        pass
    return impls


def part_attention(budget: float, args) -> dict:
    deadline = time.monotonic() + budget
    impls = _attention_impls()
    lengths = args.attention_lengths
    rows, skipped = [], []
    for t in lengths:  # every length for every kind before the next length
        for d in args.head_dims:
            for causal in (False, True):
                batch, heads = max(1, args.tokens // t), args.width // d
                gen = torch.Generator(device=DEVICE).manual_seed(t + d)
                q, k, v, grad = (
                    torch.randn(
                        batch,
                        heads,
                        t,
                        d,
                        device=DEVICE,
                        generator=gen,
                        dtype=DTYPE,
                    )
                    for _ in range(4)
                )
                # the float32 reference: SDPA's efficient kernel
                with torch.no_grad():
                    exact = torch.nn.functional.scaled_dot_product_attention(
                        q.float(), k.float(), v.float(), is_causal=causal
                    )
                shape = {
                    "d": d,
                    "causal": causal,
                    "T": t,
                    "B": batch,
                    "H": heads,
                }
                for name, fn in impls.items():
                    if time.monotonic() > deadline:
                        skipped.append({**shape, "impl": name})
                        continue
                    rows.append(
                        {
                            **shape,
                            "impl": name,
                            **_time_attention(
                                fn, q, k, v, grad, causal, exact
                            ),
                        }
                    )
                _free()
    return {
        "dtype": str(DTYPE)[6:],
        "rows": rows,
        "skipped": skipped,
        "ratios": _attention_ratios(rows),
    }


def _time_attention(fn, q, k, v, grad, causal, exact) -> dict:
    from .race import relative_error

    batch, heads, t, d = q.shape
    row: dict[str, Any] = {}
    try:
        with torch.no_grad():
            out = fn(q, k, v, causal)
            row["error"] = relative_error(out, exact)
            ms = _median_ms(lambda: fn(q, k, v, causal))
        row["forward_ms"] = ms
        row["forward_tflops"] = (
            attention_flops(batch, heads, t, d, causal) / ms / 1e9
        )
    except Exception as error:  # noqa: BLE001 - a backend this GPU lacks
        return {"status": f"{type(error).__name__}: {str(error)[:200]}"}
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def step():
        fn(*leaves, causal).backward(grad)

    try:
        ms = _median_ms(step, grad_to_none=leaves)
        row["forward_backward_ms"] = ms
        row["forward_backward_tflops"] = (
            attention_flops(batch, heads, t, d, causal, backward=True)
            / ms
            / 1e9
        )
    except Exception as error:  # noqa: BLE001
        row["backward_status"] = f"{type(error).__name__}: {str(error)[:200]}"
    row["status"] = "ok"
    return row


def _attention_ratios(rows) -> list[dict]:
    by = {(r["d"], r["causal"], r["T"], r["impl"]): r for r in rows}
    out = []
    for (d, causal, t, impl), row in by.items():
        if impl != "triton" or row.get("status") != "ok":
            continue
        ratio = {"d": d, "causal": causal, "T": t}
        for other in ("sdpa_flash", "sdpa_cudnn", "flex_compiled"):
            theirs = by.get((d, causal, t, other), {})
            for key in ("forward_ms", "forward_backward_ms"):
                if key in row and key in theirs:
                    ratio[f"{key[:-3]}_vs_{other}"] = round(
                        theirs[key] / row[key], 3
                    )
            if "error" in theirs and theirs["error"] > 0:
                ratio[f"error_vs_{other}"] = round(
                    row["error"] / theirs["error"], 3
                )
        out.append(ratio)
    return out


# ---------------------------------------------------------------------------
# 4. Decode bandwidth


def part_decode(budget: float, args) -> dict:
    from torch.nn import functional as F

    from .. import kernels
    from .race import relative_error

    deadline = time.monotonic() + budget
    copy_gbs = _copy_ceiling()
    rows = []
    for batch, heads, kv_heads, t_k in DECODE_SHAPES:
        if time.monotonic() > deadline:
            rows.append(
                {
                    "shape": [batch, heads, kv_heads, t_k],
                    "status": "skipped: time",
                }
            )
            continue
        d = DECODE_HEAD_DIM
        gen = torch.Generator(device=DEVICE).manual_seed(t_k)

        def draw(*shape):
            return torch.randn(
                *shape, device=DEVICE, generator=gen, dtype=DTYPE
            )

        q, k, v = (
            draw(batch, heads, 1, d),
            draw(batch, kv_heads, t_k, d),
            draw(batch, kv_heads, t_k, d),
        )
        kv_bytes = 2 * k.numel() * k.element_size()
        with torch.no_grad():
            exact = F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), enable_gqa=True
            )
        row = {
            "batch": batch,
            "heads": heads,
            "kv_heads": kv_heads,
            "T_k": t_k,
            "d": d,
            "kv_bytes": kv_bytes,
        }
        packed = kernels.Techniques(pack_group=True)
        runs = {
            "sdpa": lambda: F.scaled_dot_product_attention(
                q, k, v, enable_gqa=True
            ),
            "split_kv": lambda: kernels.triton_split_kv_attention(q, k, v),
            "split_kv_packed": lambda: kernels.triton_split_kv_attention(
                q, k, v, techniques=packed
            ),
        }
        for waves in DECODE_WAVES:  # more splits: programs per SM
            splits = _decode_splits(q, k, waves)
            runs[f"split_kv_packed_w{waves}"] = lambda splits=splits: (
                kernels.triton_split_kv_attention(
                    q, k, v, techniques=packed, num_splits=splits
                )
            )
        for block in (16, 64):
            runs[f"paged_{block}"] = _paged_runner(q, k, v, block)
            for waves in DECODE_WAVES:
                runs[f"paged_{block}_w{waves}"] = _paged_runner(
                    q, k, v, block, _decode_splits(q, k, waves)
                )
        for name, run in runs.items():
            try:
                with torch.no_grad():
                    row[f"{name}_error"] = relative_error(run(), exact)
                    ms = _median_ms(run)
                row[f"{name}_gbs"] = kv_bytes / ms / 1e6
            except Exception as error:  # noqa: BLE001
                row[f"{name}_status"] = (
                    f"{type(error).__name__}: {str(error)[:200]}"
                )
        rows.append(row)
        _free()
    return {
        "dtype": str(DTYPE)[6:],
        "copy_ceiling_gbs": copy_gbs,
        "rows": rows,
    }


def _decode_splits(q, k, waves: int) -> int:
    """Key splits that make ``waves`` programs per multiprocessor for a
    decoding step whose rows pack a GQA group (split-KV packed, paged)."""
    from ..kernels.attention import multiprocessors
    from ..kernels.tiles import (
        capability_of,
        default_num_splits,
        default_tiles,
    )

    (batch, heads, t_q, d), (kv_heads, t_k) = q.shape, k.shape[1:3]
    tiles = default_tiles("split_kv", d, q.dtype, capability_of(q.device))
    rows = -(-(heads // kv_heads) * t_q // tiles.block_q)
    return default_num_splits(
        batch * kv_heads * rows,
        t_k,
        tiles.block_k,
        multiprocessors(q.device) * waves,
    )


def _paged_runner(q, k, v, block_size, num_splits=None):
    """Keys and values cut into blocks, put in a pool in shuffled order;
    ``num_splits``: the kernel's default, or this many."""
    from .. import kernels
    from ..kernels.paged import paged_forward

    batch, kv_heads, t_k, d = k.shape
    per_row = -(-t_k // block_size)
    order = torch.randperm(batch * per_row, device=DEVICE)
    table = order.view(batch, per_row).to(torch.int32)

    def pool_of(x):
        padded = torch.nn.functional.pad(
            x, (0, 0, 0, per_row * block_size - t_k)
        )
        blocks = padded.view(batch, kv_heads, per_row, block_size, d)
        blocks = blocks.permute(0, 2, 3, 1, 4).reshape(
            batch * per_row, block_size, kv_heads, d
        )
        pool = torch.empty_like(blocks)
        pool[order] = blocks
        return pool

    k_pool, v_pool = pool_of(k), pool_of(v)
    lens = torch.full((batch,), t_k, dtype=torch.int32, device=DEVICE)
    # max_seq_len: the longest length known on the host, as a serving
    # step knows it; without it every call reads the lengths back
    if num_splits is not None:
        return lambda: paged_forward(
            q, k_pool, v_pool, table, lens, num_splits=num_splits,
            max_seq_len=t_k,
        )[0]  # fmt: skip
    return lambda: kernels.triton_paged_attention(
        q, k_pool, v_pool, table, lens, max_seq_len=t_k
    )


def _copy_ceiling() -> float:
    """GB/s of a 2 GiB device-to-device copy, bytes read plus written."""
    src = torch.empty(
        COPY_ELEMENTS, dtype=torch.int16, device=DEVICE
    ).random_()
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    gbs = 2 * src.numel() * src.element_size() / ms / 1e6
    _free()
    return gbs


def _free() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------
# 5. generate per backend beside transformers', a 1B-shaped model


def _one_b(dtype, layers=None):
    """transformers' model of :data:`ONE_B`'s shape (``layers`` of them),
    random weights, on the device, in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(ONE_B)
    if layers is not None:
        fields["num_hidden_layers"] = layers
    config = LlamaConfig(**fields)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(DEVICE):
        theirs = LlamaForCausalLM(config).to(dtype).eval()
    theirs.generation_config.eos_token_id = None
    theirs.generation_config.pad_token_id = 0
    return config, theirs


def _ours(config, theirs, backend):
    from ..model import CausalLM

    weight = theirs.lm_head.weight
    model = CausalLM.from_config(
        config, attn_backend=backend, device=DEVICE, dtype=weight.dtype
    )
    model.load_state_dict(theirs.state_dict())
    return model.eval()


def _seconds(fn, repeats=1) -> float:
    fn()  # warm-up: compiles kernels
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return min(times)


def part_model(budget: float, args) -> dict:
    deadline = time.monotonic() + budget
    prompt, new = MODEL_PROMPT, MODEL_NEW_TOKENS
    config, theirs = _one_b(DTYPE)
    ids = torch.randint(
        0,
        config.vocab_size,
        (1, prompt),
        generator=torch.Generator().manual_seed(0),
    ).to(DEVICE)
    rows = {}
    with torch.no_grad():
        rows["transformers"] = {
            "seconds": _seconds(
                lambda: theirs.generate(
                    ids,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                )
            )
        }
        reference = theirs.generate(
            ids, max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
        model = _ours(config, theirs, "sdpa")
        for backend, cache in (
            ("sdpa", "static"),
            ("triton", "static"),
            ("flex", "static"),
            ("triton", "paged"),
            ("sdpa", "paged"),
            ("eager", "static"),
        ):
            name = f"{backend}_{cache}"
            if time.monotonic() > deadline:
                rows[name] = {"status": "skipped: time"}
                continue
            model.set_attention_backend(backend)
            try:
                seconds = _seconds(
                    lambda: model.generate(ids, new, cache=cache)
                )
                tokens = model.generate(ids, new, cache=cache)
                rows[name] = {
                    "seconds": seconds,
                    "syncs_per_step": _syncs_per_step(model, ids, cache),
                    "vs_transformers": seconds
                    / rows["transformers"]["seconds"],
                    "first_token_differing": _first_difference(
                        tokens, reference, prompt
                    ),
                }
            except Exception as error:  # noqa: BLE001
                rows[name] = {
                    "status": f"{type(error).__name__}: {str(error)[:300]}"
                }
        if time.monotonic() > deadline:
            rows["sdpa_static_compiled"] = {"status": "skipped: time"}
        else:
            model.set_attention_backend("sdpa")
            rows["sdpa_static_compiled"] = _compiled_row(
                model, ids, new, reference, rows["transformers"]["seconds"]
            )
    _free()
    return {
        "model": "Llama-3.2-1B shape, random weights",
        "dtype": str(DTYPE)[6:],
        "batch": 1,
        "prompt": prompt,
        "new_tokens": new,
        "rows": rows,
    }


def _compiled_row(model, ids, new, reference, theirs: float) -> dict:
    """``generate(compile=True)``: every decoding step one graph, a CUDA
    graph on a GPU. Its time beside transformers', whether its tokens are
    theirs, the CUDA graphs Inductor skipped (and why), and the bytes a
    token reads (every weight once, tied ones once; the whole static cache,
    which each step's graph attends over) per second of generate, prompt
    included, as gpt-fast reports its bandwidth."""
    from torch._dynamo.utils import counters

    try:
        counters["inductor"].clear()
        seconds = _seconds(lambda: model.generate(ids, new, compile=True))
        tokens = model.generate(ids, new, compile=True)
    except Exception as error:  # noqa: BLE001
        return {"status": f"{type(error).__name__}: {str(error)[:300]}"}
    weights = {
        p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()
    }
    attn = model.model.layers[0].self_attn
    slots = ids.shape[0] * (ids.shape[1] + new)  # the static cache's
    per_slot = attn.num_kv_heads * attn.head_dim
    size = model.lm_head.weight.element_size()
    cache = 2 * len(model.model.layers) * slots * per_slot * size
    per_token = sum(weights.values()) + cache
    return {
        "seconds": seconds,
        "vs_transformers": seconds / theirs,
        "first_token_differing": _first_difference(
            tokens, reference, ids.shape[1]
        ),
        "cudagraph_counters": {
            k: v for k, v in counters["inductor"].items() if "cudagraph" in k
        },
        "bytes_per_token": per_token,
        "achieved_gbs": per_token * new / seconds / 1e9,
        "copy_ceiling_gbs": _measured(_copy_ceiling),
    }


def _measured(fn: Callable[[], float]) -> float | str:
    """``fn()``, or what stopped it (the row's other numbers are kept)."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - recorded, with its name
        return f"{type(error).__name__}: {str(error)[:200]}"


def _syncs_per_step(model, ids, cache: str) -> int | None:
    """The synchronising CUDA calls of one decoding step after the prompt,
    as torch's sync debug mode reports them (each a wait for every queued
    kernel); None off a GPU."""
    if not ids.is_cuda:
        return None
    caches = model.new_caches(1, ids.shape[1] + 2, kind=cache)
    model(ids, None, None, caches, 1)  # the prompt
    step = ids[:, -1:]
    model(step, None, None, caches, 1)  # a first step: allocations settle
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model(step, None, None, caches, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def _first_difference(a, b, start=0) -> int | None:
    """The first generated position where two token sequences part, or None."""
    a, b = a[0, start:].tolist(), b[0, start:].tolist()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


# ---------------------------------------------------------------------------
# 6. The engine beside one request at a time


def _workload(requests, seed=0, prompts=(64, 256), new=(16, 32)):
    vocab = ONE_B["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # noqa: E731
    return [
        (
            torch.randint(0, vocab, (draw(*prompts),), generator=g).tolist(),
            draw(*new),
        )
        for _ in range(requests)
    ]


def _engine_tokens(model, work):
    from ..serving import Engine

    blocks = sum(-(-(len(p) + n) // 16) for p, n in work)
    engine = Engine(
        model, num_blocks=blocks, block_size=16, max_num_batched_tokens=512
    )
    ids = [engine.add_request(p, n) for p, n in work]
    done = engine.run()
    return [done[i] for i in ids]


def _alone_tokens(model, work):
    return [
        model.generate(torch.tensor([p], device=DEVICE), n)[
            0, len(p) :
        ].tolist()
        for p, n in work
    ]


def _parting(xs, ys):
    """Per request: the first new token where two runs part (None: equal)."""
    out = []
    for x, y in zip(xs, ys):
        out.append(
            next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
        )
    return out


def part_engine(budget: float, args) -> dict:
    deadline = time.monotonic() + budget
    result: dict[str, Any] = {}
    work = _workload(**ENGINE_WORK)
    with torch.no_grad():
        config, theirs = _one_b(DTYPE)
        model = _ours(config, theirs, "triton")
        result["timing"] = {
            "requests": len(work),
            "model": "1B shape, bfloat16, triton backend",
            "engine_s": _seconds(
                lambda: _engine_tokens(model, work), repeats=1
            ),
            "one_by_one_s": _seconds(
                lambda: _alone_tokens(model, work), repeats=1
            ),
        }
        _free()
        if time.monotonic() > deadline:
            result["exactness"] = {"status": "skipped: time"}
            return result
        # Exactness on a 4-layer model of the same shape, float32 then 16-bit
        small = _workload(**EXACT_WORK)
        tokens = {}
        for dtype in (torch.float32, DTYPE):
            config, theirs = _one_b(dtype, layers=4)
            for backend in ("triton", "sdpa"):
                model = _ours(config, theirs, backend)
                name = f"{backend}_{str(dtype)[6:]}"
                tokens[name] = (
                    _engine_tokens(model, small),
                    _alone_tokens(model, small),
                )
            _free()
        for name, (engine, alone) in tokens.items():
            base = tokens[name.split("_")[0] + "_float32"]
            result[name] = {
                "requests_equal": sum(
                    p is None for p in _parting(engine, alone)
                ),
                "engine_vs_alone_parts_at": _parting(engine, alone),
                "engine_vs_float32_engine": _parting(engine, base[0]),
                "alone_vs_float32_alone": _parting(alone, base[1]),
            }
        result["requests"] = len(small)
    return result


# ---------------------------------------------------------------------------
# Driver


def part_ladder(budget: float, args) -> dict:
    """The ladder of techniques and the tiles (:mod:`mha.bench.ladder`)."""
    from .ladder import part_ladder as run

    return run(budget, args)


PART_RUNNERS = {
    "race": part_race,
    "tests": part_tests,
    "attention": part_attention,
    "ladder": part_ladder,
    "decode": part_decode,
    "model": part_model,
    "engine": part_engine,
}
#: Each part's share of the budget, at most (what a part leaves goes on).
SHARES = {
    "race": 0.2,
    "tests": 0.1,
    "attention": 0.28,
    "ladder": 0.14,
    "decode": 0.08,
    "model": 0.12,
    "engine": 0.08,
}


def run_parts(args, report: dict, write: Callable[[], None]) -> None:
    """Run the chosen parts in order, each within its share of what is left."""
    start = time.monotonic()
    parts = [p for p in PARTS if p in args.parts]
    for i, part in enumerate(parts):
        left = args.budget - (time.monotonic() - start)
        share = sum(SHARES[p] for p in parts[i:])
        budget = max(5.0, left * SHARES[part] / share)
        print(
            f"[gpu-check] {part}: up to {budget:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        began = time.monotonic()
        try:
            report[part] = PART_RUNNERS[part](budget, args)
        except Exception as error:  # noqa: BLE001 - the other parts still run
            import traceback

            report[part] = {
                "status": "failed",
                "error": traceback.format_exc()[-2000:],
            }
            print(
                f"[gpu-check] {part} failed: {error!r}",
                file=sys.stderr,
                flush=True,
            )
        report[part]["seconds"] = round(time.monotonic() - began, 1)
        write()


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float as None: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def checks_passed(report: dict, parts) -> bool:
    """Whether the checks among ``parts`` passed: every case of the race
    grid run and none failed, and the cuda tests' pytest exited 0 (a run
    cut short by its budget has not passed)."""
    race = report.get("race", {})
    race_ok = (
        not race.get("failed", {"": 1}) and not race.get("not_run", [""])
        if "race" in parts
        else True
    )
    tests_ok = (
        report.get("tests", {}).get("returncode") == 0
        if "tests" in parts
        else True
    )
    return race_ok and tests_ok


def format_summary(report: dict) -> str:
    """The one table: what was checked and measured."""
    env = report["environment"]
    lines = [
        f"gpu-check on {env['device_name']} (torch {env['torch']}, triton "
        f"{env['triton']}, transformers {env['transformers']})"
    ]
    race = report.get("race", {})
    if "cases" in race:
        lines.append(
            f"race grid: {race['cases']} cases, {len(race['failed'])} failed, "
            f"{len(race['not_run'])} not run (time), "
            f"{race['elements_differ']} elements differ between reruns; worst "
            f"error / SDPA's: {race['worst_error_ratio']}"
        )
    tests = report.get("tests", {})
    if "summary" in tests or "status" in tests:
        lines.append(f"cuda tests: {tests.get('summary') or tests['status']}")
    for ratio in report.get("attention", {}).get("ratios", []):
        cells = " ".join(
            f"{k}={v}"
            for k, v in ratio.items()
            if k not in ("d", "causal", "T")
        )
        lines.append(
            f"attention d={ratio['d']} causal={ratio['causal']} "
            f"T={ratio['T']}: {cells}"
        )
    ladder = report.get("ladder", {})
    for ratio in ladder.get("ratios", []):
        cells = " ".join(
            f"{k}={v}" for k, v in ratio.items() if k.startswith("vs_")
        )
        lines.append(
            f"ladder d={ratio['d']} causal={ratio['causal']} T={ratio['T']} "
            f"{ratio['rung']}: {cells}"
        )
    for best in ladder.get("best_tiles", []):
        lines.append(f"fastest tiles: {best}")
    if "cs336" in ladder:
        lines.append(f"cs336: {ladder['cs336']}")
    for row in ladder.get("gqa_backward", []):
        lines.append(f"gqa backward: {row}")
    decode = report.get("decode", {})
    if "rows" in decode:
        lines.append(
            f"decode (copy ceiling {decode['copy_ceiling_gbs']:.0f} GB/s):"
        )
        for row in decode["rows"]:
            rates = " ".join(
                f"{k[:-4]}={row[k]:.0f}" for k in row if k.endswith("_gbs")
            )
            lines.append(
                f"  B={row.get('batch')} H={row.get('heads')}/"
                f"{row.get('kv_heads')} T_k={row.get('T_k')}: {rates} GB/s"
            )
    for name, row in report.get("model", {}).get("rows", {}).items():
        lines.append(f"generate {name}: {row}")
    for name, row in report.get("engine", {}).items():
        lines.append(f"engine {name}: {row}")
    for part in PARTS:
        if report.get(part, {}).get("status") == "failed":
            lines.append(f"{part}: FAILED\n{report[part]['error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mha.bench.gpu", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="(default: all)",
    )
    add(
        "--budget",
        type=float,
        default=420.0,
        help="seconds for every part together (default 420)",
    )
    add(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="processes for the race grid and tests",
    )
    add(
        "--attention-lengths",
        type=int,
        nargs="+",
        default=[4096, 16384, 1024, 8192, 2048],
    )
    add("--head-dims", type=int, nargs="+", default=[64, 128])
    add(
        "--ladder-lengths",
        type=int,
        nargs="+",
        default=[4096, 16384, 1024],
        help="T of the ladder's shapes (each rung compiles once)",
    )
    add(
        "--tokens",
        type=int,
        default=16384,
        help="B T of every attention shape",
    )
    add("--width", type=int, default=2048, help="H d of every attention shape")
    add(
        "--output",
        help="the JSON file (default benchmarks/gpu_<device>_<date>.json)",
    )
    add("--copy-to", help="also write the JSON into this folder")
    add("--commit", help="the commit measured (default: $MHA_COMMIT or git)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu-check needs a CUDA GPU: torch.cuda.is_available() is False "
            "here (nothing was checked)",
            file=sys.stderr,
        )
        return 2
    import mha.kernels  # noqa: F401  (before triton: see mha.kernels)

    report = {"environment": _environment(args), "budget_s": args.budget}
    report["environment"]["compiler"] = configure_compiler()
    name = re.sub(
        r"[^a-z0-9]+", "_", report["environment"]["device_name"].lower()
    ).strip("_")
    path = Path(
        args.output
        or ROOT
        / "benchmarks"
        / f"gpu_{name}_{report['environment']['date']}.json"
    )

    def write() -> None:
        text = json.dumps(_finite(report), indent=1, default=str) + "\n"
        targets = [path]
        if args.copy_to:
            targets.append(Path(args.copy_to) / path.name)
        for target in targets:  # whole or not at all: a new file, renamed
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".partial")
            partial.write_text(text)
            os.replace(partial, target)

    run_parts(args, report, write)
    print(format_summary(report))
    print(f"written: {path}")
    return 0 if checks_passed(report, args.parts) else 1


if __name__ == "__main__":
    sys.exit(main())
