"""The worker list (``Store.session_list``, ``GET /v1/workers``, ``orbit worker ls``)
filtered by session state."""

from __future__ import annotations

import pytest

from orbit.core.errors import Code, OrbitError
from orbit.store import Store
from tests.conftest import ManualClock
from tests.store.helpers import worker


def test_the_session_list_filters_by_state(store: Store, clock: ManualClock) -> None:
    """Sessions are never deleted: every worker process that ever said hello stays in
    the list, expired, so after a few deploys the live workers were buried among the
    dead ones with no way to ask for them alone."""
    gone, _ = worker(store, name="gone")
    clock.advance(61)  # past the 60 s session TTL
    assert store.reap().sessions_expired == 1
    here, _ = worker(store, name="here")
    assert [s.id for s in store.session_list()] == [gone.id, here.id]
    assert [s.id for s in store.session_list(state="live")] == [here.id]
    assert [s.id for s in store.session_list(state="expired")] == [gone.id]
    assert store.session_list(state="nope") == []


def test_the_session_list_pages_by_keyset(store: Store, clock: ManualClock) -> None:
    """Sessions are never deleted, and ``GET /v1/workers`` answered all of them at once:
    it now pages them as the task list does, in id (= opening) order after ``after_id``,
    ``limit`` at a time, with the state filter applied before the limit."""
    opened = []
    for i in range(5):
        opened.append(worker(store, name=f"w{i}")[0].id)
        clock.advance(1)
    assert sorted(opened) == opened
    assert [s.id for s in store.session_list(limit=2)] == opened[:2]
    assert [s.id for s in store.session_list(after_id=opened[1], limit=2)] == opened[2:4]
    assert [s.id for s in store.session_list(after_id=opened[3], limit=2)] == opened[4:]
    assert store.session_list(after_id=opened[4], limit=2) == []
    clock.advance(60)  # the first five expire; two more open
    assert store.reap().sessions_expired == 5
    later = [worker(store, name="x0")[0].id]
    clock.advance(1)
    later.append(worker(store, name="x1")[0].id)
    assert [s.id for s in store.session_list(state="live", limit=1)] == later[:1]
    assert [s.id for s in store.session_list(state="live", after_id=later[0])] == later[1:]
    assert [s.id for s in store.session_list(state="expired", after_id=opened[2])] == opened[3:]
    assert [s.id for s in store.session_list()] == opened + later  # no limit: all


def test_the_session_list_refuses_a_limit_out_of_range(store: Store) -> None:
    worker(store, name="w")
    for bad in (0, -1, 1001):
        with pytest.raises(OrbitError) as refused:
            store.session_list(limit=bad)
        assert refused.value.code == Code.INVALID_ARGUMENT
