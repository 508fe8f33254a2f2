"""Mapping between database rows (plain dicts, or tuples by position) and the domain records
of orbit.core."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from orbit.core.model import (
    Artifact,
    Attempt,
    Backoff,
    Capability,
    Event,
    Queue,
    Schedule,
    Session,
    Task,
    TaskSpec,
    Token,
    sorted_json_texts,
)
from orbit.core.states import AttemptState, SessionState, TaskState
from orbit.store.driver import Row, RowColumns, Table

_TASK_STATES = {str(s.value): s for s in TaskState}
_ATTEMPT_STATES = {str(s.value): s for s in AttemptState}


def _opt_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


#: Each task's backoff as read, by its three columns: a record is immutable, so tasks
#: that back off alike (nearly all: most name none) share one, where each row built its
#: own through the frozen ``__init__`` (three calls a task read by a claim or a finish).
_BACKOFFS: dict[tuple[Any, Any, Any], Backoff] = {}

#: The most backoffs ``_BACKOFFS`` holds: clients choose them, so their number is theirs.
BACKOFFS_KEPT = 1024


def _backoff(base_us: int, factor: float, max_us: int) -> Backoff:
    """A row's backoff, made and kept (``_BACKOFFS``) the first time it is read."""
    made = Backoff(base_us, float(factor), max_us)
    if len(_BACKOFFS) < BACKOFFS_KEPT:
        _BACKOFFS[base_us, factor, max_us] = made
    return made


#: Task fields read from the column of the same name, as the driver returned it (both
#: backends return these as int, str or None already).
_TASK_AS_IS = (
    "id",
    "queue",
    "handler",
    "tenant",
    "priority",
    "payload",
    "payload_digest",
    "idempotency_key",
    "parent_id",
    "max_attempts",
    "attempt_timeout_us",
    "deadline",
    "run_after",
    "attempts_used",
    "fence",
    "result",
    "error_code",
    "error_message",
    "result_digest",
    "result_version",
    "created_at",
    "updated_at",
    "finished_at",
    "version",
)


def task_from_row(r: Row) -> Task:
    """A task from its row, unchecked: the field lists here are fixed and a test holds
    them to the dataclass. The row's values by position through the reader a batch's
    tuples go through (``_task_reader``), so each column's conversion is spelled once."""
    return _task_reader(tuple(r))(tuple(r.values()))


#: What a start's task holds in the fields it never reads nor writes: the task is not
#: returned, and none of these reaches a write or an event (a test holds a start on such a
#: task to the same plan as on the whole task).
_TASK_START_UNREAD: dict[str, Any] = {
    "handler": "",
    "priority": 0,
    "payload": "",
    "payload_digest": "",
    "idempotency_key": None,
    "parent_id": None,
    "retry_safe": False,
    "backoff": Backoff(0, 1.0, 0),
    "created_at": 0,
}


#: The task fields a start reads or writes back (``transitions.start``, the event its
#: ``Plan.move`` records, ``task_write_columns``): the columns of ``task_lock_for_starts``
#: read as they come (the converted ones are named in ``_start_task_reader``), i.e.
#: every plain column but those a start never reads.
_TASK_START_AS_IS = tuple(name for name in _TASK_AS_IS if name not in _TASK_START_UNREAD)


#: The record types the positional readers make.
Rec = TypeVar("Rec", Task, Attempt)


def tasks_from_table(table: Table) -> Iterator[Task]:
    """Each row's task, as ``task_from_row`` makes it from the row's dict, made as the
    iterator is taken (a claim may stop part way through its rows)."""
    return _records(table, _task_reader)


def start_tasks_from_table(table: Table) -> Iterator[Task]:
    """Each row's task for a start, from rows of ``task_lock_for_starts``: only the
    columns a start reads or writes back (20 of the 31: each column selected costs every
    row its conversion, in the driver and into the record), the other fields
    ``_TASK_START_UNREAD``."""
    return _records(table, _start_task_reader)


