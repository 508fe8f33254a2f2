"""What writing an event costs PostgreSQL, schema against schema, without the rest of Orbit.

A whole drain (``benchmarks.probe``) moves by several percent from run to run on a
shared machine, more than one index entry an event costs. This measures only the
statement every state change ends with (``event_insert_many``, as in
``queries.sql``) against scratch databases that differ only in the event table's
schema, the databases taking turns statement by statement, and reads the CPU time of
the database backend that ran each insert (``/proc/<pid>/schedstat``: nanoseconds on CPU,
so a busy neighbour adds waiting, not CPU) and the WAL the statement wrote
(``EXPLAIN (ANALYZE, WAL)``, per statement, so other writers on the cluster do not count).

Each task's life writes four events (submitted, claimed, started, succeeded), one kind at
a time in a transaction of ``--batch`` tasks, as a drain's batches do. The server must be
on this host (the backend's ``/proc`` entry is read).

    python -m benchmarks.event_cost --dsn postgresql://postgres@127.0.0.1/postgres
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import uuid
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.systems.base import create_database, drop_database

MIGRATIONS = Path(__file__).resolve().parent.parent / "orbit/store/postgres/migrations"
BEFORE = sorted(p for p in MIGRATIONS.glob("*.sql") if p.name < "0008")
INSERT = """
INSERT INTO orbit_events (at, kind, task_id, attempt_id, session_id, queue, tenant,
    task_from, task_to, attempt_from, attempt_to, code, data)
SELECT at, kind, task_id, attempt_id, session_id, queue, tenant, task_from, task_to,
    attempt_from, attempt_to, code, data
FROM json_to_recordset(CAST(%s AS json)) AS x(
    at bigint, kind text, task_id text, attempt_id text, session_id text, queue text,
    tenant text, task_from text, task_to text, attempt_from text, attempt_to text,
    code text, data text)
RETURNING id"""

XID_COLUMN = """
ALTER TABLE orbit_events ADD COLUMN xid xid8 NOT NULL DEFAULT '0';
ALTER TABLE orbit_events ALTER COLUMN xid SET DEFAULT pg_current_xact_id();
"""
#: Each schema: the SQL run on a database migrated to 0007.
SCHEMAS: dict[str, str] = {
    # the log before the gap-free feed
    "0007": "",
    # the xid column alone: what its default and its 8 bytes cost
    "column": XID_COLUMN,
    # and the (xid, id) index, the task index left as it was
    "xid-index": XID_COLUMN + "CREATE INDEX orbit_events_xid ON orbit_events (xid, id);",
    # 0008 as first merged (cf87847): the (xid, id) index, the task index on (task_id, xid, id)
    "0008-cf87847": XID_COLUMN
    + """
CREATE INDEX orbit_events_xid ON orbit_events (xid, id);
DROP INDEX orbit_events_task;
CREATE INDEX orbit_events_task ON orbit_events (task_id, xid, id) WHERE task_id IS NOT NULL;""",
    # 0008 as it is now
    "0008": (MIGRATIONS / "0008_event_xid.sql").read_text(),
}


def _task_events(task: str, attempt: str, session: str, now: int) -> list[list[dict[str, Any]]]:
    """One task's four events, as event rows, one list per stage."""
    base = {"task_id": task, "queue": "default", "tenant": "default", "code": None, "at": now}
    base |= {"attempt_from": None, "attempt_to": None, "attempt_id": None, "session_id": None}
    digest = "sha256:" + "ab" * 32
    return [
        [
            base
            | {"kind": "submitted", "task_from": None, "task_to": "queued"}
            | {"data": json.dumps({"handler": "noop", "payload_digest": digest})}
        ],
        [
            base
            | {"kind": "claimed", "task_from": "queued", "task_to": "claimed"}
            | {"attempt_id": attempt, "session_id": session, "attempt_to": "claimed"}
            | {"data": None}
        ],
        [
            base
            | {"kind": "started", "task_from": "claimed", "task_to": "running"}
            | {"attempt_id": attempt, "session_id": session}
            | {"attempt_from": "claimed", "attempt_to": "running", "data": None}
        ],
        [
            base
            | {"kind": "succeeded", "task_from": "running", "task_to": "succeeded"}
            | {"attempt_id": attempt, "session_id": session}
            | {"attempt_from": "running", "attempt_to": "succeeded"}
            | {"data": json.dumps({"result_digest": digest})}
        ],
    ]


def batches(tasks: int, batch: int) -> list[str]:
    """The statements' parameters for ``tasks`` tasks: per batch of tasks, one per stage."""
    session = str(uuid.uuid4())
    out: list[str] = []
    for start in range(0, tasks, batch):
        lives = [
            _task_events(str(uuid.uuid4()), str(uuid.uuid4()), session, 1_700_000_000_000_000)
            for _ in range(start, min(start + batch, tasks))
        ]
        for stage in range(4):
            out.append(json.dumps([e for life in lives for e in life[stage]]))
    return out


def backend_cpu_ns(pid: int) -> int:
    """Nanoseconds the process has spent on a CPU (the scheduler's own count)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def create(admin_dsn: str, name: str, sql: str) -> str:
    """A scratch database with the schema ``sql`` makes of 0007's; its DSN."""
    target = create_database(admin_dsn, name)
    with psycopg.connect(target, autocommit=True) as cx:
        for path in BEFORE:
            cx.execute(path.read_text().encode())
        if sql:
            cx.execute(sql.encode())
    return target


