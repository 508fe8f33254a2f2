"""The task list's time window, as protocol.md states it: ``created_after`` is
inclusive, ``created_before`` exclusive, so consecutive windows neither overlap nor
leave a gap."""

from __future__ import annotations

from orbit.store import Store
from tests.conftest import ManualClock
from tests.store.helpers import queue, submit


def test_created_after_is_inclusive_and_created_before_exclusive(
    store: Store, clock: ManualClock
) -> None:
    queue(store)
    at = clock.now
    first = submit(store)
    clock.advance(1)
    second = submit(store)
    assert store.task_get(first).created_at == at
    assert [t.id for t in store.task_list(created_after=at)] == [first, second]
    assert store.task_list(created_before=at) == []
    assert [t.id for t in store.task_list(created_before=clock.now)] == [first]
    assert [t.id for t in store.task_list(created_after=clock.now)] == [second]
