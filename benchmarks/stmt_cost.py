"""What each statement of a drain's claim, start and finish costs PostgreSQL, in process.

A drain's three transactions (``benchmarks.phases``' claim, start and finish through
``Store``, no server, no worker) run as a one-worker drain runs them: claims of
``--batch`` tasks while fewer than ``--live`` attempts are live, each claimed batch
started, then finished, so the live attempts (which every claim counts) stay near what
a worker's slots hold. Around every round trip the driver makes, it reads the CPU time
of the database backend that ran it (``/proc/<pid>/schedstat``: nanoseconds on CPU, so a
busy neighbour adds waiting, not CPU) and, with ``--wal``, the cluster's WAL position
(``pg_current_wal_insert_lsn``, from another connection: any other writer on the
cluster counts too, so run it alone) and, over the whole drain, ``pg_stat_wal``'s records,
full-page images and bytes a task; a ``CHECKPOINT`` between the fill and the drain makes
every page's first change log its image, as a drain that a checkpoint precedes does
(``--no-checkpoint``: none). It prints each round trip's share a task, by
phase, largest first, and the totals. ``--sql`` runs statements on the fresh database
after its migrations (a variant of the schema: ``DROP INDEX ...``), ``--explain N``
prints ``EXPLAIN (ANALYZE, BUFFERS, WAL)`` of each phase's statements once, at its N-th
round trip (inside a savepoint, rolled back), to stderr. The server must be on this
host (the backend's ``/proc`` entry is read).

    python -m benchmarks.stmt_cost --tasks 20000 --wal
    python -m benchmarks.stmt_cost --tasks 20000 --wal --sql 'DROP INDEX orbit_events_task'
    python -m benchmarks.stmt_cost --tasks 20000 --explain 50 2>plans.txt
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from benchmarks.event_cost import backend_cpu_ns
from benchmarks.phases import DEFAULT_ADMIN_DSN, store_url
from benchmarks.wal import POSITION_SQL, lsn_bytes
from orbit.core.model import SECOND, Capability, Outcome, TaskSpec
from orbit.store import StoreConfig, open_store
from orbit.store.postgres import driver as D

_TOUCHES = re.compile(
    r"(INSERT INTO \w+|UPDATE \w+ AS \w|DELETE FROM \w+|FROM \w+ AS \w|FROM orbit_\w+|"
    r"json_agg|orbit_stale_write|FOR UPDATE SKIP LOCKED|FOR UPDATE|FOR SHARE|"
    r"pg_advisory_xact_lock|pg_notify)"
)


class _Meter:
    """The driver's round trips, each one's backend CPU and WAL added to its label."""

    def __init__(self) -> None:
        self.phase = "-"
        self.stats: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        self.names: dict[bytes, str] = {}
        self.wal: psycopg.Connection[Any] | None = None
        self.explain_at = 0
        self.explained: set[tuple[str, bool]] = set()
        self.trips: collections.Counter[str] = collections.Counter()
        #: the cluster's WAL a task over the drain (``pg_stat_wal``), with ``--wal``
        self.cluster_wal: dict[str, float] = {}

    def lsn(self) -> int:
        if self.wal is None:
            return 0
        row = self.wal.execute(POSITION_SQL).fetchone()
        assert row is not None
        return lsn_bytes(row[0])

    def measure(self, raw: Any, label: str, call: Callable[[], Any]) -> Any:
        pid = raw._cx.info.backend_pid
        wal_before = self.lsn()
        cpu_before = backend_cpu_ns(pid)
        result = call()
        cpu = backend_cpu_ns(pid) - cpu_before
        wal = self.lsn() - wal_before
        entry = self.stats[(self.phase, label)]
        entry[0] += 1
        entry[1] += cpu
        entry[2] += wal
        return result

    def explain(self, raw: Any, statements: Sequence[tuple[bytes, list[bytes | None]]]) -> None:
        pg = raw._pg
        for name, values in statements:
            D._checked(pg.exec_(b"SAVEPOINT stmt_cost"))
            args = b",".join(
                b"NULL" if v is None else b"'" + v.replace(b"'", b"''") + b"'" for v in values
            )
            sql = b"EXPLAIN (ANALYZE, BUFFERS, WAL) EXECUTE " + name
            result = D._checked(pg.exec_(sql + (b"(" + args + b")" if values else b"")))
            print(f"=== {self.phase}: {_label(self.names[name])}", file=sys.stderr)
            for i in range(result.ntuples):
                print((result.get_value(i, 0) or b"").decode(), file=sys.stderr)
            D._checked(pg.exec_(b"ROLLBACK TO SAVEPOINT stmt_cost"))

    def install(self) -> None:
        """Wrap ``_Raw``'s calls: every statement the store sends goes through them."""
        meter = self
        prepare, run, command, pipeline = (
            D._Raw.prepare,
            D._Raw.run,
            D._Raw.command,
            D._Raw.pipeline,
        )

        def prepare_(raw: Any, sql: str, params: Any) -> Any:
            name, values = prepare(raw, sql, params)
            meter.names[name] = sql
            return name, values

        def run_(raw: Any, sql: str, params: Any) -> Any:
            return meter.measure(raw, _label(sql), lambda: run(raw, sql, params))

        def command_(raw: Any, sql: bytes) -> Any:
            return meter.measure(raw, sql.decode(), lambda: command(raw, sql))

        def pipeline_(raw: Any, statements: Any, *, begin: bool, commit: bool = False) -> Any:
            meter.trips[meter.phase] += 1
            key = (meter.phase, begin)
            due = meter.explain_at and meter.trips[meter.phase] >= meter.explain_at
            if due and key not in meter.explained and meter.phase != "-":
                meter.explained.add(key)
                if begin:
                    D._checked(raw._pg.exec_(b"BEGIN"))
                    begin = False
                meter.explain(raw, statements)
            label = " ;; ".join(_label(meter.names[n]) for n, _ in statements)
            label = ("BEGIN; " if begin else "") + label + ("; COMMIT" if commit else "")
            return meter.measure(
                raw, label, lambda: pipeline(raw, statements, begin=begin, commit=commit)
            )

        D._Raw.prepare = prepare_  # type: ignore[method-assign]
        D._Raw.run = run_  # type: ignore[method-assign]
        D._Raw.command = command_  # type: ignore[method-assign]
        D._Raw.pipeline = pipeline_  # type: ignore[method-assign]


