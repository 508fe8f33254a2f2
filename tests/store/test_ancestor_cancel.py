"""A cancel cascades down the whole tree of a task, past children that had already
ended (which it leaves as they were). So the operator's retry of a task, and the submit
of a new child, look at every ancestor, not only the parent: a grandchild under a
cancelled grandparent and a finished parent is refused (PARENT_CANCELLED), as a child of
the cancelled task itself is."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from orbit.core.errors import Code, OrbitError
from orbit.core.model import Outcome, TaskSpec
from orbit.core.states import TaskState
from orbit.store import Store, open_store
from orbit.store import store as store_module
from tests.conftest import store_url
from tests.invariants import check_all
from tests.store.helpers import (
    RACE_WAIT,
    queue,
    run_one,
    submit,
    until_done_or_waiting_on_a_lock,
    worker,
)


def _cancelled_grandparent(store: Store) -> tuple[str, str, str]:
    """Grandparent, parent and grandchild: the parent succeeded, then the grandparent was
    cancelled, which cancelled the waiting grandchild and left the parent succeeded."""
    queue(store)
    grandparent = submit(store, handler="g")
    parent = submit(store, handler="p", parent_id=grandparent)
    child = submit(store, handler="c", parent_id=parent)
    s, _ = worker(store, {"p": 1})
    g = run_one(store, s)
    assert g.task.id == parent
    store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success())
    store.task_cancel(grandparent)
    assert store.task_get(parent).state == "succeeded"
    assert not store.task_get(parent).cancel_requested
    assert store.task_get(child).state == "cancelled"
    return grandparent, parent, child


def test_a_grandchild_is_not_retried_under_a_cancelled_grandparent(store: Store) -> None:
    grandparent, _, child = _cancelled_grandparent(store)
    events = len(store.event_list())
    with pytest.raises(OrbitError) as err:
        store.task_retry(child)
    assert err.value.code == Code.PARENT_CANCELLED
    assert grandparent in err.value.message
    assert store.task_get(child).state == "cancelled"
    assert len(store.event_list()) == events  # nothing written
    assert check_all(store) == []
    # Once the grandparent itself is retried, nothing cancelled stands above the child.
    store.task_retry(grandparent)
    assert store.task_retry(child).state == "queued"
    assert check_all(store) == []


@pytest.mark.parametrize("key", [None, "new"])
def test_no_new_child_under_a_finished_parent_of_a_cancelled_task(
    store: Store, key: str | None
) -> None:
    grandparent, parent, _ = _cancelled_grandparent(store)
    before = len(store.task_list())
    spec = TaskSpec(queue="q", handler="c", parent_id=parent, idempotency_key=key)
    with pytest.raises(OrbitError) as err:
        store.task_submit(spec)
    assert err.value.code == Code.PARENT_CANCELLED
    assert grandparent in err.value.message
    with pytest.raises(OrbitError) as err:  # the same in a batch beside a root task
        store.task_submit_many([TaskSpec(queue="q", handler="c"), spec])
    assert err.value.code == Code.PARENT_CANCELLED
    assert len(store.task_list()) == before  # nothing written
    assert check_all(store) == []


def test_an_ancestors_cancel_that_was_retried_blocks_nothing(store: Store) -> None:
    """A grandparent cancelled and then retried is no longer cancelled: a new child under
    its finished child is taken, as one under an uncancelled tree always was."""
    grandparent, parent, _ = _cancelled_grandparent(store)
    store.task_retry(grandparent)
    made = store.task_submit(TaskSpec(queue="q", handler="c", parent_id=parent))
    assert made.created and made.task.state == "queued"
    assert check_all(store) == []


def test_a_grandchild_submitted_while_its_grandparent_is_cancelled_is_cancelled_too(
    make_store: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The submit's look at the ancestors is not locked: it is safe because the parent's
    share lock, held from before that look until commit, is one the grandparent's cancel
    must take too (it locks the whole subtree). So a cancel that began after the look
    waits for the submit, then finds the new grandchild and cancels it."""
    node_a: Store = make_store()  # the database's own clock: two nodes share it
    url = store_url(node_a)
    node_b = open_store(url, migrate=False)
    try:
        grandparent, parent, _ = _cancelled_grandparent(node_a)
        node_a.task_retry(grandparent)  # not cancelled any more: a new grandchild is taken
        looked, insert = threading.Event(), threading.Event()
        fetch = store_module._Tx.fetch

        def pausing_fetch(self: Any, query: str, /, **params: Any) -> Any:
            rows = fetch(self, query, **params)
            if self._store is node_b and query == "task_cancelled_lineage":
                looked.set()  # no cancelled ancestor seen; the parent held FOR SHARE
                assert insert.wait(RACE_WAIT)
            return rows

        monkeypatch.setattr(store_module._Tx, "fetch", pausing_fetch)
        out: dict[str, Any] = {}

        def grandchild_submit() -> None:
            spec = TaskSpec(queue="q", handler="c", parent_id=parent)
            out["child"] = node_b.task_submit(spec).task.id

        def cancel() -> None:
            out["root"] = node_a.task_cancel(grandparent)

        submitting = threading.Thread(target=grandchild_submit)
        submitting.start()
        assert looked.wait(RACE_WAIT)
        cancelling = threading.Thread(target=cancel)
        cancelling.start()
        if backend == "postgres":  # the cancel waits for the parent's lock
            until_done_or_waiting_on_a_lock(cancelling, url)
        insert.set()
        submitting.join(RACE_WAIT)
        cancelling.join(RACE_WAIT)
        assert not submitting.is_alive() and not cancelling.is_alive()
        monkeypatch.undo()

        assert out["root"].state == TaskState.CANCELLED
        child = node_a.task_get(out["child"])
        assert child.cancel_requested and child.state == TaskState.CANCELLED
        assert node_a.task_get(parent).state == TaskState.SUCCEEDED
        assert check_all(node_a) == []
    finally:
        node_b.close()
