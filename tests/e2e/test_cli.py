"""Every ``orbit`` command against a real server, bad arguments included."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orbit.server.routes import encode_cursor
from tests.e2e.servers import Node, Tokens, make_tokens, start_server

Run = Callable[..., subprocess.CompletedProcess[str]]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> tuple[Node, Tokens, str]:
    tmp = tmp_path_factory.mktemp("cli")
    db = f"sqlite:///{tmp}/orbit.db"
    tokens = make_tokens(db)
    node = start_server(db, tmp, args=["--reap-interval", "0.2"])
    yield node, tokens, db  # type: ignore[misc]
    node.stop()


@pytest.fixture
def orbit(cluster: tuple[Node, Tokens, str]) -> Run:
    node, tokens, _ = cluster
    return runner(node, tokens.admin)


def runner(node: Node, admin: str) -> Run:
    """``orbit`` as a subprocess against ``node``, on a wide terminal, with the token
    ``admin`` unless the call gives another (``token=None``: none)."""

    def run(*args: str, token: str | None = admin, **env: str) -> subprocess.CompletedProcess[str]:
        environment = {
            k: v for k, v in os.environ.items() if k not in ("ORBIT_TOKEN", "ORBIT_TOKEN_FILE")
        }
        environment.update({"ORBIT_URL": node.http, "COLUMNS": "200", **env})
        if token is not None:
            environment["ORBIT_TOKEN"] = token
        return subprocess.run(
            [sys.executable, "-m", "orbit.cli", *args],
            env=environment,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    return run


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_queue_commands(orbit: Run) -> None:
    made = json.loads(
        ok(orbit("queue", "create", "cli", "--max-concurrency", "2", "--rate", "0", "--json"))
    )
    assert made["name"] == "cli" and made["rate"] == 0
    assert "cli" in ok(orbit("queue", "ls"))
    assert json.loads(ok(orbit("queue", "pause", "cli", "--json")))["paused"] is True
    assert json.loads(ok(orbit("queue", "resume", "cli", "--json")))["paused"] is False
    missing = orbit("queue", "create", "nocaps")
    assert missing.returncode == 2 and "--max-concurrency and --rate" in missing.stderr
    dup = orbit("queue", "create", "cli", "--max-concurrency", "2", "--rate", "0")
    assert dup.returncode == 3 and "QUEUE_EXISTS" in dup.stderr
    assert orbit("queue", "pause", "nope").returncode == 3


def test_task_commands(orbit: Run) -> None:
    orbit("queue", "create", "t", "--max-concurrency", "2", "--rate", "0")
    task = json.loads(
        ok(
            orbit(
                "task",
                "submit",
                "t",
                "h",
                "--payload",
                '{"a": 1}',
                "--key",
                "k1",
                "--retry-safe",
                "--max-attempts",
                "2",
                "--timeout",
                "5",
                "--json",
            )
        )
    )
    assert task["payload"] == {"a": 1} and task["retry_safe"] and task["max_attempts"] == 2
    listed = json.loads(ok(orbit("task", "ls", "--queue", "t", "--json")))
    assert [t["id"] for t in listed["items"]] == [task["id"]]
    assert task["id"] in ok(orbit("task", "ls", "--state", "queued"))
    shown = json.loads(ok(orbit("task", "show", task["id"], "--json")))
    assert shown["events"][0]["kind"] == "submitted"
    assert "submitted" in ok(orbit("task", "show", task["id"]))
    assert json.loads(ok(orbit("task", "cancel", task["id"], "--json")))["state"] == "cancelled"
    waited = orbit("task", "wait", task["id"], "--json")
    assert waited.returncode == 1  # ended, but not succeeded
    assert json.loads(waited.stdout)["state"] == "cancelled"
    assert json.loads(ok(orbit("task", "retry", task["id"], "--json")))["state"] == "queued"
    timeout = orbit("task", "wait", task["id"], "--timeout", "0.5")
    assert timeout.returncode == 5 and "still queued" in timeout.stderr
    refused = orbit("task", "resolve", task["id"], "--decision", "retry")
    assert refused.returncode == 3 and "INVALID_STATE" in refused.stderr


def test_bad_arguments_get_clear_messages(orbit: Run, tmp_path: Path) -> None:
    bad_json = orbit("task", "submit", "t", "h", "--payload", "{nope")
    assert bad_json.returncode == 2 and "--payload is not JSON" in bad_json.stderr
    decision = orbit("task", "resolve", "x", "--decision", "maybe")
    assert decision.returncode == 2 and "succeeded, failed or retry" in decision.stderr
    unknown = orbit("task", "show", "no-such-task")
    assert unknown.returncode == 3 and "TASK_NOT_FOUND" in unknown.stderr
    for odd in ("a b", "é"):  # refused by the server, not a traceback nor "cannot reach"
        shown = orbit("task", "show", odd)
        assert shown.returncode == 3 and "TASK_NOT_FOUND" in shown.stderr, shown.stderr
        assert "Traceback" not in shown.stderr
    no_token = orbit("queue", "ls", token=None)
    assert no_token.returncode == 2 and "ORBIT_TOKEN" in no_token.stderr
    loose = tmp_path / "token"
    loose.write_text("x")
    loose.chmod(0o644)
    exposed = orbit("queue", "ls", token=None, ORBIT_TOKEN_FILE=str(loose))
    assert exposed.returncode == 2 and "open to group or others" in exposed.stderr
    two_lines = orbit("queue", "ls", token="orbit_00_s3cr3tpart\nsecond line")
    assert two_lines.returncode == 2 and "ORBIT_TOKEN holds" in two_lines.stderr
    assert "s3cr3tpart" not in two_lines.stderr + two_lines.stdout
    wrong = orbit("queue", "ls", token="orbit_00_bad")
    assert wrong.returncode == 3 and "UNAUTHENTICATED" in wrong.stderr
    down = orbit("queue", "ls", ORBIT_URL="http://127.0.0.1:9")
    assert down.returncode == 4 and "cannot reach" in down.stderr
    for url in ("127.0.0.1:8000", "http://ops:hunter2@127.0.0.1:9"):
        unusable = orbit("queue", "ls", ORBIT_URL=url)
        assert unusable.returncode == 2 and "server URL must" in unusable.stderr
        assert "hunter2" not in unusable.stderr + unusable.stdout
    missing_ca = str(tmp_path / "missing.pem")
    no_ca = orbit("queue", "ls", "--cafile", missing_ca, ORBIT_URL="https://127.0.0.1:9")
    assert no_ca.returncode == 2 and "No such file" in no_ca.stderr, no_ca.stderr
    assert orbit("worker", "frobnicate").returncode == 2
    assert orbit("worker", "nosuchmodule:worker").returncode == 2
    assert orbit("server", "--db", "mysql://x").returncode == 2
    unused = tmp_path / "unused" / "orbit.db"
    for cache in ("-1", "3601", "soon"):
        refused = orbit("server", "--db", f"sqlite:///{unused}", "--token-cache", cache)
        assert refused.returncode == 2 and "--token-cache" in refused.stderr, refused.stderr
    for every in ("0", "31", "soon"):  # past 30 s an on-time instant would be a misfire
        refused = orbit("server", "--db", f"sqlite:///{unused}", "--schedule-interval", every)
        assert refused.returncode == 2 and "--schedule-interval" in refused.stderr
    assert not unused.parent.exists()
    assert orbit("task", "ls", "--limit", "0").returncode == 2


def _attach(cluster: tuple[Node, Tokens, str], *names: str) -> list[str]:
    """Open a worker session under each name on the module's server, and close its
    connection: the sessions' ids."""
    import asyncio

    from orbit.worker import WorkerConnection

    node, tokens, _ = cluster

    async def attach() -> list[str]:
        ids = []
        for name in names:
            conn = await WorkerConnection.connect(node.ws, tokens.worker)
            await conn.hello(name, {"h": 1}, 1, push=False)
            await conn.close()
            assert conn.session_id is not None
            ids.append(conn.session_id)
        return ids

    return asyncio.run(attach())


def test_worker_commands(orbit: Run, cluster: tuple[Node, Tokens, str]) -> None:
    [session_id] = _attach(cluster, "cli-worker")
    assert "cli-worker" in ok(orbit("worker", "ls"))
    shown = ok(orbit("worker", "drain", session_id))
    assert session_id in shown and "yes" in shown  # a table, as `worker ls` prints
    drained = json.loads(ok(orbit("worker", "drain", session_id, "--json")))
    assert drained["draining"] is True
    assert json.loads(ok(orbit("worker", "ls", "--json")))[0]["draining"] is True


def test_task_show_and_wait_read_every_page_of_events(
    orbit: Run, cluster: tuple[Node, Tokens, str]
) -> None:
    """A task's history can outgrow one events page (1,000): a handler that reports
    progress in a loop does. ``task show`` lists all of it, and ``task wait`` follows it
    to the end rather than going quiet after the first page."""
    import asyncio

    from orbit.worker import WorkerConnection

    node, tokens, _ = cluster
    ok(orbit("queue", "create", "chatty", "--max-concurrency", "1", "--rate", "0"))
    task = json.loads(ok(orbit("task", "submit", "chatty", "talk", "--json")))
    steps = 1010

    async def run() -> None:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        await conn.hello("chatty-worker", {"talk": 1}, 1, push=False)
        [a] = await conn.claim(1)
        await conn.start(a["attempt_id"], a["fence"])
        for i in range(steps):
            await conn.progress(a["attempt_id"], a["fence"], message=f"step {i}")
        await conn.finish(a["attempt_id"], a["fence"], result="done")
        await conn.close()

    asyncio.run(run())
    shown = json.loads(ok(orbit("task", "show", task["id"], "--json")))
    kinds = [e["kind"] for e in shown["events"]]
    assert kinds.count("progress") == steps
    assert shown["events"][-1]["task_to"] == "succeeded", shown["events"][-1]
    ids = [int(e["id"]) for e in shown["events"]]
    assert ids == sorted(set(ids))
    waited = orbit("task", "wait", task["id"])
    assert waited.returncode == 0, waited.stderr
    assert f"step {steps - 1}" in waited.stderr
    assert "→ succeeded" in waited.stderr


def test_an_80_column_terminal_shows_whole_ids_attempts_and_why_a_task_failed(
    orbit: Run, cluster: tuple[Node, Tokens, str]
) -> None:
    """In an 80-column terminal the tables cut ids short (``01a24af6-5679-7d…``), and
    the commands they were copied into refused them. ``task show`` printed no attempts
    though its help promised them, and ``task wait`` (and ``submit --wait``) said a task
    failed, exit 1, but not why."""
    import asyncio

    from orbit.worker import WorkerConnection

    node, tokens, _ = cluster
    narrow = {"COLUMNS": "80"}
    ok(orbit("queue", "create", "narrow", "--max-concurrency", "1", "--rate", "0"))
    submitted = ok(orbit("task", "submit", "narrow", "breaks", **narrow))
    tid = json.loads(ok(orbit("task", "ls", "--queue", "narrow", "--json")))["items"][0]["id"]
    assert tid in submitted and tid in ok(orbit("task", "ls", "--queue", "narrow", **narrow))

    async def fail_it() -> tuple[str, str]:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        await conn.hello("narrow-worker", {"breaks": 1}, 1, push=False)
        [a] = await conn.claim(1)
        await conn.start(a["attempt_id"], a["fence"])
        error = {"code": "BOOM", "message": "it broke", "retryable": False}
        await conn.finish(a["attempt_id"], a["fence"], error=error)
        await conn.close()
        assert conn.session_id is not None
        return a["attempt_id"], conn.session_id

    attempt_id, session_id = asyncio.run(fail_it())
    shown = ok(orbit("task", "show", tid, **narrow))
    assert tid in shown and attempt_id in shown and "error: BOOM it broke" in shown
    assert session_id in ok(orbit("worker", "ls", **narrow))
    waited = orbit("task", "wait", tid, **narrow)
    assert waited.returncode == 1 and "error: BOOM it broke" in waited.stdout, waited.stdout

    # --wait-timeout bounds submit --wait, and goes with --wait only.
    alone = orbit("task", "submit", "narrow", "nobody", "--wait-timeout", "5")
    assert alone.returncode == 2 and "--wait-timeout goes with --wait" in alone.stderr
    assert json.loads(ok(orbit("task", "ls", "--queue", "narrow", "--json")))["items"] == [
        json.loads(ok(orbit("task", "show", tid, "--json")))["task"]
    ]  # nothing submitted
    gave_up = orbit("task", "submit", "narrow", "nobody", "--wait", "--wait-timeout", "0.5")
    assert gave_up.returncode == 5, gave_up.stderr


