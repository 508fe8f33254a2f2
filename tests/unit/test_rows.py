"""Rows to records: every field of the dataclass is filled, and with the right type."""

from __future__ import annotations

import re
from dataclasses import fields, replace

import pytest

from orbit.core import transitions
from orbit.core.model import Attempt, Backoff, Event, Session, Task, TaskSpec
from orbit.core.states import AttemptState, SessionState, TaskState
from orbit.core.transitions import NEW_TASK_FIXED, Plan, new_task
from orbit.store import rows as R
from orbit.store.driver import RowColumns, Table, load_queries
from orbit.store.postgres import driver as pg
from orbit.store.sqlite import driver as sqlite


def test_every_task_and_attempt_field_is_filled_from_its_row() -> None:
    converted = {"retry_safe", "cancel_requested", "error_retryable", "state", "backoff"}
    assert set(R._TASK_AS_IS) | converted == {f.name for f in fields(Task)}
    assert set(R._ATTEMPT_AS_IS) | {"state"} == {f.name for f in fields(Attempt)}


def _task() -> Task:
    return Task(
        id="t1",
        queue="q",
        handler="h",
        tenant="default",
        priority=3,
        payload='{"a":1}',
        payload_digest="sha256:x",
        idempotency_key=None,
        parent_id="p",
        retry_safe=True,
        max_attempts=3,
        backoff=Backoff(1_000_000, 2.0, 300_000_000),
        attempt_timeout_us=None,
        deadline=123,
        run_after=5,
        state=TaskState.RUNNING,
        attempts_used=1,
        fence=2,
        cancel_requested=False,
        result=None,
        error_code=None,
        error_message=None,
        error_retryable=None,
        result_digest=None,
        result_version=0,
        created_at=1,
        updated_at=2,
        finished_at=None,
        version=4,
    )


def test_a_task_row_round_trips_with_sqlite_style_booleans() -> None:
    task = _task()
    row = R.task_to_row(task)
    assert R.task_from_row(row) == task
    sqlite_row = {**row, "retry_safe": 1, "cancel_requested": 0, "error_retryable": 0}
    back = R.task_from_row(sqlite_row)
    assert back == Task(**{**task.__dict__, "error_retryable": False})
    assert back.retry_safe is True and back.cancel_requested is False


def _inserted(row: dict[str, object]) -> dict[str, object]:
    """A task's row as the insert reads it: without what the insert spells itself."""
    return {k: v for k, v in row.items() if k not in NEW_TASK_FIXED and k != "updated_at"}


def test_tasks_columns_hold_each_tasks_row() -> None:
    """The columns a batch submit sends are task_to_row's rows, column by column, less
    the columns the insert spells itself, for tasks that differ in every kind of field
    it sends (None and not, each state, each type)."""
    base = _task()
    tasks = [
        base,
        replace(base, id="t2", idempotency_key="k", parent_id=None, state=TaskState.QUEUED),
        replace(base, id="t3", attempt_timeout_us=5, deadline=None, max_attempts=1),
        replace(base, id="t4", backoff=Backoff(1, 1.5, 2), state=TaskState.SCHEDULED),
    ]
    columns = R.tasks_columns(tasks)
    rows = [_inserted(R.task_to_row(t)) for t in tasks]
    assert set(columns.columns) == set(rows[0])
    assert len(columns) == 4
    assert list(columns) == rows
    assert [columns[i] for i in range(-4, 4)] == rows + rows
    assert columns[1:3] == rows[1:3]
    with pytest.raises(IndexError):
        columns[4]
    assert list(R.tasks_columns([])) == [] and len(R.tasks_columns([])) == 0


def test_every_new_task_starts_with_the_columns_the_insert_spells() -> None:
    """The insert writes NEW_TASK_FIXED and created_at as updated_at in place of the
    task's own values: new_task, the only maker of submitted tasks, must agree, for
    every kind of spec (scheduled or not, keyed, with a parent, a deadline, a backoff)."""
    specs = [
        TaskSpec(queue="q", handler="h"),
        TaskSpec(
            queue="q",
            handler="h",
            payload={"a": [1]},
            tenant="t",
            priority=-4,
            idempotency_key="k",
            parent_id="p",
            retry_safe=True,
            max_attempts=9,
            backoff=Backoff(5, 3.0, 50),
            attempt_timeout_us=7,
            deadline=10**9,
            run_after=10**8,
        ),
    ]
    for spec in specs:
        row = R.task_to_row(new_task(spec, task_id="t", payload="{}", now=1_000))
        assert {k: row[k] for k in NEW_TASK_FIXED} == NEW_TASK_FIXED
        assert row["updated_at"] == row["created_at"] == 1_000
        assert set(NEW_TASK_FIXED) | {"updated_at"} | set(R.tasks_columns([]).columns) == set(row)


