"""Compile the kernels ahead of time for a named GPU, and read what came out.

No GPU is needed: Triton compiles for a *target* (``GPUTarget("cuda", 90,
32)`` is an H100's sm_90) down to PTX and then, with the ``ptxas`` that the
triton wheel ships, to a cubin, the GPU's machine code. This module builds
the exact launches that :func:`mha.kernels.triton_attention` would make (the
same launch code, on ``device="meta"`` tensors that have shapes and strides
but no data), compiles each for the target and reads:

* registers per thread and stack bytes from the cubin (``cuobjdump
  -res-usage``), and the same registers, the stack and the spill stores and
  loads from ``ptxas -v`` run again on the PTX: the two routes must agree;
* shared memory per program: what Triton allocates (its metadata) plus what
  ``ptxas`` placed statically;
* tensor-core instructions in the SASS (``cuobjdump -sass``), counted apart:
  ``HMMA`` (a warp's products, ``mma.sync``: sm_80, and sm_90 where Triton
  does not use the warpgroup products) and ``HGMMA`` (sm_90's warpgroup
  products, ``wgmma``), and of the ``HGMMA`` those that take their A operand
  from registers (``HGMMA.64x128x16.F32 R24, R120, gdesc[UR12]...``: A in
  registers R120.., B described in shared memory) or from shared memory
  (``HGMMA.64x64x16.F32 R88, gdesc[UR12], R88``: one descriptor pair for A
  and B). B always comes from shared memory.

The kernels must be decorated with ``TRITON_INTERPRET`` off, so
:func:`inspect_builds` runs in a process where it is ("0"); ``python -m
mha.kernels --inspect`` starts one.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from . import INTERPRETED
from . import attention as kernels
from .tiles import INSPECTED_HEAD_DIMS, LADDER, SHARED_LIMIT, Techniques

__all__ = [
    "ARCHS",
    "SHARED_LIMIT",
    "DTYPES",
    "INSPECTED_HEAD_DIMS",
    "example_launches",
    "compile_launch",
    "read_build",
    "tensor_core_counts",
    "inspect_builds",
    "inspect_ladder",
    "instruction_counts",
    "sass",
]

#: Targets by name: compute capability (A100: sm_80, H100: sm_90).
ARCHS = {"sm_80": 80, "sm_90": 90}

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}

# A representative launch: 4 sequences of 4096 tokens, 32 query heads
# sharing 8 key/value heads (as Llama 3 8B does); one new token per
# sequence for the split-KV kernel.
EXAMPLE = {"batch": 4, "heads": 32, "kv_heads": 8, "t": 4096}

# The sliding window of the window builds (Mistral 7B's). The window is a
# runtime int: its value is not compiled in (4095 or 256 give the same cubin
# as 4096), but for 1, which Triton makes a constant as it does any integer
# argument equal to 1.
EXAMPLE_WINDOW = 4096

#: The kernels that take a sliding window (``--window`` compiles these only):
#: every one.
WINDOWED = ("forward", "backward_dk_dv", "backward_dq", "split_kv", "paged")

# One SASS instruction each: the destination registers come first, then A.
HMMA = re.compile(r"\bHMMA\.")
HGMMA = re.compile(r"\bHGMMA\.\S+\s+R\d+,\s+(R\d+|gdesc\[)")
# One SASS line: its address, an optional predicate (@P0, @!UP1), the opcode.
OPCODE = re.compile(
    r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)"
)

#: The kernels with switches (:class:`mha.kernels.tiles.Techniques`).
SWITCHED = ("forward", "split_kv")

#: The instructions a rung of the ladder is read by: the exponentials
#: (``MUFU.EX2``), the float multiplies and multiply-adds, the selects and
#: comparisons that masks compile to, and the two kinds of copy into shared
#: memory.
COUNTED = (
    "MUFU.EX2", "FMUL", "FFMA", "FADD", "FSEL", "FSETP", "ISETP",
    "LDGSTS",  # a thread's asynchronous copy, global to shared memory
    "UTMALDG",  # a tile's copy by the TMA unit, sm_90 on
    "USETMAXREG",  # a warp group's register budget set (setmaxnreg, sm_90)
)  # fmt: skip
#: The PTX forms of the exponential: ``tl.exp`` becomes a multiply by
#: log2 e and ``ex2.approx.f32``; ``tl.exp2`` the flush-to-zero form.
PTX_EXP2 = {
    "ptx_ex2": re.compile(r"\bex2\.approx\.f32\b"),
    "ptx_ex2_ftz": re.compile(r"\bex2\.approx\.ftz\.f32\b"),
}


def example_launches(
    kernel: str,
    dtype: torch.dtype,
    head_dim: int,
    capability: int,
    causal: bool = True,
    key_start: bool = False,
    window: bool = False,
    techniques: Techniques | None = None,
) -> list:
    """The launch(es) of ``kernel`` that :mod:`mha.kernels.attention` makes,
    with its default tiles for the target, on meta tensors; ``key_start``:
    with per-row key starts (a left-padded batch); ``window``: with a
    sliding window of ``EXAMPLE_WINDOW`` keys; ``techniques``: the switches
    of the kernels in ``SWITCHED`` (None: all off)."""
    batch, heads, kv_heads, t = EXAMPLE.values()
    major = (capability // 10, capability % 10)
    if window and kernel not in WINDOWED:
        raise ValueError(
            f"kernel must take a sliding window ({WINDOWED}), got {kernel!r}"
        )

    def tensor(h, length, d=head_dim, kind=dtype):
        return torch.empty((batch, h, length, d), dtype=kind, device="meta")

    if kernel == "paged":
        return [_paged_launch(dtype, head_dim, major, key_start, window)]
    t_q = 1 if kernel == "split_kv" else t
    q, k, v = tensor(heads, t_q), tensor(kv_heads, t), tensor(kv_heads, t)
    lse = torch.empty((batch, heads, t_q), device="meta")
    tiles = kernels.default_tiles(kernel, head_dim, dtype, major)
    starts = torch.empty((batch,), dtype=torch.int32, device="meta")
    common = dict(
        causal=causal,
        scale=head_dim**-0.5,
        key_start=starts if key_start else None,
        window=EXAMPLE_WINDOW if window else None,
    )
    if techniques is not None and kernel not in SWITCHED:
        raise ValueError(
            f"techniques are switches of {SWITCHED} only, got {kernel!r}"
        )
    if kernel == "forward":
        return [
            kernels.forward_launch(
                q, k, v, q, lse, tiles=tiles, techniques=techniques, **common
            )
        ]
    if kernel == "split_kv":
        programs = batch * heads  # one query tile each
        splits = kernels.default_num_splits(
            programs, t, tiles.block_k, kernels.H100_MULTIPROCESSORS
        )
        keys, splits = kernels.split_sizes(t, splits, tiles.block_k)
        partial = torch.empty(
            (batch, heads, splits, t_q, head_dim), device="meta"
        )
        return [
            kernels.split_kv_launch(
                q,
                k,
                v,
                partial,
                partial[..., 0],
                tiles=tiles,
                keys_per_split=keys,
                techniques=techniques,
                **common,
            )
        ]
    names = ("backward_dk_dv", "backward_dq")
    both = {
        name: kernels.default_tiles(name, head_dim, dtype, major)
        for name in names
    }
    launches = kernels.backward_launches(
        q, k, v, q, lse, lse, q, k, v, tiles=both, **common
    )
    return [launches[names.index(kernel)]]


def _paged_launch(
    dtype: torch.dtype,
    head_dim: int,
    major: tuple[int, int],
    key_start: bool = False,
    window: bool = False,
):
    """A decoding step of the paged kernel: the example's sequences held in
    blocks of 16 positions of one pool; ``key_start``: with per-row key
    starts (a left-padded batch); ``window``: with a sliding window of
    ``EXAMPLE_WINDOW`` keys."""
    from .paged import paged_launch

    batch, heads, kv_heads, t = EXAMPLE.values()
    block_size = 16
    blocks = batch * t // block_size
    q = torch.empty((batch, heads, 1, head_dim), dtype=dtype, device="meta")
    pool = torch.empty(
        (blocks, block_size, kv_heads, head_dim), dtype=dtype, device="meta"
    )
    table = torch.empty(
        (batch, t // block_size), dtype=torch.int32, device="meta"
    )
    lens = torch.empty((batch,), dtype=torch.int32, device="meta")
    starts = torch.empty((batch,), dtype=torch.int32, device="meta")
    tiles = kernels.default_tiles("paged", head_dim, dtype, major)
    rows = heads // kv_heads  # a group's query heads, one query each
    programs = batch * kv_heads * -(-rows // tiles.block_q)
    splits = kernels.default_num_splits(
        programs, t, tiles.block_k, kernels.H100_MULTIPROCESSORS
    )
    keys, splits = kernels.split_sizes(t, splits, tiles.block_k)
    partial = torch.empty(
        (batch, kv_heads, splits, rows, head_dim), device="meta"
    )
    return paged_launch(
        q,
        pool,
        pool,
        table,
        lens,
        partial,
        partial[..., 0],
        scale=head_dim**-0.5,
        tiles=tiles,
        keys_per_split=keys,
        key_start=starts if key_start else None,
        window=EXAMPLE_WINDOW if window else None,
    )


def compile_launch(launch, capability: int):
    """Compile one launch for ``GPUTarget("cuda", capability, 32)``.

    The arguments are specialised as a real launch would specialise them
    (integers equal to 1 become constants, pointers and integers divisible
    by 16 are marked so), by Triton's own binder.
    """
    backend = make_backend(GPUTarget("cuda", capability, 32))
    fn = launch.kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.constants)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.constants, bound, specialization, options
    )
    source = ASTSource(fn, signature, constexprs, attrs)
    target = GPUTarget("cuda", capability, 32)
    # compiled afresh, ptxas's own report of this build kept (registers,
    # stack, spills): ptxas's flags and which ptxas vary with Triton's
    # version, so its report is read, not made again
    log = io.StringIO()
    knobs = triton.knobs
    with knobs.compilation.scope(), knobs.nvidia.scope():
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(
                source, target=target, options=options.__dict__
            )
    compiled.ptxas_log = log.getvalue()
    return compiled


def _tool(name: str, *args: str) -> str:
    path = getattr(triton.knobs.nvidia, name).path
    done = subprocess.run(
        [path, *args], capture_output=True, text=True, check=True
    )
    return done.stdout + done.stderr


def _number(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    if found is None:
        raise RuntimeError(f"{pattern!r} not found in:\n{text}")
    return int(found.group(1))


def sass(cubin: bytes) -> str:
    """The cubin's machine code, as ``cuobjdump -sass`` prints it."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        return _tool("cuobjdump", "-sass", str(path))


