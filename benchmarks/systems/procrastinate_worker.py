"""The Procrastinate app of the benchmark, for its workers and for its producer.

Workers are Procrastinate's documented CLI, started by
:class:`benchmarks.systems.procrastinate_system.ProcrastinateSystem` as
``python -m procrastinate --app=benchmarks.systems.procrastinate_worker.app worker
--concurrency N``. At import the module builds that ``app`` from the environment the
system exports: an async ``PsycopgConnector`` on ``BENCH_PROCRASTINATE_DSN``, and, in
recovery mode with the tuned profile, the stalled-job retry recipe of Procrastinate's
docs ("Retry stalled jobs") with the shortest sane timings. The producer (the harness
process) builds its own app with :func:`build_app` over a ``SyncPsycopgConnector``, as
the docs recommend for synchronous deferring; both register the same task name.
"""

from __future__ import annotations

import os
from typing import Any

import procrastinate
from procrastinate import connector as connector_module
from procrastinate.app import WorkerOptions

from benchmarks import recorder

#: the database the harness created for this run (a libpq DSN)
DSN_ENV = "BENCH_PROCRASTINATE_DSN"
#: "defaults" or "tuned"
PROFILE_ENV = "BENCH_PROFILE"
#: "1" when the workers must recover jobs of a killed worker
RECOVERY_ENV = "BENCH_RECOVERY"
#: the task every benchmark job is deferred to
TASK_NAME = "bench"
#: the docs' recovery task, registered only in tuned recovery mode
RETRY_TASK_NAME = "retry_stalled_jobs"

# Tuned recovery mode. A worker refreshes its heartbeat every UPDATE_HEARTBEAT_INTERVAL
# seconds; a worker silent for STALLED_AFTER seconds is stalled, and so are its jobs in
# "doing". The periodic retry task runs every RETRY_CRON (six columns: seconds first).
UPDATE_HEARTBEAT_INTERVAL = 1.0
STALLED_AFTER = 5.0
RETRY_CRON = "* * * * * *"


def build_app(
    connector: connector_module.BaseConnector, *, recovery: bool = False
) -> procrastinate.App:
    """A Procrastinate app with the benchmark task (and the recovery recipe if asked)."""
    worker_defaults: WorkerOptions = {}
    if recovery:
        # The docs: when changing seconds_since_heartbeat, adjust the worker's
        # update_heartbeat_interval and stalled_worker_timeout accordingly.
        worker_defaults = {
            "update_heartbeat_interval": UPDATE_HEARTBEAT_INTERVAL,
            "stalled_worker_timeout": STALLED_AFTER,
        }
    app = procrastinate.App(connector=connector, worker_defaults=worker_defaults)

    @app.task(name=TASK_NAME)
    async def bench(payload: dict[str, Any]) -> None:
        await recorder.run_async(payload)

    if recovery:

        @app.periodic(cron=RETRY_CRON)
        @app.task(name=RETRY_TASK_NAME, queueing_lock=RETRY_TASK_NAME)
        async def retry_stalled_jobs(timestamp: int) -> None:
            stalled = await app.job_manager.get_stalled_jobs(seconds_since_heartbeat=STALLED_AFTER)
            for job in stalled:
                await app.job_manager.retry_job(job)

    return app


def _worker_app() -> procrastinate.App:
    recovery = os.environ.get(RECOVERY_ENV) == "1" and os.environ.get(PROFILE_ENV) == "tuned"
    connector = procrastinate.PsycopgConnector(conninfo=os.environ.get(DSN_ENV, ""))
    return build_app(connector, recovery=recovery)


#: the app ``procrastinate --app=benchmarks.systems.procrastinate_worker.app`` loads
app = _worker_app()
