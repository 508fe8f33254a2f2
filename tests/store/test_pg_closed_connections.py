"""Pooled PostgreSQL connections the server has closed are passed over, not used.

When PostgreSQL restarts (or an operator runs ``pg_terminate_backend``), every idle
connection in the driver's two pools is closed by the server. A store call must not be
the one that finds out: each such connection used to fail one call (a 500 at the API)
before the pool replaced it. These tests close the connections from the server's side, on
a database of their own, and wait until the backends are gone before the next call.
PostgreSQL only: SQLite has no connection to lose.
"""

from __future__ import annotations

import select
import time
from collections.abc import Iterator

import psycopg
import pytest

from orbit.core.model import Outcome
from orbit.store import Store, open_store
from orbit.store.postgres.driver import PostgresDriver, close_if_stale
from tests.pg import ADMIN_DSN, as_url, temporary_database
from tests.store.helpers import claim_one, queue, submit, worker

pytestmark = pytest.mark.parametrize("backend", ["postgres"])


def _terminate_all(dbname: str) -> int:
    """Terminate every backend connected to ``dbname``; return how many, once all have
    exited (so their sockets are closed on our side too)."""
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        row = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = %s",
            (dbname,),
        ).fetchone()
        assert row is not None
        deadline = time.monotonic() + 30
        while admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (dbname,)
        ).fetchone() != (0,):
            assert time.monotonic() < deadline, "the terminated backends did not exit"
            time.sleep(0.01)
        return int(row[0])


@pytest.fixture
def own_store(backend: str) -> Iterator[tuple[Store, str]]:
    """A store on a database of its own: terminating its backends touches no other test."""
    with temporary_database("orbit_closed") as dsn:
        url = as_url(dsn)
        store = open_store(url)
        try:
            yield store, url.rsplit("/", 1)[1]
        finally:
            store.close()


def test_every_call_after_the_server_closed_the_pools_succeeds(
    own_store: tuple[Store, str],
) -> None:
    store, dbname = own_store
    driver = store.driver
    assert isinstance(driver, PostgresDriver)
    queue(store)
    session, _ = worker(store)
    # grow both pools past one connection, so several closed ones wait in each
    with driver.transaction() as a, driver.transaction() as b, driver.transaction() as c:
        for tx in (a, b, c):
            tx.now()
    with driver.transaction(durable=False) as a, driver.transaction(durable=False) as b:
        for tx in (a, b):
            tx.now()
    assert _terminate_all(dbname) >= 5

    # a submit, a claim (the relaxed pool), a start, a finish and reads: none may fail
    task_id = submit(store)
    grant = claim_one(store, session)
    store.attempt_start(session.id, session.epoch, grant.attempt.id, grant.attempt.fence)
    store.attempt_finish(
        session.id, session.epoch, grant.attempt.id, grant.attempt.fence, Outcome.success(1)
    )
    assert store.task_get(task_id).state == "succeeded"
    kinds = [e["kind"] for e in store.event_list(task_id=task_id)]
    assert kinds == ["submitted", "claimed", "started", "succeeded"]


@pytest.fixture
def connection(backend: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with temporary_database("orbit_closed") as dsn, psycopg.connect(dsn, autocommit=True) as cx:
        yield cx


def _readable(cx: psycopg.Connection[tuple[object, ...]]) -> bool:
    """Wait (up to 30 s) until the connection's socket has something to read."""
    waiter = select.poll()
    waiter.register(cx.pgconn.socket, select.POLLIN)
    return bool(waiter.poll(30_000))


def test_an_idle_open_connection_is_kept(
    connection: psycopg.Connection[tuple[object, ...]],
) -> None:
    connection.execute("SELECT 1")
    assert not close_if_stale(connection)
    assert connection.execute("SELECT 2").fetchone() == (2,)


def test_a_connection_the_server_spoke_on_unasked_is_closed(
    connection: psycopg.Connection[tuple[object, ...]],
) -> None:
    """A pooled connection listens to nothing, so a message on an idle one is the
    server's goodbye or a rare unprompted one: either way a new connection is cheaper."""
    connection.execute("LISTEN orbit_closed_test")
    with psycopg.connect(connection.info.dsn, autocommit=True) as same_db:
        same_db.execute("NOTIFY orbit_closed_test, 'hello'")
    assert _readable(connection)  # the notification waits on the socket
    assert close_if_stale(connection)
    assert connection.closed


def test_a_connection_the_server_terminated_is_closed(
    connection: psycopg.Connection[tuple[object, ...]],
) -> None:
    connection.execute("SELECT 1")
    assert _terminate_all(connection.info.dbname) == 1
    assert close_if_stale(connection)
    assert connection.closed
