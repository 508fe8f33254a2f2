"""A batch submit's chunk whose tasks share every column but their ids and payloads, and
carry no idempotency key, goes to PostgreSQL in the insert's uniform form
(``task_submit_many_uniform``: those columns once each, no ON CONFLICT; see
orbit/store/postgres/driver.py, ``uniform_params``). Whatever form a chunk takes, the
tasks and events stored are the ones the general form stores, byte for byte, on both
backends (SQLite has one form only)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from contextlib import closing
from typing import Any

import psycopg
import pytest

from orbit.core.model import Backoff, TaskSpec
from orbit.store import Store
from orbit.store.store import SUBMIT_CHUNK
from tests.conftest import store_url
from tests.store.helpers import queue

#: every column of a task but its id; the event's but its ids and its transaction's
TASK_COLUMNS = (
    "queue, handler, tenant, priority, payload, payload_digest, idempotency_key, parent_id, "
    "retry_safe, max_attempts, backoff_base_us, backoff_factor, backoff_max_us, "
    "attempt_timeout_us, deadline, run_after, state, attempts_used, fence, cancel_requested, "
    "result, error_code, error_message, error_retryable, result_digest, result_version, "
    "created_at, updated_at, finished_at, version"
)
EVENT_COLUMNS = (
    "at, kind, attempt_id, session_id, queue, tenant, task_from, task_to, attempt_from, "
    "attempt_to, code, data"
)
AWKWARD = ["\x1f", "\x1e", "a\x1fb", "", "None", "null", ",", '"', "\\", "é"]

Make = Callable[[int, str], TaskSpec]


def _raw(store: Store, sql: str, ids: list[str]) -> list[tuple[Any, ...]]:
    """Rows as the database holds them, in the order of ``ids``: ``sql`` selects the
    task's id first (dropped) and names the ids as ``{ids}``."""
    url = store_url(store)
    if store.backend == "postgres":
        with psycopg.connect(url) as cx:
            found = cx.execute(sql.format(ids="= ANY(%s)"), (ids,)).fetchall()
    else:
        with closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
            within = sql.format(ids="IN (SELECT value FROM json_each(?))")
            found = db.execute(within, (json.dumps(ids),)).fetchall()
    by_id = {row[0]: row[1:] for row in found}
    return [by_id[i] for i in ids]


def _stored(store: Store, ids: list[str]) -> list[tuple[Any, ...]]:
    tasks = _raw(store, f"SELECT id, {TASK_COLUMNS} FROM orbit_tasks WHERE id {{ids}}", ids)
    events = _raw(
        store, f"SELECT task_id, {EVENT_COLUMNS} FROM orbit_events WHERE task_id {{ids}}", ids
    )
    return [t + e for t, e in zip(tasks, events, strict=True)]


def _submit_both_ways(store: Store, batch: list[TaskSpec]) -> list[str]:
    """Submit ``batch`` twice, in the uniform form where it fits and then with that form
    turned off; each stored task and its event must be the same, id (and a key made
    anew for the second submit) aside. The first submit's ids."""
    first = [d.task.id for d in store.task_submit_many(batch)]
    uniform = getattr(store.driver, "uniform", None)
    if uniform is not None:
        store.driver.uniform = {}  # type: ignore[attr-defined]
    try:
        keyless = [s if s.idempotency_key is None else _rekeyed(s) for s in batch]
        second = [d.task.id for d in store.task_submit_many(keyless)]
    finally:
        if uniform is not None:
            store.driver.uniform = uniform  # type: ignore[attr-defined]
    uniform_rows, general_rows = _stored(store, first), _stored(store, second)
    assert [_unkeyed(r) for r in uniform_rows] == [_unkeyed(r) for r in general_rows]
    return first


def _rekeyed(spec: TaskSpec) -> TaskSpec:
    """The same spec under another key: the second submit must make new tasks."""
    return TaskSpec(**{**spec.__dict__, "idempotency_key": f"again:{spec.idempotency_key}"})


def _unkeyed(row: tuple[Any, ...]) -> tuple[Any, ...]:
    key = row[6]
    return (*row[:6], key.removeprefix("again:") if isinstance(key, str) else key, *row[7:])


def _every_field(parent: str, later: int) -> Make:
    def make(i: int, handler: str) -> TaskSpec:
        return TaskSpec(
            queue="q",
            handler=handler,
            payload={"i": i},
            tenant="t",
            priority=7,
            parent_id=parent,
            retry_safe=True,
            max_attempts=9,
            backoff=Backoff(base_us=3, factor=1.5, max_us=99),
            attempt_timeout_us=123_456,
            deadline=later + 5,
            run_after=later,
        )

    return make


@pytest.mark.parametrize("n", [8, SUBMIT_CHUNK, 2 * SUBMIT_CHUNK + 7])
def test_a_uniform_batch_stores_what_the_general_form_stores(store: Store, n: int) -> None:
    queue(store)
    parent = store.task_submit(TaskSpec(queue="q", handler="h")).task
    later = parent.created_at + 10**9
    plain: Make = lambda i, h: TaskSpec(queue="q", handler=h, payload={"i": i})  # noqa: E731
    awkward: Make = lambda i, h: TaskSpec(  # noqa: E731  (the payloads go as JSON rows)
        queue="q", handler=h, payload=AWKWARD[i % len(AWKWARD)]
    )
    for make in (plain, _every_field(parent.id, later), awkward):
        _submit_both_ways(store, [make(i, "h.x-1") for i in range(n)])


@pytest.mark.parametrize(
    "field",
    [
        "queue",
        "handler",
        "tenant",
        "priority",
        "parent_id",
        "retry_safe",
        "max_attempts",
        "backoff",
        "attempt_timeout_us",
        "deadline",
        "run_after",
        "idempotency_key",
    ],
)
def test_a_batch_with_one_task_unlike_the_others_is_stored_as_submitted(
    store: Store, field: str
) -> None:
    """Each column the uniform form reads once, changed in one task of a chunk (the
    last of 20): the chunk goes the general way and every task keeps its own value."""
    queue(store)
    queue(store, "other")
    parent = store.task_submit(TaskSpec(queue="q", handler="h")).task
    later = parent.created_at + 10**9
    odd: dict[str, Any] = {
        "queue": "other",
        "handler": "g",
        "tenant": "u",
        "priority": 1,
        "parent_id": None,
        "retry_safe": False,
        "max_attempts": 2,
        "backoff": Backoff(),
        "attempt_timeout_us": None,
        "deadline": None,
        "run_after": later + 1,
        "idempotency_key": "k",
    }
    make = _every_field(parent.id, later)
    batch = [make(i, "h") for i in range(20)]
    batch[-1] = TaskSpec(**{**batch[-1].__dict__, field: odd[field]})
    ids = _submit_both_ways(store, batch)
    assert getattr(store.task_get(ids[-1]), field) == odd[field]
    assert getattr(store.task_get(ids[0]), field) == getattr(batch[0], field)
