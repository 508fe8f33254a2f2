"""A batch submit larger than SUBMIT_CHUNK is written a chunk at a time, each chunk's
statement sent before the next chunk is made (PostgreSQL's pipeline mode). Whatever
happens in a later chunk, the batch is still all or nothing, on both backends, and the
connection is fit for the next transaction."""

from __future__ import annotations

import itertools
import sqlite3
import threading
from typing import Any

import psycopg
import pytest

from orbit.core.errors import Code, OrbitError
from orbit.core.model import TaskSpec
from orbit.store import Store, Submitted, open_store
from orbit.store.store import (
    SUBMIT_CHUNK,
    SUBMIT_CHUNK_GROWTH,
    SUBMIT_FIRST_CHUNK,
    submit_chunks,
)
from tests.conftest import ManualClock, store_url
from tests.store.helpers import blind_first_look, queue

#: several chunks (submit_chunks), the last one short
N = 2 * SUBMIT_CHUNK + 7


def specs(n: int = N) -> list[TaskSpec]:
    return [TaskSpec(queue="q", handler="h", payload={"i": i}) for i in range(n)]


def with_key(batch: list[TaskSpec], i: int, key: str, payload: Any) -> None:
    batch[i] = TaskSpec(queue="q", handler="h", payload=payload, idempotency_key=key)


def stored(store: Store) -> int:
    return len(store.task_list(limit=1000))


def submitted_events(store: Store) -> list[dict[str, Any]]:
    return [e for e in store.event_list(limit=1000) if e["kind"] == "submitted"]


def test_a_batch_of_several_chunks_is_written_whole_and_in_order(store: Store) -> None:
    queue(store)
    done = store.task_submit_many(specs())
    assert [d.task.payload for d in done] == [f'{{"i":{i}}}' for i in range(N)]
    assert all(d.created for d in done)
    assert sorted(t.id for t in store.task_list(limit=1000)) == sorted(d.task.id for d in done)
    assert sorted(e["task_id"] for e in submitted_events(store)) == sorted(d.task.id for d in done)


@pytest.mark.parametrize("n", [1, 3, N])
def test_each_stored_new_task_is_the_task_submit_answered(store: Store, n: int) -> None:
    """The insert spells the columns every new task starts with (transitions.NEW_TASK_FIXED)
    instead of reading them from the rows: each stored task, read back, must still be
    exactly the one submit made and answered, in the JSON form (1, 3) and the columnar
    streamed one (N), for plain, keyed, scheduled and parented specs alike."""
    queue(store)
    parent = store.task_submit(TaskSpec(queue="q", handler="h")).task
    later = parent.created_at + 10**9
    batch = [
        TaskSpec(
            queue="q",
            handler="h",
            payload={"i": i},
            tenant="t" if i % 2 else "default",
            priority=i % 5,
            idempotency_key=f"k{i}" if i % 3 == 0 else None,
            parent_id=parent.id if i % 4 == 1 else None,
            retry_safe=bool(i % 2),
            max_attempts=1 + i % 4,
            deadline=later + i if i % 5 == 2 else None,
            run_after=later if i % 2 == 0 else None,
        )
        for i in range(n)
    ]
    done = store.task_submit_many(batch)
    assert all(d.created for d in done)
    assert [store.task_get(d.task.id) for d in done] == [d.task for d in done]


def test_a_key_repeated_in_a_later_chunk_answers_with_the_first_task(store: Store) -> None:
    queue(store)
    batch = specs()
    with_key(batch, 3, "k", "same")
    with_key(batch, SUBMIT_CHUNK + 3, "k", "same")
    done = store.task_submit_many(batch)
    first, again = done[3], done[SUBMIT_CHUNK + 3]
    assert first.created and not again.created
    assert again.task.id == first.task.id
    assert stored(store) == N - 1


