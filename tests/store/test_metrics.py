"""The task gauges of /metrics, read from the store (both backends)."""

from __future__ import annotations

from orbit.server.metrics import Metrics
from orbit.store import Store
from tests.conftest import ManualClock
from tests.store.helpers import queue, submit


def _gauge(metrics: Metrics, name: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(s.labels.values()): s.value
        for family in metrics.registry.collect()
        if family.name == name
        for s in family.samples
    }


def test_oldest_queued_age_is_measured_by_the_stores_clock(
    store: Store, clock: ManualClock
) -> None:
    """A queued task's age is the store's clock (the database's, as for leases and
    deadlines) less the instant it became due. It used to be this process's wall clock
    less that instant: off by the skew between an app host and the database, and 0 here,
    where the store's clock is a test clock ahead of the wall clock."""
    queue(store)
    submit(store)
    clock.advance(5)
    assert _gauge(Metrics(store), "orbit_oldest_queued_seconds") == {("q",): 5.0}
