"""Checks of the repository itself: pins agree, notebooks are stored from one clean run."""

from __future__ import annotations

import json
import os
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


# A number printed at rounding level (the size of float64's or float32's last bits) changes with
# the CPU's instruction set (torch and NumPy pick their kernels per CPU: AVX2, AVX-512), so nbval
# would fail on another reader's machine. Such a value is printed as a bound ("< 1e-12") or
# asserted.
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w.])")
_BOUND_BEFORE = re.compile(r"(?:<|≤|<=|\bbelow|\bunder|\bto|\bwithin|\bat most)\s*$")
_POWER_OF_TEN = re.compile(r"^1[eE]-?\d+$")  # a tolerance as written: 1e-12
_ROUNDING_LEVEL = 1e-9


def _compared_texts(cell):
    """The texts of a cell's stored outputs that nbval compares (images are not compared)."""
    for out in cell.get("outputs", []):
        if "text" in out:
            yield "".join(out["text"])
        for mime, value in out.get("data", {}).items():
            if not mime.startswith("image/"):
                if isinstance(value, list):
                    value = "".join(value)
                yield value if isinstance(value, str) else json.dumps(value)


def rounding_level_numbers(text):
    """Non-zero numbers below 1e-9 in absolute value that are not bounds.

    A bound follows '<', '≤', 'below', 'under', 'to', 'within' or 'at most', or is a power of ten
    (a tolerance such as 1e-12, glued or printed).
    """
    found = []
    for match in _NUMBER.finditer(text):
        try:
            value = float(match.group())
        except ValueError:
            continue
        if value != 0 and abs(value) < _ROUNDING_LEVEL and not _POWER_OF_TEN.match(match.group()):
            if not _BOUND_BEFORE.search(text[max(0, match.start() - 10) : match.start()]):
                found.append(match.group())
    return found


def test_rounding_level_scanner_finds_values_and_spares_bounds():
    assert rounding_level_numbers("max |diff| = 3e-16, near:2.2e-16") == ["3e-16", "2.2e-16"]
    assert rounding_level_numbers("tensor([1.0000e-10, 5.0000e-01])") == ["1.0000e-10"]
    assert rounding_level_numbers("diff < 3e-12, ≤ 4e-15, <= 2e-16, 0.0, 1e-6, 0e+00") == []
    assert rounding_level_numbers("below 2e-20, agree to 5e-13, at most 2.5e-14") == []
    assert rounding_level_numbers("x86-64 sm_80 ch13_x 1e-9 tolerance 1e-12") == []
    assert rounding_level_numbers("differs by 8.9e-16") == ["8.9e-16"]


def test_no_stored_output_prints_a_value_at_rounding_level():
    problems = []
    for path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            source = "".join(cell.get("source", ""))
            ignored = source.lstrip().startswith("# NBVAL_IGNORE_OUTPUT")
            if cell["cell_type"] != "code" or ignored:
                continue
            for text in _compared_texts(cell):
                for number in rounding_level_numbers(text):
                    problems.append(f"{path.relative_to(ROOT)} cell {i}: prints {number}")
    assert not problems, "print a bound, not the value:\n" + "\n".join(problems)


def test_ci_runs_nbval_under_another_instruction_set(monkeypatch):
    """.ci/run checks the stored outputs twice: on this CPU, then under a lower instruction set."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("make test") < ci.index("make nbval-other-isa")
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^nbval-other-isa:.*\n\t.*tests/nbval_other_isa\.py", makefile, re.M)

    import importlib.util

    spec = importlib.util.spec_from_file_location("other", ROOT / "tests" / "nbval_other_isa.py")
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    for own, level in (("AVX512", "avx2"), ("AVX2", "default"), ("DEFAULT", "default")):
        monkeypatch.setattr(other.torch.backends.cpu, "get_cpu_capability", lambda own=own: own)
        env = other.other_isa()
        assert env["ATEN_CPU_CAPABILITY"] == level
        assert env["ONEDNN_MAX_CPU_ISA"] == {"avx2": "AVX2", "default": "SSE41"}[level]
        disabled = env["NPY_DISABLE_CPU_FEATURES"].split()
        assert "X86_V2" not in disabled  # NumPy's baseline cannot be disabled
        has_avx2 = "X86_V3" in other.__cpu_dispatch__ and other.__cpu_features__.get("X86_V3")
        assert ("X86_V3" in disabled) == (level == "default" and bool(has_avx2))


def test_the_readme_is_for_the_reader_and_contributing_holds_the_rest():
    # The README: what the book is, the two commands, reading, running, the package in ten lines,
    # where to go next, under 8,000 characters; the rooms and how to contribute are elsewhere.
    readme = (ROOT / "README.md").read_text()
    assert len(readme) < 8000, len(readme)
    for words in ("make book", "make test", "make lab", "make gpu-check", "CONTRIBUTING.md"):
        assert words in readme, words
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    assert "## Rooms: which module, which chapter, which tests" in contributing
    assert "### Adding a chapter" in contributing and "Rooms" not in readme


def test_bfloat16_attention_runs_under_the_other_instruction_set():
    # An AVX-512/AMX CPU forced to torch's AVX2 kernels must not take the AMX packing road that no
    # real AVX2 CPU takes: the environment nbval_other_isa.py sets runs bfloat16 SDPA.
    import importlib.util
    import subprocess
    import sys

    spec = importlib.util.spec_from_file_location("other", ROOT / "tests" / "nbval_other_isa.py")
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    env = other.other_isa()
    env.pop("own")
    code = (
        "import torch, torch.nn.functional as F\n"
        "q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)\n"
        "print(F.scaled_dot_product_attention(q, q, q).shape)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-800:]
    assert "torch.Size([1, 2, 8, 16])" in run.stdout
