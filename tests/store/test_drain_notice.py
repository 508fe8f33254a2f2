"""An operator's drain reaches the worker on whichever node holds its session: the drain's
commit notifies the other nodes on PostgreSQL (NOTIFY orbit_ready
``<origin>:drained:<session id>``), and the node holding the connection pushes
``{"type": "drain"}`` (``Dispatcher.push_drain``); a worker's own drain notifies nobody.
A node that missed the notice pushes it when its claim for the session is refused
``SESSION_DRAINING``."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import psycopg
import pytest
from fastapi import WebSocket

from orbit.server.gateway import Dispatcher, WorkerConnection
from orbit.server.listen import listen
from orbit.server.metrics import Metrics
from orbit.store import Store
from tests.store.helpers import Watched, worker

_WAIT = 10.0  # a safety net: every wait below ends on an event long before


def test_only_an_operators_drain_notifies_the_other_nodes(store: Store) -> None:
    """The worker's own drain (with its epoch) sends nothing; the operator's drain after
    it (the session already draining) sends its notice all the same, for a worker that
    missed the first: notices arrive in commit order, so the first one heard is it."""
    if store.backend != "postgres":
        pytest.skip("NOTIFY is PostgreSQL's; SQLite has one node")
    dsn: str = store.driver.dsn  # type: ignore[attr-defined]
    session, _ = worker(store)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN orbit_ready")
        store.session_drain(session.id, session.epoch)
        store.session_drain(session.id)
        [note] = listener.notifies(timeout=_WAIT, stop_after=1)
    assert note.payload == f"{store.origin}:drained:{session.id}"


class Socket:
    """Stands in for a worker's WebSocket: records what was sent to it."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.got = asyncio.Event()

    async def send_text(self, text: str) -> None:
        self.sent.append(json.loads(text))
        self.got.set()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        raise AssertionError(f"nothing should be closed: {code} {reason}")


def test_a_drain_on_another_node_is_pushed_to_the_worker_here(store: Store) -> None:
    """PostgreSQL only: the real ``listen``; the drain is committed by "another node" (a
    store whose origin is not the listener's). The drained session's connection is
    pushed ``drain`` and offered nothing more; another session's is told nothing."""
    if store.backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's; SQLite has one node")
    dsn: str = store.driver.dsn  # type: ignore[attr-defined]
    drained, _ = worker(store, name="drained")
    other, _ = worker(store, name="other")

    async def run() -> tuple[Socket, Socket, WorkerConnection]:
        dispatcher = Watched(store)
        dispatcher.bind(asyncio.get_running_loop())
        told, untold = Socket(), Socket()
        conn = WorkerConnection(cast(WebSocket, told), drained, push=True)
        assert dispatcher.attach(conn) is None
        assert dispatcher.attach(WorkerConnection(cast(WebSocket, untold), other, True)) is None
        listening = asyncio.create_task(listen(dsn, "this-node", dispatcher))
        try:
            async with asyncio.timeout(_WAIT):
                await dispatcher.listening.wait()
                await asyncio.to_thread(store.session_drain, drained.id)
                await told.got.wait()
        finally:
            listening.cancel()
            await asyncio.gather(listening, return_exceptions=True)
        return told, untold, conn

    told, untold, conn = asyncio.run(run())
    assert told.sent == [{"type": "drain"}]
    assert untold.sent == []
    assert conn.push is False


@pytest.mark.parametrize("own", [False, True], ids=["operator", "own-drain"])
def test_a_claim_refused_draining_pushes_drain_unless_the_worker_asked(
    store: Store, own: bool
) -> None:
    """Both backends: a session drained while this node heard nothing of it (no notice,
    no route here) is pushed ``drain`` by the dispatcher's next claim for it, once; not
    if its worker drained itself (it knows)."""
    session, _ = worker(store)
    store.session_drain(session.id)

    async def run() -> tuple[Socket, WorkerConnection]:
        dispatcher = Dispatcher(store, poll_interval=60, metrics=Metrics(store))
        dispatcher.bind(asyncio.get_running_loop())
        socket = Socket()
        conn = WorkerConnection(cast(WebSocket, socket), session, push=True)
        conn.draining = own
        assert dispatcher.attach(conn) is None
        await dispatcher.offer_all()
        await dispatcher.offer_all()  # no longer offered: nothing more is pushed
        return socket, conn

    socket, conn = asyncio.run(run())
    assert socket.sent == ([] if own else [{"type": "drain"}])
    assert conn.push is False
