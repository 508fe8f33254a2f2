"""Concurrency caps and the per-queue token bucket, as pure functions (I4)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from orbit.core.model import SECOND, Queue


def bucket_refill(queue: Queue, now: int) -> float:
    """Tokens available at ``now``; an unlimited queue (rate 0) is never short. A bucket
    stamped later than ``now`` holds what it was stamped with (``bucket_stamped_ahead``)."""
    if queue.rate <= 0:
        return float("inf")
    elapsed = max(now - queue.tokens_at, 0)
    return min(float(queue.burst), queue.tokens + queue.rate * elapsed / SECOND)


def bucket_stamped_ahead(queue: Queue, now: int) -> bool:
    """Whether a rate-limited queue's bucket was written at an instant later than ``now``:
    the store's clock went back since. Such a bucket counts as holding, at ``now``, what
    it was written with, and a claim writes it back stamped ``now`` even if it takes no
    token, so that it refills from now on. Left stamped ahead, an empty bucket refilled
    nothing until the clock caught up with the stamp: the whole length of the step."""
    return queue.rate > 0 and queue.tokens_at > now


def queue_with_caps(
    queue: Queue,
    *,
    max_concurrency: int | None,
    rate: float | None,
    burst: int | None,
    now: int,
) -> Queue:
    """``queue`` with the caps given (None keeps one as it is), its bucket settled.

    A new rate or burst first settles the bucket: it holds what it held at ``now`` under
    the old rate (a full bucket if the queue was unlimited), at most the new burst, and
    refills at the new rate from ``now``. So a raised burst fills at the rate rather than
    at once, and a lowered one is never exceeded. The same values change nothing."""
    after = replace(
        queue,
        max_concurrency=queue.max_concurrency if max_concurrency is None else max_concurrency,
        rate=queue.rate if rate is None else float(rate) + 0.0,  # -0.0 is 0: unlimited
        burst=queue.burst if burst is None else burst,
    )
    if (after.rate, after.burst) != (queue.rate, queue.burst):
        held = bucket_refill(queue, now) if queue.rate > 0 else float(after.burst)
        after = replace(after, tokens=min(held, float(after.burst)), tokens_at=now)
    return after


def caps_raised(before: Queue, after: Queue) -> bool:
    """Whether ``after`` may let a claim through that ``before`` held back: more
    concurrency, a faster rate (0, unlimited, is the fastest), or a larger burst."""

    def speed(rate: float) -> float:
        return math.inf if rate <= 0 else rate

    return (
        after.max_concurrency > before.max_concurrency
        or speed(after.rate) > speed(before.rate)
        or (after.rate > 0 and after.burst > before.burst)
    )


#: the longest wait ``token_wait_us`` reports (a day): a rate so small that the next token
#: is further off than that is woken by the dispatcher's poll long before
MAX_TOKEN_WAIT_US = 24 * 3600 * SECOND


def token_wait_us(tokens: float, rate: float) -> int | None:
    """Microseconds until a bucket that holds ``tokens`` now holds a whole token again,
    refilling at ``rate`` per second: 0 if it holds one already, None for an unlimited
    queue (rate 0), at most ``MAX_TOKEN_WAIT_US``.

    Rounded up, and checked against ``bucket_refill``'s own arithmetic, so that a claim
    made that long after the one that left ``tokens`` finds the token there."""
    if tokens >= 1.0:
        return 0
    if rate <= 0:
        return None
    need = (1.0 - tokens) * SECOND / rate
    if not math.isfinite(need) or need >= MAX_TOKEN_WAIT_US:
        return MAX_TOKEN_WAIT_US
    wait = max(math.ceil(need), 1)
    while tokens + rate * wait / SECOND < 1.0:  # float rounding, at most a step or two
        wait += 1
    return wait


@dataclass
class Occupancy:
    """Live attempts (claimed or running) at one moment, by scope.

    A claim is granted only if every scope stays within its cap after it; the counts
    are read under the claim lock, so concurrent finishes can only lower them.
    """

    total: int
    by_queue: dict[str, int]
    by_tenant: dict[str, int]
    by_handler: dict[str, int]  # for the claiming session only
    session_total: int

    def admit(
        self,
        queue: str,
        tenant: str,
        handler: str,
        queue_cap: int,
        tenant_cap: int | None,
        handler_cap: int,
        session_cap: int,
        global_cap: int | None,
    ) -> bool:
        """Take one permit in every scope if all have room; report whether it did.

        Called for every row a claim reads, so the claim passes its arguments by position:
        eight keywords, matched by name on each call, cost about as much as the checks."""
        if global_cap is not None and self.total >= global_cap:
            return False
        if self.by_queue.get(queue, 0) >= queue_cap:
            return False
        if tenant_cap is not None and self.by_tenant.get(tenant, 0) >= tenant_cap:
            return False
        if self.by_handler.get(handler, 0) >= handler_cap:
            return False
        if self.session_total >= session_cap:
            return False
        self.total += 1
        self.by_queue[queue] = self.by_queue.get(queue, 0) + 1
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1
        self.by_handler[handler] = self.by_handler.get(handler, 0) + 1
        self.session_total += 1
        return True


def room_for_all(
    want: int,
    occ: Occupancy,
    *,
    queues: Mapping[str, Queue],
    tokens: Mapping[str, float],
    tenant_caps: Mapping[str, int],
    handler_caps: Mapping[str, int],
) -> bool:
    """Whether ``want`` more grants fit every cap a ready row could meet: each queue's
    concurrency and tokens, each capped tenant, each handler's capacity. Give only the
    scopes the claim still reads rows from (a queue or tenant already at its cap is left
    out of the select). The session's and the global cap are in ``want`` already.

    When it holds, every row the select returns is granted (but for a passed deadline),
    so a claim asks for exactly ``want`` rows instead of a margin it locks and throws
    away."""
    return (
        all(q.max_concurrency - occ.by_queue.get(name, 0) >= want for name, q in queues.items())
        and all(tokens[name] >= want for name in queues)
        and all(cap - occ.by_tenant.get(t, 0) >= want for t, cap in tenant_caps.items())
        and all(cap - occ.by_handler.get(h, 0) >= want for h, cap in handler_caps.items())
    )
