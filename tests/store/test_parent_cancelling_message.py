"""PARENT_CANCELLED says whether the cancel in the way is done or only requested: a
running task whose cancel was asked is ``cancelling`` until its handler ends, and the
message said "is cancelled" of it, sending an operator to look for a cancelled task
that was still running."""

from __future__ import annotations

import pytest

from orbit.core.errors import Code, OrbitError
from orbit.core.model import Grant, Outcome, Session, TaskSpec
from orbit.core.states import TaskState
from orbit.store import Store
from tests.invariants import check_all
from tests.store.helpers import queue, run_one, submit, worker


def _refusal(call: object) -> OrbitError:
    with pytest.raises(OrbitError) as err:
        call()  # type: ignore[operator]
    assert err.value.code == Code.PARENT_CANCELLED, err.value
    return err.value


def _cancelling_root(store: Store) -> tuple[dict[str, str], Session, Grant]:
    """A running root with a child that succeeded and one that failed, then cancelled:
    the root is ``cancelling`` (its handler still runs), its ended children untouched."""
    queue(store)
    ids = {"root": submit(store, handler="r")}
    s, _ = worker(store, {"r": 1}, name="wr")
    g = run_one(store, s)
    ids["ok"] = submit(store, handler="ok", parent_id=ids["root"])
    ids["failed"] = submit(store, handler="failed", parent_id=ids["root"])
    s2, _ = worker(store, {"ok": 1, "failed": 1}, name="wc")
    for _ in range(2):
        c = run_one(store, s2)
        outcome = (
            Outcome.failure("E", retryable=False)
            if c.task.id == ids["failed"]
            else Outcome.success()
        )
        store.attempt_finish(s2.id, s2.epoch, c.attempt.id, c.attempt.fence, outcome)
    assert store.task_cancel(ids["root"]).state == TaskState.CANCELLING
    return ids, s, g


def test_a_child_under_a_cancelling_parent_is_refused_as_being_cancelled(store: Store) -> None:
    ids, s, g = _cancelling_root(store)
    root, ok = ids["root"], ids["ok"]
    refused = _refusal(lambda: store.task_submit(TaskSpec(queue="q", handler="c", parent_id=root)))
    assert refused.message == f"parent task {root} is being cancelled (cancel requested)"
    assert refused.field == "parent_id"
    refused = _refusal(lambda: store.task_submit(TaskSpec(queue="q", handler="c", parent_id=ok)))
    assert refused.message == (
        f"task {root}, an ancestor of parent task {ok}, is being cancelled (cancel requested)"
    )
    # Its handler ends: the cancel is done, and the message says so.
    store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success())
    assert store.task_get(root).state == TaskState.CANCELLED
    refused = _refusal(lambda: store.task_submit(TaskSpec(queue="q", handler="c", parent_id=root)))
    assert refused.message == f"parent task {root} is cancelled"
    refused = _refusal(lambda: store.task_submit(TaskSpec(queue="q", handler="c", parent_id=ok)))
    assert refused.message == f"task {root}, an ancestor of parent task {ok}, is cancelled"
    assert check_all(store) == []


def test_a_retry_under_a_cancelling_parent_is_refused_as_being_cancelled(store: Store) -> None:
    ids, s, g = _cancelling_root(store)
    root, failed = ids["root"], ids["failed"]
    refused = _refusal(lambda: store.task_retry(failed))
    assert refused.message == (
        f"parent task {root} is being cancelled (cancel requested); retry it once it is cancelled"
    )
    store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success())
    refused = _refusal(lambda: store.task_retry(failed))
    assert refused.message == f"parent task {root} is cancelled; retry it first"
    assert store.task_get(failed).state == TaskState.FAILED
    assert check_all(store) == []
