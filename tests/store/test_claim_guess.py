"""A claim that sends its ready select on a guess, with its first read (``ClaimGuess``).

A session whose last claim found fewer ready tasks than it asked for has its next
claim's ready select sent in the round trip of the claim's first read, with the filters
the last one used; the claim uses those rows only if it works out the same filters and
wants no more rows than the guess asked for, and otherwise selects as before. Grants
must be exactly what a claim without the guess makes, on both backends; on PostgreSQL
the guess saves the round trip (SQLite has none to save, so it makes no guess read).
These stores read the database's clock: a store with a test clock never guesses.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from orbit.core.model import Session
from orbit.store import Store
from orbit.store import store as store_module
from tests.store.helpers import queue, submit, worker
from tests.store.test_pg_transactions import _record_round_trips


@pytest.fixture
def live_store(make_store: Any) -> Store:
    """A store on the database's own clock (no test clock), as a server's is."""
    store: Store = make_store()
    return store


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Each ready read a claim asks for, in order, with its limit: ``("guess", n)`` for
    one sent on a guess, ``("select", n)`` for the claim's own select."""
    asked: list[tuple[str, int]] = []
    fetch_table = store_module._Tx.fetch_table
    trailer = store_module._Tx.trailer

    def recording_fetch(self: Any, query: str, /, **params: Any) -> Any:
        if query == "task_ready_select":
            asked.append(("select", params["limit"]))
        return fetch_table(self, query, **params)

    def recording_trailer(self: Any, query: str, /, **params: Any) -> None:
        assert query == "task_ready_guess"
        asked.append(("guess", params["limit"]))
        trailer(self, query, **params)

    monkeypatch.setattr(store_module._Tx, "fetch_table", recording_fetch)
    monkeypatch.setattr(store_module._Tx, "trailer", recording_trailer)
    return asked


def _claim_ids(store: Store, session: Session, n: int) -> list[str]:
    return [g.task.id for g in store.attempt_claim_many(session.id, session.epoch, n)]


def _guessed(store: Store, limit: int, window: int | None = None) -> list[tuple[str, int]]:
    """The reads of a claim whose guess (of ``limit`` rows) fit: the guess alone on
    PostgreSQL; on SQLite, which sends no guess read, the claim's own select too (of
    ``window`` rows, ``limit`` unless given)."""
    if store.backend == "postgres":
        return [("guess", limit)]
    return [("guess", limit), ("select", limit if window is None else window)]


def _idle_session(store: Store, n: int = 5, **queues: int) -> Session:
    """A session whose first claim (of ``n``) found one task, so that its next is
    guessed; one queue ``q`` unless ``queues`` names them (name -> max_concurrency)."""
    for name, cap in (queues or {"q": 10}).items():
        queue(store, name, max_concurrency=cap)
    session, _ = worker(store, max_concurrency=50, handlers={"h": 50})
    first = submit(store, next(iter(queues or {"q": 10})))
    assert _claim_ids(store, session, n) == [first]
    return session


def test_an_idle_sessions_next_claim_takes_its_rows_from_the_guess(
    live_store: Store, reads: list[tuple[str, int]]
) -> None:
    store = live_store
    queue(store)
    session, _ = worker(store, max_concurrency=50, handlers={"h": 50})
    first = submit(store)
    assert _claim_ids(store, session, 5) == [first]
    assert reads == [("select", 5)]  # nothing to guess from yet
    reads.clear()
    second = submit(store)
    assert _claim_ids(store, session, 5) == [second]
    assert reads == _guessed(store, 5)
    assert store.task_get(second).state == "claimed"


def test_a_guessed_claim_wanting_fewer_rows_takes_the_first_and_leaves_the_rest(
    live_store: Store, reads: list[tuple[str, int]]
) -> None:
    store = live_store
    session = _idle_session(store)
    ids = [submit(store) for _ in range(4)]
    reads.clear()
    assert _claim_ids(store, session, 3) == ids[:3]
    assert reads == _guessed(store, 5, window=3)
    # the guess also locked the fourth, until its claim committed: it is still ready
    assert store.task_get(ids[3]).state == "queued"
    other, _ = worker(store, name="w2", handlers={"h": 5})
    assert _claim_ids(store, other, 5) == [ids[3]]
    # the claim filled its window, so the session's next claim makes no guess
    reads.clear()
    assert _claim_ids(store, session, 5) == []
    assert reads == [("select", 5)]


