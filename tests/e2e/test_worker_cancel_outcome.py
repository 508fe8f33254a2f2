"""A handler that ends on its own terms once its task's cancel has reached the worker:
the task ends cancelled whatever is reported (cancel wins), and what the handler ended
with is kept as evidence in the ``cancelled`` event, never as the task's result
(DESIGN.md: finish while cancelling; docs/worker.md, *Cancellation*). An async handler
that caught ``CancelledError`` reports what it returned or raised, so that one which
finished an irreversible step can say so; a plain function reports ``CANCELLED``. A
real server, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest

from orbit.worker.runner import Context, Fail, Worker
from tests.e2e.servers import Node, Tokens
from tests.e2e.test_runner import api, fast, run_until, submit, wait_state  # noqa: F401


def _reported(client: httpx.Client, tid: str) -> list[dict[str, Any]]:
    """The outcomes the task's attempts reported, as the events that ended them keep them."""
    events = client.get(f"/v1/tasks/{tid}/events").json()["items"]
    return [e["data"]["outcome"] for e in events if (e["data"] or {}).get("outcome")]


@pytest.mark.parametrize("how", ["async_returns", "async_fails", "sync_returns"])
def test_a_handler_that_ends_after_its_cancel_is_reported_as_evidence(
    fast: Node,  # noqa: F811
    tokens: Tokens,
    api: httpx.Client,  # noqa: F811
    how: str,
) -> None:
    """The handler hears the cancel and ends on its own terms: it returns a value (an
    async one by catching ``CancelledError``) or raises ``Fail``. No result is stored;
    the report is the event's evidence."""
    worker = Worker(fast.http, tokens.worker, cancel_grace=30)
    started = threading.Event()
    ended: list[str] = []

    if how.startswith("async"):

        @worker.handler("h")
        async def catches(ctx: Context, payload: Any) -> str:
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                ended.append(ctx.task_id)
                if how == "async_fails":
                    raise Fail("failed on the way out", code="CLEANUP") from None
                return "caught the cancel"
            return "never cancelled"
    else:

        @worker.handler("h")
        def looks(ctx: Context, payload: Any) -> str:
            started.set()
            end = time.monotonic() + 60
            while not ctx.cancelled and time.monotonic() < end:
                time.sleep(0.01)
            ended.append(ctx.task_id)
            return "saw the cancel"

    tid = submit(api, "h", max_attempts=3)

    def cancel_when_started() -> None:
        started.wait(30)
        api.post(f"/v1/tasks/{tid}/cancel")

    canceller = threading.Thread(target=cancel_when_started)
    canceller.start()
    asyncio.run(run_until(worker, lambda: bool(ended) and not worker.running))
    canceller.join()
    task = wait_state(api, tid, {"cancelled"})
    assert task["attempts_used"] == 1 and task["result"] is None, task
    reported = _reported(api, tid)
    assert len(reported) == 1, reported
    expected = {
        "async_returns": {"ok": True, "result": "caught the cancel"},
        "async_fails": {"ok": False, "code": "CLEANUP"},
        "sync_returns": {"ok": False, "code": "CANCELLED"},
    }[how]
    got = reported[0]
    if got["ok"]:
        assert got == expected, reported
    else:
        assert {"ok": False, "code": got["error"]["code"]} == expected, reported
