"""What the event-stream tests share, whichever carrier they test: SSE
(tests/e2e/test_event_stream.py), WebSocket (tests/e2e/test_event_socket.py), or both
(tests/e2e/test_stream_wake.py). The two carriers promise the same reads, so their
tests set up the same way and drive the same scenarios; written once here, a fix to
one is a fix to both.

- the node's stream timings (``FAST``) and a test's patience;
- the calls that make events: a queue, a task, and the whole log as ``GET /v1/events``
  gives it;
- a reader for each carrier: ``stream`` (SSE messages) and ``socket`` (WebSocket frames);
- the fixtures: ``fast`` and ``api``, a fresh node (and database) per test, for tests
  that read the whole log or stop the node; ``served``, one node per module and backend,
  for tests that read only their own tasks and tokens;
- ``Follower``, a client's follow of the log on a thread, and the kill-and-restart
  scenario each client's follow must ride.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlencode

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from orbit.client import AsyncClient, Client
from orbit.client._sse import Message, Parser
from orbit.core.model import TaskSpec
from orbit.store import open_store
from tests.e2e.servers import Node, Tokens, database, make_tokens, start_server

#: a stream reads the log this often, and an idle one says so this often, in these tests
FAST = ["--stream-poll", "0.05", "--stream-keepalive", "0.3"]
#: how long a test waits for what it expects to come (it comes within a poll or two)
PATIENCE = 15.0
#: cursors no server issued: not base64 of a position, and positions that name no event
BAD_CURSORS = ("zz", "OTk5OTkuOTk5OTk", "MC45OTk5OTk")
#: a task id no task has
UNKNOWN = "01a2439c-e925-72b4-8000-0199ea1b10c2"

#: what a client's follow yields: the event's cursor and the event
Item = tuple[str, dict[str, Any]]


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def create_queue(api: httpx.Client) -> None:
    """Queue ``q``, which ``submit_task`` submits to."""
    api.post("/v1/queues", json={"name": "q", "max_concurrency": 5, "rate": 100}).raise_for_status()


def submit_task(api: httpx.Client, payload: Any = None) -> str:
    reply = api.post("/v1/tasks", json={"queue": "q", "handler": "h", "payload": payload})
    reply.raise_for_status()
    return str(reply.json()["task"]["id"])


def all_events(api: httpx.Client, cursor: str | None = None) -> list[dict[str, Any]]:
    """The log after ``cursor`` (or all of it), as ``GET /v1/events`` gives it."""
    items: list[dict[str, Any]] = []
    while True:
        page = api.get(
            "/v1/events", params={"limit": 1000, **({"cursor": cursor} if cursor else {})}
        )
        page.raise_for_status()
        body = page.json()
        items += body["items"]
        cursor = body["next_cursor"]
        if cursor is None:
            return items


@contextlib.contextmanager
def admin_with_queue(node: Node, tokens: Tokens) -> Iterator[httpx.Client]:
    """An admin's client of ``node``, queue ``q`` made."""
    with httpx.Client(base_url=node.http, timeout=PATIENCE, headers=auth(tokens.admin)) as c:
        create_queue(c)
        yield c


def two_nodes(db_url: str, nodes: Callable[..., Node], args: list[str] = FAST) -> tuple[Node, Node]:
    """Nodes ``a`` and ``b`` on one database; skipped on SQLite (one server per file)."""
    if db_url.startswith("sqlite"):
        pytest.skip("one server per SQLite file")
    return nodes(node_id="a", args=args), nodes(node_id="b", args=args)


# --------------------------------------------------------------------------- SSE


class Stream:
    """An open SSE response, read a message at a time."""

    def __init__(self, reply: httpx.Response) -> None:
        self.reply = reply
        self._raw = reply.iter_raw()
        self._parser = Parser()
        self._ready: list[Message] = []

    def next(self) -> Message:
        """The next message; StopIteration when the server ends the stream. Keep-alives
        come every 0.3 s, so a stream that never ends fails the test rather than hang."""
        deadline = time.monotonic() + PATIENCE
        while not self._ready:
            assert time.monotonic() < deadline, "no message, and the stream goes on"
            self._ready = self._parser.feed(next(self._raw))
        return self._ready.pop(0)

    def comment(self) -> bytes:
        """The next comment line: read on past whatever messages come first."""
        text = b"\n"
        while (start := text.find(b"\n:")) < 0 or text.find(b"\n", start + 1) < 0:
            text += next(self._raw)
        return text[start + 1 : text.find(b"\n", start + 1)]

    def events_until(self, done: Callable[[list[Message]], bool]) -> list[Message]:
        seen: list[Message] = []
        while not done(seen):
            seen.append(self.next())
        return seen


@contextlib.contextmanager
def stream(
    node: Node, token: str, path: str, headers: dict[str, str] | None = None, **params: str
) -> Iterator[Stream]:
    with (
        httpx.Client(base_url=node.http, timeout=PATIENCE) as c,
        c.stream("GET", path, headers={**auth(token), **(headers or {})}, params=params) as r,
    ):
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        yield Stream(r)


