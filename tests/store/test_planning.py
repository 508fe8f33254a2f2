"""Every pooled PostgreSQL connection plans each statement for the rows at hand.

psycopg prepares a statement after its fifth run, and PostgreSQL may then keep one
generic plan for it. Orbit's tables swing from empty to a large backlog and back, and a
plan kept from a nearly empty ``orbit_attempts`` once made a 20,000-task drain run at a
third of its speed (see ``_plan_for_the_rows_at_hand`` in the driver). SQLite has no such
plan cache, so this is PostgreSQL's own test.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from orbit.store import Store


@pytest.mark.parametrize("backend", ["postgres"])
def test_every_pooled_connection_plans_each_run_anew(make_store: Any) -> None:
    store: Store = make_store()
    store.driver.queries["test_plan_mode"] = "SHOW plan_cache_mode"
    modes: list[str] = []
    inside = threading.Barrier(4)

    def one() -> None:
        # four transactions open at once: the pool must open new connections for them
        with store.driver.transaction() as cx:
            modes.append(str(cx.fetch("test_plan_mode", {})[0]["plan_cache_mode"]))
            inside.wait(timeout=30)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert modes == ["force_custom_plan"] * 4
