"""The sync client's HTTP/1.1 transport: the standard library's ``http.client`` over a
small pool of keep-alive connections.

httpx, which this replaced for ``Client``, spent 0.7-1 ms of CPU on a one-task submit
(request and response models, header validation, two ``send`` calls for the headers and
the body) against 0.25 ms here, and that time sat in every submit's path to a worker's
start (``docs/benchmarks/history.md``). ``AsyncClient`` still uses httpx.

A connection is reused only when it is idle and open: before a request, a readable
socket means the server closed it (or sent what no request asked for), and it is
replaced; one idle for ``KEEPALIVE_EXPIRY`` or longer is closed unused, before a server's
idle timeout can close it just as a request goes out on it. A request that fails once
sent is not retried, since the server may have acted on it; the caller sees
:class:`Unreachable`, as for a server that is down. The one exception,
:func:`sent_again`, is the rule of both clients: a GET on a reused connection that the
server closed as the request went out (its idle timeout met the request on the wire):
not a byte of an answer came, a GET changes nothing, and it is sent once more on a fresh
connection.
"""

from __future__ import annotations

import http.client
import io
import os
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any
from urllib.parse import SplitResult, quote, urlencode

import httpcore
import httpx

from orbit.client._errors import ApiError, Unavailable
from orbit.client._tls import ProxyNotSupported
from orbit.core.errors import DATABASE_CODES
from orbit.urls import check_server_url

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

#: Bytes read at a time from a streamed body.
STREAM_CHUNK = 64 * 1024
#: Seconds a kept-alive connection may sit idle in either client's pool before it is
#: closed rather than reused: under uvicorn's default idle timeout (5 s), which closed a
#: connection idle that long just as a request went out on it (a POST, never sent again,
#: then raised Unreachable from a healthy server). Orbit's server waits far longer
#: (``orbit.cli.listening.KEEP_ALIVE``); this covers a server or proxy that does not.
KEEPALIVE_EXPIRY = 4.0
#: The longest ``timeout`` a request may be given (about 31 years): a socket holds its
#: timeout in nanoseconds in 64 bits, and a lock's wait (websockets' ``recv``) takes at
#: most ``threading.TIMEOUT_MAX``; a larger one raised OverflowError at the first call.
MAX_TIMEOUT = min(1e9, threading.TIMEOUT_MAX)


class Unreachable(ConnectionError):
    """The server could not be reached, or the connection failed mid-request (the
    cause is chained). Whether a request that failed this way took effect is unknown:
    resubmit with an idempotency key to be sure."""


class Reply:
    """A whole response: its status, its body, where it redirects (its Location), and
    when to try again (its Retry-After, on a 429 or a 503)."""

    __slots__ = ("content", "location", "retry_after", "status_code")

    def __init__(
        self,
        status_code: int,
        content: bytes,
        location: str | None = None,
        retry_after: str | None = None,
    ) -> None:
        self.status_code = status_code
        self.content = content
        self.location = location
        self.retry_after = retry_after


class Opened(tuple[int, str | None, str | None, Iterator[bytes]]):
    """What ``Transport.stream`` yields: its status, Location, Content-Type and body's
    chunks, and besides them its ``retry_after`` (its Retry-After), which a follow's
    refusal carries as a call's does: a stream's 503 dropped it."""

    retry_after: str | None = None


