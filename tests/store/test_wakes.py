"""What a commit tells the dispatchers, on SQLite and PostgreSQL.

A task that becomes ready wakes every dispatcher (``on_ready``; NOTIFY ``ready``). An
attempt that ends frees a permit (``on_freed``; NOTIFY ``freed``), which is worth a new
claim only to a dispatcher whose last claim was held back: ``Grants.blocked`` says which.
"""

from __future__ import annotations

import psycopg
import pytest

from orbit.core.model import Outcome
from orbit.store import InjectedFault, Store, open_store
from tests.pg import as_url, temporary_database
from tests.store.helpers import queue, submit, worker


def _finish(store: Store, session_id: str, epoch: int, attempt_id: str, fence: int) -> None:
    store.attempt_start(session_id, epoch, attempt_id, fence)
    store.attempt_finish(session_id, epoch, attempt_id, fence, Outcome.success(None))


def test_a_claim_that_empties_the_ready_set_is_not_blocked(store: Store) -> None:
    queue(store)
    session, _ = worker(store)
    submit(store)
    grants = store.attempt_claim_many(session.id, session.epoch, 10)
    assert len(grants) == 1 and not grants.blocked
    assert not store.attempt_claim_many(session.id, session.epoch, 10).blocked


def test_a_queue_cap_blocks_a_claim(store: Store) -> None:
    queue(store, max_concurrency=1)
    session, _ = worker(store)
    submit(store)
    submit(store)
    grants = store.attempt_claim_many(session.id, session.epoch, 10)
    assert len(grants) == 1 and grants.blocked


def test_the_workers_own_capacity_blocks_a_claim(store: Store) -> None:
    queue(store)
    session, _ = worker(store, max_concurrency=1)
    submit(store)
    submit(store)
    assert store.attempt_claim_many(session.id, session.epoch, 10).blocked
    assert store.attempt_claim_many(session.id, session.epoch, 10).blocked  # full: asks none


def test_a_handler_capacity_blocks_a_claim(store: Store) -> None:
    queue(store)
    session, _ = worker(store, handlers={"h": 1, "g": 5})
    submit(store, handler="h")
    submit(store, handler="h")
    grants = store.attempt_claim_many(session.id, session.epoch, 10)
    assert len(grants) == 1
    assert store.attempt_claim_many(session.id, session.epoch, 10).blocked


def test_a_tenant_cap_blocks_a_claim(store: Store) -> None:
    queue(store)
    store.tenant_limit_set("t1", 1)
    session, _ = worker(store)
    submit(store, tenant="t1")
    submit(store, tenant="t1")
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 1
    assert store.attempt_claim_many(session.id, session.epoch, 10).blocked


def test_asking_for_fewer_than_are_ready_blocks_a_claim(store: Store) -> None:
    queue(store)
    session, _ = worker(store)
    submit(store)
    submit(store)
    grants = store.attempt_claim_many(session.id, session.epoch, 1)
    assert len(grants) == 1 and grants.blocked


def test_a_rate_limit_blocks_a_claim(store: Store) -> None:
    queue(store, rate=0.001, burst=1)
    session, _ = worker(store)
    submit(store)
    submit(store)
    assert len(store.attempt_claim_many(session.id, session.epoch, 10)) == 1
    assert store.attempt_claim_many(session.id, session.epoch, 10).blocked


def test_submits_call_on_ready_and_finishes_call_on_freed(store: Store) -> None:
    calls: list[tuple[str, set[str]]] = []
    store.on_ready = lambda queues: calls.append(("ready", set(queues)))
    store.on_freed = lambda queues: calls.append(("freed", set(queues)))
    queue(store)
    session, _ = worker(store)
    submit(store)
    assert calls == [("ready", {"q"})]
    g = store.attempt_claim_many(session.id, session.epoch, 1)[0]
    store.attempt_start(session.id, session.epoch, g.attempt.id, g.attempt.fence)
    assert calls == [("ready", {"q"})]  # a claim and a start free nothing and ready nothing
    store.attempt_finish(
        session.id, session.epoch, g.attempt.id, g.attempt.fence, Outcome.success(None)
    )
    assert calls == [("ready", {"q"}), ("freed", {"q"})]


def test_resuming_a_queue_wakes_the_dispatchers(store: Store) -> None:
    calls: list[set[str]] = []
    queue(store)
    store.queue_pause("q")
    submit(store)
    store.on_ready = lambda queues: calls.append(set(queues))
    store.queue_pause("q")  # already paused: nothing changes, nobody is woken
    assert calls == []
    store.queue_resume("q")
    assert calls == [{"q"}]


def test_changing_a_limit_counts_as_freeing_permits_in_every_queue(store: Store) -> None:
    calls: list[set[str]] = []
    queue(store, name="a")
    queue(store, name="b")
    store.on_freed = lambda queues: calls.append(set(queues))
    store.tenant_limit_set("t1", 5)
    store.global_limit_set(7)
    store.global_limit_set(None)
    assert calls == [{"a", "b"}, {"a", "b"}, {"a", "b"}]


