"""A running node whose tables change under it (another node's migration adds a
column), on both backends.

A node of the new version migrates when it starts, while the other nodes still serve.
On PostgreSQL every statement a node runs is prepared once per connection, and
PostgreSQL refuses to run a prepared statement whose result's columns changed (a
``SELECT *``): each of the node's connections failed every such statement (a start, a
finish, a task read) until the pool replaced it, an hour later. The node now drops its
prepared statements and runs the transaction again."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from typing import Any

import psycopg
import pytest

from orbit.core.model import Outcome
from orbit.store import Store, open_store, sqlite_path
from tests.conftest import ManualClock
from tests.store.helpers import queue, run_one, start_and_succeed, submit, worker

#: the tables whose rows a task's path reads whole
TABLES = ("orbit_tasks", "orbit_attempts", "orbit_queues", "orbit_sessions")


def _alter(url: str, statements: list[str]) -> None:
    """Run DDL on a connection of its own, as another node's migration would."""
    path = sqlite_path(url)
    if path is None:
        with psycopg.connect(url, autocommit=True) as cx:
            for sql in statements:
                cx.execute(sql)
    else:
        with closing(sqlite3.connect(path, isolation_level=None)) as cx:
            for sql in statements:
                cx.execute(sql)


def _task_path(store: Store) -> str:
    """One task submitted, claimed, started and finished one call at a time, and two
    more in batches; the first one's id."""
    session, _ = worker(store)
    tid = submit(store)
    g = run_one(store, session)
    store.attempt_finish(
        session.id, session.epoch, g.attempt.id, g.attempt.fence, Outcome.success(1)
    )
    submit(store)
    submit(store)
    grants = store.attempt_claim_many(session.id, session.epoch, 2)
    start_and_succeed(store, session, grants)
    return tid


def test_a_column_added_and_dropped_under_a_running_store_breaks_nothing(
    fresh_url: str, clock: ManualClock
) -> None:
    store = open_store(fresh_url, clock=clock)
    try:
        queue(store)
        first = _task_path(store)  # every statement of the path prepared
        assert store.task_get(first).state == "succeeded"

        _alter(fresh_url, [f"ALTER TABLE {t} ADD COLUMN later_col integer" for t in TABLES])
        assert store.task_get(first).state == "succeeded"  # a read of its own first
        second = _task_path(store)  # then the transactions
        assert store.task_get(second).state == "succeeded"
        assert store.queue_get("q").name == "q"

        _alter(fresh_url, [f"ALTER TABLE {t} DROP COLUMN later_col" for t in TABLES])
        third = _task_path(store)
        assert [store.task_get(t).state for t in (first, second, third)] == ["succeeded"] * 3
        assert store.task_counts() == {"succeeded": 9}
    finally:
        store.close()


def test_a_statement_refused_for_itself_runs_twice_and_is_raised(
    fresh_url: str, backend: str
) -> None:
    """A refusal with the stale statements' SQLSTATE that is the statement's own (``FOR
    UPDATE`` with an aggregate is ``0A000`` too) runs again once, on statements prepared
    afresh, and is then raised: each of the store's retries had dropped every
    connection's statements once more. On SQLite the statement is refused at once."""
    store = open_store(fresh_url)
    try:
        store.driver.queries["test_aggregate_lock"] = (
            "SELECT count(*) AS n FROM orbit_tasks FOR UPDATE"
        )
        runs = 0

        def work(tx: Any) -> None:
            nonlocal runs
            runs += 1
            tx.fetch("test_aggregate_lock")

        before = getattr(getattr(store.driver, "plans", None), "epoch", 0)
        with pytest.raises((psycopg.Error, sqlite3.Error)) as refused:
            store._tx(work)
        if backend == "postgres":
            assert isinstance(refused.value, psycopg.errors.FeatureNotSupported)
            assert runs == 2 and store.driver.plans.epoch == before + 1  # type: ignore[attr-defined]
            queue(store)  # the connections work on
        else:
            assert runs == 1
    finally:
        store.close()
