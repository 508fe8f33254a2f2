"""Both clients against real loopback servers that answer too slowly or not at all: a
call is given its ``timeout`` as a whole, however slowly the server trickles its answer
(the timeout bounded each read of the socket, and a byte every 0.3 s kept a call going
for ever), a stream's body still waits per read, and ``Client.close`` ends a call in
flight in another thread at once."""

from __future__ import annotations

import asyncio
import socketserver
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from orbit.client import AsyncClient, Client, Unreachable, WaitTimeout
from orbit.client._http import Transport
from tests.http_servers import serving

#: Seconds between two bytes of a trickled answer: far under any timeout here, so that
#: no single read of the socket ever times out.
PACE = 0.05
#: Bytes a trickled answer never gets to the end of (PACE apart: more than an hour).
ENDLESS = 100_000
#: The most a test waits for a call that should end, before it calls the call hung: the
#: timeout that fails these tests on the defect (which held a call for the whole trickle,
#: over an hour, or a wait's poll for the client's 30 s), and far more than a call given
#: 0.5 s or 1 s needs on a loaded machine. No test measures how long a call took.
HUNG = 15.0

_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


class _Server(socketserver.ThreadingTCPServer):
    """Answers every request as ``mode`` says (``_Answer``). ``asked`` is set once a
    request has come; ``stop`` ends every answer still going (at the test's end)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, mode: str) -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.mode = mode
        self.asked = threading.Event()
        self.stop = threading.Event()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up mid-answer, on purpose

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Answer(socketserver.BaseRequestHandler):
    """``head``: the answer's head one byte every ``PACE`` s, never ending; ``body``: the
    head at once, then a body of ``ENDLESS`` bytes at that pace; ``silent``: no answer
    at all; ``withheld``: the head at once and not a byte of its body; ``stream``: the
    head at once, then ten bytes 0.2 s apart (a stream that is slow as a whole, and
    quick enough at each read)."""

    server: _Server

    def handle(self) -> None:
        asked = b""
        while b"\r\n\r\n" not in asked:
            got = self.request.recv(65536)
            if not got:
                return
            asked += got
        self.server.asked.set()
        mode = self.server.mode
        if mode == "head":
            self._drip(_HEAD + b"X-Pad: " + b"a" * ENDLESS, PACE)
        elif mode == "body":
            self.request.sendall(_HEAD + b"Content-Length: %d\r\n\r\n" % ENDLESS)
            self._drip(b" " * ENDLESS, PACE)
        elif mode == "withheld":
            self.request.sendall(_HEAD + b"Content-Length: 2\r\n\r\n")
            self.server.stop.wait()
        elif mode == "stream":
            self.request.sendall(_HEAD + b"Content-Length: 10\r\n\r\n")
            self._drip(b"0123456789", 0.2)
        else:
            self.server.stop.wait()

    def _drip(self, data: bytes, pace: float) -> None:
        for i in range(len(data)):
            if self.server.stop.wait(pace):
                return
            try:
                self.request.sendall(data[i : i + 1])
            except OSError:  # the client hung up
                return


@pytest.fixture
def slow() -> Iterator[Callable[[str], _Server]]:
    """Servers that answer as ``mode`` says, each stopped at the test's end."""
    running: list[_Server] = []

    def start(mode: str) -> _Server:
        srv = _Server(mode)
        running.append(srv)
        return srv

    try:
        yield start
    finally:
        for srv in running:
            srv.stop.set()


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``call`` running in a thread of its own; the list gets what it returned or
    raised, once it has."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # what ended it, for the test thread
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _ended(call: Callable[[], Any]) -> Any:
    """What ``call`` returned or raised; the test fails if it goes on for ``HUNG``
    seconds."""
    thread, outcome = _in_thread(call)
    thread.join(HUNG)
    assert not thread.is_alive(), f"the call still runs after {HUNG} s"
    return outcome[0]


async def _ended_async(call: Callable[[], Any]) -> Any:
    """As ``_ended``, for a coroutine function."""
    running = asyncio.ensure_future(call())
    done, _ = await asyncio.wait({running}, timeout=HUNG)
    if not done:
        running.cancel()
        pytest.fail(f"the call still runs after {HUNG} s")
    return running.exception() or running.result()


@pytest.mark.parametrize("mode", ["head", "body"])
def test_a_call_ends_within_its_timeout_however_slowly_the_server_trickles(
    slow: Callable[[str], _Server], mode: str
) -> None:
    """A byte every 0.05 s, of the answer's head or of its body: each read of the socket
    came well within the timeout, and ``get`` waited for ever. It raises Unreachable,
    "no answer … within 0.5 s", when its 0.5 s are up; the client's own timeout and
    one given to the call alike."""
    srv = slow(mode)
    with serving(srv):
        with Client(srv.url, "t0ken", timeout=0.5) as c:
            exc = _ended(lambda: c.get("x"))
            assert isinstance(exc, Unreachable), exc
            assert str(exc) == f"no answer from 127.0.0.1:{srv.server_address[1]} within 0.5 s"
        with Client(srv.url, "t0ken", timeout=30) as c:
            exc = _ended(lambda: c.get("x", timeout=0.5))
            assert isinstance(exc, Unreachable) and "within 0.5 s" in str(exc), exc