def test_setting_the_limit_in_force_wakes_nobody(store: Store) -> None:
    """A wake tells the dispatchers whose last claim a cap held back that a claim may now
    find more. Setting the caps in force changes nothing a claim weighs (and a claim in
    flight has committed first: both take the claim lock), so it would find what it
    found: a tenant's cap woke nobody then, but the global cap woke every queue, a round
    of claims on every node for each held-back worker."""
    calls: list[set[str]] = []
    queue(store, name="a")
    store.on_freed = lambda queues: calls.append(set(queues))
    store.global_limit_set(None)  # no cap, as a new database has
    store.tenant_limit_set("t1", None)
    assert calls == []
    store.tenant_limit_set("t1", 5)
    store.global_limit_set(7)
    calls.clear()
    store.tenant_limit_set("t1", 5)
    store.tenant_limit_set("t1", max_queued=3)  # a cap no claim weighs
    store.global_limit_set(7)
    assert calls == []


def test_a_release_readies_the_task_and_frees_its_permit(store: Store) -> None:
    """A release (as a retry, a reaped claim) readies its task and frees its session's
    slot: both are said. It said only ready, and a dispatcher that skips a worker whose
    session was full (``Grants.full``) never heard that the slot was free, and left the
    worker idle until its poll round."""
    calls: list[str] = []
    store.on_ready = lambda _: calls.append("ready")
    store.on_freed = lambda _: calls.append("freed")
    queue(store)
    session, _ = worker(store)
    submit(store, retry_safe=True)
    g = store.attempt_claim_many(session.id, session.epoch, 1)[0]
    store.attempt_release(session.id, session.epoch, g.attempt.id, g.attempt.fence)
    assert calls == ["ready", "ready", "freed"]


def test_notify_names_the_origin_and_the_kind() -> None:
    """PostgreSQL only: SQLite has one server process and calls back in-process."""
    with temporary_database("orbit_notify") as dsn:
        store = open_store(as_url(dsn))
        try:
            with psycopg.connect(dsn, autocommit=True) as listener:
                listener.execute("LISTEN orbit_ready")
                queue(store, name="a:b")  # a queue name may hold ':' itself
                session, _ = worker(store)
                submit(store, queue="a:b")
                g = store.attempt_claim_many(session.id, session.epoch, 1)[0]
                _finish(store, session.id, session.epoch, g.attempt.id, g.attempt.fence)
                payloads = [n.payload for n in listener.notifies(timeout=2, stop_after=2)]
        finally:
            store.close()
    assert payloads == [f"{store.origin}:ready:a:b", f"{store.origin}:freed:a:b"]


def _until_sentinel(listener: psycopg.Connection[object], dsn: str) -> list[str]:
    """Every orbit_ready payload delivered before a sentinel sent now: what the earlier
    commits notified, without waiting for a silence."""
    with psycopg.connect(dsn, autocommit=True) as other:
        other.execute("SELECT pg_notify('orbit_ready', 'sentinel')")
    payloads: list[str] = []
    for n in listener.notifies(timeout=5):
        if n.payload == "sentinel":
            return payloads
        payloads.append(n.payload)
    raise AssertionError(f"the sentinel never came; heard {payloads}")


def test_a_rolled_back_finish_notifies_no_one_and_a_cancel_names_its_attempt() -> None:
    """PostgreSQL only. A plan's notices travel inside its batched write: a transaction
    that fails after that write sends none of them; the one that commits sends each once.
    A cancel of a running task tells the node holding its worker (orbit_cancel)."""
    with temporary_database("orbit_notify_tx") as dsn:
        store = open_store(as_url(dsn))
        try:
            with psycopg.connect(dsn, autocommit=True) as listener:
                listener.execute("LISTEN orbit_ready")
                listener.execute("LISTEN orbit_cancel")
                queue(store)
                session, _ = worker(store)
                submit(store)
                submit(store)
                assert _until_sentinel(listener, dsn) == [f"{store.origin}:ready:q"] * 2
                a, b = store.attempt_claim_many(session.id, session.epoch, 2)
                store.attempt_start(session.id, session.epoch, a.attempt.id, a.attempt.fence)
                with store.inject_fault("event_insert_many"), pytest.raises(InjectedFault):
                    store.attempt_finish(
                        session.id,
                        session.epoch,
                        a.attempt.id,
                        a.attempt.fence,
                        Outcome.success(None),
                    )
                assert _until_sentinel(listener, dsn) == []
                store.attempt_finish(
                    session.id, session.epoch, a.attempt.id, a.attempt.fence, Outcome.success(None)
                )
                assert _until_sentinel(listener, dsn) == [f"{store.origin}:freed:q"]

                store.attempt_start(session.id, session.epoch, b.attempt.id, b.attempt.fence)
                store.task_cancel(b.task.id)
                cancels = []
                for n in listener.notifies(timeout=5, stop_after=1):
                    cancels.append((n.channel, n.payload))
                assert cancels == [("orbit_cancel", f"{session.id}:{b.attempt.id}")]
        finally:
            store.close()
