"""The clients' own logic over a real loopback HTTP server: ``wait`` (and ``orbit task
wait``) riding over a server that is briefly unreachable, iterations resumed from a
cursor, ``TaskFailed``'s message, and both clients' one retry of a GET on a kept-alive
connection the server closed as it was reused."""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import re
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import typer

from orbit.cli.api import EXIT_TIMEOUT, _wait
from orbit.client import (
    ApiError,
    AsyncClient,
    BadRequest,
    Client,
    NotFound,
    TaskFailed,
    TooManyRequests,
    Unreachable,
    WaitTimeout,
)
from orbit.client._client import POLL_TIMEOUT_FLOOR, Waiting
from orbit.client._http import MAX_TIMEOUT, Transport
from tests.http_servers import AnsweringHandler, serving


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    #: requests answered by hanging up without a word (a server going down mid-deploy)
    drop_first = 0
    #: on each connection, its n-th request is met by a hang-up (0: never)
    drop_on_reuse = 0
    #: requests answered by a proxy in front whose server is away: (status, how many)
    gateway_first = (502, 0)
    #: requests answered by Orbit's own 500 INTERNAL (its database away)
    internal_first = 0
    seen: list[dict[str, Any]]
    #: set at teardown: what holds the answers to /v1/tasks/slow after its first
    released: threading.Event
    #: events pages answered before the rest are held, as /v1/tasks/slow is (None: all)
    events_answered: int | None = None

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class _Handler(AnsweringHandler):
    server: _Server
    served = 0  # requests on this connection (one handler per connection)

    def _answer(self) -> None:
        self.body()
        self.served += 1
        srv = self.server
        srv.seen.append({"method": self.command, "path": self.path, "n": self.served})
        slow = [s for s in srv.seen if s["path"] == "/v1/tasks/slow"]
        if len(slow) > 1 and self.path == "/v1/tasks/slow":  # running, then no answer
            srv.released.wait(10)
            self.close_connection = True
            return
        events = [s for s in srv.seen if s["path"].split("?")[0].endswith("/events")]
        held = srv.events_answered is not None and len(events) > srv.events_answered
        if held and self.path.split("?")[0].endswith("/events"):  # slow to answer
            srv.released.wait(10)
            self.close_connection = True
            return
        if srv.drop_first > 0 or self.served == srv.drop_on_reuse:
            srv.drop_first -= 1
            self.close_connection = True  # not a byte of an answer
            return
        status, body = self._reply(urlsplit(self.path))
        data = json.dumps(body).encode()
        kind = "application/json"
        if srv.internal_first > 0:  # Orbit's answer while its database is away
            srv.internal_first -= 1
            status, body = 500, {"error": {"code": "INTERNAL", "message": "unprocessed"}}
            data = json.dumps(body).encode()
        if srv.gateway_first[1] > 0:  # nginx's own page: the upstream is restarting
            status, left = srv.gateway_first
            srv.gateway_first = (status, left - 1)
            data, kind = b"<html><body>502 Bad Gateway</body></html>", "text/html"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _reply(self, url: Any) -> tuple[int, Any]:
        if url.path.startswith("/v1/tasks/missing"):
            return 404, {"error": {"code": "NOT_FOUND", "message": "no such task"}}
        if url.path == "/v1/tasks/slow":
            return 200, {"id": "slow", "state": "running", "attempts_used": 1, "max_attempts": 3}
        if url.path == "/v1/tasks/t1":
            return 200, {
                "id": "t1",
                "state": "succeeded",
                "result": 7,
                "attempts_used": 1,
                "max_attempts": 3,
            }
        # a list of three pages: no cursor, "c1", "c2"
        cursor = parse_qs(url.query).get("cursor", [""])[0]
        page = {"": 0, "c1": 1, "c2": 2}[cursor]
        following = {0: "c1", 1: "c2", 2: None}[page]
        item = {"id": page, "page": page, "path": url.path}  # an event's id, too
        return 200, {"items": [item], "next_cursor": following}


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.seen = []
    srv.released = threading.Event()
    with serving(srv):
        try:
            yield srv
        finally:
            srv.released.set()


def _url(srv: _Server) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def _free_port() -> int:
    with socket.socket() as placeholder:  # a port nobody listens on
        placeholder.bind(("127.0.0.1", 0))
        return int(placeholder.getsockname()[1])


# --------------------------------------------------------------------------- wait


def test_task_wait_rides_over_a_server_that_is_briefly_unreachable(
    server: _Server, capsys: pytest.CaptureFixture[str]
) -> None:
    """``orbit task wait`` (its ``_wait``, in process) asks again, as ``Client.wait``
    does: it ended with exit 4 at the first poll that found the server gone."""
    server.drop_first = 3
    with Client(_url(server), "t0ken") as c:
        _wait(c, "t1", timeout=10, as_json=True)  # succeeded: returns, exit 0
    assert json.loads(capsys.readouterr().out)["state"] == "succeeded"
    assert len(server.seen) > 3


