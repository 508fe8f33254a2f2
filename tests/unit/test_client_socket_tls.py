"""``Client.subscribe`` over ``wss://`` reads in one thread and writes in another, so its
TLS session is entered by one thread at a time (``orbit.client._tls``), against real TLS
servers on loopback ports with a test CA (``trustme``).

Over a plain ``ssl.SSLSocket`` the reading thread blocked inside ``SSL_read`` once the
server's TLS 1.3 session tickets came without application data; an upgrade the server
never answered then hung its caller for ever (joining that thread) instead of failing
after the client's timeout, as a CI run's ``test_task_life_over_verified_tls`` did."""

from __future__ import annotations

import contextlib
import random
import select
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trustme

from orbit.client import Client, Unreachable
from orbit.client._http import server_down
from orbit.client._tls import ProxyNotSupported, ThreadSafeTLS, ThreadSafeTLSSocket

TOKEN = "orbit_" + "0" * 32 + "_" + "s" * 43


@dataclass
class TLSServer:
    """A TLS server on a loopback port that runs ``serve`` on each connection, in a
    thread, after the handshake (which sends TLS 1.3's session tickets)."""

    serve: Callable[[ssl.SSLSocket], None]
    ca: trustme.CA = field(default_factory=trustme.CA)
    listener: socket.socket = field(default_factory=lambda: socket.create_server(("127.0.0.1", 0)))
    connections: list[ssl.SSLSocket] = field(default_factory=list)
    #: why each handshake that failed did (what the client's alert said, if it sent one)
    refusals: list[str] = field(default_factory=list)
    refused: threading.Event = field(default_factory=threading.Event)
    #: set once ``serve`` has returned for a connection
    served: threading.Event = field(default_factory=threading.Event)

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def start(self) -> None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert("127.0.0.1").configure_cert(context)
        threading.Thread(target=self._accept, args=(context,), daemon=True).start()

    def _accept(self, context: ssl.SSLContext) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # shut down: the test is over
                return
            try:
                tls = context.wrap_socket(conn, server_side=True)
            except OSError as exc:  # a client that refused the certificate
                self.refusals.append(str(exc))
                self.refused.set()
                conn.close()
                continue
            self.connections.append(tls)
            threading.Thread(target=self._serve, args=(tls,), daemon=True).start()

    def _serve(self, conn: ssl.SSLSocket) -> None:
        self.serve(conn)
        self.served.set()

    def stop(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.listener.close()
        for conn in self.connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def cafile(self, tmp_path: Path) -> str:
        """The test CA's certificate as a file, for a client's ``cafile``."""
        cafile = tmp_path / "ca.pem"
        self.ca.cert_pem.write_to_path(str(cafile))
        return str(cafile)

    def client_context(self, tmp_path: Path) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.cafile(tmp_path))


def _silent(conn: ssl.SSLSocket) -> None:
    """Reads what the client sends (an upgrade's request) and never answers."""
    with contextlib.suppress(OSError):
        while conn.recv(65536):
            pass


def _echo(conn: ssl.SSLSocket) -> None:
    with contextlib.suppress(OSError):
        while data := conn.recv(65536):
            conn.sendall(data)


def _says_bye(conn: ssl.SSLSocket) -> None:
    """Sends a few bytes, then closes with a close_notify."""
    conn.sendall(b"bye")
    with contextlib.suppress(OSError):
        conn.unwrap().close()


def _says_bye_and_stays(conn: ssl.SSLSocket) -> None:
    """Sends a few bytes and a close_notify, then keeps the TCP connection open (as a
    proxy may), so only the close_notify says the stream has ended."""
    conn.sendall(b"bye")
    conn.setblocking(False)  # sends the close_notify without waiting for the client's
    with contextlib.suppress(ssl.SSLWantReadError):
        conn.unwrap()


def _server(serve: Callable[[ssl.SSLSocket], None]) -> Iterator[TLSServer]:
    server = TLSServer(serve)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def silent() -> Iterator[TLSServer]:
    yield from _server(_silent)


@pytest.fixture
def echo() -> Iterator[TLSServer]:
    yield from _server(_echo)


@pytest.fixture
def says_bye() -> Iterator[TLSServer]:
    yield from _server(_says_bye)


@pytest.fixture
def says_bye_and_stays() -> Iterator[TLSServer]:
    yield from _server(_says_bye_and_stays)


def _connect(server: TLSServer, tmp_path: Path) -> ThreadSafeTLSSocket:
    """A client connection to ``server``; its reads wait 10 s at most (a test that hangs
    fails in 10 s, not at pytest's timeout)."""
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return ThreadSafeTLS(server.client_context(tmp_path)).wrap_socket(raw, "127.0.0.1")


