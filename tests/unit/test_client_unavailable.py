"""The server's 503 for its database's sake (DATABASE_BUSY, DATABASE_FULL,
DATABASE_READ_ONLY, DATABASE_UNAVAILABLE, with ``Retry-After: 5``) in the clients and the
CLI, over real loopback servers of the test's own (HTTP, and WebSocket for ``subscribe``).

The clients raised a plain ApiError(503) and dropped its Retry-After; ``wait`` and the
follows took it for a refusal and ended at the first one, where they ride over a 500
INTERNAL; ``orbit`` exited 3 ("refused") for a condition that passes. Now a 503 is
``Unavailable`` with ``retry_after``, the waits and follows ask again through it, and the
CLI exits 6, "try again later", saying when."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner
from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.sync.server import ServerConnection, serve

from orbit.cli.api import EXIT_FULL, _wait
from orbit.cli.main import app
from orbit.client import (
    ApiError,
    AsyncClient,
    Client,
    TooManyRequests,
    Unavailable,
)
from orbit.client._http import DATABASE_CODES
from orbit.store.driver import UNAVAILABLE_MESSAGES
from tests.http_servers import AnsweringHandler, QuietServer, database_refusal, serving

BUSY = database_refusal("DATABASE_BUSY")
TASK = {"id": "t1", "state": "succeeded", "result": 7, "attempts_used": 1, "max_attempts": 3}
EVENT = {"id": "1", "kind": "succeeded", "task_id": "t1"}


class _Server(QuietServer):
    #: requests answered 503 with ``refusal`` and ``Retry-After: 5`` before the rest
    busy_first = 0
    refusal: dict[str, Any] = BUSY
    seen: list[str]


class _Handler(AnsweringHandler):
    server: _Server

    def _answer(self) -> None:
        self.body()
        srv = self.server
        srv.seen.append(self.path)
        headers = {"Content-Type": "application/json"}
        if srv.busy_first > 0:  # Orbit's answer while its database cannot take a call
            srv.busy_first -= 1
            status, data = 503, json.dumps(srv.refusal).encode()
            headers["Retry-After"] = "5"
        elif self.path.split("?")[0] == "/v1/tasks/t1/events/stream":
            status = 200
            headers["Content-Type"] = "text/event-stream"
            data = (
                f"id: c1\nevent: succeeded\ndata: {json.dumps(EVENT)}\n\n"
                'event: stream.end\ndata: {"task_id": "t1", "state": "succeeded"}\n\n'
            ).encode()
        elif self.path.split("?")[0] == "/v1/tasks/t1/events":  # orbit task wait's reads
            status, data = 200, json.dumps({"items": [], "next_cursor": None}).encode()
        elif self.path == "/v1/tasks/t1":
            status, data = 200, json.dumps(TASK).encode()
        elif self.path == "/v1/tasks/proxied":  # a proxy's own page: the server is away
            status, data = 503, b"<html><body>503 Service Unavailable</body></html>"
            headers["Content-Type"] = "text/html"
        else:
            status = 404
            data = json.dumps({"error": {"code": "NOT_FOUND", "message": "no"}}).encode()
        self.send(status, data, headers)


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.seen = []
    with serving(srv):
        yield srv


def _url(srv: _Server) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


# --------------------------------------------------------------------------- the error


def test_a_503_is_unavailable_with_the_servers_retry_after(server: _Server) -> None:
    """Both clients raise ``Unavailable`` (an ApiError, not a TooManyRequests) carrying
    the server's code, words and ``Retry-After``: it was a plain ApiError(503), the
    Retry-After dropped."""
    server.busy_first = 2
    with Client(_url(server), "t0ken") as c, pytest.raises(Unavailable) as caught:
        c.submit("q", "h")

    async def main() -> Unavailable:
        async with AsyncClient(_url(server), "t0ken") as c:
            try:
                await c.submit("q", "h")
            except Unavailable as exc:
                return exc
        raise AssertionError("not refused")

    for error in (caught.value, asyncio.run(main())):
        assert isinstance(error, ApiError) and not isinstance(error, TooManyRequests)
        assert (error.status, error.code, error.retry_after) == (503, "DATABASE_BUSY", 5.0)
        assert error.message == BUSY["error"]["message"]


def test_a_proxys_own_503_page_is_no_unavailable(server: _Server) -> None:
    """No Orbit error body: the server out of reach behind a proxy, as before."""
    with Client(_url(server), "t0ken") as c, pytest.raises(ApiError) as caught:
        c.get("proxied")
    assert type(caught.value) is ApiError
    assert (caught.value.status, caught.value.code) == (503, "HTTP_ERROR")


def test_unavailable_crosses_a_process_boundary() -> None:
    error = Unavailable(503, "DATABASE_FULL", "the database is full", None, 5.0)
    error.add_note("while submitting")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is Unavailable
    assert str(back) == str(error) and vars(back) == vars(error)
    assert back.retry_after == 5.0 and back.__notes__ == ["while submitting"]


def test_the_clients_database_codes_are_the_stores() -> None:
    """The client cannot import the store (a worker's process does without it): its
    copy of the codes follows the store's."""
    assert set(UNAVAILABLE_MESSAGES) == DATABASE_CODES


# --------------------------------------------------------------------------- wait


@pytest.mark.parametrize("code", sorted(DATABASE_CODES))
def test_wait_rides_over_a_database_that_cannot_take_a_call(server: _Server, code: str) -> None:
    """The first polls are answered 503 DATABASE_*: ``wait`` raised the first, as a
    refusal, though the condition passes (as a 500 INTERNAL, which it rode over)."""
    server.refusal = database_refusal(code)
    server.busy_first = 3
    with Client(_url(server), "t0ken") as c:
        assert c.wait("t1", timeout=10, poll=0.05)["state"] == "succeeded"
    assert len(server.seen) == 4
    server.busy_first = 3

    async def main() -> dict[str, Any]:
        async with AsyncClient(_url(server), "t0ken") as c:
            return await c.wait("t1", timeout=10, poll=0.05)

    assert asyncio.run(main())["state"] == "succeeded"
    assert len(server.seen) == 8


def test_wait_raises_the_503_when_it_lasts_to_the_end(server: _Server) -> None:
    server.busy_first = 1000
    with Client(_url(server), "t0ken") as c, pytest.raises(Unavailable) as caught:
        c.wait("t1", timeout=0.3, poll=0.05)
    assert (caught.value.code, caught.value.retry_after) == ("DATABASE_BUSY", 5.0)
    assert len(server.seen) > 1  # asked again, not raised at the first


def test_task_wait_rides_over_a_busy_database(
    server: _Server, capsys: pytest.CaptureFixture[str]
) -> None:
    """``orbit task wait`` (its ``_wait``, in process) as ``Client.wait``: it exited 3."""
    server.busy_first = 3
    with Client(_url(server), "t0ken") as c:
        _wait(c, "t1", timeout=10, as_json=True)  # succeeded: returns, exit 0
    assert json.loads(capsys.readouterr().out)["state"] == "succeeded"
    assert len(server.seen) > 3


# --------------------------------------------------------------------------- streams


def test_stream_events_rides_over_a_busy_database(server: _Server) -> None:
    """A stream's open answered 503 DATABASE_BUSY ended the follow, as a refusal."""
    server.busy_first = 2
    with Client(_url(server), "t0ken") as c:
        assert list(c.stream_events("t1", outage=10)) == [("c1", EVENT)]
    assert len(server.seen) == 3
    server.busy_first = 2

    async def main() -> list[tuple[str, dict[str, Any]]]:
        async with AsyncClient(_url(server), "t0ken") as c:
            return [item async for item in c.stream_events("t1", outage=10)]

    assert asyncio.run(main()) == [("c1", EVENT)]
    assert len(server.seen) == 6


def test_stream_events_raises_the_503_with_its_retry_after_when_it_lasts(
    server: _Server,
) -> None:
    """Past ``outage`` the server's last 503 is raised, its Retry-After kept (a stream's
    refusal dropped it, where a call's kept it)."""
    server.busy_first = 1000
    with Client(_url(server), "t0ken") as c, pytest.raises(Unavailable) as caught:
        list(c.stream_events("t1", outage=0.2))
    assert caught.value.retry_after == 5.0
    tries = len(server.seen)
    assert tries > 1

    async def main() -> Unavailable:
        async with AsyncClient(_url(server), "t0ken") as c:
            try:
                [item async for item in c.stream_events("t1", outage=0.2)]
            except Unavailable as exc:
                return exc
        raise AssertionError("not raised")

    assert asyncio.run(main()).retry_after == 5.0
    assert len(server.seen) > tries + 1


@pytest.fixture
def socket_server() -> Iterator[tuple[str, list[str], list[int]]]:
    """A WebSocket server whose upgrades are refused 503 DATABASE_BUSY (``Retry-After:
    5``) while its counter (the list's one item) is above 0, then serves a task's
    stream: an event and ``stream.end``. Yields its URL, the paths asked and the
    counter."""
    seen: list[str] = []
    busy = [0]

    def refuse(connection: ServerConnection, request: Request) -> Response | None:
        seen.append(request.path)
        if busy[0] <= 0:
            return None
        busy[0] -= 1
        body = json.dumps(BUSY).encode()
        headers = Headers(
            [
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                ("Retry-After", "5"),
            ]
        )
        return Response(503, "Service Unavailable", headers, body)

    def handler(connection: ServerConnection) -> None:
        connection.send(json.dumps({"type": "event", "cursor": "c1", "event": EVENT}))
        connection.send(json.dumps({"type": "stream.end", "task_id": "t1", "state": "done"}))
        connection.close()

    with serve(handler, "127.0.0.1", 0, process_request=refuse) as srv:
        thread = threading.Thread(target=srv.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{srv.socket.getsockname()[1]}", seen, busy
        finally:
            srv.shutdown()
            thread.join(10)


def test_subscribe_rides_over_an_upgrade_refused_for_a_busy_database(
    socket_server: tuple[str, list[str], list[int]],
) -> None:
    url, seen, busy = socket_server
    busy[0] = 2
    with Client(url, "t0ken") as c:
        assert list(c.subscribe("t1", outage=10)) == [("c1", EVENT)]
    assert len(seen) == 3
    busy[0] = 2

    async def main() -> list[tuple[str, dict[str, Any]]]:
        async with AsyncClient(url, "t0ken") as c:
            return [item async for item in c.subscribe("t1", outage=10)]

    assert asyncio.run(main()) == [("c1", EVENT)]
    assert len(seen) == 6
    busy[0] = 1000
    with Client(url, "t0ken") as c, pytest.raises(Unavailable) as caught:
        list(c.subscribe("t1", outage=0.2))
    assert (caught.value.code, caught.value.retry_after) == ("DATABASE_BUSY", 5.0)


# --------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize(
    "command",
    [["task", "submit", "q", "h"], ["queue", "ls"], ["event", "ls"], ["task", "show", "t1"]],
)
def test_the_cli_exits_6_try_again_later_on_a_busy_database(
    server: _Server, command: list[str]
) -> None:
    """One line naming the condition and when to try again, exit 6: it was exit 3,
    "refused by the server", as if the same command would always be."""
    server.busy_first = 1
    ran = CliRunner().invoke(
        app, [*command, "--url", _url(server)], env={"ORBIT_TOKEN": "t0ken", "COLUMNS": "300"}
    )
    assert ran.exit_code == EXIT_FULL == 6, ran.output
    said = " ".join(ran.stderr.split())
    assert said == f"error: DATABASE_BUSY: {BUSY['error']['message']} (retry after 5 s)"


def test_the_groups_help_names_exit_6() -> None:
    for group in ("queue", "limit", "event", "schedule", "task"):
        helped = CliRunner().invoke(app, [group, "--help"], env={"COLUMNS": "300"})
        assert helped.exit_code == 0, helped.output
        text = " ".join(helped.stdout.split())
        assert "6 the server's database cannot take the call now (503" in text or (
            group == "task" and "or the server's database cannot take the call now" in text
        ), text
