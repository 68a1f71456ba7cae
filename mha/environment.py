"""What the figures depend on.

The device and its name, versions, threads, date and commit.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["device_name", "environment", "describe", "git_commit"]
__all__ += ["load_average", "interpreter_problem"]


def _release(version: str) -> tuple[int, ...]:
    """(3, 6) of "3.6.0", (2, 4) of "2.4.0rc1": major and minor."""
    major, minor = (version.split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _triton_version() -> str | None:
    """The Triton in use (imported or importable), without importing it."""
    imported = sys.modules.get("triton")
    if imported is not None:
        return getattr(imported, "__version__", None)
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


def interpreter_problem(
    triton_version: str | None = None, numpy_version: str | None = None
) -> str | None:
    """Why Triton's interpreter cannot run Triton kernels here, or None.

    The interpreters of Triton 3.4 to 3.6 turn a one-element array into a
    Python integer (a loop's bounds, among others), which NumPy 2.4 refuses
    ("only 0-dimensional arrays can be converted to Python scalars"); from
    Triton 3.7 on they do not, and with NumPy 2.3 the older ones run (each
    pair measured on the book's forward kernel). Defaults: the versions in
    use; None where Triton is missing. Imports neither Triton nor
    :mod:`mha.kernels`, so that the exercise checkers can ask it too.
    """
    if triton_version is None:
        triton_version = _triton_version()
        if triton_version is None:
            return None
    if numpy_version is None:
        numpy_version = np.__version__
    old_interpreter = _release(triton_version) < (3, 7)
    if old_interpreter and _release(numpy_version) >= (2, 4):
        return (
            f"Triton {triton_version}'s interpreter cannot run these kernels "
            f"with NumPy {numpy_version}: it turns one-element arrays into "
            "Python integers, which NumPy 2.4 refuses; install triton 3.7 or "
            "later (this project pins 3.9.0) or numpy older than 2.4"
        )
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith("model name")]
        return lines[0].split(":", 1)[1].strip()
    except (OSError, IndexError):
        return platform.processor() or platform.machine() or "unknown CPU"


def git_commit(root: Path | None = None) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the repository holding ``root`` (this package).

    ``dirty`` is True if tracked files other than the results under
    ``benchmarks/`` differ from the commit: replacing old results is not
    a change of the code that measures them. (None, None) outside git.
    """
    root = root or Path(__file__).resolve().parent.parent
    try:
        commit, status = (
            subprocess.run(
                ["git", *args],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
            for args in (
                ("rev-parse", "HEAD"),
                ("status", "--porcelain", "--untracked-files=no", "--")
                + (":(top)", ":(top,exclude)benchmarks"),
            )
        )
        return commit or None, bool(status)
    except (OSError, subprocess.SubprocessError):
        return None, None


def device_name(device: torch.device | str) -> str:
    """The GPU's name (``torch.cuda``) or the CPU's model (/proc/cpuinfo)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_model()


def environment(device: torch.device | str, dtype: str) -> dict[str, Any]:
    """What the figures depend on.

    Device and its name, versions, dtype, threads, date, commit, load.
    """
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    commit, dirty = git_commit()
    return {
        "device": device.type,
        "device_name": device_name(device),
        "cuda_capability": ".".join(
            map(str, torch.cuda.get_device_capability(device))
        )
        if on_gpu
        else None,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if on_gpu else None,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "transformers_version": _version("transformers"),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "dtype": dtype,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "git_commit": commit,
        "git_dirty": dirty,
        "load_average_1min": load_average(),
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def describe(env: dict[str, Any]) -> str:
    """One line: the device, the versions, dtype, threads and date."""
    versions = [f"{name} {env.get(f'{name}_version')}" for name in _PACKAGES]
    return (
        f"{env['device_name']} ({env['device']}), {', '.join(versions)}, "
        f"{env['dtype']}, {env['threads']} threads, {env['date_utc']}"
    )


_PACKAGES = ("torch", "numpy", "transformers")


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None
