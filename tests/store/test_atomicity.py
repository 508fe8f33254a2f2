"""Atomicity: a failure injected in any statement of a transition, the event insert
(the last) included, rolls back the receipt, the state change and the permit together.
One test per transition kind, on both backends; each then shows the same call succeeds
once the fault is gone, so the rollback left nothing half-done behind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from orbit.core.model import Outcome, TaskSpec
from orbit.store import InjectedFault, Store
from orbit.store.store import SUBMIT_CHUNK
from tests.conftest import ManualClock
from tests.invariants import check_all
from tests.store.helpers import claim_one, queue, run_one, submit, worker


def snapshot(store: Store) -> tuple[Any, ...]:
    tasks = store.task_list(limit=1000)
    attempts = [a for t in tasks for a in store.attempt_list(t.id)]
    return (
        tasks,
        attempts,
        store.event_list(),
        store.session_list(),
        store.queue_list(),
        store.live_attempt_counts(),
    )


Setup = Callable[[Store, ManualClock], Callable[[], object]]


def _submit(store: Store, clock: ManualClock) -> Callable[[], object]:
    queue(store)
    return lambda: submit(store, idempotency_key="k")


def _submit_batch(store: Store, clock: ManualClock) -> Callable[[], object]:
    """A batch of several chunks (SUBMIT_CHUNK): the fault fires once all are written."""
    queue(store)
    specs = [TaskSpec(queue="q", handler="h", payload=i) for i in range(2 * SUBMIT_CHUNK + 1)]
    return lambda: store.task_submit_many(specs)


def _claim(store: Store, clock: ManualClock) -> Callable[[], object]:
    queue(store, rate=5, burst=5)
    submit(store)
    s, _ = worker(store)
    return lambda: store.attempt_claim_many(s.id, s.epoch, 5)


def _start(store: Store, clock: ManualClock) -> Callable[[], object]:
    queue(store)
    submit(store)
    s, _ = worker(store)
    g = claim_one(store, s)
    return lambda: store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence)


def _renew(store: Store, clock: ManualClock) -> Callable[[], object]:
    queue(store)
    submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    clock.advance(5)
    return lambda: store.lease_renew_many(s.id, s.epoch, [g.attempt.id])


def _finish(outcome: Outcome) -> Setup:
    def setup(store: Store, clock: ManualClock) -> Callable[[], object]:
        queue(store)
        submit(store)
        s, _ = worker(store)
        g = run_one(store, s)
        return lambda: store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, outcome)

    return setup


def _finish_cancelling(store: Store, clock: ManualClock) -> Callable[[], object]:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    store.task_cancel(tid)
    return lambda: store.attempt_finish(
        s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success()
    )


def _rejected_report(store: Store, clock: ManualClock) -> Callable[[], object]:
    queue(store)
    submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    clock.advance(60)

    def call() -> object:
        try:
            return store.attempt_finish(
                s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success()
            )
        except InjectedFault:
            raise
        except Exception as exc:  # the rejection itself, once the fault is gone
            return exc

    return call


def _release(store: Store, clock: ManualClock) -> Callable[[], object]:
    queue(store)
    submit(store)
    s, _ = worker(store)
    g = claim_one(store, s)
    return lambda: store.attempt_release(s.id, s.epoch, g.attempt.id, g.attempt.fence)


def _cancel(store: Store, clock: ManualClock) -> Callable[[], object]:
    queue(store)
    root = submit(store)
    s, _ = worker(store)
    run_one(store, s)
    child = submit(store, parent_id=root)
    claim_one(store, s)  # the child holds a claimed attempt that the cancel releases
    submit(store, parent_id=child)
    return lambda: store.task_cancel(root)


def _reap_leases(store: Store, clock: ManualClock) -> Callable[[], object]:
    queue(store)
    submit(store, retry_safe=True)
    submit(store, retry_safe=False)
    submit(store)
    s, _ = worker(store)
    run_one(store, s)
    run_one(store, s)
    claim_one(store, s)
    clock.advance(31)
    return store.reap


def _reap_deadline(store: Store, clock: ManualClock) -> Callable[[], object]:
    queue(store)
    submit(store, deadline=clock.now + 1_000_000)
    submit(store, run_after=clock.now + 500_000)
    clock.advance(2)
    return store.reap


def _session_expiry(store: Store, clock: ManualClock) -> Callable[[], object]:
    queue(store)
    submit(store)
    s, _ = worker(store)
    clock.advance(50)
    claim_one(store, s)
    clock.advance(11)  # the session (60 s) has lapsed; the claim lease (30 s) has not
    return store.reap


def _resolve(store: Store, clock: ManualClock) -> Callable[[], object]:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    run_one(store, s)
    clock.advance(31)
    store.reap()
    return lambda: store.task_resolve(tid, "succeeded", Outcome.success("ok"))


def _retry(store: Store, clock: ManualClock) -> Callable[[], object]:
    queue(store)
    tid = submit(store)
    store.task_cancel(tid)
    return lambda: store.task_retry(tid)


def _resume(store: Store, clock: ManualClock) -> Callable[[], object]:
    s, secret = worker(store)
    return lambda: store.session_resume(s.id, secret, node_id="n2")


def _pause(store: Store, clock: ManualClock) -> Callable[[], object]:
    queue(store)
    return lambda: store.queue_pause("q")


CASES: dict[str, tuple[Setup, list[str]]] = {
    "submit": (_submit, ["task_submit_many"]),
    "submit_batch": (_submit_batch, ["task_submit_many"]),
    "claim": (
        _claim,
        ["task_write_many", "attempt_insert_many", "queue_tokens_write_many", "event_insert_many"],
    ),
    "start": (_start, ["attempt_write_many", "task_write_many", "event_insert_many"]),
    "renew": (_renew, ["attempt_write_many", "session_write_many"]),
    "finish_success": (
        _finish(Outcome.success("r")),
        ["attempt_write_many", "task_write_many", "event_insert_many"],
    ),
    "finish_retry": (_finish(Outcome.failure("E")), ["task_write_many", "event_insert_many"]),
    "finish_failed": (_finish(Outcome.failure("E", retryable=False)), ["event_insert_many"]),
    "finish_cancelling": (_finish_cancelling, ["task_write_many", "event_insert_many"]),
    "rejected_report": (_rejected_report, ["event_insert_many"]),
    "release": (_release, ["attempt_write_many", "event_insert_many"]),
    "cancel": (_cancel, ["attempt_write_many", "task_write_many", "event_insert_many"]),
    "reap_leases": (_reap_leases, ["attempt_write_many", "task_write_many", "event_insert_many"]),
    "reap_deadline": (_reap_deadline, ["task_write_many", "event_insert_many"]),
    "session_expiry": (_session_expiry, ["session_write_many", "event_insert_many"]),
    "resolve": (_resolve, ["task_write_many", "event_insert_many"]),
    "operator_retry": (_retry, ["task_write_many", "event_insert_many"]),
    "resume": (_resume, ["session_write_many", "event_insert_many"]),
    "queue_pause": (_pause, ["queue_set_paused", "event_insert_many"]),
}


@pytest.mark.parametrize(("case", "query"), [(c, q) for c, (_, qs) in CASES.items() for q in qs])
def test_failure_mid_transition_rolls_back_everything(
    make_store: Any, clock: ManualClock, case: str, query: str
) -> None:
    store: Store = make_store(clock=clock)
    setup, _ = CASES[case]
    call = setup(store, clock)
    before = snapshot(store)
    with store.inject_fault(query), pytest.raises(InjectedFault):
        call()
    assert snapshot(store) == before
    call()  # the same transition goes through once the fault is gone
    assert snapshot(store) != before
    assert check_all(store) == []
