"""Following an event stream over WebSocket (orbit/client/_ws.py): the URL a follow
opens and reopens, what each frame says; and the close code that stands for a refused
upgrade's status where the server cannot answer it (orbit/server/errors.py)."""

from __future__ import annotations

import pytest

from orbit.client._errors import ApiError
from orbit.client._ws import Subscription, socket_base
from orbit.server.errors import close_code
from orbit.urls import check_server_url


def test_the_url_keeps_the_scheme_and_prefix_and_resumes_from_the_last_cursor() -> None:
    assert socket_base(check_server_url("http://h:1")) == "ws://h:1"
    assert socket_base(check_server_url("HTTPS://h/orbit/")) == "wss://h/orbit"
    whole = Subscription(None, None, outage=5)
    assert whole.url("ws://h:1") == "ws://h:1/v1/events/ws"
    task = Subscription("a b.", "MC4x", outage=5)
    assert task.url("wss://h/orbit") == "wss://h/orbit/v1/tasks/a%20b./events/ws?cursor=MC4x"
    dots = Subscription("..", None, outage=5)
    assert dots.url("ws://h") == "ws://h/v1/tasks/%2E%2E/events/ws"


def test_frames_give_events_with_their_cursors_and_the_end() -> None:
    following = Subscription("t1", None, outage=5)
    assert following.frame('{"type": "keep-alive"}') is None
    event = {"id": "7", "kind": "submitted"}
    got = following.frame(
        b'{"type": "event", "cursor": "c1", "event": {"id": "7", "kind": "submitted"}}'
    )
    assert got == ("c1", event)
    assert following.url("ws://h") == "ws://h/v1/tasks/t1/events/ws?cursor=c1"
    assert following.frame('{"type": "some.later.kind"}') is None  # skipped, not refused
    assert not following.ended
    assert following.frame('{"type": "stream.end", "task_id": "t1", "state": "failed"}') is None
    assert following.ended and following.cursor == "c1"


@pytest.mark.parametrize(
    "frame",
    [
        "<html>",
        "[1]",
        '"event"',
        "",
        # an event frame without its cursor or its event, or with one of the wrong type:
        # it raised a bare KeyError or TypeError out of the follow, or took "None" for
        # the cursor to resume from
        '{"type": "event", "event": {}}',
        '{"type": "event", "cursor": "c1"}',
        '{"type": "event", "cursor": null, "event": {}}',
        '{"type": "event", "cursor": 7, "event": {}}',
        '{"type": "event", "cursor": "c1", "event": 5}',
        '{"type": "event", "cursor": "c1", "event": [1]}',
        # nested past what the parsers take: RecursionError out of the follow
        "[" * 200_000,
    ],
)
def test_a_frame_no_orbit_server_sends_is_refused(frame: str) -> None:
    following = Subscription(None, None, outage=5)
    with pytest.raises(ApiError) as refused:
        following.frame(frame)
    assert refused.value.code == "NOT_EVENT_STREAM"
    assert following.cursor is None  # nothing taken from it
    with pytest.raises(ApiError):  # and the follow raises it, as any refusal
        following.broke(refused.value)


def test_a_refused_upgrade_closes_with_a_code_for_its_status() -> None:
    assert [close_code(s) for s in (400, 401, 403, 404, 503, 500)] == [
        4400,
        4401,
        4403,
        4404,
        1013,
        1011,
    ]


def test_a_redirect_from_wss_to_ws_is_the_redirect_it_met() -> None:
    """websockets refuses to follow a redirect from ``wss`` to ``ws`` with a SecurityError
    raised from the 308 it met: ``subscribe`` raises that redirect (REDIRECT, naming
    where), as an HTTP call's, not Unreachable, which it would retry until ``outage``."""
    from websockets.datastructures import Headers
    from websockets.exceptions import InvalidStatus, SecurityError
    from websockets.http11 import Response

    from orbit.client._client import _upgrade_failed

    plain = "ws://plain.example/v1/events/ws"
    met = InvalidStatus(Response(308, "Permanent Redirect", Headers({"Location": plain}), b""))
    refused = SecurityError(f"cannot follow redirect to non-secure URI {plain}")
    refused.__cause__ = met
    error = _upgrade_failed(refused, "wss://orbit.example", 5.0)
    assert isinstance(error, ApiError)
    assert (error.status, error.code) == (308, "REDIRECT") and plain in str(error)
