"""``ctx.attempt`` counts started attempts, as ``attempts_used`` does, and
``ctx.max_attempts`` says how many there may be. The assignment's ``attempt`` counts
claims, released ones too: a task with max_attempts=1 whose claim had been given back
twice ran with ctx.attempt=3. A real server, SQLite and PostgreSQL; the old-server
fallback against the fake gateway."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from orbit.worker import WorkerConnection
from orbit.worker.runner import Context, Retry, Worker
from tests.e2e.servers import Node, Tokens
from tests.e2e.test_runner import api, fast, run_until, submit, wait_state  # noqa: F401
from tests.unit.fake_gateway import FakeGateway, assignment
from tests.unit.test_worker_recovery import _finished, _is, running

QUICK = {"base": 0.05, "factor": 1, "max": 0.05}


async def _claim_and_release(node: Node, token: str, times: int) -> list[dict[str, Any]]:
    """Claim the one ready task and give it back unstarted, ``times`` times; the
    assignments as the wire carried them."""
    seen = []
    for i in range(times):
        conn = await WorkerConnection.connect(node.ws, token)
        try:
            await conn.hello(f"claimer{i}", {"count": 1}, 1, push=False)
            (got,) = await conn.claim(1)
            seen.append(dict(got))
            await conn.release(got["attempt_id"], got["fence"])
        finally:
            await conn.close()
    return seen


def test_released_claims_do_not_count_in_ctx_attempt(
    fast: Node,  # noqa: F811
    tokens: Tokens,
    api: httpx.Client,  # noqa: F811
) -> None:
    tid = submit(api, "count", max_attempts=2, backoff=QUICK)
    wires = asyncio.run(_claim_and_release(fast, tokens.worker, 2))
    assert [w["attempt"] for w in wires] == [1, 2]  # the claims' numbers
    assert [(w["attempts_used"], w["max_attempts"]) for w in wires] == [(0, 2), (0, 2)]

    worker = Worker(fast.http, tokens.worker)
    seen: list[tuple[int, int | None]] = []

    @worker.handler("count")
    def count(ctx: Context, payload: Any) -> str:
        seen.append((ctx.attempt, ctx.max_attempts))
        if len(seen) == 1:
            raise Retry("once more")
        return "done"

    asyncio.run(run_until(worker, lambda: len(seen) == 2 and not worker.running))
    task = wait_state(api, tid, {"succeeded", "failed"})
    assert task["state"] == "succeeded" and task["attempts_used"] == 2, task
    # claims 3 and 4, started attempts 1 and 2 of 2: the second is the last try
    assert seen == [(1, 2), (2, 2)]


def test_an_assignment_from_an_older_server_keeps_the_claim_number() -> None:
    """No ``attempts_used`` in the assignment: ctx.attempt is its ``attempt``, and
    ctx.max_attempts is None; with it, the started ordinal whatever the claim's number."""
    seen: dict[str, tuple[int, int | None]] = {}

    async def record(ctx: Context, payload: Any) -> None:
        seen[ctx.attempt_id] = (ctx.attempt, ctx.max_attempts)

    async def main() -> None:
        async with FakeGateway() as gw:
            worker = Worker(gw.url, "token", grace=0.2, cancel_grace=0.3)
            worker.handler("h")(record)
            async with running(worker):
                await gw.wait_for(_is("hello"))
                old = assignment("old", "h", attempt=3)
                new = assignment("new", "h", attempt=3, attempts_used=1, max_attempts=4)
                await gw.push({"type": "tasks", "req_id": None, "tasks": [old, new]})
                await gw.wait_for(_finished("old"))
                await gw.wait_for(_finished("new"))

    asyncio.run(main())
    assert seen == {"old": (3, None), "new": (2, 4)}
