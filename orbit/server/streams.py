"""Event subscriptions over Server-Sent Events: ``GET /v1/events/stream`` and
``GET /v1/tasks/{id}/events/stream``.

A stream is the event feed's gap-free tail (``Store.event_list``), read again every
``poll`` seconds: one indexed read per interval per open stream, and nothing at all
while nobody subscribes (the task path never learns that streams exist). The LISTEN
notices (orbit/server/listen.py) are sent only for what wakes a dispatcher (a task
readied, a permit freed, a cancel), not for every event, so they cannot tell a stream
that something is there to read.

Each event goes out with its cursor as the SSE ``id``: a client that reconnects with
``Last-Event-ID`` (a browser's EventSource does so by itself) is given exactly the
events after the last one it read. The reads run on a small thread pool of their own
(``READ_THREADS``), so streams never hold a thread that a worker's report or a submit
waits for (orbit/server/threads.py), and never more than that many pooled database
connections at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
from fastapi import Request
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from orbit.core.model import compact_json
from orbit.server.errors import ApiError
from orbit.server.views import event_view
from orbit.store import Store

log = logging.getLogger("orbit.server")

#: the task states after which a task stream ends (``needs_review`` is not one: an
#: operator's decision moves the task on)
FINAL = frozenset({"succeeded", "failed", "cancelled"})
#: events read at a time; a page that comes back full is followed at once by the next
PAGE = 500
#: threads (and so database connections) the streams of a node read through at once
READ_THREADS = 4
#: the SSE event name of the message that ends a task stream
END = "stream.end"
#: how long a client told the node is full waits before it tries again (Retry-After)
RETRY_AFTER_S = 1


class Streams:
    """This node's open streams: how many may be open at once, how often each reads the
    log, how often an idle one sends a keep-alive, and the signal that ends them all when
    the server shuts down (uvicorn waits for open responses to finish before it stops,
    and a stream never would)."""

    def __init__(self, limit: int, poll_s: float, keepalive_s: float) -> None:
        self.limit = limit
        self.poll_s = poll_s
        self.keepalive_s = keepalive_s
        self.open = 0
        self.limiter = anyio.CapacityLimiter(READ_THREADS)
        self._closing = asyncio.Event()

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    def close(self) -> None:
        """End every open stream (at its next wait) and refuse new ones: the server is
        shutting down. Called on the event loop."""
        self._closing.set()

    def admit(self) -> None:
        """Count a new stream in, or refuse it: 503 ``TOO_MANY_STREAMS`` at the cap (the
        client may try again, here or at another node), 503 ``SHUTTING_DOWN`` once the
        server is stopping."""
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if self.closing:
            raise ApiError(503, "SHUTTING_DOWN", "the server is shutting down", headers=retry)
        if self.open >= self.limit:
            raise ApiError(
                503,
                "TOO_MANY_STREAMS",
                f"this node serves at most {self.limit} event streams at once",
                headers=retry,
            )
        self.open += 1

    def release(self) -> None:
        self.open -= 1

    async def pause(self, seconds: float) -> bool:
        """Wait ``seconds``; True if the server began shutting down meanwhile."""
        try:
            await asyncio.wait_for(self._closing.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def read(self, fn: Callable[..., Any], /, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(partial(fn, **kwargs), limiter=self.limiter)


def message(cursor: str | None, kind: str, data: Any) -> bytes:
    """One SSE message. The JSON is one line: it escapes every line break in a string."""
    head = b"" if cursor is None else b"id: " + cursor.encode() + b"\n"
    return head + b"event: " + kind.encode() + b"\ndata: " + compact_json(data) + b"\n\n"


KEEPALIVE = b": keep-alive\n\n"


class EventStream(Response):
    """The ASGI response of one stream: the events from ``rows`` on (the first page,
    read before the response began, so that a bad cursor was a 400), then whatever is
    appended after them, until the client goes, the server stops, the token is refused,
    or (a task stream) the task has ended and its events are all out. The stream's slot
    in ``streams`` is released whatever ends it."""

    def __init__(
        self,
        request: Request,
        *,
        scope: str,
        task_id: str | None,
        position: tuple[int, int],
        rows: list[dict[str, Any]],
        cursor_of: Callable[[dict[str, Any]], str],
    ) -> None:
        self.status_code = 200
        self.background = None
        self.streams: Streams = request.app.state.streams
        self.store: Store = request.app.state.store
        self.tokens = request.app.state.tokens
        self.auth = Headers(headers={"authorization": request.headers.get("authorization", "")})
        self.needs = scope  # the token scope the route asked for
        self.task_id = task_id
        self.position = position
        self.rows = rows
        self.cursor_of = cursor_of
        # A task stream looks at the task's state when it has caught up, if the task may
        # have ended: at first, and after each event into a final state.
        self.check_end = task_id is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                await self._serve(send)
                group.cancel_scope.cancel()
        finally:
            self.streams.release()

    async def _serve(self, send: Send) -> None:
        """``_run``, its failures ended here: a client gone as a message was sent, or a
        read that failed (the database away), which ends the body so the client
        reconnects from its last cursor, as after any end without ``stream.end``."""
        try:
            await self._run(send)
        except OSError:
            pass
        except Exception as exc:
            log.warning("event stream ended: a read failed (%s)", type(exc).__name__)
            with contextlib.suppress(Exception):
                await self._write(send, b"", more=False)

    async def _run(self, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-store"),
                    (b"x-accel-buffering", b"no"),  # nginx: pass each message on at once
                ],
            }
        )
        write = partial(self._write, send)
        rows, complete = self.rows, True
        quiet_since = time.monotonic()
        while True:
            if rows:
                await write(b"".join(self._messages(rows)))
                quiet_since = time.monotonic()
            more = len(rows) == PAGE  # a full page: the next may follow at once
            if not more and complete and self.check_end:
                state = await self._final_state()
                if state is not None:
                    rows, complete = await self._tail()
                    if not rows and complete:
                        await write(message(None, END, {"task_id": self.task_id, "state": state}))
                        await write(b"", more=False)
                        return
                    continue
            if self.streams.closing:
                await write(b"", more=False)
                return
            if not more or not complete:
                if await self.streams.pause(self.streams.poll_s):
                    await write(b"", more=False)
                    return
                if time.monotonic() - quiet_since >= self.streams.keepalive_s:
                    await write(KEEPALIVE)
                    quiet_since = time.monotonic()
                if not await self._still_allowed():
                    await write(b"", more=False)
                    return
            rows, complete = await self._tail()

    def _messages(self, rows: list[dict[str, Any]]) -> list[bytes]:
        out = []
        for row in rows:
            cursor = self.cursor_of(row)
            out.append(message(cursor, row["kind"], event_view(row).model_dump(mode="json")))
            if row["task_to"] in FINAL and row["task_id"] == self.task_id:
                self.check_end = True
        last = rows[-1]
        self.position = (int(last["xid"]), int(last["id"]))
        return out

    async def _write(self, send: Send, body: bytes, *, more: bool = True) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": more})

    async def _tail(self) -> tuple[list[dict[str, Any]], bool]:
        xid, event_id = self.position
        rows, held_back = await self.streams.read(
            self.store.event_read,
            task_id=self.task_id,
            after_xid=xid,
            after_id=event_id,
            limit=PAGE,
            checked=False,
        )
        return rows, not held_back

    async def _final_state(self) -> str | None:
        """The task's state if it is final, else None (and no further look until an
        event into a final state comes)."""
        task = await self.streams.read(self.store.task_get, task_id=self.task_id)
        state = str(task.state)
        if state in FINAL:
            return state
        self.check_end = False
        return None

    async def _still_allowed(self) -> bool:
        """Whether the stream's token still holds its scope: a revoked token ends the
        stream within the node's token cache time (``orbit server --token-cache``), as it
        closes a worker's connection. Mostly a look in that cache."""
        try:
            await self.tokens.require(self.auth, self.needs)
        except ApiError:
            return False
        return True


async def open_stream(
    request: Request,
    *,
    scope: str,
    task_id: str | None,
    position: tuple[int, int],
    first_page: Callable[[], Awaitable[list[dict[str, Any]]]],
    cursor_of: Callable[[dict[str, Any]], str],
) -> EventStream:
    """Admit a stream and read its first page, both before the response begins: a node at
    its cap, and a cursor that names no event, are refused with their own status."""
    streams: Streams = request.app.state.streams
    streams.admit()
    try:
        rows = await first_page()
    except BaseException:
        streams.release()
        raise
    return EventStream(
        request, scope=scope, task_id=task_id, position=position, rows=rows, cursor_of=cursor_of
    )
