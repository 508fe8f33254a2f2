"""The batch reads' records made from tuples by position (``Table``, ``rows.*_from_table``)
are the records the dict path makes (``rows.task_from_row``, ``attempt_from_row``): every
field, of the same type, on both backends, in every form a driver reads them in, for
tasks and attempts with each nullable field set and unset."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from orbit.core.model import Attempt, Backoff, Outcome, Task
from orbit.store import Store
from orbit.store import rows as R
from orbit.store.driver import Connection, Row, Table
from orbit.store.postgres.driver import LOCK_MANY_INLINE_MAX
from tests.conftest import ManualClock
from tests.store.helpers import claim_one, queue, submit, worker

SECOND = 1_000_000
Record = Task | Attempt


def _typed(record: Record) -> dict[str, tuple[type, Any]]:
    """Every field of a record with its value's type (``1 == True`` and ``2 == 2.0``
    in Python), and the backoff's fields."""
    typed: dict[str, tuple[type, Any]] = {}
    for name, value in vars(record).items():
        typed[name] = (type(value), value)
        if isinstance(value, Backoff):
            typed.update({f"backoff.{k}": (type(v), v) for k, v in vars(value).items()})
    return typed


def _fill(store: Store, clock: ManualClock) -> list[str]:
    """Tasks and attempts in every state a batch reads, each nullable field set on some
    and unset on others, and two ready tasks (one with every option, one with none);
    the attempts' ids."""
    queue(store)
    s, _ = worker(store, max_concurrency=100)
    attempts: list[str] = []

    def claimed(**spec: Any) -> Any:
        submit(store, **spec)
        g = claim_one(store, s)
        attempts.append(g.attempt.id)
        return g

    def started(**spec: Any) -> Any:
        g = claimed(**spec)
        store.attempt_start(s.id, s.epoch, g.attempt.id, g.attempt.fence)
        return g

    def finish(g: Any, outcome: Outcome) -> None:
        store.attempt_finish(s.id, s.epoch, g.attempt.id, g.attempt.fence, outcome)

    parent = claimed().task.id  # claimed, never started: no start, lease or end
    every = {
        "idempotency_key": "k",
        "parent_id": parent,
        "deadline": clock.now + 3600 * SECOND,
        "attempt_timeout_us": 60 * SECOND,
        "retry_safe": True,
        "priority": 5,
        "backoff": Backoff(2 * SECOND, 1.5, 10 * SECOND),
        "max_attempts": 3,
    }
    # scheduled for a retry: the error's fields, error_retryable True
    finish(started(**every), Outcome.failure("E", "again", retryable=True))
    finish(started(), Outcome.success({"r": [1, "é"]}))  # a result, its digest, an end
    finish(started(), Outcome.failure("F", "never", retryable=False))  # retryable False
    running = started(**{**every, "idempotency_key": "k2"})
    store.task_cancel(running.task.id)  # running, its cancel requested
    submit(store, **{**every, "idempotency_key": "k3"})  # ready, with every option
    submit(store)  # ready, with none
    return attempts


def _both_ways(records: Sequence[Record]) -> None:
    """Each nullable field is None in some of ``records`` and set in others, and each
    boolean both true and false: the comparison has seen both."""
    kind = type(records[0])
    for f in dataclasses.fields(kind):
        if "None" in str(f.type):
            assert {getattr(r, f.name) is None for r in records} == {True, False}, f.name
    tasks = [r for r in records if isinstance(r, Task)]
    if tasks:
        assert {t.error_retryable for t in tasks} == {True, False, None}
        assert {t.cancel_requested for t in tasks} == {True, False}
        assert {t.retry_safe for t in tasks} == {True, False}


#: Each form a driver reads a batch's rows in: alone (``fetch_table``), and with the
#: clock (``lock_tables``), whose PostgreSQL form depends on the number of ids: one
#: statement of JSON arrays, or each read its own statement.
Form = Callable[[Connection, str, dict[str, Any]], Table]
FORMS: dict[str, Form] = {
    "fetch_table": lambda cx, name, params: cx.fetch_table(name, params),
    "lock_tables": lambda cx, name, params: cx.lock_tables([(name, params)])[0][0],
    "lock_tables-pipelined": lambda cx, name, params: cx.lock_tables([(name, _padded(params))])[0][
        0
    ],
}


def _padded(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with more ids than PostgreSQL's one-statement form takes."""
    return {**params, "ids": params["ids"] + [f"no-{i}" for i in range(LOCK_MANY_INLINE_MAX)]}


def _start_task(row: Row) -> Task:
    """A start's task from its whole row: the task with the fields a start never reads
    set to their placeholders (what ``start_tasks_from_table`` makes)."""
    return dataclasses.replace(R.task_from_row(row), **R._TASK_START_UNREAD)


#: Each batch read: the query the dict path reads and makes each record with, and the
#: table-path maker.
READS: dict[str, tuple[str, Callable[[Row], Record], Callable[[Table], Iterator[Record]]]] = {
    "task_lock_for_attempts": ("task_lock_for_attempts", R.task_from_row, R.tasks_from_table),
    "task_lock_for_starts": ("task_lock_for_attempts", _start_task, R.start_tasks_from_table),
    "attempt_lock_many": ("attempt_lock_many", R.attempt_from_row, R.attempts_from_table),
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("read", list(READS))
def test_a_batch_reads_records_by_position_as_the_dict_path_makes_them(
    store: Store, clock: ManualClock, read: str, form: str
) -> None:
    ids = _fill(store, clock)
    dict_query, from_row, from_table = READS[read]
    with store.driver.transaction() as cx:
        rows = cx.fetch(dict_query, {"ids": ids})
        table = FORMS[form](cx, read, {"ids": ids})
    expected = [from_row(r) for r in rows]
    made = list(from_table(table))
    assert len(made) == len(expected) >= 5
    _both_ways(
        [(R.attempt_from_row if read == "attempt_lock_many" else R.task_from_row)(r) for r in rows]
    )
    assert [_typed(r) for r in made] == [_typed(r) for r in expected]
    assert made == expected


def test_a_claims_ready_rows_make_the_tasks_the_dict_path_makes(
    store: Store, clock: ManualClock
) -> None:
    _fill(store, clock)
    params = {
        # past the retry's backoff (2 s), short of the deadlines (an hour): a task past
        # its deadline is no ready row
        "now": clock.now + 60 * SECOND,
        "handlers": ["h"],
        "skip_queues": [],
        "skip_tenants": [],
        "skip_ids": [],
        "limit": 100,
    }
    with store.driver.transaction() as cx:
        rows = cx.fetch("task_ready_select", params)
        table = cx.fetch_table("task_ready_select", params)
    dicts = table.dicts()
    for row in [*dicts, *rows]:  # each read's own clock (PostgreSQL; NULL on SQLite)
        row.pop("locked_at")
    assert dicts == rows
    expected = [R.task_from_row(r) for r in rows]
    made = list(R.tasks_from_table(table))
    assert len(made) == 3  # the retry and the two ready tasks
    assert {t.idempotency_key for t in made} == {"k", "k3", None}
    assert [_typed(t) for t in made] == [_typed(t) for t in expected]


def test_a_table_without_rows_makes_no_records() -> None:
    """A read with no rows may come without its columns' names (PostgreSQL's JSON
    form): no reader is made for it."""
    empty = Table((), [])
    assert list(R.tasks_from_table(empty)) == []
    assert list(R.start_tasks_from_table(empty)) == []
    assert list(R.attempts_from_table(empty)) == []
    assert empty.dicts() == []
