"""What wakes event streams (orbit/server/streams.py), part by part, on real databases.

- ``Store.on_events`` is called once after each commit that wrote events, saying
  whether the commit also sent the other nodes a notice; never after a read, nor after
  a transaction that was refused (which changed nothing).
- ``Hint``: the first raise is acted on at once; one raised during the gap that follows
  is acted on after it, not lost.
- ``Streams.wake_threadsafe``: any number of calls before the loop runs become one wake,
  which every stream waiting on ``woken()`` sees; nothing while no stream is open.
- PostgreSQL: ``Announcer`` sends one ``orbit_events`` notice for a burst of calls, and
  ``listen`` wakes the streams on another node's notices and not on its own.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from orbit.core.errors import OrbitError
from orbit.server.announce import Announcer
from orbit.server.gateway import Dispatcher
from orbit.server.hints import Hint
from orbit.server.listen import EVENTS_CHANNEL, listen
from orbit.server.metrics import Metrics
from orbit.server.streams import Streams
from orbit.store import Store
from tests.store.helpers import claim_one, queue, submit, worker

_WAIT = 10.0  # a safety net: what is awaited comes as soon as LISTEN delivers it


def test_on_events_follows_each_commit_that_wrote_events(store: Store) -> None:
    calls: list[bool] = []
    store.on_events = calls.append
    queue(store)  # a queue.created event, and no notice
    assert calls == [False]
    task_id = submit(store)  # submitted: orbit_ready ready:q goes with it
    assert calls[1:] == [True]
    store.task_get(task_id)
    store.event_read()
    assert len(calls) == 2  # reads write no events
    session, _ = worker(store)
    calls.clear()
    claim_one(store, session)  # the claim's events, with no notice
    assert calls == [False]
    calls.clear()
    with pytest.raises(OrbitError):
        submit(store, queue="nope")  # refused: nothing written, nobody woken
    with pytest.raises(OrbitError):
        store.queue_create("q", max_concurrency=1, rate=0)  # taken
    assert calls == []
    store.task_cancel(task_id)  # claimed: ended at once, its permit freed (a notice)
    assert calls == [True]


def test_a_hint_raised_during_its_gap_is_acted_on_after_it() -> None:
    async def run() -> list[int]:
        acts: list[int] = []
        done = asyncio.Event()

        def act() -> None:
            acts.append(len(acts))
            done.set()

        hint = Hint(act, gap=0.01)
        hint.bind(asyncio.get_running_loop())
        hint.raise_threadsafe()
        await asyncio.sleep(0)
        assert acts == [0]  # at once
        done.clear()
        await asyncio.to_thread(hint.raise_threadsafe)  # during the gap, from a thread
        await asyncio.wait_for(done.wait(), _WAIT)
        return acts

    assert asyncio.run(run()) == [0, 1]


def test_a_burst_of_wakes_is_one_wake_for_every_open_stream() -> None:
    async def run() -> None:
        streams = Streams(limit=10, poll_s=60, keepalive_s=60)
        streams.bind(asyncio.get_running_loop())
        first = streams.woken()
        streams.wake_threadsafe()  # no stream open: nothing at all
        await asyncio.sleep(0)
        assert streams.woken() is first and not first.is_set()
        streams.admit()
        for _ in range(10_000):  # before the loop runs any of them
            streams.wake_threadsafe()
        await asyncio.sleep(0)
        assert first.is_set()
        second = streams.woken()
        assert second is not first
        await asyncio.sleep(0)
        assert not second.is_set()  # one wake, not 10,000
        await asyncio.to_thread(streams.wake_threadsafe)  # from the store's threads
        await asyncio.wait_for(second.wait(), _WAIT)
        streams.close()  # shutting down: whatever waits for a wake stops waiting
        assert streams.woken().is_set()

    asyncio.run(run())


def test_a_burst_of_commits_sends_one_orbit_events_notice(store: Store) -> None:
    if store.backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    dsn: str = store.driver.dsn  # type: ignore[attr-defined]

    async def run() -> None:
        announcer = Announcer(dsn, store.origin)
        announcer.bind(asyncio.get_running_loop())
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as other:
            await other.execute(f"LISTEN {EVENTS_CHANNEL}")
            sending = asyncio.create_task(announcer.run())
            try:
                for _ in range(10_000):  # before the loop runs any of them
                    announcer.announce_threadsafe()
                async with asyncio.timeout(_WAIT):
                    async for note in other.notifies():
                        assert (note.channel, note.payload) == (EVENTS_CHANNEL, store.origin)
                        break
                    while announcer.sent == 0:  # the sender hears its reply after we do
                        await asyncio.sleep(0.01)
                assert announcer.sent == 1
                assert not announcer._due.is_set()  # nothing more is owed
            finally:
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)

    asyncio.run(run())


def test_listen_wakes_the_streams_on_other_nodes_notices_not_its_own(store: Store) -> None:
    if store.backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    dsn: str = store.driver.dsn  # type: ignore[attr-defined]
    woken: list[str] = []

    async def run() -> None:
        dispatcher = Dispatcher(store, poll_interval=60, metrics=Metrics(store))
        dispatcher.bind(asyncio.get_running_loop())
        got = asyncio.Event()

        def wake() -> None:
            woken.append("wake")
            got.set()

        listening = asyncio.create_task(listen(dsn, store.origin, dispatcher, None, wake))
        try:
            async with asyncio.timeout(_WAIT):
                await got.wait()  # once LISTEN is up: for whatever was missed before
            got.clear()
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as cx:
                # the node's own notices first: a session's notices arrive in order
                for channel, payload in (
                    (EVENTS_CHANNEL, store.origin),
                    ("orbit_ready", f"{store.origin}:ready:q"),
                    (EVENTS_CHANNEL, "another-node"),
                ):
                    await cx.execute("SELECT pg_notify(%s, %s)", (channel, payload))
            async with asyncio.timeout(_WAIT):
                await got.wait()
            woken.append("other")
            got.clear()
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as cx:
                await cx.execute("SELECT pg_notify('orbit_ready', 'another-node:ready:q')")
            async with asyncio.timeout(_WAIT):
                await got.wait()
        finally:
            listening.cancel()
            await asyncio.gather(listening, return_exceptions=True)

    asyncio.run(run())
    assert woken == ["wake", "wake", "other", "wake"]


def test_the_announcer_replaces_a_connection_found_dead(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A PostgreSQL restart (here: its backend terminated) closes the announcer's
    connection; the next notice goes out on a new one, not after a failure's retry."""
    if store.backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    dsn: str = store.driver.dsn  # type: ignore[attr-defined]

    async def next_notice(other: psycopg.AsyncConnection[object]) -> str:
        async with asyncio.timeout(_WAIT):
            async for note in other.notifies():
                return note.payload
        raise AssertionError("the notices ended")

    async def run() -> None:
        announcer = Announcer(dsn, store.origin)
        announcer.bind(asyncio.get_running_loop())
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as other:
            await other.execute(f"LISTEN {EVENTS_CHANNEL}")
            sending = asyncio.create_task(announcer.run())
            try:
                announcer.announce_threadsafe()
                assert await next_notice(other) == store.origin
                async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as cx:
                    ended = await cx.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND query LIKE 'SELECT pg_notify%'"
                    )
                    assert await ended.fetchall() == [(True,)]
                announcer._due.set()  # as the hint does once its gap is over
                assert await next_notice(other) == store.origin
            finally:
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)

    asyncio.run(run())
    assert "sending orbit_events failed" not in caplog.text