def test_a_wait_ends_about_its_timeout_however_slowly_the_server_trickles(
    slow: Callable[[str], _Server],
) -> None:
    """The docs' promise: ``wait(timeout=T)`` returns or raises within about T + 0.5 s
    however slow the server is. Against a server that trickles its answer, the one poll
    it has time for does not answer: WaitTimeout, saying so."""
    srv = slow("head")
    # A poll given the client's 30 s, not what is left of the wait, runs past HUNG: failed.
    with serving(srv), Client(srv.url, "t0ken", timeout=30) as c:
        exc = _ended(lambda: c.wait("x", timeout=1))
    assert isinstance(exc, WaitTimeout) and "did not answer the last poll" in str(exc), exc


@pytest.mark.parametrize("mode", ["head", "body"])
def test_an_async_call_and_wait_end_within_their_timeout_too(
    slow: Callable[[str], _Server], mode: str
) -> None:
    """AsyncClient, over httpx, gave each read the timeout as well: its calls and waits
    on a trickling server went on for ever, as Client's did."""
    srv = slow(mode)
    where = f"127.0.0.1:{srv.server_address[1]}"

    async def main() -> None:
        async with AsyncClient(srv.url, "t0ken", timeout=0.5) as c:
            exc = await _ended_async(lambda: c.get("x"))
            assert isinstance(exc, Unreachable), exc
            assert str(exc) == f"no answer from {where} within 0.5 s"
        async with AsyncClient(srv.url, "t0ken", timeout=30) as c:
            exc = await _ended_async(lambda: c.wait("x", timeout=1))
            assert isinstance(exc, WaitTimeout), exc

    with serving(srv):
        asyncio.run(main())


def test_a_stream_opens_within_the_timeout_and_its_body_waits_per_read(
    slow: Callable[[str], _Server],
) -> None:
    """A stream is no call with a deadline: its body, read for as long as a follow goes
    on, waits at most the timeout per read (ten bytes 0.2 s apart, 2 s in all, with a
    1 s timeout, come whole, from either client). Its open, up to the answer's head, is
    a request: a head trickled for ever is Unreachable once the timeout is up."""
    streaming, trickling = slow("stream"), slow("head")
    with serving(streaming), serving(trickling):
        t = Transport(streaming.url, {}, cafile=None, timeout=1.0)
        with t.stream("GET", "/") as (status, _, _, chunks):
            assert status == 200 and b"".join(chunks) == b"0123456789"
        t.close()
        t = Transport(trickling.url, {}, cafile=None, timeout=0.5)
        exc = _ended(lambda: t.stream("GET", "/").__enter__())
        assert isinstance(exc, Unreachable) and "within 0.5 s" in str(exc), exc
        t.close()

        async def main() -> None:
            async with AsyncClient(streaming.url, "t0ken", timeout=1.0) as c:
                assert await c.artifact_content("a") == b"0123456789"
            async with AsyncClient(trickling.url, "t0ken", timeout=0.5) as c:
                exc = await _ended_async(lambda: c.artifact_content("a"))
                assert isinstance(exc, Unreachable) and "within 0.5 s" in str(exc), exc

        asyncio.run(main())


@pytest.mark.parametrize("mode", ["silent", "withheld"])
@pytest.mark.parametrize("call", ["get", "wait"])
def test_closing_the_client_ends_a_call_in_flight_in_another_thread(
    slow: Callable[[str], _Server], mode: str, call: str
) -> None:
    """``close`` shut down only the streams being read: a ``get`` or a ``wait`` in
    another thread, its server silent (no answer, or a head and no body), went on for
    the client's whole timeout (30 s here) after it. It ends at once now, with the
    closed client's RuntimeError, and the client refuses calls after it."""
    srv = slow(mode)
    with serving(srv):
        c = Client(srv.url, "t0ken", timeout=30)
        calls = {"get": lambda: c.get("x"), "wait": lambda: c.wait("x", timeout=60)}
        thread, outcome = _in_thread(calls[call])
        assert srv.asked.wait(HUNG), "the request never came"
        c.close()
        thread.join(HUNG)
        assert not thread.is_alive(), f"the call still runs {HUNG} s after the close"
        [exc] = outcome
        assert isinstance(exc, RuntimeError) and str(exc) == "the client is closed", exc
        with pytest.raises(RuntimeError, match=r"^the client is closed$"):
            c.get("x")


@pytest.mark.parametrize("mode", ["silent", "withheld"])
@pytest.mark.parametrize("call", ["get", "wait"])
def test_aclose_ends_a_call_in_flight_and_later_ones_as_a_closed_client(
    slow: Callable[[str], _Server], mode: str, call: str
) -> None:
    """As ``Client.close``: ``aclose`` cut a call in flight short with an Unreachable
    (httpx's ReadError: "no answer", an outage to a caller that retries) or, for a
    ``wait``, httpx's own RuntimeError text, and a call after it said "Cannot send a
    request, as the client has been closed". Each is the closed client's RuntimeError
    now."""
    srv = slow(mode)

    async def main() -> None:
        c = AsyncClient(srv.url, "t0ken", timeout=30)
        calls = {"get": lambda: c.get("x"), "wait": lambda: c.wait("x", timeout=60)}
        running = asyncio.ensure_future(calls[call]())
        assert await asyncio.to_thread(srv.asked.wait, HUNG), "the request never came"
        await c.aclose()
        done, _ = await asyncio.wait({running}, timeout=HUNG)
        assert done, f"the call still runs {HUNG} s after aclose"
        exc = running.exception()
        assert isinstance(exc, RuntimeError) and str(exc) == "the client is closed", exc
        with pytest.raises(RuntimeError, match=r"^the client is closed$"):
            await c.get("x")

    with serving(srv):
        asyncio.run(main())
