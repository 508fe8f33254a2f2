"""The lifecycle table of DESIGN §2, transition by transition, on both backends."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from orbit.core.errors import Code, OrbitError, Rejected
from orbit.core.model import SECOND, Backoff, Capability, Outcome, TaskSpec, compact_json
from orbit.store import Store, StoreConfig
from orbit.store.store import SUBMIT_CHUNK
from tests.conftest import ManualClock
from tests.invariants import check_all
from tests.store.helpers import claim_one, queue, run_one, submit, worker


def test_success_path_and_events(store: Store) -> None:
    queue(store)
    tid = submit(store, payload={"url": "https://example.test"})
    s, _ = worker(store)
    g = run_one(store, s)
    assert store.task_get(tid).state == "running"
    assert store.task_get(tid).attempts_used == 1
    receipt = store.attempt_finish(
        s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success({"png": "abc"})
    )
    task = store.task_get(tid)
    assert task.state == "succeeded" and task.result == '{"png":"abc"}'
    assert receipt.task_state == "succeeded" and receipt.result_version == 1
    kinds = [e["kind"] for e in store.event_list(task_id=tid)]
    assert kinds == ["submitted", "claimed", "started", "succeeded"]
    assert check_all(store) == []


def test_repeated_finish_returns_the_original_receipt(store: Store) -> None:
    queue(store)
    submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    first = store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success(1))
    events_before = len(store.event_list())
    again = store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success(1))
    assert again == first
    assert len(store.event_list()) == events_before  # nothing written
    with pytest.raises(Rejected) as err:
        store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success(2))
    assert err.value.code == Code.ALREADY_FINISHED
    assert store.task_get(g.task.id).result == "1"


def test_retryable_failure_schedules_with_backoff_then_succeeds(
    store: Store, clock: ManualClock
) -> None:
    queue(store)
    tid = submit(store, backoff=Backoff(base_us=10 * SECOND, factor=2.0, max_us=60 * SECOND))
    s, _ = worker(store)
    g = run_one(store, s)
    receipt = store.attempt_finish(
        s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.failure("FLAKY", "try again")
    )
    task = store.task_get(tid)
    assert receipt.task_state == "scheduled" and task.state == "scheduled"
    assert clock.now + 5 * SECOND <= task.run_after <= clock.now + 10 * SECOND
    assert store.attempt_claim_many(s.id, s.epoch, 1) == []  # not due yet
    clock.now = task.run_after
    g2 = run_one(store, s)
    assert g2.attempt.number == 2 and g2.attempt.fence == 2
    store.attempt_finish(s.id, s.epoch, g2.attempt.id, g2.attempt.fence, Outcome.success())
    assert store.task_get(tid).state == "succeeded"
    assert store.task_get(tid).attempts_used == 2


def test_attempts_exhausted_and_non_retryable_fail(store: Store, clock: ManualClock) -> None:
    queue(store)
    exhausted = submit(store, max_attempts=1)
    fatal = submit(store)
    s, _ = worker(store)
    for _ in range(2):
        g = run_one(store, s)
        retryable = g.task.id == exhausted
        store.attempt_finish(
            s.id,
            s.epoch,
            g.attempt.id,
            g.attempt.fence,
            Outcome.failure("E", "boom", retryable=retryable),
        )
    for tid in (exhausted, fatal):
        task = store.task_get(tid)
        assert task.state == "failed" and task.error_code == "E"


def test_retry_past_deadline_fails_with_deadline_exceeded(store: Store, clock: ManualClock) -> None:
    queue(store)
    tid = submit(
        store,
        deadline=clock.now + 5 * SECOND,
        backoff=Backoff(base_us=20 * SECOND, factor=1.0, max_us=20 * SECOND),
    )
    s, _ = worker(store)
    g = run_one(store, s)
    store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.failure("E"))
    task = store.task_get(tid)
    assert task.state == "failed" and task.error_code == "DEADLINE_EXCEEDED"


def test_release_returns_task_without_using_an_attempt(store: Store) -> None:
    queue(store)
    tid = submit(store, max_attempts=1)
    s, _ = worker(store)
    g = claim_one(store, s)
    store.attempt_release(s.id, s.epoch, g.attempt.id, g.attempt.fence)
    assert store.task_get(tid).state == "queued"
    assert store.attempt_get(g.attempt.id).state == "released"
    g2 = run_one(store, s)
    assert g2.task.id == tid and store.task_get(tid).attempts_used == 1
    with pytest.raises(Rejected) as err:
        store.attempt_release(s.id, s.epoch, g2.attempt.id, g2.attempt.fence)
    assert err.value.code == Code.NOT_CLAIMED


def test_start_is_idempotent_for_a_lost_ack(store: Store) -> None:
    queue(store)
    submit(store)
    s, _ = worker(store)
    g = claim_one(store, s)
    first = store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence)
    again = store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence)
    assert again == first
    assert store.task_get(g.task.id).attempts_used == 1


@pytest.mark.parametrize("case", ["fence", "epoch", "owner", "lease", "no_start", "deadline"])
def test_stale_finish_is_rejected_with_evidence(
    store: Store, clock: ManualClock, case: str
) -> None:
    """I3: each kind of stale report changes nothing and leaves an event."""
    queue(store)
    tid = submit(store, deadline=clock.now + 3600 * SECOND)
    s, secret = worker(store)
    other, _ = worker(store, name="other")
    g = claim_one(store, s) if case == "no_start" else run_one(store, s)
    sid, epoch, fence = s.id, s.epoch, g.attempt.fence
    expected = {
        "fence": Code.STALE_FENCE,
        "epoch": Code.FENCED_EPOCH,
        "owner": Code.NOT_OWNER,
        "lease": Code.LEASE_EXPIRED,
        "no_start": Code.FINISH_WITHOUT_START,
        "deadline": Code.DEADLINE_EXCEEDED,
    }[case]
    if case == "fence":
        fence += 1
    elif case == "epoch":
        store.session_resume(s.id, secret, node_id="n2")
    elif case == "owner":
        sid, epoch = other.id, other.epoch
    elif case == "lease":
        clock.advance(31)
    elif case == "deadline":
        clock.advance(3600)
    before_task, before_attempt = store.task_get(tid), store.attempt_get(g.attempt.id)
    before_events = store.event_list()
    with pytest.raises(Rejected) as err:
        store.attempt_finish(sid, epoch, g.attempt.id, fence, Outcome.success("late"))
    assert err.value.code == expected
    assert store.task_get(tid) == before_task
    assert store.attempt_get(g.attempt.id) == before_attempt
    new = store.event_list(after_xid=before_events[-1]["xid"], after_id=before_events[-1]["id"])
    assert [(e["kind"], e["code"]) for e in new] == [("rejected", expected)]


def test_finish_without_start_frees_no_capacity(store: Store) -> None:
    queue(store, max_concurrency=1)
    submit(store)
    submit(store)
    s, _ = worker(store)
    g = claim_one(store, s)
    with pytest.raises(Rejected):
        store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success())
    assert store.attempt_claim_many(s.id, s.epoch, 5) == []  # the permit is still held
    assert store.attempt_get(g.attempt.id).state == "claimed"


def test_paused_queue_blocks_start_but_not_finish(store: Store) -> None:
    queue(store)
    submit(store)
    submit(store)
    s, _ = worker(store)
    running = run_one(store, s)
    claimed = claim_one(store, s)
    store.queue_pause("q")
    with pytest.raises(Rejected) as err:
        store.attempt_start(s.id, s.epoch, claimed.attempt.id, claimed.attempt.fence)
    assert err.value.code == Code.QUEUE_PAUSED
    receipt = store.attempt_finish(
        s.id, s.epoch, running.attempt.id, running.attempt.fence, Outcome.success("saved")
    )
    assert receipt.task_state == "succeeded"
    assert store.attempt_claim_many(s.id, s.epoch, 5) == []  # paused: nothing claimable
    store.queue_resume("q")
    store.attempt_start(s.id, s.epoch, claimed.attempt.id, claimed.attempt.fence)


def test_a_lease_says_its_time_left_by_the_stores_clock(store: Store, clock: ManualClock) -> None:
    """What a worker times its lease from, so its own wall clock never enters."""
    queue(store)
    submit(store, deadline=clock.now + 100 * SECOND)
    s, _ = worker(store)
    g = claim_one(store, s)
    clock.advance(1)
    started = store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence)
    assert started.lease_expires_at is not None
    assert started.lease_left_us == started.lease_expires_at - clock.now == 30 * SECOND
    clock.advance(4)
    again = store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence)  # a lost ACK
    assert again.lease_left_us == 26 * SECOND
    for left in (30, 30, 20):  # renewed at 30, 55 and 80 s: the deadline (100 s) caps it
        clock.advance(25)
        (renewed,) = store.lease_renew_many(s.id, s.epoch, [g.attempt.id])
        assert renewed.status == "ok" and renewed.lease_left_us == left * SECOND
    (lost,) = store.lease_renew_many(s.id, s.epoch, ["01234567-unknown"])
    assert lost.status == "lost" and lost.lease_left_us is None


def test_renew_extends_capped_by_timeout_and_deadline(store: Store, clock: ManualClock) -> None:
    queue(store)
    t0 = clock.now
    timed = submit(store, attempt_timeout_us=45 * SECOND)
    submit(store, deadline=t0 + 40 * SECOND)
    s, _ = worker(store)
    first, second = run_one(store, s), run_one(store, s)
    a, b = (first, second) if first.task.id == timed else (second, first)
    a, b = a.attempt, b.attempt
    clock.advance(20)
    leases = {x.attempt_id: x for x in store.lease_renew_many(s.id, s.epoch, [a.id, b.id])}
    # the timeout's lease includes the report grace, so the runner's ATTEMPT_TIMEOUT lands
    assert leases[a.id].status == "ok" and leases[a.id].lease_expires_at == t0 + 50 * SECOND
    assert leases[b.id].status == "ok" and leases[b.id].lease_expires_at == t0 + 40 * SECOND
    clock.advance(26)  # past the attempt timeout: the lease is no longer extended
    leases = {x.attempt_id: x for x in store.lease_renew_many(s.id, s.epoch, [a.id])}
    assert leases[a.id].status == "ok" and leases[a.id].lease_expires_at == t0 + 50 * SECOND
    receipt = store.attempt_finish(
        s.id, s.epoch, a.id, a.fence, Outcome.failure("ATTEMPT_TIMEOUT", retryable=True)
    )
    assert receipt.task_state == "scheduled"  # the runner's timeout report is accepted
    clock.advance(5)
    leases = {x.attempt_id: x for x in store.lease_renew_many(s.id, s.epoch, [b.id])}
    assert leases[b.id].status == "lost"  # b's lease ended at its deadline


def test_cancel_cascades_to_descendants_in_one_transaction(store: Store) -> None:
    queue(store)
    job = submit(store)
    s, _ = worker(store)
    run_one(store, s)  # the job is running
    child = submit(store, handler="other", parent_id=job)
    grandchild = submit(store, handler="other", parent_id=child)
    claimed_child = submit(store, parent_id=job)
    g = claim_one(store, s)  # the worker only runs "h": it claims claimed_child
    assert g.task.id == claimed_child
    store.task_cancel(job)
    assert store.task_get(job).state == "cancelling"
    for tid in (child, grandchild, claimed_child):
        assert store.task_get(tid).state == "cancelled"
    assert store.attempt_get(g.attempt.id).state == "released"
    ats = {e["at"] for e in store.event_list() if e["kind"] in ("cancelled", "cancel_requested")}
    assert len(ats) == 1  # one transaction, one instant
    with pytest.raises(OrbitError) as err:
        submit(store, parent_id=job)
    assert err.value.code == Code.PARENT_CANCELLED
    assert check_all(store) == []


def test_cancel_wins_the_race_with_a_result(store: Store) -> None:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    store.task_cancel(tid)
    [lease] = store.lease_renew_many(s.id, s.epoch, [g.attempt.id])
    assert lease.status == "cancel"
    receipt = store.attempt_finish(
        s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success("too late")
    )
    task = store.task_get(tid)
    assert receipt.task_state == "cancelled" and task.state == "cancelled"
    assert task.result is None and task.result_version == 0
    evidence = store.event_list(task_id=tid)[-1]
    assert evidence["kind"] == "cancelled" and "too late" in evidence["data"]


def test_cancel_is_idempotent(store: Store) -> None:
    queue(store)
    tid = submit(store)
    store.task_cancel(tid)
    n = len(store.event_list())
    assert store.task_cancel(tid).state == "cancelled"
    assert len(store.event_list()) == n


def test_reaper_releases_expired_claims(store: Store, clock: ManualClock) -> None:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = claim_one(store, s)
    clock.advance(29.9)
    assert store.reap().total == 0
    clock.advance(0.2)
    assert store.reap().released == 1
    assert store.task_get(tid).state == "queued"
    with pytest.raises(Rejected) as err:
        store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence)
    assert err.value.code == Code.ATTEMPT_ENDED


def test_reaper_lease_expiry_splits_on_retry_safe(store: Store, clock: ManualClock) -> None:
    queue(store)
    safe = submit(store, retry_safe=True)
    unsafe = submit(store, retry_safe=False)
    s, _ = worker(store)
    ga, gb = run_one(store, s), run_one(store, s)
    clock.advance(30)
    report = store.reap()
    assert report.expired_leases == 2
    assert store.task_get(safe).state == "scheduled"
    assert store.attempt_get(ga.attempt.id if ga.task.id == safe else gb.attempt.id).state == "lost"
    task = store.task_get(unsafe)
    assert task.state == "needs_review" and task.attempts_used == 1
    unknown = gb.attempt.id if gb.task.id == unsafe else ga.attempt.id
    assert store.attempt_get(unknown).state == "unknown"
    # capacity is usable by other work, and the unsafe task is not re-run
    other = submit(store)
    clock.advance(10)
    grants = store.attempt_claim_many(s.id, s.epoch, 10)
    assert {g.task.id for g in grants} == {safe, other}
    assert check_all(store) == []


def test_reaper_marks_timed_out_attempts(store: Store, clock: ManualClock) -> None:
    queue(store)
    tid = submit(store, retry_safe=True, attempt_timeout_us=5 * SECOND, max_attempts=1)
    s, _ = worker(store)
    g = run_one(store, s)
    clock.advance(5)
    assert store.reap().total == 0  # the lease lasts the report grace beyond the timeout
    clock.advance(5)
    store.reap()
    assert store.attempt_get(g.attempt.id).state == "timed_out"
    task = store.task_get(tid)
    assert task.state == "failed" and task.error_code == "ATTEMPT_TIMEOUT"


@pytest.mark.parametrize("max_attempts", [1, 3])
def test_reaper_fails_a_lost_attempt_past_its_deadline_with_deadline_exceeded(
    store: Store, clock: ManualClock, max_attempts: int
) -> None:
    # The deadline decides the code whether or not attempts remain: with the one attempt
    # used, the retry plan alone would have said ATTEMPT_LOST.
    queue(store)
    tid = submit(
        store, retry_safe=True, max_attempts=max_attempts, deadline=clock.now + 10 * SECOND
    )
    s, _ = worker(store)
    g = run_one(store, s)
    clock.advance(11)
    report = store.reap()
    # a run lease that ran out (at the deadline, where renew caps it) is a lease expiry
    # too: counted as a deadline alone, orbit_lease_expiries_total missed it
    assert report.deadlines == 1 and report.expired_leases == 1
    assert store.attempt_get(g.attempt.id).state == "lost"
    task = store.task_get(tid)
    assert task.state == "failed" and task.error_code == "DEADLINE_EXCEEDED"
    assert not task.error_retryable
    assert check_all(store) == []


def test_reaper_fails_waiting_tasks_past_deadline(store: Store, clock: ManualClock) -> None:
    queue(store)
    queued = submit(store, deadline=clock.now + 10 * SECOND)
    s, _ = worker(store)
    clock.advance(10)
    assert store.attempt_claim_many(s.id, s.epoch, 5) == []
    assert store.reap().deadlines == 1
    task = store.task_get(queued)
    assert task.state == "failed" and task.error_code == "DEADLINE_EXCEEDED"


def test_reaper_promotes_scheduled_tasks(store: Store, clock: ManualClock) -> None:
    queue(store)
    tid = submit(store, run_after=clock.now + 60 * SECOND)
    assert store.task_get(tid).state == "scheduled"
    clock.advance(60)
    assert store.reap().promoted == 1
    assert store.task_get(tid).state == "queued"


def test_cancelling_task_whose_lease_expires_is_cancelled(store: Store, clock: ManualClock) -> None:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    run_one(store, s)
    store.task_cancel(tid)
    clock.advance(30)
    store.reap()
    assert store.task_get(tid).state == "cancelled"


@pytest.mark.parametrize("decision", ["succeeded", "failed", "retry"])
def test_resolve_needs_review(store: Store, clock: ManualClock, decision: str) -> None:
    queue(store)
    tid = submit(store, max_attempts=1)
    s, _ = worker(store)
    run_one(store, s)
    clock.advance(30)
    store.reap()
    assert store.task_get(tid).state == "needs_review"
    outcome = Outcome.success({"checked": True}) if decision == "succeeded" else None
    task = store.task_resolve(tid, decision, outcome)
    assert task.state == {"succeeded": "succeeded", "failed": "failed", "retry": "queued"}[decision]
    if decision == "retry":
        g = run_one(store, s)
        assert g.task.id == tid and store.task_get(tid).attempts_used == 2
    with pytest.raises(OrbitError) as err:
        store.task_resolve(tid, "failed")
    assert err.value.code == Code.INVALID_STATE
    assert check_all(store) == []


def test_operator_retry_of_a_failed_task(store: Store) -> None:
    queue(store)
    tid = submit(store, max_attempts=1)
    s, _ = worker(store)
    g = run_one(store, s)
    store.attempt_finish(
        s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.failure("E", retryable=False)
    )
    assert store.task_retry(tid).state == "queued"
    assert run_one(store, s).task.id == tid
    with pytest.raises(OrbitError) as err:
        store.task_retry(tid)
    assert err.value.code == Code.INVALID_STATE


def test_an_operator_retry_past_the_deadline_is_refused(store: Store, clock: ManualClock) -> None:
    """A retry, or a resolve 'retry', of a task whose deadline has passed used to queue
    it for the reaper's next pass to fail DEADLINE_EXCEEDED: it is refused with that
    code, and the task is left as it was. Before the deadline both still work."""
    queue(store)
    s, _ = worker(store)
    failed = submit(store, max_attempts=1, deadline=clock.now + 60 * SECOND)
    g = run_one(store, s)
    store.attempt_finish(
        s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.failure("E", retryable=False)
    )
    review = submit(store, max_attempts=1, deadline=clock.now + 60 * SECOND)
    run_one(store, s)
    clock.advance(30)
    store.reap()
    assert store.task_get(review).state == "needs_review"
    clock.advance(31)  # past both deadlines
    for call in (lambda: store.task_retry(failed), lambda: store.task_resolve(review, "retry")):
        before = [store.task_get(failed), store.task_get(review)]
        with pytest.raises(OrbitError) as err:
            call()
        assert err.value.code == Code.DEADLINE_EXCEEDED
        assert [store.task_get(failed), store.task_get(review)] == before
    assert store.task_resolve(review, "failed").state == "failed"  # other decisions stand
    assert check_all(store) == []


def test_resume_fences_the_old_epoch(store: Store) -> None:
    queue(store)
    tid = submit(store)
    s, secret = worker(store)
    g = run_one(store, s)
    resumed = store.session_resume(s.id, secret, node_id="n2")
    assert resumed.epoch == s.epoch + 1 and resumed.node_id == "n2"
    [lost] = store.lease_renew_many(s.id, s.epoch, [g.attempt.id])
    assert lost.status == "lost"
    [ok] = store.lease_renew_many(s.id, resumed.epoch, [g.attempt.id])
    assert ok.status == "ok"
    receipt = store.attempt_finish(
        s.id, resumed.epoch, g.attempt.id, g.attempt.fence, Outcome.success()
    )
    assert receipt.task_state == "succeeded" and store.task_get(tid).state == "succeeded"
    with pytest.raises(OrbitError) as err:
        store.session_resume(s.id, "wrong secret", node_id="n3")
    assert err.value.code == Code.BAD_SECRET and "wrong secret" not in str(err.value)


def test_session_expiry_releases_claims_but_keeps_running_leases(
    store: Store, clock: ManualClock
) -> None:
    queue(store)
    submit(store)
    submit(store)
    s, secret = worker(store)
    running = run_one(store, s)
    claimed = claim_one(store, s)
    clock.advance(25)
    store.lease_renew_many(s.id, s.epoch, [running.attempt.id])  # also a heartbeat
    clock.advance(60)
    report = store.reap()
    assert report.sessions_expired == 1
    assert store.attempt_get(claimed.attempt.id).state == "released"
    with pytest.raises(Rejected) as err:
        store.attempt_claim_many(s.id, s.epoch, 1)
    assert err.value.code == Code.SESSION_EXPIRED
    resumed = store.session_resume(s.id, secret, node_id="n1")
    assert len(store.attempt_claim_many(s.id, resumed.epoch, 5)) == 1


def test_capacity_updates_are_absolute_and_sequenced(store: Store) -> None:
    queue(store)
    for _ in range(5):
        submit(store)
    s, _ = worker(store, handlers={"h": 10}, max_concurrency=10)
    store.session_capacity_set(
        s.id, s.epoch, seq=2, capabilities=[Capability("h", 2)], max_concurrency=2
    )
    with pytest.raises(Rejected) as err:
        store.session_capacity_set(
            s.id, s.epoch, seq=1, capabilities=[Capability("h", 9)], max_concurrency=9
        )
    assert err.value.code == Code.STALE_CAPACITY
    assert len(store.attempt_claim_many(s.id, s.epoch, 10)) == 2


def test_capacity_seq_zero_is_stale_and_leaves_its_event(store: Store) -> None:
    """A new session's seq is 0, so a capacity update with seq 0 is not newer: it was
    refused INVALID_ARGUMENT before the transaction, without the event every refused
    capacity update leaves. It is STALE_CAPACITY, with its event, and changes nothing;
    a negative seq (no counter the wire can carry) is still refused before."""
    s, _ = worker(store, handlers={"h": 10}, max_concurrency=10)
    before = store.session_get(s.id)
    events = len(store.event_list())
    with pytest.raises(Rejected) as err:
        store.session_capacity_set(
            s.id, s.epoch, seq=0, capabilities=[Capability("h", 2)], max_concurrency=2
        )
    assert err.value.code == Code.STALE_CAPACITY
    assert store.session_get(s.id) == before
    [event] = store.event_list()[events:]
    assert (event["kind"], event["code"], event["session_id"]) == (
        "rejected",
        "STALE_CAPACITY",
        s.id,
    )
    with pytest.raises(OrbitError) as bad:
        store.session_capacity_set(
            s.id, s.epoch, seq=-1, capabilities=[Capability("h", 2)], max_concurrency=2
        )
    assert bad.value.code == Code.INVALID_ARGUMENT
    assert store.session_get(s.id) == before
    assert len(store.event_list()) == events + 1


def test_drain_is_durable_and_stops_claims(make_store: object, clock: ManualClock) -> None:
    store: Store = make_store(clock=clock)  # type: ignore[operator]
    queue(store)
    submit(store)
    s, _ = worker(store)
    store.session_drain(s.id)
    assert store.session_get(s.id).draining
    with pytest.raises(Rejected) as err:
        store.attempt_claim_many(s.id, s.epoch, 1)
    assert err.value.code == Code.SESSION_DRAINING


def test_caps_queue_tenant_session_global_and_handler(store: Store) -> None:
    queue(store, "a", max_concurrency=3)
    queue(store, "b", max_concurrency=10)
    store.tenant_limit_set("acme", 2)
    for _ in range(5):
        submit(store, "a")
        submit(store, "b", tenant="acme")
        submit(store, "b", handler="slow")
    s, _ = worker(store, handlers={"h": 100, "slow": 1}, max_concurrency=100)
    grants = store.attempt_claim_many(s.id, s.epoch, 100)
    by = [(g.task.queue, g.task.tenant, g.task.handler) for g in grants]
    assert by.count(("a", "default", "h")) == 3
    assert by.count(("b", "acme", "h")) == 2
    assert by.count(("b", "default", "slow")) == 1
    store.global_limit_set(7)
    assert store.attempt_claim_many(s.id, s.epoch, 100) == []  # 6 live; all scopes full
    store.tenant_limit_set("acme", None)
    assert len(store.attempt_claim_many(s.id, s.epoch, 100)) == 1  # global cap 7


def test_rate_limit_token_bucket(store: Store, clock: ManualClock) -> None:
    queue(store, max_concurrency=100, rate=2, burst=3)
    for _ in range(10):
        submit(store)
    s, _ = worker(store, max_concurrency=100)
    assert len(store.attempt_claim_many(s.id, s.epoch, 10)) == 3  # the burst
    assert store.attempt_claim_many(s.id, s.epoch, 10) == []
    clock.advance(1)
    assert len(store.attempt_claim_many(s.id, s.epoch, 10)) == 2  # 2 per second


def test_a_claim_short_of_tokens_says_when_the_next_is_due(
    store: Store, clock: ManualClock
) -> None:
    """A claim held back by a queue's rate reports how long until that queue has a token
    again (``Grants.token_wait_us``), and a claim made exactly that much later gets one:
    what lets a dispatcher wake for it when nothing else happens."""
    queue(store, "slow", max_concurrency=100, rate=4, burst=2)
    queue(store, "free", max_concurrency=100, rate=0)
    for _ in range(5):
        submit(store, "slow")
    s, _ = worker(store, max_concurrency=100)
    first = store.attempt_claim_many(s.id, s.epoch, 10)
    assert len(first) == 2 and first.blocked  # the burst, then out of tokens
    assert first.token_wait_us == SECOND // 4
    clock.advance(0.1)
    early = store.attempt_claim_many(s.id, s.epoch, 10)
    assert early == [] and early.token_wait_us == SECOND * 15 // 100  # the rest of it
    clock.advance(0.15)
    again = store.attempt_claim_many(s.id, s.epoch, 10)
    assert len(again) == 1 and again.token_wait_us == SECOND // 4
    # a claim that stops for another reason, or with tokens to spare, reports no wait
    submit(store, "free")
    clock.advance(10)  # the bucket is full again (2 tokens)
    rest = store.attempt_claim_many(s.id, s.epoch, 10)
    assert sorted(g.task.queue for g in rest) == ["free", "slow", "slow"]
    assert rest.token_wait_us is None  # the slow queue is empty, not short
    store.queue_pause("slow")
    submit(store, "slow")
    clock.advance(0.1)
    paused = store.attempt_claim_many(s.id, s.epoch, 10)
    assert paused == [] and paused.token_wait_us is None  # its resume wakes a dispatcher


def test_priority_then_fifo(store: Store, clock: ManualClock) -> None:
    queue(store)
    low = submit(store, priority=0)
    clock.advance(0.001)
    high = submit(store, priority=5)
    clock.advance(0.001)
    low2 = submit(store, priority=0)
    s, _ = worker(store)
    order = [g.task.id for g in store.attempt_claim_many(s.id, s.epoch, 3)]
    assert order == [high, low, low2]


def test_a_batch_is_claimed_in_the_order_it_was_submitted(store: Store) -> None:
    """A batch's tasks share their instant; their ids still sort in the batch's order,
    across the chunks a large batch is written in (SUBMIT_CHUNK), so FIFO holds."""
    n = 2 * SUBMIT_CHUNK + 7
    queue(store, max_concurrency=n)
    specs = [TaskSpec(queue="q", handler="h", payload=i) for i in range(n)]
    made = [d.task.id for d in store.task_submit_many(specs)]
    s, _ = worker(store, handlers={"h": n}, max_concurrency=n)
    claimed = [g.task.payload for g in store.attempt_claim_many(s.id, s.epoch, n)]
    assert claimed == [str(i) for i in range(n)] and sorted(made) == made


def test_idempotent_submit(store: Store) -> None:
    queue(store)
    spec = TaskSpec(queue="q", handler="h", payload={"a": 1}, idempotency_key="k1")
    first = store.task_submit(spec)
    again = store.task_submit(spec)
    assert first.created and not again.created and again.task.id == first.task.id
    other_tenant = store.task_submit(
        TaskSpec(queue="q", handler="h", payload={"a": 2}, idempotency_key="k1", tenant="t2")
    )
    assert other_tenant.created


def test_an_idempotent_retry_after_the_deadline_returns_the_task(
    store: Store, clock: ManualClock
) -> None:
    """A client that retries a submit once its deadline has passed gets the task its key
    made (whatever became of it), not INVALID_DEADLINE; a new key still gets the error."""
    queue(store)
    spec = TaskSpec(
        queue="q",
        handler="h",
        payload={"a": 1},
        idempotency_key="k1",
        deadline=clock.now + 10 * SECOND,
    )
    first = store.task_submit(spec)
    clock.advance(11)
    for _ in range(2):  # before the reaper fails it, and after
        again = store.task_submit_many([spec])[0]
        assert not again.created and again.task.id == first.task.id
        store.reap()
    assert store.task_get(first.task.id).error_code == "DEADLINE_EXCEEDED"
    with pytest.raises(OrbitError) as err:
        store.task_submit(replace(spec, idempotency_key="k2"))
    assert err.value.code == Code.INVALID_DEADLINE
    assert len(store.task_list(limit=10)) == 1


def test_submit_many_is_one_batch(store: Store) -> None:
    queue(store)
    specs = [
        TaskSpec(queue="q", handler="h", payload=i, idempotency_key=f"k{i % 3}") for i in range(3)
    ] + [TaskSpec(queue="q", handler="h", payload=0, idempotency_key="k0")]
    results = store.task_submit_many(specs)
    assert [r.created for r in results] == [True, True, True, False]
    assert results[3].task.id == results[0].task.id
    assert store.task_counts() == {"queued": 3}


def test_long_handler_survives_on_renewals(store: Store, clock: ManualClock) -> None:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    for _ in range(9):  # three lease lengths, renewed every 10 s
        clock.advance(10)
        [lease] = store.lease_renew_many(s.id, s.epoch, [g.attempt.id])
        assert lease.status == "ok"
        assert store.reap().total == 0
    store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success())
    assert store.task_get(tid).state == "succeeded"


def test_config_lease_lengths_are_honoured(make_store: object, clock: ManualClock) -> None:
    store: Store = make_store(  # type: ignore[operator]
        clock=clock, config=StoreConfig(claim_ttl_us=2 * SECOND, lease_ttl_us=3 * SECOND)
    )
    queue(store)
    submit(store)
    s, _ = worker(store)
    g = claim_one(store, s)
    assert g.attempt.claim_expires_at == clock.now + 2 * SECOND
    lease = store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence)
    assert lease.lease_expires_at == clock.now + 3 * SECOND


def test_progress_is_an_event_of_a_running_attempt(store: Store, clock: ManualClock) -> None:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    before = store.task_get(tid)
    store.attempt_progress(
        s.id, s.epoch, g.attempt.id, g.attempt.fence, fraction=0.5, message="halfway"
    )
    assert store.task_get(tid) == before  # no state change
    [event] = [e for e in store.event_list(task_id=tid) if e["kind"] == "progress"]
    assert json.loads(event["data"]) == {"fraction": 0.5, "message": "halfway"}
    with pytest.raises(OrbitError) as err:
        store.attempt_progress(s.id, s.epoch, g.attempt.id, g.attempt.fence, fraction=1.5)
    assert err.value.code == Code.INVALID_ARGUMENT
    store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success())
    with pytest.raises(Rejected) as late:
        store.attempt_progress(s.id, s.epoch, g.attempt.id, g.attempt.fence, fraction=1.0)
    assert late.value.code == Code.ATTEMPT_ENDED
    assert check_all(store) == []


def test_submitted_events_are_made_from_the_inserted_tasks(
    store: Store, clock: ManualClock
) -> None:
    """The database writes each new task's `submitted` event from the row it inserted
    (``task_submit_many``): one per task created, in submission order, none for a task an
    idempotency key answered, spelled exactly as every other event's data."""
    queue(store)
    queue(store, "q2")
    first = submit(store, idempotency_key="k")
    specs = [
        TaskSpec(queue="q", handler="h.one", payload={"n": 1}),
        TaskSpec(queue="q", handler="h", idempotency_key="k"),  # answered by the first
        TaskSpec(queue="q2", handler="h-2:x", tenant="t1", payload=[1, "two"]),
        TaskSpec(queue="q", handler="h", run_after=clock.now + 60 * SECOND),  # scheduled
    ]
    done = store.task_submit_many(specs)
    assert [d.created for d in done] == [True, False, True, True]
    assert done[1].task.id == first
    fresh = [d.task for d in done if d.created]
    events = [e for e in store.event_list() if e["kind"] == "submitted" and e["task_id"] != first]
    assert [e["task_id"] for e in events] == [t.id for t in fresh]
    for task, event in zip(fresh, events, strict=True):
        assert event["kind"] == "submitted"
        assert event["at"] == task.created_at
        assert (event["queue"], event["tenant"]) == (task.queue, task.tenant)
        assert (event["task_from"], event["task_to"]) == (None, str(task.state))
        assert event["attempt_id"] is None and event["session_id"] is None
        assert event["code"] is None
        expected = {"handler": task.handler, "payload_digest": task.payload_digest}
        assert event["data"] == compact_json(expected, sort_keys=True).decode()
    assert [t.state for t in fresh] == ["queued", "queued", "scheduled"]
    assert check_all(store) == []


