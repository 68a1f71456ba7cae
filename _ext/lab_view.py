"""JupyterLab shows the book's notebooks as the book shows them.

The notebooks are the one source of the book and of what JupyterLab shows.
Their markdown uses MyST roles that only the book's build resolves:
``{glue:text}`` pastes a number a code cell computed, ``{cite:t}`` a citation
from references.bib, ``{ref}``, ``{numref}`` and ``{doc}`` a cross-reference.
`make lab` starts JupyterLab with :class:`BookContentsManager` (through
``lab_config.py``), which hands JupyterLab each notebook with those roles
replaced by what the book prints:

- a glued value from the notebook's own stored glue outputs, formatted as
  MyST-NB formats it: the data the book pastes when it is built from the
  stored outputs;
- a citation as "Vaswani et al. [2017]" (``cite:t``) or "[Vaswani et al.,
  2017]" (``cite:p``), the labels of the book's bibliography (bibstyle.py);
- a cross-reference as the book numbers it (Exercise 3.1, Fig. 8.2, a
  section's title, chapter 5), a link where it leads to another notebook;
  exercises carry the book's numbers, and a figure its number and caption.

A solution (the cells between ``solution-start`` and ``solution-end``) becomes
one markdown cell, a folded box "Solution to Exercise 3.1" holding its prose,
its code and what the code printed: one click opens it, nothing of it shows
before.

When JupyterLab saves, the file gets back what it held: a solution's cells, a
figure's caption left out, the roles of a markdown cell (the original is kept
in the cell's metadata while the notebook is open). A markdown cell the
learner edited keeps the learner's text.
"""

from __future__ import annotations

import copy
import json
import posixpath
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from jupyter_server.services.contents.largefilemanager import (
    AsyncLargeFileManager,
)

ROOT = Path(__file__).resolve().parents[1]
# Where a cell keeps what the file holds while JupyterLab shows the view.
KEPT = "book_source"

ROLES = "glue:text|glue:md|glue|cite:t|cite:p|cite|ref|numref|doc"
ROLE = re.compile(r"\{(?P<role>" + ROLES + r")\}`(?P<text>[^`]*)`")
LABEL_TARGET = re.compile(
    r"^\((?P<label>[\w-]+)\)=\s*\n#+\s+(?P<title>.+)$", re.M
)
EXERCISE = re.compile(
    r"^[`:]{3,}\{exercise\}\s*(?P<title>.*)\n:label:\s*(?P<label>[\w-]+)",
    re.M,
)
SOLUTION_START = re.compile(
    r"^\s*[`:]{3,}\{solution-start\}\s*(?P<label>[\w-]+)"
)
SOLUTION_END = re.compile(r"^\s*[`:]{3,}\{solution-end\}")


# ---------------------------------------------------------------------------
# The book: its notebooks in order, their numbers, labels and bibliography


def _toc_files() -> list[str]:
    """The book's documents in the order of _toc.yml, as paths without
    suffix."""
    files = re.findall(
        r"^\s*-?\s*file:\s*(\S+)", (ROOT / "_toc.yml").read_text(), re.M
    )
    return files


@lru_cache(maxsize=1)
def book_index() -> dict[str, Any]:
    """Labels, titles and numbers of every notebook of the book, read from the
    files.

    The chapters are numbered in the order of _toc.yml (numbered parts);
    exercises and figures are numbered within their chapter (3.1, 3.2, ...), as
    the book numbers them.
    """
    titles: dict[str, str] = {}
    # label -> (document, what a reference to it shows)
    labels: dict[str, tuple[str, str]] = {}
    captions: dict[tuple[str, str], str] = {}  # (document, caption) -> number
    chapter = 0
    for document in _toc_files():
        path = ROOT / f"{document}.ipynb"
        if not path.exists():
            continue
        number = None
        if document.startswith("chapters/"):
            chapter += 1
            number = chapter
        cells = json.loads(path.read_text())["cells"]
        exercises = figures = 0
        for cell in cells:
            source = "".join(cell["source"])
            if cell["cell_type"] == "markdown":
                heading = re.search(r"^#\s+(.+)$", source, re.M)
                if heading and document not in titles:
                    titles[document] = heading.group(1).strip()
                for match in LABEL_TARGET.finditer(source):
                    labels[match["label"]] = (document, match["title"].strip())
                for match in EXERCISE.finditer(source):
                    exercises += 1
                    name = (
                        f"Exercise {number}.{exercises}"
                        if number
                        else "Exercise"
                    )
                    labels[match["label"]] = (document, name)
            mystnb = cell.get("metadata", {}).get("mystnb", {})
            if "figure" in mystnb:  # every figure is numbered, named or not
                figures += 1
                name = f"Fig. {number}.{figures}" if number else "Fig."
                if mystnb["figure"].get("name"):
                    labels[mystnb["figure"]["name"]] = (document, name)
                captions[(document, mystnb["figure"].get("caption"))] = name
    return {"titles": titles, "labels": labels, "figures": captions}


