"""A claim's rounds and its rate buckets, on both backends.

A claim reads ready tasks in rounds (at most eight), each skipping the queues and tenants
the rounds before filled. With more capped scopes ahead in claim order than rounds, each
round granted one of them and capped it, and the claim stopped with ready tasks behind
them that no cap held back: it must say so (``Grants.more``), so that the dispatcher
claims again at once rather than wait for a freed permit or its poll.

A rate-limited queue's bucket is refilled at the claim's first clock read and was written
back stamped with the clock read after the rows were locked: the refill between the two
was lost at every claim, and the queue drained below its rate.
"""

from __future__ import annotations

from collections import Counter

import pytest

from orbit.core.model import TaskSpec
from orbit.store import Store
from tests.conftest import ManualClock
from tests.store.helpers import queue, submit, worker

#: more capped scopes than a claim has rounds, each with a backlog longer than a round reads
CAPPED = 10
BACKLOG = 300
#: the uncapped work behind them in claim order
BULK = 20


def _fill(store: Store, clock: ManualClock, scope: str) -> None:
    """``CAPPED`` queues (or tenants) capped at one live attempt, each with a backlog,
    then ``BULK`` tasks nothing caps, submitted last (so claimed last)."""
    if scope == "queue":
        for i in range(CAPPED):
            queue(store, f"c{i}", max_concurrency=1)
            store.task_submit_many([TaskSpec(queue=f"c{i}", handler="h")] * BACKLOG)
            clock.advance(1)
        queue(store, "bulk", max_concurrency=1000)
        store.task_submit_many([TaskSpec(queue="bulk", handler="h")] * BULK)
    else:
        queue(store, "q", max_concurrency=1000)
        for i in range(CAPPED):
            store.tenant_limit_set(f"c{i}", 1)
            store.task_submit_many([TaskSpec(queue="q", handler="h", tenant=f"c{i}")] * BACKLOG)
            clock.advance(1)
        store.task_submit_many([TaskSpec(queue="q", handler="h", tenant="bulk")] * BULK)


@pytest.mark.parametrize("scope", ["queue", "tenant"])
def test_a_claim_that_ran_out_of_rounds_asks_to_be_made_again(
    store: Store, clock: ManualClock, scope: str
) -> None:
    _fill(store, clock, scope)
    session, _ = worker(store, handlers={"h": 100}, max_concurrency=100)

    first = store.attempt_claim_many(session.id, session.epoch, 100)
    assert len(first) == 8  # one capped scope a round
    assert first.more, "ready tasks that no cap holds back were left: claim again now"

    second = store.attempt_claim_many(session.id, session.epoch, 100)
    taken = Counter(
        (g.task.queue if scope == "queue" else g.task.tenant) for g in [*first, *second]
    )
    assert taken == {**{f"c{i}": 1 for i in range(CAPPED)}, "bulk": BULK}
    assert not second.more  # the rest is capped: a freed permit is what matters now
    assert second.blocked


def test_a_claim_that_took_everything_it_could_does_not_ask_again(
    store: Store, clock: ManualClock
) -> None:
    _fill(store, clock, "queue")
    session, _ = worker(store, handlers={"h": 100}, max_concurrency=100)
    store.attempt_claim_many(session.id, session.epoch, 100)
    store.attempt_claim_many(session.id, session.epoch, 100)
    third = store.attempt_claim_many(session.id, session.epoch, 100)
    assert len(third) == 0 and not third.more


class TickingClock(ManualClock):
    """A clock each read of which moves on 200 ms: the gap between a claim's first clock
    read and the one after its rows are locked, made large and deterministic."""

    def __call__(self) -> int:
        now = self.now
        self.now += 200_000
        return now


def test_back_to_back_claims_get_the_whole_rate(make_store: object) -> None:
    clock = TickingClock()
    store: Store = make_store(clock=clock)  # type: ignore[operator]
    queue(store, max_concurrency=1000, rate=2, burst=3)  # room: no token spills over
    for _ in range(120):
        submit(store)
    session, _ = worker(store, max_concurrency=1000, handlers={"h": 1000})
    start = clock.now
    granted = sum(len(store.attempt_claim_many(session.id, session.epoch, 1)) for _ in range(100))
    elapsed_s = (clock.now - start) / 1e6
    # 2 tokens a second by the store's clock, less the last partial one, and no more
    # than that and the full bucket it began with
    assert 2 * elapsed_s - 1 <= granted <= 2 * elapsed_s + 3, (granted, elapsed_s)
