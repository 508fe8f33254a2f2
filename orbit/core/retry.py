"""Backoff arithmetic and the retry decision, as pure functions."""

from __future__ import annotations

from dataclasses import dataclass

from orbit.core.model import Backoff, instant_text
from orbit.core.validate import MAX_ERROR_MESSAGE


def backoff_delay(backoff: Backoff, attempts_used: int, rand: float) -> int:
    """Delay before the next attempt after ``attempts_used`` started attempts.

    Exponential growth ``base * factor**(n-1)`` capped at ``max``, with equal jitter: the
    delay is uniform in ``[d/2, d]``. ``rand`` is a number in ``[0, 1)`` the caller drew,
    so the result is deterministic for a given draw.
    """
    if not 0.0 <= rand < 1.0:
        raise ValueError("rand must be in [0, 1)")
    exponent = max(attempts_used - 1, 0)
    delay = float(backoff.base_us)
    for _ in range(exponent):
        delay *= backoff.factor
        if delay >= backoff.max_us:
            break
    capped = min(int(delay), backoff.max_us)
    half = capped // 2
    return half + int((capped - half) * rand)


@dataclass(frozen=True)
class RetryPlan:
    """Either ``retry_at`` is set (schedule another attempt) or ``final_code`` says why not.
    ``past_deadline``: when the next attempt was refused for falling past the deadline,
    that attempt's instant and the deadline, so the task's message can say why it failed
    ``DEADLINE_EXCEEDED`` before its deadline."""

    retry_at: int | None
    final_code: str | None
    past_deadline: tuple[int, int] | None = None


def plan_retry(
    *,
    retryable: bool,
    attempts_used: int,
    max_attempts: int,
    deadline: int | None,
    backoff: Backoff,
    now: int,
    rand: float,
    error_code: str,
) -> RetryPlan:
    """Decide what follows a failed attempt."""
    if not retryable or attempts_used >= max_attempts:
        return RetryPlan(None, error_code)
    at = now + backoff_delay(backoff, attempts_used, rand)
    if deadline is not None and at >= deadline:
        return RetryPlan(None, "DEADLINE_EXCEEDED", (at, deadline))
    return RetryPlan(at, None)


def past_deadline_message(past_deadline: tuple[int, int], code: str, message: str | None) -> str:
    """The message of a task failed ``DEADLINE_EXCEEDED`` because its next attempt would
    fall past the deadline (``RetryPlan.past_deadline``), which may be well before the
    deadline: it says so, then what the last attempt reported, within the bound a
    message has."""
    at, deadline = past_deadline
    last = f"{code}: {message}" if message else code
    text = (
        f"the next attempt (at {instant_text(at)}) would fall past the deadline "
        f"({instant_text(deadline)}); last attempt: {last}"
    )
    return text[:MAX_ERROR_MESSAGE]