def sse_has(kind: str, task_id: str) -> Callable[[list[Message]], bool]:
    """Whether the messages read hold ``task_id``'s event of this kind."""
    return lambda seen: any(
        m.event == kind and '"task_id":"' + task_id + '"' in m.data for m in seen
    )


# --------------------------------------------------------------------------- WebSocket


def ws_url(node: Node, path: str, **params: str) -> str:
    return f"ws://127.0.0.1:{node.port}{path}" + ("?" + urlencode(params) if params else "")


class Socket:
    """An open event socket, read a frame at a time."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws

    def frame(self) -> dict[str, Any]:
        """The next frame, keep-alives included; ConnectionClosed once the server closes.
        Keep-alives come every 0.3 s, so a socket that says nothing fails the test."""
        return dict(json.loads(self.ws.recv(timeout=PATIENCE)))

    def next(self) -> dict[str, Any]:
        """The next frame that is not a keep-alive."""
        while (frame := self.frame())["type"] == "keep-alive":
            pass
        return frame

    def events_until(self, done: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
        """Event frames until ``done`` says enough."""
        seen: list[dict[str, Any]] = []
        while not done(seen):
            frame = self.next()
            assert frame["type"] == "event", frame
            seen.append(frame)
        return seen

    def close_code(self) -> tuple[int | None, str | None]:
        """Read on to the server's close: its code and reason."""
        with pytest.raises(ConnectionClosed):
            while True:
                self.frame()
        return self.ws.close_code, self.ws.close_reason


@contextlib.contextmanager
def socket(node: Node, token: str, path: str, **params: str) -> Iterator[Socket]:
    with connect(
        ws_url(node, path, **params), additional_headers=auth(token), open_timeout=PATIENCE
    ) as ws:
        yield Socket(ws)


def refusal(
    node: Node, token: str | None, path: str, query: str = ""
) -> tuple[int, dict[str, Any], Any]:
    """The upgrade's refusal: its status, its error body and its headers."""
    with pytest.raises(InvalidStatus) as refused:
        connect(
            ws_url(node, path) + query,
            additional_headers=auth(token) if token else None,
            open_timeout=PATIENCE,
        )
    reply = refused.value.response
    return reply.status_code, json.loads(bytes(reply.body))["error"], reply.headers


def ws_has(kind: str, task_id: str) -> Callable[[list[dict[str, Any]]], bool]:
    """Whether the frames read hold ``task_id``'s event of this kind."""
    return lambda seen: any(
        f["event"]["kind"] == kind and f["event"]["task_id"] == task_id for f in seen
    )


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def fast(nodes: Callable[..., Node]) -> Node:
    """A node of its own, on a fresh database: for a test that reads the whole log, or
    that stops, kills or starves the node."""
    return nodes(args=FAST)


@pytest.fixture
def api(fast: Node, tokens: Tokens) -> Iterator[httpx.Client]:
    with admin_with_queue(fast, tokens) as c:
        yield c


@dataclass
class Served:
    """A node shared by a module's tests on one backend (starting one costs seconds),
    its tokens, and an admin's client with queue ``q`` made. A test served by it reads
    only the tasks and tokens it makes itself, and leaves the node running."""

    node: Node
    tokens: Tokens
    api: httpx.Client


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    backend = str(request.param)
    work = tmp_path_factory.mktemp(f"streams-{backend}")
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(database(backend, work))
        tokens = make_tokens(url)
        node = start_server(url, work, args=FAST)
        stack.callback(node.stop)
        yield Served(node, tokens, stack.enter_context(admin_with_queue(node, tokens)))


# --------------------------------------------------------------------------- following


class Follower:
    """A client following the whole log on a thread, until its first ``cancelled``
    event: ``Client`` or ``AsyncClient`` (``form``), over SSE (``stream_events``) or
    WebSocket (``subscribe``), riding outages of up to ``PATIENCE``. Each item, or the
    exception that ended the follow, is queued for ``take``: the test thread asserts."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        carrier: Literal["sse", "ws"],
        form: Literal["sync", "async"] = "sync",
        timeout: float,
    ) -> None:
        self._url, self._token, self._carrier, self._timeout = url, token, carrier, timeout
        self._got: queue.Queue[Item | BaseException] = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(form,), daemon=True)
        self.thread.start()

    def _run(self, form: str) -> None:
        try:
            if form == "async":
                asyncio.run(self._follow_async())
            else:
                self._follow()
        except BaseException as exc:
            self._got.put(exc)

    def _follow(self) -> None:
        with Client(self._url, self._token, timeout=self._timeout) as c:
            follow = c.stream_events if self._carrier == "sse" else c.subscribe
            for item in follow(outage=PATIENCE):
                self._got.put(item)
                if item[1]["kind"] == "cancelled":
                    return

    async def _follow_async(self) -> None:
        async with AsyncClient(self._url, self._token, timeout=self._timeout) as c:
            items: AsyncIterator[Item] = (
                c.stream_events(outage=PATIENCE)
                if self._carrier == "sse"
                else c.subscribe(outage=PATIENCE)
            )
            async for item in items:
                self._got.put(item)
                if item[1]["kind"] == "cancelled":
                    return

    def take(self) -> Item:
        """The next item the follow yielded; the follow's exception fails the test."""
        item = self._got.get(timeout=PATIENCE)
        assert not isinstance(item, BaseException), item
        return item

    def join(self) -> None:
        self.thread.join(PATIENCE)


