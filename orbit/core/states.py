"""Task and attempt states, and the transition table the docs are generated from."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class TaskState(StrEnum):
    SCHEDULED = "scheduled"
    QUEUED = "queued"
    CLAIMED = "claimed"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    NEEDS_REVIEW = "needs_review"


class AttemptState(StrEnum):
    CLAIMED = "claimed"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    LOST = "lost"
    UNKNOWN = "unknown"
    RELEASED = "released"


class SessionState(StrEnum):
    LIVE = "live"
    EXPIRED = "expired"


TERMINAL_TASK_STATES = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED})
#: States in which a task waits for a worker (and can be claimed once due).
WAITING_TASK_STATES = frozenset({TaskState.QUEUED, TaskState.SCHEDULED})
#: Attempt states that hold a permit: they count against every cap (I4).
LIVE_ATTEMPT_STATES = frozenset({AttemptState.CLAIMED, AttemptState.RUNNING})


@dataclass(frozen=True)
class Transition:
    """One row of the lifecycle table: who moves a task from where to where, and why."""

    operation: str
    task_from: tuple[TaskState, ...]
    task_to: TaskState
    attempt: str
    guard: str


_T = TaskState
_WAIT = (_T.QUEUED, _T.SCHEDULED)
TRANSITIONS: tuple[Transition, ...] = (
    Transition("submit", (), _T.QUEUED, "-", "queue exists; payload within bounds; key new"),
    Transition("submit", (), _T.SCHEDULED, "-", "as above, run_after in the future"),
    Transition("reap promote", (_T.SCHEDULED,), _T.QUEUED, "-", "run_after reached"),
    Transition(
        "claim",
        _WAIT,
        _T.CLAIMED,
        "new attempt claimed",
        "session live, not draining, current epoch; handler capable; queue not paused; "
        "run_after and deadline allow; global, queue, tenant, session caps and rate allow",
    ),
    Transition(
        "start",
        (_T.CLAIMED,),
        _T.RUNNING,
        "claimed -> running",
        "same session, current epoch and fence, session live; claim lease and deadline "
        "not passed; task not cancel-requested; queue not paused (attempts_used += 1)",
    ),
    Transition(
        "finish ok",
        (_T.RUNNING,),
        _T.SUCCEEDED,
        "running -> succeeded",
        "owned, current epoch and fence; lease and deadline not passed by the clock",
    ),
    Transition(
        "finish error",
        (_T.RUNNING,),
        _T.SCHEDULED,
        "running -> failed",
        "as above; retryable, attempts left, next run before the deadline",
    ),
    Transition(
        "finish error",
        (_T.RUNNING,),
        _T.FAILED,
        "running -> failed",
        "as above; not retryable, attempts exhausted, or next run past the deadline",
    ),
    Transition(
        "finish",
        (_T.CANCELLING,),
        _T.CANCELLED,
        "running -> cancelled",
        "owned; whatever the outcome, cancel wins (a result is kept as evidence only)",
    ),
    Transition("release", (_T.CLAIMED,), _T.QUEUED, "claimed -> released", "attempt claimed"),
    Transition(
        "release", (_T.CLAIMED,), _T.FAILED, "claimed -> released", "deadline already passed"
    ),
    Transition(
        "cancel",
        (_T.QUEUED, _T.SCHEDULED, _T.NEEDS_REVIEW),
        _T.CANCELLED,
        "-",
        "none (idempotent); descendants in the same transaction",
    ),
    Transition("cancel", (_T.CLAIMED,), _T.CANCELLED, "claimed -> released", "as above"),
    Transition(
        "cancel",
        (_T.RUNNING,),
        _T.CANCELLING,
        "-",
        "as above; pushed to the worker at once, and said by its next renew",
    ),
    Transition(
        "reap claim", (_T.CLAIMED,), _T.QUEUED, "claimed -> released", "claim lease expired"
    ),
    Transition(
        "reap claim",
        (_T.CLAIMED,),
        _T.FAILED,
        "claimed -> released",
        "claim lease expired, deadline passed (DEADLINE_EXCEEDED)",
    ),
    Transition(
        "session expiry",
        (_T.CLAIMED,),
        _T.QUEUED,
        "claimed -> released",
        "the session's heartbeat lapsed",
    ),
    Transition(
        "session expiry",
        (_T.CLAIMED,),
        _T.FAILED,
        "claimed -> released",
        "the session's heartbeat lapsed, deadline passed (DEADLINE_EXCEEDED)",
    ),
    Transition(
        "token revoke",
        (_T.CLAIMED,),
        _T.QUEUED,
        "claimed -> released",
        "its session's connection closed for a revoked token (TOKEN_REVOKED)",
    ),
    Transition(
        "token revoke",
        (_T.CLAIMED,),
        _T.FAILED,
        "claimed -> released",
        "as above, deadline passed (DEADLINE_EXCEEDED)",
    ),
    Transition(
        "reap lease",
        (_T.CANCELLING,),
        _T.CANCELLED,
        "running -> cancelled",
        "run lease expired while cancel was asked",
    ),
    Transition(
        "reap lease",
        (_T.RUNNING,),
        _T.SCHEDULED,
        "running -> lost | timed_out",
        "run lease expired, retry_safe, attempts left, next run before the deadline",
    ),
    Transition(
        "reap lease",
        (_T.RUNNING,),
        _T.FAILED,
        "running -> lost | timed_out",
        "run lease expired, retry_safe, attempts exhausted or deadline passed",
    ),
    Transition(
        "reap lease",
        (_T.RUNNING,),
        _T.NEEDS_REVIEW,
        "running -> unknown",
        "run lease expired, not retry_safe: effects may have happened",
    ),
    Transition(
        "reap lease",
        (_T.RUNNING,),
        _T.FAILED,
        "running -> unknown",
        "run lease expired, not retry_safe, deadline passed (DEADLINE_EXCEEDED)",
    ),
    Transition("reap deadline", _WAIT, _T.FAILED, "-", "deadline passed (DEADLINE_EXCEEDED)"),
    Transition(
        "reap deadline",
        (_T.CLAIMED,),
        _T.FAILED,
        "claimed -> released",
        "deadline passed (DEADLINE_EXCEEDED)",
    ),
    Transition(
        "resolve",
        (_T.NEEDS_REVIEW,),
        _T.SUCCEEDED,
        "-",
        "operator decision with a result",
    ),
    Transition("resolve", (_T.NEEDS_REVIEW,), _T.FAILED, "-", "operator decision"),
    Transition(
        "resolve",
        (_T.NEEDS_REVIEW,),
        _T.QUEUED,
        "-",
        "operator decision: run it again; no ancestor cancelled; deadline not passed",
    ),
    Transition(
        "retry",
        (_T.FAILED, _T.CANCELLED),
        _T.QUEUED,
        "-",
        "operator decision; no ancestor cancelled; deadline not passed; one more attempt allowed",
    ),
)