def test_row_columns_refuse_columns_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        RowColumns({"a": [1, 2], "b": [1]})


def _attempt(**changes: object) -> Attempt:
    attempt = Attempt(
        id="a1",
        task_id="t1",
        number=2,
        session_id="s",
        session_epoch=1,
        fence=2,
        state=AttemptState.RUNNING,
        claimed_at=1,
        claim_expires_at=2,
        started_at=3,
        lease_expires_at=4,
        ended_at=None,
        finish_digest=None,
        receipt=None,
        queue="q",
        tenant="default",
        handler="h",
    )
    return replace(attempt, **changes)


def test_attempts_columns_hold_each_attempt_and_read_back_as_it() -> None:
    """The inserted attempts' columns hold every field of each (its state spelled), so
    that each row, read back, is the attempt a claim made, for attempts that differ in
    every kind of field (None and not, each state)."""
    attempts = [
        _attempt(),
        _attempt(id="a2", state=AttemptState.CLAIMED, started_at=None, lease_expires_at=None),
        _attempt(id="a3", state=AttemptState.SUCCEEDED, ended_at=5, finish_digest="d", receipt="r"),
    ]
    columns = R.attempts_columns(attempts)
    assert len(columns) == 3
    assert columns[1]["state"] == "claimed"
    assert [R.attempt_from_row(row) for row in columns] == attempts
    assert len(R.attempts_columns([])) == 0


def _columns_read(write: str) -> tuple[set[str], set[str]]:
    """The columns a batched write reads from its rows: PostgreSQL's (its columnar
    form's) and SQLite's (its named parameters)."""
    pg_sql = pg.to_psycopg(load_queries(pg._HERE / "queries.sql")[write])
    form = pg.columnar_sql(pg_sql)
    assert form is not None
    sqlite_sql = load_queries(sqlite._HERE / "queries.sql")[write]
    return {name for name, _ in form[1]}, set(re.findall(r"(?<![:\w]):([a-z_]+)", sqlite_sql))


def test_the_write_columns_are_the_columns_each_write_reads() -> None:
    """A column the builder left out would travel as a JSON row without it, which
    json_to_recordset reads as NULL: each builder makes exactly what its write reads,
    on both backends."""
    task, attempt = _task(), _attempt()
    made = {
        "task_write_many": R.task_write_columns([(task, task)]),
        "attempt_write_many": R.attempt_write_columns([(attempt, attempt)]),
        "event_insert_many": R.event_columns([Event(kind="k")], 1),
        "attempt_insert_many": R.attempts_columns([attempt]),
    }
    for write, columns in made.items():
        on_pg, on_sqlite = _columns_read(write)
        assert set(columns.columns) == on_pg == on_sqlite, write


def test_the_write_columns_hold_each_pairs_new_values_and_old_guards() -> None:
    before = _task()
    after = replace(
        before,
        state=TaskState.SUCCEEDED,
        result="null",
        result_digest="sha256:r",
        result_version=1,
        error_retryable=True,
        cancel_requested=True,
        finished_at=9,
        version=5,
    )
    rows = list(R.task_write_columns([(before, after), (after, before)]))
    assert rows[0] == {
        "id": "t1",
        "expect_version": 4,
        "state": "succeeded",
        "attempts_used": 1,
        "fence": 2,
        "cancel_requested": True,
        "run_after": 5,
        "max_attempts": 3,
        "result": "null",
        "error_code": None,
        "error_message": None,
        "error_retryable": True,
        "result_digest": "sha256:r",
        "result_version": 1,
        "updated_at": 2,
        "finished_at": 9,
        "version": 5,
    }
    assert rows[1]["expect_version"] == 5 and rows[1]["state"] == "running"
    running = _attempt()
    ended = replace(
        running, state=AttemptState.SUCCEEDED, ended_at=8, finish_digest="d", receipt="{}"
    )
    claimed = _attempt(state=AttemptState.CLAIMED, started_at=None, lease_expires_at=None)
    assert list(R.attempt_write_columns([(running, ended), (claimed, running)])) == [
        {
            "id": "a1",
            "expect_state": "running",
            "expect_lease": 4,
            "state": "succeeded",
            "started_at": 3,
            "lease_expires_at": 4,
            "ended_at": 8,
            "finish_digest": "d",
            "receipt": "{}",
        },
        {
            "id": "a1",
            "expect_state": "claimed",
            "expect_lease": None,
            "state": "running",
            "started_at": 3,
            "lease_expires_at": 4,
            "ended_at": None,
            "finish_digest": None,
            "receipt": None,
        },
    ]
    assert len(R.task_write_columns([])) == len(R.attempt_write_columns([])) == 0


