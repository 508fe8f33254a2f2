"""Orbit under test: a real ``orbit server`` process and ``orbit worker`` processes.

Jobs flow through Orbit's public surface, as a user would run it: ``orbit server`` and
``orbit worker`` processes, and ``orbit.Client`` to submit. Setting up (migrating the
schema, creating the token) uses ``orbit.store.open_store`` in-process, as the test suite
does. Only the measurements read the database directly (``done_count``,
``claim_statement_ms``) and ``reset`` empties it, so that a run costs no server round
trips and no server restart.

One deliberate non-default: the server always runs with ``--lease-ttl 5
--reap-interval 0.5`` (defaults 30 s and 1 s), so the recovery workload can be measured
without restarting the server between workloads. The only extra work this costs is one
renewal message per worker every 2.5 s and a reaper pass every 0.5 s; ``settings()``
says so in every result.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.systems.base import (
    Env,
    Job,
    System,
    WorkerSpec,
    analyze,
    create_database,
    drop_database,
    vacuum_checkpoint,
)
from orbit.store import StoreConfig

QUEUE = "bench"
HANDLER = "bench"
LEASE_TTL_S = 5.0
TUNED_CONCURRENCY = 1500
REAP_INTERVAL_S = 0.5
SUBMIT_BATCH_MAX = 1000  # the API's batch limit (POST /v1/tasks/batch)
#: The most one claim grants (``StoreConfig.max_batch``, the server's default): the
#: server offers a pushing worker min(its declared slots, this) at a time
#: (``orbit.server.gateway``'s ``_offer``), and with room in every queue and cap the
#: store reads exactly that many ready rows (``Store._claim``'s window is ``want``).
MAX_CLAIM = StoreConfig().max_batch
#: every table that holds jobs; queues, tokens, sessions and settings survive a reset
JOB_TABLES = [
    "orbit_artifact_chunks",
    "orbit_artifacts",
    "orbit_events",
    "orbit_attempts",
    "orbit_tasks",
]
REPO = Path(__file__).resolve().parents[2]


_PARAM_RE = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")


def _migrate_and_token(db_url: str) -> str:
    """Migrate the schema and create a token with every scope, in this process, as the
    test suite does (``orbit db migrate`` and ``orbit token create`` do the same, at a
    second or two of interpreter start-up each, which adds up in a smoke run)."""
    from orbit.store import open_store

    store = open_store(db_url)  # migrates
    try:
        _, token = store.token_create("bench", ["admin", "submit", "worker"])
    finally:
        store.close()
    return str(token)


def _named_query(path: Path, name: str) -> str | None:
    """One ``-- name:`` query from Orbit's queries.sql, or None if it is not there."""
    if not path.exists():
        return None
    match = re.search(rf"^-- name: {name}\s*$(.*?)(?=^-- name: |\Z)", path.read_text(), re.M | re.S)
    if match is None:
        return None
    body = "\n".join(ln for ln in match.group(1).splitlines() if not ln.startswith("--"))
    return body.strip().rstrip(";")


def _claim_params(now_us: int, window: int) -> dict[str, Any]:
    """Parameters of the ready-task select, as a worker with one handler would send them,
    reading ``window`` rows (``OrbitSystem.claim_window``)."""
    return {
        "now": now_us,
        "handlers": [HANDLER],
        "skip_queues": [],
        "skip_tenants": [],
        "skip_ids": [],
        "limit": window,
    }


#: How often ``reset`` tries its TRUNCATE before giving up.
RESET_TRIES = 5


def retry_deadlocks(call: Callable[[], object], tries: int = RESET_TRIES) -> None:
    """Run ``call`` until PostgreSQL does not pick it as a deadlock's victim. The TRUNCATE
    between runs locks the job tables one by one while the idle server's reaper may read
    them in another order: PostgreSQL then aborts one of the two, and a run was lost to
    it (a full-scale enqueue run, 2026-12-03). Nothing was truncated, so trying again is
    safe; any other error, or a deadlock on the last try, is raised."""
    for attempt in range(1, tries + 1):
        try:
            call()
            return
        except psycopg.errors.DeadlockDetected:
            if attempt == tries:
                raise


