"""benchmarks.worker_drain: a tiny drain against the fake server ends with every task
pushed, started and finished, and the worker's exit status 0."""

from __future__ import annotations

import asyncio

from benchmarks import worker_drain


def test_a_tiny_drain_finishes_every_task() -> None:
    async def run() -> tuple[int, worker_drain.FakeServer]:
        async with (
            asyncio.timeout(60),
            worker_drain.fake_server(400, delay=0.005) as (port, server),
        ):
            # 400 tasks at 150 in flight: pushes of 150, then of what each finish frees
            status = await worker_drain.drain(port, 400, concurrency=150, result="dict")
            await server.done.wait()
        return status, server

    status, server = asyncio.run(run())
    assert status == 0
    assert (server.pushed, server.left, server.in_flight) == (400, 0, 0)