def tensor_core_counts(code: str) -> dict:
    """``HMMA`` and ``HGMMA`` instructions in SASS text, and how many of the
    ``HGMMA`` read their A operand from registers or from shared memory."""
    a_operands = HGMMA.findall(code)
    hmma, hgmma = len(HMMA.findall(code)), len(a_operands)
    if hgmma != code.count("HGMMA."):
        raise RuntimeError(f"an HGMMA of unknown form in:\n{code}")
    a_regs = sum(operand.startswith("R") for operand in a_operands)
    return {
        "tensor_core_instructions": hmma + hgmma,
        "hmma": hmma,
        "hgmma": hgmma,
        "hgmma_a_regs": a_regs,
        "hgmma_a_smem": hgmma - a_regs,
    }


def instruction_counts(code: str) -> dict:
    """How many of each instruction of ``COUNTED`` the SASS text holds
    (``MUFU.EX2`` by its full name, the others by their opcode's first
    part: ``FSETP.GT.AND`` is an ``FSETP``), and every instruction."""
    opcodes = OPCODE.findall(code)
    counts = {name: 0 for name in COUNTED}
    for opcode in opcodes:
        if opcode.startswith("MUFU.EX2"):
            counts["MUFU.EX2"] += 1
        elif opcode.split(".")[0] in counts:
            counts[opcode.split(".")[0]] += 1
    return {"instructions": len(opcodes), **counts}