def test_a_claim_wanting_more_rows_than_the_guess_selects_them(
    live_store: Store, reads: list[tuple[str, int]]
) -> None:
    store = live_store
    session = _idle_session(store, n=2)
    ids = [submit(store) for _ in range(5)]
    reads.clear()
    assert _claim_ids(store, session, 5) == ids
    assert reads == [("guess", 2), ("select", 5)]


def test_a_guess_that_found_every_ready_task_serves_a_claim_wanting_more(
    live_store: Store, reads: list[tuple[str, int]]
) -> None:
    """An idle session's claim may want one row more than its last, empty, claim did
    (made while a task of the session was live); a guess that found fewer rows than it
    asked for found every ready one, so it serves a bigger window too."""
    store = live_store
    queue(store, max_concurrency=100)  # room under every cap: a claim reads what it wants
    session, _ = worker(store, max_concurrency=50, handlers={"h": 50})
    first = submit(store)
    (grant,) = store.attempt_claim_many(session.id, session.epoch, 50)
    assert _claim_ids(store, session, 50) == []  # a task live, 49 slots: a guess of 49
    store.attempt_release(session.id, session.epoch, grant.attempt.id, grant.attempt.fence)
    reads.clear()
    # 50 slots again; the guess of 49 rows finds the released task and a new one
    second = submit(store)
    assert _claim_ids(store, session, 50) == [first, second]
    assert reads == _guessed(store, 49, window=50)


def test_a_claim_whose_filters_changed_selects_with_its_own(
    live_store: Store, reads: list[tuple[str, int]]
) -> None:
    """The guess was made with both queues open; a paused queue is skipped now, so the
    guess's rows (which hold the paused queue's task) are not used."""
    store = live_store
    session = _idle_session(store, q=10, p=10)
    paused = submit(store, "p")
    store.queue_pause("p")
    ready = submit(store, "q")
    reads.clear()
    assert _claim_ids(store, session, 5) == [ready]
    assert reads == [("guess", 5), ("select", 5)]
    assert store.task_get(paused).state == "queued"
    store.queue_resume("p")
    assert _claim_ids(store, session, 5) == [paused]


def test_a_guessed_claim_takes_no_task_before_it_is_due(
    live_store: Store, reads: list[tuple[str, int]]
) -> None:
    store = live_store
    session = _idle_session(store)
    later = submit(store, run_after=(time.time_ns() // 1000) + 3_600_000_000)
    due = submit(store)
    reads.clear()
    assert _claim_ids(store, session, 5) == [due]
    assert reads == _guessed(store, 5)
    assert store.task_get(later).state == "scheduled"


def test_a_full_claim_forgets_the_guess(live_store: Store, reads: list[tuple[str, int]]) -> None:
    store = live_store
    session = _idle_session(store, n=2)
    ids = [submit(store) for _ in range(3)]
    reads.clear()
    assert _claim_ids(store, session, 2) == ids[:2]
    assert _claim_ids(store, session, 2) == ids[2:]
    assert reads == [*_guessed(store, 2), ("select", 2)]


def test_a_store_on_a_test_clock_never_guesses(store: Store, reads: list[tuple[str, int]]) -> None:
    """The guess judges ready by the database's clock, which a test clock replaces."""
    queue(store)
    session, _ = worker(store, max_concurrency=50, handlers={"h": 50})
    for _ in range(2):
        submit(store)
        assert len(store.attempt_claim_many(session.id, session.epoch, 5)) == 1
    assert reads == [("select", 5), ("select", 5)]


@pytest.mark.parametrize("backend", ["postgres"])
def test_a_guessed_claim_is_two_round_trips(
    live_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its lock, reads and guessed select, then its write and COMMIT: where a claim
    without a guess is three (``test_a_transition_sends_its_write_with_its_commit``)."""
    store = live_store
    session = _idle_session(store)
    submit(store)
    sent = _record_round_trips(monkeypatch)
    assert len(store.attempt_claim_many(session.id, session.epoch, 5)) == 1
    assert sent == ["pipeline", "pipeline+COMMIT"]
