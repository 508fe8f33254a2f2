"""A small HTTP server of a test's own, answering on a thread for the length of a block."""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serving(srv: socketserver.BaseServer) -> Iterator[None]:
    """``srv`` serving on a daemon thread for the block, then shut down and its socket
    closed (its loop checks for the shutdown every 50 ms, so a fixture's end is quick)."""
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        srv.shutdown()
        srv.server_close()
