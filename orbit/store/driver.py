"""The one interface through which Orbit reaches a database.

A driver knows how to open a transaction, run a named query, write many rows in one
statement and read the database clock. Everything Orbit decides is decided above it,
once, for every backend (``orbit.store.store.Store``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, NamedTuple, Protocol, overload

from orbit.core.errors import DATABASE_BUSY as DATABASE_BUSY
from orbit.core.errors import DATABASE_FULL as DATABASE_FULL
from orbit.core.errors import DATABASE_READ_ONLY as DATABASE_READ_ONLY
from orbit.core.errors import DATABASE_UNAVAILABLE as DATABASE_UNAVAILABLE

Row = dict[str, Any]
Params = dict[str, Any]
#: A notification to the other server nodes: ``(channel, payload)``.
Notice = tuple[str, str]


class StaleWrite(Exception):
    """A compare-and-set write matched fewer rows than planned; the transaction is retried."""


#: What the server answers (503, ``Retry-After``) for each of the database's conditions a
#: transaction gives up on (``Driver.unavailable_code``; the codes are
#: ``orbit.core.errors``'). Every word of these is the server's own: nothing of the
#: driver's message (a host, a path) goes to a client.
UNAVAILABLE_MESSAGES = {
    DATABASE_BUSY: (
        "the database is busy: another process or a long transaction holds its lock; "
        "nothing was written"
    ),
    DATABASE_FULL: "the database is full (its disk, or its size limit); nothing was written",
    DATABASE_READ_ONLY: "the database is read-only; nothing was written",
    DATABASE_UNAVAILABLE: "the database is unavailable: it failed or cannot be reached",
}


class DatabaseUnavailable(Exception):
    """A transaction the store gave up on because of the database itself, not of what
    it asked (``Store._tx``): its lock held by another process past the store's wait
    (``StoreConfig.tx_wait_us``), its disk full, the database read-only, or out of reach.
    For the first three nothing was written. ``code`` is one of ``UNAVAILABLE_MESSAGES``'
    keys, ``message`` its words; the driver's own error is the ``__cause__``."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.message = UNAVAILABLE_MESSAGES[code]
        super().__init__(self.message)


