"""Event subscriptions over SSE (``GET /v1/events/stream``, ``GET /v1/tasks/{id}/events/
stream``) against real ``orbit server`` processes, on both backends.

- Events appear in the stream as tasks change; a task's stream ends (``stream.end``)
  once the task has ended and its events are out.
- A reconnect with ``Last-Event-ID`` gets exactly the events written meanwhile, none
  twice; the header wins over ``?cursor=``.
- PostgreSQL, two nodes: a stream on node B sees the events written through node A.
- Refusals before the stream starts: a bad cursor 400, no token 401, a wrong scope 403,
  an unknown task 404, a node at its cap of streams 503 (the slot is free again once
  the client goes). A revoked token's stream ends.
- An idle stream sends keep-alive comments; SIGTERM ends open streams and the server
  exits; ``Client.stream_events`` rides a SIGKILL and restart of the server and misses
  nothing written while it was down.
- ``Client.close()`` ends the follows (``stream_events``, ``subscribe``) other threads
  read; a client whose timeout is under the keep-alive interval follows an idle stream
  without giving up on it.

The setup, the readers and the scenarios shared with the WebSocket twins
(tests/e2e/test_event_socket.py) are in tests/e2e/streams_common.py. The tests that read
only their own tasks and tokens share one node per backend (``served``).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from orbit.client import Client
from tests.e2e import streams_common
from tests.e2e.servers import Node, Tokens
from tests.e2e.streams_common import (
    BAD_CURSORS,
    FAST,
    PATIENCE,
    UNKNOWN,
    Served,
    admin_with_queue,
    all_events,
    auth,
    create_queue,
    follow_a_task_to_its_end,
    follow_across_a_database_outage,
    follow_across_a_restart,
    sse_has,
    stream,
    submit_task,
    two_nodes,
)

# the fixtures: a fresh node per test (``fast``, ``api``), or one per backend (``served``)
fast, api, served = streams_common.fast, streams_common.api, streams_common.served


def test_events_appear_as_tasks_change_and_a_task_stream_ends(
    api: httpx.Client, fast: Node, tokens: Tokens
) -> None:
    with stream(fast, tokens.admin, "/v1/events/stream") as log:
        first = log.events_until(lambda seen: any(m.event == "queue.created" for m in seen))
        task_id = submit_task(api)
        with stream(fast, tokens.submit, f"/v1/tasks/{task_id}/events/stream") as task:
            assert task.next().event == "submitted"
            assert log.events_until(sse_has("submitted", task_id))[-1].id is not None
            api.post(f"/v1/tasks/{task_id}/cancel").raise_for_status()
            cancelled = log.events_until(sse_has("cancelled", task_id))[-1]
            assert task.next().event == "cancelled"
            end = task.next()
            assert (end.event, end.id) == ("stream.end", None)
            assert '"state":"cancelled"' in end.data
            with pytest.raises(StopIteration):
                task.next()
    # every message is the event as GET /v1/events gives it, its id the event's cursor
    listed = all_events(api)
    assert [e["kind"] for e in listed] == ["queue.created", "submitted", "cancelled"]
    assert first[0].data and cancelled.id
    after = api.get("/v1/events", params={"cursor": cancelled.id}).json()["items"]
    assert after == []


def test_a_reconnect_with_last_event_id_gets_exactly_the_missed_events(
    api: httpx.Client, fast: Node, tokens: Tokens
) -> None:
    early = [submit_task(api, i) for i in range(3)]
    with stream(fast, tokens.admin, "/v1/events/stream") as log:
        seen = log.events_until(sse_has("submitted", early[-1]))
    last = seen[-1].id
    assert last is not None
    # more than a stream reads at a time (orbit.server.streams.PAGE, 500)
    batch = [{"queue": "q", "handler": "h", "payload": i} for i in range(700)]
    reply = api.post("/v1/tasks/batch", params={"reply": "ids"}, json={"tasks": batch})
    late = [item["id"] for item in reply.json()]
    api.post(f"/v1/tasks/{early[0]}/cancel").raise_for_status()
    # ?cursor= names the start, but Last-Event-ID (as a browser's EventSource sends it
    # on a reconnect to the same URL) wins
    with stream(
        fast, tokens.admin, "/v1/events/stream", {"Last-Event-ID": last}, cursor=seen[0].id or ""
    ) as log:
        missed = log.events_until(sse_has("cancelled", early[0]))
    # exactly the events after the last one read: each once, in the log's order
    expected = all_events(api, last)
    assert [json.loads(m.data) for m in missed] == expected
    assert [m.event for m in missed] == ["submitted"] * len(late) + ["cancelled"]
    assert {json.loads(m.data)["task_id"] for m in missed} == {*late, early[0]}
    assert len({m.id for m in seen + missed}) == len(seen) + len(missed)


def test_a_stream_on_one_node_sees_events_written_through_another(
    db_url: str, nodes: Callable[..., Node], tokens: Tokens
) -> None:
    node_a, node_b = two_nodes(db_url, nodes)
    with (
        admin_with_queue(node_a, tokens) as a,
        stream(node_b, tokens.admin, "/v1/events/stream") as log,
    ):
        task_id = submit_task(a)
        a.post(f"/v1/tasks/{task_id}/cancel").raise_for_status()
        got = log.events_until(sse_has("cancelled", task_id))
    assert [m.event for m in got] == ["queue.created", "submitted", "cancelled"]


def test_refusals_come_before_the_stream_starts(served: Served) -> None:
    """A bad cursor (in the query or the header) 400, ``cursor`` twice 400, no token 401,
    a token without the scope 403, an unknown task 404: each a JSON error, no stream."""
    api, tokens = served.api, served.tokens
    task_id = submit_task(api)
    twice = api.get("/v1/events/stream", params=[("cursor", "MC4x"), ("cursor", "MC4x")])
    assert (twice.status_code, twice.json()["error"]["field"]) == (400, "cursor")
    for path in ("/v1/events/stream", f"/v1/tasks/{task_id}/events/stream"):
        for cursor in BAD_CURSORS:
            # the field names which one was at fault (a bad header was called "cursor")
            for reply, field in (
                (api.get(path, params={"cursor": cursor}), "cursor"),
                (api.get(path, headers={"Last-Event-ID": cursor}), "Last-Event-ID"),
            ):
                assert reply.status_code == 400, reply.text
                error = reply.json()["error"]
                assert (error["code"], error["field"]) == ("INVALID_CURSOR", field), error
    bare = httpx.Client(base_url=str(api.base_url), timeout=PATIENCE)
    assert bare.get("/v1/events/stream").status_code == 401
    assert bare.get(f"/v1/tasks/{task_id}/events/stream").status_code == 401
    submit = auth(tokens.submit)
    refused = bare.get("/v1/events/stream", headers=submit)
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "FORBIDDEN")
    worker = auth(tokens.worker)
    assert bare.get(f"/v1/tasks/{task_id}/events/stream", headers=worker).status_code == 403
    unknown = bare.get(f"/v1/tasks/{UNKNOWN}/events/stream", headers=submit)
    assert unknown.status_code == 404
    bare.close()


def test_a_node_serves_at_most_its_cap_of_streams(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    node = nodes(args=[*FAST, "--max-streams", "1"])
    with httpx.Client(base_url=node.http, timeout=PATIENCE, headers=auth(tokens.admin)) as c:
        with stream(node, tokens.admin, "/v1/events/stream"):
            refused = c.get("/v1/events/stream")
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "TOO_MANY_STREAMS"
            assert refused.headers["retry-after"] == "1"
        # the client has gone: its slot is freed once the server hears of it
        deadline = time.monotonic() + PATIENCE
        while True:
            with c.stream("GET", "/v1/events/stream") as again:
                if again.status_code == 200:
                    break
            assert time.monotonic() < deadline, "the closed stream's slot was never freed"
            time.sleep(0.05)


def test_an_idle_stream_sends_keep_alive_comments(served: Served) -> None:
    api, fast, tokens = served.api, served.node, served.tokens
    task_id = submit_task(api)
    with stream(fast, tokens.submit, f"/v1/tasks/{task_id}/events/stream") as task:
        assert task.next().event == "submitted"
        assert task.comment() == b": keep-alive"


def test_sigterm_ends_open_streams_and_the_server_exits(
    api: httpx.Client, fast: Node, tokens: Tokens
) -> None:
    with stream(fast, tokens.admin, "/v1/events/stream") as log:
        log.events_until(lambda seen: len(seen) == 1)
        fast.proc.terminate()
        with pytest.raises(StopIteration):  # the body ends cleanly: no stream.end
            log.next()
    # the command exits 0 once its shutdown is done: the lifespan's end is logged only if
    # no open response held it up
    assert fast.proc.wait(timeout=PATIENCE) == 0
    assert "Application shutdown complete" in fast.log_text()


def test_the_client_follows_across_a_server_killed_and_restarted(
    db_url: str, fast: Node, tokens: Tokens, api: httpx.Client, tmp_path: Path
) -> None:
    """A SIGKILLed server, an event written while it is down, the server back on the same
    port: ``stream_events`` goes on from its last cursor, every event once, in order."""
    follow_across_a_restart(db_url, fast, tokens, api, tmp_path, carrier="sse")


def test_the_async_client_follows_a_task_to_its_end(served: Served) -> None:
    assert follow_a_task_to_its_end(served, "sse") == ["submitted", "cancelled"]


def test_a_revoked_tokens_stream_ends(served: Served) -> None:
    api, fast = served.api, served.node
    task_id = submit_task(api)
    made = api.post("/v1/tokens", json={"name": "follower", "scopes": ["submit"]}).json()
    with stream(fast, made["token"], f"/v1/tasks/{task_id}/events/stream") as task:
        assert task.next().event == "submitted"
        api.post(f"/v1/tokens/{made['id']}/revoke").raise_for_status()
        with pytest.raises(StopIteration):  # no stream.end: the task has not ended
            task.next()
    assert api.get(f"/v1/tasks/{task_id}").json()["state"] == "queued"


def _follow(
    c: Client, carrier: str, task_id: str | None = None, *, outage: float = 60.0
) -> tuple[threading.Event, queue.Queue[BaseException | None]]:
    """``c``'s follow (``stream_events`` or ``subscribe``) on a thread: an event set once
    it yields, and a queue that gets what ended it (None: its end)."""
    yielded, ended = threading.Event(), queue.Queue[BaseException | None]()

    def run() -> None:
        follow = c.stream_events if carrier == "sse" else c.subscribe
        try:
            for _ in follow(task_id, outage=outage):
                yielded.set()
        except BaseException as exc:  # what ended it, for the test thread
            ended.put(exc)
        else:
            ended.put(None)

    threading.Thread(target=run, daemon=True).start()
    return yielded, ended


def _closed_error(ended: queue.Queue[BaseException | None]) -> None:
    """The follow ended, soon, with the closed client's error."""
    exc = ended.get(timeout=5)
    assert isinstance(exc, RuntimeError) and str(exc) == "the client is closed", repr(exc)


