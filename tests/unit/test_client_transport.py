"""The sync client's transport (``orbit.client._http``) against a real HTTP/1.1 server on
a loopback port: keep-alive reuse, a connection the server closed while idle, path
prefixes and queries, streamed bodies, threads, and the errors a caller sees."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

from orbit.client import ApiError, AsyncClient, Client, Unreachable
from orbit.client._http import KEEPALIVE_EXPIRY, STREAM_CHUNK, Transport, _still_open
from tests.http_servers import AnsweringHandler, serving


class _Handler(AnsweringHandler):
    server: _Server

    def _answer(self) -> None:
        body = self.body()
        self.server.seen.append(
            {
                "port": self.client_address[1],
                "method": self.command,
                "path": self.path,
                "body": body,
                "headers": dict(self.headers),
            }
        )
        if self.path.startswith("/slow"):
            time.sleep(1.0)
        if self.path.startswith("/endless"):  # a body that never ends: read on till closed
            self.send_response(200)
            self.send_header("Content-Length", str(10 * STREAM_CHUNK))
            if self.path.startswith("/endless-close"):
                self.send_header("Connection", "close")  # the response takes the socket
            self.end_headers()
            self.wfile.write(b"x" * 10)
            self.wfile.flush()
            self.rfile.read(1)  # until the client hangs up
            self.close_connection = True
            return
        if self.path.startswith(("/moved", "/empty")):  # a proxy's redirect; no body at all
            moved = self.path.startswith("/moved")
            self.send_response(308 if moved else 200)
            if moved:
                self.send_header("Location", "https://orbit.example" + self.path[6:])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        kind = "application/json"
        if self.path.startswith("/gzip"):  # a body that claims gzip and is not
            self.send_response(502 if self.path.startswith("/gzip-502") else 200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", "10")
            self.end_headers()
            self.wfile.write(b"not gzip!!")
            return
        if self.path.startswith("/big"):
            payload = b"x" * (3 * STREAM_CHUNK + 5)
        elif self.path.startswith("/html"):  # a proxy's page, or no Orbit server at all
            payload, kind = b"<html><body>Bad Gateway</body></html>", "text/html"
        elif self.path.startswith("/fake-sse"):  # a page mislabelled as an event stream
            payload, kind = b"<!DOCTYPE html>\n<html><body>Hi</body></html>\n", "text/event-stream"
        elif self.path.startswith("/text-data"):  # SSE whose event's data is no JSON object
            payload, kind = b"id: MQ\nevent: submitted\ndata: hello\n\n", "text/event-stream"
        elif self.path.startswith("/deep"):  # JSON nested past what any parser takes
            payload = b"[" * 200_000
        else:
            payload = json.dumps({"path": self.path}).encode()
        status = 404 if self.path.startswith("/missing") else 200
        self.send_response(502 if self.path.startswith(("/html-502", "/deep-502")) else status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        if self.path.startswith("/close"):
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(payload)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    seen: list[dict[str, Any]]

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up mid-body, on purpose


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.seen = []
    with serving(srv):
        yield srv


def _url(srv: _Server, path: str = "") -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}{path}"


def _transport(url: str, timeout: float = 5.0) -> Transport:
    return Transport(url, {"Authorization": "Bearer t0ken"}, cafile=None, timeout=timeout)


def test_requests_share_one_keep_alive_connection(server: _Server) -> None:
    t = _transport(_url(server))
    for i in range(5):
        reply = t.request("POST", "/v1/tasks", {"limit": i, "q": "a b&c"}, b'{"n":1}')
        assert reply.status_code == 200
    t.close()
    assert len({s["port"] for s in server.seen}) == 1
    assert server.seen[3]["path"] == "/v1/tasks?limit=3&q=a+b%26c"
    assert server.seen[0]["body"] == b'{"n":1}'
    assert server.seen[0]["headers"]["Content-Type"] == "application/json"
    assert server.seen[0]["headers"]["Authorization"] == "Bearer t0ken"


def test_a_path_prefix_in_the_url_is_kept(server: _Server) -> None:
    t = _transport(_url(server, "/orbit/"))
    assert json.loads(t.request("GET", "/v1/queues", None, None).content) == {
        "path": "/orbit/v1/queues"
    }
    t.close()


def test_connections_are_reused_in_a_process_with_many_files_open(server: _Server) -> None:
    """``select.select`` takes no descriptor numbered 1024 or more (ValueError): in a
    process with that many files and sockets open (a busy web server calling Orbit),
    each idle connection was taken for one the server had closed, and every call opened
    a connection of its own (with TLS, a handshake)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("this process may not open 1,200 files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    read, write = os.pipe()
    held = [os.dup(read) for _ in range(1030)]  # the next sockets are numbered past 1024
    try:
        t = _transport(_url(server))
        for _ in range(3):
            assert t.request("GET", "/v1/queues", None, None).status_code == 200
        t.close()
    finally:
        for fd in [*held, read, write]:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len({s["port"] for s in server.seen}) == 1


def test_connections_are_reused_where_select_has_no_poll(
    server: _Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows' ``select`` has no ``poll``: the idle check's ``select.poll()`` raised
    AttributeError, unwrapped, from every call that found an idle connection (each one
    after the first). ``select.select`` checks it there, as it did before poll."""
    import select

    monkeypatch.delattr(select, "poll")
    t = _transport(_url(server))
    for _ in range(3):
        assert t.request("GET", "/v1/queues", None, None).status_code == 200
    t.close()
    assert len({s["port"] for s in server.seen}) == 1


def test_a_forked_child_does_not_reuse_its_parents_connections(server: _Server) -> None:
    """A client made before a fork (gunicorn's --preload, a prefork pool, a
    multiprocessing "fork" start) is used in the child: the child took the parent's idle
    connections, the very sockets the parent goes on using, and two processes that share
    one connection read each other's answers. The child opens its own."""
    t = _transport(_url(server))
    assert t.request("GET", "/parent", None, None).status_code == 200
    pid = os.fork()
    if pid == 0:  # the child: exit 0 if its request was answered, never return to pytest
        try:
            os._exit(0 if t.request("GET", "/child", None, None).status_code == 200 else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert t.request("GET", "/parent-again", None, None).status_code == 200
    t.close()
    ports = {s["path"]: s["port"] for s in server.seen}
    assert ports["/child"] != ports["/parent"]
    assert ports["/parent-again"] == ports["/parent"]  # the parent's own, still its own


class _IdleTimeoutHandler(_Handler):
    timeout = 0.2  # the server drops a keep-alive connection idle this long


def test_a_connection_the_server_closed_is_replaced_before_the_next_request(
    server: _Server,
) -> None:
    t = _transport(_url(server))
    assert t.request("GET", "/close", None, None).status_code == 200  # "Connection: close"
    assert t.request("GET", "/after", None, None).status_code == 200
    t.close()
    ports = [s["port"] for s in server.seen]
    assert ports[0] != ports[1]


def test_a_connection_the_server_dropped_while_idle_is_replaced() -> None:
    srv = _Server(("127.0.0.1", 0), _IdleTimeoutHandler)
    srv.seen = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        t = _transport(_url(srv))
        assert t.request("GET", "/first", None, None).status_code == 200
        [idle] = t._idle
        deadline = time.monotonic() + 10
        while _still_open(idle):  # the server's idle timeout closes it
            assert time.monotonic() < deadline, "the server never closed the connection"
            time.sleep(0.05)
        assert t.request("GET", "/second", None, None).status_code == 200
        t.close()
        assert srv.seen[0]["port"] != srv.seen[1]["port"]
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_connection_idle_for_the_keep_alive_expiry_is_not_reused(server: _Server) -> None:
    """uvicorn closes a keep-alive connection idle for 5 s (its default): a request sent
    on one idle about that long met the close on the wire, and a POST, never sent twice,
    raised Unreachable from a healthy server. Client's pool never let a connection
    expire, and AsyncClient's (httpx's) expired one idle 5 s, the server's own limit.
    Both now close one idle ``KEEPALIVE_EXPIRY`` (4 s) rather than send on it; one idle
    for less is reused."""
    with Client(_url(server), token="t0ken") as c:

        async def main() -> None:
            async with AsyncClient(_url(server), token="t0ken") as ac:
                for path in ("/s1", "/s2"):
                    c._call(("POST", path, None, {}))
                for path in ("/a1", "/a2"):
                    await ac._call(("POST", path, None, {}))
                await asyncio.sleep(KEEPALIVE_EXPIRY + 0.2)  # both idle that long
                await ac._call(("POST", "/a3", None, {}))

        asyncio.run(main())
        c._call(("POST", "/s3", None, {}))
    port = {seen["path"]: seen["port"] for seen in server.seen}
    assert port["/s1"] == port["/s2"] != port["/s3"]
    assert port["/a1"] == port["/a2"] != port["/a3"]


def test_a_streamed_body_arrives_in_chunks_and_an_unread_one_is_not_reused(
    server: _Server,
) -> None:
    t = _transport(_url(server))
    with t.stream("GET", "/big") as (status, _, _, chunks):
        got = list(chunks)
    assert status == 200 and sum(map(len, got)) == 3 * STREAM_CHUNK + 5 and len(got) > 1
    assert len(t._idle) == 1  # read to its end: back to the pool
    with t.stream("GET", "/big") as (status, _, _, chunks):
        next(chunks)
    assert not t._idle  # the same one went out, and was closed rather than returned
    t.close()


@pytest.mark.parametrize("path", ["/endless", "/endless-close"])
def test_closing_the_transport_ends_a_stream_read_in_another_thread(
    server: _Server, path: str
) -> None:
    """``close`` closed only the idle connections: a stream read in another thread (an
    event stream that never ends by itself, an artifact's bytes) went on from a client
    that was closed. Its connection is shut down now, and its read ends at once with
    RuntimeError, "the client is closed"; a stream opened after that is refused so. A
    response that says ``Connection: close`` takes the socket from its connection
    (``conn.sock`` is None): ``close`` raised AttributeError, and the read went on."""
    t = _transport(_url(server), timeout=30)
    read: list[bytes] = []
    ended: list[BaseException] = []

    def follow() -> None:
        try:
            with t.stream("GET", path, live=True) as (_, _, _, chunks):
                read.extend(chunks)
        except BaseException as exc:  # what ended it, for the test thread
            ended.append(exc)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    deadline = time.monotonic() + 10
    while not read:  # the stream is open, its first bytes read
        assert time.monotonic() < deadline and reader.is_alive(), ended
        time.sleep(0.01)
    t.close()
    reader.join(5)
    assert not reader.is_alive(), "the read goes on after the close"
    [exc] = ended
    assert isinstance(exc, RuntimeError) and str(exc) == "the client is closed"
    with pytest.raises(RuntimeError, match="closed"), t.stream("GET", "/endless"):
        pass


def test_threads_each_get_a_connection(server: _Server) -> None:
    t = _transport(_url(server))
    errors: list[BaseException] = []

    def calls(n: int) -> None:
        try:
            for i in range(20):
                assert json.loads(t.request("GET", f"/t{n}/{i}", None, None).content) == {
                    "path": f"/t{n}/{i}"
                }
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=calls, args=(n,)) for n in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t.close()
    assert not errors and len(server.seen) == 120


def test_no_server_and_no_answer_raise_unreachable() -> None:
    with socket.socket() as placeholder:  # a port nobody listens on
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    t = _transport(f"http://127.0.0.1:{port}")
    with pytest.raises(Unreachable, match=f"127.0.0.1:{port}") as caught:
        t.request("GET", "/v1/queues", None, None)
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)


def test_a_slow_answer_raises_unreachable_after_the_timeout(server: _Server) -> None:
    t = _transport(_url(server), timeout=0.2)
    with pytest.raises(Unreachable, match=r"within 0\.2 s"):
        t.request("GET", "/slow", None, None)
    assert not t._idle  # the connection that timed out is not reused
    assert t.request("GET", "/quick", None, None).status_code == 200
    t.close()


def test_async_client_says_which_server_did_not_answer_as_client_does(server: _Server) -> None:
    """AsyncClient's Unreachable said "ReadTimeout: " and "ConnectError: All connection
    attempts failed": neither the server nor the time waited."""
    with socket.socket() as placeholder:  # a port nobody listens on
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]

    async def main() -> None:
        async with AsyncClient(_url(server), "t0ken", timeout=0.2) as c:
            with pytest.raises(Unreachable) as slow:
                await c._call(("GET", "/slow", None, None))
        where = f"127.0.0.1:{server.server_address[1]}"
        assert str(slow.value) == f"no answer from {where} within 0.2 s"
        async with AsyncClient(f"http://127.0.0.1:{port}", "t0ken") as c:
            with pytest.raises(Unreachable, match=f"^127.0.0.1:{port}: ConnectError: "):
                await c.queues()

    asyncio.run(main())


