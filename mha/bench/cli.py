"""The command line: ``python -m mha.bench``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .config import DTYPES
from .decode import (
    DECODE_BATCHES,
    DECODE_CONTEXTS,
    format_decode_table,
    run_decode_benchmark,
)
from .registry import (
    DECODE_IMPLEMENTATIONS,
    IMPLEMENTATIONS,
    implementation_table,
)
from .report import format_table, write_results
from .run import DEFAULT_SEQ_LENS, MEMORY_SEQ_LENS, _log, run_benchmark
from .timing import cpu_peak_probe

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mha.bench",
        description=(
            "Time one multi-head self-attention layer "
            "(B x T x D, D = heads x head-dim) in several implementations, "
            "print a table and the ratios mha_module/sdpa_bare and "
            "torch_mha/mha_module, and optionally write every figure with "
            "the environment to JSON or CSV."
        ),
        epilog=(
            "Implementations: "
            + ", ".join(IMPLEMENTATIONS)
            + ". Scope 'layer' times the whole layer, "
            "'core' only F.scaled_dot_product_attention on projected "
            "(B, H, T, d_k) inputs, 'projections' the four linear maps. "
            "Examples: python -m mha.bench --device cpu;  "
            "python -m mha.bench --memory "
            "--output benchmarks/cpu_memory.json;  "
            "python -m mha.bench --device cuda --dtype bfloat16 "
            "--output gpu.json;  "
            "python -m mha.bench --decode --output decode.json "
            "(time per generated token against context: "
            + ", ".join(DECODE_IMPLEMENTATIONS)
            + ")"
        ),
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default="cpu",
        help="where to run; auto = cuda if available, else cpu (default: cpu)",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="float32",
        help="(default: float32)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=None,
        metavar="B",
        help="B, sequences per call (default: 8; 1 with --memory; "
        f"{' and '.join(map(str, DECODE_BATCHES))} with --decode, which "
        "takes several)",
    )
    parser.add_argument("--heads", type=int, default=8, help="H (default: 8)")
    parser.add_argument(
        "--head-dim",
        type=int,
        default=64,
        help="d_k; D = heads x head-dim (default: 64)",
    )
    parser.add_argument(
        "--seq-lens",
        type=int,
        nargs="+",
        default=None,
        metavar="T",
        help="sequence lengths (default: "
        f"{' '.join(map(str, DEFAULT_SEQ_LENS))}; "
        f"{' '.join(map(str, MEMORY_SEQ_LENS))} with --memory); with "
        "--decode the context lengths (default: "
        f"{' '.join(map(str, DECODE_CONTEXTS))})",
    )
    parser.add_argument(
        "--decode",
        action="store_true",
        help="time one generated token after a context of T tokens: no "
        "cache, the concatenating and the preallocated cache of "
        "mha.GroupedQueryAttention, and transformers' LlamaAttention with "
        "its DynamicCache and StaticCache, for several numbers of key/value "
        "heads (--kv-heads); JSON output only",
    )
    parser.add_argument(
        "--kv-heads",
        type=int,
        nargs="+",
        default=None,
        metavar="H_KV",
        help="with --decode: key/value head counts, each dividing --heads "
        "(default: heads, heads/4, 1: MHA, GQA, MQA)",
    )
    parser.add_argument(
        "--impl",
        nargs="*",
        choices=tuple(IMPLEMENTATIONS) + tuple(DECODE_IMPLEMENTATIONS),
        default=None,
        metavar="NAME",
        help="implementations to run (default: those the device offers; "
        "on the CPU every one but sdpa_efficient and sdpa_cudnn); "
        "--impl alone lists them",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed calls per implementation and T, at least (default: 5)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed calls before timing, at least 1: the first one also "
        "checks that the implementation can run here (default: 1)",
    )
    parser.add_argument(
        "--min-time",
        type=float,
        default=1.0,
        help="more rounds of calls for fast configurations, until the timed "
        "rounds of a T take this many seconds (default: 1.0)",
    )
    parser.add_argument(
        "--max-repeats",
        type=int,
        default=50,
        help="cap on timed calls (default: 50)",
    )
    parser.add_argument(
        "--causal",
        action="store_true",
        help="causal self-attention (core FLOPs halved)",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="also measure peak extra memory per (impl, T): CUDA allocator "
        "peak on a GPU, peak RSS in a fresh process on the CPU; defaults "
        "become B=1 and T up to 4096",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's, from "
        "OMP_NUM_THREADS); NumPy's BLAS threads follow OMP_NUM_THREADS / "
        "OPENBLAS_NUM_THREADS set before start",
    )
    parser.add_argument(
        "--numpy-max-len",
        type=int,
        default=512,
        help="skip the NumPy implementations above this T; at T = 2048, "
        "B = 8 one call takes tens of seconds on 2 cores (default: 512)",
    )
    parser.add_argument(
        "--output",
        nargs="+",
        default=(),
        metavar="FILE",
        help="write the results to FILE(s): .json or .csv by extension",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress lines on stderr"
    )
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; see ``python -m mha.bench --help``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.memory_probe:
        print(json.dumps(cpu_peak_probe(json.loads(args.memory_probe))))
        return 0
    if args.impl == []:
        print(implementation_table())
        print()
        print(implementation_table(DECODE_IMPLEMENTATIONS))
        return 0
    if args.decode:
        return _decode(parser, args, argv)
    for output in args.output:
        if Path(output).suffix.lower() not in (".json", ".csv"):
            parser.error(f"--output must end in .json or .csv, got {output!r}")
    if args.batch is not None and len(args.batch) != 1:
        parser.error("--batch takes one value (several only with --decode)")
    if args.kv_heads is not None:
        parser.error("--kv-heads goes with --decode")
    if args.impl and any(i in DECODE_IMPLEMENTATIONS for i in args.impl):
        parser.error("decode implementations (--impl) go with --decode")
    batch = (
        args.batch[0] if args.batch is not None else (1 if args.memory else 8)
    )
    seq_lens = (
        args.seq_lens
        if args.seq_lens is not None
        else list(MEMORY_SEQ_LENS if args.memory else DEFAULT_SEQ_LENS)
    )
    try:
        report = run_benchmark(
            device=args.device,
            dtype=args.dtype,
            batch=batch,
            heads=args.heads,
            head_dim=args.head_dim,
            seq_lens=seq_lens,
            impls=args.impl,
            repeats=args.repeats,
            warmup=args.warmup,
            min_time=args.min_time,
            max_repeats=args.max_repeats,
            causal=args.causal,
            memory=args.memory,
            threads=args.threads,
            numpy_max_len=args.numpy_max_len,
            quiet=args.quiet,
        )
    except ValueError as error:
        parser.error(str(error))
    return _report(report, format_table, args, argv)


def _decode(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    argv: Sequence[str] | None,
) -> int:
    """``--decode``: time per generated token; JSON output."""
    for output in args.output:
        if Path(output).suffix.lower() != ".json":
            parser.error(
                f"--output with --decode must end in .json, got {output!r}"
            )
    if args.memory:
        parser.error("--memory and --decode do not go together")
    if args.impl and any(i not in DECODE_IMPLEMENTATIONS for i in args.impl):
        parser.error(
            "with --decode, --impl takes " + ", ".join(DECODE_IMPLEMENTATIONS)
        )
    try:
        report = run_decode_benchmark(
            device="cpu" if args.device == "auto" else args.device,
            dtype=args.dtype,
            batches=args.batch or DECODE_BATCHES,
            heads=args.heads,
            head_dim=args.head_dim,
            kv_heads=args.kv_heads,
            contexts=args.seq_lens or DECODE_CONTEXTS,
            impls=args.impl,
            repeats=args.repeats,
            warmup=args.warmup,
            min_time=args.min_time,
            max_repeats=args.max_repeats,
            threads=args.threads,
            quiet=args.quiet,
        )
    except ValueError as error:
        parser.error(str(error))
    return _report(report, format_decode_table, args, argv)


def _report(
    report: dict,
    table: Callable[[dict], str],
    args: argparse.Namespace,
    argv: Sequence[str] | None,
) -> int:
    """Record the command line, print the table, write the files."""
    report["environment"]["command"] = "python -m mha.bench " + " ".join(
        sys.argv[1:] if argv is None else list(argv)
    )
    print(table(report))
    for output in args.output:
        written = write_results(report, output)
        _log(f"wrote {written}", args.quiet)
    return 0