class Transport:
    """Requests to one server (``base_url``: scheme, host, port and an optional path
    prefix), safe to share between threads: each request holds a connection of its own
    from the pool while it runs."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str],
        *,
        cafile: str | None,
        timeout: float,
    ) -> None:
        parts = check_server_url(base_url)
        self._https = parts.scheme == "https"
        self._host: str = parts.hostname or ""  # never empty: check_server_url saw to it
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self._where = where(parts)
        self._headers = headers
        self._timeout = timeout
        self._tls = ssl.create_default_context(cafile=cafile) if self._https else None
        self._idle: list[_Connection] = []
        #: when each idle connection went back to the pool (``time.monotonic``)
        self._idle_since: dict[_Connection, float] = {}
        #: the sockets of the streams being read (``held``), which ``close`` shuts down
        self._held: set[socket.socket] = set()
        #: each connection's socket, as it connected: a response that says
        #: ``Connection: close`` takes it from the connection (``conn.sock`` is None then)
        self._sock_of: weakref.WeakKeyDictionary[_Connection, socket.socket] = (
            weakref.WeakKeyDictionary()
        )
        # Reentrant: Ctrl-C (KeyboardInterrupt) may land just after a ``with self._lock``
        # acquired it and before its block began, leaving it held by the interrupted
        # thread, which then closes the client on its way out (``with Client() as c``, the
        # CLI): with a plain Lock that close waited for itself for ever.
        self._lock = threading.RLock()
        self._closed = False
        self._pid = os.getpid()  # the process whose connections the pool holds

    def request(
        self,
        method: str,
        path: str,
        query: dict[str, Any] | None,
        body: bytes | None,
        timeout: float | None = None,
    ) -> Reply:
        """``timeout``: this request's, in place of the transport's (None): the whole
        request, from the connect to the body's last byte, not each read of the socket
        (``_Response``)."""
        timeout = self._timeout if timeout is None else checked_timeout(timeout)
        deadline = time.monotonic() + timeout
        conn, response = self._open(method, path, query, body, timeout, deadline)
        with self._closed_on_error(conn, timeout):
            content = response.read()
        self._done(conn, response)
        return Reply(
            response.status,
            content,
            response.getheader("Location"),
            response.getheader("Retry-After"),
        )

    @contextmanager
    def stream(
        self,
        method: str,
        path: str,
        headers: dict[str, str] | None = None,
        *,
        live: bool = False,
    ) -> Iterator[Opened]:
        """The status, the Location, the Content-Type, and the body's chunks as they arrive,
        each read waiting at most the transport's timeout (``Opened``, with its Retry-After
        besides); a body not read to its end closes the connection rather than go back to
        the pool. ``headers``: sent besides the transport's. ``live``: a read returns what
        has come (``read1``) rather than wait for a whole chunk: an event stream's messages
        are small and come one by one. ``close``, from any thread, ends the read of a stream
        in progress (``held``). Its open, up to the end of the answer's head, is a request
        given the transport's timeout as a whole, as ``request`` is: only its body, which a
        follow reads for as long as it goes on, waits per read."""
        deadline = time.monotonic() + self._timeout
        conn, response = self._open(method, path, None, None, self._timeout, deadline, headers)
        try:
            sock = conn.sock or self._sock_of.get(conn)  # the response's, if it took it
            conn.deadline = None  # each read of the body waits the socket's timeout
            if sock is not None:
                sock.settimeout(self._timeout)
            with self.held(sock):
                opened = Opened(
                    (
                        response.status,
                        response.getheader("Location"),
                        response.getheader("Content-Type"),
                        self._chunks(response, live),
                    )
                )
                opened.retry_after = response.getheader("Retry-After")
                yield opened
        finally:
            self._done(conn, response)

    @property
    def closed(self) -> bool:
        """Whether ``close`` has been called: a stream that broke then is not reopened."""
        return self._closed

    @contextmanager
    def held(self, sock: socket.socket | None) -> Iterator[None]:
        """``sock`` (a stream's: an event stream's or a WebSocket's) shut down by
        ``close`` if the block still runs then, so that a read waiting on it in another
        thread ends at once: the whole log's stream never ends by itself, and a follow
        went on reading from a client that was closed. RuntimeError if the transport is
        closed already."""
        self._hold(sock)
        try:
            yield
        finally:
            self._release(sock)

    def _hold(self, sock: socket.socket | None) -> None:
        """``sock`` shut down by ``close`` until ``_release``: ``held``, without a
        context manager's cost in every request's path (``_closed_on_error``)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the client is closed")
            if sock is not None:
                self._held.add(sock)

    def _release(self, sock: socket.socket | None) -> None:
        if sock is not None:
            with self._lock:
                self._held.discard(sock)

    def close(self) -> None:
        """Close the idle connections, and shut down the streams being read and the
        requests waiting for their answer (``held``): each ends with RuntimeError, "the
        client is closed"."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._idle_since.clear()
            held, self._held = self._held, set()
        for conn in idle:
            conn.close()
        for sock in held:
            with suppress(OSError):  # closed by its reader meanwhile
                sock.shutdown(socket.SHUT_RDWR)

    def _open(
        self,
        method: str,
        path: str,
        query: dict[str, Any] | None,
        body: bytes | None,
        timeout: float,
        deadline: float,
        extra: dict[str, str] | None = None,
    ) -> tuple[_Connection, http.client.HTTPResponse]:
        """The request sent and its answer's head read, all by ``deadline``
        (``time.monotonic``), the one sent once more too (``sent_again``)."""
        target = self._prefix + path + ("?" + urlencode(query) if query else "")
        headers = self._headers if body is None else {**self._headers, **_JSON}
        if extra:
            headers = {**headers, **extra}
        conn, reused = self._take(timeout, deadline)
        try:
            with self._closed_on_error(conn, timeout):
                conn.answer_by(deadline)
                # one send for the headers and a bytes body (http.client joins them)
                conn.request(method, target, body=body, headers=headers)
                return conn, conn.getresponse()
        except Unreachable as exc:
            if not sent_again(method, reused, exc):
                raise
        conn = self._connect(timeout, deadline)
        with self._closed_on_error(conn, timeout):
            conn.answer_by(deadline)
            conn.request(method, target, body=body, headers=headers)
            return conn, conn.getresponse()

    @contextmanager
    def _closed_on_error(self, conn: _Connection, timeout: float) -> Iterator[None]:
        """Any error closes ``conn`` (its state is unknown); a transport error is raised
        as ``Unreachable`` (``timeout``: what the request was given, as it says), or as
        RuntimeError, "the client is closed", once ``close`` has been called. The block
        holds ``conn``'s socket (``held``): ``close`` from another thread ends a request
        waiting for its answer at once, as it ends a stream's read; a ``wait`` on a server
        that did not answer went on for the client's whole timeout after the close."""
        sock = self._sock_of.get(conn)
        try:
            self._hold(sock)
            try:
                yield
            finally:
                self._release(sock)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise self._broken(exc, timeout) from exc
        except BaseException:
            conn.close()
            raise

    def _chunks(self, response: http.client.HTTPResponse, live: bool) -> Iterator[bytes]:
        read = response.read1 if live else response.read
        while True:
            try:
                chunk = read(STREAM_CHUNK)
            except (OSError, http.client.HTTPException) as exc:
                raise self._broken(exc, self._timeout) from exc
            if not chunk:
                # http.client's read(n) answers b"" when the connection closes before the
                # Content-Length is reached (``length`` is what is still owed): a body cut
                # off, never a whole one.
                if response.length:
                    raise self._broken(
                        http.client.IncompleteRead(b"", response.length), self._timeout
                    )
                return
            yield chunk

    def _broken(self, exc: BaseException, timeout: float) -> Exception:
        """What a request's or a stream's failed read raises: RuntimeError if ``close``
        shut it down (the client is closed, not the server out of reach), Unreachable
        otherwise (``timeout``: what the request was given)."""
        if self._closed:
            return RuntimeError("the client is closed")
        return self._unreachable(exc, timeout)

    def _done(self, conn: _Connection, response: http.client.HTTPResponse) -> None:
        """Back to the pool if the server keeps it open and the body was read out."""
        if response.will_close or not response.isclosed() or conn.sock is None:
            conn.close()
            return
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                self._idle_since[conn] = time.monotonic()
                return
        conn.close()

    def _unreachable(self, exc: BaseException, timeout: float) -> Unreachable:
        return unreachable(self._where, timeout, exc, timed_out=isinstance(exc, TimeoutError))

    def _take(self, timeout: float, deadline: float) -> tuple[_Connection, bool]:
        """A connection for a request given ``timeout``, due by ``deadline`` (a kept-alive
        one keeps the timeout of its last request until told: ``answer_by``), and whether
        it is a kept-alive one (it served a request)."""
        if self._pid != os.getpid():
            self._forget_the_parents()
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the client is closed")
                conn = self._idle.pop() if self._idle else None
                since = self._idle_since.pop(conn, 0.0) if conn is not None else 0.0
            if conn is None:
                return self._connect(timeout, deadline), False
            fresh = time.monotonic() - since < KEEPALIVE_EXPIRY
            if fresh and _still_open(conn) and conn.sock is not None:
                return conn, True
            conn.close()

    def _forget_the_parents(self) -> None:
        """In the child of a fork (a client made before gunicorn's --preload forks, or a
        prefork pool's), the idle connections are the parent's too: the child took them,
        and two processes on one connection read each other's answers. The child closes
        its copies (the parent's sockets stay open) and starts a pool of its own, with a
        lock of its own (the parent's may have been held by a thread the child has not)."""
        idle, self._idle = self._idle, []
        self._idle_since = {}
        self._held = set()  # the parent's streams, read by its threads
        self._lock = threading.RLock()
        self._pid = os.getpid()
        for conn in idle:
            conn.close()

    def _connect(self, timeout: float, deadline: float) -> _Connection:
        """A fresh connection, made in the time left before ``deadline`` (``timeout``:
        what the request was given, as its error says)."""
        conn: _Connection
        if self._tls is not None:
            conn = _TLSConnection(self._host, self._port, timeout=timeout, context=self._tls)
        else:
            conn = _Connection(self._host, self._port, timeout=timeout)
        with self._closed_on_error(conn, timeout):
            conn.timeout = _left(deadline)
            conn.connect()  # which sets TCP_NODELAY
        if conn.sock is not None:
            self._sock_of[conn] = conn.sock
        return conn


def checked_timeout(timeout: object) -> float:
    """``timeout`` if a request can be given it: a positive, finite number of seconds, at
    most ``MAX_TIMEOUT``; ValueError if not, before anything is sent. Taken as it was, 0
    failed the sync client's connect (BlockingIOError, raised as Unreachable from a
    server that was well) and timed out every async call at once; a negative one, NaN,
    infinity or one past ``MAX_TIMEOUT`` (``sys.maxsize``, "for ever") raised ValueError,
    OverflowError or Unreachable at the first call."""
    if (
        isinstance(timeout, int | float)
        and not isinstance(timeout, bool)  # True is no number of seconds
        and 0 < timeout <= MAX_TIMEOUT
    ):
        return float(timeout)
    raise ValueError(
        f"timeout must be a positive, finite number of seconds, at most {MAX_TIMEOUT:g}, "
        f"not {timeout!r}"
    )


class Where(str):
    """``host:port`` of a checked server URL, as errors name it, knowing whether the URL
    was plain ``http://`` (for ``unreachable``'s hint)."""

    plain: bool

    def __new__(cls, text: str, *, plain: bool) -> Where:
        made = super().__new__(cls, text)
        made.plain = plain
        return made


def where(parts: SplitResult) -> Where:
    """``host:port`` of a checked server URL, as errors name it."""
    https = parts.scheme in ("https", "wss")
    return Where(f"{parts.hostname}:{parts.port or (443 if https else 80)}", plain=not https)


#: What a plain request to a TLS port meets (the server reads no HTTP and hangs up), said
#: after the cause: "RemoteDisconnected" alone sent users looking for a crashed server.
_TLS_HINT = " (if the server serves TLS, its URL is https://)"


def unreachable(where: str, timeout: float, exc: BaseException, *, timed_out: bool) -> Unreachable:
    """The error both clients raise for a transport failure: which server, and what
    happened (or how long it was waited for)."""
    if timed_out:
        return Unreachable(f"no answer from {where} within {timeout} s")
    said = f"{where}: {type(exc).__name__}: {exc}"[:300]
    if getattr(where, "plain", False) and _closed_unanswered(exc):
        said += _TLS_HINT
    return Unreachable(said)


def sent_again(method: str, reused: bool, exc: BaseException) -> bool:
    """Whether a request that failed with ``exc`` before any of its answer was read is
    sent once more: a GET (or HEAD) on a kept-alive connection (``reused``) that the
    server closed just as the request went out on it (its idle timeout, a restart). The
    request met the close, and no answer had begun: the caller got Unreachable from a
    server that was up and well. A POST never is (the server may have acted on it), nor a
    request on a fresh connection, nor any other failure (a timeout, a refusal). The rule
    of both clients: ``Transport`` here, ``AsyncClient`` over httpx."""
    return reused and method in _IDEMPOTENT and _closed_unanswered(exc)


def timed_out(exc: BaseException) -> bool:
    """Whether a call failed for want of an answer in its time (either client's timeout
    in ``exc``'s chain), rather than being refused a connection or cut off."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, TimeoutError | httpx.TimeoutException):
            return True
        seen = seen.__cause__
    return False


def _closed_unanswered(exc: BaseException) -> bool:
    """Whether ``exc``'s cause chain says the connection was found closed before any
    byte of the answer: http.client's RemoteDisconnected (the status line's read found
    it closed), a reset or a broken pipe (the send met the close), or httpcore's own
    "Server disconnected without sending a response" (raised where the answer's head was
    awaited, without a cause; one from h11's reading of bytes that came has h11's)."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, _CLOSED_UNANSWERED):
            return True
        if isinstance(seen, httpcore.RemoteProtocolError) and seen.__cause__ is None:
            return True
        seen = seen.__cause__
    return False


