"""What ``ctx.upload`` and ``ctx.upload_from_thread`` raise when the server is not there
or does not answer, against real sockets on a loopback port."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest

from orbit.worker.connection import ServerError
from orbit.worker.runner import Context, Worker


def _context(worker: Worker, loop: asyncio.AbstractEventLoop) -> Context:
    """A running attempt's context, as the runner builds it (``Worker._accept``)."""
    worker._conn = SimpleNamespace(session_id="s1", epoch="1")  # type: ignore[assignment]
    ctx = Context("t1", "a1", 1, "h", "q", "default", None, None)
    ctx._loop = loop
    ctx._upload = worker._upload
    ctx._fence = "1"
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_upload_to_a_server_that_is_down_raises_connection_error() -> None:
    """It raised httpx's ConnectError, which is no ConnectionError: a handler that
    catches transport failures as the rest of the SDK raises them did not catch it."""

    async def main() -> None:
        worker = Worker(f"http://127.0.0.1:{_free_port()}", "t0ken")
        ctx = _context(worker, asyncio.get_running_loop())
        with pytest.raises(ConnectionError) as caught:
            await ctx.upload("out.txt", b"data", "text/plain")
        assert "127.0.0.1" in str(caught.value)
        assert "t0ken" not in str(caught.value)

    asyncio.run(main())


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()


def test_an_upload_from_a_thread_that_times_out_is_given_up(silent_server: str) -> None:
    """Its TimeoutError left the upload running on the event loop, the connection and
    the file held, for as long as the server took (300 s)."""

    async def main() -> None:
        worker = Worker(silent_server, "t0ken")
        ctx = _context(worker, asyncio.get_running_loop())
        before = asyncio.all_tasks()

        def upload() -> None:
            with pytest.raises(TimeoutError):
                ctx.upload_from_thread("out.txt", b"data", timeout=0.2)

        await asyncio.to_thread(upload)
        left = asyncio.all_tasks() - before - {asyncio.current_task()}
        if left:
            await asyncio.wait(left, timeout=1.0)
        assert all(task.done() for task in left)

    asyncio.run(main())


def test_an_upload_from_a_thread_called_on_the_event_loop_is_refused(silent_server: str) -> None:
    """Called from an async handler (on the event loop's own thread), it blocked the
    loop while it waited for the upload that loop was to run: every attempt of the
    worker stood still, renewals too, until its timeout (300 s by default)."""

    async def main() -> None:
        worker = Worker(silent_server, "t0ken")
        ctx = _context(worker, asyncio.get_running_loop())
        with pytest.raises(RuntimeError, match=r"await ctx\.upload"):
            ctx.upload_from_thread("out.txt", b"data", timeout=0.2)

    asyncio.run(main())


class _NotOrbit(BaseHTTPRequestHandler):
    """What a proxy in front may answer an upload with instead of Orbit's JSON."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *_: Any) -> None:
        pass

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        kind = self.path.split("/")[1]
        body, extra = b"", {}
        if kind == "moved":  # plain HTTP sent on to https
            status, extra = 308, {"Location": "https://orbit.example/"}
        elif kind == "page":  # a success that is no Orbit reply
            status, body = 200, b"<html><body>hello</body></html>"
        else:  # a body labelled gzip that is not
            status, body, extra = 200, b"not gzip!!", {"Content-Encoding": "gzip"}
        self.send_response(status)
        for name, value in extra.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def not_orbit() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _NotOrbit)
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize(
    ("prefix", "code"), [("moved", "REDIRECT"), ("page", "NOT_JSON"), ("gzip", "NOT_JSON")]
)
def test_an_upload_answered_with_no_orbit_reply_raises_server_error(
    not_orbit: str, prefix: str, code: str
) -> None:
    """A redirect or a success that is not Orbit's JSON (a proxy's page; a body labelled
    gzip that is not) raised json's JSONDecodeError or httpx's DecodingError from
    ``ctx.upload``, where a proxy's error page raises ServerError: a ServerError too now,
    with the code the clients give such a reply."""

    async def main() -> None:
        worker = Worker(f"{not_orbit}/{prefix}", "t0ken")
        ctx = _context(worker, asyncio.get_running_loop())
        with pytest.raises(ServerError) as caught:
            await ctx.upload("out.txt", b"data", "text/plain")
        assert caught.value.code == code

    asyncio.run(main())
