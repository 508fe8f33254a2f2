"""benchmarks.stmt_cost: a tiny drain reports each phase's round trips with the
PostgreSQL backend's CPU and the WAL a task, and every task claimed, started and
finished (in a process of its own: the meter wraps the driver's calls for good)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from tests.pg import ADMIN_DSN


def _backend_is_here() -> bool:
    """Whether the test server's backends are processes of this machine: the tool reads
    their CPU from ``/proc/<pid>/schedstat``, which a server elsewhere does not have."""
    with psycopg.connect(ADMIN_DSN) as cx:  # looked for while the backend is alive
        row = cx.execute("SELECT pg_backend_pid()").fetchone()
        return row is not None and Path(f"/proc/{row[0]}/schedstat").exists()


def test_a_tiny_drain_reports_every_phase(tmp_path: Path) -> None:
    if not _backend_is_here():
        pytest.skip("ORBIT_TEST_PG_DSN names a server whose backends are not on this machine")
    out = tmp_path / "rows.json"
    # no CHECKPOINT: a cluster-wide one would slow every test running beside this one
    args = ["--tasks", "40", "--batch", "10", "--live", "20", "--wal", "--no-checkpoint"]
    args += ["--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.stmt_cost", *args],
        env={**os.environ, "BENCH_PG_DSN": ADMIN_DSN},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    totals = {r["phase"]: r for r in rows if r["label"] == "TOTAL"}
    assert set(totals) == {"claim", "start", "finish", "all"}
    for phase in ("claim", "start", "finish"):
        assert totals[phase]["us_task"] > 0 and totals[phase]["wal_task"] > 0, totals[phase]
        # a claim, a start and a finish of 10 each: four batches of each, at least
        assert totals[phase]["calls"] >= 4
    writes = [
        r for r in rows if r["phase"] == "claim" and "INSERT INTO orbit_attempts" in r["label"]
    ]
    assert writes and writes[0]["calls"] == 4
    assert "cluster WAL a task" in done.stdout
