"""Render built pages in headless Chromium and check that MathJax typeset the math offline."""

from __future__ import annotations

import subprocess
import tempfile

import pytest
from browser import HEADLESS_FLAGS, require_chromium

PAGES = [
    "chapters/01_single_head.html",
    "chapters/04_worked_example.html",
    "appendix/notation.html",
]


def _dump_dom(browser: str, url: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            [
                browser,
                *HEADLESS_FLAGS,
                f"--user-data-dir={profile}",
                "--virtual-time-budget=15000",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 0, f"chromium failed on {url}:\n{result.stderr[-2000:]}"
    return result.stdout


@pytest.mark.parametrize("page", PAGES)
def test_math_is_typeset(html_dir, page):
    browser = require_chromium()
    path = html_dir / page
    assert path.exists(), f"{page} was not built"
    dom = _dump_dom(browser, path.as_uri())
    assert "<mjx-container" in dom, f"no MathJax output in {page}: the math was not typeset"
    # MathJax's injected stylesheet names mjx-merror too; an error is an element of that name.
    assert "<mjx-merror" not in dom, f"MathJax reported an error while typesetting {page}"
