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

(``--admin-dsn`` names the server to create it on; it is dropped afterwards, failed or not.)
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.probe import DEFAULT_ADMIN_DSN
from benchmarks.systems.base import create_database, drop_database
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


#: Queue ``small``'s cap and the tasks it holds before the timed submits: the room left
#: is the most submits to it that are not refused.
CAP = 1000
HELD = 10
ROOM = CAP - HELD


def _fill(store: Store, backlog: int) -> None:
    store.queue_create("big", max_concurrency=10, rate=0)
    store.queue_create("small", max_concurrency=10, rate=0, max_queued=CAP)
    store.queue_create("free", max_concurrency=10, rate=0)
    for start in range(0, backlog, 1000):
        n = min(1000, backlog - start)
        store.task_submit_many([TaskSpec(queue="big", handler="h") for _ in range(n)])
    store.task_submit_many([TaskSpec(queue="small", handler="h") for _ in range(HELD)])


def _median_ms(call: Callable[[], object], rounds: int) -> float:
    took = []
    for _ in range(rounds):
        began = time.perf_counter()
        call()
        took.append(time.perf_counter() - began)
    return round(statistics.median(took) * 1000, 2)


def _submits(store: Store, rounds: int) -> dict[str, float]:
    free = _median_ms(lambda: store.task_submit(TaskSpec(queue="free", handler="h")), rounds)
    capped = _median_ms(lambda: store.task_submit(TaskSpec(queue="small", handler="h")), rounds)
    return {"free": free, "capped": capped}


def _on_postgres(admin_dsn: str, backlog: int, rounds: int) -> dict[str, Any]:
    """The submits and the count's plan in a scratch database, dropped afterwards."""
    name = f"orbit_depthcost_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = create_database(admin_dsn, name)
    try:
        store = open_store(url)
        try:
            _fill(store, backlog)
            submits = _submits(store, rounds)
        finally:
            store.close()
        with psycopg.connect(url, autocommit=True) as cx:
            cx.execute("ANALYZE orbit_tasks")
            plan = [
                line
                for (line,) in cx.execute(
                    f"EXPLAIN (ANALYZE, BUFFERS) {COUNT.format(greatest='greatest')}"
                )
            ]
    finally:
        drop_database(admin_dsn, name)
    return {"backend": "postgres", "database": name, "submit_ms": submits, "plan": plan}


def _on_sqlite(backlog: int, rounds: int) -> dict[str, Any]:
    """The submits, the count's plan and one timed count in a scratch file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "orbit.db"
        store = open_store(f"sqlite:///{path}")
        try:
            _fill(store, backlog)
            submits = _submits(store, rounds)
        finally:
            store.close()
        cx = sqlite3.connect(path)
        try:
            count = COUNT.format(greatest="max")
            plan = [str(row) for row in cx.execute(f"EXPLAIN QUERY PLAN {count}").fetchall()]
            count_ms = _median_ms(lambda: cx.execute(count).fetchall(), 5)
        finally:
            cx.close()
    return {"backend": "sqlite", "submit_ms": submits, "plan": plan, "count_ms": count_ms}


def measure(
    *, backlog: int, rounds: int, postgres: bool = False, admin_dsn: str = DEFAULT_ADMIN_DSN
) -> dict[str, Any]:
    """Fill, then time ``rounds`` submits to each queue (their medians, in ms) and read
    the count's plan, in a scratch SQLite file or PostgreSQL database."""
    if backlog < 0 or not 1 <= rounds <= ROOM:
        raise ValueError(f"backlog must be non-negative and rounds from 1 to {ROOM}")
    out = _on_postgres(admin_dsn, backlog, rounds) if postgres else _on_sqlite(backlog, rounds)
    return {"backlog": backlog, "rounds": rounds} | out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=20, help=f"submits timed, at most {ROOM}")
    parser.add_argument("--postgres", action="store_true", help="a scratch PostgreSQL database")
    parser.add_argument(
        "--admin-dsn",
        default=DEFAULT_ADMIN_DSN,
        help="with --postgres: a DSN allowed to create databases",
    )
    args = parser.parse_args()
    out = measure(
        backlog=args.backlog, rounds=args.rounds, postgres=args.postgres, admin_dsn=args.admin_dsn
    )
    submits = out["submit_ms"]
    print(
        f"submit, median of {args.rounds}: no cap {submits['free']} ms, "
        f"capped {submits['capped']} ms"
    )
    for line in out["plan"]:
        print(line)
    if "count_ms" in out:
        print("count:", out["count_ms"], "ms")


if __name__ == "__main__":
    main()
