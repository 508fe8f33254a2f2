"""How big each workload is: the real benchmark (``full``) and the smoke check (``smoke``).

The sizes live in one place so that the method in docs/benchmarks.md, the harness and the
smoke test can never disagree about them; every result file records the scale it ran at.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: Tasks per transaction in the physical limit's batched pipeline: the batches Orbit's hot
#: path forms under load. The worker sends its start and finish reports in batches of up
#: to 200 (``orbit.worker.batching.Coalescer``'s ``max_batch``), and a claim takes as many
#: tasks as the worker has free slots (500 tuned); a 20,000-task drain averaged claims of
#: 179 and reports of 163. pgbench's ceiling climbs steeply with the batch up to about 128
#: and flattens after (2 clients, one hour: 64 → 4,350 jobs/s, 128 → 6,230, 170 → 6,650,
#: 200 → 6,960), so a smaller batch understates what PostgreSQL allows Orbit's SQL; it
#: was 64 until 2026-12-01.
PHYSICAL_BATCH = 200

#: Untimed jobs the latency workload submits at its paced rate, after the worker has run
#: its readiness job and before the timed ones. The harness resets each system before a
#: run (a ``TRUNCATE``; Celery's Redis db flushed and its client built anew) and starts
#: a fresh worker, and the first tasks after that pay for it: on PostgreSQL a
#: statement's first runs on each pooled connection (on a connection new in the run, a
#: prepared statement's first five runs are custom plans; after a ``TRUNCATE`` on one
#: already open, its first run plans it again; Orbit's durable pool hands out four
#: connections in turn), cold caches. With one warm-up job (until 2026-12-05), Orbit's
#: first ten timed tasks held 48 of the 270 places among the ten slowest of 27 session
#: runs (chance: 2.7), most in the first run after the system was prepared; Celery's 14
#: and PgQueuer's 13. As warm-up jobs, Orbit's first six took 1.0-3.6 times the run's
#: median on average and settled within 10-20; 50 (0.5 s at 100/s) is more than twice
#: the 20 tasks in which four new connections run each statement five times. The same for every
#: system; it moved no system's p99 beyond the spread of a noisy hour
#: (docs/benchmarks/history.md, the fixes table: *the latency workload's single warm-up job*).
LATENCY_WARM_UP = 50


@dataclass(frozen=True)
class Scale:
    name: str
    #: throughput: pre-enqueued no-op jobs, drained by each number of worker processes
    throughput_jobs: int
    throughput_processes: tuple[int, ...]
    #: jobs in flight per worker process for the throughput, latency and backlog workloads
    worker_concurrency: int
    #: enqueue: jobs submitted one call each, and jobs submitted ``batch`` per call
    enqueue_one_jobs: int
    enqueue_batch_jobs: int
    batch: int
    #: latency: jobs submitted one at a time at ``latency_rate`` per second, after
    #: ``latency_warm_up_jobs`` untimed jobs at the same rate (``LATENCY_WARM_UP``: why)
    latency_jobs: int
    latency_rate: float
    latency_warm_up_jobs: int
    #: I/O-bound: jobs that each sleep ``io_sleep_ms``, ``io_concurrency`` at once
    io_jobs: int
    io_sleep_ms: int
    io_concurrency: int
    #: recovery: jobs held by the victim, and how long to wait after the kill (the
    #: harness raises the cap above every system's documented recovery in the run:
    #: ``recovery_cap_fits_systems``)
    recovery_jobs: int
    recovery_cap_s: float
    #: backlog: jobs drained by 1 worker with ``backlog_large`` queued, and with only
    #: ``backlog_small`` queued (the drained count is ``backlog_small`` in both cases)
    backlog_large: int
    backlog_small: int
    #: the longest any single wait may take before the run is recorded as timed out
    timeout_s: float
    #: how long a freshly started worker may take to run its warm-up job (latency: the
    #: run fails after that), and how long the recovery workload waits for the rescuer's
    #: warm-up before killing the victim anyway (a victim that prefetched the warm-up
    #: job keeps it from the rescuer; the run records whether the rescuer was seen ready)
    ready_timeout_s: float
    rescuer_ready_s: float
    #: how often waits poll the records (and done_count), and how often CPU is sampled
    #: (0: only at the start and the end of each measured phase)
    poll_s: float
    cpu_interval_s: float
    #: arguments of benchmarks.physical.measure (PHYSICAL_BATCH: why 200)
    physical_batch: int
    physical_clients: tuple[int, ...]
    physical_seconds: float
    physical_backlog: int
    physical_submit_batch: int
    physical_commits: int
    #: whether the harness raises ``recovery_cap_s`` above the slowest documented recovery
    #: of the systems in the run (``benchmarks.harness.recovery_cap``): every real scale
    #: does; the smoke check keeps its short cap (its numbers mean nothing, and the peers
    #: that never recover would each wait out the raised cap in the test suite)
    recovery_cap_fits_systems: bool = True

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


FULL = Scale(
    name="full",
    throughput_jobs=20_000,
    throughput_processes=(1, 2),
    worker_concurrency=10,
    enqueue_one_jobs=2_000,
    enqueue_batch_jobs=20_000,
    batch=1_000,
    latency_jobs=1_000,
    latency_rate=100.0,
    latency_warm_up_jobs=LATENCY_WARM_UP,
    io_jobs=5_000,
    io_sleep_ms=20,
    io_concurrency=200,
    recovery_jobs=200,
    recovery_cap_s=60.0,
    backlog_large=1_000_000,
    backlog_small=20_000,
    timeout_s=3600.0,
    ready_timeout_s=60.0,
    rescuer_ready_s=30.0,
    poll_s=0.015,
    cpu_interval_s=0.25,
    physical_batch=PHYSICAL_BATCH,
    physical_clients=(1, 2),
    physical_seconds=10.0,
    physical_backlog=20_000,
    physical_submit_batch=1000,
    physical_commits=500,
)

#: What one working session can afford on a shared 2-core machine (about 45 minutes for
#: eight systems and five runs): the full workloads with fewer jobs, a 50,000-job backlog
#: instead of 1,000,000, and a 15 s recovery cap, which the harness raises above the
#: slowest documented recovery of the systems in the run (PgQueuer's defaults: a 30 s
#: heartbeat timeout, then up to a 30 s dequeue poll). The latency workload keeps the issue's
#: 1,000 jobs (10 s a run): with 300, a run's p99 was its third-slowest job, and one
#: burst of slow jobs moved it. docs/benchmarks.md says which scale each published
#: figure comes from.
SESSION = Scale(
    name="session",
    throughput_jobs=2_000,
    throughput_processes=(1, 2),
    worker_concurrency=10,
    enqueue_one_jobs=200,
    enqueue_batch_jobs=5_000,
    batch=1_000,
    latency_jobs=1_000,
    latency_rate=100.0,
    latency_warm_up_jobs=LATENCY_WARM_UP,
    io_jobs=1_000,
    io_sleep_ms=20,
    io_concurrency=200,
    recovery_jobs=200,
    recovery_cap_s=15.0,
    backlog_large=50_000,
    backlog_small=2_000,
    timeout_s=900.0,
    ready_timeout_s=60.0,
    rescuer_ready_s=30.0,
    poll_s=0.015,
    cpu_interval_s=0.25,
    physical_batch=PHYSICAL_BATCH,
    physical_clients=(1, 2),
    physical_seconds=10.0,
    physical_backlog=20_000,
    physical_submit_batch=1000,
    physical_commits=500,
)

SMOKE = Scale(
    name="smoke",
    throughput_jobs=30,
    # 2 only: every other workload starts 1 process, so this still covers both paths
    # of every system's start_workers, with two fewer process start-ups per system
    throughput_processes=(2,),
    worker_concurrency=10,
    enqueue_one_jobs=30,
    enqueue_batch_jobs=30,
    batch=10,
    latency_jobs=30,
    latency_rate=100.0,
    latency_warm_up_jobs=5,
    io_jobs=30,
    io_sleep_ms=20,
    io_concurrency=200,
    recovery_jobs=10,
    recovery_cap_s=10.0,
    backlog_large=300,
    backlog_small=30,
    timeout_s=60.0,
    ready_timeout_s=60.0,
    rescuer_ready_s=15.0,
    poll_s=0.05,  # a smoke run polls less: 8 systems share the harness process
    cpu_interval_s=0.0,  # readings at the start and end of each phase only
    physical_batch=8,
    physical_clients=(1,),
    physical_seconds=1.0,
    physical_backlog=200,
    physical_submit_batch=50,
    physical_commits=20,
    recovery_cap_fits_systems=False,
)

SCALES = {s.name: s for s in (FULL, SESSION, SMOKE)}
