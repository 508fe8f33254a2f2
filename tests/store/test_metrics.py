"""The task gauges of /metrics, read from the store (both backends)."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest

from orbit.core.model import TaskSpec
from orbit.server.metrics import Metrics
from orbit.store import Store
from tests.conftest import ManualClock
from tests.store.helpers import (
    claim_one,
    postgres_driver,
    query_plan,
    queue,
    run_one,
    start_and_succeed,
    submit,
    worker,
)

#: tasks ended before the plan is read, so that a walk of the whole table would show
ENDED = 2000
BATCH = 500


def _gauge(metrics: Metrics, name: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(s.labels.values()): s.value
        for family in metrics.registry.collect()
        if family.name == name
        for s in family.samples
    }


def test_oldest_queued_age_is_measured_by_the_stores_clock(
    store: Store, clock: ManualClock
) -> None:
    """A queued task's age is the store's clock (the database's, as for leases and
    deadlines) less the instant it became due. It used to be this process's wall clock
    less that instant: off by the skew between an app host and the database, and 0 here,
    where the store's clock is a test clock ahead of the wall clock."""
    queue(store)
    submit(store)
    clock.advance(5)
    assert _gauge(Metrics(store), "orbit_oldest_queued_seconds") == {("q",): 5.0}


def test_the_task_gauge_counts_each_state_a_task_can_still_leave(
    store: Store, clock: ManualClock
) -> None:
    """``orbit_tasks`` counts, by queue, the tasks queued, scheduled, claimed, running,
    cancelling and awaiting review; the ended ones (succeeded, failed, cancelled) are not
    in it. It used to count every state, a scan of every task ever stored at every
    scrape, on every node."""
    queue(store)
    queue(store, "r")
    first, _ = worker(store)
    for _ in range(2):
        submit(store, retry_safe=False)
        run_one(store, first)
    clock.advance(store.config.lease_ttl_us / 1e6 + 1)
    store.reap()  # both leases ran out under handlers that are not retry-safe
    reviewed = [t.id for t in store.task_list(state="needs_review", limit=10)]
    assert len(reviewed) == 2
    store.task_resolve(reviewed[0], "failed")
    session, _ = worker(store, name="w2")
    submit(store)
    start_and_succeed(store, session, [claim_one(store, session)])
    store.task_cancel(submit(store))
    submit(store, "r")
    claim_one(store, session)  # claimed
    submit(store, "r")
    run_one(store, session)  # running
    submit(store)
    store.task_cancel(run_one(store, session).task.id)  # cancelling: its handler still runs
    for _ in range(2):
        submit(store, "r")
    submit(store)
    submit(store, "r", run_after=clock.now + 3600 * 1_000_000)
    states = {s: n for s, n in store.task_counts().items() if n}
    assert states == {
        "succeeded": 1,
        "failed": 1,
        "cancelled": 1,
        "needs_review": 1,
        "claimed": 1,
        "running": 1,
        "cancelling": 1,
        "queued": 3,
        "scheduled": 1,
    }
    metrics = Metrics(store)
    assert _gauge(metrics, "orbit_tasks") == {
        ("q", "needs_review"): 1.0,
        ("r", "claimed"): 1.0,
        ("r", "running"): 1.0,
        ("q", "cancelling"): 1.0,
        ("r", "queued"): 2.0,
        ("q", "queued"): 1.0,
        ("r", "scheduled"): 1.0,
    }
    assert _gauge(metrics, "orbit_queue_depth") == {("q",): 1.0, ("r",): 2.0}


