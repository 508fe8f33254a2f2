"""A server whose database cannot take a write, on SQLite and PostgreSQL: its lock held by
another process, full, or read-only.

A submit under another process's lock waited with no bound (SQLite: 10 s of
``busy_timeout`` a try, five tries; PostgreSQL: no ``lock_timeout``): its client gave up
after its 30 s timeout (Unreachable), and the task was committed later. A full or
read-only database answered every submit 500 INTERNAL while /readyz said ready. Now the
store gives up after its wait (``tx_wait_us``: a fraction of a second here, past the
first try, which on PostgreSQL ends at the connection's default ``lock_timeout``, 5 s)
and the server answers 503 with the condition's code and ``Retry-After``; /readyz is not ready
while writes fail on a full or read-only database, and stays ready while a lock keeps some
writes waiting (a deliberate change: it said not ready for that too, and since every node
shares the database and meets the same lock, one frozen node's lock on a queue's
idempotency stripe took every healthy node out of a balancer's rotation); a worker's
finish that meets it is sent again until it lands.

The servers run ``tests.e2e.busy_app`` (``create_app`` embedded, with the test's wait)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from orbit.store import sqlite_path
from orbit.worker.runner import Context, Worker
from tests.db_locks import write_lock
from tests.e2e.servers import Node, Tokens, app_server

#: the servers' wait for the database, in seconds (``StoreConfig.tx_wait_us``)
TX_WAIT_S = 0.5
#: a safety net for the waits below: each ends on what it waits for long before
WAIT_S = 30.0


@contextmanager
def _server(db_url: str, tmp_path: Path, *extra: str) -> Iterator[Node]:
    log = tmp_path / f"busy-{uuid.uuid4().hex[:8]}.log"
    with app_server("tests.e2e.busy_app", [db_url, str(TX_WAIT_S), *extra], log, WAIT_S) as node:
        yield node


def _api(node: Node, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=node.http, timeout=WAIT_S, headers={"Authorization": f"Bearer {token}"}
    )


def _queue(node: Node, tokens: Tokens) -> None:
    with _api(node, tokens.admin) as admin:
        made = admin.post("/v1/queues", json={"name": "q", "max_concurrency": 10, "rate": 0})
        assert made.status_code == 201, made.text


TASK = {"queue": "q", "handler": "h", "payload": {"x": 1}}


def test_a_submit_under_another_processs_lock_is_answered_503_busy(
    db_url: str, tokens: Tokens, tmp_path: Path
) -> None:
    with _server(db_url, tmp_path) as node, _api(node, tokens.submit) as api:
        _queue(node, tokens)
        with write_lock(db_url):
            refused = api.post("/v1/tasks", json=TASK)
            assert refused.status_code == 503, refused.text
            assert refused.json() == {
                "error": {
                    "code": "DATABASE_BUSY",
                    "message": "the database is busy: another process or a long transaction "
                    "holds its lock; nothing was written",
                }
            }
            assert refused.headers["Retry-After"] == "5"
            # a lock: the node stays ready (every node meets the same lock)
            ready = httpx.get(f"{node.http}/readyz", timeout=WAIT_S)
            assert ready.status_code == 200, ready.text
            assert ready.json() == {"status": "ready"}
        made = api.post("/v1/tasks", json=TASK)
        assert made.status_code == 201, made.text
        assert httpx.get(f"{node.http}/readyz", timeout=WAIT_S).status_code == 200
        with _api(node, tokens.admin) as admin:
            listed = admin.get("/v1/tasks", params={"queue": "q"}).json()["items"]
        assert [t["id"] for t in listed] == [made.json()["task"]["id"]]  # one: the second
    said = node.log_text()
    assert "a transaction gave up" in said, said
    assert "request failed" not in said, said  # a 503, not a failure of the server's


def test_more_submits_than_threads_under_a_lock_commit_only_those_answered_201(
    db_url: str, tokens: Tokens, tmp_path: Path
) -> None:
    """More submits at once than the node has store threads (``THREADS``), under another
    process's lock released after the first answer: every submit is answered (none left
    to its client's timeout), and the tasks committed are exactly those answered 201. A
    submit queued for a thread behind others waiting for the lock waited its whole wait
    again once a thread took it, and committed after its client had given up (the
    store-level test_busy_database.py pins the queued wait down deterministically)."""
    from orbit.server.threads import THREADS

    with _server(db_url, tmp_path) as node, _api(node, tokens.submit) as api:
        _queue(node, tokens)

        def send(i: int) -> httpx.Response:
            return api.post("/v1/tasks", json={**TASK, "payload": {"i": i}})

        with ThreadPoolExecutor(THREADS * 2) as pool:
            with write_lock(db_url):
                sent = [pool.submit(send, i) for i in range(THREADS * 2)]
                wait(sent, return_when=FIRST_COMPLETED)
            answers = [f.result() for f in sent]  # an answer each, no client timeout
        assert {a.status_code for a in answers} <= {201, 503}, [a.text for a in answers]
        assert any(a.status_code == 503 for a in answers)
        made = {a.json()["task"]["id"] for a in answers if a.status_code == 201}
        with _api(node, tokens.admin) as admin:
            listed = admin.get("/v1/tasks", params={"queue": "q", "limit": 100}).json()
        assert {t["id"] for t in listed["items"]} == made


def test_a_finish_under_another_processs_lock_is_sent_again_until_it_lands(
    db_url: str, tokens: Tokens, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway answers a finish the store gave up on with the database's code
    (``DATABASE_BUSY``, and no traceback in the server's log: it was ``INTERNAL``, with
    one), which the runner sends again while its lease lasts: the finish lands once the
    lock is released."""
    caplog.set_level(logging.WARNING, logger="orbit.worker")
    with _server(db_url, tmp_path) as node, _api(node, tokens.admin) as admin:
        _queue(node, tokens)
        made = admin.post("/v1/tasks", json={**TASK, "handler": "held"})
        assert made.status_code == 201, made.text
        task_id = made.json()["task"]["id"]
        worker = Worker(node.http, tokens.worker)

        async def scenario() -> None:
            started, go = asyncio.Event(), asyncio.Event()

            @worker.handler("held")
            async def held(ctx: Context, payload: Any) -> Any:
                started.set()
                await go.wait()
                return {"done": True}

            runner = asyncio.create_task(worker.arun())
            try:
                await asyncio.wait_for(started.wait(), WAIT_S)
                with write_lock(db_url):
                    go.set()  # its finish meets the lock
                    end = time.monotonic() + WAIT_S
                    while not any("sending it again" in r.message for r in caplog.records):
                        assert time.monotonic() < end, "the finish was never answered"
                        assert not runner.done(), runner
                        await asyncio.sleep(0.02)
                while worker.finished < 1:
                    assert time.monotonic() < end + WAIT_S, "the finish never landed"
                    await asyncio.sleep(0.02)
            finally:
                worker.stop()
                await asyncio.wait_for(runner, WAIT_S)

        asyncio.run(scenario())
        task = admin.get(f"/v1/tasks/{task_id}").json()
        assert task["state"] == "succeeded", task
        assert task["result"] == {"done": True}
        again = [r.message for r in caplog.records if "sending it again" in r.message]
        assert "answered DATABASE_BUSY" in again[0], again
        assert "worker request failed" not in node.log_text()


