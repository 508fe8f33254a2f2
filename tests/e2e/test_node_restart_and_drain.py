"""Real ``orbit worker`` processes (tests/e2e/lease_app.py) against real nodes, on SQLite
and PostgreSQL: a node restarted while the worker holds a lease, and an operator's drain.

- A node SIGKILLed and restarted on the same port and database before the worker's lease
  runs out (but after half of it): the worker's reconnect pauses are capped by its lease,
  so it is back in time and its finished handler's result lands (one attempt). Its
  back-off is long (``reconnect_max``), so an uncapped pause slept past the lease.
- The same, restarted after the lease ran out: the finish queued meanwhile is dropped,
  not sent after the reconnect (no ``rejected`` finish in the task's history).
- ``POST /v1/workers/{id}/drain`` (on PostgreSQL through another node than the worker's):
  the worker is pushed ``drain``, lets its running task finish, and exits 0.
- A session drained while no connection held it is pushed ``drain`` after the
  ``welcome`` of its resume.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from orbit.worker.connection import WorkerConnection
from tests.e2e.servers import Node, Tokens, start_server

REPO = Path(__file__).resolve().parents[2]
WAIT = 60.0


def _until(what: str, done: Callable[[], Any], timeout: float = WAIT) -> Any:
    end = time.monotonic() + timeout
    while not (found := done()):
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.05)
    return found


def _worker(
    node: Node, tokens: Tokens, tmp: Path, name: str, reconnect_max: float
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Start ``orbit worker tests.e2e.lease_app:worker``; its marks dir and log file."""
    marks = tmp / f"marks-{name}"
    marks.mkdir()
    log = tmp / f"{name}.log"
    env = {
        **os.environ,
        "ORBIT_URL": node.http,
        "ORBIT_TOKEN": tokens.worker,
        "ORBIT_TEST_MARKS": str(marks),
        "ORBIT_TEST_NAME": name,
        "ORBIT_TEST_RECONNECT_MAX": str(reconnect_max),
    }
    env.pop("ORBIT_TOKEN_FILE", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orbit.cli", "worker", "tests.e2e.lease_app:worker"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    return proc, marks, log


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _api(node: Node, tokens: Tokens) -> httpx.Client:
    auth = {"Authorization": f"Bearer {tokens.admin}"}
    return httpx.Client(base_url=node.http, timeout=30, headers=auth)


def _submit(api: httpx.Client, handler: str, payload: dict[str, Any]) -> str:
    reply = api.post("/v1/tasks", json={"queue": "q", "handler": handler, "payload": payload})
    assert reply.status_code == 201, reply.text
    return str(reply.json()["task"]["id"])


def _queue(api: httpx.Client) -> None:
    reply = api.post("/v1/queues", json={"name": "q", "max_concurrency": 10, "rate": 0})
    assert reply.status_code == 201, reply.text


def _session_id(api: httpx.Client, name: str) -> str:
    def find() -> str | None:
        items = api.get("/v1/workers", params={"state": "live"}).json()["items"]
        return next((s["session_id"] for s in items if s["name"] == name), None)

    return str(_until(f"the session of {name}", find))


def _failed_connects(log: Path) -> int:
    return log.read_text(errors="replace").count("connect failed (")


def test_a_node_back_before_the_lease_ends_gets_the_finished_result(
    db_url: str, tokens: Tokens, tmp_path: Path
) -> None:
    """Leases of 12 s; the worker's pauses (no jitter) are 0.05, 0.1, 0.2, ... 3.2, 6.4,
    12.8 s, so it tries at about 0, 0.05, 0.15, ..., 3.15 and 6.35 s after the kill and
    next, uncapped, at 12.75 s: past the lease. The node is restarted (same port, same
    database) right after the try at 6.35 s, past half the lease. Capped at half of what
    is left of the lease, the next try comes at about 9 s: the session resumes, the
    result waiting since the handler finished lands, and the task succeeds with its one
    attempt (before the fix: needs_review, its result dropped)."""
    args = ["--lease-ttl", "12", "--reap-interval", "0.2", "--session-ttl", "120"]
    node = start_server(db_url, tmp_path, args=args)
    api = _api(node, tokens)
    proc = None
    try:
        _queue(api)
        proc, marks, log = _worker(node, tokens, tmp_path, "w1", reconnect_max=60)
        _session_id(api, "w1")
        task = _submit(api, "nap", {"seconds": 1})
        _until("the handler's start", (marks / f"start-{task}").exists)
        node.kill()
        # the eighth failed try is the one at about 6.35 s (the first seven, 3.15 s)
        _until("eight failed connects", lambda: _failed_connects(log) >= 8)
        assert (marks / f"done-{task}").exists()  # finished while the node was down
        waited = [float(p) for p in re.findall(r"retrying in ([\d.]+)s", log.read_text())][:7]
        assert sum(waited) > 6  # the node stays down past half the lease
        node = start_server(db_url, tmp_path, args=[*args, "--port", str(node.port)])
        api.close()
        api = _api(node, tokens)
        _until("the resume", lambda: "resumed session" in log.read_text(errors="replace"))
        done = _until(
            "the task's end",
            lambda: (t := api.get(f"/v1/tasks/{task}").json())["state"] != "running" and t,
        )
        assert done["state"] == "succeeded", log.read_text(errors="replace")
        assert done["attempts_used"] == 1
        pauses = [float(p) for p in re.findall(r"retrying in ([\d.]+)s", log.read_text())]
        assert max(pauses) < 6.4, pauses  # no pause past what was left of the lease
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc is not None:
            _stop(proc)
        api.close()
        node.stop()


def test_a_finish_whose_lease_ran_out_while_the_node_was_down_is_not_sent(
    db_url: str, tokens: Tokens, tmp_path: Path
) -> None:
    """Leases of 3 s; the handler finishes 1 s in, while the node is down; the node comes
    back only once the worker has logged the attempt lost (its lease ran out). After the
    reconnect, the finish that waited for it is dropped (logged), not sent: the server
    records no rejected finish for the task (before the fix: sent, refused
    ATTEMPT_ENDED, a `rejected` event)."""
    args = ["--lease-ttl", "3", "--reap-interval", "0.2", "--session-ttl", "120"]
    node = start_server(db_url, tmp_path, args=args)
    api = _api(node, tokens)
    proc = None
    try:
        _queue(api)
        proc, marks, log = _worker(node, tokens, tmp_path, "w1", reconnect_max=1)
        _session_id(api, "w1")
        task = _submit(api, "nap", {"seconds": 1})
        _until("the handler's start", (marks / f"start-{task}").exists)
        node.kill()
        _until("the lease lost", lambda: "lost: lease expired" in log.read_text())
        assert (marks / f"done-{task}").exists()
        node = start_server(db_url, tmp_path, args=[*args, "--port", str(node.port)])
        api.close()
        api = _api(node, tokens)
        dropped = "the handler finished, but its outcome is dropped"
        _until(
            "the finish dropped or refused",
            lambda: (
                dropped in (text := log.read_text()) or re.search(r"finish of \S+ refused", text)
            ),
        )
        events = api.get(f"/v1/tasks/{task}/events", params={"limit": 1000}).json()["items"]
        rejected = [e for e in events if e["kind"] == "rejected"]
        assert rejected == [], rejected
        assert dropped in log.read_text()
        proc.terminate()
        proc.wait(timeout=30)
    finally:
        if proc is not None:
            _stop(proc)
        api.close()
        node.stop()


def test_an_operators_drain_stops_the_worker_once_its_task_finishes(
    db_url: str, tokens: Tokens, tmp_path: Path
) -> None:
    """The worker runs on node A with a task in hand; the drain is posted (on PostgreSQL
    to node B). The worker is told: it logs that the server drained it, keeps running
    until its task finishes, then exits 0 (before the fix it never learnt of the drain
    and heartbeated for ever)."""
    node = start_server(db_url, tmp_path)
    other = (
        start_server(db_url, tmp_path, node_id="node-b") if db_url.startswith("postgres") else node
    )
    api = _api(other, tokens)
    proc = None
    try:
        _queue(api)
        proc, marks, log = _worker(node, tokens, tmp_path, "w1", reconnect_max=5)
        session = _session_id(api, "w1")
        task = _submit(api, "held", {})
        _until("the handler's start", (marks / f"start-{task}").exists)
        reply = api.post(f"/v1/workers/{session}/drain")
        assert reply.status_code == 200 and reply.json()["draining"] is True, reply.text
        _until("the drain heard", lambda: "drained by the server" in log.read_text())
        assert proc.poll() is None  # its task is still running
        (marks / f"release-{task}").write_text("go")
        assert proc.wait(timeout=WAIT) == 0, log.read_text()
        assert api.get(f"/v1/tasks/{task}").json()["state"] == "succeeded"
        assert log.read_text().count("drained by the server") == 1
    finally:
        if proc is not None:
            _stop(proc)
        api.close()
        node.stop()
        other.stop()


def test_a_session_drained_while_away_is_pushed_drain_after_its_resume(
    db_url: str, tokens: Tokens, tmp_path: Path
) -> None:
    """A session drained by an operator while no connection holds it: the welcome of its
    resume is followed by a pushed ``drain`` (even with ``push`` off: it is no task)."""
    node = start_server(db_url, tmp_path)

    async def scenario() -> None:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        await conn.hello("w1", {"nap": 1}, 1)
        session, secret = conn.session_id, conn.resume_secret
        assert session is not None and secret is not None
        await conn.close()
        with _api(node, tokens) as api:
            assert api.post(f"/v1/workers/{session}/drain").status_code == 200
        again = await WorkerConnection.connect(node.ws, tokens.worker)
        try:
            # push=False: no claim is made for it, whose refusal would push drain too
            await again.resume(session, secret, push=False)
            assert await again.next_push(timeout=10) == {"type": "drain"}
        finally:
            await again.close()

    try:
        asyncio.run(scenario())
    finally:
        node.stop()
