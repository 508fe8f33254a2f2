"""A transaction's last write and its ``COMMIT`` in one round trip (``commit_with``).

Every transition (a claim, a start, a finish, a renewal, ...) ends with one batched
write of its plan. On PostgreSQL that write now carries the ``COMMIT`` with it, and the
guards the store checked between the two (each write's count of rows matched) are
checked inside the statement: a count that differs fails it (``orbit_stale_write``,
migration 6), PostgreSQL skips the ``COMMIT`` behind it, and nothing of the transaction
is committed. SQLite commits in process and keeps the store's own check. Both must give
the same answers.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from orbit.core.model import Event, Outcome, TaskSpec
from orbit.core.transitions import new_task
from orbit.store import InjectedFault, StaleWrite, Store
from orbit.store.postgres.driver import (
    STALE_WRITE_SQLSTATE,
    PostgresDriver,
    _Statements,
    split_with,
    write_batch_sql,
)
from orbit.store.rows import task_to_row, task_write_columns
from tests.store.helpers import claim_one, queue, submit, worker
from tests.store.test_pg_transactions import _record_round_trips


def _planned_row(store: Store, task_id: str, *, version_off_by: int = 0) -> dict[str, Any]:
    """A ``task_write_many`` row that raises the task's ``max_attempts`` by one, guarded
    by the version the task has (plus ``version_off_by``: a guard that misses)."""
    task = store.task_get(task_id)
    row = task_write_columns([(task, task)])[0]
    row["expect_version"] = task.version + version_off_by
    row["max_attempts"] = task.max_attempts + 1
    row["version"] = task.version + 1
    return row


def _event(task_id: str) -> Event:
    return Event(kind="test_marker", task_id=task_id, data={"why": "commit_with"})


def _markers(store: Store) -> list[dict[str, Any]]:
    return [e for e in store.event_list(limit=1000) if e["kind"] == "test_marker"]


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_last_write_that_misses_its_guard_commits_nothing(store: Store) -> None:
    """The transaction's earlier write (an event) and its last one (a task whose guard
    names a version it no longer has) are both undone, and the store raises StaleWrite
    once its retries are spent: on PostgreSQL from inside the statement sent with the
    COMMIT, on SQLite from the store's own count."""
    queue(store)
    task_id = submit(store)
    before = store.task_get(task_id)
    stale = _planned_row(store, task_id, version_off_by=5)

    def work(tx: Any) -> None:
        tx.events([_event(task_id)])
        tx.write_batch(("task_write_many", [stale], 1), final=True)

    with pytest.raises(StaleWrite):
        store._tx(work)
    assert store.task_get(task_id) == before
    assert _markers(store) == []


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_one_missed_guard_among_several_undoes_them_all_and_is_retried(store: Store) -> None:
    """Two writes in the last statement, the first meeting its guard and the second not:
    neither is committed, and the transaction was tried ``max_tx_retries + 1`` times."""
    queue(store)
    first, second = submit(store), submit(store)
    before = (store.task_get(first), store.task_get(second))
    good = _planned_row(store, first)
    stale = _planned_row(store, second, version_off_by=1)
    tries: list[int] = []

    def work(tx: Any) -> None:
        tries.append(1)
        tx.write_batch(("task_write_many", [good], 1), ("task_write_many", [stale], 1), final=True)

    with pytest.raises(StaleWrite):
        store._tx(work)
    assert (store.task_get(first), store.task_get(second)) == before
    assert len(tries) == store.config.max_tx_retries + 1


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_no_statement_is_taken_after_the_final_write(store: Store) -> None:
    """On PostgreSQL the transaction has committed with its final write; both backends
    refuse what a caller would send after it, so a mistake shows on either."""
    queue(store)
    task_id = submit(store)
    row = _planned_row(store, task_id)

    def work(tx: Any) -> None:
        tx.write_batch(("task_write_many", [row], 1), final=True)
        tx.fetch("task_get", id=task_id)

    with pytest.raises(RuntimeError, match="after this transaction's final write"):
        store._tx(work)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_last_write_that_meets_its_guard_commits_everything(store: Store) -> None:
    queue(store)
    task_id = submit(store)
    row = _planned_row(store, task_id)

    def work(tx: Any) -> list[int]:
        tx.events([_event(task_id)])
        return tx.write_batch(("task_write_many", [row], 1), final=True)

    assert store._tx(work) == [1]
    assert store.task_get(task_id).max_attempts == row["max_attempts"]
    assert len(_markers(store)) == 1


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_an_armed_fault_in_a_last_write_still_undoes_it(store: Store) -> None:
    """A fault injected in the last write fires after the write has run (the harshest
    case for atomicity); the write must not have taken its COMMIT with it then."""
    queue(store)
    task_id = submit(store)
    s, _ = worker(store)
    g = claim_one(store, s)
    before = (store.task_get(task_id), store.attempt_list(task_id), store.event_list())
    with store.inject_fault("event_insert_many"), pytest.raises(InjectedFault):
        store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence)
    assert (store.task_get(task_id), store.attempt_list(task_id), store.event_list()) == before
    store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence)
    assert store.task_get(task_id).state == "running"


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_transition_sends_its_write_with_its_commit(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit, a start and a finish done one at a time are each two round trips (they
    were three): the reads with their BEGIN, then the write with its COMMIT. A claim is
    three (it was four): its lock and reads, its ready select, its write and COMMIT."""
    queue(store)
    s, _ = worker(store)
    sent = _record_round_trips(monkeypatch)
    task_id = submit(store)
    assert sent == ["pipeline", "pipeline+COMMIT"]
    sent.clear()
    g = claim_one(store, s)
    claim = list(sent)
    sent.clear()
    store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence)
    start = list(sent)
    sent.clear()
    store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, Outcome.success(7))
    finish = list(sent)
    assert claim == ["pipeline", "run", "pipeline+COMMIT"]
    assert claim[-1] == start[-1] == finish[-1] == "pipeline+COMMIT"
    assert "COMMIT" not in claim + start + finish
    assert start == finish == ["pipeline", "pipeline+COMMIT"]
    assert store.task_get(task_id).state == "succeeded"


@pytest.mark.parametrize("backend", ["postgres"])
def test_the_commit_travels_with_the_write(store: Store) -> None:
    """Committed as soon as the write returns (another connection sees it before the
    transaction's block ends), and the transaction then takes no other statement."""
    driver = store.driver
    assert isinstance(driver, PostgresDriver)
    queue(store)
    task_id = submit(store)
    row = _planned_row(store, task_id)
    seen: list[int] = []
    refused = pytest.raises(RuntimeError, match="committed with its last write")
    with refused, driver.transaction() as cx:
        assert cx.write_batch([("task_write_many", [row])], commit_with=[1]) == [1]
        with psycopg.connect(driver.dsn, autocommit=True) as other:
            found = other.execute(
                "SELECT max_attempts FROM orbit_tasks WHERE id = %s", [task_id]
            ).fetchone()
            assert found is not None
            seen.append(found[0])
        cx.fetch("task_get", {"id": task_id})
    assert seen == [row["max_attempts"]]
    assert store.task_get(task_id).max_attempts == row["max_attempts"]


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_missed_guard_is_stale_write_and_the_connection_stays_usable(store: Store) -> None:
    driver = store.driver
    assert isinstance(driver, PostgresDriver)
    queue(store)
    task_id = submit(store)
    before = store.task_get(task_id)
    row = _planned_row(store, task_id)
    with pytest.raises(StaleWrite, match="task_write_many"), driver.transaction() as cx:
        cx.write_batch([("task_write_many", [row])], commit_with=[2])
    assert store.task_get(task_id) == before
    for _ in range(3):  # every pooled connection answers again
        assert store.task_get(task_id) == before
    with driver.transaction() as cx:  # a count of None is not checked
        assert cx.write_batch([("task_write_many", [row])], commit_with=[None]) == [1]
    assert store.task_get(task_id).max_attempts == row["max_attempts"]


@pytest.mark.parametrize("backend", ["postgres"])
def test_the_guard_function_raises_its_own_sqlstate(store: Store) -> None:
    driver = store.driver
    assert isinstance(driver, PostgresDriver)
    with psycopg.connect(driver.dsn, autocommit=True) as cx, pytest.raises(psycopg.Error) as err:
        cx.execute("SELECT orbit_stale_write('why')")
    assert err.value.sqlstate == STALE_WRITE_SQLSTATE
    assert "stale write: why" in str(err.value)


def test_the_guarded_form_checks_only_the_guarded_counts() -> None:
    a = "UPDATE t SET x = 1 WHERE id = %(id)s RETURNING id"
    b = "SELECT pg_notify('c', 'p')"
    sql = write_batch_sql([a, b], [True, False])
    assert "c0 = CAST(%(expect_0)s AS bigint)" in sql and "expect_1" not in sql
    assert "orbit_stale_write(" in sql
    assert "orbit_stale_write(" not in write_batch_sql([a, b])
    assert "WHEN true THEN" in write_batch_sql([a, b], [False, False])
    assert "OFFSET 0) AS counts" in sql  # each count computed once, not once per use
    with pytest.raises(ValueError, match="one guard flag for each write"):
        write_batch_sql([a, b], [True])


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_submit_whose_insert_falls_short_commits_nothing(store: Store) -> None:
    """A single submit's insert makes its tasks' events from the rows it returns, in a
    statement with a WITH of its own, hoisted into the guarded one: a row skipped for a
    key another submit took makes the count fall short, and neither the other new task
    nor any event is committed."""
    driver = store.driver
    assert isinstance(driver, PostgresDriver)
    queue(store)
    spec = TaskSpec(queue="q", handler="h", payload="same", idempotency_key="k")
    winner = store.task_submit(spec).task
    events = store.event_list(limit=1000)
    loser = new_task(spec, task_id="t-loser", payload='"same"', now=1)
    fresh = new_task(TaskSpec(queue="q", handler="h"), task_id="t-fresh", payload="1", now=1)
    rows = [task_to_row(fresh), task_to_row(loser)]
    with pytest.raises(StaleWrite, match="task_submit_many"), driver.transaction() as cx:
        cx.write_batch(
            [("task_submit_many", rows)], [("orbit_ready", "x:ready:q")], commit_with=[2]
        )
    assert [t.id for t in store.task_list()] == [winner.id]
    assert store.event_list(limit=1000) == events
    with driver.transaction() as cx:  # without the taken key, both rows and their events
        counts = cx.write_batch([("task_submit_many", rows[:1])], commit_with=[1])
    assert counts == [1]
    assert {t.id for t in store.task_list()} == {winner.id, "t-fresh"}
    assert [e["task_id"] for e in store.event_list(limit=1000) if e["kind"] == "submitted"][
        -1
    ] == "t-fresh"


def test_a_write_with_its_own_with_list_is_hoisted_into_the_statement() -> None:
    """PostgreSQL takes a data-modifying WITH only at a statement's top level, so the
    write's own CTEs join the statement's list, renamed for its position."""
    own = (
        "WITH made AS (INSERT INTO a SELECT ')(' || x FROM y RETURNING id), "
        "kept AS (SELECT id FROM made WHERE id <> 'made') "
        "INSERT INTO b SELECT id FROM kept RETURNING id"
    )
    ctes, main = split_with(own)
    assert [name for name, _ in ctes] == ["made", "kept"]
    assert ctes[0][1] == "INSERT INTO a SELECT ')(' || x FROM y RETURNING id"
    assert main == "INSERT INTO b SELECT id FROM kept RETURNING id"
    sql = write_batch_sql(["UPDATE t SET x = 1 RETURNING id", own], [False, True])
    assert "w1_made AS (INSERT INTO a SELECT ')(' || x FROM y RETURNING id)" in sql
    assert "w1_kept AS (SELECT id FROM w1_made WHERE" in sql
    assert "w1 AS (INSERT INTO b SELECT id FROM w1_kept RETURNING id)" in sql
    assert "c1 = CAST(%(expect_1)s AS bigint)" in sql
    recursive = "WITH RECURSIVE r AS (SELECT 1) SELECT * FROM r"
    assert split_with(recursive) == ([], recursive)
    assert split_with("SELECT 1") == ([], "SELECT 1")


def test_the_hoisting_renames_only_names_and_refuses_what_it_cannot_read() -> None:
    """A name inside a string literal stays as it is, a new name is never renamed
    again, and a WITH list it cannot read safely is refused, never guessed at."""
    own = (
        "WITH a AS (INSERT INTO t SELECT 'a''s a' RETURNING id), "
        "w0_a AS (SELECT id FROM a) INSERT INTO u SELECT id FROM w0_a RETURNING id"
    )
    sql = write_batch_sql([own])
    assert "w0_a AS (INSERT INTO t SELECT 'a''s a' RETURNING id)" in sql
    assert "w0_w0_a AS (SELECT id FROM w0_a)" in sql
    assert "w0 AS (INSERT INTO u SELECT id FROM w0_w0_a RETURNING id)" in sql
    for unread in [
        "WITH a AS (SELECT (1) SELECT 2",  # unclosed
        "WITH a AS (SELECT 'x) SELECT 2",  # an unclosed literal
        "WITH a(x) AS (SELECT 1) SELECT x FROM a",  # a column list
        "WITH a AS MATERIALIZED (SELECT 1) SELECT * FROM a",
        "WITH a AS (SELECT $$)$$) SELECT * FROM a",
        "WITH a AS (SELECT E')') SELECT * FROM a",
        "WITH a AS (SELECT 1 -- )\n) SELECT * FROM a",
    ]:
        with pytest.raises(ValueError):
            split_with(unread)
    with pytest.raises(ValueError):  # the driver reads every list when it loads them
        _Statements(
            {
                "bad_many": "WITH a(x) AS (INSERT INTO t VALUES (1) RETURNING x) "
                "INSERT INTO u SELECT x FROM a RETURNING x"
            }
        )
