"""Every example runs against a real server (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from examples import cancellation, history, low_level, runner
from examples.webapp.app import make_server
from tests.e2e.servers import Node, Tokens

ROOT = Path(__file__).resolve().parents[2]


def test_runner_example(node: Node, tokens: Tokens) -> None:
    result = asyncio.run(runner.main(node.http, tokens.admin))
    assert result["add"]["sum"] == 5
    assert result["divide"]["code"] == "DIVISION_BY_ZERO"


def test_low_level_example(node: Node, tokens: Tokens) -> None:
    result = asyncio.run(low_level.main(node.http, tokens.admin))
    assert result["lease"] == "ok" and result["renewed"] == "ok"
    assert result["receipt"]["task_state"] == "succeeded"


def test_history_example(node: Node, tokens: Tokens) -> None:
    result = history.main(node.http, tokens.admin)
    assert result["first_page"] == 2 and result["total"] == 5
    assert result["history"] == [("submitted", "queued"), ("cancelled", "cancelled")]


def test_cancellation_example(node: Node, tokens: Tokens) -> None:
    result = asyncio.run(cancellation.main(node.http, tokens.admin))
    assert result == {"parent": "cancelled", "child": "cancelled", "reason": "task cancelled"}


def test_web_app_with_its_worker(node: Node, tokens: Tokens) -> None:
    app = make_server(0, node.http, tokens.admin)  # 0: a port the server picks itself
    port = app.server_port
    threading.Thread(target=app.serve_forever, daemon=True).start()
    worker = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "worker", "examples.webapp.jobs:worker"],
        env={**os.environ, "ORBIT_URL": node.http, "ORBIT_TOKEN": tokens.worker},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def call(method: str, path: str, body: object = None) -> dict[str, object]:
            data = json.dumps(body).encode() if body is not None else None
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}{path}", data=data, method=method
            )
            with urllib.request.urlopen(request, timeout=10) as reply:
                return dict(json.loads(reply.read()))

        first = call("POST", "/thumbnails", {"url": "https://example.test/cat.png"})
        again = call("POST", "/thumbnails", {"url": "https://example.test/cat.png"})
        assert first["id"] == again["id"]  # idempotent per URL
        deadline = time.monotonic() + 30
        while (status := call("GET", f"/thumbnails/{first['id']}"))["state"] != "succeeded":
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert status["result"]["width"] == 320  # type: ignore[index]
    finally:
        app.shutdown()
        worker.terminate()
        out, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, out


def _answer(port: int, method: str, path: str, body: object = None) -> tuple[int, object]:
    """The web app's status and JSON body for one request, an error status included."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def test_web_app_answers_an_empty_id_and_an_orbit_out_of_reach(node: Node, tokens: Tokens) -> None:
    """``GET /thumbnails/`` dropped the connection (the client's ValueError for an empty
    id, uncaught), and so did any request while Orbit was out of reach (Unreachable,
    uncaught): 404 and 503 now."""
    app = make_server(0, node.http, tokens.admin)
    port = app.server_port
    threading.Thread(target=app.serve_forever, daemon=True).start()
    try:
        assert _answer(port, "GET", "/thumbnails/") == (404, {"error": "not found"})
        status, made = _answer(port, "POST", "/thumbnails", {"url": "https://example.test/a"})
        assert status == 202, made
        node.stop()
        down = (503, {"error": "orbit unreachable, try again"})
        assert _answer(port, "GET", f"/thumbnails/{made['id']}") == down  # type: ignore[index]
        assert _answer(port, "POST", "/thumbnails", {"url": "https://example.test/b"}) == down
        assert _answer(port, "GET", "/thumbnails/") == (404, {"error": "not found"})
    finally:
        app.shutdown()


def _readme_snippets() -> list[str]:
    """The README's Python blocks, in order."""
    text = (ROOT / "README.md").read_text()
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


def test_the_readmes_worker_and_submitter_run_as_written(
    node: Node, tokens: Tokens, tmp_path: Path
) -> None:
    """The README's worker module under ``orbit worker``, and its submitter run twice (a
    second run finds the queue made). As one script, the submitter waited for a worker
    that was only made after it, and a second run failed on the existing queue."""
    worker_code, submitter = (
        s.replace("http://127.0.0.1:8000", node.http) for s in _readme_snippets()
    )
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "jobs.py").write_text(worker_code)
    (tmp_path / "submit.py").write_text(submitter)
    env = {k: v for k, v in os.environ.items() if k not in ("ORBIT_TOKEN", "ORBIT_TOKEN_FILE")}
    worker = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "worker", "myapp.jobs:worker"],
        env={**env, "ORBIT_TOKEN": tokens.worker, "PYTHONPATH": str(tmp_path)},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for _ in range(2):
            done = subprocess.run(
                [sys.executable, "submit.py"],
                env={**env, "ORBIT_TOKEN": tokens.admin},
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=90,
                check=False,
            )
            assert done.returncode == 0, done.stdout + done.stderr
            assert "'rendered': 'https://example.com'" in done.stdout, done.stdout
    finally:
        worker.terminate()
        out, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, out
    assert "connected as session" in out, out  # it says when it is up
