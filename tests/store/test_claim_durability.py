"""Claims commit without waiting for the disk; every other transaction waits.

A claim only reserves a task, so losing it in a database crash must be harmless: the
task is queued again and the worker's start of the vanished attempt is refused. These
tests check the durability level each transaction really runs with, and replay that
crash by opening a copy of the database taken before the claim (what recovery would
bring back if the claim's commit never reached the disk).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from orbit.core.errors import Code, OrbitError
from orbit.core.model import Outcome
from orbit.store import Store, open_store
from tests.pg import ADMIN_DSN, as_url, temporary_database
from tests.store.helpers import claim_one, queue, submit, worker

#: the safety level a transaction runs with, as each backend reports it
SHOW_LEVEL = {"postgres": "SHOW synchronous_commit", "sqlite": "PRAGMA synchronous"}
RELAXED = {"postgres": "off", "sqlite": 1}  # SQLite: 1 = NORMAL
DURABLE = {"postgres": "on", "sqlite": 2}  # SQLite: 2 = FULL


def _level(store: Store, *, durable: bool) -> Any:
    store.driver.queries["test_show_level"] = SHOW_LEVEL[store.backend]
    with store.driver.transaction(durable=durable) as cx:
        row = cx.fetch("test_show_level", {})[0]
    return next(iter(row.values()))


def test_a_relaxed_transaction_runs_relaxed_and_the_next_one_is_durable_again(
    store: Store,
) -> None:
    backend = store.backend
    assert _level(store, durable=True) == DURABLE[backend]
    assert _level(store, durable=False) == RELAXED[backend]
    # SQLite's one connection is durable again; PostgreSQL's relaxed transactions run on
    # connections of their own, and no durable transaction ever runs on one of those
    assert _level(store, durable=True) == DURABLE[backend]


@pytest.mark.parametrize("backend", ["postgres"])
def test_every_relaxed_connection_is_relaxed_and_no_durable_one_is(store: Store) -> None:
    """PostgreSQL keeps a few connections set to ``synchronous_commit = off`` for claims
    (set once when the pool opens each): two held at once are two connections, both
    relaxed, while the durable pool's are not."""
    show = "SHOW synchronous_commit"
    with (
        store.driver.transaction(durable=False) as a,
        store.driver.transaction(durable=False) as b,
        store.driver.transaction() as c,
    ):
        levels = [cx._cx.execute(show).fetchone()[0] for cx in (a, b, c)]  # type: ignore[attr-defined]
        pids = {cx._cx.info.backend_pid for cx in (a, b, c)}  # type: ignore[attr-defined]
    assert levels == ["off", "off", "on"] and len(pids) == 3


def test_a_failed_relaxed_transaction_leaves_the_next_one_durable(store: Store) -> None:
    with pytest.raises(RuntimeError), store.driver.transaction(durable=False):
        raise RuntimeError("the work failed")
    assert _level(store, durable=True) == DURABLE[store.backend]


class _Recorder:
    """Passes every transaction through to the real driver, noting its durability."""

    def __init__(self, store: Store) -> None:
        self.real = store.driver.transaction
        self.levels: list[bool] = []

    def __call__(self, *, durable: bool = True, **kw: Any) -> AbstractContextManager[Any]:
        self.levels.append(durable)
        return self.real(durable=durable, **kw)


def test_only_the_claim_is_relaxed(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    queue(store)
    recorder = _Recorder(store)
    monkeypatch.setattr(store.driver, "transaction", recorder)
    task_id = submit(store)
    session, _ = worker(store)
    steps = [recorder.levels.copy()]
    grant = claim_one(store, session)
    steps.append(recorder.levels[len(steps[0]) :])
    before = len(recorder.levels)
    store.attempt_start(session.id, session.epoch, grant.attempt.id, grant.attempt.fence)
    store.attempt_finish(
        session.id, session.epoch, grant.attempt.id, grant.attempt.fence, Outcome.success(None)
    )
    steps.append(recorder.levels[before:])
    assert steps == [[True, True], [False], [True, True]]
    assert store.task_get(task_id).state == "succeeded"


@contextmanager
def _copies(backend: str, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A database URL and a function that snapshots it into a second URL."""
    if backend == "sqlite":
        live = tmp_path / "live.db"

        def snapshot_sqlite(store: Store) -> str:
            copy = tmp_path / "before-claim.db"
            with sqlite3.connect(live) as src, sqlite3.connect(copy) as dst:
                src.backup(dst)
            return f"sqlite:///{copy}"

        yield f"sqlite:///{live}", snapshot_sqlite
        return
    with temporary_database() as dsn:
        url = as_url(dsn)
        copies: list[str] = []

        def snapshot_pg(store: Store) -> str:
            # CREATE DATABASE … TEMPLATE needs the source to have no connections
            store.close()
            name = f"{url.rsplit('/', 1)[1]}_copy"
            with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
                admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{url.rsplit("/", 1)[1]}"')
            copies.append(name)
            return f"{url.rsplit('/', 1)[0]}/{name}"

        try:
            yield url, snapshot_pg
        finally:
            with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
                for name in copies:
                    admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_claim_undone_by_a_database_crash_runs_nothing(backend: str, tmp_path: Path) -> None:
    with _copies(backend, tmp_path) as (url, snapshot):
        store = open_store(url)
        queue(store)
        task_id = submit(store)
        session, _ = worker(store)
        before_claim = snapshot(store)
        if backend == "postgres":
            store = open_store(url)
        lost = claim_one(store, session)  # committed, then "lost" with the crash
        store.close()

        recovered = open_store(before_claim)
        try:
            assert recovered.task_get(task_id).state == "queued"
            with pytest.raises(OrbitError) as refused:
                recovered.attempt_start(
                    session.id, session.epoch, lost.attempt.id, lost.attempt.fence
                )
            assert refused.value.code == Code.ATTEMPT_NOT_FOUND
            assert recovered.task_get(task_id).state == "queued"  # the refusal changed nothing

            # claimed again: a new attempt, which runs; the lost one stays refused
            again = claim_one(recovered, session)
            assert again.attempt.id != lost.attempt.id
            recovered.attempt_start(
                session.id, session.epoch, again.attempt.id, again.attempt.fence
            )
            with pytest.raises(OrbitError) as late:
                recovered.attempt_finish(
                    session.id,
                    session.epoch,
                    lost.attempt.id,
                    lost.attempt.fence,
                    Outcome.success("from the lost claim"),
                )
            assert late.value.code == Code.ATTEMPT_NOT_FOUND
            recovered.attempt_finish(
                session.id,
                session.epoch,
                again.attempt.id,
                again.attempt.fence,
                Outcome.success("ran once"),
            )
            task = recovered.task_get(task_id)
            assert task.state == "succeeded"
            assert task.attempts_used == 1
        finally:
            recovered.close()
