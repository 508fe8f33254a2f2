"""Batched writes of 8 rows or more send their rows column by column on PostgreSQL,
split by ``string_to_array`` (see orbit/store/postgres/driver.py), and as JSON whenever
a value could be misread that way. Whatever a value holds, it must come back exactly, on both
backends."""

from __future__ import annotations

from orbit.core.model import Outcome, TaskSpec
from orbit.store import Store
from tests.store.helpers import queue, worker

#: the separator and the NULL spelling of the columnar form, and their neighbours
AWKWARD = ["\x1f", "\x1e", "a\x1fb", "\x1e\x1e", "None", "null", "NULL", ",", '"', "\\", "é"]


def test_awkward_text_comes_back_exactly(store: Store) -> None:
    queue(store)
    specs = [
        TaskSpec(queue="q", handler="h", payload=i, idempotency_key=key)
        for i, key in enumerate(AWKWARD)
    ]
    submitted = store.task_submit_many(specs)
    assert [store.task_get(s.task.id).idempotency_key for s in submitted] == AWKWARD


def test_empty_messages_are_not_read_as_none(store: Store) -> None:
    """An empty value between separators is an empty string, not a missing one."""
    queue(store, max_concurrency=100)
    messages = ["", "x", "", "", "y", "", "", ""]  # a batch large enough to go by column
    store.task_submit_many(
        [TaskSpec(queue="q", handler="h", payload=i, max_attempts=1) for i in range(8)]
    )
    session, _ = worker(store, handlers={"h": 100}, max_concurrency=100)
    grants = store.attempt_claim_many(session.id, session.epoch, 100)
    store.attempt_start_many(
        session.id, session.epoch, [(g.attempt.id, g.attempt.fence) for g in grants]
    )
    store.attempt_finish_many(
        session.id,
        session.epoch,
        [
            (g.attempt.id, g.attempt.fence, Outcome.failure("E_X", m, retryable=False))
            for g, m in zip(grants, messages, strict=True)
        ],
    )
    assert [store.task_get(g.task.id).error_message for g in grants] == messages


def test_a_batch_of_failures_keeps_each_message(store: Store) -> None:
    queue(store, max_concurrency=100)
    store.task_submit_many(
        [TaskSpec(queue="q", handler="h", payload=i, max_attempts=1) for i in range(len(AWKWARD))]
    )
    session, _ = worker(store, handlers={"h": 100}, max_concurrency=100)
    grants = store.attempt_claim_many(session.id, session.epoch, 100)
    store.attempt_start_many(
        session.id, session.epoch, [(g.attempt.id, g.attempt.fence) for g in grants]
    )
    messages = {g.task.id: AWKWARD[i] for i, g in enumerate(grants)}
    store.attempt_finish_many(
        session.id,
        session.epoch,
        [
            (g.attempt.id, g.attempt.fence, Outcome.failure("E_X", messages[g.task.id], False))
            for g in grants
        ],
    )
    assert {i: store.task_get(i).error_message for i in messages} == messages
