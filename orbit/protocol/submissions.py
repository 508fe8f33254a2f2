"""Submissions (``POST /v1/tasks/batch``, ``POST /v1/tasks``) as the store takes them.

A batch holds up to a thousand tasks, and each went through the rule walks, the pydantic
model and then ``spec_from`` before the store saw it: 7-9 µs a task of the server's
38-43 (a batch of 1,000 through the server, timed piece by piece in one process). A task
that sets only the usual fields (queue, handler, payload, tenant, priority, an
idempotency key, a parent, retry safety, max attempts), each of its type and within its
limits, is read here in one pass. A batch with anything else in any task (backoff,
timeouts, instants, a field unknown or misspelt, a wrong type, a value out of range, a
NUL) makes the reader return None, and the strict path decodes it and names the rule it
broke. So the reader only accepts what the strict path accepts, and both give the store
the same specs: ``tests/unit/test_submission_batches.py`` holds them to each other.

A batch is read in two passes (``UsualBatch``): the first, before the transaction,
checks each task's field names and the fields the transaction needs first (the tasks'
queues, tenants, keys and parents, each distinct value once); the second reads the rest
a chunk at a time inside it, while the database writes the chunk before
(``orbit.core.batches``).

The document has already been parsed by ``decode_json``, under the strict JSON rules.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from orbit.core.batches import LazyBatch, UnusualTask
from orbit.core.model import DEFAULT_BACKOFF, TaskSpec, assemble
from orbit.core.validate import (
    MAX_ATTEMPTS_LIMIT,
    MAX_KEY_LEN,
    MAX_PRIORITY,
    is_fire_key,
    is_name,
)
from orbit.protocol.decode import short_text, values_ok

#: the fields read here; a task with any other goes the strict way
_USUAL = frozenset(
    {
        "queue",
        "handler",
        "payload",
        "tenant",
        "priority",
        "idempotency_key",
        "parent_id",
        "retry_safe",
        "max_attempts",
    }
)
_REQUIRED = frozenset({"queue", "handler"})

#: the limits TaskBatch and TaskSubmit set (messages.py) beyond the store's own (validate.py)
_BATCH_MAX = 1000
_ID_MAX = 64

#: how deep a payload sits in a batch's body (body, tasks, task) and in a single task's
#: (the task), for ``values_ok``: the nesting limit counts from the body itself
_BATCH_PAYLOAD_DEPTH = 3
_TASK_PAYLOAD_DEPTH = 1


def _optional_text(value: Any, most: int) -> bool:
    """None, or ``short_text``."""
    return value is None or short_text(value, most)


def _usual_key(value: Any) -> bool:
    """An idempotency key ``check_spec`` takes: 1-``MAX_KEY_LEN`` characters, and not
    one of the schedules' own (``is_fire_key``)."""
    return short_text(value, MAX_KEY_LEN) and not is_fire_key(value)


def _optional_key(value: Any) -> bool:
    """None, or ``_usual_key``."""
    return value is None or _usual_key(value)


def _int(value: Any, least: int, most: int) -> bool:
    return type(value) is int and least <= value <= most


#: a batch's task's queue (a KeyError if it has none)
_queue_of = itemgetter("queue")


def _named_ok(task: dict[str, Any]) -> bool:
    """A task's field names: the required ones, and only the usual ones."""
    return _REQUIRED <= task.keys() <= _USUAL


def _shape_ok(task: Any) -> bool:
    """A single task's first pass (a batch's is ``UsualBatch.of``): its field names, and
    the fields a batch's transaction needs before its first chunk (queue, tenant,
    idempotency key, parent)."""
    if type(task) is not dict or not _named_ok(task):
        return False
    get = task.get
    return (
        is_name(task["queue"])
        and is_name(get("tenant", "default"))
        and _optional_key(get("idempotency_key"))
        and _optional_text(get("parent_id"), _ID_MAX)
    )


