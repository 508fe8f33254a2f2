"""The worker list (``Store.session_list``, ``GET /v1/workers``, ``orbit worker ls``)
filtered by session state."""

from __future__ import annotations

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