def test_task_wait_says_unreachable_when_the_server_stays_away() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    with Client(url, "t0ken") as c, pytest.raises(Unreachable) as caught:
        _wait(c, "t1", timeout=0.5, as_json=True)
    assert "was unreachable for the last" in str(caught.value)


def _waits_ride_over(server: _Server, outage: Callable[[], None]) -> None:
    """``Client.wait`` and then ``AsyncClient.wait``, each after ``outage`` has made the
    server fail its next 3 polls: both end with the task succeeded, 4 polls each."""
    outage()
    with Client(_url(server), "t0ken") as c:
        assert c.wait("t1", timeout=10, poll=0.05)["state"] == "succeeded"
    outage()

    async def main() -> dict[str, Any]:
        async with AsyncClient(_url(server), "t0ken") as c:
            return await c.wait("t1", timeout=10, poll=0.05)

    assert asyncio.run(main())["state"] == "succeeded"
    assert len(server.seen) == 8


def test_wait_rides_over_a_server_that_is_briefly_unreachable(server: _Server) -> None:
    """A rolling deploy: the first polls find the server hanging up. ``wait`` raised the
    first Unreachable at once; it polls on until its timeout."""
    _waits_ride_over(server, lambda: setattr(server, "drop_first", 3))


@pytest.mark.parametrize("status", [502, 503, 504])
def test_wait_rides_over_a_proxy_whose_server_is_briefly_away(server: _Server, status: int) -> None:
    """A rolling deploy behind a proxy (nginx, a load balancer): the server cannot be
    reached, and the proxy says so with its own 502, 503 or 504 page, not Orbit's JSON.
    ``wait`` raised that ApiError (HTTP_ERROR) at the first poll, as if the server had
    refused the call, though it rode over the same outage seen directly."""
    _waits_ride_over(server, lambda: setattr(server, "gateway_first", (status, 3)))


def test_wait_rides_over_a_server_whose_database_is_briefly_away(server: _Server) -> None:
    """A database hiccup: the server answers its own 500 INTERNAL to the first polls.
    ``wait`` raised it at once, as a refusal, though the server asks clients to try
    again; it polls on until its timeout, and raises the 500 only if it lasts."""
    _waits_ride_over(server, lambda: setattr(server, "internal_first", 3))
    server.internal_first = 1000
    with Client(_url(server), "t0ken") as c, pytest.raises(ApiError) as caught:
        c.wait("t1", timeout=0.3, poll=0.05)
    assert (caught.value.status, caught.value.code) == (500, "INTERNAL")


def test_wait_raises_unreachable_when_the_proxy_never_reaches_the_server(
    server: _Server,
) -> None:
    server.gateway_first = (502, 1000)
    with (
        Client(_url(server), "t0ken") as c,
        pytest.raises(Unreachable, match=r"unreachable for the last 0\.\d s") as caught,
    ):
        c.wait("t1", timeout=0.3, poll=0.05)
    assert isinstance(caught.value.__cause__, ApiError)
    assert caught.value.__cause__.status == 502


def test_wait_raises_unreachable_when_the_server_stays_unreachable() -> None:
    port = _free_port()
    with (
        Client(f"http://127.0.0.1:{port}", "t0ken") as c,
        pytest.raises(Unreachable, match=r"unreachable for the last 0\.\d s") as caught,
    ):
        c.wait("t1", timeout=0.3, poll=0.05)
    assert isinstance(caught.value.__cause__, Unreachable)

    async def main() -> None:
        async with AsyncClient(f"http://127.0.0.1:{port}", "t0ken") as c:
            with pytest.raises(Unreachable, match=r"unreachable for the last 0\.\d s"):
                await c.wait("t1", timeout=0.3, poll=0.05)

    asyncio.run(main())


def test_wait_raises_an_https_url_for_a_plain_http_server_at_once(server: _Server) -> None:
    """``https://`` for a server that speaks plain HTTP on that port fails every TLS
    handshake (WRONG_VERSION_NUMBER): a client set up wrong, as an untrusted certificate
    is, which no waiting mends. Taken for an outage, ``wait`` said so only when its whole
    timeout had run out."""
    url = _url(server).replace("http://", "https://")
    with Client(url, "t0ken") as c, pytest.raises(Unreachable) as caught:
        c.wait("t1", timeout=5)
    assert "WRONG_VERSION_NUMBER" in str(caught.value)
    assert "was unreachable for the last" not in str(caught.value)

    async def main() -> None:
        async with AsyncClient(url, "t0ken") as c:
            with pytest.raises(Unreachable) as caught:
                await c.wait("t1", timeout=5)
        assert "WRONG_VERSION_NUMBER" in str(caught.value)
        assert "was unreachable for the last" not in str(caught.value)

    asyncio.run(main())


