"""PostgreSQL LISTEN: another node's commit wakes this node's dispatcher.

Every commit that readies a task, frees a permit or requests a cancel sends a NOTIFY
(``orbit/store/postgres/queries.sql``), so a node also hears one for each of its own
submits and finishes. The notifications are read straight from libpq on the event loop:
one ``add_reader`` on the connection's socket for the connection's life, then
``consume_input`` and ``notifies`` (C calls) for whatever arrived. psycopg's
``AsyncConnection.notifies()`` costs a future and a reader registration per
notification, which was 8-12 % of the server's CPU with tasks submitted one at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import pq

from orbit.server.gateway import Dispatcher
from orbit.server.revocation import Revocations
from orbit.server.threads import in_thread
from orbit.store.postgres.driver import with_tcp_checks

log = logging.getLogger("orbit.server")

#: another node committed events and sent no other notice (orbit/server/announce.py)
EVENTS_CHANNEL = "orbit_events"
CHANNELS = ("orbit_ready", "orbit_cancel", EVENTS_CHANNEL)


async def connect(dsn: str) -> psycopg.AsyncConnection[Any]:
    """The LISTEN connection: autocommit, with the store's ``TCP_CHECKS``. It only ever
    reads, so without keepalive probes a PostgreSQL gone without a reset would leave the
    node deaf to other nodes' wakes and cancels (but for its slow poll) for hours."""
    return await psycopg.AsyncConnection.connect(with_tcp_checks(dsn), autocommit=True)


async def listen(
    dsn: str,
    origin: str,
    dispatcher: Dispatcher,
    revocations: Revocations | None = None,
    wake_streams: Callable[[], None] | None = None,
) -> None:
    """Run for the server's life, reconnecting (with backoff) whenever the connection
    fails; a reconnect catches up on anything missed meanwhile (``catch_up``).

    The payload of ``orbit_ready`` is ``<origin>:<kind>:<queue>``. One from this node's
    own store is skipped: its ``on_ready``/``on_freed`` already told the dispatcher.
    ``ready`` (a task became ready) always wakes it; ``freed`` (a permit was freed) only
    if a worker's last claim was held back by a cap. ``<origin>:fenced:<session
    id>:<epoch>`` says a session resumed (on the sending node, whose own ``attach``
    closed its older connection there): a connection of it attached here with an older
    epoch is closed. A node of an older version takes it for ``ready``, and its next
    dispatch round closes a fenced connection that takes pushes. ``<origin>:revoked:<token
    id>`` says a token was revoked: the connections opened with it here are closed
    (``revocations``; a node of an older version wakes, and leaves them open).
    ``<origin>:drained:<session id>`` says an operator drained a session: ``drain`` is
    pushed to it if it is attached here (a node of an older version wakes; its next
    claim for the session finds it draining and stops offering to it).
    ``orbit_cancel`` carries ``<session id>:<attempt id>``, pushed to the session if it is
    attached here.

    Every notice from another node also wakes this node's event streams
    (``wake_streams``, orbit/server/streams.py): the commits that send one wrote events.
    ``orbit_events`` (payload ``<origin>``) is sent for those that sent no other
    (orbit/server/announce.py), and does nothing else.
    """
    own = f"{origin}:"

    def deliver(channel: str, payload: str) -> None:
        if wake_streams is not None and not (payload == origin or payload.startswith(own)):
            wake_streams()
        if channel == "orbit_ready":
            if payload.startswith(own):
                return
            kind = payload.split(":", 2)[1:3]
            if kind[:1] == ["freed"]:
                dispatcher.freed_threadsafe()
            elif kind[:1] == ["fenced"]:
                fenced = fenced_notice(kind[1:])
                if fenced is not None:
                    dispatcher.close_fenced(*fenced)
            elif kind[:1] == ["revoked"]:
                if revocations is not None and len(kind) == 2 and kind[1].isalnum():
                    revocations.revoked([kind[1]])
            elif kind[:1] == ["drained"]:
                if len(kind) == 2 and kind[1]:
                    dispatcher.push_drain(kind[1])
            else:
                dispatcher.wake_threadsafe()
        elif channel == "orbit_cancel":
            session_id, _, attempt_id = payload.partition(":")
            dispatcher.push_cancel([(session_id, attempt_id)])

    delay = 0.5
    lost = False
    while True:
        try:
            async with await connect(dsn) as cx:
                for channel in CHANNELS:
                    await cx.execute(f"LISTEN {channel}")
                delay = 0.5
                if wake_streams is not None:  # events missed meanwhile
                    wake_streams()
                await catch_up(dispatcher)
                if revocations is not None:  # a revoke missed meanwhile
                    await revocations.catch_up()
                if lost:
                    log.info("LISTEN connection back; caught up on the notices missed")
                    lost = False
                await read_notifications(cx.pgconn, deliver)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            lost = True
            log.warning("LISTEN connection lost (%s); retrying", type(exc).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)


def fenced_notice(rest: list[str]) -> tuple[str, int] | None:
    """``(session id, epoch)`` from what follows ``<origin>:fenced:`` in a notice, or None
    for anything else. The epoch must be ASCII digits: ``str.isdigit`` also takes ``²``,
    whose ``int()`` raised ValueError out of the notification callback, and the node
    dropped its LISTEN connection (and the notices sent while it reconnected)."""
    if len(rest) != 1:
        return None
    session_id, _, epoch = rest[0].rpartition(":")
    if not session_id or not epoch.isascii() or not epoch.isdigit() or len(epoch) > 18:
        return None
    return session_id, int(epoch)


async def catch_up(dispatcher: Dispatcher) -> None:
    """Once LISTEN is (re)established, make up for the notifications missed while it was
    not: wake the dispatcher (tasks readied, permits freed), and push ``cancel`` for every
    running attempt of a session attached here whose task is `cancelling` (one query).
    Without the latter a cancel NOTIFY sent while the connection was away reached the
    worker only at its next renew. A cancel the worker already heard may be pushed again;
    one NOTIFY'd meanwhile is delivered as well, since LISTEN came first."""
    dispatcher.wake_threadsafe()
    sessions = list(dispatcher.connections)
    if not sessions:
        return
    try:
        pairs = await in_thread(dispatcher.store.attempt_cancelling_for_sessions, sessions)
    except Exception as exc:  # the next renew still says `cancel`
        log.warning("re-checking cancels after LISTEN failed (%s)", type(exc).__name__)
        return
    if pairs:
        dispatcher.push_cancel(pairs)


async def read_notifications(pgconn: pq.abc.PGconn, deliver: Callable[[str, str], None]) -> None:
    """Hand every notification on ``pgconn`` to ``deliver(channel, payload)`` as it
    arrives, until the connection fails: then raise what libpq reported."""
    loop = asyncio.get_running_loop()
    failed: asyncio.Future[None] = loop.create_future()
    fd = pgconn.socket

    def readable() -> None:
        try:
            pgconn.consume_input()
            while (note := pgconn.notifies()) is not None:
                deliver(note.relname.decode(), note.extra.decode())
        except Exception as exc:  # the connection is gone: let the caller reconnect
            if not failed.done():
                failed.set_exception(exc)

    loop.add_reader(fd, readable)
    try:
        readable()  # whatever came in with the replies to LISTEN
        await failed
    finally:
        loop.remove_reader(fd)
