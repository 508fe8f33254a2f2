"""The SQLite driver's one connection after a statement or a COMMIT fails: the error
raised is the one that happened, and the connection serves the next call."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from orbit.store import open_store
from orbit.store.driver import DatabaseUnavailable
from tests.store.helpers import queue, submit


def test_a_full_disk_is_reported_as_such_and_the_next_call_succeeds(tmp_path: Path) -> None:
    """SQLite rolls the whole transaction back itself when a write finds the disk full
    (here, the file at its ``max_page_count``); the driver's ROLLBACK then raised
    ``cannot rollback - no transaction is active``, and that, not the full disk, was the
    error the node logged."""
    store = open_store(f"sqlite:///{tmp_path}/orbit.db")
    try:
        queue(store)
        cx = store.driver._raw()
        pages = cx.execute("PRAGMA page_count").fetchone()[0]
        cx.execute(f"PRAGMA max_page_count = {pages}")
        with pytest.raises(DatabaseUnavailable, match="full") as refused:
            submit(store, payload={"blob": "x" * 200_000})
        assert isinstance(refused.value.__cause__, sqlite3.OperationalError)
        cx.execute("PRAGMA max_page_count = 1073741823")
        assert submit(store, payload={"blob": "x" * 200_000})
    finally:
        store.close()


def test_a_commit_that_fails_leaves_no_transaction_open(tmp_path: Path) -> None:
    """A COMMIT that fails (here, a deferred foreign key: the same for a COMMIT that
    cannot write) left its transaction open on the connection every thread shares, and
    every later call failed with ``cannot start a transaction within a transaction``."""
    store = open_store(f"sqlite:///{tmp_path}/orbit.db")
    try:
        queue(store)
        store.driver.queries["test_defer"] = "PRAGMA defer_foreign_keys = ON"
        store.driver.queries["test_orphan"] = (
            "INSERT INTO orbit_artifact_chunks (artifact_id, seq, data) VALUES ('none', 0, x'00')"
        )
        with (
            pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"),
            store.driver.transaction() as tx,
        ):
            tx.execute("test_defer", {})
            tx.execute("test_orphan", {})
        assert not store.driver._raw().in_transaction
        assert submit(store)
    finally:
        store.close()
