"""The latency workload's warm-up: a fixed number of untimed jobs at the workload's rate,
recorded with the run and never among its samples.

The first tasks after the harness's reset pay for it (a statement's first runs on each
pooled connection, cold caches), and a run's p99 is its tenth-slowest task: timed, they
measured the harness's reset more than the system's steady state. A fake system writes
each job's record as it is enqueued, with a start that says the job's place in the order
of arrival, so the test reads which jobs each number came from.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from benchmarks.scale import SCALES, SMOKE
from benchmarks.systems.base import Job
from benchmarks.workloads import RunContext, latency
from tests.bench.test_latency_sampling import _Instant


class _Numbered(_Instant):
    """Runs every job the moment it is enqueued; the n-th job to arrive (0: the first)
    is recorded as started n seconds after its enqueue time."""

    name = "numbered"

    def __init__(self) -> None:
        super().__init__()
        self.arrived: list[str] = []

    def enqueue_one(self, job: Job) -> None:
        self.arrived.append(job["id"])
        super().enqueue_one(job)

    def started(self, job: Job, now: float) -> float:
        return float(job["t"]) + len(self.arrived) - 1


def _order(values_ms: list[float]) -> list[int]:
    """The places in the order of arrival that the fake's latencies say."""
    return [round(v / 1000) for v in values_ms]


def test_warm_up_jobs_are_recorded_and_never_sampled(tmp_path: Path) -> None:
    scale = dataclasses.replace(SMOKE, latency_jobs=20, latency_warm_up_jobs=7)
    system = _Numbered()
    ctx = RunContext(system=system, scale=scale, run=1, rec_root=tmp_path, state={})

    outcome = latency(ctx)

    assert outcome.detail["ready"]["ready"]  # the readiness job (arrival 0) still comes first
    warm = outcome.detail["warm_up"]
    assert set(warm) == {"jobs", "rate_per_s", "latencies_ms", "enqueue_call_ms_max"}
    assert warm["jobs"] == 7
    assert warm["rate_per_s"] == scale.latency_rate
    assert _order(warm["latencies_ms"]) == list(range(1, 8))  # kept, untimed
    # the samples are the 20 timed jobs, every one submitted after the warm-up
    assert outcome.detail["jobs"] == 20
    assert _order(outcome.detail["latencies_ms"]) == list(range(8, 28))
    assert len(system.arrived) == 1 + 7 + 20
    assert round(outcome.metrics["max_ms"] or 0) // 1000 == 27


def test_every_scale_warms_up_at_the_workloads_rate() -> None:
    for scale in SCALES.values():
        assert scale.latency_warm_up_jobs > 0, scale.name
