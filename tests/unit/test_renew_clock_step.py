"""``transitions.renew`` never shortens a lease, but for one that ends later than a fresh
lease could, which only a step back of the store's clock leaves (docs/reliability.md,
"Clock steps")."""

from __future__ import annotations

from dataclasses import replace

from orbit.core import transitions
from orbit.core.transitions import Plan
from tests.unit.test_rows import _attempt, _session, _task

NOW = 1_000
TTL = 50


def _renew(lease_expires_at: int, session_expires_at: int) -> tuple[int | None, Plan]:
    plan = Plan()
    lease = transitions.renew(
        plan,
        replace(_task(), deadline=None),
        _attempt(lease_expires_at=lease_expires_at),
        replace(_session(), expires_at=session_expires_at),
        epoch=1,
        now=NOW,
        lease_ttl=TTL,
    )
    assert lease.status == "ok"
    return lease.lease_expires_at, plan


def test_a_renew_keeps_a_later_end_a_fresh_lease_could_have_had() -> None:
    # the session's expiry caps the fresh lease at NOW + 20; the lease held ends later
    until, plan = _renew(lease_expires_at=NOW + 40, session_expires_at=NOW + 20)
    assert until == NOW + 40 and not plan.attempt_writes


def test_a_renew_gives_a_lease_granted_before_a_backward_step_a_ttl_from_now() -> None:
    until, plan = _renew(lease_expires_at=NOW + TTL + 3_600, session_expires_at=NOW + 5_000)
    assert until == NOW + TTL
    ((_, after),) = plan.attempt_writes
    assert after.lease_expires_at == NOW + TTL
