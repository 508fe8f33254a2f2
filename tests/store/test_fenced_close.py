"""A worker session that resumes on another node fences its connection on this one
(the epoch is bumped). The resume's commit says so on NOTIFY orbit_ready
(``<origin>:fenced:<session>:<epoch>``), and the node holding the superseded connection
closes it at once. Before, it stayed open until its worker's next request or the node's
next dispatch round for it (never, for a connection that takes no pushes and sends
nothing)."""

from __future__ import annotations

import asyncio
import json
from typing import cast

import psycopg
import pytest
from fastapi import WebSocket

from orbit.server.gateway import WorkerConnection
from orbit.server.listen import listen
from orbit.store import Store
from tests.invariants import check_all
from tests.store.helpers import Watched, worker

_WAIT = 10.0  # a safety net: every wait below ends on an event long before


class ClosingSocket:
    """Stands in for a worker's WebSocket: records how it was closed."""

    def __init__(self) -> None:
        self.closed_with: tuple[int, str] | None = None
        self.closed = asyncio.Event()

    async def send_text(self, text: str) -> None:
        raise AssertionError(f"nothing should be sent: {json.loads(text)}")

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed_with = (code, reason)
        self.closed.set()


def test_a_resume_elsewhere_notifies_its_new_epoch(store: Store) -> None:
    if store.backend != "postgres":
        pytest.skip("NOTIFY is PostgreSQL's; SQLite has one node")
    dsn: str = store.driver.dsn  # type: ignore[attr-defined]
    session, secret = worker(store)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN orbit_ready")
        resumed = store.session_resume(session.id, secret, node_id="n2")
        [note] = listener.notifies(timeout=_WAIT, stop_after=1)
    assert note.payload == f"{store.origin}:fenced:{session.id}:{resumed.epoch}"


def test_a_connection_fenced_by_a_resume_on_another_node_is_closed_at_once(
    store: Store,
) -> None:
    """PostgreSQL only. The real ``listen`` against the real database; the resume is
    committed by "another node" (a store whose origin is not the listener's). Old code:
    the superseded connection stayed open (the wait for its close timed out)."""
    if store.backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's; SQLite has one node")
    dsn: str = store.driver.dsn  # type: ignore[attr-defined]
    session, secret = worker(store, name="moved")
    stays, _ = worker(store, name="stays")

    async def run() -> tuple[ClosingSocket, ClosingSocket, WorkerConnection]:
        dispatcher = Watched(store)
        dispatcher.bind(asyncio.get_running_loop())
        moved, kept = ClosingSocket(), ClosingSocket()
        old = WorkerConnection(cast(WebSocket, moved), session, push=False)
        assert dispatcher.attach(old) is None
        assert dispatcher.attach(WorkerConnection(cast(WebSocket, kept), stays, push=False)) is None
        listening = asyncio.create_task(listen(dsn, "this-node", dispatcher))
        try:
            async with asyncio.timeout(_WAIT):
                await dispatcher.listening.wait()
                await asyncio.to_thread(store.session_resume, session.id, secret, node_id="n2")
                await moved.closed.wait()
        finally:
            listening.cancel()
            await asyncio.gather(listening, return_exceptions=True)
        return moved, kept, old

    moved, kept, old = asyncio.run(run())
    assert moved.closed_with is not None and moved.closed_with[0] == 4409
    assert old.closed
    assert kept.closed_with is None
    assert check_all(store) == []
