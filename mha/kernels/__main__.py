"""``python -m mha.kernels --inspect``: compile every kernel ahead of time.

For each kernel (forward, the two backward kernels, split-KV, paged), GPU
(``sm_80``, the A100; ``sm_90``, the H100), dtype, head size (64, 80, 96,
128, 192, 256 by default) and mask (causal and full), the kernel is compiled
at its default launch settings (the paged kernel: causal only, by its
lengths), without a GPU, and one JSON line is printed:
kernel, arch, dtype, head_dim, causal, key_start, window, block_q, block_k,
num_warps, num_stages, registers, stack_bytes, spill_bytes, shared_bytes,
tensor_core_instructions (``hmma`` + ``hgmma``), hmma, hgmma, hgmma_a_regs,
hgmma_a_smem (the ``HGMMA`` whose A operand is in registers, or in shared
memory) and cubin (the file written to ``--cubin-dir``, or null).
``--output`` also writes every line, with the environment (versions, date,
commit), to one JSON file. See :mod:`mha.kernels.aot`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from argparse import SUPPRESS
from pathlib import Path

from . import INTERPRETED, TRITON_AVAILABLE
from .tiles import INSPECTED_HEAD_DIMS

CHOICES = {
    "arch": ("sm_80", "sm_90"),
    "dtype": ("float16", "bfloat16", "float32"),
    "kernel": (
        "forward",
        "backward_dk_dv",
        "backward_dq",
        "split_kv",
        "paged",
    ),
    "mask": ("causal", "full"),
}


def _names(kind: str):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(text.split(","))
        for name in names:
            if name not in CHOICES[kind]:
                raise argparse.ArgumentTypeError(
                    f"{kind} must be among {', '.join(CHOICES[kind])}, "
                    f"got {name!r}"
                )
        return names

    return parse


def _head_dims(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"head sizes must be integers, e.g. 64,128, got {text!r}"
        ) from None
    if not all(1 <= dim <= 256 for dim in dims):
        raise argparse.ArgumentTypeError(
            f"head sizes must be between 1 and 256, got {text!r}"
        )
    return dims


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mha.kernels``."""
    p = argparse.ArgumentParser(
        prog="python -m mha.kernels",
        description=(
            "Compile the attention kernels ahead of time for NVIDIA GPUs (no "
            "GPU needed) and print, per build, one JSON line with its tiles, "
            "registers, spills, shared memory and tensor-core instructions."
        ),
    )
    p.add_argument(
        "--inspect",
        action="store_true",
        help="compile and inspect every build (the only action)",
    )
    p.add_argument(
        "--arch",
        type=_names("arch"),
        default=CHOICES["arch"],
        help="comma-separated targets: sm_80 (A100), sm_90 (H100); "
        "default both",
    )
    p.add_argument(
        "--dtype",
        type=_names("dtype"),
        default=CHOICES["dtype"],
        help="comma-separated input dtypes; default float16,bfloat16,float32",
    )
    p.add_argument(
        "--head-dim",
        type=_head_dims,
        default=INSPECTED_HEAD_DIMS,
        help="comma-separated head sizes d_k (1 to 256); default "
        + ",".join(map(str, INSPECTED_HEAD_DIMS)),
    )
    p.add_argument(
        "--kernel",
        type=_names("kernel"),
        default=CHOICES["kernel"],
        help="comma-separated kernels; default all five",
    )
    p.add_argument(
        "--mask",
        type=_names("mask"),
        default=CHOICES["mask"],
        help="comma-separated masks: causal (bottom-right), full (no mask); "
        "default both",
    )
    p.add_argument(
        "--key-start",
        action="store_true",
        help="compile the kernels with per-row key starts (a left-padded "
        "batch)",
    )
    p.add_argument(
        "--window",
        action="store_true",
        help="compile the kernels with a sliding window of 4096 keys (a "
        "runtime int: its value is not compiled in), each without and with "
        "per-row key starts, or with them only where --key-start is given",
    )
    p.add_argument(
        "--ladder",
        action="store_true",
        help="compile every rung of the ladder of techniques (forward and "
        "split_kv only; default sm_90, bfloat16, d_k 64 and 128) and add "
        "each row's rung, switches and counts of the instructions they "
        "change",
    )
    p.add_argument(
        "--cubin-dir",
        type=Path,
        help="write each build's cubin (GPU machine code) to this folder",
    )
    p.add_argument(
        "--output",
        type=Path,
        help="also write the rows and the environment to this JSON file",
    )
    # set by the command for the process it starts to compile in
    p.add_argument("--compiling-process", action="store_true", help=SUPPRESS)
    return p


