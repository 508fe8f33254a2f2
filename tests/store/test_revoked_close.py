"""A revoked token's open worker connections are closed on every node: the revoke's
commit tells its own node (``Store.on_revoked``) and, on PostgreSQL, the others (NOTIFY
orbit_ready ``<origin>:revoked:<token id>``); a node re-checks the tokens of its open
connections in one read (``token_live``), at intervals and whenever its LISTEN
connection comes back, for a notice it may have missed."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import psycopg
import pytest
from fastapi import WebSocket

from orbit.server.auth import TokenCheck
from orbit.server.gateway import Dispatcher, WorkerConnection
from orbit.server.listen import listen
from orbit.server.metrics import Metrics
from orbit.server.revocation import Revocations
from orbit.store import InjectedFault, Store
from tests.store.helpers import worker

_WAIT = 10.0  # a safety net: every wait below ends on an event long before


def test_token_live_answers_which_tokens_are_still_accepted(store: Store) -> None:
    kept, _ = store.token_create("kept", ["worker"])
    gone, _ = store.token_create("gone", ["worker"])
    store.token_revoke(gone)
    assert store.token_live([kept, gone, "unknown0"]) == {kept}
    assert store.token_live([]) == set()


def test_a_revoke_tells_its_node_after_the_commit_and_again_when_repeated(store: Store) -> None:
    """Both backends: ``on_revoked`` hears each revoke (a repeated one too: a node that
    missed the first hears it again); a revoke that fails tells nothing."""
    heard: list[list[str]] = []
    store.on_revoked = heard.append
    token_id, _ = store.token_create("leaked", ["worker"])
    with store.inject_fault("token_revoke"), pytest.raises(InjectedFault):
        store.token_revoke(token_id)
    assert heard == []
    store.token_revoke(token_id)
    store.token_revoke(token_id)
    assert heard == [[token_id], [token_id]]


def test_a_revoke_notifies_the_other_nodes(store: Store) -> None:
    if store.backend != "postgres":
        pytest.skip("NOTIFY is PostgreSQL's; SQLite has one node")
    dsn: str = store.driver.dsn  # type: ignore[attr-defined]
    token_id, _ = store.token_create("leaked", ["worker"])
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN orbit_ready")
        store.token_revoke(token_id)
        [note] = listener.notifies(timeout=_WAIT, stop_after=1)
    assert note.payload == f"{store.origin}:revoked:{token_id}"


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


class Watched(Dispatcher):
    """Says when it is first woken: ``listen`` wakes it once LISTEN is established."""

    def __init__(self, store: Store) -> None:
        super().__init__(store, poll_interval=60, metrics=Metrics(store))
        self.listening = asyncio.Event()

    def wake_threadsafe(self, *args: Any) -> None:
        super().wake_threadsafe(*args)
        self.listening.set()


@pytest.mark.parametrize("missed", [False, True], ids=["notice", "missed-notice"])
def test_a_revoke_on_another_node_closes_the_connections_of_that_token_here(
    store: Store, missed: bool
) -> None:
    """PostgreSQL only. The real ``listen`` against the real database; the revoke is
    committed by "another node" (a store whose origin is not the listener's), either
    while LISTEN is up (its notice closes the connection) or before it connects (the
    catch-up's re-check does). The connection of another token stays open."""
    if store.backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's; SQLite has one node")
    dsn: str = store.driver.dsn  # type: ignore[attr-defined]
    leaked, _ = store.token_create("leaked", ["worker"])
    good, _ = store.token_create("good", ["worker"])
    holder, _ = worker(store, name="holder")
    other, _ = worker(store, name="other")
    if missed:
        store.token_revoke(leaked)

    async def run() -> tuple[ClosingSocket, ClosingSocket]:
        dispatcher = Watched(store)
        dispatcher.bind(asyncio.get_running_loop())
        revocations = Revocations(dispatcher, TokenCheck(store, 600.0))
        held, kept = ClosingSocket(), ClosingSocket()
        conn = WorkerConnection(cast(WebSocket, held), holder, push=False, token_id=leaked)
        assert dispatcher.attach(conn) is None
        stays = WorkerConnection(cast(WebSocket, kept), other, push=False, token_id=good)
        assert dispatcher.attach(stays) is None
        listening = asyncio.create_task(listen(dsn, "this-node", dispatcher, revocations))
        try:
            async with asyncio.timeout(_WAIT):
                if not missed:
                    await dispatcher.listening.wait()
                    await asyncio.to_thread(store.token_revoke, leaked)
                await held.closed.wait()
        finally:
            listening.cancel()
            await asyncio.gather(listening, return_exceptions=True)
        return held, kept

    held, kept = asyncio.run(run())
    assert held.closed_with == (4401, "UNAUTHENTICATED")
    assert kept.closed_with is None
