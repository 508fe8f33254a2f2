"""The live attempts are read through ``orbit_attempts_one_live`` alone (migrations
0013 on PostgreSQL, 0008 on SQLite): the reaper's expiry reads, a session's claimed
attempts and the cancels a node may have missed each walk the live attempts, never the
table of every attempt ever made, on both backends."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from orbit.core.model import SECOND, TaskSpec
from orbit.store import Store, StoreConfig
from tests.conftest import ManualClock
from tests.store.helpers import claim_one, query_plan, queue, start_and_succeed, submit, worker

#: attempts that have ended, so that a walk of the whole table would be the slow read
ENDED = 2000
BATCH = 500


def _end_many(store: Store, n: int) -> None:
    """``n`` tasks claimed, started and finished, ``BATCH`` at a time, by one session."""
    session, _ = worker(store, {"h": BATCH}, max_concurrency=BATCH, name="filler")
    for _ in range(n // BATCH):
        store.task_submit_many([TaskSpec(queue="q", handler="h")] * BATCH)
        start_and_succeed(
            store, session, store.attempt_claim_many(session.id, session.epoch, BATCH)
        )


def _analyze(store: Store) -> None:
    """PostgreSQL's statistics as autovacuum leaves them on a database that has run for a
    while. SQLite has none to refresh: its planner takes a partial index whose condition
    the query states, with or without statistics."""
    if store.backend == "sqlite":
        return
    with psycopg.connect(store.driver.dsn, autocommit=True) as raw:  # type: ignore[attr-defined]
        raw.execute("ANALYZE orbit_attempts")
        raw.execute("ANALYZE orbit_tasks")


@pytest.fixture
def busy_store(make_store: Any, clock: ManualClock) -> Store:
    store: Store = make_store(
        clock=clock, config=StoreConfig(claim_ttl_us=10 * SECOND, lease_ttl_us=5 * SECOND)
    )
    queue(store, max_concurrency=BATCH)
    _end_many(store, ENDED)
    _analyze(store)
    return store


def test_each_read_of_the_live_attempts_walks_their_index(busy_store: Store) -> None:
    store = busy_store
    session = "01a229a4-0000-7000-8000-000000000000"
    reads: dict[str, dict[str, Any]] = {
        "reap_candidates": {"now": 0, "limit": 100},
        "reap_next_due": {"artifact_grace": 0},
        "attempt_claimed_for_session": {"session_id": session},
        "attempt_cancelling_for_sessions": {"session_ids": [session]},
    }
    for query, params in reads.items():
        plan = query_plan(store, query, params)
        assert "orbit_attempts_one_live" in plan, (query, plan)


def test_the_reaper_still_finds_each_expiry_among_many_ended_attempts(
    busy_store: Store, clock: ManualClock
) -> None:
    """The soonest expiry and the expired attempts come from the one walk, for claims
    and leases alike, whatever the attempts that ended long ago held."""
    store = busy_store
    session, _ = worker(store)
    submit(store)
    submit(store)
    claimed = claim_one(store, session)
    clock.advance(1)
    running = claim_one(store, session)
    store.attempt_start(session.id, session.epoch, running.attempt.id, running.attempt.fence)
    # The claim runs out 10 s after it was made; the lease 5 s after its start, 1 s later.
    assert store.reap_due_in() == pytest.approx(5)
    clock.advance(5)
    report = store.reap()
    assert report.expired_leases == 1 and report.released == 0
    assert str(store.task_get(running.task.id).state) == "needs_review"  # not retry-safe
    assert store.reap_due_in() == pytest.approx(4)  # the claim's, 10 s after it was made
    clock.advance(4)
    assert store.reap().released == 1
    assert str(store.task_get(claimed.task.id).state) == "queued"
