"""A lost lease is never silent: the runner logs the lost attempt, and a handler that
finishes after its lease is gone says its outcome is dropped. Both once went unlogged:
an async handler that blocked the loop took every attempt beside it down, and the log
showed nothing between "connected" and the stop. A real server, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import httpx
import pytest

from orbit.worker.runner import Context, Worker
from tests.e2e.servers import Node, Tokens
from tests.e2e.test_runner import api, fast, run_until, submit, wait_state  # noqa: F401

BLOCK_S = 3.0  # the server's lease is 1 s (FAST): blocked this long, every lease runs out


def test_a_blocked_loop_loses_every_lease_and_says_so(
    fast: Node,  # noqa: F811
    tokens: Tokens,
    api: httpx.Client,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An async handler blocks the loop with time.sleep; a plain one runs beside it in its
    thread. Both finish after their leases ran out: each drop is a warning naming its
    attempt, its task and why, and neither result is committed (needs_review)."""
    caplog.set_level(logging.WARNING, logger="orbit.worker")
    worker = Worker(fast.http, tokens.worker, concurrency=2)
    beside_started = threading.Event()
    ended: list[str] = []

    @worker.handler("beside")
    def beside(ctx: Context, payload: Any) -> str:
        beside_started.set()
        time.sleep(BLOCK_S + 0.5)  # ignores its cancel: it finishes all the same
        ended.append(ctx.task_id)
        return "too late"

    @worker.handler("blocker")
    async def blocker(ctx: Context, payload: Any) -> str:
        await asyncio.to_thread(beside_started.wait, 30)
        time.sleep(BLOCK_S)  # the mistake the docs warn of: the loop stops here
        ended.append(ctx.task_id)
        return "too late"

    beside_id = submit(api, "beside")
    blocker_id = submit(api, "blocker")
    asyncio.run(run_until(worker, lambda: len(ended) == 2 and not worker.running))

    for tid in (beside_id, blocker_id):
        task = wait_state(api, tid, {"needs_review", "succeeded", "failed"})
        assert task["state"] == "needs_review" and task["result"] is None, task
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    blocker_lines = [m for m in lines if f"(task {blocker_id})" in m]
    beside_lines = [m for m in lines if f"(task {beside_id})" in m]
    # The blocker's own finish comes first or the renew loop's check does: either way
    # its finished outcome is said to be dropped, with the reason.
    assert any(
        "the handler finished, but its outcome is dropped" in m and "lease" in m
        for m in blocker_lines
    ), lines
    # The plain handler was still running when the loop woke: lost, then cancelled.
    assert any("lost: lease expired" in m for m in beside_lines), lines
    for m in blocker_lines + beside_lines:
        assert m.startswith("attempt "), m  # each names its attempt id first