def test_a_conflict_in_a_later_chunk_writes_nothing(store: Store) -> None:
    queue(store)
    batch = specs()
    with_key(batch, 3, "k", "one")
    with_key(batch, 2 * SUBMIT_CHUNK + 1, "k", "two")
    with pytest.raises(OrbitError) as err:
        store.task_submit_many(batch)
    assert err.value.code == Code.IDEMPOTENCY_CONFLICT
    assert stored(store) == 0 and submitted_events(store) == []
    assert len(store.task_submit_many(specs())) == N  # the connection is fit for more
    assert stored(store) == N


def test_a_database_error_in_a_later_chunk_undoes_the_earlier_ones(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last chunk's first task reuses the first task's id: the database refuses that
    statement after the earlier chunks' statements have run, and none of them stays."""
    queue(store)
    made: list[str] = []
    new_ids = store._new_ids
    last = submit_chunks(N)[-1][0]

    def clashing(now: int, count: int, first: int) -> list[str]:
        ids = new_ids(now, count, first)
        if len(made) <= last < len(made) + count:  # this chunk holds the last's first
            ids[last - len(made)] = made[0]
        made.extend(ids)
        return ids

    monkeypatch.setattr(store, "_new_ids", clashing)
    with pytest.raises((psycopg.errors.UniqueViolation, sqlite3.IntegrityError)):
        store.task_submit_many(specs())
    assert len(made) == N  # every chunk was made: the error came from the database
    assert stored(store) == 0 and submitted_events(store) == []
    monkeypatch.undo()
    assert len(store.task_submit_many(specs())) == N
    assert stored(store) == N


def test_a_key_taken_concurrently_is_found_on_the_retry(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first look for existing keys misses a key another submit has just taken: that
    chunk's insert skips the row, the count falls short, and the retried transaction
    answers with the other submit's task."""
    queue(store)
    winner = store.task_submit(
        TaskSpec(queue="q", handler="h", payload="same", idempotency_key="k")
    ).task
    looks = blind_first_look(store, monkeypatch)
    batch = specs()
    with_key(batch, SUBMIT_CHUNK + 5, "k", "same")
    done = store.task_submit_many(batch)
    assert looks() == 2
    assert done[SUBMIT_CHUNK + 5].task.id == winner.id
    assert not done[SUBMIT_CHUNK + 5].created
    assert stored(store) == N


@pytest.mark.parametrize("n", [3, N])
def test_rendered_values_come_back_once_in_order_after_a_retry(
    store: Store, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """``task_submit_rendered`` renders each result as its chunk is written; a retried
    transaction renders them all again, and the caller gets one value per task."""
    queue(store)
    store.task_submit(TaskSpec(queue="q", handler="h", payload="same", idempotency_key="k"))
    looks = blind_first_look(store, monkeypatch)
    batch = specs(n)
    with_key(batch, n - 1, "k", "same")
    calls = 0

    def render(done: Submitted) -> tuple[str, bool]:
        nonlocal calls
        calls += 1
        return done.task.payload, done.created

    views = store.task_submit_rendered(batch, render)
    assert looks() == 2
    assert views == [(f'{{"i":{i}}}', True) for i in range(n - 1)] + [('"same"', False)]
    # Every result is rendered before the short count is seen (a streamed batch's chunks
    # while the next is written, a single chunk's before its write, which carries the
    # COMMIT), and again on the retry.
    assert calls == 2 * n


@pytest.mark.parametrize("n", [1, 3, N])
def test_a_render_that_raises_commits_nothing(store: Store, n: int) -> None:
    """A render is part of the submit: one that raises leaves no task and no event, also
    for a batch of one chunk, whose write carries the COMMIT on PostgreSQL."""
    queue(store)

    def render(done: Submitted) -> str:
        if done.task.payload == f'{{"i":{n - 1}}}':
            raise RuntimeError("a view that cannot be made")
        return done.task.id

    with pytest.raises(RuntimeError, match="cannot be made"):
        store.task_submit_rendered(specs(n), render)
    assert stored(store) == 0 and submitted_events(store) == []
    assert len(store.task_submit_rendered(specs(n), lambda done: done.task.id)) == n


def test_two_stores_racing_the_same_keyed_batch_make_each_task_once(
    store: Store, clock: ManualClock
) -> None:
    """Two stores (two nodes' pools) submit the same keyed batch of several chunks at
    once: each key makes one task, and both callers are answered with the same ids."""
    queue(store)
    other = open_store(store_url(store), clock=clock)
    batch = [
        TaskSpec(queue="q", handler="h", payload={"i": i}, idempotency_key=f"k{i}")
        for i in range(N)
    ]
    start = threading.Barrier(2)
    answers: list[list[Submitted]] = [[], []]

    def submit(i: int, s: Store) -> None:
        start.wait()
        answers[i] = s.task_submit_many(batch)

    try:
        racers = [
            threading.Thread(target=submit, args=(i, s)) for i, s in enumerate([store, other])
        ]
        for t in racers:
            t.start()
        for t in racers:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in racers)
    finally:
        other.close()
    first, second = answers
    assert [d.task.id for d in first] == [d.task.id for d in second]
    assert sum(d.created for d in first + second) == N
    assert stored(store) == N
    assert len(submitted_events(store)) == N


@pytest.mark.parametrize("n", [SUBMIT_CHUNK + 1, N, 1000])
def test_a_streamed_batch_starts_with_a_small_chunk_that_grows(n: int) -> None:
    """The database waits while the first chunk is made, so it is small; each next one
    is at most SUBMIT_CHUNK_GROWTH times the one before, so it is made while that one is
    written. The chunks cover the batch once, in order."""
    bounds = submit_chunks(n)
    assert bounds[0] == (0, SUBMIT_FIRST_CHUNK)
    assert [start for start, _ in bounds[1:]] == [end for _, end in bounds[:-1]]
    assert bounds[-1][1] == n
    sizes = [end - start for start, end in bounds]
    assert all(0 < b <= a * SUBMIT_CHUNK_GROWTH for a, b in itertools.pairwise(sizes))
    assert len(bounds) > 2


@pytest.mark.timeout(120)  # the bug was a wait for ever: fail, do not hang the suite
@pytest.mark.parametrize("count", [45, 300])  # one write, and a streamed batch of chunks
def test_a_batch_larger_than_the_sockets_buffer_is_written(store: Store, count: int) -> None:
    """A batch's statements may be megabytes: 45 tasks of 200 KB went out part way (the
    connection is nonblocking and nothing sent the rest), and PostgreSQL waited for the
    rest of the statement while the store waited for its answer. The finishes of such
    tasks, with results as large, go the same way."""
    from orbit.core.model import Outcome
    from tests.store.helpers import worker

    queue(store, max_concurrency=1000)
    pad = "x" * (200_000 if count == 45 else 30_000)
    specs = [TaskSpec(queue="q", handler="h", payload={"i": i, "pad": pad}) for i in range(count)]
    done = store.task_submit_many(specs)
    assert [d.task.payload for d in done] == [f'{{"i":{i},"pad":"{pad}"}}' for i in range(count)]
    assert store.task_counts() == {"queued": count}
    session, _ = worker(store, max_concurrency=1000, handlers={"h": 1000})
    grants = []
    while len(grants) < min(count, 45):
        grants += store.attempt_claim_many(session.id, session.epoch, 45 - len(grants))
    starts = [(g.attempt.id, g.attempt.fence) for g in grants]
    store.attempt_start_many(session.id, session.epoch, starts)
    finishes = [(a, f, Outcome.success({"echo": pad})) for a, f in starts]
    receipts = store.attempt_finish_many(session.id, session.epoch, finishes)
    assert all(not isinstance(r, Exception) for r in receipts)
    assert store.task_counts().get("succeeded") == 45