def test_wait_raises_a_refusal_at_once(server: _Server) -> None:
    with Client(_url(server), "t0ken") as c, pytest.raises(NotFound):
        c.wait("missing", timeout=10)

    async def main() -> None:
        async with AsyncClient(_url(server), "t0ken") as c:
            with pytest.raises(NotFound):
                await c.wait("missing", timeout=10)

    asyncio.run(main())
    assert len(server.seen) == 2


def test_a_polls_request_timeout_is_cut_to_what_is_left_of_the_wait() -> None:
    """The client's timeout while the wait has longer to go; what is left of it once it
    has less, though never less than the floor (a server that is well needs a moment)."""
    assert Waiting("t1", timeout=60).request_timeout(30.0) == 30.0
    assert 9.0 < Waiting("t1", timeout=10).request_timeout(30.0) <= 10.0
    assert Waiting("t1", timeout=0).request_timeout(30.0) == POLL_TIMEOUT_FLOOR
    assert Waiting("t1", timeout=0).request_timeout(0.1) == 0.1  # never the client's past


def test_wait_ends_at_its_timeout_when_the_server_is_slow_to_answer(server: _Server) -> None:
    """A server that stops answering (overloaded, a lock held): each poll waited for the
    client's whole timeout, so ``wait(timeout=0.2)`` took 5 s here (30 s by default) and
    then raised Unreachable, for a server it had reached. The last poll is now cut to
    what is left of the wait (the floor, here), and the wait raises WaitTimeout."""
    # The defect ended in Unreachable after the client's timeout: WaitTimeout is the check.
    with (
        Client(_url(server), "t0ken", timeout=5.0) as c,
        pytest.raises(WaitTimeout, match="is still running: the server did not") as caught,
    ):
        c.wait("slow", timeout=0.2, poll=0.05)
    assert f"within {POLL_TIMEOUT_FLOOR} s" in str(caught.value.__cause__)
    server.seen.clear()  # /v1/tasks/slow answers once more

    async def main() -> None:
        async with AsyncClient(_url(server), "t0ken", timeout=5.0) as c:
            with pytest.raises(WaitTimeout, match="is still running") as caught:
                await c.wait("slow", timeout=0.2, poll=0.05)
        assert f"within {POLL_TIMEOUT_FLOOR} s" in str(caught.value.__cause__)

    asyncio.run(main())


def test_task_wait_ends_at_its_timeout_when_the_server_is_slow_to_answer(
    server: _Server,
) -> None:
    """``orbit task wait`` as ``wait``: exit 5 (timeout) at its end, not exit 4 after
    the client's whole timeout."""
    with Client(_url(server), "t0ken", timeout=5.0) as c, pytest.raises(typer.Exit) as caught:
        _wait(c, "slow", timeout=0.2, as_json=True)
    assert caught.value.exit_code == EXIT_TIMEOUT  # not 4 (unreachable), as it was


def test_task_wait_for_a_task_that_ended_is_not_failed_by_its_last_events_read(
    server: _Server, capsys: pytest.CaptureFixture[str]
) -> None:
    """Once the task is seen ended, ``orbit task wait`` reads the events written since
    its last read, for show. That read was cut to what was left of the wait too, and a
    server slow to give it (well, but past the floor) made the read raise Unreachable:
    exit 4, a task that succeeded reported as a server out of reach. The task's outcome
    stands; the events it could not read are said to be missing."""
    server.events_answered = 3  # the three pages of the first read; the next is slow
    with Client(_url(server), "t0ken", timeout=5.0) as c:
        _wait(c, "t1", timeout=0.2, as_json=True)  # succeeded: returns, exit 0
    out, errors = capsys.readouterr()
    assert json.loads(out)["state"] == "succeeded"
    assert "the task's last events could not be read" in errors