def read_build(compiled, arch: str) -> dict:
    """Registers, stack, spills, shared memory, tensor-core instructions."""
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = _tool("cuobjdump", "-res-usage", str(cubin))
        log = compiled.ptxas_log  # the report of the ptxas that made it
        code = _tool("cuobjdump", "-sass", str(cubin))
    registers = _number(r"REG:(\d+)", usage)
    stack = _number(r"STACK:(\d+)", usage)
    if registers != _number(r"Used (\d+) registers", log) or stack != (
        _number(r"(\d+) bytes stack frame", log)
    ):
        raise RuntimeError(f"cuobjdump and ptxas disagree:\n{usage}\n{log}")
    spills = _number(r"(\d+) bytes spill stores", log) + _number(
        r"(\d+) bytes spill loads", log
    )
    return {
        "registers": registers,
        "stack_bytes": stack,
        "spill_bytes": spills,
        "shared_bytes": compiled.metadata.shared
        + _number(r"SHARED:(\d+)", usage),
        **tensor_core_counts(code),
    }


def inspect_builds(
    archs=("sm_80", "sm_90"),
    dtypes=("float16", "bfloat16", "float32"),
    head_dims=INSPECTED_HEAD_DIMS,
    kernel_names=kernels.KERNELS,
    cubin_dir: Path | None = None,
    causal=(True, False),
    key_start: bool = False,
    window: bool = False,
) -> Iterator[dict]:
    """Compile each (kernel, arch, dtype, head_dim, causal) and yield its
    row; ``key_start``: the kernels with per-row key starts (left padding).
    The paged kernel is causal by its lengths: causal builds only.
    ``window``: only the kernels that take a sliding window (``WINDOWED``),
    with one, each build without and then with key starts (the serving
    engine's launch and a left-padded batch's), or with them only where
    ``key_start``."""
    if INTERPRETED is not False:
        raise RuntimeError(
            "the kernels were decorated for Triton's interpreter: inspect in "
            "a process started with TRITON_INTERPRET=0"
        )
    if window:
        kernel_names = [name for name in kernel_names if name in WINDOWED]
    starts = (False, True) if window and not key_start else (key_start,)
    for arch in archs:
        for dtype in dtypes:
            for head_dim in head_dims:
                for name in kernel_names:
                    # the paged kernel is causal by its lengths: no flag
                    masks = (True,) if name == "paged" else causal
                    for masked in masks:
                        for padded in starts:
                            yield _inspect_one(
                                name,
                                arch,
                                dtype,
                                head_dim,
                                masked,
                                padded,
                                window,
                                cubin_dir,
                            )


