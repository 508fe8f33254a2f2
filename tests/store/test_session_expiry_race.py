"""A claim and the reaper's session expiry racing on two nodes: the claim read its
session live, just before its expiry; the reaper expires the session before the claim
commits. The claim's attempt must be released with the session's others, not left
claimed under an expired session until its claim lease runs out.

Before the fix, on PostgreSQL the reaper read the session's claimed attempts without the
claim's and committed first; the claim then committed an attempt nobody could start. On
SQLite a transaction runs alone, so the reaper waits for the whole claim; the same
assertions hold."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from orbit.core.states import AttemptState, SessionState, TaskState
from orbit.store import Store, open_store
from tests.conftest import ManualClock, store_url
from tests.invariants import check_all
from tests.store.helpers import (
    RACE_WAIT,
    pause_after_the_clock,
    queue,
    submit,
    until_done_or_waiting_on_a_lock,
    worker,
)


def test_a_claim_racing_its_sessions_expiry_is_released_with_it(
    make_store: Any, backend: str, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    node_a: Store = make_store(clock=clock)
    node_b = open_store(store_url(node_a), migrate=False, clock=clock)  # one clock, shared
    try:
        queue(node_a)
        task_id = submit(node_a)
        session, _ = worker(node_a)
        # the claim will have read the session, live at this instant
        read_live, commit = pause_after_the_clock(monkeypatch, node_b)
        out: dict[str, Any] = {}

        def claim() -> None:
            out["grants"] = node_b.attempt_claim_many(session.id, session.epoch, 10)

        def reap() -> None:
            out["reaped"] = node_a.reap()

        claiming = threading.Thread(target=claim)
        claiming.start()
        assert read_live.wait(RACE_WAIT)
        clock.advance(61)  # past the session's 60 s
        reaping = threading.Thread(target=reap)
        reaping.start()
        if backend == "postgres":  # it finishes (before the fix) or waits for the claim
            until_done_or_waiting_on_a_lock(reaping, store_url(node_a))
        commit.set()
        claiming.join(RACE_WAIT)
        reaping.join(RACE_WAIT)
        assert not claiming.is_alive() and not reaping.is_alive()
        monkeypatch.undo()

        (grant,) = out["grants"]
        assert grant.task.id == task_id
        assert out["reaped"].sessions_expired == 1
        assert node_a.session_get(session.id).state == SessionState.EXPIRED
        assert node_a.attempt_get(grant.attempt.id).state == AttemptState.RELEASED
        assert node_a.task_get(task_id).state == TaskState.QUEUED
        assert check_all(node_a) == []
    finally:
        node_b.close()
