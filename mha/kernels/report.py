"""How your own Triton kernel compiles for the A100 and the H100.

:func:`compile_report` calls a launcher once and records every Triton
kernel it launches (the kernel's source, the arguments' dtypes, shapes and
strides, the constexprs, warps and stages) without running it: nothing is
launched, in Triton's interpreter or on a GPU, so example tensors on the CPU
serve on either machine (a kernel compiled for the GPU cannot read them).
It compiles each kernel ahead of time for sm_80 and sm_90 and returns one
row per build, with the columns of ``python -m mha.kernels --inspect``:
warps and stages, registers, spills, shared memory and tensor-core
instructions, and ``warnings`` in words (:func:`build_warnings`): a spill,
what the registers figure of a spilling build means, shared memory beyond
what one program may use. Where the launcher's first arguments are q, k and
v, the book's forward kernel is compiled for the same shapes, beside it.
:func:`format_report` prints the rows as a table.

The registers figure is ptxas's own (``cuobjdump -res-usage`` on the cubin,
checked against ``ptxas -v``): the registers it allocated per thread. Where
a build spills, that is not what the code needs: ptxas either used every
register a thread may have (:func:`register_limit`) and spilled the rest, or,
where it spills much more, kept most values in local memory and counts only
the registers it still uses (32 or 64 where a tile far too large for the
registers spills), well below the limit.

A kernel decorated while ``TRITON_INTERPRET=1`` cannot be compiled in the
same process, so the compiling happens in a child process that rebuilds
the kernels from their source with the interpreter off (:func:`main`,
``python -m mha.kernels.report``, reads the launches as JSON on stdin).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .tiles import SHARED_LIMIT

__all__ = [
    "compile_report",
    "build_warnings",
    "register_limit",
    "format_report",
    "capture_launches",
    "kernel_source",
]

# Launch options a kernel call takes besides its parameters.
OPTIONS = (
    "num_warps",
    "num_stages",
    "num_ctas",
    "maxnreg",
    "enable_fp_fusion",
)
# The constexpr names the tile sizes go by (ours; Triton's tutorials').
TILE_NAMES = {
    "block_q": ("BLOCK_Q", "BLOCK_M"),
    "block_k": ("BLOCK_K", "BLOCK_N"),
}
# The GPUs the archs stand for, in a sentence.
GPUS = {"sm_80": "an A100", "sm_90": "an H100"}
# Registers: at most 255 per thread, and 65,536 (32-bit) for all the
# threads of one program, on sm_80 and sm_90 (CUDA C++ Programming Guide,
# technical specifications per compute capability).
MAX_REGISTERS = 255
PROGRAM_REGISTERS = 65536


def compile_report(
    fn: Callable, *example_args: Any, archs=("sm_80", "sm_90")
) -> list[dict]:
    """Compile the kernels ``fn(*example_args)`` launches, for each arch.

    ``fn`` runs, its kernels do not: their launches are recorded only (what
    they would write stays as ``fn`` allocated it), so the example tensors
    may be on the CPU or a GPU, whether Triton compiles or interprets here.

    Returns rows as ``python -m mha.kernels --inspect`` prints them (kernel,
    arch, dtype, head_dim, causal, block_q, block_k, num_warps, num_stages,
    registers, stack_bytes, spill_bytes, shared_bytes, hmma, hgmma, ...,
    and for your kernels their ``constexprs``), each with
    ``register_limit`` (:func:`register_limit`) and ``warnings``, a list of
    sentences (:func:`build_warnings`; empty for a build that neither
    spills nor asks for too much shared memory): first your kernels', then,
    where the first three example arguments are q (B, H, T_q, d) and k, v
    (B, H_kv, T_k, d), the book's forward kernel (``"forward (book)"``) at
    its default tiles for the same shapes and ``causal`` (the first bool
    among the arguments).

    Raises:
        ValueError: an arch other than sm_80 and sm_90, or ``fn`` launched
            no Triton kernel.
        RuntimeError: the compiler failed; the message holds its error.
    """
    from . import TRITON_AVAILABLE

    if not TRITON_AVAILABLE:
        raise ModuleNotFoundError(
            "compile_report needs the triton package: pip install "
            "triton==3.9.0 (Linux)"
        )
    archs = tuple(archs)
    for arch in archs:
        if arch not in ("sm_80", "sm_90"):
            raise ValueError(
                f"archs must be among sm_80 (A100) and sm_90 (H100), got "
                f"{arch!r}"
            )
    with capture_launches(run=False) as launches:
        fn(*example_args)
    if not launches:
        raise ValueError(
            f"{getattr(fn, '__name__', fn)!r} launched no Triton kernel on "
            "the example arguments"
        )
    request = {
        "archs": archs,
        "launches": _unique(launches),
        "book": _book_request(example_args),
    }
    rows = _in_a_compiling_process(request)
    return [{**row, "warnings": build_warnings(row)} for row in rows]


# ---------------------------------------------------------------------------
# What a row means, in words


def register_limit(num_warps: int, maxnreg: int | None = None) -> int:
    """The most registers ptxas may give one thread of a program of
    ``num_warps`` warps: 255, or fewer where the program's threads would
    need more than the 65,536 registers one program may hold (16 warps:
    128; 32 warps: 64), or ``maxnreg`` where the launch sets it."""
    limit = min(MAX_REGISTERS, PROGRAM_REGISTERS // (32 * num_warps))
    return limit if maxnreg is None else min(limit, maxnreg)


def build_warnings(row: dict) -> list[str]:
    """What a build (a row of :func:`compile_report`) should not do, in
    words: it spills to local memory (and then what its registers figure
    means), or it asks for more shared memory than one program may use
    (:data:`mha.kernels.tiles.SHARED_LIMIT`), so that it would not
    launch."""
    said = []
    if row["spill_bytes"]:
        said.append(
            f"spills {row['spill_bytes']} bytes to local memory (spill "
            f"stores and loads; {row['stack_bytes']} bytes of stack per "
            "thread): a spilled value lives in main memory, behind the "
            "caches, and is read back from there; smaller tiles, or more "
            "warps to share them, keep it in registers"
        )
        said.append(_registers_when_spilling(row))
    limit = SHARED_LIMIT[row["arch"]]
    if row["shared_bytes"] > limit:
        said.append(
            f"uses {row['shared_bytes'] / 1024:.1f} KiB of shared memory, "
            f"more than the {limit // 1024} KiB one program may use on "
            f"{GPUS[row['arch']]} ({row['arch']}): it would fail to "
            f"launch; fewer stages (num_stages={row['num_stages']}) or "
            "smaller tiles need less"
        )
    return said


def _registers_when_spilling(row: dict) -> str:
    registers, warps = row["registers"], row["num_warps"]
    limit = row.get("register_limit") or register_limit(warps)
    if limit == MAX_REGISTERS:
        why = f"{limit}, the most any thread may have"
    elif limit == register_limit(warps):
        why = f"{limit}: 65,536 shared by the {32 * warps} threads of {warps}"
        why += " warps"
    else:
        why = f"{limit}, set by maxnreg"
    if registers >= limit:
        return (
            f"registers: {registers} is the limit ptxas hit ({why}), not "
            "what the code needs: it needs more, and the rest spilled"
        )
    return (
        f"registers: {registers} is not what the code needs: spilling this "
        "much, ptxas kept most values in local memory and counts only the "
        f"registers it still uses, fewer than the limit ({why})"
    )


def format_report(rows: list[dict]) -> str:
    """The rows of :func:`compile_report` as a table (79 columns wide for
    a kernel's name of 20 characters), each build's warnings under it,
    wrapped at 79 columns."""
    width = max(len(row["kernel"]) for row in rows) + 1
    lines = [
        f"{'kernel':<{width}}GPU      tile warps stages regs  spill"
        " smem KiB HMMA HGMMA"
    ]
    notes = []
    for row in rows:
        tile = (
            f"{row['block_q']}x{row['block_k']}"
            if row.get("block_q") and row.get("block_k")
            else "-"
        )
        lines.append(
            f"{row['kernel']:<{width}}{row['arch']:<5}{tile:>8}"
            f"{row['num_warps']:>6}{row['num_stages']:>7}"
            f"{row['registers']:>5}{row['spill_bytes']:>7}"
            f"{row['shared_bytes'] / 1024:>9.1f}"
            f"{row['hmma']:>5}{row['hgmma']:>6}"
        )
        said = row.get("warnings", build_warnings(row))
        if said:
            notes.append(f"{row['kernel']}, {row['arch']}:")
            for sentence in said:
                notes.append(
                    textwrap.fill(
                        sentence,
                        79,
                        initial_indent="  - ",
                        subsequent_indent="    ",
                    )
                )
    return "\n".join(lines + notes)


# ---------------------------------------------------------------------------
# Capturing the launches (in this process)


@contextmanager
def capture_launches(run: bool = True) -> Iterator[list[dict]]:
    """Record each Triton kernel launched inside the ``with`` block: its
    source, name, arguments and launch options.

    ``run``: launch it too (as it would be without the ``with``); False
    records it only, and launches nothing: no tensor is read, on any
    device, and nothing is compiled for this machine's GPU.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list[dict] = []
    originals = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}

    def recording(cls):
        def recorded(self, *args, grid, warmup, **kwargs):
            if not warmup:
                launches.append(_describe_launch(self.fn, args, dict(kwargs)))
                if not run:
                    return None
            return originals[cls](
                self, *args, grid=grid, warmup=warmup, **kwargs
            )

        return recorded

    for cls in originals:
        cls.run = recording(cls)
    try:
        yield launches
    finally:
        for cls, original in originals.items():
            cls.run = original


