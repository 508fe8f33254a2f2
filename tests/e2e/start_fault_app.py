"""A real server process for tests/e2e/test_worker_start_not_tried.py: an application
that embeds ``create_app`` (as tests/e2e/busy_app.py does) over a real store whose first
starts fail as a database fails them, raising the store's own ``DatabaseUnavailable``:

- ``committed``: the start (or ``start_many``) commits, then the answer is
  ``DATABASE_UNAVAILABLE``, as when the connection is killed after the COMMIT and the
  reply is lost (the store cannot tell whether it landed);
- ``uncommitted``: the start is answered ``DATABASE_BUSY`` before anything is written.

``python -m tests.e2e.start_fault_app <db url> <mode> <faults>``: each attempt's first
``faults`` starts fail so (a ``start_many`` fails whole while any of its attempts is
to). The run lease is 3 s and the reaper looks every 0.1 s (a start left unresent is
reaped, its task ``needs_review``, within seconds); the claim lease is 300 s (a claim
left unstarted and unreleased holds its task for the whole test). It says where it
listens in ``orbit server``'s words, so that ``tests.e2e.servers`` finds its port."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

from orbit.core.errors import DATABASE_BUSY, DATABASE_UNAVAILABLE
from orbit.core.model import SECOND
from orbit.logs import configure
from orbit.server import ServerSettings
from orbit.store import StoreConfig, open_store
from orbit.store.driver import DatabaseUnavailable
from tests.e2e.app_serving import hold_if_sqlite, serve

MODES = ("committed", "uncommitted")


def main(db_url: str, mode: str, faults: int) -> None:
    assert mode in MODES, mode
    configure("info")
    held = hold_if_sqlite(db_url)
    config = StoreConfig(lease_ttl_us=3 * SECOND, claim_ttl_us=300 * SECOND)
    store = open_store(db_url, config)
    real = store.attempt_start_many
    failed: dict[str, int] = {}
    lock = threading.Lock()

    def failing(session_id: str, epoch: int, items: Sequence[tuple[str, int]]) -> list[Any]:
        """``attempt_start_many`` (a lone start goes through it too), failed as ``mode``
        says while any of its attempts has been failed fewer than ``faults`` times."""
        with lock:
            fail = any(failed.get(attempt_id, 0) < faults for attempt_id, _ in items)
            if fail:
                for attempt_id, _ in items:
                    failed[attempt_id] = failed.get(attempt_id, 0) + 1
        if not fail:
            return real(session_id, epoch, items)
        if mode == "committed":
            real(session_id, epoch, items)
            raise DatabaseUnavailable(DATABASE_UNAVAILABLE)
        raise DatabaseUnavailable(DATABASE_BUSY)

    store.attempt_start_many = failing  # type: ignore[method-assign]
    settings = ServerSettings(
        db_url=db_url, node_id="start-fault", store_config=config, reap_interval=0.1
    )
    serve(settings, store, held)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
