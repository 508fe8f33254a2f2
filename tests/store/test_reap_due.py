"""Store.reap_due_in: when the reaper's next pass has work, by the store's clock (the
server's reaper sleeps until then), on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from orbit.core.model import SECOND
from orbit.store import StoreConfig
from tests.conftest import ManualClock
from tests.store.helpers import claim_one, queue, submit, worker

CONFIG = StoreConfig(claim_ttl_us=10 * SECOND, lease_ttl_us=5 * SECOND, session_ttl_us=60 * SECOND)


def test_the_next_due_instant_follows_sessions_claims_leases_and_deadlines(
    make_store: object, clock: ManualClock
) -> None:
    store = make_store(clock=clock, config=CONFIG)  # type: ignore[operator]
    assert store.reap_due_in() is None  # nothing live, nothing due
    queue(store)
    session, _ = worker(store)
    assert store.reap_due_in() == pytest.approx(60)  # the session's expiry
    submit(store)
    grant = claim_one(store, session)
    assert store.reap_due_in() == pytest.approx(10)  # the claim's
    store.attempt_start(session.id, session.epoch, grant.attempt.id, grant.attempt.fence)
    assert store.reap_due_in() == pytest.approx(5)  # the run lease's
    clock.advance(7)
    assert store.reap_due_in() == pytest.approx(-2)  # overdue: the next pass has work
    assert store.reap().expired_leases == 1
    assert store.reap_due_in() == pytest.approx(53)  # only the session is left
    submit(store, deadline=clock.now + 3 * SECOND)
    assert store.reap_due_in() == pytest.approx(3)  # a queued task's deadline
