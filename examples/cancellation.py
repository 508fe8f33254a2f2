"""Cancellation: a running handler learns at once, and its late result is not kept."""

from __future__ import annotations

import asyncio
from typing import Any

from examples._env import server
from orbit import AsyncClient, Context, Worker


async def main(url: str, token: str) -> dict[str, Any]:
    worker = Worker(url, token, name="example-cancel")
    seen: dict[str, Any] = {}
    started = asyncio.Event()

    @worker.handler("example.long")
    async def long(ctx: Context, payload: Any) -> Any:
        started.set()
        try:
            await asyncio.sleep(300)
        except asyncio.CancelledError:
            seen["reason"] = ctx.reason  # "task cancelled"
            raise
        return "never"

    running = asyncio.create_task(worker.arun())
    async with AsyncClient(url, token) as client:
        if "examples" not in {q["name"] for q in await client.queues()}:
            await client.queue_create("examples", max_concurrency=4, rate=0)
        parent = await client.submit("examples", "example.long", None)
        child = await client.submit("examples", "example.child", None, parent_id=parent["id"])
        await asyncio.wait_for(started.wait(), 30)
        await client.cancel(parent["id"])  # cascades to the child in the same transaction
        parent_final = await client.wait(parent["id"], timeout=30)
        child_final = await client.get(child["id"])
    worker.stop()
    await running
    return {"parent": parent_final["state"], "child": child_final["state"], **seen}


if __name__ == "__main__":
    print(asyncio.run(main(*server())))