def attempts_from_table(table: Table) -> Iterator[Attempt]:
    """Each row's attempt, as ``attempt_from_row`` makes it from the row's dict."""
    return _records(table, _attempt_reader)


def _records(
    table: Table, reader: Callable[[tuple[str, ...]], Callable[[tuple[Any, ...]], Rec]]
) -> Iterator[Rec]:
    """The records ``reader``'s function for the table's columns makes of its rows. A
    table without rows may have no names, and needs no reader."""
    if not table.rows:
        return iter(())
    return map(reader(table.names), table.rows)


@functools.cache  # one per shape of row: a query's columns, on one backend
def _task_reader(names: tuple[str, ...]) -> Callable[[tuple[Any, ...]], Task]:
    """``task_from_row`` for rows of these columns, by position (``_compiled``)."""
    return _compiled(
        Task,
        names,
        _TASK_AS_IS,
        {
            "retry_safe": "bool(row[{retry_safe}])",  # SQLite stores booleans as 0/1
            "cancel_requested": "bool(row[{cancel_requested}])",
            "error_retryable": "_opt_bool(row[{error_retryable}])",
            "state": "_TASK_STATES[row[{state}]]",
            "backoff": "_BACKOFFS.get((row[{backoff_base_us}], row[{backoff_factor}], "
            "row[{backoff_max_us}])) or _backoff(row[{backoff_base_us}], "
            "row[{backoff_factor}], row[{backoff_max_us}])",
        },
    )


@functools.cache
def _start_task_reader(names: tuple[str, ...]) -> Callable[[tuple[Any, ...]], Task]:
    """``_task_reader`` for a start's rows (``task_lock_for_starts``): only the columns a
    start reads or writes back, the other fields ``_TASK_START_UNREAD``."""
    return _compiled(
        Task,
        names,
        _TASK_START_AS_IS,
        {
            "cancel_requested": "bool(row[{cancel_requested}])",
            "error_retryable": "_opt_bool(row[{error_retryable}])",
            "state": "_TASK_STATES[row[{state}]]",
            **{name: f"_TASK_START_UNREAD[{name!r}]" for name in _TASK_START_UNREAD},
        },
    )


@functools.cache
def _attempt_reader(names: tuple[str, ...]) -> Callable[[tuple[Any, ...]], Attempt]:
    """``attempt_from_row`` for rows of these columns, by position (``_compiled``)."""
    return _compiled(Attempt, names, _ATTEMPT_AS_IS, {"state": "_ATTEMPT_STATES[row[{state}]]"})


def _compiled(
    cls: type[Rec], names: tuple[str, ...], plain: Sequence[str], converted: dict[str, str]
) -> Callable[[tuple[Any, ...]], Rec]:
    """A function that makes a ``cls`` record from a row of these columns: one dict
    display of every field (``plain`` fields each the value at its column's index, the
    ``converted`` ones each its expression, ``{column}`` standing for that column's
    index), which Python builds at its final size and which becomes the record's dict. A
    display compiled once per shape of row, for hundreds of rows a batch: looping over
    the fields per row cost more. Only indexes and field names reach the source."""
    at = {name: i for i, name in enumerate(names)}
    items = [f"{name!r}: row[{at[name]}]" for name in plain]
    items += [f"{name!r}: {expr.format_map(at)}" for name, expr in converted.items()]
    display = "{" + ", ".join(items) + "}"
    body = f"record = new(cls)\n    setdict(record, '__dict__', {display})\n    return record"
    source = f"def read(row):\n    {body}"
    scope: dict[str, Any] = {
        "new": object.__new__,
        "setdict": object.__setattr__,
        "cls": cls,
        **globals(),
    }
    exec(source, scope)
    read: Callable[[tuple[Any, ...]], Rec] = scope["read"]
    return read


