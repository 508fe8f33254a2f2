"""One test per invariant I1-I9 (DESIGN §2), on both backends. Each builds the situation
that could break it, then checks the rows and the event log (tests/invariants.py)."""

from __future__ import annotations

import pytest

from orbit.core.errors import Code, OrbitError, Rejected
from orbit.core.model import Outcome
from orbit.store import Store
from tests import invariants as inv
from tests.conftest import ManualClock
from tests.store.helpers import claim_one, queue, run_one, submit, worker


def _attempts(store: Store) -> dict[str, list[object]]:
    return {t.id: store.attempt_list(t.id) for t in store.task_list(limit=1000)}


def test_i1_one_live_attempt_per_task(store: Store, clock: ManualClock) -> None:
    queue(store)
    tid = submit(store)
    a, _ = worker(store, name="a")
    b, _ = worker(store, name="b")
    claim_one(store, a)
    assert store.attempt_claim_many(b.id, b.epoch, 5) == []  # nothing left to claim
    clock.advance(31)  # the claim lapses; b takes the task over
    store.reap()
    run_one(store, b)
    live = [x for x in store.attempt_list(tid) if x.state in ("claimed", "running")]
    assert len(live) == 1
    assert inv.check_i1(_attempts(store)) == []


def test_i2_a_result_is_committed_once_and_never_changes(store: Store) -> None:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    ledger = inv.ResultLedger()
    store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success("one"))
    assert ledger.check(store.task_list()) == []
    with pytest.raises(Rejected):
        store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success("two"))
    with pytest.raises(OrbitError) as refused:  # only a needs_review task is resolved
        store.task_resolve(tid, "succeeded", Outcome.success("three"))
    assert refused.value.code == Code.INVALID_STATE
    assert store.task_get(tid).result == '"one"'
    assert ledger.check(store.task_list()) == []
    assert inv.check_i2(store.task_list(), store.event_list(), None) == []


def test_i3_a_fenced_report_changes_nothing_and_leaves_evidence(
    store: Store, clock: ManualClock
) -> None:
    queue(store)
    tid = submit(store)
    s, secret = worker(store)
    g = run_one(store, s)
    store.session_resume(s.id, secret, node_id="n2")
    before = (store.task_get(tid), store.attempt_get(g.attempt.id))
    for report in (
        lambda: store.attempt_finish(
            s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success()
        ),
        lambda: store.attempt_release(s.id, s.epoch, g.attempt.id, g.attempt.fence),
        lambda: store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence),
    ):
        with pytest.raises(Rejected) as err:
            report()
        assert err.value.code == Code.FENCED_EPOCH
    assert (store.task_get(tid), store.attempt_get(g.attempt.id)) == before
    codes = [e["code"] for e in store.event_list(task_id=tid) if e["kind"] == "rejected"]
    assert codes == [Code.FENCED_EPOCH] * 3


def test_i4_caps_hold_in_every_scope(store: Store, clock: ManualClock) -> None:
    queue(store, max_concurrency=2)
    store.tenant_limit_set("t", 1)
    for tenant in ("t", "t", "u", "u", "u"):
        submit(store, tenant=tenant)
        clock.advance(0.001)  # ids in submission order: the two t tasks come first
    s, _ = worker(store, max_concurrency=10)
    grants = store.attempt_claim_many(s.id, s.epoch, 10)
    # the second t task is held back by the tenant cap, the third task by the queue cap
    assert sorted(g.task.tenant for g in grants) == ["t", "u"]
    bad, peak = inv.occupancy_replay(store.event_list())
    assert bad == [] and peak["queue:q"] == 2 and peak["tenant:t"] == 1
    assert inv.check_i4(store, store.event_list(), {"tenant:t": 1}) == []


def test_i5_attempts_used_counts_starts_and_never_decreases(
    store: Store, clock: ManualClock
) -> None:
    queue(store)
    tid = submit(store, max_attempts=2)
    s, secret = worker(store)
    seen = [store.task_get(tid).attempts_used]
    g = claim_one(store, s)
    store.attempt_release(s.id, s.epoch, g.attempt.id, g.attempt.fence)  # not a start
    seen.append(store.task_get(tid).attempts_used)
    g = run_one(store, s)
    store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.failure("E"))
    seen.append(store.task_get(tid).attempts_used)
    clock.advance(600)
    s = store.session_resume(s.id, secret, node_id="n1")  # the session lapsed meanwhile
    g = run_one(store, s)
    clock.advance(31)
    store.reap()  # needs_review: the count stays
    seen.append(store.task_get(tid).attempts_used)
    store.task_resolve(tid, "retry")
    seen.append(store.task_get(tid).attempts_used)
    assert seen == [0, 0, 1, 2, 2]
    assert inv.check_i5(store.task_list(), _attempts(store), store.event_list()) == []


def test_i6_an_unsafe_task_is_not_restarted_without_a_decision(
    store: Store, clock: ManualClock
) -> None:
    queue(store)
    tid = submit(store, retry_safe=False, max_attempts=3)
    s, secret = worker(store)
    run_one(store, s)
    clock.advance(31)
    store.reap()
    assert store.task_get(tid).state == "needs_review"
    clock.advance(3600)
    store.reap()
    s = store.session_resume(s.id, secret, node_id="n1")
    assert store.attempt_claim_many(s.id, s.epoch, 5) == []  # never offered again
    store.task_resolve(tid, "retry")  # the operator's decision
    assert run_one(store, s).task.id == tid
    assert inv.check_i6(store.task_list(), store.event_list()) == []


def test_i7_cancel_reaches_every_descendant(store: Store) -> None:
    queue(store)
    root = submit(store)
    child = submit(store, parent_id=root)
    grandchild = submit(store, parent_id=child)
    store.task_cancel(root)
    assert {store.task_get(t).state for t in (root, child, grandchild)} == {"cancelled"}
    assert inv.check_i7(store.task_list()) == []


def test_i8_every_task_ends(store: Store, clock: ManualClock) -> None:
    queue(store)
    ids = [submit(store, retry_safe=i % 2 == 0, max_attempts=2) for i in range(8)]
    s, _ = worker(store)
    for round_ in range(30):
        for g in store.attempt_claim_many(s.id, s.epoch, 10):
            store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence)
            n = ids.index(g.task.id)
            if n % 4 == 0:
                continue  # this worker goes silent: the lease decides
            outcome = Outcome.success(n) if (n + round_) % 3 else Outcome.failure("E")
            store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, outcome)
        store.session_heartbeat(s.id, s.epoch)
        clock.advance(40)
        store.reap()
    ends = {store.task_get(t).state for t in ids}
    assert ends <= {"succeeded", "failed", "cancelled", "needs_review"}


def test_i9_every_change_and_refusal_is_in_the_log(store: Store, clock: ManualClock) -> None:
    queue(store)
    tid = submit(store)
    s, _ = worker(store)
    g = run_one(store, s)
    with pytest.raises(Rejected):
        store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence + 1, Outcome.success())
    store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success())
    events = store.event_list(task_id=tid)
    assert [e["kind"] for e in events] == [
        "submitted",
        "claimed",
        "started",
        "rejected",
        "succeeded",
    ]
    assert inv.check_i9(store.task_list(), _attempts(store), store.event_list()) == []