def follow_across_a_restart(
    db_url: str,
    fast: Node,
    tokens: Tokens,
    api: httpx.Client,
    tmp_path: Path,
    *,
    carrier: Literal["sse", "ws"],
    form: Literal["sync", "async"] = "sync",
) -> None:
    """A SIGKILLed server, an event written while it is down, the server back on the same
    port: the follow goes on from its last cursor, every event once, in order, and each
    cursor is its event's place in the feed (the next event follows it)."""
    first = submit_task(api)
    follower = Follower(fast.http, tokens.admin, carrier=carrier, form=form, timeout=5)
    seen = [follower.take(), follower.take()]
    assert [e["kind"] for _, e in seen] == ["queue.created", "submitted"]
    fast.kill()
    store = open_store(db_url)
    try:  # written while no server runs: the follower must not miss it
        while_down = store.task_submit(TaskSpec(queue="q", handler="h")).task.id
    finally:
        store.close()
    back = start_server(db_url, tmp_path, args=[*FAST, "--port", str(fast.port)])
    try:
        with httpx.Client(base_url=back.http, timeout=PATIENCE, headers=auth(tokens.admin)) as c:
            late = submit_task(c)
            c.post(f"/v1/tasks/{first}/cancel").raise_for_status()
            while (item := follower.take())[1]["kind"] != "cancelled":
                seen.append(item)
            seen.append(item)
            follower.join()
            expected = all_events(c)
            for (cursor, _), (_, after) in itertools.pairwise(seen):
                page = c.get("/v1/events", params={"cursor": cursor, "limit": 1}).json()
                assert page["items"] == [after]
    finally:
        back.stop()
    assert [e for _, e in seen] == expected  # every event once, in order
    assert {while_down, late} <= {e["task_id"] for _, e in seen}
    assert not follower.thread.is_alive()


def follow_across_a_database_outage(
    db_url: str,
    fast: Node,
    tokens: Tokens,
    api: httpx.Client,
    *,
    carrier: Literal["sse", "ws"],
) -> None:
    """The database away under an open follow (its events table taken away, as the
    1011 test does): the stream ends (a read failed), and each reconnect is answered 500
    INTERNAL while the table stays away. The follow rides that as an outage and, once the
    table is back, goes on from its cursor. A follow took the 500 for a refusal and
    ended, so a database hiccup of a second ended every follow open at the time."""
    from tests.e2e.test_api import _rename_tokens_table as rename_table

    first = submit_task(api)
    follower = Follower(fast.http, tokens.admin, carrier=carrier, timeout=5)
    assert [follower.take()[1]["kind"] for _ in range(2)] == ["queue.created", "submitted"]
    refused = "event stream upgrade failed" if carrier == "ws" else "request failed"
    rename_table(db_url, "orbit_events", "orbit_events_away")
    try:
        deadline = time.monotonic() + PATIENCE
        while fast.log_text().count(refused) < 2:  # two reconnects answered 500
            assert time.monotonic() < deadline, "no reconnect was refused"
            time.sleep(0.05)
    finally:
        rename_table(db_url, "orbit_events_away", "orbit_events")
    api.post(f"/v1/tasks/{first}/cancel").raise_for_status()
    kinds = []
    while (item := follower.take())[1]["kind"] != "cancelled":
        kinds.append(item[1]["kind"])
    follower.join()
    assert not follower.thread.is_alive()
    assert "submitted" not in kinds  # from its cursor: nothing seen before comes again


def follow_a_task_to_its_end(served: Served, carrier: Literal["sse", "ws"]) -> list[str]:
    """The kinds of event ``AsyncClient`` reads following a task of its own (over SSE,
    ``stream_events``, or WebSocket, ``subscribe``), which it cancels once it has read
    the submit: the follow ends by itself once the task has ended."""
    task_id = submit_task(served.api)

    async def follow() -> list[str]:
        kinds = []
        async with AsyncClient(served.node.http, served.tokens.submit) as c:
            events = c.stream_events(task_id) if carrier == "sse" else c.subscribe(task_id)
            async for _, event in events:
                kinds.append(event["kind"])
                if event["kind"] == "submitted":
                    served.api.post(f"/v1/tasks/{task_id}/cancel").raise_for_status()
        return kinds

    return asyncio.run(follow())
