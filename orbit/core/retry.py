"""Backoff arithmetic and the retry decision, as pure functions."""

from __future__ import annotations

from dataclasses import dataclass

from orbit.core.model import Backoff


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
    """Either ``retry_at`` is set (schedule another attempt) or ``final_code`` says why not."""

    retry_at: int | None
    final_code: str | None


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
        return RetryPlan(None, "DEADLINE_EXCEEDED")
    return RetryPlan(at, None)