def test_renew_while_cancelling_says_cancel_and_does_not_extend(
    store: Store, clock: ManualClock
) -> None:
    """DESIGN §2: cancel means "stop now", and a silent worker's `cancelling` task ends by
    lease expiry. A worker that ignored the cancel and kept renewing used to have its
    lease extended each time, holding the task `cancelling` (and its permit) for as long
    as it renewed. Now the renew answers `cancel` with the lease it already had."""
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    clock.advance(10)
    [before] = store.lease_renew_many(s.id, s.epoch, [g.attempt.id])
    assert before.status == "ok" and before.lease_expires_at == clock.now + 30 * SECOND
    store.task_cancel(tid)
    clock.advance(20)
    [lease] = store.lease_renew_many(s.id, s.epoch, [g.attempt.id])
    assert lease.status == "cancel"
    assert lease.lease_expires_at == before.lease_expires_at  # not extended
    assert lease.lease_left_us == 10 * SECOND
    assert store.attempt_get(g.attempt.id).lease_expires_at == before.lease_expires_at
    clock.advance(10)
    [late] = store.lease_renew_many(s.id, s.epoch, [g.attempt.id])
    assert late.status == "lost"
    store.reap()
    assert store.task_get(tid).state == "cancelled"
    assert store.attempt_get(g.attempt.id).state == "cancelled"
    assert check_all(store) == []


