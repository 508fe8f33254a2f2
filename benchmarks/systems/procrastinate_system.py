"""Procrastinate 3.10 as a system under test.

Everything goes through Procrastinate's documented surface: ``App.schema_manager
.apply_schema()`` for the schema, ``Task.defer`` / ``Task.batch_defer`` over a
``SyncPsycopgConnector`` (the docs' choice for synchronous deferring) for enqueueing, and
the ``procrastinate ... worker`` CLI with the app in
:mod:`benchmarks.systems.procrastinate_worker` for the workers. Only the read-side probes
(``done_count``, ``claim_statement_ms``, ``reset``) are plain SQL on Procrastinate's
tables, and the claim probe runs Procrastinate's own ``fetch_job`` query text.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import procrastinate
import psycopg
from procrastinate import sql as procrastinate_sql
from procrastinate.types import JSONDict
from psycopg import sql

from benchmarks.recorder import HOLD_ENV, REC_DIR_ENV
from benchmarks.systems.base import (
    Env,
    Job,
    PostgresPeer,
    WorkerSpec,
    analyze,
    vacuum_checkpoint,
)
from benchmarks.systems.procrastinate_worker import (
    DSN_ENV,
    PROFILE_ENV,
    RECOVERY_ENV,
    RETRY_CRON,
    STALLED_AFTER,
    TASK_NAME,
    UPDATE_HEARTBEAT_INTERVAL,
    build_app,
)

ROOT = Path(__file__).resolve().parents[2]
APP_PATH = "benchmarks.systems.procrastinate_worker.app"
DEFAULT_CONCURRENCY = 1  # procrastinate.worker.WORKER_CONCURRENCY
#: how often an idle worker polls when no notification wakes it (procrastinate default)
FETCH_JOB_POLLING_INTERVAL_S = 5.0
TABLES = (
    "procrastinate_events",
    "procrastinate_periodic_defers",
    "procrastinate_jobs",
    "procrastinate_workers",
)


class ProcrastinateSystem(PostgresPeer):
    """Procrastinate over a private PostgreSQL database.

    Recovery mode: when ``recovery`` is true, or once any worker of the current run was
    started with ``WorkerSpec.hold`` (until the next ``reset``), the workers are started
    with ``BENCH_RECOVERY=1``. With the tuned profile the worker app then registers the
    docs' ``retry_stalled_jobs`` periodic task and shortens the heartbeat timings (see
    ``recovery_settings``); with the defaults profile nothing changes, as Procrastinate
    does nothing about stalled jobs unless that task is added.
    """

    name = "procrastinate"
    uses_postgres = True

    def __init__(self, profile: str = "defaults", recovery: bool = False) -> None:
        super().__init__(profile, recovery)
        self._app: procrastinate.App | None = None
        self._probe_cx: psycopg.Connection[Any] | None = None
        self._last_concurrency: int | None = None
        self._log_seq = 0

    # -- description -------------------------------------------------------------------

    def versions(self) -> dict[str, str]:
        return {
            "procrastinate": importlib.metadata.version("procrastinate"),
            "psycopg": importlib.metadata.version("psycopg"),
            "psycopg-pool": importlib.metadata.version("psycopg-pool"),
        }

    def settings(self) -> dict[str, Any]:
        tuned = self.profile == "tuned"
        out: dict[str, Any] = {
            "profile": self.profile,
            "connector": _setting(
                "worker: PsycopgConnector (async psycopg_pool, default size 4); "
                "producer: SyncPsycopgConnector",
                "procrastinate docs (connector, sync defer)",
            ),
            "concurrency": _setting(
                "WorkerSpec.concurrency"
                if tuned
                else f"{DEFAULT_CONCURRENCY}; WorkerSpec.concurrency when the workload is "
                "io_bound or hold",
                "procrastinate docs (concurrency): worker --concurrency"
                if tuned
                else "procrastinate default (worker --concurrency)",
            ),
            "listen_notify": _setting(True, "procrastinate default"),
            "fetch_job_polling_interval_s": _setting(
                FETCH_JOB_POLLING_INTERVAL_S, "procrastinate default"
            ),
            "delete_jobs": _setting(
                "never", "procrastinate default; finished jobs stay as the completion record"
            ),
            "claim": _setting(
                "one job per fetch (procrastinate_fetch_job_v2), one finish call per job",
                "procrastinate behaviour",
            ),
            "update_heartbeat_interval_s": _setting(
                f"{UPDATE_HEARTBEAT_INTERVAL} in recovery mode, else 10" if tuned else 10.0,
                "worker option; 10 is procrastinate's default",
            ),
            "stalled_job_retry": _setting(
                f"periodic retry_stalled_jobs every second, stalled after {STALLED_AFTER} s "
                "(recovery mode only)"
                if tuned
                else "none",
                "procrastinate docs (retry stalled jobs)" if tuned else "procrastinate default",
            ),
        }
        if self._last_concurrency is not None:
            out["last_worker_concurrency"] = self._last_concurrency
        return out

    # -- lifecycle ------------------------------------------------------------------------

    def prepare(self, env: Env) -> None:
        self._env = env
        env.work_dir.mkdir(parents=True, exist_ok=True)
        self._create_database(env, "bench_procrastinate")
        try:
            app = build_app(procrastinate.SyncPsycopgConnector(conninfo=self._dsn))
            app.open()
            self._app = app
            app.schema_manager.apply_schema()
            self._probe_cx = psycopg.connect(self._dsn, autocommit=True)
        except BaseException:
            self.close()  # never leave a half-prepared database behind
            raise

    def reset(self) -> None:
        self._forget_hold()
        tables = sql.SQL(", ").join(sql.Identifier(t) for t in TABLES)
        self._probe().execute(sql.SQL("TRUNCATE {} RESTART IDENTITY CASCADE").format(tables))

    def close(self) -> None:
        if self._app is not None:
            self._app.close()
            self._app = None
        if self._probe_cx is not None:
            self._probe_cx.close()
            self._probe_cx = None
        self._drop_database()

    # -- jobs -----------------------------------------------------------------------------

    def enqueue(self, jobs: list[Job], batch: int) -> None:
        """``Task.defer`` per job, or ``Task.batch_defer`` (one INSERT of many rows) per
        ``batch`` jobs. Each call commits before it returns."""
        task = self._require_app().tasks[TASK_NAME]
        if batch <= 1:
            for job in jobs:
                task.defer(payload=job)
            return
        for start in range(0, len(jobs), batch):
            chunk = jobs[start : start + batch]
            task.batch_defer(*(cast(JSONDict, {"payload": job}) for job in chunk))

    def start_workers(
        self, spec: WorkerSpec, into: list[subprocess.Popen[bytes]] | None = None
    ) -> list[subprocess.Popen[bytes]]:
        self._note_workers(spec)
        concurrency = self.worker_concurrency(spec)
        self._last_concurrency = concurrency
        env = _base_env()
        env.pop(HOLD_ENV, None)
        env.pop(RECOVERY_ENV, None)
        env[REC_DIR_ENV] = str(spec.rec_dir)
        env[DSN_ENV] = self._dsn
        env[PROFILE_ENV] = self.profile
        if spec.hold:
            env[HOLD_ENV] = "1"
        if self._recovery_mode():
            env[RECOVERY_ENV] = "1"
        cmd = [sys.executable, "-m", "procrastinate", f"--app={APP_PATH}", "worker"]
        if concurrency != DEFAULT_CONCURRENCY:
            cmd.append(f"--concurrency={concurrency}")
        return self._start_each(spec.processes, into, lambda: self._spawn(cmd, env))

    def worker_concurrency(self, spec: WorkerSpec) -> int:
        """Jobs in flight per worker process for ``spec`` under this profile."""
        if self.profile == "tuned" or spec.io_bound or spec.hold:
            return spec.concurrency
        return DEFAULT_CONCURRENCY

    def done_count(self) -> int:
        """Succeeded benchmark jobs: Procrastinate keeps finished jobs (``delete_jobs`` is
        ``never`` by default) with ``status = 'succeeded'``."""
        row = (
            self._probe()
            .execute(
                "SELECT count(*) FROM procrastinate_jobs"
                " WHERE status = 'succeeded' AND task_name = %s",
                (TASK_NAME,),
            )
            .fetchone()
        )
        assert row is not None
        return int(row[0])

    def settle(self) -> None:
        analyze(self._dsn)

    def maintain(self) -> dict[str, Any]:
        return vacuum_checkpoint(self._dsn)

    def in_flight(self, spec: WorkerSpec) -> str:
        n = self.worker_concurrency(spec)
        return f"{n:,} at once (--concurrency), one job per fetch"

    def claim_probe(self, spec: WorkerSpec | None = None) -> str:
        return (
            "Procrastinate's whole fetch_job statement (one job: select and UPDATE in one); "
            "EXPLAIN ANALYZE, rolled back"
        )

    def recovery_bound_s(self) -> float | None:
        """Tuned: the worker's heartbeat is older than seconds_since_heartbeat, the
        periodic retry task's next second re-queues the job, and an idle worker fetches
        it at the latest on its next poll. Defaults: never (no retry task)."""
        if self.profile != "tuned":
            return None
        return STALLED_AFTER + 1.0 + FETCH_JOB_POLLING_INTERVAL_S

    def claim_statement_ms(self, spec: WorkerSpec | None = None) -> float | None:
        """EXPLAIN ANALYZE of Procrastinate's own ``fetch_job`` query as a worker runs it
        (all queues, a registered worker id), in a transaction that is rolled back, so the
        worker row and the claim both vanish."""
        cx = self._probe()
        with cx.transaction(force_rollback=True):
            row = cx.execute("SELECT * FROM procrastinate_register_worker_v1()").fetchone()
            assert row is not None
            statement = "EXPLAIN (ANALYZE, FORMAT JSON) " + procrastinate_sql.queries["fetch_job"]
            plan = cx.execute(statement, {"queues": None, "worker_id": row[0]}).fetchone()
        assert plan is not None
        cell = plan[0]
        plans = json.loads(cell) if isinstance(cell, str | bytes) else cell
        return float(plans[0]["Execution Time"])

    # -- recovery -------------------------------------------------------------------------

    def recovery_note(self) -> str:
        return (
            "A SIGKILLed worker leaves its jobs in 'doing' forever unless the application "
            "adds the docs' periodic retry_stalled_jobs task: it lists jobs of workers whose "
            "heartbeat (refreshed every update_heartbeat_interval, default 10 s) is older "
            "than seconds_since_heartbeat (default 30 s) via JobManager.get_stalled_jobs and "
            "re-queues them with retry_job; the docs' example runs it every 10 minutes. "
            "With the defaults profile the task is not added, so held jobs never recover."
        )

    def recovery_settings(self) -> dict[str, Any]:
        if self.profile == "tuned":
            return {
                "retry_stalled_jobs_cron": RETRY_CRON,
                "seconds_since_heartbeat": STALLED_AFTER,
                "update_heartbeat_interval_s": UPDATE_HEARTBEAT_INTERVAL,
                "stalled_worker_timeout_s": STALLED_AFTER,
                "source": "procrastinate docs (retry stalled jobs), shortest sane timings",
            }
        return {
            "retry_stalled_jobs": "not configured (procrastinate default)",
            "update_heartbeat_interval_s": 10.0,
            "source": "procrastinate defaults",
        }

    # -- helpers --------------------------------------------------------------------------

    def _probe(self) -> psycopg.Connection[Any]:
        if self._probe_cx is None:
            raise RuntimeError("prepare() has not been called")
        return self._probe_cx

    def _require_app(self) -> procrastinate.App:
        if self._app is None:
            raise RuntimeError("prepare() has not been called")
        return self._app

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        if self._env is None:
            raise RuntimeError("prepare() has not been called")
        self._log_seq += 1
        log = self._env.work_dir / f"procrastinate-worker-{self._log_seq}.log"
        with log.open("ab") as out:
            return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _setting(value: Any, source: str) -> dict[str, Any]:
    return {"value": value, "source": source}


def _base_env() -> dict[str, str]:
    """This process's environment, with the project root importable."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) if not path else f"{ROOT}{os.pathsep}{path}"
    return env