def task_to_row(t: Task) -> Row:
    return {
        "id": t.id,
        "queue": t.queue,
        "handler": t.handler,
        "tenant": t.tenant,
        "priority": t.priority,
        "payload": t.payload,
        "payload_digest": t.payload_digest,
        "idempotency_key": t.idempotency_key,
        "parent_id": t.parent_id,
        "retry_safe": t.retry_safe,
        "max_attempts": t.max_attempts,
        "backoff_base_us": t.backoff.base_us,
        "backoff_factor": t.backoff.factor,
        "backoff_max_us": t.backoff.max_us,
        "attempt_timeout_us": t.attempt_timeout_us,
        "deadline": t.deadline,
        "run_after": t.run_after,
        "state": str(t.state),
        "attempts_used": t.attempts_used,
        "fence": t.fence,
        "cancel_requested": t.cancel_requested,
        "result": t.result,
        "error_code": t.error_code,
        "error_message": t.error_message,
        "error_retryable": t.error_retryable,
        "result_digest": t.result_digest,
        "result_version": t.result_version,
        "created_at": t.created_at,
        "updated_at": t.updated_at,
        "finished_at": t.finished_at,
        "version": t.version,
    }


def tasks_columns(tasks: Sequence[Task]) -> RowColumns:
    """The new tasks' rows as the insert reads them, held column by column
    (``RowColumns``): ``task_to_row`` of each task without ``transitions.NEW_TASK_FIXED`` and
    ``updated_at``, which the insert (``task_submit_many``, both backends) spells itself,
    since on PostgreSQL each column is an array of a thousand values to parse per batch
    (the insert of 1,000 tasks and their events took 8.9 → 8.2 ms without them,
    ``EXPLAIN ANALYZE``). A list per column, where a dict per task cost the batch submit
    more than the columns do (a test holds the two to each other)."""
    return RowColumns(
        {
            "id": [t.id for t in tasks],
            "queue": [t.queue for t in tasks],
            "handler": [t.handler for t in tasks],
            "tenant": [t.tenant for t in tasks],
            "priority": [t.priority for t in tasks],
            "payload": [t.payload for t in tasks],
            "payload_digest": [t.payload_digest for t in tasks],
            "idempotency_key": [t.idempotency_key for t in tasks],
            "parent_id": [t.parent_id for t in tasks],
            "retry_safe": [t.retry_safe for t in tasks],
            "max_attempts": [t.max_attempts for t in tasks],
            "backoff_base_us": [t.backoff.base_us for t in tasks],
            "backoff_factor": [t.backoff.factor for t in tasks],
            "backoff_max_us": [t.backoff.max_us for t in tasks],
            "attempt_timeout_us": [t.attempt_timeout_us for t in tasks],
            "deadline": [t.deadline for t in tasks],
            "run_after": [t.run_after for t in tasks],
            "state": [str(t.state) for t in tasks],
            "created_at": [t.created_at for t in tasks],
        }
    )


def task_write_columns(pairs: Sequence[tuple[Task, Task]]) -> RowColumns:
    """``task_write_many``'s rows, column by column: the columns a transition may change
    (never the payload: it can be large and is written once), each row guarded by the
    version its plan was built from. Columns (``RowColumns``) rather than a dict per
    row, which the PostgreSQL driver took apart again into these columns: a batch of
    starts or finishes writes hundreds (the SQLite driver binds them by position)."""
    afters = [after for _, after in pairs]
    return RowColumns(
        {
            "id": [t.id for t in afters],
            "expect_version": [before.version for before, _ in pairs],
            "state": [str(t.state) for t in afters],
            "attempts_used": [t.attempts_used for t in afters],
            "fence": [t.fence for t in afters],
            "cancel_requested": [t.cancel_requested for t in afters],
            "run_after": [t.run_after for t in afters],
            "max_attempts": [t.max_attempts for t in afters],
            "result": [t.result for t in afters],
            "error_code": [t.error_code for t in afters],
            "error_message": [t.error_message for t in afters],
            "error_retryable": [t.error_retryable for t in afters],
            "result_digest": [t.result_digest for t in afters],
            "result_version": [t.result_version for t in afters],
            "updated_at": [t.updated_at for t in afters],
            "finished_at": [t.finished_at for t in afters],
            "version": [t.version for t in afters],
        }
    )


