"""Review fixes, on both backends: an artifact's content type must be an RFC 9110 media
type (the server's upload route answers 400, ``Context.upload`` raises ValueError before
sending); a cursor is only the exact spelling the server issues (a list, an SSE stream's
start, a WebSocket's); and an SSE stream refuses a bad ``?cursor=`` even behind a good
``Last-Event-ID``."""

from __future__ import annotations

import warnings
from typing import Any
from urllib.parse import quote

import httpx
from starlette.exceptions import StarletteDeprecationWarning

from orbit.server.routes import encode_cursor
from orbit.worker.runner import Context
from tests.e2e import streams_common
from tests.e2e.servers import Node, Tokens
from tests.e2e.streams_common import Served, refusal, submit_task
from tests.e2e.test_artifact_http import MEDIA_TYPES, NOT_MEDIA_TYPES
from tests.e2e.test_artifact_options import _run

with warnings.catch_warnings():  # starlette's TestClient warns at import about httpx
    warnings.simplefilter("ignore", StarletteDeprecationWarning)

# one node per backend for the cursor tests, which read only their own tasks
served = streams_common.served


def _misspelt(cursor: str) -> list[str]:
    """Spellings of a real cursor the server never issues, which the base64 decoder read
    as it: padding, characters outside the alphabet dropped, whitespace inside."""
    return [
        cursor + "=",
        cursor + "==",
        cursor + "!!!!",
        ".".join(cursor),
        cursor[:2] + " " + cursor[2:],
        cursor + "\n",
    ]


# --------------------------------------------------------------- content types


def test_upload_raises_value_error_for_a_content_type_that_is_no_media_type(
    node: Node, tokens: Tokens
) -> None:
    """Before anything is sent: ``"text/plain "`` reached h11, which refused the header,
    and the handler got ``Unreachable``, which says to retry."""

    async def handler(ctx: Context, payload: Any) -> Any:
        seen = []
        for content_type in NOT_MEDIA_TYPES:
            try:
                await ctx.upload("bad.bin", b"x", content_type)
            except Exception as exc:
                seen.append([type(exc).__name__, str(exc)])
            else:
                seen.append(["accepted", ""])
        for i, content_type in enumerate(MEDIA_TYPES):
            await ctx.upload(f"good-{i}.bin", b"x", content_type)
        return seen

    seen, listed, api = _run(node, tokens, handler)
    api.close()
    for content_type, (kind, says) in zip(NOT_MEDIA_TYPES, seen, strict=True):
        assert kind == "ValueError", (content_type, kind, says)
        assert "content_type must be a media type" in says, (content_type, says)
    assert sorted(a["content_type"] for a in listed) == sorted(MEDIA_TYPES)


# --------------------------------------------------------------------- cursors


def _refused(reply: httpx.Response, field: str = "cursor") -> bool:
    return reply.status_code == 400 and reply.json()["error"] == {
        "code": "INVALID_CURSOR",
        "message": "the cursor is not one this server issued",
        "field": field,
    }


def _sse_start(api: httpx.Client, path: str, **kw: Any) -> httpx.Response:
    """A stream's answer, its body read only if it is a refusal: a stream it wrongly
    started is closed at once, never read (it would not end)."""
    with api.stream("GET", path, **kw) as reply:
        if reply.status_code != 200:
            reply.read()
    return reply


def test_a_list_refuses_a_cursor_spelt_otherwise_than_issued(served: Served) -> None:
    """``MC4z==``, ``MC4z!!!!`` and ``M.C.4.z`` were read as ``MC4z``, though only what
    the server issues is a cursor."""
    api = served.api
    for _ in range(2):
        submit_task(api)
    for path in ("/v1/events", "/v1/tasks"):
        cursor = api.get(path, params={"limit": 1}).json()["next_cursor"]
        assert api.get(path, params={"limit": 1, "cursor": cursor}).status_code == 200
        for bad in _misspelt(cursor):
            reply = api.get(path, params={"limit": 1, "cursor": bad})
            assert _refused(reply), (path, bad, reply.text)
    event_position = encode_cursor("0.3")  # "MC4z", the review's example
    assert event_position == "MC4z"
    for bad in ("M.C.4.z", "MC4z!!!!", "MC4z=="):
        assert _refused(api.get("/v1/events", params={"limit": 1, "cursor": bad})), bad


def test_a_stream_refuses_a_cursor_spelt_otherwise_than_issued(served: Served) -> None:
    """SSE (query and ``Last-Event-ID``) and WebSocket alike, before the stream starts."""
    api = served.api
    task_id = submit_task(api)
    cursor = api.get("/v1/events", params={"limit": 1}).json()["next_cursor"]
    for path in ("/v1/events/stream", f"/v1/tasks/{task_id}/events/stream"):
        for bad in _misspelt(cursor):
            assert _refused(_sse_start(api, path, params={"cursor": bad})), (path, bad)
            if "\n" not in bad:  # no header carries a newline
                reply = _sse_start(api, path, headers={"Last-Event-ID": bad})
                assert _refused(reply, "Last-Event-ID"), (path, bad)
    for path in ("/v1/events/ws", f"/v1/tasks/{task_id}/events/ws"):
        for bad in _misspelt(cursor):
            status, error, _ = refusal(
                served.node, served.tokens.admin, path, "?cursor=" + quote(bad, safe="")
            )
            assert (status, error["code"], error["field"]) == (400, "INVALID_CURSOR", "cursor")


def test_an_sse_stream_refuses_a_bad_query_cursor_behind_a_good_header(
    served: Served,
) -> None:
    """A cursor, either one, that the server did not issue is INVALID_CURSOR before the
    stream starts: the query's was not read at all when the header was good. Both good,
    the stream starts (the header says where)."""
    api = served.api
    task_id = submit_task(api)
    good = api.get(f"/v1/tasks/{task_id}/events", params={"limit": 1}).json()["next_cursor"]
    assert good is not None
    for path in ("/v1/events/stream", f"/v1/tasks/{task_id}/events/stream"):
        for bad in ["zz", encode_cursor("0"), encode_cursor("05"), "", *_misspelt(good)]:
            reply = _sse_start(api, path, params={"cursor": bad}, headers={"Last-Event-ID": good})
            assert _refused(reply), (path, bad)
        started = _sse_start(api, path, params={"cursor": good}, headers={"Last-Event-ID": good})
        assert started.status_code == 200
        assert started.headers["content-type"].startswith("text/event-stream")
