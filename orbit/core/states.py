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
TRANSITIONS: tuple[Transition, ...] = (
    Transition("submit", (), _T.QUEUED, "-", "queue exists; payload within bounds; key new"),
    Transition("submit", (), _T.SCHEDULED, "-", "as above, run_after in the future"),
    Transition(
        "claim",
        (_T.QUEUED, _T.SCHEDULED),
        _T.CLAIMED,
        "new attempt claimed",
        "session live and not draining; handler capable; queue not paused; caps and rate allow",
    ),
    Transition(
        "start",
        (_T.CLAIMED,),
        _T.RUNNING,
        "claimed -> running",
        "same session, current epoch and fence; claim lease and deadline not passed; "
        "queue not paused",
    ),
    Transition(
        "finish ok",
        (_T.RUNNING,),
        _T.SUCCEEDED,
        "running -> succeeded",
        "owned, current epoch and fence; lease not expired by the clock",
    ),
    Transition(
        "finish error",
        (_T.RUNNING,),
        _T.SCHEDULED,
        "running -> failed",
        "retryable, attempts left, next run before the deadline",
    ),
    Transition(
        "finish error",
        (_T.RUNNING,),
        _T.FAILED,
        "running -> failed",
        "not retryable, attempts exhausted, or next run past the deadline",
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
        "cancel",
        (_T.QUEUED, _T.SCHEDULED, _T.CLAIMED, _T.NEEDS_REVIEW),
        _T.CANCELLED,
        "claimed -> released",
        "none (idempotent); descendants in the same transaction",
    ),
    Transition("cancel", (_T.RUNNING,), _T.CANCELLING, "-", "delivered on the next renew"),
    Transition(
        "reap claim",
        (_T.CLAIMED,),
        _T.QUEUED,
        "claimed -> released",
        "claim lease expired",
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
        "run lease expired, retry_safe, attempts left",
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
        "reap deadline",
        (_T.QUEUED, _T.SCHEDULED, _T.CLAIMED),
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
    Transition("resolve", (_T.NEEDS_REVIEW,), _T.QUEUED, "-", "operator decision: run it again"),
)