def _wal_stats(cx: psycopg.Connection[Any] | None) -> dict[str, float]:
    """The cluster's WAL counters (``pg_stat_wal``): records, full-page images, bytes."""
    if cx is None:
        return {}
    row = cx.execute("SELECT wal_records, wal_fpi, wal_bytes FROM pg_stat_wal").fetchone()
    assert row is not None
    return {"records": float(row[0]), "fpi": float(row[1]), "bytes": float(row[2])}


def _label(sql: str) -> str:
    """A statement's first words and the tables and locks it names."""
    flat = " ".join(sql.split())
    touched = list(dict.fromkeys(_TOUCHES.findall(flat)))
    return flat[:40] + " | " + ",".join(touched)


def drain(
    meter: _Meter, tasks: int, batch: int, live_max: int, sql: str, wal: bool, checkpoint: bool
) -> None:
    hour = 3600 * SECOND
    config = StoreConfig(claim_ttl_us=hour, lease_ttl_us=hour, session_ttl_us=hour)
    with store_url("postgres", DEFAULT_ADMIN_DSN) as url:
        store = open_store(url, config)
        try:
            if sql:
                with psycopg.connect(url, autocommit=True) as cx:
                    cx.execute(sql.encode())
            if wal:
                meter.wal = psycopg.connect(url, autocommit=True)
            store.queue_create("q", max_concurrency=tasks, rate=0)
            session, _ = store.session_open(
                name="w", node_id="n", capabilities=[Capability("h", tasks)], max_concurrency=tasks
            )
            meter.phase = "fill"
            for at in range(0, tasks, 1000):
                count = min(1000, tasks - at)
                store.task_submit_many(
                    [TaskSpec(queue="q", handler="h", payload={"n": at + i}) for i in range(count)]
                )
            if meter.wal is not None and checkpoint:
                meter.wal.execute("CHECKPOINT")  # every page's first change logs its image
            wal_before = _wal_stats(meter.wal)
            claimed: list[list[tuple[str, int]]] = []
            started: list[list[tuple[str, int]]] = []
            done = live = 0
            while done < tasks:
                if live < live_max and done + live < tasks:
                    meter.phase = "claim"
                    want = min(batch, tasks - done - live)
                    grants = store.attempt_claim_many(session.id, session.epoch, want)
                    assert grants, "nothing left to claim"
                    claimed.append([(g.attempt.id, g.attempt.fence) for g in grants])
                    live += len(grants)
                    continue
                if claimed:
                    meter.phase = "start"
                    attempts = claimed.pop(0)
                    for answer in store.attempt_start_many(session.id, session.epoch, attempts):
                        assert not isinstance(answer, Exception), answer
                    started.append(attempts)
                if started and (not claimed or len(started) > 1):
                    meter.phase = "finish"
                    attempts = started.pop(0)
                    items = [(a, f, Outcome.success(None)) for a, f in attempts]
                    for answer in store.attempt_finish_many(session.id, session.epoch, items):
                        assert not isinstance(answer, Exception), answer
                    live -= len(attempts)
                    done += len(attempts)
            if meter.wal is not None:
                after = _wal_stats(meter.wal)
                meter.cluster_wal = {k: (after[k] - wal_before[k]) / tasks for k in after}
        finally:
            store.close()
            if meter.wal is not None:
                meter.wal.close()


