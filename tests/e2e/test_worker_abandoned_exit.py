"""``orbit worker``'s exit code after a drain counts only the abandoned handlers still
running when it ends. A handler that ignored its task's cancel past ``cancel_grace`` was
abandoned, and every later clean drain of the process exited 1 for it, even once it had
ended long before. Real processes, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.e2e.servers import Node, Tokens
from tests.e2e.test_runner import _wait_for, api, fast, submit, wait_state  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
ABANDONED = "abandoning it"  # the runner's log line as it gives up on a handler
STILL_RUNNING = "are still running"  # the drain's, for those it ends with


class _Output:
    """A process's output lines, read as they come, so that a test can wait for one."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    def wait_for(self, text: str, timeout: float = 30) -> None:
        with self._changed:
            found = self._changed.wait_for(lambda: text in self.text(), timeout)
        assert found, f"{text!r} never logged:\n{self.text()}"

    def text(self) -> str:
        return "".join(self.lines)

    def finished(self) -> str:
        self._reader.join(30)
        return self.text()


@contextmanager
def _worker(node: Node, tokens: Tokens, marks: Path) -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, "ORBIT_URL": node.http, "ORBIT_TOKEN": tokens.worker}
    env["ORBIT_TEST_MARKS"] = str(marks)
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "worker", "tests.e2e.ignoring_app:worker"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


@pytest.mark.parametrize("handler", ["ignores", "ignores.async"])
@pytest.mark.parametrize("ended", [True, False], ids=["ended", "still_running"])
def test_the_exit_code_counts_the_abandoned_handlers_still_running_at_the_drain(
    fast: Node,  # noqa: F811
    tokens: Tokens,
    api: httpx.Client,  # noqa: F811
    tmp_path: Path,
    handler: str,
    ended: bool,
) -> None:
    """A handler ignores its task's cancel past ``cancel_grace`` and is abandoned. If it
    then ends on its own, a later SIGTERM drain with nothing running exits 0; if it is
    still running when the drain ends, the worker exits 1 and says so."""
    with _worker(fast, tokens, tmp_path) as proc:
        output = _Output(proc)
        tid = submit(api, handler)
        try:
            _wait_for(tmp_path / f"start-{tid}")
            assert api.post(f"/v1/tasks/{tid}/cancel").status_code == 200
            output.wait_for(ABANDONED)
            if ended:
                (tmp_path / f"release-{tid}").touch()
                _wait_for(tmp_path / f"done-{tid}")
                # and the worker goes on: another task runs after it
                wait_state(api, submit(api, "quick"), {"succeeded"})
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(30)
        finally:
            (tmp_path / f"release-{tid}").touch()
        out = output.finished()
    assert wait_state(api, tid, {"cancelled"})["state"] == "cancelled"
    if ended:
        assert code == 0, out
        assert STILL_RUNNING not in out, out
    else:
        assert code == 1, out
        assert f"1 handler(s) ignored cancellation, were abandoned and {STILL_RUNNING}" in out
