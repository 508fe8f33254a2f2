"""Each peer system end to end on a handful of jobs: its own schema, its documented
enqueue (one call per job, and batches), one real worker process running the shared
handler body, its own completion record, and a clean teardown.

It asserts what happened, never how fast: the numbers of a run on a shared machine mean
nothing. Waits poll with a deadline instead of sleeping a fixed time.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import redis

from benchmarks.recorder import RecordReader
from benchmarks.systems.base import Env, Job, System, WorkerSpec
from benchmarks.systems.celery_system import CelerySystem
from benchmarks.systems.pgqueuer_system import PgQueuerSystem
from benchmarks.systems.procrastinate_system import ProcrastinateSystem
from tests.pg import ADMIN_DSN

JOBS = 20
DEADLINE_S = 60.0
POLL_S = 0.05
#: a Redis database of its own, away from the ones the harness reserves (1 and up)
REDIS_URL = os.environ.get("BENCH_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")

PEERS: dict[str, Callable[[str], System]] = {
    "pgqueuer": PgQueuerSystem,
    "procrastinate": ProcrastinateSystem,
    "celery": CelerySystem,
}
#: the fixture's cases: each peer, plus PgQueuer on its psycopg driver (the fallback when
#: asyncpg is not installed) next to the default one
CASES = [*sorted(PEERS), "pgqueuer-psycopg"]


def _jobs(n: int) -> list[Job]:
    """No-op jobs; every other one asks for a start record, so the records show that each
    payload reached its handler whole."""
    now = time.time()
    jobs: list[Job] = []
    for i in range(n):
        job: Job = {"id": uuid.uuid4().hex, "t": now + i / 1000, "kind": "noop", "ms": 0}
        if i % 2:
            job["mark_start"] = True
        jobs.append(job)
    return jobs


def _bench_databases(peer: str) -> set[str]:
    """This process's databases of ``peer`` (the systems name them bench_<peer>_<pid>_*)."""
    pattern = f"bench_{peer}_{os.getpid()}_%"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as cx:
        rows = cx.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s", (pattern,)
        ).fetchall()
    return {r[0] for r in rows}


def _wait_finished(
    system: System, reader: RecordReader, ids: set[str], procs: list[subprocess.Popen[bytes]]
) -> set[str]:
    """Poll until the system (or, without a durable record, the handlers) reports every
    job done; fail at the deadline, or early if a worker died."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        reader.poll()
        finished = {r.job_id for r in reader.finished()}
        done = system.done_count()
        if done == -1:
            done = len(finished & ids)
        if done >= len(ids) and ids <= finished:
            return finished
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, f"a worker exited early (done {done}/{len(ids)})"
        assert time.monotonic() < deadline, f"only {done}/{len(ids)} done after {DEADLINE_S} s"
        time.sleep(POLL_S)


@pytest.fixture(params=CASES)
def peer(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, System]]:
    """A prepared peer (defaults profile) that is closed, and checked gone, afterwards."""
    name, _, variant = str(request.param).partition("-")
    system = PEERS[name]("defaults")
    if variant:
        assert isinstance(system, PgQueuerSystem)
        system.driver = variant
    before = _bench_databases(name)
    system.prepare(Env(ADMIN_DSN, REDIS_URL, tmp_path / "work"))
    try:
        yield name, system
    finally:
        system.close()
    if system.uses_postgres:
        assert _bench_databases(name) == before, "close() left the database behind"
    else:
        assert redis.Redis.from_url(REDIS_URL).dbsize() == 0, "close() left keys behind"


@pytest.mark.parametrize("batch", [1, 10])
def test_peer_runs_jobs_end_to_end(peer: tuple[str, System], batch: int, tmp_path: Path) -> None:
    name, system = peer
    if system.uses_postgres:
        assert len(_bench_databases(name)) == 1, "prepare() created no database"
    system.reset()
    jobs = _jobs(JOBS)
    ids = {j["id"] for j in jobs}

    system.enqueue(jobs, batch)
    assert system.done_count() in (0, -1)
    claim_ms = system.claim_statement_ms()
    assert (claim_ms is None) == (not system.uses_postgres)
    assert claim_ms is None or claim_ms >= 0

    rec_dir = tmp_path / "rec"
    rec_dir.mkdir()
    reader = RecordReader(rec_dir)
    procs = system.start_workers(WorkerSpec(processes=1, concurrency=4, rec_dir=rec_dir))
    try:
        assert len(procs) == 1
        finished = _wait_finished(system, reader, ids, procs)
    finally:
        system.stop_workers(procs)
    assert all(p.poll() is not None for p in procs)

    records = [r for r in reader.finished() if r.job_id in ids]
    assert finished == ids and len(records) == JOBS, "each job ran exactly once"
    sent = {j["id"]: j["t"] for j in jobs}
    assert all(abs(r.enqueued - sent[r.job_id]) < 1e-5 for r in records), "payload altered"
    marked = {j["id"] for j in jobs if j.get("mark_start")}
    assert {r.job_id for r in reader.started()} == marked, "payload altered"
    assert system.done_count() in (JOBS, -1)


def test_peers_describe_themselves() -> None:
    """Versions, settings and the recovery story are there for every profile, without a
    database (the report prints them even for a run that failed)."""
    for cls in PEERS.values():
        for profile in ("defaults", "tuned"):
            system = cls(profile)
            assert system.profile == profile
            assert all(system.versions().values())
            settings = system.settings()
            assert settings["profile"] == profile and len(settings) > 3
            assert system.recovery_note()
            assert system.recovery_settings()
        with pytest.raises(ValueError):
            cls("fast")
