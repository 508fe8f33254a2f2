"""A node whose PostgreSQL LISTEN connection is away, and cannot come back: the database
refuses it (here closed to new connections, as a database or role whose ``CONNECTION
LIMIT`` the pools have reached refuses one more).

The node logged ``LISTEN connection lost (OperationalError); retrying`` every 10 s and
never why; /readyz said ready with nothing more and /metrics had no series for it. It now
logs the database's reason once (again only if the reason changes), with no name the
server's message quotes; ``orbit_listen_connected`` is 0 meanwhile; /readyz stays ready
(the node serves every request without it: docs/operations.md) and says in its body
that the connection is down, since when, after how many tries, and why. Once the
database takes connections again, the node says the connection is back, and all is as
before. PostgreSQL only: SQLite has no LISTEN connection (nor the series)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from orbit.server.listen import CHANNELS
from tests.e2e.servers import start_server
from tests.pg import ADMIN_DSN, as_url, temporary_database

#: a safety net for the waits below: each ends on what it waits for long before
WAIT_S = 60.0
#: the database's refusal, as the node tells it: no database name
REFUSED = 'OperationalError: database "…" is not currently accepting connections'


def _until(check: Callable[[], bool], what: str, log: Path) -> None:
    ends = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < ends, f"never: {what}\n{log.read_text()}"
        time.sleep(0.05)


def _gauge(http: str) -> str | None:
    found = re.search(r"^orbit_listen_connected (\S+)$", httpx.get(f"{http}/metrics").text, re.M)
    return None if found is None else found.group(1)


@pytest.mark.postgres_only
def test_a_listen_connection_refused_is_said_once_with_its_reason_and_measured(
    tmp_path: Path,
) -> None:
    with temporary_database("orbit_e2e") as dsn:
        name = str(conninfo_to_dict(dsn)["dbname"])
        node = start_server(as_url(dsn), tmp_path)
        try:
            _until(lambda: _gauge(node.http) == "1.0", "LISTEN up", node.log)
            assert httpx.get(f"{node.http}/readyz").json() == {"status": "ready"}
            with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
                try:
                    admin.execute(f'ALTER DATABASE "{name}" WITH allow_connections false')
                    # the LISTEN connection alone: the pools keep theirs, and serve
                    [ended] = admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = %s AND query = %s",
                        (name, f"LISTEN {CHANNELS[-1]}"),
                    ).fetchall()
                    assert ended == (True,)

                    def tries() -> int:
                        body = httpx.get(f"{node.http}/readyz").json()
                        return int(body.get("listen", {}).get("failed_tries", 0))

                    # the loss, then two refusals (0.5 s, then 1 s apart)
                    _until(lambda: tries() >= 3, "three failed tries", node.log)
                    ready = httpx.get(f"{node.http}/readyz")
                    assert ready.status_code == 200, ready.text
                    listen = ready.json()["listen"]
                    assert listen["connected"] is False
                    assert listen["reason"] == REFUSED
                    assert listen["down_s"] > 0
                    assert "by its polls" in listen["message"]
                    assert _gauge(node.http) == "0.0"
                finally:
                    admin.execute(f'ALTER DATABASE "{name}" WITH allow_connections true')
            _until(lambda: "LISTEN connection back" in node.log_text(), "back", node.log)
            assert _gauge(node.http) == "1.0"
            assert httpx.get(f"{node.http}/readyz").json() == {"status": "ready"}
        finally:
            node.stop()
    said = node.log_text()
    down = [line for line in said.splitlines() if "LISTEN connection" in line]
    # The loss of the connection, then its refusal, each once; then back, with the count.
    assert len(down) == 3, said
    assert "WARNING" in down[0] and "LISTEN connection down: OperationalError: " in down[0]
    assert "WARNING" in down[1] and f"LISTEN connection down: {REFUSED};" in down[1]
    assert "INFO" in down[2] and "LISTEN connection back after" in down[2]
    assert int(down[2].split(" and ")[1].split()[0]) >= 3  # the tries that failed
    assert name not in said
    assert "Traceback" not in said
