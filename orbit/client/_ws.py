"""Following an event stream over WebSocket (``/v1/events/ws``, ``/v1/tasks/{id}/events/
ws``): the frames, the URL, and how a failed upgrade or a closed connection is told to
``Following``, whose rules (reconnect from the last cursor within ``outage``) both
carriers share.

The token goes in the upgrade's ``Authorization`` header, never in the URL. Redirects
are websockets' own: followed to the same origin with the token, elsewhere without it
(the server there then refuses the upgrade, 401), never from ``wss`` to ``ws``; one
not followed (that, or to an ``https://`` page) is REDIRECT, as an HTTP call's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import SplitResult

from websockets.asyncio.client import ClientConnection as AsyncConnection
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection as SyncConnection

from orbit.client._errors import ApiError
from orbit.client._http import Unreachable, path_segment
from orbit.client._sse import END, Following
from orbit.core.model import parse_json
from orbit.logs import RedactSecrets

#: What websockets logs about these connections: every header of the upgrade at debug
#: level, the Authorization header among them, so redacted (as the worker's connection)
ws_log = logging.getLogger("websockets.client.orbit.events")
ws_log.addFilter(RedactSecrets())
#: the largest frame taken: one event's view, bounded by what the server takes in (its
#: ``max_body_bytes``, 16 MiB by default), as any evidence an event records is
MAX_FRAME = 16 * 1024 * 1024


def socket_base(server: SplitResult) -> str:
    """The ``ws://`` (``wss://`` for https) base of a checked server URL: its host, port
    and path prefix."""
    scheme = "wss" if server.scheme == "https" else "ws"
    return f"{scheme}://{server.netloc}{server.path.rstrip('/')}"


class Subscription(Following):
    """``Following`` over WebSocket frames: the URL to (re)open, with the cursor of the
    last event handed out, and what each frame says."""

    def url(self, base: str) -> str:
        """The stream's URL under ``base`` (``socket_base``), resuming after ``cursor`` if
        there is one."""
        path = (
            "/v1/events/ws"
            if self.task_id is None
            else f"/v1/tasks/{path_segment(self.task_id, 'task_id')}/events/ws"
        )
        return base + path + self.cursor_query

    def frame(self, data: str | bytes) -> tuple[str, dict[str, Any]] | None:
        """The ``(cursor, event)`` of an event frame; None for any other (a keep-alive,
        the end of a task stream, which sets ``ended``, or a type this client does not
        know). Any frame says the server is back (``heard``). A frame that is no JSON
        object, or an event frame without a cursor (a non-empty string) and an event (an
        object), is an ApiError, NOT_EVENT_STREAM: no Orbit server sends one."""
        try:
            msg = parse_json(data)
        except (ValueError, RecursionError):  # nested past the parser's depth
            msg = None
        if not isinstance(msg, dict):
            raise _not_ours("a frame is not a JSON object")
        kind = msg.get("type")
        if kind == "event":
            cursor, event = msg.get("cursor"), msg.get("event")
            if not isinstance(cursor, str) or not cursor or not isinstance(event, dict):
                raise _not_ours("an event frame lacks its cursor or its event")
            self.heard()
            self.cursor = cursor
            return cursor, event
        self.heard()
        if kind == END:
            self.ended = True
        return None


def _not_ours(what: str) -> ApiError:
    """The refusal of a frame no Orbit server sends (it names no byte of the frame)."""
    return ApiError(101, "NOT_EVENT_STREAM", f"{what}: is the URL an Orbit server's?")


def closed(exc: ConnectionClosed, where: str) -> Unreachable:
    """A connection that closed before the end of its stream, as the follow's break: the
    server's close code and reason say why (1012 shutting down, 4401 the token revoked,
    1011 a read failed), and the follow reconnects from its last cursor either way."""
    said = exc.rcvd
    how = "without a close frame" if said is None else f"with {said.code} {said.reason}".strip()
    return Unreachable(f"{where}: the event stream closed {how}")


@contextlib.contextmanager
def held(conn: SyncConnection) -> Iterator[SyncConnection]:
    """``conn`` for the block, then closed: with the closing handshake when the follow
    has ended (the server closes after ``stream.end``), but aborted first (its socket
    closed, no close frame) when anything else leaves the block: the follow gives up on
    it (Unreachable: it closed without a close frame, or a read waited the client's
    timeout), or its caller stops it (GeneratorExit, a break out of its loop) or raises
    through it. A peer that went silent (a host gone, a network cut) never answers the
    handshake; and while frames the caller will never read keep coming (a follow left
    with a backlog), websockets stops reading the socket once 16 wait, so the answer
    queued behind them is never read. Either way ``close()`` waited websockets' close
    timeout (10 s): before the follow could reconnect, or before the caller's loop went
    on. A stream is only read: nothing is lost by not saying goodbye."""
    with conn:  # whose close, after an abort, finds the protocol CLOSED: no wait
        try:
            yield conn
        except BaseException:
            conn.close_socket()  # the protocol is CLOSED when it returns
            conn.recv_events_thread.join()  # ends once its socket is closed
            raise


@contextlib.asynccontextmanager
async def aheld(conn: AsyncConnection) -> AsyncIterator[AsyncConnection]:
    """As ``held``, for ``AsyncClient.subscribe`` (there the caller stops it by
    ``aclose()``, or by cancelling its task)."""
    async with conn:
        try:
            yield conn
        except BaseException:
            conn.transport.abort()
            await conn.wait_closed()  # the abort's connection_lost: at once
            raise
