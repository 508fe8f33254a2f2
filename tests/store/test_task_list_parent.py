"""The task list's ``parent_id`` filter: a task's children, in id order, a page at a
time, read through the partial index on ``parent_id`` rather than a walk of every task."""

from __future__ import annotations

from typing import Any

from orbit.store import Store
from tests.conftest import ManualClock
from tests.store.helpers import query_plan, queue, submit


def test_the_task_list_filters_by_parent(store: Store, clock: ManualClock) -> None:
    """``GET /v1/tasks`` had no ``parent_id`` filter: a parent's children could be found
    only by reading every task. ``task_list(parent_id=…)`` lists them, with the other
    filters and keyset pages as without it."""
    queue(store)
    queue(store, "other")
    parent = submit(store)
    other_parent = submit(store)
    children = []
    for i in range(4):
        clock.advance(1)
        children.append(submit(store, handler="odd" if i % 2 else "h", parent_id=parent))
        submit(store, parent_id=other_parent)
    grandchild = submit(store, parent_id=children[0])
    assert [t.id for t in store.task_list(parent_id=parent)] == children
    assert [t.id for t in store.task_list(parent_id=parent, limit=3)] == children[:3]
    assert [t.id for t in store.task_list(parent_id=parent, after_id=children[2])] == [children[3]]
    assert [t.id for t in store.task_list(parent_id=parent, handler="odd")] == children[1::2]
    assert store.task_list(parent_id=parent, queue="other") == []
    at = store.task_get(children[2]).created_at
    assert [t.id for t in store.task_list(parent_id=parent, created_after=at)] == children[2:]
    assert [t.id for t in store.task_list(parent_id=children[0])] == [grandchild]
    assert store.task_list(parent_id=grandchild) == []
    assert store.task_list(parent_id="01a229a4-0000-7000-8000-000000000000") == []
    assert len(store.task_list()) == 11  # without it: every task


def test_the_parent_filter_reads_the_parent_index(store: Store) -> None:
    """The filter is its own query, ``parent_id = :parent_id`` without the ``:x IS NULL
    OR`` form of the others: SQLite cannot use an index through that form (it walked
    every task in id order), nor can PostgreSQL's generic plan of a prepared statement."""
    params: dict[str, Any] = {
        "parent_id": "01a229a4-0000-7000-8000-000000000000",
        "queue": None,
        "state": None,
        "tenant": None,
        "handler": None,
        "created_after": None,
        "created_before": None,
        "after_id": None,
        "limit": 100,
    }
    plan = query_plan(store, "task_list_by_parent", params, seqscan=False)
    assert "orbit_tasks_parent" in plan, plan
