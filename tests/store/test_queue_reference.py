"""Every task's queue exists. On PostgreSQL the store alone holds this since migration
0005 dropped the tasks' foreign key to the queues (a per-row check, a fifth of a batch
insert's time); SQLite keeps its foreign key. So the store's own check must refuse a
missing queue wherever it sits in a batch, a chunked one included, and the migration
must carry a database's tasks over unchanged."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from orbit.core.errors import Code, OrbitError
from orbit.core.model import TaskSpec
from orbit.store import Store, open_store
from orbit.store.store import SUBMIT_CHUNK
from tests.pg import as_url, postgres_migrations_up_to, temporary_database
from tests.store.helpers import queue

_PG_QUEUE_FKS = """
SELECT conname FROM pg_constraint
WHERE conrelid = 'orbit_tasks'::regclass AND contype = 'f'
  AND confrelid = 'orbit_queues'::regclass
"""


def _orphans(store: Store) -> list[str]:
    """Tasks whose queue is not a queue."""
    queues = {q.name for q in store.queue_list()}
    return [t.id for t in store.task_list(limit=1000) if t.queue not in queues]


@pytest.mark.parametrize("where", [0, SUBMIT_CHUNK, 2 * SUBMIT_CHUNK + 6])
def test_a_missing_queue_anywhere_in_a_chunked_batch_writes_nothing(
    store: Store, where: int
) -> None:
    queue(store)
    n = 2 * SUBMIT_CHUNK + 7
    batch = [TaskSpec(queue="q", handler="h", payload={"i": i}) for i in range(n)]
    batch[where] = TaskSpec(queue="gone", handler="h")
    with pytest.raises(OrbitError) as err:
        store.task_submit_many(batch)
    assert err.value.code == Code.QUEUE_NOT_FOUND and "'gone'" in err.value.message
    assert store.task_list(limit=1000) == []
    assert [e for e in store.event_list(limit=1000) if e["kind"] == "submitted"] == []
    # the same batch with the queue made is taken whole, every task in a queue
    queue(store, "gone")
    assert len(store.task_submit_many(batch)) == len(batch)
    assert _orphans(store) == []


_V4_QUEUE = """
INSERT INTO orbit_queues (name, max_concurrency, rate, burst, paused, tokens, tokens_at,
    created_at)
VALUES ('q', 1, 0, 1, false, 1, 0, 0)"""

_V4_TASK = """
INSERT INTO orbit_tasks (id, queue, handler, tenant, priority, payload, payload_digest,
    retry_safe, max_attempts, backoff_base_us, backoff_factor, backoff_max_us, run_after,
    state, attempts_used, fence, cancel_requested, result_version, created_at, updated_at,
    version)
VALUES (%s, 'q', 'h', 'default', 0, %s, 'd', true, 3, 1000000, 2, 60000000, 0, 'queued', 0,
    0, false, 0, 0, 0, 0)"""


def test_migration_5_keeps_the_tasks_and_drops_only_the_queue_key(tmp_path: Path) -> None:
    """A database at schema version 4, with tasks in it, migrates to 5: the tasks and
    their queue are as they were, the queue's foreign key is gone, and submits go on.

    The queue and tasks are written in SQL as schema 4 has them: today's store writes
    columns later migrations add (``max_queued``, 9), so it cannot write a schema 4."""
    four = postgres_migrations_up_to(4, tmp_path / "migrations-4")
    with temporary_database() as dsn:
        url = as_url(dsn)
        old = open_store(url, migrate=False)
        old.driver.migrations = four  # type: ignore[attr-defined]
        assert old.migrate() == 4
        old.close()
        ids = [f"0190{i:028x}" for i in range(3)]
        with psycopg.connect(dsn) as cx:
            cx.execute(_V4_QUEUE)
            for n, task_id in enumerate(ids):
                cx.execute(_V4_TASK, (task_id, f'{{"i":{n}}}'))
            assert cx.execute(_PG_QUEUE_FKS).fetchall() == [("orbit_tasks_queue_fkey",)]

        new = open_store(url)  # migrates
        try:
            kept_tasks = [new.task_get(task_id) for task_id in ids]
            assert [(t.queue, t.payload, str(t.state)) for t in kept_tasks] == [
                ("q", f'{{"i":{n}}}', "queued") for n in range(3)
            ]
            assert [q.name for q in new.queue_list()] == ["q"]
            with psycopg.connect(dsn) as cx:
                assert cx.execute(_PG_QUEUE_FKS).fetchall() == []
                # the other foreign keys stay (a task's parent; an attempt's task until
                # migration 12, tests/store/test_attempt_task_reference.py)
                kept = {
                    r[0]
                    for r in cx.execute(
                        "SELECT conname FROM pg_constraint WHERE contype = 'f'"
                    ).fetchall()
                }
            assert {"orbit_tasks_parent_id_fkey", "orbit_artifacts_task_id_fkey"} <= kept
            with pytest.raises(OrbitError) as err:
                new.task_submit(TaskSpec(queue="nope", handler="h"))
            assert err.value.code == Code.QUEUE_NOT_FOUND
            assert new.task_submit(TaskSpec(queue="q", handler="h")).created
            assert _orphans(new) == []
        finally:
            new.close()
