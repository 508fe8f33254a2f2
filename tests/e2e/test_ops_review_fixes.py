"""Operations review fixes: odd SQLite URLs refused before anything is made, the token
commands kept off databases that are not Orbit's, `orbit worker`'s refusal of a bad
MODULE:OBJ, help texts that say what the commands do, /readyz naming a database that
refuses connections, and the documented SQLite backup taken from a live node."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from orbit.store import open_store
from orbit.store.sqlite.driver import DatabaseNotAFile, SqliteDriver
from tests.e2e.servers import make_tokens, start_server
from tests.pg import ADMIN_DSN, as_url, temporary_database

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _orbit(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORBIT_")}
    return subprocess.run(
        [sys.executable, "-m", "orbit.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
        env={**env, "COLUMNS": "300"},
    )


def _said(text: str) -> str:
    """A command's output as one line of words: rich's box characters and wrapping out."""
    return " ".join(text.replace("│", " ").split())


def test_a_sqlite_path_ending_in_a_slash_is_refused_and_nothing_is_made(tmp_path: Path) -> None:
    """``sqlite:////dir/x/`` made a file ``x`` (the slash dropped) and a server started on
    it; every later run was a NotADirectoryError, exit 1. Refused up front now, by each
    command (exit 2), by ``open_store`` and by the driver, with nothing made."""
    url = f"sqlite:///{tmp_path}/made/dir/"
    for args in (
        ["db", "migrate", "--db", url],
        ["server", "--db", url, "--port", "0"],
        ["token", "ls", "--db", url],
    ):
        run = _orbit(*args)
        assert run.returncode == 2, (args, run.stdout, run.stderr)
        assert "Traceback" not in run.stderr, run.stderr
        assert f"{tmp_path}/made/dir/ ends in / and so names a directory" in run.stderr
    with pytest.raises(ValueError, match="ends in / and so names a directory"):
        open_store(url)
    with pytest.raises(DatabaseNotAFile, match="ends in / and so names a directory"):
        SqliteDriver(f"{tmp_path}/made/")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "url",
    ["sqlite:///orbit.db?mode=ro", "sqlite:///o.db?cache=shared&mode=ro", "sqlite://host/x.db"],
)
def test_a_sqlite_url_with_query_parameters_or_a_host_is_refused(tmp_path: Path, url: str) -> None:
    """``?mode=ro`` became part of the file's name, and ``sqlite://host/x.db`` the file
    ``./host/x.db``. Each is refused, naming the spellings that work, nothing made."""
    for args in (
        ["db", "migrate", "--db", url],
        ["token", "create", "--db", url, "--name", "ops", "--scope", "admin"],
    ):
        run = _orbit(*args, cwd=tmp_path)
        assert run.returncode == 2, (args, run.stdout, run.stderr)
        [line] = run.stderr.splitlines()
        assert "sqlite:///relative/orbit.db" in line and "sqlite:////absolute/orbit.db" in line
    with pytest.raises(ValueError, match=re.escape("sqlite:////absolute/orbit.db")):
        open_store(url)
    assert list(tmp_path.iterdir()) == []


def _tables(url: str) -> list[str]:
    with psycopg.connect(url) as cx:
        rows = cx.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema "
            "NOT IN ('pg_catalog', 'information_schema') ORDER BY table_name"
        ).fetchall()
    return [name for (name,) in rows]


def test_the_token_commands_refuse_a_database_that_is_not_orbits(db_url: str) -> None:
    """``token ls``, ``create`` and ``revoke`` migrated whatever database they were given:
    a PostgreSQL database with one table of another application's got Orbit's tables, an
    empty SQLite file became an Orbit database. Refused now, exit 2, nothing changed."""
    if db_url.startswith("sqlite"):
        path = Path(db_url.removeprefix("sqlite:///"))
        path.touch()
    else:
        with psycopg.connect(db_url, autocommit=True) as cx:
            cx.execute("CREATE TABLE photos (id int)")
    for args in (
        ["token", "ls", "--db", db_url],
        ["token", "create", "--db", db_url, "--name", "ops", "--scope", "admin"],
        ["token", "revoke", "--db", db_url, "0" * 32],
    ):
        run = _orbit(*args)
        assert run.returncode == 2, (args, run.stdout, run.stderr)
        [line] = run.stderr.splitlines()
        assert "is not an Orbit database" in line and "orbit db migrate" in line, line
        assert run.stdout == ""
    if db_url.startswith("sqlite"):
        assert [p.name for p in path.parent.iterdir()] == [path.name]
        assert path.stat().st_size == 0
        # another application's SQLite file: refused as such, exit 2 (it was the
        # driver's DatabaseNotOrbit through "cannot open the database", exit 1)
        foreign = path.with_name("photos.db")
        with contextlib.closing(sqlite3.connect(foreign)) as cx:
            cx.execute("CREATE TABLE photos (id int)")
            cx.commit()
        before = foreign.read_bytes()
        run = _orbit("token", "ls", "--db", f"sqlite:///{foreign}")
        assert run.returncode == 2, (run.stdout, run.stderr)
        [line] = run.stderr.splitlines()
        assert "is not an Orbit database" in line and "photos" in line, line
        assert foreign.read_bytes() == before
    else:
        assert _tables(db_url) == ["photos"]


def test_orbit_worker_refuses_an_empty_or_relative_module_before_importing(
    tmp_path: Path,
) -> None:
    """``:worker`` and ``.wk:worker`` were importlib's ValueError and TypeError, a
    traceback and exit 1; ``wk:`` imported the module (running its code) to find no
    object. Each is one line, exit 2, and the module is not imported."""
    (tmp_path / "wk.py").write_text("open('imported', 'w').close()\nworker = None\n")
    for target in (":worker", ".wk:worker", "wk:"):
        run = _orbit("worker", target, cwd=tmp_path)
        assert run.returncode == 2, (target, run.stdout, run.stderr)
        assert "Traceback" not in run.stderr, run.stderr
        [line] = run.stderr.splitlines()
        assert f"{target!r} is no MODULE:OBJ" in line, line
    assert not (tmp_path / "imported").exists()


def test_orbit_worker_help_says_a_handler_the_drain_stopped_exits_0() -> None:
    """The help said exit 1 for "an outcome the server never confirmed", which a handler
    the drain stops part way (not retry_safe, left to its lease) is, yet the worker
    exits 0 for it, as docs/worker.md says."""
    said = _said(_orbit("worker", "--help").stdout)
    assert "never confirmed (its lease decides)" not in said, said
    assert "0 drained, a handler the drain stopped part way included" in said, said
    assert (
        "1 a handler ignored its cancellation, or an outcome the server never confirmed "
        "(a report the worker sent, unanswered when it stopped: its lease decides)"
    ) in said, said


def test_the_token_commands_help_does_not_say_they_make_directories() -> None:
    """The token commands shared the --db help of `db migrate` and `server`, which said
    missing directories are made: they refuse a database that is not there."""
    for command in ("create", "ls", "revoke"):
        said = _said(_orbit("token", command, "--help").stdout)
        assert "directories are made" not in said, (command, said)
        assert "it must exist and hold Orbit's schema" in said, (command, said)


@pytest.mark.postgres_only  # SQLite has no pool: its reads never wait for a connection
def test_readyz_and_metrics_name_a_database_that_refuses_connections(tmp_path: Path) -> None:
    """With the database closed to connections, /readyz and /metrics said it "did not
    answer within 2 s" (TimeoutError) while the pool was being refused outright. They
    now give the refusal's type and the server's words, with no host, port or URL."""
    with temporary_database("orbit_e2e") as dsn:
        name = conninfo_to_dict(dsn)["dbname"]
        node = start_server(as_url(dsn), tmp_path)
        try:
            _refused_and_back(node.http, name, node.log_text)
        finally:
            node.stop()


def _refused_and_back(http: str, name: str, log: Callable[[], str]) -> None:
    """Close database ``name`` to connections (its open ones ended): /readyz and
    /metrics say it refuses them; open it again: /readyz is ready again."""
    assert httpx.get(f"{http}/readyz").json() == {"status": "ready"}
    try:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{name}" WITH allow_connections false')
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (name,),
            )
        # A read on a connection cut as it ran fails as such ("could not be read"): the
        # probes after it wait for a connection, which the server refuses.
        for path in ("/readyz", "/metrics", "/readyz"):
            reply = httpx.get(f"{http}{path}", timeout=60)
            if "could not be read" not in reply.text:
                break
        assert reply.status_code == 503, reply.text
        assert reply.json() == {
            "status": "unavailable",
            "reason": "OperationalError",
            # the database's name left out: /readyz and /metrics take no token
            "message": 'the database refuses connections: database "…" is not '
            "currently accepting connections",
        }
        for path in ("/metrics", "/readyz"):
            assert httpx.get(f"{http}{path}", timeout=60).json() == reply.json()
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{name}" WITH allow_connections true')
    deadline = time.monotonic() + 60
    while httpx.get(f"{http}/readyz", timeout=60).status_code != 200:
        assert time.monotonic() < deadline, log()
        time.sleep(0.1)


def test_the_documented_sqlite_backup_of_a_live_node_holds_every_task(tmp_path: Path) -> None:
    """docs/operations.md's Backups: each `sqlite3` command it gives, run on a live
    node's database, copies every committed task, those still in the -wal file too
    (which `cp orbit.db` loses)."""
    section = (DOCS / "operations.md").read_text().split("## Backups", 1)[1].split("\n## ")[0]
    commands = [line.strip() for line in section.splitlines() if line.startswith("    sqlite3 ")]
    assert len(commands) == 2, section
    if shutil.which("sqlite3") is None:
        pytest.skip("no sqlite3 command on this machine")
    db = tmp_path / "orbit.db"
    url = f"sqlite:///{db}"
    admin = make_tokens(url).admin
    node = start_server(url, tmp_path)
    try:
        headers = {"Authorization": f"Bearer {admin}"}
        with httpx.Client(base_url=node.http, headers=headers, timeout=30) as client:
            queue = {"name": "q", "max_concurrency": 1, "rate": 0}
            assert client.post("/v1/queues", json=queue).status_code == 201
            for i in range(20):
                task = {"queue": "q", "handler": "h", "payload": {"i": i}}
                assert client.post("/v1/tasks", json=task).status_code == 201
        assert (tmp_path / "orbit.db-wal").stat().st_size > 0  # the node still runs on it
        for i, command in enumerate(commands):
            copy = tmp_path / f"copy{i}.db"
            argv = [
                re.sub(r"/backups/orbit-backup\.db", str(copy), part)
                for part in shlex.split(command.replace("/var/lib/orbit/orbit.db", str(db)))
            ]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
            assert done.returncode == 0, (argv, done.stderr)
            with closing(sqlite3.connect(f"file:{copy}?immutable=1", uri=True)) as cx:
                assert cx.execute("SELECT count(*) FROM orbit_tasks").fetchone() == (20,)
    finally:
        node.stop()


def test_a_hash_or_question_mark_in_a_sqlite_path_is_the_file_names(tmp_path: Path) -> None:
    """A ``#`` or a ``?`` that starts no ``name=value`` is part of the path, as in ``orbit
    dev --data-dir 'run#1'``: refused as a fragment, no URL could name such a file."""
    made = _orbit("db", "migrate", "--db", "sqlite:///run#1/what?/orbit.db", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "run#1" / "what?" / "orbit.db").is_file()
