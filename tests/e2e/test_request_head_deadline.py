"""A connection that never delivers a complete request head is closed (``--header-timeout``).

uvicorn starts no timer on a connection before its first response: a peer that connected
and sent nothing, or part of a request head, held the connection and a file descriptor of
the node for as long as it liked (one was still open after 136 s), and enough of them,
from anyone without a token, held every descriptor (a worker's hello failed, clients got
an empty reply). Each such connection is now closed within ``--header-timeout``, over
plain TCP and TLS; slow clients that keep sending, idle kept-alive connections and
worker WebSockets are not.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from pathlib import Path

from orbit.client import AsyncClient
from orbit.worker import WorkerConnection
from tests.e2e.servers import Node, Tokens, database, make_tokens, start_server
from tests.e2e.test_tls import trusting, write_pki

#: the deadline the nodes here run with: short, so the test takes seconds
DEADLINE = 2.0
#: how long a probe waits for the node's close before it says the connection stayed open:
#: far past the deadline, so a loaded machine never fails it
WAIT = 15.0
HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
PARTIAL = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
#: an event stream's keep-alive comment this often (s): a stream seen alive, by its comments
KEEPALIVE = 0.5

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The status and body of one HTTP/1.1 response with a Content-Length."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(
        int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")
    )
    return int(lines[0].split()[1]), await reader.readexactly(length)


async def closed_by_node(name: str, streams: Streams) -> None:
    """Read until the node closes the connection (an end of stream or a reset)."""
    reader, writer = streams
    try:
        async with asyncio.timeout(WAIT):
            while await reader.read(65536):
                pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"{name}: still open {WAIT} s after connecting") from None
    finally:
        writer.close()


async def drip(writer: asyncio.StreamWriter, data: bytes, pieces: int, gap: float) -> None:
    """Send ``data`` in ``pieces`` parts, ``gap`` seconds apart: a slow client."""
    size = -(-len(data) // pieces)
    for at in range(0, len(data), size):
        if at:
            await asyncio.sleep(gap)
        writer.write(data[at : at + size])
        await writer.drain()


async def queues(node: Node, tokens: Tokens, ca: Path | None = None) -> None:
    """Orbit's own client is served."""
    async with AsyncClient(node.http, tokens.admin, cafile=None if ca is None else str(ca)) as c:
        await c.queues()


async def probe(node: Node, tokens: Tokens) -> None:
    """Connections that never complete a request head are closed, concurrently with
    clients that must be left alone."""
    port = node.port

    async def opened() -> Streams:
        return await asyncio.open_connection("127.0.0.1", port)

    async def silent() -> None:
        await closed_by_node("silent", await opened())

    async def partial_head() -> None:
        streams = await opened()
        streams[1].write(PARTIAL)
        await closed_by_node("partial head", streams)

    async def partial_head_after_a_request() -> None:
        # A byte of the next request stops uvicorn's keep-alive timer: the head's own
        # deadline must take over.
        reader, writer = await opened()
        writer.write(HEAD)
        assert (await response(reader))[0] == 200
        writer.write(PARTIAL)
        await closed_by_node("partial head after a request", (reader, writer))

    async def slow_head() -> None:  # the whole head within the deadline, bit by bit
        reader, writer = await opened()
        await drip(writer, HEAD, pieces=4, gap=DEADLINE / 8)
        assert (await response(reader))[0] == 200
        writer.close()

    async def slow_body() -> None:  # the body is not bound by the head's deadline
        reader, writer = await opened()
        body = b'{"name": "slow", "max_concurrency": 1, "rate": 0}'
        writer.write(
            b"POST /v1/queues HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Authorization: Bearer {tokens.admin}\r\n".encode()
            + b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        await drip(writer, body, pieces=4, gap=DEADLINE / 2)
        status, text = await response(reader)
        assert status == 201, text
        writer.close()

    async def idle_between_requests() -> None:  # the keep-alive timeout applies, not this
        reader, writer = await opened()
        writer.write(HEAD)
        assert (await response(reader))[0] == 200
        await asyncio.sleep(DEADLINE * 1.5)
        writer.write(HEAD)
        assert (await response(reader))[0] == 200
        writer.close()

    async def pipelined_behind_a_stream() -> None:
        # A head pipelined behind a request still being answered (an event stream, which
        # never ends) is not timed while uvicorn reads none of it: timed, it closed the
        # connection, and the stream with it, after the deadline.
        reader, writer = await opened()
        writer.write(
            b"GET /v1/events/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Authorization: Bearer {tokens.admin}\r\n\r\n".encode()
            + PARTIAL
        )
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        seen = b""
        async with asyncio.timeout(WAIT):  # keep-alives for three deadlines and more
            while seen.count(b": keep-alive") < 3 * DEADLINE / KEEPALIVE:
                more = await reader.read(65536)
                assert more, f"closed {seen.count(b': keep-alive')} keep-alives in"
                seen += more
        writer.close()

    async def idle_worker() -> None:  # an upgraded connection is no longer timed
        conn = await WorkerConnection.connect(node.ws, tokens.worker)
        try:
            await conn.hello("idle", {"h": 1}, max_concurrency=1)
            await asyncio.sleep(DEADLINE * 1.5)
            await conn.heartbeat(timeout=10)
        finally:
            await conn.close()

    await asyncio.gather(
        silent(),
        partial_head(),
        partial_head_after_a_request(),
        slow_head(),
        slow_body(),
        idle_between_requests(),
        pipelined_behind_a_stream(),
        idle_worker(),
        queues(node, tokens),
    )
    await queues(node, tokens)  # the node serves on


def test_connections_without_a_complete_request_head_are_closed(
    nodes: Callable[..., Node], tokens: Tokens
) -> None:
    node = nodes(args=["--header-timeout", str(DEADLINE), "--stream-keepalive", str(KEEPALIVE)])
    asyncio.run(probe(node, tokens))
    assert "Traceback" not in node.log_text()


def test_tls_connections_without_a_request_head_are_closed(tmp_path: Path) -> None:
    """Over TLS the HTTP protocol starts after the handshake (the event loop bounds a
    handshake itself, at 60 s): a peer that completes one and then sends nothing is closed
    within the deadline all the same, while https and wss clients are served."""
    cert, key, ca = write_pki(tmp_path)
    with database("sqlite", tmp_path) as db_url:
        tokens = make_tokens(db_url)
        node = start_server(
            db_url, tmp_path, tls=(cert, key, ca), args=["--header-timeout", str(DEADLINE)]
        )
        try:

            async def tls() -> None:
                context = trusting(ca)
                silent = await asyncio.open_connection("127.0.0.1", node.port, ssl=context)
                assert isinstance(silent[1].get_extra_info("ssl_object"), ssl.SSLObject)
                partial = await asyncio.open_connection("127.0.0.1", node.port, ssl=context)
                partial[1].write(PARTIAL)

                async def worker() -> None:
                    conn = await WorkerConnection.connect(node.ws, tokens.worker, cafile=str(ca))
                    try:
                        await conn.hello("tls", {"h": 1}, max_concurrency=1)
                    finally:
                        await conn.close()

                await asyncio.gather(
                    closed_by_node("silent after the handshake", silent),
                    closed_by_node("partial head over TLS", partial),
                    worker(),
                    queues(node, tokens, ca),
                )

            asyncio.run(tls())
        finally:
            node.stop()
