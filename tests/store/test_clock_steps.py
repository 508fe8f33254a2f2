"""A store clock stepped back (a wall clock set back on the database host), on SQLite and
PostgreSQL: leases, claims and sessions written before the step end a TTL from now, not
the step's length later, and an empty token bucket refills from now
(docs/reliability.md, "Clock steps"). The store's test clock is stepped as the database
host's would be."""

from __future__ import annotations

import logging

import pytest

from orbit.core.model import SECOND
from orbit.store import Store, StoreConfig, open_store
from tests.conftest import ManualClock, store_url
from tests.store.helpers import claim_one, queue, run_one, submit, worker

CONFIG = StoreConfig(claim_ttl_us=10 * SECOND, lease_ttl_us=5 * SECOND, session_ttl_us=60 * SECOND)
STEP_S = 3600  # the clock goes back an hour


def test_a_renew_after_a_backward_step_ends_the_lease_a_ttl_from_now(
    make_store: object, clock: ManualClock
) -> None:
    store: Store = make_store(clock=clock, config=CONFIG)  # type: ignore[operator]
    queue(store)
    session, _ = worker(store)
    submit(store)
    grant = run_one(store, session)
    clock.advance(-STEP_S)
    (lease,) = store.lease_renew_many(session.id, session.epoch, [grant.attempt.id])
    assert lease.status == "ok"
    # not the lease granted before the step, an hour and 5 s from now
    assert lease.lease_expires_at == clock.now + CONFIG.lease_ttl_us
    assert store.attempt_get(grant.attempt.id).lease_expires_at == clock.now + 5 * SECOND
    # and a worker that dies now loses its attempt a lease TTL later
    clock.advance(5)
    assert store.reap().expired_leases == 1
    assert store.task_get(grant.task.id).state == "needs_review"


def test_the_reaper_pulls_back_the_ends_a_backward_step_left(
    make_store: object, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker killed before the step renews nothing: the reaper's pass gives its run
    lease, another's claim lease and both sessions the end a grant made now would have,
    so the attempts are given up a TTL after the step, the sessions a session TTL after.
    Only ends later than twice the TTL from now: a node with a longer TTL grants less."""
    store: Store = make_store(clock=clock, config=CONFIG)  # type: ignore[operator]
    queue(store)
    running, _ = worker(store, name="running")
    claiming, _ = worker(store, name="claiming")
    submit(store)
    submit(store)
    run = run_one(store, running)
    run_lease_end = clock.now + CONFIG.lease_ttl_us
    claim = claim_one(store, claiming)
    with caplog.at_level(logging.WARNING, logger="orbit.store"):
        assert store.reap().total == 0
        # a step back shorter than a TTL leaves ends a node with twice the TTL grants
        clock.advance(-4)
        assert store.reap().total == 0
        assert store.attempt_get(run.attempt.id).lease_expires_at == run_lease_end
        assert not caplog.records  # nothing changed
        clock.advance(4 - STEP_S)
        events = len(store.event_list())
        assert store.reap().total == 0
        (warning,) = caplog.records
    assert len(store.event_list()) == events  # a lease's new end is no event, as a renew's
    assert warning.getMessage().startswith(
        "the database clock went back: 1 run leases, 1 claim leases and 2 sessions"
    )
    now = clock.now
    assert store.attempt_get(run.attempt.id).lease_expires_at == now + CONFIG.lease_ttl_us
    assert store.attempt_get(claim.attempt.id).claim_expires_at == now + CONFIG.claim_ttl_us
    for session in (running, claiming):
        assert store.session_get(session.id).expires_at == now + CONFIG.session_ttl_us
    clock.advance(5)
    assert store.reap().expired_leases == 1
    assert store.task_get(run.task.id).state == "needs_review"
    clock.advance(5)
    assert store.reap().released == 1
    assert store.task_get(claim.task.id).state == "queued"
    clock.advance(50)
    assert store.reap().sessions_expired == 2


def test_an_empty_bucket_refills_from_now_after_a_backward_step(
    make_store: object, clock: ManualClock
) -> None:
    store: Store = make_store(clock=clock, config=CONFIG)  # type: ignore[operator]
    queue(store, max_concurrency=100, rate=1, burst=1)
    submit(store)
    session, _ = worker(store)
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 1  # the burst
    clock.advance(-STEP_S)
    for _ in range(2):
        submit(store)  # due now: one submitted before the step would be due in an hour
    assert store.attempt_claim_many(session.id, session.epoch, 10) == []  # still empty
    clock.advance(1)
    # a token a second from the claim that found the bucket stamped an hour ahead
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 1


def test_a_task_queued_before_a_backward_step_is_claimed_at_once(
    make_store: object, clock: ManualClock
) -> None:
    """A submit makes a task queued with its instant as its run_after; a claim took only
    tasks whose run_after had passed, so one submitted in the hour before the step waited
    that hour. A queued task is due whatever its run_after; a scheduled one still waits."""
    store: Store = make_store(clock=clock, config=CONFIG)  # type: ignore[operator]
    queue(store)
    session, _ = worker(store)
    queued = submit(store)
    clock.advance(-STEP_S)
    later = submit(store, run_after=clock.now + 60 * SECOND)
    grant = claim_one(store, session)
    assert grant.task.id == queued
    assert store.attempt_claim_many(session.id, session.epoch, 1) == []
    assert store.task_get(later).state == "scheduled"


def test_a_node_with_a_shorter_ttl_leaves_longer_leases_alone(
    make_store: object, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """No clock step: a node restarted with a shorter lease TTL (or another node of a
    rolling change) reaps beside leases a longer TTL granted. Pulled back by their TTL
    alone, a healthy worker's lease was cut short unbeknown to it, it renewed at half the
    lease it was given, too late, and its task that was not retry_safe went to
    needs_review. Ends are pulled back only after the clock was seen to go back."""
    long = StoreConfig(
        claim_ttl_us=60 * SECOND, lease_ttl_us=60 * SECOND, session_ttl_us=120 * SECOND
    )
    store: Store = make_store(clock=clock, config=long)  # type: ignore[operator]
    queue(store)
    session, _ = worker(store)
    submit(store)
    grant = run_one(store, session)
    lease_end = store.attempt_get(grant.attempt.id).lease_expires_at
    session_end = store.session_get(session.id).expires_at
    restarted = open_store(store_url(store), CONFIG, clock=clock, migrate=False)
    try:
        clock.advance(1)
        with caplog.at_level(logging.WARNING, logger="orbit.store"):
            assert restarted.reap().total == 0
        assert not caplog.records
        assert store.attempt_get(grant.attempt.id).lease_expires_at == lease_end
        assert store.session_get(session.id).expires_at == session_end
    finally:
        restarted.close()
