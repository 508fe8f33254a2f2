"""A batch read a chunk at a time inside the transaction (``orbit.core.batches``, the
protocol's ``UsualBatch``): written whole and in order, read while earlier chunks are
written, and all or nothing when a later task turns out bad, on both backends."""

from __future__ import annotations

from typing import Any

import pytest

from orbit.core.batches import UnusualTask
from orbit.core.errors import Code, OrbitError
from orbit.protocol.submissions import UsualBatch
from orbit.store import Store, Submitted
from orbit.store.store import SUBMIT_CHUNK, StoreConfig, submit_chunks
from tests.conftest import ManualClock
from tests.store.helpers import queue

#: several chunks, the last one short
N = 2 * SUBMIT_CHUNK + 7


def tasks(n: int = N, **late: Any) -> list[dict[str, Any]]:
    """``n`` usual tasks; the fields in ``late`` set on the last chunk's first task."""
    made: list[dict[str, Any]] = [
        {"queue": "q", "handler": "h", "payload": {"i": i}, "retry_safe": True} for i in range(n)
    ]
    made[submit_chunks(n)[-1][0]].update(late)
    return made


def batch_of(made: list[dict[str, Any]]) -> tuple[UsualBatch, list[tuple[int, int]]]:
    """The batch, and the chunks it is asked to read, in order."""
    batch = UsualBatch.of({"tasks": made})
    assert batch is not None
    reads: list[tuple[int, int]] = []
    read = batch.read

    def recorded(start: int, end: int) -> Any:
        reads.append((start, end))
        return read(start, end)

    batch.read = recorded  # type: ignore[method-assign]
    return batch, reads


def written(store: Store) -> tuple[int, int]:
    events = [e for e in store.event_list(limit=5000) if e["kind"] == "submitted"]
    return len(store.task_list(limit=1000)), len(events)


def test_a_lazy_batch_is_read_a_chunk_at_a_time_and_written_in_order(store: Store) -> None:
    queue(store)
    batch, reads = batch_of(tasks(idempotency_key="k"))
    done: list[Submitted] = store.task_submit_rendered(batch, lambda d: d)
    assert reads == submit_chunks(N)
    assert [d.task.payload for d in done] == [f'{{"i":{i}}}' for i in range(N)]
    assert all(d.created and d.task.retry_safe for d in done)
    assert written(store) == (N, N)
    again, _ = batch_of(tasks(idempotency_key="k"))  # the key's task is found, not made
    found = store.task_submit_rendered(again, lambda d: (d.created, d.task.id))
    assert found[submit_chunks(N)[-1][0]] == (False, done[submit_chunks(N)[-1][0]].task.id)
    assert written(store)[1] == 2 * N - 1  # a `submitted` event for each task made


def test_a_late_task_its_reader_cannot_take_undoes_the_batch(store: Store) -> None:
    """Found inside the transaction, after earlier chunks were read (and, on
    PostgreSQL, sent): UnusualTask, for the caller's strict path, and nothing stays."""
    queue(store)
    batch, reads = batch_of(tasks(priority=10**6 + 1))
    with pytest.raises(UnusualTask) as err:
        store.task_submit_rendered(batch, lambda d: d)
    assert err.value.index == submit_chunks(N)[-1][0]
    assert reads == submit_chunks(N)
    assert written(store) == (0, 0)
    good, _ = batch_of(tasks())
    assert len(store.task_submit_rendered(good, lambda d: d)) == N  # the store is fine


def test_a_late_payload_too_large_undoes_the_batch(make_store: Any, clock: ManualClock) -> None:
    store: Store = make_store(clock=clock, config=StoreConfig(max_payload_bytes=1024))
    queue(store)
    batch, _ = batch_of(tasks(payload="x" * 2000))
    with pytest.raises(OrbitError) as err:
        store.task_submit_rendered(batch, lambda d: d)
    assert err.value.code == Code.PAYLOAD_TOO_LARGE
    assert written(store) == (0, 0)


def test_a_lazy_batch_of_one_chunk_is_read_before_the_transaction(store: Store) -> None:
    """Nothing to overlap: its bad task is found before any SQL (the armed fault on the
    transaction's first statement never fires)."""
    queue(store)
    batch, reads = batch_of(tasks(SUBMIT_CHUNK, priority=10**6 + 1))
    with store.inject_fault("queue_get_many"), pytest.raises(UnusualTask):
        store.task_submit_rendered(batch, lambda d: d)
    assert reads == [(0, SUBMIT_CHUNK)]
    assert written(store) == (0, 0)


def test_a_lazy_batch_names_an_unknown_queue_before_reading_its_tasks(store: Store) -> None:
    queue(store)
    made = tasks()
    made[-1]["queue"] = "nope"
    batch, reads = batch_of(made)
    with pytest.raises(OrbitError) as err:
        store.task_submit_rendered(batch, lambda d: d)
    assert err.value.code == Code.QUEUE_NOT_FOUND and reads == []
    assert written(store) == (0, 0)
