"""The automatic runner: register handlers, run, submit, wait for results."""

from __future__ import annotations

import asyncio
from typing import Any

from examples._env import server
from orbit import AsyncClient, Context, Fail, Worker


def make_worker(url: str, token: str) -> Worker:
    worker = Worker(url, token, name="example-runner", concurrency=4)

    @worker.handler("example.add")
    async def add(ctx: Context, payload: Any) -> Any:
        return {"sum": payload["a"] + payload["b"], "attempt": ctx.attempt}

    @worker.handler("example.divide")
    def divide(ctx: Context, payload: Any) -> Any:  # a plain function runs in a thread
        if payload["by"] == 0:
            raise Fail("cannot divide by zero", code="DIVISION_BY_ZERO")  # no retry
        return payload["n"] / payload["by"]

    return worker


async def main(url: str, token: str) -> dict[str, Any]:
    worker = make_worker(url, token)
    running = asyncio.create_task(worker.arun())
    async with AsyncClient(url, token) as client:
        queues = {q["name"] for q in await client.queues()}
        if "examples" not in queues:
            await client.queue_create("examples", max_concurrency=4, rate=0)
        add = await client.submit("examples", "example.add", {"a": 2, "b": 3})
        bad = await client.submit("examples", "example.divide", {"n": 1, "by": 0})
        results = {
            "add": await client.result(add["id"], timeout=30),
            "divide": (await client.wait(bad["id"], timeout=30))["error"],
        }
    worker.stop()
    await running
    return results


if __name__ == "__main__":
    print(asyncio.run(main(*server())))
