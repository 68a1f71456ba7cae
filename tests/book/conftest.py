"""Fixtures for checks of the built HTML book (run after `make book`)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HTML = ROOT / "_build" / "html"


@pytest.fixture(scope="session")
def html_dir() -> Path:
    if not (HTML / "index.html").exists():
        pytest.fail(f"no built book at {HTML}: run `make book` first (`make test` does)")
    return HTML


@pytest.fixture(scope="session")
def html_pages(html_dir: Path) -> list[Path]:
    pages = sorted(p for p in html_dir.rglob("*.html") if "_static" not in p.parts)
    assert pages, "the built book has no pages"
    return pages
