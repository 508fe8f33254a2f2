"""Store records as wire views."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from orbit.core.model import (
    Artifact,
    Attempt,
    Grant,
    Lease,
    Queue,
    Receipt,
    Schedule,
    Session,
    Task,
    instant_text,
    parse_json,
)
from orbit.protocol.convert import instant_to_wire, json_or_none, us_to_seconds
from orbit.protocol.messages import (
    ArtifactView,
    AttemptOutcome,
    AttemptView,
    EventView,
    QueueView,
    ScheduleTemplateView,
    ScheduleView,
    WorkerView,
)


def _at(us: int) -> str:
    text = instant_to_wire(us)
    assert text is not None
    return text


def task_wire(t: Task) -> dict[str, Any]:
    """A task as the wire's TaskView, built as a plain dict: the submit, batch and read
    routes send thousands of these, and a pydantic model per task costs more than the
    store's work for it. A test holds it to what ``TaskView`` (the documented schema)
    validates and dumps."""
    return {
        "id": t.id,
        "queue": t.queue,
        "handler": t.handler,
        "tenant": t.tenant,
        "priority": t.priority,
        "payload": parse_json(t.payload),
        "state": str(t.state),
        "parent_id": t.parent_id,
        "idempotency_key": t.idempotency_key,
        "retry_safe": t.retry_safe,
        "attempts_used": t.attempts_used,
        "max_attempts": t.max_attempts,
        "backoff": {
            "base": t.backoff.base_us / 1_000_000,
            "factor": t.backoff.factor,
            "max": t.backoff.max_us / 1_000_000,
        },
        "attempt_timeout": us_to_seconds(t.attempt_timeout_us),
        "deadline": instant_to_wire(t.deadline),
        "run_after": _at(t.run_after),
        "result": json_or_none(t.result),
        "error": (
            {"code": t.error_code, "message": t.error_message, "retryable": t.error_retryable}
            if t.error_code
            else None
        ),
        "result_digest": t.result_digest,
        "result_version": str(t.result_version),
        "created_at": _at(t.created_at),
        "updated_at": _at(t.updated_at),
        "finished_at": instant_to_wire(t.finished_at),
    }


def queue_view(q: Queue) -> QueueView:
    return QueueView(
        name=q.name,
        max_concurrency=q.max_concurrency,
        rate=q.rate,
        burst=q.burst,
        paused=q.paused,
        created_at=_at(q.created_at),
        max_queued=q.max_queued,
    )


def attempt_view(a: Attempt, outcome: tuple[str, str | None] | None = None) -> AttemptView:
    """An attempt with its ``outcome``: the ``(kind, code)`` of the event that ended it
    (``Store.attempt_outcomes``), None while it is live."""
    return AttemptView(
        id=a.id,
        task_id=a.task_id,
        number=a.number,
        session_id=a.session_id,
        session_epoch=str(a.session_epoch),
        fence=str(a.fence),
        state=str(a.state),
        claimed_at=_at(a.claimed_at),
        claim_expires_at=_at(a.claim_expires_at),
        started_at=instant_to_wire(a.started_at),
        lease_expires_at=instant_to_wire(a.lease_expires_at),
        ended_at=instant_to_wire(a.ended_at),
        outcome=None if outcome is None else AttemptOutcome(kind=outcome[0], code=outcome[1]),
    )


def event_view(row: dict[str, Any]) -> EventView:
    return EventView(
        id=str(row["id"]),
        at=_at(int(row["at"])),
        kind=row["kind"],
        task_id=row["task_id"],
        attempt_id=row["attempt_id"],
        session_id=row["session_id"],
        queue=row["queue"],
        tenant=row["tenant"],
        task_from=row["task_from"],
        task_to=row["task_to"],
        attempt_from=row["attempt_from"],
        attempt_to=row["attempt_to"],
        code=row["code"],
        data=json_or_none(row["data"]),
    )


def worker_view(s: Session) -> WorkerView:
    return WorkerView(
        session_id=s.id,
        name=s.name,
        node_id=s.node_id,
        epoch=str(s.epoch),
        state=str(s.state),
        draining=s.draining,
        max_concurrency=s.max_concurrency,
        capabilities=[{"handler": c.handler, "capacity": c.capacity} for c in s.capabilities],
        expires_at=_at(s.expires_at),
    )


# The worker protocol's hot replies (a push of claimed tasks, the answers to start_many,
# finish_many and renew) are built as plain dicts, as ``task_wire`` is: a pydantic model
# per item cost a tenth of the server's time in a drain. tests/unit/test_wire_views.py
# holds each to what its model (the documented schema) validates and dumps.


def assignments_wire(grants: Sequence[Grant]) -> list[dict[str, Any]]:
    """Claimed attempts as the wire's ``Assignment``s, for orjson to write (``tasks_frame``
    in gateway.py): the payload goes into the frame as it is stored, an
    ``orjson.Fragment``, rather than parsed into objects only for orjson to write them
    again (half of a push's work). The stored text is JSON Orbit wrote itself
    (``canonical_json``: compact, UTF-8, no NaN), so the frame is the same JSON value,
    spelled as the payload was stored (a float past 1e16 as ``1e+16``, as the standard
    library writes it, where orjson writes ``1e16``; an integer past 64 bits, which
    orjson cannot write, as it is).

    A batch at a time, for what a claim's attempts share: they expire at one instant
    (the claim's clock plus the claim lease), spelled once rather than looked up in the
    formatter's cache per attempt; and one loop, not a call per attempt."""
    wires: list[dict[str, Any]] = []
    append = wires.append
    fragment = orjson.Fragment
    expires_us, expires = -1, ""
    for g in grants:
        task, attempt = g.task, g.attempt
        deadline, timeout = task.deadline, task.attempt_timeout_us
        if attempt.claim_expires_at != expires_us:
            expires_us = attempt.claim_expires_at
            expires = instant_text(expires_us)
        append(
            {
                "task_id": task.id,
                "attempt_id": attempt.id,
                "fence": f"{attempt.fence}",
                "handler": task.handler,
                "queue": task.queue,
                "tenant": task.tenant,
                "payload": fragment(task.payload),
                "attempt": attempt.number,
                "retry_safe": task.retry_safe,
                "deadline": None if deadline is None else instant_text(deadline),
                "deadline_left": (
                    None if deadline is None else (deadline - attempt.claimed_at) / 1e6
                ),
                "attempt_timeout": None if timeout is None else timeout / 1e6,
                "claim_expires_at": expires,
                "attempts_used": task.attempts_used,
                "max_attempts": task.max_attempts,
            }
        )
    return wires


def lease_wire(lease: Lease) -> dict[str, Any]:
    """A start's or a renew's answer as the wire's ``LeaseView``."""
    expires, left = lease.lease_expires_at, lease.lease_left_us
    return {
        "attempt_id": lease.attempt_id,
        "status": lease.status,
        "lease_expires_at": None if expires is None else instant_text(expires),
        "lease_left": None if left is None else left / 1e6,
    }


def receipt_wire(r: Receipt) -> dict[str, Any]:
    """A finish's receipt as the wire's ``ReceiptView``. The states stay the records'
    ``StrEnum`` members, which orjson writes as their text (a ``str()`` of each was a
    tenth of a ``finished_many``'s answer)."""
    return {
        "task_id": r.task_id,
        "attempt_id": r.attempt_id,
        "fence": str(r.fence),
        "task_state": r.task_state,
        "attempt_state": r.attempt_state,
        "result_digest": r.result_digest,
        "result_version": str(r.result_version),
    }


def artifact_view(a: Artifact) -> ArtifactView:
    return ArtifactView(
        id=a.id,
        task_id=a.task_id,
        attempt_id=a.attempt_id,
        name=a.name,
        content_type=a.content_type,
        size=a.size,
        sha256=a.sha256,
        created_at=_at(a.created_at),
        expires_at=_at(a.expires_at),
    )


def schedule_view(s: Schedule) -> ScheduleView:
    t = s.template
    backoff = {
        "base": t.backoff.base_us / 1_000_000,
        "factor": t.backoff.factor,
        "max": t.backoff.max_us / 1_000_000,
    }
    template = ScheduleTemplateView(
        queue=t.queue,
        handler=t.handler,
        payload=t.payload,
        tenant=t.tenant,
        priority=t.priority,
        retry_safe=t.retry_safe,
        max_attempts=t.max_attempts,
        backoff=backoff,
        attempt_timeout=us_to_seconds(t.attempt_timeout_us),
    )
    return ScheduleView(
        name=s.name,
        cron=s.cron,
        timezone=s.timezone,
        template=template,
        misfire=s.misfire,
        max_catch_up=s.max_catch_up,
        paused=s.paused,
        next_fire_at=_at(s.next_fire_at),
        last_fire_at=instant_to_wire(s.last_fire_at),
        created_at=_at(s.created_at),
        updated_at=_at(s.updated_at),
    )
