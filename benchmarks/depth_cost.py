"""What a submit to a capped queue (``max_queued``) costs when other queues hold a backlog.

The depth count (``queue_depth`` in ``queries.sql``) walks ``orbit_tasks_ready`` (every
waiting task of every queue, by priority and id), filtering by queue, and stops only
once it has found enough of the queue's own tasks to refuse. A queue below its cap is
therefore counted past the whole backlog of the other queues. This makes ``--backlog``
waiting tasks in queue ``big``, a few in ``small`` (capped at 1000) and none in ``free``
(no cap), then times single submits to each (the median of ``--rounds``) and prints the
count statement's plan (PostgreSQL: ``EXPLAIN ANALYZE``; SQLite: its query plan and one
timed run).

    python -m benchmarks.depth_cost --backlog 200000            # SQLite, in a scratch file
    python -m benchmarks.depth_cost --backlog 200000 --postgres  # a scratch database
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

from orbit.core.model import TaskSpec
from orbit.store import Store, open_store

#: ``queue_depth`` as ``queries.sql`` has it, for queue ``small`` adding one task (the
#: LIMIT from a subquery, as there: a constant one is planned otherwise).
COUNT = """SELECT max_queued, (SELECT count(*) FROM (
    SELECT 1 FROM orbit_tasks WHERE queue = 'small' AND state IN ('queued', 'scheduled')
    ORDER BY priority DESC, id
    LIMIT (SELECT {greatest}(coalesce(max(max_queued), 0), 0) FROM orbit_queues
           WHERE name = 'small')) AS w) AS depth
FROM orbit_queues WHERE name = 'small'"""


def _fill(store: Store, backlog: int) -> None:
    store.queue_create("big", max_concurrency=10, rate=0)
    store.queue_create("small", max_concurrency=10, rate=0, max_queued=1000)
    store.queue_create("free", max_concurrency=10, rate=0)
    for start in range(0, backlog, 1000):
        n = min(1000, backlog - start)
        store.task_submit_many([TaskSpec(queue="big", handler="h") for _ in range(n)])
    store.task_submit_many([TaskSpec(queue="small", handler="h") for _ in range(10)])


def _median_ms(call: Callable[[], object], rounds: int) -> float:
    took = []
    for _ in range(rounds):
        began = time.perf_counter()
        call()
        took.append(time.perf_counter() - began)
    return round(statistics.median(took) * 1000, 2)


def _submits(store: Store, rounds: int) -> str:
    free = _median_ms(lambda: store.task_submit(TaskSpec(queue="free", handler="h")), rounds)
    capped = _median_ms(lambda: store.task_submit(TaskSpec(queue="small", handler="h")), rounds)
    return f"submit, median of {rounds}: no cap {free} ms, capped {capped} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--postgres", action="store_true", help="a scratch PostgreSQL database")
    args = parser.parse_args()
    if args.postgres:
        from tests.pg import as_url, temporary_database

        with temporary_database("orbit_bench") as dsn:
            store = open_store(as_url(dsn))
            _fill(store, args.backlog)
            print(_submits(store, args.rounds))
            store.close()
            with psycopg.connect(dsn, autocommit=True) as cx:
                cx.execute("ANALYZE orbit_tasks")
                for (line,) in cx.execute(
                    f"EXPLAIN (ANALYZE, BUFFERS) {COUNT.format(greatest='greatest')}"
                ):
                    print(line)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "orbit.db"
        store = open_store(f"sqlite:///{path}")
        _fill(store, args.backlog)
        print(_submits(store, args.rounds))
        store.close()
        with sqlite3.connect(path) as cx:
            count = COUNT.format(greatest="max")
            print(cx.execute(f"EXPLAIN QUERY PLAN {count}").fetchall())
            print("count:", _median_ms(lambda: cx.execute(count).fetchall(), 5), "ms")


if __name__ == "__main__":
    main()