#: Server URLs no client can use, and what the refusal says (never the password).
UNUSABLE_URLS = [
    ("ftp://127.0.0.1:1", "must be http"),
    ("127.0.0.1:8000", "must be http"),
    ("http://127.0.0.1:99999", "must be http"),
    ("http://127.0.0.1:1/?x=1", "query"),
    ("http://user:secret@127.0.0.1:1", "credentials"),
]


@pytest.mark.parametrize(("url", "message"), UNUSABLE_URLS)
def test_urls_it_cannot_use_are_refused(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        _transport(url)
    assert "secret" not in str(caught.value)


@pytest.mark.parametrize(("url", "message"), UNUSABLE_URLS)
def test_async_client_refuses_the_urls_client_refuses(url: str, message: str) -> None:
    """At once, as ``ValueError``: httpx took a URL with credentials and sent them as a
    Basic ``Authorization`` header in place of the bearer token, and a URL with no
    scheme surfaced only at the first call, as ``Unreachable``."""
    from orbit.client import AsyncClient

    with pytest.raises(ValueError, match=message) as caught:
        AsyncClient(url, token="t0ken")
    assert "secret" not in str(caught.value)


@pytest.mark.parametrize(("url", "message"), UNUSABLE_URLS)
def test_a_worker_refuses_the_urls_client_refuses(url: str, message: str) -> None:
    """At construction: a ``Worker`` given one of these reconnected for ever (a URL with
    no scheme became a WebSocket URL websockets could not open, and credentials went as
    Basic auth in place of the token, refused as a network error would be)."""
    from orbit.worker.runner import Worker

    with pytest.raises(ValueError, match=message) as caught:
        Worker(url, token="t0ken")
    assert "secret" not in str(caught.value)


def test_a_closed_transport_refuses_requests(server: _Server) -> None:
    t = _transport(_url(server))
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        t.request("GET", "/", None, None)


def test_client_sends_compact_json_and_reads_errors(server: _Server) -> None:
    with Client(_url(server), token="t0ken") as c:
        with pytest.raises(ApiError) as caught:  # a 404 without an Orbit error body
            c._call(("GET", "/missing", None, None))
        assert (caught.value.status, caught.value.code) == (404, "HTTP_ERROR")
        c._call(("POST", "/v1/tasks", None, {"b": [1, 2.5], "a": "é"}))
    assert server.seen[-1]["body"] == '{"b":[1,2.5],"a":"é"}'.encode()
    assert server.seen[-1]["headers"]["User-Agent"] == "orbit-python"


def test_a_reply_that_is_not_json_is_an_api_error(server: _Server) -> None:
    """A page that is no JSON (a proxy's error page, a URL that names some other server)
    is an ``ApiError`` with the status, as a refusal is, not a JSONDecodeError: the CLI
    printed that as a traceback."""
    import asyncio

    from orbit.client import ApiError, AsyncClient

    with Client(_url(server), token="t0ken") as c:
        for path, status in (("/html", 200), ("/html-502", 502)):
            with pytest.raises(ApiError) as caught:
                c._call(("GET", path, None, None))
            assert caught.value.status == status, caught.value

    async def call(path: str) -> None:
        async with AsyncClient(_url(server), token="t0ken") as c:
            await c._call(("GET", path, None, None))

    for path, status in (("/html", 200), ("/html-502", 502)):
        with pytest.raises(ApiError) as caught:
            asyncio.run(call(path))
        assert caught.value.status == status, caught.value


def _refused(c: Client, expected: list[tuple[str, int, str]]) -> None:
    """Each GET of ``expected``'s paths raises the ApiError of its status and code."""
    from orbit.client import ApiError

    for path, status, code in expected:
        with pytest.raises(ApiError) as caught:
            c._call(("GET", path, None, None))
        assert (caught.value.status, caught.value.code) == (status, code)


async def _refused_async(c: AsyncClient, expected: list[tuple[str, int, str]]) -> None:
    """``_refused`` through an AsyncClient."""
    from orbit.client import ApiError

    for path, status, code in expected:
        with pytest.raises(ApiError) as caught:
            await c._call(("GET", path, None, None))
        assert (caught.value.status, caught.value.code) == (status, code)


def test_a_body_that_claims_gzip_and_is_not_is_an_api_error_from_both_clients(
    server: _Server,
) -> None:
    """A proxy that labels a body gzip when it is not: Client, which asks for no
    encoding and reads the bytes as they came, says NOT_JSON (or the error status's
    HTTP_ERROR), as for any page that is no JSON. AsyncClient let httpx's DecodingError
    out, unwrapped: neither an ApiError nor Unreachable, and ``wait`` did not catch it.
    An artifact's bytes are the bytes the server sent, from both clients."""
    from orbit.client import ApiError, AsyncClient

    expected = [("/gzip", 200, "NOT_JSON"), ("/gzip-502", 502, "HTTP_ERROR")]
    with Client(_url(server), token="t0ken") as c:
        _refused(c, expected)
    with Client(_url(server, "/gzip"), token="t0ken") as c:
        assert c.artifact_content("a1") == b"not gzip!!"

    async def main() -> None:
        async with AsyncClient(_url(server), token="t0ken") as c:
            await _refused_async(c, expected)
            # and the connection each went out on is not left half read
            assert (await c._call(("GET", "/after", None, None))) == {"path": "/after"}
        async with AsyncClient(_url(server, "/gzip"), token="t0ken") as c:
            assert await c.artifact_content("a1") == b"not gzip!!"  # as Client reads it
        async with AsyncClient(_url(server, "/gzip-502"), token="t0ken") as c:
            with pytest.raises(ApiError, match="HTTP_ERROR"):
                await c.artifact_content("a1")

    asyncio.run(main())


def test_a_body_nested_past_the_parsers_depth_is_an_api_error(server: _Server) -> None:
    """orjson refuses JSON nested past 1024 levels and the standard library's parser,
    its fallback, raises RecursionError: a reply of 200 KB of ``[`` (a broken or hostile
    proxy, some other server at the URL) raised RecursionError out of every call, and
    out of ``wait``, which rides a proxy's 502. It is an unreadable body, as any page
    that is no JSON: NOT_JSON, or the error status's HTTP_ERROR."""

    expected = [("/deep", 200, "NOT_JSON"), ("/deep-502", 502, "HTTP_ERROR")]
    with Client(_url(server), token="t0ken") as c:
        _refused(c, expected)

    async def main() -> None:
        async with AsyncClient(_url(server), token="t0ken") as c:
            await _refused_async(c, expected)

    asyncio.run(main())


def test_a_redirect_or_an_empty_reply_is_an_api_error(server: _Server) -> None:
    """A proxy in front that redirects (plain HTTP to https, say) or answers 200 with no
    body: the calls raised TypeError ("'NoneType' object is not iterable"), and
    ``artifact_content`` returned the redirect's empty body as the artifact's bytes. A
    redirect is not followed (the token would go along): an ``ApiError`` names where."""
    from orbit.client import ApiError, AsyncClient

    moved = "https://orbit.example/v1/queues"
    with Client(_url(server, "/moved"), token="t0ken") as c:
        with pytest.raises(ApiError, match=f"redirects to {moved}") as caught:
            c.queues()
        assert (caught.value.status, caught.value.code) == (308, "REDIRECT")
        with pytest.raises(ApiError, match="REDIRECT"):
            c.artifact_content("a1")
        with pytest.raises(ApiError, match="REDIRECT"):
            list(c.artifact_stream("a1"))
    with (
        Client(_url(server, "/empty"), token="t0ken") as c,
        pytest.raises(ApiError, match="NOT_JSON"),
    ):
        c.queues()

    async def main() -> None:
        async with AsyncClient(_url(server, "/moved"), token="t0ken") as c:
            with pytest.raises(ApiError, match=f"redirects to {moved}"):
                await c.queues()
            with pytest.raises(ApiError, match="REDIRECT"):
                await c.artifact_content("a1")
        async with AsyncClient(_url(server, "/empty"), token="t0ken") as c:
            with pytest.raises(ApiError, match="NOT_JSON"):
                await c.queues()

    asyncio.run(main())


def test_nan_and_the_infinities_are_refused_before_anything_is_sent(server: _Server) -> None:
    """orjson writes NaN and the infinities as ``null``: a payload ``{"x": nan}`` was
    stored as ``{"x": null}`` and ``attempt_timeout=inf`` gave a task no timeout, without
    a word. Both clients refuse them with ValueError and send nothing; a real ``null``
    beside finite numbers is sent as it is."""
    import asyncio

    from orbit.client import AsyncClient

    odd = [
        {"payload": {"x": float("nan")}},
        {"payload": [1, None, {"deep": [float("inf")]}]},
        {"attempt_timeout": float("-inf")},
        {"tasks": [{"payload": None}, {"payload": (0.5, float("nan"))}]},
    ]
    with Client(_url(server), token="t0ken") as c:
        for body in odd:
            with pytest.raises(ValueError, match="NaN or an infinity"):
                c._call(("POST", "/v1/tasks", None, body))
        c._call(("POST", "/v1/tasks", None, {"payload": {"x": None, "y": 1.5}}))

    async def refused(body: dict[str, Any]) -> None:
        async with AsyncClient(_url(server), token="t0ken") as c:
            with pytest.raises(ValueError, match="NaN or an infinity"):
                await c._call(("POST", "/v1/tasks", None, body))

    for body in odd:
        asyncio.run(refused(body))
    assert [s["body"] for s in server.seen] == [b'{"payload":{"x":null,"y":1.5}}']


def test_nan_inside_a_dataclass_or_an_enum_is_refused_too(server: _Server) -> None:
    """orjson writes a dataclass instance (and an enum member's value) natively, so a
    payload may be one: its NaN went out as ``null`` while a dict's was refused, since
    only dicts, lists and tuples were looked into."""
    import dataclasses
    import enum

    from orbit.client import AsyncClient

    @dataclasses.dataclass
    class Point:
        x: float
        tags: list[float]

    class Level(enum.Enum):
        UNKNOWN = float("nan")

    odd = [
        {"payload": Point(float("nan"), [])},
        {"payload": [Point(1.0, [2.0, float("inf")])]},
        {"payload": {"level": Level.UNKNOWN}},
    ]
    with Client(_url(server), token="t0ken") as c:
        for body in odd:
            with pytest.raises(ValueError, match="NaN or an infinity"):
                c._call(("POST", "/v1/tasks", None, body))
        c._call(("POST", "/v1/tasks", None, {"payload": Point(0.5, [1.0]), "p": None}))

    async def refused(body: dict[str, Any]) -> None:
        async with AsyncClient(_url(server), token="t0ken") as c:
            with pytest.raises(ValueError, match="NaN or an infinity"):
                await c._call(("POST", "/v1/tasks", None, body))

    for body in odd:
        asyncio.run(refused(body))
    assert [s["body"] for s in server.seen] == [b'{"payload":{"x":0.5,"tags":[1.0]},"p":null}']


def _first_item_raises(url: str, follow: str) -> list[Any]:
    """The ApiError that the first item of a follow (``stream_events`` or ``subscribe``)
    raises at ``url``: from ``Client`` (the whole log's stream), then from
    ``AsyncClient`` (task t1's), each iterator closed after."""
    from orbit.client import ApiError, AsyncClient

    raised: list[Any] = []
    with Client(url, token="t0ken") as c:
        with pytest.raises(ApiError) as caught:
            next(getattr(c, follow)(outage=5))
        raised.append(caught.value)

    async def main() -> None:
        async with AsyncClient(url, token="t0ken") as c:
            stream = getattr(c, follow)("t1", outage=5)
            try:
                with pytest.raises(ApiError) as caught:
                    await anext(stream)
            finally:
                await stream.aclose()
            raised.append(caught.value)

    asyncio.run(main())
    return raised


def test_a_200_that_is_no_event_stream_is_an_api_error_at_once(server: _Server) -> None:
    """A URL that answers 200 with something other than an event stream (a proxy's HTML
    page, some other server): ``stream_events`` took each such answer for a stream that
    broke, and tried again until ``outage`` ran out, then raised Unreachable. Both
    clients now raise NOT_EVENT_STREAM after the one request, naming the type received
    (never the token)."""
    for error in _first_item_raises(_url(server, "/html"), "stream_events"):
        assert (error.status, error.code) == (200, "NOT_EVENT_STREAM")
        assert "text/html" in str(error) and "t0ken" not in str(error)
    assert len(server.seen) == 2  # one request each: not tried again


def test_a_200_labelled_an_event_stream_that_holds_no_sse_is_an_api_error_at_once(
    server: _Server,
) -> None:
    """A URL that answers 200 ``text/event-stream`` with a body that is no Server-Sent
    Events (a page, plain text): ``stream_events`` took each such answer for a stream
    that broke, and tried again until ``outage`` ran out, then raised Unreachable. Both
    clients now raise NOT_EVENT_STREAM after the one request, quoting nothing of the
    body (some other server's, which may echo the request and its token)."""
    for error in _first_item_raises(_url(server, "/fake-sse"), "stream_events"):
        assert (error.status, error.code) == (200, "NOT_EVENT_STREAM")
        assert "no Server-Sent Events" in str(error)
        assert "DOCTYPE" not in str(error) and "t0ken" not in str(error)
    assert len(server.seen) == 2  # one request each: not tried again


def test_event_data_that_is_no_json_object_is_an_api_error_at_once(server: _Server) -> None:
    """An event stream whose event ``data`` is no JSON object (a proxy's injected
    message, another server's stream) raised a bare JSONDecodeError (or TypeError, for a
    list) out of ``stream_events``, where ``subscribe`` raised NOT_EVENT_STREAM for the
    same content in a frame. Both clients now raise that, after the one request, quoting
    nothing of the data."""
    for error in _first_item_raises(_url(server, "/text-data"), "stream_events"):
        assert (error.status, error.code) == (200, "NOT_EVENT_STREAM")
        assert "not a JSON object" in str(error) and "hello" not in str(error)
    assert len(server.seen) == 2  # one request each: not tried again


def test_an_upgrade_redirected_to_a_page_is_a_redirect_error_at_once(server: _Server) -> None:
    """A proxy in front that answers the event stream's upgrade with a redirect to an
    ``https://`` page (a login, the same server under TLS): websockets follows only a
    ``ws(s)://`` one, and raised its own ``InvalidURI`` out of ``subscribe``, no
    ``ApiError``. It is the REDIRECT an HTTP call meets there, naming where, raised
    after the one request, the token sent nowhere else."""
    paths = ["/v1/events/ws", "/v1/tasks/t1/events/ws"]
    errors = _first_item_raises(_url(server, "/moved"), "subscribe")
    for error, path in zip(errors, paths, strict=True):
        assert (error.status, error.code) == (308, "REDIRECT")
        assert f"redirects to https://orbit.example{path}" in str(error)
    assert [seen["path"] for seen in server.seen] == ["/moved" + p for p in paths]


def test_a_lock_an_interrupt_left_held_does_not_hang_the_close_that_follows() -> None:
    """Ctrl-C can land just after ``with self._lock`` acquired the transport's lock and
    before its block began (CPython checks for signals between the two), leaving the lock
    held by the interrupted thread, which then closes the client on its way out
    (``with Client(...) as c``; ``orbit task wait`` hung after Ctrl-C under load). The
    thread below takes the lock as such an interrupt leaves it, then closes."""
    transport = Transport("http://127.0.0.1:1", {}, cafile=None, timeout=1.0)
    ended = threading.Event()

    def interrupted_then_closes() -> None:
        transport._lock.acquire()  # what the interrupted ``with`` left behind
        transport.close()
        ended.set()

    threading.Thread(target=interrupted_then_closes, daemon=True).start()
    assert ended.wait(30), "close waited for a lock its own thread held"
    assert transport.closed
