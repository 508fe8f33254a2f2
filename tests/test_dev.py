"""The README's first command: ``orbit dev`` from nothing to tasks flowing, then Ctrl-C."""

from __future__ import annotations

import os
import pty
import queue
import re
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tests.e2e.network import idle_connection_answers


def _serving_dev(data: Path) -> subprocess.Popen[str]:
    """``orbit dev`` on a free port with ``data`` as its data directory, serving until it
    is stopped, its output on one pipe and wide enough not to wrap."""
    return subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "dev", "--port", "0", "--data-dir", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )


def _interrupted_when(data: Path, ready: Callable[[], bool]) -> tuple[int, str]:
    """``orbit dev`` on ``data``, sent one SIGINT once ``ready()`` holds (polled: it reads
    what the process writes to its data directory): its exit status and its output."""
    proc = _serving_dev(data)
    try:
        deadline = time.monotonic() + 60
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out


def test_orbit_dev_runs_the_demo_and_serves_until_interrupted(tmp_path: Path) -> None:
    data = tmp_path / "dot-orbit"
    proc = _serving_dev(data)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Press Ctrl-C to stop." in line:
                break
            assert time.monotonic() < deadline, "".join(lines)
        # The URL it prints, opened as a browser would: the API's pages (it was a 404).
        url = re.search(r"Orbit is running at (\S+)", "".join(lines))
        assert url is not None, "".join(lines)
        opened = httpx.get(url.group(1), follow_redirects=True, timeout=10)
        assert opened.status_code == 200 and "text/html" in opened.headers["content-type"]
        assert str(opened.url).endswith("/docs")
        # an idle connection is kept open past uvicorn's default 5 s, as ``orbit server``
        # keeps one (``KEEP_ALIVE``): a client's next request never meets its close
        port = urlsplit(url.group(1)).port
        assert port is not None and idle_connection_answers(port, idle=6.0)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    assert "Orbit is running at http://127.0.0.1:" in out and "stopped" in out
    for row in ("succeeds", "retries", "cancelled", "times out"):
        assert row in out
    assert "ATTEMPT_TIMEOUT" in out
    assert (data / "token").stat().st_mode & 0o077 == 0
    with sqlite3.connect(data / "orbit.db") as cx:
        states = sorted(r[0] for r in cx.execute("SELECT state FROM orbit_tasks"))
        retried = cx.execute("SELECT max(attempts_used) FROM orbit_tasks").fetchone()[0]
    assert states == ["cancelled", "failed", "succeeded", "succeeded"]
    assert retried == 2


def _dev(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orbit.cli", "dev", "--once", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "300"},
        cwd=cwd,
    )


def test_orbit_dev_refuses_what_it_cannot_use_before_writing_anything(tmp_path: Path) -> None:
    """A port in use or an address it cannot listen on is refused (exit 2, no
    traceback) before the database and the admin token are made; a ``--data-dir`` that
    is a file is refused as such and left as it was."""
    data = tmp_path / "dot-orbit"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        in_use = _dev("--port", str(port), "--data-dir", str(data))
    assert in_use.returncode == 2 and f"port {port} is in use" in in_use.stderr, in_use.stderr
    bad_host = _dev("--host", "no-such-host.invalid", "--port", "0", "--data-dir", str(data))
    assert bad_host.returncode == 2, bad_host.stderr
    assert "cannot listen on no-such-host.invalid" in bad_host.stderr, bad_host.stderr
    empty_host = _dev("--host", "", "--port", "0", "--data-dir", str(data))
    assert empty_host.returncode == 2 and "--host is empty" in empty_host.stderr, empty_host.stderr
    assert not data.exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    not_a_dir = _dev("--port", "0", "--data-dir", str(a_file))
    assert not_a_dir.returncode == 2, not_a_dir.stderr
    assert f"--data-dir {a_file} is not a directory" in not_a_dir.stderr, not_a_dir.stderr
    assert a_file.read_text() == "mine"
    for run in (in_use, bad_host, not_a_dir):
        assert "Traceback" not in run.stderr, run.stderr


