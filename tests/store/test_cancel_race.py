"""A cancel and a child's submit racing on two nodes (I7): the child is cancelled with
its parent, whichever commits first.

The child's submit has checked its parent (holding the parent's row FOR SHARE) and not
yet inserted when the cancel begins. On PostgreSQL the cancel then reads the tree
without the child and waits for the parent's lock; before the fix it cancelled the
tree it had read, and the child, committed meanwhile, stayed queued and claimable. On
SQLite a transaction runs alone, so the cancel waits for the whole submit; the same
assertions hold."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from orbit.core.model import TaskSpec
from orbit.core.states import TaskState
from orbit.store import Store, open_store
from orbit.store import store as store_module
from tests.conftest import store_url
from tests.invariants import check_all
from tests.store.helpers import queue, submit, worker

_WAIT = 30.0  # a safety net: every wait below ends on an event long before


def _until_waiting_on_a_lock(url: str) -> None:
    """Return once some session of this database waits for a row lock."""
    query = (
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    deadline = time.monotonic() + _WAIT
    with psycopg.connect(url, autocommit=True) as watch:
        while watch.execute(query).fetchone() == (0,):
            assert time.monotonic() < deadline, "the cancel never waited for the parent"
            time.sleep(0.01)


def test_a_child_submitted_while_its_parent_is_cancelled_is_cancelled_too(
    make_store: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    node_a: Store = make_store()  # the database's own clock: two nodes share it
    url = store_url(node_a)
    node_b = open_store(url, migrate=False)
    try:
        queue(node_a)
        parent = submit(node_a)
        parent_checked, insert = threading.Event(), threading.Event()
        fetch = store_module._Tx.fetch

        def pausing_fetch(self: Any, query: str, /, **params: Any) -> Any:
            rows = fetch(self, query, **params)
            if self._store is node_b and query == "task_share":
                parent_checked.set()  # the parent is checked and held FOR SHARE
                assert insert.wait(_WAIT)
            return rows

        monkeypatch.setattr(store_module._Tx, "fetch", pausing_fetch)
        out: dict[str, Any] = {}

        def child_submit() -> None:
            spec = TaskSpec(queue="q", handler="h", parent_id=parent)
            out["child"] = node_b.task_submit(spec).task.id

        def cancel() -> None:
            out["root"] = node_a.task_cancel(parent)

        submitting = threading.Thread(target=child_submit)
        submitting.start()
        assert parent_checked.wait(_WAIT)
        cancelling = threading.Thread(target=cancel)
        cancelling.start()
        if backend == "postgres":
            _until_waiting_on_a_lock(url)  # the cancel has read the tree, without the child
        insert.set()
        submitting.join(_WAIT)
        cancelling.join(_WAIT)
        assert not submitting.is_alive() and not cancelling.is_alive()
        monkeypatch.undo()

        assert out["root"].state == TaskState.CANCELLED
        child = node_a.task_get(out["child"])
        assert child.cancel_requested
        assert child.state == TaskState.CANCELLED
        session, _ = worker(node_a)
        assert node_a.attempt_claim_many(session.id, session.epoch, 10) == []
        assert check_all(node_a) == []
    finally:
        node_b.close()