_ATTEMPT_AS_IS = (
    "id",
    "task_id",
    "number",
    "session_id",
    "session_epoch",
    "fence",
    "claimed_at",
    "claim_expires_at",
    "started_at",
    "lease_expires_at",
    "ended_at",
    "finish_digest",
    "receipt",
    "queue",
    "tenant",
    "handler",
)


def attempt_from_row(r: Row) -> Attempt:
    """An attempt from its row, built as ``task_from_row`` builds a task."""
    return _attempt_reader(tuple(r))(tuple(r.values()))


def attempts_columns(attempts: Sequence[Attempt]) -> RowColumns:
    """The new attempts' rows for ``attempt_insert_many``, every column of the table,
    held column by column as ``task_write_columns``: a claim of 200 inserts 200, and
    the PostgreSQL driver took a dict per attempt apart again into these lists."""
    return RowColumns(
        {
            "id": [a.id for a in attempts],
            "task_id": [a.task_id for a in attempts],
            "number": [a.number for a in attempts],
            "session_id": [a.session_id for a in attempts],
            "session_epoch": [a.session_epoch for a in attempts],
            "fence": [a.fence for a in attempts],
            "state": [str(a.state) for a in attempts],
            "claimed_at": [a.claimed_at for a in attempts],
            "claim_expires_at": [a.claim_expires_at for a in attempts],
            "started_at": [a.started_at for a in attempts],
            "lease_expires_at": [a.lease_expires_at for a in attempts],
            "ended_at": [a.ended_at for a in attempts],
            "finish_digest": [a.finish_digest for a in attempts],
            "receipt": [a.receipt for a in attempts],
            "queue": [a.queue for a in attempts],
            "tenant": [a.tenant for a in attempts],
            "handler": [a.handler for a in attempts],
        }
    )


def attempt_write_columns(pairs: Sequence[tuple[Attempt, Attempt]]) -> RowColumns:
    """``attempt_write_many``'s rows, column by column as ``task_write_columns``: the
    columns the write reads (both backends), each row guarded by the state and lease
    its plan was built from."""
    afters = [after for _, after in pairs]
    return RowColumns(
        {
            "id": [a.id for a in afters],
            "expect_state": [str(before.state) for before, _ in pairs],
            "expect_lease": [before.lease_expires_at for before, _ in pairs],
            "state": [str(a.state) for a in afters],
            "started_at": [a.started_at for a in afters],
            "lease_expires_at": [a.lease_expires_at for a in afters],
            "ended_at": [a.ended_at for a in afters],
            "finish_digest": [a.finish_digest for a in afters],
            "receipt": [a.receipt for a in afters],
        }
    )


def session_from_row(r: Row) -> Session:
    caps = tuple(
        Capability(c["handler"], int(c["capacity"])) for c in json.loads(r["capabilities"])
    )
    return Session(
        id=r["id"],
        name=r["name"],
        node_id=r["node_id"],
        epoch=int(r["epoch"]),
        secret_hash=r["secret_hash"],
        capabilities=caps,
        max_concurrency=int(r["max_concurrency"]),
        capacity_seq=int(r["capacity_seq"]),
        draining=bool(r["draining"]),
        state=SessionState(r["state"]),
        expires_at=int(r["expires_at"]),
        created_at=int(r["created_at"]),
    )


def session_to_row(s: Session) -> Row:
    return {
        "id": s.id,
        "name": s.name,
        "node_id": s.node_id,
        "epoch": s.epoch,
        "secret_hash": s.secret_hash,
        "capabilities": json.dumps(
            [{"handler": c.handler, "capacity": c.capacity} for c in s.capabilities]
        ),
        "max_concurrency": s.max_concurrency,
        "capacity_seq": s.capacity_seq,
        "draining": s.draining,
        "state": str(s.state),
        "expires_at": s.expires_at,
        "created_at": s.created_at,
    }


def session_write_row(before: Session, after: Session) -> Row:
    row = session_to_row(after)
    row["expect_epoch"] = before.epoch
    return row


