"""Another connection holding a database's write lock, for tests of what waits for it."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from orbit.store import sqlite_path


@contextmanager
def write_lock(url: str) -> Iterator[None]:
    """Another connection holding the database's write lock for the block: SQLite's
    (``BEGIN IMMEDIATE``), or PostgreSQL's tasks table (``LOCK TABLE … IN EXCLUSIVE
    MODE``, as an operator's session or a migration would)."""
    path = sqlite_path(url)
    if path is not None:
        holder = sqlite3.connect(path, isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            yield
            holder.execute("COMMIT")
        finally:
            holder.close()
        return
    with psycopg.connect(url) as cx:
        cx.execute("LOCK TABLE orbit_tasks IN EXCLUSIVE MODE")
        yield
        cx.rollback()
