"""The package's rooms: CONTRIBUTING.md's table lists every module with the chapters that import
it, and no module imports another module's private names."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import mha

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mha"
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
#: Every notebook, as the table's chapters column names it: "01" ... or "appendix".
NOTEBOOKS = [(path.name[:2], path) for path in CHAPTERS]
NOTEBOOKS += [("appendix", path) for path in sorted((ROOT / "appendix").glob("*.ipynb"))]


def _rooms() -> set[str]:
    """Every module of the package as the table names it: mha/x.py, or mha/x/ for a package."""
    modules = {f"mha/{path.name}" for path in PACKAGE.glob("*.py") if path.name != "__init__.py"}
    packages = {f"mha/{path.parent.name}/" for path in PACKAGE.glob("*/__init__.py")}
    return modules | packages


def _room_of(dotted: str) -> str | None:
    """mha.x.y -> the room of mha.x; None for mha itself."""
    parts = dotted.split(".")
    if len(parts) < 2:
        return None
    name = parts[1]
    if (PACKAGE / name / "__init__.py").exists():
        return f"mha/{name}/"
    if (PACKAGE / f"{name}.py").exists():
        return f"mha/{name}.py"
    return None


def _room_of_name(name: str) -> str | None:
    """A name read from the top of the package: a module, a lazy name or the reference's."""
    return (
        _room_of(f"mha.{name}")
        or (_room_of(mha._LAZY[name]) if name in mha._LAZY else None)
        or ("mha/reference.py" if name in mha.reference.__all__ else None)
    )


def _imported_rooms(source: str) -> set[str]:
    """The rooms a notebook's code imports: ``import mha.x``, ``from mha.x import ...``,
    ``from mha import x`` and, after ``import mha``, ``mha.x``."""
    code = "\n".join(
        line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))
    )
    rooms: set[str | None] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mha":
            if node.module == "mha":
                rooms |= {_room_of_name(alias.name) for alias in node.names}
            else:
                rooms.add(_room_of(node.module))
        elif isinstance(node, ast.Import):
            rooms |= {_room_of(alias.name) for alias in node.names}
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "mha"
        ):
            rooms.add(_room_of_name(node.attr))
    return rooms - {None}


def _chapters_importing() -> dict[str, set[str]]:
    chapters: dict[str, set[str]] = {room: set() for room in _rooms()}
    for label, path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        for room in _imported_rooms(source):
            chapters[room].add(label)
    return chapters


def _table() -> dict[str, tuple[str, str]]:
    """CONTRIBUTING's table of rooms: module -> (chapters column, tests column)."""
    rows = {}
    for line in (ROOT / "CONTRIBUTING.md").read_text().splitlines():
        match = re.match(r"^\| `(mha/[^`]+)` \|.*\| ([^|]+) \| ([^|]+) \|$", line)
        if match:
            rows[match.group(1)] = (match.group(2).strip(), match.group(3).strip())
    return rows


def _chapter_numbers(text: str) -> set[str]:
    if text == "all":
        return {path.name[:2] for path in CHAPTERS}
    if text == "-":
        return set()
    return {number.strip() for number in text.split(",")}


def test_the_table_of_rooms_lists_every_module() -> None:
    table = _table()
    missing = sorted(_rooms() - set(table))
    assert not missing, f"CONTRIBUTING's table of rooms has no row for {missing}"
    gone = sorted(set(table) - _rooms())
    assert not gone, f"CONTRIBUTING's table of rooms lists modules that do not exist: {gone}"


def test_the_table_names_the_chapters_that_import_each_module() -> None:
    table = _table()
    wrong = []
    for room, chapters in sorted(_chapters_importing().items()):
        if room in table and _chapter_numbers(table[room][0]) != chapters:
            listed = ", ".join(sorted(chapters)) or "-"
            wrong.append(f"{room}: the table says {table[room][0]!r}, the notebooks: {listed}")
    assert not wrong, "\n".join(wrong)


def test_the_tests_the_table_names_exist() -> None:
    missing = []
    for room, (_, tests) in _table().items():
        for name in re.findall(r"`([^`]+\.py)`", tests):
            if not list((ROOT / "tests").glob(name)):
                missing.append(f"{room}: {name}")
    assert not missing, f"the table names tests that do not exist: {missing}"


def test_the_room_finder_reads_every_kind_of_import() -> None:
    source = (
        "import mha\nimport mha.plotting\nfrom mha.flash import flash_attention\n"
        "from mha import counting, MultiHeadAttention\n"
        "x = mha.softmax(y)\nz = mha.GroupedQueryAttention(8, 2, 1)\n%timeit f()\n"
    )
    assert _imported_rooms(source) == {
        "mha/plotting.py",
        "mha/flash.py",
        "mha/counting.py",
        "mha/module.py",
        "mha/reference.py",
        "mha/layer.py",
    }


def test_no_module_imports_another_modules_private_names() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0 and (node.module or "").split(".")[0] != "mha":
                continue  # another library's names
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    where = "." * node.level + (node.module or "")
                    offenders.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} {where} {alias.name}"
                    )
    assert not offenders, "private names imported across modules:\n" + "\n".join(offenders)