def _describe_launch(fn, args: tuple, kwargs: dict) -> dict:
    options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
    bound = inspect.signature(fn).bind(*args, **kwargs)
    return {
        "name": fn.__name__,
        "source": kernel_source(fn),
        "arguments": {k: _describe(v) for k, v in bound.arguments.items()},
        "options": options,
    }


def _describe(value: Any) -> dict:
    if isinstance(value, torch.Tensor):
        return {
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "stride": list(value.stride()),
        }
    value = getattr(value, "value", value)  # a tl.constexpr
    if value is None or isinstance(value, bool | int | float | str):
        return {"value": value}
    raise TypeError(
        f"a kernel argument of type {type(value).__name__} cannot be "
        "compiled ahead of time here: pass tensors, numbers, strings or bools"
    )


def kernel_source(fn: Callable) -> str:
    """A module's text that defines ``fn`` (a ``@triton.jit`` function's
    Python function) and what it uses from its module: the jitted helpers
    it calls (their source, or an import where they come from another
    module, such as ``triton.language``), the modules it names, its
    constants."""
    lines = ["import triton", "import triton.language as tl", ""]
    done: set[str] = set()  # global names written
    defined: set[str] = set()  # functions whose source is written
    bodies: list[str] = []
    aliases: list[str] = []

    def add(function) -> None:
        defined.add(function.__name__)
        for name in sorted(_names(function.__code__)):
            if name not in function.__globals__ or name in done:
                continue
            done.add(name)
            value = function.__globals__[name]
            helper = getattr(value, "fn", None)
            if callable(helper) and helper.__module__ != function.__module__:
                lines.append(
                    f"from {helper.__module__} import {helper.__name__} "
                    f"as {name}"
                )
            elif callable(helper):  # a jitted helper of the same module
                if helper.__name__ not in defined:
                    add(helper)
                if name != helper.__name__:
                    aliases.append(f"{name} = {helper.__name__}")
            elif isinstance(value, types.ModuleType):
                lines.append(f"import {value.__name__} as {name}")
            elif _plain(getattr(value, "value", value)):
                constant = getattr(value, "value", value)
                wrap = (
                    "tl.constexpr({!r})" if value is not constant else "{!r}"
                )
                lines.append(f"{name} = " + wrap.format(constant))
            elif _importable(value):
                lines.append(
                    f"from {value.__module__} import {value.__qualname__} "
                    f"as {name}"
                )
        bodies.append(textwrap.dedent(inspect.getsource(function)))

    add(fn)
    return (
        "\n".join(lines)
        + "\n\n\n"
        + "\n\n".join(bodies)
        + "\n"
        + "\n".join(aliases)
        + "\n"
    )


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _importable(value: Any) -> bool:
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", "")
    return bool(module) and module != "__main__" and qualname.isidentifier()


