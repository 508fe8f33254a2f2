"""A SQLite file that is another application's database, given to Orbit as its own: it
is refused before anything in it (or beside it) changes. Orbit's is a database with
``orbit_schema_version``; a new one is no file, an empty file, or a SQLite database with
nothing in it. PostgreSQL is not concerned: a database there holding other tables is
normal, and Orbit's tables are named apart."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from orbit.store import open_store
from orbit.store.sqlite import DatabaseNotOrbit, SqliteDriver, hold_for_server

#: the other application's script: it makes its database, says so, and keeps it open
#: (in WAL mode: its -wal and -shm are there) until its stdin closes
OTHER_APP = """
import sqlite3, sys
cx = sqlite3.connect(sys.argv[1], isolation_level=None)
cx.execute("PRAGMA journal_mode = WAL")
cx.execute("CREATE TABLE photos (id integer PRIMARY KEY, path text)")
cx.execute("INSERT INTO photos (path) VALUES ('a.jpg')")
print("ready", flush=True)
sys.stdin.read()
cx.close()
"""


def _make(path: Path, *statements: str) -> None:
    with closing(sqlite3.connect(path, isolation_level=None)) as cx:
        for statement in statements:
            cx.execute(statement)


@contextmanager
def _in_use(path: Path) -> Iterator[None]:
    """Another process with a WAL database open at ``path``, until the block ends."""
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_APP, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None and other.stdout.readline() == "ready\n"
        yield
    finally:
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=60)


CREATE = "CREATE TABLE photos (id integer PRIMARY KEY, path text)"
FOREIGN: dict[str, tuple[Callable[[Path], object], str]] = {
    # what another application left, and what the refusal names of it
    "rollback": (lambda p: _make(p, CREATE), "(photos)"),
    "wal, closed": (lambda p: _make(p, "PRAGMA journal_mode = WAL", CREATE), "(photos)"),
    "views and indexes": (
        lambda p: _make(
            p, CREATE, "CREATE INDEX by_path ON photos (path)", "CREATE VIEW v AS SELECT 1"
        ),
        "(by_path, photos, v)",
    ),
    "no table, a user_version": (lambda p: _make(p, "PRAGMA user_version = 7"), "(user_version 7)"),
    "an application_id": (lambda p: _make(p, "PRAGMA application_id = 1"), "(application_id 1)"),
    "no SQLite file": (
        lambda p: p.write_bytes(b"not a database, and long enough to have a header" * 4),
        ": file is not a database",
    ),
}


def _snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def _refusals(path: Path) -> list[Callable[[], object]]:
    """Each way Orbit opens a SQLite file: a server's lock, the store (a node, the
    ``token`` commands), the store unmigrated (``orbit db migrate``), the driver."""
    url = f"sqlite:///{path}"
    return [
        lambda: hold_for_server(str(path)),
        lambda: open_store(url),
        lambda: open_store(url, migrate=False),
        lambda: SqliteDriver(path),
    ]


@pytest.mark.parametrize("kind", list(FOREIGN))
def test_another_applications_database_is_refused_and_left_as_it_was(
    tmp_path: Path, kind: str
) -> None:
    """Opened as its own, the file was put in WAL mode (its header rewritten, a -wal and
    a -shm made beside it) and given Orbit's tables. Each way in is refused with one
    line naming the file, and the directory is left byte for byte, mtime for mtime: no
    journal-mode change, no table, no -wal, -shm or -server.lock."""
    path = tmp_path / "photos.db"
    make, named = FOREIGN[kind]
    make(path)
    before = _snapshot(tmp_path)
    for call in _refusals(path):
        with pytest.raises(DatabaseNotOrbit) as refused:
            call()
        assert str(refused.value).startswith(f"{path} is not an Orbit database"), refused.value
        assert named in str(refused.value), refused.value
    assert _snapshot(tmp_path) == before
    if kind != "no SQLite file":
        header = path.read_bytes()[:20]
        assert header[18] == (2 if kind == "wal, closed" else 1)  # the journal mode it had


def test_a_database_another_process_has_open_is_refused_as_it_runs(tmp_path: Path) -> None:
    """The other application is running: its WAL holds what it wrote, which Orbit reads
    as any reader does. Nothing Orbit refuses changes its database or its WAL."""
    path = tmp_path / "photos.db"
    with _in_use(path):
        before = {n: (tmp_path / n).read_bytes() for n in ("photos.db", "photos.db-wal")}
        for call in _refusals(path):
            with pytest.raises(DatabaseNotOrbit, match="another application's data"):
                call()
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == ["photos.db", "photos.db-shm", "photos.db-wal"]
        assert {n: (tmp_path / n).read_bytes() for n in before} == before
    with closing(sqlite3.connect(path)) as cx:
        tables = cx.execute("SELECT name FROM sqlite_master").fetchall()
    assert tables == [("photos",)]


def _orbit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orbit.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "300"},
    )


def test_the_commands_refuse_another_applications_database_and_open_orbits(
    tmp_path: Path,
) -> None:
    """``orbit db migrate``, ``orbit server`` and ``orbit dev`` on another application's
    file: one line that names it, exit 1, the file as it was. An empty file is a new
    database, and an Orbit database an operator added a table of their own to is still
    Orbit's: both are migrated."""
    foreign = tmp_path / "dot-orbit" / "orbit.db"
    foreign.parent.mkdir()
    _make(foreign, CREATE)
    before = _snapshot(foreign.parent)
    url = f"sqlite:///{foreign}"
    for args in (
        ["db", "migrate", "--db", url],
        ["server", "--db", url, "--port", "0"],
        ["dev", "--once", "--port", "0", "--data-dir", str(foreign.parent)],
    ):
        run = _orbit(*args)
        assert run.returncode == 1, (args, run.stdout, run.stderr)
        assert "Traceback" not in run.stderr, run.stderr
        [said] = [line for line in run.stderr.splitlines() if line.startswith("error:")]
        assert f"{foreign} is not an Orbit database" in said, said
    assert _snapshot(foreign.parent) == before
    empty, extended = tmp_path / "empty.db", tmp_path / "extended.db"
    empty.touch()
    open_store(f"sqlite:///{extended}").close()
    _make(extended, "CREATE TABLE ops_notes (note text)")
    for path in (empty, extended):
        run = _orbit("db", "migrate", "--db", f"sqlite:///{path}")
        assert run.returncode == 0 and run.stdout.startswith("schema at version"), run.stderr
    with closing(sqlite3.connect(extended)) as cx:
        assert cx.execute("SELECT count(*) FROM ops_notes").fetchone() == (0,)
