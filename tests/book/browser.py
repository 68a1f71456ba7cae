"""A small headless-Chromium driver for the checks of the built book.

Chromium is started with its DevTools protocol on a loopback port; the page is loaded at a given
window width and JavaScript is evaluated in it after layout (and after MathJax has typeset the
math), so a test can measure what a reader sees. Only ``websocket-client`` is needed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import websocket

#: Headless, offline, no first-run work: every launch of the book's checks.
HEADLESS_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

#: The driven browser: DevTools on a loopback port of Chromium's choosing.
FLAGS = [
    *HEADLESS_FLAGS,
    "--hide-scrollbars",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def require_chromium() -> str:
    """Chromium's path; skip the test without it, or fail where CI or
    ``MHA_REQUIRE_CHROMIUM`` says it must run."""
    import pytest

    executable = find_chromium()
    if executable is None:
        reason = (
            "headless Chromium is not installed (Debian package `chromium`; .ci/run installs it)"
        )
        if os.environ.get("MHA_REQUIRE_CHROMIUM") or os.environ.get("CI"):
            pytest.fail(reason + ", and this run requires it")
        pytest.skip(reason)
    return executable


class Page:
    """One browser tab, driven over the DevTools protocol."""

    def __init__(self, ws_url: str) -> None:
        self._ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self._next_id = 0
        self.call("Page.enable")
        self.call("Runtime.enable")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message_id = self._next_id
        self._ws.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self._ws.recv())
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def evaluate(self, expression: str, *, await_promise: bool = False) -> Any:
        result = self.call(
            "Runtime.evaluate",
            expression=expression,
            returnByValue=True,
            awaitPromise=await_promise,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str, width: int, height: int = 1600, timeout: float = 60.0) -> None:
        """Load ``url`` in a window ``width`` CSS pixels wide; wait until MathJax has finished."""
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=width < 600,
        )
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.evaluate("document.readyState") == "complete":
                break
            time.sleep(0.1)
        self.evaluate(
            "(window.MathJax && MathJax.startup && MathJax.startup.promise) "
            "? MathJax.startup.promise.then(() => true) : Promise.resolve(true)",
            await_promise=True,
        )
        self.evaluate("document.fonts.ready.then(() => true)", await_promise=True)

    def close(self) -> None:
        self._ws.close()


@contextmanager
def browser(executable: str) -> Iterator[Page]:
    """Start headless Chromium and yield one :class:`Page`; the browser is killed on exit."""
    # Chromium's helper processes may still write to the profile as it closes.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        process = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, ended as a whole
        )
        page = None
        try:
            port = _devtools_port(process, profile)
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/json/list", timeout=30
            ) as answer:
                targets = json.loads(answer.read())
            page_target = next(t for t in targets if t.get("type") == "page")
            page = Page(page_target["webSocketDebuggerUrl"])
            yield page
        finally:
            if page is not None:
                page.close()
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(timeout=30)


def _devtools_port(process: subprocess.Popen, profile: str, timeout: float = 60.0) -> int:
    """The port Chromium chose: it writes it to ``DevToolsActivePort`` in the profile."""
    marker = os.path.join(profile, "DevToolsActivePort")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"chromium exited early:\n{process.stderr.read()[-2000:]}")
        if os.path.exists(marker):
            text = open(marker).read().split()
            if text and re.fullmatch(r"\d+", text[0]):
                return int(text[0])
        time.sleep(0.05)
    raise RuntimeError("chromium did not open its DevTools port in time")
