"""A worker that starts while its server cannot write (a full disk, a read-only database)
keeps trying: the server answers its ``hello`` ``INTERNAL``, or the database's code
(``DATABASE_READ_ONLY``, with no traceback in the server's log: it was ``INTERNAL``
with one), which the runner retries like a failed connect. It once ended the run at
once, as if the server had refused the worker's credentials (``orbit worker`` exited 3
for good). Once writes work again the worker connects and runs a task. A real server,
SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import closing, contextmanager
from typing import Any

import httpx
import psycopg
from psycopg.conninfo import conninfo_to_dict

from orbit.store import sqlite_path
from orbit.worker.runner import Context, Worker
from tests.e2e.servers import Node, Tokens
from tests.e2e.test_runner import api, fast, wait_state  # noqa: F401

#: the retries of the refused hello this test waits for before letting writes through
RETRIES = 3


def _terminate_server_connections(cx: psycopg.Connection[Any], name: str) -> None:
    """End the server's connections: its pool opens new ones, which take the database's
    settings as they are now (a setting changed by ALTER DATABASE reaches new sessions)."""
    cx.execute(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE datname = %s AND pid <> pg_backend_pid()",
        [name],
    )


@contextmanager
def writes_refused(db_url: str) -> Iterator[None]:
    """The server's writes fail for the block. PostgreSQL: the database read-only
    (``default_transaction_read_only``, as a standby or a full-disk guard sets it), the
    server's connections ended so that its pool takes it up. SQLite: a trigger refuses
    every new session's row, so the hello's transaction fails inside the server as a
    full disk fails it (the server's own connection cannot be made read-only from
    outside)."""
    path = sqlite_path(db_url)
    if path is not None:
        with closing(sqlite3.connect(path, isolation_level=None)) as cx:
            cx.execute(
                "CREATE TRIGGER refuse_sessions BEFORE INSERT ON orbit_sessions "
                "BEGIN SELECT RAISE(ABORT, 'disk I/O refused by the test'); END"
            )
            try:
                yield
            finally:
                cx.execute("DROP TRIGGER refuse_sessions")
        return
    name = conninfo_to_dict(db_url)["dbname"]
    with psycopg.connect(db_url, autocommit=True) as cx:
        cx.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        _terminate_server_connections(cx, name)
        try:
            yield
        finally:
            cx.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
            _terminate_server_connections(cx, name)


def _submit(client: httpx.Client) -> str:
    """Submit once the server writes again: the first transaction on a connection the
    test ended may be answered 503 (the database unavailable), which a client retries."""
    for _ in range(100):
        reply = client.post(
            "/v1/tasks", json={"queue": "q", "handler": "echo", "payload": {"n": 1}}
        )
        if reply.status_code != 503:
            break
    assert reply.status_code == 201, reply.text
    return str(reply.json()["task"]["id"])


class _Refusals(logging.Handler):
    """Counts the runner's warnings of a hello the server could not try (``code``)."""

    def __init__(self, enough: int, code: str) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.enough = enough
        self.code = code
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(f"connect failed ({self.code} from the server"):
            self.lines.append(message)
            if len(self.lines) >= self.enough:
                self.seen.set()


def test_a_worker_started_while_writes_fail_retries_its_hello_and_then_runs(
    fast: Node,  # noqa: F811
    tokens: Tokens,
    api: httpx.Client,  # noqa: F811
    db_url: str,
) -> None:
    worker = Worker(fast.http, tokens.worker, reconnect_max=0.2)
    done: list[str] = []

    @worker.handler("echo")
    def echo(ctx: Context, payload: Any) -> Any:
        done.append(ctx.task_id)
        return payload

    # SQLite's trigger is no condition of the database's (a constraint): INTERNAL
    sqlite = sqlite_path(db_url) is not None
    refusals = _Refusals(RETRIES, "INTERNAL" if sqlite else "DATABASE_READ_ONLY")
    logger = logging.getLogger("orbit.worker")
    logger.addHandler(refusals)

    async def scenario() -> None:
        runner: asyncio.Task[int] | None = None
        try:
            with writes_refused(db_url):
                runner = asyncio.create_task(worker.arun())
                seen = asyncio.create_task(asyncio.to_thread(refusals.seen.wait, 30))
                await asyncio.wait((runner, seen), return_when=asyncio.FIRST_COMPLETED)
                # Still trying: the run did not end on the server's INTERNAL.
                assert not runner.done(), runner.exception()
                assert refusals.seen.is_set(), f"no hello refused {refusals.code} was retried"
                assert worker.session_id is None
            tid = await asyncio.to_thread(_submit, api)
            task = await asyncio.to_thread(wait_state, api, tid, {"succeeded", "failed"})
            assert task["state"] == "succeeded", task
            assert done == [tid]
            assert worker.session_id is not None
        finally:
            worker.stop()
            if runner is not None:
                assert await asyncio.wait_for(runner, 30) == 0

    try:
        asyncio.run(scenario())
    finally:
        logger.removeHandler(refusals)
    line = refusals.lines[0]
    assert "retrying in" in line, line
    if sqlite:
        assert "the server could not process this request" in line, line
    else:
        assert "the database is read-only" in line, line
        assert "handshake failed" not in fast.log_text()
