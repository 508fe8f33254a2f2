"""A migration waits for the database past a request's wait (``StoreConfig.tx_wait_us``),
on both backends: a node starting beside another that migrates (the migration lock on
PostgreSQL, the write lock on SQLite) must wait for it, not fail its start once the wait
a client's request gets is over."""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest

from orbit.core.model import SECOND
from orbit.store import StoreConfig, open_store, sqlite_path
from orbit.store.driver import migration_files

#: the request wait of the store under test: the lock below is held four times as long
WAIT_US = SECOND // 4


@contextmanager
def migration_lock_held(url: str) -> Iterator[Callable[[], None]]:
    """Hold what a migrating node holds (PostgreSQL's migration lock, SQLite's write lock)
    until the yielded function is called."""
    path = sqlite_path(url)
    if path is not None:
        sqlite = sqlite3.connect(path, isolation_level=None)
        sqlite.execute("BEGIN IMMEDIATE")
        try:
            yield lambda: sqlite.execute("COMMIT")
        finally:
            sqlite.close()
        return
    dsn = url.replace("postgresql://", "postgres://", 1)
    with psycopg.connect(dsn) as pg:
        pg.execute("SELECT pg_advisory_xact_lock(7270600)")
        yield pg.commit


def test_a_migration_waits_for_another_nodes_past_a_requests_wait(
    fresh_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """It gave up after a request's 20 s, so a node starting beside another's long
    migration failed its start; and it waits saying so, once (it said nothing)."""
    # PostgreSQL's lock waits end at the connection's lock_timeout (5 s unless the URL
    # sets one) and are tried again while the wait lasts: 100 ms here, so the lock held
    # outlasts both
    url = fresh_url if sqlite_path(fresh_url) else f"{fresh_url}?options=-c%20lock_timeout%3D100"
    store = open_store(url, StoreConfig(tx_wait_us=WAIT_US), migrate=False)
    if sqlite_path(fresh_url):  # one try's wait for the write lock: shorter than the hold
        store.driver.busy_timeout_ms = 100  # type: ignore[attr-defined]
    caplog.set_level(logging.INFO, logger="orbit.store")
    try:
        latest = migration_files(store.driver.migrations)[-1][0]
        outcome: list[object] = []
        with migration_lock_held(fresh_url) as release:
            migrating = threading.Thread(
                target=lambda: outcome.append(_migrate(store)), name="migrating"
            )
            migrating.start()
            # held four times the request wait: a migration that waited only that long
            # gave up (DatabaseUnavailable, reported as MigrationFailed) while held
            migrating.join(timeout=4 * WAIT_US / SECOND)
            assert migrating.is_alive(), outcome
            release()
        migrating.join()
        assert outcome == [latest]
        waits = [r.getMessage() for r in caplog.records if "the migration waits" in r.getMessage()]
        assert len(waits) == 1, waits
        assert "another node's migration" in waits[0]
    finally:
        store.close()


def _migrate(store: object) -> object:
    try:
        return store.migrate()  # type: ignore[attr-defined]
    except Exception as exc:  # the assert above shows it
        return exc