@pytest.mark.parametrize(
    "timeout", [0, -1.0, math.nan, math.inf, None, True, "30", 1e10, sys.maxsize]
)
def test_a_timeout_no_request_can_use_is_refused_at_once(server: _Server, timeout: Any) -> None:
    """Taken as it was, 0 raised Unreachable (sync: BlockingIOError) from a server that
    was well, at the first call; -1 Unreachable (async: "within -1 s") or ValueError;
    NaN and infinity ValueError or OverflowError there, and so did a finite one too large
    for a socket's timeout (1e10 s, ``sys.maxsize``: "for ever"), leaking the connection.
    Refused now, with nothing sent: a client's, and one call's (where None is the
    client's)."""
    with pytest.raises(ValueError, match="timeout must be a positive, finite number"):
        Client(_url(server), "t0ken", timeout=timeout)
    with pytest.raises(ValueError, match="timeout must be a positive, finite number"):
        AsyncClient(_url(server), "t0ken", timeout=timeout)
    if timeout is None:
        return
    with Client(_url(server), "t0ken") as c, pytest.raises(ValueError, match="timeout must"):
        c.get("t1", timeout=timeout)

    async def main() -> None:
        async with AsyncClient(_url(server), "t0ken") as c:
            with pytest.raises(ValueError, match="timeout must"):
                await c.events("t1", timeout=timeout)

    asyncio.run(main())
    assert server.seen == []


def _made(cls: type, *args: Any, **kw: Any) -> str:
    """How making a client of ``cls`` with these arguments ends: "made", or its error."""
    try:
        cls(*args, **kw)
    except Exception as exc:  # each kind is what the test compares
        return f"{type(exc).__name__}: {exc}"
    return "made"


def test_both_clients_check_what_they_are_made_with_alike(tmp_path: Any) -> None:
    """The same checks in the same order (URL, timeout, CA file, token), to the same
    error from either client, nothing connected. ``Client(None)`` raised AttributeError
    (AsyncClient a ValueError); a CA file that cannot be loaded was taken by Client for an
    ``http://`` URL (AsyncClient: FileNotFoundError), and named by neither."""
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("not a certificate\n")
    usage = "ValueError: the server URL must be http://host[:port] or https://host[:port]"
    missing = "ValueError: cafile /nope.pem: cannot load CA certificates from it"
    cases: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [
        ((None, "t0ken"), {}, f"{usage}, not NoneType"),
        ((123, "t0ken"), {}, f"{usage}, not int"),
        (("http://127.0.0.1:1", "t0ken"), {"cafile": "/nope.pem"}, missing),
        (("https://127.0.0.1:1", "t0ken"), {"cafile": "/nope.pem"}, missing),
        (
            ("http://127.0.0.1:1", "t0ken"),
            {"cafile": str(not_pem)},
            f"ValueError: cafile {not_pem}",
        ),
        # the order: the URL, then the timeout, then the CA file, then the token
        (("bad", ""), {"timeout": 0, "cafile": "/nope.pem"}, usage),
        (("http://127.0.0.1:1", ""), {"timeout": 0, "cafile": "/nope.pem"}, "ValueError: timeout"),
        (("http://127.0.0.1:1", ""), {"cafile": "/nope.pem"}, missing),
        (("http://127.0.0.1:1", ""), {}, "ValueError: the token is empty"),
        (("http://127.0.0.1:1", "t0ken"), {}, "made"),
    ]
    for args, kw, expected in cases:
        made = _made(Client, *args, **kw)
        assert made.startswith(expected), (args, kw, made)
        assert _made(AsyncClient, *args, **kw) == made, (args, kw)


@pytest.mark.parametrize(
    ("timeout", "poll"),
    [(math.nan, 0.2), (10.0, 0.0), (10.0, -1.0), (10.0, math.nan), (True, 0.2), (10.0, True)],
)
def test_wait_refuses_a_timeout_or_a_poll_it_cannot_keep(
    server: _Server, timeout: float, poll: float
) -> None:
    """A NaN timeout never ran out (no clock is past NaN): a wait for a task that did not
    end went on for ever. A poll of 0 (or less) asked the server in a tight loop, and
    a negative one raised ValueError from time.sleep after the first poll. Refused now,
    before anything is sent; and so is True, which is no number of seconds (taken as 1 s,
    where ``checked_timeout`` refuses it)."""
    with Client(_url(server), "t0ken") as c, pytest.raises(ValueError, match="wait's"):
        c.wait("t1", timeout=timeout, poll=poll)

    async def main() -> None:
        async with AsyncClient(_url(server), "t0ken") as c:
            with pytest.raises(ValueError, match="wait's"):
                await c.wait("t1", timeout=timeout, poll=poll)

    asyncio.run(main())
    assert server.seen == []


def test_the_largest_timeout_taken_is_one_every_call_can_use(server: _Server) -> None:
    """``MAX_TIMEOUT``, the most ``checked_timeout`` takes, goes to a socket, httpx and
    asyncio without an OverflowError, as the client's timeout and as one call's."""
    with Client(_url(server), "t0ken", timeout=MAX_TIMEOUT) as c:
        assert c.get("t1")["state"] == "succeeded"
        assert c.get("t1", timeout=MAX_TIMEOUT)["state"] == "succeeded"

    async def main() -> None:
        async with AsyncClient(_url(server), "t0ken", timeout=MAX_TIMEOUT) as c:
            assert (await c.get("t1"))["state"] == "succeeded"
            assert (await c.get("t1", timeout=MAX_TIMEOUT))["state"] == "succeeded"

    asyncio.run(main())


