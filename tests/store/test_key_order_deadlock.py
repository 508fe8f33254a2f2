"""Two batches that share idempotency keys, listed in different orders, submitted at once
on two nodes: both succeed, each key names one task, and neither waits for the other in
a cycle.

On PostgreSQL each batch inserted its keys in its own order, and ``ON CONFLICT`` waits
for a key's inserter to end: batch A held ``k1`` and waited for ``k2``, batch B held
``k2`` and waited for ``k1``, a deadlock PostgreSQL broke after a second by aborting
one. The store retried it, five times at most, then answered 500 INTERNAL. Here a
trigger makes each insert of these keys slow (0.3 s a row), so both batches are
inserting when the other reaches its second key, and the stores are given no retries:
a deadlock is the submit's error. On SQLite one transaction writes at a time; the same
assertions hold."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from orbit.core.model import TaskSpec
from orbit.store import Store, StoreConfig, open_store
from tests.store.helpers import queue

_WAIT = 30.0  # a safety net: each thread ends long before

_SLOW_INSERTS = """
CREATE FUNCTION orbit_test_slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(0.3); RETURN NEW; END $$;
CREATE TRIGGER orbit_test_slow_insert BEFORE INSERT ON orbit_tasks FOR EACH ROW
WHEN (NEW.idempotency_key LIKE 'shared-%') EXECUTE FUNCTION orbit_test_slow_insert();
"""


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_batches_sharing_keys_in_other_orders_do_not_deadlock(fresh_url: str, backend: str) -> None:
    no_retries = StoreConfig(max_tx_retries=0)
    node_a: Store = open_store(fresh_url, no_retries)
    node_b: Store = open_store(fresh_url, no_retries, migrate=False)
    try:
        queue(node_a)
        if backend == "postgres":
            with psycopg.connect(node_a.driver.dsn, autocommit=True) as cx:  # type: ignore[attr-defined]
                cx.execute(_SLOW_INSERTS)
        keys = ["shared-1", "shared-2", "shared-3"]

        def batch(order: list[str]) -> list[TaskSpec]:
            return [
                TaskSpec(queue="q", handler="h", payload={"k": k}, idempotency_key=k) for k in order
            ]

        out: dict[str, Any] = {}

        def submit(node: Store, name: str, order: list[str]) -> None:
            try:
                out[name] = {
                    s.task.idempotency_key: s.task.id for s in node.task_submit_many(batch(order))
                }
            except Exception as exc:  # the assertion below names it
                out[name] = exc

        threads = [
            threading.Thread(target=submit, args=(node_a, "a", keys)),
            threading.Thread(target=submit, args=(node_b, "b", keys[::-1])),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(_WAIT)
            assert not t.is_alive()
        assert isinstance(out["a"], dict), out["a"]
        assert isinstance(out["b"], dict), out["b"]
        assert out["a"] == out["b"]  # one task a key, whichever batch made it
        listed = node_a.task_list(queue="q")
        assert sorted(t.idempotency_key or "" for t in listed) == keys
    finally:
        node_b.close()
        node_a.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_batch_of_twenty_thousand_keys_is_made(fresh_url: str) -> None:
    """A lock per key held them all until the commit, in PostgreSQL's shared lock table
    (``max_locks_per_transaction`` times ``max_connections``, 6,400 by default): a batch of
    20,000 keys failed "out of shared memory", as did twenty concurrent batches of
    1,000. The keyed batch takes a lock per stripe of its queues instead."""
    store = open_store(fresh_url, StoreConfig(max_batch=20_000, max_tx_retries=0))
    try:
        queue(store)
        specs = [TaskSpec(queue="q", handler="h", idempotency_key=f"k-{i}") for i in range(20_000)]
        made = store.task_submit_many(specs)
        assert sum(s.created for s in made) == 20_000
    finally:
        store.close()
