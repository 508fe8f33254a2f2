"""The one interface every system under test implements.

The harness (``benchmarks/harness.py``) drives a system only through this class, so each
workload is written once and runs unchanged against Orbit and every peer. A system
lives in the harness process; its workers are separate OS processes that run the
shared handler body from :mod:`benchmarks.recorder`.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Job = dict[str, Any]  # the payload described in benchmarks.recorder


@dataclass
class Env:
    """What the harness hands a system when it prepares it."""

    pg_admin_dsn: str  # a DSN to the local PostgreSQL that may CREATE/DROP DATABASE
    redis_url: str  # e.g. redis://127.0.0.1:6379/<db>
    work_dir: Path  # a private scratch directory for this system (SQLite files, logs)
    #: a Redis system may flush its database although it holds keys (else it refuses)
    flush_redis: bool = False


@dataclass
class WorkerSpec:
    """How to start worker processes for one workload."""

    processes: int  # number of OS processes
    concurrency: int  # jobs in flight per process
    rec_dir: Path  # exported to the workers as BENCH_REC_DIR
    hold: bool = False  # export BENCH_HOLD=1 (the recovery victim)
    io_bound: bool = False  # the jobs sleep: use the system's documented I/O-bound mode


class System(ABC):
    """One queue under test. Methods are called in this order:
    ``prepare`` once; then per run ``reset`` → ``enqueue``/``start_workers`` →
    ``done_count`` polls → ``stop_workers``; ``close`` once at the end."""

    #: short stable name used in the JSON and the tables, e.g. "orbit-pg"
    name: str
    #: "defaults" or "tuned": which settings this instance uses (see ``settings``)
    profile: str = "defaults"
    #: the systems that have a PostgreSQL table to measure a claim statement on
    uses_postgres: bool = True

    @abstractmethod
    def versions(self) -> dict[str, str]:
        """Package versions (the system's and its driver's)."""

    @abstractmethod
    def settings(self) -> dict[str, Any]:
        """Every setting that affects speed, and where it comes from (defaults / docs)."""

    @abstractmethod
    def prepare(self, env: Env) -> None:
        """Create a fresh database (or Redis db) and schema; start any server process."""

    @abstractmethod
    def reset(self) -> None:
        """Remove every job and result, so the next run starts from an empty queue."""

    @abstractmethod
    def enqueue(self, jobs: list[Job], batch: int) -> None:
        """Enqueue ``jobs`` through the system's documented client API, ``batch`` at a
        time (1 = one call per job). Returns when every job is durably queued."""

    def enqueue_one(self, job: Job) -> None:
        """Enqueue a single job (the latency workload calls this at a fixed rate)."""
        self.enqueue([job], 1)

    @abstractmethod
    def start_workers(
        self, spec: WorkerSpec, into: list[subprocess.Popen[bytes]] | None = None
    ) -> list[subprocess.Popen[bytes]]:
        """Start ``spec.processes`` worker processes and return at once (not when they are
        ready: start-up counts in the "including start-up" figure).

        Each is appended to ``into`` (the caller's list, which is returned) the moment
        it is started, through ``_start_each``: a caller whose start is interrupted
        part-way (Ctrl-C, SIGTERM) still holds, and stops, every worker already running
        (``benchmarks.workloads.running``)."""

    @staticmethod
    def _start_each(
        n: int,
        into: list[subprocess.Popen[bytes]] | None,
        start_one: Callable[[], subprocess.Popen[bytes]],
    ) -> list[subprocess.Popen[bytes]]:
        """Start ``n`` workers with ``start_one``, each appended to ``into`` (or a new
        list) as soon as it runs; returns that list (``start_workers``). Ctrl-C and
        SIGTERM wait until the worker being started is in the list (``_signals_held``)."""
        procs = [] if into is None else into
        for _ in range(n):
            with _signals_held():
                procs.append(start_one())
        return procs

    def stop_workers(self, procs: list[subprocess.Popen[bytes]]) -> None:
        """Stop workers: SIGTERM, wait up to 10 s, then SIGKILL; always reap."""
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    @abstractmethod
    def done_count(self) -> int:
        """How many jobs the system itself records as durably completed (succeeded).
        A system with no durable completion record returns -1, and the harness falls
        back to the handlers' own records."""

    def settle(self) -> None:
        """Bring the planner's statistics up to date after a bulk enqueue, as autovacuum's
        ANALYZE would on a default server (this machine's PostgreSQL runs with autovacuum
        off, and a claim planned without statistics can sort the whole queue). The harness
        calls it outside every timed phase, for every system alike. Systems without a
        query planner (Celery on Redis) have nothing to do."""
        return None

    def maintain(self) -> dict[str, Any]:
        """After a bulk fill (the backlog workload's large queue) and after each top-up
        of it, untimed: VACUUM ANALYZE the system's own database and CHECKPOINT
        (``vacuum_checkpoint``), so no timed run meets a freshly written table without
        its visibility map or pays for the fill's (or the last run's) dirty pages.
        Returns what was done. The default only brings the statistics up to
        date (``settle``): a system without a database (Celery on Redis) has nothing
        more to do."""
        self.settle()
        return {"settle": True}

    def claim_statement_ms(self, spec: WorkerSpec | None = None) -> float | None:
        """Time of one claim statement on the current backlog (EXPLAIN ANALYZE of the
        system's own claim query) as a worker started with ``spec`` would run it, or
        None where that does not apply."""
        return None

    def claim_probe(self, spec: WorkerSpec | None = None) -> str:
        """What ``claim_statement_ms(spec)`` times, in a few words, for the report."""
        return ""

    def in_flight(self, spec: WorkerSpec) -> str:
        """How many jobs one worker process started with ``spec`` holds at once, in this
        system's own terms (its slots, its fetch batch, its pool times its prefetch),
        as its settings make it: the report's captions say it for every system."""
        return f"{spec.concurrency:,} slots"

    def own_pids(self) -> list[int]:
        """Processes the system keeps running between runs (a server), not its workers:
        the CPU accounting of another system's run leaves them out."""
        return []

    def recovery_note(self) -> str:
        """The system's documented behaviour when a worker dies holding jobs."""
        return ""

    def recovery_settings(self) -> dict[str, Any]:
        """Settings the recovery workload uses (e.g. lease TTL); {} if none."""
        return {}

    def recovery_bound_s(self) -> float | None:
        """The longest the system's documented recovery, as configured for the recovery
        workload, may take after the kill (every timeout and poll it waits for, added),
        or None when held jobs are never recovered. The harness sets the recovery cap
        above the largest of these in the run, so no system's recovery is cut short."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Stop everything started in ``prepare`` and drop the database."""


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held over the block, then delivered to the handlers they would
    have reached: an interrupt inside ``Popen`` (after its fork, before it returns) would
    otherwise leave a running worker no list holds. Only the main thread receives
    signals and may set handlers: elsewhere (``--parallel``'s threads) a no-op."""
    wanted = (signal.SIGINT, signal.SIGTERM)
    # None: a handler set outside Python, which could not be put back
    restorable = all(signal.getsignal(s) is not None for s in wanted)
    if threading.current_thread() is not threading.main_thread() or not restorable:
        yield
        return
    caught: list[int] = []
    before = {s: signal.signal(s, lambda signum, _frame: caught.append(signum)) for s in wanted}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if caught:
            signal.raise_signal(caught[0])


#: every peer runs twice: with its own defaults, and tuned as its docs recommend
PROFILES = ("defaults", "tuned")


class PeerSystem(System):
    """A peer queue in its ``defaults`` or ``tuned`` profile.

    ``recovery`` switches on the recovery settings the peer's docs describe, and so does
    starting a hold worker (the recovery workload's victim) in the current run; ``reset``
    forgets that again (``_forget_hold``).
    """

    def __init__(self, profile: str = "defaults", recovery: bool = False) -> None:
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, not {profile!r}")
        self.profile = profile
        self.recovery = recovery
        self._hold_seen = False
        self._env: Env | None = None

    def _note_workers(self, spec: WorkerSpec) -> None:
        """Call first in ``start_workers``: a hold worker means recovery mode."""
        if spec.hold:
            self._hold_seen = True

    def _forget_hold(self) -> None:
        self._hold_seen = False

    def _recovery_mode(self) -> bool:
        return self.recovery or self._hold_seen

    def _require_env(self) -> Env:
        if self._env is None:
            raise RuntimeError("prepare() has not been called")
        return self._env


class PostgresPeer(PeerSystem):
    """A peer that keeps its queue in a PostgreSQL database of its own, created in
    ``prepare`` (``_create_database``) and dropped in ``close`` (``_drop_database``)."""

    def __init__(self, profile: str = "defaults", recovery: bool = False) -> None:
        super().__init__(profile, recovery)
        self._admin_dsn = ""
        self._dbname = ""
        self._dsn = ""

    def _create_database(self, env: Env, prefix: str) -> None:
        import os
        import secrets

        self._admin_dsn = env.pg_admin_dsn
        self._dbname = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
        self._dsn = create_database(self._admin_dsn, self._dbname)

    def _drop_database(self) -> None:
        if self._dbname:
            drop_database(self._admin_dsn, self._dbname)
            self._dbname = ""


def analyze(url: str) -> None:
    """ANALYZE a system's whole database (PostgreSQL URL/DSN or ``sqlite:///path``)."""
    if url.startswith("sqlite:///"):
        import sqlite3

        cx = sqlite3.connect(url.removeprefix("sqlite:///"))
        try:
            cx.execute("ANALYZE")
        finally:
            cx.close()
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as cx:
        cx.execute("ANALYZE")


def vacuum_checkpoint(url: str) -> dict[str, Any]:
    """VACUUM ANALYZE a system's whole database, then CHECKPOINT (PostgreSQL; best
    effort: only a superuser or a member of pg_checkpoint may), so the vacuum's own writes
    are flushed too; on SQLite (``sqlite:///path``) ANALYZE and a TRUNCATE checkpoint of
    its write-ahead log. Returns the seconds each step took."""
    import time

    done: dict[str, Any] = {}
    if url.startswith("sqlite:///"):
        import sqlite3

        cx = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None, timeout=60)
        try:
            cx.execute("PRAGMA busy_timeout = 60000")
            t0 = time.perf_counter()
            cx.execute("ANALYZE")
            done["analyze_s"] = round(time.perf_counter() - t0, 3)
            t0 = time.perf_counter()
            row = cx.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            done["wal_checkpoint_s"] = round(time.perf_counter() - t0, 3)
            done["wal_checkpoint"] = list(row) if row else None  # (busy, log, checkpointed)
        finally:
            cx.close()
        return done
    import psycopg

    with psycopg.connect(url, autocommit=True) as cx:
        t0 = time.perf_counter()
        cx.execute("VACUUM ANALYZE")
        done["vacuum_analyze_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        try:
            cx.execute("CHECKPOINT")
        except psycopg.errors.InsufficientPrivilege as exc:
            done["checkpoint"] = f"not allowed: {exc}"
        else:
            done["checkpoint_s"] = round(time.perf_counter() - t0, 3)
    return done


def create_database(admin_dsn: str, dbname: str) -> str:
    """Create ``dbname`` on the admin DSN's server; return a ``postgresql://`` URL for it
    (a URL, because asyncpg, which PgQueuer's workers use, reads nothing else)."""
    from urllib.parse import quote

    import psycopg
    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict

    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    params = conninfo_to_dict(admin_dsn)
    auth = quote(str(params.get("user", "postgres")), safe="")
    if params.get("password"):
        auth += ":" + quote(str(params["password"]), safe="")
    host = quote(str(params.get("host", "127.0.0.1")), safe="")
    port = params.get("port", "5432")
    return f"postgresql://{auth}@{host}:{port}/{quote(dbname, safe='')}"


def drop_database(admin_dsn: str, dbname: str) -> None:
    """Drop ``dbname``, ending any connection a killed worker may have left behind."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
        )
