"""A start or finish reads its rows and the clock in one round trip (``lock_many``).

Two things must hold for that to be safe: the rows come back exactly as single reads
return them (PostgreSQL sends them as JSON), and the clock is read only once every lock
is held, so a report that waited for a lock is judged at the time it got it (a lease
that ran out during the wait has run out).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import psycopg
import pytest

from orbit.core.errors import Code, OrbitError
from orbit.core.model import Outcome, TaskState
from orbit.store import Store
from orbit.store import rows as R
from orbit.store.postgres.driver import LOCK_MANY_INLINE_MAX
from tests.conftest import store_url
from tests.store.helpers import queue, run_one, submit, worker


def test_locked_reads_return_the_rows_single_reads_return(store: Store) -> None:
    queue(store)
    submit(store, payload={"text": 'quote " and \\ backslash, ünïcode', "big": 2**62})
    s, _ = worker(store)
    ids = [run_one(store, s).attempt.id]
    calls: list[tuple[str, dict[str, Any]]] = [
        ("task_lock_for_attempts", {"ids": ids}),
        ("attempt_lock_many", {"ids": ids}),
        ("session_share", {"id": s.id}),
        ("queue_share_for_attempts", {"ids": ids}),
    ]
    # more ids than PostgreSQL's one-statement form takes: the reads go one by one
    padded = ids + [f"no-such-attempt-{i}" for i in range(LOCK_MANY_INLINE_MAX)]
    with store.driver.transaction() as cx:
        single = [cx.fetch(name, params) for name, params in calls]
        locked, now = cx.lock_many(calls)
        one_by_one, later = cx.lock_many([(n, {**p, "ids": padded}) for n, p in calls[:2]])
    assert isinstance(now, int) and now > 0 and later >= now
    assert one_by_one == single[:2]
    assert [len(rows) for rows in locked] == [1, 1, 1, 1]
    assert R.task_from_row(locked[0][0]) == R.task_from_row(single[0][0])
    assert R.attempt_from_row(locked[1][0]) == R.attempt_from_row(single[1][0])
    assert R.session_from_row(locked[2][0]) == R.session_from_row(single[2][0])
    assert R.queue_from_row(locked[3][0]) == R.queue_from_row(single[3][0])
    assert isinstance(R.task_from_row(locked[0][0]).backoff.factor, float)


@pytest.mark.parametrize("padding", [0, LOCK_MANY_INLINE_MAX], ids=["one-statement", "pipelined"])
def test_report_reads_leave_out_the_payload_and_nothing_else(store: Store, padding: int) -> None:
    """A report's tasks come without their payload (it can be large and no report reads
    it), and with every other column exactly as stored, in both of lock_many's forms."""
    queue(store)
    task_id = submit(store, payload={"blob": "x" * 5000})
    s, _ = worker(store)
    ids = [run_one(store, s).attempt.id] + [f"no-such-attempt-{i}" for i in range(padding)]
    with store.driver.transaction() as cx:
        (rows,), _ = cx.lock_many([("task_lock_for_attempts", {"ids": ids})])
    read = R.task_from_row(rows[0])
    stored = store.task_get(task_id)
    assert read.payload == ""
    assert dataclasses.replace(read, payload=stored.payload) == stored


def test_a_large_payload_outlives_every_report(store: Store) -> None:
    """Starts, renewals and finishes read tasks without their payload: none of them may
    write that back. A payload near the limit (TOASTed on PostgreSQL, overflow pages on
    SQLite) is intact after a start, a renewal, a retryable failure and a success."""
    queue(store)
    payloads = [{"n": i, "blob": f"{i}" * 200_000} for i in range(2)]
    task_ids = [submit(store, payload=p, retry_safe=True) for p in payloads]
    stored = {t: store.task_get(t).payload for t in task_ids}
    s, _ = worker(store)
    grants = [run_one(store, s), run_one(store, s)]
    assert {g.task.id: g.task.payload for g in grants} == stored  # the claim reads it
    leases = store.lease_renew_many(s.id, s.epoch, [g.attempt.id for g in grants])
    assert [lease.status for lease in leases] == ["ok", "ok"]
    failed, succeeded = grants
    store.attempt_finish(
        s.id, s.epoch, failed.attempt.id, failed.attempt.fence, Outcome.failure("BOOM")
    )
    store.attempt_finish(
        s.id, s.epoch, succeeded.attempt.id, succeeded.attempt.fence, Outcome.success(1)
    )
    after = {t: store.task_get(t) for t in task_ids}
    assert after[failed.task.id].state == TaskState.SCHEDULED
    assert after[succeeded.task.id].state == TaskState.SUCCEEDED
    assert {t: task.payload for t, task in after.items()} == stored


def test_a_report_from_an_unknown_session_is_refused_and_changes_nothing(store: Store) -> None:
    queue(store)
    submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    before = store.attempt_get(g.attempt.id)
    for report in (
        lambda: store.attempt_finish(
            "nope", s.epoch, g.attempt.id, g.attempt.fence, Outcome.success(1)
        ),
        lambda: store.attempt_start("nope", s.epoch, g.attempt.id, g.attempt.fence),
    ):
        with pytest.raises(OrbitError) as info:
            report()
        assert info.value.code == Code.SESSION_NOT_FOUND
    assert store.attempt_get(g.attempt.id) == before


# PostgreSQL only: SQLite takes its single write lock (BEGIN IMMEDIATE) before any read,
# so there a report never waits for a lock after it began.
@pytest.mark.parametrize("backend", ["postgres"])
@pytest.mark.parametrize("padding", [0, LOCK_MANY_INLINE_MAX], ids=["one-statement", "pipelined"])
def test_a_report_that_waited_for_a_lock_reads_the_clock_after_it(
    make_store: Any, padding: int
) -> None:
    """``padding``: reports of unknown attempts sent along, enough to take the reads out
    of the one-statement form: each read is then its own statement, the clock the last
    one, all sent at once (``lock_many``)."""
    store: Store = make_store()  # the database's own clock
    queue(store)
    submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    url = store_url(store)
    done: dict[str, Any] = {}

    def finish() -> None:
        try:
            unknown = [(f"no-such-attempt-{i}", 1, Outcome.success(1)) for i in range(padding)]
            done["receipt"], *refused = store.attempt_finish_many(
                s.id, s.epoch, [(g.attempt.id, g.attempt.fence, Outcome.success(1)), *unknown]
            )
            assert all(isinstance(r, OrbitError) for r in refused)
        except Exception as exc:  # reported by the assertions below
            done["error"] = exc

    with psycopg.connect(url) as locker, psycopg.connect(url, autocommit=True) as watch:
        locker.execute("SELECT 1 FROM orbit_tasks WHERE id = %s FOR UPDATE", [g.task.id])
        thread = threading.Thread(target=finish)
        thread.start()
        waiting = (
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        deadline = time.monotonic() + 30
        while watch.execute(waiting).fetchone() == (0,):  # until the finish waits on us
            assert time.monotonic() < deadline, "the finish never waited for the lock"
            time.sleep(0.01)
        row = locker.execute(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
        ).fetchone()
        assert row is not None
        released_at = int(row[0])
        locker.commit()
    thread.join(30)
    assert "error" not in done and not isinstance(done["receipt"], OrbitError)
    task = store.task_get(g.task.id)
    assert task.state == "succeeded"
    assert task.finished_at is not None and task.finished_at >= released_at
