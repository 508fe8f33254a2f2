"""A transaction of Orbit's that waits for its node is ended by PostgreSQL.

A node cut off from the database in the middle of a transaction held its row locks
until the database's keepalives gave the connection up, two hours by default, and every
claim of the cluster could wait behind them. Every pooled connection sets
``idle_in_transaction_session_timeout`` when it opens (SQLite has one writer per file
and no connection of another host)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from orbit.store import Store, open_store
from orbit.store.postgres import driver as pg_driver
from tests.conftest import store_url
from tests.store.helpers import RACE_WAIT, queue, submit

SHOW = "SHOW idle_in_transaction_session_timeout"


@pytest.mark.parametrize("backend", ["postgres"])
def test_every_pooled_connection_ends_a_transaction_left_waiting(store: Store) -> None:
    with (
        store.driver.transaction(durable=False) as relaxed,
        store.driver.transaction() as durable,
    ):
        shown = [tx._cx.execute(SHOW).fetchone()[0] for tx in (relaxed, durable)]  # type: ignore[attr-defined]
    assert shown == ["1min", "1min"]
    assert pg_driver.IDLE_IN_TRANSACTION_MS == 60_000
    # and the server's own TCP checks of the connection, for a node cut off mid-statement
    with store.driver.transaction() as durable:
        checks = [
            durable._cx.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[attr-defined]
            for name in ("tcp_keepalives_idle", "tcp_keepalives_count", "tcp_user_timeout")
        ]
    assert checks == ["10", "3", "30000"]


@pytest.mark.parametrize("backend", ["postgres"])
def test_the_row_locks_of_a_stalled_transaction_are_freed(store: Store, monkeypatch: Any) -> None:
    """A node whose transaction stalls after locking a task: once the timeout passes,
    PostgreSQL ends it, and another transaction takes the row (waited for, not slept)."""
    queue(store)
    tid = submit(store)
    monkeypatch.setattr(pg_driver, "IDLE_IN_TRANSACTION_MS", 200)
    stalled = open_store(store_url(store))
    try:
        # the node finds its connection gone at its next statement
        with pytest.raises(psycopg.OperationalError) as lost, stalled.driver.transaction() as tx:
            tx.fetch("task_lock_many", {"ids": [tid]})
            with psycopg.connect(store_url(store), autocommit=True) as other:
                other.execute(f"SET statement_timeout = {int(RACE_WAIT * 1000)}")
                locked = other.execute(
                    "SELECT id FROM orbit_tasks WHERE id = %s FOR UPDATE", (tid,)
                ).fetchall()
            assert locked == [(tid,)]
            tx.fetch("task_get", {"id": tid})
        assert stalled.driver.is_unavailable(lost.value)  # not blamed on the work
    finally:
        stalled.close()
    assert store.task_get(tid).state == "queued"
