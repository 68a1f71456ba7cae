"""Checks of the built HTML.

Every chapter is there, nothing loads from another host, links resolve.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import yaml

ROOT = Path(__file__).resolve().parents[2]


class _Refs(HTMLParser):
    """Collect (tag, attribute, value) for every src/href, and every id on the page."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, str, str]] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value is None:
                continue
            if name in ("src", "href") or (tag == "link" and name == "href"):
                self.refs.append((tag, name, value))
            if name == "id":
                self.ids.add(value)


def _parse(page: Path) -> _Refs:
    parser = _Refs()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def _is_external(url: str) -> bool:
    url = url.strip()
    return url.startswith("//") or bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", url))


def _toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        for chapter in part.get("chapters", []):
            files.append(chapter["file"])
    return files


def test_every_toc_entry_was_built(html_dir):
    missing = [f for f in _toc_files() if not (html_dir / f"{f}.html").exists()]
    assert not missing, f"pages listed in _toc.yml but not built: {missing}"


def test_every_chapter_notebook_is_in_the_toc():
    listed = set(_toc_files())
    notebooks = {f"chapters/{p.stem}" for p in (ROOT / "chapters").glob("*.ipynb")}
    assert notebooks <= listed, f"notebooks not in _toc.yml: {sorted(notebooks - listed)}"


def test_no_page_loads_anything_from_another_host(html_pages):
    offenders = []
    for page in html_pages:
        for tag, attr, value in _parse(page).refs:
            if tag in (
                "script",
                "link",
                "img",
                "iframe",
                "source",
                "video",
                "audio",
                "embed",
            ) and _is_external(value):
                offenders.append(f"{page.name}: <{tag} {attr}={value!r}>")
    assert not offenders, "built pages load resources from other hosts:\n" + "\n".join(offenders)


def test_no_stylesheet_or_script_names_another_host(html_dir):
    # CSS @import / url() and JS loaders could fetch from a CDN even when the HTML does not.
    pattern = re.compile(r"""(?:@import\s+|url\()\s*['"]?(https?:)?//""")
    offenders = [
        str(p.relative_to(html_dir))
        for p in html_dir.rglob("*.css")
        if pattern.search(p.read_text(encoding="utf-8", errors="ignore"))
    ]
    assert not offenders, f"stylesheets that import from other hosts: {offenders}"


def test_mathjax_is_served_locally(html_dir):
    page = html_dir / "chapters" / "01_single_head.html"
    scripts = [v for t, a, v in _parse(page).refs if t == "script" and "mathjax" in v.lower()]
    assert scripts, "no MathJax script on the chapter page"
    for src in scripts:
        target = (page.parent / unquote(urlsplit(src).path)).resolve()
        assert target.is_file(), f"MathJax script {src} is not in the built book"


def test_internal_links_resolve(html_pages, html_dir):
    ids_cache: dict[Path, set[str]] = {}
    broken = []
    for page in html_pages:
        for tag, attr, value in _parse(page).refs:
            if _is_external(value) or value.startswith(("mailto:", "javascript:", "data:")):
                continue
            parts = urlsplit(value)
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if not target.exists():
                broken.append(f"{page.relative_to(html_dir)}: {value}")
                continue
            if parts.fragment and target.suffix == ".html" and tag == "a":
                if target not in ids_cache:
                    ids_cache[target] = _parse(target).ids
                if parts.fragment not in ids_cache[target]:
                    broken.append(f"{page.relative_to(html_dir)}: {value} (no such anchor)")
    assert not broken, "broken internal links:\n" + "\n".join(broken[:50])


def test_no_error_output_in_built_pages(html_pages):
    offenders = [
        p.name
        for p in html_pages
        if "Traceback (most recent call last)" in p.read_text(encoding="utf-8")
    ]
    assert not offenders, f"pages that show a Python traceback: {offenders}"


# ---------------------------------------------------------------------------------------------
# What the reader must not see: the machinery of a checkable book, and links that read badly


