"""Render built pages in headless Chromium and check that MathJax typeset the math offline."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

PAGES = [
    "chapters/01_single_head.html",
    "chapters/04_worked_example.html",
    "appendix/notation.html",
]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    reason = "headless Chromium is not installed (Debian package `chromium`; .ci/run installs it)"
    if os.environ.get("MHA_REQUIRE_CHROMIUM") or os.environ.get("CI"):
        pytest.fail(reason + ", and this run requires it")
    pytest.skip(reason)


def _dump_dom(browser: str, url: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
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
    browser = _chromium()
    path = html_dir / page
    assert path.exists(), f"{page} was not built"
    dom = _dump_dom(browser, path.as_uri())
    assert "<mjx-container" in dom, f"no MathJax output in {page}: the math was not typeset"
    # MathJax's injected stylesheet names mjx-merror too; an error is an element of that name.
    assert "<mjx-merror" not in dom, f"MathJax reported an error while typesetting {page}"