@pytest.mark.parametrize("carrier", ["sse", "ws"])
def test_closing_the_client_ends_its_follows_in_other_threads(served: Served, carrier: str) -> None:
    """``Client.close()`` closed only the idle pooled connections: a follow read by
    another thread kept its own and read on, yielding events from a client that was
    closed, until its connection happened to break (a task's stream that does not end,
    the whole log's never). ``close`` shuts the follows' connections down: each ends at
    once with RuntimeError, "the client is closed"."""
    task_id = submit_task(served.api)
    c = Client(served.node.http, served.tokens.submit)
    yielded, ended = _follow(c, carrier, task_id)
    assert yielded.wait(PATIENCE)  # open: the task's first event came
    c.close()
    _closed_error(ended)


def test_a_client_timeout_under_the_keep_alive_interval_is_no_outage(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """A client made with a timeout under the server's keep-alive interval takes an
    idle stream for broken when a read times out, and reopens it, each reopen answered.
    No line of SSE (no frame) came before the next read timed out, so the follow never
    counted the server as heard, and after ``outage`` it raised "the event stream could
    not be reopened" from a healthy server. A stream that opened and then said nothing
    is an idle one: both carriers follow on."""
    node = nodes(args=["--stream-keepalive", "3"])
    clients = {carrier: Client(node.http, tokens.admin, timeout=1) for carrier in ("sse", "ws")}
    follows = {carrier: _follow(c, carrier, outage=1.5) for carrier, c in clients.items()}
    time.sleep(5)  # reads timed out, and reopened, past the outage more than once
    for carrier, c in clients.items():
        c.close()
        _closed_error(follows[carrier][1])  # not Unreachable: still following till then


def _stalled_client(node: Node, token: str, path: str, *, upgrade: bool) -> socket.socket:
    """A stream's client that asks and then never reads: a raw socket with a small
    receive buffer and a small segment size (which keeps the server's send buffer small
    too), so that the server's sends soon wait on it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", node.port))
    head = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{node.port}"]
    head.append(f"Authorization: Bearer {token}")
    if upgrade:
        key = base64.b64encode(os.urandom(16)).decode()
        head += ["Upgrade: websocket", "Connection: Upgrade", f"Sec-WebSocket-Key: {key}"]
        head.append("Sec-WebSocket-Version: 13")
    else:
        head.append("Accept: text/event-stream")
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    return sock


@pytest.mark.parametrize("carrier", ["sse", "ws"])
def test_a_client_that_stops_reading_loses_its_slot(
    nodes: Callable[..., Node], tokens: Tokens, carrier: str
) -> None:
    """A stream whose client takes nothing for ``--stream-send-timeout`` is dropped, and
    its slot (here the node's only one) is free for another stream."""
    node = nodes(args=[*FAST, "--max-streams", "1", "--stream-send-timeout", "0.5"])
    path = "/v1/events/stream" if carrier == "sse" else "/v1/events/ws"
    with httpx.Client(base_url=node.http, timeout=PATIENCE, headers=auth(tokens.admin)) as c:
        create_queue(c)
        stalled = _stalled_client(node, tokens.admin, path, upgrade=carrier == "ws")
        try:
            # admitted (its status line, peeked: nothing is taken from the socket) ...
            stalled.settimeout(PATIENCE)
            status = stalled.recv(12, socket.MSG_PEEK)
            assert status.split()[1:] == [b"200" if carrier == "sse" else b"101"]
            # ... it holds the node's only slot: another is refused
            refused = c.get("/v1/events/stream")
            assert refused.json()["error"]["code"] == "TOO_MANY_STREAMS"
            # events enough to fill the buffers, until the slot is freed
            tasks = [{"queue": "q", "handler": "h"} for _ in range(500)]
            deadline = time.monotonic() + 8 * PATIENCE
            while True:
                c.post("/v1/tasks/batch?reply=ids", json={"tasks": tasks}).raise_for_status()
                with c.stream("GET", "/v1/events/stream") as again:
                    if again.status_code == 200:
                        break
                    assert again.status_code == 503
                assert time.monotonic() < deadline, "the stalled stream's slot was never freed"
        finally:
            stalled.close()


def test_stream_events_rides_a_database_outage(
    db_url: str, fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    """The database away under an open follow: ``stream_events`` rides the failed read and the
    reconnects answered 500 INTERNAL, and goes on from its cursor once it is back."""
    follow_across_a_database_outage(db_url, fast, tokens, api, carrier="sse")
