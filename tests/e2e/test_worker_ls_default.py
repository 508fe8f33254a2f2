"""``orbit worker ls`` lists the live sessions unless asked for more.

Expired sessions are never deleted, and the command read every page: at 2,000 expired
sessions it printed 6,055 lines in 17 s to show the few workers running. With no
``--state`` it now lists the live ones; ``--state all`` lists every session, ``expired``
the expired ones. A real server (SQLite) with a short session TTL makes an expired one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orbit.client import AsyncClient
from orbit.worker import WorkerConnection
from tests.e2e.servers import Node, Tokens, make_tokens, start_server
from tests.e2e.test_cli import ok, runner


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Node, Tokens]]:
    db = f"sqlite:///{tmp_path}/orbit.db"
    tokens = make_tokens(db)
    server = start_server(db, tmp_path, args=["--session-ttl", "1", "--reap-interval", "0.1"])
    yield server, tokens
    server.stop()


async def _state_of(node: Node, admin: str, session_id: str) -> str:
    async with AsyncClient(node.http, admin) as c:
        return next(w["state"] for w in await c.workers() if w["session_id"] == session_id)


async def _heartbeat(conn: WorkerConnection) -> None:
    """Keep a session live for as long as the test lists it (its TTL is a second)."""
    while True:
        await conn.heartbeat()
        await asyncio.sleep(0.1)


def test_worker_ls_lists_live_sessions_by_default_and_all_on_request(
    node: tuple[Node, Tokens],
) -> None:
    server, tokens = node
    cli = runner(server, tokens.admin)

    async def scenario() -> None:
        gone_conn = await WorkerConnection.connect(server.ws, tokens.worker)
        await gone_conn.hello("gone-worker", {"h": 1}, 1, push=False)
        gone = gone_conn.session_id
        assert gone is not None
        await gone_conn.close()
        deadline = time.monotonic() + 30
        while await _state_of(server, tokens.admin, gone) != "expired":  # the reaper's pass
            assert time.monotonic() < deadline, "the session never expired"
            await asyncio.sleep(0.05)

        conn = await WorkerConnection.connect(server.ws, tokens.worker)
        await conn.hello("fresh-worker", {"h": 1}, 1, push=False)
        fresh = conn.session_id
        beating = asyncio.create_task(_heartbeat(conn))
        try:
            listed = json.loads(ok(await asyncio.to_thread(cli, "worker", "ls", "--json")))
            assert [w["session_id"] for w in listed] == [fresh]
            table = ok(await asyncio.to_thread(cli, "worker", "ls"))
            assert "fresh-worker" in table and "gone-worker" not in table
            every = await asyncio.to_thread(cli, "worker", "ls", "--state", "all", "--json")
            assert [w["session_id"] for w in json.loads(ok(every))] == [gone, fresh]
            expired = await asyncio.to_thread(cli, "worker", "ls", "--state", "expired", "--json")
            assert [w["session_id"] for w in json.loads(ok(expired))] == [gone]
            assert await _state_of(server, tokens.admin, fresh) == "live"  # all along
        finally:
            beating.cancel()
            await conn.close()

    asyncio.run(scenario())
