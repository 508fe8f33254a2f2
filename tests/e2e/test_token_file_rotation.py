"""A worker token rotated in ``ORBIT_TOKEN_FILE`` with the old one revoked first: the
close for the revoke (4401) is waited out as any other drop is, so a new token written
into the file just after it resumes the session, and the attempt running goes on. A
token that cannot change (``ORBIT_TOKEN``) still ends the run at the first refusal after
the close, and a file given no usable token ends it once ``ROTATION_WAIT_S`` has passed
(2 s in ``tests/e2e/rotation_app.py``), after more refusals than ``REFUSALS_TO_STOP``.
Real servers and real ``orbit worker`` processes, on both backends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest

from orbit.worker.runner import REFUSALS_TO_STOP
from tests.e2e.servers import Node, Tokens
from tests.e2e.test_runner import _wait_for, submit, wait_state

#: what the worker logs when the server closes its connection for the revoke
REVOKED_LINE = "its token was revoked (4401 UNAUTHENTICATED)"


class Output:
    """A process's output, read line by line as it comes (by a thread of its own), so
    that a test waits for a line rather than for a time."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: list[str] = []
        self._ended = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def text(self) -> str:
        with self._changed:
            return "".join(self._lines)

    def wait_for(self, text: str, timeout: float = 30) -> None:
        """Return once a line holding ``text`` has come; fail if the output ends (or
        ``timeout`` passes) without one."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._ended or any(text in line for line in self._lines), timeout
            )
        assert text in self.text(), f"never logged {text!r}:\n{self.text()}"

    def all(self) -> str:
        """Everything, once the process has ended."""
        self._reader.join(30)
        return self.text()


@pytest.fixture
def admin_q(admin: httpx.Client) -> httpx.Client:
    created = admin.post("/v1/queues", json={"name": "q", "max_concurrency": 5, "rate": 0})
    assert created.status_code == 201, created.text
    return admin


def _write_token(path: Path, token: str, mode: int = 0o600) -> None:
    """Replace ``path`` with a file of ``mode`` holding ``token``, in one rename (as a
    rotation should), so the worker never reads it half written."""
    part = path.with_name(path.name + ".new")
    part.write_text(token + "\n")
    part.chmod(mode)
    os.replace(part, path)


@pytest.fixture
def old_token(admin_q: httpx.Client) -> tuple[str, str]:
    """The worker token to be revoked, made through the API: its id and its secret."""
    made = admin_q.post("/v1/tokens", json={"name": "old", "scopes": ["worker"]})
    assert made.status_code == 201, made.text
    return made.json()["id"], made.json()["token"]


@pytest.fixture
def token_file(tmp_path: Path, old_token: tuple[str, str]) -> Path:
    """A token file (mode 600) holding the old token."""
    path = tmp_path / "token"
    _write_token(path, old_token[1])
    return path


@contextlib.contextmanager
def _worker(node: Node, marks: Path, **env: str) -> Iterator[tuple[subprocess.Popen[str], Output]]:
    """``orbit worker tests.e2e.rotation_app:worker`` on ``node``, its token given by
    ``env`` alone (ORBIT_TOKEN, ORBIT_TOKEN_FILE), and its output read as it comes."""
    environment = {
        k: v for k, v in os.environ.items() if k not in ("ORBIT_TOKEN", "ORBIT_TOKEN_FILE")
    }
    environment.update(ORBIT_URL=node.http, ORBIT_TEST_MARKS=str(marks), **env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "worker", "tests.e2e.rotation_app:worker"],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None
    try:
        yield proc, Output(proc.stdout)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _running_task(admin: httpx.Client, marks: Path) -> str:
    """A task (not retry_safe) the worker has started, and holds until let go."""
    task_id = submit(admin, "gated")
    _wait_for(marks / f"start-{task_id}")
    return task_id


def _revoke(admin: httpx.Client, token_id: str) -> None:
    revoked = admin.post(f"/v1/tokens/{token_id}/revoke")
    assert revoked.status_code == 200, revoked.text


def _resumes_and_succeeds(
    proc: subprocess.Popen[str], out: Output, admin: httpx.Client, task_id: str, marks: Path
) -> None:
    """The worker resumes its session with the token now in the file, the attempt it
    held goes on and succeeds (one attempt: no restart), and the worker, still running,
    stops on SIGTERM with exit 0."""
    out.wait_for("resumed session")
    (marks / f"go-{task_id}").write_text("")
    task = wait_state(admin, task_id, {"succeeded", "failed", "needs_review"})
    assert (task["state"], task["result"]) == ("succeeded", "went"), task
    attempts = admin.get(f"/v1/tasks/{task_id}/attempts").json()["items"]
    assert [a["state"] for a in attempts] == ["succeeded"], attempts
    assert proc.poll() is None, out.text()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, out.all()


def test_a_new_token_written_just_after_the_revoke_resumes_and_the_task_goes_on(
    node: Node,
    tokens: Tokens,
    admin_q: httpx.Client,
    old_token: tuple[str, str],
    token_file: Path,
    tmp_path: Path,
) -> None:
    """A rotation done in the other order: the old token revoked while the worker runs a
    task that is not retry_safe, and the new token written into ORBIT_TOKEN_FILE only
    once the worker has logged the close (4401) and the refusal of the old token read
    again. The worker waits for it as after any other drop (the same token again after
    a pause, a new one at once), resumes its session with it, and the attempt goes on
    and succeeds: one attempt, no restart. Before, that first refusal after the close
    ended the run (``orbit worker`` exited 3), and the task went to needs_review when
    its lease ran out."""
    with _worker(node, tmp_path, ORBIT_TOKEN_FILE=str(token_file)) as (proc, out):
        task_id = _running_task(admin_q, tmp_path)
        _revoke(admin_q, old_token[0])
        out.wait_for(REVOKED_LINE)
        # The old token read again and refused once: the file is written only now, so
        # the worker cannot have read the new token before the reconnect after the close
        # (that reconnect's refusal ended the run before).
        out.wait_for("connect refused: HTTP 401 (bad credentials?); retrying in")
        _write_token(token_file, tokens.worker)
        _resumes_and_succeeds(proc, out, admin_q, task_id, tmp_path)
    text = out.all()
    assert old_token[1] not in text and tokens.worker not in text


def test_a_revoked_token_from_orbit_token_ends_the_run_at_its_first_refusal(
    node: Node,
    tokens: Tokens,
    admin_q: httpx.Client,
    old_token: tuple[str, str],
    tmp_path: Path,
) -> None:
    """A token in ORBIT_TOKEN cannot change under the worker: after the close for its
    revoke the worker reconnects once, and the refusal of that try ends the run (exit 3)
    with no pause and no second try, as before. A good token in ORBIT_TOKEN_FILE beside
    it changes nothing: ORBIT_TOKEN is the one read."""
    spare = tmp_path / "token"
    _write_token(spare, tokens.worker)
    with _worker(node, tmp_path, ORBIT_TOKEN=old_token[1], ORBIT_TOKEN_FILE=str(spare)) as (
        proc,
        out,
    ):
        _running_task(admin_q, tmp_path)
        _revoke(admin_q, old_token[0])
        assert proc.wait(30) == 3, out.all()
    text = out.all()
    assert REVOKED_LINE in text, text
    assert "the server refused the token (HTTP 401)" in text, text
    assert "connect refused" not in text, text  # the first refusal was final
    assert old_token[1] not in text


def test_a_revoked_token_left_in_the_file_ends_the_run_once_the_wait_is_over(
    node: Node,
    admin_q: httpx.Client,
    old_token: tuple[str, str],
    token_file: Path,
    tmp_path: Path,
) -> None:
    """No new token ever comes into ORBIT_TOKEN_FILE after the revoke: the old one, read
    again, is refused with a pause after each try until the rotation's wait is over, and
    the run ends (exit 3). Before, it ended at the first refusal; the first version of
    this fix ended it after REFUSALS_TO_STOP, a third of a second."""
    with _worker(node, tmp_path, ORBIT_TOKEN_FILE=str(token_file)) as (proc, out):
        _running_task(admin_q, tmp_path)
        _revoke(admin_q, old_token[0])
        assert proc.wait(30) == 3, out.all()
    text = out.all()
    assert REVOKED_LINE in text, text
    assert text.count("connect refused: HTTP 401 (bad credentials?)") > REFUSALS_TO_STOP, text
    assert text.count("stopping in") == 1, text
    assert "the server refused the token (HTTP 401)" in text, text
    assert old_token[1] not in text


def test_a_token_file_left_unusable_after_the_revoke_ends_the_run_once_the_wait_is_over(
    node: Node,
    tokens: Tokens,
    admin_q: httpx.Client,
    old_token: tuple[str, str],
    token_file: Path,
    tmp_path: Path,
) -> None:
    """The new token is written into ORBIT_TOKEN_FILE open to group and others (mode
    644, as umask 022 leaves a new file), then the old one revoked: the file is refused
    at each read. Each try with no token to read counts as a refusal of the token in
    hand, so once the rotation's wait is over, the file still refused, the run ends with
    the file's fault (exit 2, saying to chmod 600) rather than trying for ever. Before,
    it ended at the first read, with no time to mend the file in."""
    with _worker(node, tmp_path, ORBIT_TOKEN_FILE=str(token_file)) as (proc, out):
        _running_task(admin_q, tmp_path)
        _write_token(token_file, tokens.worker, mode=0o644)
        _revoke(admin_q, old_token[0])
        assert proc.wait(30) == 2, out.all()
    text = out.all()
    assert REVOKED_LINE in text, text
    assert text.count("no token to reconnect with") > REFUSALS_TO_STOP, text
    assert f"run: chmod 600 {token_file}" in text, text
    assert tokens.worker not in text and old_token[1] not in text


def test_a_token_file_mended_after_the_revoke_resumes_and_the_task_goes_on(
    node: Node,
    tokens: Tokens,
    admin_q: httpx.Client,
    old_token: tuple[str, str],
    token_file: Path,
    tmp_path: Path,
) -> None:
    """The new token written mode 644, the old one revoked, and the file mended by hand
    (chmod 600) once the worker has said it has no token to reconnect with, twice: the
    worker, still waiting, resumes its session with it and the attempt goes on. Before,
    the first unreadable read ended the run (exit 2, 0.03 s after the close), and the
    task went to needs_review."""
    with _worker(node, tmp_path, ORBIT_TOKEN_FILE=str(token_file)) as (proc, out):
        task_id = _running_task(admin_q, tmp_path)
        _write_token(token_file, tokens.worker, mode=0o644)
        _revoke(admin_q, old_token[0])
        out.wait_for(REVOKED_LINE)
        out.wait_for("no token to reconnect with")
        token_file.chmod(0o600)
        _resumes_and_succeeds(proc, out, admin_q, task_id, tmp_path)
