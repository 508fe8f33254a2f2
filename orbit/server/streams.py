"""Event subscriptions: over Server-Sent Events (``GET /v1/events/stream``, ``GET
/v1/tasks/{id}/events/stream``) and over WebSocket (``/v1/events/ws``,
``/v1/tasks/{id}/events/ws``), two carriers of one reading side (``Tail``).

A stream is the event feed's gap-free tail (``Store.event_list``), read again when the
node hears that events were committed (a *wake*), and in any case every ``poll``
seconds. A wake is only a hint that reading may find something: the stream always reads
from its cursor, so a wake lost or never sent delays an event until the next poll and
loses nothing. The wakes come from the node's own commits (``Store.on_events``, on
either backend; one server per SQLite file, so that is all of them) and, on PostgreSQL,
from the other nodes' commits through LISTEN (orbit/server/listen.py): any notice they
already send (``orbit_ready``, ``orbit_cancel``), and ``orbit_events``, which a node
sends, coalesced, after commits of events that sent no notice (orbit/server/
announce.py). Wakes are coalesced (orbit/server/hints.py), and so are reads: a stream
reads at most once per ``WAKE_GAP_S`` however many commits woke it, so a burst of
events costs each stream a read per gap (of up to ``PAGE`` events), not one per commit.
On PostgreSQL a read returns only the events below the horizon (the oldest running
transaction): when it says some were held back, the stream reads again after a short
pause that doubles up to ``poll`` while they stay held back and it is not woken
(``HELD_BACK_S``), rather than waiting the whole ``poll``; woken, it still reads at
most once per gap, so it never spins. Nothing at all is read while nobody subscribes.

Each event goes out with its cursor (the SSE ``id``; a WebSocket frame's ``cursor``): a
client that reconnects from it (SSE's ``Last-Event-ID``, which a browser's EventSource
sends by itself, or ``?cursor=``) is given exactly the events after the last one it
read. The reads run on a small thread pool of their own (``READ_THREADS``), so streams
never hold a thread that a worker's report or a submit waits for (orbit/server/
threads.py), and never more than that many pooled database connections at once. They
share the event loop with the task path, though, which sends every event to every
stream: an event's wire forms are built once for all of them (``Encoded``). Both
carriers count toward one cap (``--max-streams``) and end when the server stops.

A client that stops reading (a process stopped, a peer gone without a word) would hold
its slot for ever: once the socket's buffers are full, a send waits for the client to
take something, and a hundred such clients would deny streams to everyone on the node.
So every send has a deadline (``--stream-send-timeout``, 30 s): a stream whose send has
not completed by then is dropped, its slot freed, and the client, if it ever reads
again, reconnects from its last cursor as after any end without ``stream.end``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

import anyio
import anyio.to_thread
from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from orbit.core.model import compact_json
from orbit.server.errors import ApiError
from orbit.server.hints import Hint
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
#: the SSE event name (and the WebSocket frame type) of what ends a task stream
END = "stream.end"
#: how long a client told the node is full waits before it tries again (Retry-After)
RETRY_AFTER_S = 1
#: the least time between two reads of one stream that wakes bring on: a burst of
#: commits costs each stream one read per gap, and a lone event waits for none of it
WAKE_GAP_S = 0.02
#: the first pause before reading again when a read said events were held back behind
#: a running transaction (PostgreSQL's horizon); doubled while they stay held, up to poll
HELD_BACK_S = 0.02
#: how many events' wire forms (each carrier's) a node keeps for its streams to share,
#: and how many bytes (characters of a frame) at most, each form; a form larger than
#: ENCODED_ENTRY_MAX is not kept (an event may carry a result of megabytes: a finish's
#: outcome that a cancel won over is in its ``cancelled`` event)
ENCODED = 4096
ENCODED_BYTES = 16 * 2**20
ENCODED_ENTRY_MAX = 64 * 2**10

#: an event's wire form: an SSE message (bytes) or a WebSocket frame (text)
_Form = TypeVar("_Form", bytes, str)


class Streams:
    """This node's open streams: how many may be open at once, how often each reads the
    log, how often an idle one sends a keep-alive, and the signal that ends them all when
    the server shuts down (uvicorn waits for open responses to finish before it stops,
    and a stream never would)."""

    def __init__(
        self, limit: int, poll_s: float, keepalive_s: float, send_timeout_s: float = 30.0
    ) -> None:
        self.limit = limit
        self.poll_s = poll_s
        self.keepalive_s = keepalive_s
        self.send_timeout_s = send_timeout_s
        self.open = 0
        self.limiter = anyio.CapacityLimiter(READ_THREADS)
        self._closing = asyncio.Event()
        #: set (and replaced by a fresh one) by the next wake, or by ``close``
        self._woken = asyncio.Event()
        self._hint = Hint(self.wake, WAKE_GAP_S)
        self.encoded = Encoded()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._hint.bind(loop)

    def woken(self) -> asyncio.Event:
        """What the next wake sets. A stream takes it before it reads, and after the
        read waits for it: a wake that came during the read is not missed."""
        return self._woken

    def wake(self) -> None:
        """Events were committed: every stream waiting for a wake reads again (within
        ``WAKE_GAP_S`` of its last read). Runs on the event loop; nothing while no stream
        is open (LISTEN calls it for every other node's notice)."""
        if not self.open:
            return
        woken, self._woken = self._woken, asyncio.Event()
        woken.set()

    def wake_threadsafe(self) -> None:
        """``wake`` from another thread (``Store.on_events`` runs in the store's): nothing
        while no stream is open, and at most one hop to the loop per ``WAKE_GAP_S``
        however many commits call it (``Hint``)."""
        if self.open:
            self._hint.raise_threadsafe()

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    def close(self) -> None:
        """End every open stream (at its next wait) and refuse new ones: the server is
        shutting down. Called on the event loop."""
        self._closing.set()
        self._woken.set()  # the streams waiting for a wake stop waiting

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

    async def wait_wake(self, woken: asyncio.Event, seconds: float) -> bool:
        """Wait until ``woken`` is set (a wake, or the server shutting down) or
        ``seconds`` have passed; True if it was set."""
        if woken.is_set():
            return True
        try:
            await asyncio.wait_for(woken.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def deliver(self, sending: Awaitable[None]) -> None:
        """Await one send to a stream's client, at most ``send_timeout_s``: ``Stalled``
        if the client has not taken it by then (it stopped reading, and the socket's
        buffers are full). ``asyncio.timeout``, not ``wait_for``: no task per send (a
        WebSocket stream sends a frame per event)."""
        try:
            async with asyncio.timeout(self.send_timeout_s):
                await sending
        except TimeoutError:
            raise Stalled from None

    async def read(self, fn: Callable[..., Any], /, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(partial(fn, **kwargs), limiter=self.limiter)


class Stalled(Exception):
    """A send to a stream's client did not complete within ``--stream-send-timeout``."""


#: uvicorn's ERROR line for a response its application returned from unfinished
UNFINISHED = "ASGI callable returned without completing response."
#: True in the task that served an SSE stream once the stream was dropped (``Stalled``):
#: uvicorn logs ``UNFINISHED`` in that task as the application returns
_dropped: ContextVar[bool] = ContextVar("orbit_stream_dropped", default=False)


class DroppedQuietly(logging.Filter):
    """Drops uvicorn's ``UNFINISHED`` ERROR for an SSE stream dropped as stalled. Its
    response is left unfinished on purpose (its last empty body would wait as long as
    the send that timed out), and the INFO ``event stream dropped`` says so: a routine
    event, which an operator's alert on ERROR lines counted as a failure. Any other
    response left unfinished still gets its ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == UNFINISHED and _dropped.get())


def quiet_dropped_streams() -> None:
    """Put ``DroppedQuietly`` on uvicorn's error logger, once."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, DroppedQuietly) for f in logger.filters):
        logger.addFilter(DroppedQuietly())


def message(cursor: str | None, kind: str, data: Any) -> bytes:
    """One SSE message. The JSON is one line: it escapes every line break in a string."""
    head = b"" if cursor is None else b"id: " + cursor.encode() + b"\n"
    return head + b"event: " + kind.encode() + b"\ndata: " + compact_json(data) + b"\n\n"


KEEPALIVE = b": keep-alive\n\n"

#: an event's position, (xid, id): what identifies it in the log (and its cursor)
Position = tuple[int, int]


class Encoded:
    """The wire forms of the node's recent events, shared by all its streams: an event's
    SSE message and its WebSocket frame are encoded once, by the first stream that sends
    it, and the others send the same bytes. Building an event's view and its JSON was
    done on the event loop by every stream for every event (N streams, N encodings of
    each): with 250 streams it took half the loop's time, and a submit waited 0.8 s.
    Neither form holds anything of the stream's own (the cursor is the event's position,
    and a task's stream sends its task's events as the whole log's stream does), and an
    event is never changed once written, so an entry never goes stale. At most
    ``ENCODED`` events of each form are kept, and ``ENCODED_BYTES`` (``_Kept``), the least
    recently sent dropped first: the streams that follow the tail share the newest, and
    one reading a backlog from long ago encodes its own pages as before. Used on the
    event loop only."""

    def __init__(self, size: int = ENCODED, max_bytes: int = ENCODED_BYTES) -> None:
        self._sse = _Kept[bytes](size, max_bytes)
        self._ws = _Kept[str](size, max_bytes)

    def sse(
        self, rows: list[dict[str, Any]], cursor_of: Callable[[dict[str, Any]], str]
    ) -> list[bytes]:
        """The SSE messages of ``rows``, one an event (sent together, as one body)."""

        def encode(row: dict[str, Any]) -> bytes:
            view = event_view(row).model_dump(mode="json")
            return message(cursor_of(row), view["kind"], view)

        return [self._sse.get(row, encode) for row in rows]

    def frames(
        self, rows: list[dict[str, Any]], cursor_of: Callable[[dict[str, Any]], str]
    ) -> list[str]:
        """The WebSocket frames of ``rows``, one an event (docs/protocol.md)."""

        def encode(row: dict[str, Any]) -> str:
            view = event_view(row).model_dump(mode="json")
            return compact_json({"type": "event", "cursor": cursor_of(row), "event": view}).decode()

        return [self._ws.get(row, encode) for row in rows]


class _Kept(Generic[_Form]):
    """One wire form's recently sent events (``Encoded``), the least recently sent
    dropped first past ``size`` entries or ``max_bytes`` in all. Counted in entries
    alone, a stream reading a backlog of events that carry large results (up to some
    4 MB each) filled it with gigabytes and kept them; a form over ENCODED_ENTRY_MAX is
    sent and not kept, as every form was before the cache."""

    def __init__(self, size: int, max_bytes: int) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self.bytes = 0
        self._forms: OrderedDict[Position, _Form] = OrderedDict()

    def __len__(self) -> int:
        return len(self._forms)

    def get(self, row: dict[str, Any], encode: Callable[[dict[str, Any]], _Form]) -> _Form:
        key = (int(row["xid"]), int(row["id"]))
        form = self._forms.get(key)
        if form is not None:
            self._forms.move_to_end(key)
            return form
        form = encode(row)
        if len(form) <= ENCODED_ENTRY_MAX:
            self._forms[key] = form
            self.bytes += len(form)
            while len(self._forms) > self.size or self.bytes > self.max_bytes:
                self.bytes -= len(self._forms.popitem(last=False)[1])
        return form


@dataclass(frozen=True)
class Events:
    """Events to send, in the log's order: their rows (``Store.event_read``'s), which
    the carrier sends in its wire form (``Encoded``)."""

    items: list[dict[str, Any]]


@dataclass(frozen=True)
class KeepAlive:
    """Nothing has been sent for the keep-alive interval: say the stream is alive."""


@dataclass(frozen=True)
class Ended:
    """A task's stream is over: the task is in ``state`` and its events are all out."""

    task_id: str
    state: str


@dataclass(frozen=True)
class Stopped:
    """The stream stops without its end (the client reconnects from its last cursor):
    ``reason`` SHUTTING_DOWN, the server is stopping, or UNAUTHENTICATED, the stream's
    token no longer holds its scope."""

    reason: str


Step = Events | KeepAlive | Ended | Stopped


class Tail:
    """The reading side of one stream, whichever way it is carried (SSE or WebSocket):
    the events from ``rows`` on (the first page, read before the stream was accepted,
    so that a bad cursor was refused), then whatever is appended after them, until the
    server stops, the token is refused, or (a task stream) the task has ended and its
    events are all out. ``steps`` says what to send; the carrier sends it, and releases
    the stream's slot in ``streams`` whatever ends it."""

    def __init__(
        self,
        conn: HTTPConnection,
        *,
        scope: str,
        task_id: str | None,
        position: tuple[int, int],
        rows: list[dict[str, Any]],
        cursor_of: Callable[[dict[str, Any]], str],
        woken: asyncio.Event,
        held_back: bool = False,
    ) -> None:
        self.streams: Streams = conn.app.state.streams
        self.store: Store = conn.app.state.store
        self.tokens = conn.app.state.tokens
        self.auth = Headers(headers={"authorization": conn.headers.get("authorization", "")})
        self.needs = scope  # the token scope the route asked for
        self.task_id = task_id
        self.position = position
        self.rows = rows
        #: the first page said events after it were held back (PostgreSQL's horizon):
        #: re-read after a short pause, not the poll (their commits' wakes may be gone)
        self.held_back = held_back
        self.cursor_of = cursor_of
        # A task stream looks at the task's state when it has caught up, if the task may
        # have ended: at first, and after each event into a final state.
        self.check_end = task_id is not None
        self._woken = woken  # taken before the last read: set by the next wake after it
        self._read_at = time.monotonic()
        self._held = HELD_BACK_S  # the next pause while events are held back
        self._quiet_since = self._read_at  # when something was last sent

    async def steps(self) -> AsyncGenerator[Step, None]:
        """What to send, in order, until the stream is over (``Ended`` or ``Stopped``,
        last). A read that fails (the database away) raises here: the carrier ends the
        stream, and the client reconnects from its last cursor."""
        rows, complete = self.rows, not self.held_back
        self._quiet_since = time.monotonic()
        while True:
            if rows:
                yield Events(self._seen(rows))
                self._quiet_since = time.monotonic()
            more = len(rows) == PAGE  # a full page: the next may follow at once
            if not more and complete and self.check_end:
                state = await self._final_state()
                if state is not None:
                    rows, complete = await self._tail()
                    if not rows and complete:
                        yield Ended(str(self.task_id), state)
                        return
                    continue
            if self.streams.closing:
                yield Stopped("SHUTTING_DOWN")
                return
            if not more or not complete:
                if await self._wait(complete, progressed=bool(rows)):
                    yield Stopped("SHUTTING_DOWN")
                    return
                if time.monotonic() - self._quiet_since >= self.streams.keepalive_s:
                    yield KeepAlive()
                    self._quiet_since = time.monotonic()
            # before every read, not only after a wait: a stream with a backlog reads
            # page after page without one, and read on with a revoked token
            if not await self._still_allowed():
                yield Stopped("UNAUTHENTICATED")
                return
            rows, complete = await self._tail()

    def _seen(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``rows``, about to be sent: the stream moves on past them, and looks at its
        task's state again if one of them took the task into a final state."""
        for row in rows:
            if row["task_to"] in FINAL and row["task_id"] == self.task_id:
                self.check_end = True
        last = rows[-1]
        self.position = (int(last["xid"]), int(last["id"]))
        return rows

    async def _wait(self, complete: bool, *, progressed: bool) -> bool:
        """Wait until the next read is due: a wake, or ``poll`` seconds, or (the last read
        said events were held back) a pause of ``HELD_BACK_S`` doubled at each read that
        finds them still held and returns nothing, up to ``poll``. A wake never brings a
        read sooner than ``WAKE_GAP_S`` after the last, so neither a burst of wakes nor a
        wake for events still behind the horizon makes the stream spin. True if the
        server began shutting down meanwhile."""
        poll = self.streams.poll_s
        if complete or progressed:
            self._held = HELD_BACK_S
        if complete:
            delay = poll
        else:
            delay = min(self._held, poll)
            self._held = min(self._held * 2, poll)
        # a keep-alive due before the poll is sent when it is due (a --stream-poll longer
        # than --stream-keepalive would otherwise space them a poll apart)
        due = self._quiet_since + self.streams.keepalive_s - time.monotonic()
        delay = max(0.0, min(delay, due))
        woke = await self.streams.wait_wake(self._woken, delay)
        if self.streams.closing:
            return True
        if woke:
            rest = self._read_at + WAKE_GAP_S - time.monotonic()
            if rest > 0 and await self.streams.pause(rest):
                return True
        return False

    async def _tail(self) -> tuple[list[dict[str, Any]], bool]:
        xid, event_id = self.position
        self._woken = self.streams.woken()
        self._read_at = time.monotonic()
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
        closes a worker's connection, whether the stream waits or reads a backlog. Asked
        before each read of the log: mostly a look in that cache."""
        try:
            await self.tokens.require(self.auth, self.needs)
        except ApiError:
            return False
        return True


class EventStream(Response):
    """The ASGI response of one SSE stream: ``tail``'s steps as SSE messages, the event's
    cursor its ``id``, until the client goes or the tail is over. The stream's slot in
    ``streams`` is released whatever ends it."""

    def __init__(self, tail: Tail) -> None:
        self.status_code = 200
        self.background = None
        self.tail = tail

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
            self.tail.streams.release()

    async def _serve(self, send: Send) -> None:
        """``_run``, its failures ended here: a client gone as a message was sent, or a
        read that failed (the database away), which ends the body so the client
        reconnects from its last cursor, as after any end without ``stream.end``."""
        try:
            await self._run(send)
        except OSError:
            pass
        except Stalled:
            # No last empty body: it would wait as long. The response is left unfinished,
            # and the server closes the connection (uvicorn's close: what it had queued
            # stays until the client takes it or goes; an abort needs its transport);
            # uvicorn's ERROR that it was unfinished is left out (``DroppedQuietly``: this
            # task, run_asgi's, logs it).
            quiet_dropped_streams()
            _dropped.set(True)
            log.info("event stream dropped: its client took nothing for the send timeout")
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
        encoded = self.tail.streams.encoded
        async with contextlib.aclosing(self.tail.steps()) as steps:
            async for step in steps:
                if isinstance(step, Events):
                    await write(b"".join(encoded.sse(step.items, self.tail.cursor_of)))
                elif isinstance(step, KeepAlive):
                    await write(KEEPALIVE)
                elif isinstance(step, Ended):
                    await write(message(None, END, {"task_id": step.task_id, "state": step.state}))
        await write(b"", more=False)

    async def _write(self, send: Send, body: bytes, *, more: bool = True) -> None:
        message = {"type": "http.response.body", "body": body, "more_body": more}
        await self.tail.streams.deliver(send(message))


#: the close code of a WebSocket stream that stopped without its end (``Stopped``), by
#: reason: 1012 (service restart) as uvicorn closes every WebSocket when it stops, and
#: 4401 as a worker's connection is closed when its token is revoked
STOP_CODES = {"SHUTTING_DOWN": 1012, "UNAUTHENTICATED": 4401}
#: a WebSocket stream's close code and reason once a read failed (the database away)
READ_FAILED = (1011, "INTERNAL")


class _Gone(Exception):
    """The WebSocket client went as a frame was sent to it."""


async def serve_socket(ws: WebSocket, tail: Tail) -> None:
    """Accept a WebSocket stream and send ``tail``'s steps as JSON frames, until the
    client goes or the tail is over, then close it with a code that says how it ended
    (docs/protocol.md, *Event streams (WebSocket)*). Frames the client sends are read
    and dropped. The stream's slot in ``streams`` is released whatever ends it."""
    closing: tuple[int, str] | None = None  # None: the client went
    try:
        try:
            await ws.accept()
        except (WebSocketDisconnect, RuntimeError, OSError):
            return  # gone before it was accepted
        async with anyio.create_task_group() as group:

            async def watch() -> None:
                while (await ws.receive())["type"] != "websocket.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(watch)
            closing = await _frames(ws, tail)
            group.cancel_scope.cancel()
        if closing is not None:
            with contextlib.suppress(Exception):  # the client may be gone (or stalled)
                await tail.streams.deliver(ws.close(*closing))
    finally:
        tail.streams.release()


async def _frames(ws: WebSocket, tail: Tail) -> tuple[int, str] | None:
    """Send the frames; the close code and reason to end with (None: the client went)."""

    async def frame(body: dict[str, Any]) -> None:
        await send(compact_json(body).decode())

    async def send(text: str) -> None:
        try:
            await tail.streams.deliver(ws.send_text(text))
        except (WebSocketDisconnect, RuntimeError, OSError):
            raise _Gone from None
        except Stalled:
            # no close frame: it would wait behind the frames the client has not taken
            log.info("event stream dropped: its client took nothing for the send timeout")
            raise _Gone from None

    try:
        async with contextlib.aclosing(tail.steps()) as steps:
            async for step in steps:
                if isinstance(step, Events):
                    for text in tail.streams.encoded.frames(step.items, tail.cursor_of):
                        await send(text)
                elif isinstance(step, KeepAlive):
                    await frame({"type": "keep-alive"})
                elif isinstance(step, Ended):
                    await frame({"type": END, "task_id": step.task_id, "state": step.state})
                    return 1000, END
                else:
                    return STOP_CODES[step.reason], step.reason
    except _Gone:
        return None
    except Exception as exc:
        log.warning("event stream ended: a read failed (%s)", type(exc).__name__)
        return READ_FAILED
    return None


async def open_tail(
    conn: HTTPConnection,
    *,
    scope: str,
    task_id: str | None,
    position: tuple[int, int],
    first_page: Callable[[], Awaitable[tuple[list[dict[str, Any]], bool]]],
    cursor_of: Callable[[dict[str, Any]], str],
) -> Tail:
    """Admit a stream and read its first page, both before the stream is accepted: a node
    at its cap, and a cursor that names no event, are refused with their own status.
    ``first_page`` returns the rows and whether events after them were held back."""
    streams: Streams = conn.app.state.streams
    streams.admit()
    woken = streams.woken()  # before the first read: a commit during it wakes the stream
    try:
        rows, held_back = await first_page()
    except BaseException:
        streams.release()
        raise
    return Tail(
        conn,
        scope=scope,
        task_id=task_id,
        position=position,
        rows=rows,
        cursor_of=cursor_of,
        woken=woken,
        held_back=held_back,
    )
