"""The SQLite connection's own settings (PostgreSQL's are the server's)."""

from __future__ import annotations

from pathlib import Path

from orbit.store import open_store
from orbit.store.sqlite.driver import CACHE_KIB


def test_the_sqlite_connection_runs_with_wal_full_sync_and_a_large_page_cache(
    tmp_path: Path,
) -> None:
    store = open_store(f"sqlite:///{tmp_path}/orbit.db")
    try:
        store.driver.queries["test_pragmas"] = (
            "SELECT (SELECT journal_mode FROM pragma_journal_mode) AS journal,"
            " (SELECT synchronous FROM pragma_synchronous) AS sync,"
            " (SELECT cache_size FROM pragma_cache_size) AS cache"
        )
        with store.driver.transaction() as cx:
            row = cx.fetch("test_pragmas", {})[0]
    finally:
        store.close()
    assert row == {"journal": "wal", "sync": 2, "cache": -CACHE_KIB}
    assert CACHE_KIB >= 64 * 1024
