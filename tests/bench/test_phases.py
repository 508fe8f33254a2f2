"""benchmarks.phases: a tiny run claims, starts and finishes every task it filled, on
both backends, and stops after the phase it is told to."""

from __future__ import annotations

import pytest

from benchmarks import phases
from tests.pg import ADMIN_DSN


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_tiny_run_times_every_phase(backend: str) -> None:
    spent = phases.run(backend, 450, admin_dsn=ADMIN_DSN, tune_gc=False)  # 3 batches a phase
    assert list(spent) == list(phases.PHASES)
    assert all(us > 0 for us in spent.values())


def test_a_run_stops_after_the_phase_it_is_told() -> None:
    spent = phases.run("sqlite", 10, "claim", admin_dsn=ADMIN_DSN, tune_gc=False)
    assert list(spent) == ["fill", "claim"]
