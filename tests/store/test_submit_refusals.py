"""What a refused submit says, on both backends: a batch's refusal names the task it is
about (``tasks[<index>].<field>``, the decoder's spelling, also leading the message) and
a single submit's names the field; an idempotency key reused for another job (another
handler or parent) is a conflict, not the other task; and a task that ran and then
reached its deadline waiting for a retry says so, keeping its last attempt's error."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from orbit.core.errors import Code, OrbitError
from orbit.core.model import SECOND, Backoff, Outcome, TaskSpec
from orbit.protocol.submissions import UsualBatch
from orbit.store import Store
from orbit.store.store import SUBMIT_CHUNK
from tests.conftest import ManualClock
from tests.store.helpers import queue, run_one, submit, worker

GOOD = TaskSpec(queue="q", handler="h", payload={"ok": 1})


def _written(store: Store) -> tuple[int, int]:
    """The tasks and the events stored: a refusal changes neither."""
    return len(store.task_list(limit=1000)), len(store.event_list(limit=5000))


def _refused(store: Store, call: Any) -> OrbitError:
    before = _written(store)
    with pytest.raises(OrbitError) as err:
        call()
    assert _written(store) == before, "a refusal wrote something"
    return err.value


#: (what makes a task bad, given ``now``, the code, the field it is refused for)
BAD: list[tuple[str, Any, Code, str]] = [
    (
        "backoff",
        lambda now: {"backoff": Backoff(base_us=SECOND, factor=1000.0, max_us=SECOND)},
        Code.INVALID_BACKOFF,
        "backoff.factor",
    ),
    ("timeout", lambda now: {"attempt_timeout_us": -1}, Code.INVALID_TIMEOUT, "attempt_timeout"),
    ("past deadline", lambda now: {"deadline": now - SECOND}, Code.INVALID_DEADLINE, "deadline"),
    (
        "run_after at the deadline",
        lambda now: {"deadline": now + 20 * SECOND, "run_after": now + 20 * SECOND},
        Code.INVALID_DEADLINE,
        "run_after",
    ),
    ("payload", lambda now: {"payload": "x" * 300_000}, Code.PAYLOAD_TOO_LARGE, "payload"),
    ("parent", lambda now: {"parent_id": "no-such-task"}, Code.PARENT_NOT_FOUND, "parent_id"),
    ("queue", lambda now: {"queue": "nope"}, Code.QUEUE_NOT_FOUND, "queue"),
]


@pytest.mark.parametrize(("case", "bad", "code", "field"), BAD, ids=[b[0] for b in BAD])
def test_a_refused_batch_names_its_task_and_a_single_submit_its_field(
    store: Store, clock: ManualClock, case: str, bad: Any, code: Code, field: str
) -> None:
    queue(store)
    wrong = replace(GOOD, **bad(clock.now))
    err = _refused(store, lambda: store.task_submit_many([GOOD, GOOD, wrong, GOOD]))
    assert (err.code, err.field) == (code, f"tasks[2].{field}"), err
    assert err.message.startswith(f"tasks[2].{field}: "), err.message
    err = _refused(store, lambda: store.task_submit(wrong))
    assert (err.code, err.field) == (code, field), err
    assert not err.message.startswith("tasks"), err.message


def test_a_lazy_batch_names_its_late_task(store: Store) -> None:
    """The reader's batch (``UsualBatch``, read a chunk at a time inside the transaction)
    names its bad task as the strict path does, by its index in the whole batch."""
    queue(store)
    n = 2 * SUBMIT_CHUNK + 7
    late = n - 3
    cases: list[tuple[dict[str, Any], Code, str]] = [
        ({"payload": "x" * 300_000}, Code.PAYLOAD_TOO_LARGE, "payload"),
        ({"parent_id": "no-such-task"}, Code.PARENT_NOT_FOUND, "parent_id"),
        ({"queue": "nope"}, Code.QUEUE_NOT_FOUND, "queue"),
    ]
    for change, code, field in cases:
        tasks: list[dict[str, Any]] = [
            {"queue": "q", "handler": "h", "payload": {"i": i}} for i in range(n)
        ]
        tasks[late].update(change)
        batch = UsualBatch.of({"tasks": tasks})
        assert batch is not None
        err = _refused(store, lambda b=batch: store.task_submit_rendered(b, lambda d: d))
        assert (err.code, err.field) == (code, f"tasks[{late}].{field}"), err
        assert err.message.startswith(f"tasks[{late}].{field}: "), err.message


def test_a_batch_names_the_task_that_reuses_a_key(store: Store) -> None:
    queue(store)
    submit(store, payload=1, idempotency_key="k")
    clash = TaskSpec(queue="q", handler="h", payload=2, idempotency_key="k")
    err = _refused(store, lambda: store.task_submit_many([GOOD, clash]))
    assert (err.code, err.field) == (Code.IDEMPOTENCY_CONFLICT, "tasks[1].idempotency_key")
    err = _refused(store, lambda: store.task_submit(clash))
    assert (err.code, err.field) == (Code.IDEMPOTENCY_CONFLICT, "idempotency_key")


def test_a_key_reused_for_another_handler_or_parent_is_a_conflict(store: Store) -> None:
    """Same key, same payload, another handler (or parent): another job, refused 409
    naming what differs, where it returned the other task as if it were this one."""
    queue(store)
    parent = submit(store)
    spec = TaskSpec(queue="q", handler="x", payload=1, idempotency_key="k", parent_id=parent)
    first = store.task_submit(spec)
    digest = first.task.payload_digest
    for change, said in (
        ({"handler": "y"}, "handler 'x', not 'y'"),
        ({"parent_id": None}, f"parent {parent}, not none"),
    ):
        again = replace(spec, **change)
        err = _refused(store, lambda a=again: store.task_submit(a))
        assert err.code == Code.IDEMPOTENCY_CONFLICT and err.status == 409, err
        assert f"already names task {first.task.id}, submitted with {said}" in err.message
    twice = [TaskSpec(queue="q", handler=h, payload=1, idempotency_key="k2") for h in ("a", "b")]
    err = _refused(store, lambda: store.task_submit_many(twice))
    assert err.code == Code.IDEMPOTENCY_CONFLICT and err.field == "tasks[1].idempotency_key"
    assert "given twice in this batch, with handlers 'a' and 'b'" in err.message, err.message
    assert store.task_get(first.task.id).payload_digest == digest  # the digest is unchanged


def test_a_retry_may_change_the_options_a_key_does_not_compare(
    store: Store, clock: ManualClock
) -> None:
    """A client retrying a submit may compute its deadline (now + 1 h), priority or
    attempts afresh: the same key, payload, handler and parent still get the same task."""
    queue(store)
    first = store.task_submit(
        replace(GOOD, idempotency_key="k", deadline=clock.now + 3600 * SECOND)
    )
    clock.advance(5)
    again = replace(
        GOOD,
        idempotency_key="k",
        deadline=clock.now + 3600 * SECOND,
        run_after=clock.now + 60 * SECOND,
        priority=9,
        max_attempts=1,
        retry_safe=True,
    )
    for done in (store.task_submit(again), store.task_submit_many([GOOD, again])[1]):
        assert not done.created and done.task.id == first.task.id
        assert done.task.priority == 0 and done.task.deadline == first.task.deadline


def test_a_task_that_ran_says_its_deadline_passed_before_its_next_attempt(
    store: Store, clock: ManualClock
) -> None:
    """Failed and scheduled for a retry, its queue paused past its deadline: it fails
    DEADLINE_EXCEEDED saying it ran (not "before the task could run"), and its message
    keeps the last attempt's error, which the task's error no longer holds."""
    queue(store)
    tid = submit(
        store,
        retry_safe=True,
        max_attempts=5,
        deadline=clock.now + 10 * SECOND,
        backoff=Backoff(base_us=SECOND, factor=1.0, max_us=SECOND),
    )
    s, _ = worker(store)
    g = run_one(store, s)
    failure = Outcome.failure("RENDER_FAILED", "the page crashed", retryable=True)
    receipt = store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, failure)
    assert receipt.task_state == "scheduled"
    store.queue_pause("q")
    clock.advance(11)
    store.reap()
    task = store.task_get(tid)
    assert (task.state, task.error_code, task.attempts_used) == ("failed", "DEADLINE_EXCEEDED", 1)
    assert task.error_message == (
        "the deadline passed before its next attempt (1 of 5 attempts used); "
        "the last attempt failed RENDER_FAILED: the page crashed"
    )
    assert task.error_retryable is False


def test_a_task_that_never_ran_says_so_at_its_deadline(store: Store, clock: ManualClock) -> None:
    queue(store)
    tid = submit(store, deadline=clock.now + 10 * SECOND)
    store.queue_pause("q")
    clock.advance(11)
    store.reap()
    task = store.task_get(tid)
    assert (task.state, task.error_code, task.attempts_used) == ("failed", "DEADLINE_EXCEEDED", 0)
    assert task.error_message == "the deadline passed before the task could run"