def test_deadline_exceeded_is_never_retryable(store: Store, clock: ManualClock) -> None:
    """A task the deadline ended says its error is not retryable, whichever way it ended:
    a reported failure whose retry would fall past the deadline, a lost lease the same,
    or the reaper at the deadline. The first two said ``retryable: true``, the third
    false: one code, two answers to "may this be retried?"."""
    queue(store)
    s, _ = worker(store)
    backoff = Backoff(base_us=20 * SECOND, factor=1.0, max_us=20 * SECOND)
    reported = submit(store, deadline=clock.now + 5 * SECOND, backoff=backoff)
    lost = submit(store, deadline=clock.now + 40 * SECOND, backoff=backoff, retry_safe=True)
    reaped = submit(store, deadline=clock.now + 10 * SECOND, retry_safe=True)
    grants = {g.task.id: g for g in (run_one(store, s), run_one(store, s), run_one(store, s))}
    g = grants[reported]
    store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.failure("E"))
    clock.advance(11)  # reaped's lease ends at its deadline
    store.reap()
    clock.advance(20)  # lost's lease (30 s) runs out; its retry would fall past its deadline
    store.reap()
    ended = [store.task_get(tid) for tid in (reported, lost, reaped)]
    assert [(t.state, t.error_code, t.error_retryable) for t in ended] == [
        ("failed", "DEADLINE_EXCEEDED", False)
    ] * 3
    assert check_all(store) == []
