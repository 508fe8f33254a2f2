"""The queue, token, attempt and tenant limit lists, a page at a time (``GET
/v1/queues``, ``GET /v1/tokens``, ``GET /v1/tasks/{id}/attempts``, ``GET
/v1/limits/tenants``): keyset pages that hold each row exactly once, a bounded limit, and
a read of the key's index from the cursor on rather than a walk of every row from the
start."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest

from orbit.core.errors import Code, OrbitError
from orbit.store import Store
from tests.conftest import ManualClock
from tests.store.helpers import claim_one, query_plan, queue, submit, worker

K = TypeVar("K")


def _walk(
    read: Callable[[K | None, int], Sequence[Any]], key: Callable[[Any], K], size: int
) -> list[list[K]]:
    """Every page of a list read ``size`` rows at a time, each from the last key of the
    page before, as the API's cursor does."""
    pages: list[list[K]] = []
    after: K | None = None
    while True:
        page = [key(row) for row in read(after, size)]
        assert len(page) <= size
        if not page:
            return pages
        pages.append(page)
        after = page[-1]


def test_the_queue_list_pages_by_name(store: Store) -> None:
    """``GET /v1/queues`` answered every queue in one bare list: the store reads them a
    page at a time, in name order after a name, each queue on exactly one page."""
    names = ["b", "a.1", "A", "z", "a", "m:n", "a-2", "0"]
    for name in names:
        queue(store, name)
    every = [q.name for q in store.queue_list()]
    assert every == sorted(names)  # code-point order on both backends
    for size in (1, 2, 3, 8, 1000):
        pages = _walk(lambda a, n: store.queue_list(after_name=a, limit=n), lambda q: q.name, size)
        assert [n for p in pages for n in p] == every, size
        assert all(len(p) == size for p in pages[:-1])
    assert [q.name for q in store.queue_list(after_name="a", limit=2)] == ["a-2", "a.1"]
    assert store.queue_list(after_name="z") == []
    assert [q.name for q in store.queue_list(after_name="b")] == ["m:n", "z"]  # no limit: all


def test_the_token_list_pages_in_creation_order(store: Store, clock: ManualClock) -> None:
    """Tokens, revoked ones too, oldest first as before, now a page at a time in id
    order: a token's id is the uuid7 of its ``created_at``, so that is the same order,
    tokens made in one instant included."""
    made = []
    for i in range(7):
        made.append(store.token_create(f"t{i}", ["submit"])[0])
        if i % 3 == 2:
            clock.advance(1)  # some share an instant, some do not
    store.token_revoke(made[1])
    every = store.token_list()
    assert [t.id for t in every] == [
        t.id for t in sorted(every, key=lambda t: (t.created_at, t.id))
    ]
    assert {t.id for t in every} == set(made)
    for size in (1, 2, 3, 7):
        pages = _walk(lambda a, n: store.token_list(after_id=a, limit=n), lambda t: t.id, size)
        assert [i for p in pages for i in p] == [t.id for t in every], size
    assert store.token_list(after_id=every[-1].id, limit=5) == []
    assert store.token_list(after_id=every[2].id) == every[3:]


def test_the_attempt_list_pages_by_number(store: Store) -> None:
    """A task's attempts are bounded by its claims, not ``max_attempts`` (a released
    claim counts for nothing), and were answered all at once: they are read a page at a
    time in number order, only that task's."""
    queue(store)
    task_id = submit(store)
    other = submit(store, handler="other")
    session, _ = worker(store, {"h": 1})
    for _ in range(5):
        grant = claim_one(store, session)
        assert grant.attempt.task_id == task_id
        store.attempt_release(session.id, session.epoch, grant.attempt.id, grant.attempt.fence)
    claim_one(store, session)
    elsewhere, _ = worker(store, {"other": 1}, name="other")
    assert claim_one(store, elsewhere).attempt.task_id == other  # number 1 of another task
    every = [a.number for a in store.attempt_list(task_id)]
    assert every == [1, 2, 3, 4, 5, 6]
    for size in (1, 2, 4, 1000):
        pages = _walk(
            lambda a, n: store.attempt_list(task_id, after_number=a or 0, limit=n),
            lambda a: a.number,
            size,
        )
        assert [n for p in pages for n in p] == every, size
    assert [a.number for a in store.attempt_list(task_id, after_number=3)] == every[3:]
    assert {a.task_id for a in store.attempt_list(task_id)} == {task_id}
    assert store.attempt_list("01a229a4-0000-7000-8000-000000000000", limit=5) == []


