"""The worker protocol by hand: what the runner does for you, step by step."""

from __future__ import annotations

import asyncio
from typing import Any

from examples._env import server
from orbit import AsyncClient
from orbit.worker import WorkerConnection


async def main(url: str, token: str) -> dict[str, Any]:
    async with AsyncClient(url, token) as client:
        if "examples" not in {q["name"] for q in await client.queues()}:
            await client.queue_create("examples", max_concurrency=4, rate=0)
        task = await client.submit("examples", "example.raw", {"text": "hello"})
    ws_url = url.replace("http", "ws", 1) + "/v1/worker"
    conn = await WorkerConnection.connect(ws_url, token)
    try:
        await conn.hello("example-raw", {"example.raw": 1}, max_concurrency=1, push=False)
        [assignment] = await conn.claim(1)  # a short claim lease: start it or release it
        lease = await conn.start(assignment["attempt_id"], assignment["fence"])
        [renewed] = await conn.renew([assignment["attempt_id"]])  # keep the lease alive
        result = {"upper": assignment["payload"]["text"].upper()}
        receipt = await conn.finish(assignment["attempt_id"], assignment["fence"], result=result)
        again = await conn.finish(assignment["attempt_id"], assignment["fence"], result=result)
        assert again == receipt  # a repeated finish (lost reply) gets the same receipt
    finally:
        await conn.close()
    return {
        "task": task["id"],
        "lease": lease["status"],
        "renewed": renewed["status"],
        "receipt": receipt,
    }


if __name__ == "__main__":
    print(asyncio.run(main(*server())))