def _calls_with_an_id(c: Any) -> list[tuple[str, Callable[[str], Any]]]:
    """Every call of ``c`` (either client) that puts an id or a name in the path, given
    that id or name, with the argument it names it by."""
    return [
        ("task_id", lambda v: c.get(v)),
        ("task_id", lambda v: c.wait(v, timeout=1)),
        ("task_id", lambda v: c.cancel(v)),
        ("task_id", lambda v: c.events(v)),
        ("task_id", lambda v: c.list_attempts(v)),
        ("task_id", lambda v: c.list_artifacts(v)),
        ("task_id", lambda v: c.resolve(v, "failed")),
        ("name", lambda v: c.schedule(v)),
        ("name", lambda v: c.schedule_update(v, cron="* * * * *")),
        ("name", lambda v: c.schedule_delete(v)),
        ("name", lambda v: c.queue_update(v, rate=1)),
        ("name", lambda v: c.queue_pause(v)),
        ("tenant", lambda v: c.tenant_limit(v)),
        ("tenant", lambda v: c.tenant_limit_set(v, 5)),
        ("session_id", lambda v: c.worker_drain(v)),
        ("token_id", lambda v: c.token_revoke(v)),
        ("artifact_id", lambda v: c.artifact_content(v)),
    ]


def test_an_empty_id_or_name_is_refused_before_anything_is_sent(server: _Server) -> None:
    """An empty id or name went as an empty path segment: ``get("")`` asked for
    ``/v1/tasks/``, which the server answers with a 307 to the task list, and the caller
    was told (REDIRECT) to give the client the URL the server redirects to: advice about
    the server's URL, for an unset variable or an empty form field. Both clients refuse
    it with a ValueError naming the argument, follows too, and send nothing."""
    with Client(_url(server), "t0ken") as c:
        for argument, call in _calls_with_an_id(c):
            with pytest.raises(ValueError, match=f"^{argument} must not be empty$"):
                call("")
        for follow in (c.stream_events, c.subscribe):
            with pytest.raises(ValueError, match=r"^task_id must not be empty$"):
                next(follow(""))

    async def main() -> None:
        async with AsyncClient(_url(server), "t0ken") as c:
            for argument, call in _calls_with_an_id(c):
                with pytest.raises(ValueError, match=f"^{argument} must not be empty$"):
                    await call("")
            for follow in (c.stream_events, c.subscribe):
                with pytest.raises(ValueError, match=r"^task_id must not be empty$"):
                    await anext(follow(""))

    asyncio.run(main())
    assert server.seen == []


@pytest.mark.parametrize("value", [None, 123, b"t1", 1.5])
def test_an_id_or_name_that_is_no_text_is_refused_before_anything_is_sent(
    server: _Server, value: Any
) -> None:
    """``get(None)``, ``get(123)`` raised ``TypeError: quote_from_bytes() expected
    bytes``, naming no argument. Both clients refuse any id or name that is neither text
    nor a UUID with a TypeError naming the argument and its type, follows too (where None
    is the whole log's follow), and send nothing."""
    kind = type(value).__name__
    follows = value is not None
    with Client(_url(server), "t0ken") as c:
        for argument, call in _calls_with_an_id(c):
            with pytest.raises(TypeError, match=f"^{argument} must be a string, not {kind}$"):
                call(value)
        for follow in (c.stream_events, c.subscribe) if follows else ():
            with pytest.raises(TypeError, match=f"^task_id must be a string, not {kind}$"):
                next(follow(value))

    async def main() -> None:
        async with AsyncClient(_url(server), "t0ken") as c:
            for argument, call in _calls_with_an_id(c):
                with pytest.raises(TypeError, match=f"^{argument} must be a string, not {kind}$"):
                    await call(value)
            for follow in (c.stream_events, c.subscribe) if follows else ():
                with pytest.raises(TypeError, match=f"^task_id must be a string, not {kind}$"):
                    await anext(follow(value))

    asyncio.run(main())
    assert server.seen == []


def test_a_uuid_is_sent_as_its_text(server: _Server) -> None:
    """``get(uuid.UUID(...))`` raised TypeError where ``submit(parent_id=UUID)`` took
    one: an id given as a UUID is sent as its text, by both clients."""
    task_id = uuid.UUID("01234567-89ab-7def-8123-456789abcdef")
    with Client(_url(server), "t0ken") as c:
        c.get(task_id)  # type: ignore[arg-type]
        c.cancel(task_id)  # type: ignore[arg-type]

    async def main() -> None:
        async with AsyncClient(_url(server), "t0ken") as c:
            await c.get(task_id)  # type: ignore[arg-type]
            await c.cancel(task_id)  # type: ignore[arg-type]

    asyncio.run(main())
    assert [(s["method"], s["path"]) for s in server.seen] == [
        ("GET", f"/v1/tasks/{task_id}"),
        ("POST", f"/v1/tasks/{task_id}/cancel"),
    ] * 2


