"""The Orbit harness prefetches only where docs/worker.md says to: the tuned profile's
I/O-bound workload (as many as it runs at once); the throughput workload, recovery and
the defaults profile keep the worker's default, 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.systems.base import WorkerSpec
from benchmarks.systems.orbit_system import TUNED_CONCURRENCY, OrbitSystem


@pytest.mark.parametrize(
    ("profile", "spec", "concurrency", "prefetch"),
    [
        ("tuned", WorkerSpec(1, 200, Path("."), io_bound=True), 200, 200),
        ("tuned", WorkerSpec(1, 10, Path(".")), TUNED_CONCURRENCY, 0),  # throughput
        ("tuned", WorkerSpec(1, 10, Path("."), hold=True), 10, 0),  # recovery's victim
        ("defaults", WorkerSpec(1, 200, Path("."), io_bound=True), 200, 0),
        ("defaults", WorkerSpec(1, 10, Path(".")), 10, 0),
    ],
)
def test_only_the_tuned_io_bound_workload_prefetches(
    profile: str, spec: WorkerSpec, concurrency: int, prefetch: int
) -> None:
    system = OrbitSystem("postgres", profile)
    assert system._concurrency(spec) == concurrency
    assert system._prefetch(spec) == prefetch
