"""The README's first command: ``orbit dev`` from nothing to tasks flowing, then Ctrl-C."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path


def test_orbit_dev_runs_the_demo_and_serves_until_interrupted(tmp_path: Path) -> None:
    data = tmp_path / "dot-orbit"
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "dev", "--port", "0", "--data-dir", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Press Ctrl-C to stop." in line:
                break
            assert time.monotonic() < deadline, "".join(lines)
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
