"""What a migration says, on both backends: ``Store.schema_status`` (read alone) lists
the migration files due, ``Store.schema_migrate`` reports the versions before and after
and the files it applied (and logs them), and a migration that fails half way is named,
with the version the schema stays at."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from orbit.store import MigrationFailed, Store, open_store
from orbit.store.driver import migration_files


def older(url: str, tmp_path: Path, *, before: str) -> tuple[int, list[str]]:
    """Migrate the empty database at ``url`` up to the migration just before the one whose
    file name ends in ``before`` (``_schedules.sql``), as an older Orbit left it; return
    that version and the names of the files this Orbit has above it."""
    store = open_store(url, migrate=False)
    try:
        shipped = migration_files(store.driver.migrations)
        [at] = [i for i, (_, path) in enumerate(shipped) if path.name.endswith(before)]
        folder = tmp_path / "older-migrations"
        folder.mkdir()
        for _, path in shipped[:at]:
            shutil.copy(path, folder / path.name)
        store.driver.migrations = folder
        version = store.migrate()
    finally:
        store.close()
    assert version == shipped[at - 1][0]
    return version, [path.name for _, path in shipped[at:]]


def versions(store: Store) -> list[int]:
    store.driver.queries["test_versions"] = (
        "SELECT version FROM orbit_schema_version ORDER BY version"
    )
    return [int(r["version"]) for r in store._read("test_versions")]


def test_status_lists_what_is_due_and_migrate_says_what_it_applied(
    fresh_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``orbit db migrate`` said ``schema at version 13`` whether it had applied four
    migrations or none, and a node migrating at start logged nothing: what ran was
    found only in ``orbit_schema_version``."""
    version, due = older(fresh_url, tmp_path, before="_artifact_order.sql")
    store = open_store(fresh_url, migrate=False)
    try:
        latest = migration_files(store.driver.migrations)[-1][0]
        status = store.schema_status()
        assert (status.version, status.known, list(status.pending)) == (version, latest, due)
        assert versions(store) == [*range(1, version + 1)]  # read alone: nothing applied

        with caplog.at_level(logging.INFO, logger="orbit.store"):
            done = store.schema_migrate()
        assert (done.before, done.after, list(done.applied)) == (version, latest, due)
        assert done.describe() == (
            f"schema at version {latest}, migrated from version {version}: {', '.join(due)}"
        )
        said = [r.getMessage() for r in caplog.records if r.name == "orbit.store"]
        assert said == [f"migrated the schema from version {version} to {latest}: {', '.join(due)}"]

        caplog.clear()
        with caplog.at_level(logging.INFO, logger="orbit.store"):
            again = store.schema_migrate()
            assert store.migrate() == latest  # the callers that take a version
        assert (again.before, again.after, again.applied) == (latest, latest, ())
        assert again.describe() == f"schema at version {latest}, up to date"
        assert [r for r in caplog.records if r.name == "orbit.store"] == []
        assert store.schema_status().pending == ()
    finally:
        store.close()


def test_a_migration_that_meets_an_object_made_by_hand_is_named_and_applies_nothing(
    fresh_url: str, tmp_path: Path
) -> None:
    """A table made by hand where a migration makes its own failed the run with the
    driver's bare ``DuplicateTable`` (``OperationalError`` on SQLite), which the command
    reported as "cannot open the database". The error names the file, the driver's
    words and the version the schema stays at; nothing of the run is applied, the
    migrations before the failing one included."""
    version, due = older(fresh_url, tmp_path, before="_artifact_order.sql")
    failing = next(name for name in due if name.endswith("_schedules.sql"))
    assert due.index(failing) > 0  # one of the run's migrations comes before it
    store = open_store(fresh_url, migrate=False)
    try:
        store.driver.queries["test_conflict"] = "CREATE TABLE orbit_schedules (x integer)"
        store._tx(lambda tx: tx.execute("test_conflict"))
        with pytest.raises(MigrationFailed) as failed:
            store.migrate()
        said = str(failed.value)
        assert said.startswith(f"migration {failing} failed: "), said
        assert "orbit_schedules" in said and "already exists" in said, said
        assert said.endswith(f"the schema stays at version {version}"), said
        assert (failed.value.failed, failed.value.version) == (failing, version)
        assert failed.value.__cause__ is not None
        assert versions(store) == [*range(1, version + 1)]
        assert list(store.schema_status().pending) == due  # the one before it: not applied
    finally:
        store.close()