def error_line(exc: BaseException) -> str:
    """``exc`` as one line for a log or a person: its type and the first line of its
    message (psycopg's next lines quote rows' values, which may be anyone's data)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class RowColumns(Sequence[Row]):
    """Rows held column by column, each column a list in row order. A batch submit makes
    its new tasks' rows so (``rows.tasks_columns``), and the PostgreSQL driver sends a
    column of them as it is, where a row at a time it made a dict per row and took the
    dicts apart again (3-4 µs a task); any other reader sees the rows as dicts."""

    __slots__ = ("_count", "columns")

    def __init__(self, columns: dict[str, list[Any]]) -> None:
        counts = {len(values) for values in columns.values()}
        if len(counts) > 1:
            raise ValueError(f"the columns differ in length: {sorted(counts)}")
        self.columns = columns
        self._count = counts.pop() if counts else 0

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Row: ...

    @overload
    def __getitem__(self, index: slice) -> list[Row]: ...

    def __getitem__(self, index: int | slice) -> Row | list[Row]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if not -self._count <= index < self._count:
            raise IndexError("row index out of range")
        return {name: values[index] for name, values in self.columns.items()}

    def __iter__(self) -> Iterator[Row]:
        names = list(self.columns)
        rows = zip(*self.columns.values(), strict=True)
        return (dict(zip(names, values, strict=True)) for values in rows)


class Table(NamedTuple):
    """A read's rows as the database driver made them, tuples in column order, and the
    columns' names once (none for a read with no rows, whose names may be unknown).
    The reads a batch of claims, starts or finishes takes hundreds of rows from come
    so (``Connection.fetch_table``, ``lock_tables``), for ``rows`` to build records
    from each row's values by position: a dict per row, by name, was most of their
    cost (psycopg's rows to dicts, then each field looked up by name)."""

    names: tuple[str, ...]
    rows: list[tuple[Any, ...]]

    def dicts(self) -> list[Row]:
        """The rows as dicts, by column name, as ``Connection.fetch`` returns them."""
        names = self.names
        return [dict(zip(names, row, strict=True)) for row in self.rows]


_NAME_RE = re.compile(r"^-- name: ([a-z_]+)\s*$", re.MULTILINE)


def load_queries(path: Path) -> dict[str, str]:
    """Split a ``queries.sql`` file on its ``-- name: x`` headers into named queries: a
    copy of what the process read the first time, which the caller may change. Read
    once: every store a process opens took the file apart again, and a process that
    gives up its user's rights (a test of a read-only database, as ``nobody``) could not
    reach the file any more."""
    return dict(_read_queries(path))


@functools.cache
def _read_queries(path: Path) -> dict[str, str]:
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
    """Numbered migrations (``0001_name.sql``) in order: listed once per process, as the
    queries are read once (``load_queries``); a store opened on a current schema reads
    no file of them."""
    return list(_list_migrations(directory))


@functools.cache
def _list_migrations(directory: Path) -> list[tuple[int, Path]]:
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

    def fetch_table(self, name: str, params: Params) -> Table:
        """``fetch``'s rows as a ``Table``: tuples and the columns' names."""
        ...

    def write_many(self, name: str, rows: Sequence[Row]) -> int: ...

    def write_stream(
        self,
        name: str,
        chunks: Iterable[Sequence[Row]],
        notify: Callable[[], Sequence[Notice]] = tuple,
    ) -> int:
        """``write_many`` over rows made a chunk at a time, in one transaction; the total
        count. A backend may send each chunk's statement without waiting for the one
        before (PostgreSQL's pipeline mode), so that the caller's Python making the next
        chunk runs while the database writes this one. ``notify`` is called once every
        chunk is made, and its notices go with the chunks, as ``write_batch``'s do with
        its writes (on PostgreSQL one more statement of the pipeline: sent after it,
        they cost a round trip of their own)."""
        ...

    def lock_many(self, calls: Sequence[tuple[str, Params]]) -> tuple[list[list[Row]], int]:
        """Run several reads (locking ones take their locks in the order given), then
        read the clock, and return each one's rows and the clock. A backend may send them
        as one statement, but the clock is always read after every lock is held."""
        ...

    def lock_tables(self, calls: Sequence[tuple[str, Params]]) -> tuple[list[Table], int]:
        """``lock_many``, each read's rows as a ``Table``."""
        ...

    def write_batch(
        self,
        writes: Sequence[tuple[str, Sequence[Row]]],
        notify: Sequence[Notice] = (),
        *,
        commit_with: Sequence[int | None] | None = None,
    ) -> list[int]:
        """Run several ``*_many`` writes (each with ``RETURNING``; there may be none) and
        return each one's count of rows written. Each ``(channel, payload)`` of ``notify``
        goes to the other server nodes once this transaction commits (PostgreSQL
        ``NOTIFY``; nothing if it rolls back); a backend with one server process (SQLite)
        has no one to tell. A backend may send all of it as one statement.

        ``commit_with``: these writes are the transaction's last statement, and each
        one's count must be the number given (None: any count). A backend may then check
        the counts inside the statement and send the ``COMMIT`` with it, in one round
        trip: a count that differs then raises ``StaleWrite`` and nothing of the
        transaction is committed, and the transaction takes no other statement. A backend
        that does not (SQLite) returns the counts for the caller to check, and commits
        when the transaction ends."""
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

    def transaction(
        self, *, durable: bool = True, wait_s: float | None = None
    ) -> AbstractContextManager[Connection]:
        """One transaction. ``durable=False`` lets its commit return before the commit is
        on disk (PostgreSQL ``synchronous_commit = off``, SQLite ``synchronous = NORMAL``):
        a crash of the database's machine, or of PostgreSQL itself, may then undo it.
        Only for transactions whose loss is harmless (claims: see ``Store``). Any later
        durable commit makes every earlier commit durable too: the log is written in
        order.

        ``wait_s``: about the longest the transaction may wait to begin, for this
        process's connection (SQLite's, shared by its threads; a pooled one) and for the
        database's write lock (SQLite's ``busy_timeout``, cut to it); past it, it fails
        with an error ``unavailable_code`` calls ``DATABASE_BUSY``. None: the driver's
        own waits. A lock a statement waits for later is bounded by the driver's own
        lock wait (PostgreSQL's ``lock_timeout``), and ``Store._tx`` retries it."""
        ...

    def read(self, name: str, params: Params) -> list[Row]:
        """One read that is a transaction of its own. A backend may run it without
        ``BEGIN`` and ``COMMIT`` (PostgreSQL: one statement in autocommit, one round
        trip instead of three)."""
        ...

    def is_retryable(self, exc: BaseException) -> bool: ...

    def is_unavailable(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the database itself failed (unreachable, closed, out of
        connections, disk or lock trouble past the retries), so that any other statement
        now would fail alike: a loop over many items (``Store.schedule_fire_due``) ends
        on it rather than charging it to each item."""
        ...

    def unavailable_code(self, exc: BaseException) -> str | None:
        """Which of the database's conditions ``exc`` says (``DATABASE_BUSY``: a lock
        wait that ran out; ``DATABASE_FULL``; ``DATABASE_READ_ONLY``;
        ``DATABASE_UNAVAILABLE``: the connection or the file failed), None for any other
        error (a bug, a deadlock past the retries), which stays the server's 500."""
        ...

    def connect_refusal(self) -> tuple[str, str] | None:
        """Why a call waiting for a connection waits, when the database itself refused
        the last one: the error's type and the server's own words, no host, URL or name
        in them (/readyz's answer). None if it did not, or if there are no connections
        to wait for (SQLite)."""
        ...

    def disk_space(self) -> tuple[int, int] | None:
        """``(free, size)`` in bytes of the file system that holds the database, as this
        process sees it; None where that disk is not the node's to see (PostgreSQL's
        server) or there is none (an in-memory database)."""
        ...

    def close(self) -> None: ...
