"""A token revoked closes its sessions' connections, and their claimed (not started)
attempts are released (``transitions.release_claims`` with ``TOKEN_REVOKED``): the task
back to ``queued``, or ``failed`` with ``DEADLINE_EXCEEDED`` past its deadline. Both
paths are rows of ``TRANSITIONS`` (and so of docs/state-machine.md), which once listed
neither."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orbit.core import transitions
from orbit.core.errors import Code
from orbit.core.states import TRANSITIONS, AttemptState, TaskState
from orbit.core.transitions import Plan
from tests.unit.test_rows import _attempt, _task


@pytest.mark.parametrize(
    ("deadline", "after", "code"),
    [(None, TaskState.QUEUED, "TOKEN_REVOKED"), (40, TaskState.FAILED, "DEADLINE_EXCEEDED")],
)
def test_a_revoke_release_is_a_row_of_the_table(
    deadline: int | None, after: TaskState, code: str
) -> None:
    task = replace(_task(), state=TaskState.CLAIMED, deadline=deadline)
    attempt = _attempt(state=AttemptState.CLAIMED, started_at=None, lease_expires_at=None)
    plan = Plan()
    transitions.release_claims(plan, [(task, attempt)], 50, Code.TOKEN_REVOKED)
    ((before, written),) = plan.task_writes
    assert (before.state, written.state) == (TaskState.CLAIMED, after)
    assert [e.code for e in plan.events] == [code]
    rows = [
        t for t in TRANSITIONS if t.operation == "token revoke" and TaskState.CLAIMED in t.task_from
    ]
    assert after in [t.task_to for t in rows]
    assert all(t.attempt == "claimed -> released" for t in rows)
