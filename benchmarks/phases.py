"""The drain's three store transactions in one process: fill N tasks, then claim, start
and finish them 200 at a time through ``Store`` (no server, no worker), on PostgreSQL or
SQLite. It answers "did a change make a claim, start or finish cheaper in this process?"
with figures a shared machine moves little:

    python -m benchmarks.phases --backend postgres --tasks 10000          # µs of CPU a task
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.before \\
        python -m benchmarks.phases --backend postgres --tasks 2000 --stop claim
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.after \\
        python -m benchmarks.phases --backend postgres --tasks 2000 --stop start

Each phase's CPU is the calling thread's (``time.thread_time``): PostgreSQL's own work is
not in it. Under callgrind a phase's instructions are the difference between a run that
stops before it and one that stops after it (``--stop``: the last phase run), divided by
the tasks. The leases are an hour long, so a slow run (callgrind's) expires none. The
garbage collector is tuned as the server tunes it (``orbit.gctune``)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.systems.base import create_database, drop_database
from orbit.core.model import SECOND, Capability, Outcome, TaskSpec
from orbit.gctune import tune_for_throughput
from orbit.store import Store, StoreConfig, open_store

DEFAULT_ADMIN_DSN = os.environ.get("BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
PHASES = ("fill", "claim", "start", "finish")
BATCH = 200
FILL_BATCH = 1000


@contextmanager
def store_url(backend: str, admin_dsn: str) -> Iterator[str]:
    """A fresh database for one run, dropped (or deleted) after it."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="orbit-phases-") as where:
            yield f"sqlite:///{Path(where) / 'orbit.db'}"
        return
    name = f"orbit_phases_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = create_database(admin_dsn, name)
    try:
        yield url
    finally:
        drop_database(admin_dsn, name)


def _phases(store: Store, tasks: int, stop: str) -> dict[str, float]:
    """Run the phases up to ``stop``; each one's thread CPU in µs a task."""
    spent: dict[str, float] = {}

    def timed(phase: str, work: Callable[[], None]) -> bool:
        started = time.thread_time()
        work()
        spent[phase] = (time.thread_time() - started) * 1e6 / tasks
        return phase != stop

    store.queue_create("q", max_concurrency=tasks, rate=0)
    session, _ = store.session_open(
        name="w", node_id="n", capabilities=[Capability("h", tasks)], max_concurrency=tasks
    )
    attempts: list[tuple[str, int]] = []

    def fill() -> None:
        for at in range(0, tasks, FILL_BATCH):
            count = min(FILL_BATCH, tasks - at)
            store.task_submit_many(
                [TaskSpec(queue="q", handler="h", payload={"n": at + i}) for i in range(count)]
            )

    def claim() -> None:
        while len(attempts) < tasks:
            grants = store.attempt_claim_many(session.id, session.epoch, BATCH)
            assert grants, "nothing left to claim"
            attempts.extend((g.attempt.id, g.attempt.fence) for g in grants)

    def start() -> None:
        for at in range(0, tasks, BATCH):
            for answer in store.attempt_start_many(
                session.id, session.epoch, attempts[at : at + BATCH]
            ):
                assert not isinstance(answer, Exception), answer

    def finish() -> None:
        for at in range(0, tasks, BATCH):
            items = [(a, f, Outcome.success(None)) for a, f in attempts[at : at + BATCH]]
            for answer in store.attempt_finish_many(session.id, session.epoch, items):
                assert not isinstance(answer, Exception), answer

    for phase, work in zip(PHASES, (fill, claim, start, finish), strict=True):
        if not timed(phase, work):
            break
    return spent


def run(
    backend: str,
    tasks: int,
    stop: str = "finish",
    admin_dsn: str = DEFAULT_ADMIN_DSN,
    *,
    tune_gc: bool = True,
) -> dict[str, float]:
    """One run on a fresh database: each phase's thread CPU in µs a task, up to ``stop``.
    ``tune_gc``: the collector as the server sets it (for good: a test's process
    keeps its own)."""
    hour = 3600 * SECOND
    config = StoreConfig(claim_ttl_us=hour, lease_ttl_us=hour, session_ttl_us=hour)
    with store_url(backend, admin_dsn) as url:
        store = open_store(url, config)
        try:
            if tune_gc:
                tune_for_throughput()
            return _phases(store, tasks, stop)
        finally:
            store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--stop", choices=PHASES, default="finish", help="the last phase run")
    parser.add_argument("--admin-dsn", default=DEFAULT_ADMIN_DSN)
    args = parser.parse_args()
    if args.tasks < 1:
        parser.error("--tasks must be at least 1")
    spent = run(args.backend, args.tasks, args.stop, args.admin_dsn)
    print(json.dumps({"backend": args.backend, "tasks": args.tasks, "us_a_task": spent}))


if __name__ == "__main__":
    main()