def _left(deadline: float) -> float:
    """Seconds left before ``deadline`` (``time.monotonic``); TimeoutError if none are:
    the request's time has run out (``Unreachable``, "no answer … within …")."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


class _Connection(http.client.HTTPConnection):
    """http.client's connection, its requests each answered by a deadline of their own
    (``answer_by``) rather than within a timeout per read of the socket: a server that
    sent a byte every 0.3 s kept a call with a 2 s timeout waiting for ever."""

    #: when the answer must have come (``time.monotonic``); None: each read of the
    #: socket waits its timeout (a stream's body, read for as long as the follow goes on)
    deadline: float | None = None

    def answer_by(self, deadline: float) -> None:
        """The next request sent, and its answer read (``_Response``), by ``deadline``."""
        self.deadline = deadline
        if self.sock is not None:
            self.sock.settimeout(_left(deadline))

    # http.client makes each answer with ``response_class(sock, ...)``: this one reads
    # its socket by the connection's deadline.
    def response_class(  # type: ignore[override]
        self, sock: socket.socket, *args: Any, **kwargs: Any
    ) -> http.client.HTTPResponse:
        return _Response(sock, self, *args, **kwargs)


class _TLSConnection(http.client.HTTPSConnection, _Connection):
    """The same over TLS."""


class _Response(http.client.HTTPResponse):
    """An answer whose every read of the socket (its head's, its body's) is given the
    time left before its connection's deadline (``_Paced``)."""

    def __init__(self, sock: socket.socket, conn: _Connection, *args: Any, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        # the socket's own reader (``makefile``'s), under a buffer that paces its reads
        self.fp = io.BufferedReader(_Paced(self.fp.detach(), sock, conn))


class _Paced(io.RawIOBase):
    """The reads of an answer from ``sock`` (``raw``: the socket's own reader, which
    keeps the socket open while the answer is read), each given the time left before
    ``conn``'s deadline, or, with none, the socket's timeout."""

    def __init__(self, raw: io.RawIOBase, sock: socket.socket, conn: _Connection) -> None:
        super().__init__()
        self._raw = raw
        self._sock = sock
        self._conn = conn

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int | None:
        if self._conn.deadline is not None:
            self._sock.settimeout(_left(self._conn.deadline))
        return self._raw.readinto(buffer)

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self._raw.close()  # the answer's hold on the socket, which may close it now
        super().close()


#: Idle connections kept per client (one per thread that calls it at once, up to this).
MAX_IDLE = 8

_JSON = {"Content-Type": "application/json"}
#: the methods sent again after a kept-alive connection's close met them
_IDEMPOTENT = frozenset({"GET", "HEAD"})
#: how that close shows, before any byte of the answer (``_closed_unanswered``)
_CLOSED_UNANSWERED = (
    http.client.RemoteDisconnected,
    ConnectionResetError,
    BrokenPipeError,
    ConnectionAbortedError,
)


def _still_open(conn: http.client.HTTPConnection) -> bool:
    """An idle keep-alive connection has nothing to read; if its socket is readable (or
    hung up, or in error), the server closed it (or broke the protocol), and it must not
    carry a request. ``poll``, not ``select``: select takes no descriptor numbered 1024
    or more, and in a process with that many open every connection was taken for closed
    (a new one, and a TLS handshake, for every call). Where there is no poll (Windows),
    select, which takes any socket there."""
    sock = conn.sock
    if sock is None:
        return False
    try:
        if not hasattr(select, "poll"):
            readable, _, _ = select.select([sock], [], [], 0)
            return not readable
        waiter = select.poll()
        waiter.register(sock, select.POLLIN)
        return not waiter.poll(0)
    except (OSError, ValueError):  # a socket already closed (fileno -1)
        return False


#: what a proxy in front answers, with a page of its own, when it cannot reach the server
_GATEWAY_DOWN = frozenset({502, 503, 504})


def server_down(exc: Unreachable | ApiError) -> bool:
    """Whether a call failed because the server could not be reached: directly
    (Unreachable, but for a certificate that fails verification), or through a proxy that
    says so with its own page (502, 503 or 504 that is not Orbit's JSON: ``HTTP_ERROR``).
    Anything else is the server's refusal."""
    if isinstance(exc, Unreachable):
        return not _untrusted(exc)
    return exc.status in _GATEWAY_DOWN and exc.code == "HTTP_ERROR"


def server_failing(exc: Unreachable | ApiError) -> bool:
    """Whether the server answered that it failed for its database's sake, which it asks
    clients to try again, unlike a refusal: its own 500 ``INTERNAL`` (a check that
    failed), or a 503 with a ``DATABASE_CODES`` code (``Unavailable``, with a
    ``Retry-After``). **Changed:** that 503 was taken for a refusal, and a database busy
    for a moment ended every wait and follow that met it."""
    if isinstance(exc, Unavailable):
        return exc.code in DATABASE_CODES
    return isinstance(exc, ApiError) and exc.code == "INTERNAL"


def _untrusted(exc: BaseException) -> bool:
    """Whether TLS failed somewhere in ``exc``'s chain in a way that no waiting mends, a
    client set up wrong: the server's certificate failed verification (its CA, the host
    name), or the server speaks no TLS on that port (WRONG_VERSION_NUMBER: an https://
    URL for a plain HTTP server), or ``Client.subscribe`` was given an ``https://`` proxy
    (``ProxyNotSupported``). Taken for an outage, a ``wait`` said so only when its whole
    timeout had run out."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLCertVerificationError | ProxyNotSupported):
            return True
        if isinstance(seen, ssl.SSLError) and seen.reason == "WRONG_VERSION_NUMBER":
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def path_segment(value: object, name: str) -> str:
    """An id or a name as one path segment, percent-encoded, so that the server reads it
    whole: unencoded, a space made the sync transport refuse the URL (``Unreachable``),
    a non-ASCII letter raised UnicodeEncodeError, and '?' or '#' cut the id short. A
    segment of dots is encoded too, which neither transport then folds into its parent.
    An empty one (an unset variable, an empty form field) is a ValueError naming the
    argument (``name``), nothing sent: sent, ``get("")`` asked for ``/v1/tasks/``, which
    the server redirects to the list, and the caller was told to change the server URL.
    A ``uuid.UUID`` is taken as its text (``submit(parent_id=...)`` takes one so); any
    other type (None, a number) is a TypeError naming the argument, where ``quote`` said
    only "quote_from_bytes() expected bytes"."""
    import uuid  # here, not at the top: only this function of the module needs it

    if isinstance(value, uuid.UUID):
        value = str(value)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {type(value).__name__}")
    if value == "":
        raise ValueError(f"{name} must not be empty")
    part = quote(value, safe="")
    return part.replace(".", "%2E") if part.strip(".") == "" else part
