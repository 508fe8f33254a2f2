"""A revoked token's open worker connections are closed on every node: the revoke's
commit tells its own node (``Store.on_revoked``) and, on PostgreSQL, the others (NOTIFY
orbit_ready ``<origin>:revoked:<token id>``); a node re-checks the tokens of its open
connections in one read (``token_live``), at intervals and whenever its LISTEN
connection comes back, for a notice it may have missed. The node that closes such a
connection releases at once what its session had claimed and not started."""

from __future__ import annotations

import asyncio
import json
from typing import cast

import psycopg
import pytest
from fastapi import WebSocket

from orbit.core.errors import Code, Rejected
from orbit.server.auth import TokenCheck
from orbit.server.gateway import Dispatcher, WorkerConnection
from orbit.server.listen import listen
from orbit.server.metrics import Metrics
from orbit.server.revocation import Revocations
from orbit.store import InjectedFault, Store
from tests.store.helpers import Watched, claim_one, queue, run_one, submit, worker

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


@pytest.mark.parametrize("missed", [False, True], ids=["notice", "missed-notice"])
def test_a_revoke_on_another_node_closes_the_connections_of_that_token_here(
    store: Store, missed: bool
) -> None:
    """PostgreSQL only. The real ``listen`` against the real database; the revoke is
    committed by "another node" (a store whose origin is not the listener's), either
    while LISTEN is up (its notice closes the connection) or before it connects (the
    catch-up's re-check does). The connection of another token stays open. This node,
    not the revoke's, releases the attempt the closed connection's session had claimed."""
    if store.backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's; SQLite has one node")
    dsn: str = store.driver.dsn  # type: ignore[attr-defined]
    leaked, _ = store.token_create("leaked", ["worker"])
    good, _ = store.token_create("good", ["worker"])
    holder, _ = worker(store, name="holder")
    other, _ = worker(store, name="other")
    queue(store)
    submit(store)
    claimed = claim_one(store, holder)
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
                await asyncio.gather(*dispatcher.releasing)
        finally:
            listening.cancel()
            await asyncio.gather(listening, return_exceptions=True)
        return held, kept

    held, kept = asyncio.run(run())
    assert held.closed_with == (4401, "UNAUTHENTICATED")
    assert kept.closed_with is None
    _released_by_revoke(store, claimed.task.id, claimed.attempt.id)


def _released_by_revoke(store: Store, task_id: str, attempt_id: str) -> None:
    """The attempt was released for the revoke, and its task queued again."""
    assert store.attempt_get(attempt_id).state == "released"
    assert store.task_get(task_id).state == "queued"
    released = [e for e in store.event_list(task_id=task_id) if e["kind"] == "released"]
    assert [(e["attempt_id"], e["code"]) for e in released] == [(attempt_id, "TOKEN_REVOKED")]


@pytest.mark.parametrize("path", ["sweep", "attach"])
def test_a_connection_closed_for_a_revoked_token_gives_back_its_claims_at_once(
    store: Store, path: str
) -> None:
    """Both backends. A session holds a claimed attempt and a running one on a connection
    whose token is revoked; the node closes it (the revoke's sweep, or as it attaches
    after the node heard of the revoke). The claimed attempt is released at once (its
    task queued, event code TOKEN_REVOKED) and another worker claims the task without
    waiting for the claim lease; a late start of it from the closed connection is
    refused. The running attempt keeps its lease, and another session's claim is left
    alone. Before, the claimed task waited for its claim lease (30 s by default)."""
    queue(store)
    leaked, _ = store.token_create("leaked", ["worker"])
    good, _ = store.token_create("good", ["worker"])
    holder, _ = worker(store, name="holder")
    other, _ = worker(store, name="other")
    for _ in range(3):
        submit(store)
    running = run_one(store, holder)
    claimed = claim_one(store, holder)
    kept = claim_one(store, other)
    claimed_task = claimed.task.id

    async def run() -> tuple[ClosingSocket, ClosingSocket]:
        dispatcher = Dispatcher(store, poll_interval=60, metrics=Metrics(store))
        dispatcher.bind(asyncio.get_running_loop())
        held, stays = ClosingSocket(), ClosingSocket()
        conn = WorkerConnection(cast(WebSocket, held), holder, push=False, token_id=leaked)
        good_conn = WorkerConnection(cast(WebSocket, stays), other, push=False, token_id=good)
        assert dispatcher.attach(good_conn) is None
        if path == "sweep":
            assert dispatcher.attach(conn) is None
            assert dispatcher.close_revoked([leaked]) == 1
        else:
            assert dispatcher.close_revoked([leaked]) == 0
            assert dispatcher.attach(conn) is None
            dispatcher.refuse_revoked(conn)
        async with asyncio.timeout(_WAIT):
            await held.closed.wait()
            await asyncio.gather(*dispatcher.releasing)
        return held, stays

    held, stays = asyncio.run(run())
    assert held.closed_with == (4401, "UNAUTHENTICATED")
    assert stays.closed_with is None
    _released_by_revoke(store, claimed_task, claimed.attempt.id)
    with pytest.raises(Rejected) as late:
        store.attempt_start(holder.id, holder.epoch, claimed.attempt.id, claimed.attempt.fence)
    assert late.value.code == Code.ATTEMPT_ENDED
    assert store.attempt_get(running.attempt.id).state == "running"
    assert store.attempt_get(kept.attempt.id).state == "claimed"
    rescuer, _ = worker(store, name="rescuer")
    assert claim_one(store, rescuer).task.id == claimed_task


def test_a_release_for_a_revoked_token_leaves_a_resumed_session_its_claims(store: Store) -> None:
    """Both backends. The worker resumed its session (a rotated token) before the node
    that closed its old connection released its claims: they belong to the new
    connection now, and the release in the old epoch changes nothing."""
    queue(store)
    task_id = submit(store)
    holder, secret = worker(store, name="holder")
    claimed = claim_one(store, holder)
    resumed = store.session_resume(holder.id, secret, node_id="n2")
    assert store.session_release_claims(holder.id, holder.epoch) == 0
    assert store.attempt_get(claimed.attempt.id).state == "claimed"
    assert store.task_get(task_id).state == "claimed"
    assert store.session_release_claims(holder.id, resumed.epoch) == 1
    _released_by_revoke(store, task_id, claimed.attempt.id)
