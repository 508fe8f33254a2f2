"""PostgreSQL: the node's ``orbit_events`` notices while the database refuses the
announcer's connection (here: closed to new connections, as a database or role whose
``CONNECTION LIMIT`` the pools have reached refuses one more).

Each try, one a second, logged ``sending orbit_events failed (OperationalError)``: a
line a second for as long as it lasted, and never why. It is now one WARNING with the
database's reason (no name the server's message quotes), and one INFO once a notice
goes out again, with the count of the tries that failed. The announcer is the real one,
on a real database; its pause between tries is cut short here."""

from __future__ import annotations

import asyncio
import logging

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from orbit.server import announce
from orbit.server.announce import Announcer
from orbit.server.listen import EVENTS_CHANNEL
from tests.pg import ADMIN_DSN

_WAIT = 30.0  # a safety net: what is awaited comes long before


def test_a_refused_announcer_says_why_once_and_when_it_sends_again(
    backend: str, fresh_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend != "postgres":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    dsn = fresh_url  # a database of the test's own: closed to connections for a while
    name = str(conninfo_to_dict(dsn)["dbname"])
    origin = "node-a"
    monkeypatch.setattr(announce, "RETRY_S", 0.05)

    async def run() -> None:
        announcer = Announcer(dsn, origin)
        announcer.bind(asyncio.get_running_loop())
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as other:
            await other.execute(f"LISTEN {EVENTS_CHANNEL}")
            sending = asyncio.create_task(announcer.run())
            try:
                with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
                    try:
                        admin.execute(f'ALTER DATABASE "{name}" WITH allow_connections false')
                        announcer.announce_threadsafe()  # its first connect: refused
                        async with asyncio.timeout(_WAIT):
                            while announcer.failures < 5:
                                await asyncio.sleep(0.01)
                    finally:
                        admin.execute(f'ALTER DATABASE "{name}" WITH allow_connections true')
                async with asyncio.timeout(_WAIT):
                    async for note in other.notifies():
                        assert note.payload == origin
                        break
                    # The notice can reach this connection before the announcer's own
                    # call returns: cancelled then, it would never log that it sent one.
                    while announcer.failing is not None:
                        await asyncio.sleep(0.01)
            finally:
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)

    caplog.set_level(logging.INFO, logger="orbit.server")
    asyncio.run(run())
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "orbit_events" in r.message]
    assert len(said) == 2, caplog.text
    refused = 'OperationalError: database "…" is not currently accepting connections'
    assert said[0] == (
        logging.WARNING,
        f"sending orbit_events failed: {refused}; trying again every 0.05 s (other nodes' "
        "event streams hear of this node's events by their polls meanwhile)",
    )
    level, again = said[1]
    assert level == logging.INFO
    assert again.startswith("orbit_events sent again, after ")
    assert int(again.split()[-3]) >= 5  # the tries that failed
    assert name not in caplog.text
