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
import statistics
import uuid
from pathlib import Path
from typing import Any

import psycopg

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


def create(admin: psycopg.Connection[Any], dsn: str, name: str, sql: str) -> str:
    """A scratch database with the schema ``sql`` makes of 0007's; its DSN."""
    admin.execute(f"DROP DATABASE IF EXISTS {name}")
    admin.execute(f"CREATE DATABASE {name}")
    target = psycopg.conninfo.make_conninfo(dsn, dbname=name)
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
    names = args.schemas.split(",")
    admin = psycopg.connect(args.dsn, autocommit=True)
    conns: dict[str, tuple[psycopg.Connection[Any], int]] = {}
    dbs = {n: f"orbit_evcost_{i}" for i, n in enumerate(names)}
    try:
        for n in names:
            cx = psycopg.connect(create(admin, args.dsn, dbs[n], SCHEMAS[n]))
            pid = cx.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
            cx.commit()
            conns[n] = (cx, pid)
            run_round([conns[n]], batches(args.fill, 500))
            cx.autocommit = True
            cx.execute("VACUUM ANALYZE orbit_events")
            cx.autocommit = False
        per_event: dict[str, list[float]] = {n: [] for n in names}
        events = args.tasks * 4
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            spent = run_round([conns[n] for n in order], batches(args.tasks, args.batch))
            for n, ns in zip(order, spent, strict=True):
                per_event[n].append(ns / events / 1000)
        print(
            f"{args.rounds} rounds of {args.tasks} tasks ({events} events) per schema, "
            f"{args.batch} tasks a transaction, after {args.fill} tasks written"
        )
        print(
            "schema     CPU us/event median [min-max]  vs first: median [min-max]  "
            "WAL rec/event bytes/event"
        )
        sample = batches(args.batch, args.batch)[2]
        base = per_event[names[0]]
        for n in names:
            xs = per_event[n]
            ratios = [x / b for x, b in zip(xs, base, strict=True)]
            recs, nbytes = wal_per_event(conns[n][0], sample)
            print(
                f"{n:10} {statistics.median(xs):6.2f} [{min(xs):.2f}-{max(xs):.2f}]"
                f"        {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
                f"          {recs:5.2f}   {nbytes:6.1f}"
            )
        print("per round:", json.dumps({n: [round(x, 2) for x in per_event[n]] for n in names}))
    finally:
        for cx, _ in conns.values():
            cx.close()
        if not args.keep:
            for name in dbs.values():
                admin.execute(f"DROP DATABASE IF EXISTS {name}")
        admin.close()


if __name__ == "__main__":
    main()
