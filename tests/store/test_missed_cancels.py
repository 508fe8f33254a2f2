"""Cancels a node missed while its LISTEN connection was away (PostgreSQL's NOTIFY
orbit_cancel is not queued for a connection that is not there). Once LISTEN is back,
the node asks the store, in one query, which running attempts of the sessions attached
to it belong to a `cancelling` task, and pushes `cancel` to their workers: before, they
heard of the cancel only at their next renew."""

from __future__ import annotations

import asyncio
import json
from typing import cast

import pytest
from fastapi import WebSocket

from orbit.server.gateway import Dispatcher, WorkerConnection
from orbit.server.listen import listen
from orbit.server.metrics import Metrics
from orbit.store import Store
from tests.invariants import check_all
from tests.store.helpers import claim_one, queue, run_one, submit, worker

_WAIT = 10.0  # a safety net: the push comes as soon as LISTEN is up


def test_the_cancelling_attempts_of_the_named_sessions(store: Store) -> None:
    queue(store)
    s1, _ = worker(store, name="w1")
    s2, _ = worker(store, name="w2")
    t1 = submit(store)
    a1 = run_one(store, s1).attempt.id
    submit(store)
    run_one(store, s1)  # running, not cancelled
    t3 = submit(store)
    a3 = run_one(store, s2).attempt.id
    t4 = submit(store)
    claim_one(store, s1)  # claimed: a cancel ends it at once, nothing to tell
    for tid in (t1, t3, t4):
        store.task_cancel(tid)
    assert store.attempt_cancelling_for_sessions([s1.id]) == [(s1.id, a1)]
    both = store.attempt_cancelling_for_sessions([s2.id, s1.id, s1.id])
    assert sorted(both) == sorted([(s1.id, a1), (s2.id, a3)])
    assert store.attempt_cancelling_for_sessions([]) == []
    assert store.attempt_cancelling_for_sessions(["no-such-session"]) == []
    assert check_all(store) == []


class CancelSocket:
    """Stands in for a worker's WebSocket: records the cancels pushed to it."""

    def __init__(self) -> None:
        self.cancels: list[list[str]] = []
        self.got = asyncio.Event()

    async def send_text(self, text: str) -> None:
        message = json.loads(text)
        assert message["type"] == "cancel", message
        self.cancels.append(message["attempt_ids"])
        self.got.set()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        raise AssertionError(f"closed with {code} {reason}")


def test_a_cancel_missed_while_listen_was_away_is_pushed_once_it_is_back(store: Store) -> None:
    """PostgreSQL only (SQLite has one process and pushes cancels in-process). The
    cancel commits while no LISTEN connection is up, so its NOTIFY reaches no one; then
    the listener connects, as it does on a reconnect. Old code: it only woke the
    dispatcher, and the worker heard nothing (the wait below timed out)."""
    if store.backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    dsn: str = store.driver.dsn  # type: ignore[attr-defined]
    queue(store)
    session, _ = worker(store)
    other, _ = worker(store, name="elsewhere")  # attached to another node
    tid = submit(store)
    attempt = run_one(store, session).attempt.id
    elsewhere = submit(store)
    run_one(store, other)
    store.task_cancel(tid)
    store.task_cancel(elsewhere)

    async def run() -> list[list[str]]:
        dispatcher = Dispatcher(store, poll_interval=60, metrics=Metrics(store))
        dispatcher.bind(asyncio.get_running_loop())
        socket = CancelSocket()
        conn = WorkerConnection(cast(WebSocket, socket), session, push=False)
        assert dispatcher.attach(conn) is None
        listening = asyncio.create_task(listen(dsn, store.origin, dispatcher))
        try:
            async with asyncio.timeout(_WAIT):
                await socket.got.wait()
        finally:
            listening.cancel()
            await asyncio.gather(listening, return_exceptions=True)
        return socket.cancels

    assert asyncio.run(run()) == [[attempt]]
    assert check_all(store) == []
