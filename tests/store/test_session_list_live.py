"""``Store.session_list(state="live")`` (``GET /v1/workers?state=live``, ``orbit worker ls
--state live``) reads the live sessions through their own partial index. Sessions are
never deleted, and the list walked the primary key through every expired one: 140-300 ms
a page on PostgreSQL and 48-118 ms on SQLite at 225,000 expired sessions."""

from __future__ import annotations

import contextlib
import sqlite3

import psycopg

from orbit.core.model import SECOND
from orbit.store import Store, StoreConfig
from tests.conftest import ManualClock
from tests.store.helpers import worker

CONFIG = StoreConfig(session_ttl_us=10 * SECOND)


def _sessions(store: Store, clock: ManualClock, expired: int, live: int) -> list[str]:
    """``expired`` sessions opened and lapsed, then ``live`` ones: the live ones' ids."""
    for i in range(expired):
        worker(store, name=f"gone-{i}")
    clock.advance(11)
    while store.reap().sessions_expired:
        pass
    return [worker(store, name=f"live-{i}")[0].id for i in range(live)]


def test_live_sessions_are_listed_a_page_at_a_time_among_expired_ones(
    make_store: object, clock: ManualClock
) -> None:
    store: Store = make_store(clock=clock, config=CONFIG)  # type: ignore[operator]
    live = _sessions(store, clock, expired=60, live=5)
    first = store.session_list(state="live", limit=3)
    rest = store.session_list(state="live", after_id=first[-1].id, limit=3)
    assert [s.id for s in first + rest] == sorted(live)
    assert all(s.state == "live" for s in first + rest)
    assert len(store.session_list(state="expired")) == 60
    assert len(store.session_list()) == 65


def test_the_live_list_reads_the_index_of_live_sessions(
    make_store: object, clock: ManualClock, backend: str
) -> None:
    """Its plan, as a cached (generic) plan would run it on PostgreSQL: not a walk of the
    primary key through the expired sessions."""
    store: Store = make_store(clock=clock, config=CONFIG)  # type: ignore[operator]
    _sessions(store, clock, expired=300, live=2)
    sql = store.driver.queries["session_list_live"]  # type: ignore[attr-defined]
    if backend == "sqlite":
        with contextlib.closing(sqlite3.connect(store.driver.path)) as cx:  # type: ignore[attr-defined]
            cx.execute("ANALYZE")
            plan = " ".join(
                str(r[-1])
                for r in cx.execute("EXPLAIN QUERY PLAN " + sql, {"after_id": None, "limit": 100})
            )
    else:
        with psycopg.connect(store.driver.dsn, autocommit=True) as cx:  # type: ignore[attr-defined]
            cx.execute("ANALYZE orbit_sessions")
            cx.execute("SET plan_cache_mode = force_generic_plan")
            text = sql.replace("%(after_id)s", "$1").replace("%(limit)s", "$2")
            cx.execute(f"PREPARE live_list(text, bigint) AS {text}")
            plan = " ".join(str(r[0]) for r in cx.execute("EXPLAIN EXECUTE live_list(NULL, 100)"))
    assert "orbit_sessions_expiry" in plan, plan
