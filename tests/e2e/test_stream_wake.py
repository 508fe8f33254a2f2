"""Event streams are woken by commits (orbit/server/streams.py), with the poll as the
safety net, against real ``orbit server`` processes on both backends.

The nodes here poll once a minute (``--stream-poll 60``, and keep-alives as rarely),
while a test waits at most ``PATIENCE`` (15 s) for what it expects: an event that comes
was brought by a wake, never by the poll.

- An event committed through the node reaches an open SSE stream and an open WebSocket
  stream (the whole log's and a task's, which then ends).
- PostgreSQL, two nodes: events committed through node A reach streams on node B, both
  those whose commit sends a notice of its own (a submit, a cancel) and those whose
  commit sends none (a queue created: node A's coalesced ``orbit_events``).
- PostgreSQL: an event held back behind an older running transaction (the horizon)
  comes once that transaction ends, though the end wakes nobody: the stream re-reads
  after a short pause while events are held back, not after the whole poll.
- An event committed with no wake at all (written by another process straight into the
  database) still comes, by the poll.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import psycopg
import pytest

from orbit.store import open_store
from tests.e2e.servers import Node, Tokens
from tests.e2e.streams_common import (
    PATIENCE,
    admin_with_queue,
    auth,
    create_queue,
    socket,
    sse_has,
    stream,
    submit_task,
    two_nodes,
    ws_has,
)

#: streams that read only when woken, within any test's patience
SLOW = ["--stream-poll", "60", "--stream-keepalive", "60"]


@pytest.fixture
def slow(nodes: Callable[..., Node]) -> Node:
    return nodes(args=SLOW)


@pytest.fixture
def api(slow: Node, tokens: Tokens) -> Iterator[httpx.Client]:
    with admin_with_queue(slow, tokens) as c:
        yield c


def test_a_commit_wakes_open_sse_and_websocket_streams(
    api: httpx.Client, slow: Node, tokens: Tokens
) -> None:
    with (
        stream(slow, tokens.admin, "/v1/events/stream") as sse,
        socket(slow, tokens.admin, "/v1/events/ws") as ws,
    ):
        # the first page, read as the streams opened
        assert sse.next().event == "queue.created"
        assert ws.next()["event"]["kind"] == "queue.created"
        task_id = submit_task(api)
        sse.events_until(sse_has("submitted", task_id))
        ws.events_until(ws_has("submitted", task_id))
        with (
            stream(slow, tokens.submit, f"/v1/tasks/{task_id}/events/stream") as task_sse,
            socket(slow, tokens.submit, f"/v1/tasks/{task_id}/events/ws") as task_ws,
        ):
            assert task_sse.next().event == "submitted"
            assert task_ws.next()["event"]["kind"] == "submitted"
            api.post(f"/v1/tasks/{task_id}/cancel").raise_for_status()
            sse.events_until(sse_has("cancelled", task_id))
            ws.events_until(ws_has("cancelled", task_id))
            assert [task_sse.next().event, task_sse.next().event] == ["cancelled", "stream.end"]
            assert [task_ws.next()["type"], task_ws.next()["type"]] == ["event", "stream.end"]


def test_a_commit_on_one_node_wakes_streams_on_another(
    db_url: str, nodes: Callable[..., Node], tokens: Tokens
) -> None:
    node_a, node_b = two_nodes(db_url, nodes, SLOW)
    with (
        httpx.Client(base_url=node_a.http, timeout=PATIENCE, headers=auth(tokens.admin)) as a,
        stream(node_b, tokens.admin, "/v1/events/stream") as sse,
        socket(node_b, tokens.admin, "/v1/events/ws") as ws,
    ):
        # a queue created sends no notice of its own: node A's orbit_events wakes B
        create_queue(a)
        assert sse.next().event == "queue.created"
        assert ws.next()["event"]["kind"] == "queue.created"
        # a submit's commit sends orbit_ready, which wakes B's streams as well
        task_id = submit_task(a)
        sse.events_until(sse_has("submitted", task_id))
        ws.events_until(ws_has("submitted", task_id))
        a.post(f"/v1/tasks/{task_id}/cancel").raise_for_status()
        sse.events_until(sse_has("cancelled", task_id))
        ws.events_until(ws_has("cancelled", task_id))


def test_an_event_held_behind_a_running_transaction_comes_when_it_ends(
    db_url: str, api: httpx.Client, slow: Node, tokens: Tokens
) -> None:
    if db_url.startswith("sqlite"):
        pytest.skip("SQLite runs one writer at a time: nothing is held back")
    with (
        stream(slow, tokens.admin, "/v1/events/stream") as sse,
        socket(slow, tokens.admin, "/v1/events/ws") as ws,
    ):
        assert sse.next().event == "queue.created"
        assert ws.next()["event"]["kind"] == "queue.created"
        with psycopg.connect(db_url) as holder:
            holder.execute("SELECT pg_current_xact_id()")  # an older running transaction
            task_id = submit_task(api)
            # the submit committed, and its wake came, but its event is held back
            listed = api.get("/v1/events").json()["items"]
            assert [e["kind"] for e in listed] == ["queue.created"]
        # the holder ended (rolled back: no commit of events, so no wake)
        sse.events_until(sse_has("submitted", task_id))
        ws.events_until(ws_has("submitted", task_id))


def test_an_event_committed_with_no_wake_comes_by_the_poll(
    db_url: str, nodes: Callable[..., Node], tokens: Tokens
) -> None:
    node = nodes(args=["--stream-poll", "0.2", "--stream-keepalive", "60"])
    with (
        stream(node, tokens.admin, "/v1/events/stream") as sse,
        socket(node, tokens.admin, "/v1/events/ws") as ws,
    ):
        # another process's store: no server hears of its commit (a queue created sends
        # no notice on PostgreSQL, and nothing at all is sent on SQLite)
        other = open_store(db_url)
        try:
            other.queue_create("quiet", max_concurrency=1, rate=0)
        finally:
            other.close()
        got = sse.next()
        assert (got.event, '"queue":"quiet"' in got.data) == ("queue.created", True)
        frame = ws.next()["event"]
        assert (frame["kind"], frame["queue"]) == ("queue.created", "quiet")


def test_an_event_held_back_as_a_stream_opens_comes_when_the_holder_ends(
    db_url: str, api: httpx.Client, slow: Node, tokens: Tokens
) -> None:
    """The first page, read before the stream is accepted, found an event held back: the
    stream re-reads shortly, as after any later read that said so, not after the poll."""
    if db_url.startswith("sqlite"):
        pytest.skip("SQLite runs one writer at a time: nothing is held back")
    with psycopg.connect(db_url) as holder:
        holder.execute("SELECT pg_current_xact_id()")  # an older running transaction
        task_id = submit_task(api)  # committed, its wake gone before any stream opened
        with (
            stream(slow, tokens.admin, "/v1/events/stream") as sse,
            socket(slow, tokens.admin, "/v1/events/ws") as ws,
        ):
            assert sse.next().event == "queue.created"
            assert ws.next()["event"]["kind"] == "queue.created"
            holder.rollback()  # the holder ends: no commit of events, so no wake
            sse.events_until(sse_has("submitted", task_id))
            ws.events_until(ws_has("submitted", task_id))
