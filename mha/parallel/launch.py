"""Start N local processes, wait for them, stop them all on the first failure.

Each process runs ``python -m mha.parallel --worker CONFIG`` with the
environment variables that ``torchrun`` sets for its rank (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``) and prints one JSON line with its results.
The processes find each other through a file in a fresh temporary folder
(``torch.distributed.FileStore``, named in ``MHA_PARALLEL_STORE``), not a
TCP port, and gloo talks over the loopback interface only (and NCCL's
bootstrap, on GPUs): nothing listens beyond this machine. The launcher
never waits longer than its timeout: a rank that fails ends the run at once
(the others are killed) with that rank's error; a rank that hangs ends it at
the timeout. Workers also die with the launcher (Linux ``PR_SET_PDEATHSIG``),
so a launcher that is itself killed leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["LaunchError", "launch", "die_with_parent", "STORE"]

#: The environment variable naming the rendezvous file of a launch.
STORE = "MHA_PARALLEL_STORE"
_PARENT = "MHA_PARALLEL_PARENT"


class LaunchError(RuntimeError):
    """A rank failed or the run timed out; the message holds their errors."""


def launch(
    nproc: int,
    config: dict[str, Any],
    *,
    timeout: float,
    threads: int = 1,
) -> tuple[list[dict[str, Any]], list[int]]:
    """Run ``nproc`` workers on ``config``: each rank's JSON result, the pids.

    Raises :class:`LaunchError` when a rank exits with an error (after
    killing the others) or when the run takes longer than ``timeout``
    seconds (after killing every rank).
    """
    with tempfile.TemporaryDirectory(prefix="mha-parallel-") as tmp:
        logs = [
            (Path(tmp) / f"rank{r}.out", Path(tmp) / f"rank{r}.err")
            for r in range(nproc)
        ]
        procs: list[subprocess.Popen] = []
        try:
            for rank, (out, err) in enumerate(logs):
                procs.append(
                    _start(rank, nproc, Path(tmp), config, threads, out, err)
                )
            _wait(procs, logs, timeout)
        except LaunchError as error:
            pids = [p.pid for p in procs]
            raise LaunchError(
                f"{error}\n(worker pids {pids}, stopped)"
            ) from None
        finally:
            _stop(procs)
        results = [_result(rank, out) for rank, (out, _) in enumerate(logs)]
    return results, [p.pid for p in procs]


def die_with_parent() -> None:
    """In a worker: die with the launcher (Linux); exit if it already died."""
    parent = int(os.environ.get(_PARENT, "0"))
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if parent and os.getppid() != parent:  # the launcher died before prctl
        os._exit(1)


def _start(rank, nproc, tmp, config, threads, out, err) -> subprocess.Popen:
    env = dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        **{STORE: str(tmp / "store")},
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        **{_PARENT: str(os.getpid())},
    )
    if Path("/sys/class/net/lo").exists():
        env.update(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    command = [sys.executable, "-m", "mha.parallel", "--worker"]
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        return subprocess.Popen(
            [*command, json.dumps(config)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
        )


def _wait(procs, logs, timeout: float) -> None:
    """Poll until every rank exits 0; raise on a failure or at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            time.sleep(0.2)  # let a rank that fails at the same time finish
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            raise LaunchError(
                "\n".join(
                    f"rank {r} exited with code {codes[r]}:\n"
                    + _tail(logs[r][1])
                    for r in failed
                )
            )
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            raise LaunchError(
                f"timed out after {timeout:g} s with rank(s) {running} still "
                "running (stopped); their output:\n"
                + "\n".join(f"rank {r}:\n{_tail(logs[r][1])}" for r in running)
            )
        time.sleep(0.02)


def _stop(procs) -> None:
    """Kill every rank still running and reap all of them."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace").rstrip()
    return "\n".join(text.splitlines()[-lines:]) or "(no output)"


def _result(rank: int, out: Path) -> dict[str, Any]:
    lines = out.read_text().strip().splitlines()
    if not lines:
        raise LaunchError(f"rank {rank} exited without printing its result")
    return json.loads(lines[-1])
