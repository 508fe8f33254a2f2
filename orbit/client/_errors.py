"""Typed exceptions carrying the server's machine-readable code."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """The server refused a call; ``code`` is what to branch on."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.field = field

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled by its own arguments: the default passes ``args`` (the one message)
        to ``__init__``, and an error raised in a process pool's child came back to the
        parent as a TypeError. Its ``__dict__`` goes along, as every exception's does:
        a note (``add_note``) or an attribute set on it after it was made."""
        return (type(self), (self.status, self.code, self.message, self.field), self.__dict__)


class BadRequest(ApiError):
    pass


class Unauthorized(ApiError):
    pass


class Forbidden(ApiError):
    pass


class NotFound(ApiError):
    pass


class Conflict(ApiError):
    pass


class TooLarge(ApiError):
    """413: a payload, a body or an artifact over its bound, or a batch submit that makes
    more new tasks in a queue or a tenant than its ``max_queued`` (``code``
    BATCH_EXCEEDS_CAP). Nothing was written, and the same call would be refused again:
    do not retry it as it is (split the batch)."""


class _RetryLater(ApiError):
    """A refusal that says when to try again: ``retry_after``, the seconds the server
    asks to wait (its ``Retry-After``), None if it named none. Pickled as every ApiError
    is, ``retry_after`` with the rest of its ``__dict__``."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(status, code, message, field)
        self.retry_after = retry_after


class TooManyRequests(_RetryLater):
    """Backpressure (429): the submit would take a queue's or a tenant's waiting tasks
    past its ``max_queued`` (``code`` QUEUE_FULL or TENANT_FULL), and nothing of it was
    written. ``retry_after``: the seconds the server asks to wait before trying again
    (its ``Retry-After``), None if it named none. A resubmit with the same idempotency
    keys is safe: a task already made comes back, and is never refused. A batch that can
    never fit under the cap is not this but ``TooLarge`` (BATCH_EXCEEDS_CAP): waiting
    would not help it."""


class Unavailable(_RetryLater):
    """503 from Orbit itself: the server cannot take the call now, for a reason that
    passes. Its database (``code`` DATABASE_BUSY: another process held its lock past the
    server's wait; DATABASE_FULL; DATABASE_READ_ONLY; DATABASE_UNAVAILABLE: it failed or
    cannot be reached; for the first three nothing was written), or, opening an event
    stream, a node at its cap of streams or shutting down (TOO_MANY_STREAMS,
    SHUTTING_DOWN). ``retry_after``: the seconds the server asks to wait before making
    the same call again (its ``Retry-After``: 5 for the database), None if it named none.
    ``wait``, ``result`` and the follows (``stream_events``, ``subscribe``) ask again
    through it, as through a 500 INTERNAL, until their timeout or outage. A proxy's own
    503 page (no Orbit error body) is not this but an ``ApiError`` HTTP_ERROR: the
    server out of reach. **Changed:** a 503 was a plain ``ApiError``, its
    ``Retry-After`` dropped."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
}
#: the refusals that carry the server's ``Retry-After``
_RETRY_LATER: dict[int, type[_RetryLater]] = {429: TooManyRequests, 503: Unavailable}


def retry_after_seconds(header: str | None) -> float | None:
    """A ``Retry-After`` header's delay in seconds: Orbit sends whole seconds; a date, or
    anything else that is not a non-negative number, is None."""
    if header is None or not header.strip().isascii() or not header.strip().isdigit():
        return None
    return float(header.strip())


def error_from(status: int, body: Any, retry_after: str | None = None) -> ApiError:
    """The error a refusal is raised as; ``retry_after``: the reply's Retry-After."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return ApiError(status, "HTTP_ERROR", f"unexpected reply with status {status}")
    code, message, field = str(err.get("code")), str(err.get("message")), err.get("field")
    later = _RETRY_LATER.get(status)
    if later is not None:
        return later(status, code, message, field, retry_after_seconds(retry_after))
    cls = _BY_STATUS.get(status, ApiError)
    return cls(status, code, message, field)


class TaskFailed(Exception):
    """``result()`` of a task that ended without a result (failed, cancelled, needs_review).

    ``code`` is why it ended: the task's error code, or ``TASK_CANCELLED`` for a cancelled
    task. A task cancelled while it waited for a retry (or from ``needs_review``) keeps
    its last attempt's error in its view (the history of what happened); that error is
    ``last_error`` here, never ``code``: the task did not end because of it."""

    def __init__(self, task: dict[str, Any]) -> None:
        error = task.get("error") or {}
        self.task = task
        self.state = task["state"]
        self.last_error: dict[str, Any] | None = error or None
        detail = " ".join(str(p) for p in (error.get("code"), error.get("message")) if p)
        if self.state == "cancelled":
            self.code: str | None = "TASK_CANCELLED"
            # A task cancelled before it ran has no error: it said "...: None".
            said = f" (its last attempt's error: {detail})" if detail else " (no error recorded)"
        else:
            self.code = error.get("code")
            said = f": {detail}" if detail else " (no error recorded)"
        super().__init__(f"task {task['id']} ended {task['state']}{said}")

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled by the task it was made from, with its ``__dict__`` (as ``ApiError``)."""
        return (type(self), (self.task,), self.__dict__)


class WaitTimeout(TimeoutError):
    """``wait()`` gave up before the task ended; the task itself goes on."""
