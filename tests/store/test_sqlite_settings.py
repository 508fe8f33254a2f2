"""The SQLite connection's own settings (PostgreSQL's are the server's)."""

from __future__ import annotations

import os
import sqlite3
import stat
from contextlib import closing
from pathlib import Path

import pytest

from orbit.store import open_store
from orbit.store.sqlite.driver import (
    CACHE_KIB,
    JOURNAL_LIMIT_BYTES,
    DatabaseLinked,
    DatabaseNotWal,
    set_wal,
)


def test_the_sqlite_connection_runs_with_wal_full_sync_and_a_large_page_cache(
    tmp_path: Path,
) -> None:
    """... and a limit on the -wal file: past a checkpoint SQLite reuses it from the
    start but never shrank it, so one large batch (a submit of 100,000 tasks) left a
    -wal file of its size on disk for as long as the server ran."""
    store = open_store(f"sqlite:///{tmp_path}/orbit.db")
    try:
        store.driver.queries["test_pragmas"] = (
            "SELECT (SELECT journal_mode FROM pragma_journal_mode) AS journal,"
            " (SELECT synchronous FROM pragma_synchronous) AS sync,"
            " (SELECT cache_size FROM pragma_cache_size) AS cache,"
            " (SELECT journal_size_limit FROM pragma_journal_size_limit) AS wal_limit,"
            " (SELECT fullfsync FROM pragma_fullfsync) AS fullfsync"
        )
        with store.driver.transaction() as cx:
            row = cx.fetch("test_pragmas", {})[0]
    finally:
        store.close()
    assert row == {
        "journal": "wal",
        "sync": 2,
        "cache": -CACHE_KIB,
        "wal_limit": JOURNAL_LIMIT_BYTES,
        "fullfsync": 1,  # macOS: fsync() alone leaves a commit in the drive's cache
    }
    assert CACHE_KIB >= 64 * 1024
    assert JOURNAL_LIMIT_BYTES == 64 * 1024 * 1024


def test_a_database_sqlite_cannot_put_in_wal_mode_is_refused(tmp_path: Path) -> None:
    """``PRAGMA journal_mode = WAL`` answers with the mode in effect, and where WAL
    cannot be had (a VFS without shared memory, as some network file systems are) it
    keeps the old one and raises nothing: Orbit ran in rollback mode, where a reader
    waits for every writer, and said nothing. The connection is a real one through
    SQLite's ``unix-none`` VFS, which has no shared memory."""
    path = tmp_path / "orbit.db"
    with (
        closing(sqlite3.connect(f"file:{path}?vfs=unix-none", uri=True)) as cx,
        pytest.raises(DatabaseNotWal) as refused,
    ):
        set_wal(cx, str(path))
    message = str(refused.value)
    assert message == (
        f"SQLite cannot use WAL for {path} (its journal mode stays 'delete'): "
        "put the database on a local file system"
    )
    with closing(sqlite3.connect(path)) as cx:  # where it can, it does
        set_wal(cx, str(path))
        assert cx.execute("PRAGMA journal_mode").fetchone() == ("wal",)


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


def test_a_database_file_with_another_name_is_refused_by_every_name(tmp_path: Path) -> None:
    """A hard link gives SQLite a second name for the file and a second -wal and -shm
    beside it: a server on each name (the one-server lock is named from the path) wrote
    past the other's locks, and the file ended "malformed". Either name is refused, and
    the database is left as it was; once the link is gone it opens again."""
    first = tmp_path / "a.db"
    open_store(f"sqlite:///{first}").close()
    second = tmp_path / "b.db"
    os.link(first, second)
    before = first.read_bytes()
    for name in (first, second):
        with pytest.raises(DatabaseLinked) as refused:
            open_store(f"sqlite:///{name}")
        assert "2 hard links" in str(refused.value) and str(name) in str(refused.value)
    assert first.read_bytes() == before
    assert not (tmp_path / "b.db-wal").exists()
    second.unlink()
    open_store(f"sqlite:///{first}").close()