def test_event_columns_stamp_every_event_and_spell_its_states_and_data() -> None:
    moved = Event(
        kind="succeeded",
        task_id="t1",
        attempt_id="a1",
        session_id="s",
        queue="q",
        tenant="default",
        task_from=TaskState.RUNNING,
        task_to=TaskState.SUCCEEDED,
        attempt_from=AttemptState.RUNNING,
        attempt_to=AttemptState.SUCCEEDED,
        code="E",
        data={"z": 1, "a": [None, "é"]},
    )
    bare = Event(kind="queue.created", queue="q")
    assert list(R.event_columns([moved, bare], 77)) == [
        {
            "at": 77,
            "kind": "succeeded",
            "task_id": "t1",
            "attempt_id": "a1",
            "session_id": "s",
            "queue": "q",
            "tenant": "default",
            "task_from": "running",
            "task_to": "succeeded",
            "attempt_from": "running",
            "attempt_to": "succeeded",
            "code": "E",
            "data": '{"a":[null,"é"],"z":1}',
        },
        {
            "at": 77,
            "kind": "queue.created",
            "task_id": None,
            "attempt_id": None,
            "session_id": None,
            "queue": "q",
            "tenant": None,
            "task_from": None,
            "task_to": None,
            "attempt_from": None,
            "attempt_to": None,
            "code": None,
            "data": None,
        },
    ]


def test_sqlite_encodes_rows_held_by_column_as_it_encodes_dicts() -> None:
    """The SQLite driver encodes a column of rows a column at a time: the same
    parameters as each row read as a dict and encoded, a list in any row included."""
    held = RowColumns(
        {"id": ["a", "b", "c"], "ids": [None, ["x", "y"], ("z",)], "n": [1, None, True]}
    )
    expected = [sqlite._encode(row) for row in held]
    assert sqlite._encoded_rows(held) == expected
    assert expected[1]["ids"] == '["x", "y"]' and expected[2]["ids"] == '["z"]'
    assert sqlite._encoded_rows(list(held)) == expected
    assert sqlite._encoded_rows(RowColumns({})) == []


def test_sqlite_joins_a_streams_chunks_held_by_column_into_one_column_each() -> None:
    """A streamed write's chunks reach SQLite as one batch of rows in order: chunks held
    by column alike stay so (each column the chunks' lists, encoded a column at a time),
    and any other mix is read row by row, as before; either way the same rows."""
    first = RowColumns({"id": ["a", "b"], "n": [1, None]})
    second = RowColumns({"id": ["c"], "n": [3]})
    empty = RowColumns({"id": [], "n": []})
    rows = [*first, *second]
    joined = sqlite.joined([first, empty, second])
    assert isinstance(joined, RowColumns)
    assert joined.columns == {"id": ["a", "b", "c"], "n": [1, None, 3]}
    assert list(joined) == rows
    assert sqlite._encoded_rows(joined) == [sqlite._encode(r) for r in rows]
    mixed = sqlite.joined([first, [{"id": "c", "n": 3}]])
    assert not isinstance(mixed, RowColumns) and list(mixed) == rows
    other = sqlite.joined([first, RowColumns({"n": [3], "id": ["c"]})])  # another order
    assert not isinstance(other, RowColumns) and list(other) == [*rows[:2], {"n": 3, "id": "c"}]
    assert list(sqlite.joined([])) == []


def _selected(query: str) -> dict[str, set[str]]:
    """The columns a query's SELECT list names, on each backend."""
    found = {}
    for name, module in (("postgresql", pg), ("sqlite", sqlite)):
        sql = load_queries(module._HERE / "queries.sql")[query]
        head = sql.split("FROM", 1)[0].removeprefix("SELECT")
        found[name] = {c.strip().split()[-1] for c in head.split(",")}
    return found