def _unique(launches: list[dict]) -> list[dict]:
    seen, kept = set(), []
    for launch in launches:
        key = json.dumps(launch, sort_keys=True)
        if key not in seen:
            seen.add(key)
            kept.append(launch)
    return kept


def _book_request(example_args: tuple) -> dict | None:
    tensors = [a for a in example_args[:3] if isinstance(a, torch.Tensor)]
    if len(tensors) < 3 or any(t.ndim != 4 for t in tensors):
        return None
    causal = next((a for a in example_args if isinstance(a, bool)), False)
    return {"qkv": [_describe(t) for t in tensors], "causal": causal}


def _in_a_compiling_process(request: dict) -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "mha.kernels.report"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            "compiling ahead of time failed:\n" + done.stderr[-4000:]
        )
    return [json.loads(line) for line in done.stdout.splitlines() if line]


# ---------------------------------------------------------------------------
# Compiling (in a process with TRITON_INTERPRET=0)


def main() -> int:
    """Read a request as JSON on stdin, print one JSON row per build."""
    from . import INTERPRETED

    if INTERPRETED is not False:
        print("compile with TRITON_INTERPRET=0", file=sys.stderr)
        return 1
    request = json.load(sys.stdin)
    with tempfile.TemporaryDirectory() as folder:
        kernels = [
            _load_kernel(launch, Path(folder) / f"learner_{number}.py")
            for number, launch in enumerate(request["launches"])
        ]
        for arch in request["archs"]:
            for kernel, launch in zip(kernels, request["launches"]):
                print(json.dumps(_learner_row(kernel, launch, arch, request)))
            if request["book"] is not None:
                print(json.dumps(_book_row(request["book"], arch)))
    return 0


