"""``orbit task wait`` over a real loopback HTTP server that hangs up on its first
requests (a server restarting in a rolling deploy): the command asks again, as
``Client.wait`` does, instead of ending with exit 4 at the first poll."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from orbit.cli.api import _wait
from orbit.client import Client, Unreachable


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    drop_first = 0  # requests met by a hang-up, not a byte of an answer
    seen: list[str]

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *_: Any) -> None:
        pass

    def do_GET(self) -> None:
        srv = self.server
        srv.seen.append(self.path)
        if srv.drop_first > 0:
            srv.drop_first -= 1
            self.close_connection = True
            return
        if self.path.startswith("/v1/tasks/t1/events"):
            body: Any = {"items": [{"id": 1, "kind": "submitted"}], "next_cursor": None}
        else:
            body = {"id": "t1", "state": "succeeded", "attempts_used": 1, "max_attempts": 3}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.seen = []
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def test_task_wait_rides_over_a_server_that_is_briefly_unreachable(
    server: _Server, capsys: pytest.CaptureFixture[str]
) -> None:
    server.drop_first = 3
    with Client(f"http://127.0.0.1:{server.server_address[1]}", "t0ken") as c:
        _wait(c, "t1", timeout=10, as_json=True)  # succeeded: returns, exit 0
    assert json.loads(capsys.readouterr().out)["state"] == "succeeded"
    assert len(server.seen) > 3


def test_task_wait_says_unreachable_when_the_server_stays_away() -> None:
    with socket.socket() as placeholder:  # a port nobody listens on
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    with Client(f"http://127.0.0.1:{port}", "t0ken") as c, pytest.raises(Unreachable) as caught:
        _wait(c, "t1", timeout=0.5, as_json=True)
    assert "was unreachable for the last" in str(caught.value)
