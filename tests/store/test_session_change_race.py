"""A claim racing, on another node, a change of what it weighs: its session's drain,
capacity or epoch (a resume), a queue's, a tenant's or the global cap, or the set of
queues. A claim must honour a change that committed before it does: the state table checks
"session live, not draining" and every cap atomically.

Before the fix, on PostgreSQL the claim read these without a lock: a change that
committed while the claim was under way was acknowledged first, and the claim then
committed grants that the drain, the new cap or the new epoch forbade, or failed with a
KeyError on a ready task of a queue created meanwhile. On SQLite a transaction runs
alone, so the change waits for the whole claim; the same assertions hold."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from orbit.core.model import Capability, Session
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

CHANGES: dict[str, tuple[str, Callable[[Store, Session, str], Any]]] = {
    "operator drain": ("session.draining", lambda store, s, _: store.session_drain(s.id)),
    "worker drain": (
        "session.draining",
        lambda store, s, _: store.session_drain(s.id, s.epoch),
    ),
    "capacity lowered": (
        "session.capacity",
        lambda store, s, _: store.session_capacity_set(
            s.id, s.epoch, seq=1, capabilities=[Capability("h", 1)], max_concurrency=1
        ),
    ),
    "resume": (
        "session.resumed",
        lambda store, s, secret: store.session_resume(s.id, secret, node_id="n2"),
    ),
    # A queue the claim did not read when it began, with a ready task (it was a KeyError).
    "queue created": (
        "queue.created",
        lambda store, s, _: (queue(store, "q2"), submit(store, queue="q2")),
    ),
    "queue cap lowered": (
        "queue.updated",
        lambda store, s, _: store.queue_update("q", max_concurrency=1),
    ),
    "tenant cap lowered": (
        "tenant.updated",
        lambda store, s, _: store.tenant_limit_set("default", 1),
    ),
    "global cap lowered": ("global.updated", lambda store, s, _: store.global_limit_set(1)),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_claim_racing_a_change_of_its_session_is_ordered_before_it(
    make_store: Any,
    backend: str,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
    change: str,
) -> None:
    kind, make_change = CHANGES[change]
    node_a: Store = make_store(clock=clock)
    node_b = open_store(store_url(node_a), migrate=False, clock=clock)  # one clock, shared
    try:
        queue(node_a)
        for _ in range(3):
            submit(node_a)
        session, secret = worker(node_a)
        # the claim will have read its session: live, not draining
        read_session, commit = pause_after_the_clock(monkeypatch, node_b)
        out: dict[str, Any] = {}

        def claim() -> None:
            out["grants"] = node_b.attempt_claim_many(session.id, session.epoch, 10)

        def change_session() -> None:
            out["changed"] = make_change(node_a, session, secret)

        claiming = threading.Thread(target=claim)
        claiming.start()
        assert read_session.wait(RACE_WAIT)
        changing = threading.Thread(target=change_session)
        changing.start()
        waited = True
        if backend == "postgres":  # it commits (before the fix) or waits for the claim
            until_done_or_waiting_on_a_lock(changing, store_url(node_a))
            waited = changing.is_alive()
        commit.set()
        claiming.join(RACE_WAIT)
        changing.join(RACE_WAIT)
        assert not claiming.is_alive() and not changing.is_alive()
        monkeypatch.undo()

        assert len(out["grants"]) == 3 and "changed" in out
        events = node_a.event_list()
        claimed_at = [e["id"] for e in events if e["kind"] == "claimed"]
        assert len(claimed_at) == 3
        changed_at = max(e["id"] for e in events if e["kind"] == kind)  # the last: q2's
        # Every grant was committed before the change: none after a drain, past a
        # capacity already acknowledged or a cap already lowered, or for an epoch a resume
        # had fenced.
        assert max(claimed_at) < changed_at, (claimed_at, changed_at)
        # The three were granted under the caps in force before the change (the checker
        # knows only the caps the event log names).
        caps = {f"session:{session.id}": 10, "tenant:default": 10, "global": 10}
        assert check_all(node_a, caps=caps) == []
        assert waited, "the change committed while a claim was under way"
    finally:
        node_b.close()
