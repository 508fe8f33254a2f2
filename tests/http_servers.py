"""A small HTTP server of a test's own, answering on a thread for the length of a block."""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from orbit.store.driver import UNAVAILABLE_MESSAGES


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

    def send(self, status: int, data: bytes, headers: dict[str, str] | None = None) -> None:
        """Answer ``status`` with ``data`` (JSON unless ``headers`` say otherwise)."""
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_refusal(self, code: str) -> None:
        """Orbit's 503 while its database cannot take a call (``code``: DATABASE_BUSY, …),
        with the server's own words and its ``Retry-After``."""
        self.send(503, json.dumps(database_refusal(code)).encode(), {"Retry-After": "5"})

    def _answer(self) -> None:
        raise NotImplementedError


class QuietServer(ThreadingHTTPServer):
    """A threading server on daemon threads that prints nothing when a client hangs up."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


def database_refusal(code: str) -> dict[str, Any]:
    """The body of Orbit's 503 for ``code`` (``DATABASE_BUSY``, …), in the server's words."""
    return {"error": {"code": code, "message": UNAVAILABLE_MESSAGES[code]}}
