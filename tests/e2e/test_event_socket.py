"""Event subscriptions over WebSocket (``/v1/events/ws``, ``/v1/tasks/{id}/events/ws``)
against real ``orbit server`` processes, on both backends: the SSE streams' twins
(tests/e2e/test_event_stream.py), sharing their reads, their cap and their shutdown.

- Each event is a frame with its cursor and its EventView, as ``GET /v1/events`` gives
  it; a task's socket sends ``stream.end`` once the task has ended, then closes 1000.
- A reconnect with ``?cursor=`` gets exactly the events written meanwhile, none twice.
- PostgreSQL, two nodes: a socket on node B sees the events written through node A.
- Refusals answer the upgrade with the SSE route's status and error body, before any
  frame: a bad cursor 400, ``cursor`` twice 400, no token 401 (a token in the URL is
  none), a wrong scope 403, an unknown task 404, a NUL in the URL 400, the node at its
  cap of streams (SSE and WebSocket counted together) 503.
- An idle socket sends keep-alive frames; SIGTERM closes it 1012 and the server exits; a
  revoked token closes it 4401.
- ``Client.subscribe`` and ``AsyncClient.subscribe`` ride a SIGKILL and restart of the
  server and miss nothing written while it was down, and abort (no close frame) a
  connection that went silent before reconnecting, or that their caller leaves while
  frames are still coming (no wait for a closing handshake); ``AsyncClient.subscribe`` follows a
  task to its end; both raise a refusal at once.
- A refused upgrade is no ERROR line in the server's log.

The setup, the readers and the scenarios shared with the SSE twins are in
tests/e2e/streams_common.py. The tests that read only their own tasks and tokens share
one node per backend (``served``).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from orbit.client import (
    ApiError,
    AsyncClient,
    BadRequest,
    Client,
    Forbidden,
    NotFound,
    Unauthorized,
)
from tests.e2e import streams_common
from tests.e2e.servers import Node, Tokens
from tests.e2e.streams_common import (
    BAD_CURSORS,
    FAST,
    PATIENCE,
    UNKNOWN,
    Follower,
    Served,
    Socket,
    admin_with_queue,
    all_events,
    auth,
    follow_a_task_to_its_end,
    follow_across_a_database_outage,
    follow_across_a_restart,
    refusal,
    socket,
    stream,
    submit_task,
    two_nodes,
    ws_has,
    ws_url,
)
from tests.e2e.test_api import _rename_tokens_table
from tests.fault.proxy import FaultProxy

# the fixtures: a fresh node per test (``fast``, ``api``), or one per backend (``served``)
fast, api, served = streams_common.fast, streams_common.api, streams_common.served


def test_events_come_as_frames_and_a_task_socket_ends(
    api: httpx.Client, fast: Node, tokens: Tokens
) -> None:
    with socket(fast, tokens.admin, "/v1/events/ws") as log:
        first = log.events_until(lambda seen: len(seen) == 1)
        task_id = submit_task(api)
        with socket(fast, tokens.submit, f"/v1/tasks/{task_id}/events/ws") as task:
            assert task.next()["event"]["kind"] == "submitted"
            log.events_until(ws_has("submitted", task_id))
            api.post(f"/v1/tasks/{task_id}/cancel").raise_for_status()
            cancelled = log.events_until(ws_has("cancelled", task_id))[-1]
            assert task.next()["event"]["kind"] == "cancelled"
            assert task.next() == {"type": "stream.end", "task_id": task_id, "state": "cancelled"}
            assert task.close_code() == (1000, "stream.end")
    # each frame's event is the event as GET /v1/events gives it, its cursor the event's
    listed = all_events(api)
    assert [e["kind"] for e in listed] == ["queue.created", "submitted", "cancelled"]
    assert first[0]["event"] == listed[0]
    assert cancelled["event"] == listed[-1]
    after = api.get("/v1/events", params={"cursor": first[0]["cursor"]}).json()["items"]
    assert after == listed[1:]


def test_a_reconnect_with_the_cursor_gets_exactly_the_missed_events(
    api: httpx.Client, fast: Node, tokens: Tokens
) -> None:
    early = [submit_task(api, i) for i in range(3)]
    with socket(fast, tokens.admin, "/v1/events/ws") as log:
        seen = log.events_until(ws_has("submitted", early[-1]))
    last = seen[-1]["cursor"]
    # more than a stream reads at a time (orbit.server.streams.PAGE, 500)
    batch = [{"queue": "q", "handler": "h", "payload": i} for i in range(700)]
    reply = api.post("/v1/tasks/batch", params={"reply": "ids"}, json={"tasks": batch})
    late = [item["id"] for item in reply.json()]
    api.post(f"/v1/tasks/{early[0]}/cancel").raise_for_status()
    with socket(fast, tokens.admin, "/v1/events/ws", cursor=last) as log:
        missed = log.events_until(ws_has("cancelled", early[0]))
    # exactly the events after the last one read: each once, in the log's order
    assert [f["event"] for f in missed] == all_events(api, last)
    assert [f["event"]["kind"] for f in missed] == ["submitted"] * len(late) + ["cancelled"]
    assert {f["event"]["task_id"] for f in missed} == {*late, early[0]}
    assert len({f["cursor"] for f in seen + missed}) == len(seen) + len(missed)


def test_a_socket_on_one_node_sees_events_written_through_another(
    db_url: str, nodes: Callable[..., Node], tokens: Tokens
) -> None:
    node_a, node_b = two_nodes(db_url, nodes)
    with (
        admin_with_queue(node_a, tokens) as a,
        socket(node_b, tokens.admin, "/v1/events/ws") as log,
    ):
        task_id = submit_task(a)
        with socket(node_b, tokens.submit, f"/v1/tasks/{task_id}/events/ws") as task:
            a.post(f"/v1/tasks/{task_id}/cancel").raise_for_status()
            got = log.events_until(ws_has("cancelled", task_id))
            kinds = [task.next()["event"]["kind"], task.next()["event"]["kind"]]
            assert task.next()["type"] == "stream.end"
    assert [f["event"]["kind"] for f in got] == ["queue.created", "submitted", "cancelled"]
    assert kinds == ["submitted", "cancelled"]


def test_refusals_answer_the_upgrade_before_any_frame(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """Each refusal is the SSE route's status and JSON error, as the upgrade's answer; it
    changes nothing and keeps no slot (the node serves one stream at a time)."""
    fast = nodes(args=[*FAST, "--max-streams", "1"])
    with admin_with_queue(fast, tokens) as api:
        task_id = submit_task(api)
        task_path = f"/v1/tasks/{task_id}/events/ws"
        for path in ("/v1/events/ws", task_path):
            for cursor in BAD_CURSORS:
                status, error, _ = refusal(fast, tokens.admin, path, "?cursor=" + cursor)
                assert (status, error["code"], error["field"]) == (400, "INVALID_CURSOR", "cursor")
        status, error, _ = refusal(fast, tokens.admin, "/v1/events/ws", "?cursor=MC4x&cursor=MC4x")
        assert (status, error["code"], error["field"]) == (400, "INVALID_ARGUMENT", "cursor")
        for path in ("/v1/events/ws", task_path):
            status, error, headers = refusal(fast, None, path)
            assert (status, error["code"]) == (401, "UNAUTHENTICATED")
            assert headers["WWW-Authenticate"] == "Bearer"
            # a token in the URL is no token: it would be in every proxy's and server's log
            for name in ("token", "access_token"):
                status, error, _ = refusal(fast, None, path, f"?{name}={tokens.admin}")
                assert (status, error["code"]) == (401, "UNAUTHENTICATED")
        status, error, _ = refusal(fast, tokens.submit, "/v1/events/ws")
        assert (status, error["code"]) == (403, "FORBIDDEN")
        status, error, _ = refusal(fast, tokens.worker, task_path)
        assert (status, error["code"]) == (403, "FORBIDDEN")
        status, error, _ = refusal(fast, tokens.submit, f"/v1/tasks/{UNKNOWN}/events/ws")
        assert (status, error["code"]) == (404, "TASK_NOT_FOUND")
        status, error, _ = refusal(fast, tokens.submit, "/v1/tasks/a%00b/events/ws")
        assert (status, error["code"]) == (400, "NUL_CHARACTER")
        # nothing was changed, and no refused socket kept the one slot: a socket may open
        assert [e["kind"] for e in all_events(api)] == ["queue.created", "submitted"]
    with socket(fast, tokens.submit, task_path) as task:
        assert task.next()["event"]["kind"] == "submitted"


def test_a_failed_token_check_answers_500_and_keeps_no_slot(
    nodes: Callable[..., Node], tokens: Tokens, db_url: str
) -> None:
    """A token check that fails in the database judged nothing: 500 INTERNAL (which a
    client retries), logged, never a refusal of the token; once the database answers
    again, the same token subscribes (the one slot was not kept)."""
    node = nodes(args=[*FAST, "--max-streams", "1"])
    _rename_tokens_table(db_url, "orbit_tokens", "orbit_tokens_away")
    try:
        status, error, _ = refusal(node, tokens.admin, "/v1/events/ws")
    finally:
        _rename_tokens_table(db_url, "orbit_tokens_away", "orbit_tokens")
    assert (status, error["code"]) == (500, "INTERNAL")
    assert "event stream upgrade failed" in node.log_text()
    with socket(node, tokens.admin, "/v1/events/ws") as log:
        log.frame()


@contextmanager
def once_free(node: Node, token: str) -> Iterator[Socket]:
    """A socket on ``node``, opened once a closed stream's slot is free again: the server
    frees it once it hears the client went."""
    deadline = time.monotonic() + PATIENCE
    while True:
        try:
            ws = connect(
                ws_url(node, "/v1/events/ws"), additional_headers=auth(token), open_timeout=PATIENCE
            )
            break
        except InvalidStatus as exc:
            assert exc.response.status_code == 503
        assert time.monotonic() < deadline, "a closed stream's slot was never freed"
        time.sleep(0.05)
    with ws:
        yield Socket(ws)


def test_sockets_and_sse_streams_share_the_cap(nodes: Callable[..., Node], tokens: Tokens) -> None:
    node = nodes(args=[*FAST, "--max-streams", "1"])
    with httpx.Client(base_url=node.http, timeout=PATIENCE, headers=auth(tokens.admin)) as c:
        with stream(node, tokens.admin, "/v1/events/stream"):
            status, error, headers = refusal(node, tokens.admin, "/v1/events/ws")
            assert (status, error["code"]) == (503, "TOO_MANY_STREAMS")
            assert headers["Retry-After"] == "1"
        with once_free(node, tokens.admin) as log:
            log.frame()  # open: it holds the slot
            refused = c.get("/v1/events/stream")
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "TOO_MANY_STREAMS"
            status, error, _ = refusal(node, tokens.admin, "/v1/events/ws")
            assert (status, error["code"]) == (503, "TOO_MANY_STREAMS")
        with once_free(node, tokens.admin):  # the socket's slot, freed once it closed
            pass


def test_an_idle_socket_sends_keep_alive_frames(served: Served) -> None:
    api, fast, tokens = served.api, served.node, served.tokens
    task_id = submit_task(api)
    with socket(fast, tokens.submit, f"/v1/tasks/{task_id}/events/ws") as task:
        assert task.frame()["event"]["kind"] == "submitted"
        assert task.frame() == {"type": "keep-alive"}


def test_sigterm_closes_open_sockets_and_the_server_exits(
    api: httpx.Client, fast: Node, tokens: Tokens
) -> None:
    with socket(fast, tokens.admin, "/v1/events/ws") as log:
        log.events_until(lambda seen: len(seen) == 1)
        fast.proc.terminate()
        assert log.close_code()[0] == 1012  # service restart: reconnect from the cursor
    assert fast.proc.wait(timeout=PATIENCE) == 0
    assert "Application shutdown complete" in fast.log_text()


def test_a_revoked_tokens_socket_is_closed(served: Served) -> None:
    api, fast = served.api, served.node
    task_id = submit_task(api)
    made = api.post("/v1/tokens", json={"name": "follower", "scopes": ["submit"]}).json()
    with socket(fast, made["token"], f"/v1/tasks/{task_id}/events/ws") as task:
        assert task.next()["event"]["kind"] == "submitted"
        api.post(f"/v1/tokens/{made['id']}/revoke").raise_for_status()
        assert task.close_code() == (4401, "UNAUTHENTICATED")  # no stream.end
    assert api.get(f"/v1/tasks/{task_id}").json()["state"] == "queued"
    # the client reconnects after the close, and raises the refusal it then meets
    other = api.post("/v1/tokens", json={"name": "sdk", "scopes": ["submit"]}).json()
    with Client(fast.http, other["token"]) as c:
        events = c.subscribe(task_id, outage=PATIENCE)
        assert next(events)[1]["kind"] == "submitted"
        api.post(f"/v1/tokens/{other['id']}/revoke").raise_for_status()
        with pytest.raises(Unauthorized):
            next(events)


@pytest.mark.parametrize("form", ["sync", "async"])
def test_the_client_subscribes_across_a_server_killed_and_restarted(
    db_url: str,
    fast: Node,
    tokens: Tokens,
    api: httpx.Client,
    tmp_path: Path,
    form: Literal["sync", "async"],
) -> None:
    """A SIGKILLed server, an event written while it is down, the server back on the same
    port: ``subscribe`` (``Client``'s and ``AsyncClient``'s) goes on from its last
    cursor, every event once, in order."""
    follow_across_a_restart(db_url, fast, tokens, api, tmp_path, carrier="ws", form=form)


def test_subscribe_waits_out_a_node_at_its_cap_for_its_outage(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """A node at its cap (503 TOO_MANY_STREAMS) is tried again, as ``stream_events``
    tries it: given no outage the refusal is raised; given one, the follow opens once
    the slot is free."""
    node = nodes(args=[*FAST, "--max-streams", "1"])
    got: queue.Queue[tuple[str, dict[str, Any]] | BaseException] = queue.Queue()
    with Client(node.http, tokens.admin, timeout=5) as c:
        c.queue_create("q", max_concurrency=5, rate=100)
        with stream(node, tokens.admin, "/v1/events/stream"):
            with pytest.raises(ApiError) as busy:
                next(c.subscribe(outage=0))
            assert (busy.value.status, busy.value.code) == (503, "TOO_MANY_STREAMS")

            def follow() -> None:
                try:
                    got.put(next(c.subscribe(outage=PATIENCE)))
                except BaseException as exc:
                    got.put(exc)

            follower = threading.Thread(target=follow, daemon=True)
            follower.start()
        item = got.get(timeout=PATIENCE)  # the SSE stream has gone: its slot is free
        follower.join(PATIENCE)
    assert not isinstance(item, BaseException), item
    assert item[1]["kind"] == "queue.created"


def test_a_failed_read_closes_the_socket_1011(
    api: httpx.Client, fast: Node, tokens: Tokens, db_url: str
) -> None:
    """A read that fails (here the events table taken away; in life the database gone)
    closes the socket 1011 INTERNAL, logged: the client reconnects from its cursor."""
    with socket(fast, tokens.admin, "/v1/events/ws") as log:
        log.events_until(lambda seen: len(seen) == 1)
        _rename_tokens_table(db_url, "orbit_events", "orbit_events_away")
        try:
            assert log.close_code() == (1011, "INTERNAL")
        finally:
            _rename_tokens_table(db_url, "orbit_events_away", "orbit_events")
    assert "event stream ended: a read failed" in fast.log_text()


def test_the_async_client_subscribes_to_a_task_to_its_end(served: Served) -> None:
    assert follow_a_task_to_its_end(served, "ws") == ["submitted", "cancelled"]


def test_subscribe_raises_a_refusal_at_once(served: Served) -> None:
    """A bad cursor, an unknown task, a wrong scope: raised as the HTTP calls raise them,
    however long ``outage`` is (no retry could mend one)."""
    api, fast, tokens = served.api, served.node, served.tokens
    task_id = submit_task(api)
    with Client(fast.http, tokens.submit) as c:
        with pytest.raises(BadRequest) as bad:
            next(c.subscribe(task_id, cursor="zz", outage=PATIENCE))
        assert bad.value.code == "INVALID_CURSOR"
        with pytest.raises(NotFound):
            next(c.subscribe(UNKNOWN, outage=PATIENCE))
        with pytest.raises(Forbidden):
            next(c.subscribe(outage=PATIENCE))

    async def refused() -> str:
        async with AsyncClient(fast.http, tokens.submit) as c:
            with pytest.raises(BadRequest) as bad:
                await anext(c.subscribe(task_id, cursor="zz", outage=PATIENCE))
            with pytest.raises(Forbidden):
                await anext(c.subscribe(outage=PATIENCE))
            return bad.value.code

    assert asyncio.run(refused()) == "INVALID_CURSOR"


def test_a_refused_upgrade_logs_no_error(
    nodes: Callable[..., Node], tokens: Tokens, db_url: str
) -> None:
    """A refused upgrade is routine (a wrong token, a wrong scope): answered with its
    status, it is no ERROR in the server's log. uvicorn's own WebSocket protocol logged
    ``ASGI callable returned without completing handshake`` at ERROR for every one, the
    denial response sent in full notwithstanding."""
    node = nodes(args=FAST)
    worker = f"ws://127.0.0.1:{node.port}/v1/worker"
    with pytest.raises(InvalidStatus) as refused:
        connect(worker, additional_headers=auth("not-a-token"), open_timeout=PATIENCE)
    assert refused.value.response.status_code == 401
    with pytest.raises(InvalidStatus) as refused:
        connect(worker, additional_headers=auth(tokens.submit), open_timeout=PATIENCE)
    assert refused.value.response.status_code == 403
    assert refusal(node, None, "/v1/events/ws")[0] == 401
    assert refusal(node, tokens.worker, "/v1/events/ws")[0] == 403
    node.stop()  # every line the refusals made is written by now
    log = node.log_text()
    assert " ERROR " not in log, log
    assert "without completing handshake" not in log, log


def test_no_socket_negotiates_permessage_deflate(node: Node, tokens: Tokens) -> None:
    """Frames travel uncompressed whatever the client offers. uvicorn's default accepted
    permessage-deflate from any client offering it, as the websockets library and browsers
    do by default (Orbit's own worker and client never do): deflating a drain's frames
    cost the server about eleven times the instructions of the rest of its WebSocket layer
    (``benchmarks/wslayer.py``)."""
    for token, path in ((tokens.worker, "/v1/worker"), (tokens.admin, "/v1/events/ws")):
        with connect(
            ws_url(node, path),
            additional_headers=auth(token),
            compression="deflate",
            open_timeout=PATIENCE,
        ) as ws:
            assert ws.protocol.extensions == [], path
            assert "Sec-WebSocket-Extensions" not in ws.response.headers, path


@pytest.mark.parametrize("form", ["sync", "async"])
def test_subscribe_aborts_a_connection_it_gives_up_on(
    api: httpx.Client, fast: Node, tokens: Tokens, form: Literal["sync", "async"]
) -> None:
    """A server that stops answering without closing (a host gone, a network cut: here a
    proxy that holds every frame, either way) is given up on once a read waited the
    client's timeout, and the follow reconnects from its cursor. The connection given up
    on is aborted: no close frame goes to it, and no closing handshake waits websockets'
    close timeout (10 s) for a peer that will never answer before the reconnect. Before,
    both forms sent a close frame and waited."""
    first = submit_task(api)
    with FaultProxy(fast.port) as proxy:
        follower = Follower(proxy.http, tokens.admin, carrier="ws", form=form, timeout=2)
        kinds = [follower.take()[1]["kind"], follower.take()[1]["kind"]]
        assert kinds == ["queue.created", "submitted"]
        held = proxy.opened()
        proxy.pause("both")  # the server says nothing more, and hears nothing
        proxy.wait_opened(held + 1, timeout=4 * PATIENCE)  # the follow reconnected
        proxy.resume("both")
        api.post(f"/v1/tasks/{first}/cancel").raise_for_status()
        assert follower.take()[1]["kind"] == "cancelled"
        follower.join()
        closes = [r for r in proxy.records("up") if r.link <= held and r.opcode == 8]
    assert closes == []  # no closing handshake with the connection given up on
    assert not follower.thread.is_alive()


def test_subscribe_rides_a_database_outage(
    db_url: str, fast: Node, tokens: Tokens, api: httpx.Client
) -> None:
    """The database away under an open follow: ``subscribe`` rides the failed read and the
    reconnects answered 500 INTERNAL, and goes on from its cursor once it is back."""
    follow_across_a_database_outage(db_url, fast, tokens, api, carrier="ws")


@pytest.mark.parametrize("form", ["sync", "async"])
def test_leaving_a_subscribe_with_frames_still_coming_closes_it_at_once(
    served: Served, form: Literal["sync", "async"]
) -> None:
    """A caller that stops its follow (it breaks out of its loop at the event it waited
    for) while the log goes on coming: websockets stops reading the socket once 16 frames
    wait unread, so the server's answer to a closing handshake, queued behind the frames
    still on their way, was never read, and leaving the loop took websockets' whole close
    timeout (10 s by default; here far longer than the test waits). Both forms now abort
    the connection, as they abort one they give up on: a stream is only read."""
    api, node, tokens = served.api, served.node, served.tokens
    tasks = [{"queue": "q", "handler": "h"}] * 300  # hundreds of frames behind the first
    api.post("/v1/tasks/batch", json={"tasks": tasks}).raise_for_status()
    left: queue.Queue[BaseException | None] = queue.Queue()

    def leave() -> None:
        with Client(node.http, tokens.admin, timeout=PATIENCE) as c:
            c._socket["close_timeout"] = 100 * PATIENCE
            follow = c.subscribe(outage=PATIENCE)
            next(follow)
            follow.close()

    async def leave_async() -> None:
        async with AsyncClient(node.http, tokens.admin, timeout=PATIENCE) as c:
            c._socket["close_timeout"] = 100 * PATIENCE
            follow = c.subscribe(outage=PATIENCE)
            await anext(follow)
            await follow.aclose()

    def run() -> None:
        try:
            leave() if form == "sync" else asyncio.run(leave_async())
        except BaseException as exc:
            left.put(exc)
        else:
            left.put(None)

    threading.Thread(target=run, daemon=True).start()
    try:
        assert left.get(timeout=PATIENCE) is None
    except queue.Empty:
        pytest.fail("leaving the follow waited for a closing handshake")
