"""Cached plans are remade when Orbit's tables change size (``orbit/store/postgres/plans.py``).

psycopg prepares a statement after its fifth run, and PostgreSQL then keeps one generic
plan for it. A plan made while a table was empty scans the whole table once it is large:
that once made a 20,000-task drain run at a third of its speed. SQLite has no such plan
cache, so the behaviour test is PostgreSQL's own; the drift rule is plain arithmetic.
"""

from __future__ import annotations

import json
import re
from typing import Any

import psycopg
import pytest

from orbit.core.model import Capability, Outcome, TaskSpec
from orbit.store import Store
from orbit.store.postgres.driver import PostgresDriver
from orbit.store.postgres.plans import MIN_PAGES, PAGE, SIZES_SQL, PlanWatch, drifted

LOCK_BY_ID = "SELECT * FROM orbit_tasks WHERE id = ANY(%(ids)s::text[]) ORDER BY id FOR UPDATE"


def _fill(store: Store, n: int) -> None:
    """``n`` ready tasks in queue ``q``, submitted a thousand at a time."""
    for start in range(0, n, 1000):
        store.task_submit_many(
            [TaskSpec(queue="q", handler="h", payload={"i": i}) for i in range(start, start + 1000)]
        )


def test_a_table_that_doubles_or_halves_drifts() -> None:
    big = 100 * PAGE
    assert drifted((0, big), (0, 2 * big + PAGE))  # grew past double
    assert drifted((0, big), (0, big // 2 - PAGE))  # shrank past half
    assert drifted((big, 0), (big, MIN_PAGES * PAGE))  # from empty, by MIN_PAGES
    assert not drifted((0, big), (0, 2 * big))  # exactly double: not yet
    assert not drifted((0, big), (PAGE, big + big // 2))  # small changes
    assert not drifted((0, 0), (0, (MIN_PAGES - 1) * PAGE))  # tiny tables plan alike


def _plan(driver: PostgresDriver) -> str:
    """The plan the cached statement runs with now (after any re-planning is due)."""
    with driver.transaction() as cx:
        raw = cx._cx  # the psycopg connection under the driver's
        found = raw.execute(
            "SELECT name FROM pg_prepared_statements WHERE statement = %s",
            (LOCK_BY_ID.replace("%(ids)s", "$1"),),
        ).fetchone()
        assert found is not None, "the statement was never prepared"
        rows = raw.execute(f"EXPLAIN EXECUTE {found[0]}('{{x}}')").fetchall()
    return "\n".join(str(r[0]) for r in rows)


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_plan_made_on_an_empty_table_is_remade_once_it_has_grown(make_store: Any) -> None:
    store: Store = make_store()
    store.queue_create("q", max_concurrency=10, rate=0)
    dsn: str = store.driver.dsn  # type: ignore[attr-defined]
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("ANALYZE orbit_tasks")  # the planner now knows the table as empty
    driver = PostgresDriver(dsn, min_size=1, max_size=1)  # one connection: one plan cache
    try:
        driver.plans.interval = 3600.0  # the first transaction reads the sizes, then none
        for _ in range(15):  # prepared after 5 runs, a generic plan after 5 more
            with driver.transaction() as cx:
                cx._cx.execute(LOCK_BY_ID, {"ids": "{x}"})
        _fill(store, 20_000)
        # The plan cached while the table was empty is still used: a scan of it all.
        assert "Seq Scan on orbit_tasks" in _plan(driver)

        driver.plans.interval = 0.0  # the next transaction reads the sizes again
        driver.plans._next_check = 0.0
        plan = _plan(driver)
        assert "Index Scan using orbit_tasks_pkey" in plan, plan
        assert driver.plans.epoch == 1
    finally:
        driver.close()


class _Recorder:
    """Stands in for a pooled connection: answers the size read, records every statement."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.sent: list[str] = []

    def execute(self, sql: str) -> _Recorder:
        self.sent.append("sizes" if sql == SIZES_SQL else sql)
        return self

    def fetchone(self) -> tuple[int, ...]:
        return tuple(self.sizes)


def test_every_connection_discards_its_plans_once_after_a_drift() -> None:
    now = [0.0]
    watch = PlanWatch(interval=1.0, clock=lambda: now[0])
    sizes = [0, 0, 0, 0]
    a, b = _Recorder(sizes), _Recorder(sizes)
    watch.before_transaction(a)  # type: ignore[arg-type]
    watch.before_transaction(b)  # type: ignore[arg-type]
    assert a.sent == ["sizes"] and b.sent == []  # one read per interval, by whoever comes
    sizes[1] = 1000 * PAGE  # orbit_attempts grew from empty
    watch.before_transaction(b)  # type: ignore[arg-type]
    assert b.sent == []  # not read again before the interval is over
    now[0] = 1.5
    watch.before_transaction(b)  # type: ignore[arg-type]
    assert b.sent == ["sizes", "DISCARD PLANS"] and watch.epoch == 1
    watch.before_transaction(a)  # type: ignore[arg-type]
    watch.before_transaction(a)  # type: ignore[arg-type]
    assert a.sent == ["sizes", "DISCARD PLANS"]  # once, on its next transaction


def test_every_connection_drops_its_statements_once_after_they_went_stale() -> None:
    """After a statement failed for a change of the tables (``statements_stale``), each
    connection drops its prepared statements (and the driver forgets them) before its
    next transaction; a later drift only discards plans again."""
    now = [0.0]
    forgotten: list[object] = []
    watch = PlanWatch(interval=1.0, clock=lambda: now[0], forget=forgotten.append)
    sizes = [0, 0, 0, 0]
    a, b = _Recorder(sizes), _Recorder(sizes)
    watch.before_transaction(a)  # type: ignore[arg-type]
    watch.before_transaction(b)  # type: ignore[arg-type]
    watch.statements_stale()
    for cx in (a, b, a, b):
        watch.before_transaction(cx)  # type: ignore[arg-type]
    assert a.sent == ["sizes", "DEALLOCATE ALL"] and b.sent == ["DEALLOCATE ALL"]
    assert forgotten == [a, b]
    sizes[1] = 1000 * PAGE
    now[0] = 1.5
    watch.before_transaction(a)  # type: ignore[arg-type]
    watch.before_transaction(b)  # type: ignore[arg-type]
    assert a.sent[2:] == ["sizes", "DISCARD PLANS"] and b.sent[1:] == ["DISCARD PLANS"]
    assert forgotten == [a, b]


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_small_batched_write_updates_by_primary_key(make_store: Any) -> None:
    """A batched write unpacks its rows from JSON, and PostgreSQL guesses that a
    set-returning function yields 100 rows. Against a table of a few thousand rows that
    guess made a hash join over the whole table look cheaper than 100 index lookups, and a
    worker's start or finish of 10 tasks read every task (a drain with 10 slots ran at two
    thirds of its speed). The statement states its row count (``LIMIT :rows_n``)."""
    store: Store = make_store()
    store.queue_create("q", max_concurrency=10, rate=0)
    _fill(store, 5000)
    driver: PostgresDriver = store.driver  # type: ignore[assignment]
    with psycopg.connect(driver.dsn, autocommit=True) as admin:
        admin.execute("ANALYZE orbit_tasks")
        ids = [r[0] for r in admin.execute("SELECT id FROM orbit_tasks LIMIT 10").fetchall()]
    rows = [{"id": i, "expect_version": 1, "state": "queued", "version": 2} for i in ids]
    with driver.transaction() as cx:
        plan = "\n".join(
            str(r[0])
            for r in cx._cx.execute(
                "EXPLAIN " + driver.queries["task_write_many"],
                {"rows": json.dumps(rows), "rows_n": len(rows)},
            ).fetchall()
        )
    assert "Index Scan using orbit_tasks_pkey" in plan, plan
    assert "Seq Scan on orbit_tasks" not in plan, plan


LIVE_COUNT = (
    "SELECT queue, tenant, handler, session_id, count(*) AS n FROM orbit_attempts"
    " WHERE state IN ('claimed', 'running') GROUP BY queue, tenant, handler, session_id"
)


@pytest.mark.alone  # another transaction anywhere on the server can keep the entries alive
@pytest.mark.parametrize("backend", ["postgres"])
def test_a_claim_marks_the_dead_entries_of_the_live_attempt_index(make_store: Any) -> None:
    """Every attempt leaves entries in the live-attempt partial index,
    ``orbit_attempts_one_live`` (one per version claimed or running), until VACUUM. A claim
    counts live attempts through it; a bitmap scan would visit every dead entry again on
    every claim, a plain index scan marks them dead as it passes, so the next reader skips
    them (``claim_lock``)."""
    store: Store = make_store()
    store.queue_create("q", max_concurrency=10_000, rate=0)
    driver: PostgresDriver = store.driver  # type: ignore[assignment]
    with psycopg.connect(driver.dsn, autocommit=True) as admin:
        admin.execute("ANALYZE orbit_attempts")  # statistics of an empty table, as at start
    session, _ = store.session_open(
        name="w", node_id="n", capabilities=[Capability("h", 1000)], max_concurrency=1000
    )
    _fill(store, 3000)
    for _ in range(15):  # 3,000 attempts claimed, started and finished: 6,000 dead entries
        grants = store.attempt_claim_many(session.id, session.epoch, 200)
        done = [(g.attempt.id, g.attempt.fence) for g in grants]
        store.attempt_start_many(session.id, session.epoch, done)
        store.attempt_finish_many(
            session.id, session.epoch, [(a, f, Outcome(ok=True)) for a, f in done]
        )
    # The claim's plans were made while the table grew, from an empty table's statistics.
    # Re-plan for the table as it is (what the plan watch does after growth), so that the
    # claim reads the index as the reader below does.
    driver.plans.epoch += 1
    store.attempt_claim_many(session.id, session.epoch, 1)  # nothing left: counts only
    with psycopg.connect(driver.dsn, autocommit=True) as cx:
        cx.execute("SET enable_bitmapscan = off")  # read the index the way a claim does
        plan = [str(r[0]) for r in cx.execute("EXPLAIN (ANALYZE, BUFFERS) " + LIVE_COUNT)]
    executed = plan[: next(i for i, line in enumerate(plan) if line.startswith("Planning"))]
    shown = "\n".join(plan)
    assert any("Index Scan using orbit_attempts_one_live" in line for line in executed), shown
    hits = [int(m.group(1)) for line in executed if (m := re.search(r"shared hit=(\d+)", line))]
    # Only the index's own pages once the entries are marked; every dead version's heap
    # page as well (hundreds) if the claims read the index with bitmap scans.
    assert hits and max(hits) < 100, shown