def _shaped_spec(task: dict[str, Any], payload_depth: int) -> TaskSpec | None:
    """A task that passed ``_shape_ok`` as the store's spec, or None: its other fields."""
    get = task.get
    handler, payload = task["handler"], get("payload")
    priority, max_attempts = get("priority", 0), get("max_attempts", 3)
    retry_safe = get("retry_safe", False)
    if not (
        is_name(handler)
        and _int(priority, -MAX_PRIORITY, MAX_PRIORITY)
        and _int(max_attempts, 1, MAX_ATTEMPTS_LIMIT)
        and type(retry_safe) is bool
        and values_ok(payload, payload_depth)
    ):
        return None
    # assemble, not TaskSpec(...) or build(): every field given as a constant-keyed dict
    # (a test holds these specs to spec_from's, which TaskSpec's own __init__ checks)
    return assemble(
        TaskSpec,
        {
            "queue": task["queue"],
            "handler": handler,
            "payload": payload,
            "tenant": get("tenant", "default"),
            "priority": priority,
            "idempotency_key": get("idempotency_key"),
            "parent_id": get("parent_id"),
            "retry_safe": retry_safe,
            "max_attempts": max_attempts,
            "backoff": DEFAULT_BACKOFF,
            "attempt_timeout_us": None,
            "deadline": None,
            "run_after": None,
        },
    )


def _spec(task: Any, payload_depth: int) -> TaskSpec | None:
    """One task as the store's spec, or None."""
    return _shaped_spec(task, payload_depth) if _shape_ok(task) else None


class UsualBatch(LazyBatch):
    """A batch whose tasks are all in the usual shape as far as a first pass sees: the
    envelope, each task a dict of usual fields, and the fields the transaction needs
    before its first chunk (queue, tenant, idempotency key, parent). The other fields and
    the payload are read a chunk at a time (``read``), while the database inserts the
    chunk before (``orbit.core.batches``)."""

    def __init__(
        self,
        tasks: list[dict[str, Any]],
        queues: frozenset[str],
        tenants: frozenset[str],
        parents: frozenset[str],
        keys: frozenset[tuple[str, str, str]],
    ) -> None:
        """Made by ``of``, which has checked the first pass's fields of every task."""
        self._tasks = tasks
        self.queues, self.tenants, self.parents, self.keys = queues, tenants, parents, keys

    @classmethod
    def of(cls, raw: Any) -> UsualBatch | None:
        """The batch if its first pass finds the usual shape, else None (see the class).

        The pass is made of comprehensions over the tasks, and the queues, tenants, keys
        and parents are checked once each (a batch names one queue and one tenant, as a
        rule): it runs on the event loop before the transaction, while the database
        waits, and a check of each task's fields in turn took 0.69 ms per 1,000 tasks
        against 0.2 this way. A task without a handler is found with its other fields, a
        chunk at a time (``read``)."""
        if type(raw) is not dict or raw.keys() != {"tasks"}:
            return None
        tasks = raw["tasks"]
        if type(tasks) is not list or not 0 < len(tasks) <= _BATCH_MAX:
            return None
        # each a dict of usual fields only: a field of another kind (a backoff, an
        # instant) takes the strict path at once, not after part of the transaction
        if set(map(type, tasks)) != {dict} or not all(map(_USUAL.issuperset, tasks)):
            return None
        try:  # KeyError: a task without a queue; TypeError: a value that is no str
            queues = set(map(_queue_of, tasks))
            tenants = {t.get("tenant", "default") for t in tasks}
            keys = {
                (t.get("tenant", "default"), t["queue"], key)
                for t in tasks
                if (key := t.get("idempotency_key")) is not None
            }
            parents = {p for t in tasks if (p := t.get("parent_id")) is not None}
        except (KeyError, TypeError):
            return None
        if not (
            all(map(is_name, queues))
            and all(map(is_name, tenants))
            and all(_usual_key(key) for _, _, key in keys)
            and all(short_text(p, _ID_MAX) for p in parents)
        ):
            return None
        return cls(
            tasks, frozenset(queues), frozenset(tenants), frozenset(parents), frozenset(keys)
        )

    def __len__(self) -> int:
        return len(self._tasks)

    def first_naming(self, field: str, value: str) -> int | None:
        """``LazyBatch.first_naming`` from the tasks as sent (``of`` has checked the
        queues and parents it is asked about): no chunk is read for it."""
        for index, task in enumerate(self._tasks):
            if task.get(field) == value:
                return index
        return None

    def read(self, start: int, end: int) -> list[TaskSpec]:
        specs: list[TaskSpec] = []
        tasks = self._tasks
        for index in range(start, min(end, len(tasks))):
            task = tasks[index]
            # the first pass (``of``) did not look for the handler
            spec = _shaped_spec(task, _BATCH_PAYLOAD_DEPTH) if _named_ok(task) else None
            if spec is None:
                raise UnusualTask(index)
            specs.append(spec)
        return specs


def read_task(raw: Any) -> TaskSpec | None:
    """A single submission (``POST /v1/tasks``) as a spec if it is in the usual shape,
    else None."""
    return _spec(raw, _TASK_PAYLOAD_DEPTH)
