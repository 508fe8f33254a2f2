"""The short chaos run (``tests/fault/chaos.py``) for CI: 150 tasks on PostgreSQL, two
server nodes, three workers behind fault relays, six faults (worker SIGKILL, server
SIGKILL, connection cut, drawn from the seed) and one PostgreSQL restart; then every
invariant checked on the store at rest. The long run is ``scripts/chaos.py``
(``make chaos``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fault.chaos import run_chaos

# It restarts PostgreSQL, which every other test running beside it would see.
pytestmark = pytest.mark.alone

TASKS = 150
KILLS = 6
SEED = 20240611


@pytest.mark.postgres_only
@pytest.mark.timeout(180)
def test_chaos_short(tmp_path: Path) -> None:
    report = run_chaos(TASKS, KILLS, SEED, tmp_path / "chaos", pg_restart=True, timeout=75)
    print(report.summary())
    print("\n".join(report.timeline))
    assert report.violations == [], "\n".join(report.violations[:50])
    assert report.submitted == TASKS
    assert report.lost_tasks == 0
    assert report.double_commits == 0
    assert report.unsafe_double_starts == 0
    assert report.pg_restarts == 1
    assert sum(report.kills.values()) + report.disconnects == KILLS
    assert all(report.peaks.get(scope, 0) <= cap for scope, cap in report.caps.items())