def _load_kernel(launch: dict, path: Path):
    # Triton reads a kernel's source from its file: write, then import it
    path.write_text(launch["source"])
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return getattr(module, launch["name"])


def _value(description: dict):
    if "value" in description:
        return description["value"]
    dtype = getattr(torch, description["dtype"])
    return torch.empty_strided(
        description["shape"], description["stride"], dtype=dtype, device="meta"
    )


def _compile(kernel, args: list, constants: dict, arch: str) -> dict:
    from .aot import ARCHS, compile_launch, read_build
    from .attention import Launch

    launch = Launch(kernel, (1,), tuple(args), constants)
    compiled = compile_launch(launch, ARCHS[arch])
    warps = compiled.metadata.num_warps
    return {
        "num_warps": warps,
        "num_stages": compiled.metadata.num_stages,
        **read_build(compiled, arch),
        "register_limit": register_limit(
            warps, getattr(compiled.metadata, "maxnreg", None)
        ),
    }


def _learner_row(kernel, launch: dict, arch: str, request: dict) -> dict:
    arguments = {k: _value(v) for k, v in launch["arguments"].items()}
    args, constants = [], dict(launch["options"])
    for param in kernel.params:
        if param.name not in arguments:
            continue  # left to its default
        if param.is_constexpr:
            constants[param.name] = arguments[param.name]
        else:
            args.append(arguments[param.name])
    tensors = [a for a in launch["arguments"].values() if "dtype" in a]
    book = request["book"]
    row = {
        "kernel": launch["name"],
        "arch": arch,
        "dtype": tensors[0]["dtype"] if tensors else None,
        "head_dim": book["qkv"][0]["shape"][-1] if book else None,
        "causal": book["causal"] if book else None,
    }
    for key, names in TILE_NAMES.items():
        row[key] = next((constants[n] for n in names if n in constants), None)
    compiled = _compile(kernel, args, constants, arch)
    specialised = {k: v for k, v in constants.items() if k not in OPTIONS}
    return {**row, **compiled, "constexprs": specialised, "cubin": None}


def _book_row(book: dict, arch: str) -> dict:
    from .aot import ARCHS
    from .attention import default_tiles, forward_launch

    q, k, v = (_value(t) for t in book["qkv"])
    lse = torch.empty(q.shape[:3], device="meta")
    capability = ARCHS[arch]
    tiles = default_tiles(
        "forward", q.shape[-1], q.dtype, (capability // 10, capability % 10)
    )
    launch = forward_launch(
        q,
        k,
        v,
        torch.empty_like(q),
        lse,
        causal=book["causal"],
        scale=q.shape[-1] ** -0.5,
        tiles=tiles,
    )
    constants = dict(launch.constants)
    row = {
        "kernel": "forward (book)",
        "arch": arch,
        "dtype": book["qkv"][0]["dtype"],
        "head_dim": q.shape[-1],
        "causal": book["causal"],
        "block_q": tiles.block_q,
        "block_k": tiles.block_k,
    }
    return {
        **row,
        **_compile(launch.kernel, list(launch.args), constants, arch),
        "cubin": None,
    }


if __name__ == "__main__":
    sys.exit(main())
