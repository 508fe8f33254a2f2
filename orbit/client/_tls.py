"""TLS for the synchronous WebSocket client (``Client.subscribe``), entered by one thread
at a time.

websockets' synchronous connection reads in a thread of its own while the caller's
thread writes: the upgrade's request, pings, the close. Over an ``ssl.SSLSocket`` that is
two threads in one OpenSSL session at once, which OpenSSL does not allow: a write that
races a read can lose or corrupt a record, so an upgrade's request may never reach the
server. And the reading thread blocks inside ``SSL_read`` once a TLS 1.3 session ticket
arrives without application data, where closing the socket does not wake it: an upgrade
that timed out then hung its caller for ever, joining that thread (a CI run's
``test_task_life_over_verified_tls`` waited out pytest's 300 s).

Here the session is an ``ssl.SSLObject`` over memory buffers. Only its calls hold the
session's lock, never a wait on the network; the bytes it writes go out in the order it
wrote them (under the sending lock); a read waits in the socket's own ``recv``, which
``close`` wakes by shutting the socket down first.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class ProxyNotSupported(ssl.SSLError):
    """``wss://`` through an ``https://`` proxy, which ``ThreadSafeTLS`` refuses: a
    client set up wrong, which no waiting mends, so a follow raises it at once
    (``orbit.client._http.server_down``)."""


class ThreadSafeTLS:
    """What websockets' synchronous ``connect`` is given as its ``ssl`` context: it only
    calls ``wrap_socket``, which here makes a ``ThreadSafeTLSSocket``.

    ``context`` is made to refuse TLS 1.2 renegotiation: a write that meets one would
    have to wait for a read (``SSLWantReadError``), which only the reading thread does.
    """

    def __init__(self, context: ssl.SSLContext) -> None:
        context.options |= ssl.OP_NO_RENEGOTIATION
        self.context = context

    def wrap_socket(
        self, sock: socket.socket, server_hostname: str | None = None
    ) -> ThreadSafeTLSSocket:
        if isinstance(sock, ssl.SSLSocket):
            # websockets' own TLS to an https:// proxy, under this one: its reads and
            # writes would again enter one session from two threads at once
            raise ProxyNotSupported(
                "wss:// through an https:// proxy is not supported by Client.subscribe "
                "(an http:// proxy is)"
            )
        return ThreadSafeTLSSocket(sock, self.context, server_hostname)


class ThreadSafeTLSSocket:
    """A TLS client connection over ``sock`` with the socket methods websockets' sync
    connection calls (``recv``, ``sendall``, ``settimeout``, ``shutdown``, ``close``,
    ``fileno``, ``getsockname``, ``getpeername``), safe to read in one thread while
    others write. The handshake runs in the constructor, under ``sock``'s timeout."""

    #: what one ``recv`` of the socket asks for: a TLS record is at most 16 KiB
    recv_bufsize = 65536

    def __init__(
        self, sock: socket.socket, context: ssl.SSLContext, server_hostname: str | None
    ) -> None:
        self._sock = sock
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(
            self._incoming, self._outgoing, server_hostname=server_hostname
        )
        self._session = threading.Lock()  # held for SSLObject calls only: no network wait
        self._sending = threading.Lock()  # held from a write to its bytes being sent
        while not self._step(self._handshake):
            self._receive()

    def _handshake(self) -> bool:
        self._tls.do_handshake()
        return True

    def _step(self, call: Callable[[], T]) -> T | None:
        """``call`` on the session; None if it needs more bytes from the peer first.
        Whatever it wrote for the peer (a handshake message, a reply to a key update, the
        alert of a failed handshake, such as a certificate refused) is sent, in order."""
        try:
            with self._session:
                try:
                    result: T | None = call()
                except ssl.SSLWantReadError:
                    result = None
        except ssl.SSLError:
            with contextlib.suppress(OSError):  # the alert is a courtesy to the peer
                self._flush()
            raise
        self._flush()
        return result

    def _flush(self) -> None:
        """Send what the session wrote, unless a writer is sending: then it sends these
        bytes too once it is done (``sendall``), so a reader never waits for a writer
        (one blocked by a peer that reads no more until it is read from)."""
        while self._outgoing.pending:
            if not self._sending.acquire(blocking=False):
                return
            try:
                with self._session:
                    data = self._outgoing.read()
                self._sock.sendall(data)
            finally:
                self._sending.release()

    def _receive(self) -> None:
        """Wait for the peer's next bytes (the socket's timeout applies) and hand them to
        the session; the end of the stream too."""
        data = self._sock.recv(self.recv_bufsize)
        with self._session:
            if data:
                self._incoming.write(data)
            else:
                self._incoming.write_eof()

    def recv(self, bufsize: int) -> bytes:
        """The application data the session has, once it has some (more than ``bufsize``
        if more was decrypted: left in the session, it would wait unseen by websockets'
        ``select`` on the socket); b"" at the end of the stream."""
        while True:
            data = self._step(self._read_all)
            if data is not None:
                return data
            self._receive()

    def _read_all(self) -> bytes:
        """Everything decrypted so far; SSLWantReadError if that is nothing yet."""
        chunks: list[bytes] = []
        while True:
            try:
                chunk = self._tls.read(self.recv_bufsize)
            except ssl.SSLWantReadError:
                if chunks:
                    return b"".join(chunks)
                raise
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                chunk = b""  # closed, with a close_notify or without (a ragged end)
            if not chunk:  # the end of the stream
                if chunks:
                    self._end_reads()
                return b"".join(chunks)
            chunks.append(chunk)

    def _end_reads(self) -> None:
        """The peer closed in the read that brought the last bytes: the end is in the
        session, where websockets' ``select`` on the socket cannot see it while the peer
        keeps TCP open, so the socket's read side is shut down to wake that ``select``;
        the next ``recv`` then returns b"" from the session. Nothing more can come."""
        with contextlib.suppress(OSError):  # closed by now
            self._sock.shutdown(socket.SHUT_RD)

    def sendall(self, data: bytes) -> None:
        with self._sending:
            with self._session:
                view = memoryview(data)
                while view:
                    view = view[self._tls.write(view) :]
                encrypted = self._outgoing.read()
            self._sock.sendall(encrypted)
        self._flush()  # what a reader left while this was sending

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        """Closed, and a thread waiting in ``recv`` woken (closing alone does not wake
        it on Linux): the socket is shut down first."""
        with contextlib.suppress(OSError):  # not connected any more, or closed already
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def fileno(self) -> int:
        return self._sock.fileno()

    def getsockname(self) -> object:
        return self._sock.getsockname()

    def getpeername(self) -> object:
        return self._sock.getpeername()
