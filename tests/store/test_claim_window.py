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
from tests.store.helpers import queue, submit, worker


@pytest.fixture
def limits_asked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``limit`` of every ready-task select, in order."""
    asked: list[int] = []
    fetch = store_module._Tx.fetch

    def recording(self: Any, query: str, /, **params: Any) -> Any:
        if query == "task_ready_select":
            asked.append(params["limit"])
        return fetch(self, query, **params)

    monkeypatch.setattr(store_module._Tx, "fetch", recording)
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