class _Text(HTMLParser):
    """The text of the article: shown code (cell inputs) apart from prose, and internal links."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # > 0 inside <article>
        self.code_depth = 0  # > 0 inside a cell input
        self.code: list[str] = []
        self.prose: list[str] = []
        self.links: list[tuple[str, str]] = []  # (href, text) of <a class="reference internal">
        self._link: list | None = None
        self._stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if tag == "article":
            self.depth += 1
        if self.depth and tag == "div":
            self._stack.append("code" if "cell_input" in classes else "div")
            if "cell_input" in classes:
                self.code_depth += 1
        if self.depth and tag == "a" and "reference" in classes and "internal" in classes:
            self._link = [attrs.get("href", ""), ""]

    def handle_endtag(self, tag):
        if tag == "article":
            self.depth -= 1
        if self.depth and tag == "div" and self._stack:
            if self._stack.pop() == "code":
                self.code_depth -= 1
        if tag == "a" and self._link is not None:
            self.links.append((self._link[0], self._link[1].strip()))
            self._link = None

    def handle_data(self, data):
        if not self.depth:
            return
        (self.code if self.code_depth else self.prose).append(data)
        if self._link is not None:
            self._link[1] += data


def _article(page: Path) -> _Text:
    parser = _Text()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


MACHINERY = ("glue(", "from myst_nb import", "NBVAL_", "set_num_threads")
ABOUT_THE_BUILD = (
    "this edition",
    "this page was built",
    "when this page was",
    "built this page",
    "no gpu was available",
    "stored outputs",
    "stored output",
)


def test_shown_code_has_no_machinery(html_pages, html_dir):
    offenders = []
    for page in html_pages:
        code = "".join(_article(page).code)
        for word in MACHINERY:
            if word in code:
                offenders.append(f"{page.relative_to(html_dir)}: shows {word!r}")
        for key in re.findall(r"#.*\b([a-z]+\d{4}[a-z]+)\b", code):
            offenders.append(f"{page.relative_to(html_dir)}: a BibTeX key in a comment: {key}")
    assert not offenders, "machinery on show (hide it with cell tags):\n" + "\n".join(offenders)


def test_prose_speaks_of_the_subject_not_of_the_build(html_pages, html_dir):
    offenders = []
    for page in html_pages:
        prose = " ".join("".join(_article(page).prose).split()).lower()
        offenders += [
            f"{page.relative_to(html_dir)}: {p!r}" for p in ABOUT_THE_BUILD if p in prose
        ]
    assert not offenders, "sentences about how the book was made:\n" + "\n".join(offenders)


# LaTeX text commands are for a LaTeX build; in HTML they show as typed (a BibTeX field, say)
RAW_LATEX = re.compile(r"\\(texttt|textbf|textit|emph|url|href)\b")


def test_no_raw_latex_text_commands_in_prose(html_pages, html_dir):
    offenders = []
    for page in html_pages:
        prose = " ".join(_article(page).prose)
        offenders += [f"{page.relative_to(html_dir)}: \\{m}" for m in RAW_LATEX.findall(prose)]
    assert not offenders, "raw LaTeX in the rendered text:\n" + "\n".join(offenders)


def _titles(html_dir: Path) -> dict[Path, str]:
    titles = {}
    for page in html_dir.rglob("*.html"):
        match = re.search(r"<title>(.*?) &#8212;", page.read_text(encoding="utf-8"))
        if match:
            title = re.sub(r"^[\d.]+\s+", "", match.group(1))  # without its number
            titles[page.resolve()] = title.replace("&amp;", "&")
    return titles


def test_links_read_as_prose(html_pages, html_dir):
    titles = _titles(html_dir)
    offenders = []
    for page in html_pages:
        if page.name in ("genindex.html", "search.html") or page.parent.name == "_static":
            continue
        article = _article(page)
        for href, text in article.links:
            target = (page.parent / unquote(urlsplit(href).path)).resolve()
            if target != page.resolve() and titles.get(target) == text and len(text) > 25:
                offenders.append(f"{page.relative_to(html_dir)}: a link reads {text!r}")
        prose = " ".join("".join(article.prose).split())
        for doubled in re.findall(r"\b(chapter|exercise|figure|section) \1\b", prose, re.I):
            offenders.append(f"{page.relative_to(html_dir)}: {doubled!r} twice in a row")
    assert not offenders, "links that paste a whole title into a sentence:\n" + "\n".join(
        offenders[:40]
    )