@contextmanager
def _unwritable(db_url: str) -> Iterator[tuple[list[str], str, str]]:
    """The database made unwritable for a server started in the block: the server's
    extra arguments, and the code and message its writes are refused with. SQLite: held
    to the pages it has (``PRAGMA max_page_count``: SQLITE_FULL, as a full disk);
    PostgreSQL: ``default_transaction_read_only`` (as a standby, or a database an
    operator closed to writes)."""
    path = sqlite_path(db_url)
    if path is not None:
        with sqlite3.connect(path) as cx:
            (pages,) = cx.execute("PRAGMA page_count").fetchone()
        yield (
            [str(pages)],
            "DATABASE_FULL",
            "the database is full (its disk, or its size limit); nothing was written",
        )
        return
    name = conninfo_to_dict(db_url)["dbname"]
    with psycopg.connect(db_url, autocommit=True) as cx:
        cx.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        try:
            yield [], "DATABASE_READ_ONLY", "the database is read-only; nothing was written"
        finally:
            cx.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')


def test_a_database_that_cannot_be_written_is_answered_503_and_not_ready(
    db_url: str, tokens: Tokens, tmp_path: Path
) -> None:
    with _server(db_url, tmp_path) as node:
        _queue(node, tokens)
    with (
        _unwritable(db_url) as (extra, code, message),
        _server(db_url, tmp_path, *extra) as node,
        _api(node, tokens.submit) as api,
    ):
        big = {**TASK, "payload": {"x": "y" * 100_000}}  # more pages than SQLite has free
        refused = api.post("/v1/tasks", json=big)
        assert refused.status_code == 503, refused.text
        assert refused.json() == {"error": {"code": code, "message": message}}
        assert refused.headers["Retry-After"] == "5"
        ready = httpx.get(f"{node.http}/readyz", timeout=WAIT_S)
        assert ready.status_code == 503, ready.text
        assert ready.json() == {"status": "unavailable", "reason": code, "message": message}
        said = node.log_text()
        assert "a transaction gave up" in said, said
        assert "request failed" not in said, said  # a 503, not a failure of the server's
