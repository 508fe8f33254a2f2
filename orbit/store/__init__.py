"""Durable state: one ``Store`` over a SQLite or PostgreSQL driver.

``open_store("sqlite:///path/orbit.db")`` or ``open_store("postgresql://…")`` returns a
migrated store. Tests pass ``clock=`` to control time exactly.
"""

from __future__ import annotations

import re
from contextlib import suppress
from pathlib import Path

from orbit.store.store import Clock as Clock
from orbit.store.store import (
    Grants,
    InjectedFault,
    Migrated,
    MigrationFailed,
    ReapReport,
    SchemaStatus,
    SchemaTooNew,
    StaleWrite,
    Store,
    StoreConfig,
    Submitted,
)

#: the spellings a ``sqlite://`` URL may take, as a refusal of another names them
SQLITE_SPELLINGS = (
    "sqlite:///relative/orbit.db (three slashes: from the working directory) or "
    "sqlite:////absolute/orbit.db (four)"
)


#: a query string of URI parameters (``?mode=ro``, ``?cache=shared&…``), which SQLite
#: URIs take and a path after ``sqlite://`` does not
_URI_PARAMETERS = re.compile(r"\?[A-Za-z_][A-Za-z0-9_]*=")


def sqlite_path(url: str) -> str | None:
    """The file a ``sqlite://`` URL names (``sqlite:///rel``, ``sqlite:////abs``; ``""`` or
    ``":memory:"`` for none), or None for any other URL.

    ValueError for what would be taken, silently, as part of a file name, before
    anything is made: query parameters (``sqlite:///orbit.db?mode=ro`` made a file
    named ``orbit.db?mode=ro``; a ``?`` or ``#`` that introduces none is the file
    name's, as in ``orbit dev --data-dir 'run#1'``), a host (``sqlite://host/x.db``
    was ``./host/x.db``), and a path ending in ``/`` (a directory's spelling: a file
    without the slash was made, then refused as no directory by every later run)."""
    if not url.startswith("sqlite://"):
        return None
    rest = url.removeprefix("sqlite://")
    if _URI_PARAMETERS.search(rest):
        raise ValueError(
            f"a sqlite URL takes no query parameters (?name=value): give {SQLITE_SPELLINGS}"
        )
    host = rest.partition("/")[0]
    if host not in ("", ":memory:"):
        raise ValueError(f"a sqlite URL names no host ({host!r}): give {SQLITE_SPELLINGS}")
    path = rest[1:] if rest.startswith("/") else rest
    if path.endswith("/") and path.strip("/"):
        raise ValueError(
            f"{path} ends in / and so names a directory: give the path of the database "
            f"file (e.g. {path}orbit.db)"
        )
    return path


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
    "Migrated",
    "MigrationFailed",
    "ReapReport",
    "SchemaStatus",
    "SchemaTooNew",
    "StaleWrite",
    "Store",
    "StoreConfig",
    "Submitted",
    "open_store",
]