class OrbitSystem(System):
    """Orbit on PostgreSQL (``orbit-pg``) or on SQLite (``orbit-sqlite``)."""

    def __init__(self, backend: str = "postgres", profile: str = "defaults") -> None:
        if backend not in ("postgres", "sqlite"):
            raise ValueError("backend must be postgres or sqlite")
        if profile not in ("defaults", "tuned"):
            raise ValueError("profile must be defaults or tuned")
        self.backend = backend
        self.profile = profile
        base = "orbit-pg" if backend == "postgres" else "orbit-sqlite"
        self.name = base if profile == "defaults" else f"{base}-tuned"
        self.uses_postgres = backend == "postgres"
        self._env: Env | None = None
        self._db_url = ""
        self._dbname = ""
        self._sqlite_path: Path | None = None
        self._port = 0
        self._server: subprocess.Popen[bytes] | None = None
        self._client: Any = None  # orbit.Client, imported lazily
        self._pg: psycopg.Connection[Any] | None = None
        self._token_file: Path | None = None
        self._started = 0

    # ------------------------------------------------------------------ description

    def versions(self) -> dict[str, str]:
        found = {
            "orbit": metadata.version("orbit"),
            "python": sys.version.split()[0],
            "psycopg": metadata.version("psycopg"),
            "uvicorn": metadata.version("uvicorn"),
            "websockets": metadata.version("websockets"),
            "httpx": metadata.version("httpx"),
        }
        if self.backend == "sqlite":
            found["sqlite"] = sqlite3.sqlite_version
        return found

    def settings(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "profile": (
                "defaults: Orbit's own defaults, except the two server flags below"
                if self.profile == "defaults"
                else f"tuned: worker concurrency {TUNED_CONCURRENCY} (docs/worker.md, "
                "'Throughput'), except for the I/O-bound and recovery workloads, which set "
                "their own; server flags as below"
            ),
            "server": {
                "command": "orbit server --db … --port … --log-level warning "
                f"--lease-ttl {LEASE_TTL_S:g} --reap-interval {REAP_INTERVAL_S:g}",
                "lease_ttl_s": f"{LEASE_TTL_S:g} (default 30; set for every workload so the "
                "recovery workload needs no server restart)",
                "reap_interval_s": f"{REAP_INTERVAL_S:g} (default 1.0; same reason)",
                "other": "Orbit's defaults (poll interval 5 s, claim TTL 30 s, one node)",
            },
            "queue": {"name": QUEUE, "max_concurrency": 1_000_000, "rate": "0 (unlimited)"},
            "worker": {
                "command": "orbit worker benchmarks.systems.orbit_worker:worker",
                "handler": "async def (runs on the event loop)",
                "concurrency": "WorkerSpec.concurrency (orbit.Worker(concurrency=…))",
                "io_bound": (
                    "tuned: prefetch = concurrency (orbit.Worker(prefetch=…), docs/worker.md, "
                    "'Prefetch': many waiting handlers), so a handler's end starts a claimed "
                    "attempt at once rather than after the next claim"
                    if self.profile == "tuned"
                    else "no special mode: async handlers already overlap their sleeps"
                ),
                "prefetch": "the I/O-bound workload's concurrency when tuned, else 0 "
                "(Orbit's default)",
                "grace": "default (30 s)",
            },
            "submit": {
                "one": "Client.submit(queue, 'bench', payload, retry_safe=True)",
                "batch": f"Client.submit_many(≤{SUBMIT_BATCH_MAX} tasks), one call per batch"
                + (
                    ", reply='ids' (each task's id, not its whole view: docs/protocol.md, "
                    "'Batch submit')"
                    if self.profile == "tuned"
                    else " (each task's whole view in the reply, the default)"
                ),
                "retry_safe": True,
                "max_attempts": "default (3)",
            },
            "done_count": "SELECT count(*) FROM orbit_tasks WHERE state = 'succeeded'",
            "claim_statement": self.claim_probe(),
        }

    def recovery_note(self) -> str:
        return (
            "A worker that dies stops renewing its attempts' run lease. When the lease runs "
            f"out (--lease-ttl, {LEASE_TTL_S:g} s here) the reaper, which sleeps until the "
            "soonest lease or claim runs out (at most --reap-interval, "
            f"{REAP_INTERVAL_S:g} s here), marks the attempt lost and, for a task submitted "
            "retry_safe, schedules the next attempt, which any live worker claims at once. "
            "Target: every job recovered within lease TTL + 1 s of the kill."
        )

    def recovery_settings(self) -> dict[str, Any]:
        return {
            "lease_ttl_s": LEASE_TTL_S,
            "reap_interval_s": REAP_INTERVAL_S,
            "target_s": LEASE_TTL_S + 1.0,
        }

    def recovery_bound_s(self) -> float:
        """The lease runs out, then the reaper's next pass (a live worker claims at once)."""
        return LEASE_TTL_S + REAP_INTERVAL_S

    def in_flight(self, spec: WorkerSpec) -> str:
        slots = self._concurrency(spec)
        prefetch = self._prefetch(spec)
        text = f"{slots:,} slots"
        return text + (f" + {prefetch:,} prefetched" if prefetch else "")

    def own_pids(self) -> list[int]:
        return [self._server.pid] if self._server is not None else []

    # ------------------------------------------------------------------ lifecycle

    def prepare(self, env: Env) -> None:
        self._env = env
        env.work_dir.mkdir(parents=True, exist_ok=True)
        (env.work_dir / "logs").mkdir(exist_ok=True)
        if self.backend == "postgres":
            self._dbname = f"orbit_bench_{os.getpid()}_{uuid.uuid4().hex[:8]}"
            self._db_url = create_database(env.pg_admin_dsn, self._dbname)
            self._pg = psycopg.connect(self._db_url, autocommit=True)
        else:
            self._sqlite_path = (env.work_dir / "orbit.db").resolve()
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self._sqlite_path}{suffix}").unlink(missing_ok=True)
            self._db_url = f"sqlite:///{self._sqlite_path}"
        token = _migrate_and_token(self._db_url)
        self._token_file = env.work_dir / "token"
        fd = os.open(self._token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.chmod(self._token_file, 0o600)
        self._start_server()
        from orbit import Client

        self._client = Client(f"http://127.0.0.1:{self._port}", token, timeout=120)
        self._client.queue_create(QUEUE, max_concurrency=1_000_000, rate=0)

    def _start_server(self) -> None:
        """Start ``orbit server`` on a port it picks (``--port 0``; one picked here first
        could be taken before the server binds it), read that port from the line the
        server prints once it serves."""
        from orbit.cli.listening import announced_port

        assert self._env is not None
        log_path = self._env.work_dir / "logs" / "server.log"
        log = log_path.open("ab")
        start = log.tell()  # the log is appended to: the line is after this
        cmd = [
            sys.executable, "-m", "orbit.cli", "server",
            "--db", self._db_url,
            "--port", "0",
            "--node-id", "bench",
            "--log-level", "warning",
            "--lease-ttl", f"{LEASE_TTL_S:g}",
            "--reap-interval", f"{REAP_INTERVAL_S:g}",
        ]  # fmt: skip
        self._server = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        # Printed once the node serves: its store open, its port accepting.
        self._port = announced_port(self._server, log_path, start=start)

    def reset(self) -> None:
        """Empty every job table in place (TRUNCATE / DELETE): far cheaper than a new
        database, and the server holds no job state of its own between runs."""
        if self._pg is not None:
            pg = self._pg
            truncate = f"TRUNCATE {', '.join(JOB_TABLES)} RESTART IDENTITY CASCADE"
            retry_deadlocks(lambda: pg.execute(truncate))
            pg.execute("ANALYZE orbit_tasks")
            return
        with self._sqlite() as cx:
            cx.execute("BEGIN IMMEDIATE")
            for table in JOB_TABLES:
                cx.execute(f"DELETE FROM {table}")
            cx.execute("COMMIT")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._server is not None and self._server.poll() is None:
            self._server.terminate()
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        self._server = None
        if self._pg is not None:
            self._pg.close()
            self._pg = None
        if self._dbname and self._env is not None:
            drop_database(self._env.pg_admin_dsn, self._dbname)
            self._dbname = ""
        if self._sqlite_path is not None:  # a million-job backlog is worth deleting
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self._sqlite_path}{suffix}").unlink(missing_ok=True)

    # ------------------------------------------------------------------ jobs

    def enqueue(self, jobs: list[Job], batch: int) -> None:
        if batch <= 1:
            for job in jobs:
                self._client.submit(QUEUE, HANDLER, job, retry_safe=True)
            return
        size = min(batch, SUBMIT_BATCH_MAX)
        reply = "ids" if self.profile == "tuned" else "full"
        for i in range(0, len(jobs), size):
            self._client.submit_many(
                [
                    {"queue": QUEUE, "handler": HANDLER, "payload": job, "retry_safe": True}
                    for job in jobs[i : i + size]
                ],
                reply=reply,
            )

    def _concurrency(self, spec: WorkerSpec) -> int:
        """Tuned: docs/worker.md's advice for many short tasks (concurrency 1,500, so the
        runner's start/finish batches grow with the load); the workload's own figure where
        it asks for one (I/O-bound, recovery)."""
        if self.profile == "tuned" and not (spec.io_bound or spec.hold):
            return TUNED_CONCURRENCY
        return spec.concurrency

    def _prefetch(self, spec: WorkerSpec) -> int:
        """Tuned, I/O-bound only: as many attempts claimed ahead as run (docs/worker.md,
        'Prefetch': for many handlers that mostly wait). Not for the throughput workload,
        whose 1,500 slots already keep the batches full, nor for recovery."""
        if self.profile == "tuned" and spec.io_bound and not spec.hold:
            return spec.concurrency
        return 0

    def start_workers(
        self, spec: WorkerSpec, into: list[subprocess.Popen[bytes]] | None = None
    ) -> list[subprocess.Popen[bytes]]:
        assert self._env is not None and self._token_file is not None
        work_dir = self._env.work_dir
        env = {
            **os.environ,
            "ORBIT_URL": f"http://127.0.0.1:{self._port}",
            "ORBIT_TOKEN_FILE": str(self._token_file),
            "BENCH_CONCURRENCY": str(self._concurrency(spec)),
            "BENCH_PREFETCH": str(self._prefetch(spec)),
            "BENCH_REC_DIR": str(spec.rec_dir),
            "BENCH_HOLD": "1" if spec.hold else "0",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        env.pop("ORBIT_TOKEN", None)

        def start_one() -> subprocess.Popen[bytes]:
            self._started += 1
            env["BENCH_WORKER_NAME"] = f"bench-{self._started}"
            cmd = [
                sys.executable, "-m", "orbit.cli", "worker",
                "benchmarks.systems.orbit_worker:worker",
            ]  # fmt: skip
            with (work_dir / "logs" / f"worker-{self._started}.log").open("ab") as log:
                return subprocess.Popen(
                    cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
                )

        return self._start_each(spec.processes, into, start_one)

    # ------------------------------------------------------------------ measurements

    @contextmanager
    def _sqlite(self) -> Iterator[sqlite3.Connection]:
        """A short-lived autocommit connection: no read snapshot outlives one call."""
        assert self._sqlite_path is not None
        cx = sqlite3.connect(self._sqlite_path, isolation_level=None, timeout=30)
        try:
            cx.execute("PRAGMA busy_timeout = 30000")
            yield cx
        finally:
            cx.close()

    def done_count(self) -> int:
        sql = "SELECT count(*) FROM orbit_tasks WHERE state = 'succeeded'"
        if self._pg is not None:
            row = self._pg.execute(sql).fetchone()
        else:
            with self._sqlite() as cx:
                row = cx.execute(sql).fetchone()
        return int(row[0]) if row else 0

    def settle(self) -> None:
        analyze(self._db_url)

    def maintain(self) -> dict[str, Any]:
        return vacuum_checkpoint(self._db_url)

    def claim_window(self, spec: WorkerSpec | None) -> int:
        """The ready rows a claim reads for a worker started with ``spec`` (None: the
        scale-independent default worker, 10 slots) on an idle start: every slot it
        declares (its concurrency and prefetch) is free, the server offers
        min(slots, ``MAX_CLAIM``), and with room in every queue and cap (the benchmark's
        queue has no cap and no rate) the store reads exactly that many (``want``)."""
        spec = spec if spec is not None else WorkerSpec(1, 10, Path("."))
        return min(self._concurrency(spec) + self._prefetch(spec), MAX_CLAIM)

    def claim_probe(self, spec: WorkerSpec | None = None) -> str:
        """What ``claim_statement_ms(spec)`` times, at the window it reads for ``spec``."""
        how = "EXPLAIN ANALYZE" if self.uses_postgres else "timed"
        return (
            f"the ready-task select alone (task_ready_select, orbit/store/{self.backend}/"
            f"queries.sql; {how}, rolled back) at LIMIT {self.claim_window(spec):,}, the rows "
            "the claim of this profile's worker reads; not the claim's writes, which Orbit sends "
            "with its COMMIT in one round trip and cannot be run apart and rolled back"
        )

    def claim_statement_ms(self, spec: WorkerSpec | None = None) -> float | None:
        """The median of 5 executions of the ready-task select every claim runs (the
        first of 6 only warms the cache), on the current backlog, rolled back, reading as
        many rows as the claim of a worker started with ``spec`` (``claim_window``)."""
        path = REPO / "orbit" / "store" / self.backend / "queries.sql"
        sql = _named_query(path, "task_ready_select")
        if sql is None:
            return None
        params = _claim_params(time.time_ns() // 1000 + 1_000_000, self.claim_window(spec))
        if set(_PARAM_RE.findall(sql)) - params.keys():
            return None  # the query changed shape: better no number than a wrong one
        timings = [self._time_claim(sql, params) for _ in range(6)][1:]
        return statistics.median(timings)

    def _time_claim(self, sql: str, params: dict[str, Any]) -> float:
        if self._pg is not None:
            text = _PARAM_RE.sub(r"%(\1)s", sql.replace("%", "%%"))
            elapsed = 0.0
            with self._pg.transaction() as tx:
                row = self._pg.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {text}", params).fetchone()
                assert row is not None
                plan = row[0][0] if isinstance(row[0], list) else row[0]
                elapsed = float(plan["Execution Time"])
                raise psycopg.Rollback(tx)  # EXPLAIN ANALYZE really locked the rows
            return elapsed
        encoded = {k: json.dumps(v) if isinstance(v, list) else v for k, v in params.items()}
        with self._sqlite() as cx:
            cx.execute("BEGIN")
            t0 = time.perf_counter()
            cx.execute(sql, encoded).fetchall()
            elapsed = (time.perf_counter() - t0) * 1000
            cx.execute("ROLLBACK")
        return elapsed