def test_the_task_gauge_reads_no_ended_task(make_store: Any, clock: ManualClock) -> None:
    """The gauges' query reads the tasks not ended through indexes that hold only them
    (orbit_tasks_ready, orbit_tasks_review, and the live attempts' orbit_attempts_one_live,
    each task then by its id), never by a walk of the tasks table, whose ended tasks grow
    without end: among 2,000 of them, on SQLite no ``SCAN`` of orbit_tasks, on PostgreSQL
    (sequential scans off, which would be cheaper on so small a table) no ``Seq Scan`` and
    no index scan of it without a condition but a partial index's."""
    store: Store = make_store(clock=clock)
    queue(store, max_concurrency=BATCH)
    session, _ = worker(store, {"h": BATCH}, max_concurrency=BATCH, name="filler")
    for _ in range(ENDED // BATCH):
        store.task_submit_many([TaskSpec(queue="q", handler="h")] * BATCH)
        start_and_succeed(
            store, session, store.attempt_claim_many(session.id, session.epoch, BATCH)
        )
    submit(store)
    run_one(store, session)
    submit(store)
    if store.backend == "postgres":
        with psycopg.connect(store.driver.dsn, autocommit=True) as raw:  # type: ignore[attr-defined]
            raw.execute("ANALYZE orbit_tasks")
            raw.execute("ANALYZE orbit_attempts")
    plan = query_plan(store, "task_stats", {}, seqscan=False)
    if store.backend == "sqlite":
        scans = re.findall(r"SCAN (\w+)(?: USING (?:COVERING )?INDEX (\w+))?", plan)
        walked = {index for table, index in scans if table in ("orbit_tasks", "t")}
        assert walked <= {"orbit_tasks_ready", "orbit_tasks_review"}, plan
        assert "SEARCH t USING INDEX sqlite_autoindex_orbit_tasks_1 (id=?)" in plan, plan
        assert "orbit_attempts_one_live" in plan, plan
    else:
        assert "Seq Scan" not in plan, plan
        assert "orbit_tasks_ready" in plan and "orbit_tasks_review" in plan, plan
        assert "orbit_attempts_one_live" in plan, plan
        assert re.search(
            r"Index Scan using orbit_tasks_pkey on orbit_tasks \w+ .*"
            r"Index Cond: \(id = a\.task_id\)",
            plan,
        ), plan
        assert plan.count("orbit_tasks_pkey") == 1, plan


@pytest.mark.parametrize("backend", ["postgres"])
def test_the_task_gauge_reads_no_ended_task_where_a_scan_looks_cheaper(
    make_store: Any,
) -> None:
    """PostgreSQL's planner judges a bitmap scan of the waiting tasks by their share of
    the table, as if they were strewn over every page, and read the whole table, ended
    tasks and all, for a backlog of a few per cent of the tasks. ``task_stats`` turns
    sequential scans off for its transaction: with half the tasks queued, where the
    planner would scan, the store's own transaction makes no sequential scan of
    ``orbit_tasks`` (counted by ``pg_stat_xact_user_tables``, in that transaction)."""
    store: Store = make_store()
    queue(store, max_concurrency=BATCH)
    session, _ = worker(store, {"h": BATCH}, max_concurrency=BATCH, name="filler")
    store.task_submit_many([TaskSpec(queue="q", handler="h")] * BATCH)
    start_and_succeed(store, session, store.attempt_claim_many(session.id, session.epoch, BATCH))
    store.task_submit_many([TaskSpec(queue="q", handler="h")] * BATCH)
    with psycopg.connect(store.driver.dsn, autocommit=True) as raw:  # type: ignore[attr-defined]
        raw.execute("ANALYZE orbit_tasks")
    postgres_driver(
        store,
        {
            "test_task_scans": "SELECT seq_scan, idx_scan FROM pg_stat_xact_user_tables"
            " WHERE relname = 'orbit_tasks'"
        },
    )

    def read(tx: Any) -> tuple[list[Any], dict[str, int], dict[str, int]]:
        # the counts before it too, in the same transaction: the view adds this
        # connection's counts of earlier transactions not yet flushed to the statistics
        [before] = tx.fetch("test_task_scans")
        rows, _ = store._task_stats(tx)
        [after] = tx.fetch("test_task_scans")
        return rows, before, after

    rows, before, after = store._tx(read)
    assert {(r["queue"], r["state"]): r["n"] for r in rows} == {("q", "queued"): BATCH}
    assert after["seq_scan"] == before["seq_scan"], (before, after)
    assert after["idx_scan"] > before["idx_scan"], (before, after)
