"""Checks of the repository itself: pins agree, notebooks are stored from one clean run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "chapters").glob("*.ipynb")) + sorted(
    (ROOT / "appendix").glob("*.ipynb")
)


def _pins(lines):
    return {line.strip() for line in lines if re.match(r"^[A-Za-z0-9_.\-\[\]]+==", line.strip())}


def test_requirements_are_exact_pins():
    lines = [
        l
        for l in (ROOT / "requirements.txt").read_text().splitlines()
        if l.strip() and not l.startswith("#")
    ]
    loose = [l for l in lines if "==" not in l]
    assert not loose, f"requirements.txt must pin exact versions, found: {loose}"
    assert "torch==2.13.0" in lines
    assert any(l.startswith("jupyter-book==1.") for l in lines), "jupyter-book must be 1.x"
    # JupyterLab renders the chapters' MyST (exercises, folded solutions) only with it
    assert any(l.startswith("jupyterlab-myst==") for l in lines), "jupyterlab-myst must be pinned"


def test_environment_yml_has_the_same_pins():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert _pins(pip_section) == _pins((ROOT / "requirements.txt").read_text().splitlines())


def test_notebooks_exist():
    assert NOTEBOOKS, "no chapters found"


def test_notebooks_stored_from_one_fresh_run():
    problems = []
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        counts = [
            c.get("execution_count")
            for c in nb["cells"]
            if c["cell_type"] == "code" and "".join(c["source"]).strip()
        ]
        if counts != list(range(1, len(counts) + 1)):
            problems.append(f"{path.name}: execution counts {counts}")
        for i, cell in enumerate(nb["cells"]):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    problems.append(f"{path.name}: cell {i} stored an error")
        if nb.get("metadata", {}).get("kernelspec", {}).get("name") != "python3":
            problems.append(f"{path.name}: kernel is not python3")
    assert not problems, "\n".join(problems)


def test_only_device_dependent_cells_ignore_their_output():
    # NBVAL_IGNORE_OUTPUT is allowed only where the output depends on the machine
    # (timings, devices).
    allowed_words = (
        "time",
        "perf_counter",
        "bench",
        "device",
        "cuda",
        "backend",
        "sdpa_kernel",
        "timeit",
    )
    offenders = []
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        for i, cell in enumerate(nb["cells"]):
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and "NBVAL_IGNORE_OUTPUT" in source:
                if not any(word in source for word in allowed_words):
                    offenders.append(f"{path.name}: cell {i}")
            if cell["cell_type"] == "code" and (
                "NBVAL_SKIP" in source or "NBVAL_RAISES_EXCEPTION" in source
            ):
                offenders.append(f"{path.name}: cell {i} skips or expects an exception")
    assert not offenders, (
        "cells that ignore output without measuring time or devices:\n" + "\n".join(offenders)
    )


def test_glued_values_are_plain_python_types():
    # MyST-NB formats glued numbers with a format spec; a NumPy scalar's repr ("np.float64(...)")
    # cannot be formatted and only shows up as a build warning.
    offenders = []
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        for i, cell in enumerate(nb["cells"]):
            for out in cell.get("outputs", []):
                for mime, value in out.get("data", {}).items():
                    text = "".join(value) if isinstance(value, list) else str(value)
                    if mime.startswith("application/papermill.record") and re.match(
                        r"^np\.\w+\(", text
                    ):
                        offenders.append(f"{path.name}: cell {i} glues {text}")
    assert not offenders, "glue plain Python values (float(x), int(x)):\n" + "\n".join(offenders)
