"""The network between a client and a node, for end-to-end tests of keep-alive
connections: ``DelayRelay``, a link with latency, and ``idle_connection_answers``.

``DelayRelay`` is a TCP relay on 127.0.0.1 that delivers every byte, and every close,
``delay`` seconds after it arrived, in order, each way: a network whose one-way latency
is ``delay`` (a cross-region link, a congested VPN), on which a server's close of an
idle connection is still on the wire when the client sends its next request.

    with DelayRelay(node.port, delay=0.3) as relay:
        client = Client(relay.http, token)
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import threading
import time


class DelayRelay:
    """Relays ``127.0.0.1:port`` (``http``) to ``target_port``, ``delay`` late each way."""

    def __init__(self, target_port: int, *, delay: float) -> None:
        self.target_port = target_port
        self.delay = delay
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._links: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> DelayRelay:
        self._thread.start()
        assert self._ready.wait(10), "the relay did not start"
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._link, "127.0.0.1", 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _stop(self) -> None:
        """The listener closed and every link ended (its connections closed, which ends
        its reads: a link cancelled instead is logged as an error by Python 3.11's
        streams), before the loop stops."""
        self._server.close()
        for writer in self._writers:
            writer.close()
        if self._links:
            await asyncio.wait(self._links, timeout=5)
        await self._server.wait_closed()

    async def _link(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._links.add(task)
        self._writers.add(down_w)
        up_w: asyncio.StreamWriter | None = None
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
            self._writers.add(up_w)
            await asyncio.gather(self._pipe(down_r, up_w), self._pipe(up_r, down_w))
        finally:
            for writer in (down_w, up_w):
                if writer is not None:
                    writer.close()
                    self._writers.discard(writer)
            self._links.discard(task)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """``src``'s bytes to ``dst``, each ``delay`` after it came; then its close."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                at, data = await queue.get()
                await asyncio.sleep(max(0.0, at - loop.time()))
                if not data:  # the close, as late as the bytes before it
                    dst.close()
                    return
                try:
                    dst.write(data)
                    await dst.drain()
                except ConnectionError:  # the other end is gone
                    return

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                try:
                    data = await src.read(65536)
                except ConnectionError:  # a reset: a close too
                    data = b""
                queue.put_nowait((loop.time() + self.delay, data))
                if not data:
                    break
            await sender
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender


def idle_connection_answers(port: int, idle: float) -> bool:
    """Whether the server on 127.0.0.1:``port`` answers a request on a connection left
    idle for ``idle`` seconds after its first answer (the same connection: False if the
    server closed it meanwhile)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/healthz")
        first = conn.getresponse()
        first.read()
        assert first.status == 200 and not first.will_close
        sock = conn.sock
        time.sleep(idle)
        try:
            conn.request("GET", "/healthz")
            again = conn.getresponse()
            again.read()
        except (http.client.RemoteDisconnected, ConnectionError):
            return False
        return conn.sock is sock and again.status == 200
    finally:
        conn.close()
