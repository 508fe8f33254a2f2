"""Reading Server-Sent Events (orbit/client/_sse.py): the parser, and the follow's rules
for what breaks a stream and what ends it."""

from __future__ import annotations

import time

import httpx
import pytest

from orbit.client._errors import ApiError, BadRequest, error_from
from orbit.client._http import Unreachable
from orbit.client._sse import Following, Message, Parser


def test_messages_split_across_chunks_with_comments_and_crlf() -> None:
    parser = Parser()
    assert parser.feed(b': keep-alive\n\nid: a\r\nevent: submitted\ndata: {"x"') == []
    assert parser.spoke
    assert parser.feed(b":1}\n\n: keep-alive\n\nevent: stream.end\ndata: {}\n") == [
        Message("a", "submitted", '{"x":1}')
    ]
    assert parser.feed(b"\n") == [Message(None, "stream.end", "{}")]


def test_lines_of_no_stream_do_not_count_as_one() -> None:
    parser = Parser()
    assert parser.feed(b"<html>\n<body>hello</body>\n\n") == []
    assert not parser.spoke


def test_the_follow_resumes_from_the_last_cursor_and_stops_at_the_end() -> None:
    following = Following("t1", None, outage=5)
    assert following.path == "/v1/tasks/t1/events/stream"
    assert following.headers == {}
    following.opened("text/event-stream; charset=utf-8")
    got = following.feed(b'id: c1\nevent: submitted\ndata: {"id": "1"}\n\n')
    assert got == [("c1", {"id": "1"})]
    assert following.headers == {"Last-Event-ID": "c1"}
    got = following.feed(b'id: c2\nevent: cancelled\ndata: {"id": "2"}\n\nevent: stream.end\n')
    assert got == [("c2", {"id": "2"})] and not following.ended
    assert following.feed(b"data: {}\n\nid: c3\nevent: x\ndata: {}\n\n") == []
    assert following.ended and following.cursor == "c2"


def test_a_refusal_is_raised_and_an_outage_ridden_until_it_lasts_too_long() -> None:
    following = Following(None, "c0", outage=0)
    with pytest.raises(BadRequest):
        following.broke(error_from(400, {"error": {"code": "INVALID_CURSOR", "message": "x"}}))
    busy = error_from(503, {"error": {"code": "TOO_MANY_STREAMS", "message": "full"}})
    following.broke(busy)  # the first: tried again
    with pytest.raises(type(busy)):
        following.broke(busy)  # still so past the outage (0 s)
    down = Following(None, None, outage=0)
    down.broke(Unreachable("refused"))
    with pytest.raises(Unreachable, match="could not be reopened"):
        down.broke(None)


def _timed_out(cause: BaseException) -> Unreachable:
    """A read that waited the client's timeout, as each client raises it."""
    error = Unreachable("no answer from h:1 within 1.0 s")
    error.__cause__ = cause
    return error


def test_a_stream_that_opened_and_then_timed_out_is_no_outage() -> None:
    """A client whose timeout is under the server's keep-alive interval (15 s) takes an
    idle stream for broken and reopens it, each reopen answered. No line of SSE came
    before the next read timed out, so none counted the server as heard: after
    ``outage`` the follow raised "could not be reopened" from a healthy server. A stream
    that opened (200, or an upgrade) and then went silent is an idle one; a read that
    timed out before the stream opened, and any other break, still count."""
    for cause in (TimeoutError("timed out"), httpx.ReadTimeout("timed out")):
        following = Following(None, None, outage=0)
        for _ in range(3):
            following.opened("text/event-stream")  # the reopen: answered
            time.sleep(0.01)  # past the outage (0 s)
            following.broke(_timed_out(cause))
        following.reached()  # the WebSocket follow's upgrade
        following.broke(_timed_out(cause))
    unopened = Following(None, None, outage=0)
    unopened.broke(_timed_out(TimeoutError("timed out")))  # no answer to the open
    time.sleep(0.01)
    with pytest.raises(Unreachable, match="could not be reopened"):
        unopened.broke(_timed_out(TimeoutError("timed out")))
    cut = Following(None, None, outage=0)
    cut.opened("text/event-stream")
    cut.broke(None)  # the body ended: a server going down
    time.sleep(0.01)
    cut.opened("text/event-stream")
    with pytest.raises(Unreachable, match="could not be reopened"):
        cut.broke(Unreachable("h:1: IncompleteRead"))  # cut off again


