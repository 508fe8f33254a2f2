"""What ``ctx.upload`` and ``ctx.upload_from_thread`` raise when the server is not there
or does not answer, or refuses an upload for an epoch the worker's resume replaced (and
when the upload is sent again), against real sockets on a loopback port."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from orbit.worker.connection import ServerError
from orbit.worker.runner import UPLOAD_SENDS, Context, Worker, _Running
from tests.http_servers import serving


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
    with serving(srv):
        yield f"http://127.0.0.1:{srv.server_address[1]}"


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


@pytest.mark.parametrize("name", ["reports/summary.pdf", "..", ".", "bad name.png", ""])
def test_a_bad_artifact_name_is_refused_before_it_is_sent(name: str) -> None:
    """Refused as the server refuses it (``INVALID_ARGUMENT``, "artifact name must be
    ..."), nothing sent (nothing listens here). Sent, a '/' was refused for its encoding
    in the URL's path ("%2F"), and '.' and '..', dot segments that httpx removes from a
    path, went to another route and were answered 404 "Not Found": not a word about the
    name."""

    async def main() -> None:
        worker = Worker(f"http://127.0.0.1:{_free_port()}", "t0ken")
        ctx = _context(worker, asyncio.get_running_loop())
        with pytest.raises(ServerError) as caught:
            await ctx.upload(name, b"data", "text/plain")
        assert caught.value.code == "INVALID_ARGUMENT"
        assert caught.value.message.startswith("artifact name must be 1-128 characters")

    asyncio.run(main())


class _Fenced(BaseHTTPRequestHandler):
    """An Orbit server's upload route as a session's resume meets it: each PUT is kept
    (its X-Orbit-Epoch and body) and answered 201 or ``409 FENCED_EPOCH``, as the
    server's ``accept`` says, given the epoch sent."""

    protocol_version = "HTTP/1.1"
    server: _FencedServer

    def log_message(self, *_: Any) -> None:
        pass

    def _body(self) -> bytes:
        if "Content-Length" in self.headers:
            return self.rfile.read(int(self.headers["Content-Length"]))
        body = b""  # a file is streamed: chunked
        while size := int(self.rfile.readline().strip(), 16):
            body += self.rfile.read(size)
            self.rfile.readline()
        self.rfile.readline()
        return body

    def do_PUT(self) -> None:
        epoch = self.headers["X-Orbit-Epoch"]
        self.server.puts.append((epoch, self._body()))
        answer: dict[str, Any]
        if self.server.accept(epoch):
            status, answer = 201, {"id": "f1"}
        else:
            error = {"code": "FENCED_EPOCH", "message": "the session has a newer epoch"}
            status, answer = 409, {"error": error}
        body = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _FencedServer(ThreadingHTTPServer):
    daemon_threads = True
    puts: list[tuple[str, bytes]]
    accept: Callable[[str], bool]


@pytest.fixture
def fenced() -> Iterator[_FencedServer]:
    srv = _FencedServer(("127.0.0.1", 0), _Fenced)
    srv.puts = []
    with serving(srv):
        yield srv


def _running_attempt(worker: Worker, ctx: Context) -> _Running:
    """``ctx``'s attempt, started and held by ``worker`` over a live connection."""
    running = _Running(ctx, ctx._fence, lease_expires=time.monotonic() + 30)
    worker.running[ctx.attempt_id] = running
    worker._connected.set()
    return running


def _resumed(worker: Worker, session_id: str, epoch: str) -> None:
    worker._conn = SimpleNamespace(session_id=session_id, epoch=epoch)  # type: ignore[assignment]


def test_an_upload_fenced_off_by_the_workers_resume_is_sent_again(
    fenced: _FencedServer, tmp_path: Path
) -> None:
    """The socket dropped during the upload and the worker resumed its session (epoch 1
    to 2): the commit was refused ``FENCED_EPOCH`` though the attempt was still the
    worker's, which then finished it with no artifact. Sent again now under the new
    epoch (a file read again from its start), once the resume under way is done."""
    data = os.urandom(600_000)  # three chunks of the file's reads
    (tmp_path / "out.bin").write_bytes(data)

    async def main() -> None:
        worker = Worker(f"http://127.0.0.1:{fenced.server_address[1]}", "t0ken")
        loop = asyncio.get_running_loop()
        ctx = _context(worker, loop)
        _running_attempt(worker, ctx)

        def accept(epoch: str) -> bool:
            if epoch == "1":  # the resume is under way when the refusal arrives
                loop.call_soon_threadsafe(worker._connected.clear)
                loop.call_soon_threadsafe(loop.call_later, 0.2, resume)
            return epoch == "2"

        def resume() -> None:
            _resumed(worker, "s1", "2")
            worker._connected.set()

        fenced.accept = accept
        made = await ctx.upload("out.bin", tmp_path / "out.bin")
        assert made == {"id": "f1"}

    asyncio.run(main())
    assert fenced.puts == [("1", data), ("2", data)]


@pytest.mark.parametrize(
    ("case", "sends"),
    [
        ("each send fenced off by a resume", UPLOAD_SENDS),
        ("no resume", 1),
        ("a new session", 1),
        ("the attempt lost", 1),
        ("the attempt over", 1),
        ("the lease run out", 1),
    ],
)
def test_an_upload_is_sent_again_only_after_a_resume_while_the_attempt_is_ours(
    fenced: _FencedServer, case: str, sends: int
) -> None:
    """A ``FENCED_EPOCH`` refusal is raised as it came (the upload not sent again) when
    the worker has not resumed the same session since, or the attempt is no longer its
    own; and after ``UPLOAD_SENDS`` sends whatever happens."""

    async def main() -> None:
        worker = Worker(f"http://127.0.0.1:{fenced.server_address[1]}", "t0ken")
        ctx = _context(worker, asyncio.get_running_loop())
        running = _running_attempt(worker, ctx)

        def accept(epoch: str) -> bool:
            if case != "no resume":
                session = "s2" if case == "a new session" else "s1"
                _resumed(worker, session, str(int(epoch) + 1))
            if case == "the attempt lost":
                running.lost = True
            elif case == "the attempt over":
                worker.running.clear()
            elif case == "the lease run out":
                running.lease_expires = time.monotonic()
            return False

        fenced.accept = accept
        with pytest.raises(ServerError) as caught:
            await ctx.upload("out.bin", b"data")
        assert caught.value.code == "FENCED_EPOCH"

    asyncio.run(main())
    assert [epoch for epoch, _ in fenced.puts] == [str(n) for n in range(1, sends + 1)]


@pytest.mark.parametrize("data", [bytearray(b"out"), memoryview(b"out")])
def test_bytes_like_data_is_uploaded_as_its_bytes(fenced: _FencedServer, data: Any) -> None:
    """A bytearray or a memoryview failed with AttributeError once the PUT had begun."""

    async def main() -> None:
        worker = Worker(f"http://127.0.0.1:{fenced.server_address[1]}", "t0ken")
        ctx = _context(worker, asyncio.get_running_loop())
        _running_attempt(worker, ctx)
        fenced.accept = lambda epoch: True
        assert await ctx.upload("out.txt", data, "text/plain") == {"id": "f1"}

    asyncio.run(main())
    assert [body for _, body in fenced.puts] == [b"out"]


@pytest.mark.parametrize("data", ["out.txt", 42, None])
def test_data_neither_bytes_nor_a_path_is_refused_before_it_is_sent(
    fenced: _FencedServer, data: Any
) -> None:
    """A str file name raised AttributeError ("'str' object has no attribute 'open'")
    from deep in the request, after the PUT had begun."""

    async def main() -> None:
        worker = Worker(f"http://127.0.0.1:{fenced.server_address[1]}", "t0ken")
        ctx = _context(worker, asyncio.get_running_loop())
        name = type(data).__name__
        with pytest.raises(TypeError, match=f"data must be bytes or a pathlib.Path, not {name}"):
            await ctx.upload("out.txt", data, "text/plain")

    asyncio.run(main())
    assert fenced.puts == []
