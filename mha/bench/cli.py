"""The command line: ``python -m mha.bench COMMAND`` (layer, decode, variants,
model, serve).

A subcommand is a benchmark: its registry, its ``run`` function (named after
whose keyword arguments the options are), its table, the common options
(:func:`_common`) and its own. ``layer`` is the default.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from . import decode, layer, model, serve, variants
from .registry import Implementation, implementation_table
from .report import write_results
from .timing import DEVICES, DTYPES, log

__all__ = ["main", "load", "COMMANDS"]

#: The subcommands; the first is the default.
COMMANDS = ("layer", "decode", "variants", "model", "serve")


def _numbers(values: Sequence[int]) -> str:
    return " ".join(map(str, values))


def _json_path(text: str) -> str:
    if not text.lower().endswith(".json"):
        raise argparse.ArgumentTypeError(f"must end in .json, got {text!r}")
    return text


def _command(
    commands: argparse._SubParsersAction,
    name: str,
    about: tuple[str, str],
    registry: dict[str, Implementation],
    run: Callable[..., dict],
    table: Callable[[dict], str],
    lengths: tuple[str, str] | None,
) -> Callable[..., object]:
    """A subcommand with the common options; returns its ``add_argument``.

    ``about``: help and description; ``lengths``: the run's keyword for
    ``--seq-lens`` and its help (None: no ``--seq-lens``). An option left
    out (None) leaves run's default.
    """
    parser = commands.add_parser(name, help=about[0], description=about[1])
    parser.set_defaults(run=run, table=table, registry=registry)
    add = parser.add_argument
    # fmt: off
    add("--device", choices=DEVICES, help="auto: cuda if there is one, "
        "else cpu (default: cpu)")
    add("--dtype", choices=tuple(DTYPES), help="(default: float32)")
    add("--heads", type=int, help="H (default: 8)")
    add("--head-dim", type=int, help="d_k; D = H d_k (default: 64)")
    if lengths is not None:  # serve names its own (--requests)
        add("--seq-lens", dest=lengths[0], type=int, nargs="+", metavar="T",
            help=lengths[1])
    add("--impl", dest="impls", nargs="*", choices=tuple(registry),
        metavar="NAME", help="entries to run (default: those the device "
        "runs by default); --impl alone lists them")
    add("--repeats", type=int, help="timed calls, at least (default: 5)")
    add("--warmup", type=int, help="untimed calls first, at least 1; the "
        "first tells whether the entry can run here (default: 1)")
    add("--min-time", type=float, help="more rounds for fast cases, until "
        "one configuration's rounds take this long (default: 1.0 s)")
    add("--max-repeats", type=int, help="at most this many rounds "
        "(default: 50)")
    add("--threads", type=int, help="torch intra-op threads (default: "
        "torch's, from OMP_NUM_THREADS)")
    add("--output", type=_json_path, metavar="FILE.json",
        help="write the report, with its environment, as JSON")
    add("--quiet", action="store_true", default=None,
        help="no progress lines on stderr")
    add("--load", action="append", metavar="FILE.py", help="a Python file "
        "run first, whose entries (mha.bench.core, mha.bench.register) "
        "join the benchmark's, for --impl to name: your own kernel beside "
        "the book's; repeatable")
    # fmt: on
    return add


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mha.bench",
        description="Time attention implementations side by side, in "
        "interleaved rounds; print a table and paired time ratios.",
        epilog="layer is the default. 'python -m mha.bench COMMAND --help' "
        "lists a benchmark's options, 'COMMAND --impl' its entries.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    # fmt: off
    add = _command(
        commands, "layer",
        ("one self-attention layer (B x T x D) against T",
         "Time one multi-head self-attention layer (scope 'layer'), its "
         "attention core on projected (B, H, T, d_k) inputs ('core') and its "
         "projections, in several implementations."),
        layer.IMPLEMENTATIONS, layer.run_benchmark, layer.format_table,
        ("seq_lens", f"sequence lengths (default: "
         f"{_numbers(layer.DEFAULT_SEQ_LENS)}; with --memory "
         f"{_numbers(layer.MEMORY_SEQ_LENS)})"),
    )
    add("--batch", type=int, metavar="B", help="sequences per call "
        "(default: 8; with --memory 1)")
    add("--causal", action="store_true", default=None,
        help="causal self-attention (core FLOPs halved)")
    add("--memory", action="store_true", default=None, help="also the "
        "peak extra memory of one call: the CUDA allocator's peak, or the "
        "peak RSS in a fresh process")
    add("--numpy-max-len", type=int, metavar="T", help="skip the NumPy "
        "entries above this T (default: 512; at T = 2048, B = 8 one call "
        "takes tens of seconds on 2 cores)")
    add = _command(
        commands, "decode",
        ("one generated token after a context of T tokens",
         "Time one decoding step of mha.GroupedQueryAttention after a "
         "context of T tokens, with and without caches, beside transformers' "
         "LlamaAttention with its caches (same weights), for several numbers "
         "of key/value heads."),
        decode.DECODE_IMPLEMENTATIONS, decode.run_decode_benchmark,
        decode.format_decode_table,
        ("contexts", "context lengths (default: "
         f"{_numbers(decode.DECODE_CONTEXTS)})"),
    )
    add("--batch", dest="batches", type=int, nargs="+", metavar="B",
        help=f"batch sizes (default: {_numbers(decode.DECODE_BATCHES)})")
    add("--kv-heads", type=int, nargs="+", metavar="H_KV", help="key/value "
        "head counts, each dividing H (default: H, H/4, 1: MHA, GQA, MQA)")
    add = _command(
        commands, "variants",
        ("the attention core under a variant's mask against T",
         "Time the attention core (B, H, T, d_k) under the mask of an "
         "attention variant of mha.variants: compiled FlexAttention with its "
         "block mask, SDPA with the same mask as a dense (T, T) tensor, and "
         "the causal pair; also the first (compiling) call, the block mask's "
         "build time and each output's difference from the dense mask's."),
        variants.VARIANT_IMPLEMENTATIONS, variants.run_variants_benchmark,
        variants.format_variants,
        ("seq_lens", "sequence lengths (default: "
         f"{_numbers(variants.VARIANT_SEQ_LENS)})"),
    )
    add("--batch", type=int, metavar="B", help="sequences per call "
        "(default: 1)")
    add("--mask", choices=variants.MASKS, help="the variant "
        "(default: sliding_window)")
    add("--window", type=int, metavar="W", help="keys in the window "
        "(default: 256)")
    add("--sinks", type=int, help="with --mask sink_window: first keys "
        "every query keeps (default: 4)")
    add("--warm-compile", dest="cold_compile", action="store_false",
        default=None, help="compile with the compiler's usual cache (by "
        "default an empty temporary one, so first calls include the whole "
        "build)")
    add = _command(
        commands, "model",
        ("a whole model's generate, tokens/s per attention backend",
         "Time greedy generate of mha.CausalLM (a small Llama with random "
         "weights) on each attention backend and cache, beside transformers' "
         "generate on the same weights."),
        model.MODEL_IMPLEMENTATIONS, model.run_model_benchmark,
        model.format_model_table,
        ("prompts", "prompt lengths (default: 32)"),
    )
    add("--batch", type=int, metavar="B", help="prompts per call "
        "(default: 1)")
    add("--new-tokens", type=int, metavar="N", help="tokens generated per "
        "call (default: 32)")
    add = _command(
        commands, "serve",
        ("N requests: the engine, one by one, a padded static batch",
         "Serve N requests with a mix of prompt lengths and new tokens on a "
         "small Llama (random weights): mha.Engine (continuous batching "
         "over a paged pool), generate on each request in turn, and one "
         "generate of the left-padded batch; tokens/s, time ratios, blocks."),
        serve.SERVE_IMPLEMENTATIONS, serve.run_serve_benchmark,
        serve.format_serve,
        None,
    )
    add("--requests", type=int, nargs="+", metavar="N", help="numbers of "
        "requests (default: 8)")
    add("--mix", choices=tuple(serve.MIXES), help="the requests' lengths: "
        "chat, prompts of 8-128 tokens and 8-64 new; short_prompts, 8-32 "
        "and 32-128 (default: chat)")
    add("--budget", type=int, metavar="TOKENS", help="the engine's "
        "max_num_batched_tokens (default: 256)")
    # fmt: on
    return parser


def _loaded_files(argv: Sequence[str]) -> list[str]:
    """The files named by ``--load`` (``--load F`` or ``--load=F``)."""
    files = []
    for i, word in enumerate(argv):
        if word == "--load" and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif word.startswith("--load="):
            files.append(word.split("=", 1)[1])
    return files


def load(path: str) -> None:
    """Run the Python file ``path``, whose decorated entries register
    themselves (:func:`mha.bench.core`, :func:`mha.bench.register`); its
    folder is importable while it runs, for its own modules."""
    file = Path(path)
    if file.suffix != ".py" or not file.is_file():
        raise ValueError(f"--load takes a Python file (.py), got {path!r}: "
                         "no such file")  # fmt: skip
    folder = str(file.resolve().parent)
    sys.path.insert(0, folder)
    try:
        runpy.run_path(str(file), run_name="__mha_bench_load__")
    except Exception as error:
        raise ValueError(
            f"--load {path}: running it raised {type(error).__name__}: {error}"
        ) from error
    finally:
        sys.path.remove(folder)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; see ``python -m mha.bench --help``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv.insert(0, COMMANDS[0])
    try:  # before the parser: the files' entries are --impl's choices
        for path in _loaded_files(argv):
            load(path)
    except ValueError as error:
        print(f"python -m mha.bench: error: {error}", file=sys.stderr)
        return 2
    parser = _parser()
    args = parser.parse_args(argv)
    if args.impls == []:
        print(implementation_table(args.registry))
        return 0
    options = {
        key: value
        for key, value in vars(args).items()
        if value is not None
        and key
        not in ("command", "run", "table", "registry", "output", "load")
    }
    try:
        report = args.run(**options)
    except ValueError as error:
        parser.error(str(error))
    report["environment"]["command"] = "python -m mha.bench " + " ".join(argv)
    print(args.table(report))
    if args.output:
        log(f"wrote {write_results(report, args.output)}", bool(args.quiet))
    return 0
