"""Every attempt's task exists. On PostgreSQL the store alone holds this since migration
0012 dropped the attempts' foreign key to the tasks (a per-row check in every claim's
insert, an eighth of the claim's write); SQLite keeps its foreign key. An attempt is
inserted only by a claim, in the statement that writes its task (locked, and guarded
by the version it was read at), and no statement deletes a task, so the migration must
carry a database's attempts over unchanged and the drain must leave no attempt without
its task. A start reads its queues through the attempts (which carry their task's
queue), not through the tasks again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from orbit.core.model import Outcome, TaskSpec
from orbit.store import Store, open_store
from tests.pg import as_url, postgres_migrations_up_to, temporary_database
from tests.store.helpers import claim_one, query_plan, queue, start_and_succeed, submit, worker

_FKS = """
SELECT conrelid::regclass::text, conname FROM pg_constraint WHERE contype = 'f'
ORDER BY 1, 2
"""


def _orphans(store: Store) -> list[str]:
    """Attempts whose task is not a task."""
    store.driver.queries["test_orphans"] = (
        "SELECT a.id FROM orbit_attempts AS a LEFT JOIN orbit_tasks AS t ON t.id = a.task_id"
        " WHERE t.id IS NULL"
    )
    with store.driver.transaction() as cx:
        return [r["id"] for r in cx.fetch("test_orphans", {})]


def test_a_drain_leaves_every_attempt_with_its_task(store: Store) -> None:
    queue(store, max_concurrency=100)
    session, _ = worker(store, {"h": 100}, max_concurrency=100)
    ids = [s.task.id for s in store.task_submit_many([TaskSpec(queue="q", handler="h")] * 20)]
    grants = store.attempt_claim_many(session.id, session.epoch, 20)
    assert sorted(g.task.id for g in grants) == sorted(ids)
    start_and_succeed(store, session, grants)
    assert {str(store.task_get(i).state) for i in ids} == {"succeeded"}
    assert _orphans(store) == []


def test_a_start_reads_its_queues_through_the_attempts_alone(store: Store) -> None:
    """The queues a batch of starts shares come from the attempts' own ``queue``: the
    tasks were already locked by the batch's first read, and looking each one up again
    by its key was half of this read's time on PostgreSQL."""
    queue(store)
    queue(store, "other")
    session, _ = worker(store)
    submit(store)
    submit(store, "other")
    grants = [claim_one(store, session), claim_one(store, session)]
    ids = sorted(g.attempt.id for g in grants)
    plan = query_plan(store, "queue_share_for_attempts", {"ids": ids})
    assert "orbit_tasks" not in plan and "orbit_attempts" in plan, plan
    # and the read names the queues of exactly these attempts, each once, in order
    with store.driver.transaction() as cx:
        rows = cx.fetch("queue_share_for_attempts", {"ids": ids})
    assert [r["name"] for r in rows] == ["other", "q"]
    for g in grants:
        lease = store.attempt_start(session.id, session.epoch, g.attempt.id, g.attempt.fence)
        assert lease.status == "ok", lease


def test_migration_12_keeps_the_attempts_and_drops_only_their_task_key(
    tmp_path: Path,
) -> None:
    """A database at schema version 11, with claimed attempts in it, migrates to 12: the
    attempts are as they were, the attempts' foreign key to the tasks is gone (and only
    it), and the attempts are started and finished as before."""
    eleven = postgres_migrations_up_to(11, tmp_path / "migrations-11")
    with temporary_database() as dsn:
        url = as_url(dsn)
        old = open_store(url, migrate=False)
        try:
            old.driver.migrations = eleven  # type: ignore[attr-defined]
            assert old.migrate() == 11
            queue(old)
            session, _ = worker(old)
            for _ in range(3):
                submit(old)
            grants = [claim_one(old, session) for _ in range(3)]
            before = {g.task.id: old.attempt_list(g.task.id) for g in grants}
        finally:
            old.close()
        with psycopg.connect(dsn) as cx:
            fks_before: list[Any] = cx.execute(_FKS).fetchall()
        assert ("orbit_attempts", "orbit_attempts_task_id_fkey") in fks_before

        new = open_store(url)  # migrates
        try:
            with psycopg.connect(dsn) as cx:
                fks_after = cx.execute(_FKS).fetchall()
            assert fks_after == [
                fk for fk in fks_before if fk != ("orbit_attempts", "orbit_attempts_task_id_fkey")
            ]
            assert {task_id: new.attempt_list(task_id) for task_id in before} == before
            pairs = [(g.attempt.id, g.attempt.fence) for g in grants]
            started = new.attempt_start_many(session.id, session.epoch, pairs)
            assert not any(isinstance(a, Exception) for a in started), started
            items = [(a, f, Outcome.success(None)) for a, f in pairs]
            finished = new.attempt_finish_many(session.id, session.epoch, items)
            assert not any(isinstance(a, Exception) for a in finished), finished
            assert _orphans(new) == []
        finally:
            new.close()


def test_sqlite_keeps_the_attempts_task_key(tmp_path: Path) -> None:
    """SQLite keeps the key (its check is a lookup in the same process)."""
    store = open_store(f"sqlite:///{tmp_path / 'orbit.db'}")
    try:
        store.driver.queries["test_fks"] = (
            "SELECT \"table\" FROM pragma_foreign_key_list('orbit_attempts')"
        )
        with store.driver.transaction() as cx:
            assert [r["table"] for r in cx.fetch("test_fks", {})] == ["orbit_tasks"]
    finally:
        store.close()
