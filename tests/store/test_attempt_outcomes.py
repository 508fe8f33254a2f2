"""How each attempt ended, as the attempt list shows it (``outcome`` of ``GET
/v1/tasks/{id}/attempts``): read from the event that ended it, which every end of an
attempt writes in its own transaction, so the claim, start and finish paths write
nothing more for it."""

from __future__ import annotations

from orbit.core.errors import OrbitError
from orbit.core.model import Backoff, Outcome
from orbit.store import Store
from tests.conftest import ManualClock
from tests.store.helpers import claim_one, queue, run_one, submit, worker


def test_each_ended_attempt_has_the_kind_and_code_of_the_event_that_ended_it(
    store: Store, clock: ManualClock
) -> None:
    """A release, a lapsed claim, a retryable failure and a success each end an attempt
    of one task, each with its own event: the outcomes are those events' kinds and codes.
    A live attempt has none, nor has an attempt of another task, and a report refused
    after the end (evidence only) does not change it."""
    queue(store)
    task_id = submit(store, max_attempts=3, backoff=Backoff(base_us=1000, max_us=1000))
    session, _ = worker(store)
    released = claim_one(store, session).attempt
    store.attempt_release(session.id, session.epoch, released.id, released.fence)
    lapsed = claim_one(store, session).attempt
    clock.advance(store.config.claim_ttl_us / 1e6 + 1)
    store.reap()
    failed = run_one(store, session).attempt
    boom = Outcome.failure("BOOM", "it broke", retryable=True)
    store.attempt_finish(session.id, session.epoch, failed.id, failed.fence, boom)
    late = Outcome.failure("OTHER", "a second report", retryable=False)
    try:  # refused: the attempt has ended; a `rejected` event is the only write
        store.attempt_finish(session.id, session.epoch, failed.id, failed.fence, late)
        raise AssertionError("a second, different finish was taken")
    except OrbitError:
        pass
    clock.advance(1)  # past the retry's backoff (and within the session's lifetime)
    succeeded = run_one(store, session).attempt
    store.attempt_finish(
        session.id, session.epoch, succeeded.id, succeeded.fence, Outcome.success(1)
    )
    other_task = submit(store)
    live = claim_one(store, session).attempt
    assert live.task_id == other_task

    attempts = store.attempt_list(task_id)
    assert [a.id for a in attempts] == [released.id, lapsed.id, failed.id, succeeded.id]
    assert [str(a.state) for a in attempts] == ["released", "released", "failed", "succeeded"]
    ids = [a.id for a in attempts] + [live.id]
    assert store.attempt_outcomes(task_id, ids) == {
        released.id: ("released", None),
        lapsed.id: ("claim_expired", "CLAIM_EXPIRED"),
        failed.id: ("retry_scheduled", "BOOM"),
        succeeded.id: ("succeeded", None),
    }
    assert store.attempt_outcomes(other_task, ids) == {}  # live, and of another task
    assert store.attempt_outcomes(task_id, [failed.id]) == {failed.id: ("retry_scheduled", "BOOM")}
    assert store.attempt_outcomes(task_id, []) == {}


def test_an_attempt_whose_lease_ran_out_ends_with_the_reapers_code(
    store: Store, clock: ManualClock
) -> None:
    """A running attempt of a task that is not retry-safe, whose worker went silent: the
    reaper ends it ``unknown`` and the task ``needs_review``; its outcome says so, with
    the code the reaper gave (LEASE_EXPIRED)."""
    queue(store)
    task_id = submit(store)
    session, _ = worker(store)
    running = run_one(store, session).attempt
    assert store.attempt_outcomes(task_id, [running.id]) == {}
    clock.advance(store.config.lease_ttl_us / 1e6 + 1)
    store.reap()
    assert store.task_get(task_id).state == "needs_review"
    assert store.attempt_outcomes(task_id, [running.id]) == {
        running.id: ("needs_review", "LEASE_EXPIRED")
    }
