"""The HTTP answer to a submit whose database connection was lost while its ``COMMIT``
was on its way (``tests/store/test_commit_lost.py`` for the store): 503
``DATABASE_UNAVAILABLE`` with ``Retry-After`` as before, since a client may make the call
again once the database is back, but its message says that the task may have been made
and that a resend must carry the same idempotency key. It said only that the database
had failed, and a resend without a key made a second task. A real server on PostgreSQL;
SQLite has no connection to lose."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.commit_hold import commit_held


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_submit_whose_commit_lost_its_connection_says_it_may_be_made(
    db_url: str, admin: httpx.Client
) -> None:
    made = admin.post("/v1/queues", json={"name": "q", "max_concurrency": 10, "rate": 0})
    assert made.status_code == 201, made.text
    with commit_held(db_url, "orbit_tasks") as held, ThreadPoolExecutor(1) as pool:
        killed = pool.submit(held.terminate)
        answer = admin.post("/v1/tasks", json={"queue": "q", "handler": "h"})
        killed.result()
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "DATABASE_UNAVAILABLE"
    assert "it may have been committed" in error["message"]
    assert "a resend must carry the same idempotency key" in error["message"]
    assert answer.headers["Retry-After"] == "5"
