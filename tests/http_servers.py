"""A small HTTP server of a test's own, answering on a thread for the length of a block."""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from typing import Any


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


class AnsweringHandler(BaseHTTPRequestHandler):
    """A keep-alive handler that logs nothing and answers GET and POST alike with its
    subclass's ``_answer``, the request's body read first (``body``)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *_: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _answer(self) -> None:
        raise NotImplementedError
