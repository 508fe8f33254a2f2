"""A ``start`` the server could not try (its database failed: ``DATABASE_UNAVAILABLE``,
``DATABASE_BUSY``, ``INTERNAL``) is sent again while the claim lasts. It was logged and
dropped: when its COMMIT had landed and only the reply was lost, the reaper later found
the attempt started and unreported, and sent a task that is not ``retry_safe`` to
``needs_review`` although its handler never ran; when it had not, the task waited out
its claim lease. Now a start that did commit is answered, sent again, with the same
lease (the handler runs once, the task succeeds with one attempt), and one that did not
starts at once. A real server (``tests.e2e.start_fault_app``, whose store fails the
first starts), SQLite and PostgreSQL; a lone start, and a ``start_many`` of several."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from orbit.worker.runner import Context, Worker
from tests.e2e.servers import Node, Tokens, app_server
from tests.e2e.test_runner import run_until

WAIT_S = 30.0
#: the starts failed by the server before it answers them
FAULTS = 2
TERMINAL = {"succeeded", "failed", "needs_review", "cancelled"}


@contextmanager
def _server(db_url: str, tmp_path: Path, mode: str) -> Iterator[Node]:
    log = tmp_path / f"start-fault-{uuid.uuid4().hex[:8]}.log"
    args = [db_url, mode, str(FAULTS)]
    with app_server("tests.e2e.start_fault_app", args, log, WAIT_S) as node:
        yield node


@pytest.mark.parametrize("mode", ["committed", "uncommitted"])
def test_a_start_the_server_could_not_try_is_sent_again_and_runs_once(
    db_url: str, tokens: Tokens, tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    caplog.set_level(logging.WARNING, logger="orbit.worker")
    with _server(db_url, tmp_path, mode) as node:
        headers = {"Authorization": f"Bearer {tokens.admin}"}
        with httpx.Client(base_url=node.http, timeout=WAIT_S, headers=headers) as api:
            made = api.post("/v1/queues", json={"name": "q", "max_concurrency": 10, "rate": 0})
            assert made.status_code == 201, made.text
            # A lone start, then four that go together (a start_many).
            for tasks in (1, 4):
                caplog.clear()
                _round(api, node, tokens, tasks)
                # The faults were met: the starts were answered so, and sent again.
                code = "DATABASE_UNAVAILABLE" if mode == "committed" else "DATABASE_BUSY"
                resent = [r.message for r in caplog.records if "sending it again" in r.message]
                assert len(resent) >= FAULTS, resent
                assert all(f"answered {code}" in m for m in resent), resent


def _round(api: httpx.Client, node: Node, tokens: Tokens, tasks: int) -> None:
    """Submit ``tasks`` tasks, then run a worker until they end: its first claim takes
    them all, and their starts go out together. Each succeeds, with one attempt, its
    handler run once."""
    ids = []
    for n in range(tasks):
        reply = api.post("/v1/tasks", json={"queue": "q", "handler": "h", "payload": n})
        assert reply.status_code == 201, reply.text
        ids.append(str(reply.json()["task"]["id"]))
    worker = Worker(node.http, tokens.worker, concurrency=4)
    ran: list[str] = []

    @worker.handler("h")
    async def handler(ctx: Context, payload: Any) -> Any:
        ran.append(ctx.task_id)
        return payload

    def ended() -> bool:
        return all(api.get(f"/v1/tasks/{tid}").json()["state"] in TERMINAL for tid in ids)

    # The claim lease is 300 s: a start dropped unreleased holds its task past this
    # wait; and the run lease 3 s: one committed and dropped is reaped (needs_review).
    asyncio.run(run_until(worker, ended, timeout=WAIT_S))
    for tid in ids:
        task = api.get(f"/v1/tasks/{tid}").json()
        assert task["state"] == "succeeded", task
        attempts = api.get(f"/v1/tasks/{tid}/attempts").json()["items"]
        assert len(attempts) == 1, attempts
    assert sorted(ran) == sorted(ids)
