"""The notebooks read in JupyterLab as in the book.

`make lab`'s server (JupyterLab with `_ext/lab_config.py`) is started on a loopback port and
headless Chromium opens the chapters in it. In the rendered markdown there must be no glue key,
no bibtex key, no cross-reference label and no raw MyST role: every number, citation and
cross-reference shows as the book shows it. Every solution is one folded box: nothing of it, code
or prose, is visible before it is opened. A control opens a chapter in JupyterLab without the
book's view, where the same check must find the raw keys.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "book"))
from browser import browser, require_chromium  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "_ext" / "lab_config.py"
NOTEBOOKS = [
    *sorted((ROOT / "chapters").glob("*.ipynb")),
    ROOT / "appendix" / "attention_bugs.ipynb",
]
RAW_ROLE = re.compile(r"\{(?:glue|cite|ref|numref|doc|eval|solution|exercise)[\w:-]*\}")
# a directive's fence shown as text (```{admonition}, :::{note}): MyST did not parse it
RAW_FENCE = re.compile(r"(?:`{3,}|:{3,})\s*\{[\w-]+\}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def lab_server(tmp: Path, *, book_view: bool = True) -> Iterator[str]:
    """JupyterLab as `make lab` starts it (or without the book's view); yields its base URL
    with the token."""
    port, token = _free_port(), secrets.token_hex(16)
    # all cells in the page at once, so that every markdown cell is rendered
    settings = tmp / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    args = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        f"--ServerApp.token={token}",
        f"--ServerApp.root_dir={ROOT}",
        f"--LabApp.user_settings_dir={tmp / 'settings'}",
        f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if book_view:
        args.append(f"--config={CONFIG}")
    if os.geteuid() == 0:
        args.append("--allow-root")
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp / "config")}
    env["JUPYTER_RUNTIME_DIR"] = str(tmp / "runtime")
    log = (tmp / "server.log").open("w")
    server = subprocess.Popen(
        args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((tmp / "server.log").read_text()[-3000:]) from None
                time.sleep(0.2)
        yield base, token
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


# What the page shows: every markdown cell's visible text, the solutions' boxes and whether
# each is closed.
READ_PAGE = """(() => {
  const cells = [...document.querySelectorAll('.jp-Notebook .jp-MarkdownCell')];
  const boxes = [...document.querySelectorAll('.jp-Notebook details')];
  return {
    cells: cells.length,
    rendered: document.querySelectorAll('.jp-Notebook .jp-MarkdownCell .myst').length,
    text: cells.map(c => c.innerText).join('\\n'),
    closed: boxes.filter(b => !b.open).map(b => b.querySelector('summary')?.innerText || ''),
  };
})()"""


def read_notebook(page, base: str, token: str, path: Path) -> dict:
    """Open ``path`` in JupyterLab and read its rendered markdown once it has settled."""
    relative = path.relative_to(ROOT).as_posix()
    page.call(
        "Emulation.setDeviceMetricsOverride",
        width=1280,
        height=1600,
        deviceScaleFactor=1,
        mobile=False,
    )
    page.call("Page.navigate", url=f"{base}/lab/tree/{relative}?token={token}&reset")
    expected = sum(c["cell_type"] == "markdown" for c in json.loads(path.read_text())["cells"])
    deadline, last, seen, same = time.monotonic() + 90, None, None, 0
    while time.monotonic() < deadline:
        seen = page.evaluate(READ_PAGE)
        same = same + 1 if seen == last else 0
        # unchanged over four reads (1.6 s): a long notebook on a loaded machine can pause
        # between cells for longer than one read's interval
        settled = seen["cells"] and seen["rendered"] >= seen["cells"] // 2 and same >= 4
        if settled and seen["cells"] >= min(expected, 1):
            return seen
        last = seen
        time.sleep(0.4)
    raise AssertionError(f"{relative} did not finish rendering in JupyterLab: {seen}")


def glue_keys(notebook: dict) -> set[str]:
    return {
        output["metadata"]["scrapbook"]["name"]
        for cell in notebook["cells"]
        for output in cell.get("outputs", [])
        if "scrapbook" in output.get("metadata", {})
    }


def labels(notebook: dict) -> set[str]:
    source = "\n".join("".join(c["source"]) for c in notebook["cells"])
    found = set(re.findall(r"^\(([\w-]+)\)=", source, re.M))
    found |= set(re.findall(r"^:label:\s*([\w-]+)", source, re.M))
    found |= {
        c["metadata"]["mystnb"]["figure"]["name"]
        for c in notebook["cells"]
        if c.get("metadata", {}).get("mystnb", {}).get("figure", {}).get("name")
    }
    return found


BIBTEX_KEYS = set(re.findall(r"^@\w+\{([^,\s]+),", (ROOT / "references.bib").read_text(), re.M))


def raw_things(text: str, notebook: dict) -> list[str]:
    """Key names, bibtex keys, labels and raw roles that the rendered text shows."""
    words = set(re.findall(r"[\w-]+", text))
    found = [f"raw role {m}" for m in sorted(set(RAW_ROLE.findall(text)))]
    found += [f"raw fence {m}" for m in sorted(set(RAW_FENCE.findall(text)))]
    found += [f"glue key {k}" for k in sorted(glue_keys(notebook) & words)]
    found += [f"bibtex key {k}" for k in sorted(BIBTEX_KEYS & words)]
    found += [f"label {k}" for k in sorted(labels(notebook) & words)]
    return found


def solution_lines(notebook: dict) -> list[str]:
    """A telling line of every cell inside a solution: its first line of code or prose.

    A line that a cell outside the solutions shows too (an exercise's skeleton has the
    solution's signature) tells nothing, and is left out.
    """
    lines, outside, inside = [], [], False
    for cell in notebook["cells"]:
        source = "".join(cell["source"])
        if "{solution-start}" in source:
            inside = True
        elif "{solution-end}" in source:
            inside = False
        elif inside:
            first = next(
                (line.strip() for line in source.splitlines() if len(line.strip()) > 12), ""
            )
            if first and not re.search(r"[$`{\\]", first):  # plain text, as a browser shows it
                lines.append(first)
        else:
            outside.append(source)
    return [line for line in lines if not any(line in text for text in outside)]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    executable = require_chromium()
    with lab_server(tmp_path_factory.mktemp("lab")) as (base, token), browser(executable) as page:
        yield page, base, token


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_jupyterlab_shows_what_the_book_shows(lab, path):
    page, base, token = lab
    notebook = json.loads(path.read_text())
    seen = read_notebook(page, base, token, path)
    raw = raw_things(seen["text"], notebook)
    assert not raw, f"{path.name} in JupyterLab shows " + ", ".join(raw)
    solutions = sum("{solution-start}" in "".join(c["source"]) for c in notebook["cells"])
    folded = [title for title in seen["closed"] if title.startswith("Solution to Exercise")]
    assert len(folded) == solutions, (path.name, seen["closed"])
    visible = [line for line in solution_lines(notebook) if line in seen["text"]]
    assert not visible, f"{path.name}: solution text visible before it is opened: {visible}"


def _view():
    sys.path.insert(0, str(ROOT / "_ext"))
    import lab_view

    return lab_view


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_saving_from_jupyterlab_writes_back_the_books_source(path):
    view = _view()
    stored = json.loads(path.read_text())
    shown = view.render_notebook(
        json.loads(path.read_text()), str(path.relative_to(ROOT).with_suffix(""))
    )
    if any("{solution-start}" in "".join(c["source"]) for c in stored["cells"]):
        assert len(shown["cells"]) < len(stored["cells"])  # a solution is one cell
    # what JupyterLab sends back on save: the shown notebook as JSON
    saved = view.restore_notebook(json.loads(json.dumps(shown)))
    for cell in (*saved["cells"], *stored["cells"]):
        cell["source"] = "".join(cell["source"])
    assert saved == stored


def test_a_markdown_cell_the_learner_edited_keeps_the_learners_text():
    view = _view()
    path = ROOT / "chapters" / "03_heads_one_by_one.ipynb"
    shown = view.render_notebook(json.loads(path.read_text()), "chapters/03_heads_one_by_one")
    edited = next(c for c in shown["cells"] if "Vaswani et al. \\[2017\\]" in c["source"])
    edited["source"] = "my own notes"
    saved = view.restore_notebook(json.loads(json.dumps(shown)))
    assert sum(c["source"] == "my own notes" for c in saved["cells"]) == 1
    assert not any(view.KEPT in c.get("metadata", {}) for c in saved["cells"])


def test_make_lab_starts_jupyterlab_with_the_books_view():
    makefile = (ROOT / "Makefile").read_text()
    assert "--config=$(CURDIR)/_ext/lab_config.py" in makefile


def test_without_the_books_view_the_check_finds_the_raw_keys(tmp_path):
    # The control: JupyterLab on the same notebook without _ext/lab_config.py shows key names.
    path = ROOT / "chapters" / "04_worked_example.ipynb"
    executable = require_chromium()
    with lab_server(tmp_path, book_view=False) as (base, token), browser(executable) as page:
        seen = read_notebook(page, base, token, path)
    raw = raw_things(seen["text"], json.loads(path.read_text()))
    assert any(thing.startswith("glue key") for thing in raw), raw
    assert any(thing.startswith("bibtex key") for thing in raw), raw
