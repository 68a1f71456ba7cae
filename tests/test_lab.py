"""`make lab` serves the book: JupyterLab starts headless (as root too),
answers on the loopback interface, opens on chapters/, lists every chapter
and the appendix's notebooks, and starts a kernel.
The server runs in its own process group, ended as a whole, within a time
limit."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STARTUP_SECONDS = 120
STOP_SECONDS = 20


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # the 30x comes back as an HTTPError, with its Location


class Lab:
    def __init__(self, port: int, token: str, process: subprocess.Popen):
        self.base = f"http://127.0.0.1:{port}"
        self.token = token
        self.process = process
        self.last_location = ""

    def request(
        self, path: str, method: str = "GET", token: bool = True, follow: bool = True
    ) -> tuple[int, bytes]:
        req = urllib.request.Request(
            f"{self.base}{path}",
            method=method,
            headers={"Authorization": f"token {self.token}"} if token else {},
            data=b"{}" if method == "POST" else None,
        )
        opener = urllib.request.build_opener(*([] if follow else [_NoRedirect()]))
        try:
            with opener.open(req, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            self.last_location = error.headers.get("Location", "")
            return error.code, error.read()

    def json(self, path: str, method: str = "GET"):
        status, body = self.request(path, method)
        assert 200 <= status < 300, f"{method} {path}: HTTP {status} {body[:300]!r}"
        return json.loads(body)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    port, token = _free_port(), secrets.token_hex(16)
    runtime = tmp_path_factory.mktemp("jupyter-runtime")
    log = (tmp_path_factory.mktemp("lab") / "lab.log").open("w+")
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime)}
    args = f"--no-browser --port={port} --IdentityProvider.token={token}"
    process = subprocess.Popen(
        ["make", "--no-print-directory", "lab", f"LAB_ARGS={args}"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: make, sh, jupyter, kernels
    )
    server = Lab(port, token, process)
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if process.poll() is not None:
                log.seek(0)
                pytest.fail(f"`make lab` exited with {process.returncode}:\n{log.read()[-3000:]}")
            try:
                if server.request("/api/status")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"no answer within {STARTUP_SECONDS} s:\n{log.read()[-3000:]}")
            time.sleep(0.5)
        yield server
    finally:
        pgid = process.pid
        if _group_alive(pgid):
            os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_SECONDS
            while _group_alive(pgid) and time.monotonic() < deadline:
                process.poll()
                time.sleep(0.2)
            if _group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)
        process.wait(timeout=STOP_SECONDS)
        log.close()


def test_lab_answers_on_loopback(lab):
    status, body = lab.request("/lab")
    assert status == 200
    assert b"JupyterLab" in body


@pytest.mark.parametrize("folder", ["chapters", "appendix"])
def test_lab_lists_every_notebook(lab, folder):
    listing = lab.json(f"/api/contents/{folder}")
    served = sorted(item["name"] for item in listing["content"] if item["type"] == "notebook")
    stored = sorted(path.name for path in (ROOT / folder).glob("*.ipynb"))
    assert stored and served == stored


def test_lab_opens_on_the_chapters(lab):
    status, _ = lab.request("/", follow=False)
    assert status in (301, 302), status
    assert lab.last_location.split("?")[0].endswith("/lab/tree/chapters"), lab.last_location


def _execute(lab: Lab, kernel_id: str, code: str, timeout: float = 90) -> str:
    """Run `code` in a kernel over its websocket; return what it printed."""
    import websocket  # websocket-client, pinned with JupyterLab's dependencies

    ws = websocket.create_connection(
        f"ws://{lab.base.removeprefix('http://')}/api/kernels/{kernel_id}/channels",
        header=[f"Authorization: token {lab.token}"],
        timeout=timeout,
    )
    msg_id = secrets.token_hex(8)
    header = {"msg_id": msg_id, "msg_type": "execute_request", "session": "test"}
    header |= {"username": "test", "version": "5.3", "date": ""}
    content = {"code": code, "silent": False, "store_history": False}
    content |= {"user_expressions": {}, "allow_stdin": False, "stop_on_error": True}
    ws.send(
        json.dumps(
            {
                "header": header,
                "parent_header": {},
                "metadata": {},
                "content": content,
                "channel": "shell",
                "buffers": [],
            }
        )
    )
    printed, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            msg = json.loads(ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                printed.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                raise AssertionError("\n".join(msg["content"]["traceback"]))
            elif msg["msg_type"] == "execute_reply":
                return "".join(printed)
    finally:
        ws.close()
    raise AssertionError(f"no reply within {timeout} s")


def test_lab_starts_the_python_kernel_with_mha_importable(lab):
    specs = lab.json("/api/kernelspecs")
    assert "python3" in specs["kernelspecs"], specs["kernelspecs"].keys()
    kernel = lab.json("/api/kernels", method="POST")
    try:
        printed = _execute(lab, kernel["id"], "import mha; print(mha.__file__)")
    finally:
        lab.request(f"/api/kernels/{kernel['id']}", method="DELETE")
    assert Path(printed.strip()).resolve() == ROOT / "mha" / "__init__.py", printed


def test_lab_refuses_requests_without_the_token(lab):
    status, _ = lab.request("/api/contents", token=False)
    assert status == 403
