"""uvicorn's HTTP protocol with a deadline for each request head (``--header-timeout``).

uvicorn starts no timer on a connection until a response has gone (its keep-alive
timeout): a peer that connects and sends nothing, or sends part of a request head and
stops, held its connection, and a file descriptor, for as long as it liked (one was
still open after 136 s). Enough of them, from anyone who can reach the port without a
token, held every descriptor of the node: a worker's hello then failed and clients got
an empty reply or a reset. Here a connection whose request head (request line and
headers; a WebSocket upgrade is an HTTP request too) is not complete within the deadline
is closed: counted from the connection's start for its first request (for TLS, from the
end of the handshake, which the event loop bounds itself at 60 s), and from the head's
first byte for a later one on a kept-alive connection (between requests the keep-alive
timeout applies, and any byte cancels it). The body is not covered: an upload may take
long, and its route reads it. Nor is a head pipelined behind a request still being
answered (uvicorn stops reading while it is): timed from that answer's end, it never cut
the requests in flight (an event stream's, say) with it.

uvicorn runs httptools' parser (``http="auto"`` picks it when installed, and
``uvicorn[standard]``, which Orbit depends on, installs it); this is that protocol.
"""

from __future__ import annotations

from asyncio import Transport
from asyncio.events import TimerHandle
from typing import ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeadDeadline(HttpToolsProtocol):
    """``HttpToolsProtocol`` that closes a connection whose request head is not complete
    within ``header_timeout`` seconds (``uvicorn.Config(http=head_deadline(...))``)."""

    header_timeout: ClassVar[float]
    _head_timer: TimerHandle | None = None
    #: a request head has begun and is not complete
    _in_head = False

    def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        if self._head_timer is None and not self._answering():
            self._arm_head_timer()  # a later request's first byte on a kept-alive connection

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A head begun behind the answer just ended is timed from now (uvicorn read no
        # more of it meanwhile); none begun, the keep-alive timeout is the one that runs.
        if (
            self._in_head
            and self._head_timer is None
            and not self._answering()  # the next pipelined one, started just now
            and not self.transport.is_closing()
        ):
            self._arm_head_timer()

    def _answering(self) -> bool:
        """Whether a request on this connection is still being answered."""
        return self.cycle is not None and not self.cycle.response_complete

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_overdue)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def head_deadline(header_timeout: float) -> type[HeadDeadline]:
    """The protocol class to give ``uvicorn.Config(http=...)``: uvicorn makes one per
    connection from the class alone, so the deadline is a class attribute."""

    class Bound(HeadDeadline):
        pass

    Bound.header_timeout = header_timeout
    return Bound