@pytest.mark.parametrize("data", [b"hello", b"[1, 2]", b"5", b'"x"', b"[" * 200_000])
def test_event_data_that_is_no_json_object_is_refused(data: bytes) -> None:
    """An event's data must be a JSON object: text, a list, a number, or JSON nested
    past what the parsers take raised JSONDecodeError, TypeError or RecursionError out
    of the follow. NOT_EVENT_STREAM, as a WebSocket frame that is none, the cursor left
    at the last event handed out."""
    following = Following(None, None, outage=5)
    following.opened("text/event-stream")
    assert following.feed(b'id: c1\nevent: submitted\ndata: {"id": "1"}\n\n')
    with pytest.raises(ApiError) as caught:
        following.feed(b"id: c2\nevent: submitted\ndata: " + data + b"\n\n")
    assert (caught.value.status, caught.value.code) == (200, "NOT_EVENT_STREAM")
    assert "not a JSON object" in caught.value.message
    assert following.cursor == "c1"


def test_an_outage_must_be_a_finite_number() -> None:
    for bad in (-1, float("inf"), float("nan"), "5"):
        with pytest.raises(ValueError, match="outage"):
            Following(None, None, bad)  # type: ignore[arg-type]


def test_a_200_that_is_no_event_stream_is_refused_when_opened() -> None:
    following = Following(None, None, outage=5)
    for stream in ("text/event-stream", "Text/Event-Stream ; charset=utf-8"):
        following.opened(stream)
    for other, named in (
        ("text/html; charset=utf-8", "Content-Type 'text/html; charset=utf-8'"),
        ("", "no Content-Type"),
        (None, "no Content-Type"),
    ):
        with pytest.raises(ApiError) as caught:
            following.opened(other)
        assert (caught.value.status, caught.value.code) == (200, "NOT_EVENT_STREAM")
        assert named in caught.value.message


def test_a_task_id_of_dots_stays_one_segment_of_the_stream_path() -> None:
    """``stream_events("..")`` asked for ``/v1/tasks/../events/stream``, which a
    transport may fold into ``/v1/events/stream``, the whole log: a task id is one
    segment, dots encoded, as every other call of the clients spells it (``path_segment``)."""
    assert Following("..", None, 1).path == "/v1/tasks/%2E%2E/events/stream"
    assert Following("a b/c", None, 1).path == "/v1/tasks/a%20b%2Fc/events/stream"


@pytest.mark.parametrize(
    "body",
    [
        b"<!DOCTYPE html>\n<html><body>Bad Gateway</body></html>\n",
        b"Not Found",  # plain text, no line end yet: its first letter tells
        b"\r\n\nInternal Server Error\r\n",  # blank lines first
        b'{"error": "nope"}\n',
        b"Authorization: Bearer orbit_x_y\n",  # an echo server: never quoted back
        b"dat\n",
        b"datum: 1\n",
        b"\xef\xbb\xbfhello\n",
    ],
)
def test_a_body_labelled_an_event_stream_that_holds_no_sse_is_refused_at_once(
    body: bytes,
) -> None:
    """A 200 labelled ``text/event-stream`` whose first non-empty line is no SSE field
    (``id``, ``event``, ``data`` or ``retry``) nor a comment is some other server's
    page: NOT_EVENT_STREAM at once, whether the body comes whole or a byte at a time. It
    was taken for a stream that broke, and tried again until ``outage`` ran out."""
    for chunks in ([body], [body[i : i + 1] for i in range(len(body))]):
        following = Following(None, None, outage=5)
        following.opened("text/event-stream")
        with pytest.raises(ApiError) as caught:
            for chunk in chunks:
                following.feed(chunk)
        assert (caught.value.status, caught.value.code) == (200, "NOT_EVENT_STREAM")
        assert "body is no Server-Sent Events" in caught.value.message
        assert "orbit_x_y" not in str(caught.value) and "Bearer" not in str(caught.value)


@pytest.mark.parametrize(
    "body",
    [
        b": keep-alive\n\n",
        b"\n\r\nid: c1\r\nevent: x\r\ndata: {}\r\n\r\n",
        b"\xef\xbb\xbfdata: {}\n\n",  # a byte order mark first, as the standard allows
        b"data\n\n",  # a field with no colon: an empty value
        b"retry: 1000\n\n",
        b"event: stream.end\ndata: {}\n\n",
    ],
)
def test_a_body_that_starts_as_sse_is_followed(body: bytes) -> None:
    """What can start a stream is not refused, however it is cut into chunks."""
    for chunks in ([body], [body[i : i + 1] for i in range(len(body))]):
        following = Following(None, None, outage=5)
        following.opened("text/event-stream")
        for chunk in chunks:
            following.feed(chunk)
        assert following._parser.is_sse is True
