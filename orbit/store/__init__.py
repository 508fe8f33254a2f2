"""Durable state: one ``Store`` over a SQLite or PostgreSQL driver.

``open_store("sqlite:///path/orbit.db")`` or ``open_store("postgresql://…")`` returns a
migrated store. Tests pass ``clock=`` to control time exactly.
"""

from __future__ import annotations

from pathlib import Path

from orbit.store.store import Clock as Clock
from orbit.store.store import (
    Grants,
    InjectedFault,
    ReapReport,
    SchemaTooNew,
    StaleWrite,
    Store,
    StoreConfig,
    Submitted,
)


def open_store(
    url: str,
    config: StoreConfig | None = None,
    *,
    clock: Clock | None = None,
    migrate: bool = True,
) -> Store:
    """Open the store a URL names: ``sqlite:///file.db`` or ``postgresql://…``."""
    if url.startswith("sqlite://"):
        from orbit.store.sqlite import SqliteDriver

        path = url.removeprefix("sqlite://")
        path = path[1:] if path.startswith("/") else path  # sqlite:///rel, sqlite:////abs
        if path not in ("", ":memory:"):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        store = Store(SqliteDriver(path or ":memory:"), config, clock=clock)
    elif url.startswith(("postgresql://", "postgres://")):
        from orbit.store.postgres import PostgresDriver

        store = Store(PostgresDriver(url), config, clock=clock)
    else:
        raise ValueError("the store URL must start with sqlite:// or postgresql://")
    if migrate:
        store.migrate()
    return store


__all__ = [
    "Grants",
    "InjectedFault",
    "ReapReport",
    "SchemaTooNew",
    "StaleWrite",
    "Store",
    "StoreConfig",
    "Submitted",
    "open_store",
]
