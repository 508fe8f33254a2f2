"""Following an event stream (``GET /v1/events/stream``, ``GET /v1/tasks/{id}/events/
stream``): reading Server-Sent Events, and the rules both clients follow to reconnect
from the last cursor when the stream breaks."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from orbit.client._errors import ApiError
from orbit.client._http import (
    Unreachable,
    path_segment,
    server_down,
    server_failing,
    timed_out,
)
from orbit.core.model import parse_json

#: the SSE event that ends a task stream: the task has ended and its events are all out
END = "stream.end"
#: the server's refusals that a later try may not meet: the node at its cap of streams,
#: or shutting down (another node, or this one back, can take the stream)
BUSY = frozenset({"TOO_MANY_STREAMS", "SHUTTING_DOWN"})
#: the media type of a stream's answer; any other is not followed (``opened``)
EVENT_STREAM = "text/event-stream"
#: the first pause before a reconnect, doubling up to ``MAX_PAUSE``
FIRST_PAUSE = 0.05
MAX_PAUSE = 2.0


@dataclass
class Message:
    """One SSE message: its ``id`` (None if it had none), ``event`` and ``data``."""

    id: str | None
    event: str
    data: str


#: the field names a body of SSE may start with (after blank lines), besides a comment
#: (a line that starts with ``:``): the four the SSE standard defines
FIELDS = (b"id", b"event", b"data", b"retry")
#: UTF-8's byte order mark, which a stream may start with (the standard skips it)
BOM = b"\xef\xbb\xbf"


def sse_start(line: bytes, *, whole: bool) -> bool | None:
    """Whether a body whose first non-empty line is (or, ``whole`` False, begins with)
    ``line`` can be Server-Sent Events: True if the line is a comment or a field of the
    standard's four (``data: …``, ``id`` alone), False if it cannot be (``<!DOCTYPE
    html>``, ``Not Found``), None if what has come of it is too little to tell (``da``).

    Conservative: the standard reads any line, ignoring fields it does not know, so
    ``hello`` would be a stream of nothing; but no Orbit server starts a stream so, and a
    body that does is some other server's page, which will not turn into one by asking
    again. A leading byte order mark is skipped, as the standard does."""
    if not whole:
        line = line.removesuffix(b"\r")  # a CRLF's first half
        if BOM.startswith(line):
            return None
    line = line.removeprefix(BOM)
    if not line:  # a byte order mark alone: the line after it tells
        return None
    if line.startswith(b":"):
        return True
    name, colon, _ = line.partition(b":")
    if name in FIELDS and (colon or whole):
        return True
    if not whole and not colon and any(f.startswith(name) for f in FIELDS):
        return None
    return False


class Parser:
    """SSE messages from a body's chunks, as they arrive. Lines end with LF or CRLF (the
    server writes LF); a comment (``: keep-alive``) is skipped."""

    def __init__(self) -> None:
        self._rest = b""
        #: whether a line of SSE (a field or a comment) has come: the body is a stream
        self.spoke = False
        #: whether the body's first non-empty line is SSE (``sse_start``): None until
        #: enough of it has come to tell
        self.is_sse: bool | None = None
        self._id: str | None = None
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[Message]:
        lines = (self._rest + chunk).split(b"\n")
        self._rest = lines.pop()
        out: list[Message] = []
        for raw in lines:
            if self.is_sse is None and raw.removesuffix(b"\r"):
                self.is_sse = sse_start(raw.removesuffix(b"\r"), whole=True)
            line = raw.removesuffix(b"\r").decode("utf-8", errors="replace")
            if not line:
                if self._data or self._event:
                    out.append(Message(self._id, self._event or "message", "\n".join(self._data)))
                self._id, self._event, self._data = None, "", []
                continue
            if line.startswith(":"):
                self.spoke = True
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            self.spoke = self.spoke or name in ("id", "event", "data")
            if name == "id":
                self._id = value
            elif name == "event":
                self._event = value
            elif name == "data":
                self._data.append(value)
        if self.is_sse is None and self._rest.removesuffix(b"\r"):
            self.is_sse = sse_start(self._rest, whole=False)
        return out


class Following:
    """One client's follow of a stream across reconnects: where to resume (the cursor of
    the last event handed out), whether the stream has ended, and for how long the
    server may be out of reach before the follow gives up. ``Client.stream_events`` and
    ``AsyncClient.stream_events`` read their own way and share these rules, as ``wait``
    shares ``Waiting``'s."""

    def __init__(self, task_id: str | None, cursor: str | None, outage: float) -> None:
        if not isinstance(outage, int | float) or not 0 <= outage < float("inf"):
            raise ValueError(f"outage must be a finite number of seconds >= 0, not {outage!r}")
        self.task_id = task_id
        self.cursor = cursor
        self.ended = False
        self._outage = outage
        self._down_since: float | None = None
        self._delay = FIRST_PAUSE
        self._parser = Parser()
        #: whether the stream being read was opened (answered 200, or upgraded)
        self._open = False

    @property
    def path(self) -> str:
        """The stream's path, with ``?cursor=`` once there is one to resume after: the
        server reads ``Last-Event-ID`` (``headers``) first, and the query when the header
        is empty, as an empty cursor given as the start is. The header alone took that
        for no cursor at all, as the SSE standard says, and the stream began again from
        the start of the log, every event repeated, where every other read refuses an
        empty cursor (``INVALID_CURSOR``)."""
        path = (
            "/v1/events/stream"
            if self.task_id is None
            else f"/v1/tasks/{path_segment(self.task_id, 'task_id')}/events/stream"
        )
        return path + self.cursor_query

    @property
    def cursor_query(self) -> str:
        """``?cursor=…`` to resume after ``cursor``, or nothing before there is one."""
        return "" if self.cursor is None else "?" + urlencode({"cursor": self.cursor})

    @property
    def headers(self) -> dict[str, str]:
        """``Last-Event-ID`` once an event has been handed out (or given as the start)."""
        return {} if self.cursor is None else {"Last-Event-ID": self.cursor}

    def opened(self, content_type: str | None) -> None:
        """A stream answered 200 with ``content_type``: its body is read from here. A 200
        that is no event stream (a proxy's HTML page, a URL that names some other server)
        is raised as an ApiError, NOT_EVENT_STREAM, at once: taken for a stream that broke,
        it was tried again, to the same answer, until ``outage`` ran out."""
        media = (content_type or "").partition(";")[0].strip().lower()
        if media != EVENT_STREAM:
            got = f"Content-Type {content_type[:100]!r}" if content_type else "no Content-Type"
            raise ApiError(
                200,
                "NOT_EVENT_STREAM",
                f"the reply has {got}, not {EVENT_STREAM}: is the URL an Orbit server's?",
            )
        self._parser = Parser()
        self.reached()

    def reached(self) -> None:
        """The stream opened: the server answered, whatever its body then says."""
        self._open = True

    def feed(self, chunk: bytes) -> list[tuple[str, dict[str, Any]]]:
        """The ``(cursor, event)`` of each event in the chunk, up to the end of a task
        stream (``ended`` is then True). The first line of SSE says the server is back:
        the next break's pauses start short again. A body labelled an event stream whose
        first non-empty line is no SSE (``sse_start``: a page, plain text) is an
        ApiError, NOT_EVENT_STREAM, at once, as another Content-Type is (``opened``):
        taken for a stream that broke, it was tried again until ``outage`` ran out. The
        message names no byte of the body, which is some other server's and may echo
        the request, token and all."""
        messages = self._parser.feed(chunk)
        if self._parser.is_sse is False:
            raise ApiError(
                200,
                "NOT_EVENT_STREAM",
                f"the reply is labelled {EVENT_STREAM} but its body is no Server-Sent Events "
                "(its first line is neither a field nor a comment): is the URL an Orbit "
                "server's?",
            )
        out: list[tuple[str, dict[str, Any]]] = []
        for message in messages:
            if message.event == END:
                self.ended = True
                break
            if message.id is not None:
                out.append((message.id, _event(message.data)))
                self.cursor = message.id  # only once its event is read
        if self._parser.spoke:
            self.heard()
        return out

    def heard(self) -> None:
        """The server has spoken on an open stream: it is back, and the next break's
        pauses start short again."""
        self._down_since = None
        self._delay = FIRST_PAUSE

    def broke(self, exc: Unreachable | ApiError | None) -> None:
        """The stream ended without ``stream.end`` (``exc`` None: a clean close, as when a
        server shuts down) or could not be opened. A refusal (a bad cursor, a token
        refused, an unknown task) is raised; a server out of reach, behind a proxy's own
        502, 503 or 504, busy (``BUSY``) or failing (``server_failing``: its database
        away, which is also why the stream broke, a 1011 close or an SSE body ending, or
        busy, 503 ``DATABASE_*``; a follow took that 500 or 503 for a refusal and ended,
        and a database hiccup of a second ended every follow open at the time) is tried
        again until it has been so for
        ``outage`` seconds: Unreachable then, or the server's last refusal.

        A stream that opened and then said nothing for the client's timeout (a read timed
        out) broke on a server that answered: it is idle, its keep-alive further apart
        than the timeout, not out of reach. Counted as an outage, a client whose timeout
        was under the keep-alive interval gave up after ``outage`` on a healthy server
        that answered every reopen."""
        was_open, self._open = self._open, False
        if was_open and exc is not None and timed_out(exc):
            self.heard()
            return
        if isinstance(exc, ApiError) and (exc.code in BUSY or server_failing(exc)):
            pass
        elif exc is not None and not server_down(exc):
            raise exc
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            return
        if now - self._down_since <= self._outage:
            return
        if isinstance(exc, ApiError):
            raise exc
        raise Unreachable(
            f"the event stream could not be reopened for {now - self._down_since:.1f} s"
            + (f" ({exc})" if exc is not None else "")
        ) from exc

    def pause(self) -> float:
        """Seconds before the next reconnect: short at first, doubling up to MAX_PAUSE."""
        pause = self._delay
        self._delay = min(self._delay * 2, MAX_PAUSE)
        return pause


def _event(data: str) -> dict[str, Any]:
    """An event message's ``data``: a JSON object, or an ApiError, NOT_EVENT_STREAM, as
    for a WebSocket frame that is none (no Orbit server sends one: a proxy's injected
    message, some other server's stream). Text that is no JSON, a list and JSON nested
    past what the parser takes raised JSONDecodeError, TypeError or RecursionError out of
    the follow. The message names no byte of the data."""
    try:
        event = parse_json(data.encode())
    except (ValueError, RecursionError):
        event = None
    if not isinstance(event, dict):
        raise ApiError(
            200,
            "NOT_EVENT_STREAM",
            "an event's data is not a JSON object: is the URL an Orbit server's?",
        )
    return event