@lru_cache(maxsize=1)
def bibliography() -> dict[str, str]:
    """bibtex key -> "Vaswani et al., 2017", the labels of the book's
    reference list."""
    import sys

    from pybtex.database import parse_file

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bibstyle import AuthorYearLabels

    database = parse_file(str(ROOT / "references.bib"))
    # the reference list is sorted by author, year and title, as bibstyle's
    # style sorts it
    from pybtex.style.sorting.author_year_title import SortingStyle

    entries = SortingStyle().sort(list(database.entries.values()))
    labels = AuthorYearLabels().format_labels(entries)
    return {entry.key: label for entry, label in zip(entries, labels)}


# ---------------------------------------------------------------------------
# One notebook


def glued_values(notebook: dict) -> dict[str, dict[str, str]]:
    """Glue key -> the MIME bundle a code cell glued
    (``application/papermill.record/...``)."""
    values = {}
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            scrap = output.get("metadata", {}).get("scrapbook", {})
            if "name" in scrap:
                prefix = scrap.get(
                    "mime_prefix", "application/papermill.record/"
                )
                values[scrap["name"]] = {
                    mime[len(prefix) :]: data
                    for mime, data in output.get("data", {}).items()
                    if mime.startswith(prefix)
                }
    return values


def _format_plain(text: str, spec: str) -> str:
    """MyST-NB's formatting of a glued text/plain value with a format spec."""
    try:  # MyST-NB is pinned beside JupyterLab; the book uses this function
        from myst_nb.core.variables import format_plain_text
    except ImportError:
        format_plain_text = None
    if format_plain_text is not None:
        return format_plain_text(text, spec)
    return format(float(text), spec) if spec != "s" else text


def _link(document: str, target: str, text: str) -> str:
    """A markdown link from ``document`` to the notebook ``target`` (both
    without suffix)."""
    if target == document:
        return text
    relative = posixpath.relpath(target, posixpath.dirname(document))
    return f"[{text}]({relative}.ipynb)"


def render_role(role: str, text: str, document: str, glued: dict) -> str:
    """What the book prints for one role, as markdown."""
    explicit = re.fullmatch(
        r"(?P<shown>.+?)\s*<(?P<target>[^>]+)>", text, re.S
    )
    if role.startswith("glue"):
        key, _, spec = (
            text.partition(":") if role != "glue:md" else (text, "", "")
        )
        bundle = glued.get(key)
        if bundle is None:
            return f"`{text}`"
        if role == "glue:md" and "text/markdown" in bundle:
            return bundle["text/markdown"].strip()
        return _format_plain(bundle.get("text/plain", ""), spec or "s")
    if role.startswith("cite"):
        labels = [
            bibliography().get(key.strip(), key.strip())
            for key in text.split(",")
        ]
        # as the book prints them: Vaswani et al. [2017]; [Dao et al., 2022]
        if role == "cite:t":
            return ", ".join(
                re.sub(r", (\S+)$", r" \\[\1\\]", label) for label in labels
            )
        return "\\[" + ", ".join(labels) + "\\]"
    index = book_index()
    if role == "doc":
        target = explicit["target"] if explicit else text
        target = posixpath.normpath(
            posixpath.join(posixpath.dirname(document), target)
        )
        shown = (
            explicit["shown"]
            if explicit
            else index["titles"].get(target, target)
        )
        return _link(document, target, shown)
    label = explicit["target"] if explicit else text
    where, shown = index["labels"].get(label, (document, label))
    if explicit:
        shown = explicit["shown"]
    return _link(document, where, shown)


def _numbered_exercise(match: re.Match) -> str:
    """An exercise directive with the book's number (3.1) as its enumerator."""
    shown = book_index()["labels"].get(match["label"], ("", ""))[1]
    number = shown.removeprefix("Exercise").strip()
    if not number:
        return match[0]
    return f"{match[0]}\n:enumerator: {number}"


def render_markdown(source: str, document: str, glued: dict) -> str:
    source = EXERCISE.sub(_numbered_exercise, source)
    return ROLE.sub(
        lambda m: render_role(m["role"], m["text"], document, glued), source
    )


