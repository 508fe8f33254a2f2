"""PgQueuer 1.6 as a system under test.

Everything goes through PgQueuer's documented surface: ``pgq install`` (and ``pgq
autovac`` when tuned) for the schema, ``SyncQueries.enqueue`` over ``SyncPsycopgDriver``
(the documented synchronous producer) for enqueueing, and ``pgqueuer.run`` (the
documented programmatic twin of ``pgq run``, whose CLI form is broken in this install)
with the factory in :mod:`benchmarks.systems.pgqueuer_worker` for the workers. Only the
read-side probes (``done_count``, ``claim_statement_ms``, ``reset``) are plain SQL on
PgQueuer's tables, and the claim probe renders PgQueuer's own dequeue statement.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from pgqueuer.adapters.persistence.qb import QueryQueueBuilder
from pgqueuer.db import SyncPsycopgDriver
from pgqueuer.domain.types import QueueEntrypoint, QueueManagerId
from pgqueuer.queries import SyncQueries
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
from benchmarks.systems.pgqueuer_worker import DRIVER_ENV, DSN_ENV, ENTRYPOINT, default_driver

ROOT = Path(__file__).resolve().parents[2]
#: exported to the workers as "1" in recovery mode (see PgQueuerSystem)
RECOVERY_ENV = "BENCH_RECOVERY"

# PgQueuer's own defaults (``pgq run`` / ``QueueManager.run`` signatures in 1.6.0).
DEFAULT_BATCH_SIZE = 10
DEFAULT_DEQUEUE_TIMEOUT = 30.0
DEFAULT_HEARTBEAT_TIMEOUT = 30.0
# Tuned: the performance-tuning guide says to raise batch_size for short (< 1 s) jobs and
# uses 25 in its example; the recovery values are the shortest we consider sane.
TUNED_BATCH_SIZE = 25
TUNED_RECOVERY_HEARTBEAT_TIMEOUT = 5.0
TUNED_RECOVERY_DEQUEUE_TIMEOUT = 1.0

TABLES = ("pgqueuer", "pgqueuer_log", "pgqueuer_statistics", "pgqueuer_schedules")


@dataclasses.dataclass(frozen=True)
class WorkerParams:
    """The ``pgq run`` / ``pgqueuer.run`` options one worker process is started with."""

    batch_size: int
    dequeue_timeout: float
    heartbeat_timeout: float
    max_concurrent_tasks: int | None  # None: PgQueuer's default, no cap

    def cli_args(self) -> list[str]:
        args = [
            "--batch-size",
            str(self.batch_size),
            "--dequeue-timeout",
            str(self.dequeue_timeout),
            "--heartbeat-timeout",
            str(self.heartbeat_timeout),
        ]
        if self.max_concurrent_tasks is not None:
            args += ["--max-concurrent-tasks", str(self.max_concurrent_tasks)]
        return args


class PgQueuerSystem(PostgresPeer):
    """PgQueuer over a private PostgreSQL database.

    Recovery mode: the workers are started with the tuned recovery settings (see
    ``recovery_settings``) when ``recovery`` is true, or once any worker of the current
    run was started with ``WorkerSpec.hold`` (until the next ``reset``), so the rescuer
    started after the victim uses the same settings. Recovery mode is exported to the
    workers as ``BENCH_RECOVERY=1``; for PgQueuer it only changes the run options, and
    only with the tuned profile (the defaults profile keeps PgQueuer's 30 s timeouts).

    Workers connect with asyncpg when it is installed (``driver``; see
    :mod:`benchmarks.systems.pgqueuer_worker` for why), else with psycopg.
    """

    name = "pgqueuer"
    uses_postgres = True

    def __init__(self, profile: str = "defaults", recovery: bool = False) -> None:
        super().__init__(profile, recovery)
        self._enqueue_cx: psycopg.Connection[Any] | None = None
        self._probe_cx: psycopg.Connection[Any] | None = None
        self._queries: SyncQueries | None = None
        self._last_params: WorkerParams | None = None
        #: the workers' driver (see benchmarks.systems.pgqueuer_worker)
        self.driver = default_driver()
        self._log_seq = 0

    # -- description -------------------------------------------------------------------

    def versions(self) -> dict[str, str]:
        return {
            "pgqueuer": importlib.metadata.version("pgqueuer"),
            "psycopg": importlib.metadata.version("psycopg"),
            self.driver: importlib.metadata.version(self.driver),
        }

    def settings(self) -> dict[str, Any]:
        tuned = self.profile == "tuned"
        out: dict[str, Any] = {
            "profile": self.profile,
            "driver": _setting(
                f"{self.driver}: one direct connection per worker process",
                "pgqueuer docs (performance tuning: 'always use a direct asyncpg connection for "
                "the QueueManager'); psycopg only when asyncpg is not installed",
            ),
            "producer": _setting(
                "SyncQueries over SyncPsycopgDriver (autocommit psycopg connection)",
                "pgqueuer docs (drivers: synchronous driver for enqueueing)",
            ),
            "batch_size": _setting(
                TUNED_BATCH_SIZE if tuned else DEFAULT_BATCH_SIZE,
                "pgqueuer docs (performance tuning): raise for short jobs, example 25"
                if tuned
                else "pgqueuer default",
            ),
            "max_concurrent_tasks": _setting(
                "unlimited; WorkerSpec.concurrency when the workload is io_bound or hold "
                "(batch_size then lowered to concurrency // 2 if needed: PgQueuer requires a "
                "cap of at least 2 x batch_size)",
                "pgqueuer default (unlimited); the docs call it a per-process safety ceiling, "
                "not a throughput setting; in a trial here a cap of 10 ran no-op jobs ~3x slower",
            ),
            "durability": _setting(
                "durable (all tables logged)",
                "pgqueuer default; 'balanced'/'volatile' are documented as faster but lose "
                "the log (where completion is recorded) or the queue on a crash",
            ),
            "autovacuum": _setting(
                "pgq autovac (scale factor 0.01, cost delay 0, fillfactor 70)"
                if tuned
                else "PostgreSQL defaults",
                "pgqueuer docs (performance tuning checklist)" if tuned else "pgqueuer default",
            ),
            "heartbeat_timeout_s": _setting(
                "5 in recovery mode, else 30" if tuned else DEFAULT_HEARTBEAT_TIMEOUT,
                "pgq run --heartbeat-timeout; 30 is pgqueuer's default",
            ),
            "dequeue_timeout_s": _setting(
                "1 in recovery mode, else 30" if tuned else DEFAULT_DEQUEUE_TIMEOUT,
                "pgq run --dequeue-timeout (poll fallback to LISTEN/NOTIFY); 30 is the default",
            ),
            "log_aggregation_interval_s": _setting(30, "pgqueuer default (not a CLI option)"),
            "completion_writes": _setting(
                "batched: JobStatusLogBuffer flushes batch_size results at once",
                "pgqueuer behaviour",
            ),
        }
        if self._last_params is not None:
            out["last_worker_params"] = dataclasses.asdict(self._last_params)
        return out

    # -- lifecycle ------------------------------------------------------------------------

    def prepare(self, env: Env) -> None:
        self._env = env
        env.work_dir.mkdir(parents=True, exist_ok=True)
        self._create_database(env, "bench_pgqueuer")
        try:
            self._pgq_cli("install")
            if self.profile == "tuned":
                self._pgq_cli("autovac")
            self._enqueue_cx = psycopg.connect(self._dsn, autocommit=True)
            self._probe_cx = psycopg.connect(self._dsn, autocommit=True)
            self._queries = SyncQueries(SyncPsycopgDriver(self._enqueue_cx))
        except BaseException:
            self.close()  # never leave a half-prepared database behind
            raise

    def reset(self) -> None:
        self._forget_hold()
        tables = sql.SQL(", ").join(sql.Identifier(t) for t in TABLES)
        self._probe().execute(sql.SQL("TRUNCATE {} RESTART IDENTITY").format(tables))

    def close(self) -> None:
        for cx in (self._enqueue_cx, self._probe_cx):
            if cx is not None:
                cx.close()
        self._enqueue_cx = self._probe_cx = None
        self._queries = None
        self._drop_database()

    # -- jobs -----------------------------------------------------------------------------

    def enqueue(self, jobs: list[Job], batch: int) -> None:
        """One ``SyncQueries.enqueue`` per job, or per ``batch`` jobs with the list form
        (one multi-row INSERT). The connection is in autocommit, so each call has
        committed when it returns."""
        queries = self._require_queries()
        if batch <= 1:
            for job in jobs:
                queries.enqueue(ENTRYPOINT, _encode(job))
            return
        for start in range(0, len(jobs), batch):
            chunk = jobs[start : start + batch]
            queries.enqueue(
                [ENTRYPOINT] * len(chunk), [_encode(j) for j in chunk], [0] * len(chunk)
            )

    def start_workers(
        self, spec: WorkerSpec, into: list[subprocess.Popen[bytes]] | None = None
    ) -> list[subprocess.Popen[bytes]]:
        self._note_workers(spec)
        params = self.worker_params(spec)
        self._last_params = params
        env = _worker_env(spec, recovery=self._recovery_mode())
        env[DSN_ENV] = self._dsn
        env[DRIVER_ENV] = self.driver
        cmd = [sys.executable, "-m", "benchmarks.systems.pgqueuer_worker", *params.cli_args()]
        return self._start_each(spec.processes, into, lambda: self._spawn(cmd, env))

    def worker_params(self, spec: WorkerSpec | None) -> WorkerParams:
        """The ``pgq run`` options for ``spec`` under this profile (see ``settings``)."""
        tuned = self.profile == "tuned"
        batch = TUNED_BATCH_SIZE if tuned else DEFAULT_BATCH_SIZE
        cap: int | None = None
        if spec is not None and (spec.io_bound or spec.hold):
            # PgQueuer refuses a cap below twice the batch size: shrink the batch to fit the
            # requested concurrency, and never go below the smallest legal cap (2).
            batch = max(1, min(batch, spec.concurrency // 2))
            cap = max(spec.concurrency, 2 * batch)
        heartbeat, dequeue = DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_DEQUEUE_TIMEOUT
        if tuned and self._recovery_mode():
            heartbeat, dequeue = TUNED_RECOVERY_HEARTBEAT_TIMEOUT, TUNED_RECOVERY_DEQUEUE_TIMEOUT
        return WorkerParams(batch, dequeue, heartbeat, cap)

    def done_count(self) -> int:
        """Completed jobs: PgQueuer deletes a finished job from ``pgqueuer`` and writes a
        ``successful`` row to ``pgqueuer_log`` in the same statement."""
        row = (
            self._probe()
            .execute("SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'")
            .fetchone()
        )
        assert row is not None
        return int(row[0])

    def settle(self) -> None:
        analyze(self._dsn)

    def maintain(self) -> dict[str, Any]:
        return vacuum_checkpoint(self._dsn)

    def in_flight(self, spec: WorkerSpec) -> str:
        params = self.worker_params(spec)
        cap = (
            "no cap on concurrent jobs"
            if params.max_concurrent_tasks is None
            else f"at most {params.max_concurrent_tasks:,} concurrent jobs"
        )
        return f"dequeue batch {params.batch_size:,}, {cap}"

    def claim_probe(self, spec: WorkerSpec | None = None) -> str:
        return (
            "PgQueuer's whole dequeue statement (its query builder's, select and UPDATE "
            "in one), at the worker's batch size; EXPLAIN ANALYZE, rolled back"
        )

    def recovery_bound_s(self) -> float:
        """The heartbeat goes stale (at most heartbeat_timeout after the kill), then the
        idle rescuer's next dequeue (at most dequeue_timeout later)."""
        settings = self.recovery_settings()  # the recovery workload's (recovery mode)
        return float(settings["heartbeat_timeout_s"]) + float(settings["dequeue_timeout_s"])

    def claim_statement_ms(self, spec: WorkerSpec | None = None) -> float | None:
        """EXPLAIN ANALYZE of the dequeue statement PgQueuer's own query builder renders
        for the parameters of a worker started with ``spec`` (without one: the last
        started workers', or the profile's before any), inside a transaction that is
        rolled back so nothing stays claimed."""
        if spec is not None:
            params = self.worker_params(spec)
        else:
            params = self._last_params or self.worker_params(None)
        query = QueryQueueBuilder().build_dequeue_query(
            batch_size=params.batch_size,
            entrypoints=[QueueEntrypoint(ENTRYPOINT)],
            concurrency_limits=[0],
            queue_manager_id=QueueManagerId(uuid.uuid4()),
            global_concurrency_limit=params.max_concurrent_tasks,
            heartbeat_timeout=timedelta(seconds=params.heartbeat_timeout),
        )
        statement = "EXPLAIN (ANALYZE, FORMAT JSON) " + query.sql.strip().rstrip(";")
        cx = self._probe()
        with cx.transaction(force_rollback=True):
            cursor = psycopg.RawCursor(cx)
            cursor.execute(statement, query.args)
            row = cursor.fetchone()
        assert row is not None
        return float(_plan_json(row[0])["Execution Time"])

    # -- recovery -------------------------------------------------------------------------

    def recovery_note(self) -> str:
        return (
            "A picked job carries a heartbeat that its worker refreshes every "
            "heartbeat_timeout/2. When the worker is SIGKILLed the heartbeat goes stale, and "
            "any other worker's dequeue re-picks jobs whose heartbeat is older than "
            "heartbeat_timeout (default 30 s, `pgq run --heartbeat-timeout`); an idle "
            "worker only runs that dequeue on its next poll, at most dequeue_timeout "
            "(default 30 s) later. No extra process or configuration is needed."
        )

    def recovery_settings(self) -> dict[str, Any]:
        if self.profile == "tuned":
            return {
                "heartbeat_timeout_s": TUNED_RECOVERY_HEARTBEAT_TIMEOUT,
                "dequeue_timeout_s": TUNED_RECOVERY_DEQUEUE_TIMEOUT,
                "source": "pgq run --heartbeat-timeout / --dequeue-timeout, shortest sane",
            }
        return {
            "heartbeat_timeout_s": DEFAULT_HEARTBEAT_TIMEOUT,
            "dequeue_timeout_s": DEFAULT_DEQUEUE_TIMEOUT,
            "source": "pgqueuer defaults",
        }

    # -- helpers --------------------------------------------------------------------------

    def _probe(self) -> psycopg.Connection[Any]:
        if self._probe_cx is None:
            raise RuntimeError("prepare() has not been called")
        return self._probe_cx

    def _require_queries(self) -> SyncQueries:
        if self._queries is None:
            raise RuntimeError("prepare() has not been called")
        return self._queries

    def _work_dir(self) -> Path:
        if self._env is None:
            raise RuntimeError("prepare() has not been called")
        return self._env.work_dir

    def _pgq_cli(self, command: str) -> None:
        """Run a ``pgq`` admin command against this system's database."""
        log = self._work_dir() / f"pgq-{command}.log"
        with log.open("ab") as out:
            subprocess.run(
                [sys.executable, "-m", "pgqueuer", "--pg-dsn", self._dsn, command],
                cwd=ROOT,
                env=_base_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                check=True,
            )

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        self._log_seq += 1
        log = self._work_dir() / f"pgqueuer-worker-{self._log_seq}.log"
        with log.open("ab") as out:
            return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _setting(value: Any, source: str) -> dict[str, Any]:
    return {"value": value, "source": source}


def _encode(job: Job) -> bytes:
    return json.dumps(job, separators=(",", ":")).encode()


def _plan_json(cell: Any) -> dict[str, Any]:
    """The top plan object of an ``EXPLAIN (FORMAT JSON)`` result cell."""
    plans = json.loads(cell) if isinstance(cell, str | bytes) else cell
    top: dict[str, Any] = plans[0]
    return top


def _base_env() -> dict[str, str]:
    """This process's environment, with the project root importable."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) if not path else f"{ROOT}{os.pathsep}{path}"
    return env


def _worker_env(spec: WorkerSpec, *, recovery: bool) -> dict[str, str]:
    env = _base_env()
    env[REC_DIR_ENV] = str(spec.rec_dir)
    env.pop(HOLD_ENV, None)
    env.pop(RECOVERY_ENV, None)
    if spec.hold:
        env[HOLD_ENV] = "1"
    if recovery:
        env[RECOVERY_ENV] = "1"
    return env