def test_a_second_orbit_dev_on_one_data_dir_is_refused_before_it_writes(tmp_path: Path) -> None:
    """A second ``orbit dev`` on a directory one already serves opened the database,
    migrated it, made the demo queue and, with no usable token saved, minted an admin
    token and wrote the token file, and only then met the first's lock. It is refused
    first: one line, exit 1, nothing written. The first is this process holding the
    one-server lock (``hold_for_server``, what a running ``orbit dev`` holds) on a
    directory an earlier run prepared, whose token file has been removed since."""
    from orbit.cli.dev import _prepare
    from orbit.store.sqlite import hold_for_server

    data = tmp_path / "dot-orbit"
    _prepare(data)
    (data / "token").unlink()
    held = hold_for_server(str(data / "orbit.db"))
    try:
        second = _dev("--port", "0", "--data-dir", str(data))
    finally:
        os.close(held)
    assert second.returncode == 1, second.stdout + second.stderr
    # in orbit dev's words: the store's ("use PostgreSQL for more") are for servers
    assert f"another orbit dev (or orbit server) is using --data-dir {data}" in second.stderr
    assert "PostgreSQL" not in second.stderr, second.stderr
    assert "Traceback" not in second.stderr, second.stderr
    assert not (data / "token").exists()
    with sqlite3.connect(data / "orbit.db") as cx:
        assert cx.execute("SELECT count(*) FROM orbit_tokens").fetchone() == (1,)
    cx.close()


def test_the_token_file_is_written_afresh_with_mode_600(tmp_path: Path) -> None:
    """The admin token goes into a new file made with mode 600 and then renamed into
    place: never through a ``token`` symlink into whatever it points at, and never into
    an old token file that others can read, before its mode is changed."""
    from orbit.cli.dev import _prepare

    data = tmp_path / "dot-orbit"
    data.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("mine\n")
    elsewhere.chmod(0o644)
    (data / "token").symlink_to(elsewhere)
    _, token = _prepare(data)
    # Compared first, so that a failure prints no token.
    untouched = elsewhere.read_text() == "mine\n"
    assert untouched, "the token was written through the symlink"
    assert elsewhere.stat().st_mode & 0o777 == 0o644
    saved = data / "token"
    holds_it = saved.read_text() == token + "\n"
    assert not saved.is_symlink() and holds_it
    assert saved.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in data.iterdir() if "token" in p.name] == ["token"]


def test_orbit_dev_keeps_its_admin_token_from_one_run_to_the_next(tmp_path: Path) -> None:
    """Each run minted another admin token and overwrote the file holding the last one:
    every earlier token stayed valid for ever, its only copy gone (Orbit then had no way
    to revoke a token). A saved token the database still knows is used again; another is
    minted only when the saved one is missing or no longer an admin token."""
    from orbit.cli.dev import _prepare

    def tokens_in(data: Path) -> int:
        with sqlite3.connect(data / "orbit.db") as cx:
            return int(cx.execute("SELECT count(*) FROM orbit_tokens").fetchone()[0])

    data = tmp_path / "dot-orbit"
    _, first = _prepare(data)
    _, second = _prepare(data)
    same = first == second  # compared first, so that a failure prints no token
    assert same and tokens_in(data) == 1
    (data / "token").write_text("orbit_0123456789abcdef0123456789abcdef_stale\n")
    _, third = _prepare(data)
    fresh = third not in (first, "orbit_0123456789abcdef0123456789abcdef_stale")
    assert fresh and tokens_in(data) == 2
    saved = (data / "token").read_text() == third + "\n"
    assert saved


def test_a_saved_token_others_could_read_is_revoked_as_it_is_replaced(tmp_path: Path) -> None:
    """A token file open to group or others is not used again: another admin token is
    minted and saved in its place. The old one, which other users could read, stayed
    valid for ever, its only copy overwritten. It is revoked; a token of the user's own
    left in that file (not one ``orbit dev`` made) is left alone."""
    from orbit.cli.dev import _prepare
    from orbit.store import open_store

    data = tmp_path / "dot-orbit"
    _, first = _prepare(data)
    (data / "token").chmod(0o644)
    _, second = _prepare(data)
    store = open_store(f"sqlite:///{data / 'orbit.db'}")
    try:
        _, mine = store.token_create("mine", ["admin"])
        (data / "token").write_text(mine + "\n")
        (data / "token").chmod(0o640)
        _, third = _prepare(data)
        # compared first, so that a failure prints no token
        first_refused = store.token_scopes(first) is None
        second_taken = store.token_scopes(second) == frozenset({"admin"})
        mine_taken = store.token_scopes(mine) == frozenset({"admin"})
        third_taken = store.token_scopes(third) == frozenset({"admin"})
    finally:
        store.close()
    assert first_refused and second_taken and mine_taken and third_taken


