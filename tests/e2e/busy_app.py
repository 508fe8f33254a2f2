"""A real server process for tests/e2e/test_busy_database.py: an application that embeds
``create_app``, as docs/operations.md describes, with a store whose wait for the database
(``StoreConfig.tx_wait_us``) is a test's (``orbit server`` keeps the default, 20 s).

``python -m tests.e2e.busy_app <db url> <tx wait, seconds> [<max_page_count>]``: on
SQLite it takes the one-server lock first (``hold_for_server``), as ``orbit server``
does; a third argument holds the SQLite file to that many pages (SQLITE_FULL past them,
as a full disk). It says where it listens in ``orbit server``'s words, so that
``tests.e2e.servers`` finds its port."""

from __future__ import annotations

import sys

from orbit.core.model import SECOND
from orbit.logs import configure
from orbit.server import ServerSettings
from orbit.store import StoreConfig, open_store
from tests.e2e.app_serving import hold_if_sqlite, serve


def main(db_url: str, tx_wait_s: float, max_pages: int | None) -> None:
    configure("info")
    held = hold_if_sqlite(db_url)
    config = StoreConfig(tx_wait_us=int(tx_wait_s * SECOND))
    store = open_store(db_url, config)
    if max_pages is not None:
        store.driver._raw().execute(f"PRAGMA max_page_count = {max_pages}")  # type: ignore[attr-defined]
    settings = ServerSettings(db_url=db_url, node_id="busy", store_config=config)
    serve(settings, store, held)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
