"""An operator changes a queue's caps (``Store.queue_update``), on SQLite and PostgreSQL.

Only the caps given change; nothing running is pre-empted by a lowered cap; a raised cap
lets a claim through that it held back and wakes the dispatchers; a new rate or burst
settles the token bucket (``orbit.core.limits.queue_with_caps``)."""

from __future__ import annotations

import json

from orbit.core.model import Outcome
from orbit.store import Store
from tests.conftest import ManualClock
from tests.invariants import check_all
from tests.store.helpers import queue, run_one, submit, worker


def _updates(store: Store) -> list[dict[str, object]]:
    return [json.loads(e["data"]) for e in store.event_list() if e["kind"] == "queue.updated"]


def test_only_the_caps_given_change_and_an_event_says_which(store: Store) -> None:
    queue(store, max_concurrency=3, rate=5, burst=7)
    after = store.queue_update("q", max_concurrency=4)
    assert (after.max_concurrency, after.rate, after.burst) == (4, 5.0, 7)
    assert store.queue_get("q") == after
    assert _updates(store) == [{"max_concurrency": 4, "max_concurrency_before": 3}]
    after = store.queue_update("q", rate=2, burst=2)
    assert (after.max_concurrency, after.rate, after.burst) == (4, 2.0, 2)
    assert _updates(store)[-1] == {"rate": 2.0, "rate_before": 5.0, "burst": 2, "burst_before": 7}
    store.queue_update("q", max_concurrency=4, rate=2)  # the same values: a no-op, no event
    assert len(_updates(store)) == 2
    assert check_all(store) == []


def test_a_raised_cap_lets_a_held_back_claim_through(store: Store) -> None:
    queue(store, max_concurrency=1)
    session, _ = worker(store)
    submit(store)
    submit(store)
    run_one(store, session)
    held = store.attempt_claim_many(session.id, session.epoch, 10)
    assert len(held) == 0 and held.blocked
    freed: list[set[str]] = []
    store.on_freed = lambda queues: freed.append(set(queues))
    store.queue_update("q", max_concurrency=2)
    assert freed == [{"q"}]  # the dispatchers a cap held back are woken
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 1
    assert check_all(store) == []


def test_a_lowered_cap_stops_new_claims_and_running_attempts_go_on(store: Store) -> None:
    queue(store, max_concurrency=3)
    session, _ = worker(store)
    for _ in range(5):
        submit(store)
    running = [run_one(store, session) for _ in range(2)]
    freed: list[set[str]] = []
    store.on_freed = lambda queues: freed.append(set(queues))
    store.queue_update("q", max_concurrency=1)
    assert freed == []  # a lowered cap wakes no one
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 0
    # Both running attempts keep their leases and finish; claims wait until only
    # max_concurrency - 1 are live.
    leases = store.lease_renew_many(session.id, session.epoch, [g.attempt.id for g in running])
    assert [lease.status for lease in leases] == ["ok", "ok"]
    g = running[0]
    store.attempt_finish(
        session.id, session.epoch, g.attempt.id, g.attempt.fence, Outcome.success(None)
    )
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 0  # 1 live: full
    g = running[1]
    store.attempt_finish(
        session.id, session.epoch, g.attempt.id, g.attempt.fence, Outcome.success(None)
    )
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 1
    assert check_all(store) == []


def test_a_faster_rate_lets_a_rate_limited_claim_through(store: Store, clock: ManualClock) -> None:
    queue(store, rate=0.001, burst=1)  # one token per 1,000 s
    session, _ = worker(store)
    for _ in range(3):
        submit(store)
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 1
    assert store.attempt_claim_many(session.id, session.epoch, 10).token_wait_us is not None
    freed: list[set[str]] = []
    store.on_freed = lambda queues: freed.append(set(queues))
    store.queue_update("q", rate=10)
    assert freed == [{"q"}]
    # The bucket held ~0 tokens at the old rate; it refills at the new one from now.
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 0
    clock.advance(0.1)
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 1
    store.queue_update("q", rate=0)  # unlimited
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 1
    assert check_all(store) == []


def test_a_lowered_burst_clamps_the_tokens_held(store: Store, clock: ManualClock) -> None:
    queue(store, rate=1, burst=10)  # starts full: 10 tokens
    session, _ = worker(store)
    for _ in range(10):
        submit(store)
    store.queue_update("q", burst=2)
    assert store.queue_get("q").tokens == 2.0
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 2
    assert check_all(store) == []


def test_a_raised_burst_fills_at_the_rate_not_at_once(store: Store, clock: ManualClock) -> None:
    queue(store, rate=1, burst=1)
    session, _ = worker(store)
    for _ in range(10):
        submit(store)
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 1  # bucket empty
    store.queue_update("q", burst=5)
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 0
    clock.advance(3)
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 3
    assert check_all(store) == []


def test_an_unlimited_queue_made_rate_limited_starts_with_a_full_bucket(
    store: Store, clock: ManualClock
) -> None:
    queue(store, rate=0)
    session, _ = worker(store)
    for _ in range(5):
        submit(store)
    store.queue_update("q", rate=1, burst=3)
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 3
    assert check_all(store) == []


def test_a_rate_of_minus_zero_is_stored_and_reported_as_zero(store: Store) -> None:
    """-0.0 passed every check (it is 0, unlimited) and was kept as it was sent: a queue
    read back, and its ``queue.updated`` event, said ``-0.0``."""
    queue(store, rate=-0.0)
    assert str(store.queue_get("q").rate) == "0.0"
    store.queue_update("q", rate=3)
    after = store.queue_update("q", rate=-0.0)
    assert str(after.rate) == str(store.queue_get("q").rate) == "0.0"
    assert json.dumps(_updates(store)[-1]) == '{"rate": 0.0, "rate_before": 3.0}'
