"""What ``orbit worker ls`` and ``orbit worker drain`` exit on, against a real loopback
server of the test's own, and what ``orbit worker --help`` says they do: a 503 for the
server's database's sake (DATABASE_BUSY, ...) is exit 6, "try again later", as for every
other API command, where the help listed only 0, 2, 3 and 4."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from orbit.cli.api import DATABASE_BUSY_HELP, EXIT_FULL
from orbit.cli.main import app
from tests.http_servers import AnsweringHandler, QuietServer, database_refusal, serving

BUSY = database_refusal("DATABASE_BUSY")


class _Server(QuietServer):
    seen: list[str]


class _Busy(AnsweringHandler):
    """Orbit's answer to every call while its database is locked by another process."""

    server: _Server

    def _answer(self) -> None:
        self.body()
        self.server.seen.append(f"{self.command} {self.path}")
        self.send_refusal("DATABASE_BUSY")


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
