"""A real server process for tests/e2e/test_busy_database.py: an application that embeds
``create_app``, as docs/operations.md describes, with a store whose wait for the database
(``StoreConfig.tx_wait_us``) is a test's (``orbit server`` keeps the default, 20 s).

``python -m tests.e2e.busy_app <db url> <tx wait, seconds> [<max_page_count>]``: on
SQLite it takes the one-server lock first (``hold_for_server``), as ``orbit server``
does; a third argument holds the SQLite file to that many pages (SQLITE_FULL past them,
as a full disk). It says where it listens in ``orbit server``'s words, so that
``tests.e2e.servers`` finds its port."""

from __future__ import annotations

import os
import socket
import sys

import uvicorn

from orbit.cli.listening import announcement, bind, url_of
from orbit.core.model import SECOND
from orbit.logs import configure
from orbit.server import ServerSettings, create_app
from orbit.store import StoreConfig, open_store, sqlite_path


def main(db_url: str, tx_wait_s: float, max_pages: int | None) -> None:
    configure("info")
    held = None
    path = sqlite_path(db_url)
    if path is not None:
        from orbit.store.sqlite import hold_for_server

        held = hold_for_server(path)
    config = StoreConfig(tx_wait_us=int(tx_wait_s * SECOND))
    store = open_store(db_url, config)
    if max_pages is not None:
        store.driver._raw().execute(f"PRAGMA max_page_count = {max_pages}")  # type: ignore[attr-defined]
    settings = ServerSettings(db_url=db_url, node_id="busy", store_config=config)
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


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
