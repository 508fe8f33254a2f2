"""The server's listening socket drops a peer that takes none of its bytes for
``unread_timeout`` seconds: a stopped worker's kernel keeps answering TCP's window
probes, so without ``TCP_USER_TIMEOUT`` such a connection is never given up."""

from __future__ import annotations

import errno
import select
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from orbit.cli.listening import bind

pytestmark = pytest.mark.skipif(
    not hasattr(socket, "TCP_USER_TIMEOUT"), reason="TCP_USER_TIMEOUT is Linux's"
)


@contextmanager
def accepted(unread_timeout: float) -> Iterator[socket.socket]:
    """The server's side of a connection to a peer that never reads."""
    with (
        bind("127.0.0.1", 0, unread_timeout=unread_timeout) as listener,
        socket.create_connection(listener.getsockname()),
    ):
        ours, _ = listener.accept()
        with ours:
            yield ours


def test_an_accepted_connection_carries_the_timeout() -> None:
    with accepted(2.5) as ours:
        assert ours.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 2500


def test_a_peer_that_never_reads_is_dropped_after_the_timeout() -> None:
    """Fill the peer's window (it never reads), then keep offering bytes: the kernel
    must fail the connection soon after the timeout, where without it the writes would
    wait for as long as the peer lives."""
    with accepted(1.0) as ours:
        ours.setblocking(False)
        with pytest.raises(BlockingIOError):
            while True:  # until the peer's window and our buffer are full
                ours.send(b"x" * 65536)
        end = time.monotonic() + 30
        with pytest.raises(OSError) as failed:
            while time.monotonic() < end:
                select.select([], [ours], [], 0.5)
                try:
                    ours.send(b"x")
                except BlockingIOError:
                    continue
        assert failed.value.errno == errno.ETIMEDOUT
