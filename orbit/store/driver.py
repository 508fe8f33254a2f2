"""The one interface through which Orbit reaches a database.

A driver knows how to open a transaction, run a named query, write many rows in one
statement and read the database clock. Everything Orbit decides is decided above it,
once, for every backend (``orbit.store.store.Store``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

Row = dict[str, Any]
Params = dict[str, Any]
#: A notification to the other server nodes: ``(channel, payload)``.
Notice = tuple[str, str]

_NAME_RE = re.compile(r"^-- name: ([a-z_]+)\s*$", re.MULTILINE)


def load_queries(path: Path) -> dict[str, str]:
    """Split a ``queries.sql`` file on its ``-- name: x`` headers into named queries."""
    text = path.read_text(encoding="utf-8")
    parts = _NAME_RE.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name} is defined twice in {path}")
        sql = "\n".join(line for line in body.splitlines() if not line.startswith("--"))
        queries[name] = sql.strip().rstrip(";")
    return queries


def migration_files(directory: Path) -> list[tuple[int, Path]]:
    """Numbered migrations (``0001_name.sql``) in order."""
    found = []
    for path in sorted(directory.glob("*.sql")):
        number = int(path.name.split("_", 1)[0])
        found.append((number, path))
    numbers = [n for n, _ in found]
    if numbers != list(range(1, len(numbers) + 1)):
        raise ValueError(f"migrations must be numbered 1..n without gaps: {numbers}")
    return found


class Connection(Protocol):
    """One open transaction on one backend."""

    def fetch(self, name: str, params: Params) -> list[Row]: ...

    def write_many(self, name: str, rows: Sequence[Row]) -> int: ...

    def write_stream(self, name: str, chunks: Iterable[Sequence[Row]]) -> int:
        """``write_many`` over rows made a chunk at a time, in one transaction; the total
        count. A backend may send each chunk's statement without waiting for the one
        before (PostgreSQL's pipeline mode), so that the caller's Python making the next
        chunk runs while the database writes this one."""
        ...

    def lock_many(self, calls: Sequence[tuple[str, Params]]) -> tuple[list[list[Row]], int]:
        """Run several reads (locking ones take their locks in the order given), then
        read the clock, and return each one's rows and the clock. A backend may send them
        as one statement, but the clock is always read after every lock is held."""
        ...

    def write_batch(
        self, writes: Sequence[tuple[str, Sequence[Row]]], notify: Sequence[Notice] = ()
    ) -> list[int]:
        """Run several ``*_many`` writes (each with ``RETURNING``; there may be none) and
        return each one's count of rows written. Each ``(channel, payload)`` of ``notify``
        goes to the other server nodes once this transaction commits (PostgreSQL
        ``NOTIFY``; nothing if it rolls back); a backend with one server process (SQLite)
        has no one to tell. A backend may send all of it as one statement."""
        ...

    def execute(self, name: str, params: Params) -> int: ...

    def prelude(self, name: str, params: Params) -> None:
        """Run a statement whose answer is not needed (a lock) before this transaction's
        next one. A backend may send it with that next statement, in one round trip, but
        runs it first, as a statement of its own."""
        ...

    def now(self) -> int: ...

    def run_script(self, sql: str) -> None: ...


class Driver(Protocol):
    """A backend: transactions, the named queries and the migrations of one database."""

    name: str
    queries: dict[str, str]
    migrations: Path

    def transaction(self, *, durable: bool = True) -> AbstractContextManager[Connection]:
        """One transaction. ``durable=False`` lets its commit return before the commit is
        on disk (PostgreSQL ``synchronous_commit = off``, SQLite ``synchronous = NORMAL``):
        a crash of the database's machine, or of PostgreSQL itself, may then undo it.
        Only for transactions whose loss is harmless (claims: see ``Store``). Any later
        durable commit makes every earlier commit durable too: the log is written in
        order."""
        ...

    def read(self, name: str, params: Params) -> list[Row]:
        """One read that is a transaction of its own. A backend may run it without
        ``BEGIN`` and ``COMMIT`` (PostgreSQL: one statement in autocommit, one round
        trip instead of three)."""
        ...

    def is_retryable(self, exc: BaseException) -> bool: ...

    def close(self) -> None: ...
