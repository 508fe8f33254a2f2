"""The dispatcher's claims while another connection holds the database's write lock, on
both backends: each claim the store gives up on (``DatabaseUnavailable``) is skipped with
one WARNING for the whole stretch (``PassSkips``, as the reaper's and the scheduler's
passes), no traceback, and once the lock is released the next round pushes the task and
says that claims run again.

Every such claim was logged at ERROR with a full traceback (``dispatch failed``), under
the store's own warning that it gave up: noise that read as a bug. The lock is held by a
real second connection; the store waits a tenth of a second for it. The rounds are run
one by one (``Dispatcher.offer_all``), so the count of those skipped is exact."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import pytest
from fastapi import WebSocket

from orbit.core.model import SECOND
from orbit.server.gateway import Dispatcher, WorkerConnection
from orbit.server.metrics import Metrics
from orbit.store import Store, StoreConfig, open_store, sqlite_path
from orbit.store.driver import DATABASE_BUSY, DatabaseUnavailable
from tests.db_locks import write_lock
from tests.e2e.test_dispatch_rounds import RecordingSocket
from tests.store.helpers import queue, submit, worker

#: the store's wait for the lock before it gives up (``tx_wait_us``)
WAIT = StoreConfig(tx_wait_us=SECOND // 10)
#: PostgreSQL's lock wait per try, through the URL (the store keeps a URL's own)
IMPATIENT = "options=-c%20lock_timeout%3D30"
#: the dispatcher's poll interval, which its warning names
POLL_S = 60.0


def test_claims_under_a_lock_are_skipped_with_one_warning(
    fresh_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = fresh_url
    if sqlite_path(url) is None:
        url = f"{url}{'&' if '?' in url else '?'}{IMPATIENT}"
    store = open_store(url, WAIT)
    try:
        queue(store)
        task_id = submit(store)
        session, _ = worker(store)
        dispatcher = Dispatcher(store, POLL_S, Metrics(store))
        socket = RecordingSocket()
        conn = WorkerConnection(cast(WebSocket, socket), session, push=True)
        assert dispatcher.attach(conn) is None

        async def rounds() -> None:
            with write_lock(fresh_url):
                for _ in range(3):
                    await dispatcher.offer_all()
            await dispatcher.offer_all()
            for _ in range(100):  # the push goes out on a task of its own
                if socket.task_ids:
                    break
                await asyncio.sleep(0.01)

        caplog.set_level(logging.INFO)
        asyncio.run(rounds())
        assert socket.task_ids == [task_id]
    finally:
        store.close()

    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "orbit.gateway"]
    busy = (
        "dispatch pass skipped: the database is busy: another process or a long transaction "
        f"holds its lock; nothing was written (DATABASE_BUSY); trying again every {POLL_S:g} s"
    )
    assert said == [
        (logging.WARNING, busy),  # once, not a claim
        (logging.INFO, "dispatch passes run again, after 3 skipped"),
    ], caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert not [r for r in caplog.records if r.exc_info or r.exc_text], caplog.text


def test_a_round_whose_claims_are_partly_skipped_warns_once(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A round where the database kept some claims from running and let others through:
    the skips' state was reset after any claim that ran, so the warning and the "run
    again" alternated at every claim of every round. "Run again" now waits for a round
    whose claims all ran. One session's claims are made to fail as a busy database
    fails them (the real store's own error), the other's run on the real store."""
    queue(store)
    # (Handlers of their own: a claim that found nothing for a handler set skips the
    # sessions of that set for the rest of the round, whichever came first.)
    refused_session, _ = worker(store, {"a": 10})
    served_session, _ = worker(store, {"b": 10})
    real = store.attempt_claim_many
    failing = {refused_session.id}

    def claim(session_id: str, epoch: int, n: int) -> Any:
        if session_id in failing:
            raise DatabaseUnavailable(DATABASE_BUSY)
        return real(session_id, epoch, n)

    store.attempt_claim_many = claim  # type: ignore[method-assign]
    dispatcher = Dispatcher(store, POLL_S, Metrics(store))
    for session in (refused_session, served_session):
        conn = WorkerConnection(cast(WebSocket, RecordingSocket()), session, push=True)
        assert dispatcher.attach(conn) is None

    async def rounds() -> None:
        for _ in range(4):
            await dispatcher.offer_all()
        failing.clear()
        await dispatcher.offer_all()

    caplog.set_level(logging.INFO)
    asyncio.run(rounds())
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "orbit.gateway"]
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO], caplog.text
    assert said[1][1] == "dispatch passes run again, after 4 skipped", caplog.text
