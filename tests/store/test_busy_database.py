"""A database that cannot take a write: its lock held by another process, full, or
read-only. A transaction waits for it about ``StoreConfig.tx_wait_us`` in all, then gives
up with ``DatabaseUnavailable`` (nothing written, one warning logged). A full,
read-only or unreachable database is noted by ``Store.write_failure`` (/readyz) until a
write goes through again; a lock's wait (``DATABASE_BUSY``) is not, since other writes
commit meanwhile and every node meets the same lock. On the server's store threads the
wait counts from when the call was queued for a thread.

It waited with no bound: on SQLite ``busy_timeout`` (10 s) times the retries, plus the
wait for the process's one connection; on PostgreSQL, which had no ``lock_timeout``, for
as long as the lock was held. The client gave up (its 30 s timeout) and the task was
committed later. The lock is held here by a real second connection, for as long as the
test needs it; each test's store waits a fraction of a second before it gives up."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from orbit.core.model import SECOND, TaskSpec
from orbit.server.threads import THREADS, in_thread
from orbit.store import Store, StoreConfig, open_store, sqlite_path
from orbit.store.driver import (
    DATABASE_BUSY,
    DATABASE_FULL,
    DATABASE_READ_ONLY,
    UNAVAILABLE_MESSAGES,
    DatabaseUnavailable,
)
from orbit.store.postgres import driver as postgres_driver
from tests.db_locks import write_lock
from tests.store.helpers import RACE_WAIT, call_bounded, queue, submit

#: each store's wait for the database here (``tx_wait_us``)
WAIT = StoreConfig(tx_wait_us=SECOND // 4)
#: PostgreSQL's lock wait per try here, through the URL (the store keeps a URL's own)
IMPATIENT = "options=-c%20lock_timeout%3D50"


def _open(url: str, config: StoreConfig = WAIT, *, migrate: bool = True) -> Store:
    if sqlite_path(url) is None:
        url = f"{url}{'&' if '?' in url else '?'}{IMPATIENT}"
    return open_store(url, config, migrate=migrate)


def _gave_up(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "orbit.store" and r.levelno == logging.WARNING and "gave up" in r.message
    ]


def _count(store: Store) -> int:
    return len(store.task_list(queue="q"))


def test_a_submit_under_another_connections_lock_gives_up_within_its_wait(
    fresh_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = _open(fresh_url)
    try:
        queue(store)
        caplog.set_level(logging.WARNING, logger="orbit.store")
        with write_lock(fresh_url):
            refused = call_bounded(lambda: submit(store))
            assert isinstance(refused, DatabaseUnavailable), refused
            assert (refused.code, refused.message) == (
                DATABASE_BUSY,
                (
                    "the database is busy: another process or a long transaction holds its lock; "
                    "nothing was written"
                ),
            )
            # a lock's wait leaves /readyz ready: others' writes commit meanwhile, and
            # every node meets the same lock (it was noted, and took healthy nodes out)
            assert store.write_failure() is None
        assert len(_gave_up(caplog)) == 1, caplog.text  # once, not once a try
        assert _count(store) == 0  # nothing was written, and nothing is written later
        submit(store)  # the lock is free: it goes through
        assert _count(store) == 1
        assert store.write_failure() is None
    finally:
        store.close()


@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_transaction_waits_for_this_process_connection_only_within_its_wait(
    fresh_url: str,
) -> None:
    """SQLite's one connection is shared by the process's threads: a transaction that
    holds it (waiting for another process's lock, or a long write) held every other
    thread's with no bound, past their own waits."""
    store = _open(fresh_url)
    release = threading.Event()
    held = threading.Event()

    def hold() -> None:
        with store.driver.transaction():
            held.set()
            release.wait(RACE_WAIT)

    holder = threading.Thread(target=hold, daemon=True)
    try:
        queue(store)
        holder.start()
        assert held.wait(RACE_WAIT)
        refused = call_bounded(lambda: submit(store))
        assert isinstance(refused, DatabaseUnavailable), refused
        assert refused.code == DATABASE_BUSY
        release.set()
        holder.join(RACE_WAIT)
        submit(store)
        assert _count(store) == 1
    finally:
        release.set()
        holder.join(RACE_WAIT)
        store.close()


@pytest.mark.parametrize("backend", ["postgres"])
def test_postgres_connections_wait_for_a_lock_a_bounded_time_unless_set_otherwise(
    fresh_url: str,
) -> None:
    """A pooled connection has ``lock_timeout`` set (once, with its other settings), so
    a lock wait ends and the store can try again or give up; a URL's own is kept."""
    plain = open_store(fresh_url, migrate=True)
    own = _open(fresh_url, migrate=False)
    try:
        default = f"{postgres_driver.LOCK_TIMEOUT_MS // 1000}s"
        for store, expected in ((plain, default), (own, "50ms")):
            with store.driver.transaction() as cx:
                shown = cx._cx.execute("SHOW lock_timeout").fetchone()[0]  # type: ignore[attr-defined]
            assert shown == expected
    finally:
        own.close()
        plain.close()


@contextmanager
def _read_only(url: str, store: Store) -> Iterator[Store]:
    """``store``'s database read-only for the block, and a store that writes to it:
    SQLite's connection with ``PRAGMA query_only`` (SQLITE_READONLY, as a read-only
    file gives), PostgreSQL's database with ``default_transaction_read_only`` (as a
    standby answers), which a new store's connections take."""
    if sqlite_path(url) is not None:
        raw = store.driver._raw()  # type: ignore[attr-defined]
        raw.execute("PRAGMA query_only = ON")
        try:
            yield store
        finally:
            raw.execute("PRAGMA query_only = OFF")
        return
    name = conninfo_to_dict(url)["dbname"]
    with psycopg.connect(url, autocommit=True) as cx:
        cx.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        try:
            reopened = _open(url)  # its schema is current: opening it writes nothing
            try:
                yield reopened
            finally:
                reopened.close()
        finally:
            cx.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')


def test_a_write_to_a_read_only_database_is_refused_as_such(
    fresh_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = _open(fresh_url)
    try:
        queue(store)
        caplog.set_level(logging.WARNING, logger="orbit.store")
        with _read_only(fresh_url, store) as writing:
            refused = call_bounded(lambda: submit(writing))
            assert isinstance(refused, DatabaseUnavailable), refused
            assert refused.code == DATABASE_READ_ONLY
            assert refused.message == "the database is read-only; nothing was written"
            assert writing.write_failure() == (DATABASE_READ_ONLY, refused.message)
            assert writing.queue_list()  # reads go on
        assert len(_gave_up(caplog)) == 1, caplog.text
        assert _count(store) == 0
        submit(store)
        assert _count(store) == 1
    finally:
        store.close()


@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_write_to_a_full_database_is_refused_as_such(
    fresh_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLITE_FULL, as a full disk gives it, from a database held to the pages it has
    (``PRAGMA max_page_count``): it was 500 INTERNAL, and only the log said why."""
    store = _open(fresh_url)
    try:
        queue(store)
        raw = store.driver._raw()  # type: ignore[attr-defined]
        (pages,) = raw.execute("PRAGMA page_count").fetchone()
        raw.execute(f"PRAGMA max_page_count = {pages}")
        caplog.set_level(logging.WARNING, logger="orbit.store")
        big = [TaskSpec(queue="q", handler="h", payload={"x": "y" * 2000}) for _ in range(200)]
        refused = call_bounded(lambda: store.task_submit_many(big))
        assert isinstance(refused, DatabaseUnavailable), refused
        assert refused.code == DATABASE_FULL
        assert refused.message == UNAVAILABLE_MESSAGES[DATABASE_FULL]
        assert store.write_failure() == (DATABASE_FULL, refused.message)
        assert len(_gave_up(caplog)) == 1, caplog.text
        assert _count(store) == 0
        raw.execute("PRAGMA max_page_count = 1073741823")
        submit(store)
        assert _count(store) == 1
        assert store.write_failure() is None
    finally:
        store.close()


def test_a_write_failure_is_forgotten_after_its_window(fresh_url: str) -> None:
    """/readyz says not ready for ``WRITE_FAILURE_S`` after a write gave up on a database
    that cannot take one (here read-only), then ready again although nothing was written
    meanwhile: a node taken out of a balancer's rotation gets no writes to tell it that
    the database is back. A write that gave up on a lock is not noted at all (a
    deliberate change: it was, and a lock one frozen node held on one queue's stripe
    kept every node not ready, so a balancer had no node left)."""
    store = _open(fresh_url)
    try:
        queue(store)
        with write_lock(fresh_url):
            refused = call_bounded(lambda: submit(store))
            assert isinstance(refused, DatabaseUnavailable), refused
            assert refused.code == DATABASE_BUSY
        assert store.write_failure() is None
        with _read_only(fresh_url, store) as writing:
            assert isinstance(call_bounded(lambda: submit(writing)), DatabaseUnavailable)
            assert writing.write_failure() is not None
            assert writing.write_failure(within_s=0.0) is None
    finally:
        store.close()


def test_a_call_whose_wait_ran_out_in_the_threads_queue_is_refused_untried(
    fresh_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server's store calls queue for its ``THREADS`` threads (orbit/server/threads.py).
    A transaction's wait counted from its own start: with every thread held by a submit
    waiting for another process's lock (16 waits of 20 s), a submit queued behind them
    waited its whole wait again once a thread took it, outlived its client's 30 s
    timeout, and committed when the lock was released. Its wait now counts from when it
    was queued: here every thread is held past the wait of a submit queued behind them,
    and that submit is refused at once (``DATABASE_BUSY``), nothing tried or written,
    though nothing holds the database by then. A call queued with its wait left goes
    through."""
    store = _open(fresh_url)
    wait_s = WAIT.tx_wait_us / SECOND
    all_held = threading.Barrier(THREADS + 1, timeout=RACE_WAIT)
    release = threading.Event()

    def hold() -> None:  # as a call waiting for a lock holds its thread
        all_held.wait()
        release.wait(RACE_WAIT)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        holders = [asyncio.ensure_future(in_thread(hold)) for _ in range(THREADS)]
        try:
            await loop.run_in_executor(None, all_held.wait)  # every store thread held
            late = asyncio.ensure_future(in_thread(submit, store))
            await asyncio.sleep(0)  # it is queued (``in_thread`` ran to its await)
            over = time.monotonic() + wait_s
            while time.monotonic() <= over:  # its wait runs out while it is queued
                await asyncio.sleep(over - time.monotonic() + 0.01)
        finally:
            release.set()
            await asyncio.gather(*holders)
        with pytest.raises(DatabaseUnavailable) as refused:
            await late
        assert refused.value.code == DATABASE_BUSY
        assert _count(store) == 0  # nothing was written, and nothing is written later
        await in_thread(submit, store)  # queued with its wait left: it goes through
        assert _count(store) == 1

    try:
        queue(store)
        caplog.set_level(logging.WARNING, logger="orbit.store")
        asyncio.run(scenario())
        said = [r.message for r in caplog.records if r.name == "orbit.store"]
        assert len(said) == 1 and "a transaction was not tried" in said[0], said
        assert store.write_failure() is None
    finally:
        release.set()
        store.close()


def test_a_read_kept_from_sqlites_connection_is_busy_not_a_failure(fresh_url: str) -> None:
    """SQLite's read connection, held by another read (a long one): a read waits
    ``busy_timeout`` for it at most, then is refused as the database being busy (503),
    not as a failure (a 500 ``INTERNAL`` with a traceback). (It was the one connection,
    held by a transaction waiting for another process's write lock: reads now have their
    own, test_reads_beside_writers.py.)"""
    if sqlite_path(fresh_url) is None:
        pytest.skip(
            "PostgreSQL's reads take their own pooled connection: none waits behind a write"
        )
    store = open_store(fresh_url, WAIT)
    try:
        queue(store)
        store.driver.busy_timeout_ms = 50  # type: ignore[attr-defined]  # the read's wait
        held, release = threading.Event(), threading.Event()

        def hold() -> None:  # as a long read holds the read connection
            with store.driver._read_lock:  # type: ignore[attr-defined]
                held.set()
                release.wait()

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert held.wait(RACE_WAIT)
            with pytest.raises(DatabaseUnavailable) as refused:
                store.task_list(queue="q")
            assert refused.value.code == DATABASE_BUSY
            assert store.write_failure() is None  # a read: no write failed
        finally:
            release.set()
            holder.join()
        assert store.task_list(queue="q") == []
    finally:
        store.close()
