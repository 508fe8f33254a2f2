"""An operator changes a tenant's or the global cap (``Store.tenant_limit_set``,
``Store.global_limit_set``), on SQLite and PostgreSQL: each change is an event, as a
queue's is (``queue.updated``), written in the same transaction."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orbit.core.errors import OrbitError
from orbit.store import InjectedFault, Store


def _changes(store: Store, kind: str) -> list[tuple[str | None, dict[str, Any]]]:
    """``(tenant, data)`` of each event of ``kind``, oldest first."""
    return [(e["tenant"], json.loads(e["data"])) for e in store.event_list() if e["kind"] == kind]


def test_a_tenant_cap_change_writes_what_changed_with_its_old_value(store: Store) -> None:
    store.tenant_limit_set("acme", 5)
    store.tenant_limit_set("acme", 3)
    store.tenant_limit_set("acme", None)
    assert _changes(store, "tenant.updated") == [
        ("acme", {"max_concurrency": 5, "max_concurrency_before": None}),
        ("acme", {"max_concurrency": 3, "max_concurrency_before": 5}),
        ("acme", {"max_concurrency": None, "max_concurrency_before": 3}),
    ]
    store.tenant_limit_set("acme", None)  # the cap it has (none): a no-op, no event
    store.tenant_limit_set("other", None)  # a tenant never capped: none either
    assert len(_changes(store, "tenant.updated")) == 3


def test_a_global_cap_change_writes_what_changed_with_its_old_value(store: Store) -> None:
    store.global_limit_set(100)
    store.global_limit_set(100)  # the same value: no event
    store.global_limit_set(None)
    assert _changes(store, "global.updated") == [
        (None, {"max_concurrency": 100, "max_concurrency_before": None}),
        (None, {"max_concurrency": None, "max_concurrency_before": 100}),
    ]


def test_a_refused_cap_writes_no_event(store: Store) -> None:
    for bad in (0, -1, 2_000_000):
        with pytest.raises(OrbitError):
            store.tenant_limit_set("acme", bad)
    with pytest.raises(OrbitError):
        store.global_limit_set(0)
    assert store.event_list() == []


@pytest.mark.parametrize("scope", ["tenant", "global"])
def test_a_cap_change_and_its_event_commit_together(store: Store, scope: str) -> None:
    """A failed event insert rolls the cap back: the event is in the change's transaction."""
    query = "tenant_upsert" if scope == "tenant" else "setting_upsert"

    def change() -> None:
        if scope == "tenant":
            store.tenant_limit_set("acme", 4)
        else:
            store.global_limit_set(4)

    def cap() -> int | None:
        return store.tenant_limit_get("acme") if scope == "tenant" else store.global_limit_get()

    for failing in (query, "event_insert_many"):
        with store.inject_fault(failing), pytest.raises(InjectedFault):
            change()
        assert (cap(), store.event_list()) == (None, [])
    change()
    assert cap() == 4 and [e["kind"] for e in store.event_list()] == [f"{scope}.updated"]
