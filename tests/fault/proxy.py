"""A small TCP relay for fault drills, placed between a worker and a server node.

    with FaultProxy(node.port) as proxy:        # listens on 127.0.0.1:proxy.port
        worker_url = proxy.http                  # give this URL to the worker
        proxy.pause("up")                        # hold client→server frames
        proxy.resume("up")
        trap = proxy.drop_reply("finish", then_target=node_b.port)
        ...                                      # the worker's next finish reaches the
        trap.wait()                              # server, its reply never comes back
        proxy.cut_all()

It runs its own event loop in a daemon thread, so a test drives it with plain calls; every
control call returns once the loop has applied it.

It understands just enough of the worker WebSocket to act on messages:

- the upgrade request goes through with its ``Sec-WebSocket-Extensions`` header removed,
  so no compression is negotiated and every frame carries its JSON in clear;
- after the upgrade it relays whole frames (client frames are masked, server frames are
  not; RFC 6455 §5.2) and decodes each complete text frame as JSON, recording it
  (``records()``): the test can see what the worker sent and what the server answered,
  including frames that were held or dropped;
- a pause holds whole frames of one direction (``up`` = worker→server, ``down`` =
  server→worker), for every connection, new ones included; nothing is lost: held frames
  go on when the direction is resumed, unless the connection is cut meanwhile;
- ``drop_reply(request)`` arms a one-shot trap for the next frame whose ``type`` is
  ``request``: once it has been forwarded to the server, not one more byte is relayed on
  that connection, either way; when the server's reply to it (the frame echoing its
  ``req_id``) arrives, it is recorded in the trap and dropped, and the connection is
  aborted on both sides (a TCP reset). So the server really processed the request and
  only its answer was lost — an ACK loss — and the worker learns of the loss only after
  the server committed (it cannot race its own request by resuming elsewhere first).
  With ``then_target``, new connections go to another port from the cut on (a reconnect
  lands on another node).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

Direction = Literal["up", "down"]
HEADER_END = b"\r\n\r\n"


@dataclass
class Record:
    """One complete frame seen by the proxy. ``message`` is the decoded JSON text frame
    (None for control frames or non-JSON); ``delivered`` says whether it was relayed."""

    link: int
    direction: Direction
    opcode: int
    message: dict[str, Any] | None
    at: float
    delivered: bool = False

    @property
    def type(self) -> str | None:
        return None if self.message is None else self.message.get("type")


@dataclass
class Trap:
    """A one-shot ACK loss: see ``FaultProxy.drop_reply``."""

    request: str
    then_target: int | None
    fired: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    link: int | None = None
    sent: dict[str, Any] | None = None  # the request that went through
    dropped: dict[str, Any] | None = None  # the reply that never reached the worker

    def wait(self, timeout: float = 15.0) -> dict[str, Any]:
        """Wait until the reply was dropped (or the server side gave up); return it."""
        if not self.done.wait(timeout):
            raise AssertionError(f"the {self.request!r} trap did not complete in {timeout}s")
        assert self.dropped is not None, f"the server never answered the {self.request!r}"
        return self.dropped


@dataclass
class _Link:
    id: int
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    swallow: Trap | None = None  # set once the trap fired on this link
    closed: bool = False


def _unmask(data: bytes, mask: bytes) -> bytes:
    if not mask or not data:
        return data
    key = (mask * (len(data) // 4 + 1))[: len(data)]
    n = int.from_bytes(data, "big") ^ int.from_bytes(key, "big")
    return n.to_bytes(len(data), "big")


async def _read_frame(reader: asyncio.StreamReader) -> tuple[bytes, int, bool, bytes]:
    """One WebSocket frame: its raw bytes (relayed as is), opcode, FIN bit and payload."""
    head = await reader.readexactly(2)
    fin, opcode = bool(head[0] & 0x80), head[0] & 0x0F
    masked, size = bool(head[1] & 0x80), head[1] & 0x7F
    ext = b""
    if size == 126:
        ext = await reader.readexactly(2)
        size = int.from_bytes(ext, "big")
    elif size == 127:
        ext = await reader.readexactly(8)
        size = int.from_bytes(ext, "big")
    mask = await reader.readexactly(4) if masked else b""
    data = await reader.readexactly(size)
    return head + ext + mask + data, opcode, fin, _unmask(data, mask)


def _strip_extensions(header: bytes) -> bytes:
    lines = header[: -len(HEADER_END)].split(b"\r\n")
    kept = [ln for ln in lines if not ln.lower().startswith(b"sec-websocket-extensions:")]
    return b"\r\n".join(kept) + HEADER_END


class FaultProxy:
    """A loopback relay to ``target_port`` with fault controls; see the module docstring."""

    def __init__(self, target_port: int, *, reply_timeout: float = 10.0) -> None:
        self.target_port = target_port
        self.reply_timeout = reply_timeout
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._gates: dict[Direction, asyncio.Event] = {}
        self._links: dict[int, _Link] = {}
        self._next_id = 0
        self._trap: Trap | None = None
        self._records: list[Record] = []
        self._lock = threading.Lock()
        self.errors: list[str] = []  # anything unexpected (e.g. a compressed frame)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FaultProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def close(self) -> None:
        """Cut every connection, stop listening and end the thread."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ controls

    def pause(self, direction: Direction | Literal["both"]) -> None:
        self._call(self._set_gates(direction, False))

    def resume(self, direction: Direction | Literal["both"]) -> None:
        self._call(self._set_gates(direction, True))

    def cut_all(self) -> None:
        """Abort every connection now, both sides (held frames are lost)."""
        self._call(self._cut_all())

    def retarget(self, port: int) -> None:
        """Send new connections to another port (existing ones are left alone)."""
        self._call(self._retarget(port))

    def drop_reply(self, request: str, *, then_target: int | None = None) -> Trap:
        """Arm a one-shot trap on the next ``request`` frame (by its ``type``)."""
        trap = Trap(request, then_target)
        self._call(self._arm(trap))
        return trap

    def records(self, direction: Direction | None = None, kind: str | None = None) -> list[Record]:
        with self._lock:
            return [
                r
                for r in self._records
                if (direction is None or r.direction == direction)
                and (kind is None or r.type == kind)
            ]

    def wait_record(
        self,
        what: str,
        predicate: Callable[[Record], bool],
        timeout: float = 15.0,
    ) -> Record:
        """Poll until a recorded frame satisfies ``predicate``; return the first one."""
        end = time.monotonic() + timeout
        while True:
            for r in self.records():
                if predicate(r):
                    return r
            assert time.monotonic() < end, f"the proxy never saw {what} within {timeout}s"
            time.sleep(0.01)

    def links(self) -> int:
        """How many connections are open now."""
        return len(self._links)

    def opened(self) -> int:
        """How many connections were relayed so far, closed ones included (the id of the
        latest)."""
        return self._next_id

    def wait_opened(self, n: int, timeout: float = 15.0) -> None:
        """Poll until ``n`` connections in all were relayed."""
        end = time.monotonic() + timeout
        while self.opened() < n:
            assert time.monotonic() < end, f"the proxy never relayed {n} connections"
            time.sleep(0.01)

    # ------------------------------------------------------------------ loop side

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self) -> None:
        self._gates = {"up": asyncio.Event(), "down": asyncio.Event()}
        for gate in self._gates.values():
            gate.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._cut_all()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:  # the connection handlers, ending now that their links are cut
            await asyncio.wait(others, timeout=5)

    async def _set_gates(self, direction: Direction | Literal["both"], open_: bool) -> None:
        names: tuple[Direction, ...] = ("up", "down") if direction == "both" else (direction,)
        for name in names:
            gate = self._gates[name]
            if open_:
                gate.set()
            else:
                gate.clear()

    async def _retarget(self, port: int) -> None:
        self.target_port = port

    async def _arm(self, trap: Trap) -> None:
        self._trap = trap

    async def _cut_all(self) -> None:
        for link in list(self._links.values()):
            self._close_link(link)
        tasks = [t for link in self._links.values() for t in link.tasks]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        self._links.clear()

    def _close_link(self, link: _Link) -> None:
        link.closed = True
        for w in (link.client, link.server):
            w.transport.abort()

    def _record(
        self, link: _Link, direction: Direction, opcode: int, fin: bool, payload: bytes
    ) -> Record:
        message = None
        if opcode == 1 and fin:
            with contextlib.suppress(ValueError):
                decoded = json.loads(payload)
                message = decoded if isinstance(decoded, dict) else None
        rec = Record(link.id, direction, opcode, message, time.time())
        with self._lock:
            self._records.append(rec)
        return rec

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            sreader, swriter = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            cwriter.transport.abort()
            return
        self._next_id += 1
        link = _Link(self._next_id, cwriter, swriter)
        self._links[link.id] = link
        link.tasks = [
            asyncio.create_task(self._pump(link, "up", creader, swriter)),
            asyncio.create_task(self._pump(link, "down", sreader, cwriter)),
        ]
        await asyncio.gather(*link.tasks, return_exceptions=True)
        self._close_link(link)
        self._links.pop(link.id, None)

    async def _pump(
        self,
        link: _Link,
        direction: Direction,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        gate = self._gates[direction]
        try:
            header = await reader.readuntil(HEADER_END)  # the HTTP upgrade, either way
            if direction == "up":
                header = _strip_extensions(header)
            await gate.wait()
            if link.closed:
                return
            writer.write(header)
            while not link.closed:
                raw, opcode, fin, payload = await _read_frame(reader)
                if raw[0] & 0x70:
                    self.errors.append(f"link {link.id} {direction}: a frame with RSV bits")
                rec = self._record(link, direction, opcode, fin, payload)
                if link.swallow is not None:
                    self._swallowed(link, rec)
                    continue
                await gate.wait()
                if link.closed:
                    return
                if link.swallow is not None:  # the trap fired while this frame was held
                    self._swallowed(link, rec)
                    continue
                writer.write(raw)
                rec.delivered = True
                if direction == "up":
                    self._maybe_fire(link, rec)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except asyncio.LimitOverrunError:
            self.errors.append(f"link {link.id} {direction}: an oversized HTTP header")
        self._close_link(link)

    def _maybe_fire(self, link: _Link, rec: Record) -> None:
        trap = self._trap
        if trap is None or rec.type != trap.request:
            return
        self._trap = None
        trap.link, trap.sent = link.id, rec.message
        link.swallow = trap  # from now on nothing more is relayed on this link
        trap.fired.set()
        self._loop.call_later(self.reply_timeout, self._cut_trapped, link, trap)

    def _swallowed(self, link: _Link, rec: Record) -> None:
        trap = link.swallow
        assert trap is not None and trap.sent is not None
        message = rec.message
        if rec.direction == "down" and message and message.get("req_id") == trap.sent["req_id"]:
            trap.dropped = message
            self._cut_trapped(link, trap)

    def _cut_trapped(self, link: _Link, trap: Trap) -> None:
        if trap.done.is_set():
            return
        if trap.then_target is not None:
            self.target_port = trap.then_target
        self._close_link(link)  # the worker sees its connection drop only now
        trap.done.set()
