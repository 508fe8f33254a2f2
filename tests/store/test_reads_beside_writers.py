"""Reads beside writers. On SQLite a read has a connection of its own
(``SqliteDriver.read``): it waited for the process's one connection, which a transaction
held while it waited in ``BEGIN IMMEDIATE`` for another process's write lock (or while it
wrote), and the read was refused as busy after ``busy_timeout``. Under WAL a read takes
none of a writer's locks: it reads the last commit, this process's as soon as its
transaction has returned."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from orbit.core.model import SECOND
from orbit.store import Store, StoreConfig, open_store, sqlite_path
from orbit.store.driver import DATABASE_BUSY, DatabaseUnavailable
from tests.db_locks import write_lock
from tests.store.helpers import RACE_WAIT, queue, submit


def test_a_read_sees_the_write_committed_just_before(store: Store) -> None:
    queue(store)
    for n in range(3):
        made = submit(store, payload={"n": n})
        assert json.loads(store.task_get(made).payload) == {"n": n}
        assert made in {t.id for t in store.task_list(queue="q")}
    assert store.task_counts() == {"queued": 3}


@contextmanager
def _sqlite(url: str, config: StoreConfig) -> Iterator[Store]:
    if sqlite_path(url) is None:
        pytest.skip("PostgreSQL's reads take their own pooled connection: none waits")
    store = open_store(url, config)
    try:
        yield store
    finally:
        store.close()


def test_a_read_waits_for_no_transaction_of_this_process(fresh_url: str) -> None:
    """A transaction of another thread holds the write connection (as a long write, or
    one waiting for the write lock, does): a read goes on, and sees the last commit, not
    the transaction's writes."""
    with _sqlite(fresh_url, StoreConfig()) as store:
        queue(store)
        first = submit(store)
        store.driver.busy_timeout_ms = 50  # type: ignore[attr-defined]  # a read's wait, at most
        held, release = threading.Event(), threading.Event()

        def write() -> None:
            with store.driver.transaction() as tx:
                tx.execute("task_delete_test", {"id": first})
                held.set()
                assert release.wait(RACE_WAIT)

        store.driver.queries["task_delete_test"] = "DELETE FROM orbit_tasks WHERE id = :id"
        with ThreadPoolExecutor(1) as pool:
            writing = pool.submit(write)
            try:
                assert held.wait(RACE_WAIT)
                assert store.task_get(first).id == first  # not the uncommitted delete
                assert [t.id for t in store.task_list(queue="q")] == [first]
            finally:
                release.set()
            writing.result(RACE_WAIT)


def test_a_read_goes_on_while_a_write_waits_for_another_connections_lock(
    fresh_url: str,
) -> None:
    """A submit waits in ``BEGIN IMMEDIATE`` for another connection's write lock,
    holding the write connection: reads go on meanwhile; the submit commits once the lock
    is let go, and the next read sees it."""
    with _sqlite(fresh_url, StoreConfig(tx_wait_us=int(RACE_WAIT * SECOND))) as store:
        queue(store)
        first = submit(store)
        begun = threading.Event()
        raw = store.driver._raw()  # type: ignore[attr-defined]
        raw.set_trace_callback(lambda sql: begun.set() if sql == "BEGIN IMMEDIATE" else None)
        with ThreadPoolExecutor(1) as pool:
            with write_lock(fresh_url):
                waiting = pool.submit(submit, store)
                assert begun.wait(RACE_WAIT)  # the submit holds the connection, waiting
                store.driver.busy_timeout_ms = 50  # type: ignore[attr-defined]  # a read's wait
                assert store.task_get(first).id == first
                assert store.queue_get("q").name == "q"
                assert not waiting.done()  # it waits for the lock all along
            second = waiting.result(RACE_WAIT)
        raw.set_trace_callback(None)
        assert [t.id for t in store.task_list(queue="q")] == [first, second]


def test_a_write_under_another_connections_lock_is_still_busy(fresh_url: str) -> None:
    """Reads go on; a write still gives up after its wait, busy, nothing written."""
    with _sqlite(fresh_url, StoreConfig(tx_wait_us=SECOND // 4)) as store:
        queue(store)
        with write_lock(fresh_url):
            with pytest.raises(DatabaseUnavailable) as refused:
                submit(store)
            assert refused.value.code == DATABASE_BUSY
            assert store.task_list(queue="q") == []
