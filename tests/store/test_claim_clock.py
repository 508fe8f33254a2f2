"""A claim's instant is read after the rows it claims are locked, with the database's own
clock (no test clock here): on PostgreSQL the ready select returns it with its rows
(``locked_at``), on SQLite the store reads it in-process."""

from __future__ import annotations

import time

from orbit.store import Store
from tests.store.helpers import queue, submit, worker


def _now_us() -> int:
    return time.time_ns() // 1000


def test_a_claim_is_stamped_after_the_rows_it_locked(make_store: object) -> None:
    store: Store = make_store()  # type: ignore[operator]
    queue(store)
    ids = [submit(store, payload=i) for i in range(5)]
    session, _ = worker(store)
    submitted = max(store.task_get(i).updated_at for i in ids)
    before = _now_us()
    grants = store.attempt_claim_many(session.id, session.epoch, 5)
    after = _now_us()
    assert sorted(g.task.id for g in grants) == sorted(ids)
    instants = {g.attempt.claimed_at for g in grants}
    assert len(instants) == 1  # one claim, one instant
    (claimed_at,) = instants
    assert submitted <= claimed_at
    assert before - 50_000 <= claimed_at <= after + 50_000  # the same machine's clock
    assert all(g.task.updated_at == claimed_at for g in grants)


def test_the_ready_select_reads_the_clock_after_each_lock(store: Store) -> None:
    queue(store)
    for i in range(4):
        submit(store, payload=i)
    params = {
        "now": 2**62,
        "handlers": ["h"],
        "skip_queues": [],
        "skip_tenants": [],
        "skip_ids": [],
        "limit": 10,
    }
    before = _now_us()
    with store.driver.transaction() as cx:
        rows = cx.fetch("task_ready_select", params)
    assert len(rows) == 4
    read = [row["locked_at"] for row in rows]
    if store.backend == "sqlite":
        assert read == [None] * 4  # the store reads the clock itself
    else:
        assert read == sorted(read)  # row by row, each after its own lock
        assert before - 50_000 <= read[0]
