"""Durable state: one ``Store`` over a SQLite or PostgreSQL driver.

``open_store("sqlite:///path/orbit.db")`` or ``open_store("postgresql://…")`` returns a
migrated store. Tests pass ``clock=`` to control time exactly.
"""

from __future__ import annotations

from contextlib import suppress
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


def sqlite_path(url: str) -> str | None:
    """The file a ``sqlite://`` URL names (``sqlite:///rel``, ``sqlite:////abs``; ``""`` or
    ``":memory:"`` for none), or None for any other URL."""
    if not url.startswith("sqlite://"):
        return None
    path = url.removeprefix("sqlite://")
    return path[1:] if path.startswith("/") else path


def open_store(
    url: str,
    config: StoreConfig | None = None,
    *,
    clock: Clock | None = None,
    migrate: bool = True,
) -> Store:
    """Open the store a URL names: ``sqlite:///file.db`` or ``postgresql://…``."""
    path = sqlite_path(url)
    if path is not None:
        from orbit.store.sqlite import SqliteDriver

        if path not in ("", ":memory:"):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        store = Store(SqliteDriver(path or ":memory:"), config, clock=clock)
    elif url.startswith(("postgresql://", "postgres://")):
        from orbit.store.postgres import PostgresDriver

        store = Store(PostgresDriver(url), config, clock=clock)
    else:
        raise ValueError("the store URL must start with sqlite:// or postgresql://")
    if migrate:
        try:
            store.migrate()
        except BaseException:
            # The caller never gets the store: close it here, or its connection (on
            # PostgreSQL two pools, their connections and threads) lives for as long as
            # the error does. The error raised is migrate's, not one from closing.
            with suppress(Exception):
                store.close()
            raise
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
