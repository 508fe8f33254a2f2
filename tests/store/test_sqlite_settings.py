"""The SQLite connection's own settings (PostgreSQL's are the server's)."""

from __future__ import annotations

import os
import stat
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


def test_a_new_sqlite_database_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    """The file holds token hashes and resume-secret hashes: it was created 0644 under
    the usual umask 022, readable by every user of the machine, and so were its WAL and
    shared-memory files, which SQLite creates with the database file's mode. An existing
    file keeps the mode its operator gave it."""
    old_umask = os.umask(0o022)
    try:
        path = tmp_path / "new" / "orbit.db"
        store = open_store(f"sqlite:///{path}")
        try:
            store.token_create("ci", ["submit"])  # a write: the WAL file exists
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.parent.iterdir()}
        finally:
            store.close()
        assert "orbit.db-wal" in modes, modes
        assert modes == dict.fromkeys(modes, 0o600), {k: oct(v) for k, v in modes.items()}
        shared = tmp_path / "shared.db"
        shared.touch(mode=0o640)
        open_store(f"sqlite:///{shared}").close()
        assert stat.S_IMODE(shared.stat().st_mode) == 0o640
    finally:
        os.umask(old_umask)