def run_round(conns: list[tuple[psycopg.Connection[Any], int]], params: list[str]) -> list[int]:
    """CPU ns each backend spent inserting ``params``, a transaction each: the schemas
    take turns statement by statement, so a neighbour's burst lands on all of them."""
    spent = [0] * len(conns)
    for rows in params:
        for i, (cx, pid) in enumerate(conns):
            start = backend_cpu_ns(pid)
            cx.execute(INSERT, (rows,), prepare=True)
            cx.commit()
            spent[i] += backend_cpu_ns(pid) - start
    return spent


def wal_per_event(cx: psycopg.Connection[Any], rows: str) -> tuple[float, float]:
    """WAL records and bytes per event of one statement (rolled back), from a run that
    wrote no full-page image (the first change of a page after a checkpoint does)."""
    n = len(json.loads(rows))
    found: list[tuple[float, float]] = []
    for _ in range(20):
        plan = cx.execute("EXPLAIN (ANALYZE, WAL, FORMAT JSON) " + INSERT, (rows,)).fetchone()
        cx.rollback()
        assert plan is not None
        top = plan[0][0]["Plan"]
        if not top["WAL FPI"]:
            found.append((top["WAL Records"] / n, top["WAL Bytes"] / n))
    return min(found) if found else (float("nan"), float("nan"))


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure(
    dsn: str,
    *,
    schemas: list[str],
    tasks: int,
    batch: int,
    rounds: int,
    fill: int,
    keep: bool = False,
) -> dict[str, Any]:
    """Fill a scratch database per schema with ``fill`` tasks' events, then time
    ``rounds`` rounds of ``tasks`` tasks each, the schemas taking turns; the
    databases are dropped afterwards, failed or not (unless ``keep``)."""
    unknown = [n for n in schemas if n not in SCHEMAS]
    if not schemas or unknown or len(set(schemas)) != len(schemas):
        raise ValueError(f"schemas must be distinct names of {','.join(SCHEMAS)}: {schemas}")
    if tasks < 1 or batch < 1 or rounds < 1 or fill < 0:
        raise ValueError("tasks, batch and rounds must be at least 1 and fill non-negative")
    prefix = f"orbit_evcost_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    dbs = {n: f"{prefix}_{i}" for i, n in enumerate(schemas)}
    conns: dict[str, tuple[psycopg.Connection[Any], int]] = {}
    events = tasks * 4
    try:
        for n in schemas:
            cx = psycopg.connect(create(dsn, dbs[n], SCHEMAS[n]))
            pid = cx.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
            cx.commit()
            conns[n] = (cx, pid)
            run_round([conns[n]], batches(fill, 500))
            cx.autocommit = True
            cx.execute("VACUUM ANALYZE orbit_events")
            cx.autocommit = False
        per_event: dict[str, list[float]] = {n: [] for n in schemas}
        for r in range(rounds):
            order = schemas[r % len(schemas) :] + schemas[: r % len(schemas)]
            spent = run_round([conns[n] for n in order], batches(tasks, batch))
            for n, ns in zip(order, spent, strict=True):
                per_event[n].append(ns / events / 1000)
        sample = batches(batch, batch)[2]
        base = per_event[schemas[0]]
        results: dict[str, Any] = {}
        for n in schemas:
            xs = per_event[n]
            recs, nbytes = wal_per_event(conns[n][0], sample)
            results[n] = {
                "cpu_us_per_event": _spread(xs),
                "vs_first": _spread([x / b for x, b in zip(xs, base, strict=True)]),
                "wal_records_per_event": recs,
                "wal_bytes_per_event": nbytes,
                "per_round": [round(x, 2) for x in xs],
            }
    finally:
        for cx, _ in conns.values():
            cx.close()
        if not keep:
            for name in dbs.values():
                drop_database(dsn, name)
    return {
        "databases": list(dbs.values()),
        "rounds": rounds,
        "tasks": tasks,
        "batch": batch,
        "fill": fill,
        "events_per_round": events,
        "schemas": results,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dsn", default="postgresql://postgres@127.0.0.1/postgres")
    ap.add_argument("--schemas", default="0007,0008-cf87847,0008", help=f"of {','.join(SCHEMAS)}")
    ap.add_argument("--tasks", type=int, default=2000, help="tasks a round, per schema")
    ap.add_argument("--batch", type=int, default=50, help="tasks a transaction")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--fill", type=int, default=50_000, help="tasks written before the rounds")
    ap.add_argument("--keep", action="store_true", help="leave the scratch databases")
    args = ap.parse_args()
    out = measure(
        args.dsn,
        schemas=args.schemas.split(","),
        tasks=args.tasks,
        batch=args.batch,
        rounds=args.rounds,
        fill=args.fill,
        keep=args.keep,
    )
    print(
        f"{args.rounds} rounds of {args.tasks} tasks ({out['events_per_round']} events) per "
        f"schema, {args.batch} tasks a transaction, after {args.fill} tasks written"
    )
    print(
        "schema     CPU us/event median [min-max]  vs first: median [min-max]  "
        "WAL rec/event bytes/event"
    )
    for n, r in out["schemas"].items():
        cpu, ratio = r["cpu_us_per_event"], r["vs_first"]
        print(
            f"{n:10} {cpu['median']:6.2f} [{cpu['min']:.2f}-{cpu['max']:.2f}]"
            f"        {ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]"
            f"          {r['wal_records_per_event']:5.2f}   {r['wal_bytes_per_event']:6.1f}"
        )
    print("per round:", json.dumps({n: r["per_round"] for n, r in out["schemas"].items()}))
    if args.keep:
        print("kept:", ", ".join(out["databases"]))


if __name__ == "__main__":
    main()
