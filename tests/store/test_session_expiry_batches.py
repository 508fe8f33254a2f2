"""Many sessions lapsing together (a deploy, a lost pool of hosts) are expired in batches.

The reaper's session expiry holds the claim lock, which every claim on every node waits
for. It handled up to ``reap_batch`` (500) lapsed sessions in one transaction, a few
statements each: on PostgreSQL, 3000 sessions lapsing together stalled every claim of
the cluster for seconds. Now each transaction expires at most ``SESSION_EXPIRY_BATCH``
sessions in a fixed few statements, and the claim lock is let go between batches; one
pass still expires every lapsed session, releases their claimed attempts and leaves
their running ones to their own leases, with the same events."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from orbit.core.errors import Code
from orbit.core.model import SECOND, Session, TaskSpec
from orbit.core.states import AttemptState, SessionState, TaskState
from orbit.store import Store, StoreConfig, open_store
from tests.conftest import ManualClock, store_url
from tests.invariants import all_events, check_all
from tests.store.helpers import claim_one, query_plan, queue, submit, worker

#: more lapsed sessions than two batches (``SESSION_EXPIRY_BATCH``) hold, fewer than one
#: pass's ``reap_batch``
SESSIONS = 120
#: claims outlive the sessions: their session's expiry is what releases them
CONFIG = StoreConfig(claim_ttl_us=600 * SECOND)


def _lapsing_sessions(store: Store) -> tuple[list[Session], list[str], list[str]]:
    """``SESSIONS`` sessions, each holding one claimed and one running attempt; and the
    ids of the claimed attempts and of the running ones."""
    queue(store, max_concurrency=2 * SESSIONS)
    store.task_submit_many([TaskSpec(queue="q", handler="h")] * (2 * SESSIONS))
    sessions, claimed, running = [], [], []
    for i in range(SESSIONS):
        session, _ = worker(store, name=f"w{i}")
        to_run, to_hold = store.attempt_claim_many(session.id, session.epoch, 2)
        store.attempt_start(session.id, session.epoch, to_run.attempt.id, to_run.attempt.fence)
        sessions.append(session)
        running.append(to_run.attempt.id)
        claimed.append(to_hold.attempt.id)
    return sessions, claimed, running


def test_one_pass_expires_a_mass_lapse_a_batch_at_a_time(
    make_store: Any, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first expiry to commit expires one batch, not every lapsed session: the claim
    lock is let go there, and a claim made then, on another node, is answered before the
    pass goes on with the rest. The pass ends with every lapsed session expired, as one
    lapsed session is."""
    store: Store = make_store(clock=clock, config=CONFIG)
    other = open_store(store_url(store), migrate=False, clock=clock)
    try:
        sessions, claimed, running = _lapsing_sessions(store)
        clock.advance(61)  # past every session's 60 s
        queue(other, "q2")  # of its own, so that the claim takes this one task
        live, _ = worker(other, {"h2": 1}, name="live")
        ready = submit(other, "q2", "h2")
        before = len(all_events(store))
        seen: list[tuple[int, str]] = []  # at the first expiry: how many, and the claim
        run_tx = store._tx

        def each_tx(*args: Any, **kwargs: Any) -> Any:
            out = run_tx(*args, **kwargs)
            expired = len(other.session_list(state="expired"))
            if expired and not seen:
                seen.append((expired, claim_one(other, live).attempt.task_id))
            return out

        monkeypatch.setattr(store, "_tx", each_tx)
        report = store.reap()
        monkeypatch.undo()

        [(first, granted)] = seen
        assert 0 < first < SESSIONS and granted == ready
        assert report.sessions_expired == SESSIONS and report.released == SESSIONS
        assert all(store.session_get(s.id).state == SessionState.EXPIRED for s in sessions)
        for attempt_id in claimed:  # released, its task queued again for another worker
            attempt = store.attempt_get(attempt_id)
            assert attempt.state == AttemptState.RELEASED
            assert store.task_get(attempt.task_id).state == TaskState.QUEUED
        # A run lease never outlives its session's expiry (renew caps it there): each ran
        # out with it and was judged as any lost lease (not retry-safe: needs_review).
        assert report.expired_leases == SESSIONS
        for attempt_id in running:
            attempt = store.attempt_get(attempt_id)
            assert attempt.state == AttemptState.UNKNOWN
            assert store.task_get(attempt.task_id).state == TaskState.NEEDS_REVIEW
        new = [e for e in all_events(store)[before:] if e["task_id"] != ready]
        assert sorted(e["session_id"] for e in new if e["kind"] == "session.expired") == sorted(
            s.id for s in sessions
        )
        by_change = Counter(
            (e["attempt_from"], e["attempt_to"], e["code"]) for e in new if e["attempt_id"]
        )
        assert by_change == {
            ("claimed", "released", Code.SESSION_EXPIRED): SESSIONS,
            ("running", "unknown", Code.LEASE_EXPIRED): SESSIONS,
        }
        released = sorted(e["attempt_id"] for e in new if e["attempt_from"] == "claimed")
        assert released == sorted(claimed)
        assert check_all(store) == []
        assert store.reap().sessions_expired == 0  # nothing was left for a later pass
    finally:
        other.close()


def test_the_batched_read_of_claimed_attempts_walks_the_live_ones(
    make_store: Any, clock: ManualClock
) -> None:
    """As every other read of the live attempts (test_live_attempt_reads)."""
    store: Store = make_store(clock=clock, config=CONFIG)
    sessions, _, _ = _lapsing_sessions(store)
    ids = [s.id for s in sessions]
    plan = query_plan(store, "attempt_claimed_for_sessions", {"session_ids": ids}, seqscan=False)
    assert "orbit_attempts_one_live" in plan, plan