def test_db_and_token_commands(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/x.db"
    migrate = _orbit("db", "migrate", "--db", db)
    latest = len(list((ROOT / "orbit/store/sqlite/migrations").glob("*.sql")))
    assert migrate.returncode == 0 and f"schema at version {latest}" in migrate.stdout
    made = _orbit("token", "create", "--db", db, "--name", "ci", "--scope", "submit")
    assert made.returncode == 0 and made.stdout.startswith("orbit_")
    assert made.stdout.strip() not in made.stderr  # the token only on stdout
    bad = _orbit("token", "create", "--db", db, "--name", "ci", "--scope", "root")
    assert bad.returncode == 2 and "scopes must be among" in bad.stderr
    # a mistyped SQLite path: refused, and no database made there (one was, and a token
    # printed that no server would take)
    typo = tmp_path / "typo" / "x.db"
    for scope in ("admin", "root"):
        made_nothing = _orbit(
            "token", "create", "--db", f"sqlite:///{typo}", "--name", "ci", "--scope", scope
        )
        assert made_nothing.returncode == 2 and "no database at" in made_nothing.stderr
        assert not made_nothing.stdout and not typo.exists() and not typo.parent.exists()
    assert make_tokens(db).admin.startswith("orbit_")
    helps = _orbit("--help")
    for command in ("dev", "server", "worker", "queue", "task", "db", "token"):
        assert command in helps.stdout


def _orbit(*args: str) -> subprocess.CompletedProcess[str]:
    """``orbit *args`` in a process of its own, on a wide terminal."""
    return subprocess.run(
        [sys.executable, "-m", "orbit.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_token_ls_and_revoke(db_url: str) -> None:
    """``token ls`` lists every token without its secret; ``token revoke`` refuses it from
    then on, shows it revoked, and a second revoke keeps the first instant."""
    from orbit.store import open_store

    ok(_orbit("db", "migrate", "--db", db_url))  # token create makes no database
    made = _orbit("token", "create", "--db", db_url, "--name", "leaky", "--scope", "submit")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    token_id, secret = token.split("_")[1], token.split("_", 2)[2]
    listed = json.loads(ok(_orbit("token", "ls", "--db", db_url, "--json")))
    assert listed == [
        {
            "id": token_id,
            "name": "leaky",
            "scopes": ["submit"],
            "created_at": listed[0]["created_at"],
            "revoked_at": None,
        }
    ]
    table = ok(_orbit("token", "ls", "--db", db_url))
    assert token_id in table and "leaky" in table and secret not in table
    revoked = _orbit("token", "revoke", "--db", db_url, token_id)
    assert revoked.returncode == 0, revoked.stderr
    assert token_id in revoked.stdout and "within their --token-cache" in revoked.stderr
    [after] = json.loads(ok(_orbit("token", "ls", "--db", db_url, "--json")))
    assert after["revoked_at"] is not None and after["revoked_at"] >= after["created_at"]
    again = json.loads(ok(_orbit("token", "revoke", "--db", db_url, token_id, "--json")))
    assert again == after
    store = open_store(db_url)
    try:
        assert store.token_scopes(token) is None
    finally:
        store.close()
    for run in (made, revoked):
        assert secret not in run.stderr


def test_token_revoke_refuses_what_it_cannot_revoke_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """An unknown id, a whole token given for its id (its secret is not repeated), no id
    at all, and a --db that names no database are refused with one line, exit 2, and
    leave every token (and the file system) as it was."""
    db = f"sqlite:///{tmp_path}/orbit.db"
    token = make_tokens(db).admin
    before = ok(_orbit("token", "ls", "--db", db, "--json"))
    unknown = _orbit("token", "revoke", "--db", db, "0" * 32)
    assert unknown.returncode == 2, unknown.stderr
    assert unknown.stderr.startswith("error: no token with id '" + "0" * 32), unknown.stderr
    whole = _orbit("token", "revoke", "--db", db, token)
    assert whole.returncode == 2 and "between 'orbit_' and the next '_'" in whole.stderr
    assert token.split("_", 2)[2] not in whole.stdout + whole.stderr
    missing = _orbit("token", "revoke", "--db", db)
    assert missing.returncode == 2 and "Missing argument 'TOKEN_ID'" in missing.stderr
    for run in (unknown, whole, missing):
        assert run.stdout == "" and "Traceback" not in run.stderr, run.stderr
    assert ok(_orbit("token", "ls", "--db", db, "--json")) == before
    nowhere = tmp_path / "typo" / "orbit.db"
    for command in (["token", "ls"], ["token", "revoke", token.split("_")[1]]):
        absent = _orbit(*command, "--db", f"sqlite:///{nowhere}")
        assert absent.returncode == 2, absent.stderr
        assert f"error: no database at {nowhere}" in absent.stderr, absent.stderr
        scheme = _orbit(*command, "--db", "mysql://db/orbit")
        assert scheme.returncode == 2, scheme.stderr
        assert "--db must start with sqlite:// or postgresql://" in scheme.stderr
    assert not nowhere.parent.exists()
    assert ok(_orbit("token", "ls", "--db", db, "--json")) == before


def test_token_help_gives_an_example_and_the_cache_lifetime() -> None:
    """``token revoke --help`` says how long a running server still takes a revoked
    token: the server's cache lifetime, which the text must follow if it changes; and
    that the worker connections open with it are closed within it."""
    from orbit.server.auth import CACHE_SECONDS

    for command, example in (
        ("ls", "Example: orbit token ls --db"),
        ("revoke", "Example: orbit token revoke --db"),
    ):
        helped = _orbit("token", command, "--help")
        assert helped.returncode == 0, helped.stderr
        text = " ".join(helped.stdout.split())
        assert example in text, text
    assert f"for up to {CACHE_SECONDS:g} seconds" in text, text
    assert "each worker connection already open with it is closed within that time" in text


def _junk_database(tmp_path: Path) -> Path:
    """A file that SQLite cannot open as a database."""
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database, and it is long enough to have a header")
    return junk


def _cannot_open(args: list[str], cause: str) -> subprocess.CompletedProcess[str]:
    """Run ``orbit *args``, which must exit 1 with one ``error:`` line that says the
    database cannot be opened and names ``cause``, and no traceback."""
    run = _orbit(*args)
    assert run.returncode == 1, (args, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    [said] = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert said.startswith("error: cannot open the database: "), said
    assert cause in said, said
    return run


def test_db_commands_on_a_file_that_is_no_database_say_so(tmp_path: Path) -> None:
    """``db migrate`` and the ``token`` commands on a database they cannot open print one
    line that says so and exit 1: no traceback, and the file is left as it was."""
    junk = _junk_database(tmp_path)
    db = f"sqlite:///{junk}"
    for args in (
        ["db", "migrate", "--db", db],
        ["token", "create", "--db", db, "--name", "ci", "--scope", "submit"],
        ["token", "ls", "--db", db],
        ["token", "revoke", "--db", db, "0" * 32],
    ):
        run = _cannot_open(args, "file is not a database")
        assert run.stderr.startswith("error: cannot open the database"), run.stderr
        assert run.stdout == ""
    assert junk.read_bytes().startswith(b"this is not a database")


def _contents(*dirs: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for d in dirs for p in sorted(d.iterdir())}


def test_db_commands_and_server_refuse_a_read_only_database_with_one_line(
    tmp_path: Path,
) -> None:
    """``db migrate``, the ``token`` commands and ``server`` on a SQLite file in a
    directory they cannot write in, or on a read-only file, exit 1 with one line that
    names the path and why, and change nothing. They said ``unable to open database
    file`` in the directory; on the read-only file ``db migrate`` and ``token ls``
    succeeded, ``token create`` ended in a traceback (``attempt to write a readonly
    database``) and ``server`` started serving, to fail every write. In-process (with
    ``CliRunner``): as root only an effective user other than root is stopped by a
    file's mode, and that user cannot reach this interpreter's files to start another."""
    # uvicorn and orbit.server: imported before the user changes, since `server` imports
    # them lazily, from files only root may read.
    import uvicorn  # noqa: F401
    from typer.testing import CliRunner

    import orbit.server  # noqa: F401
    from orbit.cli.main import app
    from orbit.store import open_store
    from tests.store.read_only import as_unprivileged, reachable_dir

    with reachable_dir(tmp_path) as base:
        locked_dir, locked_file = base / "locked-dir", base / "locked-file"
        for where in (locked_dir, locked_file):
            where.mkdir()
            open_store(f"sqlite:///{where / 'orbit.db'}").close()
        (locked_file / "orbit.db").chmod(0o444)
        locked_file.chmod(0o777)  # the directory is writable: only the file is not
        locked_dir.chmod(0o555)
        before = _contents(locked_dir, locked_file)

        def commands(db: str) -> list[list[str]]:
            return [
                ["db", "migrate", "--db", db],
                ["token", "create", "--db", db, "--name", "ci", "--scope", "submit"],
                ["token", "ls", "--db", db],
                ["token", "revoke", "--db", db, "0" * 32],
                ["server", "--db", db, "--port", "0"],
            ]

        # Each command once as root, on a path that cannot be opened (its directory is a
        # file): what they import lazily on the way to the same one-line error is loaded
        # before the user changes, from a checkout (a fresh clone in a 0700 temporary
        # directory) that `nobody` may not reach.
        blocked = base / "not-a-directory"
        blocked.write_text("")
        for args in commands(f"sqlite:///{blocked / 'orbit.db'}"):
            warm = CliRunner().invoke(app, args)
            assert warm.exit_code in (1, 2), (args, warm.output, warm.exception)
        runs = []
        with as_unprivileged():
            for where, cause in (
                (locked_dir, f"cannot write in {locked_dir}, the directory of "),
                (locked_file, f"{locked_file / 'orbit.db'} is read-only to this user"),
            ):
                db = f"sqlite:///{where / 'orbit.db'}"
                for args in commands(db):
                    runs.append((args, cause, CliRunner().invoke(app, args)))
        locked_dir.chmod(0o755)  # for the clean-up
        for args, cause, run in runs:
            assert run.exit_code == 1, (args, run.output, run.exception)
            assert run.stdout == "", (args, run.stdout)
            said = f"error: cannot open the database: DatabaseReadOnly: {cause}"
            assert run.stderr.startswith(said), (args, run.stderr)
            assert run.stderr.count("\n") == 1, (args, run.stderr)
        assert _contents(locked_dir, locked_file) == before


def test_db_commands_and_server_refuse_a_database_from_a_newer_orbit(tmp_path: Path) -> None:
    """A database a newer Orbit migrated (its schema version above this one's last
    migration) is refused by ``db migrate``, the ``token`` commands and ``server``: one
    line that names the version, exit 1, and the recorded version left as it was."""
    import sqlite3

    path = tmp_path / "orbit.db"
    db = f"sqlite:///{path}"
    done = subprocess.run(
        [sys.executable, "-m", "orbit.cli", "db", "migrate", "--db", db],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.startswith("schema at version ")
    with sqlite3.connect(path) as cx:
        cx.execute("INSERT INTO orbit_schema_version VALUES (999, 0)")
    cx.close()
    for args in (
        ["db", "migrate", "--db", db],
        ["token", "ls", "--db", db],
        ["server", "--db", db, "--port", "0"],
    ):
        run = _cannot_open(args, "schema is at version 999")
        assert run.stdout == ""
    with sqlite3.connect(path) as cx:
        assert cx.execute("SELECT max(version) FROM orbit_schema_version").fetchone() == (999,)
    cx.close()


def test_a_second_server_on_one_sqlite_file_is_refused_until_the_first_is_gone(
    tmp_path: Path,
) -> None:
    """SQLite takes one server (docs/operations.md): a second one on the same file
    started and served, but each wakes only its own workers (dispatch and cancels are
    in-process), so a task submitted through one waited for the other's slow poll. It is
    refused with one line, exit 1; once the first is SIGKILLed (and confirmed gone) its
    lock is gone with it, and a new server starts on the file."""
    db = f"sqlite:///{tmp_path / 'orbit.db'}"
    first = start_server(db, tmp_path, node_id="first")
    try:
        _cannot_open(["server", "--db", db, "--port", "0"], "another orbit server")
    finally:
        first.kill()
    second = start_server(db, tmp_path, node_id="second")  # raises unless it serves
    second.stop()


def test_a_server_stopped_by_sigterm_or_ctrl_c_closes_its_store_and_exits_0(
    tmp_path: Path,
) -> None:
    """uvicorn raises the signal that stopped it once more after its shutdown: on
    SIGTERM (what a supervisor sends) ``orbit server`` then died of it (-15) before it
    closed its store. It exits 0 now, as on Ctrl-C, the store closed (SQLite removes the
    ``-wal`` file as the last connection closes)."""
    import signal

    db = tmp_path / "orbit.db"
    for sig in (signal.SIGTERM, signal.SIGINT):
        node = start_server(f"sqlite:///{db}", tmp_path, node_id=f"stopped-{sig.name}")
        try:
            node.proc.send_signal(sig)
            node.proc.wait(timeout=30)
        finally:
            node.stop()
        said = node.log_text()
        assert node.proc.returncode == 0, (sig, said)
        assert "Aborted" not in said and "Traceback" not in said, (sig, said)
        assert not Path(f"{db}-wal").exists(), (sig, said)


def test_a_second_ctrl_c_stops_a_server_at_once_quietly_and_closes_its_store(
    tmp_path: Path,
) -> None:
    """The first Ctrl-C waits for the requests under way, here one whose body never
    comes; the second stops without waiting for it. What that left running was then
    cancelled as the process ended, and uvicorn logged each as an ERROR with its
    traceback. Now: exit 0, no traceback, the store closed (no -wal file left)."""
    import signal
    import time

    db = tmp_path / "orbit.db"
    tokens = make_tokens(f"sqlite:///{db}")
    node = start_server(f"sqlite:///{db}", tmp_path, node_id="forced")
    try:
        with socket.create_connection(("127.0.0.1", node.port)) as stalled:
            stalled.sendall(
                b"POST /v1/queues HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                + f"Authorization: Bearer {tokens.admin}\r\n".encode()
                + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
            )
            assert httpx.get(f"{node.http}/healthz", timeout=10).is_success
            node.proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 60
            while "Waiting for connections to close" not in node.log_text():
                assert node.proc.poll() is None and time.monotonic() < deadline, node.log_text()
                time.sleep(0.02)
            node.proc.send_signal(signal.SIGINT)
            node.proc.wait(timeout=60)  # a guard: the first stop alone waits for ever
    finally:
        node.stop()
    said = node.log_text()
    assert node.proc.returncode == 0, said
    assert "Traceback" not in said and "ERROR" not in said, said
    assert not Path(f"{db}-wal").exists(), said


def test_a_second_server_is_refused_before_it_migrates_the_file_the_first_serves(
    tmp_path: Path,
) -> None:
    """The second server opened the store, migrations and all, and only then met the
    first's lock: an upgraded server started beside an older one that still served the
    file migrated the schema under it, then was refused. The lock is taken first: the
    second is refused with one line and the file stays at its version. The first server
    is this process holding the one-server lock (``hold_for_server``, what every server
    holds) on a database one migration behind this Orbit, as an older Orbit left it."""
    import sqlite3
    from contextlib import closing

    from orbit.store import Store
    from orbit.store.driver import migration_files
    from orbit.store.sqlite import SqliteDriver, hold_for_server

    path = tmp_path / "orbit.db"
    driver = SqliteDriver(path)
    shipped = migration_files(driver.migrations)
    older = tmp_path / "older-migrations"
    older.mkdir()
    for _, file in shipped[:-1]:
        (older / file.name).write_text(file.read_text(encoding="utf-8"), encoding="utf-8")
    driver.migrations = older
    store = Store(driver)
    try:
        previous = store.migrate()
    finally:
        store.close()
    assert previous == shipped[-2][0]
    held = hold_for_server(str(path))
    try:
        _cannot_open(["server", "--db", f"sqlite:///{path}", "--port", "0"], "another orbit server")
    finally:
        os.close(held)
    with closing(sqlite3.connect(path)) as cx:
        assert cx.execute("SELECT max(version) FROM orbit_schema_version").fetchone() == (previous,)


def test_a_server_on_a_sqlite_file_other_users_may_read_says_so(tmp_path: Path) -> None:
    """Orbit makes a new database file 0600, but a file an older Orbit made (0644 under
    the usual umask) kept its mode, and with it every task's payload and result stayed
    readable by every user of the machine, and nothing said so. The server says it
    once when it starts, naming the file and its mode, and leaves the mode as it is; a
    file only its owner (and group) may read gets no such line."""
    from orbit.store import open_store

    exposed, private = tmp_path / "exposed.db", tmp_path / "private.db"
    for path in (exposed, private):
        open_store(f"sqlite:///{path}").close()
    exposed.chmod(0o644)
    private.chmod(0o640)
    said = "is open to other users of this machine"
    for path, warned in ((exposed, True), (private, False)):
        node = start_server(f"sqlite:///{path}", tmp_path, node_id=path.stem)
        try:
            log = node.log_text()
        finally:
            node.stop()
        assert (f"the database file {path} {said} (mode 644)" in log) is warned, log
        assert (said in log) is warned, log
    assert oct(exposed.stat().st_mode & 0o777) == oct(0o644)


def test_a_server_whose_database_cannot_be_opened_says_why_at_once(tmp_path: Path) -> None:
    """``orbit server`` (and ``db migrate``) on a PostgreSQL that refuses connections, or
    on a file that is no database, print one line that names the cause and exit 1. On
    PostgreSQL the line was the pool's ``PoolTimeout`` after 30 s, which named none (the
    server's was a traceback from uvicorn's start-up)."""
    junk = _junk_database(tmp_path)
    with socket.socket() as nobody:  # bound and not listening: a connect is refused
        nobody.bind(("127.0.0.1", 0))
        refusing = f"postgresql://postgres@127.0.0.1:{nobody.getsockname()[1]}/orbit"
        _cannot_open(["server", "--db", refusing, "--port", "0"], "Connection refused")
        _cannot_open(["db", "migrate", "--db", refusing], "Connection refused")
        not_a_database = ["server", "--db", f"sqlite:///{junk}", "--port", "0"]
        _cannot_open(not_a_database, "file is not a database")
    assert junk.read_bytes().startswith(b"this is not a database")


def test_server_on_a_port_in_use_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        db = tmp_path / "orbit.db"
        command = ["server", "--db", f"sqlite:///{db}", "--port", str(port)]
        result = _orbit(*command)
    assert result.returncode == 2, result.stderr
    assert f"port {port} is in use; pass --port 0 or another" in result.stderr
    assert not db.exists()


def test_server_says_where_it_listens_whatever_its_log_level(
    cluster: tuple[Node, Tokens, str],
) -> None:
    """``--port 0`` picks a port; the node names it (every e2e node is found so)."""
    node, _, _ = cluster
    assert node.port > 0
    assert f"orbit server listening on http://127.0.0.1:{node.port}" in node.log_text()
    # A database of its own: a second server on the cluster's SQLite file is refused.
    quiet_db = f"sqlite:///{node.log.parent / 'quiet.db'}"
    quiet = start_server(quiet_db, node.log.parent, node_id="quiet", args=["--log-level", "error"])
    try:
        assert f"orbit server listening on http://127.0.0.1:{quiet.port}" in quiet.log_text()
    finally:
        quiet.stop()


def test_a_database_url_password_is_in_no_error_line() -> None:
    """Whatever stops ``db migrate``, a ``token`` command or ``server`` from opening a
    PostgreSQL database, the one line that says so never holds the URL's password: not
    when the driver quotes a URL it cannot parse whole, nor when the password is a query
    parameter (``?password=``), percent-encoded or not."""
    from psycopg.conninfo import conninfo_to_dict

    from tests.pg import ADMIN_DSN

    pg = conninfo_to_dict(ADMIN_DSN)
    at = f"{pg.get('host', '127.0.0.1')}:{pg.get('port', '5432')}"
    user = pg.get("user", "postgres")
    secret = "hunter2"
    with socket.socket() as nobody:  # bound and not listening: a connect is refused
        nobody.bind(("127.0.0.1", 0))
        refusing = f"127.0.0.1:{nobody.getsockname()[1]}"
        cases = {  # URL: what the line must still name
            f"postgresql://{user}:{secret}@[::1:5432/orbit": "IPv6",  # bad syntax
            f"postgresql://{user}:hun%zzter2@{at}/orbit": "percent-encoded",
            f"postgresql://{user}@{at}/orbit?password=hun%zzter2": "percent-encoded",
            f"postgresql://{user}@{at}/orbit?password={secret}&sslmode=bogus": "sslmode",
            f"postgresql://{user}:{secret}@{refusing}/orbit": "Connection refused",
            f"postgresql://{user}:{secret}@{at}/orbit_no_such_db": "does not exist",
            f"postgresql://no_such_role:{secret}@{at}/test": "no_such_role",
        }
        runs = [(["db", "migrate", "--db", url], cause, url) for url, cause in cases.items()] + [
            ([*command, "--db", url], cause, url)
            for command in (
                ["token", "create", "--name", "ci", "--scope", "admin"],
                ["token", "ls"],
                ["token", "revoke", "0" * 32],
                ["server", "--port", "0"],
            )
            for url, cause in list(cases.items())[:2]
        ]
        for args, cause, url in runs:
            run = _cannot_open(args, cause)
            said = run.stdout + run.stderr
            assert secret not in said and "hun%zzter2" not in said, (url, said)


def test_a_database_password_with_an_unencoded_at_or_slash_is_refused_unechoed() -> None:
    """libpq ends a URL's user part at its first ``@`` or ``/``: ``user:hun@ter2@host``
    is password ``hun`` on host ``ter2@host``, which it looked up in DNS and named in its
    error ("failed to resolve host 'ter2@…'"), so the line kept the password's tail. Such
    a URL is refused before the driver sees it, with a line that says how to write it
    and holds no part of it."""
    from psycopg.conninfo import conninfo_to_dict

    from tests.pg import ADMIN_DSN

    pg = conninfo_to_dict(ADMIN_DSN)
    at = f"{pg.get('host', '127.0.0.1')}:{pg.get('port', '5432')}"
    user = pg.get("user", "postgres")
    for password in ("hun@ter2", "hun/ter2", "h@un/ter2@x"):
        url = f"postgresql://{user}:{password}@{at}/review_redact_none"
        for args in (
            ["db", "migrate", "--db", url],
            ["token", "ls", "--db", url],
            ["server", "--port", "0", "--db", url],
        ):
            run = _orbit(*args)
            said = run.stdout + run.stderr
            # Plain booleans: a failed assertion shows no part of the output it checked.
            refused, explained = run.returncode == 2, "percent-encode" in said
            clean = "Traceback" not in said and "hun" not in said and "ter2" not in said
            assert refused and explained and clean, (args[:2], refused, explained, clean)


def test_server_on_an_address_it_cannot_listen_on_is_refused_and_touches_nothing(
    tmp_path: Path,
) -> None:
    """A ``--host`` that names no address (or none of this machine's) is a usage error
    that names it, not a traceback from ``bind``, and no database is created. An empty
    one too: it listened on every interface."""
    db = tmp_path / "orbit.db"
    for host in ("no-such-host.invalid", "192.0.2.1"):
        command = ["server", "--db", f"sqlite:///{db}", "--host", host, "--port", "0"]
        result = _orbit(*command)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        assert f"cannot listen on {host}" in result.stderr, result.stderr
    for empty in ("", " "):  # the kernel took it for every interface
        command = ["server", "--db", f"sqlite:///{db}", "--host", empty, "--port", "0"]
        result = _orbit(*command)
        assert result.returncode == 2, result.stderr
        assert "--host is empty" in result.stderr, result.stderr
    assert not db.exists()


def test_worker_without_a_usable_token_or_url_says_so(
    orbit: Run, cluster: tuple[Node, Tokens, str]
) -> None:
    """``orbit worker MODULE:OBJ`` with no token, a token the server refuses (unknown, or
    without the worker scope) or a server URL it cannot use exits at once with one line
    that says which (2: bad arguments, 3: refused, as the other commands), not with a
    traceback, and never prints the token or a password in the URL. A Worker(...) the
    module cannot build (a name the protocol refuses) is one line and exit 2 as well."""
    _, tokens, _ = cluster
    app = "tests.e2e.worker_app:worker"
    unknown = "orbit_0123456789abcdef0123456789abcdef_notavalidsecret"
    cases = [
        (orbit("worker", app, token=None), 2, "ORBIT_TOKEN"),
        (orbit("worker", app, token=unknown), 3, "refused the token"),
        (orbit("worker", app, token=tokens.submit), 3, "refused the token"),
        (orbit("worker", app, ORBIT_TEST_NAME="no/such name"), 2, "name must be"),
        (orbit("worker", app, ORBIT_TEST_RENAME="no/such name"), 3, "refused this worker"),
        (orbit("worker", app, ORBIT_URL="127.0.0.1:9"), 2, "server URL must"),
        (orbit("worker", app, ORBIT_URL="http://ops:hunter2@127.0.0.1:9"), 2, "server URL"),
        (orbit("worker", app, "--json"), 2, "--json"),  # was accepted, then ignored
    ]
    for run, code, says in cases:
        assert run.returncode == code, run.stderr
        assert "Traceback" not in run.stderr, run.stderr
        [line] = [x for x in run.stderr.splitlines() if x.startswith("error:")]
        assert says in line, line
        for secret in ("notavalidsecret", tokens.submit.split("_", 2)[2], "hunter2"):
            assert secret not in run.stdout + run.stderr


def test_server_with_a_certificate_it_cannot_load_is_refused_and_touches_nothing(
    tmp_path: Path,
) -> None:
    """A ``--tls-cert``/``--tls-key`` pair that is no PEM certificate and key is a usage
    error that says so, before the database is opened: not an SSLError traceback from
    uvicorn's start-up after the schema was made."""
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    db = tmp_path / "orbit.db"
    tls = ["--tls-cert", str(junk), "--tls-key", str(junk)]
    command = ["server", "--db", f"sqlite:///{db}", "--port", "0", *tls]
    result = _orbit(*command)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "cannot load --tls-cert and --tls-key" in result.stderr, result.stderr
    assert not db.exists()
    # An encrypted key is refused as such, not prompted for (uvicorn gets no passphrase).
    import trustme
    from cryptography.hazmat.primitives import serialization

    issued = trustme.CA().issue_cert("127.0.0.1")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    private = serialization.load_pem_private_key(issued.private_key_pem.bytes(), None)
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    command = ["server", "--db", f"sqlite:///{db}", "--port", "0"]
    encrypted = subprocess.run(
        [
            sys.executable,
            "-m",
            "orbit.cli",
            *command,
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert encrypted.returncode == 2, encrypted.stderr
    assert "the key is encrypted" in encrypted.stderr, encrypted.stderr
    assert not db.exists()


def test_db_commands_refuse_a_database_that_is_no_file() -> None:
    """``sqlite:///`` and ``sqlite:///:memory:`` name an in-memory database, gone when
    the command ends: ``token create`` printed a token that no server could ever accept,
    and ``db migrate`` reported a schema nobody would see. They are refused as the bad
    argument they are."""
    for db in ("sqlite:///", "sqlite://", "sqlite:///:memory:"):
        for args in (
            ["db", "migrate", "--db", db],
            ["token", "create", "--db", db, "--name", "ci", "--scope", "admin"],
            ["token", "ls", "--db", db],
            ["token", "revoke", "--db", db, "0" * 32],
            ["server", "--db", db, "--port", "0"],
        ):
            run = _orbit(*args)
            assert run.returncode == 2, (args, run.stdout, run.stderr)
            assert "names no file" in run.stderr, run.stderr
            assert run.stdout == ""


def test_text_that_looks_like_markup_is_printed_as_it_is(
    orbit: Run, cluster: tuple[Node, Tokens, str], tmp_path: Path
) -> None:
    """Results, progress messages, error messages, ids and paths are data: one holding
    ``[/x]`` is printed as written. The CLI printed them through rich's markup, and a
    closing tag that matched nothing was a MarkupError traceback (``task show``,
    ``task wait``, an ORBIT_TOKEN_FILE path in the error line)."""
    import asyncio

    from orbit.worker import WorkerConnection

    node, tokens, _ = cluster
    ok(orbit("queue", "create", "marked", "--max-concurrency", "1", "--rate", "0"))
    done = json.loads(ok(orbit("task", "submit", "marked", "mark", "--json")))
    failed = json.loads(ok(orbit("task", "submit", "marked", "mark", "--json")))

    async def run() -> None:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        await conn.hello("marked-worker", {"mark": 1}, 1, push=False)
        for n, outcome in enumerate(("result", "error")):
            [a] = await conn.claim(1)
            await conn.start(a["attempt_id"], a["fence"])
            await conn.progress(a["attempt_id"], a["fence"], message=f"step [/x] {n}")
            if outcome == "result":
                await conn.finish(a["attempt_id"], a["fence"], result={"said": "[/red] ok"})
            else:
                error = {"code": "BAD", "message": "no [/b] way", "retryable": False}
                await conn.finish(a["attempt_id"], a["fence"], error=error)
        await conn.close()

    asyncio.run(run())
    shown = ok(orbit("task", "show", done["id"]))
    assert "[/red] ok" in shown
    waited = orbit("task", "wait", done["id"])
    assert waited.returncode == 0 and "step [/x] 0" in waited.stderr, waited.stderr
    assert "no [/b] way" in ok(orbit("task", "show", failed["id"]))
    missing = orbit("task", "wait", "[/x]")
    assert missing.returncode == 3 and "Traceback" not in missing.stderr, missing.stderr
    odd = tmp_path / "[/x]"
    gone = orbit("queue", "ls", token=None, ORBIT_TOKEN_FILE=str(odd))
    assert gone.returncode == 2 and f"{odd} does not exist" in gone.stderr, gone.stderr


def test_the_api_groups_help_says_where_the_token_comes_from_and_the_exit_codes() -> None:
    """``orbit queue --help`` and ``orbit task --help`` named neither the token's source
    nor the exit codes that scripts branch on; only docs/quickstart.md did. Each group
    names the codes its commands exit with (the queue commands listed the task ones,
    1, 5 and 6, too), and -h is --help everywhere (only ``orbit worker`` took it)."""
    for group, flag in (("queue", "--help"), ("task", "-h"), ("schedule", "-h")):
        helped = subprocess.run(
            [sys.executable, "-m", "orbit.cli", group, flag],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "COLUMNS": "300"},
        )
        assert helped.returncode == 0, helped.stderr
        text = " ".join(helped.stdout.split())
        assert "ORBIT_TOKEN or ORBIT_TOKEN_FILE" in text, text
        assert "3 refused by the server" in text and "4 server unreachable" in text, text
        task_only = ("1 the task ended", "5 timed out", "6 the queue or tenant is full")
        assert all((code in text) == (group == "task") for code in task_only), text
        if group == "schedule":
            assert "Create, update, list" in text, text


def test_server_with_a_node_id_no_worker_could_attach_to_is_refused(tmp_path: Path) -> None:
    """A ``--node-id`` outside the names the store takes ("my node") started a node
    whose every worker hello was then refused with INVALID_ARGUMENT. It is a usage error
    at start, before the database is made."""
    db = tmp_path / "orbit.db"
    command = ["server", "--db", f"sqlite:///{db}", "--port", "0", "--node-id", "my node"]
    result = _orbit(*command)
    assert result.returncode == 2, result.stderr
    assert "--node-id must be 1-128 characters" in result.stderr, result.stderr
    assert not db.exists()


def test_server_durations_past_a_day_or_infinite_are_refused_before_anything(
    tmp_path: Path,
) -> None:
    """``--lease-ttl inf`` (or ``--claim-ttl``, ``--session-ttl``) was an OverflowError
    traceback, and ``--claim-ttl 1e300`` started a node whose first claim overflowed the
    database's 64-bit microseconds. Every duration of ``orbit server`` is now at most a
    day: more is a usage error (exit 2) naming the option, before the database is made.
    In this process, as the command parses its options first: the TTLs come first, so
    that without the bound the test fails at once rather than start a server here."""
    from typer.testing import CliRunner

    from orbit.cli.main import app

    db = tmp_path / "orbit.db"
    for option in (
        "--lease-ttl",
        "--claim-ttl",
        "--session-ttl",
        "--poll-interval",
        "--reap-interval",
        "--stream-poll",
        "--stream-keepalive",
        "--stream-send-timeout",
        "--header-timeout",
    ):
        for value in ("inf", "1e300", "86401"):
            args = ["server", "--db", f"sqlite:///{db}", "--port", "0", option, value]
            result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
            assert isinstance(result.exception, SystemExit), (option, value, result.exception)
            assert result.exit_code == 2, (option, value, result.output)
            assert option in result.stderr, (option, value, result.stderr)
    assert not db.exists()


@pytest.fixture
def cli(cluster: tuple[Node, Tokens, str]) -> Run:
    """``orbit`` run in this process against the module's server: a few milliseconds a
    command rather than a Python start-up, for the cases that need no separate process."""
    from typer.testing import CliRunner

    from orbit.cli.main import app

    node, tokens, _ = cluster

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        env = {"ORBIT_URL": node.http, "ORBIT_TOKEN": tokens.admin, "ORBIT_TOKEN_FILE": None}
        result = CliRunner().invoke(app, list(args), env=env)  # type: ignore[arg-type]
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            result.stdout + result.stderr
        )
        return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)

    return run


def test_values_json_cannot_carry_are_refused_not_sent_as_null(cli: Run) -> None:
    """NaN, Infinity and a number that overflows a double parse in Python's ``json``
    but are no JSON: the client's encoder (orjson) wrote each as ``null``, so ``--payload
    NaN`` submitted a null payload, ``--timeout nan`` a task with no timeout, and both
    exited 0. A lone surrogate was a traceback. Each is now exit 2, nothing submitted."""
    ok(cli("queue", "create", "finite", "--max-concurrency", "1", "--rate", "0"))
    for args in (
        ["--payload", "NaN"],
        ["--payload", '{"a": Infinity}'],
        ["--payload", "[1e999]"],
        ["--payload", '"\\ud800"'],
        ["--payload", '{"a": 1, "a": 2}'],
        ["--timeout", "nan"],
        ["--timeout", "inf"],
    ):
        refused = cli("task", "submit", "finite", "h", *args)
        assert refused.returncode == 2, (args, refused.stdout, refused.stderr)
        assert "Traceback" not in refused.stderr and refused.stdout == "", args
        assert args[0] in refused.stderr, (args, refused.stderr)
    result = cli("task", "resolve", "x", "--decision", "succeeded", "--result", "NaN")
    assert result.returncode == 2 and "--result" in result.stderr, result.stderr
    for rate in ("nan", "inf"):
        made = cli("queue", "create", f"finite-{rate}", "--max-concurrency", "1", "--rate", rate)
        assert made.returncode == 2 and "--rate" in made.stderr, made.stderr
    assert json.loads(ok(cli("task", "ls", "--queue", "finite", "--json")))["items"] == []
    assert "finite-nan" not in ok(cli("queue", "ls"))


def test_task_resolve_refuses_options_its_decision_does_not_take(cli: Run) -> None:
    """``--result`` goes with ``succeeded`` and ``--error-code``/``--error-message`` with
    ``failed``. The client dropped a result given with any other decision and the CLI an
    error message given without a code, so ``--decision failed --result …`` resolved
    the task without the result it was told to keep, and said nothing."""
    for args in (
        ["--decision", "failed", "--result", '{"kept": true}'],
        ["--decision", "retry", "--result", "1"],
        ["--decision", "failed", "--error-message", "why"],
        ["--decision", "succeeded", "--error-code", "E"],
        ["--decision", "retry", "--error-code", "E"],
    ):
        refused = cli("task", "resolve", "01a229a4-0000-7000-8000-000000000000", *args)
        assert refused.returncode == 2, (args, refused.stdout, refused.stderr)
        assert "TASK_NOT_FOUND" not in refused.stderr, (args, refused.stderr)


def test_a_worker_with_no_handler_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """``orbit worker mod:worker`` for a Worker the module registered no handler on:
    ``run()`` refuses it with ValueError, which came out as a traceback and exit 1, where
    a Worker(...) the module cannot build is one line and exit 2. No server is needed:
    the run never starts."""
    (tmp_path / "nohandlers.py").write_text(
        'from orbit import Worker\nworker = Worker("http://127.0.0.1:9", "t0ken")\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "orbit.cli", "worker", "nohandlers:worker"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=30,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert "nohandlers:worker has no handler" in line, line


def test_worker_help_gives_the_exit_codes_of_ls_and_drain() -> None:
    """``orbit worker ls`` and ``drain`` exit as the other API commands do (3 refused by
    the server, 4 unreachable), but ``orbit worker --help`` gave only a running worker's
    codes: no 4 at all, and 3 as "the server refused the token" alone."""
    from typer.testing import CliRunner

    from orbit.cli.main import app

    helped = CliRunner().invoke(app, ["worker", "--help"], env={"COLUMNS": "300"})
    assert helped.exit_code == 0, helped.output
    text = " ".join(helped.stdout.split())
    assert (
        "ls and drain: 0 done; 2 bad arguments; 3 refused by the server; 4 server unreachable"
        in text
    ), text


def test_worker_help_says_an_unconfirmed_outcome_also_exits_1() -> None:
    """``run()`` returns 1 when an attempt's outcome was never confirmed by the server (a
    finish unanswered at shutdown), as for an abandoned handler; ``orbit worker --help``
    named only the abandoned handler, so an operator read exit 1 as a stuck handler."""
    from typer.testing import CliRunner

    from orbit.cli.main import app

    helped = CliRunner().invoke(app, ["worker", "--help"], env={"COLUMNS": "300"})
    assert helped.exit_code == 0, helped.output
    text = " ".join(helped.stdout.split())
    assert (
        "1 a handler ignored its cancellation, or an outcome the server never confirmed" in text
    ), text


def test_worker_ls_filters_by_state_and_refuses_an_unknown_one(
    cli: Run, cluster: tuple[Node, Tokens, str]
) -> None:
    """``orbit worker ls`` listed every session ever opened, and an expired one is never
    deleted: ``--state live`` (``GET /v1/workers?state=live``) lists the live ones
    alone. An unknown state is refused by the server, as the task list's is."""
    [session_id] = _attach(cluster, "state-worker")
    live = json.loads(ok(cli("worker", "ls", "--state", "live", "--json")))
    assert session_id in [w["session_id"] for w in live]
    assert {w["state"] for w in live} == {"live"}
    expired = json.loads(ok(cli("worker", "ls", "--state", "expired", "--json")))
    assert session_id not in [w["session_id"] for w in expired]
    for bad in ("nope", "LIVE", ""):
        refused = cli("worker", "ls", "--state", bad)
        assert refused.returncode == 3 and "INVALID_ARGUMENT" in refused.stderr, (bad, refused)
    misplaced = cli("worker", "drain", session_id, "--state", "live")
    assert misplaced.returncode == 2 and "--state applies to `ls` only" in misplaced.stderr
    # With no --state the live sessions alone are listed (test_worker_ls_default.py).
    # (Sessions of earlier tests may expire meanwhile: what is compared cannot change.)
    default = json.loads(ok(cli("worker", "ls", "--json")))
    assert session_id in [w["session_id"] for w in default]
    assert {w["state"] for w in default} == {"live"}


def test_task_cancel_help_says_a_running_task_is_told_at_once() -> None:
    """A cancel is pushed to the worker that runs the task as it commits (the renewal
    answers ``cancel`` only if the push could not be sent), but ``orbit task cancel
    --help`` said running tasks stop "at their next renewal", up to half a lease later."""
    from typer.testing import CliRunner

    from orbit.cli.main import app

    helped = CliRunner().invoke(app, ["task", "cancel", "--help"], env={"COLUMNS": "300"})
    assert helped.exit_code == 0, helped.output
    text = " ".join(helped.stdout.split())
    assert "running ones stop at their next renewal" not in text, text
    assert "a running one's worker is told at once" in text, text


def test_an_empty_id_or_name_is_one_line_and_exit_2() -> None:
    """The client refuses an empty id or name before it sends anything (a ValueError
    naming the argument): ``orbit task show "$ID"`` with ID unset, and every command
    like it, printed that as a traceback and exited 1, which for ``task wait`` means a
    task that ended other than succeeded. No server is needed: nothing is sent."""
    from typer.testing import CliRunner

    from orbit.cli.main import app

    env: dict[str, str | None] = {
        "ORBIT_URL": "http://127.0.0.1:9",
        "ORBIT_TOKEN": "orbit_00_unused",
        "ORBIT_TOKEN_FILE": None,
    }
    for args in (
        ["task", "show", ""],
        ["task", "wait", ""],
        ["task", "cancel", ""],
        ["task", "retry", ""],
        ["task", "resolve", "", "--decision", "retry"],
        ["queue", "pause", ""],
        ["queue", "update", "", "--rate", "1"],
        ["schedule", "show", ""],
        ["worker", "drain", ""],
        ["limit", "tenant", ""],
        ["event", "ls", "--task", ""],
        ["event", "ls", "--follow", "--task", ""],
    ):
        result = CliRunner().invoke(app, args, env=env)
        assert isinstance(result.exception, SystemExit), (args, result.exception)
        assert result.exit_code == 2, (args, result.output)
        assert "must not be empty" in result.stderr, (args, result.stderr)


def test_event_ls_refuses_a_limit_with_follow_which_would_ignore_it(cli: Run) -> None:
    """``orbit event ls --follow --limit 5`` took the --limit and followed every event
    regardless: a flag that did nothing. It is refused (exit 2) before anything is
    sent; without --follow it still sizes the page."""
    absent = "01a229a4-0000-7000-8000-000000000000"  # sent, the stream would be a 404
    refused = cli("event", "ls", "--follow", "--task", absent, "--limit", "5")
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert "--limit" in refused.stderr and "TASK_NOT_FOUND" not in refused.stderr
    ok(cli("queue", "create", "paged-events", "--max-concurrency", "1", "--rate", "0"))
    page = json.loads(ok(cli("event", "ls", "--limit", "1", "--json")))
    assert len(page["items"]) == 1 and page["next_cursor"], page


def test_task_submit_help_gives_the_wait_timeouts_default() -> None:
    """``--wait-timeout``'s help ended "[default: 3600]", which rich, rendering the help,
    took for a markup tag and dropped: the help never said how long --wait waits."""
    from typer.testing import CliRunner

    from orbit.cli.main import app

    helped = CliRunner().invoke(app, ["task", "submit", "--help"], env={"COLUMNS": "300"})
    assert helped.exit_code == 0, helped.output
    text = " ".join(helped.stdout.split())
    assert "give up waiting after this many seconds (default 3600)" in text, text


def test_queue_caps_and_limits_over_http_the_clients_and_the_cli(
    cluster: tuple[Node, Tokens, str],
) -> None:
    """``PATCH /v1/queues/{name}`` and ``/v1/limits/...`` on the module's server: through
    HTTP (admin only, bad bodies 400 and nothing changed), both clients, and the ``queue
    update`` and ``limit`` commands (in-process: the server is the real one)."""
    import asyncio

    import httpx
    from typer.testing import CliRunner

    from orbit.cli.main import app
    from orbit.client import AsyncClient, Client

    node, tokens, _ = cluster
    env = {"ORBIT_URL": node.http, "ORBIT_TOKEN": tokens.admin, "COLUMNS": "200"}

    def cli(*args: str) -> tuple[int, str]:
        run = CliRunner().invoke(app, list(args), env=env)
        return run.exit_code, run.output

    auth = {"Authorization": f"Bearer {tokens.admin}"}
    with httpx.Client(base_url=node.http, headers=auth, timeout=30) as http:
        made = {"name": "caps", "max_concurrency": 2, "rate": 5, "burst": 5}
        assert http.post("/v1/queues", json=made).status_code == 201
        changed = http.patch("/v1/queues/caps", json={"max_concurrency": 3})
        assert changed.status_code == 200, changed.text
        assert (changed.json()["max_concurrency"], changed.json()["rate"]) == (3, 5)
        for body, code in (
            ({}, "MISSING_FIELD"),
            ({"rate": 1, "colour": "red"}, "UNKNOWN_FIELD"),
            ({"rate": None}, "NULL_NOT_ALLOWED"),
            ({"burst": 0}, "NUMBER_OUT_OF_RANGE"),
        ):
            refused = http.patch("/v1/queues/caps", json=body)
            assert refused.status_code == 400, (body, refused.text)
            assert refused.json()["error"]["code"] == code, refused.text
        missing = http.patch("/v1/queues/nope", json={"rate": 1})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "QUEUE_NOT_FOUND"
        submit_only = {"Authorization": f"Bearer {tokens.submit}"}
        assert (
            http.patch("/v1/queues/caps", json={"rate": 1}, headers=submit_only).status_code == 403
        )
        assert (
            http.put(
                "/v1/limits/global", json={"max_concurrency": 1}, headers=submit_only
            ).status_code
            == 403
        )
        queues = http.get("/v1/queues", params={"limit": 1000}).json()["items"]
        queue = next(q for q in queues if q["name"] == "caps")
        assert (queue["max_concurrency"], queue["rate"], queue["burst"]) == (3, 5, 5)  # unchanged

        put = http.put("/v1/limits/tenants/caps-t", json={"max_concurrency": 4})
        # max_queued: the tenant's backpressure cap, added beside it (none set here)
        assert put.json() == {"tenant": "caps-t", "max_concurrency": 4, "max_queued": None}
        assert http.get("/v1/limits/tenants/caps-t").json()["max_concurrency"] == 4
        assert http.get("/v1/limits/tenants/other-t").json()["max_concurrency"] is None
        for body in ({}, {"max_concurrency": 0}, {"max_concurrency": "4"}):
            refused = http.put("/v1/limits/tenants/caps-t", json=body)
            assert refused.status_code == 400, (body, refused.text)
        over = http.put("/v1/limits/tenants/caps-t", json={"max_concurrency": 2_000_000})
        assert over.status_code == 400 and over.json()["error"]["code"] == "INVALID_ARGUMENT"
        bad_name = http.put("/v1/limits/tenants/bad%20name", json={"max_concurrency": 1})
        assert bad_name.status_code == 400
        assert http.get("/v1/limits/tenants/caps-t").json()["max_concurrency"] == 4

    try:
        with Client(node.http, tokens.admin) as c:
            assert c.queue_update("caps", rate=0)["rate"] == 0
            assert c.global_limit_set(50) == {"max_concurrency": 50}
            assert c.global_limit() == {"max_concurrency": 50}
            assert {"tenant": "caps-t", "max_concurrency": 4, "max_queued": None} in (
                c.tenant_limits()
            )

        async def through_async() -> None:
            async with AsyncClient(node.http, tokens.admin) as c:
                assert (await c.queue_update("caps", burst=9))["burst"] == 9
                assert (await c.tenant_limit_set("caps-t", None))["max_concurrency"] is None
                assert (await c.tenant_limit("caps-t"))["max_concurrency"] is None
                assert (await c.global_limit())["max_concurrency"] == 50
                assert await c.tenant_limits() == []

        asyncio.run(through_async())

        code, out = cli("queue", "update", "caps", "--max-concurrency", "6", "--json")
        assert code == 0, out
        assert json.loads(out)["max_concurrency"] == 6
        code, out = cli("queue", "update", "caps")
        assert code == 2 and "at least one of --max-concurrency" in out, out
        code, out = cli("queue", "update", "caps", "--burst", "0")
        assert code == 3 and "NUMBER_OUT_OF_RANGE" in out, out
        code, out = cli("queue", "update", "nope", "--rate", "1")
        assert code == 3 and "QUEUE_NOT_FOUND" in out, out
        assert cli("queue", "update", "caps", "--rate", "nan")[0] == 2
        code, out = cli("limit", "tenant", "caps-t", "7", "--json")
        seven = {"tenant": "caps-t", "max_concurrency": 7, "max_queued": None}
        assert (code, json.loads(out)) == (0, seven)
        code, out = cli("limit", "ls")
        assert code == 0 and "tenant caps-t" in out and "50" in out, out
        code, out = cli("limit", "ls", "--json")
        assert json.loads(out) == {
            "global": {"max_concurrency": 50},
            "tenants": [seven],
        }
        for bad in ("0", "x", "1.5", "٣"):  # a digit, but not an ASCII one
            code, out = cli("limit", "global", bad)
            assert code == 2 and "integer from 1 to 100000000 or `none`" in out, (bad, out)
        code, out = cli("limit", "global", "-1")  # was click's "No such option: -1"
        assert code == 2 and "integer from 1 to 100000000 or `none`" in out, out
        assert json.loads(cli("limit", "global", "--json")[1]) == {"max_concurrency": 50}
    finally:  # the module's other tests share this server: leave no cap behind
        with Client(node.http, tokens.admin) as c:
            c.global_limit_set(None)
            c.tenant_limit_set("caps-t", None)
    code, out = cli("limit", "global", "none", "--json")
    assert (code, json.loads(out)) == (0, {"max_concurrency": None})


# ------------------------------------------------- the list routes, over the module's server


@pytest.fixture
def api(cluster: tuple[Node, Tokens, str]) -> Iterator[httpx.Client]:
    """An admin ``httpx.Client`` on the module's server: the list routes' checks need no
    server of their own."""
    node, tokens, _ = cluster
    headers = {"Authorization": f"Bearer {tokens.admin}"}
    with httpx.Client(base_url=node.http, timeout=30, headers=headers) as http:
        yield http


def test_a_cap_change_is_an_event_in_the_log(api: httpx.Client) -> None:
    """``PUT /v1/limits/...`` wrote no event, while ``PATCH /v1/queues/{name}`` writes
    ``queue.updated``: each change is now a ``tenant.updated`` or ``global.updated``
    event that ``GET /v1/events`` shows, with the new cap and the old one."""

    def cap_events() -> list[tuple[str, str | None, Any]]:
        events, cursor = [], None
        while True:
            page = api.get(
                "/v1/events", params={"limit": 1000, **({"cursor": cursor} if cursor else {})}
            ).json()
            events += [
                (e["kind"], e["tenant"], e["data"])
                for e in page["items"]
                if e["kind"] in ("tenant.updated", "global.updated")
            ]
            cursor = page["next_cursor"]
            if cursor is None:
                return events

    seen = len(cap_events())
    try:
        assert api.put("/v1/limits/tenants/evt-t", json={"max_concurrency": 4}).status_code == 200
        assert api.put("/v1/limits/global", json={"max_concurrency": 700}).status_code == 200
        assert api.put("/v1/limits/tenants/evt-t", json={"max_concurrency": 0}).status_code == 400
    finally:  # the module's other tests share this server: leave no cap behind
        api.put("/v1/limits/global", json={"max_concurrency": None})
        api.put("/v1/limits/tenants/evt-t", json={"max_concurrency": None})
    assert cap_events()[seen:] == [
        ("tenant.updated", "evt-t", {"max_concurrency": 4, "max_concurrency_before": None}),
        ("global.updated", None, {"max_concurrency": 700, "max_concurrency_before": None}),
        ("global.updated", None, {"max_concurrency": None, "max_concurrency_before": 700}),
        ("tenant.updated", "evt-t", {"max_concurrency": None, "max_concurrency_before": 4}),
    ]


def test_the_event_log_is_read_by_both_clients_and_orbit_event_ls(
    api: httpx.Client, cli: Run, cluster: tuple[Node, Tokens, str]
) -> None:
    """``GET /v1/events`` had no reader but raw HTTP: the operators' changes (a cap's
    ``tenant.updated``, a queue's ``queue.updated``), which belong to no task, were in
    no client and no command. ``Client.event_log``/``iter_event_log``, their
    AsyncClient twins and ``orbit event ls`` read it, page by page from a cursor."""
    import asyncio

    from orbit import AsyncClient, Client
    from orbit.client import BadRequest

    node, tokens, _ = cluster
    try:
        api.put("/v1/limits/tenants/log-t", json={"max_concurrency": 3})
    finally:
        api.put("/v1/limits/tenants/log-t", json={"max_concurrency": None})
    mine = ("tenant.updated", "log-t", {"max_concurrency": 3, "max_concurrency_before": None})

    def ours(events: list[dict[str, Any]]) -> list[tuple[str, str | None, Any]]:
        return [(e["kind"], e["tenant"], e["data"]) for e in events if e["tenant"] == "log-t"]

    with Client(node.http, tokens.admin) as c:
        walked = list(c.iter_event_log(limit=7))
        assert ours(walked)[0] == mine and len(ours(walked)) == 2
        first = c.event_log(limit=2)
        assert [e["id"] for e in first["items"]] == [e["id"] for e in walked[:2]]
        rest = c.event_log(limit=5, cursor=first["next_cursor"])["items"]
        assert [e["id"] for e in rest] == [e["id"] for e in walked[2:7]]
        with pytest.raises(BadRequest):
            c.event_log(cursor="")

    async def walked_async() -> list[dict[str, Any]]:
        async with AsyncClient(node.http, tokens.admin) as c:
            page = await c.event_log(limit=1)
            return page["items"] + [e async for e in c.iter_event_log(cursor=page["next_cursor"])]

    assert [e["id"] for e in asyncio.run(walked_async())][: len(walked)] == [
        e["id"] for e in walked
    ]
    shown, cursor = [], None
    while True:
        page = json.loads(
            ok(
                cli(
                    "event",
                    "ls",
                    "--limit",
                    "1000",
                    "--json",
                    *(["--cursor", cursor] if cursor else []),
                )
            )
        )
        shown += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert ours(shown) == ours(walked)
    # the event before ours in the log's order (not id order: event feeds)
    at = next(i for i, e in enumerate(walked) if e["tenant"] == "log-t")
    just_before = encode_cursor(walked[at - 1]["id"])
    table = ok(cli("event", "ls", "--limit", "2", "--cursor", just_before))
    assert "tenant.updated" in table and "log-t" in table, table
    assert "next page: --cursor" in table, table
    assert cli("event", "ls", "--limit", "0").returncode == 2


def test_orbit_event_ls_follows_a_task_to_its_end_and_lists_its_events(
    cli: Run, api: httpx.Client
) -> None:
    """``orbit event ls --follow --task ID`` prints each of the task's events as it comes
    (the SSE stream) and exits 0 once the task has ended; ``--task`` without ``--follow``
    lists its events a page at a time."""
    ok(cli("queue", "create", "followed", "--max-concurrency", "1", "--rate", "0"))
    task = api.post("/v1/tasks", json={"queue": "followed", "handler": "h"}).json()["task"]
    api.post(f"/v1/tasks/{task['id']}/cancel").raise_for_status()
    lines = ok(cli("event", "ls", "--follow", "--task", task["id"], "--json")).splitlines()
    followed = [json.loads(line) for line in lines]
    assert [f["event"]["kind"] for f in followed] == ["submitted", "cancelled"]
    listed = json.loads(ok(cli("event", "ls", "--task", task["id"], "--json")))["items"]
    assert [f["event"] for f in followed] == listed
    after = api.get(f"/v1/tasks/{task['id']}/events", params={"cursor": followed[0]["cursor"]})
    assert after.json()["items"] == listed[1:]  # each line's cursor is that event's
    table = ok(cli("event", "ls", "-f", "--task", task["id"]))
    assert "submitted" in table and "cancelled" in table, table
    refused = cli("event", "ls", "--follow", "--task", task["id"], "--cursor", "zz")
    assert refused.returncode == 3 and "INVALID_CURSOR" in refused.stderr


def test_a_negative_cap_is_refused_naming_the_range_and_changes_nothing(
    cli: Run, api: httpx.Client
) -> None:
    """``orbit limit global -1`` was click's "No such option: -1": a negative number is
    now read as the cap it was meant as and refused as one, naming the valid values (1
    to the scope's largest cap, or ``none``), exit 2 with nothing changed."""
    before = (api.get("/v1/limits/global").json(), api.get("/v1/limits/tenants").json())
    for args, most in ((["global"], "100000000"), (["tenant", "neg-t"], "1000000")):
        for bad in ("-1", "-5", "-0", "-1.5", str(int(most) + 1)):
            refused = cli("limit", *args, bad)
            assert refused.returncode == 2, (args, bad, refused.stdout, refused.stderr)
            assert "No such option" not in refused.stderr, (args, bad, refused.stderr)
            assert f"an integer from 1 to {most} or `none`" in refused.stderr, refused.stderr
            assert repr(bad) in refused.stderr and refused.stdout == "", (args, bad)
    refused = cli("limit", "global", "--jsn")  # a mistyped option is still named as one
    assert refused.returncode == 2 and "no such option: --jsn" in refused.stderr, refused
    assert (api.get("/v1/limits/global").json(), api.get("/v1/limits/tenants").json()) == before


def test_a_rate_below_the_bound_is_refused_by_create_update_and_the_cli(
    api: httpx.Client, cli: Run
) -> None:
    """``PATCH /v1/queues/{name}`` took a rate of 5e-324 (a subnormal: one token per
    ~1e316 years, an interval ``SECOND / rate`` that overflows), and so did create. One
    bound, MIN_RATE (0.000001/s), is now refused alike by create, update and ``orbit
    queue create|update``: 400 NUMBER_OUT_OF_RANGE naming ``rate`` and the range, or
    exit 2 naming ``--rate``, nothing changed; the bound itself is taken."""
    made = {"name": "slowest", "max_concurrency": 1, "rate": 5}
    assert api.post("/v1/queues", json=made).status_code == 201
    for rate in (5e-324, 1e-7, 9.99e-7):
        for reply in (
            api.post("/v1/queues", json={**made, "name": "too-slow", "rate": rate}),
            api.patch("/v1/queues/slowest", json={"rate": rate}),
        ):
            assert reply.status_code == 400, (rate, reply.text)
            error = reply.json()["error"]
            assert (error["code"], error["field"]) == ("NUMBER_OUT_OF_RANGE", "rate"), error
            assert "0 (unlimited) or from 0.000001 to 1000000" in error["message"], error
        for command in (
            ["create", "too-slow", "--max-concurrency", "1"],
            ["update", "slowest"],
        ):
            refused = cli("queue", *command, "--rate", repr(rate))
            assert refused.returncode == 2, (command, rate, refused.stdout, refused.stderr)
            assert "--rate must be 0 (unlimited) or from 0.000001 to 1000000" in refused.stderr
    for rate in ("-1", "1000001"):  # out of range either side: exit 2 too, not the server's 3
        refused = cli("queue", "update", "slowest", "--rate", rate)
        assert refused.returncode == 2 and "--rate must be" in refused.stderr, refused
    queues = {q["name"]: q for q in api.get("/v1/queues", params={"limit": 1000}).json()["items"]}
    assert "too-slow" not in queues and queues["slowest"]["rate"] == 5
    changed = api.patch("/v1/queues/slowest", json={"rate": 0.000001})
    assert changed.status_code == 200 and changed.json()["rate"] == 1e-6, changed.text
    shown = json.loads(ok(cli("queue", "update", "slowest", "--rate", "0.000002", "--json")))
    assert shown["rate"] == 2e-6


def test_a_limit_is_plain_digits_on_every_list_route(api: httpx.Client) -> None:
    """``limit=" 1"`` and ``limit=1.0`` were read as 1 (pydantic's lax int) while
    ``limit=x`` was refused: each list route now refuses anything but ASCII digits, as
    INVALID_ARGUMENT naming ``limit``, and still takes a plain number."""
    api.post("/v1/queues", json={"name": "strict", "max_concurrency": 1, "rate": 0})
    task_id = api.post("/v1/tasks", json={"queue": "strict", "handler": "h"}).json()["task"]["id"]
    paths = (
        "/v1/tasks",
        "/v1/events",
        "/v1/workers",
        "/v1/queues",
        "/v1/tokens",
        f"/v1/tasks/{task_id}/events",
        f"/v1/tasks/{task_id}/artifacts",
        f"/v1/tasks/{task_id}/attempts",
    )
    for path in paths:
        for bad in (" 1", "1 ", "1.0", "+1", "1_0", "\u0661", "1e1", ""):
            reply = api.get(path, params={"limit": bad})
            assert reply.status_code == 400, (path, bad, reply.text)
            error = reply.json()["error"]
            assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", "limit"), (path, bad)
            assert error["message"].startswith("limit: "), error
        assert api.get(path, params={"limit": "1"}).status_code == 200, path


def test_an_empty_cursor_is_refused_by_the_routes_and_the_clients(
    api: httpx.Client, cli: Run, cluster: tuple[Node, Tokens, str]
) -> None:
    """The task list refuses ``cursor=`` (INVALID_CURSOR), but ``Client.events(cursor="")``
    dropped the empty cursor and read the events from the start, a page that looked like
    an answer. The routes and both clients now refuse it alike, the streams too:
    ``stream_events(cursor="")`` sent it as an empty ``Last-Event-ID``, which is no
    cursor, and replayed the log from its start (``orbit event ls --follow --cursor ""``
    as well)."""
    import asyncio

    from orbit import AsyncClient, Client
    from orbit.client import BadRequest

    node, tokens, _ = cluster
    api.post("/v1/queues", json={"name": "cursors", "max_concurrency": 1, "rate": 0})
    task_id = api.post("/v1/tasks", json={"queue": "cursors", "handler": "h"}).json()["task"]["id"]
    paths = (
        "/v1/tasks",
        "/v1/events",
        f"/v1/tasks/{task_id}/events",
        "/v1/workers",
        "/v1/queues",
        "/v1/tokens",
        f"/v1/tasks/{task_id}/attempts",
        "/v1/limits/tenants",
    )
    for path in paths:
        reply = api.get(path, params={"cursor": ""})
        assert reply.status_code == 400, (path, reply.text)
        assert reply.json()["error"]["code"] == "INVALID_CURSOR", path
    # each list call of the clients, with its arguments before the cursor
    calls: list[tuple[str, tuple[str, ...]]] = [
        ("events", (task_id,)),
        ("list_tasks", ()),
        ("list_artifacts", (task_id,)),
        ("list_workers", ()),
        ("list_queues", ()),
        ("list_tokens", ()),
        ("list_attempts", (task_id,)),
        ("list_tenant_limits", ()),
    ]
    with Client(node.http, tokens.admin) as c:
        for name, args in calls:
            with pytest.raises(BadRequest) as refused:
                getattr(c, name)(*args, cursor="")
            assert refused.value.code == "INVALID_CURSOR", name

    async def refused_async() -> list[str]:
        codes = []
        async with AsyncClient(node.http, tokens.admin) as c:
            for name, args in calls:
                with pytest.raises(BadRequest) as refused:
                    await getattr(c, name)(*args, cursor="")
                codes.append(refused.value.code)
        return codes

    assert asyncio.run(refused_async()) == ["INVALID_CURSOR"] * len(calls)

    streams = ((), (task_id,))  # the whole log's, and the task's
    with Client(node.http, tokens.admin) as c:
        for args in streams:
            for follow in (c.stream_events, c.subscribe):
                with pytest.raises(BadRequest) as refused:
                    next(follow(*args, cursor="", outage=0))
                assert refused.value.code == "INVALID_CURSOR", (follow, args)

    async def streams_refused_async() -> list[str]:
        codes = []
        async with AsyncClient(node.http, tokens.admin) as c:
            for args in streams:
                for follow in (c.stream_events, c.subscribe):
                    with pytest.raises(BadRequest) as refused:
                        await anext(follow(*args, cursor="", outage=0))
                    codes.append(refused.value.code)
        return codes

    assert asyncio.run(streams_refused_async()) == ["INVALID_CURSOR"] * 4
    for args in ((), ("--task", task_id)):
        followed = cli("event", "ls", "--follow", "--cursor", "", *args)
        assert followed.returncode == 3, followed
        assert "INVALID_CURSOR" in followed.stderr


def test_the_worker_list_is_paged_and_the_clients_and_cli_walk_it(
    api: httpx.Client, cli: Run, cluster: tuple[Node, Tokens, str]
) -> None:
    """Sessions are never deleted, and ``GET /v1/workers`` answered every one ever opened
    in one bare list. It is now a page (``{items, next_cursor}``, keyset by id as the task
    list is), with ``state`` still a filter; ``Client.workers()`` and ``orbit worker ls``
    walk every page, and ``list_workers``/``iter_workers`` read one or all."""
    from orbit import Client

    node, tokens, _ = cluster
    opened = _attach(cluster, *(f"paged-{i}" for i in range(3)))
    pages = _raw_pages(api, "/v1/workers", 1)
    walked = [w["session_id"] for p in pages for w in p["items"]]
    assert walked == sorted(walked) and len(walked) == len(set(walked))
    assert walked[-3:] == opened
    live = api.get("/v1/workers", params={"state": "live", "limit": 1000}).json()
    assert set(opened) <= {w["session_id"] for w in live["items"]}
    assert {w["state"] for w in live["items"]} == {"live"}
    for bad in ("hello", "0", opened[0].upper()):
        refused = api.get("/v1/workers", params={"cursor": encode_cursor(bad)})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "INVALID_CURSOR"
    lister = ("workers", "list_workers", "iter_workers")
    _clients_walk(node, tokens.admin, lister, "session_id", walked, resume_limit=2)
    with Client(node.http, tokens.admin) as c:
        assert [w["session_id"] for w in c.iter_workers(state="live", limit=1)] == [
            w["session_id"] for w in live["items"]
        ]
    listed = json.loads(ok(cli("worker", "ls", "--state", "all", "--json")))
    assert [w["session_id"] for w in listed] == walked
    live_listed = json.loads(ok(cli("worker", "ls", "--state", "live", "--json")))
    assert [w["session_id"] for w in live_listed] == [w["session_id"] for w in live["items"]]


def test_the_task_list_filters_by_parent_in_the_api_the_clients_and_the_cli(
    api: httpx.Client, cli: Run, cluster: tuple[Node, Tokens, str]
) -> None:
    """``GET /v1/tasks`` had no ``parent_id`` filter (an unknown query parameter is
    ignored, so ``?parent_id=`` listed every task): it lists that task's children, and
    ``list_tasks``/``iter_tasks`` and ``orbit task ls --parent`` pass it. A value that is
    no task id is refused rather than read as "no children"."""
    import asyncio

    from orbit import AsyncClient, Client
    from orbit.client import BadRequest

    node, tokens, _ = cluster
    api.post("/v1/queues", json={"name": "family", "max_concurrency": 1, "rate": 0})
    parent = api.post("/v1/tasks", json={"queue": "family", "handler": "h"}).json()["task"]
    kids = [{"queue": "family", "handler": "h", "parent_id": parent["id"]}] * 3
    made = api.post("/v1/tasks/batch?reply=ids", json={"tasks": kids}).json()
    children = [m["id"] for m in made]
    page = api.get("/v1/tasks", params={"parent_id": parent["id"]}).json()
    assert [t["id"] for t in page["items"]] == children
    for bad in ("", "nope", parent["id"].upper()):
        refused = api.get("/v1/tasks", params={"parent_id": bad})
        assert refused.status_code == 400, (bad, refused.text)
        assert refused.json()["error"]["field"] == "parent_id", bad
        assert refused.json()["error"]["code"] == "INVALID_ARGUMENT", bad
    with Client(node.http, tokens.admin) as c:
        one = c.list_tasks(parent_id=parent["id"], limit=1)
        assert [t["id"] for t in one["items"]] == children[:1]
        assert [t["id"] for t in c.iter_tasks(parent_id=parent["id"], limit=2)] == children
        with pytest.raises(BadRequest):
            c.list_tasks(parent_id="nope")

    async def listed_async() -> list[str]:
        async with AsyncClient(node.http, tokens.admin) as c:
            first = await c.list_tasks(parent_id=parent["id"], limit=1)
            rest = [t["id"] async for t in c.iter_tasks(parent_id=parent["id"], limit=2)]
            return [t["id"] for t in first["items"]] + rest

    assert asyncio.run(listed_async()) == children[:1] + children
    shown = json.loads(ok(cli("task", "ls", "--parent", parent["id"], "--json")))
    assert [t["id"] for t in shown["items"]] == children
    refused = cli("task", "ls", "--parent", "nope")
    assert refused.returncode == 3 and "INVALID_ARGUMENT" in refused.stderr, refused


#: the task list's string filters, as the API, the clients and ``orbit task ls`` name them
STRING_FILTERS = (
    ("queue", "queue", "--queue"),
    ("tenant", "tenant", "--tenant"),
    ("handler", "handler", "--handler"),
    ("state", "state", "--state"),
    ("parent_id", "parent_id", "--parent"),
    ("created_after", "created_after", "--created-after"),
    ("created_before", "created_before", "--created-before"),
)


def test_an_empty_filter_is_refused_by_the_task_list_the_clients_and_the_cli(
    api: httpx.Client, cli: Run, cluster: tuple[Node, Tokens, str]
) -> None:
    """``GET /v1/tasks?queue=`` (and ``tenant=``, ``handler=``) listed no task, a page
    that read as "none there", while ``created_after=`` was refused. An empty string
    filter is now refused alike: 400 naming it, BadRequest from both clients (which send
    it as it is), and exit 2 naming the option from ``orbit task ls``."""
    import asyncio

    from orbit import AsyncClient, Client
    from orbit.client import BadRequest

    node, tokens, _ = cluster
    api.post("/v1/queues", json={"name": "empties", "max_concurrency": 1, "rate": 0})
    assert api.post("/v1/tasks", json={"queue": "empties", "handler": "h"}).status_code == 201
    for param, _, _ in STRING_FILTERS:
        refused = api.get("/v1/tasks", params={param: ""})
        assert refused.status_code == 400, (param, refused.text)
        assert refused.json()["error"]["field"] == param, (param, refused.text)
        assert refused.json()["error"]["code"] in ("INVALID_ARGUMENT", "INVALID_VALUE"), param
    with Client(node.http, tokens.admin) as c:
        for _, keyword, _ in STRING_FILTERS:
            with pytest.raises(BadRequest) as err:
                c.list_tasks(**{keyword: ""})
            assert err.value.field == keyword, keyword
            with pytest.raises(BadRequest):
                next(c.iter_tasks(**{keyword: ""}))

    async def refused_async() -> list[str]:
        fields = []
        async with AsyncClient(node.http, tokens.admin) as c:
            for _, keyword, _ in STRING_FILTERS:
                with pytest.raises(BadRequest) as err:
                    await c.list_tasks(**{keyword: ""})
                fields.append(err.value.field)
        return fields

    assert asyncio.run(refused_async()) == [k for _, k, _ in STRING_FILTERS]
    for _, _, option in STRING_FILTERS:
        refused = cli("task", "ls", option, "")
        assert refused.returncode == 2, (option, refused.stdout, refused.stderr)
        assert refused.stdout == "" and len(refused.stderr.strip().splitlines()) == 1, option
        assert option in refused.stderr, (option, refused.stderr)
    listed = json.loads(ok(cli("task", "ls", "--queue", "empties", "--json")))["items"]
    assert len(listed) == 1  # a filter that is given still lists


def test_the_task_list_time_window_in_the_clients_and_the_cli(
    api: httpx.Client, cli: Run, cluster: tuple[Node, Tokens, str]
) -> None:
    """``created_after``/``created_before`` were API filters that neither
    ``Client.list_tasks``/``AsyncClient.list_tasks`` nor ``orbit task ls`` could pass.
    The clients take an aware datetime or an RFC 3339 string (a naive datetime is a
    ValueError, nothing sent); the CLI takes ISO 8601 with a timezone, and anything else
    is exit 2 with one line."""
    import asyncio
    from datetime import datetime, timedelta, timezone

    from orbit import AsyncClient, Client

    node, tokens, _ = cluster
    api.post("/v1/queues", json={"name": "window", "max_concurrency": 1, "rate": 0})
    batch = [{"queue": "window", "handler": "h"}] * 2
    first = api.post("/v1/tasks/batch", json={"tasks": batch[:1]}).json()[0]["task"]
    second = api.post("/v1/tasks/batch", json={"tasks": batch[1:]}).json()[0]["task"]
    at = second["created_at"]
    aware = datetime.fromisoformat(at)
    assert aware > datetime.fromisoformat(first["created_at"])

    def ids(page: dict[str, Any]) -> list[str]:
        return [t["id"] for t in page["items"]]

    with Client(node.http, tokens.admin) as c:
        assert ids(c.list_tasks(queue="window", created_after=at)) == [second["id"]]
        assert ids(c.list_tasks(queue="window", created_after=aware)) == [second["id"]]
        assert ids(c.list_tasks(queue="window", created_before=aware)) == [first["id"]]
        walked = c.iter_tasks(queue="window", created_before=aware + timedelta(seconds=1))
        assert [t["id"] for t in walked] == [first["id"], second["id"]]
        with pytest.raises(ValueError, match="timezone"):
            c.list_tasks(created_after=aware.replace(tzinfo=None))

    async def listed_async() -> tuple[list[str], list[str]]:
        async with AsyncClient(node.http, tokens.admin) as c:
            after = await c.list_tasks(queue="window", created_after=aware)
            before = await c.list_tasks(queue="window", created_before=at)
            with pytest.raises(ValueError, match="timezone"):
                await c.list_tasks(created_before=aware.replace(tzinfo=None))
            return ids(after), ids(before)

    assert asyncio.run(listed_async()) == ([second["id"]], [first["id"]])
    shown = json.loads(ok(cli("task", "ls", "--queue", "window", "--created-after", at, "--json")))
    assert ids(shown) == [second["id"]]
    offset = aware.astimezone(timezone(timedelta(hours=2))).isoformat()
    shown = json.loads(
        ok(cli("task", "ls", "--queue", "window", "--created-before", offset, "--json"))
    )
    assert ids(shown) == [first["id"]]
    for option in ("--created-after", "--created-before"):
        for bad in ("yesterday", "2026-01-01", "2026-01-01T00:00:00", "", "2026-13-01T00:00Z\nx"):
            refused = cli("task", "ls", option, bad)
            assert refused.returncode == 2, (option, bad, refused.stdout, refused.stderr)
            assert refused.stdout == "" and "Traceback" not in refused.stderr, (option, bad)
            assert len(refused.stderr.strip().splitlines()) == 1, (option, bad, refused.stderr)
            assert option in refused.stderr, (option, bad, refused.stderr)


# ------------------------------------- the queue, token and attempt lists, a page at a time


def _raw_pages(api: httpx.Client, path: str, limit: int) -> list[dict[str, Any]]:
    """Every page of a list route, read ``limit`` items at a time by its ``next_cursor``;
    each page's shape is checked on the way."""
    pages, cursor = [], None
    while True:
        reply = api.get(path, params={"limit": limit, **({"cursor": cursor} if cursor else {})})
        assert reply.status_code == 200, reply.text
        page = reply.json()
        assert set(page) == {"items", "next_cursor"} and len(page["items"]) <= limit, page
        assert (page["next_cursor"] is not None) == (len(page["items"]) == limit), page
        pages.append(page)
        cursor = page["next_cursor"]
        if cursor is None:
            return pages


def _clients_walk(
    node: Node,
    token: str,
    lister: tuple[str, str, str],
    key: str,
    walked: list[Any],
    *args: str,
    iter_limit: int = 2,
    resume_limit: int = 1,
) -> None:
    """``Client`` and ``AsyncClient`` read a paged list as its raw pages gave it
    (``walked``, each item's ``key``): by ``lister``'s three methods, the whole list, one
    page, and every page from the start or from the first page's cursor. ``args`` come
    before the options (an attempt list's task id)."""
    import asyncio

    from orbit import AsyncClient, Client

    whole, one_page, pages = lister

    def keys(items: Any) -> list[Any]:
        return [item[key] for item in items]

    with Client(node.http, token) as c:
        assert keys(getattr(c, whole)(*args)) == walked
        one = getattr(c, one_page)(*args, limit=1)
        assert keys(one["items"]) == walked[:1] and one["next_cursor"]
        assert keys(getattr(c, pages)(*args, limit=iter_limit)) == walked
        resumed = getattr(c, pages)(*args, limit=resume_limit, cursor=one["next_cursor"])
        assert keys(resumed) == walked[1:]

    async def walk_async() -> tuple[list[Any], ...]:
        async with AsyncClient(node.http, token) as c:
            every = keys(await getattr(c, whole)(*args))
            first = await getattr(c, one_page)(*args, limit=1)
            paged = [item[key] async for item in getattr(c, pages)(*args, limit=2)]
            cursor = first["next_cursor"]
            rest = [item[key] async for item in getattr(c, pages)(*args, limit=2, cursor=cursor)]
            return every, keys(first["items"]), paged, rest

    assert asyncio.run(walk_async()) == (walked, walked[:1], walked, walked[1:])


def test_the_queue_list_is_paged_and_the_clients_and_cli_walk_it(
    api: httpx.Client, cli: Run, cluster: tuple[Node, Tokens, str]
) -> None:
    """``GET /v1/queues`` answered every queue in one bare list. It is now a page
    (``{items, next_cursor}``, keyset by name); ``Client.queues()`` and ``orbit queue ls``
    walk every page, ``list_queues`` reads one and ``iter_queues`` all, from the start or
    from a cursor."""
    node, tokens, _ = cluster
    made = [f"paged-q{i}" for i in range(3)]
    for name in made:
        assert api.post("/v1/queues", json={"name": name, "max_concurrency": 1, "rate": 0})
    pages = _raw_pages(api, "/v1/queues", 2)
    walked = [q["name"] for p in pages for q in p["items"]]
    assert walked == sorted(walked) and len(walked) == len(set(walked)) and len(pages) >= 2
    assert set(made) <= set(walked)
    queues = ("queues", "list_queues", "iter_queues")
    _clients_walk(node, tokens.submit, queues, "name", walked)  # a submit token may list them
    listed = json.loads(ok(cli("queue", "ls", "--json")))
    assert [q["name"] for q in listed] == walked


def test_the_token_list_is_paged_and_the_clients_and_cli_walk_it(
    api: httpx.Client, cli: Run, cluster: tuple[Node, Tokens, str]
) -> None:
    """``GET /v1/tokens`` answered every token ever made in one bare list. It is now a
    page, oldest first (keyset by id, a uuid7 of the creation), never a secret; the
    clients read one page or walk them all, from the start or from a cursor."""
    node, tokens, db = cluster
    made = [
        api.post("/v1/tokens", json={"name": f"paged-t{i}", "scopes": ["submit"]}).json()
        for i in range(3)
    ]
    api.post(f"/v1/tokens/{made[1]['id']}/revoke")  # a revoked token is listed too
    pages = _raw_pages(api, "/v1/tokens", 2)
    listed = [t for p in pages for t in p["items"]]
    walked = [t["id"] for t in listed]
    assert walked == sorted(walked) and len(walked) == len(set(walked)) and len(pages) >= 2
    assert walked[-3:] == [m["id"] for m in made]  # the newest last
    created = [t["created_at"] for t in listed]
    assert created == sorted(created)
    for page in pages:
        assert not any(m["token"].split("_", 2)[2] in json.dumps(page) for m in made)
    fields = {"id", "name", "scopes", "created_at", "revoked_at"}
    assert all(set(t) == fields for t in listed)
    assert [t["revoked_at"] is not None for t in listed[-3:]] == [False, True, False]
    lister = ("token_list", "list_tokens", "iter_tokens")
    _clients_walk(node, tokens.admin, lister, "id", walked, iter_limit=3)
    # orbit token ls reads the database itself: the same tokens in the same order
    assert [t["id"] for t in json.loads(ok(cli("token", "ls", "--db", db, "--json")))] == walked


def test_a_tasks_attempts_are_paged_and_the_clients_and_cli_walk_them(
    api: httpx.Client, cli: Run, cluster: tuple[Node, Tokens, str]
) -> None:
    """A released claim does not count against ``max_attempts``, so a task can gather
    any number of attempts, and ``GET /v1/tasks/{id}/attempts`` answered them in one bare
    list. It is now a page (keyset by attempt number); ``Client.attempts()`` and ``orbit
    task show`` walk every page, ``list_attempts``/``iter_attempts`` read one or all."""
    import asyncio

    from orbit.worker import WorkerConnection

    node, tokens, _ = cluster
    api.post("/v1/queues", json={"name": "paged-a", "max_concurrency": 1, "rate": 0})
    task_id = api.post("/v1/tasks", json={"queue": "paged-a", "handler": "paged.a"}).json()["task"][
        "id"
    ]

    async def claim_and_release(times: int) -> None:
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        try:
            await conn.hello("paged-a", {"paged.a": 1}, 1, push=False)
            for _ in range(times):
                [granted] = await conn.claim(1)
                assert granted["task_id"] == task_id, granted
                await conn.release(granted["attempt_id"], granted["fence"])
        finally:
            await conn.close()

    asyncio.run(claim_and_release(5))
    pages = _raw_pages(api, f"/v1/tasks/{task_id}/attempts", 2)
    assert [len(p["items"]) for p in pages] == [2, 2, 1]
    walked = [a["number"] for p in pages for a in p["items"]]
    assert walked == [1, 2, 3, 4, 5]
    assert {(a["task_id"], a["state"]) for p in pages for a in p["items"]} == {
        (task_id, "released")
    }
    exact = _raw_pages(api, f"/v1/tasks/{task_id}/attempts", 5)  # a full last page
    assert [len(p["items"]) for p in exact] == [5, 0]
    lister = ("attempts", "list_attempts", "iter_attempts")
    _clients_walk(node, tokens.submit, lister, "number", walked, task_id, resume_limit=3)
    shown = json.loads(ok(cli("task", "show", task_id, "--json")))
    assert [a["number"] for a in shown["attempts"]] == walked


def test_a_bad_page_request_is_refused_on_the_queue_token_and_attempt_lists(
    api: httpx.Client,
) -> None:
    """Each of the three lists refuses what it would otherwise read as a place in the
    list: a cursor that is not one the server issues for that list (a queue name, a
    token id, an attempt number), a limit out of 1-1,000, and a parameter given twice.
    An attempt list's cursor is checked before its task is looked up."""
    api.post("/v1/queues", json={"name": "paged-bad", "max_concurrency": 1, "rate": 0})
    task_id = api.post("/v1/tasks", json={"queue": "paged-bad", "handler": "h"}).json()["task"][
        "id"
    ]
    unknown_task = "01a229a4-0000-7000-8000-000000000000"
    bad_cursors = {
        "/v1/queues": ["~", "-a", "a b", "a\n", "é", "a" * 129, "café"],
        "/v1/tokens": ["hello", "0" * 31, "A" * 32, "0" * 33, task_id, "orbit_" + "0" * 32],
        f"/v1/tasks/{task_id}/attempts": [
            "0",
            "01",
            "-1",
            "+1",
            "1.0",
            " 1",
            "\u0661",
            "1e3",
            str(2**31),
            "9" * 40,
            "x",
        ],
        f"/v1/tasks/{unknown_task}/attempts": ["0", "x"],
    }
    for path, cursors in bad_cursors.items():
        for bad in [encode_cursor(c) for c in cursors] + ["%%%", "!!", "YQ=x"]:
            reply = api.get(path, params={"cursor": bad})
            assert reply.status_code == 400, (path, bad, reply.text)
            error = reply.json()["error"]
            assert (error["code"], error["field"]) == ("INVALID_CURSOR", "cursor"), (path, bad)
        for limit in ("0", "1001", "-1"):
            reply = api.get(path, params={"limit": limit})
            assert reply.status_code == 400, (path, limit, reply.text)
            error = reply.json()["error"]
            assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", "limit"), (path, limit)
        for twice in ("limit=1&limit=2", "cursor=YQ&cursor=Yg"):
            reply = api.get(f"{path}?{twice}")
            assert reply.status_code == 400, (path, twice, reply.text)
            error = reply.json()["error"]
            assert error["code"] == "INVALID_ARGUMENT", (path, twice)
            assert error["message"].endswith("give it once"), (path, twice)
    # the longest name a queue can have is a cursor, as the page that ends with it says
    longest = "q" * 128
    assert api.post("/v1/queues", json={"name": longest, "max_concurrency": 1, "rate": 0})
    names = [q["name"] for q in api.get("/v1/queues", params={"limit": 1000}).json()["items"]]
    after = names.index(longest)
    page = api.get("/v1/queues", params={"limit": after + 1}).json()
    assert page["items"][-1]["name"] == longest and page["next_cursor"] == encode_cursor(longest)
    rest = api.get("/v1/queues", params={"cursor": page["next_cursor"], "limit": 1000})
    assert [q["name"] for q in rest.json()["items"]] == names[after + 1 :]
    missing = api.get(f"/v1/tasks/{unknown_task}/attempts")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "TASK_NOT_FOUND"


def test_backpressure_caps_and_a_full_queue(orbit: Run) -> None:
    """--max-queued on queues and tenants; a submit to a full queue is one line, exit 6."""
    made = orbit(
        "queue", "create", "full", "--max-concurrency", "1", "--rate", "0", "--max-queued", "1"
    )
    assert "max queued" in ok(made)
    ok(orbit("task", "submit", "full", "h"))
    refused = orbit("task", "submit", "full", "h")
    assert refused.returncode == 6, refused.stderr
    assert refused.stderr.count("\n") == 1 and "QUEUE_FULL" in refused.stderr
    assert "(retry after 1 s)" in refused.stderr
    shown = json.loads(ok(orbit("queue", "update", "full", "--max-queued", "none", "--json")))
    assert shown["max_queued"] is None
    ok(orbit("task", "submit", "full", "h"))
    for bad in ("0", "-1", "x", "1000000001", ""):
        rejected = orbit("queue", "update", "full", "--max-queued", bad)
        assert rejected.returncode == 2 and "--max-queued must be" in rejected.stderr, bad
    try:
        tenant = json.loads(ok(orbit("limit", "tenant", "cli-acme", "--max-queued", "3", "--json")))
        assert tenant == {"tenant": "cli-acme", "max_concurrency": None, "max_queued": 3}
        tenant = json.loads(ok(orbit("limit", "tenant", "cli-acme", "4", "--json")))
        assert tenant == {"tenant": "cli-acme", "max_concurrency": 4, "max_queued": 3}
        assert "max queued" in ok(orbit("limit", "ls"))
        bad_tenant = orbit("limit", "tenant", "cli-acme", "--max-queued", "0")
        assert bad_tenant.returncode == 2 and "--max-queued must be" in bad_tenant.stderr
    finally:  # the module's other tests share this server: leave no cap behind
        ok(orbit("limit", "tenant", "cli-acme", "none", "--max-queued", "none"))


def test_schedule_commands(orbit: Run) -> None:
    ok(orbit("queue", "create", "cron-q", "--max-concurrency", "1", "--rate", "0"))
    made = json.loads(
        ok(
            orbit(
                "schedule",
                "create",
                "nightly",
                "--cron",
                "0 3 * * *",
                "--timezone",
                "Europe/Berlin",
                "--queue",
                "cron-q",
                "--handler",
                "report",
                "--payload",
                '{"kind": "daily"}',
                "--misfire",
                "catch_up",
                "--max-catch-up",
                "5",
                "--priority",
                "2",
                "--json",
            )
        )
    )
    assert (made["cron"], made["misfire"], made["max_catch_up"]) == ("0 3 * * *", "catch_up", 5)
    assert made["template"]["payload"] == {"kind": "daily"} and made["template"]["priority"] == 2
    listed = ok(orbit("schedule", "ls"))
    assert "nightly" in listed and "catch_up (at most 5)" in listed
    assert json.loads(ok(orbit("schedule", "show", "nightly", "--json"))) == made
    assert json.loads(ok(orbit("schedule", "pause", "nightly", "--json")))["paused"] is True
    assert "paused" in ok(orbit("schedule", "show", "nightly"))
    assert json.loads(ok(orbit("schedule", "resume", "nightly", "--json")))["paused"] is False
    bad = orbit("schedule", "create", "x", "--cron", "* * *", "--queue", "cron-q", "--handler", "h")
    assert bad.returncode == 3 and "INVALID_CRON" in bad.stderr
    policy = orbit(
        "schedule", "create", "x", "--cron", "* * * * *", "--queue", "cron-q", "--handler", "h",
        "--misfire", "never",
    )  # fmt: skip
    assert policy.returncode == 2 and "--misfire" in policy.stderr
    dup = orbit("schedule", "create", "nightly", "--cron", "0 4 * * *", "--queue", "cron-q",
                "--handler", "h")  # fmt: skip
    assert dup.returncode == 3 and "SCHEDULE_EXISTS" in dup.stderr
    updated = json.loads(
        ok(orbit("schedule", "update", "nightly", "--cron", "30 2 * * *", "--payload",
                 '{"kind": "full"}', "--retry-safe", "--json"))
    )  # fmt: skip
    assert (updated["cron"], updated["timezone"]) == ("30 2 * * *", "Europe/Berlin")
    # the template's other fields as they were: only --payload and --retry-safe changed
    assert updated["template"] == made["template"] | {
        "payload": {"kind": "full"},
        "retry_safe": True,
    }
    nothing = orbit("schedule", "update", "nightly")
    assert nothing.returncode == 2 and "give at least one" in nothing.stderr
    bad_zone = orbit("schedule", "update", "nightly", "--timezone", "../etc/passwd")
    assert bad_zone.returncode == 3 and "INVALID_TIMEZONE" in bad_zone.stderr
    bad_policy = orbit("schedule", "update", "nightly", "--misfire", "never")
    assert bad_policy.returncode == 2 and "--misfire" in bad_policy.stderr
    missing = orbit("schedule", "update", "nope", "--payload", "1")
    assert missing.returncode == 3 and "SCHEDULE_NOT_FOUND" in missing.stderr
    assert (
        json.loads(ok(orbit("schedule", "show", "nightly", "--json")))["template"]
        == updated["template"]
    )
    assert json.loads(ok(orbit("schedule", "delete", "nightly", "--json")))["name"] == "nightly"
    gone = orbit("schedule", "show", "nightly")
    assert gone.returncode == 3 and "SCHEDULE_NOT_FOUND" in gone.stderr
    assert "catch_up" in ok(orbit("schedule", "create", "--help"))


def test_only_the_clients_own_value_errors_become_one_line() -> None:
    """The commands turn the client's refusal of an argument into one line and exit 2;
    a ValueError from anywhere else (printing, the command's own code) is a fault and
    keeps its traceback."""
    from orbit.cli.api import _raised_by_client
    from orbit.client._client import _Calls

    with pytest.raises(ValueError) as refused:
        _Calls.task_action("", "cancel")
    assert _raised_by_client(refused.value)
    with pytest.raises(ValueError) as other:
        int("not a number")
    assert not _raised_by_client(other.value)


#: A worker module whose Worker names a URL of its own, and that marks its import.
URL_MODULE = """
from pathlib import Path

from orbit import Worker

Path(__file__).with_name("imported").touch()
worker = Worker("http://127.0.0.1:9", name="own-url")


@worker.handler("h")
async def h(ctx, payload):
    return None
"""


def _worker_says(where: Path, *args: str, **env: str) -> str:
    """The first line ``orbit worker own_url:worker ARGS`` logs (which server it uses),
    run in ``where`` with ``env`` (ORBIT_URL unset unless given); then it is stopped."""
    unset = ("ORBIT_URL", "ORBIT_CAFILE", "ORBIT_TOKEN_FILE")
    environment = {k: v for k, v in os.environ.items() if k not in unset}
    environment.update(ORBIT_TOKEN="orbit_00_unused", **env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "worker", "own_url:worker", *args],
        cwd=where,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
    finally:
        proc.terminate()  # before it has connected: it stops at once, exit 0
        proc.communicate(timeout=60)
    return line


def test_a_worker_url_given_equal_to_the_default_still_replaces_the_modules(
    tmp_path: Path,
) -> None:
    """``orbit worker --url URL`` took the option as given only when it differed from the
    default: ``--url http://127.0.0.1:8000`` (or ORBIT_URL set to it) left the module's
    own URL in place. Given is given, whatever its value; not given, the module's stands.
    The worker says which server it uses, and whence, before it connects."""
    (tmp_path / "own_url.py").write_text(URL_MODULE)
    default = "http://127.0.0.1:8000"
    given = "server http://127.0.0.1:8000 (--url or ORBIT_URL)"
    assert given in _worker_says(tmp_path, "--url", default)
    assert given in _worker_says(tmp_path, ORBIT_URL=default)
    other = _worker_says(tmp_path, "--url", "http://127.0.0.1:7")
    assert "server http://127.0.0.1:7 (--url or ORBIT_URL)" in other, other
    own = _worker_says(tmp_path)
    assert "server http://127.0.0.1:9 (the module's)" in own, own


def test_an_empty_orbit_url_or_cafile_is_refused_and_changes_nothing(
    orbit: Run, cluster: tuple[Node, Tokens, str], tmp_path: Path
) -> None:
    """An ORBIT_URL set but empty (``ORBIT_URL=$UNSET``) was taken for unset: a command
    went to the default URL, and ``orbit worker`` replaced its module's URL with it. It
    is refused, one line and exit 2, as an empty ORBIT_TOKEN is, before anything is
    sent or the worker's module is imported; so is an empty ORBIT_CAFILE. The option
    given on the command line wins over the variable."""
    (tmp_path / "own_url.py").write_text(URL_MODULE)
    ok(orbit("queue", "create", "empty-env", "--max-concurrency", "1", "--rate", "0"))

    def tasks() -> list[Any]:
        return json.loads(ok(orbit("task", "ls", "--queue", "empty-env", "--json")))["items"]

    cases = [
        (("task", "submit", "empty-env", "h"), {"ORBIT_URL": ""}, "ORBIT_URL is set but empty"),
        (("task", "submit", "empty-env", "h"), {"ORBIT_URL": " "}, "ORBIT_URL is set but empty"),
        (("queue", "ls"), {"ORBIT_CAFILE": ""}, "ORBIT_CAFILE is set but empty"),
        (("worker", "own_url:worker"), {"ORBIT_URL": ""}, "ORBIT_URL is set but empty"),
        (("worker", "own_url:worker"), {"ORBIT_CAFILE": ""}, "ORBIT_CAFILE is set but empty"),
        (("worker", "ls"), {"ORBIT_URL": ""}, "ORBIT_URL is set but empty"),
    ]
    for args, env, says in cases:
        run = orbit(*args, PYTHONPATH=str(tmp_path), **env)
        assert run.returncode == 2, (args, env, run.stderr)
        assert "Traceback" not in run.stderr, run.stderr
        [line] = [x for x in run.stderr.splitlines() if x.startswith("error:")]
        assert says in line, (args, env, line)
    assert tasks() == []
    assert not (tmp_path / "imported").exists()  # refused before the module's import
    given = orbit("queue", "ls", "--url", cluster[0].http, ORBIT_URL="")
    assert given.returncode == 0 and "empty-env" in given.stdout, given.stderr


def test_submit_wait_and_wait_print_the_task_as_json_when_they_time_out(orbit: Run) -> None:
    """``orbit task submit --wait --json`` that timed out printed nothing on stdout: a
    script reading it had not even the id of the task it had just submitted (the error
    line on stderr named it). ``task wait --json`` printed nothing either. Both print the
    task as last seen, as when it has ended, and still exit 5."""
    ok(orbit("queue", "create", "nobody", "--max-concurrency", "1", "--rate", "0"))
    submitted = orbit("task", "submit", "nobody", "h", "--wait", "--wait-timeout", "0.5", "--json")
    assert submitted.returncode == 5, submitted.stderr
    assert "still queued" in submitted.stderr, submitted.stderr
    task = json.loads(submitted.stdout)
    assert task["queue"] == "nobody" and task["state"] == "queued", task
    waited = orbit("task", "wait", task["id"], "--timeout", "0.5", "--json")
    assert waited.returncode == 5 and "still queued" in waited.stderr, waited.stderr
    again = json.loads(waited.stdout)
    assert again["id"] == task["id"] and again.keys() == task.keys(), again
    people = orbit("task", "wait", task["id"], "--timeout", "0.5")  # a table is for ended ones
    assert people.returncode == 5 and people.stdout == "", people.stdout


def test_task_submit_says_whether_its_key_named_an_existing_task(orbit: Run) -> None:
    """A resubmit under the same ``--key`` printed the same table and the same JSON as
    the submit that made the task: ``--json`` now carries ``created``, and the table is
    followed by a line on stderr saying nothing new was submitted."""
    ok(orbit("queue", "create", "keyed", "--max-concurrency", "1", "--rate", "0"))
    first = orbit("task", "submit", "keyed", "h", "--key", "k-1", "--json")
    ok(first)
    made = json.loads(first.stdout)
    assert made["created"] is True, made
    again = orbit("task", "submit", "keyed", "h", "--key", "k-1", "--json")
    ok(again)
    found = json.loads(again.stdout)
    assert found["created"] is False and found["id"] == made["id"], found
    table = orbit("task", "submit", "keyed", "h", "--key", "k-1")
    ok(table)
    assert made["id"] in table.stdout, table.stdout
    assert "names this existing task" in table.stderr, table.stderr
    fresh = orbit("task", "submit", "keyed", "h", "--key", "k-2")
    ok(fresh)
    assert fresh.stderr == "", fresh.stderr


def _env(cluster: tuple[Node, Tokens, str]) -> dict[str, str]:
    """The ``orbit`` fixture's environment, for a process the test drives itself."""
    node, tokens, _ = cluster
    environment = {
        k: v for k, v in os.environ.items() if k not in ("ORBIT_TOKEN", "ORBIT_TOKEN_FILE")
    }
    environment.update({"ORBIT_URL": node.http, "ORBIT_TOKEN": tokens.admin, "COLUMNS": "200"})
    return environment


def _sigint_default() -> None:
    """Give SIGINT its default disposition back (run in the child before exec)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_dispositions(pid: int) -> str:
    """The SigIgn/SigCgt lines of a live process's /proc status (bit 1 is SIGINT)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return ", ".join(
                line.strip() for line in status if line.startswith(("SigIgn", "SigCgt"))
            )
    except OSError as exc:
        return f"no status: {exc}"


def _interrupted_while_waiting(env: dict[str, str], *args: str) -> tuple[int, str]:
    """Run ``orbit ARGS`` with stderr on a terminal (a pty), send it SIGINT once its status
    line says it is waiting, and return its exit code and all it wrote to stderr."""
    import pty
    import re
    import select
    import signal
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", *args],
        env={**env, "TERM": "xterm"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        # A shell starts a background job with SIGINT ignored, and a Python started so
        # keeps ignoring it (no KeyboardInterrupt ever): a suite launched in the
        # background (as CI may be) would see the wait go on. A terminal's Ctrl-C
        # reaches a process whose SIGINT is the default, so the child gets that back.
        preexec_fn=_sigint_default,
    )
    os.close(slave)
    said, signalled = b"", False
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            # Waiting: its status line says so, or the first event it follows (printed
            # inside the wait, after the status line starts), should rich not draw that.
            # Not "it holds a connection": submit --wait holds one for its POST, before
            # the wait, where a Ctrl-C has no task to name.
            if not signalled and re.search(
                rb"waiting for |[0-9a-f]{12}: [a-z_]+ \(|submitted +\xe2\x86\x92", said
            ):
                proc.send_signal(signal.SIGINT)
                signalled = True
            if not select.select([master], [], [], 0.5)[0]:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the process is gone and the pty closed
                break
            if not chunk:
                break
            said += chunk
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # Say what the process made of SIGINT (ignored, caught, neither) and what it
            # had written: a wait that went on was not explained by the bare timeout.
            raise AssertionError(f"{_signal_dispositions(proc.pid)}; said {said!r}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
        os.close(master)
    assert signalled, said
    return code, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", said.decode(errors="replace"))


def test_a_wait_interrupted_by_ctrl_c_names_the_task_that_goes_on(
    orbit: Run, cluster: tuple[Node, Tokens, str]
) -> None:
    """Ctrl-C during ``task wait`` or ``task submit --wait`` exited 130 with nothing said:
    the task's id had been only in the status line, which the interrupt erased. Each now
    says on stderr which task goes on and how to wait for it again."""
    ok(orbit("queue", "create", "unworked", "--max-concurrency", "1", "--rate", "0"))
    # A handler no worker of this module's other tests takes: the task stays queued
    task = json.loads(ok(orbit("task", "submit", "unworked", "nobody.takes", "--json")))
    code, said = _interrupted_while_waiting(_env(cluster), "task", "wait", task["id"])
    assert code == 130, said
    assert f"task {task['id']} goes on: orbit task wait {task['id']}" in said, said
    code, said = _interrupted_while_waiting(
        _env(cluster), "task", "submit", "unworked", "nobody.takes", "--wait"
    )
    assert code == 130, said
    listed = json.loads(ok(orbit("task", "ls", "--queue", "unworked", "--json")))["items"]
    made = next(t["id"] for t in listed if t["id"] != task["id"])
    assert f"task {made} goes on: orbit task wait {made}" in said, said


def test_task_submit_takes_attempt_timeout_and_its_older_spelling(orbit: Run) -> None:
    """``--timeout`` on ``task submit`` was the attempt's limit but read as how long
    ``--wait`` waits (a 2 s "wait" sent a 20 s task to needs_review). It is spelled
    ``--attempt-timeout`` now; ``--timeout`` still sets the same."""
    ok(orbit("queue", "create", "limited", "--max-concurrency", "1", "--rate", "0"))
    new = orbit("task", "submit", "limited", "h", "--attempt-timeout", "7", "--json")
    assert json.loads(ok(new))["attempt_timeout"] == 7, new.stdout
    old = orbit("task", "submit", "limited", "h", "--timeout", "9", "--json")
    assert json.loads(ok(old))["attempt_timeout"] == 9, old.stdout
    refused = orbit("task", "submit", "limited", "h", "--attempt-timeout", "nan")
    assert refused.returncode == 2 and "--attempt-timeout" in refused.stderr, refused.stderr
    helped = " ".join(ok(orbit("task", "submit", "--help")).split())
    assert "the attempt's limit" in helped and "--wait-timeout" in helped, helped


def test_an_unreachable_server_error_says_why_and_which_scheme_to_use(
    orbit: Run, cluster: tuple[Node, Tokens, str], tmp_path: Path
) -> None:
    """ "cannot reach URL: Unreachable" (or ``SSLError``) named only an exception class:
    the cause's message is said now, on one line, and an https:// URL for a plain HTTP
    server (or the other way round) is told which scheme to use. A URL with a password
    is refused before anything is sent, and never echoed."""
    node, _, _ = cluster
    closed = "http://127.0.0.1:1"  # a privileged port no test server listens on
    for args in (("task", "wait", "x", "--timeout", "1"), ("queue", "ls")):
        refused = orbit(*args, "--url", closed)
        assert refused.returncode == 4, refused.stderr
        assert "Connection refused" in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        tls_to_plain = orbit(*args, "--url", f"https://127.0.0.1:{node.port}")
        assert tls_to_plain.returncode == 4, tls_to_plain.stderr
        assert "SSLError: [SSL:" in tls_to_plain.stderr, tls_to_plain.stderr
        assert "plain HTTP there? use http://" in tls_to_plain.stderr, tls_to_plain.stderr
    secret = orbit("queue", "ls", "--url", "http://u:hunter2@127.0.0.1:1")
    assert secret.returncode == 2 and "hunter2" not in secret.stdout + secret.stderr
    import trustme

    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    cert, key, cafile = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(cafile))
    db = f"sqlite:///{tmp_path}/tls.db"
    make_tokens(db)
    tls = start_server(db, tmp_path, node_id="tls", tls=(cert, key, cafile))
    try:
        plain_to_tls = orbit("queue", "ls", "--url", f"http://127.0.0.1:{tls.port}")
    finally:
        tls.stop()
    assert plain_to_tls.returncode == 4, plain_to_tls.stderr
    assert "RemoteDisconnected" in plain_to_tls.stderr, plain_to_tls.stderr
    assert "if the server serves TLS there, use https://" in plain_to_tls.stderr


def test_the_server_logs_the_absolute_path_of_a_relative_sqlite_file(tmp_path: Path) -> None:
    """``sqlite:///x.db`` (three slashes) is relative to the working directory, which the
    node's log did not show ("serving on sqlite"): ``sqlite:///tmp/x.db`` made
    ./tmp/x.db unseen. The node names the file's absolute path; --db's help says how a
    path is read."""
    from orbit.cli.listening import announced_port

    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orbit.cli", "server", "--port", "0"],
            cwd=tmp_path,
            env={**os.environ, "ORBIT_DB": "sqlite:///sub/x.db"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    node = Node(proc, 0, log)
    try:
        announced_port(proc, log, timeout=30)
    finally:
        node.stop()
    where = tmp_path.resolve() / "sub" / "x.db"
    assert f"serving on sqlite {where}" in node.log_text(), node.log_text()
    assert where.exists()
    helped = subprocess.run(
        [sys.executable, "-m", "orbit.cli", "server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "300"},
    )
    text = " ".join(helped.stdout.split())
    assert "relative to the working directory" in text and "sqlite://// with four" in text


def test_a_validators_message_has_no_value_error_prefix_over_http(
    api: httpx.Client, orbit: Run
) -> None:
    """pydantic puts "Value error, " before the text of a validator's ValueError, and
    it reached users: "deadline: Value error, an instant is …". Neither a body's field
    (orbit.protocol's decoding) nor a query parameter (FastAPI's) says it now."""
    ok(orbit("queue", "create", "plain", "--max-concurrency", "1", "--rate", "0"))
    body = {"queue": "plain", "handler": "h", "payload": {}, "deadline": "2026-12-31"}
    refused = api.post("/v1/tasks", json=body)
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert message.startswith("deadline: an instant"), message
    listed = api.get("/v1/tasks", params={"limit": "+5"})
    assert listed.status_code == 400, listed.text
    assert listed.json()["error"]["message"] == "limit: give a whole number in plain digits"
    cli = orbit("task", "submit", "plain", "h", "--deadline", "2026-12-31")
    assert cli.returncode == 3 and "INVALID_VALUE: deadline: an instant" in cli.stderr
    assert "Value error" not in cli.stderr, cli.stderr
    assert api.get("/v1/tasks", params={"queue": "plain"}).json()["items"] == []


def test_the_help_marks_queue_creates_caps_required_and_schedules_a_queue_that_exists(
    orbit: Run,
) -> None:
    """``queue create`` refuses a queue without --max-concurrency and --rate, which its
    options' help did not say; ``schedule create``'s example named a queue ``reports``
    that a dev server has not (QUEUE_NOT_FOUND). ``task --help`` listed exit 1 among
    every task command's codes, though only the waits exit with it (``show`` of a failed
    task exits 0)."""
    created = " ".join(ok(orbit("queue", "create", "--help")).split())
    assert "live attempts at most (>= 1); required" in created, created
    assert "tasks per second; required" in created, created
    scheduled = " ".join(ok(orbit("schedule", "create", "--help")).split())
    assert "--queue reports" not in scheduled and "--queue demo" in scheduled, scheduled
    assert "orbit queue create" in scheduled, scheduled
    tasks = " ".join(ok(orbit("task", "--help")).split())
    assert "Of wait and submit --wait only" in tasks, tasks
    assert tasks.index("Of wait and submit --wait only") < tasks.index("1 the task ended")


def test_schedule_commands_spell_the_attempt_limit_as_task_submit_does(orbit: Run) -> None:
    """``schedule create``/``update`` took the tasks' attempt limit only as ``--timeout``,
    the spelling ``task submit`` gave up for ``--attempt-timeout`` (it read as a wait's).
    Both commands take ``--attempt-timeout`` and the older ``--timeout``; NaN is refused
    by either name, and nothing is made or changed."""
    ok(orbit("queue", "create", "limit-q", "--max-concurrency", "1", "--rate", "0"))
    made = json.loads(
        ok(orbit("schedule", "create", "limits", "--cron", "0 3 * * *", "--queue", "limit-q",
                 "--handler", "h", "--attempt-timeout", "7", "--json"))
    )  # fmt: skip
    assert made["template"]["attempt_timeout"] == 7.0
    older = orbit("schedule", "update", "limits", "--timeout", "9", "--json")
    assert json.loads(ok(older))["template"]["attempt_timeout"] == 9.0
    for spelling in ("--attempt-timeout", "--timeout"):
        refused = orbit("schedule", "update", "limits", spelling, "nan")
        assert refused.returncode == 2 and "--attempt-timeout" in refused.stderr, refused.stderr
        nan = orbit("schedule", "create", "nan", "--cron", "0 3 * * *", "--queue", "limit-q",
                    "--handler", "h", spelling, "nan")  # fmt: skip
        assert nan.returncode == 2 and "--attempt-timeout" in nan.stderr, nan.stderr
    shown = json.loads(ok(orbit("schedule", "show", "limits", "--json")))
    assert shown["template"]["attempt_timeout"] == 9.0
    assert [s["name"] for s in json.loads(ok(orbit("schedule", "ls", "--json")))] == ["limits"]
    assert "--attempt-timeout" in ok(orbit("schedule", "create", "--help"))
