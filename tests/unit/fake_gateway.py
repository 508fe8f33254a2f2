"""A fake worker gateway for the worker SDK's unit tests: a real ``websockets`` server on a
loopback port that speaks just enough of docs/protocol.md (hello, resume, start, renew,
finish, their batches, release, drain, heartbeat, progress) to drive ``WorkerConnection``
and ``Worker``, and lets a test hold, drop or reorder what it answers.

    async with FakeGateway() as gw:
        worker = Worker(gw.url, "token")
        ...
        await gw.wait_for(lambda m: m["type"] == "finish")

Every request is recorded in ``gw.received`` (in arrival order, over all connections).
``gw.on_request`` may take a request over: an async function ``(gw, ws, msg)`` that
returns True when it has dealt with the message itself (answered it later, or never).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

Hook = Callable[["FakeGateway", ServerConnection, dict[str, Any]], Awaitable[bool]]


def assignment(attempt_id: str, handler: str, payload: Any = None, **kw: Any) -> dict[str, Any]:
    """One task as ``tasks`` carries it."""
    return {
        "task_id": f"t-{attempt_id}",
        "attempt_id": attempt_id,
        "fence": "1",
        "handler": handler,
        "queue": "q",
        "tenant": "default",
        "payload": payload,
        "attempt": 1,
        "deadline": None,
        "deadline_left": None,
        "attempt_timeout": None,
        "retry_safe": False,
        **kw,
    }


class FakeGateway:
    def __init__(
        self,
        *,
        heartbeat_interval: float = 20.0,
        reject: list[int] | None = None,
        on_request: Hook | None = None,
        lease_left: float = 60.0,
        clock_offset: float = 0.0,
    ) -> None:
        self.heartbeat_interval = heartbeat_interval
        #: each lease's length, and how far this server's clock is ahead of the host's
        self.lease_left = lease_left
        self.clock_offset = clock_offset
        #: HTTP statuses to refuse the next upgrades with, one per connection attempt
        self.reject = list(reject or [])
        #: if set, the only bearer token an upgrade is let through with (else 401)
        self.accepted_token: str | None = None
        self.on_request = on_request
        self.received: list[dict[str, Any]] = []
        self.attempts = 0  # upgrades asked for, refused ones included
        self.connections: list[ServerConnection] = []
        self.finished: dict[str, dict[str, Any]] = {}  # attempt id -> outcome
        self.epoch = 0
        self._changed = asyncio.Condition()
        self._server: Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/worker"

    async def __aenter__(self) -> FakeGateway:
        self._server = await serve(
            self._serve, "127.0.0.1", 0, process_request=self._upgrade, compression=None
        )
        self.port = next(iter(self._server.sockets)).getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 10)

    async def _upgrade(self, conn: ServerConnection, request: Request) -> Response | None:
        async with self._changed:
            self.attempts += 1
            self._changed.notify_all()
        if self.reject:
            status = self.reject.pop(0)
            return Response(status, "refused", Headers(), b"refused\n")
        token = self.accepted_token
        if token is not None and request.headers.get("Authorization") != f"Bearer {token}":
            return Response(401, "Unauthorized", Headers(), b"bad token\n")
        return None

    async def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0
    ) -> dict[str, Any]:
        """The first request received (so far or later) that satisfies ``predicate``."""
        async with asyncio.timeout(timeout), self._changed:
            while True:
                for msg in self.received:
                    if predicate(msg):
                        return msg
                await self._changed.wait()

    async def count(
        self, predicate: Callable[[dict[str, Any]], bool], n: int, timeout: float = 10.0
    ) -> None:
        """Wait until ``n`` requests satisfy ``predicate``."""
        async with asyncio.timeout(timeout), self._changed:
            while sum(1 for m in self.received if predicate(m)) < n:
                await self._changed.wait()

    async def upgrades(self, n: int, timeout: float = 10.0) -> None:
        """Wait until ``n`` upgrades were asked for (refused ones included)."""
        async with asyncio.timeout(timeout), self._changed:
            while self.attempts < n:
                await self._changed.wait()

    async def push(self, message: dict[str, Any]) -> None:
        """Send ``message`` on the latest connection."""
        await self.connections[-1].send(json.dumps(message))

    async def _serve(self, ws: ServerConnection) -> None:
        self.connections.append(ws)
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                msg = json.loads(frame)
                async with self._changed:
                    self.received.append(msg)
                    self._changed.notify_all()
                if self.on_request is not None and await self.on_request(self, ws, msg):
                    continue
                await ws.send(json.dumps(self.answer(msg)))

    def answer(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The reply a well-behaved server sends to ``msg``."""
        kind, rid = msg["type"], msg.get("req_id")
        if kind in ("hello", "resume"):
            self.epoch += 1
            return {
                "type": "welcome",
                "req_id": rid,
                "session_id": "s1",
                "epoch": str(self.epoch),
                "resume_secret": "secret" if kind == "hello" else None,
                "heartbeat_interval": self.heartbeat_interval,
            }
        if kind == "start":
            return {"type": "started", "req_id": rid, "lease": self._lease(msg["attempt_id"])}
        if kind == "start_many":
            results = [
                {"attempt_id": i["attempt_id"], "lease": self._lease(i["attempt_id"])}
                for i in msg["items"]
            ]
            return {"type": "started_many", "req_id": rid, "results": results}
        if kind == "renew":
            leases = [self._lease(a) for a in msg["attempt_ids"]]
            return {"type": "renewed", "req_id": rid, "leases": leases}
        if kind == "finish":
            return {"type": "finished", "req_id": rid, "receipt": self._finish(msg)}
        if kind == "finish_many":
            results = [
                {"attempt_id": i["attempt_id"], "receipt": self._finish(i)} for i in msg["items"]
            ]
            return {"type": "finished_many", "req_id": rid, "results": results}
        return {"type": "ack", "req_id": rid, "op": kind}

    def _lease(self, attempt_id: str) -> dict[str, Any]:
        now = datetime.now(UTC) + timedelta(seconds=self.clock_offset)
        expires = now + timedelta(seconds=self.lease_left)
        return {
            "attempt_id": attempt_id,
            "status": "ok",
            "lease_expires_at": expires.isoformat().replace("+00:00", "Z"),
            "lease_left": self.lease_left,
        }

    def _finish(self, item: dict[str, Any]) -> dict[str, Any]:
        self.finished.setdefault(item["attempt_id"], item["outcome"])
        return {"attempt_id": item["attempt_id"], "fence": item["fence"]}