#: payloads with a key JSON cannot hold, and where the refusal says it is
KEYS_NOT_TEXT = [
    ({1: "a"}, "the key 1 (int) in payload"),
    ({1: "a", "1": "b"}, "the key 1 (int) in payload"),
    ({None: 1}, "the key None (NoneType) in payload"),
    ({True: 1}, "the key True (bool) in payload"),
    ({"a": [{"b": {1.5: 2}}]}, "the key 1.5 (float) in payload.a[0].b"),
]


@pytest.mark.parametrize(("payload", "where"), KEYS_NOT_TEXT)
def test_a_payload_key_that_is_no_text_is_refused_before_anything_is_sent(
    server: _Server, payload: Any, where: str
) -> None:
    """A payload's non-text key went as text (orjson refused it and the standard library
    it fell back to wrote it so): ``{1: "a"}`` was stored as ``{"1": "a"}``, ``{None: 1}``
    as ``{"null": 1}``, and ``{1: "a", "1": "b"}`` met the server's DUPLICATE_KEY. Both
    clients refuse it (TypeError naming the key and where it is) and send nothing: a
    submit, a batch (the key's place in it named), a resolve's result."""
    batch_where = where.replace("in payload", "in tasks[1].payload")
    result_where = where.replace("in payload", "in result")
    with Client(_url(server), "t0ken") as c:
        with pytest.raises(TypeError, match=re.escape(where)):
            c.submit("q", "h", payload)
        with pytest.raises(TypeError, match=re.escape(batch_where)):
            c.submit_many([{"queue": "q", "handler": "h"}, {"queue": "q", "payload": payload}])
        with pytest.raises(TypeError, match=re.escape(result_where)):
            c.resolve("t1", "succeeded", result=payload)

    async def main() -> None:
        async with AsyncClient(_url(server), "t0ken") as c:
            with pytest.raises(TypeError, match=re.escape(where)):
                await c.submit("q", "h", payload)
            with pytest.raises(TypeError, match=re.escape(batch_where)):
                await c.submit_many([{"queue": "q", "payload": payload}, {"queue": "q"}][::-1])

    asyncio.run(main())
    assert server.seen == []


def test_a_whole_token_given_for_its_id_is_refused_before_anything_is_sent(
    server: _Server,
) -> None:
    """``token_revoke`` given a whole token (its id pasted with its secret) put the secret
    in the request's path: the server refused it (400) without repeating it, but a proxy's
    access log on the way held it by then. Both clients refuse it, send nothing, and do
    not repeat it."""
    whole = "orbit_0123456789abcdef0123456789abcdef_s3cr3tS3cr3t-_x"
    with Client(_url(server), "t0ken") as c, pytest.raises(ValueError, match="whole token") as e:
        c.token_revoke(whole)
    assert "s3cr3t" not in str(e.value)

    async def main() -> None:
        async with AsyncClient(_url(server), "t0ken") as c:
            with pytest.raises(ValueError, match="whole token") as e:
                await c.token_revoke(whole)
            assert "s3cr3t" not in str(e.value)

    asyncio.run(main())
    assert server.seen == []


# --------------------------------------------------------------------------- cursors


def test_iterations_resume_from_a_cursor(server: _Server) -> None:
    """``iter_tasks(cursor=...)`` raised TypeError (``cursor`` given twice), and neither
    ``iter_artifacts`` nor an ``iter_events`` took one."""
    with Client(_url(server), "t0ken") as c:
        assert [t["page"] for t in c.iter_tasks(cursor="c1", state="queued")] == [1, 2]
        assert [t["page"] for t in c.iter_tasks()] == [0, 1, 2]
        assert [a["page"] for a in c.iter_artifacts("t1", cursor="c2")] == [2]
        assert [e["page"] for e in c.iter_events("t1", cursor="c1", limit=5)] == [1, 2]
        assert [e["page"] for e in c.iter_events("t1")] == [0, 1, 2]
    assert server.seen[0]["path"] == "/v1/tasks?state=queued&limit=100&cursor=c1"
    assert server.seen[-5]["path"] == "/v1/tasks/t1/events?limit=5&cursor=c1"

    async def main() -> list[list[int]]:
        async with AsyncClient(_url(server), "t0ken") as c:
            return [
                [t["page"] async for t in c.iter_tasks(cursor="c1", state="queued")],
                [a["page"] async for a in c.iter_artifacts("t1", cursor="c2")],
                [e["page"] async for e in c.iter_events("t1", cursor="c1", limit=5)],
                [e["page"] async for e in c.iter_events("t1")],
            ]

    assert asyncio.run(main()) == [[1, 2], [2], [1, 2], [0, 1, 2]]


