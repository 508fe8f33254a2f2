"""Rows to records: every field of the dataclass is filled, and with the right type."""

from __future__ import annotations

from dataclasses import fields

from orbit.core.model import Attempt, Backoff, Task
from orbit.core.states import AttemptState, TaskState
from orbit.store import rows as R


def test_every_task_and_attempt_field_is_filled_from_its_row() -> None:
    converted = {"retry_safe", "cancel_requested", "error_retryable", "state", "backoff"}
    assert set(R._TASK_AS_IS) | converted == {f.name for f in fields(Task)}
    assert set(R._ATTEMPT_AS_IS) | {"state"} == {f.name for f in fields(Attempt)}


def test_a_task_row_round_trips_with_sqlite_style_booleans() -> None:
    task = Task(
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
    row = R.task_to_row(task)
    assert R.task_from_row(row) == task
    sqlite_row = {**row, "retry_safe": 1, "cancel_requested": 0, "error_retryable": 0}
    back = R.task_from_row(sqlite_row)
    assert back == Task(**{**task.__dict__, "error_retryable": False})
    assert back.retry_safe is True and back.cancel_requested is False


def test_an_attempt_row_round_trips() -> None:
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
    assert R.attempt_from_row(R.attempt_to_row(attempt)) == attempt
