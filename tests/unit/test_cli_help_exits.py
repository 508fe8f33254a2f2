"""What ``orbit worker ls`` and ``orbit worker drain`` exit on, against a real loopback
server of the test's own, and what ``orbit worker --help`` says they do: a 503 for the
server's database's sake (DATABASE_BUSY, ...) is exit 6, "try again later", as for every
other API command, where the help listed only 0, 2, 3 and 4."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import pytest
from typer.testing import CliRunner

from orbit.cli.api import DATABASE_BUSY_HELP, EXIT_FULL
from orbit.cli.main import app
from tests.http_servers import AnsweringHandler, serving

BUSY = {
    "error": {
        "code": "DATABASE_BUSY",
        "message": (
            "the database is busy: another process or a long transaction holds its lock; "
            "nothing was written"
        ),
    }
}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    seen: list[str]

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class _Busy(AnsweringHandler):
    """Orbit's answer to every call while its database is locked by another process."""

    server: _Server

    def _answer(self) -> None:
        self.body()
        self.server.seen.append(f"{self.command} {self.path}")
        data = json.dumps(BUSY).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Retry-After", "5")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def busy() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Busy)
    srv.seen = []
    with serving(srv):
        yield srv


@pytest.mark.parametrize("command", [["worker", "ls"], ["worker", "drain", "s1"]])
def test_worker_ls_and_drain_exit_6_on_a_busy_database(busy: _Server, command: list[str]) -> None:
    url = f"http://127.0.0.1:{busy.server_address[1]}"
    ran = CliRunner().invoke(
        app, [*command, "--url", url], env={"ORBIT_TOKEN": "t0ken", "COLUMNS": "300"}
    )
    assert ran.exit_code == EXIT_FULL == 6, ran.output
    assert busy.seen, "the server was never asked"
    said = " ".join(ran.stderr.split())
    assert said == f"error: DATABASE_BUSY: {BUSY['error']['message']} (retry after 5 s)"


def test_worker_help_lists_exit_6_for_ls_and_drain() -> None:
    helped = CliRunner().invoke(app, ["worker", "--help"], env={"COLUMNS": "300"})
    assert helped.exit_code == 0, helped.output
    text = " ".join(helped.stdout.split())
    said = text.split("Of ls and drain:")[1]
    assert f"4 server unreachable; 6 {DATABASE_BUSY_HELP}." in said, said