def test_an_upgrade_never_answered_over_tls_fails_after_the_timeout(
    silent: TLSServer, tmp_path: Path
) -> None:
    cafile = silent.cafile(tmp_path)
    raised: list[BaseException] = []

    def follow() -> None:
        with Client(f"https://127.0.0.1:{silent.port}", TOKEN, cafile=cafile, timeout=1) as c:
            try:
                next(c.subscribe(outage=0))
            except BaseException as exc:
                raised.append(exc)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    thread.join(30)  # the client's timeout is 1 s
    assert not thread.is_alive(), "subscribe still waits, 30 s after its 1 s timeout"
    [exc] = raised
    assert isinstance(exc, Unreachable), exc
    assert f"no answer from 127.0.0.1:{silent.port} within 1.0 s" in str(exc)
    assert TOKEN not in str(exc)


def test_close_wakes_a_thread_waiting_in_recv(silent: TLSServer, tmp_path: Path) -> None:
    tls = _connect(silent, tmp_path)
    tls.settimeout(None)  # as websockets does once the handshake is over
    got: list[bytes | BaseException] = []

    def read() -> None:
        try:
            got.append(tls.recv(1024))
        except OSError as exc:
            got.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    tls.sendall(b"GET / HTTP/1.1\r\n\r\n")  # answered by nothing: recv waits
    reader.join(0.5)
    assert reader.is_alive() and not got
    tls.close()
    reader.join(10)
    assert not reader.is_alive(), "recv still waits after close"
    assert got == [b""] or isinstance(got[0], OSError), got


def test_writes_while_another_thread_reads_keep_the_session_whole(
    echo: TLSServer, tmp_path: Path
) -> None:
    """Writes of many sizes (some across several TLS records) from one thread while
    another reads the echo: every byte comes back, in order."""
    tls = _connect(echo, tmp_path)
    rng = random.Random(6)
    sent = [rng.randbytes(rng.choice([1, 7, 1500, 16_384, 40_000])) for _ in range(300)]
    total = sum(map(len, sent))

    def write() -> None:
        for chunk in sent:
            tls.sendall(chunk)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    received = bytearray()
    while len(received) < total:
        data = tls.recv(65536)
        assert data, "the echo ended early"
        received += data
    writer.join(10)
    assert bytes(received) == b"".join(sent)
    tls.close()


def test_the_peers_close_is_the_end_of_the_stream(says_bye: TLSServer, tmp_path: Path) -> None:
    tls = _connect(says_bye, tmp_path)
    received = b""
    while data := tls.recv(1024):
        received += data
    assert received == b"bye"
    assert tls.recv(1024) == b""
    tls.close()


def test_a_close_that_came_with_the_last_bytes_wakes_the_next_select(
    says_bye_and_stays: TLSServer, tmp_path: Path
) -> None:
    """websockets' reader waits in ``select`` on the socket before each ``recv``. When the
    last bytes and the close_notify arrive in one read, the close is in the session, not
    on the socket: the socket must still wake the next ``select`` (the peer keeps TCP
    open), or the reader sees the end only when its close timeout runs out."""
    tls = _connect(says_bye_and_stays, tmp_path)
    assert says_bye_and_stays.served.wait(10)  # the bytes and the close_notify are sent
    assert tls.recv(1024) == b"bye"  # the bytes and the close, read together
    readable, _, _ = select.select([tls], [], [], 5)
    assert readable == [tls], "the end of the stream did not wake select"
    assert tls.recv(1024) == b""
    tls.close()


def test_a_certificate_not_trusted_is_refused_in_the_handshake(
    silent: TLSServer, tmp_path: Path
) -> None:
    """Refused with the alert an ``ssl.SSLSocket`` sends, so the server's log says why
    (it read an end of stream before)."""
    other = ssl.create_default_context()  # the system's CAs: not the test CA
    with (
        socket.create_connection(("127.0.0.1", silent.port), timeout=10) as raw,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        ThreadSafeTLS(other).wrap_socket(raw, "127.0.0.1")
    assert silent.refused.wait(10)  # the server's thread records it as its handshake ends
    [refusal] = silent.refusals
    assert "ALERT_UNKNOWN_CA" in refusal or "unknown ca" in refusal, refusal


def test_tls_through_an_https_proxy_is_refused_clearly(silent: TLSServer, tmp_path: Path) -> None:
    """websockets wraps its own TLS connection to an ``https://`` proxy: this TLS over it
    would enter that session from two threads again, so it is refused with a reason."""
    context = silent.client_context(tmp_path)
    with (
        socket.create_connection(("127.0.0.1", silent.port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as to_proxy,
        pytest.raises(ProxyNotSupported, match=r"https:// proxy is not supported") as caught,
    ):
        ThreadSafeTLS(context).wrap_socket(to_proxy, "127.0.0.1")
    # a setup error, raised by a follow at once, not waited out as an outage
    unreachable = Unreachable("127.0.0.1: ProxyNotSupported")
    unreachable.__cause__ = caught.value
    assert not server_down(unreachable)


def test_renegotiation_is_refused() -> None:
    """A TLS 1.2 renegotiation would make a write wait for a read."""
    tls = ThreadSafeTLS(ssl.create_default_context())
    assert tls.context.options & ssl.OP_NO_RENEGOTIATION
