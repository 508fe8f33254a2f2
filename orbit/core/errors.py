"""Typed errors with machine-readable codes.

Every rejection Orbit makes carries a stable ``code`` (what a client branches on), an
HTTP-like ``status`` (how the server will answer), and a human message that never
contains a secret.
"""

from __future__ import annotations

from enum import StrEnum


class Code(StrEnum):
    """Machine-readable rejection codes."""

    # bad input (400) and not found (404)
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    INVALID_BACKOFF = "INVALID_BACKOFF"
    INVALID_TIMEOUT = "INVALID_TIMEOUT"
    INVALID_DEADLINE = "INVALID_DEADLINE"
    MISSING_CAP = "MISSING_CAP"
    INVALID_CRON = "INVALID_CRON"
    INVALID_TIMEZONE = "INVALID_TIMEZONE"
    SCHEDULE_NOT_FOUND = "SCHEDULE_NOT_FOUND"
    QUEUE_NOT_FOUND = "QUEUE_NOT_FOUND"
    TASK_NOT_FOUND = "TASK_NOT_FOUND"
    PARENT_NOT_FOUND = "PARENT_NOT_FOUND"
    ATTEMPT_NOT_FOUND = "ATTEMPT_NOT_FOUND"
    SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
    ARTIFACT_NOT_FOUND = "ARTIFACT_NOT_FOUND"
    TOKEN_NOT_FOUND = "TOKEN_NOT_FOUND"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    ARTIFACT_TOO_LARGE = "ARTIFACT_TOO_LARGE"
    DIGEST_MISMATCH = "DIGEST_MISMATCH"
    # conflicts (409)
    QUEUE_EXISTS = "QUEUE_EXISTS"
    SCHEDULE_EXISTS = "SCHEDULE_EXISTS"
    ARTIFACT_EXISTS = "ARTIFACT_EXISTS"
    IDEMPOTENCY_CONFLICT = "IDEMPOTENCY_CONFLICT"
    PARENT_CANCELLED = "PARENT_CANCELLED"
    INVALID_STATE = "INVALID_STATE"
    #: a batch making more new tasks in a queue or a tenant than its max_queued (413): it
    #: can never fit, so it is no backpressure, which a client waits out and retries
    BATCH_EXCEEDS_CAP = "BATCH_EXCEEDS_CAP"
    # backpressure (429): a queue's or a tenant's max_queued would be passed
    QUEUE_FULL = "QUEUE_FULL"
    TENANT_FULL = "TENANT_FULL"
    # session problems
    SESSION_EXPIRED = "SESSION_EXPIRED"
    SESSION_DRAINING = "SESSION_DRAINING"
    BAD_SECRET = "BAD_SECRET"
    STALE_CAPACITY = "STALE_CAPACITY"
    # rejected worker reports (409): each leaves an event as evidence (I3, I9)
    NOT_OWNER = "NOT_OWNER"
    FENCED_EPOCH = "FENCED_EPOCH"
    STALE_FENCE = "STALE_FENCE"
    CLAIM_EXPIRED = "CLAIM_EXPIRED"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    ATTEMPT_ENDED = "ATTEMPT_ENDED"
    ALREADY_FINISHED = "ALREADY_FINISHED"
    FINISH_WITHOUT_START = "FINISH_WITHOUT_START"
    #: progress or an artifact upload for an attempt still claimed: it is live, not over
    NOT_STARTED = "NOT_STARTED"
    NOT_CLAIMED = "NOT_CLAIMED"
    TASK_CANCELLED = "TASK_CANCELLED"
    QUEUE_PAUSED = "QUEUE_PAUSED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    # outcomes written by Orbit itself
    ATTEMPT_TIMEOUT = "ATTEMPT_TIMEOUT"
    ATTEMPT_LOST = "ATTEMPT_LOST"
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"  # the run lease expired: effects may have happened
    HANDLER_ERROR = "HANDLER_ERROR"  # a failure reported without a code of its own
    RESOLVED_FAILED = "RESOLVED_FAILED"  # an operator marked a needs_review task failed
    #: a claimed attempt released when its connection was closed for a revoked token
    TOKEN_REVOKED = "TOKEN_REVOKED"


_STATUS: dict[Code, int] = {
    Code.QUEUE_NOT_FOUND: 404,
    Code.TASK_NOT_FOUND: 404,
    Code.PARENT_NOT_FOUND: 404,
    Code.ATTEMPT_NOT_FOUND: 404,
    Code.SESSION_NOT_FOUND: 404,
    Code.ARTIFACT_NOT_FOUND: 404,
    Code.TOKEN_NOT_FOUND: 404,
    Code.SCHEDULE_NOT_FOUND: 404,
    Code.ARTIFACT_TOO_LARGE: 413,
    Code.PAYLOAD_TOO_LARGE: 413,
    Code.BATCH_EXCEEDS_CAP: 413,
    Code.BAD_SECRET: 401,
    Code.QUEUE_FULL: 429,
    Code.TENANT_FULL: 429,
}
_BAD_INPUT = {
    Code.INVALID_ARGUMENT,
    Code.INVALID_BACKOFF,
    Code.INVALID_TIMEOUT,
    Code.INVALID_DEADLINE,
    Code.MISSING_CAP,
    Code.INVALID_CRON,
    Code.INVALID_TIMEZONE,
    Code.DIGEST_MISMATCH,
}


def status_of(code: Code) -> int:
    """The HTTP status a code is answered with."""
    if code in _BAD_INPUT:
        return 400
    return _STATUS.get(code, 409)


class OrbitError(Exception):
    """A rejection with a stable code; nothing was changed when it is raised."""

    def __init__(self, code: Code, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        #: the request field at fault, where one is (the HTTP error's ``field``)
        self.field = field

    @property
    def status(self) -> int:
        return status_of(self.code)


class Backpressure(OrbitError):
    """A submit refused whole because it would take a queue's or a tenant's waiting
    tasks past its ``max_queued`` (QUEUE_FULL, TENANT_FULL; 429). Nothing was written.
    ``retry_after``: whole seconds the submitter should wait before trying again (the
    server's ``Retry-After``), ``scope`` the queue's or tenant's name."""

    def __init__(self, code: Code, message: str, *, scope: str, retry_after: int) -> None:
        super().__init__(code, message)
        self.scope = scope
        self.retry_after = retry_after


#: The server's answers (503, ``Retry-After``) for a call its database could not take:
#: busy (another process held its lock past the server's wait), full, read-only, failed
#: or out of reach. The store raises them (``orbit.store.driver``); a worker and a client
#: take them as the server's failure, to try again, not as a refusal.
DATABASE_BUSY = "DATABASE_BUSY"
DATABASE_FULL = "DATABASE_FULL"
DATABASE_READ_ONLY = "DATABASE_READ_ONLY"
DATABASE_UNAVAILABLE = "DATABASE_UNAVAILABLE"
DATABASE_CODES = frozenset({DATABASE_BUSY, DATABASE_FULL, DATABASE_READ_ONLY, DATABASE_UNAVAILABLE})


class Rejected(OrbitError):
    """A worker request refused by a guard. A refused report (start, renew, finish,
    release, capacity) is recorded as an event (I3, I9); a refused claim or heartbeat,
    which could not have changed anything, is only answered."""
