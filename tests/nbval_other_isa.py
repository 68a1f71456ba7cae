"""nbval once more, with torch and NumPy held to an instruction set other than this CPU's own.

A stored output must not depend on the reader's CPU: torch picks its CPU kernels by instruction set
(``ATEN_CPU_CAPABILITY``: default, avx2, avx512) and NumPy dispatches its SIMD loops the same way
(``NPY_DISABLE_CPU_FEATURES``). oneDNN, which torch's CPU attention asks whether to pack its 16-bit
tiles for AMX, is held to the same level (``ONEDNN_MAX_CPU_ISA``): without it, an AMX CPU forced to
torch's AVX2 kernels fails in bfloat16 ("pack_vnni2 is only supported when avx512 is supported"),
which no real AVX2 CPU does. On a CPU with AVX-512 this runs every notebook under AVX2; on
any other, under the portable default (no SIMD). The compiler gets a cache of its own: torch 2.13
reuses a compiled FlexAttention kernel across instruction sets, so one shared cache would give
wrong results (chapter 15).

    python tests/nbval_other_isa.py [pytest arguments, default: chapters appendix]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

ROOT = Path(__file__).resolve().parents[1]

# NumPy's dispatched features above each of torch's levels (X86_V3 is AVX2, X86_V4 AVX-512)
NUMPY_ABOVE = {
    "avx2": ("X86_V4", "AVX512_ICL", "AVX512_SPR"),
    "default": ("X86_V3", "X86_V4", "AVX512_ICL", "AVX512_SPR"),
}
# oneDNN's ceiling at each of torch's levels
ONEDNN_AT = {"avx2": "AVX2", "default": "SSE41"}


def other_isa() -> dict[str, str]:
    """The environment that holds torch and NumPy below this CPU's own instruction set."""
    own = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    level = "avx2" if own == "AVX512" else "default"
    # only what this CPU has: NumPy refuses to disable what it does not dispatch
    found = [f for f in NUMPY_ABOVE[level] if f in __cpu_dispatch__ and __cpu_features__.get(f)]
    return {
        "ATEN_CPU_CAPABILITY": level,
        "NPY_DISABLE_CPU_FEATURES": " ".join(found),
        "ONEDNN_MAX_CPU_ISA": ONEDNN_AT[level],
        "own": own,
    }


def main(argv: list[str]) -> int:
    env = other_isa()
    own = env.pop("own")
    print(
        f"nbval with ATEN_CPU_CAPABILITY={env['ATEN_CPU_CAPABILITY']} (this CPU: {own}), "
        f"NPY_DISABLE_CPU_FEATURES={env['NPY_DISABLE_CPU_FEATURES']!r}, "
        f"ONEDNN_MAX_CPU_ISA={env['ONEDNN_MAX_CPU_ISA']}",
        flush=True,
    )
    targets = argv or ["chapters", "appendix"]
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        run_env = {**os.environ, **env, "TORCHINDUCTOR_CACHE_DIR": cache}
        command = [sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env", *targets]
        return subprocess.run(command, cwd=ROOT, env=run_env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
