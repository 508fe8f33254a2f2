"""Batched starts and finishes: one transaction, each report judged on its own.

A batch must answer every report exactly as the single message would, commit the
accepted ones together, record each refusal as evidence, and refuse a malformed batch
as a whole without touching anything.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from orbit.core.errors import Code, OrbitError, Rejected
from orbit.core.model import Lease, Outcome, Receipt
from orbit.store import Store, StoreConfig
from tests.conftest import ManualClock
from tests.store.helpers import queue, submit, worker


def _snapshot(store: Store) -> tuple[Any, ...]:
    return (store.task_counts(), len(store.event_list()), store.session_list())


def _claimed(store: Store, n: int) -> tuple[Any, list[Any]]:
    queue(store, max_concurrency=50)
    for _ in range(n):
        submit(store)
    session, _ = worker(store, max_concurrency=50, handlers={"h": 50})
    grants = store.attempt_claim_many(session.id, session.epoch, n)
    assert len(grants) == n
    return session, grants


def test_start_many_answers_each_report_on_its_own(store: Store) -> None:
    session, grants = _claimed(store, 3)
    good, stale, other = grants
    events_before = len(store.event_list())
    answers = store.attempt_start_many(
        session.id,
        session.epoch,
        [
            (good.attempt.id, good.attempt.fence),
            (stale.attempt.id, stale.attempt.fence + 1),  # a fence it never had
            ("no-such-attempt", 1),
        ],
    )
    assert isinstance(answers[0], Lease) and answers[0].status == "ok"
    assert isinstance(answers[1], Rejected) and answers[1].code == Code.STALE_FENCE
    assert isinstance(answers[2], OrbitError) and answers[2].code == Code.ATTEMPT_NOT_FOUND
    assert store.task_get(good.task.id).state == "running"
    assert store.task_get(stale.task.id).state == "claimed"
    assert store.task_get(other.task.id).state == "claimed"
    kinds = [e["kind"] for e in store.event_list()[events_before:]]
    assert sorted(kinds) == ["rejected", "started"]  # the unknown id leaves no trace


def test_finish_many_commits_the_accepted_and_records_the_refused(store: Store) -> None:
    session, grants = _claimed(store, 4)
    started = store.attempt_start_many(
        session.id, session.epoch, [(g.attempt.id, g.attempt.fence) for g in grants[:3]]
    )
    assert all(isinstance(x, Lease) for x in started)
    ok, failed, wrong_fence, never_started = grants
    answers = store.attempt_finish_many(
        session.id,
        session.epoch,
        [
            (ok.attempt.id, ok.attempt.fence, Outcome.success({"n": 1})),
            (failed.attempt.id, failed.attempt.fence, Outcome.failure("E", "no", False)),
            (wrong_fence.attempt.id, wrong_fence.attempt.fence + 7, Outcome.success(1)),
            (never_started.attempt.id, never_started.attempt.fence, Outcome.success(2)),
        ],
    )
    assert isinstance(answers[0], Receipt) and answers[0].task_state == "succeeded"
    assert isinstance(answers[1], Receipt) and answers[1].task_state == "failed"
    assert isinstance(answers[2], Rejected) and answers[2].code == Code.STALE_FENCE
    assert isinstance(answers[3], Rejected) and answers[3].code == Code.FINISH_WITHOUT_START
    assert store.task_get(ok.task.id).result == '{"n":1}'
    assert store.task_get(wrong_fence.task.id).state == "running"
    assert store.task_get(never_started.task.id).state == "claimed"
    # A repeated batch (its reply was lost) gets the same receipts and writes nothing.
    before = _snapshot(store)
    again = store.attempt_finish_many(
        session.id,
        session.epoch,
        [
            (ok.attempt.id, ok.attempt.fence, Outcome.success({"n": 1})),
            (failed.attempt.id, failed.attempt.fence, Outcome.failure("E", "no", False)),
        ],
    )
    assert again == answers[:2]
    assert _snapshot(store) == before


def test_a_bad_outcome_is_refused_alone(store: Store) -> None:
    session, grants = _claimed(store, 2)
    store.attempt_start_many(
        session.id, session.epoch, [(g.attempt.id, g.attempt.fence) for g in grants]
    )
    deep: Any = 1
    for _ in range(100):
        deep = [deep]
    answers = store.attempt_finish_many(
        session.id,
        session.epoch,
        [
            (grants[0].attempt.id, grants[0].attempt.fence, Outcome.success(deep)),
            (grants[1].attempt.id, grants[1].attempt.fence, Outcome.success(None)),
        ],
    )
    assert isinstance(answers[0], OrbitError) and answers[0].code == Code.INVALID_ARGUMENT
    assert isinstance(answers[1], Receipt)
    assert store.task_get(grants[0].task.id).state == "running"


@pytest.mark.parametrize("kind", ["start", "finish"])
@pytest.mark.parametrize("problem", ["empty", "duplicate", "too_many"])
def test_a_malformed_batch_is_refused_whole(
    make_store: Any, clock: ManualClock, kind: str, problem: str
) -> None:
    store: Store = make_store(clock, StoreConfig(max_batch=3))
    session, grants = _claimed(store, 3)
    if kind == "finish":
        store.attempt_start_many(
            session.id, session.epoch, [(g.attempt.id, g.attempt.fence) for g in grants]
        )
    pairs = [(g.attempt.id, g.attempt.fence) for g in grants]
    chosen = {
        "empty": [],
        "duplicate": [pairs[0], pairs[1], pairs[0]],
        "too_many": [*pairs, ("x", 1)],
    }[problem]
    before = _snapshot(store)
    with pytest.raises(OrbitError) as err:
        if kind == "start":
            store.attempt_start_many(session.id, session.epoch, chosen)
        else:
            store.attempt_finish_many(
                session.id, session.epoch, [(a, f, Outcome.success(None)) for a, f in chosen]
            )
    assert err.value.code == Code.INVALID_ARGUMENT
    assert _snapshot(store) == before


def test_a_started_task_keeps_every_field_its_start_does_not_read(store: Store) -> None:
    """A start reads only some of its task's columns (``task_lock_for_starts``): the task
    read back after it is the one before, but for what a start changes."""
    queue(store, max_concurrency=5)
    parent = submit(store)
    task_id = submit(store, payload={"big": "x" * 5000}, priority=7, parent_id=parent)
    session, _ = worker(store, max_concurrency=5, handlers={"h": 5})
    grants = store.attempt_claim_many(session.id, session.epoch, 2)
    (grant,) = [g for g in grants if g.task.id == task_id]
    before = store.task_get(task_id)
    (lease,) = store.attempt_start_many(
        session.id, session.epoch, [(grant.attempt.id, grant.attempt.fence)]
    )
    assert isinstance(lease, Lease) and lease.status == "ok"
    after = store.task_get(task_id)
    assert after.state == "running" and after.attempts_used == before.attempts_used + 1
    assert after == replace(
        before,
        state=after.state,
        attempts_used=after.attempts_used,
        updated_at=after.updated_at,
        version=before.version + 1,
    )
