"""Orbit's claim-statement probe reads as many ready rows as the claim of the worker the
workload starts asks for (not a fixed 28), and says that it times the select alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.systems.base import WorkerSpec
from benchmarks.systems.orbit_system import MAX_CLAIM, TUNED_CONCURRENCY, OrbitSystem

HERE = Path(".")


@pytest.mark.parametrize(
    ("profile", "spec", "window"),
    [
        ("defaults", WorkerSpec(1, 10, HERE), 10),  # the default worker: its 10 slots
        ("tuned", WorkerSpec(1, 10, HERE), min(TUNED_CONCURRENCY, MAX_CLAIM)),  # 1,000
        ("tuned", WorkerSpec(1, 200, HERE, io_bound=True), 400),  # 200 slots + 200 prefetched
        ("defaults", None, 10),
    ],
)
def test_the_probe_reads_the_rows_the_workers_claim_reads(
    profile: str, spec: WorkerSpec | None, window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = OrbitSystem("postgres", profile)
    limits: list[int] = []

    def timed(sql: str, params: dict[str, Any]) -> float:
        assert "LIMIT" in sql.upper()
        limits.append(params["limit"])
        return 1.0

    monkeypatch.setattr(system, "_time_claim", timed)
    assert system.claim_statement_ms(spec) == 1.0
    assert limits == [window] * 6  # one warm-up, five timed
    assert MAX_CLAIM == 1000


def test_the_probe_says_it_times_the_select_alone() -> None:
    for profile, window in (("defaults", "10"), ("tuned", "1,000")):
        text = OrbitSystem("postgres", profile).claim_probe()
        assert "select alone" in text and f"LIMIT {window}," in text
        assert OrbitSystem("postgres", profile).settings()["claim_statement"] == text


def test_the_probe_names_the_window_of_the_spec_it_measured() -> None:
    io = WorkerSpec(1, 200, HERE, io_bound=True)
    tuned = OrbitSystem("postgres", "tuned")
    assert "LIMIT 400," in tuned.claim_probe(io)  # 200 slots + 200 prefetched, not 1,000
    assert "LIMIT 25," in OrbitSystem("postgres", "defaults").claim_probe(WorkerSpec(1, 25, HERE))
