"""Reading and writing reports.

Figures of one row, paired time ratios, tables, JSON and CSV.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "RATIO_PAIRS",
    "MIB",
    "lookup",
    "ratios",
    "format_table",
    "CSV_FIELDS",
    "write_results",
    "load_results",
    "series",
]

#: Ratios of median times printed side by side: (numerator, denominator).
RATIO_PAIRS: tuple[tuple[str, str], ...] = (
    ("mha_module", "sdpa_bare"),
    ("torch_mha", "mha_module"),
    ("torch_mha_general", "mha_module"),
    ("torch_textbook", "mha_module"),
)

MIB = 2**20


def lookup(
    report: dict[str, Any], impl: str, seq_len: int, field: str = "median_s"
) -> float | None:
    """One figure of a report: ``field`` of the measured row (impl, T).

    None if there is none.
    """
    for row in report["results"]:
        if (
            row["impl"] == impl
            and row["seq_len"] == seq_len
            and row["status"] == "ok"
        ):
            value = row.get(field)
            return None if value is None else float(value)
    return None


def _row(
    report: dict[str, Any], impl: str, seq_len: int
) -> dict[str, Any] | None:
    for row in report["results"]:
        if (
            row["impl"] == impl
            and row["seq_len"] == seq_len
            and row["status"] == "ok"
        ):
            return row
    return None


def _time_ratio(
    report: dict[str, Any], numerator: str, denominator: str, seq_len: int
) -> float | None:
    """Median of the per-round ratios of two implementations' times.

    See :func:`ratios`.
    """
    a, b = _row(report, numerator, seq_len), _row(report, denominator, seq_len)
    return paired_ratio(a, b)


def paired_ratio(a: dict[str, Any] | None, b: dict[str, Any] | None):
    """Median of the per-round ratios of two rows' times (calls of one round).

    Rows without paired ``times_s`` give the ratio of their medians; a
    missing row gives None.
    """
    if a is None or b is None:
        return None
    times_a, times_b = a.get("times_s"), b.get("times_s")
    if times_a and times_b and len(times_a) == len(times_b):
        return statistics.median(x / y for x, y in zip(times_a, times_b))
    return a["median_s"] / b["median_s"]


def ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per T, the time ratios of :data:`RATIO_PAIRS`, and of peak memory.

    The ratios of peak memory are there if memory was measured. A time ratio is
    the median, over the timing rounds, of the ratio of the two calls made in
    the same round (``times_s`` of both rows, in round order): calls made
    seconds apart share the machine's state, so a shared machine's changing
    load cancels out better than in a ratio of medians. Rows without paired
    ``times_s`` fall back to the ratio of their medians.
    ``"mha_module/sdpa_bare": 1.05`` means the module took 5 % longer than the
    bare floor; ``"torch_mha/mha_module": 2.0`` means torch's layer took twice
    as long as the module.
    """
    rows = []
    for seq_len in report["config"]["seq_lens"]:
        row: dict[str, Any] = {"seq_len": seq_len}
        for numerator, denominator in RATIO_PAIRS:
            row[f"{numerator}/{denominator}"] = _time_ratio(
                report, numerator, denominator, seq_len
            )
        if report["config"].get("memory"):
            for numerator, denominator in RATIO_PAIRS:
                a = lookup(report, numerator, seq_len, "peak_memory_bytes")
                b = lookup(report, denominator, seq_len, "peak_memory_bytes")
                row[f"memory {numerator}/{denominator}"] = (
                    None if a is None or b is None or b == 0 else a / b
                )
        rows.append(row)
    return rows


