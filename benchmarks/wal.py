"""PostgreSQL's write-ahead log over a measurement: what a system asks the database to write.

CPU per task says what a task costs; the WAL says why PostgreSQL's share differs between
systems. Every row version, index entry and row lock a task's life leaves behind is a WAL
record, so the records and bytes per task compare the systems' designs directly, in a
unit that does not drift with the machine's speed the way CPU time does.

The meter reads the WAL insert position (``pg_current_wal_insert_lsn()``) at both ends:
exact at any instant, where ``pg_stat_wal``'s record counts reach shared memory only when
each backend next flushes its statistics (at most once a second), too late for a short
window. The position is cluster-wide: the figure is what the whole server wrote inside
the window, which is this system's work as long as nothing else writes meanwhile (the
harness runs one system at a time; with ``--parallel`` the figures mean nothing, like
the rest).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import psycopg

POSITION_SQL = "SELECT pg_current_wal_insert_lsn()::text"


def lsn_bytes(lsn: str) -> int:
    """A WAL position (``"16/B374D848"``: two hexadecimal 32-bit halves) as a byte offset."""
    high, low = lsn.split("/")
    return (int(high, 16) << 32) + int(low, 16)


class WalMeter:
    """``with WalMeter(dsn) as wal: …`` then ``wal.result``: ``{"bytes": n}``, the WAL
    written inside, or ``{"error": …}`` when the position cannot be read (the
    measurement it wraps goes on either way)."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._start: int | None = None
        self.result: dict[str, Any] = {}

    def _read(self) -> int | None:
        """The insert position now, or None (and the error in ``result``)."""
        try:
            with psycopg.connect(self._dsn, autocommit=True) as cx:
                row = cx.execute(POSITION_SQL).fetchone()
        except psycopg.Error as exc:
            self.result = {"error": f"{type(exc).__name__}: {exc}"}
            return None
        assert row is not None
        return lsn_bytes(str(row[0]))

    def __enter__(self) -> WalMeter:
        self._start = self._read()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._start is None:
            return
        end = self._read()
        if end is not None:
            self.result = {"bytes": end - self._start}
