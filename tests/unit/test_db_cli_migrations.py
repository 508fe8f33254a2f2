"""``orbit db status``, ``orbit db migrate``, ``orbit server`` and the ``orbit token``
commands on a database whose schema is older than this Orbit's, or whose migration
fails, and the token commands' failed writes, on SQLite and PostgreSQL. In-process
(typer's ``CliRunner``): each command opens the real database the test made."""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner, Result

from orbit.cli.main import app
from orbit.core.model import SECOND
from orbit.store import StoreConfig, open_store, sqlite_path
from orbit.store.driver import migration_files
from tests.pg import ADMIN_DSN
from tests.store.test_migrate_report import older


def orbit(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


def recorded(url: str) -> list[int]:
    """The versions ``orbit_schema_version`` holds, read beside the store."""
    path = sqlite_path(url)
    query = "SELECT version FROM orbit_schema_version ORDER BY version"
    if path is not None:
        with closing(sqlite3.connect(path)) as cx:
            return [v for (v,) in cx.execute(query)]
    with psycopg.connect(url) as cx:
        return [v for (v,) in cx.execute(query)]


def token_names(url: str) -> list[str]:
    store = open_store(url, migrate=False)
    try:
        return [t.name for t in store.token_list()]
    finally:
        store.close()


def error_line(run: Result) -> str:
    """The one line a refused command printed (stderr), no traceback."""
    assert run.exception is None or isinstance(run.exception, SystemExit), run.exception
    [line] = run.stderr.splitlines()
    assert line.startswith("error: "), line
    return line


def test_token_commands_refuse_an_older_schema_and_db_status_lists_what_is_due(
    fresh_url: str, tmp_path: Path
) -> None:
    """``orbit token ls`` (``create``, ``revoke``) on a database an older Orbit migrated
    applied this Orbit's migrations, under the older nodes still serving it (a node that
    runs on after 0010, artifact_order, loses its uploads' places). They refuse now, exit
    2, naming both versions and the command that migrates, and change nothing. ``orbit
    db status`` says what is due without applying it; ``orbit db migrate`` applies it and
    says which files it applied."""
    version, due = older(fresh_url, tmp_path, before="_artifact_order.sql")
    latest = version + len(due)
    for args in (
        ["token", "ls"],
        ["token", "create", "--name", "ops", "--scope", "admin"],
        ["token", "revoke", "0" * 32],
    ):
        run = orbit(*args, "--db", fresh_url)
        assert run.exit_code == 2, (args, run.output)
        line = error_line(run)
        said = f"the database's schema is at version {version}, this Orbit needs {latest}: "
        assert said + "run `orbit db migrate`" in line, line
        assert run.stdout == ""
    assert recorded(fresh_url) == [*range(1, version + 1)]

    status = orbit("db", "status", "--db", fresh_url)
    assert status.exit_code == 0, status.output
    assert status.stdout.splitlines() == [
        f"schema in the database: version {version}",
        f"this Orbit's schema: version {latest}",
        f"pending migrations ({len(due)}; orbit db migrate applies them):",
        *(f"  {name}" for name in due),
    ]
    assert recorded(fresh_url) == [*range(1, version + 1)]  # status only reads

    migrated = orbit("db", "migrate", "--db", fresh_url)
    assert migrated.exit_code == 0, migrated.output
    assert migrated.stdout == (
        f"schema at version {latest}, migrated from version {version}: {', '.join(due)}\n"
    )
    assert recorded(fresh_url) == [*range(1, latest + 1)]
    again = orbit("db", "migrate", "--db", fresh_url)
    assert again.stdout == f"schema at version {latest}, up to date\n", again.output
    current = orbit("db", "status", "--db", fresh_url)
    assert current.exit_code == 0, current.output
    assert current.stdout.splitlines()[1:] == [
        f"this Orbit's schema: version {latest}",
        "up to date",
    ]
    assert orbit("token", "ls", "--db", fresh_url).exit_code == 0


def test_db_status_refuses_what_the_token_commands_refuse(fresh_url: str, tmp_path: Path) -> None:
    """A database that is not Orbit's: exit 2, left as it was. One a newer Orbit
    migrated: one line naming its version, exit 1. Neither is changed."""
    path = sqlite_path(fresh_url)
    if path is not None:
        run = orbit("db", "status", "--db", fresh_url)  # no file: none is made
        assert run.exit_code == 2, run.output
        assert f"no database at {path}" in error_line(run)
        assert not Path(path).exists()
        Path(path).touch()
    run = orbit("db", "status", "--db", fresh_url)  # an empty file, a new database
    assert run.exit_code == 2, run.output
    assert "is not an Orbit database" in error_line(run)
    if path is not None:
        assert Path(path).stat().st_size == 0
    store = open_store(fresh_url)
    try:
        latest = migration_files(store.driver.migrations)[-1][0]
        store._tx(lambda tx: tx.execute("schema_version_insert", version=latest + 1, now=0))
    finally:
        store.close()
    newer = orbit("db", "status", "--db", fresh_url)
    assert newer.exit_code == 1, newer.output
    assert f"schema is at version {latest + 1}" in error_line(newer)
    assert recorded(fresh_url) == [*range(1, latest + 2)]


def test_a_migration_that_fails_is_named_by_db_migrate_and_server(
    fresh_url: str, tmp_path: Path
) -> None:
    """A migration that failed half way was ``error: cannot open the database:
    DuplicateTable: relation "orbit_schedules" already exists``: neither which file nor
    that nothing was applied. ``db migrate`` and ``server`` now name the file, the
    driver's words and the version the schema stays at, exit 1."""
    version, due = older(fresh_url, tmp_path, before="_schedules.sql")
    store = open_store(fresh_url, migrate=False)
    try:
        store.driver.queries["test_conflict"] = "CREATE TABLE orbit_schedules (x integer)"
        store._tx(lambda tx: tx.execute("test_conflict"))
    finally:
        store.close()
    for args in (["db", "migrate"], ["server", "--port", "0"]):
        run = orbit(*args, "--db", fresh_url)
        assert run.exit_code == 1, (args, run.output)
        line = error_line(run)
        assert line.startswith(f"error: migration {due[0]} failed: "), line
        assert "orbit_schedules" in line and "already exists" in line, line
        assert line.endswith(f"the schema stays at version {version}"), line
        assert "cannot open the database" not in line, line
        assert run.stdout == ""
    assert recorded(fresh_url) == [*range(1, version + 1)]


@contextmanager
def write_locked(url: str) -> Iterator[None]:
    """Another connection holding the database's write lock (SQLite: ``BEGIN
    IMMEDIATE``), or, on PostgreSQL, the test's database read-only for new sessions."""
    path = sqlite_path(url)
    if path is not None:
        with closing(sqlite3.connect(path, isolation_level=None)) as cx:
            cx.execute("BEGIN IMMEDIATE")
            try:
                yield
            finally:
                cx.execute("ROLLBACK")
        return
    name = url.rpartition("/")[2]
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        try:
            yield
        finally:
            admin.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')


def test_a_token_command_whose_write_fails_says_what_failed(
    fresh_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``token create`` and ``revoke`` on a database that took no write (its write lock
    held by another process, a read-only PostgreSQL database) said ``cannot open the
    database: OperationalError: database is locked``, of a database they had opened.
    They say what failed, exit 1, show no token, and write nothing; ``token ls`` still
    lists. SQLite's busy timeout is cut to 50 ms for the test (it is 10 s), and the
    store's wait for the database to half a second (``tx_wait_us``, 20 s)."""
    from orbit import store as store_package
    from orbit.store import sqlite as sqlite_backend

    monkeypatch.setattr(
        sqlite_backend,
        "SqliteDriver",
        functools.partial(sqlite_backend.SqliteDriver, busy_timeout_ms=50),
    )
    impatient = StoreConfig(tx_wait_us=SECOND // 2)
    monkeypatch.setattr(
        store_package, "open_store", functools.partial(store_package.open_store, config=impatient)
    )
    store = open_store(fresh_url)
    try:
        token_id, _ = store.token_create("kept", ["admin"])
    finally:
        store.close()
    condition = "lock" if sqlite_path(fresh_url) is not None else "read-only"
    with write_locked(fresh_url):
        for args, doing in (
            (["token", "create", "--name", "ops", "--scope", "admin"], "create the token"),
            (["token", "revoke", token_id], "revoke the token"),
        ):
            run = orbit(*args, "--db", fresh_url)
            assert run.exit_code == 1, (args, run.output)
            line = error_line(run)
            assert line.startswith(f"error: could not {doing}: "), line
            assert condition in line.lower(), line
            assert "cannot open the database" not in line, line
            assert run.stdout == "" and "orbit_" not in run.output, run.output
        listed = orbit("token", "ls", "--db", fresh_url, "--json")
        assert listed.exit_code == 0, listed.output
        assert '"revoked_at": null' in listed.stdout
    assert token_names(fresh_url) == ["kept"]
