"""A SQLite node's reads while another process holds the database's write lock.

The node's one connection was shared by its reads and its transactions: a transaction
waiting in ``BEGIN IMMEDIATE`` for the other process's lock (a submit, or the idle
node's own reaper or scheduler pass) held it, and /readyz answered 503 (the database
did not answer within 2 s) and a task's GET 503 ``DATABASE_BUSY``, though under WAL a
read takes none of a writer's locks. Reads now have a connection of their own
(``SqliteDriver.read``): they go on, a metrics scrape's task gauges too, while a write
still gives up as busy.

The server runs ``tests.e2e.busy_app`` with a wait for the database (``tx_wait_us``)
long enough that its transactions hold the write connection while the reads are made."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.db_locks import write_lock
from tests.e2e.servers import Node, Tokens, app_server
from tests.e2e.test_busy_database import TASK, WAIT_S, _api, _queue

#: the server's wait for the write lock, in seconds: each of its transactions under the
#: other process's lock holds the write connection this long
HELD_S = 3.0


@contextmanager
def _server(db_url: str, tmp_path: Path) -> Iterator[Node]:
    log = tmp_path / "reads.log"
    with app_server("tests.e2e.busy_app", [db_url, str(HELD_S)], log, WAIT_S) as node:
        yield node


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # PostgreSQL has no such connection
def test_reads_go_on_while_the_nodes_writes_wait_for_another_processs_lock(
    db_url: str, tokens: Tokens, tmp_path: Path
) -> None:
    with (
        _server(db_url, tmp_path) as node,
        _api(node, tokens.submit) as api,
        _api(node, tokens.admin) as admin,
        ThreadPoolExecutor(1) as pool,
    ):
        _queue(node, tokens)
        made = api.post("/v1/tasks", json=TASK)
        assert made.status_code == 201, made.text
        task_id = made.json()["task"]["id"]
        with write_lock(db_url):
            waiting = pool.submit(api.post, "/v1/tasks", json=TASK)
            reads = 0
            # every read made while the submit (and the reaper, the scheduler) waits
            while not waiting.done() or reads < 2:
                ready = httpx.get(f"{node.http}/readyz", timeout=WAIT_S)
                assert ready.status_code == 200, ready.text
                scraped = httpx.get(f"{node.http}/metrics", timeout=WAIT_S)
                assert scraped.status_code == 200, scraped.text
                assert 'orbit_queue_depth{queue="q"} 1.0' in scraped.text, scraped.text
                got = admin.get(f"/v1/tasks/{task_id}")
                assert got.status_code == 200, got.text
                assert got.json()["id"] == task_id, got.text
                reads += 1
            refused = waiting.result(WAIT_S)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "DATABASE_BUSY"
        again = api.post("/v1/tasks", json=TASK)
        assert again.status_code == 201, again.text
        listed = admin.get("/v1/tasks", params={"queue": "q"}).json()["items"]
        assert [t["id"] for t in listed] == [task_id, again.json()["task"]["id"]]
