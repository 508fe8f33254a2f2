"""The README's first command: the lifecycle demo runs from nothing and says what happened."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path


def test_demo_runs_and_writes_its_history(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    done = subprocess.run(
        [sys.executable, "-m", "orbit.demo", "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "succeeds   succeeded" in out
    assert "scheduled -> claimed -> running -> succeeded" in out
    assert "cancelling -> cancelled" in out
    assert "needs_review" in out and "ATTEMPT_ENDED" in out
    with sqlite3.connect(db) as cx:
        states = dict(cx.execute("SELECT state, count(*) FROM orbit_tasks GROUP BY state"))
        rejected = cx.execute("SELECT count(*) FROM orbit_events WHERE kind='rejected'")
        assert states == {"succeeded": 2, "cancelled": 1, "needs_review": 1}
        assert rejected.fetchone()[0] == 1
