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
import time
from collections.abc import Callable
from typing import Any

import psycopg
from prometheus_client import Gauge
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict

from orbit.server.gateway import Dispatcher
from orbit.server.revocation import Revocations
from orbit.server.threads import in_thread
from orbit.store.postgres.driver import server_refusal, unnamed, with_tcp_checks

log = logging.getLogger("orbit.server")

#: another node committed events and sent no other notice (orbit/server/announce.py)
EVENTS_CHANNEL = "orbit_events"
CHANNELS = ("orbit_ready", "orbit_cancel", EVENTS_CHANNEL)


#: the longest pause between two tries to connect it again
RETRY_MAX_S = 10.0


def failure_said(exc: BaseException, dsn: str) -> str:
    """How a failed connection is logged (the LISTEN connection's, the ``orbit_events``
    one's) and told by /readyz: the error's type and the database's reason, with no
    secret in it. A refusal by the server is its own words (``too many connections for
    role "…"``, ``database "…" is not currently accepting connections``), as the pools'
    ``connect_refusal`` gives them; any other failure the first line of libpq's message
    after its ``connection to server at "h", port p failed:`` (``Connection refused``,
    ``terminating connection due to administrator command``). Every name the message
    quotes (a host, a user, a database) is left out, and the URL and its password too,
    should a message repeat them. Only the type was logged, ``OperationalError``, every
    10 s, which left an operator to guess why."""
    name = type(exc).__name__
    line = server_refusal(exc)
    if line is None:
        first = str(exc).strip().partition("\n")[0]
        line = first.rpartition(" failed: ")[2]
    for secret in (dsn, _password(dsn)):
        if secret and len(secret) >= 4:  # a shorter one would garble the words, not hide
            line = line.replace(secret, "…")
    line = unnamed(line).strip()[:200]
    return f"{name}: {line}" if line else name


def _password(dsn: str) -> str | None:
    try:
        password = conninfo_to_dict(dsn).get("password")
    except Exception:  # a DSN psycopg cannot read: its own error says so
        return None
    return str(password) if password else None


class ListenLink:
    """The state of the node's LISTEN connection, for the log, /readyz
    (``ListenLink.down``) and ``orbit_listen_connected`` (1 while it is up, 0 while it is
    not: before it first connects, and while it is away). Read on the event loop."""

    def __init__(self, gauge: Gauge | None = None) -> None:
        self._gauge = gauge
        self.connected = False
        #: when (``time.monotonic``) it was last connected or lost, or the link made
        self.since = time.monotonic()
        #: tries that failed since it was last up (the loss of an established one too)
        self.failures = 0
        #: why the last try failed (``failure_said``); None while it is up
        self.reason: str | None = None
        if gauge is not None:
            gauge.set(0)

    def up(self) -> tuple[float, int] | None:
        """It is connected (again): how long it was down and how many tries failed, if
        any did; None if none failed (its first connect)."""
        was = None if self.failures == 0 else (time.monotonic() - self.since, self.failures)
        self.connected, self.since, self.failures, self.reason = True, time.monotonic(), 0, None
        if self._gauge is not None:
            self._gauge.set(1)
        return was

    def failed(self, reason: str) -> bool:
        """A try failed, or the connection was lost, for ``reason``: whether that is news
        (the first failure since it was up, or another reason than the last), to log."""
        if self.connected:
            self.connected, self.since = False, time.monotonic()
            if self._gauge is not None:
                self._gauge.set(0)
        self.failures += 1
        news = reason != self.reason
        self.reason = reason
        return news

    def down(self) -> dict[str, Any] | None:
        """What /readyz adds to its body while the connection is down and a try has
        failed: how long, how many tries, and why the last failed. None while it is up,
        and while its first connect is under way."""
        if self.connected or self.failures == 0:
            return None
        return {
            "connected": False,
            "down_s": round(time.monotonic() - self.since, 1),
            "failed_tries": self.failures,
            "reason": self.reason,
            "message": "other nodes' wakes, cancels, drains, fences and revokes reach this "
            "node only by its polls meanwhile",
        }


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
    link: ListenLink | None = None,
) -> None:
    """Run for the server's life, reconnecting (with backoff) whenever the connection
    fails; a reconnect catches up on anything missed meanwhile (``catch_up``). While it
    is away the node logs one WARNING with the database's reason (``failure_said``), again
    only if the reason changes, and one INFO once it is back; ``link`` (``ListenLink``)
    holds its state for /readyz and ``orbit_listen_connected``.

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

    if link is None:
        link = ListenLink()
    delay = 0.5
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
                was = link.up()
                if was is not None:
                    log.info(
                        "LISTEN connection back after %.1f s and %d failed tries; caught up "
                        "on the notices missed",
                        *was,
                    )
                await read_notifications(cx.pgconn, deliver)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = failure_said(exc, dsn)
            if link.failed(reason):
                log.warning(
                    "LISTEN connection down: %s; retrying every %g s at most (other nodes' "
                    "wakes and cancels reach this node only by its polls meanwhile)",
                    reason,
                    RETRY_MAX_S,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)


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
