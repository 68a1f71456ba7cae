"""What the figures depend on.

The device and its name, versions, threads, date and commit.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["device_name", "environment"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _git_commit(
    root: Path | None = None,
) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the repository holding this package, if any.

    ``dirty`` is True if tracked files other than the results under
    ``benchmarks/`` differ from the commit: replacing old results is not
    a change of the code that measures them.
    """
    if root is None:
        root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        top = git("rev-parse", "--show-toplevel")
        status = git(
            "-C",
            top,
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ".",
            ":(exclude)benchmarks",
        )
        return commit or None, bool(status)
    except (OSError, subprocess.SubprocessError):
        return None, None


def device_name(device: torch.device | str) -> str:
    """The GPU's name or the CPU's model.

    The name comes from ``torch.cuda.get_device_name``, the model from
    ``/proc/cpuinfo``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(
            device.index
            if device.index is not None
            else torch.cuda.current_device()
        )
    return _cpu_model()


def environment(device: torch.device | str, dtype: str) -> dict[str, Any]:
    """What the figures depend on.

    Device and its name, versions, dtype, threads, date, commit.
    """
    device = torch.device(device)
    commit, dirty = _git_commit()
    capability = None
    if device.type == "cuda":
        index = (
            device.index
            if device.index is not None
            else torch.cuda.current_device()
        )
        capability = ".".join(
            map(str, torch.cuda.get_device_capability(index))
        )
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count()
    return {
        "device": device.type,
        "device_name": device_name(device),
        "cuda_capability": capability,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version()
        if device.type == "cuda"
        else None,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_available": affinity,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "dtype": dtype,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "git_commit": commit,
        "git_dirty": dirty,
        "load_average_1min": os.getloadavg()[0]
        if hasattr(os, "getloadavg")
        else None,
    }
