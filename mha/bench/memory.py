"""Peak memory of one call: the CUDA allocator's (:func:`cuda_peak_bytes`),
or the resident memory's in a fresh process (:func:`peak_rss_of_call`,
:func:`in_fresh_process`)."""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
from typing import Any

import torch

from .registry import Runner

__all__ = ["cuda_peak_bytes", "peak_rss_of_call", "in_fresh_process"]


def cuda_peak_bytes(runner: Runner, device: torch.device) -> int:
    """Peak memory allocated during one call, above what was allocated."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    with torch.no_grad():
        output = runner()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    del output
    return int(peak)


def _status_kib(field: str) -> int:
    """A field of /proc/self/status, in KiB (OSError where there is none)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def _peak_kib(linux: bool) -> int:
    if linux:
        return _status_kib("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_rss_of_call(runner: Runner) -> dict[str, Any]:
    """Peak extra resident memory of one call: ``peak_bytes``, ``method``.

    Where the kernel's peak-RSS counter (VmHWM) can be reset (Linux), the
    peak during the call above the RSS before it; elsewhere the process's
    peak so far, which is the call's own if it is the largest.
    """
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # VmHWM := VmRSS
        linux, before = True, _status_kib("VmRSS")
    except OSError:
        linux, before = False, _peak_kib(False)
    with torch.no_grad():
        output = runner()
    kib = max(0, _peak_kib(linux) - before)
    del output
    method = "VmHWM after clear_refs" if linux else "ru_maxrss"
    return {"peak_bytes": kib * 1024, "method": method}


_CHILD = (
    "import importlib, json, sys\n"
    "module, name = sys.argv[1].split(':')\n"
    "spec = json.loads(sys.argv[2])\n"
    "print(json.dumps(getattr(importlib.import_module(module), name)(spec)))"
)


def in_fresh_process(
    target: str, spec: dict[str, Any], threads: int, timeout: float = 600.0
) -> dict[str, Any]:
    """``module:function`` called on ``spec`` in a fresh Python process.

    The process runs with ``threads`` OpenMP/MKL threads; the function's
    JSON-ready result is returned. A failed process raises ``RuntimeError``
    with the end of its stderr.
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["MKL_NUM_THREADS"] = str(threads)
    completed = subprocess.run(
        [sys.executable, "-c", _CHILD, target, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(
            f"{target} failed in a fresh process:\n{completed.stderr[-2000:]}"
        )
    return json.loads(completed.stdout.strip().splitlines()[-1])
