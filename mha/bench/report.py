"""Reading and writing reports: one figure, paired ratios, series, JSON.

A report is a JSON-ready dict: ``environment`` (:mod:`mha.environment`,
with the command line), ``config`` (what was run, how it was timed),
``results`` (one row per measured case) and ``ratios``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MIB", "paired_ratio", "find_row", "lookup", "series"]
__all__ += ["write_results", "load_results", "number", "text_table"]
__all__ += ["ratio_table"]

MIB = 2**20


def paired_ratio(
    a: dict[str, Any] | None, b: dict[str, Any] | None
) -> float | None:
    """Median of the per-round ratios of two rows' times.

    The calls of one round were made seconds apart and share the machine's
    state, so a shared machine's changing load cancels out better than in a
    ratio of medians. Rows without paired ``times_s`` give the ratio of their
    medians; a missing row gives None.
    """
    if a is None or b is None:
        return None
    times_a, times_b = a.get("times_s"), b.get("times_s")
    if times_a and times_b and len(times_a) == len(times_b):
        return statistics.median(x / y for x, y in zip(times_a, times_b))
    return a["median_s"] / b["median_s"]


def find_row(report: dict[str, Any], **match: object) -> dict | None:
    """The measured row whose fields equal ``match``; None if there is none."""
    for row in report["results"]:
        if row["status"] == "ok" and all(
            row.get(key) == value for key, value in match.items()
        ):
            return row
    return None


def lookup(
    report: dict[str, Any], impl: str, seq_len: int, field: str = "median_s"
) -> float | None:
    """``field`` of the measured row (impl, T); None if there is none."""
    row = find_row(report, impl=impl, seq_len=seq_len)
    value = None if row is None else row.get(field)
    return None if value is None else float(value)


def series(
    report: dict[str, Any], impl: str, field: str = "median_s"
) -> tuple[np.ndarray, np.ndarray]:
    """``(seq_lens, values)`` of one implementation's measured rows.

    Two 1-D arrays, for plotting.
    """
    pairs = [
        (row["seq_len"], row[field])
        for row in report["results"]
        if row["impl"] == impl
        and row["status"] == "ok"
        and row.get(field) is not None
    ]
    seq_lens = np.array([t for t, _ in pairs], dtype=np.int64)
    values = np.array([v for _, v in pairs], dtype=np.float64)
    return seq_lens, values


def write_results(report: dict[str, Any], path: str | Path) -> Path:
    """Write ``report`` as JSON to ``path`` (which must end in ``.json``)."""
    path = Path(path)
    if path.suffix.lower() != ".json":
        raise ValueError(f"output must end in .json, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def load_results(path: str | Path) -> dict[str, Any]:
    """Read a report written by :func:`write_results`."""
    return json.loads(Path(path).read_text())


def number(value: float | None, spec: str, scale: float = 1.0) -> str | None:
    """``value / scale`` formatted with ``spec``; None stays None."""
    return None if value is None else format(value / scale, spec)


def text_table(
    header: Sequence[str], rows: Iterable[Sequence[object]]
) -> list[str]:
    """Lines of a table, each column right-aligned; None prints as ``-``."""
    cells = [list(header)]
    cells += [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return [lines[0], "-" * len(lines[0]), *lines[1:]]


def ratio_table(rows: list[dict[str, Any]], ids: dict[str, str]) -> list[str]:
    """Lines of a table of ratios: the ``ids`` columns (key: heading), then
    every other key that has a value, to two decimals."""
    keys = [k for k in rows[0] if k not in ids] if rows else []
    keys = [k for k in keys if any(r[k] is not None for r in rows)]
    cells = (
        [*(r[i] for i in ids), *(number(r[k], ".2f") for k in keys)]
        for r in rows
    )
    return text_table([*ids.values(), *keys], cells) if keys else []
