"""The worker SDK recovers from what goes wrong on its connection: requests that get no
reply, sockets that close under a send, and messages that arrive at awkward moments.
Driven against ``FakeGateway``, a real WebSocket server on a loopback port."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection

from orbit.worker.connection import WorkerConnection
from tests.unit.fake_gateway import FakeGateway


async def _swallow_heartbeats(gw: FakeGateway, ws: ServerConnection, msg: dict[str, Any]) -> bool:
    return bool(msg["type"] == "heartbeat")


def test_a_request_given_up_leaves_nothing_waiting_and_its_late_reply_is_dropped() -> None:
    async def main() -> None:
        async with FakeGateway(on_request=_swallow_heartbeats) as gw:
            conn = await WorkerConnection.connect(gw.ws_url, "token")
            try:
                asking = asyncio.create_task(conn.request({"type": "heartbeat"}))
                late = await gw.wait_for(lambda m: m["type"] == "heartbeat")
                asking.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asking
                assert conn._waiting == {}
                # The reply comes after all, then a real push: only the push is handed on.
                await gw.push({"type": "ack", "req_id": late["req_id"], "op": "heartbeat"})
                await gw.push({"type": "tasks", "req_id": None, "tasks": []})
                assert (await conn.next_push(10))["type"] == "tasks"
            finally:
                await conn.close()

    asyncio.run(main())


def test_a_request_that_times_out_leaves_nothing_waiting() -> None:
    async def main() -> None:
        async with FakeGateway(on_request=_swallow_heartbeats) as gw:
            conn = await WorkerConnection.connect(gw.ws_url, "token")
            try:
                with pytest.raises(TimeoutError):
                    await conn.request({"type": "heartbeat"}, 0.2)
                assert conn._waiting == {}
            finally:
                await conn.close()

    asyncio.run(main())
