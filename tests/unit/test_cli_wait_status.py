"""The status line of ``orbit task wait`` (and ``submit --wait``) while a poll fails:
it says what failed. It said "the server cannot be reached" for every failure, a 503
``DATABASE_BUSY`` (the server answering, its database locked) included.

The line is rich's transient status on stderr, drawn only on a terminal and erased when
the wait ends, so ``orbit`` run in a test never shows it. ``_follow`` is run instead, in
process, against a real loopback server of the test's own, with a recorder of the lines
it sets in place of rich's ``Status``; and ``why_asking_again`` is checked on the errors
the real client raises."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from rich.text import Text

from orbit.cli.api import _follow, why_asking_again
from orbit.client import ApiError, Client, Unavailable, Unreachable
from orbit.client._client import Waiting
from orbit.store.driver import UNAVAILABLE_MESSAGES
from tests.http_servers import AnsweringHandler, QuietServer, serving

TASK = {"id": "t1", "state": "succeeded", "result": 7, "attempts_used": 1, "max_attempts": 3}


class _Server(QuietServer):
    #: requests answered ``failure`` (status, code) before the rest
    failing_first = 0
    failure: tuple[int, str] = (503, "DATABASE_BUSY")


class _Handler(AnsweringHandler):
    server: _Server

    def _answer(self) -> None:
        self.body()
        srv = self.server
        path = self.path.split("?")[0]
        if srv.failing_first > 0:
            srv.failing_first -= 1
            status, code = srv.failure
            message = UNAVAILABLE_MESSAGES.get(code, "the server failed")
            error = {"error": {"code": code, "message": message}}
            self.send(status, json.dumps(error).encode(), {"Retry-After": "5"})
        elif path == "/v1/tasks/t1/events":
            self.send(200, json.dumps({"items": [], "next_cursor": None}).encode())
        elif path == "/v1/tasks/t1":
            self.send(200, json.dumps(TASK).encode())
        else:
            self.send(404, json.dumps({"error": {"code": "NOT_FOUND", "message": "no"}}).encode())


class _Lines:
    """Rich's ``Status`` as ``_follow`` uses it: the lines set, kept."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def update(self, text: Text) -> None:
        self.lines.append(text.plain)


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    with serving(srv):
        yield srv


def _url(srv: _Server) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_wait_says_the_database_is_busy_not_unreachable(server: _Server) -> None:
    server.failing_first = 1
    status = _Lines()
    with Client(_url(server), "t0ken") as c:
        task, over = _follow(c, Waiting("t1", 10), status, True, None)  # type: ignore[arg-type]
    assert over is None and task is not None and task["state"] == "succeeded"
    assert status.lines[0] == "t1: the server's database is busy (DATABASE_BUSY); asking again"
    assert not any("cannot be reached" in line for line in status.lines)


def _raised(url: str) -> Unreachable | ApiError:
    with Client(url, "t0ken") as c:
        try:
            c.get("t1", timeout=2)
        except (Unreachable, ApiError) as exc:
            return exc
    raise AssertionError("the call was not refused")


@pytest.mark.parametrize(
    ("code", "said"),
    [
        ("DATABASE_BUSY", "the server's database is busy (DATABASE_BUSY)"),
        ("DATABASE_FULL", "the server's database is full (DATABASE_FULL)"),
        ("DATABASE_READ_ONLY", "the server's database is read-only (DATABASE_READ_ONLY)"),
        ("DATABASE_UNAVAILABLE", "the server's database is away (DATABASE_UNAVAILABLE)"),
    ],
)
def test_each_database_503_is_named(server: _Server, code: str, said: str) -> None:
    server.failing_first, server.failure = 1, (503, code)
    exc = _raised(_url(server))
    assert isinstance(exc, Unavailable)
    assert why_asking_again(exc) == said


def test_a_500_is_the_server_failing(server: _Server) -> None:
    server.failing_first, server.failure = 1, (500, "INTERNAL")
    assert why_asking_again(_raised(_url(server))) == "the server failed (INTERNAL)"


def test_unreachable_stays_unreachable() -> None:
    exc = _raised(f"http://127.0.0.1:{_closed_port()}")
    assert isinstance(exc, Unreachable)
    assert why_asking_again(exc) == "the server cannot be reached"