def test_the_tenant_limit_list_pages_by_name(store: Store) -> None:
    """``GET /v1/limits/tenants`` answered every tenant with a cap in one bare list: the
    store reads them a page at a time, in name order after a name, each on exactly one
    page, with either cap; a tenant whose caps were all removed (its row stays) on none."""
    names = ["b", "a.1", "A", "z", "a", "m:n", "a-2", "0"]
    for i, name in enumerate(names):
        if i % 2:
            store.tenant_limit_set(name, i + 1)
        else:
            store.tenant_limit_set(name, max_queued=i + 1)
    store.tenant_limit_set("gone", 3, max_queued=4)
    store.tenant_limit_set("gone", None, max_queued=None)
    every = list(store.tenant_limits())
    assert every == sorted(names)  # code-point order on both backends
    for size in (1, 2, 3, 8, 1000):
        pages = _walk(
            lambda a, n: list(store.tenant_limits(after_name=a, limit=n)), lambda t: t, size
        )
        assert [n for p in pages for n in p] == every, size
        assert all(len(p) == size for p in pages[:-1])
    assert list(store.tenant_limits(after_name="a", limit=2)) == ["a-2", "a.1"]
    assert store.tenant_limits(after_name="z") == {}
    assert store.tenant_limits(after_name="b") == {"m:n": (6, None), "z": (4, None)}


@pytest.mark.parametrize("limit", [0, -1, 1001])
def test_a_page_limit_out_of_range_is_refused(store: Store, limit: int) -> None:
    queue(store)
    task_id = submit(store)
    for read in (
        lambda: store.queue_list(limit=limit),
        lambda: store.token_list(limit=limit),
        lambda: store.attempt_list(task_id, limit=limit),
        lambda: store.tenant_limits(limit=limit),
    ):
        with pytest.raises(OrbitError) as refused:
            read()
        assert refused.value.code == Code.INVALID_ARGUMENT
        assert "limit" in str(refused.value)


@pytest.mark.parametrize("after", [-1, 2**31])
def test_an_attempt_number_out_of_range_is_refused(store: Store, after: int) -> None:
    """Past 2^31 - 1 a number overflows PostgreSQL's integer column: refused as bad
    input on both backends, rather than a database error on one."""
    queue(store)
    task_id = submit(store)
    with pytest.raises(OrbitError) as refused:
        store.attempt_list(task_id, after_number=after)
    assert refused.value.code == Code.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("query", "params", "index"),
    [
        (
            "queue_list",
            {"after_name": "q", "limit": 100},
            ("orbit_queues_pkey", "autoindex_orbit_queues_1"),
        ),
        (
            "token_list",
            {"after_id": "0" * 32, "limit": 100},
            ("orbit_tokens_pkey", "autoindex_orbit_tokens_1"),
        ),
        (
            "tenant_limits",
            {"after_name": "t", "limit": 100},
            ("orbit_tenants_pkey", "autoindex_orbit_tenants_1"),
        ),
        (
            "attempt_list",
            {"task_id": "01a229a4-0000-7000-8000-000000000000", "after_number": 3, "limit": 100},
            ("orbit_attempts_task_id_number_key", "autoindex_orbit_attempts_2"),
        ),
    ],
)
def test_a_page_is_a_range_of_the_keys_index(
    store: Store, query: str, params: dict[str, Any], index: tuple[str, str]
) -> None:
    """A later page starts where the cursor points, in the index: with the ``:x IS NULL
    OR`` form of a first page, SQLite and PostgreSQL's generic plan both read the index
    from its start and skip every row before the cursor (a walk of N pages read N^2/2)."""
    plan = query_plan(store, query, params, seqscan=False)
    if store.backend == "sqlite":
        assert f"SEARCH orbit_{query.split('_')[0]}s USING" in plan and index[1] in plan, plan
        assert ">?" in plan.replace(" ", ""), plan
    else:
        assert f"Index Scan using {index[0]}" in plan and "Index Cond" in plan, plan
        assert "> $" in plan.split("Index Cond", 1)[1], plan
