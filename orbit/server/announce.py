"""PostgreSQL: tell the other nodes' event streams that this node committed events.

Most commits that write events already send the other nodes a notice (``orbit_ready``
for a task readied or a permit freed, ``orbit_cancel``), and a node's LISTEN wakes its
streams on any of them (orbit/server/listen.py). The rest (a claim, a start, a
progress report, a queue's settings) send none, and a NOTIFY in each of those
transactions would cost every one of them, on the drain's path, a write and the
commit-time lock that serialises notifying commits. So this node sends the notice
itself, after the commit and outside it: ``announce_threadsafe`` (called from
``Store.on_events``) only marks it due, and one ``NOTIFY orbit_events, '<origin>'`` goes
out on a connection of its own, at most one every ``GAP_S``, however many commits asked
for it meanwhile. A node skips its own (its streams were woken in-process).

A notice lost (this connection away, a node of an older version that sends none) only
delays the other nodes' streams until their next poll: a wake is a hint, and a stream
always reads from its cursor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import psycopg

from orbit.server.hints import Hint
from orbit.server.listen import EVENTS_CHANNEL, connect, failure_said

log = logging.getLogger("orbit.server")

#: the least time between two notices: a burst of commits sends one per gap. The first
#: commit after a quiet spell is announced at once; in a busy spell the finishes' own
#: notices (``freed``) wake the other nodes far more often than this anyway, and ten
#: notices a second cost the node a fraction of what fifty did (docs/benchmarks/history.md)
GAP_S = 0.1
#: the pause before connecting again after the connection failed
RETRY_S = 1.0


class Announcer:
    """Sends this node's coalesced ``orbit_events`` notices."""

    def __init__(self, dsn: str, origin: str) -> None:
        self.dsn = dsn
        self.origin = origin
        self.sent = 0  # notices sent (tests)
        #: why sending fails (``failure_said``), None while it goes through: logged when
        #: it changes, not at every try (one a second while the database refused it)
        self.failing: str | None = None
        self.failures = 0  # tries that failed since the last notice sent
        self._due = asyncio.Event()
        self._hint = Hint(self._due.set, GAP_S)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._hint.bind(loop)

    def announce_threadsafe(self) -> None:
        """Events were committed with no notice: send one soon. An attribute write per
        call, and at most one hop to the loop per ``GAP_S`` (``Hint``)."""
        self._hint.raise_threadsafe()

    async def run(self) -> None:
        """For the server's life: send a notice whenever one is due (at most one per
        ``GAP_S``, or one per round trip if that is longer). A connection found dead (a
        PostgreSQL restart closes it) is replaced at once; a notice that cannot be sent
        is tried again after ``RETRY_S``, and meanwhile the other nodes' polls cover: one
        WARNING with the database's reason when sending starts failing (again only if the
        reason changes), one INFO once a notice goes out again."""
        cx: psycopg.AsyncConnection[Any] | None = None
        try:
            while True:
                await self._due.wait()
                self._due.clear()
                for fresh in (cx is None, True):
                    try:
                        if fresh:
                            cx = await self._reconnect(cx)
                        assert cx is not None
                        await cx.execute("SELECT pg_notify(%s, %s)", (EVENTS_CHANNEL, self.origin))
                        self.sent += 1
                        self._sent_again()
                        break
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        if fresh:
                            self._failed(failure_said(exc, self.dsn))
                            await asyncio.sleep(RETRY_S)
                            self._due.set()
                            break
        finally:
            await self._close(cx)

    def _failed(self, reason: str) -> None:
        self.failures += 1
        if reason != self.failing:
            self.failing = reason
            log.warning(
                "sending orbit_events failed: %s; trying again every %g s (other nodes' "
                "event streams hear of this node's events by their polls meanwhile)",
                reason,
                RETRY_S,
            )

    def _sent_again(self) -> None:
        if self.failing is not None:
            log.info("orbit_events sent again, after %d failed tries", self.failures)
        self.failing, self.failures = None, 0

    async def _reconnect(self, cx: psycopg.AsyncConnection[Any] | None) -> Any:
        await self._close(cx)
        return await connect(self.dsn)

    @staticmethod
    async def _close(cx: psycopg.AsyncConnection[Any] | None) -> None:
        if cx is not None:
            with contextlib.suppress(Exception):
                await cx.close()