def report(meter: _Meter, tasks: int) -> list[dict[str, Any]]:
    """Each round trip's CPU (µs) and WAL (bytes) a task, by phase, then the totals."""
    rows = [
        {
            "phase": phase,
            "label": label,
            "calls": calls,
            "us_task": ns / 1e3 / tasks,
            "wal_task": wal / tasks,
        }
        for (phase, label), (calls, ns, wal) in meter.stats.items()
        if phase in ("claim", "start", "finish")
    ]
    rows.sort(key=lambda r: (r["phase"], -r["us_task"]))
    totals = []
    for phase in ("claim", "start", "finish"):
        mine = [r for r in rows if r["phase"] == phase]
        totals.append(
            {
                "phase": phase,
                "label": "TOTAL",
                "calls": sum(r["calls"] for r in mine),
                "us_task": sum(r["us_task"] for r in mine),
                "wal_task": sum(r["wal_task"] for r in mine),
            }
        )
    totals.append(
        {
            "phase": "all",
            "label": "TOTAL",
            "calls": sum(t["calls"] for t in totals),
            "us_task": sum(t["us_task"] for t in totals),
            "wal_task": sum(t["wal_task"] for t in totals),
        }
    )
    return rows + totals


def _positive(text: str) -> int:
    """A count of at least 1: with ``--live 0`` the drain never claims (and spins for
    good), with ``--batch 0`` or ``--tasks 0`` the store refuses the first call."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.stmt_cost",
        description=__doc__.split("\n\n")[0],
        epilog="It creates (and drops) a database of its own on the PostgreSQL that "
        "$BENCH_PG_DSN names (default postgresql://postgres@127.0.0.1:5432/test), which "
        "must run on this host.",
    )
    parser.add_argument("--tasks", type=_positive, default=20000, help="tasks to drain (20000)")
    parser.add_argument(
        "--batch", type=_positive, default=180, help="tasks a claim, start, finish (180)"
    )
    parser.add_argument(
        "--live", type=_positive, default=1000, help="claim while fewer are live (1000)"
    )
    parser.add_argument("--wal", action="store_true", help="the cluster's WAL a task too")
    parser.add_argument(
        "--no-checkpoint", action="store_true", help="no CHECKPOINT between fill and drain"
    )
    parser.add_argument("--sql", default="", help="run on the database after migrating")
    parser.add_argument("--explain", type=int, default=0, help="plans at this round trip")
    parser.add_argument("--json", default=None, help="write the rows here too")
    args = parser.parse_args(argv)
    meter = _Meter()
    meter.explain_at = args.explain
    meter.install()
    drain(meter, args.tasks, args.batch, args.live, args.sql, args.wal, not args.no_checkpoint)
    rows = report(meter, args.tasks)
    for r in rows:
        if r["label"] == "TOTAL" or r["us_task"] >= 0.3:
            print(
                f"{r['phase']:6} {r['calls']:6} {r['us_task']:8.2f} µs {r['wal_task']:7.0f} B"
                f"  {r['label'][:300]}"
            )
    if meter.cluster_wal:
        print(
            "cluster WAL a task over the drain (pg_stat_wal): "
            + ", ".join(f"{k} {v:.2f}" for k, v in meter.cluster_wal.items())
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