def test_orbit_dev_prints_a_data_dir_that_looks_like_markup_as_it_is(tmp_path: Path) -> None:
    """The data dir's path is printed as written: one holding ``[/x]`` was read as rich
    markup, and its closing tag that matched nothing was a MarkupError traceback once
    the server was up."""
    data = tmp_path / "[/x]"
    run = _dev("--port", "0", "--data-dir", str(data))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"ORBIT_TOKEN_FILE={data / 'token'}" in run.stdout.replace("\n", ""), run.stdout


def test_orbit_dev_names_its_token_file_by_an_absolute_path(tmp_path: Path) -> None:
    """The commands to try "in another shell" named the token file as given, and the
    default ``--data-dir`` is relative (``.orbit``): pasted into a shell in another
    directory, ``ORBIT_TOKEN_FILE=.orbit/token`` named no file."""
    run = _dev("--port", "0", "--data-dir", "rel-dir", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    token_file = tmp_path.resolve() / "rel-dir" / "token"
    assert f"ORBIT_TOKEN_FILE={token_file}" in run.stdout, run.stdout
    # --once stops at once, and says so rather than that it is running until Ctrl-C
    assert "stopping (--once)" in run.stdout and "Ctrl-C" not in run.stdout, run.stdout


def test_the_commands_to_try_find_orbit_in_a_fresh_shell(tmp_path: Path) -> None:
    """ "Try, in another shell: orbit task submit ..." found no ``orbit`` there:
    ``./scripts/dev`` runs it from ``.venv`` unactivated, and a fresh shell's PATH has
    none. The lines printed, pasted into a shell with a bare PATH, find this ``orbit``."""
    run = _dev("--port", "0", "--data-dir", str(tmp_path / "dot-orbit"))
    assert run.returncode == 0, run.stdout + run.stderr
    tried = run.stdout.split("Try, in another shell:\n", 1)[1]
    setup = [line.strip() for line in tried.splitlines() if line.startswith("  source ")]
    assert setup, run.stdout
    found = subprocess.run(
        ["bash", "-c", f"{setup[0]} && command -v orbit"],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == Path(sys.prefix).absolute() / "bin" / "orbit"


def test_orbit_dev_on_every_address_prints_a_url_a_client_can_use(tmp_path: Path) -> None:
    """``--host 0.0.0.0`` printed ``http://0.0.0.0:PORT`` as the URL and as the
    ``ORBIT_URL`` to export: an address to listen on, not one to connect to. The URL is
    the loopback one, and the first line says it listens on every address."""
    run = _dev("--host", "0.0.0.0", "--port", "0", "--data-dir", str(tmp_path / "dot-orbit"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0.0.0.0:" not in run.stdout, run.stdout
    found = re.search(r"export ORBIT_URL=(http://127\.0\.0\.1:\d+) ", run.stdout)
    assert found is not None, run.stdout
    assert f"at {found.group(1)} (listening on all addresses, 0.0.0.0)" in run.stdout


def test_orbit_dev_interrupted_while_it_starts_stops_cleanly(tmp_path: Path) -> None:
    """Ctrl-C in ``orbit dev``'s first second (the database prepared, the server
    starting) cancelled the start-up half way: uvicorn logged the cancelled start as an
    ERROR with its traceback, and the command exited 130. The signal asks for the same
    clean stop from the start as once it serves. The one-server lock is the first thing
    it writes, before it prepares the database: the signal is sent once it is there."""
    data = tmp_path / "dot-orbit"
    lock = data / "orbit.db-server.lock"
    status, out = _interrupted_when(data, lock.exists)
    assert status == 0, out
    assert "Traceback" not in out and "ERROR" not in out, out
    assert out.rstrip().endswith("stopped"), out
    # ... and the demo is skipped: it ran first (some 3 s), and only then did it stop
    assert "demo task" not in out and "Press Ctrl-C" not in out, out
    with sqlite3.connect(data / "orbit.db") as cx:
        assert cx.execute("SELECT count(*) FROM orbit_tasks").fetchone() == (0,)
    cx.close()


def _ctrl_c_on_a_terminal(argv: list[str], after: bytes) -> tuple[int, str]:
    """``argv`` run on a pty, with Ctrl-C typed (the terminal's SIGINT to its process
    group, as a user's) once its output holds ``after``: its exit status and output."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the test runner may ignore SIGINT, which exec keeps
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(argv[0], argv)
    out = b""
    typed = closed = False
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1)
            try:
                data = os.read(fd, 65536) if ready else b""
            except OSError:  # EIO: the child's side of the pty is closed; it has ended
                closed = True
                break
            if ready and not data:
                closed = True
                break
            out += data
            if not typed and after in out:
                os.write(fd, b"\x03")
                typed = True
        assert typed, out.decode(errors="replace")
    finally:
        if not closed:  # still running: past the deadline, or an assertion failed
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def test_ctrl_c_while_orbit_dev_imports_its_server_exits_130_quietly(tmp_path: Path) -> None:
    """Ctrl-C typed while ``orbit dev`` imported its server (some 0.7 s of its first
    two) met asyncio.run's own SIGINT handler, ``_Stopping``'s not yet installed: it
    cancelled the start-up half way, uvicorn logged an ERROR with its traceback, and it
    exited 130. The import comes before the event loop now: exit 130, no traceback,
    nothing written. The key is typed on a terminal once ``-X importtime`` reports
    ``uvicorn`` imported, the first of the server's imports."""
    data = tmp_path / "dot-orbit"
    argv = [sys.executable, "-X", "importtime", "-m", "orbit.cli", "dev", "--port", "0"]
    status, out = _ctrl_c_on_a_terminal([*argv, "--data-dir", str(data)], b"| uvicorn\r\n")
    assert status == 130, out
    assert "Traceback" not in out and "ERROR" not in out, out
    assert not data.exists(), out


def test_the_demo_that_fails_on_purpose_prints_no_traceback(tmp_path: Path) -> None:
    """The "retries" demo's first attempt raised a RuntimeError of its own, which the
    runner logs at warning with its traceback: the first screen of ``orbit dev`` showed
    a traceback among the demo's lines, as if something had broken. It raises ``Retry``
    (retryable, not logged), and the task is still retried and succeeds."""
    run = _dev("--port", "0", "--data-dir", str(tmp_path / "dot-orbit"))
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "Traceback" not in out and "fails on purpose" not in out, out
    [retries] = [line for line in run.stdout.splitlines() if "retries" in line]
    assert "succeeded" in retries and "2/3" in retries, out


def test_orbit_dev_interrupted_during_its_demo_cuts_it_short_and_cancels_its_tasks(
    tmp_path: Path,
) -> None:
    """Ctrl-C while the demo runs stops without waiting for the rest of it (it ran to its
    end, some 3 s, first); the demo tasks that had not ended are cancelled, rather than
    left to the next run's worker (the slow one, not retry_safe, needing review)."""
    data = tmp_path / "dot-orbit"
    # once the demo has submitted its first task
    status, out = _interrupted_when(data, lambda: _task_states(data) != [])
    assert status == 0, out
    assert "Traceback" not in out and "ERROR" not in out, out
    assert out.rstrip().endswith("stopped"), out
    assert "demo task" not in out and "Press Ctrl-C" not in out, out
    states = _task_states(data)
    assert states and set(states) <= {"succeeded", "failed", "cancelled"}, states
    assert "cancelled" in states, states


def _task_states(data: Path) -> list[str]:
    """The states of the tasks in ``orbit dev``'s database (none while it has none)."""
    if not (data / "orbit.db").exists():
        return []
    with sqlite3.connect(data / "orbit.db") as cx:
        try:
            rows = cx.execute("SELECT state FROM orbit_tasks").fetchall()
        except sqlite3.OperationalError:  # its schema not made yet
            rows = []
    cx.close()
    return [r[0] for r in rows]


class _Output:
    """A process's output lines, read on a thread of their own: a wait for a line is
    bounded, where a read from the pipe blocks for as long as the process is silent."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.lines: list[str] = []
        self._fed: queue.Queue[str | None] = queue.Queue()
        stdout = proc.stdout

        def read() -> None:
            for line in stdout:
                self._fed.put(line)
            self._fed.put(None)

        threading.Thread(target=read, daemon=True).start()

    def until(self, text: str, timeout: float = 120) -> None:
        """Read up to the first line holding ``text``."""
        end = time.monotonic() + timeout
        while True:
            try:
                line = self._fed.get(timeout=max(end - time.monotonic(), 0))
            except queue.Empty:
                raise AssertionError(f"no {text!r} within {timeout} s:\n{self.text}") from None
            if line is None:
                raise AssertionError(f"no {text!r} before the output ended:\n{self.text}")
            self.lines.append(line)
            if text in line:
                return

    def rest(self) -> str:
        """Everything, once the process has ended."""
        while (line := self._fed.get(timeout=30)) is not None:
            self.lines.append(line)
        return self.text

    @property
    def text(self) -> str:
        return "".join(self.lines)


def test_a_second_ctrl_c_stops_orbit_dev_at_once(tmp_path: Path) -> None:
    """The first Ctrl-C stops cleanly: the demo worker drains (its handlers get their
    grace) and the server waits for the requests under way, here one whose body never
    comes. A second Ctrl-C did nothing, as it does in ``orbit server`` and ``orbit
    worker``: the stop waited for that request for ever. It stops at once now: the
    worker's running handler is cancelled without its grace, the server waits for no
    request, and the store is still closed (SQLite removes its -wal file as the last
    connection closes)."""
    data = tmp_path / "dot-orbit"
    proc = _serving_dev(data)
    out = _Output(proc)
    stalled = socket.socket()
    try:
        out.until("Press Ctrl-C to stop.")
        found = re.search(r"Orbit is running at (\S+)", out.text)
        assert found is not None, out.text
        url = found.group(1)
        bearer = f"Bearer {(data / 'token').read_text().strip()}"
        with httpx.Client(base_url=url, headers={"Authorization": bearer}, timeout=30) as api:
            made = api.post(
                "/v1/tasks",
                json={
                    "queue": "demo",
                    "handler": "demo.slow",
                    "payload": {"seconds": 600},
                    "retry_safe": True,
                },
            )
            assert made.status_code == 201, made.text
            task_id = made.json()["task"]["id"]
            deadline = time.monotonic() + 60
            while api.get(f"/v1/tasks/{task_id}").json()["state"] != "running":
                assert time.monotonic() < deadline, "the slow demo task never started"
                time.sleep(0.05)
            port = urlsplit(url).port
            assert port is not None
            stalled.connect(("127.0.0.1", port))
            stalled.sendall(
                b"POST /v1/queues HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                + f"Authorization: {bearer}\r\n".encode()
                + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
            )
            assert api.get("/healthz").status_code == 200  # served after the stalled one
        proc.send_signal(signal.SIGINT)
        out.until("stopping (Ctrl-C again stops at once)")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)  # a guard: the first stop alone waits for ever
        text = out.rest()
    finally:
        stalled.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, text
    assert "stopping at once" in text, text
    assert "running handlers are cancelled" in text, text  # the demo worker's, at once
    assert "Traceback" not in text, text
    assert text.rstrip().endswith("stopped"), text
    assert not (data / "orbit.db-wal").exists(), text
    with sqlite3.connect(data / "orbit.db") as cx:
        state, used = cx.execute(
            "SELECT state, attempts_used FROM orbit_tasks WHERE id = ?", (task_id,)
        ).fetchone()
    cx.close()
    # cancelled as the worker stopped: retry_safe, so reported CANCELLED and due again
    assert state in ("queued", "scheduled") and used == 1, (state, used)
