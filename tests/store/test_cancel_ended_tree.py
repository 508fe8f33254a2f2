"""The cancel of a tree that has all ended (a cancel re-issued after the first outlived
its client's 30 s, a succeeded root with its children) changes nothing, and is answered
from reads alone: no write transaction, no row locked. It locked every row of the tree,
on SQLite under the write lock every other request waits for: 100,000 ended tasks held
the node 11 s, writing nothing. Another connection holds the database's write lock here
(SQLite's ``BEGIN IMMEDIATE``, PostgreSQL's ``LOCK TABLE … IN EXCLUSIVE MODE``, which
``FOR UPDATE`` waits for), and the store gives up a write after a fraction of a second:
a cancel that took a write lock fails with ``DATABASE_BUSY``.

A tree with a live task still takes the locking path, and so does one that changed
between the unlocked walk and its check (a child submitted, a task retried)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from orbit.core.model import SECOND, Outcome, Task
from orbit.core.states import TaskState
from orbit.store import Store, StoreConfig, open_store, sqlite_path
from orbit.store.driver import Row
from tests.db_locks import write_lock
from tests.invariants import check_all
from tests.store.helpers import call_bounded, queue, run_one, submit, worker

#: the store's wait for the database here (``tx_wait_us``)
WAIT = StoreConfig(tx_wait_us=SECOND // 4)
#: PostgreSQL's lock wait per try, through the URL (as tests/store/test_busy_database.py)
IMPATIENT = "options=-c%20lock_timeout%3D50"


@pytest.fixture
def impatient(fresh_url: str) -> Iterator[tuple[Store, str]]:
    """A store of the test's own database that gives up a write after ``WAIT``."""
    url = fresh_url
    if sqlite_path(url) is None:
        url = f"{url}{'&' if '?' in url else '?'}{IMPATIENT}"
    store = open_store(url, WAIT)
    try:
        yield store, fresh_url
    finally:
        store.close()


def _ended_tree(store: Store) -> dict[str, str]:
    """A root that succeeded, over children that succeeded, failed and were cancelled,
    and a grandchild that succeeded: every task ended, none by the root's cancel."""
    queue(store)
    ids = {"root": submit(store, handler="r")}
    s, _ = worker(store, {"r": 1}, name="wr")
    g_root = run_one(store, s)
    for name in ("ok", "failed", "cancelled"):
        ids[name] = submit(store, handler=name, parent_id=ids["root"])
    ids["grandchild"] = submit(store, handler="ok", parent_id=ids["ok"])
    store.task_cancel(ids["cancelled"])
    s2, _ = worker(store, {"ok": 2, "failed": 1}, name="wc")
    for _ in range(3):
        g = run_one(store, s2)
        outcome = (
            Outcome.failure("E", retryable=False)
            if g.task.id == ids["failed"]
            else Outcome.success()
        )
        store.attempt_finish(s2.id, s2.epoch, g.attempt.id, g.attempt.fence, outcome)
    store.attempt_finish(s.id, s.epoch, g_root.attempt.id, g_root.attempt.fence, Outcome.success())
    states = {n: store.task_get(i).state for n, i in ids.items()}
    assert states == {
        "root": "succeeded",
        "ok": "succeeded",
        "failed": "failed",
        "cancelled": "cancelled",
        "grandchild": "succeeded",
    }
    return ids


def _locking_answer(store: Store, task_id: str, monkeypatch: pytest.MonkeyPatch) -> Task:
    """What the locking path answers (the only path before the fix)."""
    with monkeypatch.context() as m:
        m.setattr(store, "_tree_ended", lambda _id: None)
        return store.task_cancel(task_id)


def test_an_ended_tree_is_cancelled_without_a_write_lock(
    impatient: tuple[Store, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, url = impatient
    ids = _ended_tree(store)
    before = store.task_get(ids["root"])
    events = len(store.event_list())
    with write_lock(url):
        answer = call_bounded(lambda: store.task_cancel(ids["root"]))
    assert answer == before, answer  # the root as it was, not DATABASE_BUSY
    assert len(store.event_list()) == events  # nothing written
    assert _locking_answer(store, ids["root"], monkeypatch) == answer  # as the lock's
    assert len(store.event_list()) == events
    assert {store.task_get(i).state for i in ids.values()} <= {"succeeded", "failed", "cancelled"}
    assert check_all(store) == []


def test_a_cancelled_tree_cancelled_again_takes_no_write_lock(
    impatient: tuple[Store, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The re-issued cancel of docs/operations.md: the first one cancelled the tree."""
    store, url = impatient
    queue(store)
    root = submit(store)
    kids = [submit(store, parent_id=root) for _ in range(3)]
    submit(store, parent_id=kids[0])
    first = store.task_cancel(root)
    assert first.state == TaskState.CANCELLED
    events = len(store.event_list())
    with write_lock(url):
        again = call_bounded(lambda: store.task_cancel(root))
    assert again == first, again
    assert _locking_answer(store, root, monkeypatch) == first
    assert len(store.event_list()) == events
    assert check_all(store) == []


def test_a_live_task_deep_in_an_ended_tree_is_cancelled(store: Store) -> None:
    ids = _ended_tree(store)
    late = submit(store, handler="late", parent_id=ids["grandchild"])  # queued
    answer = store.task_cancel(ids["root"])
    assert answer.state == TaskState.SUCCEEDED  # an ended task is left as it was
    assert store.task_get(late).state == TaskState.CANCELLED
    kinds = [e["kind"] for e in store.event_list(task_id=late)]
    assert kinds[-1] == "cancelled", kinds
    assert check_all(store) == []


@pytest.mark.parametrize("change", ["new child", "retry"])
def test_a_tree_changed_after_the_unlocked_walk_takes_the_locking_path(
    store: Store, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """Between the walk and the statement that checks it, a child is submitted under an
    ended task of the tree (and ends, with a live child of its own), or a failed task is
    retried: the check sees a task the walk did not find, or a live one, and the cancel
    locks the tree and cancels the live task."""
    ids = _ended_tree(store)
    read = store._read
    made: list[str] = []

    def changing_read(query: str, /, **params: Any) -> list[Row]:
        if query == "task_tree_ended" and not made:
            if change == "new child":
                # One that has ended already, over a live one: the statement reads the
                # first (a child of a task walked), but not the second, under it.
                late = submit(store, handler="late", parent_id=ids["grandchild"])
                made.append(submit(store, handler="later", parent_id=late))
                s, _ = worker(store, {"late": 1}, name="wl")
                g = run_one(store, s)
                store.attempt_finish(
                    s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success()
                )
            else:
                made.append(store.task_retry(ids["failed"]).id)
            assert store.task_get(made[0]).state == TaskState.QUEUED
        return read(query, **params)

    monkeypatch.setattr(store, "_read", changing_read)
    answer = store.task_cancel(ids["root"])
    monkeypatch.undo()
    assert made and answer.state == TaskState.SUCCEEDED
    assert store.task_get(made[0]).state == TaskState.CANCELLED
    assert check_all(store) == []
