"""The session expiry never waits for a row lock under the claim lock (PostgreSQL).

The reaper's session pass holds the cluster-wide claim lock while it releases an
expired session's claims. It waited there for the rows of that session's tasks and for
the session's row; a transaction holding one of them (a node cut off in the middle of a
report keeps its locks until PostgreSQL gives its connection up, hours later) stopped
that reaper, every other node's reaper behind the claim lock, and every claim of the
cluster. Such a session is now left for a later pass, and it can claim nothing meanwhile.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from orbit.core.errors import Code, OrbitError
from orbit.core.model import SECOND
from orbit.store import Store, StoreConfig
from orbit.store.store import ReapReport
from tests.conftest import ManualClock, store_url
from tests.store.helpers import claim_one, queue, submit, until_done_or_waiting_on_a_lock, worker

#: claims outlive the session, so that the session's expiry is what frees them
CONFIG = StoreConfig(claim_ttl_us=600 * SECOND, session_ttl_us=60 * SECOND)

HELD = {
    "task": "SELECT 1 FROM orbit_tasks WHERE id = %s FOR UPDATE",
    "session": "SELECT 1 FROM orbit_sessions WHERE id = %s FOR UPDATE",
}


def _reap_in_thread(store: Store) -> ReapReport:
    """One reaper pass, which must end without waiting for any lock."""
    done: list[Any] = []
    t = threading.Thread(target=lambda: done.append(store.reap()), daemon=True)
    t.start()
    until_done_or_waiting_on_a_lock(t, store_url(store))
    assert not t.is_alive(), "the reaper waited for a row lock"
    (report,) = done
    assert isinstance(report, ReapReport)
    return report


@pytest.mark.parametrize("row", sorted(HELD))
def test_a_held_row_leaves_its_session_to_a_later_pass_and_claims_go_on(
    make_store: Any, backend: str, clock: ManualClock, row: str
) -> None:
    if backend != "postgres":
        pytest.skip("SQLite has no row locks: a writer waits for the whole file")
    store: Store = make_store(clock=clock, config=CONFIG)
    queue(store)
    lost, _ = worker(store, name="lost")
    held_task = submit(store)
    claim_one(store, lost)
    clock.advance(61)  # the session has expired; its claim has not
    live, _ = worker(store, name="live")
    ready = submit(store)

    with psycopg.connect(store_url(store)) as holder:
        holder.execute(HELD[row], (held_task if row == "task" else lost.id,))
        report = _reap_in_thread(store)
        assert report.sessions_expired == 0 and report.released == 0
        # The claim lock is free: another session's claim goes on at once.
        assert claim_one(store, live).attempt.task_id == ready
        # The lapsed session stays live in its row until a later pass, and claims nothing.
        assert store.session_get(lost.id).state == "live"
        submit(store)
        with pytest.raises(OrbitError) as refused:
            store.attempt_claim_many(lost.id, lost.epoch, 1)
        assert refused.value.code == Code.SESSION_EXPIRED
        holder.rollback()

    report = _reap_in_thread(store)
    assert report.sessions_expired == 1 and report.released == 1
    assert store.session_get(lost.id).state == "expired"
    assert store.task_get(held_task).state == "queued"
