"""How many ready rows a claim reads and locks (``Store._claim``).

A claim selects ready tasks with ``FOR UPDATE SKIP LOCKED``, so every row it reads is
locked until it commits, and turned into a record. With room under every cap each row is
granted, and the claim asks for exactly as many as it wants; when a cap is within reach it
reads a margin, for the rows the cap turns away, and still grants no more than the cap
allows. Both backends.
"""

from __future__ import annotations

from typing import Any

import pytest

from orbit.core.model import Session
from orbit.store import Store
from orbit.store import store as store_module
from tests.conftest import ManualClock
from tests.store.helpers import queue, submit, worker


@pytest.fixture
def limits_asked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``limit`` of every ready-task select, in order."""
    asked: list[int] = []
    fetch_table = store_module._Tx.fetch_table

    def recording(self: Any, query: str, /, **params: Any) -> Any:
        if query == "task_ready_select":
            asked.append(params["limit"])
        return fetch_table(self, query, **params)

    monkeypatch.setattr(store_module._Tx, "fetch_table", recording)
    return asked


def _twenty_ready(store: Store, queue_cap: int) -> Session:
    """Twenty ready tasks in one queue, and a session with room for fifty."""
    queue(store, max_concurrency=queue_cap)
    for _ in range(20):
        submit(store)
    session, _ = worker(store, max_concurrency=50, handlers={"h": 50})
    return session


def test_with_room_everywhere_a_claim_reads_only_what_it_wants(
    store: Store, limits_asked: list[int]
) -> None:
    session = _twenty_ready(store, queue_cap=100)
    grants = store.attempt_claim_many(session.id, session.epoch, 5)
    assert len(grants) == 5
    assert limits_asked == [5]
    assert store.task_counts().get("queued") == 15


def test_near_a_cap_a_claim_reads_a_margin_and_grants_only_what_fits(
    store: Store, limits_asked: list[int]
) -> None:
    session = _twenty_ready(store, queue_cap=4)
    grants = store.attempt_claim_many(session.id, session.epoch, 5)
    assert len(grants) == 4 and grants.blocked  # the queue's cap, not the rows read
    assert limits_asked[0] == 5 * 2 + 8  # (a second round finds the queue at its cap)
    assert store.task_counts().get("queued") == 16


def _big_tasks(store: Store, count: int, size: int) -> None:
    """``count`` ready tasks whose payloads are each ``size`` bytes of JSON, one of them
    spelled with non-ASCII characters (counted in UTF-8 bytes, as the wire carries them)."""
    for i in range(count):
        pad = ("é" * ((size - 2) // 2)) if i == 0 else ("x" * (size - 2))
        submit(store, payload=pad)


def test_a_claim_hands_out_at_most_claim_payload_bytes(store: Store) -> None:
    """One claim's tasks go to the worker in one frame: their payloads stop at
    CLAIM_PAYLOAD_BYTES, the rest stay ready and ``more`` says to claim again now."""
    size = 250_000
    queue(store, max_concurrency=100)
    _big_tasks(store, 20, size)
    session, _ = worker(store, max_concurrency=50, handlers={"h": 50})
    fit = store_module.CLAIM_PAYLOAD_BYTES // size
    assert fit < 20  # the test means something only if the budget binds
    first = store.attempt_claim_many(session.id, session.epoch, 20)
    assert len(first) == fit and first.more
    assert sum(len(g.task.payload.encode()) for g in first) <= store_module.CLAIM_PAYLOAD_BYTES
    assert store.task_counts().get("queued") == 20 - fit
    rest = store.attempt_claim_many(session.id, session.epoch, 20)
    assert len(rest) == 20 - fit and not rest.more
    assert store.task_counts().get("queued") is None
    assert {g.task.id for g in first}.isdisjoint(g.task.id for g in rest)


def test_a_claim_grants_one_task_larger_than_the_budget(make_store: Any) -> None:
    """A payload over the budget (a server allowed such payloads) still goes, alone."""
    big = store_module.CLAIM_PAYLOAD_BYTES + 1000
    store = make_store(config=store_module.StoreConfig(max_payload_bytes=2 * big))
    queue(store, max_concurrency=100)
    submit(store, payload="y" * big)
    submit(store, payload="small")
    session, _ = worker(store, max_concurrency=50, handlers={"h": 50})
    first = store.attempt_claim_many(session.id, session.epoch, 10)
    assert len(first) == 1 and first.more and len(first[0].task.payload) > big
    second = store.attempt_claim_many(session.id, session.epoch, 10)
    assert [g.task.payload for g in second] == ['"small"'] and not second.more


def test_tasks_past_their_deadline_do_not_hide_a_ready_task_behind_them(
    store: Store, clock: ManualClock
) -> None:
    """Rows past their deadline were read, then skipped one by one, each round reading
    only as many as it wanted: with more of them at the head of the queue than eight
    rounds read, a claim granted nothing and said nothing was left (no ``more``). The
    reaper's failing them woke no one, so an idle worker waited the poll interval (5 s)
    while a ready task sat behind them. The select leaves them out: the task is granted."""
    queue(store, max_concurrency=10)
    for _ in range(20):
        submit(store, priority=10, deadline=clock.now + 1_000_000)
    ready = submit(store, priority=0)
    clock.advance(2)
    session, _ = worker(store, max_concurrency=1)
    grants = store.attempt_claim_many(session.id, session.epoch, 1)
    assert [g.task.id for g in grants] == [ready]
    assert store.task_counts().get("queued") == 20  # the reaper's to end, untouched here
