"""Cancelling a deep tree (I7): every level of it read through the parent index.

The tree was read by a recursive CTE, whose step PostgreSQL plans once, for no parent
in particular: once the statistics showed a parent with thousands of children, that
plan was a hash join over a scan of every task, run once per level, so a chain 1,500
deep took 8 s to cancel with its locks held throughout. The store now walks a tree a
level per statement (``_lock_tree``), each planned for its own parents."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from orbit.core.model import TaskSpec
from orbit.core.states import TaskState
from orbit.store import Store, open_store
from orbit.store import store as store_module
from orbit.store.postgres.driver import PostgresDriver, one_each
from tests.invariants import check_all
from tests.store.helpers import queue, submit

DEPTH = 300


def _chain(store: Store, depth: int) -> list[str]:
    """A root and ``depth`` tasks below it, each the only child of the one before."""
    chain = [submit(store)]
    for _ in range(depth):
        chain.append(submit(store, parent_id=chain[-1]))
    return chain


def test_a_deep_chain_is_cancelled_at_one_instant(make_store: Any) -> None:
    store: Store = make_store()  # the database's clock: one transaction, one instant
    queue(store)
    chain = _chain(store, DEPTH)
    side = submit(store, parent_id=chain[DEPTH // 2])  # a branch off the middle
    below_side = submit(store, parent_id=side)
    elsewhere = submit(store)

    assert store.task_cancel(chain[0]).state == TaskState.CANCELLED

    tree = [store.task_get(i) for i in [*chain, side, below_side]]
    assert {t.state for t in tree} == {TaskState.CANCELLED}
    assert len({t.finished_at for t in tree}) == 1
    instants = set()
    for task in tree:
        kinds = [(e["kind"], e["at"]) for e in store.event_list(task_id=task.id)]
        assert [k for k, _ in kinds] == ["submitted", "cancelled"]
        instants.add(kinds[-1][1])
    assert instants == {tree[0].finished_at}
    assert store.task_get(elsewhere).state == TaskState.QUEUED
    assert check_all(store) == []


def _plans(store: Store, reads: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Each read as its prepared statement on the store's one connection would run it
    next (``EXPLAIN EXECUTE``): PostgreSQL's plan cache has seen every run of it."""
    driver = store.driver
    assert isinstance(driver, PostgresDriver)
    plans = []
    with driver.transaction() as tx:
        cx = psycopg.ClientCursor(tx._cx)
        for name, params in reads:
            sql, names = tx._positional(name, one_each(params))
            cx.execute("SELECT name FROM pg_prepared_statements WHERE statement = %s", (sql,))
            found = cx.fetchone()
            assert found is not None, f"{name} was never prepared"
            literals = ", ".join(["%s"] * len(names))
            cx.execute(f"EXPLAIN EXECUTE {found[0]}({literals})", [params[n] for n in names])
            plans.append("\n".join(str(r[0]) for r in cx.fetchall()))
    return plans


@pytest.mark.parametrize("backend", ["postgres"])
def test_each_level_of_a_deep_tree_is_read_through_the_parent_index(
    fresh_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database of its own: the skewed statistics would outlive the run's TRUNCATEs,
    and change how every later test's statements are planned."""
    open_store(fresh_url).close()  # migrated
    store = Store(PostgresDriver(fresh_url, min_size=1, max_size=1))  # one plan cache to read
    try:
        queue(store)
        wide = submit(store)
        for _ in range(3):
            store.task_submit_many([TaskSpec(queue="q", handler="h", parent_id=wide)] * 1000)
        with psycopg.connect(fresh_url, autocommit=True) as admin:
            admin.execute("ANALYZE orbit_tasks")  # a parent holds nearly every child
        chain = _chain(store, DEPTH)

        reads: list[tuple[str, dict[str, Any]]] = []
        fetch = store_module._Tx.fetch

        def recording_fetch(self: Any, query: str, /, **params: Any) -> Any:
            if query.startswith("task_") and query != "task_lock_many":
                reads.append((query, params))  # the tree's reads; the lock is one read
            return fetch(self, query, **params)

        monkeypatch.setattr(store_module._Tx, "fetch", recording_fetch)
        store.task_cancel(chain[0])
        monkeypatch.undo()

        assert {store.task_get(i).state for i in chain} == {TaskState.CANCELLED}
        plans = _plans(store, reads)
        assert not [p for p in plans if "Seq Scan on orbit_tasks" in p], plans
        assert any("orbit_tasks_parent" in p for p in plans), plans
    finally:
        store.close()