def _fence(text: str, mark: str, least: int) -> str:
    """A fence of ``mark`` longer than any run of it in ``text``."""
    runs = [len(run) for run in re.findall(f"{re.escape(mark)}+", text)]
    return mark * max(least, max(runs, default=0) + 1)


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def solution_cell(
    label: str, cells: list[dict], document: str, glued: dict
) -> dict:
    """One markdown cell holding a whole solution, folded as the book folds it.

    The solution's prose is rendered as the rest of the notebook; its code and
    what the code printed are shown as code blocks (a solution's cells print
    text only).
    """
    parts = []
    for cell in cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if "remove-cell" in tags:
            continue
        source = _source(cell)
        if cell["cell_type"] == "markdown":
            parts.append(render_markdown(source, document, glued))
            continue
        if "remove-input" not in tags and source.strip():
            fence = _fence(source, "`", 3)
            parts.append(f"{fence}python\n{source}\n{fence}")
        printed = "".join(
            _source({"source": output.get("text", "")})
            for output in cell.get("outputs", [])
            if output.get("output_type") == "stream"
        )
        if printed.strip() and "remove-output" not in tags:
            fence = _fence(printed, "`", 3)
            parts.append(f"{fence}text\n{printed.rstrip()}\n{fence}")
    body = "\n\n".join(parts)
    colons = _fence(body, ":", 4)
    source = (
        f"{colons}{{solution}} {label}\n:class: dropdown\n\n{body}\n{colons}"
    )
    return {"cell_type": "markdown", "metadata": {}, "source": source}


def _figure_caption(cell: dict, document: str) -> dict | None:
    """A markdown cell with the number and caption the book gives a figure."""
    figure = cell.get("metadata", {}).get("mystnb", {}).get("figure", {})
    if not figure.get("caption"):
        return None
    number = book_index()["figures"].get((document, figure["caption"]))
    text = f"**{number}** {figure['caption']}" if number else figure["caption"]
    return {
        "cell_type": "markdown",
        "metadata": {KEPT: {"inserted": True}},
        "source": text,
    }


def render_notebook(notebook: dict, document: str) -> dict:
    """The notebook as JupyterLab shows it (changed in place and returned)."""
    glued = glued_values(notebook)
    cells, solution = [], None
    for cell in notebook["cells"]:
        source = _source(cell)
        start = SOLUTION_START.match(source)
        if cell["cell_type"] == "markdown" and start:
            solution = (start["label"], [cell])
            continue
        if solution is not None:
            solution[1].append(cell)
            if cell["cell_type"] == "markdown" and SOLUTION_END.match(source):
                label, kept = solution
                folded = solution_cell(label, kept[1:-1], document, glued)
                folded["metadata"][KEPT] = {"cells": copy.deepcopy(kept)}
                cells.append(folded)
                solution = None
            continue
        if cell["cell_type"] == "markdown":
            shown = render_markdown(source, document, glued)
            if shown != source:
                cell.setdefault("metadata", {})[KEPT] = {
                    "source": source,
                    "shown": shown,
                }
                cell["source"] = shown
        cells.append(cell)
        caption = _figure_caption(cell, document)
        if caption:
            cells.append(caption)
    if solution is not None:  # a solution without its end: left as it is
        cells.extend(solution[1])
    notebook["cells"] = cells
    return notebook


def restore_notebook(notebook: dict) -> dict:
    """The notebook as the file holds it: every cell the view changed, put
    back.

    A folded solution is put back as the cells it was made of; a markdown cell
    whose roles were rendered gets its source back, unless the learner edited
    it (then it keeps the learner's text).
    """
    cells = []
    for cell in notebook["cells"]:
        kept = cell.get("metadata", {}).pop(KEPT, None)
        if kept is None:
            cells.append(cell)
        elif kept.get("inserted"):
            continue
        elif "cells" in kept:
            cells.extend(kept["cells"])
        else:
            if _source(cell) == kept["shown"]:
                cell["source"] = kept["source"]
            cells.append(cell)
    notebook["cells"] = cells
    return notebook


class BookContentsManager(AsyncLargeFileManager):
    """Jupyter Server's contents manager, handing out the book's notebooks
    rendered."""

    async def get(self, path, content=True, type=None, format=None, **kw):  # noqa: A002
        model = await super().get(
            path, content=content, type=type, format=format, **kw
        )
        if (
            content
            and model.get("type") == "notebook"
            and model.get("content")
        ):
            document = str(Path(path).with_suffix("")).strip("/")
            render_notebook(model["content"], document)
        return model

    async def save(self, model, path=""):
        if model.get("type") == "notebook" and model.get("content"):
            restore_notebook(model["content"])
        return await super().save(model, path)