def inspect_ladder(
    archs=("sm_90",),
    dtypes=("bfloat16",),
    head_dims=(64, 128),
    kernel_names=SWITCHED,
    causal=(True, False),
) -> Iterator[dict]:
    """Compile every rung of :data:`mha.kernels.tiles.LADDER` (each
    (kernel, arch, dtype, head_dim, causal) of the kernels with switches)
    and yield its row: :func:`inspect_builds`'s, with the rung's name, its
    switches, :func:`instruction_counts` of its SASS and the exponentials
    of its PTX by form (``PTX_EXP2``)."""
    if INTERPRETED is not False:
        raise RuntimeError(
            "the kernels were decorated for Triton's interpreter: inspect in "
            "a process started with TRITON_INTERPRET=0"
        )
    for arch in archs:
        for dtype in dtypes:
            for head_dim in head_dims:
                for name in kernel_names:
                    if name not in SWITCHED:
                        continue
                    for masked in causal:
                        for rung, techniques in LADDER:
                            if not techniques.runs_in(name):
                                continue
                            yield {
                                "rung": rung,
                                **_inspect_one(
                                    name, arch, dtype, head_dim, masked,
                                    False, False, None, techniques,
                                ),
                            }  # fmt: skip


def _inspect_one(
    name, arch, dtype, head_dim, causal, key_start, window, cubin_dir,
    techniques=None,
) -> dict:  # fmt: skip
    capability = ARCHS[arch]
    (launch,) = example_launches(
        name, DTYPES[dtype], head_dim, capability, causal, key_start, window,
        techniques,
    )  # fmt: skip
    compiled = compile_launch(launch, capability)
    row = {
        "kernel": name,
        "arch": arch,
        "dtype": dtype,
        "head_dim": head_dim,
        "causal": bool(causal),
        "key_start": bool(key_start),
        **({"window": True} if window else {}),  # only a window build's
        "block_q": launch.constants["BLOCK_Q"],
        "block_k": launch.constants["BLOCK_K"],
        "num_warps": launch.constants["num_warps"],
        "num_stages": launch.constants["num_stages"],
        **read_build(compiled, arch),
        "cubin": None,
    }
    if techniques is not None:  # a rung of the ladder: what it changed
        row["techniques"] = [
            name for name, on in vars(techniques).items() if on
        ]
        # the warps the build runs: warp specialisation adds its own
        row["compiled_warps"] = compiled.metadata.num_warps
        row.update(instruction_counts(sass(compiled.asm["cubin"])))
        ptx = compiled.asm["ptx"]
        row.update({k: len(p.findall(ptx)) for k, p in PTX_EXP2.items()})
    if cubin_dir is not None:
        mask = (
            ("causal" if causal else "full")
            + ("_key_start" if key_start else "")
            + ("_window" if window else "")
        )
        path = (
            Path(cubin_dir) / f"{name}_{arch}_{dtype}_d{head_dim}_{mask}.cubin"
        )
        path.write_bytes(compiled.asm["cubin"])
        row["cubin"] = path.name
    return row
