"""Opening a database whose schema this Orbit does not know, on both backends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from orbit.store import SchemaTooNew, Store, open_store
from orbit.store.driver import migration_files
from tests.pg import as_url, temporary_database


@pytest.fixture
def fresh_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """A database of its own (not the session's shared PostgreSQL one): these tests
    write schema versions that would stop every later store from opening."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path}/orbit.db"
    else:
        with temporary_database() as dsn:
            yield as_url(dsn)


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
    with pytest.raises(SchemaTooNew):
        open_store(fresh_url)