def test_the_tenant_limits_are_walked_by_page(server: _Server) -> None:
    """``GET /v1/limits/tenants`` is a page: ``tenant_limits()`` walks every page of the
    most a page holds, ``iter_tenant_limits`` from a cursor, ``list_tenant_limits`` one."""
    with Client(_url(server), "t0ken") as c:
        assert [t["page"] for t in c.tenant_limits()] == [0, 1, 2]
        assert [t["page"] for t in c.iter_tenant_limits(cursor="c1", limit=7)] == [1, 2]
        assert c.list_tenant_limits(cursor="c2")["next_cursor"] is None
    paths = [seen["path"] for seen in server.seen]
    assert paths[0] == "/v1/limits/tenants?limit=1000"
    assert paths[3:] == [
        "/v1/limits/tenants?limit=7&cursor=c1",
        "/v1/limits/tenants?limit=7&cursor=c2",
        "/v1/limits/tenants?limit=100&cursor=c2",
    ]

    async def main() -> list[int]:
        async with AsyncClient(_url(server), "t0ken") as c:
            return [t["page"] for t in await c.tenant_limits()]

    assert asyncio.run(main()) == [0, 1, 2]


# --------------------------------------------------------------------------- TaskFailed


def test_a_task_that_ended_without_an_error_says_so() -> None:
    """A task cancelled before it ran has no error: the message ended in ": None"."""
    assert str(TaskFailed({"id": "t1", "state": "cancelled", "error": None})) == (
        "task t1 ended cancelled (no error recorded)"
    )
    failed = TaskFailed(
        {"id": "t2", "state": "failed", "error": {"code": "BOOM", "message": "it broke"}}
    )
    assert str(failed) == "task t2 ended failed: BOOM it broke"
    assert failed.code == "BOOM"
    assert str(TaskFailed({"id": "t3", "state": "failed", "error": {"code": "X"}})) == (
        "task t3 ended failed: X"
    )


def test_a_task_cancelled_after_a_failed_attempt_fails_as_cancelled() -> None:
    """A task cancelled while it waited for a retry keeps its last attempt's error in its
    view. ``TaskFailed`` gave that error's code as why the task ended; now it is
    ``TASK_CANCELLED``, and the attempt's error is ``last_error`` (and in the message as
    what it is). A failed task is as before: ``last_error`` is its error."""
    error = {"code": "HANDLER_ERROR", "message": "boom", "retryable": True}
    cancelled = TaskFailed({"id": "t1", "state": "cancelled", "error": error})
    assert cancelled.code == "TASK_CANCELLED" and cancelled.last_error == error
    assert (
        str(cancelled) == "task t1 ended cancelled (its last attempt's error: HANDLER_ERROR boom)"
    )
    bare = TaskFailed({"id": "t2", "state": "cancelled", "error": None})
    assert bare.code == "TASK_CANCELLED" and bare.last_error is None
    failed = TaskFailed({"id": "t3", "state": "failed", "error": error})
    assert failed.code == "HANDLER_ERROR" and failed.last_error == error
    assert pickle.loads(pickle.dumps(cancelled)).last_error == error


# --------------------------------------------------------------------------- keep-alive


def test_a_get_on_a_connection_closed_as_it_was_reused_is_sent_again_once(
    server: _Server,
) -> None:
    """The server closes a kept-alive connection just as the next request goes out on it
    (its idle timeout, a restart): not a byte of an answer came, and the GET is sent
    once more on a fresh connection. It raised Unreachable (RemoteDisconnected)."""
    server.drop_on_reuse = 2  # each connection's second request is met by a hang-up
    t = Transport(_url(server), {}, cafile=None, timeout=5.0)
    assert t.request("GET", "/v1/tasks/t1", None, None).status_code == 200
    assert t.request("GET", "/v1/tasks/t1", None, None).status_code == 200
    with t.stream("GET", "/v1/tasks/t1") as (status, _, _, chunks):
        assert status == 200 and b"".join(chunks)
    t.close()
    assert [s["n"] for s in server.seen] == [1, 2, 1, 2, 1]


