"""Worker connections that hold a socket and do nothing are closed, on both backends:
one with no ``hello`` or ``resume`` welcomed within a session TTL of its upgrade (silent,
or sending only frames that are refused) with 4408 ``HELLO_TIMEOUT``, and one whose
session lapsed with 4409 ``SESSION_EXPIRED`` whether or not the dispatcher pushes to it
(``push: false``, or drained). Before, only a pushed-to connection was ever closed: the
others stayed open for as long as their peer kept them, each holding a socket and a
task of the node's. Workers that heartbeat, or renew what they run, stay connected."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx
import websockets

from orbit.worker import WorkerConnection
from tests.e2e.servers import Node, Tokens

#: a session TTL (so a hello deadline) short enough that the test waits seconds for it
SESSION_TTL = 2.0
ARGS = ["--session-ttl", str(SESSION_TTL), "--reap-interval", "0.1"]
#: an upper bound for a close that comes a session TTL (and a reaper pass) after the
#: last request; never reached when it comes
WAIT = 30.0


async def _close_of(ws: websockets.ClientConnection, refused: list[str]) -> tuple[int, str]:
    """The close code and reason the server ends ``ws`` with. Until then ``refused`` is
    sent over and over, a frame at the heartbeat's pace (the default's 20 s scaled to
    the TTL), each answered with an ``error``."""
    try:
        while True:
            for frame in refused:
                await ws.send(frame)
                answer = json.loads(await ws.recv())
                assert answer["type"] == "error", answer
                await asyncio.sleep(SESSION_TTL / 3)
            if not refused:
                await ws.recv()
    except websockets.ConnectionClosed as exc:
        assert exc.rcvd is not None, f"dropped without a close frame: {exc}"
        return exc.rcvd.code, exc.rcvd.reason


async def _closed(conn: WorkerConnection) -> tuple[int, str]:
    """The close code and reason that end ``conn`` (anything pushed before is skipped)."""
    while (msg := await conn.next_push(timeout=None))["type"] != "closed":
        pass
    return msg["code"], msg["reason"]


async def _keep_alive(
    conn: WorkerConnection, send: Callable[[], Awaitable[None]], after: asyncio.Event, rounds: int
) -> None:
    """Keep ``conn``'s session alive with ``send`` at its heartbeat's pace until ``after``
    is set, then for ``rounds`` more (a refusal raises)."""
    while True:
        await send()
        if after.is_set():
            if rounds == 0:
                return
            rounds -= 1
        await asyncio.sleep(conn.heartbeat_interval)


def _connect(node: Node, tokens: Tokens) -> websockets.connect:
    return websockets.connect(
        node.ws, additional_headers={"Authorization": f"Bearer {tokens.worker}"}
    )


def test_a_connection_with_no_hello_welcomed_within_a_session_ttl_is_closed_4408(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """Three connections that never get a ``welcome``: one silent, one sending only
    frames that are not JSON, one sending only requests that need a session (answered
    ``HELLO_FIRST``) and a ``resume`` of a session that does not exist. Each is closed
    with 4408 ``HELLO_TIMEOUT`` once a session TTL has passed since its upgrade; the
    refused frames do not put the deadline off. A worker that said ``hello`` at once,
    connected beside them, stays connected: its heartbeats are answered for a session
    TTL after they are gone. Before, all three stayed open for as long as the client
    kept them."""
    node = nodes(args=ARGS)
    no_session = [
        json.dumps({"type": "claim", "req_id": "c", "n": 1}),
        json.dumps({"type": "resume", "req_id": "r", "session_id": "x", "secret": "s"}),
    ]

    async def scenario() -> None:
        worker = await WorkerConnection.connect(node.ws, tokens.worker)
        await worker.hello("prompt", {"h": 1}, 1, push=False)
        gone = asyncio.Event()
        rounds = 3  # a session TTL of heartbeats
        beating = asyncio.create_task(_keep_alive(worker, worker.heartbeat, gone, rounds))
        async with (
            _connect(node, tokens) as silent,
            _connect(node, tokens) as garbage,
            _connect(node, tokens) as early,
        ):
            async with asyncio.timeout(WAIT):
                closes = await asyncio.gather(
                    _close_of(silent, []),
                    _close_of(garbage, ["{not json"]),
                    _close_of(early, no_session),
                )
        assert closes == [(4408, "HELLO_TIMEOUT")] * 3
        gone.set()
        await beating
        assert worker.pushed.empty()  # not closed, no error
        await worker.close()

    asyncio.run(scenario())


def test_a_lapsed_session_closes_its_connection_whether_or_not_it_is_pushed_to(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    """Connections whose sessions lapse: one of a ``push: false`` worker that says
    nothing after ``hello``, and one of a pushed worker that drained its session (the
    dispatcher pushes to it no more) and went quiet. Each is closed with 4409
    ``SESSION_EXPIRED`` once the reaper has expired its session, as a pushed one is.
    Two ``push: false`` workers stay connected beside them and for two session TTLs
    after: one that heartbeats, and one that only renews the attempt it runs. Before,
    the two lapsed connections were never closed."""
    node = nodes(args=ARGS)
    auth = {"Authorization": f"Bearer {tokens.admin}"}
    with httpx.Client(base_url=node.http, timeout=30, headers=auth) as api:
        made = api.post("/v1/queues", json={"name": "q", "max_concurrency": 10, "rate": 0})
        assert made.status_code == 201, made.text
        sent = api.post("/v1/tasks", json={"queue": "q", "handler": "long"})
        assert sent.status_code == 201, sent.text

    async def scenario() -> None:
        quiet = await WorkerConnection.connect(node.ws, tokens.worker)
        await quiet.hello("quiet", {"h": 1}, 1, push=False)
        drained = await WorkerConnection.connect(node.ws, tokens.worker)
        await drained.hello("drained", {"h": 1}, 1)
        await drained.drain()
        beating = await WorkerConnection.connect(node.ws, tokens.worker)
        await beating.hello("beating", {"h": 1}, 1, push=False)
        renewing = await WorkerConnection.connect(node.ws, tokens.worker)
        await renewing.hello("renewing", {"long": 1}, 1, push=False)
        [task] = await renewing.claim(1)
        await renewing.start(task["attempt_id"], task["fence"])

        async def renew() -> None:
            [lease] = await renewing.renew([task["attempt_id"]])
            assert lease["status"] == "ok", lease

        gone = asyncio.Event()
        rounds = 6  # two session TTLs of heartbeats
        keepers = asyncio.gather(
            _keep_alive(beating, beating.heartbeat, gone, rounds),
            _keep_alive(renewing, renew, gone, rounds),
        )
        async with asyncio.timeout(WAIT):
            closes = await asyncio.gather(_closed(quiet), _closed(drained))
        assert closes == [(4409, "SESSION_EXPIRED")] * 2
        gone.set()
        await keepers
        assert beating.pushed.empty() and renewing.pushed.empty()  # not closed, no error
        await renewing.finish(task["attempt_id"], task["fence"], result="done")
        for conn in (quiet, drained, beating, renewing):
            await conn.close()

    asyncio.run(scenario())
