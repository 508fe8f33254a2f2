"""Small builders shared by the store tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from orbit.core.model import Capability, Grant, Session, TaskSpec
from orbit.store import Store
from orbit.store.postgres.driver import PostgresDriver


def queue(
    store: Store,
    name: str = "q",
    max_concurrency: int = 10,
    rate: float = 0,
    burst: int | None = None,
) -> None:
    store.queue_create(name, max_concurrency=max_concurrency, rate=rate, burst=burst)


def submit(store: Store, queue: str = "q", handler: str = "h", **kw: Any) -> str:
    return store.task_submit(TaskSpec(queue=queue, handler=handler, **kw)).task.id


def worker(
    store: Store,
    handlers: dict[str, int] | None = None,
    max_concurrency: int = 10,
    name: str = "w",
    node: str = "n1",
) -> tuple[Session, str]:
    caps = [Capability(h, c) for h, c in (handlers or {"h": 10}).items()]
    return store.session_open(
        name=name, node_id=node, capabilities=caps, max_concurrency=max_concurrency
    )


def claim_one(store: Store, session: Session) -> Grant:
    grants = store.attempt_claim_many(session.id, session.epoch, 1)
    assert len(grants) == 1, grants
    return grants[0]


def run_one(store: Store, session: Session) -> Grant:
    """Claim and start one task."""
    g = claim_one(store, session)
    store.attempt_start(session.id, session.epoch, g.attempt.id, g.attempt.fence)
    return g


def postgres_driver(store: Store, queries: dict[str, str]) -> PostgresDriver:
    """The store's PostgreSQL driver, with test queries (psycopg's ``%(name)s`` form)
    added to the named ones its statements are made from."""
    drv = store.driver
    assert isinstance(drv, PostgresDriver)
    drv.queries.update(queries)
    return drv


def blind_first_look(store: Store, monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Make the store's first look for existing keys find none, as if another submit
    took a key just after it; return how many looks there have been."""
    looks = 0
    existing = store._existing_by_key

    def blind_once(tx: Any, batch: Any) -> Any:
        nonlocal looks
        looks += 1
        return {} if looks == 1 else existing(tx, batch)

    monkeypatch.setattr(store, "_existing_by_key", blind_once)
    return lambda: looks
