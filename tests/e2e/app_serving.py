"""Serving ``create_app`` from a test's own process (``tests.e2e.busy_app``,
``tests.e2e.start_fault_app``): an application that embeds Orbit, as
docs/operations.md describes, over a store the test arranged. On SQLite the one-server
lock is taken first (``hold_for_server``), as ``orbit server`` does, and where it
listens is said in ``orbit server``'s words, so that ``tests.e2e.servers`` finds its
port (``app_server``)."""

from __future__ import annotations

import os
import socket
import sys

import uvicorn

from orbit.cli.listening import announcement, bind, url_of
from orbit.server import ServerSettings, create_app
from orbit.store import Store, sqlite_path


def hold_if_sqlite(db_url: str) -> int | None:
    """The one-server lock of a SQLite database (its descriptor), None on PostgreSQL."""
    path = sqlite_path(db_url)
    if path is None:
        return None
    from orbit.store.sqlite import hold_for_server

    return hold_for_server(path)


def serve(settings: ServerSettings, store: Store, held: int | None) -> None:
    """Serve the app over ``store`` on a loopback port of its own until stopped, then
    close the store and let go of the lock ``held`` (``hold_if_sqlite``)."""
    sock = bind("127.0.0.1", 0, unread_timeout=60)
    url = url_of(sock, "127.0.0.1")

    class Announced(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            print(announcement(url), file=sys.stderr, flush=True)

    app = create_app(settings, store=store)
    server = Announced(uvicorn.Config(app, log_config=None, access_log=False))
    try:
        server.run(sockets=[sock])
    finally:
        store.close()
        if held is not None:
            os.close(held)