def queue_from_row(r: Row) -> Queue:
    return Queue(
        name=r["name"],
        max_concurrency=int(r["max_concurrency"]),
        rate=float(r["rate"]),
        burst=int(r["burst"]),
        paused=bool(r["paused"]),
        tokens=float(r["tokens"]),
        tokens_at=int(r["tokens_at"]),
        created_at=int(r["created_at"]),
        max_queued=None if r["max_queued"] is None else int(r["max_queued"]),
    )


def event_columns(events: Sequence[Event], at: int) -> RowColumns:
    """The events' rows for ``event_insert_many``, stamped ``at``, column by column as
    ``task_write_columns`` (every state change writes an event). A state's name is
    spelled inline: a function call per state, four per event, was 0.6 % of a drain's
    server samples."""
    return RowColumns(
        {
            "at": [at] * len(events),
            "kind": [e.kind for e in events],
            "task_id": [e.task_id for e in events],
            "attempt_id": [e.attempt_id for e in events],
            "session_id": [e.session_id for e in events],
            "queue": [e.queue for e in events],
            "tenant": [e.tenant for e in events],
            "task_from": [str(s) if (s := e.task_from) else None for e in events],
            "task_to": [str(s) if (s := e.task_to) else None for e in events],
            "attempt_from": [str(a) if (a := e.attempt_from) else None for e in events],
            "attempt_to": [str(a) if (a := e.attempt_to) else None for e in events],
            "code": [e.code for e in events],
            "data": sorted_json_texts([e.data for e in events]),
        }
    )


def artifact_from_row(r: Row) -> Artifact:
    return Artifact(
        id=r["id"],
        task_id=r["task_id"],
        attempt_id=r["attempt_id"],
        name=r["name"],
        content_type=r["content_type"],
        size=int(r["size"]),
        sha256=r["sha256"],
        state=r["state"],
        created_at=int(r["created_at"]),
        expires_at=int(r["expires_at"]),
        ready_seq=None if r.get("ready_seq") is None else int(r["ready_seq"]),
    )


def token_from_row(r: Row) -> Token:
    revoked_at = r["revoked_at"]
    return Token(
        id=r["id"],
        name=r["name"],
        scopes=tuple(sorted(str(r["scopes"]).split(","))),
        created_at=int(r["created_at"]),
        revoked_at=None if revoked_at is None else int(revoked_at),
    )


def template_json(spec: TaskSpec, payload: str) -> str:
    """A schedule's template as its column holds it; ``payload`` is the canonical JSON
    ``check_schedule`` returned."""
    return json.dumps(
        {
            "queue": spec.queue,
            "handler": spec.handler,
            "payload": payload,
            "tenant": spec.tenant,
            "priority": spec.priority,
            "retry_safe": spec.retry_safe,
            "max_attempts": spec.max_attempts,
            "backoff": [spec.backoff.base_us, spec.backoff.factor, spec.backoff.max_us],
            "attempt_timeout_us": spec.attempt_timeout_us,
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def template_from_json(text: str) -> TaskSpec:
    t = json.loads(text)
    base_us, factor, max_us = t["backoff"]
    return TaskSpec(
        queue=t["queue"],
        handler=t["handler"],
        payload=json.loads(t["payload"]),
        tenant=t["tenant"],
        priority=t["priority"],
        retry_safe=t["retry_safe"],
        max_attempts=t["max_attempts"],
        backoff=Backoff(base_us, float(factor), max_us),
        attempt_timeout_us=t["attempt_timeout_us"],
    )


def schedule_from_row(r: Row) -> Schedule:
    return Schedule(
        name=r["name"],
        cron=r["cron"],
        timezone=r["timezone"],
        template=template_from_json(r["template"]),
        misfire=r["misfire"],
        max_catch_up=int(r["max_catch_up"]),
        paused=bool(r["paused"]),
        next_fire_at=int(r["next_fire_at"]),
        last_fire_at=None if r["last_fire_at"] is None else int(r["last_fire_at"]),
        created_at=int(r["created_at"]),
        updated_at=int(r["updated_at"]),
        version=int(r["version"]),
    )
