"""Small builders shared by the store tests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from orbit.core.model import Capability, Grant, Outcome, Session, TaskSpec
from orbit.server.gateway import Dispatcher
from orbit.server.metrics import Metrics
from orbit.store import Store
from orbit.store import store as store_module
from orbit.store.postgres.driver import PostgresDriver, to_positional


class Watched(Dispatcher):
    """A node's dispatcher that says when it is first woken: ``listen`` wakes it once
    LISTEN is established (the tests of notices from another node wait for that)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store, poll_interval=60, metrics=Metrics(store))
        self.listening = asyncio.Event()

    def wake_threadsafe(self, *args: Any) -> None:
        super().wake_threadsafe(*args)
        self.listening.set()


#: a safety net for the race tests' waits: every one ends on an event long before
RACE_WAIT = 30.0


def queue(
    store: Store,
    name: str = "q",
    max_concurrency: int = 10,
    rate: float = 0,
    burst: int | None = None,
) -> None:
    store.queue_create(name, max_concurrency=max_concurrency, rate=rate, burst=burst)


def submit(store: Store, queue: str = "q", handler: str = "h", **kw: Any) -> str:
    return store.task_submit(TaskSpec(queue=queue, handler=handler, **kw)).task.id


def worker(
    store: Store,
    handlers: dict[str, int] | None = None,
    max_concurrency: int = 10,
    name: str = "w",
    node: str = "n1",
) -> tuple[Session, str]:
    caps = [Capability(h, c) for h, c in (handlers or {"h": 10}).items()]
    return store.session_open(
        name=name, node_id=node, capabilities=caps, max_concurrency=max_concurrency
    )


def claim_one(store: Store, session: Session) -> Grant:
    grants = store.attempt_claim_many(session.id, session.epoch, 1)
    assert len(grants) == 1, grants
    return grants[0]


def run_one(store: Store, session: Session) -> Grant:
    """Claim and start one task."""
    g = claim_one(store, session)
    store.attempt_start(session.id, session.epoch, g.attempt.id, g.attempt.fence)
    return g


def start_and_succeed(store: Store, session: Session, grants: list[Grant]) -> None:
    """Start the granted attempts in one batch and finish each with a success in
    another; neither batch refuses any of them."""
    pairs = [(g.attempt.id, g.attempt.fence) for g in grants]
    assert not any(
        isinstance(r, Exception) for r in store.attempt_start_many(session.id, session.epoch, pairs)
    )
    items = [(a, f, Outcome.success(None)) for a, f in pairs]
    assert not any(
        isinstance(r, Exception)
        for r in store.attempt_finish_many(session.id, session.epoch, items)
    )


def postgres_driver(store: Store, queries: dict[str, str]) -> PostgresDriver:
    """The store's PostgreSQL driver, with test queries (psycopg's ``%(name)s`` form)
    added to the named ones its statements are made from."""
    drv = store.driver
    assert isinstance(drv, PostgresDriver)
    drv.queries.update(queries)
    return drv


def blind_first_look(store: Store, monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Make the store's first look for existing keys find none, as if another submit
    took a key just after it; return how many looks there have been."""
    looks = 0
    existing = store._existing_by_key

    def blind_once(tx: Any, batch: Any) -> Any:
        nonlocal looks
        looks += 1
        return {} if looks == 1 else existing(tx, batch)

    monkeypatch.setattr(store, "_existing_by_key", blind_once)
    return lambda: looks


def pause_after_the_clock(
    monkeypatch: pytest.MonkeyPatch, node: Store
) -> tuple[threading.Event, threading.Event]:
    """Hold every transaction of ``node`` just after it reads the clock, until the second
    event is set; the first is set when one gets there. A claim reads the clock after its
    session and caps, so a claim held here has weighed them and not yet written: the
    moment a race test makes its other node's change in."""
    reached, go_on = threading.Event(), threading.Event()
    read_clock = store_module._Tx.clock

    def pausing_clock(self: Any) -> int:
        now = read_clock(self)
        if self._store is node:
            reached.set()
            assert go_on.wait(RACE_WAIT)
        return now

    monkeypatch.setattr(store_module._Tx, "clock", pausing_clock)
    return reached, go_on


def until_done_or_waiting_on_a_lock(thread: threading.Thread, url: str) -> None:
    """Return once ``thread`` has ended or some session of this database waits for a
    lock."""
    query = (
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    deadline = time.monotonic() + RACE_WAIT
    with psycopg.connect(url, autocommit=True) as watch:
        while thread.is_alive() and watch.execute(query).fetchone() == (0,):
            assert time.monotonic() < deadline, "the thread neither ended nor waited"
            thread.join(0.01)


def _pg_literal(value: Any) -> str:
    """A parameter as SQL text for ``EXECUTE``: NULL, a number, a quoted string, or a
    text array for a list."""
    if value is None:
        return "NULL"
    if isinstance(value, list | tuple):
        return "'{" + ",".join(value) + "}'"
    return repr(value)


def call_bounded(call: Callable[[], Any], what: str = "the call") -> Any:
    """``call()``'s value or error, run on a thread given ``RACE_WAIT`` at most (a safety
    net: it ends long before, unless it waits for a lock with no bound)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(RACE_WAIT)
    assert not thread.is_alive(), f"{what} was still waiting for the lock"
    return out[0]


def query_plan(store: Store, query: str, params: dict[str, Any], *, seqscan: bool = True) -> str:
    """How the database reads a named query, as text: on SQLite its query plan, on
    PostgreSQL the generic plan of the prepared statement, which the driver runs once a
    statement has been planned for its parameters five times. ``seqscan=False`` turns
    PostgreSQL's sequential scans off, where a tiny table would be read whole otherwise."""
    sql = store.driver.queries[query]
    if store.backend == "sqlite":
        store.driver.queries["test_plan"] = "EXPLAIN QUERY PLAN " + sql
        with store.driver.transaction() as cx:
            return " ".join(str(r["detail"]) for r in cx.fetch("test_plan", params))
    assert isinstance(store.driver, PostgresDriver)
    positional, names = to_positional(sql)
    with psycopg.connect(store.driver.dsn, autocommit=True) as raw:
        raw.execute("SET plan_cache_mode = force_generic_plan")
        if not seqscan:
            raw.execute("SET enable_seqscan = off")
        raw.execute(f"PREPARE test_plan AS {positional}")
        literals = ", ".join(_pg_literal(params[n]) for n in names)
        execute = f"EXECUTE test_plan({literals})" if names else "EXECUTE test_plan"
        rows = raw.execute(f"EXPLAIN {execute}").fetchall()
    return " ".join(str(r[0]) for r in rows)
