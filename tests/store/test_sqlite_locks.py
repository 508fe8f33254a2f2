"""The SQLite driver against another connection to the same file (another process: the
``orbit token`` commands beside a running server, a ``sqlite3`` shell): what holds the
file's locks is a real second connection, and the driver is given a short
``busy_timeout``, so that a wait that runs out does so in milliseconds."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from orbit.store import Store, open_store
from orbit.store.sqlite import SqliteDriver

#: long enough for the busy handler to try more than once, short enough to be cheap
BUSY_MS = 20


def _store(path: Path) -> Store:
    """A migrated store on ``path`` whose driver waits at most ``BUSY_MS`` for a lock."""
    open_store(f"sqlite:///{path}").close()
    return Store(SqliteDriver(path, busy_timeout_ms=BUSY_MS))


@pytest.mark.parametrize("begin", ["IMMEDIATE", "EXCLUSIVE"])
def test_a_read_does_not_wait_for_another_connections_write(tmp_path: Path, begin: str) -> None:
    """A read took the database's write lock (``BEGIN IMMEDIATE``), so it waited for any
    other connection's write transaction and, past ``busy_timeout``, failed with
    ``database is locked`` (``orbit token ls`` while a server or a ``sqlite3`` shell
    was in a long write), and was not retried. Under WAL a read needs no lock a writer
    holds: it reads the last commit, not the write in progress."""
    path = tmp_path / "orbit.db"
    store = _store(path)
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        store.token_create("ci", ["submit"])
        holder.execute(f"BEGIN {begin}")
        holder.execute("UPDATE orbit_tokens SET name = 'renamed'")
        assert [t.name for t in store.token_list()] == ["ci"]
        holder.execute("COMMIT")
        assert [t.name for t in store.token_list()] == ["renamed"]
    finally:
        holder.close()
        store.close()
