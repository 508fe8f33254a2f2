"""The task list's id bounds: ``after_id`` and the created window become plain bounds on
the primary key (``task_list_range``), derived from the time-ordered ids, so a page or a
window reads the tasks in it rather than every task from the first. The results are the
ones the filters alone select, for every combination of them."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from orbit.core.ids import random8, uuid7, uuid7_many
from orbit.core.model import Task
from orbit.store import InjectedFault, Store
from orbit.store import store as store_module
from tests.conftest import ManualClock
from tests.store.helpers import query_plan, queue, submit

#: Microseconds from a second after 1970 to 2200: every instant a store's clock gives.
_NOW = st.integers(min_value=1_000_000, max_value=7_258_118_400_000_000)


@given(now=_NOW, a=_NOW, b=_NOW, first=st.integers(0, 1000))
def test_the_id_bounds_never_narrow_the_created_window(
    now: int, a: int, b: int, first: int
) -> None:
    """A task made at ``now`` has ``uuid7(now)`` (a batch: ``uuid7_many(now, …)``) for its
    id and ``now`` for its ``created_at``: whenever the window holds ``now``, the bounds
    hold the id, so they only ever leave out what the created_at conditions do."""
    ids = [uuid7(now, random8()), *uuid7_many(now, 2, first)]
    for after, before in [
        (a, b),
        (a, None),
        (None, b),
        (now, now + 1),
        (now, None),
        (None, now + 1),
    ]:
        bounds = store_module._list_id_bounds(None, after, before)
        assert bounds is not None
        lo, hi = bounds
        if (after is None or after <= now) and (before is None or now < before):
            assert all(lo < i < hi for i in ids), (now, after, before, lo, hi, ids)
    # to the millisecond: a window of one whole millisecond is one id prefix
    ms = now // 1000
    lo, hi = store_module._list_id_bounds(None, ms * 1000, ms * 1000 + 1000) or ("", "")
    assert hi > lo and all(i[:13] == lo and i < hi for i in ids)


def test_after_id_alone_keeps_its_meaning() -> None:
    assert store_module._list_id_bounds(None, None, None) is None
    assert store_module._list_id_bounds("x", None, None) == ("x", "g")
    assert store_module._list_id_bounds("", None, None) == ("", "g")
    # out of a prefix's range: no bound, the created_at conditions decide alone
    assert store_module._list_id_bounds(None, -5, 0) == ("", "g")


def _tasks(store: Store, clock: ManualClock) -> list[Task]:
    """Twenty-four tasks over two queues, handlers and tenants and three states, made at
    steps of a microsecond, a fraction of a millisecond and whole seconds."""
    queue(store)
    queue(store, "r")
    made: list[str] = []
    steps = itertools.cycle([0.000001, 0.0004, 1.0, 0.0007])
    for i in range(24):
        clock.advance(next(steps))
        later = clock.now + 3_600_000_000 if i % 5 == 1 else None
        made.append(
            submit(
                store,
                queue="r" if i % 2 else "q",
                handler="g" if i % 3 else "h",
                tenant="t2" if i % 4 == 3 else "default",
                run_after=later,
            )
        )
    for task_id in made[2::7]:
        store.task_cancel(task_id)
    return [store.task_get(t) for t in made]


def test_every_filter_combination_lists_what_the_filters_select(
    store: Store, clock: ManualClock
) -> None:
    """Each combination of the filters, with and without a created window (bounds on a
    task's instant, between two, a microsecond either side, a millisecond's start) and
    ``after_id``, lists exactly the tasks that match, in id order; and paged two at a
    time, the same tasks."""
    tasks = _tasks(store, clock)
    assert [t.id for t in tasks] == sorted(t.id for t in tasks)
    at = [t.created_at for t in tasks]
    edges = sorted({at[5], at[5] + 1, at[5] - 1, at[11] // 1000 * 1000, at[17], at[17] + 1})
    windows: list[tuple[int | None, int | None]] = [(None, None)]
    windows += [(e, None) for e in edges] + [(None, e) for e in edges]
    windows += [(a, b) for a, b in itertools.combinations(edges, 2)]
    for q, state, tenant, handler, (after, before), after_id in itertools.product(
        [None, "q", "r"],
        [None, "queued", "scheduled", "cancelled", "running"],
        [None, "t2"],
        [None, "g"],
        windows,
        [None, tasks[8].id],
    ):
        filters: dict[str, Any] = {
            "queue": q,
            "state": state,
            "tenant": tenant,
            "handler": handler,
            "created_after": after,
            "created_before": before,
        }
        expect = [
            t.id
            for t in tasks
            if (q is None or t.queue == q)
            and (state is None or t.state == state)
            and (tenant is None or t.tenant == tenant)
            and (handler is None or t.handler == handler)
            and (after is None or t.created_at >= after)
            and (before is None or t.created_at < before)
            and (after_id is None or t.id > after_id)
        ]
        got = [t.id for t in store.task_list(**filters, after_id=after_id)]
        assert got == expect, (filters, after_id)
        if len(expect) > 2 and after is not None and q is None and tenant is None:
            paged: list[str] = []
            while page := store.task_list(
                **filters, after_id=paged[-1] if paged else after_id, limit=2
            ):
                paged += [t.id for t in page]
            assert paged == expect, (filters, after_id)


def test_a_window_or_a_page_reads_the_bounded_query(store: Store, clock: ManualClock) -> None:
    """A created window or ``after_id`` takes ``task_list_range``; a list without them
    (nothing to bound) and a parent's children (its own index) do not."""
    tasks = _tasks(store, clock)
    with store.inject_fault("task_list_range"):
        for kw in [
            {"created_after": tasks[3].created_at},
            {"created_before": tasks[3].created_at},
            {"after_id": tasks[3].id},
            {"after_id": tasks[3].id, "state": "queued", "queue": "q"},
        ]:
            try:
                store.task_list(**kw)
            except InjectedFault:
                continue
            raise AssertionError(f"task_list({kw}) did not read task_list_range")
        assert len(store.task_list()) == len(tasks)
        assert store.task_list(parent_id=tasks[0].id, created_after=1) == []


def test_the_bounds_bound_the_primary_key_scan(store: Store) -> None:
    """As plain conditions the bounds are the primary key's search range, on SQLite and
    in PostgreSQL's generic plan of the prepared statement, whatever else is asked."""
    params: dict[str, Any] = {
        "id_from": "01a229a4-0000",
        "id_to": "01a229a5-0000",
        "queue": "q",
        "state": "running",
        "tenant": None,
        "handler": None,
        "created_after": 1,
        "created_before": None,
        "limit": 100,
    }
    plan = query_plan(store, "task_list_range", params, seqscan=False)
    if store.backend == "sqlite":
        assert (
            "SEARCH orbit_tasks USING INDEX sqlite_autoindex_orbit_tasks_1 (id>? AND id<?)" in plan
        ), plan
    else:
        assert "Index Cond: ((id > $1) AND (id < $2))" in plan, plan
