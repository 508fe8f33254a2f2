"""A worker that connects while its node's token check cannot read the database (its
lock held past the node's wait, out of reach).

The upgrade was answered 500 INTERNAL, and the node logged ``ERROR orbit.gateway worker
token check failed`` with a traceback at every try of every worker, while an HTTP call
at the same moment was answered 503 ``DATABASE_BUSY``. The upgrade is now answered as an
HTTP route answers: 503 with the code, the store's words and ``Retry-After``, and one
WARNING line; the worker waits the ``Retry-After`` out (it does not exit), says the
database is busy, and connects once the lock is gone.

PostgreSQL only: there another connection's ``LOCK TABLE`` keeps the token check's read
waiting until ``lock_timeout`` (cut to 200 ms through the node's URL). SQLite's reads
take no lock another process holds (WAL): only the node's own connection held past its
``busy_timeout`` turns one away, which no test can bring about on cue."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from orbit.worker.runner import Context, Worker
from tests.e2e.servers import make_tokens, start_server
from tests.pg import as_url, temporary_database

#: the node's wait for a lock (``lock_timeout``), through its URL
IMPATIENT = "options=-c%20lock_timeout%3D200"
#: a safety net for the waits below: each ends on what it waits for long before
WAIT_S = 60.0
BUSY = (
    "the database is busy: another process or a long transaction holds its lock; "
    "nothing was written"
)


@pytest.mark.postgres_only
def test_a_worker_connecting_under_a_lock_is_answered_503_busy_and_waits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with temporary_database("orbit_e2e") as dsn:
        url = as_url(dsn)
        tokens = make_tokens(url)
        node = start_server(f"{url}?{IMPATIENT}", tmp_path)
        try:
            asyncio.run(_scenario(url, node.ws, node.http, tokens.worker, caplog))
        finally:
            node.stop()
    said = node.log_text()
    # One warning for the whole stretch, however many tries were refused (the test's own
    # and the worker's), and one line once a worker is let in again.
    refused = [line for line in said.splitlines() if "worker connect refused" in line]
    assert len(refused) == 1, said
    assert f"WARNING orbit.gateway worker connect refused 503: {BUSY} (DATABASE_BUSY)" in refused[0]
    again = [line for line in said.splitlines() if "worker connects let in again" in line]
    assert len(again) == 1 and "INFO" in again[0], said
    assert int(again[0].split("after ")[1].split()[0]) >= 2, said
    assert "worker token check failed" not in said, said
    assert "Traceback" not in said, said


async def _scenario(
    url: str, ws: str, http: str, token: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="orbit.worker")
    worker = Worker(http, token)
    worker._reconnect_random = lambda: 0.0  # the pause is the Retry-After itself

    @worker.handler("h")
    async def handler(ctx: Context, payload: Any) -> Any:
        return payload

    async with await psycopg.AsyncConnection.connect(url) as holder:
        await holder.execute("LOCK TABLE orbit_tokens IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(InvalidStatus) as refused:
            async with connect(ws, additional_headers={"Authorization": f"Bearer {token}"}):
                pass
        answer = refused.value.response
        assert answer.status_code == 503
        assert answer.headers["Retry-After"] == "5"
        assert json.loads(answer.body) == {"error": {"code": "DATABASE_BUSY", "message": BUSY}}

        running = asyncio.create_task(worker.arun())
        said = f"connect failed (HTTP 503, DATABASE_BUSY from the server: {BUSY}, Retry-After 5)"
        ends = time.monotonic() + WAIT_S
        while not any(m.startswith(said) for m in caplog.messages):
            assert not running.done(), caplog.text  # retried, not the end of the run
            assert time.monotonic() < ends, caplog.text
            await asyncio.sleep(0.05)
        await holder.rollback()
    try:
        async with asyncio.timeout(WAIT_S):
            while worker.session_id is None:  # connected once the lock is gone
                assert not running.done(), caplog.text
                await asyncio.sleep(0.05)
    finally:
        worker.stop()
        assert await asyncio.wait_for(running, WAIT_S) == 0
