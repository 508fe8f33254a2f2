"""Binding the server's listening socket in the CLI, before uvicorn starts.

``orbit server --port 0`` and ``orbit dev --port 0`` pick a free port; binding it here
tells the CLI which, so it can say where it listens (uvicorn, handed a socket, does not).
A test or supervisor can then read the port from that line instead of guessing a free
port first, which another process could take before the server binds it.

The socket also bounds how long a peer may leave the server's bytes untaken
(``TCP_USER_TIMEOUT``, which every accepted connection inherits). A worker whose process
is stopped, or whose handler blocks its event loop, keeps its kernel acknowledging
window probes, so TCP never gives up on it: its connection, and the pushes waiting in
it, stayed open for as long as the process lived, even after the uvicorn keepalive
closed it (a close waits to flush the buffer first). A peer whose host is gone left the
server retransmitting for about fifteen minutes.
"""

from __future__ import annotations

import errno
import re
import socket
import subprocess
import time
from pathlib import Path

import typer

#: Seconds the server keeps an idle keep-alive connection open (uvicorn's
#: ``timeout_keep_alive``; its default is 5 s). A client that reuses a connection idle
#: about that long met the server's close on the wire: the request it sent was never
#: read, and a POST, which no client sends twice, failed as Unreachable from a healthy
#: server. Orbit's clients close a connection idle for 4 s (``KEEPALIVE_EXPIRY``), and a
#: load balancer in front closes idle ones after 60 s by default (AWS's), before a
#: server that waits longer than both: its close never meets a request.
KEEP_ALIVE = 75


def bind(host: str, port: int, *, unread_timeout: float) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 if the host is an IPv6 address);
    a port in use, or a host that names no address of this machine, is a clear usage
    error, not a traceback. The kernel drops a connection whose peer has taken none of
    its bytes, or acknowledged none, for ``unread_timeout`` seconds (Linux; elsewhere
    TCP's own limits apply). An empty host is refused: the kernel took it for every
    interface, where the default serves this machine only, and the URL made from it
    (``http://:8000``) reached nothing."""
    if not host.strip():
        raise typer.BadParameter(
            "--host is empty: give the address to listen on (127.0.0.1 for this machine "
            "only, 0.0.0.0 for every interface)"
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:  # no IPv6 on this machine
        raise typer.BadParameter(f"cannot listen on {host}: {exc.strerror or exc}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    if user_timeout is not None:
        sock.setsockopt(socket.IPPROTO_TCP, user_timeout, max(1, round(unread_timeout * 1000)))
    try:
        sock.bind((host, port))
    except OSError as exc:  # a socket.gaierror too: a name that resolves to nothing
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise typer.BadParameter(f"port {port} is in use; pass --port 0 or another") from None
        reason = exc.strerror or str(exc)
        raise typer.BadParameter(f"cannot listen on {host} port {port}: {reason}") from None
    sock.listen(2048)
    return sock


def quiet_abandoned() -> None:
    """After a stop at once (a second Ctrl-C: uvicorn's ``force_exit``): what it left
    running, the requests under way and the application's background duties, is
    cancelled as the event loop closes, and uvicorn logged each as an ERROR with its
    traceback ("Exception in ASGI application"), for a stop that did as it was asked.
    Its error log is silenced from then on; the process is about to end."""
    import logging

    logging.getLogger("uvicorn.error").disabled = True


def url_of(sock: socket.socket, host: str, scheme: str = "http") -> str:
    """The base URL a bound socket answers on."""
    port = sock.getsockname()[1]
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def announcement(url: str) -> str:
    """The line ``orbit server`` prints once it serves, whatever its log level."""
    return f"orbit server listening on {url}"


_ANNOUNCED = re.compile(rb"orbit server listening on https?://[^\s]*:(\d+)")


def listening_port(output: bytes) -> int | None:
    """The port the first ``announcement`` in a server's ``output`` names, if any: what a
    test or a supervisor that started it with ``--port 0`` reads."""
    said = _ANNOUNCED.search(output)
    return int(said.group(1)) if said else None


def announced_port(
    server: subprocess.Popen[bytes], log: Path, *, start: int = 0, timeout: float = 60.0
) -> int:
    """The port a server started with ``--port 0`` names in ``log`` (its output, read
    from byte ``start``: a log appended to by earlier servers), waiting up to ``timeout``
    seconds. RuntimeError, with the log, if the server exits or says nothing in time."""
    deadline = time.monotonic() + timeout
    while True:
        with log.open("rb") as output:
            output.seek(start)
            port = listening_port(output.read())
        if port is not None:
            return port
        if server.poll() is not None:
            said = log.read_text(errors="replace")
            raise RuntimeError(f"server exited with {server.returncode}:\n{said}")
        if time.monotonic() > deadline:
            said = log.read_text(errors="replace")
            raise RuntimeError(f"server did not say where it listens in {timeout:g} s:\n{said}")
        time.sleep(0.02)
