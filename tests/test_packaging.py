"""The package travels: the wheel built from this repository holds all of
`mha`, and installed alone (no source tree in sight) every module imports and
every command-line entry point answers `--help`."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mha"


def _tracked_package_files() -> list[str]:
    """Every file of mha/ that git tracks, as a path inside the wheel."""
    out = subprocess.run(
        ["git", "ls-files", "mha"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted(line for line in out.splitlines() if line)


def _source_modules() -> list[str]:
    """Dotted names of every module in the source tree, but `__main__`s."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def _entry_points() -> list[str]:
    """Packages with a `__main__.py`: `python -m <package>` commands."""
    return sorted(
        ".".join(path.parent.relative_to(ROOT).parts) for path in PACKAGE.rglob("__main__.py")
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Build from a copy of the tracked tree, so nothing the editable install
    # or an earlier build left in the checkout (build/, *.egg-info) is used.
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(
        ["git", "ls-files", "-z", "mha", "pyproject.toml", "README.md"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        target = src / os.fsdecode(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((ROOT / os.fsdecode(name)).read_bytes())
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"]
        + ["--no-build-isolation", "--wheel-dir", str(out), str(src)],
        check=True,
        timeout=300,
    )
    (built,) = out.glob("mha-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel. It sees this
    environment's third-party packages (torch, triton) through a path entry,
    which does not run this environment's editable install of `mha`."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        check=True,
        timeout=120,
    )
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "third_party.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install"]
        + ["--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=300,
    )
    return python


def _run_outside(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(python), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_wheel_holds_every_file_of_the_package(wheel):
    with zipfile.ZipFile(wheel) as archive:
        inside = {name for name in archive.namelist() if name.startswith("mha/")}
    missing = [name for name in _tracked_package_files() if name not in inside]
    assert not missing, f"the wheel {wheel.name} leaves out: {missing}"


def test_the_wheel_declares_what_mha_needs(wheel):
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist:")]
    plain = {
        line.split()[1].split(";")[0].rstrip("<>=!~0123456789.,")
        for line in requires
        if "extra ==" not in line
    }
    assert {"numpy", "torch", "matplotlib"} <= plain, requires
    extras = {
        line.split("extra ==")[1].strip().strip("\"'") for line in requires if "extra ==" in line
    }
    assert {"kernels", "llama"} <= extras, requires


def test_every_module_imports_from_the_installed_wheel(installed, tmp_path):
    modules = _source_modules()
    script = (
        "import importlib, pathlib, sys\n"
        f"names = {modules!r}\n"
        "for name in names:\n"
        "    module = importlib.import_module(name)\n"
        "    print(name, module.__file__)\n"
    )
    result = _run_outside(installed, "-c", script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    where = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert sorted(where) == sorted(modules)
    from_source = [n for n, f in where.items() if Path(f).resolve().is_relative_to(ROOT)]
    assert not from_source, f"imported from the source tree, not the wheel: {from_source}"


@pytest.mark.parametrize("package", _entry_points())
def test_every_command_answers_help_from_the_installed_wheel(installed, tmp_path, package):
    result = _run_outside(installed, "-m", package, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage" in result.stdout.lower(), result.stdout[:500]


def test_the_commands_this_test_runs_include_the_documented_ones():
    # `python -m mha.bench` and `python -m mha.parallel` are in the README.
    assert {"mha.bench", "mha.parallel"} <= set(_entry_points())
