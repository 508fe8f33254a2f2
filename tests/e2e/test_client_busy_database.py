"""The Python client and ``orbit task submit`` against a real server whose database's lock
another process holds, on SQLite and PostgreSQL: the server answers 503 DATABASE_BUSY with
``Retry-After: 5`` (tests/e2e/test_busy_database.py); the client raised it as a plain
ApiError(503) without its Retry-After, and the CLI exited 3, "refused by the server", for
a condition that passes. Now ``Unavailable`` with ``retry_after``, and exit 6, "try again
later", saying when. The fake-server tests (tests/unit/test_client_unavailable.py) cover
``wait`` and the follows riding over it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orbit.client import Client, Unavailable
from tests.db_locks import write_lock
from tests.e2e.servers import Tokens
from tests.e2e.test_busy_database import WAIT_S, _queue, _server

BUSY = (
    "the database is busy: another process or a long transaction holds its lock; "
    "nothing was written"
)


def test_a_submit_under_another_processs_lock_is_unavailable_and_exits_6(
    db_url: str, tokens: Tokens, tmp_path: Path
) -> None:
    with _server(db_url, tmp_path) as node, Client(node.http, tokens.submit) as client:
        _queue(node, tokens)
        with write_lock(db_url):
            with pytest.raises(Unavailable) as refused:
                client.submit("q", "h", payload={"x": 1})
            assert (refused.value.status, refused.value.code) == (503, "DATABASE_BUSY")
            assert (refused.value.message, refused.value.retry_after) == (BUSY, 5.0)
            ran = subprocess.run(
                [sys.executable, "-m", "orbit.cli", "task", "submit", "q", "h"],
                capture_output=True,
                text=True,
                timeout=WAIT_S * 2,
                check=False,
                env={**os.environ, "ORBIT_TOKEN": tokens.submit, "ORBIT_URL": node.http},
            )
        assert ran.returncode == 6, ran.stderr
        assert ran.stderr == f"error: DATABASE_BUSY: {BUSY} (retry after 5 s)\n"
        made = client.submit("q", "h", payload={"x": 1})  # once the lock is released
        assert made.created
        with Client(node.http, tokens.admin) as admin:
            listed = [t["id"] for t in admin.iter_tasks(queue="q")]
        assert listed == [made["id"]]  # nothing of the refused two was written
