"""A worker reconnecting to a real node through a front (a balancer, a proxy) that
refuses it for a while: a 503 or 429 with ``Retry-After`` is waited out rather than
hammered at the back-off's pace, the pause after a refusal without one is the back-off's
prompt one again, and the session is resumed on the node once the front lets it by."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from orbit.worker.runner import Context, Worker
from tests.e2e.servers import Node, Tokens

REASONS = {429: "Too Many Requests", 502: "Bad Gateway", 503: "Service Unavailable"}


class Front:
    """A TCP front to the node on ``target_port``: each connection is relayed to it,
    except while ``refusals`` holds answers (status, Retry-After or None), when the next
    request is answered with the first of them and closed, as a proxy or a node shutting
    down answers. ``asked`` holds the instant (``time.monotonic``) each request came."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.refusals: list[tuple[int, str | None]] = []
        self.asked: list[float] = []
        self.port = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._links: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> Front:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()
        if self._links:
            await asyncio.wait(self._links, timeout=10)
        await self._server.wait_closed()

    def cut(self) -> None:
        """Close every relayed connection, both ways, with no closing handshake: the
        worker's connection is lost as a network failure or a node's crash loses it."""
        for writer in list(self._writers):
            writer.close()

    async def _link(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._links.add(task)
        self._writers.add(down_w)
        up_w: asyncio.StreamWriter | None = None
        try:
            head = await down_r.readuntil(b"\r\n\r\n")
            self.asked.append(time.monotonic())
            if self.refusals:
                status, retry_after = self.refusals.pop(0)
                extra = "" if retry_after is None else f"Retry-After: {retry_after}\r\n"
                down_w.write(
                    f"HTTP/1.1 {status} {REASONS[status]}\r\n{extra}"
                    "Content-Length: 0\r\nConnection: close\r\n\r\n".encode()
                )
                await down_w.drain()
                return
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
            self._writers.add(up_w)
            up_w.write(head)
            await asyncio.gather(_pipe(down_r, up_w), _pipe(up_r, down_w))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went (or the test cut it): the link is over
        finally:
            for writer in (down_w, up_w):
                if writer is not None:
                    writer.close()
                    self._writers.discard(writer)
            self._links.discard(task)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """``src``'s bytes to ``dst`` until ``src`` ends; then ``dst`` is closed."""
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except ConnectionError:
        pass
    finally:
        dst.close()


async def _succeeded(api: httpx.AsyncClient, task_id: str, timeout: float = 30) -> None:
    """Wait (by polling the API, which has no push for it) until the task succeeded."""
    async with asyncio.timeout(timeout):
        while (await api.get(f"/v1/tasks/{task_id}")).json()["state"] != "succeeded":
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("status", [503, 429])
def test_a_refused_reconnect_waits_out_retry_after_then_resumes_its_session(
    nodes: Callable[..., Node], tokens: Tokens, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's connection is lost; its first reconnect is made at once and refused
    ``status`` with ``Retry-After: 1``: the next try comes no sooner than a second later
    (before, 0.1 s later: a node shutting down, or at its cap, was hammered anyway). That
    one is refused 502 with no Retry-After: the pause is the back-off's again, a fraction
    of a second, though ``reconnect_max`` is an hour. Then the front lets it by, and the
    worker resumes its session on the node and runs the next task."""
    caplog.set_level(logging.INFO, logger="orbit.worker")
    node = nodes()

    async def main() -> None:
        async with (
            Front(node.port) as front,
            httpx.AsyncClient(
                base_url=node.http,
                timeout=30,
                headers={"Authorization": f"Bearer {tokens.admin}"},
            ) as api,
        ):
            queue = {"name": "q", "max_concurrency": 5, "rate": 0}
            assert (await api.post("/v1/queues", json=queue)).status_code == 201

            async def submit() -> str:
                task = {"queue": "q", "handler": "echo", "payload": 1}
                reply = await api.post("/v1/tasks", json=task)
                assert reply.status_code == 201, reply.text
                return str(reply.json()["task"]["id"])

            worker = Worker(front.http, tokens.worker, reconnect_max=3600.0)
            worker._reconnect_random = lambda: 0.5  # each pause mid-way in its range

            @worker.handler("echo")
            async def echo(ctx: Context, payload: Any) -> Any:
                return payload

            runner = asyncio.create_task(worker.arun())
            try:
                await _succeeded(api, await submit())  # connected through the front
                session = worker.session_id
                assert session is not None and len(front.asked) == 1

                front.refusals = [(status, "1"), (502, None)]
                front.cut()
                await _succeeded(api, await submit())  # run after the resume
                assert not runner.done()
            finally:
                worker.stop()
                code = await asyncio.wait_for(runner, 30)
            assert code == 0

            assert worker.session_id == session  # resumed, not started anew
            assert f"resumed session {session}" in caplog.messages
            assert len(front.asked) == 4  # the first connection; refused twice; resumed
            waited = front.asked[2] - front.asked[1]
            assert waited >= 1.0, f"the Retry-After was not waited out: {waited:.3f}s"
            # twice the Retry-After as the pause's base, the draw half-way: 1.5 s
            said = f"connect failed (HTTP {status}, Retry-After 1); retrying in 1.5s"
            assert said in caplog.messages, caplog.messages

    asyncio.run(main())