def test_a_starts_task_read_selects_exactly_the_fields_it_fills_from_its_row() -> None:
    """``task_lock_for_starts`` selects what ``start_tasks_from_table`` reads, on both
    backends, and the two with the fields it never reads make up the whole task."""
    converted = {"cancel_requested", "error_retryable", "state"}
    read = set(R._TASK_START_AS_IS) | converted
    assert read.isdisjoint(R._TASK_START_UNREAD)
    assert read | set(R._TASK_START_UNREAD) == {f.name for f in fields(Task)}
    assert _selected("task_lock_for_starts") == {"postgresql": read, "sqlite": read}


def _session() -> Session:
    return Session(
        id="s",
        name="w",
        node_id="n",
        epoch=1,
        secret_hash="x",
        capabilities=(),
        max_concurrency=10,
        capacity_seq=0,
        draining=False,
        state=SessionState.LIVE,
        expires_at=10_000,
        created_at=0,
    )


def _start_plan(task: Task, attempt: Attempt, *, fence: int, now: int) -> tuple[object, ...]:
    plan = Plan()
    lease = transitions.start(
        plan,
        task,
        attempt,
        _session(),
        epoch=1,
        fence=fence,
        queue_paused=False,
        now=now,
        lease_ttl=1_000,
    )
    return (
        lease,
        repr(plan.rejection),
        list(R.task_write_columns(plan.task_writes)),
        list(R.attempt_write_columns(plan.attempt_writes)),
        list(R.event_columns(plan.events, now)),
    )


@pytest.mark.parametrize(
    ("changes", "fence", "now"),
    [
        ({}, 2, 5),  # accepted
        ({}, 3, 5),  # a stale fence
        ({"cancel_requested": True}, 2, 5),
        ({"deadline": 4}, 2, 5),
        ({"state": TaskState.CANCELLED}, 2, 5),
        ({"attempt_timeout_us": 7, "error_code": "E", "error_message": "m"}, 2, 5),
    ],
)
def test_a_start_on_its_narrow_task_plans_what_it_plans_on_the_whole_task(
    changes: dict[str, object], fence: int, now: int
) -> None:
    """A start's task carries placeholders in the fields it never reads: its answer, its
    writes and its events are the ones the whole task gives."""
    whole = replace(_task(), **{"state": TaskState.CLAIMED, **changes})
    row = R.task_to_row(whole)
    row["state"] = str(whole.state)
    names = tuple(sorted(_selected("task_lock_for_starts")["sqlite"]))
    (narrow,) = R.start_tasks_from_table(Table(names, [tuple(row[k] for k in names)]))
    attempt = _attempt(
        state=AttemptState.CLAIMED, claim_expires_at=100, started_at=None, lease_expires_at=None
    )
    assert narrow != whole
    assert _start_plan(narrow, attempt, fence=fence, now=now) == _start_plan(
        whole, attempt, fence=fence, now=now
    )


def test_tasks_that_back_off_alike_share_one_backoff_read_exactly() -> None:
    """A row's backoff is the one its columns spell, with a float factor whichever form
    the row holds it in (SQLite's JSON reads 2 for 2.0), shared by rows that spell it
    alike; past ``BACKOFFS_KEPT`` kept, each further one is made and not kept."""
    row = R.task_to_row(_task())
    row["state"] = str(row["state"])
    names = tuple(row)
    odd = {**row, "backoff_base_us": 7, "backoff_factor": 3, "backoff_max_us": 9}
    first, second, third = R.tasks_from_table(
        Table(names, [tuple(r.values()) for r in (row, odd, {**odd, "backoff_factor": 3.0})])
    )
    assert first.backoff == Backoff(1_000_000, 2.0, 300_000_000)
    assert second.backoff == Backoff(7, 3.0, 9) and type(second.backoff.factor) is float
    assert third.backoff is second.backoff
    kept = dict(R._BACKOFFS)
    try:
        R._BACKOFFS.update({(i, 1.0, i): Backoff(i, 1.0, i) for i in range(R.BACKOFFS_KEPT)})
        full = len(R._BACKOFFS)
        (late,) = R.tasks_from_table(Table(names, [tuple({**odd, "backoff_base_us": -5}.values())]))
        assert late.backoff == Backoff(-5, 3.0, 9) and len(R._BACKOFFS) == full
    finally:
        R._BACKOFFS.clear()
        R._BACKOFFS.update(kept)
