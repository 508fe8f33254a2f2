"""Opening a database whose schema this Orbit does not know, on both backends."""

from __future__ import annotations

import os
import threading
from contextlib import suppress
from pathlib import Path

import pytest

from orbit.store import SchemaTooNew, Store, open_store, sqlite_path
from orbit.store.driver import migration_files
from orbit.store.sqlite import SqliteDriver


def _held(url: str) -> set[object]:
    """What an open store holds in this process: on SQLite the descriptors open on the
    database file, on PostgreSQL the threads of its connection pools (named ``orbit``)."""
    path = sqlite_path(url)
    if path is None:
        return {t for t in threading.enumerate() if t.name.startswith("orbit")}
    real, found = os.path.realpath(path), set()
    for fd in os.listdir("/proc/self/fd"):
        with suppress(OSError):  # a descriptor closed since the listing
            if os.readlink(f"/proc/self/fd/{fd}") == real:
                found.add(fd)
    return found


def _versions(store: Store) -> list[int]:
    store.driver.queries["test_versions"] = (
        "SELECT version FROM orbit_schema_version ORDER BY version"
    )
    return [int(r["version"]) for r in store._read("test_versions")]


def test_a_database_from_a_newer_orbit_is_refused_and_left_as_it_was(fresh_url: str) -> None:
    """An older Orbit on a database a newer one migrated said ``schema at version N+1``
    and served it, reading and writing rows whose meaning it did not know. Opening it is
    refused, and the database is not touched."""
    store = open_store(fresh_url)
    try:
        latest = migration_files(store.driver.migrations)[-1][0]
        store._tx(lambda tx: tx.execute("schema_version_insert", version=latest + 1, now=0))
        before = _versions(store)
        with pytest.raises(SchemaTooNew) as refused:
            store.migrate()
        assert f"version {latest + 1}" in str(refused.value)
        assert _versions(store) == before == [*range(1, latest + 2)]
    finally:
        store.close()
    held = _held(fresh_url)
    with pytest.raises(SchemaTooNew) as again:
        open_store(fresh_url)
    # The store it opened to find out is closed: it stayed open for as long as the error
    # lived (its traceback holds the store), a connection on SQLite, on PostgreSQL two
    # pools with their connections and threads, in a caller that kept or logged it.
    assert _held(fresh_url) == held, again.value


def test_a_migration_that_fails_half_way_leaves_nothing_and_a_rerun_applies_it(
    fresh_url: str, tmp_path: Path
) -> None:
    """A migration and its version record commit together: one whose second statement
    fails leaves neither its first statement's table nor a version behind, and once it
    is fixed the same command applies it."""
    store = open_store(fresh_url)
    try:
        shipped = migration_files(store.driver.migrations)
        latest = shipped[-1][0]
        folder = tmp_path / "migrations"
        folder.mkdir()
        for _, path in shipped:
            (folder / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
        broken = folder / f"{latest + 1:04d}_probe.sql"
        broken.write_text(
            "CREATE TABLE orbit_probe (x integer);\nCREATE TABLE orbit_probe (x integer);\n",
            encoding="utf-8",
        )
        store.driver.migrations = folder
        with pytest.raises(Exception, match="orbit_probe"):
            store.migrate()
        assert _versions(store) == [*range(1, latest + 1)]
        store.driver.queries["test_probe"] = "SELECT count(*) AS n FROM orbit_probe"
        with pytest.raises(Exception, match="orbit_probe"):
            store._read("test_probe")
        broken.write_text("CREATE TABLE orbit_probe (x integer);\n", encoding="utf-8")
        assert store.migrate() == latest + 1
        assert store._read("test_probe") == [{"n": 0}]
        assert store.migrate() == latest + 1
    finally:
        store.close()


@pytest.fixture
def current_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A database migrated to this Orbit's schema (PostgreSQL's is the session's)."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path}/orbit.db"
        open_store(url).close()
        return url
    return str(request.getfixturevalue("pg_url"))


def _impatient(url: str) -> Store:
    """A store on ``url`` (not migrated yet) that waits at most 200 ms for a lock."""
    path = sqlite_path(url)
    if path is not None:
        return Store(SqliteDriver(path, busy_timeout_ms=200))
    return open_store(f"{url}?options=-c%20lock_timeout%3D200", migrate=False)


def test_a_current_schema_opens_while_another_connection_holds_the_migration_lock(
    current_url: str,
) -> None:
    """Opening a store took the migration's lock and wrote (``BEGIN IMMEDIATE`` on
    SQLite, an advisory lock and ``CREATE TABLE IF NOT EXISTS`` on PostgreSQL) even when
    nothing was due: ``orbit token ls`` waited behind a server's long write, and past
    its busy timeout failed with ``database is locked``. A schema that is current is
    read, with no lock, and nothing is written."""
    holder = open_store(current_url, migrate=False)
    try:
        with holder.driver.transaction() as cx:
            cx.fetch("migrate_lock", {})  # SQLite: the write lock, held since BEGIN
            store = _impatient(current_url)
            try:
                latest = migration_files(store.driver.migrations)[-1][0]
                assert store.migrate() == latest
                assert store.token_list() is not None
            finally:
                store.close()
    finally:
        holder.close()
