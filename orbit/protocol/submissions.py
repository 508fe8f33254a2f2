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

The document has already been parsed by ``decode_json``, under the strict JSON rules.
"""

from __future__ import annotations

from typing import Any

from orbit.core.model import DEFAULT_BACKOFF, TaskSpec, assemble
from orbit.core.validate import MAX_ATTEMPTS_LIMIT, MAX_KEY_LEN, MAX_PRIORITY, is_name
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


def _int(value: Any, least: int, most: int) -> bool:
    return type(value) is int and least <= value <= most


def _spec(task: Any, payload_depth: int) -> TaskSpec | None:
    """One task as the store's spec, or None."""
    if type(task) is not dict or not _REQUIRED <= task.keys() <= _USUAL:
        return None
    get = task.get
    queue, handler, tenant = task["queue"], task["handler"], get("tenant", "default")
    priority, max_attempts = get("priority", 0), get("max_attempts", 3)
    key, parent, retry_safe = get("idempotency_key"), get("parent_id"), get("retry_safe", False)
    payload = get("payload")
    if not (
        is_name(queue)
        and is_name(handler)
        and is_name(tenant)
        and _int(priority, -MAX_PRIORITY, MAX_PRIORITY)
        and _int(max_attempts, 1, MAX_ATTEMPTS_LIMIT)
        and type(retry_safe) is bool
        and _optional_text(key, MAX_KEY_LEN)
        and _optional_text(parent, _ID_MAX)
        and values_ok(payload, payload_depth)
    ):
        return None
    # assemble, not TaskSpec(...) or build(): every field given as a constant-keyed dict
    # (a test holds these specs to spec_from's, which TaskSpec's own __init__ checks)
    return assemble(
        TaskSpec,
        {
            "queue": queue,
            "handler": handler,
            "payload": payload,
            "tenant": tenant,
            "priority": priority,
            "idempotency_key": key,
            "parent_id": parent,
            "retry_safe": retry_safe,
            "max_attempts": max_attempts,
            "backoff": DEFAULT_BACKOFF,
            "attempt_timeout_us": None,
            "deadline": None,
            "run_after": None,
        },
    )


def read_task_batch(raw: Any) -> list[TaskSpec] | None:
    """The batch's tasks as specs if every one is in the usual shape, else None (see the
    module's docstring)."""
    if type(raw) is not dict or raw.keys() != {"tasks"}:
        return None
    tasks = raw["tasks"]
    if type(tasks) is not list or not 0 < len(tasks) <= _BATCH_MAX:
        return None
    specs: list[TaskSpec] = []
    for task in tasks:
        spec = _spec(task, _BATCH_PAYLOAD_DEPTH)
        if spec is None:
            return None
        specs.append(spec)
    return specs


def read_task(raw: Any) -> TaskSpec | None:
    """A single submission (``POST /v1/tasks``) as a spec if it is in the usual shape,
    else None."""
    return _spec(raw, _TASK_PAYLOAD_DEPTH)