def _environment(args: argparse.Namespace, seconds: float) -> dict:
    import triton

    from ..environment import environment

    found = environment("cpu", ",".join(args.dtype))
    keep = ("torch_version", "python_version", "platform", "date_utc")
    return {
        "triton_version": triton.__version__,
        "ptxas": {
            arch: _ptxas_version(name)
            for arch, name in (
                ("sm_80", "ptxas"),
                ("sm_90", "ptxas_blackwell"),
            )
        },
        **{key: found[key] for key in keep},
        "git_commit": found["git_commit"],
        "git_dirty": found["git_dirty"],
        "cpu_model": found["cpu_model"],
        "seconds": round(seconds, 1),
    }


def _ptxas_version(name: str) -> str:
    import triton

    path = getattr(triton.knobs.nvidia, name).path
    text = subprocess.run(
        [path, "--version"], capture_output=True, text=True, check=True
    ).stdout
    release = [line for line in text.splitlines() if "release" in line]
    return (release or text.strip().splitlines())[-1].strip()


def _in_a_compiling_process(argv: list[str]) -> int:
    """Run this command again with TRITON_INTERPRET=0 and an empty cache.

    The kernels are decorated when first imported (this process may have
    decorated them for the interpreter), and an empty Triton cache makes
    every build compile, so that the time reported is the compiler's.
    """
    cache = tempfile.mkdtemp(prefix="mha-kernels-inspect-")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": cache}
    command = [sys.executable, "-m", "mha.kernels", *argv]
    try:
        done = subprocess.run(
            [*command, "--compiling-process"], env=env, check=False
        )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return done.returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if not args.inspect:
        parser().error("nothing to do: pass --inspect")
    if not TRITON_AVAILABLE:
        print("--inspect needs the triton package (Linux)", file=sys.stderr)
        return 1
    if not args.compiling_process:
        return _in_a_compiling_process(argv)
    if INTERPRETED:  # TRITON_INTERPRET=1 was set by hand
        print("--inspect compiles: unset TRITON_INTERPRET", file=sys.stderr)
        return 1
    from .aot import inspect_builds, inspect_ladder

    if args.cubin_dir is not None:
        args.cubin_dir.mkdir(parents=True, exist_ok=True)
    start, rows = time.perf_counter(), []
    causal = tuple(mask == "causal" for mask in args.mask)
    if args.ladder:
        given = set(argv)
        builds = inspect_ladder(
            args.arch if "--arch" in given else ("sm_90",),
            args.dtype if "--dtype" in given else ("bfloat16",),
            args.head_dim if "--head-dim" in given else (64, 128),
            args.kernel,
            causal,
        )
    else:
        builds = inspect_builds(
            args.arch,
            args.dtype,
            args.head_dim,
            args.kernel,
            args.cubin_dir,
            causal=causal,
            key_start=args.key_start,
            window=args.window,
        )
    for row in builds:
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.output is not None:
        shown = [arg for arg in argv if arg != "--compiling-process"]
        result = {
            "command": "python -m mha.kernels " + " ".join(shown),
            "environment": _environment(args, time.perf_counter() - start),
            "builds": rows,
        }
        partial = args.output.with_name(args.output.name + ".partial")
        partial.write_text(json.dumps(result, indent=1) + "\n")
        partial.replace(args.output)  # never a half-written file
    return 0


if __name__ == "__main__":
    sys.exit(main())