def format_table(report: dict[str, Any]) -> str:
    """The results as a text table, one block per T, then the ratio table."""
    env, config = report["environment"], report["config"]
    on_gpu = env["device"] == "cuda"
    unit, scale = ("TFLOP/s", 1e12) if on_gpu else ("GFLOP/s", 1e9)
    memory = bool(config.get("memory"))
    lines = [
        f"{env['device_name']} ({env['device']}), "
        f"torch {env['torch_version']}, numpy {env['numpy_version']}, "
        f"{env['dtype']}, {env['threads']} threads, {env['date_utc']}",
        f"B={config['batch']} H={config['heads']} "
        f"d_k={config['head_dim']} D={config['embed_dim']}"
        f"{' causal' if config['causal'] else ''}; "
        f"median of >= {config['repeats']} calls ({config['timer']}); "
        "a layer row's core rate = core FLOPs / layer time",
        "",
    ]
    header = (
        f"{'T':>6}  {'impl':<16} {'scope':<11} {'median ms':>11} "
        f"{'layer ' + unit:>15} {'core ' + unit:>14} {'proj ' + unit:>14}"
    )
    if memory:
        header += f" {'peak MiB':>10}"
    lines += [header, "-" * len(header)]
    for row in report["results"]:
        if row["status"] != "ok":
            continue
        rates = [
            row.get(f"{part}_flop_per_s")
            for part in ("layer", "core", "projection")
        ]
        cells = [
            f"{rate / scale:>{w}.2f}" if rate is not None else f"{'':>{w}}"
            for rate, w in zip(rates, (15, 14, 14))
        ]
        line = (
            f"{row['seq_len']:>6}  {row['impl']:<16} {row['scope']:<11} "
            f"{row['median_s'] * 1e3:>11.3f} " + " ".join(cells)
        )
        if memory:
            peak = row.get("peak_memory_bytes")
            line += (
                f" {peak / MIB:>10.1f}" if peak is not None else f" {'':>10}"
            )
        lines.append(line)
    skipped_rows: dict[tuple[str, str], list[int]] = {}
    for row in report["results"]:
        if row["status"] != "ok":
            skipped_rows.setdefault((row["impl"], row["reason"]), []).append(
                row["seq_len"]
            )
    if skipped_rows:
        lines += ["", "skipped:"]
        for (impl, reason), lens in skipped_rows.items():
            lines.append(
                f"  {impl} at T = {', '.join(map(str, lens))}: {reason}"
            )
    ratio_rows = report.get("ratios") or []
    if ratio_rows:
        keys = [key for key in ratio_rows[0] if key != "seq_len"]
        keys = [
            key
            for key in keys
            if any(r.get(key) is not None for r in ratio_rows)
        ]
        if keys:
            lines += [
                "",
                "time ratios (median of per-round ratios; peak memory where "
                "marked), from this run:",
            ]
            widths = [max(len(key), 8) for key in keys]
            lines.append(
                f"{'T':>6}  "
                + "  ".join(f"{key:>{w}}" for key, w in zip(keys, widths))
            )
            for r in ratio_rows:
                cells = [
                    f"{r[key]:>{w}.2f}"
                    if r.get(key) is not None
                    else f"{'-':>{w}}"
                    for key, w in zip(keys, widths)
                ]
                lines.append(f"{r['seq_len']:>6}  " + "  ".join(cells))
    return "\n".join(lines)


CSV_FIELDS = (
    "impl",
    "scope",
    "seq_len",
    "status",
    "reason",
    "median_s",
    "min_s",
    "q1_s",
    "q3_s",
    "repeats",
    "flop",
    "flop_per_s",
    "layer_flop_per_s",
    "core_flop_per_s",
    "projection_flop_per_s",
    "core_flop",
    "projection_flop",
    "layer_flop",
    "peak_memory_bytes",
    "memory_method",
)


def write_results(report: dict[str, Any], path: str | Path) -> Path:
    """Write ``report`` as JSON (``.json``) or CSV (``.csv``).

    The CSV repeats the environment on each row.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".csv"):
        raise ValueError(
            f"output must end in .json or .csv, got {str(path)!r}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".json":
        path.write_text(json.dumps(report, indent=1) + "\n")
        return path
    env_fields = [f"env_{key}" for key in report["environment"]]
    config_fields = [
        f"config_{key}"
        for key in ("batch", "heads", "head_dim", "embed_dim", "causal")
    ]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(
            handle, fieldnames=[*CSV_FIELDS, *config_fields, *env_fields]
        )
        writer.writeheader()
        for row in report["results"]:
            record = {field: row.get(field) for field in CSV_FIELDS}
            record.update(
                {f"env_{k}": v for k, v in report["environment"].items()}
            )
            record.update(
                {
                    f"config_{k}": report["config"][k]
                    for k in (
                        "batch",
                        "heads",
                        "head_dim",
                        "embed_dim",
                        "causal",
                    )
                }
            )
            writer.writerow(record)
    return path


def load_results(path: str | Path) -> dict[str, Any]:
    """Read a report written by :func:`write_results` as JSON."""
    return json.loads(Path(path).read_text())


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
