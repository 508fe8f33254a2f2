"""A transaction whose connection is lost while its ``COMMIT`` is on its way is answered
as one whose outcome is unknown: 503 ``DATABASE_UNAVAILABLE`` still, but saying that the
change may have been committed and that a resend must carry the same idempotency key.

It was the plain ``DATABASE_UNAVAILABLE`` of a database out of reach, with
``Retry-After``: of three submits so answered while a node's backends were being
terminated, two were in the database, and a client that sent them again without a key
made a second task of each. A connection lost before the ``COMMIT`` was sent keeps the
plain answer: nothing of that transaction can have committed.

PostgreSQL only: SQLite has no connection to lose. The database is a library in the
server's own process, and its ``COMMIT`` answers there, or fails with the transaction
rolled back, with no reply in transit to lose.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from orbit.core.errors import DATABASE_UNAVAILABLE
from orbit.core.model import TaskSpec
from orbit.store import Store
from orbit.store.driver import UNAVAILABLE_MESSAGES, DatabaseUnavailable
from tests.commit_hold import commit_held
from tests.conftest import BACKENDS, store_url
from tests.store.helpers import queue, submit

pytestmark = pytest.mark.parametrize("backend", BACKENDS)

MAY_HAVE_COMMITTED = "it may have been committed"
SAME_KEY = "a resend must carry the same idempotency key"


def _url(store: Store) -> str:
    """The PostgreSQL store's URL (the run's database: the trigger is dropped after)."""
    if store.backend == "sqlite":
        pytest.skip("SQLite has no connection to lose: its COMMIT answers in-process")
    return store_url(store)


def test_a_submit_whose_commit_lost_its_connection_may_have_committed(store: Store) -> None:
    """The submit's COMMIT travels with its insert (``commit_with``)."""
    url = _url(store)
    queue(store)
    with commit_held(url, "orbit_tasks") as held, ThreadPoolExecutor(1) as pool:
        killed = pool.submit(held.terminate)
        with pytest.raises(DatabaseUnavailable) as failed:
            store.task_submit(TaskSpec(queue="q", handler="h"))
        killed.result()
    assert failed.value.code == DATABASE_UNAVAILABLE
    assert MAY_HAVE_COMMITTED in failed.value.message
    assert SAME_KEY in failed.value.message
    assert str(failed.value) == failed.value.message
    submit(store)  # the store goes on, on another connection


def test_a_commit_sent_as_the_transaction_ends_lost_may_have_committed(store: Store) -> None:
    """A queue's create commits as the driver's block ends (``_end``'s ``COMMIT``)."""
    url = _url(store)
    with commit_held(url, "orbit_queues") as held, ThreadPoolExecutor(1) as pool:
        killed = pool.submit(held.terminate)
        with pytest.raises(DatabaseUnavailable) as failed:
            queue(store, "lost")
        killed.result()
    assert failed.value.code == DATABASE_UNAVAILABLE
    assert MAY_HAVE_COMMITTED in failed.value.message
    assert SAME_KEY in failed.value.message
    # /readyz reports the code and its plain words
    assert store.write_failure() == (
        DATABASE_UNAVAILABLE,
        UNAVAILABLE_MESSAGES[DATABASE_UNAVAILABLE],
    )


def test_a_connection_lost_before_the_commit_keeps_the_plain_answer(store: Store) -> None:
    """Lost in a statement before the COMMIT was sent: nothing committed, and the answer
    says no more than that the database failed."""
    url = _url(store)
    with (
        commit_held(url, "orbit_queues", deferred=False) as held,
        ThreadPoolExecutor(1) as pool,
    ):
        killed = pool.submit(held.terminate)
        with pytest.raises(DatabaseUnavailable) as failed:
            queue(store, "lost")
        killed.result()
    assert failed.value.code == DATABASE_UNAVAILABLE
    assert failed.value.message == UNAVAILABLE_MESSAGES[DATABASE_UNAVAILABLE]
    assert [q.name for q in store.queue_list()] == []
