"""A handler's own cancel is its own failure, retryable; only a cancel the runner made is
reported ``CANCELLED``. A handler that cancelled itself (or raised ``Cancelled`` with no
cancel asked for) failed its task for good with CANCELLED, never retried, against the
docs. A real server, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest

from orbit.worker.runner import Cancelled, Context, Worker
from tests.e2e.servers import Node, Tokens
from tests.e2e.test_runner import api, fast, run_until, submit, wait_state  # noqa: F401

QUICK = {"base": 0.05, "factor": 1, "max": 0.05}


def _codes(client: httpx.Client, tid: str) -> list[str]:
    """The error codes in the task's history: an event's own, and the reported outcome
    a cancelled attempt's event keeps as evidence."""
    codes = []
    for e in client.get(f"/v1/tasks/{tid}/events").json()["items"]:
        reported = ((e["data"] or {}).get("outcome") or {}).get("error") or {}
        codes += [c for c in (e["code"], reported.get("code")) if c]
    return codes


@pytest.mark.parametrize("how", ["async_self_cancel", "async_raise", "sync_raise"])
def test_a_handler_that_cancels_itself_fails_retryably(
    fast: Node,  # noqa: F811
    tokens: Tokens,
    api: httpx.Client,  # noqa: F811
    how: str,
) -> None:
    """Its first attempt cancels itself, unasked: a retryable failure named after the
    class, so the second attempt runs and succeeds."""
    worker = Worker(fast.http, tokens.worker)
    calls: list[int] = []

    def first_time() -> bool:
        calls.append(1)
        return len(calls) == 1

    if how.startswith("async"):

        @worker.handler("own")
        async def own_async(ctx: Context, payload: Any) -> str:
            if first_time():
                if how == "async_self_cancel":
                    asyncio.current_task().cancel()  # type: ignore[union-attr]
                    await asyncio.sleep(60)
                raise Cancelled("of its own")
            return "second"
    else:

        @worker.handler("own")
        def own_sync(ctx: Context, payload: Any) -> str:
            if first_time():
                raise Cancelled("of its own")
            return "second"

    tid = submit(api, "own", max_attempts=3, backoff=QUICK)
    asyncio.run(run_until(worker, lambda: len(calls) == 2 and not worker.running))
    task = wait_state(api, tid, {"succeeded", "failed", "cancelled"})
    assert task["state"] == "succeeded" and task["result"] == "second", task
    assert task["attempts_used"] == 2
    codes = _codes(api, tid)
    expected = "CancelledError" if how == "async_self_cancel" else "Cancelled"
    assert expected in codes, codes
    assert "CANCELLED" not in codes, codes


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_handler_the_runner_stopped_still_reports_cancelled(
    fast: Node,  # noqa: F811
    tokens: Tokens,
    api: httpx.Client,  # noqa: F811
    kind: str,
) -> None:
    """The task cancelled while its handler runs: the cancel is the runner's, so the
    attempt reports CANCELLED (the server records it) and the task ends cancelled."""
    worker = Worker(fast.http, tokens.worker)
    started = threading.Event()
    ended: list[str] = []

    if kind == "async":

        @worker.handler("wait")
        async def wait_async(ctx: Context, payload: Any) -> str:
            started.set()
            try:
                await asyncio.sleep(60)
            finally:
                ended.append(ctx.task_id)
            return "finished anyway"
    else:

        @worker.handler("wait")
        def wait_sync(ctx: Context, payload: Any) -> str:
            started.set()
            try:
                end = time.monotonic() + 60
                while not ctx.cancelled and time.monotonic() < end:
                    time.sleep(0.01)
                ctx.check()  # raises Cancelled
            finally:
                ended.append(ctx.task_id)
            return "finished anyway"

    tid = submit(api, "wait", max_attempts=3)

    def cancel_when_started() -> None:
        started.wait(30)
        api.post(f"/v1/tasks/{tid}/cancel")

    canceller = threading.Thread(target=cancel_when_started)
    canceller.start()
    asyncio.run(run_until(worker, lambda: bool(ended) and not worker.running))
    canceller.join()
    task = wait_state(api, tid, {"cancelled"})
    assert task["attempts_used"] == 1 and task["result"] is None
    codes = _codes(api, tid)
    assert "CANCELLED" in codes, codes
    assert "CancelledError" not in codes and "Cancelled" not in codes, codes
