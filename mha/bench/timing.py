"""The one measurement loop of every benchmark, :func:`measure`.

Calls are timed with ``time.perf_counter`` on the CPU and CUDA events on a
GPU, in interleaved rounds (:func:`time_interleaved`).
"""

from __future__ import annotations

import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .._validate import check_choice, check_int
from ..environment import environment
from .registry import Implementation, Runner, Unsupported, select

__all__ = ["DTYPES", "DEVICES", "Timing", "Case", "measure", "prepare"]
__all__ += ["time_interleaved", "summarize", "log", "check_arguments"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}

#: ``--device``: ``auto`` is cuda where there is one, else cpu.
DEVICES = ("cpu", "cuda", "auto")


@dataclass(frozen=True)
class Timing:
    """How many calls: at least ``repeats`` timed, after ``warmup``; more
    rounds for fast cases until they took ``min_time`` s, at most
    ``max_repeats``."""

    repeats: int = 5
    warmup: int = 1
    min_time: float = 1.0
    max_repeats: int = 50

    def __post_init__(self) -> None:
        for name in ("repeats", "warmup", "max_repeats"):
            check_int(name, getattr(self, name))

    def record(self, device: torch.device) -> dict[str, Any]:
        """The fields of a report's ``config`` that say how it was timed."""
        timer = "CUDA events" if device.type == "cuda" else "time.perf_counter"
        return {**asdict(self), "timer": timer}


@dataclass
class Case:
    """One row to measure and the builder of its runner.

    ``build`` raises :class:`Unsupported` where the case cannot run.
    """

    row: dict[str, Any]
    build: Callable[[], Runner]
    library: str = "torch"


def measure(
    cases: dict[str, Case],
    device: torch.device,
    timing: Timing,
    label: str = "",
    quiet: bool = True,
) -> dict[str, Runner]:
    """Build, warm up and time every case; fill in each case's row.

    Each runner makes ``warmup`` untimed calls: the first tells whether it
    can run here. Every row gets ``status`` (``"ok"``, or ``"skipped"`` with
    the ``reason``); those that ran are timed in interleaved rounds, the
    entries of each library in rounds of their own, and get the figures of
    :func:`summarize`. Returns the runners that ran; unless ``quiet``, logs
    ``label`` and each case's time.
    """
    runners: dict[str, Runner] = {}
    for key, case in cases.items():
        case.row.update(status="ok", reason=None)
        try:
            runner = case.build()
            for _ in range(timing.warmup):
                probe(runner, device)
            runners[key] = runner
        except Unsupported as why:
            case.row.update(status="skipped", reason=str(why))
    log(f"{label}: timing {len(runners)} of {len(cases)}", quiet)
    for library in dict.fromkeys(case.library for case in cases.values()):
        group = {
            k: r for k, r in runners.items() if cases[k].library == library
        }
        for key, samples in time_interleaved(group, device, timing).items():
            cases[key].row.update(summarize(samples))
    for key, case in cases.items():
        row = case.row
        ms = f"{row['median_s'] * 1e3:10.3f} ms" if key in runners else ""
        log(f"    {key:<30} {ms or 'skipped: ' + row['reason']}", quiet)
    return runners


def summarize(samples: Sequence[float]) -> dict[str, Any]:
    """Median, minimum, quartiles, count, and the calls in round order."""
    ordered = sorted(samples)
    many = len(ordered) > 1
    q1, _, q3 = statistics.quantiles(ordered, n=4) if many else ordered * 3
    return {
        "median_s": statistics.median(ordered),
        "min_s": ordered[0],
        "q1_s": q1,
        "q3_s": q3,
        "repeats": len(ordered),
        "times_s": list(samples),
    }


def prepare(
    registry: dict[str, Implementation],
    impls: Sequence[str] | None,
    device: str,
    dtype: str,
    threads: int | None,
) -> tuple[torch.device, list[str], dict[str, Any]]:
    """The device, the entries and the environment of a run.

    ``device`` is ``"cpu"``, ``"cuda"`` or ``"auto"`` (cuda where there is
    one); ``impls`` None means the entries the device runs by default.
    """
    check_choice("device", device, DEVICES)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda' was asked for, but torch.cuda.is_available() is "
            "False"
        )
    torch_device = torch.device(device)
    impls = select(registry, impls, torch_device)
    if threads is not None:
        torch.set_num_threads(threads)
    return torch_device, impls, environment(torch_device, dtype)


def check_arguments(
    dtype: str, numbers: dict[str, object], lists: dict[str, Sequence[object]]
) -> None:
    """A dtype name, positive ints, non-empty lists of positive ints."""
    check_choice("dtype", dtype, tuple(DTYPES))
    for name, value in numbers.items():
        check_int(name, value)
    for name, values in lists.items():
        if not values:
            raise ValueError(
                f"{name} must be a non-empty list of positive ints, got []"
            )
        for value in values:
            check_int(f"each of {name}", value)


def log(message: str, quiet: bool) -> None:
    """A progress line on stderr, unless ``quiet``."""
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def probe(runner: Runner, device: torch.device) -> None:
    """Run once, untimed; raise :class:`Unsupported` if it cannot run.

    The reason is the first line of torch's error and of its warnings.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.no_grad():
                runner()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except (RuntimeError, NotImplementedError) as error:
            reasons = [str(w.message).splitlines()[0] for w in caught]
            text = str(error).strip()
            first = text.splitlines()[0] if text else type(error).__name__
            raise Unsupported("; ".join([first, *reasons])) from None


def time_call(runner: Runner, device: torch.device) -> float:
    """Seconds for one call: CUDA events on a GPU, else perf_counter."""
    with torch.no_grad():
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            runner()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        begin = time.perf_counter()
        runner()
        return time.perf_counter() - begin


def time_interleaved(
    runners: dict[str, Runner], device: torch.device, timing: Timing
) -> dict[str, list[float]]:
    """Time every runner in interleaved rounds, each in a new random order.

    Interleaved, a change in the machine's load touches every runner alike.
    The (seeded) order changes so that no runner always follows the same
    one: a call that frees a large tensor makes the next call's allocations
    fault in fresh pages, which would otherwise be charged to one neighbour.
    """
    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(0)
    start = time.perf_counter()
    rounds = 0
    while names and (
        rounds < timing.repeats
        or rounds < timing.max_repeats
        and time.perf_counter() - start < timing.min_time
    ):
        for name in order.sample(names, len(names)):
            times[name].append(time_call(runners[name], device))
        rounds += 1
    return times