def test_a_post_is_never_sent_twice(server: _Server) -> None:
    server.drop_on_reuse = 2
    t = Transport(_url(server), {}, cafile=None, timeout=5.0)
    assert t.request("POST", "/v1/tasks", None, b"{}").status_code == 200
    with pytest.raises(Unreachable, match="RemoteDisconnected"):
        t.request("POST", "/v1/tasks", None, b"{}")
    t.close()
    assert [s["method"] for s in server.seen] == ["POST", "POST"]


def test_a_get_on_a_fresh_connection_is_not_sent_again(server: _Server) -> None:
    server.drop_first = 1
    t = Transport(_url(server), {}, cafile=None, timeout=5.0)
    with pytest.raises(Unreachable, match="RemoteDisconnected"):
        t.request("GET", "/v1/tasks/t1", None, None)
    t.close()
    assert len(server.seen) == 1


def test_async_client_sends_a_get_on_a_connection_closed_as_it_was_reused_again_once(
    server: _Server,
) -> None:
    """As Client: AsyncClient raised Unreachable (httpx's RemoteProtocolError, "Server
    disconnected without sending a response") from a server that was up and well."""
    server.drop_on_reuse = 2

    async def main() -> list[Any]:
        async with AsyncClient(_url(server), "t0ken") as c:
            return [
                (await c.get("t1"))["state"],
                (await c.get("t1"))["state"],
                await c.artifact_content("a1") != b"",
            ]

    assert asyncio.run(main()) == ["succeeded", "succeeded", True]
    assert [s["n"] for s in server.seen] == [1, 2, 1, 2, 1]


def test_async_client_never_sends_a_post_twice(server: _Server) -> None:
    server.drop_on_reuse = 2

    async def main() -> None:
        async with AsyncClient(_url(server), "t0ken") as c:
            await c.cancel("t1")
            with pytest.raises(Unreachable, match="RemoteProtocolError"):
                await c.cancel("t1")

    asyncio.run(main())
    assert [(s["method"], s["n"]) for s in server.seen] == [("POST", 1), ("POST", 2)]


def test_async_client_does_not_send_a_get_on_a_fresh_connection_again(server: _Server) -> None:
    server.drop_first = 1

    async def main() -> None:
        async with AsyncClient(_url(server), "t0ken") as c:
            with pytest.raises(Unreachable, match="RemoteProtocolError"):
                await c.get("t1")

    asyncio.run(main())
    assert len(server.seen) == 1


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "error",
    [
        NotFound(404, "NOT_FOUND", "no such task"),
        ApiError(502, "HTTP_ERROR", "unexpected reply with status 502"),
        BadRequest(400, "INVALID_ARGUMENT", "limit must be 1..1000", "limit"),
        TaskFailed({"id": "t2", "state": "failed", "error": {"code": "BOOM", "message": "x"}}),
        WaitTimeout("task t1 is still running"),
        Unreachable("no answer from 127.0.0.1:1 within 0.5 s"),
        TooManyRequests(429, "QUEUE_FULL", "queue 'q' is full", None, 3.0),
    ],
)
def test_the_errors_cross_a_process_boundary(error: Exception) -> None:
    """A call made in a ``ProcessPoolExecutor`` (or any multiprocessing pool) raises in
    the parent what it raised in the child, pickled: an ApiError or a TaskFailed came
    back as "TypeError: __init__() missing 3 required positional arguments"."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert vars(back) == vars(error)


@pytest.mark.parametrize(
    "make",
    [
        lambda: NotFound(404, "NOT_FOUND", "no such task"),
        lambda: TaskFailed({"id": "t2", "state": "failed", "error": None}),
        lambda: Unreachable("no answer from 127.0.0.1:1 within 0.5 s"),
        lambda: TooManyRequests(429, "TENANT_FULL", "tenant 'acme' is full", None, 1.0),
    ],
)
def test_what_was_added_to_an_error_crosses_a_process_boundary_too(
    make: Callable[[], Exception],
) -> None:
    """A note (``add_note``, as a framework adds context) or an attribute set on the
    error after it was raised comes back with it, as it does with any exception: the
    pickled ApiError and TaskFailed carried their arguments alone, and lost them."""
    error = make()
    error.add_note("while waiting for t2")
    error.attempt = 3  # type: ignore[attr-defined]
    back = pickle.loads(pickle.dumps(error))
    assert back.__notes__ == ["while waiting for t2"]
    assert back.attempt == 3  # type: ignore[attr-defined]


def test_a_submitted_task_pickles_by_every_protocol_and_keeps_created() -> None:
    """``submit``'s dict with ``created``: the plain dict it replaced was taken by every
    pickle protocol, and its ``__slots__`` made protocols 0 and 1 refuse it."""
    import pickle

    from orbit.client._client import SubmittedTask

    task = SubmittedTask({"id": "t1", "state": "queued"}, False)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(task, protocol))
        assert back == {"id": "t1", "state": "queued"} and back.created is False
