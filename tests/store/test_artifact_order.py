"""The migration that puts a task's artifact list in commit order (PostgreSQL 0010,
SQLite 0006), on a database that already holds artifacts: those ready before it keep
their id order and come first, an upload still going on gets its place when it is
committed, after them, and a cursor issued before it (an artifact id) still resumes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from orbit.core.errors import Code, OrbitError
from orbit.store import open_store
from orbit.store.driver import migration_files
from tests.invariants import check_all
from tests.store.helpers import queue, run_one, submit, worker


def test_artifacts_stored_before_the_migration_keep_their_order_and_come_first(
    fresh_url: str, tmp_path: Path
) -> None:
    store = open_store(fresh_url, migrate=False)
    try:
        shipped = migration_files(store.driver.migrations)
        # the schema just before the artifact order (later migrations follow it)
        at = [i for i, (_, path) in enumerate(shipped) if path.name.endswith("_artifact_order.sql")]
        assert len(at) == 1
        older = tmp_path / "older"
        older.mkdir()
        for _, path in shipped[: at[0]]:
            (older / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
        store.driver.migrations = older
        store.migrate()  # the schema before the migration
        queue(store)
        tid = submit(store)
        s, _ = worker(store)
        a = run_one(store, s).attempt
        began = [
            store.artifact_begin(s.id, s.epoch, a.id, a.fence, name=n, content_type="a/b")
            for n in ("first", "second", "going-on")
        ]
        assert began == sorted(began)
        for artifact_id in began:
            store.artifact_write(artifact_id, 0, b"x")
        # committed as the older schema did: ready, nothing more
        ready = ", ".join(f"'{i}'" for i in began[:2])
        store.driver.queries["test_ready"] = (
            f"UPDATE orbit_artifacts SET state = 'ready', size = 1, "
            f"sha256 = '{hashlib.sha256(b'x').hexdigest()}' WHERE id IN ({ready})"
        )
        store._tx(lambda tx: tx.execute("test_ready"))

        store.driver.migrations = shipped[-1][1].parent
        assert store.migrate() == shipped[-1][0]  # through the artifact order, to the latest
        listed = store.artifact_list(tid)
        assert [x.id for x in listed] == began[:2]
        assert [x.ready_seq for x in listed] == [1, 2]
        # the last place drawn is the migration's largest: a cursor, not one past it
        assert store.artifact_list(tid, after_seq=2) == []
        with pytest.raises(OrbitError) as err:
            store.artifact_list(tid, after_seq=3)
        assert err.value.code == Code.INVALID_ARGUMENT
        store.artifact_commit(
            s.id, s.epoch, a.id, a.fence, began[2], size=1, sha256=hashlib.sha256(b"x").hexdigest()
        )
        assert [x.id for x in store.artifact_list(tid)] == began
        assert store.artifact_list(tid)[-1].ready_seq == 3  # after every place given before
        assert [x.id for x in store.artifact_list(tid, after_id=began[0])] == began[1:]
        assert check_all(store) == []
    finally:
        store.close()
